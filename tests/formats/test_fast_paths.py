"""Shortcuts the converter's hot paths take, each against the plain computation it replaces."""

from __future__ import annotations

import pytest
import torch

from hetquant.formats import HetquantError, get_expert_format
from hetquant.formats.awq_w4a16 import AWQ_ORDER, _pack_columns
from hetquant.formats.base import all_finite
from hetquant.formats.bits import pack_nibbles_i32


@pytest.mark.parametrize("shape", [(8, 1), (16, 3), (64, 128), (136, 40)])
def test_awq_column_pack_equals_transpose_then_pack(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    q = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)  # (N, K)
    got = _pack_columns(q)  # (K, N/8)
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert torch.equal(got, pack_nibbles_i32(q.t(), AWQ_ORDER))


def test_awq_column_pack_golden_word() -> None:
    q = torch.arange(8, dtype=torch.uint8)[:, None]  # output rows 0..7, one input column
    # nibbles from the low end hold rows 0, 2, 4, 6, 1, 3, 5, 7
    assert _pack_columns(q).item() == 0x75316420


@pytest.mark.parametrize(
    ("value", "finite"),
    [
        (0.0, True),
        (-3e38, True),
        (float("nan"), False),
        (float("inf"), False),
        (-float("inf"), False),
    ],
)
def test_all_finite(value: float, finite: bool) -> None:
    t = torch.zeros(3, 5)
    t[2, 4] = value
    assert all_finite(t) is finite
    assert all_finite(t.to(torch.bfloat16)) is finite
    assert all_finite(torch.empty(0, 4)) is True


@pytest.mark.parametrize("clip", [False, True])
def test_expert_rows_streamed_equal_whole_expert(clip: bool) -> None:
    fmt = get_expert_format("int4_cpu_experts")
    if clip:
        fmt = type(fmt)(clip_search=True)
    g = torch.Generator().manual_seed(7)
    inter, hidden, chunk = 320, 256, 128  # a partial last chunk
    gate, up = (torch.randn(inter, hidden, generator=g).bfloat16() for _ in range(2))
    down = torch.randn(hidden, inter, generator=g).bfloat16()
    whole = fmt.quantize_expert(gate, up, down)
    parts = []
    for r in range(0, inter, chunk):
        gu = torch.stack([gate[r : r + chunk], up[r : r + chunk]], 1).flatten(0, 1)  # (2c, H)
        parts.append(fmt.quantize_rows(gu))
    assert torch.equal(torch.cat([p for p, _ in parts]), whole["gate_up_packed"])
    assert torch.equal(torch.cat([s for _, s in parts]), whole["gate_up_scale"])
    packed, scale = fmt.quantize_rows(down)
    assert torch.equal(packed, whole["down_packed"]) and torch.equal(scale, whole["down_scale"])


def test_expert_rows_refuse_nan() -> None:
    rows = torch.ones(4, 8)
    rows[1, 2] = float("nan")
    with pytest.raises(HetquantError, match="NaN"):
        get_expert_format("int4_cpu_experts").quantize_rows(rows)
