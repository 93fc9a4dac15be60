"""Fused C++ row kernels of the conversion's hot path, bit-identical to the torch code they replace.

* :func:`fp8_dequant_rows`: block-FP8 rows → BF16 (``fp8_block.dequantize_rows``), the NaN-code
  check (``fp8_block.check_codes``) in the same pass, no float32 temporaries;
* :func:`fp8_absmax_array`: ``max |W|`` of a block-FP8 weight as those rows would give it
  (``fp8_block.absmax_dequantized``: a column max of the codes per block row, then one
  dequantized value per column), NaN codes refused;
* :func:`w8a8_rows`: W8A8 per-row int8 (``w8a8_npu_rows.weight_tensors``);
* :func:`int4_rows`: CPU INT4 per-row codes and scales, optionally of two row blocks interleaved
  (``int4_cpu_rows.quantize_rows`` without clip search; gate/up rows of ``quantize_expert``).

They live in the library of :mod:`._quant_native` (``_rows_native.cpp`` is compiled after
``_quant_native.cpp``, sharing its helpers and its run-time choice of instruction path), so the
same rules hold: IEEE float32, no ``-ffast-math``, no FMA contraction; built on first use,
``HETQUANT_QUANT_BACKEND=torch`` or a missing compiler leaves the torch path. Each wrapper
returns ``None`` where the kernel does not apply (no library, another dtype or device, a
non-contiguous tensor) or the input is bad (NaN codes, NaN/Inf values): the caller then runs
the torch code, which gives the result or raises the format's own error. The kernels take numpy
arrays (``*_array``: what the native conversion lane calls, without torch); the functions of
the torch code's callers are thin adapters over them (zero-copy views of CPU tensors).
Single-threaded: a conversion runs one kernel per worker process (``convert/engine/execute.py``).

Precision notes, checked against the torch code (tests/formats/test_rows_native.py):
``f32(code)`` is exact (E4M3 bits moved into a float32 and multiplied by 2^120, as
``fp8_block.e4m3_to_f32``), the product with the scale rounds once (RNE, subnormals kept), the
BF16 cast is c10's ``round_to_nearest_even``; W8A8 and INT4 divide by the row scale (true float32
division, as torch divides by a broadcast column) and round half to even.
"""

from __future__ import annotations

import numpy as np

from ._lazy import torch
from ._quant_native import QUANT_LIBRARY, float_kind, host_array

