// hetquant int4 GEMV, part 2 of 4: the x86-64 paths (AVX2, AVX-512 VNNI), per-channel and
// grouped. Each function carries its own target attribute; int4_gemv.cpp picks one at run time
// with __builtin_cpu_supports. All paths compute the same integers and the same float epilogue
// as the generic ones in int4_gemv_base.cpp, so their results are bit-identical.
namespace {

#ifdef HQ_X86
// ---------------------------------------------------------------- AVX2: vpmaddubsw + vpmaddwd
#if defined(HQ_SIMDE)
#define HQ_AVX2
#else
#define HQ_AVX2 __attribute__((target("avx2,fma")))
#endif
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
#if defined(HQ_SIMDE)
#define HQ_VNNI
#else
#define HQ_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#endif
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

// ---------------------------------------------------------------- grouped, AVX2
// Superblocks of 128 bytes (8 blocks of 16), loaded as 4 chunks of 32 bytes and transposed by
// 4-byte words within each 16-byte lane (word w of lane h of chunk c -> word c of lane h of vector
// w: 8 unpacks per row and superblock, shared by every digit plane and token), so that in all 4
// vectors word c of lane h holds 4 bytes of block 2c + h. prepare() lays the digits out the same
// way (digits_avx2) and the block sums in the order [0 2 4 6 1 3 5 7]. Per digit plane and
// token the 8 byte products (vpmaddubsw) of the 4 vectors are added in int16 lanes (|sum| <=
// 8 · 3840 < 2^15: exact) and widened by ONE vpmaddwd into the 8 block sums — no horizontal
// reduction — and the planes are combined by Horner in int32 (acc = (acc << 8) + plane; every
// block sum stays below 2^31). Lane 4h + c holds block 2c + h: blocks 0 2 4 6 go to partials p0
// p2 p4 p6 (one ymm of doubles), 1 3 5 7 to p1 p3 p5 p7, each partial still summing its blocks
// in increasing b, so the result is the same bit for bit. The scales of blocks 0 2 4 6 and
// 1 3 5 7 come out of one 16-byte load by a shift and a mask.
//
// Measured on Zen 3 (benchmarks/README.md): with the double epilogue of a superblock issued after
// the next superblock's integer work (its latency then overlaps), and the int16 sums kept in
// chunk order (HQ_OPAQUE: otherwise the compiler re-associates them into a tree that needs all
// 24 products at once and spills), the kernel runs at ~0.93-0.97 of the per-channel kernel's
// weight bytes per second in L1; two rows per tile need 16 nibble registers and were slower.

// Keeps the compiler from re-associating a running sum (no code).
#if defined(HQ_SIMDE)
#define HQ_OPAQUE(v) ((void)0)
#else
#define HQ_OPAQUE(v) __asm__("" : "+x"(v))
#endif

// Scales of the 8 blocks of a superblock (8 / GM bf16 values at s) as doubles: blocks 0 2 4 6,
// then 1 3 5 7.
template <int GM>
HQ_AVX2 static inline void scales_avx2(const uint16_t* s, __m256d* out) {
  if constexpr (GM == 1) {
    const __m128i v = _mm_loadu_si128((const __m128i*)s);  // word i: s[2i] | s[2i+1] << 16
    out[0] = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(v, 16)));
    out[1] = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_and_si128(v, _mm_set1_epi32(-65536))));
  } else {
    __m128i u;
    if constexpr (GM == 2) {
      u = _mm_loadl_epi64((const __m128i*)s);
    } else {
      uint32_t two;
      memcpy(&two, s, 4);
      u = _mm_cvtsi32_si128((int)two);
    }
    u = _mm_unpacklo_epi16(_mm_setzero_si128(), u);         // bf16 -> float: the groups in order
    if constexpr (GM == 4) u = _mm_shuffle_epi32(u, 0x50);  // blocks 0 2 | 4 6: groups 0 0 | 1 1
    out[0] = out[1] = _mm256_cvtps_pd(_mm_castsi128_ps(u));  // GM 2: blocks 2c, 2c+1: group c
  }
}

// The 128 bytes at p as the 4 transposed vectors.
HQ_AVX2 static inline void transpose_avx2(const void* p, __m256i* v) {
  const __m256i a = _mm256_loadu_si256((const __m256i*)p);
  const __m256i b = _mm256_loadu_si256((const __m256i*)p + 1);
  const __m256i c = _mm256_loadu_si256((const __m256i*)p + 2);
  const __m256i e = _mm256_loadu_si256((const __m256i*)p + 3);
  const __m256i ab0 = _mm256_unpacklo_epi32(a, b), ab1 = _mm256_unpackhi_epi32(a, b);
  const __m256i ce0 = _mm256_unpacklo_epi32(c, e), ce1 = _mm256_unpackhi_epi32(c, e);
  v[0] = _mm256_unpacklo_epi64(ab0, ce0);
  v[1] = _mm256_unpackhi_epi64(ab0, ce0);
  v[2] = _mm256_unpacklo_epi64(ab1, ce1);
  v[3] = _mm256_unpackhi_epi64(ab1, ce1);
}

