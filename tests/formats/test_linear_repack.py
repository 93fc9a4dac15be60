"""``formats/linear_repack.py``: DeepSeek-V4's FP4 (``fp4_e2m1``: E2M1 + UE8M0 per 32) into NVFP4
and its Ascend tiled layout without re-rounding: dequantization bit-identical to the source's,
the codes' bytes unchanged, one global scale per merged module, and the refusal when the UE8M0
exponents span more powers of two than an E4M3 block scale holds."""

from __future__ import annotations

import pytest
import torch

from hetquant.formats import HetquantError, get_format
from hetquant.formats.linear_repack import E4M3_POW2, LINEAR_REPACKS
from hetquant.formats.nvfp4_ascend import to_canonical

FP4 = get_format("fp4_e2m1")
SPREAD = E4M3_POW2[1] - E4M3_POW2[0]  # 17: the widest exponent span that fits


def fp4_weight(n: int, k: int, e_lo: int, e_hi: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random codes (all 16) and UE8M0 exponent bytes in [e_lo, e_hi], both ends present."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, generator=g)
    e = torch.randint(e_lo, e_hi + 1, (n, k // 32), dtype=torch.uint8, generator=g)
    e.view(-1)[0], e.view(-1)[-1] = e_lo, e_hi
    return {"weight": codes, "scale": e.view(torch.float8_e8m0fnu)}


def repack(stored, target: str, others=()) -> dict[str, torch.Tensor]:
    r = LINEAR_REPACKS["fp4_e2m1", target]
    return r.repack(stored, get_format(target), list(others))


@pytest.mark.parametrize(
    ("e_lo", "e_hi"), [(0, SPREAD), (254 - SPREAD, 254), (120, 127), (127, 127)]
)
def test_nvfp4_dequantizes_to_the_source_exactly(e_lo: int, e_hi: int) -> None:
    src = fp4_weight(48, 256, e_lo, e_hi, seed=e_lo)
    assert LINEAR_REPACKS["fp4_e2m1", "nvfp4"].fits(src, get_format("nvfp4"), []) is None
    out = repack(src, "nvfp4")
    assert torch.equal(out["weight"], src["weight"].view(torch.uint8))  # the same bytes
    assert out["weight_scale"].dtype == torch.float8_e4m3fn and out["weight_scale"].shape == (
        48,
        16,
    )
    assert out["weight_scale_2"].shape == () and out["weight_scale_2"].dtype == torch.float32
    assert float(out["weight_scale"].float().max()) == 2.0 ** E4M3_POW2[1]  # top-aligned
    want = FP4.dequantize(src)
    got = get_format("nvfp4").dequantize(out)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_ascend_tiled_layout_dequantizes_to_the_source_exactly() -> None:
    src = fp4_weight(256, 128, 100, 112)
    tiled = repack(src, "nvfp4_ascend")
    assert torch.equal(to_canonical(tiled)["weight"], src["weight"].view(torch.uint8))
    got = get_format("nvfp4_ascend").dequantize(tiled)
    assert torch.equal(got.view(torch.int32), FP4.dequantize(src).view(torch.int32))


def test_merged_module_shares_one_global_scale() -> None:
    """gate's exponents 110..115, up's 118..124: both get the global scale of the joint max."""
    gate, up = fp4_weight(32, 128, 110, 115, seed=1), fp4_weight(32, 128, 118, 124, seed=2)
    a, b = repack(gate, "nvfp4", [up]), repack(up, "nvfp4", [gate])
    assert torch.equal(a["weight_scale_2"], b["weight_scale_2"])
    assert float(a["weight_scale_2"]) == 2.0 ** (124 - 127 - E4M3_POW2[1])
    for src, out in ((gate, a), (up, b)):
        assert torch.equal(get_format("nvfp4").dequantize(out), FP4.dequantize(src))
    alone = repack(gate, "nvfp4")  # on its own it would take its own maximum
    assert float(alone["weight_scale_2"]) == 2.0 ** (115 - 127 - E4M3_POW2[1])


def test_a_spread_past_e4m3_is_refused() -> None:
    wide = fp4_weight(8, 64, 100, 100 + SPREAD + 1)
    r, nv = LINEAR_REPACKS["fp4_e2m1", "nvfp4"], get_format("nvfp4")
    why = r.fits(wide, nv, [])
    assert why is not None and "2^-27 .. 2^-9 (19 powers of two)" in why and "--requantize" in why
    with pytest.raises(HetquantError, match=r"E4M3 block scale holds 18"):
        r.repack(wide, nv, [])
    # each member alone fits; together (one global scale) they do not
    gate, up = fp4_weight(8, 64, 100, 110), fp4_weight(8, 64, 112, 118)
    assert r.fits(gate, nv, []) is None
    assert "over its merged module" in r.fits(gate, nv, [up])


def test_variant_and_nan_refusals() -> None:
    r = LINEAR_REPACKS["fp4_e2m1", "nvfp4"]
    assert "calibrated" in r.holds(FP4, get_format("nvfp4", with_input_scale=True))
    assert r.holds(FP4, get_format("nvfp4")) is None
    bad = fp4_weight(4, 64, 120, 125)
    bad["scale"].view(torch.uint8)[1, 1] = 0xFF
    with pytest.raises(HetquantError, match=r"NaN scale"):
        r.fits(bad, get_format("nvfp4"), [])
