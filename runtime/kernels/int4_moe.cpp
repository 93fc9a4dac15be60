// hetquant int4 GEMV, part 6 of 6: the routed-expert sum of one MoE layer (per-channel experts)
// in one call, on the calling thread's worker pool (int4_moe.py). Per call, in phases (each one
// Pool::run, items dealt through an atomic counter):
//   1. every token's activation digits, once (prepare, in token ranges);
//   2. per expert: its tokens' digits gathered (and the AMX B tiles built);
//   3. gate_up GEMVs: items of ~ITEM_BYTES of weight rows, expert after expert, so all threads
//      stream different rows of the same experts (balanced by bytes, whatever the routing);
//   4. per expert: a = silu(gate) * up in float32 (gate rows even, up rows odd), then its digits;
//   5. down GEMVs, as 3;
//   6. out[t] = sum over the token's experts, in the order given, of w * y, in float32, per
//      column range of the hidden size (each thread its own 64-byte-aligned columns).
// Every GEMV row is computed by the same tile code as hq_int4_gemv, and steps 4 and 6 do the
// float operations of the torch composition they replace (x / (1 + expf(-x)) * up; y * w added to
// a zero-initialised sum expert by expert), so the result is bit-identical to it.
namespace {

constexpr int64_t ITEM_BYTES = 512 << 10;  // weight bytes of one work item (whole row tiles)
constexpr int64_t KEEP_BYTES = 64 << 20;   // scratch kept between calls up to this size

// Scratch of the calling thread, kept between calls (no page faults on every call).
struct Scratch {
  uint8_t* p = nullptr;
  size_t cap = 0;
  ~Scratch() { free(p); }
  uint8_t* get(size_t bytes) {
    if (bytes > cap) {
      free(p);
      p = (uint8_t*)aligned_alloc(64, bytes);
      cap = p ? bytes : 0;
    }
    return p;
  }
  void trim() {
    if (cap > (size_t)KEEP_BYTES) {
      free(p);
      p = nullptr;
      cap = 0;
    }
  }
};
thread_local Scratch tl_scratch;

struct MoeMatrix {  // one projection of every expert: expert e's row n at w + e*es + n*rs
  const uint8_t* w; int64_t es, rs;
  const float* s; int64_t ss;  // scales: expert e's at s + e*ss
  int64_t N, K;
};

struct MoeExpert {        // one expert's share of the call
  int64_t e, off, T;      // expert, its first entry in tok / wts, its token count
  const int8_t* xq;       // gate_up input digits [T][L][2][xs1]
  const int64_t* sx; const double* p2;
  int8_t* xb1 = nullptr;  // AMX B tiles of xq
  Prepared down;          // down input digits (and B tiles)
  float *gu, *act, *y;    // [T][N1p], [T][K2], [T][Hp]
};

static int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// A job over all rows of matrix m for expert x's T tokens.
static Job moe_job(const MoeMatrix& m, const MoeExpert& x, const int8_t* xq, int64_t xs,
                   const int64_t* sx, const double* p2, const int8_t* xb, float* y, int64_t ys,
                   int isa, int L) {
  const int64_t kb = m.K / 2;
  Job j{m.w + x.e * m.es, m.rs, kb, m.s + x.e * m.ss, nullptr, 0, 0, xq, xs, L, sx, nullptr, 0,
        p2, x.T, y, ys, 0, m.N, isa, kb > 0 ? (12288 + 4 * kb - 1) / (4 * kb) : 1};
  j.xb = xb;
#ifdef HQ_HAS_AMX
  j.xbg = xb ? amx_groups(x.T, L) : 0;
#endif
  return j;
}

// Phases 3 and 5: the GEMVs of matrix m for every expert, in items of ~ITEM_BYTES of whole row
// tiles, expert after expert.
static void moe_gemvs(const MoeMatrix& m, std::vector<MoeExpert>& ex, bool up, int isa, int L,
                      int64_t xs1, int nt) {
  const int64_t tile = isa == AMX_INT8 ? 16 : 4, ys = round_up(m.N, 16);
  const int64_t rows = std::max(tile, ITEM_BYTES / std::max<int64_t>(m.K / 2, 1) / tile * tile);
  const int64_t per = (m.N + rows - 1) / rows;  // items per expert
  tl_pool.run(nt, (int64_t)ex.size() * per, [&](int64_t i) {
    const MoeExpert& x = ex[i / per];
    Job j = up ? moe_job(m, x, x.xq, xs1, x.sx, x.p2, x.xb1, x.gu, ys, isa, L)
               : moe_job(m, x, x.down.xq, x.down.xs, x.down.sx, x.down.ex, x.down.xb, x.y, ys,
                         isa, L);
    j.n0 = i % per * rows;
    j.n1 = std::min(m.N, j.n0 + rows);
    run_blocked(j);
  });
}

// Phases 1-2: every token's digits, then each expert's gathered (and its B tiles). 0 or < 0.
static int moe_inputs(const float* x, int64_t T, int64_t H, const int64_t* tok,
                      std::vector<MoeExpert>& ex, int8_t* xq, int64_t* sx, double* p2, int isa,
                      int L, int nt, int64_t& xs1) {
  const int64_t R = std::min<int64_t>(std::max(nt, 1), T);  // token ranges
  std::vector<Prepared> P((size_t)R);
  std::vector<int> rc((size_t)R, 0);
  tl_pool.run(nt, R, [&](int64_t r) {
    const int64_t t0 = r * T / R, t1 = (r + 1) * T / R;
    rc[r] = prepare(x + t0 * H, H, t1 - t0, H, L, false, Transposed{}, P[r]);
  });
  for (int c : rc)
    if (c < 0) return c;
  xs1 = P[0].xs;
  const int64_t per = (int64_t)L * 2 * xs1;
  std::atomic<int> bad{0};
  tl_pool.run(nt, (int64_t)ex.size(), [&](int64_t g) {
    MoeExpert& e = ex[g];
    for (int64_t i = 0; i < e.T; ++i) {
      const int64_t t = tok[e.off + i], r = ((t + 1) * R - 1) / T, u = t - r * T / R;  // range r
      memcpy(xq + (e.off + i) * per, P[r].xq + u * per, (size_t)per);
      sx[e.off + i] = P[r].sx[u];
      p2[e.off + i] = P[r].ex[u];
    }
    e.xq = xq + e.off * per;
    e.sx = sx + e.off;
    e.p2 = p2 + e.off;
#ifdef HQ_HAS_AMX
    if (isa == AMX_INT8 && e.T >= AMX_MIN_T && !(e.xb1 = amx_b(e.xq, xs1, L, e.T, H / 2)))
      bad = -2;
#endif
  });
  return bad;
}

// Phase 4 for expert e: a = silu(gate) * up, then its digits. 0 or < 0.
static int moe_act(MoeExpert& e, int64_t N1, int isa, int L) {
  const int64_t K2 = N1 / 2, ys = round_up(N1, 16);
  for (int64_t i = 0; i < e.T; ++i) {
    const float* g = e.gu + i * ys;
    float* a = e.act + i * K2;
    for (int64_t k = 0; k < K2; ++k) {
      const float gate = g[2 * k], up = g[2 * k + 1];
      const float silu = gate / (1.0f + expf(-gate));
      a[k] = silu * up;
    }
  }
  const int rc = prepare(e.act, K2, e.T, K2, L, false, Transposed{}, e.down);
  if (rc < 0) return rc;
#ifdef HQ_HAS_AMX
  if (isa == AMX_INT8 && e.T >= AMX_MIN_T &&
      !(e.down.xb = amx_b(e.down.xq, e.down.xs, L, e.T, K2 / 2)))
    return -2;
#endif
  return 0;
}

// Phase 6 on columns [h0, h1): out[t] = 0, then + w * y of each expert of the token, in order.
static void moe_sum(const std::vector<MoeExpert>& ex, const int64_t* tok, const float* wts,
                    float* out, int64_t T, int64_t H, int64_t h0, int64_t h1) {
  const int64_t ys = round_up(H, 16);
  for (int64_t t = 0; t < T; ++t) memset(out + t * H + h0, 0, (size_t)(h1 - h0) * sizeof(float));
  for (const MoeExpert& e : ex)
    for (int64_t i = 0; i < e.T; ++i) {
      const float w = wts[e.off + i];
      const float* y = e.y + i * ys;
      float* o = out + tok[e.off + i] * H;
      for (int64_t h = h0; h < h1; ++h) {
        const float p = y[h] * w;  // two roundings, as torch's y * w then index_add_
        o[h] = o[h] + p;
      }
    }
}

static int moe(const MoeMatrix& gu, const MoeMatrix& dn, const float* x, int64_t T,
               std::vector<MoeExpert>& ex, const int64_t* tok, const float* wts, float* out,
               int nt, int isa, int L) {
  const int64_t H = gu.K, N1 = gu.N, K2 = N1 / 2, n = ex.empty() ? 0 : ex.back().off + ex.back().T;
  const int64_t xs1 = round_up(H / 2, PAD), n1p = round_up(N1, 16), hp = round_up(H, 16);
  const int64_t per = (int64_t)L * 2 * xs1;
  // scratch: gathered digits, sums of X, 2^e, gate_up out, activations, down out (64-aligned)
  const int64_t sizes[6] = {round_up(n * per, 64), round_up(n * 8, 64), round_up(n * 8, 64),
                            n * n1p * 4, round_up(n * K2 * 4, 64), n * hp * 4};
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  uint8_t* base = tl_scratch.get((size_t)std::max<int64_t>(total, 64));
  if (!base) return -2;
  uint8_t* at[6];
  for (int i = 0; i < 6; ++i) {
    at[i] = base;
    base += sizes[i];
  }
  for (MoeExpert& e : ex) {
    e.gu = (float*)at[3] + e.off * n1p;
    e.act = (float*)at[4] + e.off * K2;
    e.y = (float*)at[5] + e.off * hp;
  }
  int64_t xs = 0;
  int rc = moe_inputs(x, T, H, tok, ex, (int8_t*)at[0], (int64_t*)at[1], (double*)at[2], isa, L,
                      nt, xs);
  if (rc == 0 && xs != xs1) rc = -1;  // prepare pads as this function assumed
  if (rc == 0) {
    moe_gemvs(gu, ex, true, isa, L, xs1, nt);
    std::vector<int> rcs(ex.size(), 0);
    tl_pool.run(nt, (int64_t)ex.size(), [&](int64_t g) { rcs[g] = moe_act(ex[g], N1, isa, L); });
    for (int c : rcs) rc = std::min(rc, c);
  }
  if (rc == 0) {
    moe_gemvs(dn, ex, false, isa, L, xs1, nt);
    const int64_t cols = 256;  // a multiple of 16 floats: threads never share a cache line
    tl_pool.run(nt, (H + cols - 1) / cols, [&](int64_t c) {
      moe_sum(ex, tok, wts, out, T, H, c * cols, std::min(H, (c + 1) * cols));
    });
  }
  for (MoeExpert& e : ex) free(e.xb1);
  tl_scratch.trim();
  return rc < 0 ? rc : isa;
}

}  // namespace

