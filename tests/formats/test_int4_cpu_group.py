"""formats/int4_cpu_group.py: the registered formats — golden bytes of a linear, registry and
shapes, ``from_stored``, refused variants and linears, and the names it re-exports (the row codec
is tested in test_int4_cpu_group_rows.py, the layer layout in test_int4_cpu_group_layer.py)."""

from __future__ import annotations

import struct

import pytest
import torch

from hetquant.formats import EXPERT_FORMATS, FORMATS, HetquantError, TensorMeta, int4_cpu_group
from hetquant.formats import int4_cpu_group_layer as layer_module
from hetquant.formats import int4_cpu_group_rows as rows_module
from hetquant.formats.int4_cpu import Int4CpuExperts
from hetquant.formats.int4_cpu import layer_stored as per_channel_layer_stored
from hetquant.formats.int4_cpu_group import Int4CpuGroup, Int4CpuGroupExperts, layer_stored

FMT = Int4CpuGroup()


def _bf16_bits(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}H", *values)


# --- golden bytes --------------------------------------------------------------------------------


def test_golden_bytes_per_linear() -> None:
    w = torch.zeros(3, 32)
    w[0, :4] = torch.tensor([7.0, -7.0, 1.0, 0.5])
    w[1, :3] = torch.tensor([1.0, -0.5, 0.07177734375])
    t = FMT.quantize(w)
    # row 0: s = 7/7 = 1 (bf16 0x3F80); q = 7 -7 1 0 (0.5 → 0: half to even); c = 15 1 9 8, 8…
    # row 1: 1/7 = 0.142857… rounded UP to bf16: 0x3E13 = 0.1435546875; w/s = 6.97 -3.48 0.5
    #        → q = 7 -3 0 (half to even); c = 15 5 8, 8…
    # row 2: all zero → s = 1.        byte j = c[2j] | c[2j+1] << 4
    want = [0x1F, 0x89] + [0x88] * 14 + [0x5F] + [0x88] * 15 + [0x88] * 16
    assert t["weight_packed"].numpy().tobytes() == bytes(want)
    assert t["weight_scale"].view(torch.int16).numpy().tobytes() == _bf16_bits(
        0x3F80, 0x3E13, 0x3F80
    )
    want_dq = torch.zeros(3, 32)
    want_dq[0, :3] = torch.tensor([7.0, -7.0, 1.0])
    want_dq[1, :2] = torch.tensor([7 * 0.1435546875, -3 * 0.1435546875])
    assert torch.equal(FMT.dequantize(t), want_dq)


def test_registry_and_shapes() -> None:
    assert "int4_cpu_group" in FORMATS  # served by runtime/kernels/ops.py (tinygemm; npu refuses)
    assert FMT.group_size == 32
    f64 = Int4CpuGroup(64)
    assert f64.stored((7168, 2048)) == {
        "weight_packed": TensorMeta("U8", (7168, 1024)),
        "weight_scale": TensorMeta("BF16", (7168, 32)),
    }
    assert FMT.bits_per_weight((4, 64)) == 4 + 16 / 32
    assert EXPERT_FORMATS["int4_cpu_group_experts"] == Int4CpuGroupExperts()
    metas = layer_stored(384, 7168, 2048, 32)  # Kimi K2 Thinking: 384 experts, group 32
    assert metas["gate_up_scale"] == TensorMeta("BF16", (384, 4096, 224))
    assert metas["down_scale"] == TensorMeta("BF16", (384, 7168, 64))
    # bytes per expert: codes as int4_cpu, 2 bytes per 32 weights instead of 4 per row
    per_expert = sum(m.nbytes for m in metas.values()) // 384
    assert per_expert == 3 * 2048 * 7168 // 2 + 2 * 3 * 2048 * 7168 // 32


def test_from_stored_inverts_stored() -> None:
    group = layer_stored(2, 64, 128, 64)
    fmt, dims = Int4CpuGroupExperts().from_stored(group)
    assert (fmt, dims) == (Int4CpuGroupExperts(64), (2, 64, 128))
    assert fmt.stored(*dims) == group
    fmt, dims = Int4CpuExperts().from_stored(group)  # another layout's answer does not fit
    assert fmt.stored(*dims) != group
    per_channel = dict(per_channel_layer_stored(2, 64, 128))
    fmt, dims = Int4CpuExperts().from_stored(per_channel)
    assert fmt.stored(*dims) == per_channel
    with pytest.raises(IndexError):  # F32 [E, 2I] scales have no group dim
        Int4CpuGroupExperts().from_stored(per_channel)
    with pytest.raises(HetquantError, match="group_size 21"):  # 64 / 3: no group size
        Int4CpuGroupExperts().from_stored(
            dict(group, gate_up_scale=TensorMeta("BF16", (2, 256, 3)))
        )
    linear = FMT.stored((64, 256))
    assert FMT.from_stored(linear) == (Int4CpuGroup(32), (64, 256))
    assert Int4CpuGroup(128).from_stored(Int4CpuGroup(128).stored((8, 512))) == (
        Int4CpuGroup(128),
        (8, 512),
    )


def test_reexports_are_the_split_modules_names() -> None:
    for name in int4_cpu_group.__all__:
        home = rows_module if name in rows_module.__all__ else layer_module
        if name not in ("Int4CpuGroup", "Int4CpuGroupExperts"):
            assert getattr(int4_cpu_group, name) is getattr(home, name), name


# --- refused inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: Int4CpuGroup(16), "group_size 16"),
        (lambda: Int4CpuGroup(48), "group_size 48"),
        (lambda: FMT.stored((4, 48)), "multiple of the group size 32"),
        (lambda: FMT.quantize(torch.ones(4, 40)), "multiple of the group size"),
        (lambda: FMT.quantize(torch.ones(2, 4, 32)), "2-D"),
        (lambda: FMT.quantize(torch.full((2, 32), float("nan"))), "NaN"),
        (lambda: FMT.quantize(torch.ones(2, 32), clip_search=True), "unknown options"),
        (
            lambda: FMT.dequantize(
                {
                    "weight_packed": torch.zeros(2, 16, dtype=torch.uint8),
                    "weight_scale": torch.full((2, 1), float("nan")).bfloat16(),
                }
            ),
            "NaN/Inf",
        ),
        (lambda: Int4CpuGroupExperts(16), "int4_cpu_group_experts: group_size 16"),
        (lambda: FMT.dequantize({"weight_scale": torch.ones(2, 1).bfloat16()}), "missing"),
        (
            lambda: Int4CpuGroupExperts(32).quantize_rows(torch.ones(2, 4, 32)),
            "expected 2-D rows",
        ),
        (lambda: Int4CpuGroupExperts(64).subpool_slice(_group32_layer(), 0, 1), "has group 32"),
    ],
)
def test_bad_inputs_refused(call, match: str) -> None:
    with pytest.raises(HetquantError, match=match):
        call()


def _group32_layer() -> dict[str, torch.Tensor]:
    expert = Int4CpuGroupExperts(32).quantize_expert(*torch.ones(3, 64, 64))
    return layer_module.stack_experts([expert])
