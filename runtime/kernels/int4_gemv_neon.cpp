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

// ---------------------------------------------------------------- per-channel
// 64 bytes per step (four 16-byte registers per row, one prefetch per row); one int32x4
// accumulator per (row, token, digit plane), reduced at the end. The last step of a row that is
// not a multiple of 64 bytes runs on a zero-padded copy (digits are padded already).
template <int R, int TT, int L>
HQ_DOT static inline void step_neon(const uint8_t* const* w, const int8_t* const (*d)[L][2],
                                    int64_t i, int32x4_t (*acc)[TT][L]) {
  const uint8x16_t m15 = vdupq_n_u8(15);
#pragma GCC unroll 4
  for (int k = 0; k < 64; k += 16) {
    int8x16_t lo[R], hi[R];
#pragma GCC unroll 64
    for (int r = 0; r < R; ++r) {
      const uint8x16_t v = vld1q_u8(w[r] + k);
      lo[r] = vreinterpretq_s8_u8(vandq_u8(v, m15));
      hi[r] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
    }
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 8
      for (int l = 0; l < L; ++l) {
        const int8x16_t de = vld1q_s8(d[t][l][0] + i + k);
        const int8x16_t dd = vld1q_s8(d[t][l][1] + i + k);
#pragma GCC unroll 64
        for (int r = 0; r < R; ++r) {
          acc[r][t][l] = vdotq_s32(acc[r][t][l], lo[r], de);
          acc[r][t][l] = vdotq_s32(acc[r][t][l], hi[r], dd);
        }
      }
  }
}

template <int R, int TT, int L>
HQ_DOT static inline void tile_neon(const Job& j, int64_t n, int64_t t0) {
  const uint8_t* rows[R];
  const int8_t* d[TT][L][2];
  for (int r = 0; r < R; ++r) rows[r] = j.w + (n + r) * j.rs;
  for (int t = 0; t < TT; ++t)
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < 2; ++h) d[t][l][h] = digits(j, t0 + t, l, h);
  const int64_t ahead = R * j.pf * j.rs, kb = j.kb, full = kb / 64 * 64;
  int32x4_t acc[R][TT][L];
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 8
      for (int l = 0; l < L; ++l) acc[r][t][l] = vdupq_n_s32(0);
  const uint8_t* w[R];
  for (int64_t i = 0; i < full; i += 64) {
#pragma GCC unroll 64
    for (int r = 0; r < R; ++r) {
      w[r] = rows[r] + i;
      __builtin_prefetch(w[r] + ahead, 0, 2);
    }
    step_neon<R, TT, L>(w, d, i, acc);
  }
  if (full < kb) {
    alignas(16) uint8_t tail[R][64];
    for (int r = 0; r < R; ++r) {
      memset(tail[r], 0, 64);
      memcpy(tail[r], rows[r] + full, (size_t)(kb - full));
      w[r] = tail[r];
    }
    step_neon<R, TT, L>(w, d, full, acc);
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

// Scales of blocks i .. i+3 of a superblock (i = 0 or 4; s: the superblock's first scale, one
// per gm blocks) as two float64x2.
HQ_DOT static inline void scales_neon(const uint16_t* s, int i, int gm, float64x2_t& s01,
                                      float64x2_t& s23) {
  uint16x4_t v;
  if (gm == 1) {
    v = vld1_u16(s + i);
  } else if (gm == 2) {
    const uint64_t a = s[i / 2], b = s[i / 2 + 1];
    v = vcreate_u16(a | a << 16 | b << 32 | b << 48);  // s0 s0 s1 s1
  } else {
    v = vld1_dup_u16(s + i / 4);
  }
  const float32x4_t f = vreinterpretq_f32_u32(vshll_n_u16(v, 16));  // bf16 -> float
  s01 = vcvt_f64_f32(vget_low_f32(f));
  s23 = vcvt_high_f64_f32(f);
}

template <int R, int TT, int L>
HQ_DOT static inline void gtile_neon(const Job& j, int64_t n, int64_t t0) {
  constexpr int64_t SB = 8 * BLK;  // superblock: 8 blocks, partials 0..7
  GTile<R, TT, L, SB> g(j, n, t0);
  const uint8x16_t m15 = vdupq_n_u8(15);
  const int64_t ahead = R * j.pf * j.rs;
  float64x2_t P[R][TT][4];
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) P[r][t][k] = vdupq_n_f64(0.0);
  for (int64_t sb = 0; sb < j.kb; sb += SB) {
    const uint8_t* w[R];
    const uint16_t* s[R];
    g.at(j, sb, w, s);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // blocks 4h .. 4h+3 of the superblock: 64 bytes
      int32x4_t acc[R][TT][4];
#pragma GCC unroll 64
      for (int r = 0; r < R; ++r) __builtin_prefetch(g.w[r] + sb + 64 * h + ahead, 0, 2);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const int64_t i = (4 * h + c) * BLK;  // within the superblock
        int8x16_t lo[R], hi[R];
#pragma GCC unroll 64
        for (int r = 0; r < R; ++r) {
          const uint8x16_t v = vld1q_u8(w[r] + i);
          lo[r] = vreinterpretq_s8_u8(vandq_u8(v, m15));
          hi[r] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
        }
#pragma GCC unroll 64
        for (int t = 0; t < TT; ++t)
#pragma GCC unroll 8
          for (int l = L - 1; l >= 0; --l) {
            const int8x16_t de = vld1q_s8(g.d[t][l][0] + sb + i);
            const int8x16_t dd = vld1q_s8(g.d[t][l][1] + sb + i);
#pragma GCC unroll 64
            for (int r = 0; r < R; ++r) {
              int32x4_t a = l == L - 1 ? vdupq_n_s32(0) : vshlq_n_s32(acc[r][t][c], 8);
              a = vdotq_s32(a, lo[r], de);
              acc[r][t][c] = vdotq_s32(a, hi[r], dd);
            }
          }
      }
      const int64_t b0 = sb / BLK + 4 * h;  // first block of this half
#pragma GCC unroll 64
      for (int r = 0; r < R; ++r) {
        float64x2_t s01, s23;
        scales_neon(s[r], 4 * h, j.gm, s01, s23);
#pragma GCC unroll 64
        for (int t = 0; t < TT; ++t) {
          const int32x4_t* a = acc[r][t];
          int32x4_t q = vpaddq_s32(vpaddq_s32(a[0], a[1]), vpaddq_s32(a[2], a[3]));  // A0..A3
          q = vsubq_s32(q, vld1q_s32(g.sx8[t] + b0));
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

struct GroupedNeon {
  static constexpr int ROWS = 2;
  template <int R, int TT, int L>
  HQ_DOT static void tile(const Job& j, int64_t n, int64_t t0) { gtile_neon<R, TT, L>(j, n, t0); }
};
#endif  // HQ_ARM

}  // namespace
