"""Grouped INT4 GEMV (``int4_cpu_group``: BF16 scales per 32 / 64 / 128 inputs) and the CPU
expert pool on group-wise layers: every x86 path bit-identical, within the derived bound of a
float64 reference (``gemv_reference.py``), strided rows and scale rows, subpools on whole groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gemv_reference import (
    assert_within,
    gemv_bound,
    gemv_ref,
    grouped_native_order,
    order_sensitive_grouped,
    routed_ref_and_bound,
    routing,
)
from safetensors.torch import load_file, save_file

from hetquant.formats import HetquantError
from hetquant.formats.int4_cpu_group import (
    Int4CpuGroupExperts,
    dequantize_expert,
    stack_experts,
)
from hetquant.runtime.experts.expert_pool import CpuExpertPool
from hetquant.runtime.kernels import int4_gemv as G

TINY_CONFIG = Path(__file__).resolve().parents[3] / "examples" / "tiny-deepseek-v3" / "config.json"
SHAPES = [  # (N, K, T, g): odd N, K = any number of 32-blocks (tails of every superblock size)
    (1, 32, 1, 32),
    (5, 96, 3, 32),
    (7, 384, 1, 64),
    (13, 544, 5, 32),
    (3, 1056, 16, 32),
    (33, 1152, 7, 128),
    (64, 2080, 2, 32),
    (9, 7168, 1, 32),
    (4, 2048, 9, 128),
]


@pytest.fixture
def native_or_skip():
    if not G.native_available():
        pytest.skip(f"native int4 kernel unavailable: {G.native_info()['error']}")


def _data(n: int, k: int, t: int, g: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // g, generator=gen) * 0.1 + 1e-3).to(torch.bfloat16)
    x = torch.randn(t, k, generator=gen) * torch.rand(t, 1, generator=gen) * 10
    return packed, scale, x


def _all_isas(monkeypatch, packed, scale, x, **kw) -> torch.Tensor:
    """The result of every instruction path of this CPU, asserted bit-identical."""
    outs = []
    for isa in G.isa_names():
        monkeypatch.setenv("HETQUANT_INT4_ISA", isa)
        outs.append(G.int4_gemv(packed, scale, x, backend="native", **kw))
    monkeypatch.delenv("HETQUANT_INT4_ISA")
    for y in outs[1:]:
        assert torch.equal(y.view(torch.int32), outs[0].view(torch.int32))
    return outs[0]


# ------------------------------------------------------------------------------------------------
# the kernel


@pytest.mark.parametrize(("n", "k", "t", "g"), SHAPES)
@pytest.mark.parametrize("precision", ["high", "fast"])
def test_isas_identical_and_within_bound(native_or_skip, monkeypatch, n, k, t, g, precision):
    packed, scale, x = _data(n, k, t, g, seed=n * k + t)
    y = _all_isas(monkeypatch, packed, scale, x, threads=2, precision=precision)
    assert y.dtype == torch.float32 and y.shape == (t, n)
    bits = 22 if precision == "high" else 14
    assert_within(
        y, gemv_ref(packed, scale, x), gemv_bound(packed, scale, x, y, "native", bits) / 2
    )
    for threads in (1, 3):  # rows dealt to any number of threads: the same bits
        assert torch.equal(
            G.int4_gemv(packed, scale, x, backend="native", threads=threads, precision=precision), y
        )


@pytest.mark.parametrize(("n", "k", "t", "g"), SHAPES[:6])
def test_torch_backend_and_auto(n, k, t, g):
    packed, scale, x = _data(n, k, t, g, seed=3 * n + k)
    ref = gemv_ref(packed, scale, x)
    y = G.int4_gemv(packed, scale, x, backend="torch")
    assert_within(y, ref, gemv_bound(packed, scale, x, y, "torch") / 2)
    y = G.int4_gemv(packed, scale, x)
    either = torch.maximum(
        gemv_bound(packed, scale, x, y, "torch"), gemv_bound(packed, scale, x, y, "native")
    )
    assert_within(y, ref, either / 2)


def test_strided_rows_and_scale_rows(native_or_skip, monkeypatch):
    """A subpool's down slice: rows of I/2S bytes at stride I/2, scale rows of I/gS at I/g."""
    gen = torch.Generator().manual_seed(8)
    down = torch.randint(0, 256, (3, 70, 128), dtype=torch.uint8, generator=gen)  # [E, H, I/2]
    dscale = (torch.rand(3, 70, 8, generator=gen) + 0.01).bfloat16()  # [E, H, I/32]
    packed, scale = down[1, :, 32:64], dscale[1, :, 2:4]  # subpool 1 of 4
    assert packed.stride(0) == 128 and scale.stride(0) == 8
    x = torch.randn(2, 64, generator=gen).bfloat16()
    y = _all_isas(monkeypatch, packed, scale, x, threads=2)
    assert torch.equal(y, G.int4_gemv(packed.contiguous(), scale.contiguous(), x, backend="native"))
    assert_within(
        y, gemv_ref(packed, scale, x.float()), gemv_bound(packed, scale, x.float(), y, "native") / 2
    )
    assert G.int4_gemv(packed, scale, x[0], backend="native").shape == (70,)


