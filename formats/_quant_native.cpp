// hetquant quantize kernels: see hetquant/formats/_quant_native.py. Every float operation mirrors
// the torch reference in formats/nvfp4_codes.py and formats/awq_w4a16.py; keep them in step (the
// one exception, NVFP4's bound count done as a rounding, is proven equal: e2m1_magnitude).
// Plain C++ that g++ -O3 vectorises; the same body is compiled for SSE2 (the x86-64 baseline, or
// whatever the target's baseline is), AVX2 and AVX-512 and chosen at run time. IEEE float ops
// round the same on every path, so every path gives the same bytes.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>
#if defined(__x86_64__)
#define HQ_X86 1
#endif

#define HQ_INLINE inline __attribute__((always_inline))
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"  // vector arguments of inlined helpers: no ABI crossing
#endif

namespace {

constexpr int BLOCK = 16;                 // NVFP4 inputs per E4M3 block scale
constexpr float E2M1_MAX = 6.0f, E4M3_MAX = 448.0f, E4M3_MIN_SUB = 1.0f / 512;
constexpr float QMAX = 15.0f;             // AWQ codes 0..15
constexpr double RANGE_EPS = 1e-5;
constexpr uint32_t ABS = 0x7FFFFFFFu, INF_BITS = 0x7F800000u;
constexpr float ROUND_MAGIC = 12582912.0f;  // M = 1.5 * 2^23: x + M - M rounds x half to even
constexpr int32_t MAGIC_BITS = 0x4B400000;  // bits of M

HQ_INLINE float as_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
HQ_INLINE uint32_t bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

// element i of a row as float32: dtype float32 or bfloat16 (its bits are the high half)
HQ_INLINE float load(const float* p, int64_t i) { return p[i]; }
HQ_INLINE float load(const uint16_t* p, int64_t i) { return as_f32((uint32_t)p[i] << 16); }

// float32 -> float8_e4m3fn bits, exactly c10::detail::fp8e4m3fn_from_fp32_value of torch 2.13
// (round to nearest even; finite overflow and Inf saturate to 448, NaN -> 0x7F)
// The E4M3 code (low 8 bits) of a magnitude's float bits b: below 2^-6 (121 << 23), the smallest
// normal, adding 2^14 (141 << 23) rounds at E4M3's 2^-9 step; from there, rounding to nearest
// even at bit 20 and rebiasing the exponent.
HQ_INLINE uint32_t e4m3_subnormal(uint32_t b) {
  return bits(as_f32(b) + as_f32(141u << 23)) - (141u << 23);
}
HQ_INLINE uint32_t e4m3_normal(uint32_t b) {
  return (b + (uint32_t)(7 - 127) * (1u << 23) + 0x7FFFFu + ((b >> 20) & 1)) >> 20;
}

HQ_INLINE uint8_t e4m3_from_f32(float f) {
  const uint32_t fp8_max = 1087u << 20;      // 480.0f, the first value beyond E4M3's range
  uint32_t b = bits(f);
  const uint32_t sign = b & 0x80000000u;
  b ^= sign;
  uint8_t r;
  if (b >= fp8_max) {
    r = b > INF_BITS ? 0x7F : 0x7E;
  } else if (b < (121u << 23)) {
    r = (uint8_t)e4m3_subnormal(b);
  } else {
    r = (uint8_t)e4m3_normal(b);
    r = r == 0x7F ? 0x7E : r;                // 464 <= |f| < 480 rounds to 480: saturate
  }
  return r | (uint8_t)(sign >> 24);
}

// E4M3 bits (not NaN) -> float32, exact: eeeemmm at float bits 20..26 is the value * 2^-120
HQ_INLINE float f32_from_e4m3(uint8_t v) {
  return as_f32((uint32_t)(v & 0x80) << 24 | (uint32_t)(v & 0x7F) << 20) * 0x1p120f;
}

// float32 -> float16 bits, round to nearest even (IEEE; subnormals; overflow -> Inf)
HQ_INLINE uint16_t f16_from_f32(float f) {
  uint32_t b = bits(f);
  const uint16_t sign = (uint16_t)((b >> 16) & 0x8000);
  b &= ABS;
  if (b > INF_BITS) return sign | 0x7E00;               // NaN
  if (b >= 0x477FF000u) return sign | 0x7C00;           // >= 65520 rounds to Inf
  if (b >= 0x38800000u) {                               // >= 2^-14: normal
    b += (uint32_t)(15 - 127) * (1u << 23) + 0xFFFu + ((b >> 13) & 1);
    return sign | (uint16_t)(b >> 13);
  }
  if (b < 0x33000000u) return sign;                     // <= 2^-25 (a tie to 0) or less
  const uint32_t m = (b & 0x7FFFFFu) | 0x800000u;       // value = m * 2^(e - 150)
  const int sh = 126 - (int)(b >> 23);                  // units of 2^-24: m >> sh, 14..24
  uint32_t q = m >> sh;
  const uint32_t rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);
  q += rem > half || (rem == half && (q & 1));
  return sign | (uint16_t)q;
}

// float16 bits (finite) -> float32, exact: the 15 low bits at float bits 13..27, times 2^112
HQ_INLINE float f32_from_f16(uint16_t h) {
  return as_f32((uint32_t)(h & 0x8000) << 16 | (uint32_t)(h & 0x7FFF) << 13) * 0x1p112f;
}

// Tiles of ROW_TILE rows x KT inputs, row tiles outermost: a tile's codes stay in L1/L2 and
// the K-major stores of a tile touch KT cache lines, not K.
constexpr int64_t ROW_TILE = 128, K_TILE = 256;

