"""Tests of formats/nvfp4_ascend.py: the format against canonical NVFP4, its stored tensors and
refused shapes, the soft-float conversions and the NPU scale fold, and the names it re-exports
(the tile order itself: test_nvfp4_ascend_tiles.py)."""

from __future__ import annotations

import pytest
import torch
from test_nvfp4_ascend_tiles import random_canonical, same_bytes

from hetquant.formats import FORMATS, HetquantError, TensorMeta, nvfp4_ascend
from hetquant.formats import nvfp4_ascend_tiles as tiles
from hetquant.formats.nvfp4 import BLOCK, E2M1_VALUES, Nvfp4
from hetquant.formats.nvfp4_ascend import (
    Nvfp4Ascend,
    e2m1_to_bf16_soft,
    e4m3_to_bf16_soft,
    npu_scale_bf16,
    to_tiled,
)

FMT = Nvfp4Ascend()
E4M3_NAN = (0x7F, 0xFF)


def test_reexports_the_tile_functions() -> None:
    for name in ("K_ALIGN", "N_ALIGN", "TILE", "tiled_slice", "to_canonical", "to_tiled"):
        assert getattr(nvfp4_ascend, name) is getattr(tiles, name), name


@pytest.mark.parametrize("with_input_scale", [False, True])
def test_quantize_dequantize_agree_with_canonical(with_input_scale: bool) -> None:
    fmt, canon = Nvfp4Ascend(with_input_scale), Nvfp4(with_input_scale)
    w = torch.randn(256, 192, generator=torch.Generator().manual_seed(1))
    opts = {"act_amax": 3.0} if with_input_scale else {}
    t, c = fmt.quantize(w, **opts), canon.quantize(w, **opts)
    fmt.check_stored(t, (256, 192))
    assert same_bytes(t, to_tiled(c))
    assert torch.equal(fmt.dequantize(t), canon.dequantize(c))
    assert fmt.nbytes((256, 192)) == canon.nbytes((256, 192))


def test_stored() -> None:
    assert FMT.stored((512, 128)) == {
        "weight": TensorMeta("U8", (128, 256)),
        "weight_scale": TensorMeta("F8_E4M3", (8, 512)),
        "weight_scale_2": TensorMeta("F32", ()),
    }
    assert FORMATS["nvfp4_ascend"] == FMT


@pytest.mark.parametrize("shape", [(256, 32), (256, 80), (128, 64), (384, 64), (250, 64)])
def test_untileable_shapes_refused(shape: tuple[int, int]) -> None:
    with pytest.raises(HetquantError, match="K % 64 == 0 and N % 256 == 0"):
        FMT.stored(shape)
    with pytest.raises(HetquantError, match="cannot be tiled"):
        FMT.quantize(torch.ones(shape))
    with pytest.raises(HetquantError, match="cannot be tiled"):
        FMT.streaming(shape)


# ---- software conversions -----------------------------------------------------------------------
def test_e2m1_soft_conversion_all_codes() -> None:
    got = e2m1_to_bf16_soft(torch.arange(16, dtype=torch.uint8))
    want = torch.tensor(E2M1_VALUES, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bitwise: -0 included
    assert got[1].item() == 0.5 and got[9].item() == -0.5  # BF16 subnormal path
    assert torch.signbit(got[8]) and not torch.signbit(got[0])


def test_e4m3_soft_conversion_all_bytes() -> None:
    b = torch.arange(256, dtype=torch.uint8)
    got = e4m3_to_bf16_soft(b)
    want = b.view(torch.float8_e4m3fn).to(torch.bfloat16)
    ok = ~torch.isin(b, torch.tensor(E4M3_NAN, dtype=torch.uint8))
    assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))
    assert got[0x01].item() == 2.0**-9 and got[0x7E].item() == 448.0
    assert got[list(E4M3_NAN)].tolist() == [480.0, -480.0]  # NaN codes, harmless for scales


def test_npu_scale_bf16() -> None:
    t = to_tiled(random_canonical(256, 128, 3))
    got = npu_scale_bf16(t)
    assert got.shape == (128 // BLOCK, 256) and got.dtype == torch.bfloat16
    want = (t["weight_scale"].float() * t["weight_scale_2"]).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
