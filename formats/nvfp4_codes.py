"""The E2M1 / E4M3 arithmetic of ``nvfp4`` (``formats/nvfp4.py`` documents the format and its
quantization formulas): the code and scale tables, the per-tensor and per-block scales, rounding to
the nearest E2M1 code (ties to even), and the shape checks. Pure functions of tensors / numbers.
"""

from __future__ import annotations

import numpy as np

from ._lazy import torch
from .errors import HetquantError

__all__ = [
    "BLOCK",
    "E2M1_BOUNDS",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MIN_SUBNORMAL",
    "FP8_E4M3_MAX",
    "block_scales_from_amax",
    "check_2d",
    "check_k",
    "e2m1_codes",
    "effective_scale",
    "magnitude_codes",
    "scale_2_from_amax",
    "scale_2_of",
    "scale_2_value",
]

BLOCK = 16  # inputs per E4M3 block scale
FP8_E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E2M1_MAX = 6.0
# Value of each 4-bit code: index = sign << 3 | magnitude index (ModelOpt ``e2m1_values``).
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES: tuple[float, ...] = _MAGNITUDES + tuple(-m for m in _MAGNITUDES)
# Midpoints between neighbouring magnitudes; at these the tie goes to the even code.
E2M1_BOUNDS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose even neighbour is the larger one


def check_k(k: int) -> None:
    """Raise unless ``k`` (in_features) is a multiple of ``BLOCK``."""
    if k % BLOCK:
        raise HetquantError(
            f"nvfp4: in_features {k} is not a multiple of the block size {BLOCK}; NVFP4 cannot "
            "store this weight — keep it in another format (e.g. bf16)"
        )


def check_2d(weight: torch.Tensor) -> None:
    """Raise unless ``weight`` is 2-D with in_features a multiple of ``BLOCK``."""
    if weight.ndim != 2:
        raise HetquantError(f"nvfp4.quantize: expected a 2-D weight, got {tuple(weight.shape)}")
    check_k(weight.shape[1])


def scale_2_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``weight_scale_2 = amax / (6 · 448)`` in float32 (1 for an all-zero weight)."""
    s2 = amax.to(torch.float32) / (E2M1_MAX * FP8_E4M3_MAX)
    return torch.where(s2 > 0, s2, torch.ones_like(s2))


def scale_2_value(amax: float) -> np.float32:
    """:func:`scale_2_from_amax` of a Python float by numpy scalars (one per streamed row
    block: torch's ops cost ~0.4 ms each time): the same float32 rounding of ``amax`` and the
    same float32 division, so the same value."""
    s2 = np.float32(amax) / np.float32(E2M1_MAX * FP8_E4M3_MAX)
    return s2 if s2 > 0 else np.float32(1.0)


def scale_2_of(amax: float) -> torch.Tensor:
    """:func:`scale_2_value` as a 0-d float32 tensor."""
    return torch.tensor(scale_2_value(amax), dtype=torch.float32)


def block_scales_from_amax(amax: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales ``e4m3(clamp(amax_16 / (6 · s2), 2^-9, 448))`` (1 for a zero block)."""
    sb = amax / (E2M1_MAX * s2)
    sb = torch.where(sb == 0, torch.ones_like(sb), sb)
    return sb.clamp(E4M3_MIN_SUBNORMAL, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Round f32 ``y`` to the nearest E2M1 value (ties to even, saturating): uint8 codes 0..15."""
    return magnitude_codes(y.abs(), y < 0)


def magnitude_codes(mag: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Codes from magnitudes and signs. The magnitude code is the number of decision bounds
    ``mag`` passes; at a bound (a tie) the even code wins: bounds below an even code count when
    reached (``>=``, the ``_TIES_UP``), the others only when passed (``>``)."""
    idx = torch.zeros(mag.shape, dtype=torch.uint8)
    for bound in E2M1_BOUNDS:
        idx += (mag >= bound) if bound in _TIES_UP else (mag > bound)
    return (negative.to(torch.uint8) << 3) | idx


def effective_scale(weight_scale: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """f32(sb) * s2 in f32, [N, K/16]: the step of each block's grid."""
    return weight_scale.to(torch.float32) * s2.to(torch.float32)