struct Tile {
  int64_t N, K, KT, n0 = 0, k0 = 0, rows = 0, kt = 0;
  bool started = false;
  Tile(int64_t n, int64_t k, int64_t tile) : N(n), K(k), KT(tile) {}
  bool next() {  // advance; false when done
    if (!started) {
      started = true;
    } else if ((k0 += KT) >= K) {
      k0 = 0;
      n0 += ROW_TILE;
    }
    rows = N - n0 < ROW_TILE ? N - n0 : ROW_TILE;
    kt = K - k0 < KT ? K - k0 : KT;
    return n0 < N && K > 0;
  }
};

// Asks for the row's next tile segment, so that it is in cache when the tile after this one
// comes back to the row (the hardware prefetchers cannot follow 128 interleaved streams).
template <typename T>
HQ_INLINE void prefetch_next(const T* row, const Tile& t, int64_t KT) {
  const int64_t k1 = t.k0 + KT, k2 = k1 + KT < t.K ? k1 + KT : t.K;
  for (int64_t k = k1; k < k2; k += 64 / (int64_t)sizeof(T)) __builtin_prefetch(row + k, 0, 2);
}

struct Scratch {  // malloc'd bytes, freed on scope exit
  void* p;
  explicit Scratch(int64_t n) : p(malloc((size_t)n)) {}
  ~Scratch() { free(p); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// ------------------------------------------------------------------------------- NVFP4
// One block of 16 as a GCC/clang generic vector (one AVX-512 register, two AVX2, four SSE2).
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

#if defined(__clang__)
#define HQ_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define HQ_SHUFFLE(a, b, ...) \
  __builtin_shuffle(a, b, (std::remove_cv_t<std::remove_reference_t<decltype(a)>>){__VA_ARGS__})
#endif

HQ_INLINE u32x16 load_bits(const float* p) { u32x16 v; memcpy(&v, p, 64); return v; }
HQ_INLINE u32x16 load_bits(const uint16_t* p) {
  u16x16 h;
  memcpy(&h, p, 32);
  return __builtin_convertvector(h, u32x16) << 16;
}

template <typename V, typename H>
HQ_INLINE H halves_max(const V& v) {
  H lo, hi;
  memcpy(&lo, &v, sizeof(H));
  memcpy(&hi, (const char*)&v + sizeof(H), sizeof(H));
  return hi > lo ? hi : lo;
}

// The largest of 16 magnitudes' bits (below 2^31, so signed lanes: SSE2 has their compare),
// halved down to one 4-lane vector, then two swaps within it: no lane goes through a scalar.
HQ_INLINE uint32_t block_max(const u32x16& v) {
  const i32x4 q = halves_max<i32x8, i32x4>(halves_max<i32x16, i32x8>((i32x16)v));
  const i32x4 p = HQ_SHUFFLE(q, q, 2, 3, 0, 1), a = p > q ? p : q;
  const i32x4 r = HQ_SHUFFLE(a, a, 1, 0, 3, 2), b = r > a ? r : a;
  return (uint32_t)b[0];
}

// E2M1 magnitude index of y = |w| / step: the count of the bounds 0.25 0.75 1.25 1.75 2.5 3.5 5
// that y passes (> below odd codes, >= below even ones: ties go to the even code), 0 for y < 0
// or NaN. That is y rounded to the E2M1 grid (0 0.5 1 1.5 2 3 4 6) to nearest even: below 1
// the grid step is 0.5, so y + 2^22 (ulp 0.5) rounds it; from 1 up, y's bits rounded to one
// mantissa bit are the code (1.0 -> 2), saturating at 7. Integer masks, not branches, select,
// so every path vectorises; tests/formats/test_native_quant.py holds it to the comparisons.
HQ_INLINE int32_t e2m1_magnitude(float y) {
  const int32_t yb = (int32_t)bits(y);
  const int32_t sub = (int32_t)bits(y + 4194304.0f) - (149 << 23);
  int32_t nrm = ((yb + 0x1FFFFF + ((yb >> 22) & 1)) >> 22) - 252;
  nrm = nrm > 7 ? 7 : nrm;
  const int32_t low = -(int32_t)(yb < 0x3F800000);  // all ones below 1
  const int32_t m = (sub & low) | (nrm & ~low);
  return m & -(int32_t)((yb >= 0) & (yb <= 0x7F800000));  // y < 0 or NaN: no bound passed
}

// Block maxima of inputs [0, K) of one row, as bits: amax[K/16]. False on NaN/Inf.
template <typename T>
HQ_INLINE bool nvfp4_amax(const T* w, int64_t K, uint32_t* amax) {
  uint32_t all = 0;
  for (int64_t b = 0; b < K / BLOCK; ++b) {  // integer max of the bits, NaN above Inf
    const uint32_t m = block_max(load_bits(w + b * BLOCK) & ABS);
    amax[b] = m;
    all = m > all ? m : all;
  }
  return all < INF_BITS;
}

// e4m3_from_f32 of a block scale's bits b, a float within [2^-9, 448]: the general encode's two
// finite cases, both computed and one chosen by an integer mask, so that loops over it vectorise.
HQ_INLINE uint32_t e4m3_scale(int32_t b) {
  const int32_t sub = (int32_t)e4m3_subnormal((uint32_t)b), nrm = (int32_t)e4m3_normal((uint32_t)b);
  const int32_t low = -(int32_t)(b < (121 << 23));
  return (uint32_t)((sub & low) | (nrm & ~low));
}

// block_scales_from_amax, then effective_scale, of n blocks at once (a tile's: one long loop
// that vectorises, where one row's 16 blocks were a scalar chain each): E4M3 scales e[n] and
// steps eff[n]. s2 > 0, so sb = amax / (6 s2) >= 0 (amax finite) and its bits order like it:
// the clamps are integer ones. The codes stay in 32-bit lanes (e: bytes would make the loop
// narrow through shuffles, as the codes loops did).
HQ_INLINE void nvfp4_scales(const uint32_t* __restrict amax, int64_t n, float s2,
                            uint32_t* __restrict e, float* __restrict eff) {
  const float denom = E2M1_MAX * s2;  // torch: E2M1_MAX * s2, a float32 0-d tensor
  const int32_t one = (int32_t)bits(1.0f), lo = (int32_t)bits(E4M3_MIN_SUB);
  const int32_t hi = (int32_t)bits(E4M3_MAX);
  for (int64_t b = 0; b < n; ++b) {
    int32_t sb = (int32_t)bits(as_f32(amax[b]) / denom);
    sb = sb == 0 ? one : sb;  // a zero block's scale is 1
    sb = sb < lo ? lo : (sb > hi ? hi : sb);
    const uint32_t code = e4m3_scale(sb);
    e[b] = code;
    // f32_from_e4m3 of a positive code, without its sign masks (which cost AVX2 6 % here)
    eff[b] = as_f32(code << 20) * 0x1p120f * s2;
  }
}

// e2m1_codes(|x| / s, x < 0): the code of input x with step s, sign << 3 | magnitude index.
HQ_INLINE int32_t e2m1_code(float x, float s) {
  return e2m1_magnitude(__builtin_fabsf(x) / s) + (x < 0.0f) * 8;
}

// Codes of inputs [0, K) of one row, each block's step in eff[K/16], in 32-bit lanes (stored
// as bytes, the vectoriser narrowed them through shuffles).
template <typename T>
HQ_INLINE void nvfp4_codes(const T* w, int64_t K, const float* eff, uint32_t* __restrict codes) {
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const float s = eff[b];
    for (int j = 0; j < BLOCK; ++j)
      codes[b * BLOCK + j] = (uint32_t)e2m1_code(load(w, b * BLOCK + j), s);
  }
}

typedef float f32x16 __attribute__((vector_size(64)));

// e2m1_magnitude of a block's 16 quotients: the same integer masks, on vector lanes.
HQ_INLINE i32x16 e2m1_magnitude16(const f32x16& y) {
  const i32x16 yb = (i32x16)y;
  const i32x16 sub = (i32x16)(y + 4194304.0f) - (149 << 23);
  i32x16 nrm = ((yb + 0x1FFFFF + ((yb >> 22) & 1)) >> 22) - 252;
  const i32x16 big = nrm > 7;
  nrm = (nrm & ~big) | (7 & big);
  const i32x16 low = yb < 0x3F800000;
  const i32x16 m = (sub & low) | (nrm & ~low);
  return m & (i32x16)((u32x16)yb <= INF_BITS);  // y < 0 (sign bit set) or NaN: 0
}

// The codes of one block of 16 inputs (bits x) with step s, in 32-bit lanes:
// e2m1_codes(|w| / s, w < 0) = sign << 3 | magnitude index.
HQ_INLINE i32x16 block_codes16(const u32x16& x, float s) {
  const f32x16 q = (f32x16)(x & ABS) / s;
  const i32x16 neg = (f32x16)x < 0.0f;
  return e2m1_magnitude16(q) + (neg & 8);
}

// Codes of 8 rows of a tile (inputs [0, kt) of rows w, w + K, ...; row r's block steps at
// eff[r * tb ..]) as K-major words: words[k] holds row r's code in nibble r. Codes stay in
// 32-bit lanes from load to word (a loop that writes them as bytes vectorises into byte
// narrowing shuffles, all on one port of Intel's AVX-512 cores). Two bodies, the same bytes:
// - Block (AVX-512): a block is one register, ORed over the 8 rows in place. A 16-lane vector
//   is split on narrower targets, and its compares then go lane by lane.
// - otherwise a loop over each row's inputs that the compiler vectorises at its own width,
//   ORing into the zeroed words (AVX2 and SSE2 measure faster so).
template <bool Block, typename T>
HQ_INLINE void nvfp4_words8(const T* w, int64_t K, int64_t kt, const float* eff, int64_t tb,
                            uint32_t* __restrict words) {
  if constexpr (Block) {
    for (int64_t b = 0; b < kt / BLOCK; ++b) {
      u32x16 acc = {};
      for (int r = 0; r < 8; ++r) {
        acc |= (u32x16)block_codes16(load_bits(w + r * K + b * BLOCK), eff[r * tb + b]) << (4 * r);
      }
      memcpy(words + b * BLOCK, &acc, sizeof acc);
    }
    return;
  }
  memset(words, 0, (size_t)kt * 4);
  for (int r = 0; r < 8; ++r) {
    const T* __restrict x = w + r * K;
    for (int64_t b = 0; b < kt / BLOCK; ++b) {
      const float s = eff[r * tb + b];
      for (int j = 0; j < BLOCK; ++j)  // in nibble r
        words[b * BLOCK + j] |= (uint32_t)e2m1_code(load(x, b * BLOCK + j), s) << (4 * r);
    }
  }
}

// Where hq_nvfp4_quantize puts its codes and scales: the rows it quantizes are rows row0 ..
// of a weight of NT rows, whose stored tensors q and sc are in ``layout``.
enum { NVFP4_ROWS = 0, NVFP4_KMAJOR = 1, NVFP4_TILED = 2 };
struct Nvfp4Out {
  uint8_t* q;
  uint8_t* sc;
  int64_t NT, row0;
  int layout;
};

// Byte (k, c) of the K-major packed codes [K, NT/2] (byte column c = n / 2) in the layout:
// row-major, or the Ascend tile order of formats/nvfp4_ascend_tiles.py (k = 64 K3 + 16 K2 + 8 K1 + K0,
// c = 128 N3 + 16 N2 + 4 N1 + N0, bytes ordered K3 > K1 > K2 > N2 > N3 > N1 > K0 > N0).
HQ_INLINE int64_t kmajor_at(const Nvfp4Out& o, int64_t k, int64_t c) {
  const int64_t NB = o.NT / 2;
  if (o.layout != NVFP4_TILED) return k * NB + c;
  const int64_t slab = (((k >> 6) * 2 + ((k >> 3) & 1)) * 4 + ((k >> 4) & 3)) * 8 + ((c >> 4) & 7);
  return ((slab * (NB >> 7) + (c >> 7)) << 7) + ((((c >> 2) & 3) * 8 + (k & 7)) << 2) + (c & 3);
}

typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));

