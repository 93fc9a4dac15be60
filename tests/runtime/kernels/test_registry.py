"""The CPU expert pool's kernel registry (``runtime/kernels/registry.py``): every registered
expert-layer format declares a kernel family that a kernel module registers; a format whose
family is unknown is refused naming it; a family registers once."""

from __future__ import annotations

from typing import ClassVar

import pytest

from hetquant.formats import HetquantError
from hetquant.formats.base import EXPERT_FORMATS
from hetquant.formats.fp4_cpu import Fp4CpuExperts
from hetquant.runtime.kernels import fp4_gemv, int4_moe
from hetquant.runtime.kernels.int4_gemv import int4_gemv
from hetquant.runtime.kernels.registry import (
    EXPERT_KERNELS,
    ExpertKernels,
    expert_kernels,
    register_expert_kernels,
)


def test_every_expert_format_has_its_kernels() -> None:
    want = {
        "int4_cpu_experts": (int4_gemv, int4_moe.int4_moe),
        "int4_cpu_group_experts": (int4_gemv, int4_moe.int4_moe),
        "fp4_cpu_experts": (fp4_gemv.fp4_gemv, None),
    }
    assert set(EXPERT_FORMATS) == set(want)
    for name, fmt in EXPERT_FORMATS.items():
        k = expert_kernels(fmt)
        assert (k.gemv, k.moe) == want[name], name


class _Unserved(Fp4CpuExperts):
    name: ClassVar[str] = "unserved_experts"
    cpu_kernel: ClassVar[str | None] = "fp3_e1m1"


def test_a_format_without_registered_kernels_is_refused() -> None:
    with pytest.raises(HetquantError, match=r"'unserved_experts' declares CPU kernel 'fp3_e1m1'"):
        expert_kernels(_Unserved())


def test_a_family_registers_once(monkeypatch) -> None:
    monkeypatch.setitem(EXPERT_KERNELS, "probe", ExpertKernels(gemv=int4_gemv))
    with pytest.raises(RuntimeError, match="registered twice"):
        register_expert_kernels("probe", ExpertKernels(gemv=int4_gemv))
