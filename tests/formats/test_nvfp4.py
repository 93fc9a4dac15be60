"""Tests of formats/nvfp4.py: golden bytes, nearest-grid rounding, shapes, variants (the E2M1 /
E4M3 arithmetic: test_nvfp4_codes.py; ModelOpt's configs: test_nvfp4_config.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetquant.formats import FORMATS, HetquantError, TensorMeta, get_format
from hetquant.formats.bits import pack_nibbles_u8
from hetquant.formats.dtypes import st_dtype
from hetquant.formats.nvfp4 import (
    BLOCK,
    E2M1_VALUES,
    Nvfp4,
)

FMT = Nvfp4()
U32 = 2.0**-24  # unit roundoff of float32
seeds = st.integers(0, 2**31 - 1)


def _bytes(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).view(torch.uint8).tolist()


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Heavy-tailed values, block magnitudes spread over 2^±12, one all-zero block."""
    g = torch.Generator().manual_seed(seed)
    chi = torch.randn(n, k, 3, generator=g).square().mean(-1)  # (n, k), chi²(3)/3
    w = torch.randn(n, k, generator=g) / chi.sqrt()  # Student t(3)
    mag = torch.exp2(torch.randint(-12, 13, (n, k // BLOCK, 1), generator=g).float())
    w = (w.reshape(n, k // BLOCK, BLOCK) * mag).reshape(n, k)
    w[0, :BLOCK] = 0
    return w


# ---- golden bytes -------------------------------------------------------------------------------
# W [2, 32]. amax = 2688 = 6 * 448, so weight_scale_2 = 1.0 exactly.
#  row 0, block 0: 448 * y for y below: every code, every tie, and -0.25 -> -0 (code 8).
#  row 0, block 1: zeros -> block scale 1.0 (0x38), codes 0.
#  row 1, block 0: fifteen 1.0 and one -1.0 -> scale e4m3(1/6) = 0.171875 (0x23); 1/0.171875 =
#                  5.82 > 5 saturates to 6 (code 7; -1.0 -> code 15).
#  row 1, block 1: 6*2^-12, -3*2^-12, zeros -> scale 2^-12 clamps to 2^-9 (0x01); y = 0.75 ties
#                  to 1.0 (code 2), y = -0.375 -> -0.5 (code 9).
Y_ROW0 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.25, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]
GOLDEN_WEIGHT = [
    [0x10, 0x32, 0x54, 0x76, 0x08, 0x22, 0x44, 0x66] + [0x00] * 8,
    [0x77] * 7 + [0xF7] + [0x92] + [0x00] * 7,
]
GOLDEN_SCALE = [[0x7E, 0x38], [0x23, 0x01]]


def _golden_input() -> torch.Tensor:
    w = torch.zeros(2, 32)
    w[0, :16] = 448 * torch.tensor(Y_ROW0)
    w[1, :16] = 1.0
    w[1, 15] = -1.0
    w[1, 16:18] = torch.tensor([6 * 2.0**-12, -3 * 2.0**-12])
    return w


def test_golden_bytes() -> None:
    q = FMT.quantize(_golden_input())
    assert q["weight"].dtype == torch.uint8
    assert q["weight"].tolist() == GOLDEN_WEIGHT
    assert q["weight_scale"].dtype == torch.float8_e4m3fn
    assert q["weight_scale"].view(torch.uint8).tolist() == GOLDEN_SCALE
    assert q["weight_scale_2"].shape == () and q["weight_scale_2"].dtype == torch.float32
    assert _bytes(q["weight_scale_2"]) == [0x00, 0x00, 0x80, 0x3F]  # 1.0f little-endian


def test_golden_dequantize() -> None:
    want = torch.zeros(2, 32)
    want[0, :16] = 448 * torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, 0, 1, 1, 2, 2, 4, 4])
    want[1, :16] = 6 * 0.171875
    want[1, 15] = -6 * 0.171875
    want[1, 16:18] = torch.tensor([2.0**-9, -(2.0**-10)])
    got = FMT.dequantize(FMT.quantize(_golden_input()))
    assert torch.equal(got, want)
    assert torch.signbit(got[0, 8])  # code 8 is -0


# ---- rounding -----------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5), blocks=st.integers(1, 5), seed=seeds)
def test_every_element_at_nearest_grid_point(n: int, blocks: int, seed: int) -> None:
    """Brute force: the stored code is the nearest of all 16 points of the block's grid."""
    w = _weights(n, blocks * BLOCK, seed)
    q = FMT.quantize(w)
    FMT.check_stored(q, tuple(w.shape))
    eff = q["weight_scale"].float() * q["weight_scale_2"]  # f32, as quantize/dequantize use it
    eff = eff.double().repeat_interleave(BLOCK, 1)  # (n, k)
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)  # (16,)
    dist = (w.double()[..., None] - grid * eff[..., None]).abs()  # (n, k, 16)
    got = (w.double() - FMT.dequantize(q).double()).abs()
    # f32 rounding of w / eff and of the product moves a decision by a few ulps of 6 * eff.
    assert (got <= dist.amin(-1) + 16 * U32 * 6 * eff).all()
    assert (FMT.dequantize(q).double().abs() <= 6 * eff * (1 + U32)).all()


def test_dequantize_reads_low_nibble_first() -> None:
    """Codes packed even-k-low decode to E2M1_VALUES[code] when both scales are 1."""
    codes = torch.arange(32, dtype=torch.uint8).reshape(1, 32) % 16
    tensors = {
        "weight": pack_nibbles_u8(codes),
        "weight_scale": torch.ones(1, 2).to(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(1.0),
    }
    assert tensors["weight"][0, :2].tolist() == [0x10, 0x32]
    assert FMT.dequantize(tensors).tolist() == [list(E2M1_VALUES) * 2]


def test_zero_weight_and_input_not_mutated() -> None:
    w = torch.zeros(3, 16, dtype=torch.bfloat16)
    q = FMT.quantize(w)
    assert q["weight_scale_2"].item() == 1.0
    assert q["weight_scale"].float().eq(1.0).all() and q["weight"].eq(0).all()
    assert torch.equal(FMT.dequantize(q), torch.zeros(3, 16))
    w2 = _weights(2, 32, 0)
    before = w2.clone()
    FMT.quantize(w2)
    assert torch.equal(w2, before)


# ---- stored tensors, shapes, variants -----------------------------------------------------------
def test_stored_and_bits() -> None:
    assert FMT.stored((5, 48)) == {
        "weight": TensorMeta("U8", (5, 24)),
        "weight_scale": TensorMeta("F8_E4M3", (5, 3)),
        "weight_scale_2": TensorMeta("F32", ()),
    }
    assert FMT.bits_per_weight((2048, 7168)) == pytest.approx(4.5, abs=1e-5)


@pytest.mark.parametrize("shape", [(4, 24), (1, 8), (3, 17), (2, 15)])
def test_k_not_multiple_of_16_refused(shape: tuple[int, int]) -> None:
    with pytest.raises(HetquantError, match="multiple of the block size 16"):
        FMT.stored(shape)
    with pytest.raises(HetquantError, match="multiple of the block size 16"):
        FMT.quantize(torch.ones(shape))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_refused(bad: float) -> None:
    w = torch.ones(2, 16)
    w[1, 3] = bad
    with pytest.raises(HetquantError, match="NaN or Inf"):
        FMT.quantize(w)
    with pytest.raises(HetquantError, match="2-D"):
        FMT.quantize(torch.ones(16))


def test_input_scale_variant() -> None:
    fmt = get_format("nvfp4", with_input_scale=True)
    q = fmt.quantize(torch.ones(2, 16), act_amax=2688.0)
    assert q["input_scale"].shape == () and q["input_scale"].item() == 1.0
    assert {k: TensorMeta(st_dtype(v.dtype), tuple(v.shape)) for k, v in q.items()} == fmt.stored(
        (2, 16)
    )
    assert torch.equal(fmt.dequantize(q), FMT.dequantize(FMT.quantize(torch.ones(2, 16))))
    with pytest.raises(HetquantError, match="calibrated act_amax"):
        fmt.quantize(torch.ones(2, 16))
    with pytest.raises(HetquantError, match="with_input_scale is False"):
        FMT.quantize(torch.ones(2, 16), act_amax=1.0)


def test_registered() -> None:
    assert FORMATS["nvfp4"] == Nvfp4()
    assert get_format("nvfp4", with_input_scale=True).with_input_scale