// Stores a tile (inputs k0 .. k0+kt of rows n0 .., the first at w, rows K apart; steps
// eff[rows][kt/16], scales [rows][KT/16]) in the canonical layout: weight [NT, K/2] with k = 2j
// in the low nibble, weight_scale [NT, K/16]. With Block (AVX-512) a block's codes go from
// 32-bit lanes to bytes directly: lanes 2j and 2j + 1 read as one 64-bit lane c, c | c >> 28
// holds their byte in its low 8 bits (one narrowing, vpmovqb). Otherwise a row's codes go
// through codes[KT] and are paired from there.
template <bool Block, typename T>
HQ_INLINE void nvfp4_store_rows(const Tile& t, const T* w, const float* eff, uint32_t* codes,
                                const uint8_t* scales, const Nvfp4Out& o) {
  const int64_t tb = t.kt / BLOCK;
  for (int64_t i = 0; i < t.rows; ++i) {
    const T* x = w + i * t.K;
    const int64_t n = o.row0 + t.n0 + i;
    uint8_t* out = o.q + n * (t.K / 2) + t.k0 / 2;
    if constexpr (Block) {
      for (int64_t b = 0; b < tb; ++b) {
        const u64x8 c = (u64x8)block_codes16(load_bits(x + b * BLOCK), eff[i * tb + b]);
        const u8x8 pairs = __builtin_convertvector(c | c >> 28, u8x8);
        memcpy(out + b * (BLOCK / 2), &pairs, BLOCK / 2);
      }
    } else {
      nvfp4_codes(x, t.kt, eff + i * tb, codes);
      for (int64_t j = 0; j < t.kt / 2; ++j)
        out[j] = (uint8_t)(codes[2 * j] | codes[2 * j + 1] << 4);
    }
    memcpy(o.sc + n * (t.K / BLOCK) + t.k0 / BLOCK, scales + i * (t.KT / BLOCK), (size_t)tb);
  }
}

