// hetquant FP4 GEMV, part 1 of 3: shared definitions, the activation rounding and the generic
// C++ kernel. int4_gemv.py compiles the int4 parts and then fp4_gemv_base.cpp, fp4_gemv_simd.cpp
// and fp4_gemv.cpp as ONE translation unit: the FP4 kernel reuses the int4 kernel's instruction
// path detection, worker pool and superblock transposes (int4_gemv_base.cpp, _x86.cpp). The math
// and the summation order every path follows are documented in fp4_gemv.py.
#if defined(HQ_SIMDE)  // tests only: an intrinsic SIMDe 0.7 lacks, written out
static inline __m512i hq_cvtepu8_epi64(__m128i a) {
  uint8_t b[16];
  int64_t w[8];
  memcpy(b, &a, 16);
  for (int i = 0; i < 8; ++i) w[i] = b[i];
  __m512i v;
  memcpy(&v, w, 64);
  return v;
}
#define _mm512_cvtepu8_epi64 hq_cvtepu8_epi64
#endif

namespace {

constexpr int64_t F4_BLK = 16;   // bytes of one group of 32 codes (one UE8M0 scale)
constexpr int F4_OFFSET = 12;    // x86: codes as unsigned bytes E2M1_X2[c] + 12, in [0, 24]

// E2M1_X2 of formats/fp4_e2m1.py (2 · E2M1 of each 4-bit code), and the same plus 12: vpdpbusd
// and vpmaddubsw take their weight operand unsigned, so the x86 paths add 12 and subtract
// 12 · (sum of the group's activations) from each group sum; sdot (NEON) takes them signed.
alignas(16) static const int8_t F4_LUT[16] = {0, 1, 2, 3, 4, 6, 8, 12,
                                              0, -1, -2, -3, -4, -6, -8, -12};
alignas(16) static const uint8_t F4_LUTU[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                                12, 11, 10, 9, 8, 6, 4, 0};

struct F4Job {
  const uint8_t* w; int64_t rs; int64_t kb;  // codes: row n at w + n*rs, kb = K/2 bytes used
  const uint8_t* s; int64_t ss;              // UE8M0 bytes: row n at s + n*ss, kb/16 per row
  const int8_t* q; int64_t qs;               // int8 activations [T][2][qs]: x[2i] (h=0), x[2i+1]
  const int32_t* q12; int64_t nbp;           // per token, nbp entries: 12 * (sum of q in group)
  const float* sx;                           // per token: amax / 127
  int64_t T; float* y; int64_t ys;           // y [T, N], row stride ys
  int64_t n0, n1;                            // rows of this job
  int isa;
  int64_t pf;                                // prefetch distance in rows
  int* bad;                                  // set to 1 when a scale byte is 0xFF (NaN)
};

static inline const int8_t* f4_q(const F4Job& j, int64_t t, int h) { return j.q + (t * 2 + h) * j.qs; }

// 2^(e - 128) as a double, exactly (the scale 2^(e - 127) halved: E2M1_X2 is 2 · E2M1).
static inline double f4_pow2(uint8_t e) {
  const uint64_t b = (uint64_t)(e + 1023 - 128) << 52;
  double d;
  memcpy(&d, &b, 8);
  return d;
}

static inline void f4_flag_bad(const F4Job& j) { __atomic_store_n(j.bad, 1, __ATOMIC_RELAXED); }

// The epilogue of every path: partials p[0..7] (p[i] = sum over groups g = i mod 8, in
// increasing g, of 2^(e_g - 128) · A_g, each product exact) added as ((p0 + p4) + (p2 + p6)) +
// ((p1 + p5) + (p3 + p7)), times sx in double, rounded once to float; a zero stored as +0.
static inline void f4_finish(const F4Job& j, int64_t t, int64_t n, const double* p) {
  const double r0 = (p[0] + p[4]) + (p[2] + p[6]);
  const double r1 = (p[1] + p[5]) + (p[3] + p[7]);
  const float v = (float)((r0 + r1) * (double)j.sx[t]);
  j.y[t * j.ys + n] = v == 0.0f ? 0.0f : v;
}

// A tile's view of superblock `sb` (byte offset) of row r: its codes and scale bytes, or, for a
// last superblock that is partial, zero-padded copies (zero codes against zero activations and
// any scale add exactly +0).
template <int R, int64_t SB>
struct F4Rows {
  const uint8_t* w[R];
  const uint8_t* s[R];
  alignas(64) uint8_t tw[R][SB];
  alignas(16) uint8_t ts[R][SB / F4_BLK];

  F4Rows(const F4Job& j, int64_t n) {
    for (int r = 0; r < R; ++r) {
      w[r] = j.w + (n + r) * j.rs;
      s[r] = j.s + (n + r) * j.ss;
    }
  }

