"""formats/int4_cpu_group_rows.py: the row codec's error bound and idempotence, the codes it
writes, and refused rows, groups and scales."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetquant.formats import HetquantError
from hetquant.formats.int4_cpu_group_rows import (
    GROUP_SIZES,
    check_group,
    check_group_size,
    dequantize_rows,
    quantize_rows,
)

seeds = st.integers(0, 2**31 - 1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), st.sampled_from(GROUP_SIZES), seeds)
def test_quantize_error_bound_and_idempotence(r: int, ng: int, group: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(r, ng * group, generator=g) * torch.exp(
        torch.randn(r, ng, 1, generator=g) * 3
    ).repeat_interleave(group, 1).reshape(r, -1)
    w[0, :group] = 0  # an all-zero group
    packed, scale = quantize_rows(w, group)
    assert packed.dtype == torch.uint8 and packed.shape == (r, ng * group // 2)
    assert scale.dtype == torch.bfloat16 and scale.shape == (r, ng)
    assert bool((scale[0, 0] == 1).item())  # an all-zero group has scale 1
    dq = dequantize_rows(packed, scale)
    s = scale.float().repeat_interleave(group, 1)
    assert ((w - dq).abs() <= s / 2 * (1 + 2**-20)).all()
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(r, -1)
    assert int(codes.min()) >= 1  # our quantizer writes 1..15
    again = quantize_rows(dq, group)  # a ±7 in every group: the same scales, the same codes
    assert torch.equal(again[1], scale)
    assert torch.equal(again[0], packed)


def test_dequantize_keeps_leading_dims() -> None:
    packed, scale = quantize_rows(
        torch.randn(6, 64, generator=torch.Generator().manual_seed(1)), 32
    )
    stacked = dequantize_rows(packed.reshape(2, 3, 32), scale.reshape(2, 3, 2))
    assert torch.equal(stacked.reshape(6, 64), dequantize_rows(packed, scale))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: check_group_size("x", 16), "x: group_size 16 not in"),
        (lambda: check_group("x", 48, "in", 96), "x: group size 48 not in"),
        (lambda: check_group("x", 32, "hidden", 0), "hidden = 0 must be a positive multiple"),
        (lambda: quantize_rows(torch.ones(4, 40), 32), "in = 40 must be a positive multiple"),
        (lambda: quantize_rows(torch.full((2, 32), float("inf")), 32), "NaN/Inf"),
        (
            lambda: dequantize_rows(torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 3)),
            "does not fit",
        ),
        (
            lambda: dequantize_rows(torch.zeros(2, 16, dtype=torch.uint8), torch.ones(3, 1)),
            "does not fit",
        ),
        (
            lambda: dequantize_rows(
                torch.zeros(2, 16, dtype=torch.uint8), torch.full((2, 1), float("inf"))
            ),
            "the file is corrupt",
        ),
    ],
)
def test_bad_rows_refused(call, match: str) -> None:
    with pytest.raises(HetquantError, match=match):
        call()