// Transposed::digits of the AVX2 layout: `len` bytes at d, in place.
HQ_AVX2 static void digits_avx2(int8_t* d, int64_t len) {
  for (int64_t s = 0; s < len; s += 128) {
    __m256i v[4];
    transpose_avx2(d + s, v);
    for (int k = 0; k < 4; ++k) _mm256_storeu_si256((__m256i*)(d + s) + k, v[k]);
  }
}

// The integer part of one superblock (weights at w, digits of TT tokens at byte offset sb):
// acc[t] = the 8 block sums of codes times X (8 ΣX not yet subtracted), lanes as above.
template <int TT, int L>
HQ_AVX2 __attribute__((always_inline)) static inline void gcore_avx2(
    const uint8_t* w, const int8_t* const (*d)[L][2], int64_t sb, __m256i* acc) {
  const __m256i m15 = _mm256_set1_epi8(15);
  __m256i v[4];
  transpose_avx2(w, v);
  __m256i p16[TT][L];  // |sum| <= 8 · 3840 < 2^15
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m256i lo = _mm256_and_si256(v[k], m15);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v[k], 4), m15);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 8
      for (int l = 0; l < L; ++l) {
        const __m256i q = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)(d[t][l][0] + sb + 32 * k))),
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(d[t][l][1] + sb + 32 * k))));
        p16[t][l] = k == 0 ? q : _mm256_add_epi16(p16[t][l], q);
        HQ_OPAQUE(p16[t][l]);
      }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
    acc[t] = _mm256_add_epi32(_mm256_madd_epi16(p16[t][L - 1], _mm256_set1_epi16(256)),
                              _mm256_madd_epi16(p16[t][L - 2], _mm256_set1_epi16(1)));
    if constexpr (L == 3)
      acc[t] = _mm256_add_epi32(_mm256_slli_epi32(acc[t], 8), _mm256_madd_epi16(p16[t][0], _mm256_set1_epi16(1)));
  }
}

// The float part of one superblock: s_b · (acc - 8 ΣX) added to the partials of each token.
template <int TT, int GM>
HQ_AVX2 __attribute__((always_inline)) static inline void gfloat_avx2(
    const __m256i* acc, const uint16_t* s, const int32_t* const* sx8, int64_t b0, __m256d (*P)[2]) {
  __m256d sc[2];
  scales_avx2<GM>(s, sc);
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
    const __m256i a = _mm256_sub_epi32(acc[t], _mm256_loadu_si256((const __m256i*)(sx8[t] + b0)));
    P[t][0] = _mm256_fmadd_pd(sc[0], _mm256_cvtepi32_pd(_mm256_castsi256_si128(a)), P[t][0]);
    P[t][1] = _mm256_fmadd_pd(sc[1], _mm256_cvtepi32_pd(_mm256_extracti128_si256(a, 1)), P[t][1]);
  }
}

// One row, TT tokens: the float part of each superblock is issued after the next superblock's
// integer part, so that the latency of its conversions and FMAs overlaps that work.
template <int TT, int L, int GM>
HQ_AVX2 static void gtile_avx2(const Job& j, int64_t n, int64_t t0) {
  constexpr int64_t SB = 128;
  GTile<1, TT, L, SB> g(j, n, t0);
  const uint8_t* w = g.w[0];
  const uint16_t* s = g.s[0];
  const int64_t ahead = j.pf * j.rs;
  __m256d P[TT][2];  // partials p0 p2 p4 p6 and p1 p3 p5 p7
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) P[t][0] = P[t][1] = _mm256_setzero_pd();
  const int64_t full = j.kb / SB * SB;
  __m256i prev[TT];
  for (int64_t sb = 0; sb < full; sb += SB) {
    _mm_prefetch((const char*)(w + sb + ahead), _MM_HINT_T1);
    _mm_prefetch((const char*)(w + sb + 64 + ahead), _MM_HINT_T1);
    __m256i cur[TT];
    gcore_avx2<TT, L>(w + sb, g.d, sb, cur);
    if (sb > 0) gfloat_avx2<TT, GM>(prev, s + (sb - SB) / (BLK * GM), g.sx8, (sb - SB) / BLK, P);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) prev[t] = cur[t];
  }
  if (full > 0) gfloat_avx2<TT, GM>(prev, s + (full - SB) / (BLK * GM), g.sx8, (full - SB) / BLK, P);
  if (full < j.kb) {  // the last, partial superblock: zero-padded copies
    const uint8_t* wp[1];
    const uint16_t* sp[1];
    g.at(j, full, wp, sp);
    gcore_avx2<TT, L>(wp[0], g.d, full, prev);
    gfloat_avx2<TT, GM>(prev, sp[0], g.sx8, full / BLK, P);
  }
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
    alignas(32) double e[4], o[4], p[NPART];
    _mm256_store_pd(e, P[t][0]);
    _mm256_store_pd(o, P[t][1]);
    for (int i = 0; i < 4; ++i) {
      p[2 * i] = e[i];
      p[2 * i + 1] = o[i];
    }
    finish_g(j, t0 + t, n, p);
  }
}

