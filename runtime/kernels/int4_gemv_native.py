"""The native INT4 GEMV library (``runtime/kernels/int4_gemv.py`` states what it computes): its
build, the ctypes bindings, and the instruction path this CPU runs.

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
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path
from typing import Any

from hetquant.formats import HetquantError
from hetquant.formats.native import NativeBuild, NativeLibrary

__all__ = ["ISA_LADDERS", "isa_names", "native_available", "native_info"]

log = logging.getLogger("hetquant.runtime")

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
