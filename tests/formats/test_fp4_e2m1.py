"""DeepSeek-V4's FP4 expert source (fp4_e2m1) and block FP8 under DeepSeek's names
(fp8_block_scale): golden bytes, exact dequantization against transformers' own code, refusals."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from hetquant.formats import HetquantError, TensorMeta, get_format
from hetquant.formats.base import stored_metas
from hetquant.formats.fp4_e2m1 import E2M1, E2M1_X2, pack_e2m1, unpack_e2m1
from hetquant.formats.identify import identify

FP4 = get_format("fp4_e2m1")
FP8S = get_format("fp8_block_scale")


def hf_dequant(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """transformers 5.24's own dequantization (``Fp8Dequantize._dequantize_one``) as the oracle."""
    return Fp8Dequantize(None)._dequantize_one(weight, scale, torch.float32)


def test_golden_bytes_of_one_row() -> None:
    """Inputs 0..31 of one row: 0, 0.5, 1, ... -> the exact bytes DeepSeek's layout stores."""
    w = torch.tensor([E2M1[i % 16] for i in range(32)], dtype=torch.float32)[None] * 4.0
    st = FP4.quantize(w)
    # scale 4 = 2^2 -> byte 129; codes 0..15 twice, low nibble first: 0x10, 0x32, ..., 0xFE
    assert st["scale"].view(torch.uint8).tolist() == [[129]]
    assert st["weight"].view(torch.uint8).tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA,
                                                         0xDC, 0xFE] * 2]  # fmt: skip
    assert st["weight"].dtype == torch.int8 and st["scale"].dtype == torch.float8_e8m0fnu


def test_nibble_order_matches_transformers() -> None:
    """Input 2j is the LOW nibble (transformers finegrained_fp8.py:1125-1127)."""
    codes = torch.tensor([[1, 2] * 16])  # 0.5 then 1.0
    packed = pack_e2m1(codes)
    assert packed.view(torch.uint8)[0, 0] == 0x21
    assert torch.equal(unpack_e2m1(packed), codes.to(torch.uint8))
    scale = torch.tensor([[127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert hf_dequant(packed, scale)[0, :2].tolist() == [0.5, 1.0]


@pytest.mark.parametrize("seed", range(4))
def test_dequantize_is_exactly_transformers(seed: int) -> None:
    """Every byte pattern and every finite scale exponent: bit-equal to transformers' float32."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-128, 128, (16, 128), generator=g, dtype=torch.int8)
    scale = torch.randint(0, 250, (16, 8), generator=g, dtype=torch.uint8)
    tensors = {"weight": weight, "scale": scale.view(torch.float8_e8m0fnu)}
    ours = FP4.dequantize(tensors)
    assert torch.equal(
        ours.view(torch.int32), hf_dequant(weight, tensors["scale"]).view(torch.int32)
    )


def test_codes_times_two_are_the_integer_table() -> None:
    assert E2M1_X2 == (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def test_quantize_bound_and_grid() -> None:
    """|W - dq| <= one step of the grid's top (2 · 2^(e-127) / 2) per group; dq is a fixed point."""
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    st = FP4.quantize(w)
    dq = FP4.dequantize(st)
    step = torch.ldexp(torch.ones(32, 8), st["scale"].view(torch.uint8).int() - 127)
    assert bool(((w - dq).abs() <= step.repeat_interleave(32, 1)).all())
    assert torch.equal(FP4.dequantize(FP4.quantize(dq)), dq)


def test_identify_and_shapes() -> None:
    st = FP4.quantize(torch.randn(64, 96))
    got = identify(stored_metas(st), name="layers.3.ffn.experts.0.w1")
    assert got is not None and got.fmt.name == "fp4_e2m1" and got.shape == (64, 96)
    assert FP4.bits_per_weight((64, 96)) == 4.25


def test_nan_scale_is_refused_by_name() -> None:
    st = FP4.quantize(torch.randn(4, 64))
    st["scale"].view(torch.uint8)[1, 0] = 0xFF
    with pytest.raises(HetquantError, match=r"^scale: 1 NaN scale\(s\) \(UE8M0 byte 0xFF\)"):
        FP4.dequantize(st)
    with pytest.raises(HetquantError, match=r"^experts\.0\.w1: scale: 1 NaN"):
        list(FP4.source_rows("experts.0.w1", st, (4, 64)))


def test_scale_that_overflows_is_refused() -> None:
    st = {"weight": torch.full((1, 16), 0x77, dtype=torch.int8),  # code 7: 6.0
          "scale": torch.full((1, 1), 254, dtype=torch.uint8).view(torch.float8_e8m0fnu)}  # fmt: skip
    with pytest.raises(HetquantError, match="NaN/Inf value"):
        list(FP4.source_rows("e.w2", st, (1, 32)))


@pytest.mark.parametrize("dtype", ["F32", "BF16", "U8"])
def test_non_ue8m0_scale_dtype_fits_no_format(dtype: str) -> None:
    metas = {"weight": TensorMeta("I8", (8, 32)), "scale": TensorMeta(dtype, (8, 2))}
    with pytest.raises(HetquantError) as e:
        identify(metas, name="layers.1.ffn.experts.3.w1")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("layers.1.ffn.experts.3.w1: ")
    assert f"scale dtype {dtype} is not UE8M0" in msg


def test_packed_shape_disagreeing_with_scales_fits_no_format() -> None:
    metas = {"weight": TensorMeta("I8", (8, 32)), "scale": TensorMeta("F8_E8M0", (8, 3))}
    with pytest.raises(HetquantError, match="fit no format"):
        identify(metas, name="m")


# -- fp8_block_scale ---------------------------------------------------------------------------


def test_fp8_block_scale_is_fp8_block_exactly() -> None:
    """UE8M0 bytes read as 2^(b-127) give fp8_block's bit-exact BF16, and transformers' value."""
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(5))
    st = FP8S.quantize(w)
    assert st["scale"].dtype == torch.float8_e8m0fnu and tuple(st["scale"].shape) == (3, 2)
    ours = FP8S.source_dequantized("m", st, (300, 200))
    s32 = st["scale"].view(torch.uint8).int()
    v3 = get_format("fp8_block").dequantize_bf16(
        st["weight"], torch.ldexp(torch.ones(3, 2), s32 - 127)
    )
    assert torch.equal(ours, v3)
    whole = FP8S.quantize(w[:256, :128])  # transformers needs whole blocks (its grid divides)
    hf = hf_dequant(whole["weight"], whole["scale"]).to(torch.bfloat16)
    assert torch.equal(FP8S.source_dequantized("m", whole, (256, 128)), hf)
    assert (
        float((ours.float() - w).abs().max())
        <= float(torch.ldexp(torch.ones(()), s32.max() - 127)) * 16
    )


def test_fp8_block_scale_identifies_both_scale_dtypes() -> None:
    for dtype in ("F8_E8M0", "F32"):
        metas = {"weight": TensorMeta("F8_E4M3", (256, 128)), "scale": TensorMeta(dtype, (2, 1))}
        got = identify(metas, name="m")
        assert got is not None and got.fmt.name == "fp8_block_scale"
        assert got.fmt.scale_dtype == dtype  # type: ignore[attr-defined]


def test_fp8_block_scale_nan_byte_refused() -> None:
    st = FP8S.quantize(torch.randn(128, 128))
    st["scale"].view(torch.uint8)[0, 0] = 0xFF
    with pytest.raises(HetquantError, match=r"^layers\.0\.attn\.wkv\.scale: 1 NaN scale"):
        list(FP8S.source_rows("layers.0.attn.wkv", st, (128, 128)))
