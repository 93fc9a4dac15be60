// BLAKE3 subtrees (formats/blake3_tree.py): the chaining value of any aligned power-of-two run
// of 1024-byte chunks of a file, so the bytes of one file can be hashed in any order, on any
// thread, as they are written; the tree is merged to the standard BLAKE3 digest afterwards.
//
// The algorithm is the BLAKE3 specification's (https://github.com/BLAKE3-team/BLAKE3-specs,
// blake3.pdf, sections 2.1-2.6): the compression function of 7 rounds over a 16-word state, the
// message schedule (2.2), chunks of 16 blocks of 64 bytes with the chunk counter as the counter
// and CHUNK_START / CHUNK_END flags, parent nodes compressing two chaining values with the PARENT
// flag, the ROOT flag on the last compression of the whole input. Written here from the spec.
//
// Chunks are compressed N at a time, one lane each (GCC/Clang vector extensions: 4, 8 or 16 lanes
// of uint32 — SSE2/NEON, AVX2, AVX-512 — chosen at run time); integer arithmetic only, so every
// path gives the same bytes, checked against the blake3 package in tests/formats/test_blake3_tree.py.
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

const uint32_t IV[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                        0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};
constexpr uint32_t CHUNK_START = 1, CHUNK_END = 2, PARENT = 4, ROOT = 8;
constexpr int64_t CHUNK = 1024, BLOCK = 64;

inline uint32_t load32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// The round function on state words v (scalar or vector), message words m.
#define HQ_G(a, b, c, d, x, y)                         \
  a = a + b + x;                                       \
  d = d ^ a;                                           \
  d = (d >> 16) | (d << 16);                           \
  c = c + d;                                           \
  b = b ^ c;                                           \
  b = (b >> 12) | (b << 20);                           \
  a = a + b + y;                                       \
  d = d ^ a;                                           \
  d = (d >> 8) | (d << 24);                            \
  c = c + d;                                           \
  b = b ^ c;                                           \
  b = (b >> 7) | (b << 25);
// One round with message words m[a..p] (the schedule's row for that round).
#define HQ_ROUND(v, m, a, b, c, d, e, f, g, h, i, j, k, l, n, o, p, q) \
  HQ_G(v[0], v[4], v[8], v[12], m[a], m[b])                        \
  HQ_G(v[1], v[5], v[9], v[13], m[c], m[d])                        \
  HQ_G(v[2], v[6], v[10], v[14], m[e], m[f])                       \
  HQ_G(v[3], v[7], v[11], v[15], m[g], m[h])                       \
  HQ_G(v[0], v[5], v[10], v[15], m[i], m[j])                       \
  HQ_G(v[1], v[6], v[11], v[12], m[k], m[l])                       \
  HQ_G(v[2], v[7], v[8], v[13], m[n], m[o])                        \
  HQ_G(v[3], v[4], v[9], v[14], m[p], m[q])
// The seven rounds: row r is the message permutation of the spec (2.2) applied r times.
#define HQ_ROUNDS(v, m)  \
  HQ_ROUND(v, m, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) \
  HQ_ROUND(v, m, 2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8) \
  HQ_ROUND(v, m, 3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1) \
  HQ_ROUND(v, m, 10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6) \
  HQ_ROUND(v, m, 12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4) \
  HQ_ROUND(v, m, 9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7) \
  HQ_ROUND(v, m, 11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13)

// One compression: cv (8 words) <- first half of the output of (cv, block, counter, len, flags).
void compress(uint32_t cv[8], const uint8_t* block, uint64_t counter, uint32_t len, uint32_t flags) {
  uint32_t m[16], v[16];
  for (int i = 0; i < 16; ++i) m[i] = load32(block + 4 * i);
  for (int i = 0; i < 8; ++i) v[i] = cv[i];
  for (int i = 0; i < 4; ++i) v[8 + i] = IV[i];
  v[12] = uint32_t(counter), v[13] = uint32_t(counter >> 32), v[14] = len, v[15] = flags;
  HQ_ROUNDS(v, m)
  for (int i = 0; i < 8; ++i) cv[i] = v[i] ^ v[i + 8];
}