// Tile order, a tile of whole 32-row runs: per 8 k (K0) the four 8-row words of each N1 make
// one contiguous 128-byte run. words[g * KT + k]: the word of rows 8g .. 8g+7 at input k.
HQ_INLINE void nvfp4_store_runs(const Tile& t, const Nvfp4Out& o, const uint32_t* words) {
  for (int64_t i = 0; i < t.rows; i += 32) {
    const uint32_t* w = words + (i / 8) * t.KT;
    const int64_t col = (o.row0 + t.n0 + i) / 2;  // a multiple of 16: N1 = N0 = 0
    for (int64_t k = 0; k < t.kt; k += 8) {
      uint8_t* dst = o.q + kmajor_at(o, t.k0 + k, col);
      for (int n1 = 0; n1 < 4; ++n1) memcpy(dst + 32 * n1, w + n1 * t.KT + k, 32);
    }
  }
}

// The same tile K-major: weight [K, NT/2] with n even in the low nibble (row-major or in tile
// order), weight_scale [K/16, NT]; here the tile's scales are [KT/16][ROW_TILE] (a block's
// rows in one run). Eight rows make one 4-byte word per k (nvfp4_words8, from the tile's rows
// w and their steps eff[rows][tb]): in tile order one N0 unit, stored whole where it is
// aligned, and whole 128-byte runs where the tile covers them. A last pair of rows (rows and
// row0 are even) goes through codes[2][KT]. words[ROW_TILE / 8 * KT] is scratch.
template <bool Block, typename T>
HQ_INLINE void nvfp4_store_kmajor(const Tile& t, const T* w, const float* eff, uint32_t* codes,
                                  const uint8_t* scales, const Nvfp4Out& o, uint32_t* words) {
  const bool runs = o.layout == NVFP4_TILED && (o.row0 + t.n0) % 32 == 0 && t.rows % 32 == 0;
  const int64_t tb = t.kt / BLOCK;
  int64_t i = 0;
  for (; i + 8 <= t.rows; i += 8) {  // 8 rows = 4 bytes of each output row
    uint32_t* __restrict wd = words + (i / 8) * t.KT;
    nvfp4_words8<Block>(w + i * t.K, t.K, t.kt, eff + i * tb, tb, wd);
    const int64_t col = (o.row0 + t.n0 + i) / 2;
    if (runs) {
      continue;  // stored below, run by run
    } else if (o.layout != NVFP4_TILED || col % 4 == 0) {
      for (int64_t k = 0; k < t.kt; ++k) memcpy(o.q + kmajor_at(o, t.k0 + k, col), wd + k, 4);
    } else {
      for (int64_t k = 0; k < t.kt; ++k)
        for (int b = 0; b < 4; ++b)
          o.q[kmajor_at(o, t.k0 + k, col + b)] = (uint8_t)(wd[k] >> (8 * b));
    }
  }
  if (runs) nvfp4_store_runs(t, o, words);
  for (; i < t.rows; i += 2) {
    for (int r = 0; r < 2; ++r)
      nvfp4_codes(w + (i + r) * t.K, t.kt, eff + (i + r) * tb, codes + r * t.KT);
    const int64_t col = (o.row0 + t.n0 + i) / 2;
    for (int64_t k = 0; k < t.kt; ++k)
      o.q[kmajor_at(o, t.k0 + k, col)] = (uint8_t)(codes[k] | codes[t.KT + k] << 4);
  }
  for (int64_t b = 0; b < t.kt / BLOCK; ++b)  // scales [KT/16][ROW_TILE]: one run per block
    memcpy(o.sc + (t.k0 / BLOCK + b) * o.NT + o.row0 + t.n0, scales + b * ROW_TILE, (size_t)t.rows);
}

