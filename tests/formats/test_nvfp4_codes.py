"""formats/nvfp4_codes.py: E2M1 rounding (ties to even, saturation, signed zero), the per-tensor
and per-block scales at their edges, the step of each block, and the shape checks."""

from __future__ import annotations

import pytest
import torch

from hetquant.formats import HetquantError, nvfp4
from hetquant.formats import nvfp4_codes as codes_module
from hetquant.formats.nvfp4_codes import (
    E2M1_BOUNDS,
    E2M1_VALUES,
    E4M3_MIN_SUBNORMAL,
    FP8_E4M3_MAX,
    block_scales_from_amax,
    check_2d,
    check_k,
    e2m1_codes,
    effective_scale,
    magnitude_codes,
    scale_2_from_amax,
)


def test_ties_go_to_even_and_saturate() -> None:
    mids = torch.tensor(E2M1_BOUNDS)
    assert e2m1_codes(mids).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert e2m1_codes(-mids).tolist() == [8, 10, 10, 12, 12, 14, 14]
    assert e2m1_codes(torch.tensor([5.0001, 6.0, 7.0, 1e30, -7.0])).tolist() == [7, 7, 7, 7, 15]
    assert e2m1_codes(torch.tensor([0.0, -0.0, 0.2499, -0.1])).tolist() == [0, 0, 0, 8]


def test_codes_index_the_value_table() -> None:
    y = torch.tensor(E2M1_VALUES)
    assert e2m1_codes(y).tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        0,
        9,
        10,
        11,
        12,
        13,
        14,
        15,
    ]  # -0 → 0
    mag = torch.tensor([0.3, 0.3])
    assert magnitude_codes(mag, torch.tensor([False, True])).tolist() == [1, 9]  # sign kept


def test_scale_2_and_block_scales_at_their_edges() -> None:
    assert scale_2_from_amax(torch.tensor(2688.0)).item() == 1.0  # 6 · 448
    assert scale_2_from_amax(torch.tensor(0.0)).item() == 1.0  # an all-zero weight
    s2 = torch.tensor(1.0)
    amax = torch.tensor([0.0, 6 * 2.0**-12, 6.0, 6 * 1000.0])  # zero, under 2^-9, 1, over 448
    sb = block_scales_from_amax(amax, s2)
    assert sb.dtype == torch.float8_e4m3fn
    assert sb.float().tolist() == [1.0, E4M3_MIN_SUBNORMAL, 1.0, FP8_E4M3_MAX]
    assert effective_scale(sb, torch.tensor(0.5)).tolist() == [0.5, 2.0**-10, 0.5, 224.0]


def test_shape_checks() -> None:
    check_k(32)
    check_2d(torch.ones(2, 16))
    with pytest.raises(
        HetquantError, match="in_features 24 is not a multiple of the block size 16"
    ):
        check_k(24)
    with pytest.raises(HetquantError, match="expected a 2-D weight"):
        check_2d(torch.ones(2, 2, 16))


def test_nvfp4_reexports_the_codes() -> None:
    for name in ("BLOCK", "E2M1_BOUNDS", "E2M1_MAX", "E2M1_VALUES", "FP8_E4M3_MAX", "e2m1_codes"):
        assert getattr(nvfp4, name) is getattr(codes_module, name), name
