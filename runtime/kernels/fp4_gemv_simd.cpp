// hetquant FP4 GEMV, part 2 of 3: the SIMD paths — AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw +
// vpmaddwd) and aarch64 NEON (sdot). Each decodes a byte's two codes with a 16-entry table held
// in a register (vpshufb / vqtbl1q_s8), computes every group's exact integer sum and adds
// 2^(e - 128) times it to the partial of its group (g mod 8) in increasing g, as the generic path
// and fp4_gemv_int8 do: the results are bit-identical. The x86 paths load each superblock of
// codes transposed by 4-byte words (transpose_vnni / transpose_avx2 of int4_gemv_x86.cpp), so
// that their int32 lanes add whole groups; prepare() transposed the activations the same way.
namespace {

#ifdef HQ_X86
// ---------------------------------------------------------------- AVX-512 VNNI
// Superblocks of 256 bytes (16 groups, in natural order across the 16 lanes); lanes 0-7 go to
// the 8 double partials first, then lanes 8-15.
template <int R, int TT>
HQ_VNNI static void f4_tile_vnni(const F4Job& j, int64_t n, int64_t t0) {
  constexpr int64_t SB = 256;
  F4Rows<R, SB> rows(j, n);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)F4_LUTU));
  const __m512i m15 = _mm512_set1_epi8(15);
  const __m512i bias = _mm512_set1_epi64(1023 - 128);
  __m128i bad = _mm_setzero_si128();
  __m512d P[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) P[r][t] = _mm512_setzero_pd();
  for (int64_t sb = 0; sb < j.kb; sb += SB) {
    const uint8_t* wp[R];
    const uint8_t* sp[R];
    rows.at(j, sb, wp, sp);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k)
        _mm_prefetch((const char*)(rows.w[r] + sb + 64 * k + j.pf * j.rs), _MM_HINT_T1);
      __m512i v[4], lo[4], hi[4];
      transpose_vnni(wp[r], v);
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        lo[k] = _mm512_shuffle_epi8(lut, _mm512_and_si512(v[k], m15));
        hi[k] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v[k], 4), m15));
      }
      const __m128i e = _mm_loadu_si128((const __m128i*)sp[r]);
      bad = _mm_or_si128(bad, _mm_cmpeq_epi8(e, _mm_set1_epi8(-1)));
      const __m512d slo = _mm512_castsi512_pd(
          _mm512_slli_epi64(_mm512_add_epi64(_mm512_cvtepu8_epi64(e), bias), 52));
      const __m512d shi = _mm512_castsi512_pd(
          _mm512_slli_epi64(_mm512_add_epi64(_mm512_cvtepu8_epi64(_mm_srli_si128(e, 8)), bias), 52));
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const int8_t* qe = f4_q(j, t0 + t, 0) + sb;
        const int8_t* qo = f4_q(j, t0 + t, 1) + sb;
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          a0 = _mm512_dpbusd_epi32(a0, lo[k], _mm512_loadu_si512(qe + 64 * k));
          a1 = _mm512_dpbusd_epi32(a1, hi[k], _mm512_loadu_si512(qo + 64 * k));
        }
        const __m512i a = _mm512_sub_epi32(_mm512_add_epi32(a0, a1),
                                           _mm512_loadu_si512(j.q12 + (t0 + t) * j.nbp + sb / F4_BLK));
        P[r][t] = _mm512_fmadd_pd(slo, _mm512_cvtepi32_pd(_mm512_castsi512_si256(a)), P[r][t]);
        P[r][t] = _mm512_fmadd_pd(shi, _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a, 1)), P[r][t]);
      }
    }
  }
  if (_mm_movemask_epi8(bad)) f4_flag_bad(j);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      alignas(64) double p[8];
      _mm512_store_pd(p, P[r][t]);
      f4_finish(j, t0 + t, n + r, p);
    }
}

struct F4Vnni {
  static constexpr int ROWS = 2, TOKENS = 4;
  template <int R, int TT>
  HQ_VNNI static void tile(const F4Job& j, int64_t n, int64_t t0) { f4_tile_vnni<R, TT>(j, n, t0); }
};

