"""The row codec of ``int4_cpu`` (``formats/int4_cpu.py`` documents codes, scales, clip search and
nibble order): float rows [R, K] (K even) ↔ packed codes U8 [R, K/2] and an F32 scale [R].

Shared by the per-linear format (``Int4Cpu``) and the per-layer expert layout
(``formats/int4_cpu_layer.py``); the group-wise variant reuses ``QMAX`` and ``ZERO_POINT``.
"""

from __future__ import annotations

from ._lazy import torch
from ._rows_native import int4_rows
from .base import all_finite
from .bits import pack_nibbles_u8, unpack_nibbles_u8
from .dtypes import divide
from .errors import HetquantError

__all__ = [
    "CLIP_RATIOS",
    "QMAX",
    "ZERO_POINT",
    "check_even",
    "check_weight",
    "dequantize_rows",
    "quantize_rows",
    "quantize_rows_torch",
]

QMAX = 7  # signed codes q ∈ [−QMAX, QMAX]
ZERO_POINT = 8  # stored code c = q + ZERO_POINT ∈ 1..15
CLIP_RATIOS = tuple(round(1.0 - 0.02 * i, 2) for i in range(16))  # 1.00, 0.98, …, 0.70


def check_even(what: str, dim: str, n: int) -> None:
    if n <= 0 or n % 2:
        raise HetquantError(
            f"{what}: {dim} = {n} must be a positive even number; int4_cpu packs two "
            "elements per byte along it and never pads"
        )


def check_weight(what: str, weight: torch.Tensor, finite: bool = True) -> torch.Tensor:
    """Validate a float weight [out, in] and return it as float32."""
    if weight.ndim != 2:
        raise HetquantError(f"{what}: expected a 2-D weight, got shape {list(weight.shape)}")
    check_even(what, "in", weight.shape[1])
    w = weight.to(torch.float32)
    if finite and not all_finite(w):
        bad = int((~torch.isfinite(w)).sum())
        raise HetquantError(f"{what}: {bad} NaN/Inf values (or beyond float32); fix the source")
    return w


def _row_scale(amax: torch.Tensor, ratio: float) -> torch.Tensor:
    s = divide(amax * ratio, QMAX)  # (R,)
    return torch.where(amax > 0, s, torch.ones_like(s))


def _codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q = (w / scale[:, None]).round_().clamp_(-QMAX, QMAX)  # (R, K), half to even
    return q.add_(ZERO_POINT).to(torch.uint8)


def _dequant_codes(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (codes.to(torch.float32) - ZERO_POINT) * scale.to(torch.float32).unsqueeze(-1)


def _sq_err(w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # w − ŵ is exact in float32 (Sterbenz: ŵ = 0, or ŵ/2 ≤ w ≤ 2ŵ since ρ ≥ 1/2); squares are
    # exact in float64, so only the float64 sum rounds.
    diff = w - _dequant_codes(codes, scale)  # (R, K)
    return diff.double().square_().sum(-1)  # (R,)


def quantize_rows(
    what: str, w: torch.Tensor, clip_search: bool = False, finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rows [R, K] (K even) → (packed U8 [R, K/2], scale F32 [R]): the fused kernel
    (``_rows_native.int4_rows``, the same bytes) without clip search, else the torch code."""
    fast = None if clip_search else int4_rows(w) if w.ndim == 2 else None
    if fast is not None:
        return fast
    return quantize_rows_torch(check_weight(what, w, finite), clip_search)


def quantize_rows_torch(w: torch.Tensor, clip_search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 rows [R, K] (K even, finite) → (packed U8 [R, K/2], scale F32 [R])."""
    amax = w.abs().amax(dim=-1)  # (R,)
    if not all_finite(amax):
        raise HetquantError("int4_cpu: NaN/Inf values (or beyond float32); fix the source")
    scale = _row_scale(amax, CLIP_RATIOS[0])
    codes = _codes(w, scale)  # (R, K)
    if clip_search:
        err = _sq_err(w, codes, scale)
        for ratio in CLIP_RATIOS[1:]:
            s = _row_scale(amax, ratio)
            c = _codes(w, s)
            e = _sq_err(w, c, s)
            better = e < err  # strict: ties keep the larger ratio
            scale = torch.where(better, s, scale)
            codes = torch.where(better[:, None], c, codes)
            err = torch.where(better, e, err)
    return pack_nibbles_u8(codes), scale


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed U8 [..., R, K/2] and scale [..., R] → float32 [..., R, K]."""
    if not torch.isfinite(scale).all():
        raise HetquantError("int4_cpu: a scale is NaN/Inf; the file is corrupt")
    return _dequant_codes(unpack_nibbles_u8(packed), scale)
