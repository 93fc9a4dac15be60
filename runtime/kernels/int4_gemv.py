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

Instruction paths (AMX-INT8, AVX-512 VNNI, AVX2, NEON dot product, generic), how each is chosen
and checked, the GEMM-shaped order and the build: ``runtime/kernels/int4_gemv_native.py``.

``"torch"`` — the pure-torch reference path, always available (``int4_gemv_ref.py``: unpack,
subtract 8, float32 matmul in blocks of rows; float32 rounding ``≲ γ_m · Σ|W||x|``).

``"auto"`` (default) — native when it is built and ``T ≤ MAX_NATIVE_TOKENS`` and ``x`` is finite,
else torch. The native kernel streams the weight once per call and does ``2·L·T`` dot-products
per 64 weight bytes (``L`` = 3 digit planes), so it is memory-bound at batch 1 and compute-bound
from a few tokens on; the torch path pays a fixed unpack of the whole matrix to float32, so it
only wins for long prefill; ``MAX_NATIVE_TOKENS = 256`` is where the two meet on a
[4096, 7168] weight (the measurement: ``benchmarks/bench_expert_gemv.py``, benchmarks/README.md).

If the native kernel cannot be built, ``"auto"`` falls back to torch with one warning and
``"native"`` raises ``HetquantError``; ``HETQUANT_INT4_BACKEND=torch`` disables it and
``HETQUANT_INT4_ISA=<path>`` caps its instruction path (``int4_gemv_native.py``).

Why not torch's own ``aten._weight_int4pack_mm_for_cpu``: it does map our scheme (codes ``c``,
``(c − 8)·scale + zero`` with ``zero = 0``, groups of 32…256), but needs a repack to its 64-row
tiled layout at load (no zero-copy mmap), keeps scales in the activation dtype (bf16: the F32
per-channel scales would be rounded), and was measured slower than this kernel at batch 1
(benchmarks/README.md).
"""

from __future__ import annotations

import torch

from hetquant.formats import HetquantError

from .int4_gemv_native import _CPP_SOURCE as _CPP_SOURCE  # the cross-ISA tests compile it
from .int4_gemv_native import (
    ISA_LADDERS,
    _get_native,
    _isa_cap,
    _Native,
    isa_names,
    native_available,
    native_info,
)
from .int4_gemv_ref import GROUP_SIZES, check_operands, int4_gemv_torch

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

BACKENDS = ("auto", "native", "torch")
PRECISIONS = {"high": 3, "fast": 2}  # native kernel: signed-byte digits per activation
MAX_NATIVE_TOKENS = 256  # "auto" uses the native kernel up to this many tokens per call
GEMM_MIN_TOKENS = 16  # native: the GEMM-shaped (token-blocked) order from this many tokens on
AMX_MIN_TOKENS = 2  # native: the AMX path from this many tokens on (int4_gemv_amx.cpp AMX_MIN_T)
MAX_K = 1 << 20  # native kernel: int32 lanes cannot overflow for K ≤ 2^20
_MIN_ELEMS_PER_THREAD = 1 << 19  # native: split a call over threads only above this many weights


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
    _, kb, group = check_operands(packed, scale, x)
    if backend == "torch":
        return int4_gemv_torch(packed, scale, x)
    nat = _get_native()
    if nat.lib is None:
        if backend == "native":
            raise HetquantError(f"int4_gemv: native kernel unavailable: {nat.error}")
        return int4_gemv_torch(packed, scale, x)
    x2 = x.reshape(-1, 2 * kb)
    if backend == "auto" and (x2.shape[0] > MAX_NATIVE_TOKENS or 2 * kb > MAX_K):
        return int4_gemv_torch(packed, scale, x)
    if 2 * kb > MAX_K:
        raise HetquantError(f"int4_gemv: K = {2 * kb} exceeds the native kernel's {MAX_K}")
    y = _native_gemv(nat, packed, scale, x2, group, threads, precision, token_block)
    if y is None:  # NaN/Inf activations: float math propagates them
        return int4_gemv_torch(packed, scale, x)
    return y[0] if x.ndim == 1 else y


def _native_gemv(
    nat: _Native,
    packed: torch.Tensor,
    scale: torch.Tensor,
    x2: torch.Tensor,
    group: int,
    threads: int | None,
    precision: str,
    token_block: int | None,
) -> torch.Tensor | None:
    """The native kernel on checked operands (``x2`` [T, K]): float32 [T, N], or None when the
    kernel declines NaN/Inf activations."""
    n, kb = packed.shape
    t = x2.shape[0]
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
    if rc == -3:
        return None
    if rc < 0:
        raise HetquantError(f"int4_gemv: native kernel failed (code {rc}) for N={n}, K={2 * kb}")
    return y