__all__ = [
    "fp8_absmax_array",
    "fp8_dequant_rows",
    "fp8_dequant_rows_array",
    "int4_rows",
    "int4_rows_array",
    "w8a8_rows",
    "w8a8_rows_array",
]


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _lent_or_new(lent: np.ndarray | None, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """``lent`` where a kernel may write its result there (that shape and dtype, C-contiguous,
    writable: the conversion lends the output's mapped pages), else a new array."""
    fits = lent is not None and lent.dtype == dtype and lent.flags.c_contiguous and lent.flags.writeable  # fmt: skip
    return lent if fits and lent.shape == shape else np.empty(shape, dtype=dtype)  # type: ignore[union-attr, return-value]


# The kernels on numpy arrays (BF16 as its bits, ``uint16``: ``dtypes.numpy_dtype``); the
# conversion's native lane (``convert/engine/native_jobs.py``) calls these, without torch.


def fp8_dequant_rows_array(
    codes: np.ndarray, scale_row: np.ndarray, block: int, isa: int = 0,
    out: np.ndarray | None = None,
) -> np.ndarray | None:  # fmt: skip
    """BF16 bits (``uint16`` [r, in]) of E4M3 codes ``codes`` (``uint8`` [r, in]) lying in one
    block row whose scales are ``scale_row`` (F32 [ceil(in / block)]), written into ``out``
    where it is such an array (C-contiguous, writable), else into a new one; None where the kernel
    does not apply or a code is NaN (the caller's torch path then raises; ``out`` then holds
    partial rows)."""
    if (
        codes.dtype != np.uint8
        or codes.ndim != 2
        or not codes.flags.c_contiguous
        or scale_row.dtype != np.float32
        or scale_row.size != -(-codes.shape[1] // block)
    ):
        return None
    lib = QUANT_LIBRARY.get().lib
    if lib is None:
        return None
    s = np.ascontiguousarray(scale_row)
    out = _lent_or_new(out, codes.shape, np.uint16)
    rc = lib.hq_fp8_dequant_rows(
        _ptr(codes), codes.shape[0], codes.shape[1], _ptr(s), block, _ptr(out), isa
    )
    return None if rc else out


def fp8_absmax_array(codes: np.ndarray, scale: np.ndarray, block: int) -> float | None:
    """``fp8_block.absmax_dequantized`` of E4M3 codes ``codes`` (``uint8`` [R, C]) with block
    scales ``scale`` (F32 [ceil(R / block), >= ceil(C / block)], already checked), reading
    only the blocks whose bound ``|bf16(448 · scale)|`` lies above the largest value found
    (largest bound first: exact; one or a few blocks of a checkpoint whose scales are each
    block's absmax / 448). None where it does not apply or a block it reads holds a NaN code
    (the torch path then raises); a NaN code in a block it skips is left to the dequantizing
    pass every caller makes next (``fp8_dequant_rows_array`` refuses it)."""
    if (
        codes.dtype != np.uint8
        or codes.ndim != 2
        or not codes.flags.c_contiguous
        or scale.dtype != np.float32
        or scale.ndim != 2
        or scale.shape[0] < -(-codes.shape[0] // block)
    ):
        return None
    lib = QUANT_LIBRARY.get().lib
    if lib is None:
        return None
    s = np.ascontiguousarray(scale)
    out = np.zeros(1, dtype=np.float32)
    rc = lib.hq_fp8_absmax(
        _ptr(codes), codes.shape[0], codes.shape[1], _ptr(s), s.shape[1], block, _ptr(out)
    )
    return None if rc else float(out[0])


def w8a8_rows_array(
    w: np.ndarray, isa: int = 0, q: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(q I8 [n, k], scale F32 [n, 1])`` of float rows ``w`` [n, k] (BF16 bits or F32; shape
    already checked), the codes written into ``q`` where it is such an array (C-contiguous,
    writable), else into a new one; None where the kernel does not apply or ``w`` holds NaN/Inf (``q``
    then holds partial rows)."""
    kind = float_kind(w)
    lib = None if kind is None or w.ndim != 2 else QUANT_LIBRARY.get().lib
    if lib is None:
        return None
    n, k = w.shape
    q = _lent_or_new(q, (n, k), np.int8)
    scale = np.empty((n, 1), dtype=np.float32)
    rc = lib.hq_w8a8_rows(_ptr(w), kind, n, k, _ptr(q), _ptr(scale), isa)
    return None if rc else (q, scale)


def int4_rows_array(
    a: np.ndarray, b: np.ndarray | None = None, isa: int = 0, packed: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(packed U8 [R, K/2], scale F32 [R])`` of float rows ``a`` [R, K] (BF16 bits or F32,
    K even), or with ``b`` (same shape and dtype) of ``a`` and ``b`` rows interleaved (``2R``
    rows: 2i from a, 2i + 1 from b); the codes written into ``packed`` where it is such an array
    (C-contiguous, writable), else into a new one. None where the kernel does not apply or a value is
    NaN/Inf (``packed`` then holds partial rows)."""
    kind = float_kind(a)
    if kind is None or a.ndim != 2 or a.shape[1] % 2:
        return None
    if b is not None and (float_kind(b) is None or b.shape != a.shape or b.dtype != a.dtype):
        return None
    lib = QUANT_LIBRARY.get().lib
    if lib is None:
        return None
    r, k = a.shape
    rows = r if b is None else 2 * r
    packed = _lent_or_new(packed, (rows, k // 2), np.uint8)
    scale = np.empty(rows, dtype=np.float32)
    rc = lib.hq_int4_rows(
        _ptr(a), None if b is None else _ptr(b), kind, r, k, _ptr(packed), _ptr(scale), isa
    )
    return None if rc else (packed, scale)


# Thin torch adapters for the torch code's callers: zero-copy views of CPU tensors, and back.


def fp8_dequant_rows(
    codes: torch.Tensor, scale_row: torch.Tensor, block: int, isa: int = 0
) -> torch.Tensor | None:
    """:func:`fp8_dequant_rows_array` of tensors (E4M3 or its bits) → BF16 [r, in]."""
    if codes.dtype not in (torch.float8_e4m3fn, torch.uint8) or scale_row.dtype != torch.float32:
        return None
    c, s = host_array(codes), host_array(scale_row)
    out = None if c is None or s is None else fp8_dequant_rows_array(c, s, block, isa)
    return None if out is None else torch.from_numpy(out).view(torch.bfloat16)


def w8a8_rows(w: torch.Tensor, isa: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`w8a8_rows_array` of a tensor."""
    a = host_array(w)
    out = None if a is None else w8a8_rows_array(a, isa)
    return None if out is None else (torch.from_numpy(out[0]), torch.from_numpy(out[1]))


def int4_rows(
    a: torch.Tensor, b: torch.Tensor | None = None, isa: int = 0
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`int4_rows_array` of tensors."""
    x = host_array(a)
    y = None if b is None else host_array(b)
    if x is None or (b is not None and y is None):
        return None
    out = int4_rows_array(x, y, isa)
    return None if out is None else (torch.from_numpy(out[0]), torch.from_numpy(out[1]))
