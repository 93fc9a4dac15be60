"""The row codec of ``int4_cpu_group`` (``formats/int4_cpu_group.py`` documents the format):
float rows → 4-bit codes and one BF16 scale per group of ``g`` inputs, and back.

Round-to-nearest: ``s = amax(|W[r, group]|) / 7`` rounded *up* to BF16 (1 for an all-zero
group), ``c = clamp(round_half_even(W / s), −7, 7) + 8``; ``W = (c − 8) · f32(s)``.
"""

from __future__ import annotations

from ._lazy import torch
from .base import all_finite
from .bits import pack_nibbles_u8, unpack_nibbles_u8
from .dtypes import divide, round_up_to
from .errors import HetquantError
from .int4_cpu_rows import QMAX, ZERO_POINT

__all__ = ["GROUP_SIZES", "check_group", "check_group_size", "dequantize_rows", "quantize_rows"]

GROUP_SIZES = (32, 64, 128)  # whole 32-element blocks (the GEMV's unit)


def check_group_size(what: str, group_size: int) -> None:
    """Raise unless ``group_size`` is one of ``GROUP_SIZES`` (a format variant's field)."""
    if group_size not in GROUP_SIZES:
        raise HetquantError(f"{what}: group_size {group_size} not in {list(GROUP_SIZES)}")


def check_group(what: str, group_size: int, dim: str, n: int) -> None:
    """Raise unless ``group_size`` is in ``GROUP_SIZES`` and divides ``n`` (``dim``'s size)."""
    if group_size not in GROUP_SIZES:
        raise HetquantError(f"{what}: group size {group_size} not in {list(GROUP_SIZES)}")
    if n <= 0 or n % group_size:
        raise HetquantError(
            f"{what}: {dim} = {n} must be a positive multiple of the group size {group_size}"
        )


def quantize_rows(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float rows [R, K] (K a multiple of g, finite) → (packed U8 [R, K/2], scale BF16 [R, K/g])."""
    r, k = w.shape
    check_group("int4_cpu_group", group_size, "in", k)
    wg = w.to(torch.float32).reshape(r, k // group_size, group_size)  # (R, K/g, g)
    amax = wg.abs().amax(dim=-1)  # (R, K/g)
    if not all_finite(amax):
        raise HetquantError("int4_cpu_group: NaN/Inf values (or beyond float32); fix the source")
    s = round_up_to(divide(amax.double(), QMAX), "BF16")
    s = torch.where(amax > 0, s, torch.ones_like(s))  # finite: amax/7 < BF16's max
    q = (wg / s.float()[..., None]).round_().clamp_(-QMAX, QMAX)  # (R, K/g, g), |q| ≤ 7
    codes = q.reshape(r, k).add_(ZERO_POINT).to(torch.uint8)
    return pack_nibbles_u8(codes), s


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed U8 [..., R, K/2] and scale BF16 [..., R, K/g] → float32 [..., R, K]."""
    codes = unpack_nibbles_u8(packed)  # (..., R, K)
    group = codes.shape[-1] // max(scale.shape[-1], 1)
    if scale.shape[:-1] != codes.shape[:-1] or group * scale.shape[-1] != codes.shape[-1]:
        raise HetquantError(
            f"int4_cpu_group: scale {list(scale.shape)} does not fit codes {list(codes.shape)}"
        )
    s = scale.to(torch.float32)
    if not bool(torch.isfinite(s).all()):
        raise HetquantError("int4_cpu_group: a scale is NaN/Inf; the file is corrupt")
    return (codes.to(torch.float32) - ZERO_POINT) * s.repeat_interleave(group, dim=-1)
