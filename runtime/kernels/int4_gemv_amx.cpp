// hetquant int4 GEMV, part 3 of 6: the x86-64 AMX path (AMX-TILE + AMX-INT8, `tdpbusd`),
// per-channel. Same integers and same epilogue as every other path, so bit-identical to them.
//
// One `tdpbusd` multiplies a 16 x 64 tile of unsigned bytes (A) by a 64 x 16 tile of signed bytes
// (B, stored as 16 rows of 16 groups of 4) into 16 x 16 int32 sums (C). Here A is 16 weight rows,
// 64 codes each (the low nibbles of 64 packed bytes in one tile, the high nibbles in another), and
// B holds 64 digits of 16 "token-planes" p = t*L + l (token t, digit plane l): the digit planes of
// a token are just more columns, so one instruction covers up to 16 token-planes, and the codes
// are unpacked once for all tokens and planes. The exact sum per (row, token-plane) stays in its
// int32 lane (|sum| <= 15 * 128 * K < 2^31 for K <= 2^20), and per (row, token) the planes are
// combined as acc = sum_l 256^l * plane_l in int64, as on the other paths.
//
// B is built once per call (`amx_b`): for chunk c (64 packed bytes), half h (0: even elements,
// low nibbles; 1: odd, high) and column group g (token-planes 16g .. 16g+15), a 1 KB tile whose
// row r holds, for each token-plane n of the group, digits(t, l, h)[64c + 4r .. 64c + 4r + 3].
// Rows of a block are swept against up to AMX_CG = 5 column groups at once (C tiles 0-4, A tiles
// 5-6, B tile 7); more token-planes take more sweeps over the block (its 16 rows are in L2 by
// then). A last block of fewer than 16 rows runs with zero rows, a last chunk of fewer than 64
// bytes with zero bytes (the digits are zero-padded already).
//
// Run-time use needs the CPU's AMX-TILE and AMX-INT8 bits and the kernel's permission for the
// tile data (arch_prctl ARCH_REQ_XCOMP_PERM, asked once in int4_gemv.cpp's best_isa). Under
// HQ_SIMDE (tests only) the tile instructions are emulated in C++ below.
#if defined(HQ_X86) && !defined(HQ_SIMDE) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#endif
namespace {

#ifdef HQ_X86
#if defined(HQ_SIMDE) || (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
    (defined(__clang__) && __clang_major__ >= 12)
#define HQ_HAS_AMX 1
#endif
#endif

#ifdef HQ_HAS_AMX
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr int AMX_CG = 5;  // column groups (C tiles) per sweep

#if defined(HQ_SIMDE)
// The tile unit in C++: eight 16 x 64-byte registers and the configured shapes.
struct EmuTiles {
  alignas(64) uint8_t t[8][16][64];
  int rows[8], colsb[8];
};
thread_local EmuTiles emu_tiles;
static void emu_config(const TileConfig* c) {
  for (int i = 0; i < 8; ++i) {
    emu_tiles.rows[i] = c->rows[i];
    emu_tiles.colsb[i] = c->colsb[i];
  }
}
static void emu_load(int t, const void* p, int64_t stride) {
  memset(emu_tiles.t[t], 0, sizeof emu_tiles.t[t]);
  for (int r = 0; r < emu_tiles.rows[t]; ++r)
    memcpy(emu_tiles.t[t][r], (const uint8_t*)p + r * stride, (size_t)emu_tiles.colsb[t]);
}
static void emu_store(int t, void* p, int64_t stride) {
  for (int r = 0; r < emu_tiles.rows[t]; ++r)
    memcpy((uint8_t*)p + r * stride, emu_tiles.t[t][r], (size_t)emu_tiles.colsb[t]);
}
static void emu_dpbusd(int c, int a, int b) {  // C[m][n] += sum_k u8 A[m][k] * s8 B[k/4][4n + k%4]
  for (int m = 0; m < emu_tiles.rows[c]; ++m)
    for (int n = 0; n < emu_tiles.colsb[c] / 4; ++n) {
      int32_t s;
      memcpy(&s, &emu_tiles.t[c][m][4 * n], 4);
      for (int k = 0; k < emu_tiles.colsb[a]; ++k)
        s += (int32_t)emu_tiles.t[a][m][k] * (int32_t)(int8_t)emu_tiles.t[b][k / 4][4 * n + k % 4];
      memcpy(&emu_tiles.t[c][m][4 * n], &s, 4);
    }
}
#define HQ_AMX
#define HQ_TILE_CONFIG(c) emu_config(c)
#define HQ_TILE_RELEASE() ((void)0)
#define HQ_TILE_ZERO(i) memset(emu_tiles.t[i], 0, sizeof emu_tiles.t[i])
#define HQ_TILE_LOAD(t, p, s) emu_load(t, p, s)
#define HQ_TILE_STORE(t, p, s) emu_store(t, p, s)
#define HQ_TILE_DP(c, a, b) emu_dpbusd(c, a, b)
#else
#define HQ_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))
#define HQ_TILE_CONFIG(c) _tile_loadconfig(c)
#define HQ_TILE_RELEASE() _tile_release()
#define HQ_TILE_ZERO(t) _tile_zero(t)
#define HQ_TILE_LOAD(t, p, s) _tile_loadd(t, p, s)
#define HQ_TILE_STORE(t, p, s) _tile_stored(t, p, s)
#define HQ_TILE_DP(c, a, b) _tile_dpbusd(c, a, b)
#endif

// Whether this CPU and kernel run AMX-INT8: the CPUID bits, then the kernel's permission for
// this process to use the tile data (asked once; a forked child inherits it).
static bool amx_usable() {
#if defined(HQ_SIMDE)
  return true;
#elif defined(__linux__)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // AMX-TILE, AMX-INT8
  const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

// Column groups of T tokens at L planes.
static inline int64_t amx_groups(int64_t T, int L) { return (T * L + 15) / 16; }

// The B tiles of T tokens (digits [T][L][2][xs], rows zero-padded to xs >= 64 * chunks), as
// described at the top: [chunk][h][group][16][64] bytes. Returns null when out of memory.
static int8_t* amx_b(const int8_t* xq, int64_t xs, int L, int64_t T, int64_t kb) {
  const int64_t chunks = (kb + 63) / 64, groups = amx_groups(T, L);
  const size_t bytes = (size_t)(chunks * 2 * groups * 1024);
  int8_t* b = (int8_t*)aligned_alloc(64, bytes);
  if (!b) return nullptr;
  memset(b, 0, bytes);  // token-planes past T * L stay zero
  for (int64_t p = 0; p < T * L; ++p) {
    const int64_t g = p / 16, n = p % 16;
    for (int h = 0; h < 2; ++h) {
      const int8_t* src = xq + (p * 2 + h) * xs;  // p = t * L + l: digits(t, l, h)
      for (int64_t c = 0; c < chunks; ++c) {
        int8_t* dst = b + ((c * 2 + h) * groups + g) * 1024 + 4 * n;
        for (int r = 0; r < 16; ++r) memcpy(dst + 64 * r, src + 64 * c + 4 * r, 4);
      }
    }
  }
  return b;
}

// The fewest tokens for which the AMX path runs; one token runs on the AVX-512 VNNI tiles, which
// were faster there on the Xeon of benchmarks/README.md (and no B tiles are built).
constexpr int AMX_MIN_T = 2;

// One sweep of a 16-row block (codes in lo/hi, rewritten per chunk) against column groups
// g0 .. g0+CG-1; the sums go to cacc (16 rows of ldc int32, group g at column 16g).
template <int CG>
HQ_AMX static void amx_sweep(const Job& j, int64_t n, int rows, int64_t g0, int32_t* cacc,
                             int64_t ldc, uint8_t (*lo)[64], uint8_t (*hi)[64]) {
  const int64_t groups = j.xbg, chunks = (j.kb + 63) / 64;
  const __m512i m15 = _mm512_set1_epi8(15);
  const int64_t ahead = n + 16 < j.n1 ? 16 * j.rs : 0;  // the same bytes of the next block
  if (CG > 0) HQ_TILE_ZERO(0);
  if (CG > 1) HQ_TILE_ZERO(1);
  if (CG > 2) HQ_TILE_ZERO(2);
  if (CG > 3) HQ_TILE_ZERO(3);
  if (CG > 4) HQ_TILE_ZERO(4);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i = 64 * c, left = j.kb - i;
    const __mmask64 mk = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
    for (int r = 0; r < rows; ++r) {
      const uint8_t* p = j.w + (n + r) * j.rs + i;
      if (ahead) _mm_prefetch((const char*)(p + ahead), _MM_HINT_T1);
      const __m512i v = _mm512_maskz_loadu_epi8(mk, p);
      _mm512_store_si512(lo[r], _mm512_and_si512(v, m15));
      _mm512_store_si512(hi[r], _mm512_and_si512(_mm512_srli_epi16(v, 4), m15));
    }
    HQ_TILE_LOAD(5, lo, 64);
    HQ_TILE_LOAD(6, hi, 64);
    const int8_t* bl = j.xb + ((c * 2 + 0) * groups + g0) * 1024;
    const int8_t* bh = j.xb + ((c * 2 + 1) * groups + g0) * 1024;
#define HQ_AMX_DP(g)                     \
  if (CG > g) {                          \
    HQ_TILE_LOAD(7, bl + 1024 * g, 64);  \
    HQ_TILE_DP(g, 5, 7);                 \
    HQ_TILE_LOAD(7, bh + 1024 * g, 64);  \
    HQ_TILE_DP(g, 6, 7);                 \
  }
    HQ_AMX_DP(0) HQ_AMX_DP(1) HQ_AMX_DP(2) HQ_AMX_DP(3) HQ_AMX_DP(4)
#undef HQ_AMX_DP
  }
  const int64_t st = ldc * 4;
  if (CG > 0) HQ_TILE_STORE(0, cacc + 16 * (g0 + 0), st);
  if (CG > 1) HQ_TILE_STORE(1, cacc + 16 * (g0 + 1), st);
  if (CG > 2) HQ_TILE_STORE(2, cacc + 16 * (g0 + 2), st);
  if (CG > 3) HQ_TILE_STORE(3, cacc + 16 * (g0 + 3), st);
  if (CG > 4) HQ_TILE_STORE(4, cacc + 16 * (g0 + 4), st);
}

// Rows j.n0 .. j.n1 of a per-channel job whose B tiles are j.xb (j.xbg column groups).
HQ_AMX static void run_amx(const Job& j) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  HQ_TILE_CONFIG(&cfg);
  const int64_t groups = j.xbg, ldc = 16 * groups;
  std::vector<int32_t> cacc((size_t)(16 * ldc));
  alignas(64) uint8_t lo[16][64], hi[16][64];
  for (int64_t n = j.n0; n < j.n1; n += 16) {
    const int rows = (int)std::min<int64_t>(16, j.n1 - n);
    if (rows < 16) {  // rows past the matrix: zero codes
      memset(lo[rows], 0, (size_t)(16 - rows) * 64);
      memset(hi[rows], 0, (size_t)(16 - rows) * 64);
    }
    for (int64_t g0 = 0; g0 < groups; g0 += AMX_CG) {
      switch (std::min<int64_t>(AMX_CG, groups - g0)) {
        case 1: amx_sweep<1>(j, n, rows, g0, cacc.data(), ldc, lo, hi); break;
        case 2: amx_sweep<2>(j, n, rows, g0, cacc.data(), ldc, lo, hi); break;
        case 3: amx_sweep<3>(j, n, rows, g0, cacc.data(), ldc, lo, hi); break;
        case 4: amx_sweep<4>(j, n, rows, g0, cacc.data(), ldc, lo, hi); break;
        default: amx_sweep<5>(j, n, rows, g0, cacc.data(), ldc, lo, hi); break;
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int64_t t = 0; t < j.T; ++t) {
        const int32_t* planes = cacc.data() + r * ldc + t * j.L;
        int64_t a = 0;
        for (int l = j.L - 1; l >= 0; --l) a = a * 256 + planes[l];
        finish(j, t, n + r, a);
      }
  }
  HQ_TILE_RELEASE();
}
#endif  // HQ_HAS_AMX

}  // namespace