// The chaining value of one chunk (1..1024 bytes; 0 only for an empty input) with counter
// ``counter``; ``root`` adds ROOT to its last block (a one-chunk input).
void chunk_cv(const uint8_t* p, int64_t n, uint64_t counter, bool root, uint32_t cv[8]) {
  memcpy(cv, IV, sizeof IV);
  int64_t blocks = n == 0 ? 1 : (n + BLOCK - 1) / BLOCK;
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t buf[BLOCK] = {0};
    int64_t len = n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK;
    if (len > 0) memcpy(buf, p + b * BLOCK, size_t(len));
    uint32_t flags = (b == 0 ? CHUNK_START : 0) | (b == blocks - 1 ? CHUNK_END : 0);
    if (root && b == blocks - 1) flags |= ROOT;
    compress(cv, buf, counter, uint32_t(len < 0 ? 0 : len), flags);
  }
}

void parent_cv(const uint32_t l[8], const uint32_t r[8], uint32_t flags, uint32_t out[8]) {
  uint8_t block[BLOCK];
  for (int i = 0; i < 8; ++i) {
    for (int k = 0; k < 4; ++k) {
      block[4 * i + k] = uint8_t(l[i] >> (8 * k));
      block[32 + 4 * i + k] = uint8_t(r[i] >> (8 * k));
    }
  }
  memcpy(out, IV, sizeof IV);
  compress(out, block, 0, BLOCK, flags | PARENT);
}

// N whole chunks p[0 .. N*1024) with counters counter .. counter+N-1, one lane each: out[j] is
// chunk j's chaining value. V is a vector of N uint32 lanes.
// LOAD(m, p, b) fills m[w] (lane j: word w of block b of chunk j).
#define HQ_MANY(NAME, N, TARGET, LOAD)                                                   \
  TARGET void many_##NAME(const uint8_t* p, int64_t stride, int blocks, uint64_t counter, \
                          uint64_t step, uint32_t flags, uint32_t out[][8]) {           \
    typedef uint32_t V __attribute__((vector_size(4 * N)));                             \
    V h[8], m[16], v[16];                                                               \
    for (int i = 0; i < 8; ++i) h[i] = V{} + IV[i];                                     \
    V lo, hi;                                                                           \
    for (int j = 0; j < N; ++j) {                                                       \
      lo[j] = uint32_t(counter + j * step);                                             \
      hi[j] = uint32_t((counter + j * step) >> 32);                                     \
    }                                                                                   \
    for (int b = 0; b < blocks; ++b) {                                                  \
      LOAD(m, p, b)                                                                     \
      for (int i = 0; i < 8; ++i) v[i] = h[i];                                          \
      for (int i = 0; i < 4; ++i) v[8 + i] = V{} + IV[i];                               \
      v[12] = lo, v[13] = hi, v[14] = V{} + uint32_t(BLOCK);                            \
      v[15] = V{} + (flags | (blocks > 1 && b == 0 ? CHUNK_START : 0u) |               \
                     (blocks > 1 && b == blocks - 1 ? CHUNK_END : 0u));                 \
      HQ_ROUNDS(v, m)                                                                   \
      for (int i = 0; i < 8; ++i) h[i] = v[i] ^ v[i + 8];                               \
    }                                                                                   \
    for (int j = 0; j < N; ++j)                                                         \
      for (int i = 0; i < 8; ++i) out[j][i] = h[i][j];                                  \
  }

#define HQ_LOAD_LANES(m, p, b)                                                           \
  for (int w = 0; w < 16; ++w)                                                          \
    for (int j = 0; j < 4; ++j) m[w][j] = load32(p + j * stride + b * BLOCK + 4 * w);
HQ_MANY(4, 4, , HQ_LOAD_LANES)

#if defined(__x86_64__) || defined(__i386__)
#define HQ_X86 1

// The 16 words of block b of 4 chunks (q[g] = chunk 4G + g's 16 bytes at byte offset 16 L of
// the block, per 128-bit lane L) → s[c]: lane L holds word 4L + c of those 4 chunks.
#define HQ_T4(s, q, UNLO32, UNHI32, UNLO64, UNHI64, T)                                    \
  {                                                                                     \
    T t0 = UNLO32(q[0], q[1]), t1 = UNHI32(q[0], q[1]);                                 \
    T t2 = UNLO32(q[2], q[3]), t3 = UNHI32(q[2], q[3]);                                 \
    s[0] = UNLO64(t0, t2), s[1] = UNHI64(t0, t2);                                       \
    s[2] = UNLO64(t1, t3), s[3] = UNHI64(t1, t3);                                       \
  }

