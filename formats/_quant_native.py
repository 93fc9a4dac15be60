"""Fused C++ quantize kernels for :mod:`.nvfp4` and :mod:`.awq_w4a16`, bit-identical to torch.

The torch code of each format is the reference; these kernels redo its arithmetic, operation for
operation (IEEE float32/float64, no ``-ffast-math``, ``-ffp-contract=off``), so every output byte
is the same, but read the weight once and keep everything else in cache: tiles of 128 rows x 256
inputs, codes packed straight into the stored layout. Single-threaded; the one C++ body is
compiled for the baseline ISA, AVX2 and AVX-512 and picked at run time (all give the same bytes).
Built on first use by :mod:`._native`; ``HETQUANT_QUANT_BACKEND=torch`` disables them.

Each wrapper returns ``None`` where the kernel does not apply (no compiler, a dtype other than
BF16/F32, a non-contiguous or non-CPU tensor, an empty one) **or** where the input is bad
(NaN/Inf, an FP16 scale overflow): the caller then runs its torch path, which produces the result
or raises the format's own error.

Precision notes, each checked against the torch code (tests/formats/test_native_quant.py):

* ``x.to(float8_e4m3fn)`` is c10's ``fp8e4m3fn_from_fp32_value`` (round to nearest even,
  subnormals by one float add at 2^-9; torch 2.13 saturates finite overflow and Inf to 448,
  older releases gave NaN: irrelevant to NVFP4, whose block scales are clamped to 448 first);
* torch casts float64 -> float16 through float32 (two roundings); ``_round_up_f16`` then moves
  any result below ``x`` up one FP16 step, so its output is the smallest FP16 >= ``x`` either way;
* float32 division is true division everywhere (torch divides a tensor by a 0-d tensor or by a
  broadcast column without a reciprocal); ``E2M1_MAX * s2`` is a float32 product (a float64 one
  moves block scales that sit on an E4M3 tie, e.g. weight_amax = 448);
* AWQ's ``round(w / s)`` is float32 ``w / s`` rounded half to even; ``hi.double() - lo.double()``
  is float64 (exact unless one magnitude exceeds the other by more than ~2^28);
* NVFP4's magnitude code, the count of E2M1 bounds ``|w| / step`` passes, is that same float32
  quotient rounded to the E2M1 grid with ties to even, done on its bits (``e2m1_magnitude``:
  no comparisons, so every path vectorises); the test holds it to the bound count on every
  bound's neighbourhood, a sweep of all bit patterns and random quotients (and it was checked
  on all 2^32 floats when written).

Layout of the work (a tile at a time): AWQ takes each group's extremes, then the parameters of
all the tile's groups in one branch-free loop (their divide chains overlap), then the codes
straight into the tile's packed words, then stores each k's run of words as one row segment of
qweight (never down a column of stride R/2 bytes, whose lines share a few L1 sets). NVFP4
takes every row's block maxima, then the scales of all the tile's blocks in one loop, then,
K-major, each 8 rows' codes straight into their 4-byte words (row-major, on AVX-512, each
block's codes straight into its 8 bytes). Codes and block scales stay in 32-bit lanes: stored
as bytes, they made the vectoriser narrow them through shuffles, which run on one port of
Intel's AVX-512 cores (NVFP4 took 1.8× its time now there). With ``out`` and ``row0`` both
quantizers write a chunk of rows into the whole weight's tensors.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ._lazy import torch
from .dtypes import numpy_dtype, st_dtype
from .errors import HetquantError
from .native import DEFAULT_FLAGS, NativeLibrary

__all__ = [
    "ISAS",
    "NVFP4_LAYOUTS",
    "QUANT_LIBRARY",
    "absmax",
    "absmax_array",
    "available",
    "awq_rtn",
    "awq_rtn_array",
    "best_isa",
    "e2m1_magnitude",
    "e4m3_encode",
    "f16_encode",
    "float_kind",
    "host_array",
    "nvfp4",
    "nvfp4_array",
    "nvfp4_tile",
    "nvfp4_tile_into",
    "u8_colmax7",
]

# The C++ source: the quantizers, then the row kernels of ``_rows_native`` (one library).
_SOURCE = "".join(
    (Path(__file__).parent / name).read_text(encoding="utf-8")
    for name in ("_quant_native.cpp", "_rows_native.cpp")
)


def _bind(lib: ctypes.CDLL) -> None:
    vp, ci, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.hq_nvfp4_quantize.argtypes = [vp, ci, i64, i64, f32, vp, vp, ci, i64, i64, ci]
    lib.hq_nvfp4_quantize.restype = ci
    lib.hq_absmax.argtypes = [vp, ci, i64, ci]
    lib.hq_absmax.restype = f32
    lib.hq_awq_quantize.argtypes = [vp, ci, i64, i64, i64, vp, vp, vp, i64, i64, ci]
    lib.hq_awq_quantize.restype = ci
    lib.hq_nvfp4_tile.argtypes = [vp, i64, i64, vp]
    lib.hq_nvfp4_tile.restype = ci
    lib.hq_nvfp4_tile_into.argtypes = [vp, i64, i64, i64, i64, vp]
    lib.hq_nvfp4_tile_into.restype = ci
    lib.hq_u8_colmax7.argtypes = [vp, i64, i64, i64, vp]
    lib.hq_u8_colmax7.restype = None
    lib.hq_quant_best_isa.argtypes = []
    lib.hq_quant_best_isa.restype = ci
    for fn in (lib.hq_e4m3_encode, lib.hq_f16_encode, lib.hq_e2m1_magnitude):
        fn.argtypes = [vp, vp, i64]
        fn.restype = None
    lib.hq_fp8_dequant_rows.argtypes = [vp, i64, i64, vp, i64, vp, ci]
    lib.hq_fp8_absmax.argtypes = [vp, i64, i64, vp, i64, i64, vp]
    lib.hq_w8a8_rows.argtypes = [vp, ci, i64, i64, vp, vp, ci]
    lib.hq_int4_rows.argtypes = [vp, vp, ci, i64, i64, vp, vp, ci]
    for fn in (lib.hq_fp8_dequant_rows, lib.hq_fp8_absmax, lib.hq_w8a8_rows, lib.hq_int4_rows):
        fn.restype = ci


QUANT_LIBRARY = NativeLibrary(
    "quant",
    _SOURCE,
    _bind,
    flags=(*DEFAULT_FLAGS, "-ffp-contract=off"),  # never fuse a*b+c: the reference rounds twice
    disable_env="HETQUANT_QUANT_BACKEND",
    label="quantize kernels",
)
ISAS = {"generic": 1, "avx2": 2, "avx512": 3}  # instruction paths; 0 = the best of this CPU


def available() -> bool:
    """Whether the kernels are built and loaded (builds them on first call)."""
    return QUANT_LIBRARY.get().lib is not None


def best_isa() -> int:
    """The instruction path the kernels take on this CPU (a value of ``ISAS``; 0 if unbuilt)."""
    lib = QUANT_LIBRARY.get().lib
    return 0 if lib is None else int(lib.hq_quant_best_isa())


def host_array(t: torch.Tensor) -> np.ndarray | None:
    """A zero-copy numpy view of a C-contiguous CPU tensor (BF16 and FP8 as their bits,
    ``dtypes.numpy_dtype``); None for any other tensor."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    try:
        dtype = numpy_dtype(st_dtype(t.dtype))
    except HetquantError:
        return None
    return t.detach().reshape(-1).view(torch.uint8).numpy().view(dtype).reshape(t.shape)


