"""Fused C++ row kernels of the conversion's hot path, bit-identical to the torch code they replace.

* :func:`fp8_dequant_rows`: block-FP8 rows → BF16 (``fp8_block.dequantize_rows``), the NaN-code
  check (``fp8_block.check_codes``) in the same pass, no float32 temporaries;
* :func:`w8a8_rows`: W8A8 per-row int8 (``w8a8_npu._weight_tensors``);
* :func:`int4_rows`: CPU INT4 per-row codes and scales, optionally of two row blocks interleaved
  (``int4_cpu._quantize_rows`` without clip search; gate/up rows of ``quantize_expert``).

They live in the library of :mod:`._quant_native` (``_rows_native.cpp`` is compiled after
``_quant_native.cpp``, sharing its helpers and its run-time choice of instruction path), so the
same rules hold: IEEE float32, no ``-ffast-math``, no FMA contraction; built on first use,
``HETQUANT_QUANT_BACKEND=torch`` or a missing compiler leaves the torch path. Each wrapper
returns ``None`` where the kernel does not apply (no library, another dtype or device, a
non-contiguous tensor) or the input is bad (NaN codes, NaN/Inf values): the caller then runs
the torch code, which gives the result or raises the format's own error. Single-threaded: a
conversion runs one kernel per worker process (``convert/execute.py``).

Precision notes, checked against the torch code (tests/formats/test_rows_native.py):
``f32(code)`` is exact (E4M3 bits moved into a float32 and multiplied by 2^120, as
``fp8_block.e4m3_to_f32``), the product with the scale rounds once (RNE, subnormals kept), the
BF16 cast is c10's ``round_to_nearest_even``; W8A8 and INT4 divide by the row scale (true float32
division, as torch divides by a broadcast column) and round half to even.
"""

from __future__ import annotations

from ._lazy import torch
from ._quant_native import QUANT_LIBRARY, _lib_for

__all__ = ["fp8_dequant_rows", "int4_rows", "w8a8_rows"]


def fp8_dequant_rows(
    codes: torch.Tensor, scale_row: torch.Tensor, block: int, isa: int = 0
) -> torch.Tensor | None:
    """BF16 [r, in] of E4M3 rows ``codes`` [r, in] lying in one block row whose scales are
    ``scale_row`` [ceil(in / block)] (F32); None where the kernel does not apply or a code is
    NaN (the caller's torch path then raises)."""
    if (
        codes.device.type != "cpu"
        or codes.dtype not in (torch.float8_e4m3fn, torch.uint8)
        or codes.ndim != 2
        or not codes.is_contiguous()
        or scale_row.dtype != torch.float32
        or scale_row.device.type != "cpu"
        or scale_row.numel() != -(-codes.shape[1] // block)
    ):
        return None
    lib = QUANT_LIBRARY.get().lib
    if lib is None:
        return None
    s = scale_row.contiguous()
    out = torch.empty(codes.shape, dtype=torch.bfloat16)
    rc = lib.hq_fp8_dequant_rows(
        codes.data_ptr(), codes.shape[0], codes.shape[1], s.data_ptr(), block, out.data_ptr(), isa
    )
    return None if rc else out


def w8a8_rows(w: torch.Tensor, isa: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q I8 [n, k], scale F32 [n, 1])`` of float rows ``w`` [n, k] (shape already checked);
    None where the kernel does not apply or ``w`` holds NaN/Inf."""
    lib = _lib_for(w)
    if lib is None or w.ndim != 2:
        return None
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.int8)
    scale = torch.empty((n, 1), dtype=torch.float32)
    rc = lib.hq_w8a8_rows(
        w.data_ptr(), w.dtype == torch.bfloat16, n, k, q.data_ptr(), scale.data_ptr(), isa
    )
    return None if rc else (q, scale)


def int4_rows(
    a: torch.Tensor, b: torch.Tensor | None = None, isa: int = 0
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(packed U8 [R, K/2], scale F32 [R])`` of float rows ``a`` [R, K] (K even), or with
    ``b`` (same shape and dtype) of ``a`` and ``b`` rows interleaved (``2R`` rows: 2i from a,
    2i + 1 from b). None where the kernel does not apply or a value is NaN/Inf."""
    lib = _lib_for(a)
    if lib is None or a.ndim != 2 or a.shape[1] % 2:
        return None
    if b is not None and (_lib_for(b) is None or b.shape != a.shape or b.dtype != a.dtype):
        return None
    r, k = a.shape
    rows = r if b is None else 2 * r
    packed = torch.empty((rows, k // 2), dtype=torch.uint8)
    scale = torch.empty(rows, dtype=torch.float32)
    rc = lib.hq_int4_rows(
        a.data_ptr(), None if b is None else b.data_ptr(), a.dtype == torch.bfloat16, r, k,
        packed.data_ptr(), scale.data_ptr(), isa,
    )  # fmt: skip
    return None if rc else (packed, scale)