// AVX2: 8 chunks, each block as two halves of 8 words (128-bit lanes 0, 1 = words 4L.. of the
// half); the 4x4 transposes of two groups of 4 chunks, then their 128-bit lanes interleaved.
#define HQ_LOAD_AVX2(m, p, b)                                                            \
  for (int half = 0; half < 2; ++half) {                                                \
    __m256i s[2][4];                                                                    \
    for (int g = 0; g < 2; ++g) {                                                       \
      __m256i q[4];                                                                     \
      for (int j = 0; j < 4; ++j)                                                       \
        q[j] = _mm256_loadu_si256(                                                      \
            (const __m256i*)(p + (4 * g + j) * stride + b * BLOCK + 32 * half));         \
      HQ_T4(s[g], q, _mm256_unpacklo_epi32, _mm256_unpackhi_epi32, _mm256_unpacklo_epi64, \
            _mm256_unpackhi_epi64, __m256i)                                             \
    }                                                                                   \
    for (int c = 0; c < 4; ++c) {                                                       \
      m[8 * half + c] = (V)_mm256_permute2x128_si256(s[0][c], s[1][c], 0x20);           \
      m[8 * half + 4 + c] = (V)_mm256_permute2x128_si256(s[0][c], s[1][c], 0x31);       \
    }                                                                                   \
  }
HQ_MANY(8, 8, __attribute__((target("avx2"))), HQ_LOAD_AVX2)

// AVX-512: 16 chunks, the 4x4 transposes of four groups, then a 4x4 transpose of 128-bit lanes.
#define HQ_LOAD_AVX512(m, p, b)                                                          \
  {                                                                                     \
    __m512i s[4][4];                                                                    \
    for (int g = 0; g < 4; ++g) {                                                       \
      __m512i q[4];                                                                     \
      for (int j = 0; j < 4; ++j)                                                       \
        q[j] = _mm512_loadu_si512((const void*)(p + (4 * g + j) * stride + b * BLOCK));   \
      HQ_T4(s[g], q, _mm512_unpacklo_epi32, _mm512_unpackhi_epi32, _mm512_unpacklo_epi64, \
            _mm512_unpackhi_epi64, __m512i)                                             \
    }                                                                                   \
    for (int c = 0; c < 4; ++c) {                                                       \
      __m512i y0 = _mm512_shuffle_i32x4(s[0][c], s[1][c], 0x44);                        \
      __m512i y1 = _mm512_shuffle_i32x4(s[0][c], s[1][c], 0xEE);                        \
      __m512i y2 = _mm512_shuffle_i32x4(s[2][c], s[3][c], 0x44);                        \
      __m512i y3 = _mm512_shuffle_i32x4(s[2][c], s[3][c], 0xEE);                        \
      m[c] = (V)_mm512_shuffle_i32x4(y0, y2, 0x88);                                     \
      m[4 + c] = (V)_mm512_shuffle_i32x4(y0, y2, 0xDD);                                 \
      m[8 + c] = (V)_mm512_shuffle_i32x4(y1, y3, 0x88);                                 \
      m[12 + c] = (V)_mm512_shuffle_i32x4(y1, y3, 0xDD);                                \
    }                                                                                   \
  }
HQ_MANY(16, 16, __attribute__((target("avx512f"))), HQ_LOAD_AVX512)
#endif

// The 16-lane path also runs the 8-lane one (a run's last chunks): both instruction sets asked.
int best_lanes() {
#ifdef HQ_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && __builtin_cpu_supports("avx512f")) return 16;
  if (avx2) return 8;
#endif
  return 4;
}

// The path of at most `lanes` lanes (0 or less: the best): 16, 8 or 4 — never more than this CPU
// has, and 4 for any request under 8 (``many`` has no other widths).
int pick(int lanes) {
  static const int best = best_lanes();
  const int want = lanes <= 0 || lanes > best ? best : lanes;
  return want >= 16 ? 16 : want >= 8 ? 8 : 4;
}

// N lanes of the path ``lanes``: chunks (stride 1024, 16 blocks, counters counter + j) or
// parents (stride 64, one block, counter 0, PARENT).
void many(int lanes, const uint8_t* p, int64_t stride, int blocks, uint64_t counter,
          uint64_t step, uint32_t flags, uint32_t out[][8]) {
  switch (lanes) {
#ifdef HQ_X86
    case 16: many_16(p, stride, blocks, counter, step, flags, out); break;
    case 8: many_8(p, stride, blocks, counter, step, flags, out); break;
#endif
    default: many_4(p, stride, blocks, counter, step, flags, out); break;
  }
}