def float_kind(a: np.ndarray) -> int | None:
    """The kernels' ``bf16`` argument for float rows ``a``: 1 for BF16 (its bits, ``uint16``),
    0 for F32; None where they cannot take ``a`` as is (another dtype, not C-contiguous, empty)."""
    if not a.flags.c_contiguous or a.size == 0:
        return None
    return {np.dtype(np.uint16): 1, np.dtype(np.float32): 0}.get(a.dtype)


def absmax_array(a: np.ndarray, isa: int = 0) -> float | None:
    """``max |a|`` of float rows ``a`` (BF16 bits or F32; NaN if any NaN), or None where the
    kernel does not apply."""
    kind = float_kind(a)
    lib = None if kind is None else QUANT_LIBRARY.get().lib
    return None if lib is None else float(lib.hq_absmax(a.ctypes.data, kind, a.size, isa))


def absmax(w: torch.Tensor, isa: int = 0) -> float | None:
    """``float(w.abs().amax())`` (NaN if any NaN), or None where the kernel does not apply."""
    a = host_array(w)
    return None if a is None else absmax_array(a, isa)


NVFP4_LAYOUTS = {"rows": 0, "kmajor": 1, "tiled": 2}  # hq_nvfp4_quantize's ``layout``


def _nvfp4_shapes(layout: str, nt: int, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(codes, scales) shapes of a whole weight of ``nt`` rows in ``layout``."""
    if layout == "rows":
        return (nt, k // 2), (nt, k // 16)
    return (k, nt // 2), (k // 16, nt)


def nvfp4_array(
    w: np.ndarray,
    s2: float,
    layout: str = "rows",
    out: tuple[np.ndarray, np.ndarray] | None = None,
    row0: int = 0,
    isa: int = 0,
) -> tuple[np.ndarray, np.ndarray] | None:
    """NVFP4 ``(weight, weight_scale)`` bytes (``uint8``) of float rows ``w`` [n, K] (BF16 bits
    or F32) with global scale ``s2`` (an exact float32 value), in ``layout`` (a key of
    ``NVFP4_LAYOUTS``): ``rows`` [n, K/2] and [n, K/16]; ``kmajor`` [K, n/2] and [K/16, n];
    ``tiled`` the K-major codes in ``nvfp4_ascend``'s tile order. With ``out``, the rows are rows
    ``row0`` .. of the whole weight whose tensors ``out`` holds (its rows: ``out[1]``'s along
    the layout), written in place and returned. None where the kernel does not apply (no
    library, another dtype, shapes the layout cannot take) or ``w`` holds NaN/Inf."""
    kind = float_kind(w)
    lib = None if kind is None or w.ndim != 2 else QUANT_LIBRARY.get().lib
    if lib is None or layout not in NVFP4_LAYOUTS:
        return None
    n, k = w.shape
    if out is None:
        out = tuple(np.empty(s, dtype=np.uint8) for s in _nvfp4_shapes(layout, n, k))  # type: ignore[assignment]
    q, sc = out  # type: ignore[misc]
    nt = sc.shape[0] if layout == "rows" else sc.shape[-1]
    good = all(a.dtype == np.uint8 and a.flags.c_contiguous for a in (q, sc))
    if k % 16 or not good or (q.shape, sc.shape) != _nvfp4_shapes(layout, nt, k):
        return None
    rc = lib.hq_nvfp4_quantize(
        w.ctypes.data, kind, n, k, s2, q.ctypes.data, sc.ctypes.data, NVFP4_LAYOUTS[layout],
        nt, row0, isa,
    )  # fmt: skip
    return None if rc else (q, sc)


def nvfp4(
    w: torch.Tensor, s2: float, kmajor: bool, isa: int = 0
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`nvfp4_array` of a tensor, canonical or (``kmajor``) K-major: weight U8 and
    weight_scale E4M3."""
    a = host_array(w)
    got = None if a is None else nvfp4_array(a, s2, "kmajor" if kmajor else "rows", isa=isa)
    if got is None:
        return None
    return torch.from_numpy(got[0]), torch.from_numpy(got[1]).view(torch.float8_e4m3fn)


def nvfp4_tile(kn: torch.Tensor) -> torch.Tensor | None:
    """``nvfp4_ascend_tiles.tile`` of packed K-major codes ``kn`` uint8 [K, N/2] (K % 64 == 0,
    N % 256 == 0): the same bytes in tile order, [K, N/2]. None where the kernel does not
    apply (no library, another dtype or layout)."""
    lib = QUANT_LIBRARY.get().lib
    if lib is None or kn.dtype != torch.uint8 or kn.ndim != 2 or not kn.is_contiguous():
        return None
    out = torch.empty_like(kn)
    rc = lib.hq_nvfp4_tile(kn.data_ptr(), kn.shape[0], kn.shape[1], out.data_ptr())
    return None if rc else out


def nvfp4_tile_into(chunk: torch.Tensor, col0: int, out: torch.Tensor) -> bool:
    """Byte columns ``col0`` .. of the packed K-major codes, ``chunk`` uint8 [K, cb], written
    straight to their tile-order places in ``out`` uint8 [K, N/2] (see :func:`nvfp4_tile`);
    False, writing nothing, where the kernel does not apply (``cb`` or ``col0`` not a multiple
    of 16, another dtype or layout, no library)."""
    lib = QUANT_LIBRARY.get().lib
    ok = lib is not None and chunk.dtype == out.dtype == torch.uint8 and chunk.ndim == out.ndim == 2
    if not ok or not (chunk.is_contiguous() and out.is_contiguous()) or chunk.shape[0] != out.shape[0]:  # fmt: skip
        return False
    k, cb = chunk.shape
    rc = lib.hq_nvfp4_tile_into(chunk.data_ptr(), k, cb, col0, out.shape[1], out.data_ptr())
    return rc == 0


def u8_colmax7(rows: torch.Tensor) -> torch.Tensor | None:
    """Per column of byte rows ``rows`` [R, C] (any 1-byte dtype, rows may be strided, columns
    contiguous): ``max(rows & 0x7F)`` as uint8 [C]; None where the kernel does not apply."""
    lib = QUANT_LIBRARY.get().lib
    if lib is None or rows.element_size() != 1 or rows.ndim != 2 or rows.stride(1) != 1:
        return None
    out = torch.empty(rows.shape[1], dtype=torch.uint8)
    lib.hq_u8_colmax7(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), out.data_ptr())
    return out