// A tile in three passes: every row's block maxima, the scales of all the tile's blocks, the codes;
// then its stores.
template <bool Block, typename T>
HQ_INLINE int nvfp4_rows(const T* w, int64_t N, int64_t K, float s2, const Nvfp4Out& o) {
  const int64_t KT = K_TILE, kb = KT / BLOCK, NB = ROW_TILE * kb;  // blocks per tile
  Scratch buf(ROW_TILE / 8 * KT * 4 + NB * 12 + 2 * KT * 4 + ROW_TILE * kb);
  if (!buf.p) return -2;
  uint32_t* words = (uint32_t*)buf.p;
  uint32_t* amax = words + ROW_TILE / 8 * KT;
  float* eff = (float*)(amax + NB);
  uint32_t* e = (uint32_t*)(eff + NB);  // [rows][tb], as amax and eff
  uint32_t* codes = e + NB;  // [2][KT]: one row's codes, or the last pair of rows'
  uint8_t* scales = (uint8_t*)(codes + 2 * KT);  // rows: [rows][kb]; K-major: [kb][ROW_TILE]
  const bool rows = o.layout == NVFP4_ROWS;
  for (Tile t(N, K, KT); t.next();) {
    const int64_t tb = t.kt / BLOCK;  // blocks of a row in this tile
    for (int64_t i = 0; i < t.rows; ++i) {
      const T* row = w + (t.n0 + i) * K;
      prefetch_next(row, t, KT);
      if (!nvfp4_amax(row + t.k0, t.kt, amax + i * tb)) return -1;
    }
    nvfp4_scales(amax, t.rows * tb, s2, e, eff);
    for (int64_t i = 0; i < t.rows; ++i)
      for (int64_t b = 0; b < tb; ++b)
        scales[rows ? i * kb + b : b * ROW_TILE + i] = (uint8_t)e[i * tb + b];
    const T* tile = w + t.n0 * K + t.k0;
    if (rows) {
      nvfp4_store_rows<Block>(t, tile, eff, codes, scales, o);
    } else {
      nvfp4_store_kmajor<Block>(t, tile, eff, codes, scales, o, words);
    }
  }
  return 0;
}

template <typename T>
HQ_INLINE float absmax(const T* w, int64_t count) {
  uint32_t m = 0;
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t a = bits(load(w, i)) & ABS;
    m = a > m ? a : m;
  }
  return as_f32(m);
}

// --------------------------------------------------------------------------- AWQ RTN
// float bits -> int32 whose order is that of the (non-NaN) floats (-0 sorts just below +0)
HQ_INLINE int32_t order_key(uint32_t b) {
  const int32_t s = (int32_t)b;
  return s ^ ((s >> 31) & 0x7FFFFFFF);
}
HQ_INLINE float from_order_key(int32_t key) { return as_f32((uint32_t)order_key((uint32_t)key)); }

// Scale (FP16 bits), its float32 value and the zero point of a group with extremes lo, hi
// (finite). Branch-free, so that the params of a tile's groups, computed in one loop, overlap
// (each is a ~100-cycle chain of divides and conversions). ok &= 0 when the scale overflows FP16.
HQ_INLINE void awq_params(float lo, float hi, uint16_t* s16, float* sf, float* z, uint32_t* ok) {
  lo = lo > 0.0f ? 0.0f : lo;  // lo.clamp(max=0), hi.clamp(min=0)
  hi = hi < 0.0f ? 0.0f : hi;
  double span = (double)hi - (double)lo;  // float64, as (hi.double() - lo.double())
  span = span < RANGE_EPS ? RANGE_EPS : span;
  const double x = span / (double)QMAX;
  uint16_t h = f16_from_f32((float)x);           // torch: float64 -> float32 -> float16
  h = (uint16_t)(h + ((double)f32_from_f16(h) < x));  // _round_up_f16: nextafter towards +Inf
  *ok &= h < 0x7C00;
  h = h < 0x7C00 ? h : 0x3C00;  // an overflow's scale is never used: keep the math finite
  *s16 = h;
  *sf = f32_from_f16(h);
  float t = lo / *sf;  // z = clamp(-round(lo / s), 0, 15); clamping t first is equivalent
  t = t < -16.0f ? -16.0f : t;
  const float zz = -((t + ROUND_MAGIC) - ROUND_MAGIC);
  *z = zz > QMAX ? QMAX : (zz < 0.0f ? 0.0f : zz);
}

// The order keys of each group's extremes over inputs [0, K) of one row (whole groups of g):
// lo[K/g], hi[K/g]. False on NaN/Inf.
template <typename T>
HQ_INLINE bool awq_extremes(const T* w, int64_t K, int64_t g, int32_t* lo, int32_t* hi) {
  uint32_t amax = 0;
  for (int64_t j = 0; j < K / g; ++j) {
    const T* p = w + j * g;
    int32_t l = INT32_MAX, h = INT32_MIN;  // min/max of order keys (integer, vectorises)
    for (int64_t k = 0; k < g; ++k) {
      const uint32_t b = bits(load(p, k));
      const int32_t key = order_key(b);
      l = key < l ? key : l;
      h = key > h ? key : h;
      const uint32_t a = b & ABS;
      amax = a > amax ? a : amax;
    }
    lo[j] = l;
    hi[j] = h;
  }
  return amax < INF_BITS;
}

