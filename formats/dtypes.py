"""Safetensors dtype strings ↔ torch dtypes, and element sizes.

The safetensors header names dtypes with strings ("F8_E4M3", "BF16", …). This table is the only
place that maps them; everything else asks it.
"""

from __future__ import annotations

import torch

from .errors import HetquantError

__all__ = ["ST_TO_TORCH", "TORCH_TO_ST", "itemsize", "round_up_to", "st_dtype", "torch_dtype"]

ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}

_ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in ST_TO_TORCH.items()}


def torch_dtype(st: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype string."""
    try:
        return ST_TO_TORCH[st]
    except KeyError:
        raise HetquantError(
            f"unsupported safetensors dtype {st!r}; known: {', '.join(ST_TO_TORCH)}"
        ) from None


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string for a torch dtype."""
    try:
        return TORCH_TO_ST[dtype]
    except KeyError:
        raise HetquantError(f"dtype {dtype} cannot be stored in safetensors") from None


def itemsize(st: str) -> int:
    """Bytes per element of a safetensors dtype string."""
    torch_dtype(st)
    return _ITEMSIZE[st]


def round_up_to(x: torch.Tensor, st: str) -> torch.Tensor:
    """Positive ``x`` rounded up to dtype ``st``: the smallest value of that dtype ``>= x``, as a
    tensor of that dtype (``inf`` where ``x`` lies beyond its range). A cast that lands below
    ``x`` (to nearest, or through float32 first, as float64 → float16 goes) moves up one step."""
    y = x.to(torch_dtype(st))
    low = y.to(x.dtype) < x
    return torch.where(low, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
