"""FP4 GEMV for the CPU expert pool: DeepSeek-V4's experts as the hybrid keeps them
(``formats/fp4_cpu.py``: E2M1 codes, UE8M0 scale per 32 inputs).

The computation (:func:`hetquant.formats.fp4_cpu.fp4_gemv_int8` is its torch reference): per
token, activations rounded to int8 (``sx = amax / 127`` in float32, ``q = round(x / sx)`` half to
even); per 32-group an exact integer ``A_g = Σ E2M1_X2[c] · q`` (``E2M1_X2`` = 2·E2M1 ∈ {0, ±1,
…, ±12}: |A_g| ≤ 32 · 12 · 127 < 2^16); ``2^(e_g − 128) · A_g`` (exact in float64) added to
partial ``p[g mod 8]`` in increasing ``g``; ``((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7))``
times ``sx`` in float64, rounded once to float32, a zero stored as +0. Only the float64 additions
round, and every path does them in this order, so every path gives the reference's bits.

Backends (``backend=``): ``"native"`` — the FP4 part of the int4 kernel's C++ library
(``fp4_gemv_base.cpp``, ``fp4_gemv_simd.cpp``, ``fp4_gemv.cpp``, compiled with the int4 parts
into one shared object: the same build, run-time path choice, worker pool and
``HETQUANT_INT4_ISA`` cap; see ``int4_gemv.py``). A byte's two codes are decoded by a 16-entry
table held in a register and fed to the int8 dot products of the int4 kernel: AVX-512 VNNI
``vpdpbusd`` and AVX2 ``vpmaddubsw`` take ``E2M1_X2[c] + 12`` (unsigned, ``vpshufb``) and subtract
``12 · Σ_g q`` (precomputed per token and group); aarch64 ``sdot`` takes ``E2M1_X2[c]`` signed
(``vqtbl1q_s8``); ``generic`` C++ everywhere. The x86 paths load 256 / 128-byte superblocks of
codes transposed by 4-byte words (``transpose_vnni`` / ``transpose_avx2``) so that each int32
lane adds one whole group. Threads split rows (each row by one thread: any thread count gives
the same bits); from 16 tokens on, rows and tokens go in cache-sized blocks (the same bits).
``"torch"`` — the reference. ``"auto"`` (default) — native when built, else torch.

The native kernel hands a call to the torch reference when ``x`` has NaN/Inf (the reference's
float math propagates them) or when ``amax / 127`` is subnormal (an activation could then round
beyond ±127: only for ``amax < 127 · 2^-126``); a NaN scale (0xFF) is refused by both.
"""

from __future__ import annotations

from typing import Any

import torch

from hetquant.formats import HetquantError
from hetquant.formats.fp4_cpu import fp4_gemv_int8
from hetquant.formats.fp4_e2m1 import GROUP, check_ue8m0

from . import int4_gemv as _int4
from .registry import ExpertKernels, register_expert_kernels

__all__ = ["BACKENDS", "fp4_gemv"]

BACKENDS = ("auto", "native", "torch")
_MIN_ELEMS_PER_THREAD = 1 << 19  # split a call over threads only above this many weights
_FALLBACK = (-3, -4)  # NaN/Inf activations, subnormal amax / 127: the reference takes the call


def _check(packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> tuple[int, int]:
    """(N, K) after checking dtypes, shapes and devices."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise HetquantError(
            f"fp4_gemv: codes must be uint8 [N, K/2], got {packed.dtype} {list(packed.shape)}"
        )
    n, k = packed.shape[0], 2 * packed.shape[1]
    if scale.dtype != torch.float8_e8m0fnu or tuple(scale.shape) != (n, k // GROUP) or k % GROUP:
        raise HetquantError(
            f"fp4_gemv: scale {scale.dtype} {list(scale.shape)} for codes [{n}, K={k}]; expected "
            f"float8_e8m0fnu [{n}, K/{GROUP}] with K a multiple of {GROUP}"
        )
    if x.ndim not in (1, 2) or x.shape[-1] != k or not x.is_floating_point():
        raise HetquantError(f"fp4_gemv: x {x.dtype} {list(x.shape)}; expected float [T, {k}]")
    if {packed.device.type, scale.device.type, x.device.type} != {"cpu"}:
        raise HetquantError("fp4_gemv: CPU tensors only")
    return n, k


def _reference(packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = fp4_gemv_int8(packed, scale, x.reshape(-1, x.shape[-1]))
    return y[0] if x.ndim == 1 else y


def fp4_gemv(
    packed: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    *,
    backend: str = "auto",
    threads: int | None = None,
    **_: Any,
) -> torch.Tensor:
    """``x · Wᵀ`` float32 [T, N] ([N] for 1-D ``x``) for codes U8 [N, K/2] and UE8M0 scales
    [N, K/32] (rows of either may be strided, each row contiguous); module docstring.
    ``threads``: the native kernel's threads (default ``torch.get_num_threads()``; small calls
    use one). The int4 kernel's other options (precision, token_block) do not apply."""
    if backend not in BACKENDS:
        raise HetquantError(f"fp4_gemv: backend {backend!r} not in {BACKENDS}")
    n, k = _check(packed, scale, x)
    if backend == "torch":
        return _reference(packed, scale, x)
    nat = _int4._get_native()
    if nat.lib is None:
        if backend == "native":
            raise HetquantError(f"fp4_gemv: native kernel unavailable: {nat.error}")
        return _reference(packed, scale, x)
    x2 = x.reshape(-1, k).to(torch.float32)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if packed.stride(1) != 1:
        packed = packed.contiguous()
    if scale.stride(1) != 1:
        scale = scale.contiguous()
    t = x2.shape[0]
    y = torch.empty(t, n, dtype=torch.float32)
    threads = torch.get_num_threads() if threads is None else int(threads)
    threads = max(1, min(threads, n * k // _MIN_ELEMS_PER_THREAD or 1))
    rc = nat.lib.hq_fp4_gemv(
        packed.data_ptr(), packed.stride(0) if n > 1 else k // 2,
        scale.data_ptr(), scale.stride(0) if n > 1 else k // GROUP,
        n, k, x2.data_ptr(), x2.stride(0) if t > 1 else k, t, y.data_ptr(), n,
        threads, _int4._isa_cap(nat.best_isa),
    )  # fmt: skip
    if rc in _FALLBACK:
        return _reference(packed, scale, x)
    if rc == -5:
        check_ue8m0("fp4_gemv: scale", scale)  # raises, naming the count
    if rc < 0:
        raise HetquantError(f"fp4_gemv: native kernel failed (code {rc}) for N={n}, K={k}")
    return y[0] if x.ndim == 1 else y


register_expert_kernels("fp4_e2m1", ExpertKernels(gemv=fp4_gemv))  # fp4_cpu_experts
