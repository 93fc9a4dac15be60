// hetquant row kernels: see hetquant/formats/_rows_native.py. Compiled as one translation unit
// after _quant_native.cpp (its helpers: load, bits, as_f32, f32_from_e4m3, ROUND_MAGIC, pick).
// Every float operation mirrors the torch reference in formats/fp8_block_rows.py
// (dequantize_rows), formats/w8a8_npu_rows.py (weight_tensors) and formats/int4_cpu_rows.py
// (quantize_rows_torch without clip search); keep them in step.
#include <algorithm>
#include <cmath>
#ifdef HQ_X86
#include <immintrin.h>
#endif

namespace {

constexpr float INT8_QMAX = 127.0f, INT4_QMAX = 7.0f;
constexpr float FLT_EPS = 1.1920928955078125e-07f;  // 2^-23, msModelSlim's scale floor

// float32 -> bfloat16 bits, c10's round_to_nearest_even (NaN -> 0x7FC0)
HQ_INLINE uint16_t bf16_from_f32(float f) {
  const uint32_t b = bits(f);
  if ((b & ABS) > INF_BITS) return 0x7FC0;
  return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// x rounded half to even for |x| <= 2^22 (fl(x + M) - M with M = 1.5 * 2^23)
HQ_INLINE float round_even(float x) { return (x + ROUND_MAGIC) - ROUND_MAGIC; }

// Block (the AVX-512 bodies): 16 BF16 inputs at a time in 32-bit lanes, narrowed once at the
// store. Loops that store bytes element by element vectorise into narrowing shuffle chains, which
// all run on one port of Intel's AVX-512 cores; a 16-lane vector type is split on narrower
// targets (its compares then go lane by lane), so AVX2 and SSE2 keep the element loops.
typedef int8_t i8x16 __attribute__((vector_size(16)));

// clamp(round_even(w / s), lo, hi) of 16 BF16 inputs, as the scalar code computes it.
HQ_INLINE i32x16 round_clamp16(const uint16_t* p, float s, float lo, float hi) {
  const f32x16 q = ((f32x16)load_bits(p) / s + ROUND_MAGIC) - ROUND_MAGIC;
  const f32x16 vlo = (f32x16){} + lo, vhi = (f32x16){} + hi;
  const f32x16 c = q < vlo ? vlo : (q > vhi ? vhi : q);
  return __builtin_convertvector(c, i32x16);
}

// --------------------------------------------------------------------- FP8 block -> BF16
// Rows [R, C] of E4M3 codes whose block row has the scales srow[ceil(C / block)]:
// out = bf16(f32(code) * s) as torch computes it (e4m3_to_f32, one multiply, RNE cast), read
// from a 256-entry table per block column (a lookup is cheaper than the arithmetic, and the table
// holds exactly the arithmetic's results). Returns 1 when a NaN code (0x7F / 0xFF) or a NaN or
// infinite scale is present (out is then garbage), else 0; -2 out of memory.
HQ_INLINE int fp8_rows(const uint8_t* codes, int64_t R, int64_t C, const float* srow,
                       int64_t block, uint16_t* out) {
  const int64_t nb = (C + block - 1) / block;
  Scratch buf(nb * 256 * 2);
  if (!buf.p) return -2;
  uint16_t* tab = (uint16_t*)buf.p;
  uint32_t bad = 0;
  for (int64_t j = 0; j < nb; ++j) {
    bad |= (uint32_t)((bits(srow[j]) & ABS) >= INF_BITS);  // NaN or Inf: torch decides
    for (int v = 0; v < 256; ++v) tab[j * 256 + v] = bf16_from_f32(f32_from_e4m3((uint8_t)v) * srow[j]);
  }
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* c = codes + r * C;
    uint16_t* o = out + r * C;
    for (int64_t j = 0; j < nb; ++j) {
      const uint16_t* t = tab + j * 256;
      const int64_t k0 = j * block, n = C - k0 < block ? C - k0 : block;
      for (int64_t k = 0; k < n; ++k) o[k0 + k] = t[c[k0 + k]];
    }
    uint8_t nan = 0;  // E4M3FN's only NaNs: magnitude 0x7F
    for (int64_t k = 0; k < C; ++k) nan |= (uint8_t)((c[k] & 0x7F) == 0x7F);
    bad |= nan;
  }
  return bad ? 1 : 0;
}

// max |bf16(f32(c) * s)| over block-FP8 codes [R, C] with scales s [ceil(R / block), sC],
// reading only the blocks that can hold it. In one block every value is at most the block's
// bound |bf16(448 * s)| (0x7E is E4M3's largest finite magnitude; the product and the rounding
// are monotone), so blocks are visited from the largest bound down and the walk stops at the
// first bound not above the largest value found: exact, and on checkpoints whose scales are
// each block's absmax / 448 (DeepSeek's), one or a few blocks are read instead of all. A NaN code
// (magnitude 0x7F) in a visited block returns 1; one in a skipped block is the caller's
// dequantizing pass to refuse (formats/_rows_native.py fp8_absmax_array).
HQ_INLINE int fp8_absmax(const uint8_t* codes, int64_t R, int64_t C, const float* s, int64_t sC,
                         int64_t block, float* out) {
  const int64_t nr = (R + block - 1) / block, nc = (C + block - 1) / block, n = nr * nc;
  if (n >= ((int64_t)1 << 32)) return -2;
  Scratch buf(n * 8 + block + 1);
  if (!buf.p) return -2;
  uint64_t* order = (uint64_t*)buf.p;  // bound << 32 | block index, largest bound first
  uint8_t* mags = (uint8_t*)(order + n);
  for (int64_t i = 0; i < nr; ++i)
    for (int64_t j = 0; j < nc; ++j) {
      const uint64_t bound = bf16_from_f32(f32_from_e4m3(0x7E) * s[i * sC + j]) & 0x7FFFu;
      order[i * nc + j] = bound << 32 | (uint64_t)(i * nc + j);
    }
  std::sort(order, order + n, [](uint64_t a, uint64_t b) { return a > b; });
  uint32_t best = 0;  // BF16 bits of the largest magnitude so far (non-negative: ordered as ints)
  for (int64_t t = 0; t < n && (uint32_t)(order[t] >> 32) > best; ++t) {
    const int64_t idx = (int64_t)(order[t] & 0xFFFFFFFFu), i = idx / nc, j = idx % nc;
    const int64_t r0 = i * block, c0 = j * block;
    const int64_t rows = R - r0 < block ? R - r0 : block, cols = C - c0 < block ? C - c0 : block;
    hq_u8_colmax7(codes + r0 * C + c0, rows, cols, C, mags);
    uint8_t m = 0;
    for (int64_t c = 0; c < cols; ++c) m = mags[c] > m ? mags[c] : m;
    if (m == 0x7F) return 1;
    const uint32_t v = bf16_from_f32(f32_from_e4m3(m) * s[i * sC + j]) & 0x7FFFu;
    best = v > best ? v : best;
  }
  *out = as_f32(best << 16);
  return 0;
}

// |w| maximum of one row as float bits (NaN sorts above Inf): _quant_native.cpp's absmax
template <typename T>
HQ_INLINE uint32_t row_amax(const T* w, int64_t K) {
  return bits(absmax(w, K));
}

// ------------------------------------------------------------------- W8A8 per-row int8
// s = up_bf16(max(amax / 127, 2^-23)) (the quotient in double, rounded UP to the nearest BF16
// value: formats/w8a8_npu_rows.py held_scale), q = clamp(round(w / s), -128, 127) with the
// quotient in float for BF16 rows (exact: formats/w8a8_npu_rows.py weight_tensors, ``narrow``)
// and in double for F32 rows.
HQ_INLINE float up_bf16(double x) {
  float f = (float)x;
  if ((double)f < x) f = std::nextafter(f, INFINITY);
  uint32_t b = bits(f);
  if (b & 0xFFFFu) b = (b & 0xFFFF0000u) + 0x10000u;
  return as_f32(b);
}

// One code, clamped before it is rounded (the same integer: the bounds are integers and both
// steps are monotone). F32 rows: the F64 quotient, std::nearbyint (half to even).
template <typename T>
HQ_INLINE int8_t w8a8_code(const T* p, int64_t k, float s) {
  double t = (double)load(p, k) / (double)s;
  t = t < -128.0 ? -128.0 : (t > 127.0 ? 127.0 : t);
  return (int8_t)(int32_t)std::nearbyint(t);
}

// BF16 rows: the F32 quotient rounded in F32, so the loop stays in float lanes (16 per AVX-512
// register, not 8 doubles: 3.4x the time before). round_even is nearbyint for |t| <= 2^22, and
// |t| <= 127 here (s >= amax / 127); rounded before the clamp, as GCC vectorises it for AVX2 too
// (clamped first, the AVX2 loop stayed scalar).
template <>
HQ_INLINE int8_t w8a8_code<uint16_t>(const uint16_t* p, int64_t k, float s) {
  float t = round_even(load(p, k) / s);
  t = t < -128.0f ? -128.0f : (t > 127.0f ? 127.0f : t);
  return (int8_t)(int32_t)t;
}

template <bool Block, typename T>
HQ_INLINE int w8a8_rows(const T* w, int64_t R, int64_t K, int8_t* q, float* scale) {
  for (int64_t r = 0; r < R; ++r) {
    const T* p = w + r * K;
    const uint32_t m = row_amax(p, K);
    if (m >= INF_BITS) return -1;
    double x = (double)as_f32(m) / (double)INT8_QMAX;
    x = x < (double)FLT_EPS ? (double)FLT_EPS : x;
    const float s = up_bf16(x);
    scale[r] = s;
    int8_t* o = q + r * K;
    int64_t k = 0;
    if constexpr (Block && std::is_same_v<T, uint16_t>) {
      for (const int64_t end = K / 16 * 16; k < end; k += 16) {  // w8a8_code, 16 a vpmovdb
        const i8x16 b = __builtin_convertvector(round_clamp16(p + k, s, -128.0f, 127.0f), i8x16);
        memcpy(o + k, &b, 16);
      }
    }
    for (; k < K; ++k) o[k] = w8a8_code(p, k, s);
  }
  return 0;
}

// ------------------------------------------------------------ INT4 per-row (int4_cpu)
// s = amax / 7 (1 for an all-zero row), c = clamp(round(w / s), -7, 7) + 8, two codes a byte
// (element 2j in the low nibble). Row i of the output is row i of a, or with b given, rows
// interleave: 2i from a[i], 2i + 1 from b[i]. -1 on NaN/Inf.
template <bool Block, typename T>
HQ_INLINE void int4_row(const T* p, int64_t K, float s, uint8_t* o) {
  int64_t j = 0;
  if constexpr (Block && std::is_same_v<T, uint16_t>) {
    for (const int64_t end = K / 16 * 8; j < end; j += 8) {  // 16 codes: lanes 2i, 2i + 1 as one
      const i32x16 c = round_clamp16(p + 2 * j, s, -INT4_QMAX, INT4_QMAX) + 8;
      const u64x8 pair = (u64x8)c;  // 64-bit lane x, x | x >> 28 holds byte i in its low bits
      const u8x8 b = __builtin_convertvector(pair | pair >> 28, u8x8);
      memcpy(o + j, &b, 8);
    }
  }
  for (; j < K / 2; ++j) {
    float lo = round_even(load(p, 2 * j) / s), hi = round_even(load(p, 2 * j + 1) / s);
    lo = lo < -INT4_QMAX ? -INT4_QMAX : (lo > INT4_QMAX ? INT4_QMAX : lo);
    hi = hi < -INT4_QMAX ? -INT4_QMAX : (hi > INT4_QMAX ? INT4_QMAX : hi);
    o[j] = (uint8_t)((int32_t)lo + 8) | (uint8_t)(((int32_t)hi + 8) << 4);
  }
}

template <bool Block, typename T>
HQ_INLINE int int4_rows(const T* a, const T* b, int64_t R, int64_t K, uint8_t* packed,
                        float* scale) {
  const int64_t out_rows = b ? 2 * R : R;
  for (int64_t i = 0; i < out_rows; ++i) {
    const T* p = b ? ((i & 1) ? b : a) + (i >> 1) * K : a + i * K;
    const uint32_t m = row_amax(p, K);
    if (m >= INF_BITS) return -1;
    const float amax = as_f32(m);
    const float s = amax > 0.0f ? amax / INT4_QMAX : 1.0f;  // amax * 1.0 (ratio) is exact
    scale[i] = s;
    int4_row<Block>(p, K, s, packed + i * (K / 2));
  }
  return 0;
}

#ifdef HQ_X86
// The same table lookup, 32 codes at a time (AVX-512BW): the 128 magnitudes' BF16 values of a
// block sit in four registers, two two-register permutes and a blend on index bit 6 look them
// up, the sign bit is ORed in — exact when the scale is +0 or positive, as bf16(-x) is
// -bf16(x) under round-to-nearest-even (for a negative scale the scalar path runs).
__attribute__((target("avx512f,avx512bw"))) int fp8_avx512bw(const uint8_t* codes, int64_t R,
                                                             int64_t C, const float* srow,
                                                             int64_t block, uint16_t* out) {
  const int64_t nb = (C + block - 1) / block;
  uint32_t neg = 0;
  for (int64_t j = 0; j < nb; ++j) neg |= bits(srow[j]) >> 31;
  if (neg) return fp8_rows(codes, R, C, srow, block, out);
  Scratch buf(nb * 256 * 2);
  if (!buf.p) return -2;
  uint16_t* tab = (uint16_t*)buf.p;
  uint32_t bad = 0;
  for (int64_t j = 0; j < nb; ++j) {
    bad |= (uint32_t)((bits(srow[j]) & ABS) >= INF_BITS);
    for (int v = 0; v < 256; ++v) tab[j * 256 + v] = bf16_from_f32(f32_from_e4m3((uint8_t)v) * srow[j]);
  }
  const __m512i mag = _mm512_set1_epi16(0x7F), sign = _mm512_set1_epi16(0x80);
  const __m512i hi_half = _mm512_set1_epi16(0x40);
  __mmask32 nan = 0;
  for (int64_t r = 0; r < R; ++r) {
    const uint8_t* c = codes + r * C;
    uint16_t* o = out + r * C;
    for (int64_t j = 0; j < nb; ++j) {
      const uint16_t* t = tab + j * 256;
      const __m512i t0 = _mm512_loadu_si512(t), t1 = _mm512_loadu_si512(t + 32);
      const __m512i t2 = _mm512_loadu_si512(t + 64), t3 = _mm512_loadu_si512(t + 96);
      const int64_t k0 = j * block, n = C - k0 < block ? C - k0 : block;
      int64_t k = 0;
      for (; k + 32 <= n; k += 32) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(c + k0 + k)));
        const __m512i idx = _mm512_and_si512(w, mag);
        const __m512i lo = _mm512_permutex2var_epi16(t0, idx, t1);  // entries 0..63
        const __m512i hi = _mm512_permutex2var_epi16(t2, idx, t3);  // entries 64..127
        __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(idx, hi_half), lo, hi);
        v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(w, sign), 8));
        nan |= _mm512_cmpeq_epi16_mask(idx, mag);
        _mm512_storeu_si512(o + k0 + k, v);
      }
      for (; k < n; ++k) {
        const uint8_t v = c[k0 + k];
        bad |= (uint32_t)((v & 0x7F) == 0x7F);
        o[k0 + k] = t[v];
      }
    }
  }
  return (bad || nan) ? 1 : 0;
}
#endif