// The chaining values of the chunks of the nbytes at p (whole chunks, the last one possibly
// short: the input's end), counters counter, counter + 1, ...: groups of `path` chunks, then of
// each narrower path down to 4 lanes (a range's edges are short runs), one at a time last.
void chunk_cvs(const uint8_t* p, int64_t nbytes, uint64_t counter, int path, uint32_t (*cv)[8]) {
  int64_t c = 0, whole = nbytes / CHUNK, chunks = (nbytes + CHUNK - 1) / CHUNK;
  for (int lanes = path; lanes >= 4; lanes /= 2)
    for (; c + lanes <= whole; c += lanes)
      many(lanes, p + c * CHUNK, CHUNK, CHUNK / BLOCK, counter + c, 1, 0, cv + c);
  for (; c < chunks; ++c) {
    int64_t n = nbytes - c * CHUNK < CHUNK ? nbytes - c * CHUNK : CHUNK;
    chunk_cv(p + c * CHUNK, n, counter + c, false, cv[c]);
  }
}

// The (non-root) chaining value of a node of `count` (a power of two) chunks whose chaining values
// are cv[0 .. count), into cv[0]: parents level by level, in place (pair i of a level is the 64
// bytes at cv[2 i], stored as words: little-endian on every platform this builds for, as load32
// reads them; a group's output lands below the pairs it has not read yet).
void merge_node(uint32_t (*cv)[8], int64_t count, int path) {
  for (; count > 1; count /= 2) {
    int64_t i = 0, pairs = count / 2;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(cv);
    for (int lanes = path; lanes >= 4; lanes /= 2)
      for (; i + lanes <= pairs; i += lanes) many(lanes, base + 64 * i, 64, 1, 0, 0, PARENT, cv + i);
    for (; i < pairs; ++i) parent_cv(cv[2 * i], cv[2 * i + 1], 0, cv[i]);
  }
}

void cv_bytes(const uint32_t cv[8], uint8_t* out) {
  for (int i = 0; i < 8; ++i)
    for (int k = 0; k < 4; ++k) out[4 * i + k] = uint8_t(cv[i] >> (8 * k));
}

}  // namespace

extern "C" {

// Lanes (chunks compressed at once) of this CPU's path: 16 AVX-512, 8 AVX2, 4 otherwise.
int hq_b3_lanes(void) { return pick(0); }

// The (non-root) chaining value of the subtree of chunks counter, counter+1, ... made of the
// nbytes at p: nbytes in ((2^k - 1) * 1024, 2^k * 1024] for some k (its last chunk may be short:
// the end of the input). lanes: 0 = the best path, else at most that many. Returns 0, or -1 if
// nbytes is not of that form.
int hq_b3_subtree(const uint8_t* p, int64_t nbytes, uint64_t counter, uint8_t* out, int lanes) {
  if (nbytes <= 0) return -1;
  int64_t chunks = (nbytes + CHUNK - 1) / CHUNK;
  if (chunks & (chunks - 1)) return -1;
  int path = pick(lanes);
  std::vector<uint32_t> cv(size_t(chunks) * 8);
  auto at = reinterpret_cast<uint32_t(*)[8]>(cv.data());
  chunk_cvs(p, nbytes, counter, path, at);
  merge_node(at, chunks, path);
  cv_bytes(at[0], out);
  return 0;
}

// The parent of two chaining values (32 bytes each, little-endian words); root != 0: the
// digest of the whole input (its first 32 bytes) instead.
void hq_b3_parent(const uint8_t* left, const uint8_t* right, int root, uint8_t* out) {
  uint32_t l[8], r[8], o[8];
  for (int i = 0; i < 8; ++i) l[i] = load32(left + 4 * i), r[i] = load32(right + 4 * i);
  parent_cv(l, r, root ? ROOT : 0, o);
  cv_bytes(o, out);
}

// The digest of an input of at most one chunk (0..1024 bytes).
int hq_b3_single(const uint8_t* p, int64_t nbytes, uint8_t* out) {
  if (nbytes < 0 || nbytes > CHUNK) return -1;
  uint32_t cv[8];
  chunk_cv(p, nbytes, 0, true, cv);
  cv_bytes(cv, out);
  return 0;
}

}  // extern "C"
