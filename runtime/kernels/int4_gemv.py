"""INT4 GEMV for the CPU expert pool, per-channel or grouped scales.

The weight is one matrix as stored: ``packed`` U8 [N, K/2] (element ``2j`` of a row in the low
nibble of byte ``j``, ``2j+1`` in the high nibble; rows may be strided, as in a ``subpool_slice``
of ``down_packed``, but each row's bytes are contiguous) and either

- ``int4_cpu`` (``formats/int4_cpu.py``): ``scale`` F32 [N],
  ``y[t, n] = s[n] · Σ_k (c[n, k] − 8) · x[t, k]``; or
- ``int4_cpu_group`` (``formats/int4_cpu_group.py``): ``scale`` BF16 [N, K/g], g = 32, 64 or
  128 (the group size is ``K / scale.shape[1]``),
  ``y[t, n] = Σ_j s[n, j] · Σ_{k in group j} (c[n, k] − 8) · x[t, k]``.

``x`` is [T, K] or [K] (float32 / bfloat16 / float16); the result is float32 [T, N] (or [N]).

Backends (``backend=``):

``"native"`` — a C++ kernel (``int4_gemv_base.cpp``, ``_x86.cpp``, ``_neon.cpp`` and
``int4_gemv.cpp`` beside this module, one translation unit) compiled with the system C++
compiler on first use into ``$HETQUANT_CACHE_DIR`` (default ``~/.cache/hetquant``), loaded with
ctypes (which releases the GIL during the call). It works on integers, and every instruction path
computes the same integers and the same float epilogue, in the same order, so all paths give
bit-identical results:

1. Per token, ``x`` is rounded to fixed point: ``X_k = round(x_k / 2^e)`` with
   ``e = E − 22`` where ``amax(|x|) < 2^E`` (so ``|X| ≤ 2^22``; rounding error
   ``≤ 2^(e−1) ≤ amax · 2^-22`` per element, i.e. float32-grade: a float32 ulp at ``amax``
   is ``2^-23 · amax`` or more). ``X`` is split into three balanced signed bytes
   ``X = d0 + 256·d1 + 65536·d2`` (``d ∈ [−128, 127]``), stored deinterleaved (even ``k``
   beside the low nibbles, odd ``k`` beside the high nibbles). ``precision="fast"`` uses
   ``e = E − 14`` and two digits (error ``≤ amax · 2^-14``) for a third fewer dot-products.
2. Integer dot products of the codes ``c`` (``b & 0xF``, ``b >> 4``: unsigned, 0..15) with the
   digits, exact in int32 lanes: AMX-INT8 ``tdpbusd`` (per-channel, 16 rows × 16 token-planes
   per tile); AVX-512 VNNI ``vpdpbusd``; AVX2 ``vpmaddubsw`` + ``vpmaddwd``; aarch64 ``sdot``
   (ARMv8.2 dot product; the codes are valid signed bytes); or plain C++.
   Per-channel: ``acc = Σ_k c·X`` over the row (``K ≤ 2^20`` keeps every lane below 2^31).
   Grouped: per block of 32 elements, ``A_b = Σ_{k in b} (c − 8)·X_k`` (``|Σ c·X| ≤ 480·2^22 <
   2^31``), the digit planes combined by Horner (``acc = (acc << 8) + plane``) in the lanes.
3. Per-channel: ``y = float(s[n] · 2^e · (acc − 8 · Σ_k X_k))`` in float64, rounded once to
   float32. Grouped: ``s_b · A_b`` is exact in float64 (8 + 31 significant bits) and is added
   to partial sum ``p[b mod 8]`` in increasing ``b``; then ``v = ((p0 + p4) + (p2 + p6)) +
   ((p1 + p5) + (p3 + p7))``, ``y = float(2^e · v)`` (a zero stored as +0). Each path keeps
   the 8 partials in its own registers (one zmm, two ymm, four NEON float64x2 or an array) and
   hands them to the same epilogue.

Error against ``y_exact`` (the real-number result for the given ``x``; ``W = s · (c − 8)``)::

    per-channel: |y − y_exact| ≤ Σ_k |W_k| · amax(|x|) · 2^-22 + 2^-24 · |y|
    grouped:     the same, + (nb/8 + 3) · 2^-53 · Σ_k |W_k| · (|x_k| + amax · 2^-22)

(``nb = K / 32`` blocks: the float64 additions of the partials; ``2^-14`` instead of ``2^-22``
for ``"fast"``), tighter than a float32 dot product of length K. Limits: ``K ≤ 2^20`` and finite
``x`` (NaN/Inf activations go to the torch path, which propagates them as float math does).

Instruction paths, chosen at run time from the CPU's features (no ``-march`` flag: each path
carries its own ``target`` attribute): x86-64 ``amx_int8`` > ``avx512_vnni`` > ``avx2`` >
``generic`` (``__builtin_cpu_supports``; AMX from CPUID and the kernel's permission for the
tile data, ``arch_prctl(ARCH_REQ_XCOMP_PERM)``); aarch64 ``neon_dotprod`` > ``generic``
(``getauxval(AT_HWCAP) & HWCAP_ASIMDDP`` on Linux; elsewhere only when the compiler targets
dotprod). The aarch64 path is tested bit for bit against the x86 results under qemu user mode
(``tests/runtime/kernels/test_int4_gemv_crossisa.py``, which also runs the AVX2, AVX-512 and
AMX paths on SIMDe's portable intrinsics and an emulation of the tile instructions); it has not
run on Arm hardware. The grouped AVX-512 path was developed on an AVX2-only CPU, checked there on
SIMDe and measured on a Xeon with AVX-512 VNNI; the test suite runs it natively on such a CPU.
The grouped AVX2 and AVX-512 kernels load each superblock of weights (128 / 256 bytes) transposed
by 4-byte words, so that their SIMD lanes add whole 32-element blocks and need no horizontal
reduction; they read the digits in the same transposed order, which ``prepare``
(``int4_gemv.cpp``) lays out per path (``Transposed``, ``int4_gemv_base.cpp``) — the integers,
and so the bits, are the same. The AMX path (``int4_gemv_amx.cpp``; per-channel; grouped calls
run the AVX-512 VNNI path) treats the digit planes of a token as more columns of a ``tdpbusd``
tile: each 64-byte chunk of 16 rows is unpacked once (into L1) and multiplied with every token
and digit plane of the call (up to 80 token-planes per sweep of the rows); it runs from
``AMX_MIN_TOKENS`` = 2 tokens on (one token stays on the VNNI tiles, faster there). It is built
with GCC ≥ 11 or clang ≥ 12 only; it was developed on an AVX2 CPU against an emulation of the
tile instructions (the SIMDe test) and run natively, tests included, on a Xeon with AMX (the
H100 host of benchmarks/README.md). Rows go in tiles (4 rows per-channel; grouped: 1 on AVX2, 2
on AVX-512 and NEON; at one token; AMX: blocks of 16) and each tile prefetches the rows ≥ 12 KB
ahead
into L2: without it the kernel waited on DRAM at under half the read bandwidth; into L1 the
prefetch evicts the 21 KB of digits. From ``GEMM_MIN_TOKENS`` = 16 tokens on the calls run in a
GEMM-shaped order: rows in blocks of ~128 KB of weights, and within each row block the tokens in
blocks whose digit planes take ~160 KB, so both stay in L2 while a block is swept (one row tile
at a time against one token pair at a time, as before); the digits, 21 KB per token at K = 7168,
then come from L3 once per row block instead of once per row. Every (row, token) is computed by
the same tile code in either order, so the bits do not change (``token_block=`` selects it,
for tests and benchmarks).

``"torch"`` — the pure-torch reference path, always available: unpack nibbles, subtract 8,
convert to float32 (times the group scales, exact) and matmul, in blocks of rows so the float
copy stays small. Float32 rounding: ``|y − y_exact| ≲ γ_m · Σ|W||x|`` with ``γ_m =
m·u/(1 − m·u)``, ``u = 2^-24``, ``m = K/2 + 1`` per-channel, ``K`` grouped.

``"auto"`` (default) — native when it is built and ``T ≤ MAX_NATIVE_TOKENS`` and ``x`` is finite,
else torch. The native kernel streams the weight once per call and does ``2·L·T`` dot-products
per 64 weight bytes (``L`` = 3 digit planes), so it is memory-bound at batch 1 and compute-bound
from a few tokens on; the torch path pays a fixed unpack of the whole matrix to float32, so it
only wins for long prefill; ``MAX_NATIVE_TOKENS = 256`` is where the two meet on a
[4096, 7168] weight (the measurement: ``benchmarks/bench_expert_gemv.py``, benchmarks/README.md).

Build (``formats/native.py``, shared with the quantize kernels): ``g++ -O3 -std=c++17 -shared
-fPIC``, once per source version (its time: :func:`native_info`); the shared object is written
to a temporary name and renamed, so concurrent first uses are safe. If there is no compiler or
the build fails, ``"auto"`` falls back to torch with one warning, ``"native"`` raises
``HetquantError``. ``HETQUANT_INT4_BACKEND=torch`` disables the native kernel;
``HETQUANT_INT4_ISA=<path>`` caps the instruction path to one of this machine's (tests use it;
:func:`isa_names`). :func:`native_info` reports what was built and how long it took. The same
shared object holds the FP4 kernel of ``fp4_gemv.py`` (its ``fp4_gemv_*.cpp`` parts, compiled
after these and using their path detection, worker pool and transposes); both settings apply
to it too.

Why not torch's own ``aten._weight_int4pack_mm_for_cpu``: it does map our scheme (codes ``c``,
``(c − 8)·scale + zero`` with ``zero = 0``, groups of 32…256), but needs a repack to its 64-row
tiled layout at load (no zero-copy mmap), keeps scales in the activation dtype (bf16: the F32
per-channel scales would be rounded), and was measured slower than this kernel at batch 1
(benchmarks/README.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path
from typing import Any

import torch

from hetquant.formats import HetquantError
from hetquant.formats.native import NativeBuild, NativeLibrary

__all__ = [
    "AMX_MIN_TOKENS",
    "BACKENDS",
    "GEMM_MIN_TOKENS",
    "GROUP_SIZES",
    "ISA_LADDERS",
    "MAX_K",
    "MAX_NATIVE_TOKENS",
    "PRECISIONS",
    "int4_gemv",
    "int4_gemv_torch",
    "isa_names",
    "native_available",
    "native_info",
]

log = logging.getLogger("hetquant.runtime")

BACKENDS = ("auto", "native", "torch")
PRECISIONS = {"high": 3, "fast": 2}  # native kernel: signed-byte digits per activation
MAX_NATIVE_TOKENS = 256  # "auto" uses the native kernel up to this many tokens per call
GEMM_MIN_TOKENS = 16  # native: the GEMM-shaped (token-blocked) order from this many tokens on
AMX_MIN_TOKENS = 2  # native: the AMX path from this many tokens on (int4_gemv_amx.cpp AMX_MIN_T)
MAX_K = 1 << 20  # native kernel: int32 lanes cannot overflow for K ≤ 2^20
GROUP_SIZES = (32, 64, 128)  # grouped scales the native kernel takes (whole 32-element blocks)
_TORCH_BLOCK_ELEMS = 1 << 22  # torch path: rows per block so that a float block is ~16 MB
_MIN_ELEMS_PER_THREAD = 1 << 19  # native: split a call over threads only above this many weights

_ISA_NAMES = {1: "generic", 2: "avx2", 3: "avx512_vnni", 4: "neon_dotprod", 5: "amx_int8"}
_ISA_CODES = {v: k for k, v in _ISA_NAMES.items()}
# The instruction paths of each machine, slowest first (a cap picks the best at or below it).
ISA_LADDERS = {
    "x86_64": ("generic", "avx2", "avx512_vnni", "amx_int8"),
    "aarch64": ("generic", "neon_dotprod"),
}

# One translation unit, in this order (each part says what it holds).
_CPP_PARTS = (
    "int4_gemv_base.cpp",
    "int4_gemv_x86.cpp",
    "int4_gemv_amx.cpp",
    "int4_gemv_neon.cpp",
    "int4_gemv.cpp",
    "int4_moe.cpp",
    "fp4_gemv_base.cpp",  # the FP4 kernel (fp4_gemv.py) shares this library's paths and pool
    "fp4_gemv_simd.cpp",
    "fp4_gemv.cpp",
)
_CPP_SOURCE = "\n".join(
    (Path(__file__).parent / part).read_text(encoding="utf-8") for part in _CPP_PARTS
)


def _bind(lib: ctypes.CDLL) -> None:
    i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn = lib.hq_int4_gemv
    fn.restype = ctypes.c_int
    fn.argtypes = [vp, i64, vp, i64, i64, vp, i64, i64, vp, i64, ci, ci, ci]
    fn = lib.hq_int4_gemv_grouped
    fn.restype = ctypes.c_int
    fn.argtypes = [vp, i64, vp, i64, i64, i64, i64, vp, i64, i64, vp, i64, ci, ci, ci]
    fn = lib.hq_int4_moe
    fn.restype = ctypes.c_int
    fn.argtypes = [vp, i64, i64, vp, i64, i64, vp, i64, i64, vp, i64, i64, i64, vp, i64, i64]
    fn.argtypes += [vp, vp, vp, vp, vp, ci, ci, ci]
    fn = lib.hq_fp4_gemv
    fn.restype = ctypes.c_int
    fn.argtypes = [vp, i64, vp, i64, i64, i64, vp, i64, i64, vp, i64, ci, ci]
    lib.hq_int4_best_isa.restype = ctypes.c_int
    lib.hq_int4_best_isa.argtypes = []
    lib.hq_int4_token_block.restype = None
    lib.hq_int4_token_block.argtypes = [ci]


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


def isa_names(machine: str | None = None) -> tuple[str, ...]:
    """The instruction paths of ``machine`` (default this one), slowest first."""
    return ISA_LADDERS.get(machine or platform.machine(), ("generic",))


def _isa_cap(best: int) -> int:
    want = os.environ.get("HETQUANT_INT4_ISA", "").strip().lower()
    if not want:
        return best
    if want not in isa_names():
        raise HetquantError(
            f"HETQUANT_INT4_ISA={want!r}: this machine ({platform.machine()}) has the paths "
            f"{', '.join(isa_names())}"
        )
    return min(best, _ISA_CODES[want])  # one machine's codes rise along its ladder


def _check(packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> tuple[int, int, int]:
    """(N, K/2, group size; 0 per-channel) after checking shapes, dtypes and devices."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise HetquantError(
            f"int4_gemv: packed must be uint8 [N, K/2], got {packed.dtype} {list(packed.shape)}"
        )
    n, kb = packed.shape
    group = 0
    if scale.ndim == 2:
        ng = scale.shape[1]
        group = 2 * kb // ng if ng else 0
        if (
            scale.shape[0] != n
            or scale.dtype != torch.bfloat16
            or group not in GROUP_SIZES
            or (group * ng != 2 * kb)
        ):
            raise HetquantError(
                f"int4_gemv: grouped scale {scale.dtype} {list(scale.shape)} for K = {2 * kb}; "
                f"expected bfloat16 [{n}, K/g] with g in {GROUP_SIZES}"
            )
    elif scale.shape != (n,):
        raise HetquantError(
            f"int4_gemv: scale shape {list(scale.shape)}, expected [{n}] (or [{n}, K/g])"
        )
    if x.ndim not in (1, 2) or x.shape[-1] != 2 * kb:
        raise HetquantError(
            f"int4_gemv: x shape {list(x.shape)}; expected [T, {2 * kb}] or [{2 * kb}]"
        )
    if not x.is_floating_point():
        raise HetquantError(f"int4_gemv: x must be floating point, got {x.dtype}")
    if packed.device.type != "cpu" or x.device.type != "cpu" or scale.device.type != "cpu":
        raise HetquantError("int4_gemv: CPU tensors only")
    return n, kb, group