int fp8_generic(const uint8_t* c, int64_t R, int64_t C, const float* s, int64_t blk,
                uint16_t* out) {
  return fp8_rows(c, R, C, s, blk, out);
}
#ifdef HQ_X86
__attribute__((target("avx2"))) int fp8_avx2(const uint8_t* c, int64_t R, int64_t C,
                                             const float* s, int64_t blk, uint16_t* out) {
  return fp8_rows(c, R, C, s, blk, out);
}
#endif

#define HQ_ROWS_ENTRY(NAME, TARGET, BLOCK)                                                      \
  TARGET int w8a8_##NAME(const void* w, int bf16, int64_t R, int64_t K, int8_t* q, float* s) {   \
    return bf16 ? w8a8_rows<BLOCK>((const uint16_t*)w, R, K, q, s)                              \
                : w8a8_rows<BLOCK>((const float*)w, R, K, q, s);                                \
  }                                                                                             \
  TARGET int int4_##NAME(const void* a, const void* b, int bf16, int64_t R, int64_t K,           \
                         uint8_t* p, float* s) {                                                \
    return bf16 ? int4_rows<BLOCK>((const uint16_t*)a, (const uint16_t*)b, R, K, p, s)          \
                : int4_rows<BLOCK>((const float*)a, (const float*)b, R, K, p, s);               \
  }

