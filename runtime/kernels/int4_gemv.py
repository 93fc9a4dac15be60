"""INT4 GEMV for the CPU expert pool: ``y[t, n] = s[n] · Σ_k (c[n, k] − 8) · x[t, k]``.

The weight is one ``int4_cpu`` matrix as stored (``formats/int4_cpu.py``): ``packed`` U8 [N, K/2]
(element ``2j`` of a row in the low nibble of byte ``j``, ``2j+1`` in the high nibble; rows may be
strided, as in a ``subpool_slice`` of ``down_packed``, but each row's bytes are contiguous) and
``scale`` F32 [N]. ``x`` is [T, K] or [K] (float32 / bfloat16 / float16); the result is float32
[T, N] (or [N]).

Backends (``backend=``):

``"native"`` — a C++ kernel (``int4_gemv.cpp`` beside this module) compiled with the system C++
compiler on first use into ``$HETQUANT_CACHE_DIR`` (default ``~/.cache/hetquant``), loaded with
ctypes (which releases the GIL during the call). It works on integers, so every instruction path
gives bit-identical results:

1. Per token, ``x`` is rounded to fixed point: ``X_k = round(x_k / 2^e)`` with
   ``e = E − 22`` where ``amax(|x|) < 2^E`` (so ``|X| < 2^22``; rounding error
   ``≤ 2^(e−1) ≤ amax · 2^-22`` per element, i.e. float32-grade: a float32 ulp at ``amax``
   is ``2^-23 · amax`` or more). ``X`` is split into three balanced signed bytes
   ``X = d0 + 256·d1 + 65536·d2`` (``d ∈ [−128, 127]``), stored deinterleaved (even ``k``
   beside the low nibbles, odd ``k`` beside the high nibbles). ``precision="fast"`` uses
   ``e = E − 14`` and two digits (error ``≤ amax · 2^-14``) for a third fewer dot-products.
2. ``acc = Σ_k c[n, k] · X_k`` is computed exactly in int32 lanes: AVX-512 VNNI
   ``vpdpbusd`` (u8 code × s8 digit, no unpacking beyond ``& 0xF`` / ``>> 4``: 3 integer ops
   and 6 dot-products per 64 weight bytes); AVX2 ``vpmaddubsw`` + ``vpmaddwd``; or plain C++
   (auto-vectorised; the path for Arm/Kunpeng hosts, where a NEON ``sdot`` kernel would be the
   next step — not written, as no Arm machine is here to test it). Rows go in tiles of 4 (one
   token) and each tile prefetches the rows ≥ 12 KB ahead into L2: without it the kernel
   waited on DRAM at under half the read bandwidth; into L1 the prefetch evicts the 21 KB of
   digits.
3. ``y = float(s[n] · 2^e · (acc − 8 · Σ_k X_k))`` in float64, rounded once to float32.

So ``|y − y_exact| ≤ s[n] · Σ_k |c − 8| · amax(|x|) · 2^-22 + 2^-24 · |y|`` (``y_exact`` = the
real-number result for the given ``x``; ``2^-14`` for ``"fast"``), tighter than a float32 dot
product of length K. Limits:
``K ≤ 2^20`` (int32 lanes cannot overflow below that) and finite ``x`` (NaN/Inf activations go
to the torch path, which propagates them as float math does).

``"torch"`` — the pure-torch reference path, always available: unpack nibbles, subtract 8,
convert to float32 and matmul (``y = s · ((c_even − 8) @ x_even + (c_odd − 8) @ x_odd)``), in
blocks of rows so the float copy stays small. Float32 rounding: ``|y − y_exact| ≲ γ_{K/2+1} ·
s · Σ|c − 8||x|`` with ``γ_m = m·u/(1 − m·u)``, ``u = 2^-24``.

``"auto"`` (default) — native when it is built and ``T ≤ MAX_NATIVE_TOKENS`` and ``x`` is finite,
else torch. The native kernel streams the weight once per call and does ``2·L·T`` dot-products
per 64 weight bytes (``L`` = 3 digit planes), so it is memory-bound at batch 1 and compute-bound
from a few tokens on; the torch path pays a fixed unpack of the whole matrix to float32, so it
only wins for long prefill. Measured on [4096, 7168] (2 threads, loaded 2-vCPU VM): native
41 / 162 / 383 / 820 ms at T = 16 / 64 / 128 / 256 against torch 657 / 535 / 745 / 1284 ms, hence
``MAX_NATIVE_TOKENS = 256``.

Build (``formats/_native.py``, shared with the quantize kernels): ``g++ -O3 -std=c++17 -shared
-fPIC`` (no ``-march``: each instruction path carries its own ``target`` attribute and is chosen
at run time with ``__builtin_cpu_supports``), 1.6–5 s once per source version on the 2-vCPU
development VM; the shared object is written to a temporary name and renamed, so concurrent first
uses are safe. If there is no compiler or the build fails, ``"auto"`` falls back
to torch with one warning, ``"native"`` raises ``HetquantError``. ``HETQUANT_INT4_BACKEND=torch``
disables the native kernel; ``HETQUANT_INT4_ISA=generic|avx2|avx512_vnni`` caps the
instruction path (tests use it). :func:`native_info` reports what was built and how long it took.

Why not torch's own ``aten._weight_int4pack_mm_for_cpu``: it does map our scheme (codes ``c``,
``(c − 8)·scale + zero`` with ``zero = 0``, per-channel as the scale repeated per group, groups of
32…256 only), but needs a repack to its 64-row tiled layout at load (no zero-copy mmap), keeps
scales in the activation dtype (bf16: the F32 scales would be rounded), and ran at about half
this kernel's rate at batch 1 on bf16 activations and at 0.1 GB/s on float32
(benchmarks/README.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any

import torch

from hetquant.formats import HetquantError
from hetquant.formats._native import NativeBuild, NativeLibrary

__all__ = [
    "BACKENDS",
    "MAX_K",
    "MAX_NATIVE_TOKENS",
    "PRECISIONS",
    "int4_gemv",
    "int4_gemv_torch",
    "native_available",
    "native_info",
]

log = logging.getLogger("hetquant.runtime")

BACKENDS = ("auto", "native", "torch")
PRECISIONS = {"high": 3, "fast": 2}  # native kernel: signed-byte digits per activation
MAX_NATIVE_TOKENS = 256  # "auto" uses the native kernel up to this many tokens per call
MAX_K = 1 << 20  # native kernel: int32 lanes cannot overflow for K ≤ 2^20
_TORCH_BLOCK_ELEMS = 1 << 22  # torch path: rows per block so that a float block is ~16 MB
_MIN_ELEMS_PER_THREAD = 1 << 19  # native: split a call over threads only above this many weights

_ISA_NAMES = {1: "generic", 2: "avx2", 3: "avx512_vnni"}
_ISA_CODES = {v: k for k, v in _ISA_NAMES.items()}

_CPP_SOURCE = (Path(__file__).parent / "int4_gemv.cpp").read_text(
    encoding="utf-8"
)  # the C++ source


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.hq_int4_gemv
    fn.restype = ctypes.c_int
    i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [vp, i64, vp, i64, i64, vp, i64, i64, vp, i64, ci, ci, ci]
    lib.hq_int4_best_isa.restype = ctypes.c_int
    lib.hq_int4_best_isa.argtypes = []


_LIBRARY = NativeLibrary(
    "int4_gemv",
    _CPP_SOURCE,
    _bind,
    libs=("-lpthread",),
    disable_env="HETQUANT_INT4_BACKEND",
    label="int4 GEMV",
    logger=log,
)


class _Native:
    """The compiled kernel (or why there is none) and the best instruction path of this CPU."""

    def __init__(self, built: NativeBuild) -> None:
        self.lib = built.lib
        self.path, self.compile_s, self.error = built.path, built.compile_s, built.error
        self.best_isa = int(built.lib.hq_int4_best_isa()) if built.lib is not None else 0


_native: _Native | None = None  # tests replace it; None: ask _LIBRARY


def _build() -> _Native:
    """A fresh build attempt (not memoized)."""
    return _Native(_LIBRARY.build())


def _get_native() -> _Native:
    global _native
    if _native is None:
        _native = _Native(_LIBRARY.get())  # one build per process, thread-safe, warns once
    return _native


def native_available() -> bool:
    """Whether the native kernel is (or can be) built and loaded; builds it on first call."""
    return _get_native().lib is not None


def native_info() -> dict[str, Any]:
    """What the native kernel is: ``available``, ``isa`` (best path of this CPU, capped by
    ``HETQUANT_INT4_ISA``), ``path`` of the shared object, ``compile_s`` (None when it came
    from the cache), ``error`` (why it is unavailable)."""
    nat = _get_native()
    isa = _isa_cap(nat.best_isa) if nat.lib is not None else 0
    return {
        "available": nat.lib is not None,
        "isa": _ISA_NAMES.get(isa),
        "path": nat.path,
        "compile_s": nat.compile_s,
        "error": nat.error,
    }


def _isa_cap(best: int) -> int:
    want = os.environ.get("HETQUANT_INT4_ISA", "").strip().lower()
    if not want:
        return best
    if want not in _ISA_CODES:
        raise HetquantError(f"HETQUANT_INT4_ISA={want!r}: expected one of {', '.join(_ISA_CODES)}")
    return min(best, _ISA_CODES[want])


def _check(packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> tuple[int, int]:
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise HetquantError(
            f"int4_gemv: packed must be uint8 [N, K/2], got {packed.dtype} {list(packed.shape)}"
        )
    n, kb = packed.shape
    if scale.shape != (n,):
        raise HetquantError(f"int4_gemv: scale shape {list(scale.shape)}, expected [{n}]")
    if x.ndim not in (1, 2) or x.shape[-1] != 2 * kb:
        raise HetquantError(
            f"int4_gemv: x shape {list(x.shape)}; expected [T, {2 * kb}] or [{2 * kb}]"
        )
    if not x.is_floating_point():
        raise HetquantError(f"int4_gemv: x must be floating point, got {x.dtype}")
    if packed.device.type != "cpu" or x.device.type != "cpu" or scale.device.type != "cpu":
        raise HetquantError("int4_gemv: CPU tensors only")
    return n, kb


def int4_gemv_torch(packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The pure-torch path (module docstring): float32 [T, N] (or [N] for 1-D ``x``)."""
    n, kb = _check(packed, scale, x)
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, 2 * kb).to(torch.float32)
    xe, xo = x2[:, 0::2], x2[:, 1::2]  # [T, K/2]
    s = scale.to(torch.float32)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    step = max(1, _TORCH_BLOCK_ELEMS // max(kb, 1))
    for a in range(0, n, step):
        p = packed[a : a + step]
        lo = (p & 0xF).to(torch.float32).sub_(8.0)  # [rows, K/2]
        hi = (p >> 4).to(torch.float32).sub_(8.0)
        y[:, a : a + step] = (xe @ lo.T + xo @ hi.T) * s[a : a + step]
    return y[0] if squeeze else y


def int4_gemv(
    packed: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    *,
    backend: str = "auto",
    threads: int | None = None,
    precision: str = "high",
) -> torch.Tensor:
    """``y[t, n] = scale[n] · Σ_k (c[n, k] − 8) · x[t, k]`` as float32 [T, N] ([N] for 1-D x).

    ``threads``: threads of the native kernel for this call (default
    ``torch.get_num_threads()``; small calls use one). The calling thread works too; the others
    come from a pool the calling thread keeps between calls (joined when it exits), and rows are
    dealt in chunks, so any thread count gives the same bits. ``precision`` (native kernel):
    ``"high"`` rounds activations to 22-bit fixed point per token, ``"fast"`` to 14-bit (two
    digit planes instead of three). See the module docstring for backends and error bounds.
    """
    if backend not in BACKENDS:
        raise HetquantError(f"int4_gemv: backend {backend!r} not in {BACKENDS}")
    if precision not in PRECISIONS:
        raise HetquantError(f"int4_gemv: precision {precision!r} not in {tuple(PRECISIONS)}")
    n, kb = _check(packed, scale, x)
    if backend == "torch":
        return int4_gemv_torch(packed, scale, x)
    nat = _get_native()
    if nat.lib is None:
        if backend == "native":
            raise HetquantError(f"int4_gemv: native kernel unavailable: {nat.error}")
        return int4_gemv_torch(packed, scale, x)
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, 2 * kb)
    t = x2.shape[0]
    if backend == "auto" and (t > MAX_NATIVE_TOKENS or 2 * kb > MAX_K):
        return int4_gemv_torch(packed, scale, x)
    if 2 * kb > MAX_K:
        raise HetquantError(f"int4_gemv: K = {2 * kb} exceeds the native kernel's {MAX_K}")
    if packed.stride(1) != 1 and n > 0:
        packed = packed.contiguous()
    x32 = x2.to(torch.float32)
    if x32.stride(-1) != 1:
        x32 = x32.contiguous()
    s = scale.to(torch.float32).contiguous()
    y = torch.empty(t, n, dtype=torch.float32)
    if threads is None:
        threads = torch.get_num_threads()
    threads = max(1, min(int(threads), n * kb * 2 // _MIN_ELEMS_PER_THREAD or 1))
    rc = nat.lib.hq_int4_gemv(
        packed.data_ptr(),
        packed.stride(0) if n > 1 else kb,
        s.data_ptr(),
        n,
        2 * kb,
        x32.data_ptr(),
        x32.stride(0) if t > 1 else 2 * kb,
        t,
        y.data_ptr(),
        n,
        threads,
        _isa_cap(nat.best_isa),
        PRECISIONS[precision],
    )
    if rc == -3:  # NaN/Inf activations: float math propagates them
        return int4_gemv_torch(packed, scale, x)
    if rc < 0:
        raise HetquantError(f"int4_gemv: native kernel failed (code {rc}) for N={n}, K={2 * kb}")
    return y[0] if squeeze else y
