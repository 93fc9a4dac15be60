// hetquant int4 GEMV, part 3 of 4: the aarch64 NEON dot-product path (ARMv8.2 FEAT_DotProd,
// `sdot`), per-channel and grouped. Compiled with a target attribute, so the object runs on any
// ARMv8 CPU; int4_gemv.cpp picks it at run time when the kernel reports the feature
// (getauxval(AT_HWCAP) & HWCAP_ASIMDDP on Linux). Same integers and same float epilogue as the
// generic path, so the results are bit-identical to it and to the x86 paths.
//
// sdot multiplies signed bytes: the codes c = b & 15 and b >> 4 (0..15) are valid signed bytes,
// so it takes them as they are, against the signed digits, like vpdpbusd on x86.
namespace {

#ifdef HQ_ARM
#if defined(__clang__)
#define HQ_DOT __attribute__((target("dotprod")))
#else
#define HQ_DOT __attribute__((target("arch=armv8.2-a+dotprod")))
#endif

static inline uint8x16_t load_upto16(const uint8_t* p, int64_t left) {
  if (left >= 16) return vld1q_u8(p);
  uint8_t tmp[16] = {0};
  if (left > 0) memcpy(tmp, p, (size_t)left);
  return vld1q_u8(tmp);
}

// ---------------------------------------------------------------- per-channel
// 16 bytes per step; one int32x4 accumulator per (row, token, digit plane), reduced at the end.
template <int R, int TT, int L>
HQ_DOT static inline void tile_neon(const Job& j, int64_t n, int64_t t0) {
  const uint8x16_t m15 = vdupq_n_u8(15);
  int32x4_t acc[R][TT][L];
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 8
      for (int l = 0; l < L; ++l) acc[r][t][l] = vdupq_n_s32(0);
#pragma GCC unroll 4
  for (int64_t i = 0; i < j.kb; i += 16) {
    int8x16_t lo[R], hi[R];
#pragma GCC unroll 64
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = j.w + (n + r) * j.rs + i;
      __builtin_prefetch(p + R * j.pf * j.rs, 0, 2);
      const uint8x16_t v = load_upto16(p, j.kb - i);
      lo[r] = vreinterpretq_s8_u8(vandq_u8(v, m15));
      hi[r] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
    }
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 8
      for (int l = 0; l < L; ++l) {
        const int8x16_t de = vld1q_s8(digits(j, t0 + t, l, 0) + i);
        const int8x16_t dd = vld1q_s8(digits(j, t0 + t, l, 1) + i);
#pragma GCC unroll 64
        for (int r = 0; r < R; ++r) {
          acc[r][t][l] = vdotq_s32(acc[r][t][l], lo[r], de);
          acc[r][t][l] = vdotq_s32(acc[r][t][l], hi[r], dd);
        }
      }
  }
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t) {
      int64_t a = 0;
      for (int l = L - 1; l >= 0; --l) a = a * 256 + vaddvq_s32(acc[r][t][l]);
      finish(j, t0 + t, n + r, a);
    }
}

template <int L>
HQ_DOT static void run_neon_l(const Job& j) {
  int64_t n = j.n0;
  if (j.T == 1) {
    for (; n + 4 <= j.n1; n += 4) tile_neon<4, 1, L>(j, n, 0);
  } else if (j.T == 2) {
    for (; n + 2 <= j.n1; n += 2) tile_neon<2, 2, L>(j, n, 0);
  }
  for (; n < j.n1; ++n) {
    int64_t t = 0;
    for (; t + 4 <= j.T; t += 4) tile_neon<1, 4, L>(j, n, t);
    for (; t < j.T; ++t) tile_neon<1, 1, L>(j, n, t);
  }
}

HQ_DOT static void run_neon(const Job& j) {
  if (j.L == 2) run_neon_l<2>(j); else run_neon_l<3>(j);
}

// ---------------------------------------------------------------- grouped
// One 16-byte register is one block. Per block and token: Horner over the digit planes in int32
// lanes (acc = (acc << 8) + plane), 4 blocks reduced by pairwise adds to [A0, A1, A2, A3], and
// s_b * A_b (exact in double) added to the partials: float64x2 P[k] holds p[2k], p[2k+1].

