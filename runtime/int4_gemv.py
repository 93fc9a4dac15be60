"""INT4 GEMV for the CPU expert pool: ``y[t, n] = s[n] · Σ_k (c[n, k] − 8) · x[t, k]``.

The weight is one ``int4_cpu`` matrix as stored (``formats/int4_cpu.py``): ``packed`` U8 [N, K/2]
(element ``2j`` of a row in the low nibble of byte ``j``, ``2j+1`` in the high nibble; rows may be
strided, as in a ``subpool_slice`` of ``down_packed``, but each row's bytes are contiguous) and
``scale`` F32 [N]. ``x`` is [T, K] or [K] (float32 / bfloat16 / float16); the result is float32
[T, N] (or [N]).

Backends (``backend=``):

``"native"`` — a C++ kernel (source below) compiled with the system C++ compiler on first use
into ``$HETQUANT_CACHE_DIR`` (default ``~/.cache/hetquant``), loaded with ctypes (which releases
the GIL during the call). It works on integers, so every instruction path gives bit-identical
results:

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

Build: ``g++ -O3 -std=c++17 -shared -fPIC`` (no ``-march``: each instruction path carries its
own ``target`` attribute and is chosen at run time with ``__builtin_cpu_supports``), 1.6–5 s
once per source version on the 2-vCPU development VM; the shared object is written to a temporary name and renamed, so
concurrent first uses are safe. If there is no compiler or the build fails, ``"auto"`` falls back
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
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hetquant.formats import HetquantError

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

_CPP_SOURCE = r"""
// hetquant int4_cpu GEMV (see hetquant/runtime/int4_gemv.py for the math and the error bound).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define HQ_X86 1
#endif

namespace {

constexpr int LMAX = 3;        // signed-byte digits per activation: L = 3 (|X| < 2^22) or 2 (2^14)
constexpr int64_t PAD = 64;    // digit rows padded to a multiple of 64 bytes (zeros)

struct Job {
  const uint8_t* w; int64_t rs; int64_t kb;   // packed rows: stride rs bytes, kb = K/2 bytes used
  const float* s;                             // scales [N]
  const int8_t* xq; int64_t xs; int L;        // digits [T][L][2][xs]: d_l of x[2i] (h=0), x[2i+1] (h=1)
  const int64_t* sx; const double* p2;        // per token: sum of X, 2^e
  int64_t T; float* y; int64_t ys;            // y [T, N], row stride ys
  int64_t n0, n1;                             // rows of this worker
  int isa;
  int64_t pf;                                 // prefetch distance in tiles (>= 1)
};

static inline const int8_t* digits(const Job& j, int64_t t, int l, int h) {
  return j.xq + ((t * j.L + l) * 2 + h) * j.xs;
}

static inline void finish(const Job& j, int64_t t, int64_t n, int64_t acc) {
  // (acc - 8 ΣX) and its product with 2^e are exact in double; one rounding by s, one to float
  const double v = (double)j.s[n] * ((double)(acc - 8 * j.sx[t]) * j.p2[t]);
  j.y[t * j.ys + n] = (float)v;
}

// ---------------------------------------------------------------- generic C++ (any CPU)
static void run_generic(const Job& j) {
  for (int64_t n = j.n0; n < j.n1; ++n) {
    const uint8_t* w = j.w + n * j.rs;
    for (int64_t t = 0; t < j.T; ++t) {
      int64_t acc = 0;
      for (int l = j.L - 1; l >= 0; --l) {
        const int8_t* de = digits(j, t, l, 0);
        const int8_t* dd = digits(j, t, l, 1);
        int32_t sum = 0;
        for (int64_t i = 0; i < j.kb; ++i)
          sum += (int32_t)(w[i] & 15) * de[i] + (int32_t)(w[i] >> 4) * dd[i];
        acc = acc * 256 + sum;
      }
      finish(j, t, n, acc);
    }
  }
}

#ifdef HQ_X86
// ---------------------------------------------------------------- AVX2: vpmaddubsw + vpmaddwd
#define HQ_AVX2 __attribute__((target("avx2,fma")))
template <int R, int TT, int L>
HQ_AVX2 static inline void tile_avx2(const Job& j, int64_t n, int64_t t0) {
  const __m256i m15 = _mm256_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][TT][L];
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 64
      for (int l = 0; l < L; ++l) acc[r][t][l] = _mm256_setzero_si256();
  for (int64_t i = 0; i < j.kb; i += 32) {
    const int64_t left = j.kb - i;
    __m256i lo[R], hi[R];
#pragma GCC unroll 64
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = j.w + (n + r) * j.rs + i;
      _mm_prefetch((const char*)(p + R * j.pf * j.rs), _MM_HINT_T1);
      __m256i v;
      if (left >= 32) {
        v = _mm256_loadu_si256((const __m256i*)p);
      } else {
        alignas(32) uint8_t tmp[32] = {0};
        memcpy(tmp, p, (size_t)left);
        v = _mm256_load_si256((const __m256i*)tmp);
      }
      lo[r] = _mm256_and_si256(v, m15);
      hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
    }
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 64
      for (int l = 0; l < L; ++l) {
        const __m256i de = _mm256_loadu_si256((const __m256i*)(digits(j, t0 + t, l, 0) + i));
        const __m256i dd = _mm256_loadu_si256((const __m256i*)(digits(j, t0 + t, l, 1) + i));
#pragma GCC unroll 64
        for (int r = 0; r < R; ++r) {
          // |c·d| ≤ 15·128: pair sums ≤ 3840, lo + hi ≤ 7680: no int16 saturation
          const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], de),
                                               _mm256_maddubs_epi16(hi[r], dd));
          acc[r][t][l] = _mm256_add_epi32(acc[r][t][l], _mm256_madd_epi16(p16, ones));
        }
      }
  }
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t) {
      int64_t a = 0;
      for (int l = L - 1; l >= 0; --l) {
        __m128i q = _mm_add_epi32(_mm256_castsi256_si128(acc[r][t][l]),
                                  _mm256_extracti128_si256(acc[r][t][l], 1));
        q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4E));
        q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1));
        a = a * 256 + _mm_cvtsi128_si32(q);
      }
      finish(j, t0 + t, n + r, a);
    }
}