struct GroupedAvx2 {
  static constexpr Transposed LAYOUT{32, true, &digits_avx2};
  static constexpr int ROWS = 1;
  template <int R, int TT, int L>
  HQ_AVX2 static void tile(const Job& j, int64_t n, int64_t t0) {
    static_assert(R == 1, "one row per tile");
    if (j.gm == 1) gtile_avx2<TT, L, 1>(j, n, t0);
    else if (j.gm == 2) gtile_avx2<TT, L, 2>(j, n, t0);
    else gtile_avx2<TT, L, 4>(j, n, t0);
  }
};

// ---------------------------------------------------------------- grouped, AVX-512 VNNI
// Superblocks of 256 bytes (16 blocks), loaded as 4 chunks of 64 bytes and transposed by 4-byte
// words across the superblock (4 two-source permutes, then 4 128-bit lane shuffles: 8 shuffles
// per row and superblock, as many as in-lane unpacks would take): vector w holds word w of
// block b at word b. vpdpbusd of the 4 vectors into one accumulator then gives the 16 block sums
// in block order, with no reduction and no permute; prepare() lays the digits out the same way
// (digits_vnni; the block sums stay in order). Each digit plane and nibble half has its own
// accumulator (chains of 4 vpdpbusd), combined by Horner at the end of the superblock; two rows
// per tile at one token. s_b · A_b is added to the 8 partials: blocks 0-7 of a superblock, then
// 8-15; the float part of a superblock is issued after the next superblock's integer part, as in
// AVX2. Measured on a Xeon (benchmarks/README.md): one Horner chain per nibble half (chains of
// 4 · L vpdpbusd) and one row per tile were slower.

// Scales of the 16 blocks of a superblock (16 / GM bf16 values at s) as doubles: blocks 0-7, 8-15.
template <int GM>
HQ_VNNI static inline void scales_vnni(const uint16_t* s, __m512d& lo, __m512d& hi) {
  __m512i v;
  if constexpr (GM == 1) {
    v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)s));
  } else {
    const __m256i u = GM == 2 ? _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)s))
                              : _mm256_castsi128_si256(_mm_loadl_epi64((const __m128i*)s));
    const __m512i gidx = GM == 2
        ? _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
        : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    v = _mm512_permutexvar_epi32(gidx, _mm512_cvtepu16_epi32(u));  // the group of each block
  }
  const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));  // bf16 -> float
  lo = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
  hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
}

// The 256 bytes at p as the 4 transposed vectors.
HQ_VNNI static inline void transpose_vnni(const void* p, __m512i* v) {
  // word u (0, 1) of blocks 0-7 (two chunks: word w of block 4c + q at word 4q + w of chunk c)
  const __m512i lo01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const __m512i hi01 = _mm512_add_epi32(lo01, _mm512_set1_epi32(2));  // words 2, 3
  const uint8_t* w = (const uint8_t*)p;
  const __m512i c0 = _mm512_loadu_si512(w), c1 = _mm512_loadu_si512(w + 64);
  const __m512i c2 = _mm512_loadu_si512(w + 128), c3 = _mm512_loadu_si512(w + 192);
  const __m512i a01 = _mm512_permutex2var_epi32(c0, lo01, c1), b01 = _mm512_permutex2var_epi32(c0, hi01, c1);
  const __m512i a23 = _mm512_permutex2var_epi32(c2, lo01, c3), b23 = _mm512_permutex2var_epi32(c2, hi01, c3);
  v[0] = _mm512_shuffle_i32x4(a01, a23, 0x44);
  v[1] = _mm512_shuffle_i32x4(a01, a23, 0xEE);
  v[2] = _mm512_shuffle_i32x4(b01, b23, 0x44);
  v[3] = _mm512_shuffle_i32x4(b01, b23, 0xEE);
}

// Transposed::digits of the AVX-512 layout: `len` bytes at d, in place.
HQ_VNNI static void digits_vnni(int8_t* d, int64_t len) {
  for (int64_t s = 0; s < len; s += 256) {
    __m512i v[4];
    transpose_vnni(d + s, v);
    for (int k = 0; k < 4; ++k) _mm512_storeu_si512(d + s + 64 * k, v[k]);
  }
}