// Code of t = w / s with zero point zi: clamp(round(t) + z, 0, 15).
HQ_INLINE int32_t awq_code(float t, int32_t zi) {
  // fl(t + M) = M + round(t) for |t| <= 16 (M = 1.5 * 2^23, where the float step is 1), and
  // its order key grows with t, so the key clamped to M -+ 16, minus M's, is
  // clamp(round(t), -16, 16); that clamp does not change the clamp to 0..15 after + z.
  int32_t r = order_key(bits(t + ROUND_MAGIC));
  r = r < MAGIC_BITS - 16 ? MAGIC_BITS - 16 : (r > MAGIC_BITS + 16 ? MAGIC_BITS + 16 : r);
  int32_t v = r - MAGIC_BITS + zi;
  return v < 0 ? 0 : (v > 15 ? 15 : v);
}

// Codes of a tile's rows (the tile's first input of its first row at w, rows K apart) straight
// into their AutoAWQ words: words[c * KTP + k] (KTP = KT + 16) holds rows 8c .. 8c+7 at input k,
// row 8c + r in nibble (r >> 1) + 4 (r & 1), the inverse of AWQ_ORDER. Group j of row i has
// float scale sf[i * GT + j] and zero point zf[i * GT + j]: q = clamp(round(w / s) + z, 0, 15).
// Codes stay in 32-bit lanes, as in nvfp4_words8; each row ORs its nibble into zeroed words.
// (A product with fl(1 / s), recoded by the divide where one lands near a tie, was measured
// slower on Zen 4.)
template <typename T>
HQ_INLINE void awq_words(const Tile& t, const T* w, int64_t g, const float* sf, const float* zf,
                         int64_t GT, uint32_t* words) {
  const int64_t KTP = t.KT + 16;
  memset(words, 0, (size_t)(t.rows / 8 * KTP) * 4);
  for (int64_t i = 0; i < t.rows; ++i) {
    const T* __restrict row = w + i * t.K;
    uint32_t* __restrict wc = words + (i / 8) * KTP;
    const int r = (int)(i % 8), shift = 4 * ((r >> 1) + 4 * (r & 1));
    for (int64_t j = 0; j < t.kt / g; ++j) {
      const float s = sf[i * GT + j];
      const int32_t z = (int32_t)zf[i * GT + j];
      for (int64_t k = j * g; k < (j + 1) * g; ++k)
        wc[k] |= (uint32_t)awq_code(load(row, k) / s, z) << shift;
    }
  }
}

// AutoAWQ word of 8 rows' codes: nibble i holds row AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)
HQ_INLINE uint32_t awq_word(const uint8_t* c, int64_t stride, int64_t k) {
  return (uint32_t)c[k] | (uint32_t)c[2 * stride + k] << 4 | (uint32_t)c[4 * stride + k] << 8 |
         (uint32_t)c[6 * stride + k] << 12 | (uint32_t)c[stride + k] << 16 |
         (uint32_t)c[3 * stride + k] << 20 | (uint32_t)c[5 * stride + k] << 24 |
         (uint32_t)c[7 * stride + k] << 28;
}

// r[j] = (a[0][j], a[1][j], a[2][j], a[3][j]) for the rows a[i] = p + i * stride (4 words each).
HQ_INLINE void transpose4(const uint32_t* p, int64_t stride, u32x4* r) {
  u32x4 a[4];
  for (int i = 0; i < 4; ++i) memcpy(&a[i], p + i * stride, 16);
  const u32x4 lo01 = HQ_SHUFFLE(a[0], a[1], 0, 4, 1, 5), hi01 = HQ_SHUFFLE(a[0], a[1], 2, 6, 3, 7);
  const u32x4 lo23 = HQ_SHUFFLE(a[2], a[3], 0, 4, 1, 5), hi23 = HQ_SHUFFLE(a[2], a[3], 2, 6, 3, 7);
  r[0] = HQ_SHUFFLE(lo01, lo23, 0, 1, 4, 5);
  r[1] = HQ_SHUFFLE(lo01, lo23, 2, 3, 6, 7);
  r[2] = HQ_SHUFFLE(hi01, hi23, 0, 1, 4, 5);
  r[3] = HQ_SHUFFLE(hi01, hi23, 2, 3, 6, 7);
}

// A tile's packed words (awq_words) into qweight [K, NT/8] and qzeros [K/g, NT/8] (W = NT/8
// words a row, the pointers already at the chunk's first column): the tile's (at most 16) words
// of one k are one run of qweight's row k. (KTP = KT + 16: the c rows of words do not share cache
// sets); stores go run by run, never down a column of stride NT/2 bytes, whose lines would fall
// in a few L1 sets.
HQ_INLINE void awq_store(const Tile& t, int64_t g, int64_t W, const uint8_t* zeros,
                         const uint32_t* words, int32_t* qw, int32_t* qz) {
  const int64_t KT = t.KT, KTP = KT + 16, GT = KT / g, C = t.rows / 8, col = t.n0 / 8;
  int64_t k = 0;
  if (C % 4 == 0)  // 4 x 4 word transposes: vector loads of words' rows, vector stores of runs
    for (; k + 4 <= t.kt; k += 4)
      for (int64_t c = 0; c < C; c += 4) {
        u32x4 r[4];
        transpose4(words + c * KTP + k, KTP, r);
        for (int j = 0; j < 4; ++j) memcpy(qw + (t.k0 + k + j) * W + col + c, &r[j], 16);
      }
  for (; k < t.kt; ++k)
    for (int64_t c = 0; c < C; ++c) qw[(t.k0 + k) * W + col + c] = (int32_t)words[c * KTP + k];
  for (int64_t j = 0; j < t.kt / g; ++j)
    for (int64_t c = 0; c < C; ++c)
      qz[(t.k0 / g + j) * W + col + c] = (int32_t)awq_word(zeros + 8 * c * GT, GT, j);
}