// ---------------------------------------------------------------- AVX2
// Superblocks of 128 bytes (8 groups): int32 lane 4h + c holds group 2c + h, so lanes 0-3 are
// groups 0 2 4 6 (partials p0 p2 p4 p6) and lanes 4-7 groups 1 3 5 7. vpmaddubsw of codes + 12
// (<= 24) and |q| <= 127: an int16 lane <= 2 · 24 · 127; two chunks of both nibbles <= 24384 <
// 2^15, so the int16 sums are widened (vpmaddwd) every two chunks.
template <int R, int TT>
HQ_AVX2 static void f4_tile_avx2(const F4Job& j, int64_t n, int64_t t0) {
  constexpr int64_t SB = 128;
  F4Rows<R, SB> rows(j, n);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)F4_LUTU));
  const __m256i m15 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i bias = _mm256_set1_epi64x(1023 - 128);
  const __m128i even = _mm_setr_epi8(0, 2, 4, 6, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m128i odd = _mm_setr_epi8(1, 3, 5, 7, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  __m128i bad = _mm_setzero_si128();
  __m256d P[R][TT][2];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) P[r][t][0] = P[r][t][1] = _mm256_setzero_pd();
  for (int64_t sb = 0; sb < j.kb; sb += SB) {
    const uint8_t* wp[R];
    const uint8_t* sp[R];
    rows.at(j, sb, wp, sp);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch((const char*)(rows.w[r] + sb + j.pf * j.rs), _MM_HINT_T1);
      _mm_prefetch((const char*)(rows.w[r] + sb + 64 + j.pf * j.rs), _MM_HINT_T1);
      __m256i v[4], lo[4], hi[4];
      transpose_avx2(wp[r], v);
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        lo[k] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v[k], m15));
        hi[k] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v[k], 4), m15));
      }
      const __m128i e = _mm_loadl_epi64((const __m128i*)sp[r]);
      bad = _mm_or_si128(bad, _mm_cmpeq_epi8(e, _mm_set1_epi8(-1)));
      const __m256d se = _mm256_castsi256_pd(_mm256_slli_epi64(
          _mm256_add_epi64(_mm256_cvtepu8_epi64(_mm_shuffle_epi8(e, even)), bias), 52));
      const __m256d so = _mm256_castsi256_pd(_mm256_slli_epi64(
          _mm256_add_epi64(_mm256_cvtepu8_epi64(_mm_shuffle_epi8(e, odd)), bias), 52));
      for (int t = 0; t < TT; ++t) {
        const int8_t* qe = f4_q(j, t0 + t, 0) + sb;
        const int8_t* qo = f4_q(j, t0 + t, 1) + sb;
        __m256i a = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int k = 0; k < 4; k += 2) {
          const __m256i p0 = _mm256_add_epi16(
              _mm256_maddubs_epi16(lo[k], _mm256_loadu_si256((const __m256i*)(qe + 32 * k))),
              _mm256_maddubs_epi16(hi[k], _mm256_loadu_si256((const __m256i*)(qo + 32 * k))));
          const __m256i p1 = _mm256_add_epi16(
              _mm256_maddubs_epi16(lo[k + 1], _mm256_loadu_si256((const __m256i*)(qe + 32 * k + 32))),
              _mm256_maddubs_epi16(hi[k + 1], _mm256_loadu_si256((const __m256i*)(qo + 32 * k + 32))));
          a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
        }
        a = _mm256_sub_epi32(a, _mm256_loadu_si256((const __m256i*)(j.q12 + (t0 + t) * j.nbp + sb / F4_BLK)));
        P[r][t][0] = _mm256_fmadd_pd(se, _mm256_cvtepi32_pd(_mm256_castsi256_si128(a)), P[r][t][0]);
        P[r][t][1] = _mm256_fmadd_pd(so, _mm256_cvtepi32_pd(_mm256_extracti128_si256(a, 1)), P[r][t][1]);
      }
    }
  }
  if (_mm_movemask_epi8(bad)) f4_flag_bad(j);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      alignas(32) double e[4], o[4], p[8];
      _mm256_store_pd(e, P[r][t][0]);
      _mm256_store_pd(o, P[r][t][1]);
      for (int i = 0; i < 4; ++i) {
        p[2 * i] = e[i];
        p[2 * i + 1] = o[i];
      }
      f4_finish(j, t0 + t, n + r, p);
    }
}