template <int L>
HQ_AVX2 static void run_avx2_l(const Job& j) {
  int64_t n = j.n0;
  if (j.T == 1) {
    for (; n + 2 <= j.n1; n += 2) tile_avx2<2, 1, L>(j, n, 0);
  }
  for (; n < j.n1; ++n) {
    int64_t t = 0;
    for (; t + 2 <= j.T; t += 2) tile_avx2<1, 2, L>(j, n, t);
    if (t < j.T) tile_avx2<1, 1, L>(j, n, t);
  }
}

HQ_AVX2 static void run_avx2(const Job& j) {
  if (j.L == 2) run_avx2_l<2>(j); else run_avx2_l<3>(j);
}

// ---------------------------------------------------------------- AVX-512 VNNI: vpdpbusd
#define HQ_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
template <int R, int TT, int L>
HQ_VNNI static inline void tile_vnni(const Job& j, int64_t n, int64_t t0) {
  const __m512i m15 = _mm512_set1_epi8(15);
  __m512i acc[R][TT][L];
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 64
      for (int l = 0; l < L; ++l) acc[r][t][l] = _mm512_setzero_si512();
  for (int64_t i = 0; i < j.kb; i += 64) {
    const int64_t left = j.kb - i;
    const __mmask64 mk = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
    __m512i lo[R], hi[R];
#pragma GCC unroll 64
    for (int r = 0; r < R; ++r) {
      // rows R·pf ahead (pf tiles, >= ~12 KB) into L2; into L1 they would evict the digits
      _mm_prefetch((const char*)(j.w + (n + R * j.pf + r) * j.rs + i), _MM_HINT_T1);
      const __m512i v = _mm512_maskz_loadu_epi8(mk, j.w + (n + r) * j.rs + i);
      lo[r] = _mm512_and_si512(v, m15);
      hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
    }
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 64
      for (int l = 0; l < L; ++l) {
        const __m512i de = _mm512_loadu_si512(digits(j, t0 + t, l, 0) + i);
        const __m512i dd = _mm512_loadu_si512(digits(j, t0 + t, l, 1) + i);
#pragma GCC unroll 64
        for (int r = 0; r < R; ++r) {
          acc[r][t][l] = _mm512_dpbusd_epi32(acc[r][t][l], lo[r], de);
          acc[r][t][l] = _mm512_dpbusd_epi32(acc[r][t][l], hi[r], dd);
        }
      }
  }
  if constexpr (R == 4) {
    // Reduce the four rows of a digit plane together: 4 × 16 lanes → [r0, r1, r2, r3].
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t) {
      __m256i tot = _mm256_setzero_si256();  // int64 per row: sum over planes of 256^l · plane
#pragma GCC unroll 8
      for (int l = 0; l < L; ++l) {
        const __m512i a0 = acc[0][t][l], a1 = acc[1][t][l], a2 = acc[2][t][l], a3 = acc[3][t][l];
        const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
        const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
        const __m512i q = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
        const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(q), _mm512_extracti64x4_epi64(q, 1));
        const __m128i v = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        tot = _mm256_add_epi64(tot, _mm256_slli_epi64(_mm256_cvtepi32_epi64(v), 8 * l));
      }
      alignas(32) int64_t out[4];
      _mm256_store_si256((__m256i*)out, tot);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) finish(j, t0 + t, n + r, out[r]);
    }
  } else {
#pragma GCC unroll 64
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
      for (int t = 0; t < TT; ++t) {
        int64_t a = 0;
        for (int l = L - 1; l >= 0; --l) a = a * 256 + _mm512_reduce_add_epi32(acc[r][t][l]);
        finish(j, t0 + t, n + r, a);
      }
  }
}

