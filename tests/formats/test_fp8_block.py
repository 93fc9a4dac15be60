"""formats/fp8_block.py against DeepSeek's dequantization formula, computed independently (the
row and absmax arithmetic of formats/fp8_block_rows.py: test_fp8_block_rows.py).

The reference (``support.ref_dequant_bits``) decodes E4M3 codes by their bit fields, multiplies
in numpy float32 and rounds to bfloat16 with integer arithmetic (round to nearest, ties to even);
it never calls torch's float8 or bfloat16 conversions.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from support import (
    TINY,
    bf16_bits,
    e4m3_to_f32,
    f32_to_bf16_bits,
    fp8_codes,
    read_json,
    ref_dequant_bits,
    st_header,
)

from hetquant.formats import HetquantError, TensorMeta, get_format
from hetquant.formats.fp8_block import (
    FP8_E4M3_MAX,
    Fp8Block,
    dequantize_rows,
    scale_shape,
)

FP8 = Fp8Block()
NAN_CODES = (0x7F, 0xFF)
FINITE_CODES = np.array([c for c in range(256) if c not in NAN_CODES], dtype=np.uint8)


def random_codes(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Every finite E4M3 code, uniformly (zeros, subnormals, ±448 included)."""
    return rng.choice(FINITE_CODES, size=shape)