@pytest.mark.parametrize(
    ("n", "k", "t", "g"),
    [(37, 2080, 1, 32), (6, 4096, 3, 32), (11, 1536, 1, 64), (9, 1536, 2, 128)],
)
def test_float_step_in_the_documented_order(native_or_skip, monkeypatch, n, k, t, g):
    """Every path gives the bits of the documented float order (partials p[b mod 8]), whatever
    its lanes (the transposed superblocks of AVX2 / AVX-512), on inputs where the order shows:
    a single running sum gives other float32 bits for most outputs."""
    packed, scale, m = order_sensitive_grouped(n, k, t, g, seed=k + t)
    want = grouped_native_order(packed, scale, m, -21)
    other = grouped_native_order(packed, scale, m, -21, order="sequential")
    assert (want.view(torch.int32) != other.view(torch.int32)).float().mean() > 0.5
    got = _all_isas(monkeypatch, packed, scale, m.float() * 2.0**-21)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("mag", [1e-42, 1e-30, 1.0, 1e20, 3e37])
def test_extreme_activation_scales(native_or_skip, monkeypatch, mag):
    packed, scale, x = _data(5, 96, 3, 32, seed=12)
    x = (x / x.abs().amax() * mag).to(torch.float32)
    y = _all_isas(monkeypatch, packed, scale, x)
    tiny = 2.0**-149 * scale.double().amax() * 8 * 96  # subnormal x: its own spacing is the limit
    assert_within(
        y, gemv_ref(packed, scale, x), gemv_bound(packed, scale, x, y, "native") / 2 + tiny
    )


def test_zeros_are_positive_and_nonfinite_activations_propagate(native_or_skip, monkeypatch):
    packed = torch.full((6, 64), 0x88, dtype=torch.uint8)  # every q = 0
    scale = -torch.ones(6, 4).bfloat16()  # negative scales: s·0 = -0 in every partial sum
    y = _all_isas(monkeypatch, packed, scale, torch.randn(3, 128))
    assert (y.view(torch.int32) == 0).all()  # +0.0 on every path, whatever the padding adds
    packed, scale, _ = _data(8, 64, 1, 32, seed=9)
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    y = G.int4_gemv(packed, scale, x, backend="native")  # falls back to float math
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()


# ------------------------------------------------------------------------------------------------
# the pool on group-wise layers