struct F4Avx2 {
  static constexpr int ROWS = 1, TOKENS = 2;
  template <int R, int TT>
  HQ_AVX2 static void tile(const F4Job& j, int64_t n, int64_t t0) { f4_tile_avx2<R, TT>(j, n, t0); }
};
#endif  // HQ_X86

#ifdef HQ_ARM
// ---------------------------------------------------------------- NEON sdot
// One 16-byte register is one group: sdot of the signed table values with q, 4 groups reduced by
// pairwise adds to [A0 .. A3], their scaled values added to float64x2 P[k] = (p[2k], p[2k+1]).
template <int R, int TT>
HQ_DOT static void f4_tile_neon(const F4Job& j, int64_t n, int64_t t0) {
  constexpr int64_t SB = 8 * F4_BLK;
  F4Rows<R, SB> rows(j, n);
  const int8x16_t lut = vld1q_s8(F4_LUT);
  const uint8x16_t m15 = vdupq_n_u8(15);
  int bad = 0;
  float64x2_t P[R][TT][4];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t)
      for (int k = 0; k < 4; ++k) P[r][t][k] = vdupq_n_f64(0.0);
  for (int64_t sb = 0; sb < j.kb; sb += SB) {
    const uint8_t* wp[R];
    const uint8_t* sp[R];
    rows.at(j, sb, wp, sp);
    for (int r = 0; r < R; ++r) __builtin_prefetch(rows.w[r] + sb + j.pf * j.rs, 0, 2);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // groups 4h .. 4h+3 of the superblock
      int32x4_t acc[R][TT][4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const int64_t i = (4 * h + c) * F4_BLK;
        int8x16_t lo[R], hi[R];
        for (int r = 0; r < R; ++r) {
          const uint8x16_t v = vld1q_u8(wp[r] + i);
          lo[r] = vqtbl1q_s8(lut, vandq_u8(v, m15));
          hi[r] = vqtbl1q_s8(lut, vshrq_n_u8(v, 4));
        }
        for (int t = 0; t < TT; ++t) {
          const int8x16_t qe = vld1q_s8(f4_q(j, t0 + t, 0) + sb + i);
          const int8x16_t qo = vld1q_s8(f4_q(j, t0 + t, 1) + sb + i);
          for (int r = 0; r < R; ++r)
            acc[r][t][c] = vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo[r], qe), hi[r], qo);
        }
      }
      for (int r = 0; r < R; ++r) {
        const uint8_t* e = sp[r] + 4 * h;
        bad |= (e[0] == 0xFF) | (e[1] == 0xFF) | (e[2] == 0xFF) | (e[3] == 0xFF);
        const double s4[4] = {f4_pow2(e[0]), f4_pow2(e[1]), f4_pow2(e[2]), f4_pow2(e[3])};
        const float64x2_t s01 = vld1q_f64(s4), s23 = vld1q_f64(s4 + 2);
        for (int t = 0; t < TT; ++t) {
          const int32x4_t* a = acc[r][t];
          const int32x4_t q = vpaddq_s32(vpaddq_s32(a[0], a[1]), vpaddq_s32(a[2], a[3]));
          const float64x2_t d01 = vcvtq_f64_s64(vmovl_s32(vget_low_s32(q)));
          const float64x2_t d23 = vcvtq_f64_s64(vmovl_high_s32(q));
          P[r][t][2 * h] = vfmaq_f64(P[r][t][2 * h], s01, d01);
          P[r][t][2 * h + 1] = vfmaq_f64(P[r][t][2 * h + 1], s23, d23);
        }
      }
    }
  }
  if (bad) f4_flag_bad(j);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      double p[8];
      for (int k = 0; k < 4; ++k) vst1q_f64(p + 2 * k, P[r][t][k]);
      f4_finish(j, t0 + t, n + r, p);
    }
}

struct F4Neon {
  static constexpr int ROWS = 2, TOKENS = 2;
  template <int R, int TT>
  HQ_DOT static void tile(const F4Job& j, int64_t n, int64_t t0) { f4_tile_neon<R, TT>(j, n, t0); }
};
#endif  // HQ_ARM

}  // namespace
