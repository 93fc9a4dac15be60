"""runtime/kernels/int4_gemv_native.py: a failed or disabled build degrades ``"auto"`` to the
torch path and makes ``"native"`` refuse; an instruction-path cap must name one of this
machine's paths."""

from __future__ import annotations

import pytest
import torch

from hetquant.formats import HetquantError
from hetquant.runtime.kernels import int4_gemv as G
from hetquant.runtime.kernels import int4_gemv_native as N


def test_build_failure_degrades_to_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("HETQUANT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    nat = N._build()
    assert nat.lib is None and "false failed" in nat.error
    monkeypatch.setattr(N, "_native", nat)
    gen = torch.Generator().manual_seed(10)
    packed = torch.randint(0, 256, (6, 20), dtype=torch.uint8, generator=gen)
    scale, x = torch.rand(6, generator=gen) * 0.1 + 1e-3, torch.randn(2, 40, generator=gen)
    assert not G.native_available() and G.native_info()["error"] == nat.error
    y = G.int4_gemv(packed, scale, x)  # auto → torch
    assert torch.equal(y, G.int4_gemv_torch(packed, scale, x))
    with pytest.raises(HetquantError, match="native kernel unavailable"):
        G.int4_gemv(packed, scale, x, backend="native")
    monkeypatch.setenv("HETQUANT_INT4_BACKEND", "torch")
    assert "disabled" in N._build().error


def test_isa_cap_names_this_machines_paths(monkeypatch):
    monkeypatch.setenv("HETQUANT_INT4_ISA", "sve2")
    packed, scale = torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 1).bfloat16()
    with pytest.raises(HetquantError, match="has the paths generic"):
        G.int4_gemv(packed, scale, torch.zeros(1, 32), backend="native")


def test_isa_names_per_machine():
    assert N.isa_names("x86_64") == ("generic", "avx2", "avx512_vnni", "amx_int8")
    assert N.isa_names("aarch64") == ("generic", "neon_dotprod")
    assert N.isa_names("riscv64") == ("generic",)
    assert G.isa_names is N.isa_names and G.ISA_LADDERS is N.ISA_LADDERS
