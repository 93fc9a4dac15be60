// hetquant int4 GEMV, part 1 of 4: shared definitions and the generic C++ kernels.
// int4_gemv.py compiles int4_gemv_base.cpp, int4_gemv_x86.cpp, int4_gemv_neon.cpp and
// int4_gemv.cpp as ONE translation unit, in that order. The math, the error bounds and the
// summation order that every instruction path follows are documented in int4_gemv.py.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <pthread.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <new>
#include <vector>
#if defined(HQ_SIMDE)
// Tests only (tests/runtime/kernels/test_int4_gemv_crossisa.py): the x86 paths built on SIMDe's portable
// intrinsics, so that the AVX2 and AVX-512 VNNI code runs, and is checked bit for bit, on any CPU.
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define HQ_X86 1
#elif defined(__x86_64__)
#include <immintrin.h>
#define HQ_X86 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#define HQ_ARM 1
#if defined(__linux__)
#include <sys/auxv.h>
#define HQ_HWCAP_ASIMDDP (1UL << 20)  // HWCAP_ASIMDDP of <asm/hwcap.h>: FEAT_DotProd
#endif
#endif

#if defined(HQ_SIMDE)  // the few intrinsics SIMDe 0.7 lacks, written out
static inline __m512i hq_maskz_loadu_epi8(uint64_t k, const void* p) {
  int8_t b[64] = {0};
  for (int i = 0; i < 64; ++i) b[i] = (k >> i & 1) ? ((const int8_t*)p)[i] : 0;
  __m512i v;
  memcpy(&v, b, 64);
  return v;
}
static inline __m256i hq_maskz_loadu_epi16(uint32_t k, const void* p) {
  int16_t b[16] = {0};
  for (int i = 0; i < 16; ++i) b[i] = (k >> i & 1) ? ((const int16_t*)p)[i] : 0;
  __m256i v;
  memcpy(&v, b, 32);
  return v;
}
static inline __m512i hq_cvtepu16_epi32(__m256i a) {
  uint16_t u[16];
  int32_t w[16];
  memcpy(u, &a, 32);
  for (int i = 0; i < 16; ++i) w[i] = u[i];
  __m512i v;
  memcpy(&v, w, 64);
  return v;
}
static inline int hq_reduce_add_epi32(__m512i a) {
  int32_t w[16];
  memcpy(w, &a, 64);
  uint32_t s = 0;
  for (int i = 0; i < 16; ++i) s += (uint32_t)w[i];
  return (int)s;
}
static inline __m512d hq_cvtps_pd(__m256 a) {
  float f[8];
  double d[8];
  memcpy(f, &a, 32);
  for (int i = 0; i < 8; ++i) d[i] = f[i];
  __m512d v;
  memcpy(&v, d, 64);
  return v;
}
static inline __m512d hq_cvtepi32_pd(__m256i a) {
  int32_t w[8];
  double d[8];
  memcpy(w, &a, 32);
  for (int i = 0; i < 8; ++i) d[i] = w[i];
  __m512d v;
  memcpy(&v, d, 64);
  return v;
}
typedef uint64_t __mmask64;
#define _mm512_cvtps_pd hq_cvtps_pd
#define _mm512_cvtepi32_pd hq_cvtepi32_pd
#define _mm512_maskz_loadu_epi8 hq_maskz_loadu_epi8
#define _mm256_maskz_loadu_epi16 hq_maskz_loadu_epi16
#define _mm512_cvtepu16_epi32 hq_cvtepu16_epi32
#define _mm512_reduce_add_epi32 hq_reduce_add_epi32
#endif