// A tile in four passes: each group's extremes, the params of all the tile's groups, the codes
// into packed words, the stores.
template <typename T>
HQ_INLINE int awq_rows(const T* w, int64_t R, int64_t K, int64_t g, int32_t* qw, int32_t* qz,
                       uint16_t* sc, int64_t NT) {
  const int64_t KT = g >= K_TILE ? g : K_TILE / g * g, GT = KT / g, W = NT / 8;  // whole groups
  const int64_t NG = ROW_TILE * GT;  // groups per tile
  Scratch buf(16 * (KT + 16) * 4 + NG * 4 * 5 + ROW_TILE * GT);
  if (!buf.p) return -2;
  uint32_t* words = (uint32_t*)buf.p;
  int32_t* lo = (int32_t*)(words + 16 * (KT + 16));
  int32_t* hi = lo + NG;
  float* sf = (float*)(hi + NG);
  float* zf = sf + NG;
  uint16_t* s16 = (uint16_t*)(zf + NG);
  uint8_t* zeros = (uint8_t*)(s16 + 2 * NG);
  for (Tile t(R, K, KT); t.next();) {
    const int64_t gt = t.kt / g, ng = t.rows * GT;
    for (int64_t i = 0; i < t.rows; ++i) {
      const T* row = w + (t.n0 + i) * K;
      prefetch_next(row, t, KT);
      if (!awq_extremes(row + t.k0, t.kt, g, lo + i * GT, hi + i * GT)) return -1;
    }
    uint32_t ok = 1;
    for (int64_t i = 0; i < ng; ++i) {
      if (i % GT >= gt) continue;
      awq_params(from_order_key(lo[i]), from_order_key(hi[i]), s16 + i, sf + i, zf + i, &ok);
      zeros[i] = (uint8_t)zf[i];
    }
    if (!ok) return -3;
    for (int64_t j = 0; j < gt; ++j)  // scales [K/g, NT]: a run of the tile's rows per group
      for (int64_t i = 0; i < t.rows; ++i) sc[(t.k0 / g + j) * NT + t.n0 + i] = s16[i * GT + j];
    awq_words(t, w + t.n0 * K + t.k0, g, sf, zf, GT, words);
    awq_store(t, g, W, zeros, words, qw, qz);
  }
  return 0;
}

// ------------------------------------------------------------------ instruction paths
#define HQ_ENTRY(NAME, TARGET, BLOCK_WORDS)                                                   \
  TARGET int nvfp4_##NAME(const void* w, int bf16, int64_t N, int64_t K, float s2,          \
                          const Nvfp4Out& o) {                                                \
    return bf16 ? nvfp4_rows<BLOCK_WORDS>((const uint16_t*)w, N, K, s2, o)                   \
                : nvfp4_rows<BLOCK_WORDS>((const float*)w, N, K, s2, o);                     \
  }                                                                                           \
  TARGET int awq_##NAME(const void* w, int bf16, int64_t R, int64_t K, int64_t g, int32_t* qw, \
                        int32_t* qz, uint16_t* sc, int64_t NT) {                              \
    return bf16 ? awq_rows((const uint16_t*)w, R, K, g, qw, qz, sc, NT)                      \
                : awq_rows((const float*)w, R, K, g, qw, qz, sc, NT);                        \
  }                                                                                           \
  TARGET float absmax_##NAME(const void* w, int bf16, int64_t count) {                        \
    return bf16 ? absmax((const uint16_t*)w, count) : absmax((const float*)w, count);         \
  }

HQ_ENTRY(generic, , false)  // nvfp4_words8's Block: AVX-512's
#ifdef HQ_X86
HQ_ENTRY(avx2, __attribute__((target("avx2"))), false)
HQ_ENTRY(avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))), true)
#endif

int best_isa() {
#ifdef HQ_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return 3;
  if (__builtin_cpu_supports("avx2")) return 2;
#endif
  return 1;
}

int pick(int isa) {
  static const int best = best_isa();
  return isa <= 0 || isa > best ? best : isa;
}

}  // namespace

