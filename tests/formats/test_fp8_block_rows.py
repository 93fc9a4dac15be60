"""formats/fp8_block_rows.py: the integer E4M3 decode against the bit-field reference, rows of one
block row, the absmax from the codes, and the source checks (NaN codes; NaN/Inf, negative,
overflowing and, under ue8m0, non-power-of-two scales) on tensors and numpy arrays alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import bf16_bits
from support import e4m3_to_f32 as ref_e4m3_to_f32
from test_fp8_block import FINITE_CODES, FP8, as_fp8, random_codes, random_scales

from hetquant.formats import HetquantError, fp8_block
from hetquant.formats import fp8_block_rows as rows_module
from hetquant.formats.fp8_block_rows import (
    absmax_dequantized,
    check_codes,
    check_pow2_scales,
    check_scales,
    dequantize_rows,
    e4m3_to_f32,
    scale_shape,
)


def test_e4m3_decode_equals_the_bit_field_reference() -> None:
    codes = FINITE_CODES[None, :]  # (1, 254): every finite code, ±0 and subnormals included
    got = e4m3_to_f32(as_fp8(codes)).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), ref_e4m3_to_f32(codes).view(np.uint32))


def test_fp8_block_reexports_the_rows_names() -> None:
    for name in rows_module.__all__:
        assert getattr(fp8_block, name) is getattr(rows_module, name), name


def test_dequantize_rows_on_slices_inside_a_block_row() -> None:
    rng = np.random.default_rng(3)
    codes = random_codes((300, 140), rng)
    scale = torch.from_numpy(random_scales((3, 2), rng, -12, 0))
    full = bf16_bits(FP8.dequantize_bf16(as_fp8(codes), scale))
    for r0, r1 in [(0, 1), (5, 128), (128, 129), (130, 200), (256, 300), (299, 300)]:
        part = dequantize_rows(as_fp8(codes[r0:r1]), scale, r0)
        np.testing.assert_array_equal(bf16_bits(part), full[r0:r1], err_msg=f"{r0}:{r1}")


@pytest.mark.parametrize(("row0", "rows"), [(0, 129), (127, 2), (100, 200)])
def test_dequantize_rows_refuses_to_cross_a_block_row(row0: int, rows: int) -> None:
    codes = np.zeros((rows, 4), dtype=np.uint8)
    with pytest.raises(HetquantError, match="cross a block row"):
        dequantize_rows(as_fp8(codes), torch.ones(3, 1), row0)


# ----------------------------------------------------------------------------------------------
# scale shapes


@pytest.mark.parametrize("shape", [(1, 1), (130, 70), (256, 384), (300, 129)])
def test_absmax_from_codes_equals_absmax_of_dequantized(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    codes[0, 0] = 0x80  # -0
    w = codes.view(torch.float8_e4m3fn)
    s = torch.exp(torch.randn(scale_shape(shape, 128), generator=g) * 8)  # tiny and huge scales
    s[0, 0] = 0.0
    want = max(
        float(dequantize_rows(w[r : r + 128], s, r).abs().amax()) for r in range(0, shape[0], 128)
    )
    assert absmax_dequantized(w, s) == want
    # every code magnitude in one column, both signs: the max is the largest magnitude
    every = torch.arange(0, 0x7F, dtype=torch.uint8).repeat(2)[:, None]  # (254, 1)
    every[::2] |= 0x80
    s1 = torch.tensor([[3.0], [0.5]])
    ref = max(
        float(dequantize_rows(every.view(torch.float8_e4m3fn)[r : r + 128], s1, r).abs().amax())
        for r in (0, 128)
    )
    assert absmax_dequantized(every.view(torch.float8_e4m3fn), s1) == ref


def test_absmax_refuses_nan_codes() -> None:
    w = torch.zeros(4, 4, dtype=torch.uint8)
    w[2, 3] = 0xFF
    with pytest.raises(HetquantError, match="NaN"):
        absmax_dequantized(w.view(torch.float8_e4m3fn), torch.ones(1, 1))


@pytest.mark.parametrize("nan", [0x7F, 0xFF])
def test_check_codes_refuses_both_nan_codes(nan: int) -> None:
    codes = torch.from_numpy(FINITE_CODES.copy()).reshape(2, 127)
    check_codes("m.weight", codes.view(torch.float8_e4m3fn))  # every finite code passes
    check_codes("m.weight", torch.empty(0, 4, dtype=torch.uint8))
    codes[1, 5] = nan
    with pytest.raises(HetquantError, match=r"^m\.weight: NaN code\(s\) in the FP8 weight"):
        check_codes("m.weight", codes.view(torch.float8_e4m3fn))


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (float("nan"), r"^s: 1 NaN/Inf value\(s\) of 4; corrupt scale"),
        (float("-inf"), r"^s: 1 NaN/Inf value\(s\) of 4"),
        (-(2.0**-10), r"^s: negative scale -0\.000976562; block scales are positive"),
        (2.0**121, r"^s: scale 2\.65846e\+36 makes 448·s overflow BF16"),
    ],
)
def test_check_scales_refuses(bad: float, match: str, as_tensor: bool) -> None:
    s = np.array([[2.0**-10, 0.0], [1.0, bad]], dtype=np.float32)
    with pytest.raises(HetquantError, match=match):
        check_scales("s", torch.from_numpy(s) if as_tensor else s)
    s[1, 1] = 2.0**119  # 448 · 2^119 < BF16's max: accepted, as is a zero scale
    check_scales("s", torch.from_numpy(s) if as_tensor else s)
    check_scales("s", np.empty((0, 3), dtype=np.float32))


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("bad", [1.5, 0.0, -1.0, 2.0**-140, 3.0 * 2.0**-20])
def test_check_pow2_scales_refuses_all_but_powers_of_two(bad: float, as_tensor: bool) -> None:
    s = np.array([1.0, 2.0**-20, 2.0**100, bad], dtype=np.float32)
    with pytest.raises(HetquantError, match=r"\(entry 3\) is not a power of two.*scale_fmt ue8m0"):
        check_pow2_scales("s", torch.from_numpy(s) if as_tensor else s)
    check_pow2_scales("s", s[:3])
