// hetquant FP4 GEMV, part 3 of 3: path dispatch, row tiling, token blocking, threads and the
// C API (see fp4_gemv.py).
namespace {

// The activation layout of a path's tiles (Transposed; v = 0: natural).
static Transposed f4_layout(int isa) {
#if defined(HQ_X86)
  if (isa == AVX2) return GroupedAvx2::LAYOUT;
  if (isa == AVX512_VNNI || isa == AMX_INT8) return GroupedVnni::LAYOUT;  // AMX: the VNNI tiles
#endif
  (void)isa;
  return Transposed{};
}

// Rows in tiles of K::ROWS at one token; otherwise one row and K::TOKENS tokens per tile.
template <class K>
static void f4_rows(const F4Job& j) {
  int64_t n = j.n0;
  if (j.T == 1) {
    for (; n + K::ROWS <= j.n1; n += K::ROWS) K::template tile<K::ROWS, 1>(j, n, 0);
  }
  for (; n < j.n1; ++n) {
    int64_t t = 0;
    for (; t + K::TOKENS <= j.T; t += K::TOKENS) K::template tile<1, K::TOKENS>(j, n, t);
    for (; t < j.T; ++t) K::template tile<1, 1>(j, n, t);
  }
}

static void f4_run(const F4Job& j) {
#if defined(HQ_X86)
  if (j.isa == AVX512_VNNI || j.isa == AMX_INT8) { f4_rows<F4Vnni>(j); return; }
  if (j.isa == AVX2) { f4_rows<F4Avx2>(j); return; }
#elif defined(HQ_ARM)
  if (j.isa == NEON_DOTPROD) { f4_rows<F4Neon>(j); return; }
#endif
  f4_run_generic(j);
}

// From F4_GEMM_MIN_T tokens on: rows in blocks of ~64 KB of codes and, within a row block, tokens
// in blocks whose activations take ~128 KB, so both stay in L2 while a block is swept. Every
// (row, token) is computed by the same code in any order: the bits do not depend on it.
constexpr int64_t F4_GEMM_MIN_T = 16;
constexpr int64_t F4_ROW_BYTES = 64 << 10, F4_ACT_BYTES = 128 << 10;

static void f4_run_blocked(const F4Job& j) {
  if (j.T < F4_GEMM_MIN_T) { f4_run(j); return; }
  const int64_t tb = std::max<int64_t>(4, F4_ACT_BYTES / (2 * j.qs) / 4 * 4);
  const int64_t nb = std::max<int64_t>(2, F4_ROW_BYTES / std::max<int64_t>(j.kb, 1) / 2 * 2);
  for (int64_t n0 = j.n0; n0 < j.n1; n0 += nb) {
    for (int64_t t0 = 0; t0 < j.T; t0 += tb) {
      F4Job s = j;
      s.n0 = n0;
      s.n1 = std::min(j.n1, n0 + nb);
      s.T = std::min(tb, j.T - t0);
      s.q = j.q + t0 * 2 * j.qs;
      s.q12 = j.q12 + t0 * j.nbp;
      s.sx = j.sx + t0;
      s.y = j.y + t0 * j.ys;
      f4_run(s);
    }
  }
}

}  // namespace

extern "C" {

// y[t, n] = sx_t * sum_g 2^(e[n, g] - 128) * sum_{k in g} E2M1_X2[c[n, k]] * q[t, k], with
// q = round(x / sx_t) in int8 and sx_t = amax_t / 127 (fp4_gemv.py: the summation order).
// w: codes, row n at w + n*rs (K/2 bytes, element 2i in the low nibble of byte i); s: UE8M0
// bytes, row n at s + n*ss (K/32); x: float32, row t at x + t*xstride; y: float32, row t at
// y + t*ys. isa: 0 = best, else that path if it runs here (else best). Returns the path used
// (> 0), -1 bad arguments, -2 out of memory, -3 a NaN/Inf in x, -4 an activation outside the
// int8 range (amax / 127 subnormal), -5 a NaN scale byte (0xFF); y is then incomplete.
int hq_fp4_gemv(const uint8_t* w, int64_t rs, const uint8_t* s, int64_t ss, int64_t N, int64_t K,
                const float* x, int64_t xstride, int64_t T, float* y, int64_t ys, int nthreads,
                int isa) {
  if (K <= 0 || K % 32 || N < 0 || T < 0) return -1;
  isa = pick_isa(isa);
  if (N == 0 || T == 0) return isa;
  F4Prepared P;
  const int rc = f4_prepare(x, xstride, T, K, f4_layout(isa), P);
  if (rc < 0) return rc;
  int bad = 0;
  F4Job base{w, rs, K / 2, s, ss, P.q, P.qs, P.q12, P.nbp, P.sx, T, y, ys, 0, N, isa, 1, &bad};
  base.pf = (12288 + 2 * base.kb - 1) / (2 * base.kb) * 2;  // rows ~12 KB ahead, whole tiles
  const int64_t tile = 2;
  const int64_t blocks = (N + tile - 1) / tile;
  int64_t nt = std::min<int64_t>(std::max(nthreads, 1), std::min<int64_t>(blocks, 256));
  if (nt <= 1) {
    f4_run_blocked(base);
  } else {  // ~8 chunks per thread, whole tiles
    const int64_t chunk = ((blocks + 8 * nt - 1) / (8 * nt)) * tile;
    tl_pool.run((int)nt, (N + chunk - 1) / chunk, [&](int64_t c) {
      F4Job j = base;
      j.n0 = c * chunk;
      j.n1 = std::min(N, (c + 1) * chunk);
      f4_run_blocked(j);
    });
  }
  return __atomic_load_n(&bad, __ATOMIC_RELAXED) ? -5 : isa;
}

}  // extern "C"