  inline void at(const F4Job& j, int64_t sb, const uint8_t** wp, const uint8_t** sp) {
    if (sb + SB <= j.kb) {
      for (int r = 0; r < R; ++r) {
        wp[r] = w[r] + sb;
        sp[r] = s[r] + sb / F4_BLK;
      }
      return;
    }
    for (int r = 0; r < R; ++r) {
      memset(tw[r], 0, sizeof(tw[r]));
      memset(ts[r], 0, sizeof(ts[r]));
      memcpy(tw[r], w[r] + sb, (size_t)(j.kb - sb));
      memcpy(ts[r], s[r] + sb / F4_BLK, (size_t)((j.kb - sb) / F4_BLK));
      wp[r] = tw[r];
      sp[r] = ts[r];
    }
  }
};

// ---------------------------------------------------------------- generic C++ (any CPU)
__attribute__((noinline)) static void f4_run_generic(const F4Job& j) {
  const int64_t nb = j.kb / F4_BLK;
  for (int64_t n = j.n0; n < j.n1; ++n) {
    const uint8_t* w = j.w + n * j.rs;
    const uint8_t* s = j.s + n * j.ss;
    for (int64_t b = 0; b < nb; ++b)
      if (s[b] == 0xFF) f4_flag_bad(j);
    for (int64_t t = 0; t < j.T; ++t) {
      const int8_t* qe = f4_q(j, t, 0);
      const int8_t* qo = f4_q(j, t, 1);
      double p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t b = 0; b < nb; ++b) {
        int32_t a = 0;
        for (int64_t i = b * F4_BLK; i < (b + 1) * F4_BLK; ++i)
          a += F4_LUT[w[i] & 15] * qe[i] + F4_LUT[w[i] >> 4] * qo[i];
        p[b % 8] += f4_pow2(s[b]) * (double)a;
      }
      f4_finish(j, t, n, p);
    }
  }
}

// Activations of T tokens as int8 (fp4_gemv.py): per token sx = amax / 127 (float32) and
// q = round(x / sx), half to even (x / 1 when sx is 0), split by parity of k, in the layout
// `lay` of the path (Transposed; v = 0: natural), with 12 · (group sums) in the same order.
struct F4Prepared {
  int8_t* q = nullptr;
  int32_t* q12 = nullptr;
  float* sx = nullptr;
  int64_t qs = 0, nbp = 0;
  ~F4Prepared() { free(q); free(q12); free(sx); }
};

// 0; -2 out of memory; -3 a NaN/Inf in x; -4 an activation rounds outside [-127, 127] (only
// when amax / 127 is subnormal, below 2^-126: the torch path takes those calls).
static int f4_prepare(const float* x, int64_t xstride, int64_t T, int64_t K, const Transposed& lay,
                      F4Prepared& P) {
  const int64_t kb = K / 2;
  P.qs = (kb + PAD - 1) / PAD * PAD;
  P.nbp = P.qs / F4_BLK;
  P.q = (int8_t*)calloc((size_t)(T * 2 * P.qs), 1);
  P.q12 = (int32_t*)calloc((size_t)(T * P.nbp), sizeof(int32_t));
  P.sx = (float*)malloc((size_t)T * sizeof(float));
  if (!P.q || !P.q12 || !P.sx) return -2;
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * xstride;
    uint32_t abits = 0;  // max of |x| as IEEE bits (NaN sorts above Inf)
    for (int64_t k = 0; k < K; ++k) {
      uint32_t b;
      memcpy(&b, xr + k, 4);
      b &= 0x7FFFFFFFu;
      abits = b > abits ? b : abits;
    }
    if (abits >= 0x7F800000u) return -3;
    float amax;
    memcpy(&amax, &abits, 4);
    const float sx = amax / 127.0f;
    const float div = sx > 0.0f ? sx : 1.0f;
    int8_t* qe = P.q + (t * 2 + 0) * P.qs;
    int8_t* qo = P.q + (t * 2 + 1) * P.qs;
    int bad = 0;
    for (int64_t i = 0; i < kb; ++i) {
      const long a = __builtin_lrintf(xr[2 * i] / div), b = __builtin_lrintf(xr[2 * i + 1] / div);
      bad |= (a < -127) | (a > 127) | (b < -127) | (b > 127);
      qe[i] = (int8_t)a;
      qo[i] = (int8_t)b;
    }
    if (bad) return -4;
    int32_t* q12 = P.q12 + t * P.nbp;
    for (int64_t g = 0; g < kb / F4_BLK; ++g) {
      int32_t sum = 0;
      for (int64_t i = g * F4_BLK; i < (g + 1) * F4_BLK; ++i) sum += qe[i] + qo[i];
      q12[g] = F4_OFFSET * sum;
    }
    if (lay.v > 0) {
      lay.digits(qe, P.qs);
      lay.digits(qo, P.qs);
      transpose_block_sums(lay, q12, P.nbp);
    }
    P.sx[t] = sx;
  }
  return 0;
}

}  // namespace
