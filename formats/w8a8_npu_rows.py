"""The per-row int8 codec of the Ascend W8A8 formats (``formats/w8a8_npu.py`` documents the
stored tensors, the scale rule and why scales are held in BF16): float weights [n, k] ↔ int8
codes, F32 scales held exactly in ``HELD_SCALE_DTYPE``, and the static activation parameters.

Shared by ``w8a8_dynamic`` and ``w8a8`` (the formats) and by the reference NPU ops
(``formats/w8a8_npu_ops.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ._lazy import torch
from ._rows_native import w8a8_rows
from .base import TensorMeta, WeightFormat, all_finite
from .dtypes import round_up_to
from .errors import HetquantError

__all__ = [
    "ASYM_LEVELS",
    "HELD_SCALE_DTYPE",
    "INT8_MAX",
    "INT8_MIN",
    "SCALE_FLOOR",
    "activation_qparams",
    "check_tensors",
    "checked_weight",
    "dequantize_int8",
    "held_scale",
    "weight_metas",
    "weight_tensors",
]

INT8_MIN, INT8_MAX = -128, 127
ASYM_LEVELS = 255  # 2**8 - 1 steps across [lo, hi]
SCALE_FLOOR = 2.0**-23  # FLT_EPSILON: msModelSlim's lower bound for every scale
HELD_SCALE_DTYPE = "BF16"  # the dtype consumers hold scales in (vllm-ascend: the model's)


def checked_weight(weight: torch.Tensor, name: str, finite: bool = True) -> torch.Tensor:
    """``weight`` as F32 [n, k] after refusing what cannot be quantized."""
    if weight.ndim != 2 or 0 in weight.shape:
        raise HetquantError(
            f"{name}: expected a non-empty 2-D weight [out, in], got shape {list(weight.shape)}; "
            "only linear weights can be stored as W8A8"
        )
    if not weight.is_floating_point():
        raise HetquantError(f"{name}: weight must be float, got {weight.dtype}; dequantize it")
    w = weight.to(torch.float32)
    if finite and not all_finite(w):
        bad = ~torch.isfinite(w)
        row, col = (int(i) for i in bad.nonzero()[0])
        raise HetquantError(
            f"{name}: {int(bad.sum())} NaN/Inf values (first at [{row}, {col}]); the source "
            "checkpoint or its dequantization is corrupt, fix it before quantizing"
        )
    return w


def held_scale(x: torch.Tensor) -> torch.Tensor:
    """Positive ``x`` (float64) floored at FLT_EPSILON and rounded up to ``HELD_SCALE_DTYPE``:
    the F32 scale a consumer holds exactly (module docstring)."""
    return round_up_to(x.clamp(min=SCALE_FLOOR), HELD_SCALE_DTYPE).to(torch.float32)


def weight_tensors(weight: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """Symmetric per-row int8 of ``weight`` [n, k]: weight, weight_scale, weight_offset."""
    fast = w8a8_rows(weight) if weight.ndim == 2 and 0 not in weight.shape else None
    if fast is not None:  # the fused kernel: the same bytes, no float32 copy
        q, scale = fast
        return {"weight": q, "weight_scale": scale, "weight_offset": torch.zeros_like(scale)}
    w = checked_weight(weight, name, finite=False)  # (n, k) F32
    amax = w.abs().amax(dim=1, keepdim=True)  # (n, 1); NaN/Inf propagate
    if not all_finite(amax):
        checked_weight(weight, name)  # raises, naming the first bad value
    scale = held_scale(amax.double() / INT8_MAX)  # (n, 1), >= amax / 127
    narrow = weight.dtype in (torch.bfloat16, torch.float16)  # their F32 quotient rounds exactly
    exact = w if narrow else w.double()  # F32 weights: an F64 quotient
    q = (exact / scale).round_().clamp_(INT8_MIN, INT8_MAX).to(torch.int8)  # (n, k)
    return {"weight": q, "weight_scale": scale, "weight_offset": torch.zeros_like(scale)}


def weight_metas(shape: tuple[int, int], fmt: str) -> dict[str, TensorMeta]:
    if len(shape) != 2 or min(shape) <= 0:
        raise HetquantError(f"{fmt}: stores 2-D weights [out, in] only, got shape {list(shape)}")
    n, k = shape
    return {
        "weight": TensorMeta("I8", (n, k)),
        "weight_scale": TensorMeta("F32", (n, 1)),
        "weight_offset": TensorMeta("F32", (n, 1)),
    }


def check_tensors(fmt: WeightFormat, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise unless ``tensors`` are exactly what ``fmt`` stores for their ``weight``."""
    if "weight" not in tensors or tensors["weight"].ndim != 2:
        raise HetquantError(f"{fmt.name}: no 2-D 'weight' among {sorted(tensors)}")
    fmt.check_stored(tensors, tuple(tensors["weight"].shape))


def dequantize_int8(fmt: WeightFormat, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    check_tensors(fmt, tensors)
    q = tensors["weight"].to(torch.float32)  # (n, k)
    return (q - tensors["weight_offset"]) * tensors["weight_scale"]  # (n, k)


def activation_qparams(
    act_min: torch.Tensor, act_max: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """msModelSlim per-tensor asymmetric int8: F32 [1] range -> (input_scale, input_offset);
    the scale held exactly in BF16, rounded up (module docstring)."""
    lo, hi = act_min.clamp(max=0.0).double(), act_max.clamp(min=0.0).double()
    scale = held_scale((hi - lo) / ASYM_LEVELS)  # (1,) F32
    return scale, (torch.round(-lo / scale) + INT8_MIN).float()  # (1,), (1,)