extern "C" {

// Best instruction path of this CPU: 3 = AVX-512, 2 = AVX2, 1 = generic C++.
int hq_quant_best_isa(void) { return pick(0); }

// NVFP4 of rows w [N, K] (bf16 != 0: bfloat16, else float32; C-contiguous) with global scale
// s2, written as rows row0 .. row0 + N of a weight of NT rows whose stored tensors are, by
// layout: 0 (rows) q [NT, K/2], sc [NT, K/16]; 1 (K-major) q [K, NT/2], sc [K/16, NT]; 2 (tiled)
// the same in the Ascend tile order (K % 64 == 0, NT % 256 == 0). K-major and tiled need N and
// row0 even; s2 > 0. isa: 0 = best, else min(isa, best). Returns 0, -1 on NaN/Inf (outputs
// partly written), -2 out of memory or bad arguments.
int hq_nvfp4_quantize(const void* w, int bf16, int64_t N, int64_t K, float s2, uint8_t* q,
                      uint8_t* sc, int layout, int64_t NT, int64_t row0, int isa) {
  if (N < 0 || K < 0 || K % BLOCK || row0 < 0 || row0 + N > NT) return -2;
  if (!(s2 > 0.0f)) return -2;  // a positive s2 (+Inf included), as scale_2_from_amax gives
  if (layout < NVFP4_ROWS || layout > NVFP4_TILED) return -2;
  if (layout != NVFP4_ROWS && (N % 2 || row0 % 2)) return -2;
  if (layout == NVFP4_TILED && (K % 64 || NT % 256)) return -2;
  const Nvfp4Out o{q, sc, NT, row0, layout};
  switch (pick(isa)) {
#ifdef HQ_X86
    case 3: return nvfp4_avx512(w, bf16, N, K, s2, o);
    case 2: return nvfp4_avx2(w, bf16, N, K, s2, o);
#endif
    default: return nvfp4_generic(w, bf16, N, K, s2, o);
  }
}

// max |w| over count elements; NaN (any NaN present) or Inf come back as such.
float hq_absmax(const void* w, int bf16, int64_t count, int isa) {
  switch (pick(isa)) {
#ifdef HQ_X86
    case 3: return absmax_avx512(w, bf16, count);
    case 2: return absmax_avx2(w, bf16, count);
#endif
    default: return absmax_generic(w, bf16, count);
  }
}

// AWQ round-to-nearest of rows w [R, K] (R % 8 == 0, K % g == 0), written as rows row0 .. row0 + R
// of a weight of NT rows (NT % 8 == 0, row0 % 8 == 0): qw int32 [K, NT/8], qz int32 [K/g, NT/8],
// sc float16 bits [K/g, NT] (the rows' columns of each). Returns 0, -1 NaN/Inf, -2 out of memory
// or bad arguments, -3 a scale beyond FP16 (outputs partly written on error).
int hq_awq_quantize(const void* w, int bf16, int64_t R, int64_t K, int64_t g, int32_t* qw,
                    int32_t* qz, uint16_t* sc, int64_t NT, int64_t row0, int isa) {
  if (R < 0 || R % 8 || g <= 0 || K < 0 || K % g) return -2;
  if (NT % 8 || row0 < 0 || row0 % 8 || row0 + R > NT) return -2;
  qw += row0 / 8, qz += row0 / 8, sc += row0;
  switch (pick(isa)) {
#ifdef HQ_X86
    case 3: return awq_avx512(w, bf16, R, K, g, qw, qz, sc, NT);
    case 2: return awq_avx2(w, bf16, R, K, g, qw, qz, sc, NT);
#endif
    default: return awq_generic(w, bf16, R, K, g, qw, qz, sc, NT);
  }
}

// NVFP4 Ascend tile order (formats/nvfp4_ascend_tiles.py ``tile``): the packed K-major codes kn
// [K, NB] (NB = N/2 bytes, K % 64 == 0, NB % 128 == 0) rewritten as out [K, NB] in the order
// K3 > K1 > K2 > N2 > N3 > N1 > K0 > N0 of k = 64 K3 + 16 K2 + 8 K1 + K0 and byte column
// 128 N3 + 16 N2 + 4 N1 + N0: a pure byte permutation that moves 4-byte (N0) words. Returns
// 0, -2 on bad arguments.
int hq_nvfp4_tile(const uint8_t* kn, int64_t K, int64_t NB, uint8_t* out) {
  if (K < 0 || NB < 0 || K % 64 || NB % 128) return -2;
  const int64_t n3s = NB / 128;
  for (int64_t k3 = 0; k3 < K / 64; ++k3)
    for (int k1 = 0; k1 < 2; ++k1)
      for (int k2 = 0; k2 < 4; ++k2) {
        const uint8_t* rows = kn + (64 * k3 + 16 * k2 + 8 * k1) * NB;  // k0 = 0 of this group
        for (int n2 = 0; n2 < 8; ++n2)
          for (int64_t n3 = 0; n3 < n3s; ++n3)
            for (int n1 = 0; n1 < 4; ++n1) {
              const uint8_t* col = rows + 128 * n3 + 16 * n2 + 4 * n1;
              for (int k0 = 0; k0 < 8; ++k0, out += 4) memcpy(out, col + k0 * NB, 4);
            }
      }
  return 0;
}

// The same order written chunk by chunk: chunk [K, cb] holds byte columns col0 .. col0+cb of
// the packed K-major codes (cb % 16 == 0, col0 % 16 == 0: whole (N3, N2) runs of 32 rows of W);
// its bytes go straight to their places in out [K, NB], the tiled tensor being assembled.
int hq_nvfp4_tile_into(const uint8_t* chunk, int64_t K, int64_t cb, int64_t col0, int64_t NB,
                       uint8_t* out) {
  if (K < 0 || K % 64 || NB % 128 || cb % 16 || col0 % 16 || col0 < 0 || col0 + cb > NB)
    return -2;
  const int64_t n3s = NB / 128;
  for (int64_t k3 = 0; k3 < K / 64; ++k3)
    for (int k1 = 0; k1 < 2; ++k1)
      for (int k2 = 0; k2 < 4; ++k2) {
        const uint8_t* rows = chunk + (64 * k3 + 16 * k2 + 8 * k1) * cb;
        const int64_t slab = ((k3 * 2 + k1) * 4 + k2) * 8;  // (K3, K1, K2) then N2
        for (int64_t j = 0; j < cb / 16; ++j) {
          const int64_t c = col0 + 16 * j, n3 = c / 128, n2 = (c / 16) % 8;
          uint8_t* dst = out + ((slab + n2) * n3s + n3) * 128;
          for (int n1 = 0; n1 < 4; ++n1)
            for (int k0 = 0; k0 < 8; ++k0, dst += 4) memcpy(dst, rows + k0 * cb + 16 * j + 4 * n1, 4);
        }
      }
  return 0;
}

// Per column of the byte rows w [R, C] (row stride ``stride`` bytes): the largest low 7 bits,
// out [C]. For E4M3 codes that is the largest magnitude's code (magnitudes order like them).
void hq_u8_colmax7(const uint8_t* __restrict w, int64_t R, int64_t C, int64_t stride,
                   uint8_t* __restrict out) {
  memset(out, 0, (size_t)C);
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* __restrict row = w + r * stride;
    for (int64_t c = 0; c < C; ++c) {  // vectorised: no aliasing between row and out
      const uint8_t m = row[c] & 0x7F;
      out[c] = m > out[c] ? m : out[c];
    }
  }
}

// Element-wise conversions, exported for the tests.
void hq_e4m3_encode(const float* x, uint8_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = e4m3_from_f32(x[i]);
}

void hq_e2m1_magnitude(const float* y, uint8_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = (uint8_t)e2m1_magnitude(y[i]);
}

void hq_f16_encode(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = f16_from_f32(x[i]);
}

}  // extern "C"
