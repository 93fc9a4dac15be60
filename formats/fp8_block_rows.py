"""The code and scale arithmetic of ``fp8_block`` (``formats/fp8_block.py`` documents the format):
the exact E4M3 → float32 decode, BF16 rows of one block row, the absmax of a whole weight from its
codes, and the checks that refuse a corrupt source (NaN codes; NaN/Inf, negative, overflowing or,
under ``ue8m0``, non-power-of-two scales). Pure functions of tensors / numpy arrays.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _quant_native
from ._lazy import torch
from .errors import HetquantError

__all__ = [
    "FP8_E4M3_MAX",
    "SCALE_FMTS",
    "absmax_dequantized",
    "check_codes",
    "check_pow2_scales",
    "check_scales",
    "dequantize_rows",
    "e4m3_to_f32",
    "scale_shape",
]

FP8_E4M3_MAX = 448.0


def scale_shape(shape: tuple[int, int], block: int) -> tuple[int, int]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape`` and square ``block``."""
    return (-(-shape[0] // block), -(-shape[1] // block))


def dequantize_rows(
    weight: torch.Tensor, scale_inv: torch.Tensor, row0: int, block: int = 128
) -> torch.Tensor:
    """Dequantize rows ``row0 : row0 + len(weight)`` of a block-FP8 weight to BF16, bit-exactly.

    ``weight`` is a row slice [r, in] (E4M3) that lies inside ONE block row (``row0 // block ==
    (row0 + r - 1) // block``); ``scale_inv`` is the full [ceil(out/b), ceil(in/b)] F32 scale.
    Streaming callers use this to keep memory at one block row.
    """
    rows, cols = weight.shape
    brow = row0 // block
    if (row0 + rows - 1) // block != brow:
        raise HetquantError(f"dequantize_rows: rows {row0}..{row0 + rows} cross a block row")
    s_row = scale_inv[brow].repeat_interleave(block)[:cols]  # (in,)
    return (e4m3_to_f32(weight) * s_row).to(torch.bfloat16)  # (r, in)


_E4M3_MAGNITUDE = 0x7F  # low 7 bits; also E4M3FN's NaN magnitude (S.1111.111)
_BF16_MAX = (2 - 2**-7) * 2.0**127  # torch.finfo(torch.bfloat16).max


def check_codes(name: str, codes: torch.Tensor) -> None:
    """Refuse NaN codes. E4M3FN's only NaNs are 0x7F and 0xFF: the largest int8 and the largest
    uint8 values, so two max reductions find them (far cheaper than masking every byte)."""
    if codes.numel() and (
        int(codes.view(torch.int8).max()) == _E4M3_MAGNITUDE
        or int(codes.view(torch.uint8).max()) == 0xFF
    ):
        raise HetquantError(f"{name}: NaN code(s) in the FP8 weight; the checkpoint is corrupt")


SCALE_FMTS = ("float", "ue8m0")
_F32_MANTISSA = (1 << 23) - 1


def _host_f32(scale_inv: Any) -> np.ndarray:
    """Scales (a numpy array, or a tensor on any device) as a float32 numpy array: the checks
    below are one rule for the torch code and the native lane (``arrays``)."""
    if isinstance(scale_inv, np.ndarray):
        return scale_inv.astype(np.float32, copy=False)
    return scale_inv.detach().to("cpu", torch.float32).numpy()


def check_pow2_scales(name: str, scale_inv: Any) -> None:
    """Refuse a scale that is not a power of two (UE8M0: exponent only; zero mantissa bits,
    normal numbers, positive). ``scale_inv``: a numpy array or a tensor."""
    s = np.ascontiguousarray(_host_f32(scale_inv)).reshape(-1)
    bits = s.view(np.int32)
    bad = ((bits & _F32_MANTISSA) != 0) | (bits <= _F32_MANTISSA)  # mantissa, or ≤ 0 / subnormal
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise HetquantError(
            f"{name}: scale {float(s[i])!r} (entry {i}) is not a power of two, but config.json "
            "declares scale_fmt ue8m0; the checkpoint is corrupt or its config is not its own"
        )


def check_scales(name: str, scale_inv: Any) -> None:
    """Refuse NaN/Inf, negative scales, and scales whose largest code (448) overflows BF16.
    ``scale_inv``: a numpy array or a tensor."""
    s = _host_f32(scale_inv)
    lo, hi = (float(s.min()), float(s.max())) if s.size else (0.0, 0.0)  # NaN propagates
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = int((~np.isfinite(s)).sum())
        raise HetquantError(f"{name}: {bad} NaN/Inf value(s) of {s.size}; corrupt scale")
    if lo < 0:
        raise HetquantError(
            f"{name}: negative scale {lo:g}; block scales are positive, the checkpoint is corrupt"
        )
    if hi * FP8_E4M3_MAX > _BF16_MAX:
        raise HetquantError(
            f"{name}: scale {hi:g} makes 448·s overflow BF16; the checkpoint is corrupt"
        )


def absmax_dequantized(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> float:
    """``max |dequantize_rows(weight)|`` over a whole block-FP8 weight, without dequantizing it.

    |bf16(f32(c)·s)| is non-decreasing in |c| (multiplication by one scale and rounding are
    monotonic), and E4M3 magnitudes order like the integers of their low 7 bits, so in each
    block row only every column's largest code needs dequantizing: one byte-wise max per block
    row (the C++ column max where built), then ``in`` values per block row instead of
    ``block × in``, all block rows in one go. NaN codes raise.
    """
    codes = weight.view(torch.uint8)
    blocks = -(-codes.shape[0] // block)
    mags = torch.empty((blocks, codes.shape[1]), dtype=torch.uint8)  # (out/b, in)
    for b in range(blocks):
        rows = codes[b * block : (b + 1) * block]
        got = _quant_native.u8_colmax7(rows)
        mags[b] = got if got is not None else (rows & _E4M3_MAGNITUDE).amax(dim=0)
    if mags.numel() == 0:
        return 0.0
    if int(mags.amax()) == _E4M3_MAGNITUDE:
        raise HetquantError("NaN code(s) in the FP8 weight; the checkpoint is corrupt")
    s = scale_inv[:blocks].repeat_interleave(block, dim=1)[:, : codes.shape[1]]  # (out/b, in)
    return float((e4m3_to_f32(mags.view(torch.float8_e4m3fn)) * s).to(torch.bfloat16).abs().amax())


_F32_SIGN_EXP4_MAN3 = -2014314496  # 0x87F00000 as int32: sign, low 4 exponent bits, top 3 mantissa
_E4M3_REBIAS = 2.0**120  # 2^(127 - 7): float32 exponent bias minus E4M3's


def e4m3_to_f32(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 (float8_e4m3fn) → float32, exactly, by integer ops (torch's own cast is ~10× slower).

    The byte ``s eeee mmm`` sign-extended to int32 and shifted left by 20 puts ``eeee mmm`` at
    float32 bits 20..26 and the sign at bit 31; as a float32 that is ``±2^(eeee−127)·1.mmm``
    (a float32 subnormal when ``eeee = 0``, exactly like E4M3's subnormals), and one multiply by
    2^120 — exact, a power of two — gives the E4M3 value. NaN codes must be refused before.
    """
    bits = codes.view(torch.int8).to(torch.int32)  # sign-extended
    bits = (bits << 20) & _F32_SIGN_EXP4_MAN3
    return bits.view(torch.float32) * _E4M3_REBIAS