// Scales of blocks b0 .. b0+3 of row n (b0 a multiple of 4) as two float64x2; past the row: 0.
static inline void scales_neon(const Job& j, int64_t n, int64_t b0, float64x2_t& s01,
                               float64x2_t& s23) {
  const uint16_t* sc = j.sg + n * j.ss;
  const int64_t nb = j.kb / BLK;
  uint16x4_t v;
  if (j.gm == 1 && b0 + 4 <= nb) {
    v = vld1_u16(sc + b0);
  } else {
    uint16_t tmp[4];
    for (int i = 0; i < 4; ++i) tmp[i] = b0 + i < nb ? sc[(b0 + i) / j.gm] : 0;
    v = vld1_u16(tmp);
  }
  const float32x4_t f = vreinterpretq_f32_u32(vshll_n_u16(v, 16));  // bf16 -> float
  s01 = vcvt_f64_f32(vget_low_f32(f));
  s23 = vcvt_high_f64_f32(f);
}

template <int R, int TT, int L>
HQ_DOT static inline void gtile_neon(const Job& j, int64_t n, int64_t t0) {
  const uint8x16_t m15 = vdupq_n_u8(15);
  float64x2_t P[R][TT][4];
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) P[r][t][k] = vdupq_n_f64(0.0);
  for (int64_t sb = 0; sb < j.kb; sb += 8 * BLK) {  // superblock: 8 blocks, partials 0..7
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // blocks 4h .. 4h+3 of the superblock
      int32x4_t acc[R][TT][4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const int64_t i = sb + (4 * h + c) * BLK;
        int8x16_t lo[R], hi[R];
#pragma GCC unroll 64
        for (int r = 0; r < R; ++r) {
          const uint8_t* p = j.w + (n + r) * j.rs + i;
          __builtin_prefetch(p + R * j.pf * j.rs, 0, 2);
          const uint8x16_t v = load_upto16(p, j.kb - i);
          lo[r] = vreinterpretq_s8_u8(vandq_u8(v, m15));
          hi[r] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
        }
#pragma GCC unroll 64
        for (int t = 0; t < TT; ++t)
#pragma GCC unroll 8
          for (int l = L - 1; l >= 0; --l) {
            const int8x16_t de = vld1q_s8(digits(j, t0 + t, l, 0) + i);
            const int8x16_t dd = vld1q_s8(digits(j, t0 + t, l, 1) + i);
#pragma GCC unroll 64
            for (int r = 0; r < R; ++r) {
              int32x4_t a = l == L - 1 ? vdupq_n_s32(0) : vshlq_n_s32(acc[r][t][c], 8);
              a = vdotq_s32(a, lo[r], de);
              acc[r][t][c] = vdotq_s32(a, hi[r], dd);
            }
          }
      }
      const int64_t b0 = sb / BLK + 4 * h;
#pragma GCC unroll 64
      for (int r = 0; r < R; ++r) {
        float64x2_t s01, s23;
        scales_neon(j, n + r, b0, s01, s23);
#pragma GCC unroll 64
        for (int t = 0; t < TT; ++t) {
          const int32x4_t* a = acc[r][t];
          int32x4_t q = vpaddq_s32(vpaddq_s32(a[0], a[1]), vpaddq_s32(a[2], a[3]));  // A0..A3
          q = vsubq_s32(q, vld1q_s32(j.sx8 + (t0 + t) * j.nbp + b0));
          const float64x2_t d01 = vcvtq_f64_s64(vmovl_s32(vget_low_s32(q)));
          const float64x2_t d23 = vcvtq_f64_s64(vmovl_high_s32(q));
          P[r][t][2 * h] = vfmaq_f64(P[r][t][2 * h], s01, d01);
          P[r][t][2 * h + 1] = vfmaq_f64(P[r][t][2 * h + 1], s23, d23);
        }
      }
    }
  }
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t) {
      double p[NPART];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) vst1q_f64(p + 2 * k, P[r][t][k]);
      finish_g(j, t0 + t, n + r, p);
    }
}

template <int L>
HQ_DOT static void run_neon_gl(const Job& j) {
  int64_t n = j.n0;
  if (j.T == 1) {
    for (; n + 2 <= j.n1; n += 2) gtile_neon<2, 1, L>(j, n, 0);
  }
  for (; n < j.n1; ++n) {
    int64_t t = 0;
    for (; t + 2 <= j.T; t += 2) gtile_neon<1, 2, L>(j, n, t);
    if (t < j.T) gtile_neon<1, 1, L>(j, n, t);
  }
}

HQ_DOT static void run_neon_g(const Job& j) {
  if (j.L == 2) run_neon_gl<2>(j); else run_neon_gl<3>(j);
}
#endif  // HQ_ARM

}  // namespace