namespace {

constexpr int LMAX = 3;        // signed-byte digits per activation: L = 3 (|X| <= 2^22) or 2 (2^14)
constexpr int64_t PAD = 256;   // digit rows padded with zeros to a multiple of 256 bytes
constexpr int64_t BLK = 16;    // grouped: bytes of one 32-element block, the unit of exact sums
constexpr int NPART = 8;       // grouped: block b is added to double partial sum b % NPART

enum Isa { GENERIC = 1, AVX2 = 2, AVX512_VNNI = 3, NEON_DOTPROD = 4, AMX_INT8 = 5 };

struct Job {
  const uint8_t* w; int64_t rs; int64_t kb;   // packed rows: stride rs bytes, kb = K/2 bytes used
  const float* s;                             // per-channel: scales [N]; grouped: null
  const uint16_t* sg; int64_t ss; int gm;     // grouped: bf16 scales, row stride ss, blocks/group
  const int8_t* xq; int64_t xs; int L;        // digits [T][L][2][xs]: d_l of x[2i] (h=0), x[2i+1] (h=1)
  const int64_t* sx;                          // per token: sum of X (per-channel)
  const int32_t* sx8; int64_t nbp;            // grouped: per token, 8 * (sum of X over block b)
  const double* p2;                           // per token: 2^e
  int64_t T; float* y; int64_t ys;            // y [T, N], row stride ys
  int64_t n0, n1;                             // rows of this worker
  int isa;
  int64_t pf;                                 // prefetch distance in tiles (>= 1)
  int tb = -1;                                // token blocking (int4_gemv.cpp run_blocked)
  const int8_t* xb = nullptr; int64_t xbg = 0;  // AMX: B tiles of the digits, column groups
};

static inline const int8_t* digits(const Job& j, int64_t t, int l, int h) {
  return j.xq + ((t * j.L + l) * 2 + h) * j.xs;
}

static inline double bf16_to_double(uint16_t h) {
  const uint32_t b = (uint32_t)h << 16;
  float f;
  memcpy(&f, &b, 4);
  return (double)f;
}

// Per-channel epilogue. (acc - 8 ΣX) and its product with 2^e are exact in double; one
// rounding by s, one to float.
static inline void finish(const Job& j, int64_t t, int64_t n, int64_t acc) {
  const double v = (double)j.s[n] * ((double)(acc - 8 * j.sx[t]) * j.p2[t]);
  j.y[t * j.ys + n] = (float)v;
}

// Grouped epilogue, the same on every path: the partial sums p[0..7] (p[i] = sum over blocks
// b = i mod 8, in increasing b, of s_b * A_b, each product exact in double) are added as
// ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)), times 2^e (exact), rounded once to float;
// a zero result is stored as +0 (padding blocks may add +0.0 to a -0.0 partial on some paths).
static inline void finish_g(const Job& j, int64_t t, int64_t n, const double* p) {
  const double r0 = (p[0] + p[4]) + (p[2] + p[6]);
  const double r1 = (p[1] + p[5]) + (p[3] + p[7]);
  const float v = (float)((r0 + r1) * j.p2[t]);
  j.y[t * j.ys + n] = v == 0.0f ? 0.0f : v;
}

// A grouped tile (rows n .. n+R-1, tokens t0 .. t0+TT-1) walks its rows in superblocks of SB
// bytes: base pointers of its rows, scales, digits and block sums, and, for a last superblock
// that is partial, zero-padded copies of its weights and scales (digits and block sums are
// padded already). Zero weights and zero scales make the padding blocks add exactly 0.
template <int R, int TT, int L, int64_t SB>
struct GTile {
  const uint8_t* w[R];
  const uint16_t* s[R];
  const int8_t* d[TT][L][2];
  const int32_t* sx8[TT];
  int gshift;  // log2(blocks per group)
  alignas(64) uint8_t tw[R][SB];
  alignas(64) uint16_t ts[R][SB / BLK];

  GTile(const Job& j, int64_t n, int64_t t0) : gshift(__builtin_ctz((unsigned)j.gm)) {
    for (int r = 0; r < R; ++r) {
      w[r] = j.w + (n + r) * j.rs;
      s[r] = j.sg + (n + r) * j.ss;
    }
    for (int t = 0; t < TT; ++t) {
      for (int l = 0; l < L; ++l)
        for (int h = 0; h < 2; ++h) d[t][l][h] = digits(j, t0 + t, l, h);
      sx8[t] = j.sx8 + (t0 + t) * j.nbp;
    }
  }