def int4_gemv_torch(packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The pure-torch path (module docstring): float32 [T, N] (or [N] for 1-D ``x``)."""
    n, kb, group = _check(packed, scale, x)
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, 2 * kb).to(torch.float32)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    step = max(1, _TORCH_BLOCK_ELEMS // max(kb, 1))
    if group:
        for a in range(0, n, step):
            p = packed[a : a + step]
            q = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)  # [rows, K]
            w = q.to(torch.float32).sub_(8.0) * scale[a : a + step].float().repeat_interleave(
                group, dim=1
            )  # exact: a 4-bit code times a bf16 scale
            y[:, a : a + step] = x2 @ w.T
        return y[0] if squeeze else y
    xe, xo = x2[:, 0::2], x2[:, 1::2]  # [T, K/2]
    s = scale.to(torch.float32)
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
    token_block: int | None = None,
) -> torch.Tensor:
    """``packed`` U8 [N, K/2] with per-channel ``scale`` F32 [N] or grouped BF16 [N, K/g],
    times ``x`` [T, K] (or [K]) → float32 [T, N] ([N] for 1-D x); formulas in the module
    docstring.

    ``threads``: threads of the native kernel for this call (default
    ``torch.get_num_threads()``; small calls use one). The calling thread works too; the others
    come from a pool the calling thread keeps between calls (joined when it exits), and rows are
    dealt in chunks, so any thread count gives the same bits. ``precision`` (native kernel):
    ``"high"`` rounds activations to 22-bit fixed point per token, ``"fast"`` to 14-bit (two
    digit planes instead of three). ``token_block`` (native kernel): ``None`` the GEMM-shaped
    order from ``GEMM_MIN_TOKENS`` tokens on, ``0`` never, ``n`` blocks of ``n`` tokens — the
    same bits either way (module docstring). See the module docstring for backends and error
    bounds.
    """
    if backend not in BACKENDS:
        raise HetquantError(f"int4_gemv: backend {backend!r} not in {BACKENDS}")
    if precision not in PRECISIONS:
        raise HetquantError(f"int4_gemv: precision {precision!r} not in {tuple(PRECISIONS)}")
    n, kb, group = _check(packed, scale, x)
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
    y = torch.empty(t, n, dtype=torch.float32)
    if threads is None:
        threads = torch.get_num_threads()
    threads = max(1, min(int(threads), n * kb * 2 // _MIN_ELEMS_PER_THREAD or 1))
    rows = (packed.data_ptr(), packed.stride(0) if n > 1 else kb)
    tail = (x32.data_ptr(), x32.stride(0) if t > 1 else 2 * kb, t, y.data_ptr(), n)
    tail += (threads, _isa_cap(nat.best_isa), PRECISIONS[precision])
    if token_block is not None:
        nat.lib.hq_int4_token_block(max(0, int(token_block)))
    try:
        if group:
            if scale.stride(1) != 1 and n > 0:
                scale = scale.contiguous()
            sg = (scale.data_ptr(), scale.stride(0) if n > 1 else scale.shape[1])
            rc = nat.lib.hq_int4_gemv_grouped(*rows, *sg, n, 2 * kb, group, *tail)
        else:
            s = scale.to(torch.float32).contiguous()
            rc = nat.lib.hq_int4_gemv(*rows, s.data_ptr(), n, 2 * kb, *tail)
    finally:
        if token_block is not None:
            nat.lib.hq_int4_token_block(-1)
    if rc == -3:  # NaN/Inf activations: float math propagates them
        return int4_gemv_torch(packed, scale, x)
    if rc < 0:
        raise HetquantError(f"int4_gemv: native kernel failed (code {rc}) for N={n}, K={2 * kb}")
    return y[0] if squeeze else y