HQ_ROWS_ENTRY(generic, , false)
#ifdef HQ_X86
HQ_ROWS_ENTRY(avx2, __attribute__((target("avx2"))), false)
HQ_ROWS_ENTRY(avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))), true)
#endif

}  // namespace

extern "C" {

// FP8 (E4M3) rows codes [R, C] with the block row's scales s[ceil(C / block)] -> BF16 bits
// out [R, C]. Returns 0, 1 when a NaN code is present, -2 on bad arguments.
int hq_fp8_dequant_rows(const uint8_t* codes, int64_t R, int64_t C, const float* s,
                        int64_t block, uint16_t* out, int isa) {
  if (R < 0 || C < 0 || block <= 0) return -2;
  switch (pick(isa)) {
#ifdef HQ_X86
    case 3: return fp8_avx512bw(codes, R, C, s, block, out);
    case 2: return fp8_avx2(codes, R, C, s, block, out);
#endif
    default: return fp8_generic(codes, R, C, s, block, out);
  }
}

// W8A8 per-row symmetric int8 of rows w [R, K] (bf16 != 0: bfloat16, else float32): q int8
// [R, K], scale float32 [R]. Returns 0, -1 on NaN/Inf, -2 on bad arguments.
int hq_w8a8_rows(const void* w, int bf16, int64_t R, int64_t K, int8_t* q, float* s, int isa) {
  if (R < 0 || K <= 0) return -2;
  switch (pick(isa)) {
#ifdef HQ_X86
    case 3: return w8a8_avx512(w, bf16, R, K, q, s);
    case 2: return w8a8_avx2(w, bf16, R, K, q, s);
#endif
    default: return w8a8_generic(w, bf16, R, K, q, s);
  }
}

// INT4 per-row codes of rows a [R, K] (K even), or of a and b [R, K] interleaved (b != NULL:
// 2R output rows): packed uint8 [R or 2R, K/2], scale float32 [R or 2R]. Returns 0, -1 on
// NaN/Inf, -2 on bad arguments.
int hq_int4_rows(const void* a, const void* b, int bf16, int64_t R, int64_t K, uint8_t* packed,
                 float* s, int isa) {
  if (R < 0 || K <= 0 || K % 2) return -2;
  switch (pick(isa)) {
#ifdef HQ_X86
    case 3: return int4_avx512(a, b, bf16, R, K, packed, s);
    case 2: return int4_avx2(a, b, bf16, R, K, packed, s);
#endif
    default: return int4_generic(a, b, bf16, R, K, packed, s);
  }
}

// max |dequantized| of block-FP8 codes [R, C] with scales s [ceil(R / block), sC] (see
// fp8_absmax). Returns 0 with *out set, 1 when a visited block holds a NaN code, -2 on bad
// arguments.
int hq_fp8_absmax(const uint8_t* codes, int64_t R, int64_t C, const float* s, int64_t sC,
                  int64_t block, float* out) {
  if (R < 0 || C < 0 || block <= 0 || sC < (C + block - 1) / block) return -2;
  return fp8_absmax(codes, R, C, s, sC, block, out);
}

}  // extern "C"
