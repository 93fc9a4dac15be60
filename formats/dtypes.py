"""Safetensors dtype strings ↔ torch and numpy dtypes, and element sizes.

The safetensors header names dtypes with strings ("F8_E4M3", "BF16", …). This table is the only
place that maps them; everything else asks it. It is keyed by those strings, so planning, the
native conversion lane and the writer need no torch (``_lazy``): the torch dtypes are looked up
only when asked for. numpy has no BF16 or FP8 dtypes, so :func:`numpy_dtype` gives those as
their bits (unsigned integers of their width), the form the native kernels take them in.
"""

from __future__ import annotations

import functools

import numpy as np

from ._lazy import torch
from .errors import HetquantError

__all__ = [
    "ST_DTYPES",
    "divide",
    "itemsize",
    "numpy_dtype",
    "round_up_to",
    "st_dtype",
    "torch_dtype",
    "torch_dtypes",
]

# safetensors dtype → (bytes per element, torch dtype name, numpy dtype: the bits where numpy lacks it)
ST_DTYPES: dict[str, tuple[int, str, type]] = {
    "F64": (8, "float64", np.float64),
    "F32": (4, "float32", np.float32),
    "F16": (2, "float16", np.float16),
    "BF16": (2, "bfloat16", np.uint16),
    "F8_E4M3": (1, "float8_e4m3fn", np.uint8),
    "F8_E5M2": (1, "float8_e5m2", np.uint8),
    "F8_E8M0": (1, "float8_e8m0fnu", np.uint8),  # UE8M0 scales: 2^(byte - 127), 0xFF NaN
    "I64": (8, "int64", np.int64),
    "I32": (4, "int32", np.int32),
    "I16": (2, "int16", np.int16),
    "I8": (1, "int8", np.int8),
    "U8": (1, "uint8", np.uint8),
    "BOOL": (1, "bool", np.bool_),
}


def _entry(st: str) -> tuple[int, str, type]:
    try:
        return ST_DTYPES[st]
    except KeyError:
        raise HetquantError(
            f"unsupported safetensors dtype {st!r}; known: {', '.join(ST_DTYPES)}"
        ) from None


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype string → torch dtype, every one (imports torch)."""
    return {st: getattr(torch, name) for st, (_, name, _) in ST_DTYPES.items()}


@functools.cache
def _st_of_torch() -> dict[torch.dtype, str]:
    return {v: k for k, v in torch_dtypes().items()}


def torch_dtype(st: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype string."""
    _entry(st)
    return torch_dtypes()[st]


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string for a torch dtype."""
    try:
        return _st_of_torch()[dtype]
    except KeyError:
        raise HetquantError(f"dtype {dtype} cannot be stored in safetensors") from None


def numpy_dtype(st: str) -> np.dtype:
    """The numpy dtype holding a safetensors dtype's elements: the dtype itself, or for BF16
    and FP8, which numpy lacks, their bits (``uint16``, ``uint8``)."""
    return np.dtype(_entry(st)[2])


def itemsize(st: str) -> int:
    """Bytes per element of a safetensors dtype string."""
    return _entry(st)[0]


def round_up_to(x: torch.Tensor, st: str) -> torch.Tensor:
    """Positive ``x`` rounded up to dtype ``st``: the smallest value of that dtype ``>= x``, as a
    tensor of that dtype (``inf`` where ``x`` lies beyond its range). A cast that lands below
    ``x`` (to nearest, or through float32 first, as float64 → float16 goes) moves up one step."""
    y = x.to(torch_dtype(st))
    low = y.to(x.dtype) < x
    return torch.where(low, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def divide(x: torch.Tensor, d: float) -> torch.Tensor:
    """``x / d``, correctly rounded on every device. PyTorch's CUDA kernel turns a division by a
    CPU scalar into a multiplication by its reciprocal, which can land one ulp off
    (``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``, ``div_true_kernel_cuda``: "compute a
    * reciprocal(b)"); a divisor tensor on ``x``'s device takes the true division there. On the
    CPU both are the same IEEE division."""
    return x / torch.full((), d, dtype=x.dtype, device=x.device)