def random_scales(shape: tuple[int, int], rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
    """Positive float32 scales with random 23-bit mantissas and exponents in [lo, hi]."""
    exp = rng.integers(lo, hi + 1, size=shape) + 127
    man = rng.integers(0, 1 << 23, size=shape)
    return ((exp << 23) | man).astype(np.uint32).view(np.float32)


def as_fp8(codes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn)


# ----------------------------------------------------------------------------------------------
# the reference itself, on hand-checked values


def test_reference_decodes_e4m3_by_hand() -> None:
    cases = {
        0x00: 0.0,
        0x01: 2.0**-9,  # smallest subnormal
        0x07: 7 * 2.0**-9,  # largest subnormal
        0x08: 2.0**-6,  # smallest normal
        0x38: 1.0,  # E=7 (bias), M=0
        0x3C: 1.5,
        0x7E: 448.0,  # largest finite
        0xB8: -1.0,
        0xFE: -448.0,
    }
    got = e4m3_to_f32(np.array(list(cases), dtype=np.uint8))
    assert got.tolist() == list(cases.values())
    assert np.signbit(e4m3_to_f32(np.array([0x80], dtype=np.uint8)))[0]  # -0.0


def test_reference_rounds_bf16_to_nearest_even() -> None:
    bits = np.array(
        [
            0x3F800000,  # 1.0 exactly
            0x3F808000,  # halfway, even below → down
            0x3F818000,  # halfway, odd below → up
            0x3F808001,  # just above halfway → up
            0x3F807FFF,  # just below halfway → down
            0x7F7FFFFF,  # max float32 → rounds up to +inf
            0x80000001,  # smallest negative subnormal → -0
        ],
        dtype=np.uint32,
    )
    want = [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0x8000]
    assert f32_to_bf16_bits(bits.view(np.float32)).tolist() == want


# ----------------------------------------------------------------------------------------------
# bit-exact dequantization


SHAPES = [(576, 300), (1, 1), (129, 257), (128, 128), (160, 256), (255, 1), (1, 385)]


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_bit_exact_on_partial_blocks(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(shape))
    codes = random_codes(shape, rng)
    scale = random_scales(scale_shape(shape, 128), rng, -20, 4)  # DeepSeek scales: ~2^-14 .. 2^-6
    got = FP8.dequantize_bf16(as_fp8(codes), torch.from_numpy(scale))
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == shape
    np.testing.assert_array_equal(bf16_bits(got), ref_dequant_bits(codes, scale))


def test_dequantize_bit_exact_at_range_edges() -> None:
    """Scales that push products into float32 subnormals, to bf16 overflow and across binades."""
    rng = np.random.default_rng(7)
    shape = (300, 260)
    codes = random_codes(shape, rng)
    scale = random_scales(scale_shape(shape, 128), rng, -126, 127)
    scale[0, 0] = np.float32(2.0**-126)  # x * s: float32 subnormals
    scale[1, 1] = np.float32(np.finfo(np.float32).max)  # overflow → ±inf
    got = FP8.dequantize_bf16(as_fp8(codes), torch.from_numpy(scale))
    np.testing.assert_array_equal(bf16_bits(got), ref_dequant_bits(codes, scale))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    block=st.sampled_from([1, 3, 4, 8, 128]),
    seed=st.integers(0, 2**32 - 1),
)
def test_dequantize_bit_exact_any_shape_and_block(
    rows: int, cols: int, block: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    codes = random_codes((rows, cols), rng)
    scale = random_scales(scale_shape((rows, cols), block), rng, -30, 10)
    fmt = Fp8Block(block)
    got = fmt.dequantize_bf16(as_fp8(codes), torch.from_numpy(scale))
    want = ref_dequant_bits(codes, scale, block)
    np.testing.assert_array_equal(bf16_bits(got), want)
    # dequantize_rows, one block row at a time, gives the same bits
    for r in range(0, rows, block):
        part = dequantize_rows(as_fp8(codes[r : r + block]), torch.from_numpy(scale), r, block)
        np.testing.assert_array_equal(bf16_bits(part), want[r : r + block])


def _tiny_fp8_weights() -> list[tuple[str, str, str]]:
    """(weight name, weight shard, scale shard) for every FP8 weight of the tiny model."""
    wm = read_json(TINY / "model.safetensors.index.json")["weight_map"]
    return [(n[: -len("_scale_inv")], wm[n[: -len("_scale_inv")]], f) for n, f in sorted(wm.items()) if n.endswith("_scale_inv")]  # fmt: skip


def test_every_tiny_fp8_weight_dequantizes_bit_exactly() -> None:
    weights = _tiny_fp8_weights()
    shards = {f: load_file(TINY / f) for f in {w for _, w, _ in weights} | {s for *_, s in weights}}

    def _load(file: str, name: str) -> torch.Tensor:
        return shards[file][name]

    fp8 = {n for f in {w for _, w, _ in weights} for n, e in st_header(TINY / f)[1].items() if n != "__metadata__" and e["dtype"] == "F8_E4M3"}  # fmt: skip
    assert {n for n, _, _ in weights} == fp8 and len(fp8) > 50
    partial = 0
    for name, wfile, sfile in weights:
        w, s = _load(wfile, name), _load(sfile, name + "_scale_inv")
        want = ref_dequant_bits(fp8_codes(w), s.numpy())
        np.testing.assert_array_equal(bf16_bits(FP8.dequantize_bf16(w, s)), want, err_msg=name)
        rows = [dequantize_rows(w[r : r + 128], s, r) for r in range(0, w.shape[0], 128)]
        np.testing.assert_array_equal(bf16_bits(torch.cat(rows)), want, err_msg=name)
        partial += w.shape[0] % 128 != 0 or w.shape[1] % 128 != 0
    assert partial > 0  # kv_a_proj_with_mqa: 160 rows, a partial block row


@pytest.mark.parametrize(
    ("wshape", "sshape"),
    [((576, 300), (5, 3)), ((1, 1), (1, 1)), ((129, 257), (2, 3)), ((128, 128), (1, 1))],
)
def test_scale_shape_and_stored(wshape: tuple[int, int], sshape: tuple[int, int]) -> None:
    assert scale_shape(wshape, 128) == sshape
    FP8.check_scale("w", wshape, sshape)  # accepted
    assert FP8.stored(wshape) == {
        "weight": TensorMeta("F8_E4M3", wshape),
        "weight_scale_inv": TensorMeta("F32", sshape),
    }
    assert get_format("fp8_block") == FP8


@pytest.mark.parametrize(
    ("wshape", "sshape"),
    [
        ((576, 300), (4, 3)),  # partial block row forgotten
        ((576, 300), (5, 2)),  # partial block column forgotten
        ((576, 300), (3, 5)),  # transposed
        ((576, 300), (15,)),  # flattened
        ((576, 300), (5, 3, 1)),
        ((1, 1), (0, 0)),
        ((129, 257), (1, 2)),  # floor instead of ceil
        ((128, 128), (2, 2)),
    ],
)
def test_check_scale_rejects_wrong_shapes(wshape: tuple[int, int], sshape: tuple[int, ...]) -> None:
    with pytest.raises(HetquantError, match=r"layers\.0\.x\.weight_scale_inv has shape"):
        FP8.check_scale("layers.0.x.weight", wshape, sshape)
    with pytest.raises(HetquantError):
        FP8.dequantize_bf16(
            torch.zeros(wshape, dtype=torch.float8_e4m3fn), torch.ones(sshape, dtype=torch.float32)
        )


@pytest.mark.parametrize("wshape", [(128,), (2, 128, 128), ()])
def test_check_scale_rejects_non_2d_weights(wshape: tuple[int, ...]) -> None:
    with pytest.raises(HetquantError, match="must be 2-D"):
        FP8.check_scale("w", wshape, (1, 1))


# ----------------------------------------------------------------------------------------------
# quantization error
#
# quantize: s = amax(block) / 448 (float32), y = fl32(x / s), q = e4m3(clamp(y, ±448)) rounded
# to nearest. E4M3 has 3 mantissa bits and minimum normal exponent -6, so the spacing of codes
# around |y| is ulp(y) = 2^(max(floor(log2|y|), -6) - 3) (2^-9 among subnormals), and
# |y - q| <= ulp(y) / 2 (|y| <= 448 after the clamp, and 448 is a code, so no overflow).
# Hence, computing q * s exactly (float64: a 4-bit times a 24-bit significand is exact):
#     |x - q s| <= |x - y s| + |y - q| s <= |x| 2^-24 + ulp(y) s / 2.
# dequantize() additionally rounds q * s to bfloat16 (8 significant bits): + |q s| 2^-8.


def e4m3_ulp(y: np.ndarray) -> np.ndarray:
    a = np.abs(y)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    return np.exp2(np.maximum(np.where(a > 0, e, -6.0), -6.0) - 3.0)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
    log_mag=st.integers(-20, 20),
)
def test_quantize_dequantize_error_within_half_an_e4m3_ulp(
    rows: int, cols: int, seed: int, log_mag: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 2.0**log_mag
    x[:, : min(cols, 3)] *= 50.0  # outliers: most of a block sits far below its amax
    if rows > 128 and cols > 128:
        x[128:256, 128:256] = 0.0  # an all-zero block (s = 1)
    stored = FP8.quantize(x)
    FP8.check_stored(stored, (rows, cols))
    q, s = stored["weight"], stored["weight_scale_inv"]
    assert not ((fp8_codes(q) & 0x7F) == 0x7F).any(), "quantize produced a NaN code"
    sr, sc = scale_shape((rows, cols), 128)
    blocks = torch.zeros(sr * 128, sc * 128)
    blocks[:rows, :cols] = x.abs()
    amax = blocks.reshape(sr, 128, sc, 128).amax(dim=(1, 3))
    np.testing.assert_array_equal(s.numpy(), torch.where(amax > 0, amax / 448, 1.0).numpy())

    xd = x.double().numpy()
    s_full = s.double().numpy()[(np.arange(rows) // 128)[:, None], (np.arange(cols) // 128)[None]]
    qd = e4m3_to_f32(fp8_codes(q)).astype(np.float64)
    y = xd / s_full
    exact = qd * s_full
    bound = e4m3_ulp(y) * s_full / 2 + np.abs(xd) * 2.0**-24
    err = np.abs(xd - exact)
    assert (err <= bound).all(), float((err - bound).max())
    assert np.abs(qd).max() <= FP8_E4M3_MAX
    # the bound is attained up to rounding noise: quantization really is nearest, not better
    if rows * cols >= 1000:
        assert (err / bound).max() > 0.9

    deq = FP8.dequantize(stored).double().numpy()
    assert (np.abs(xd - deq) <= bound + np.abs(exact) * 2.0**-8).all()


def test_quantize_of_representable_weights_is_lossless() -> None:
    """codes x 2^-10 with 448 in every block (DeepSeek's own output) gives back the same codes."""
    rng = np.random.default_rng(11)
    codes = random_codes((200, 300), rng)
    codes[::128, ::128] = 0x7E  # 448: the amax of every block, so s = 448 * 2^-10 / 448
    w = torch.from_numpy(e4m3_to_f32(codes).astype(np.float64) * 2.0**-10)
    got = FP8.quantize(w)
    assert (got["weight_scale_inv"] == 2.0**-10).all()
    np.testing.assert_array_equal(fp8_codes(got["weight"]), codes)


def test_quantize_rejects_non_2d() -> None:
    with pytest.raises(HetquantError, match="2-D"):
        FP8.quantize(torch.zeros(4))


def test_error_bound_helper() -> None:
    assert e4m3_ulp(np.array([1.0, 1.9, 2.0, 448.0, 2.0**-6, 2.0**-7, 0.0])).tolist() == [
        2.0**-3,
        2.0**-3,
        2.0**-2,
        2.0**5,
        2.0**-9,
        2.0**-9,
        2.0**-9,
    ]
    assert math.isclose(FP8_E4M3_MAX, 448.0)