def _awq_shapes(nt: int, k: int, group: int) -> dict[str, tuple[int, int]]:
    """The stored tensors of an AWQ weight of ``nt`` rows: qweight, qzeros, scales."""
    return {"qweight": (k, nt // 8), "qzeros": (k // group, nt // 8), "scales": (k // group, nt)}


_AWQ_DTYPES = {"qweight": np.int32, "qzeros": np.int32, "scales": np.float16}


def awq_rtn_array(
    w: np.ndarray,
    group: int,
    isa: int = 0,
    out: dict[str, np.ndarray] | None = None,
    row0: int = 0,
) -> dict[str, np.ndarray] | None:
    """AWQ round-to-nearest of rows ``w`` [R, K] (BF16 bits or F32; shape already validated):
    ``qweight`` I32 [K, R/8], ``qzeros`` I32 [K/g, R/8], ``scales`` F16 [K/g, R]. With ``out``,
    the rows are rows ``row0`` .. of the whole weight whose tensors ``out`` holds (its rows:
    ``out["scales"]``' columns), written into their columns in place and returned. None where
    the kernel does not apply (also ``out`` of other shapes or dtypes, a ``row0`` not a multiple
    of 8 or past the weight), ``w`` holds NaN/Inf or a scale overflows FP16."""
    kind = float_kind(w)
    lib = None if kind is None or w.ndim != 2 else QUANT_LIBRARY.get().lib
    if lib is None:
        return None
    r, k = w.shape
    if out is None:
        out = {key: np.empty(s, _AWQ_DTYPES[key]) for key, s in _awq_shapes(r, k, group).items()}
    if set(out) != set(_AWQ_DTYPES) or out["scales"].ndim != 2:
        return None
    shapes = _awq_shapes(out["scales"].shape[1], k, group)
    for key, a in out.items():
        if a.dtype != _AWQ_DTYPES[key] or a.shape != shapes[key] or not a.flags.c_contiguous:
            return None
    nt = out["scales"].shape[1]
    ptrs = (out[key].ctypes.data for key in ("qweight", "qzeros", "scales"))
    rc = lib.hq_awq_quantize(w.ctypes.data, kind, r, k, group, *ptrs, nt, row0, isa)
    return None if rc else out


def awq_rtn(w: torch.Tensor, group: int, isa: int = 0) -> dict[str, torch.Tensor] | None:
    """:func:`awq_rtn_array` of a tensor."""
    a = host_array(w)
    out = None if a is None else awq_rtn_array(a, group, isa)
    return None if out is None else {k: torch.from_numpy(v) for k, v in out.items()}


def _encode(fn_name: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    lib = QUANT_LIBRARY.get().lib
    if lib is None:
        return None
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    getattr(lib, fn_name)(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def e4m3_encode(x: torch.Tensor) -> torch.Tensor | None:
    """The kernels' float32 -> E4M3 bits (uint8), for tests; None without the kernels."""
    return _encode("hq_e4m3_encode", x, torch.uint8)


def e2m1_magnitude(y: torch.Tensor) -> torch.Tensor | None:
    """The kernels' E2M1 magnitude index (uint8, 0..7) of quotients y = |w| / step, for tests;
    None without the kernels."""
    return _encode("hq_e2m1_magnitude", y, torch.uint8)


def f16_encode(x: torch.Tensor) -> torch.Tensor | None:
    """The kernels' float32 -> float16 (as float16), for tests; None without the kernels."""
    return _encode("hq_f16_encode", x, torch.float16)