  // Weights and first scale of superblock `sb` (a byte offset) for each row.
  inline void at(const Job& j, int64_t sb, const uint8_t** wp, const uint16_t** sp) {
    const int64_t g0 = (sb / BLK) >> gshift;
    if (sb + SB <= j.kb) {
      for (int r = 0; r < R; ++r) {
        wp[r] = w[r] + sb;
        sp[r] = s[r] + g0;
      }
      return;
    }
    const int64_t groups = ((j.kb / BLK) >> gshift) - g0;
    for (int r = 0; r < R; ++r) {
      memset(tw[r], 0, sizeof(tw[r]));
      memset(ts[r], 0, sizeof(ts[r]));
      memcpy(tw[r], w[r] + sb, (size_t)(j.kb - sb));
      memcpy(ts[r], s[r] + g0, (size_t)groups * sizeof(uint16_t));
      wp[r] = tw[r];
      sp[r] = ts[r];
    }
  }
};

// Digit layout of the grouped paths that transpose their weight superblocks (gtile_avx2,
// gtile_vnni): a superblock of 4·v bytes (nb = v/4 blocks of 4 words of 4 bytes) is loaded as
// 4 vectors of v bytes and transposed so that vector w holds word w of block b at word pos(b).
// prepare() puts the digits through the same transposition (`digits`, the path's own code), so
// that they meet the weights they multiply, and the block sums of each superblock in position
// order. v = 0: the natural layout.
struct Transposed {
  int64_t v = 0;                                // bytes per vector: 32 (AVX2), 64 (AVX-512)
  bool in_lane = false;                         // pos(b) = 4 (b mod q) + b / q, q = v/16 lanes
  void (*digits)(int8_t*, int64_t) = nullptr;   // transposes `len` bytes (whole superblocks)
  int64_t pos(int64_t b) const {
    const int64_t q = v / 16;
    return in_lane ? 4 * (b % q) + b / q : b;
  }
};

// `n` block sums (whole superblocks).
static void transpose_block_sums(const Transposed& lay, int32_t* sums, int64_t n) {
  const int64_t nb = lay.v / 4;
  int32_t tmp[16];
  for (int64_t s = 0; s < n; s += nb) {
    memcpy(tmp, sums + s, (size_t)nb * sizeof(int32_t));
    for (int64_t b = 0; b < nb; ++b) sums[s + lay.pos(b)] = tmp[b];
  }
}

// Row tiling of the grouped kernels: Kernel::ROWS rows per tile at one token, else one row and
// two tokens (then one). Kernel::tile<R, TT, L>(j, n, t0) is one instruction path's grouped tile.
template <class Kernel, int L>
static void grouped_rows_l(const Job& j) {
  int64_t n = j.n0;
  if (j.T == 1) {
    for (; n + Kernel::ROWS <= j.n1; n += Kernel::ROWS) Kernel::template tile<Kernel::ROWS, 1, L>(j, n, 0);
  }
  for (; n < j.n1; ++n) {
    int64_t t = 0;
    for (; t + 2 <= j.T; t += 2) Kernel::template tile<1, 2, L>(j, n, t);
    if (t < j.T) Kernel::template tile<1, 1, L>(j, n, t);
  }
}

template <class Kernel>
static void grouped_rows(const Job& j) {
  if (j.L == 2) grouped_rows_l<Kernel, 2>(j); else grouped_rows_l<Kernel, 3>(j);
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

// 16-byte block dot product of codes and one digit plane, in a form compilers vectorise.
__attribute__((noinline)) static int32_t block_dot(const uint8_t* __restrict w,
                                                   const int8_t* __restrict de,
                                                   const int8_t* __restrict dd) {
  int32_t sum = 0;
  for (int i = 0; i < BLK; ++i) sum += (int32_t)(w[i] & 15) * de[i] + (int32_t)(w[i] >> 4) * dd[i];
  return sum;
}

// Grouped: A_b = sum over block b of (c - 8) * X, exact (|A_b| <= 2^30), then the double
// partial sums of finish_g.
__attribute__((noinline)) static void run_generic_g(const Job& j) {
  const int64_t nb = j.kb / BLK;
  for (int64_t n = j.n0; n < j.n1; ++n) {
    const uint8_t* w = j.w + n * j.rs;
    const uint16_t* sc = j.sg + n * j.ss;
    for (int64_t t = 0; t < j.T; ++t) {
      double p[NPART] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t b = 0; b < nb; ++b) {
        int64_t a = 0;
        for (int l = j.L - 1; l >= 0; --l)
          a = a * 256 + block_dot(w + b * BLK, digits(j, t, l, 0) + b * BLK, digits(j, t, l, 1) + b * BLK);
        a -= j.sx8[t * j.nbp + b];
        p[b % NPART] += bf16_to_double(sc[b / j.gm]) * (double)a;
      }
      finish_g(j, t, n, p);
    }
  }
}

}  // namespace