// The integer part of one superblock: acc[t] = the 16 block sums of codes times X, in order.
template <int TT, int L>
HQ_VNNI __attribute__((always_inline)) static inline void gcore_vnni(
    const uint8_t* w, const int8_t* const (*d)[L][2], int64_t sb, __m512i* acc) {
  const __m512i m15 = _mm512_set1_epi8(15);
  __m512i v[4];
  transpose_vnni(w, v);
  __m512i lo[4], hi[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    lo[k] = _mm512_and_si512(v[k], m15);
    hi[k] = _mm512_and_si512(_mm512_srli_epi16(v[k], 4), m15);
  }
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
    __m512i a[L][2];  // plane l, low / high nibbles
#pragma GCC unroll 8
    for (int l = 0; l < L; ++l) a[l][0] = a[l][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k)
#pragma GCC unroll 8
      for (int l = L - 1; l >= 0; --l) {
        a[l][0] = _mm512_dpbusd_epi32(a[l][0], lo[k], _mm512_loadu_si512(d[t][l][0] + sb + 64 * k));
        a[l][1] = _mm512_dpbusd_epi32(a[l][1], hi[k], _mm512_loadu_si512(d[t][l][1] + sb + 64 * k));
      }
    acc[t] = _mm512_add_epi32(a[L - 1][0], a[L - 1][1]);
#pragma GCC unroll 8
    for (int l = L - 2; l >= 0; --l)
      acc[t] = _mm512_add_epi32(_mm512_slli_epi32(acc[t], 8), _mm512_add_epi32(a[l][0], a[l][1]));
  }
}

// The float part of one superblock: s_b · (acc - 8 ΣX) added to the partials of each token.
template <int TT, int GM>
HQ_VNNI __attribute__((always_inline)) static inline void gfloat_vnni(
    const __m512i* acc, const uint16_t* s, const int32_t* const* sx8, int64_t b0, __m512d* P) {
  __m512d slo, shi;
  scales_vnni<GM>(s, slo, shi);
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
    const __m512i a = _mm512_sub_epi32(acc[t], _mm512_loadu_si512(sx8[t] + b0));
    P[t] = _mm512_fmadd_pd(slo, _mm512_cvtepi32_pd(_mm512_castsi512_si256(a)), P[t]);
    P[t] = _mm512_fmadd_pd(shi, _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a, 1)), P[t]);
  }
}

template <int R, int TT, int L, int GM>
HQ_VNNI static void gtile_vnni(const Job& j, int64_t n, int64_t t0) {
  constexpr int64_t SB = 256;
  GTile<R, TT, L, SB> g(j, n, t0);
  const int64_t ahead = R * j.pf * j.rs;
  __m512d P[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) P[r][t] = _mm512_setzero_pd();
  const int64_t full = j.kb / SB * SB;
  __m512i prev[R][TT];
  for (int64_t sb = 0; sb < full; sb += SB) {
    __m512i cur[R][TT];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) _mm_prefetch((const char*)(g.w[r] + sb + 64 * k + ahead), _MM_HINT_T1);
      gcore_vnni<TT, L>(g.w[r] + sb, g.d, sb, cur[r]);
    }
    if (sb > 0) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        gfloat_vnni<TT, GM>(prev[r], g.s[r] + (sb - SB) / (BLK * GM), g.sx8, (sb - SB) / BLK, P[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) prev[r][t] = cur[r][t];
  }
  if (full > 0) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      gfloat_vnni<TT, GM>(prev[r], g.s[r] + (full - SB) / (BLK * GM), g.sx8, (full - SB) / BLK, P[r]);
  }
  if (full < j.kb) {  // the last, partial superblock: zero-padded copies
    const uint8_t* wp[R];
    const uint16_t* sp[R];
    g.at(j, full, wp, sp);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      gcore_vnni<TT, L>(wp[r], g.d, full, prev[r]);
      gfloat_vnni<TT, GM>(prev[r], sp[r], g.sx8, full / BLK, P[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      alignas(64) double p[NPART];
      _mm512_store_pd(p, P[r][t]);
      finish_g(j, t0 + t, n + r, p);
    }
}

struct GroupedVnni {
  static constexpr Transposed LAYOUT{64, false, &digits_vnni};
  static constexpr int ROWS = 2;
  template <int R, int TT, int L>
  HQ_VNNI static void tile(const Job& j, int64_t n, int64_t t0) {
    if (j.gm == 1) gtile_vnni<R, TT, L, 1>(j, n, t0);
    else if (j.gm == 2) gtile_vnni<R, TT, L, 2>(j, n, t0);
    else gtile_vnni<R, TT, L, 4>(j, n, t0);
  }
};
#endif  // HQ_X86

}  // namespace