extern "C" {

// The routed-expert sum of one MoE layer, per-channel int4 experts (int4_moe.py):
//   out[t, :] = sum over j with tok[j] = t, in increasing j, of wts[j] * down_e(silu(gate_e x[t])
//               * up_e x[t]),  e = the expert of entry j,
// entries grouped by expert: group g (expert eids[g]) holds entries offs[g] .. offs[g+1]-1.
// gate_up: expert e's [N1, H] rows at gw + e*ges (row stride grs), scales gs + e*gss (rows 2i
// gate, 2i+1 up); down: [H, N1/2] rows at dw + e*des (row stride drs), scales ds + e*dss; x
// float32 [T, H] contiguous; out float32 [T, H], written. Returns the path used (> 0), -1 bad
// arguments, -2 out of memory, -3 a NaN/Inf in x or in an expert's activations (out undefined).
int hq_int4_moe(const uint8_t* gw, int64_t ges, int64_t grs, const float* gs, int64_t gss,
                int64_t N1, const uint8_t* dw, int64_t des, int64_t drs, const float* ds,
                int64_t dss, int64_t H, int64_t E, const float* x, int64_t T, int64_t G,
                const int64_t* eids, const int64_t* offs, const int64_t* tok, const float* wts,
                float* out, int nthreads, int isa, int L) {
  if (H <= 0 || H % 2 || H > (int64_t)1 << 20 || N1 <= 0 || N1 % 4 || N1 / 2 > (int64_t)1 << 20)
    return -1;
  if (T < 0 || G < 0 || E < 0 || L < 2 || L > LMAX) return -1;
  isa = pick_isa(isa);
  std::vector<MoeExpert> ex((size_t)G);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t a = offs[g], b = offs[g + 1];
    if (eids[g] < 0 || eids[g] >= E || a < 0 || b < a || b > offs[G]) return -1;
    ex[g].e = eids[g];
    ex[g].off = a;
    ex[g].T = b - a;
    for (int64_t i = a; i < b; ++i)
      if (tok[i] < 0 || tok[i] >= T) return -1;
  }
  if (G > 0 && offs[0] != 0) return -1;
  const MoeMatrix gu{gw, ges, grs, gs, gss, N1, H}, dn{dw, des, drs, ds, dss, H, N1 / 2};
  if (T == 0) return isa;
  return moe(gu, dn, x, T, ex, tok, wts, out, nthreads, isa, L);
}

}  // extern "C"