template <int L>
HQ_VNNI static void run_vnni_l(const Job& j) {
  int64_t n = j.n0;
  if (j.T == 1) {
    for (; n + 4 <= j.n1; n += 4) tile_vnni<4, 1, L>(j, n, 0);
  } else if (j.T == 2) {
    for (; n + 2 <= j.n1; n += 2) tile_vnni<2, 2, L>(j, n, 0);
  }
  for (; n < j.n1; ++n) {
    int64_t t = 0;
    for (; t + 4 <= j.T; t += 4) tile_vnni<1, 4, L>(j, n, t);
    switch (j.T - t) {
      case 3: tile_vnni<1, 3, L>(j, n, t); break;
      case 2: tile_vnni<1, 2, L>(j, n, t); break;
      case 1: tile_vnni<1, 1, L>(j, n, t); break;
      default: break;
    }
  }
}

HQ_VNNI static void run_vnni(const Job& j) {
  if (j.L == 2) run_vnni_l<2>(j); else run_vnni_l<3>(j);
}
#endif

static void run(const Job& j) {
#ifdef HQ_X86
  if (j.isa == 3) { run_vnni(j); return; }
  if (j.isa == 2) { run_avx2(j); return; }
#endif
  run_generic(j);
}

static void* thread_main(void* p) { run(*static_cast<const Job*>(p)); return nullptr; }

}  // namespace