def _group_artifact(root: Path, layers=(1, 2), experts=8, hidden=256, inter=256, group=32):
    """A minimal artifact: manifest + one cpu_experts file per layer, group-wise experts."""
    fmt = Int4CpuGroupExperts(group)
    gen = torch.Generator().manual_seed(5)
    tensors, files = {}, []
    for layer in layers:
        parts = []
        for _ in range(experts):
            gate, up = torch.randn(2, inter, hidden, generator=gen) * 0.2
            parts.append(
                fmt.quantize_expert(gate, up, torch.randn(hidden, inter, generator=gen) * 0.1)
            )
        tensors[layer] = stack_experts(parts)
        rel = f"cpu_experts/layer_{layer:03d}.safetensors"
        (root / "cpu_experts").mkdir(parents=True, exist_ok=True)
        prefix = f"model.layers.{layer}.mlp.experts"
        save_file({f"{prefix}.{k}": v for k, v in tensors[layer].items()}, root / rel)
        files.append(rel)
    (root / "hetquant.json").write_text(json.dumps(_manifest(root, files)))
    config = json.loads(TINY_CONFIG.read_text())  # the model family names the layers
    config.update(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts)
    (root / "config.json").write_text(json.dumps(config))  # ... and the pool checks its shapes
    return tensors


def _manifest(root: Path, files: list[str]) -> dict:
    """A manifest of the schema (formats/manifest_schema.py) listing the cpu_experts ``files``."""
    sizes = {f: {"size": (root / f).stat().st_size, "sha256": "0" * 64} for f in files}
    group = {"name": "experts", "format": "int4_cpu_group_experts", "params": 1, "bytes": 1,
             "bits_per_weight": 4.5}  # fmt: skip
    return {
        "schema_version": 2,
        "complete": True,
        "recipe": {"name": "ascend-hybrid", "options": {}},
        "source": {"path": str(root), "fingerprint": "0", "dtypes": {}},
        "max_shard_size": 5 * 10**9,
        "parts": {"cpu_experts": {"files": files}},
        "files": sizes,
        "precision": {"groups": [group], "params": 1, "bytes": 1, "effective_bits_per_weight": 4.5},
    }


@pytest.mark.parametrize(
    ("subpools", "split", "materialize"),
    [(1, "inter", False), (2, "inter", False), (8, "inter", True), (3, "experts", False)],
)
def test_pool_forward_matches_reference(tmp_path, subpools, split, materialize):
    tensors = _group_artifact(tmp_path)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    with CpuExpertPool.open(
        tmp_path, subpools=subpools, split=split, materialize=materialize
    ) as pool:
        for layer in pool.layers:
            assert pool.info(layer).fmt == Int4CpuGroupExperts(32)
            ids, w = routing(5, 8, 2, seed=layer)
            got = pool.forward(layer, x, ids, w)
            ref, bound = routed_ref_and_bound(
                tensors[layer], x, ids, w, subpools, dequantize_expert
            )
            assert_within(got, ref, bound)
            if split == "inter" and subpools > 1:  # views on whole groups of every down row
                view = pool.subpool_tensors(1, layer)
                want = Int4CpuGroupExperts(32).subpool_slice(tensors[layer], 1, subpools)
                assert all(torch.equal(view[k], want[k]) for k in want)


def test_pool_refuses_subpools_off_groups(tmp_path):
    _group_artifact(tmp_path, inter=128)
    with pytest.raises(HetquantError, match=r"legal subpool counts: \[1, 2, 4\]"):
        CpuExpertPool.open(tmp_path, subpools=8)  # 128 / 8 = 16: half a group of 32
    with CpuExpertPool.open(tmp_path, subpools=8, split="experts") as pool:  # whole experts
        assert pool.num_subpools == 8


def test_pool_refuses_an_unknown_layout(tmp_path):
    _group_artifact(tmp_path, layers=(1,))
    path = tmp_path / "cpu_experts" / "layer_001.safetensors"
    t = load_file(path)
    key = "model.layers.1.mlp.experts.down_scale"
    t[key] = t[key].float()  # F32 group scales: neither layout
    save_file(t, path)
    with pytest.raises(HetquantError, match="no CPU expert layout the pool serves"):
        CpuExpertPool.open(tmp_path)
