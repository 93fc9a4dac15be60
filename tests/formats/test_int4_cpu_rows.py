"""Tests of formats/int4_cpu_rows.py: exact round trips, the round-to-nearest error bound, clip
search, and refused rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetquant.formats import HetquantError
from hetquant.formats.bits import pack_nibbles_u8, unpack_nibbles_u8
from hetquant.formats.int4_cpu_rows import dequantize_rows, quantize_rows

U32 = 2.0**-24  # unit roundoff of float32

rows = st.integers(1, 40)
half_cols = st.integers(1, 70)  # in = 2 * half_cols: even, includes awkward sizes
seeds = st.integers(0, 2**31 - 1)


def _weights(r: int, k: int, seed: int) -> torch.Tensor:
    """Heavy-tailed rows (Student t, 3 dof) of mixed magnitudes, plus an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(r, k, generator=g)
    chi = torch.randn(r, k, 3, generator=g).square().mean(-1)  # (r, k), chi²(3)/3
    w = normal / chi.sqrt() * torch.exp(torch.randn(r, 1, generator=g) * 3)  # t(3), row scales
    w[0] = 0
    return w


def _round_trip(w: torch.Tensor, clip_search: bool = False) -> torch.Tensor:
    return dequantize_rows(*quantize_rows("rows", w, clip_search))


# --- round trips and error bounds ----------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(rows, half_cols, seeds)
def test_exact_round_trip(r: int, h: int, seed: int) -> None:
    """Weights already on the grid (power-of-two scales, a ±7 per row) come back bit-exactly."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(1, 16, (r, 2 * h), generator=g, dtype=torch.uint8)
    top = torch.randint(0, 2 * h, (r,), generator=g)
    codes[torch.arange(r), top] = torch.where(torch.rand(r, generator=g) < 0.5, 1, 15).to(
        torch.uint8
    )
    scale = torch.exp2(torch.randint(-30, 30, (r,), generator=g).float())
    w = (codes.float() - 8) * scale[:, None]
    packed, got_scale = quantize_rows("rows", w)
    assert packed.dtype == torch.uint8 and packed.shape == (r, h)
    assert torch.equal(got_scale, scale)
    assert torch.equal(packed, pack_nibbles_u8(codes))
    assert torch.equal(unpack_nibbles_u8(packed), codes)
    assert torch.equal(dequantize_rows(packed, got_scale), w)


@settings(max_examples=40, deadline=None)
@given(rows, half_cols, seeds)
def test_rtn_error_within_half_step(r: int, h: int, seed: int) -> None:
    w = _weights(r, 2 * h, seed)
    packed, scale = quantize_rows("rows", w)
    s = scale.double()[:, None]
    err = (w.double() - dequantize_rows(packed, scale).double()).abs()
    # s/2 exactly, plus float32 rounding of w/s (≤ 7·u steps) and of (c − 8)·s (≤ 7·u·s)
    assert (err <= s * (0.5 + 16 * U32)).all()
    codes = unpack_nibbles_u8(packed)
    assert codes.min() >= 1 and codes.max() <= 15


@settings(max_examples=40, deadline=None)
@given(rows, half_cols, seeds)
def test_clip_search_never_worse_per_row(r: int, h: int, seed: int) -> None:
    w = _weights(r, 2 * h, seed).double()
    rtn = (w - _round_trip(w).double()).square().sum(1)
    err = (w - _round_trip(w, clip_search=True).double()).square().sum(1)
    assert (err <= rtn).all()
    clip_scale = quantize_rows("rows", w, clip_search=True)[1]
    assert (clip_scale <= quantize_rows("rows", w)[1]).all()  # ρ ≤ 1


def test_clip_search_helps_gaussian_rows() -> None:
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    rtn = (w - _round_trip(w)).square().sum()
    clip = (w - _round_trip(w, clip_search=True)).square().sum()
    assert clip < 0.9 * rtn  # 4-bit grids on Gaussian rows want ρ < 1


# --- refused rows --------------------------------------------------------------------------------


@pytest.mark.parametrize("clip_search", [False, True])
@pytest.mark.parametrize(
    ("w", "match"),
    [
        pytest.param(torch.ones(4, 7), "positive even", id="odd-k"),
        pytest.param(torch.ones(4, 0), "positive even", id="empty-k"),
        pytest.param(torch.ones(2, 4, 4), "2-D", id="3d"),
        pytest.param(torch.tensor([[1.0, float("nan")]]), "NaN/Inf", id="nan"),
        pytest.param(torch.tensor([[float("inf"), 1.0]]), "NaN/Inf", id="inf"),
    ],
)
def test_bad_rows_refused(w: torch.Tensor, match: str, clip_search: bool) -> None:
    with pytest.raises(HetquantError, match=match):
        quantize_rows("rows", w, clip_search)


def test_nonfinite_scale_refused() -> None:
    packed = torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(HetquantError, match="scale is NaN/Inf"):
        dequantize_rows(packed, torch.tensor([1.0, float("inf")]))