extern "C" {

// Best instruction path of this CPU: 3 = AVX-512 VNNI, 2 = AVX2, 1 = generic C++.
int hq_int4_best_isa(void) {
#ifdef HQ_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return 3;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 2;
#endif
  return 1;
}

// y[t, n] = s[n] * sum_k (c[n, k] - 8) * x[t, k]   (c from the int4_cpu packing).
// w: row n at w + n*rs, K/2 bytes; s: float32 [N]; x: float32, row t at x + t*xstride;
// y: float32, row t at y + t*ys. isa: 0 = best, else min(isa, best). Returns the path used
// (> 0), -1 bad arguments, -2 out of memory, -3 a NaN/Inf in x (nothing written).
int hq_int4_gemv(const uint8_t* w, int64_t rs, const float* s, int64_t N, int64_t K,
                 const float* x, int64_t xstride, int64_t T, float* y, int64_t ys,
                 int nthreads, int isa, int L) {
  if (K <= 0 || K % 2 || K > (int64_t)1 << 20 || N < 0 || T < 0 || L < 2 || L > LMAX) return -1;
  const int best = hq_int4_best_isa();
  if (isa <= 0 || isa > best) isa = best;
  if (N == 0 || T == 0) return isa;
  const int64_t kb = K / 2;
  const int64_t xs = (kb + PAD - 1) / PAD * PAD;
  int8_t* xq = (int8_t*)calloc((size_t)(T * L * 2 * xs), 1);
  int64_t* sx = (int64_t*)malloc((size_t)T * sizeof(int64_t));
  double* ex = (double*)malloc((size_t)T * sizeof(double));
  if (!xq || !sx || !ex) { free(xq); free(sx); free(ex); return -2; }
  int32_t* X = (int32_t*)malloc((size_t)K * sizeof(int32_t));
  if (!X) { free(xq); free(sx); free(ex); return -2; }
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * xstride;
    uint32_t abits = 0;  // max of |x| as IEEE bits: integer max vectorises, NaN sorts above Inf
    for (int64_t k = 0; k < K; ++k) {
      uint32_t b;
      memcpy(&b, xr + k, 4);
      b &= 0x7FFFFFFFu;
      abits = b > abits ? b : abits;
    }
    if (abits >= 0x7F800000u) { free(X); free(xq); free(sx); free(ex); return -3; }  // NaN/Inf
    float amax;
    memcpy(&amax, &abits, 4);
    int E = 0;
    if (amax > 0.0f) frexpf(amax, &E);  // amax < 2^E
    const int e = amax > 0.0f ? E - (8 * L - 2) : 0;  // |X| < 2^(8L-2): top digit within ±64
    int64_t sum = 0;
    if (-e >= -126 && -e <= 127) {  // 2^-e is a normal float: x * 2^-e is exact (or rounds to 0)
      const float scf = ldexpf(1.0f, -e);
      for (int64_t k = 0; k < K; ++k) X[k] = (int32_t)__builtin_lrintf(xr[k] * scf);  // RNE
    } else {
      const double sc = ldexp(1.0, -e);
      for (int64_t k = 0; k < K; ++k) X[k] = (int32_t)__builtin_lrint((double)xr[k] * sc);
    }
    for (int64_t k = 0; k < K; ++k) sum += X[k];
    for (int l = 0; l < L; ++l) {  // balanced base-256 digits in [-128, 127], low digit first
      int8_t* de = xq + ((t * L + l) * 2 + 0) * xs;
      int8_t* dd = xq + ((t * L + l) * 2 + 1) * xs;
      const bool top = l + 1 == L;
      for (int64_t i = 0; i < kb; ++i) {
        const int32_t a = X[2 * i], b = X[2 * i + 1];
        const int32_t da = top ? a : ((a + 128) & 255) - 128;
        const int32_t db = top ? b : ((b + 128) & 255) - 128;
        de[i] = (int8_t)da;
        dd[i] = (int8_t)db;
        X[2 * i] = (a - da) / 256;
        X[2 * i + 1] = (b - db) / 256;
      }
    }
    sx[t] = sum;
    ex[t] = ldexp(1.0, e);
  }
  free(X);
  // prefetch at least ~12 KB ahead (one 4-row tile of a 7168-wide row, three of a 2048-wide)
  const int64_t pf = kb > 0 ? (12288 + 4 * kb - 1) / (4 * kb) : 1;
  Job base{w, rs, kb, s, xq, xs, L, sx, ex, T, y, ys, 0, N, isa, pf};
  const int64_t blocks = (N + 3) / 4;
  int64_t nt = nthreads < 1 ? 1 : nthreads;
  if (nt > blocks) nt = blocks;
  if (nt > 256) nt = 256;
  if (nt <= 1) {
    run(base);
  } else {
    Job* jobs = (Job*)malloc((size_t)nt * sizeof(Job));
    pthread_t* th = (pthread_t*)malloc((size_t)nt * sizeof(pthread_t));
    bool* ok = (bool*)calloc((size_t)nt, sizeof(bool));
    if (!jobs || !th || !ok) {
      run(base);
    } else {
      for (int64_t i = 0; i < nt; ++i) {
        jobs[i] = base;
        jobs[i].n0 = blocks * i / nt * 4;
        jobs[i].n1 = i + 1 == nt ? N : blocks * (i + 1) / nt * 4;
      }
      for (int64_t i = 1; i < nt; ++i) ok[i] = pthread_create(&th[i], nullptr, thread_main, &jobs[i]) == 0;
      run(jobs[0]);
      for (int64_t i = 1; i < nt; ++i) {
        if (ok[i]) pthread_join(th[i], nullptr);
        else run(jobs[i]);  // could not start a thread: do its rows here
      }
    }
    free(jobs); free(th); free(ok);
  }
  free(xq); free(sx); free(ex);
  return isa;
}

}  // extern "C"
"""

_CXX_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


class _Native:
    """The compiled kernel (or why there is none)."""

    def __init__(self) -> None:
        self.lib: ctypes.CDLL | None = None
        self.best_isa = 0
        self.path: str | None = None
        self.compile_s: float | None = None  # None: loaded from the cache, or not built
        self.error: str | None = None


_native: _Native | None = None
_native_lock = threading.Lock()


def _cache_dir() -> Path:
    env = os.environ.get("HETQUANT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hetquant"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build() -> _Native:
    nat = _Native()
    if os.environ.get("HETQUANT_INT4_BACKEND", "").lower() == "torch":
        nat.error = "disabled by HETQUANT_INT4_BACKEND=torch"
        return nat
    cxx = _compiler()
    if cxx is None:
        nat.error = "no C++ compiler (g++, c++ or clang++) on PATH"
        return nat
    digest = hashlib.sha256(
        "\0".join([_CPP_SOURCE, cxx, *_CXX_FLAGS, os.uname().machine]).encode()
    ).hexdigest()[:16]
    so = None
    for d in (_cache_dir(), Path(tempfile.gettempdir()) / "hetquant-cache"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            so = d / f"int4_gemv-{digest}.so"
            if not so.exists():
                t0 = time.perf_counter()
                src = d / f"int4_gemv-{digest}.cpp"
                tmp_so = d / f".int4_gemv-{digest}-{os.getpid()}-{threading.get_ident()}.so"
                src.write_text(_CPP_SOURCE, encoding="utf-8")
                res = subprocess.run(
                    [cxx, *_CXX_FLAGS, "-o", str(tmp_so), str(src), "-lpthread"],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if res.returncode != 0:
                    tmp_so.unlink(missing_ok=True)
                    nat.error = f"{cxx} failed: {res.stderr.strip()[-2000:]}"
                    return nat
                os.replace(tmp_so, so)
                nat.compile_s = time.perf_counter() - t0
            break
        except (OSError, subprocess.SubprocessError) as e:
            nat.error = f"cannot build in {d}: {e}"
            so = None
    if so is None:
        return nat
    try:
        lib = ctypes.CDLL(str(so))
        fn = lib.hq_int4_gemv
        fn.restype = ctypes.c_int
        i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn.argtypes = [vp, i64, vp, i64, i64, vp, i64, i64, vp, i64, ci, ci, ci]
        lib.hq_int4_best_isa.restype = ctypes.c_int
        lib.hq_int4_best_isa.argtypes = []
        nat.best_isa = int(lib.hq_int4_best_isa())
    except (OSError, AttributeError) as e:
        nat.error = f"cannot load {so}: {e}"
        return nat
    nat.lib, nat.path, nat.error = lib, str(so), None
    return nat


def _get_native() -> _Native:
    global _native
    if _native is None:
        with _native_lock:
            if _native is None:
                nat = _build()
                if nat.lib is None:
                    log.warning("int4 GEMV: native kernel unavailable (%s); using torch", nat.error)
                _native = nat
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

    ``threads``: worker threads of the native kernel for this call (default
    ``torch.get_num_threads()``; small calls use one). ``precision`` (native kernel):
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
