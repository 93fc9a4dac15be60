"""The formats' side of the native conversion lane: numpy rows in, numpy stored tensors out.

A conversion whose jobs all have native kernels runs without torch (``convert/engine/native_jobs.py``).
For that a format may offer, beside its torch methods, the same operation on numpy arrays (BF16
and FP8 as their bits, ``dtypes.numpy_dtype``), computed by the kernels of ``_rows_native`` and
``_quant_native`` — the C++ is the one rule; nothing here re-states a quantization in numpy:

* a source format: ``source_row_arrays(name, arrays, shape, into=None)`` → (first row, BF16 bits
  ``uint16`` [r, in]) as its ``source_rows`` gives them, validated; a format that computes its
  rows may compute them straight into ``into(first row, rows)`` where that gives an array
  (:data:`RowsInto`: the conversion's mapped output, when the target stores BF16 rows as they
  come), sparing a copy of every byte;
* a streaming target format: ``quantize_array(rows)`` → stored arrays, as ``quantize(rows)``;
* an expert-layer format: ``quantize_rows_array(a, b=None)`` → (packed, scale) of rows ``a``
  (with ``b``: ``a`` and ``b`` rows interleaved), as ``quantize_rows``.

Each raises :class:`NotNative` where it cannot answer as the torch code would (no compiler, a
dtype the kernel does not take, an option without a kernel) or the input is bad (a NaN code,
NaN/Inf values): the lane then redoes the whole job with the torch code (jobs write fixed byte
ranges, so a redo is safe), which gives the same bytes or raises the format's own error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np

from ._quant_native import absmax_array
from .base import float_row_step

__all__ = ["NotNative", "RowsInto", "float_row_arrays", "native", "require_finite"]

T = TypeVar("T")

RowsInto = Callable[[int, int], "np.ndarray | None"]
"""``into(r, n)``: where rows ``r .. r + n`` of a source weight are to be computed — a
C-contiguous ``uint16`` [n, in] array (BF16 bits) to write into, or None (allocate)."""


class NotNative(Exception):
    """The native path cannot take this input; the torch code must (module docstring)."""


def native(result: T | None, what: str | Callable[[], str]) -> T:
    """A kernel wrapper's ``result``; :class:`NotNative` where it declined (None), saying
    ``what`` (or what it returns: a message naming a dtype is built only then — numpy's
    ``str(dtype)`` is Python code, measurable once per block row)."""
    if result is None:
        raise NotNative(what if isinstance(what, str) else what())
    return result


def require_finite(name: str, a: np.ndarray) -> None:
    """:class:`NotNative` unless ``a`` (float: BF16 bits or F32) is known to hold no NaN/Inf;
    the torch code's ``check_finite`` then counts and reports what it holds."""
    amax = native(absmax_array(a), lambda: f"{name}: no absmax kernel for {a.dtype}")
    if not np.isfinite(amax):
        raise NotNative(f"{name}: NaN/Inf")


def float_row_arrays(name: str, w: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``base.float_rows`` of a numpy float weight [out, in] (BF16 bits or F32), as stored,
    checked, in the same chunks."""
    out, inp = w.shape
    step = float_row_step(inp, w.itemsize)
    for r in range(0, out, step):
        require_finite(name, w[r : r + step])
        yield r, w[r : r + step]
