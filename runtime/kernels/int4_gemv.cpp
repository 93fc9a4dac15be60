// hetquant int4 GEMV, part 5 of 6: instruction-path dispatch, the worker pool, the activation
// rounding shared by both weight layouts, and the C API (see int4_gemv.py).
namespace {

// Best instruction path of this CPU (Isa), from its features at run time.
static int find_isa() {
#if defined(HQ_SIMDE)
  return AMX_INT8;  // every x86 path, emulated
#elif defined(HQ_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
#ifdef HQ_HAS_AMX
    if (amx_usable()) return AMX_INT8;
#endif
    return AVX512_VNNI;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
#elif defined(HQ_ARM) && defined(__linux__)
  if (getauxval(AT_HWCAP) & HQ_HWCAP_ASIMDDP) return NEON_DOTPROD;
#elif defined(HQ_ARM) && defined(__ARM_FEATURE_DOTPROD)
  return NEON_DOTPROD;  // not Linux: only when the whole build targets dotprod
#endif
  return GENERIC;
}

static int best_isa() {
  static const int best = find_isa();  // once per process (AMX asks the kernel)
  return best;
}

// Whether path `isa` runs on a CPU whose best path is `best` (x86: generic < avx2 < avx512_vnni
// < amx_int8; aarch64: generic < neon_dotprod).
static bool runs_here(int isa, int best) {
  if (isa == GENERIC) return true;
#if defined(HQ_X86)
  return (isa == AVX2 || isa == AVX512_VNNI || isa == AMX_INT8) && isa <= best;
#elif defined(HQ_ARM)
  return isa == NEON_DOTPROD && best == NEON_DOTPROD;
#else
  return false;
#endif
}

// The digit layout of a path's grouped kernel (Transposed; v = 0: natural).
static Transposed grouped_layout(int isa) {
#if defined(HQ_X86)
  if (isa == AVX2) return GroupedAvx2::LAYOUT;
  if (isa == AVX512_VNNI || isa == AMX_INT8) return GroupedVnni::LAYOUT;  // AMX: grouped on VNNI
#endif
  (void)isa;
  return Transposed{};
}

static void run(const Job& j) {
  const bool grouped = j.sg != nullptr;
#if defined(HQ_X86)
#ifdef HQ_HAS_AMX
  if (j.isa == AMX_INT8 && j.xb) { run_amx(j); return; }  // per-channel, T >= AMX_MIN_T
#endif
  if (j.isa == AVX512_VNNI || j.isa == AMX_INT8) { grouped ? grouped_rows<GroupedVnni>(j) : run_vnni(j); return; }
  if (j.isa == AVX2) { grouped ? grouped_rows<GroupedAvx2>(j) : run_avx2(j); return; }
#elif defined(HQ_ARM)
  if (j.isa == NEON_DOTPROD) { grouped ? grouped_rows<GroupedNeon>(j) : run_neon(j); return; }
#endif
  grouped ? run_generic_g(j) : run_generic(j);
}

// The GEMM-shaped order for many tokens (T >= GEMM_MIN_T, unless the caller turned it off with
// hq_int4_token_block): rows in blocks of about 128 KB of weights, and for each row block the
// tokens in blocks whose digit planes take about 160 KB, so that both stay in L2 while the block
// is swept: the digits stream from L3 once per row block instead of once per row (at K = 7168 one
// token's digits are 21 KB; 64 tokens' 1.3 MB did not fit L2). Each block is an ordinary Job over
// fewer rows and tokens run by the same path, and every (row, token) result is computed by the
// same tile code as without blocking, so the result does not depend on it.
constexpr int64_t GEMM_MIN_T = 16;
constexpr int64_t GEMM_ROW_BYTES = 128 << 10, GEMM_DIGIT_BYTES = 160 << 10;
thread_local int tl_token_block = -1;  // -1 auto, 0 never, > 0 that many tokens per block

static void run_blocked(const Job& j) {
  const int64_t per_token = (int64_t)j.L * 2 * j.xs;
  int64_t tb = j.tb;
  if (j.xb) tb = 0;  // AMX sweeps all tokens of a row block itself
  if (tb < 0) tb = j.T >= GEMM_MIN_T ? std::max<int64_t>(2, GEMM_DIGIT_BYTES / per_token / 2 * 2) : 0;
  if (tb <= 0 || tb >= j.T) { run(j); return; }
  const int64_t nb = std::max<int64_t>(4, GEMM_ROW_BYTES / std::max<int64_t>(j.kb, 1) / 4 * 4);
  for (int64_t n0 = j.n0; n0 < j.n1; n0 += nb) {
    for (int64_t t0 = 0; t0 < j.T; t0 += tb) {
      Job s = j;
      s.n0 = n0;
      s.n1 = std::min(j.n1, n0 + nb);
      s.T = std::min(tb, j.T - t0);
      s.xq = j.xq + t0 * per_token;
      s.sx = j.sx + t0;
      s.sx8 = j.sx8 ? j.sx8 + t0 * j.nbp : nullptr;
      s.p2 = j.p2 + t0;
      s.y = j.y + t0 * j.ys;
      run(s);
    }
  }
}

// Worker threads of one calling thread, kept between calls (creating threads per call cost about
// as much as a second thread gained on a 0.5-1 ms GEMV). run(nt, items, fn) calls fn(i) for every
// i in [0, items) on up to nt threads (this one too), the items dealt through an atomic counter,
// so a thread slowed by another process does not hold the call up; every item is computed by
// exactly one thread with the same code, so results do not depend on the split. One pool per
// calling thread (thread_local): concurrent callers (CPU expert subpools) never share workers.
// The workers are joined when the calling thread exits; after a fork() the child forgets the
// parent's workers (they do not exist there) and starts its own.
class Pool {
 public:
  ~Pool() {
    if (pid_ != getpid()) return;
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (pthread_t t : workers_) pthread_join(t, nullptr);
  }

  template <class F>
  void run(int nt, int64_t items, const F& fn) {
    if (items <= 0) return;
    nt = (int)std::min<int64_t>(std::max(nt, 1), std::min<int64_t>(items, 256));
    if (nt == 1) {
      for (int64_t i = 0; i < items; ++i) fn(i);
      return;
    }
    if (pid_ != getpid()) forget_parent();
    while ((int)workers_.size() < nt - 1) {
      {
        std::lock_guard<std::mutex> lk(m_);
        created_gen_ = gen_;  // a new worker joins from the next round on: this one
      }
      pthread_t t;
      if (pthread_create(&t, nullptr, &Pool::main, this) != 0) break;  // fewer threads, then
      workers_.push_back(t);
    }
    const int helpers = std::min<int>(nt - 1, (int)workers_.size());
    {
      std::lock_guard<std::mutex> lk(m_);
      fn_ = [](const void* f, int64_t i) { (*static_cast<const F*>(f))(i); };
      ctx_ = &fn;
      items_ = items;
      next_.store(0, std::memory_order_relaxed);
      active_ = helpers;
      running_ = helpers;
      ++gen_;
    }
    if (helpers > 0) wake_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(m_);
    done_.wait(lk, [&] { return running_ == 0; });
  }

 private:
  // In a forked child the parent's workers do not exist, yet the copied mutex and condition
  // variables still count them as waiters (a broadcast could wait for them forever): start over
  // with fresh objects, without destroying the copied ones.
  void forget_parent() {
    workers_.clear();
    new (&m_) std::mutex();
    new (&wake_) std::condition_variable();
    new (&done_) std::condition_variable();
    stop_ = false;
    next_id_ = active_ = running_ = 0;
    pid_ = getpid();
  }

  static void* main(void* self) {
    static_cast<Pool*>(self)->loop();
    return nullptr;
  }

  void work() {
    for (;;) {
      const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= items_) return;
      fn_(ctx_, i);
    }
  }

  void loop() {
    std::unique_lock<std::mutex> lk(m_);
    const int id = next_id_++;
    uint64_t seen = created_gen_;
    for (;;) {
      wake_.wait(lk, [&] { return stop_ || gen_ != seen; });
      if (stop_) return;
      seen = gen_;
      if (id >= active_) continue;
      lk.unlock();
      work();
      lk.lock();
      if (--running_ == 0) done_.notify_one();
    }
  }

  std::mutex m_;
  std::condition_variable wake_, done_;
  std::vector<pthread_t> workers_;
  pid_t pid_ = getpid();
  bool stop_ = false;
  uint64_t gen_ = 0, created_gen_ = 0;
  int next_id_ = 0, active_ = 0, running_ = 0;
  void (*fn_)(const void*, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  int64_t items_ = 0;
  std::atomic<int64_t> next_{0};
};

thread_local Pool tl_pool;

// Activations of T tokens rounded to fixed point and split into digit planes (int4_gemv.py).
struct Prepared {
  int8_t* xq = nullptr;    // digits [T][L][2][xs]
  int64_t* sx = nullptr;   // per token: sum of X
  int32_t* sx8 = nullptr;  // grouped: per token, nbp entries of 8 * (sum of X over 32-element block)
  double* ex = nullptr;    // per token: 2^e
  int8_t* xb = nullptr;    // AMX: B tiles (int4_gemv_amx.cpp)
  int64_t xs = 0, nbp = 0;
  ~Prepared() { free(xq); free(sx); free(sx8); free(ex); free(xb); }
};

// Digits and block sums in the natural order, or in the transposed layout `lay` of a grouped
// path (Transposed). 0, -2 out of memory, -3 a NaN/Inf in x.
static int prepare(const float* x, int64_t xstride, int64_t T, int64_t K, int L, bool grouped,
                   const Transposed& lay, Prepared& P) {
  const int64_t kb = K / 2;
  P.xs = (kb + PAD - 1) / PAD * PAD;
  P.nbp = grouped ? P.xs / BLK : 0;
  P.xq = (int8_t*)calloc((size_t)(T * L * 2 * P.xs), 1);
  P.sx = (int64_t*)malloc((size_t)T * sizeof(int64_t));
  P.ex = (double*)malloc((size_t)T * sizeof(double));
  if (grouped) P.sx8 = (int32_t*)calloc((size_t)(T * P.nbp), sizeof(int32_t));
  std::vector<int32_t> X;
  try { X.resize((size_t)K); } catch (const std::bad_alloc&) { return -2; }
  if (!P.xq || !P.sx || !P.ex || (grouped && !P.sx8)) return -2;
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * xstride;
    uint32_t abits = 0;  // max of |x| as IEEE bits: integer max vectorises, NaN sorts above Inf
    for (int64_t k = 0; k < K; ++k) {
      uint32_t b;
      memcpy(&b, xr + k, 4);
      b &= 0x7FFFFFFFu;
      abits = b > abits ? b : abits;
    }
    if (abits >= 0x7F800000u) return -3;  // NaN/Inf
    float amax;
    memcpy(&amax, &abits, 4);
    int E = 0;
    if (amax > 0.0f) frexpf(amax, &E);  // amax < 2^E
    const int e = amax > 0.0f ? E - (8 * L - 2) : 0;  // |X| <= 2^(8L-2): top digit within ±64
    if (-e >= -126 && -e <= 127) {  // 2^-e is a normal float: x * 2^-e is exact (or rounds to 0)
      const float scf = ldexpf(1.0f, -e);
      for (int64_t k = 0; k < K; ++k) X[k] = (int32_t)__builtin_lrintf(xr[k] * scf);  // RNE
    } else {
      const double sc = ldexp(1.0, -e);
      for (int64_t k = 0; k < K; ++k) X[k] = (int32_t)__builtin_lrint((double)xr[k] * sc);
    }
    int64_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += X[k];
    if (grouped) {  // |8 * block sum| <= 8 * 32 * 2^22 = 2^30
      for (int64_t b = 0; b < K / 32; ++b) {
        int32_t bs = 0;
        for (int64_t k = 32 * b; k < 32 * b + 32; ++k) bs += X[k];
        P.sx8[t * P.nbp + b] = 8 * bs;
      }
    }
    for (int l = 0; l < L; ++l) {  // balanced base-256 digits in [-128, 127], low digit first
      int8_t* de = P.xq + ((t * L + l) * 2 + 0) * P.xs;
      int8_t* dd = P.xq + ((t * L + l) * 2 + 1) * P.xs;
      const bool top = l + 1 == L;
      for (int64_t i = 0; i < kb; ++i) {
        const int32_t a = X[2 * i], b = X[2 * i + 1];
        const int32_t da = top ? a : ((a + 128) & 255) - 128;
        const int32_t db = top ? b : ((b + 128) & 255) - 128;
        de[i] = (int8_t)da;
        dd[i] = (int8_t)db;
        X[2 * i] = (a - da) / 256;
        X[2 * i + 1] = (b - db) / 256;
      }
      if (lay.v > 0) {
        lay.digits(de, P.xs);
        lay.digits(dd, P.xs);
      }
    }
    if (lay.v > 0) transpose_block_sums(lay, P.sx8 + t * P.nbp, P.nbp);
    P.sx[t] = sum;
    P.ex[t] = ldexp(1.0, e);
  }
  return 0;
}

// Rounds x, then runs `base` (weights, scales, y, isa filled in) over all rows; returns the path.
static int gemv(Job base, const float* x, int64_t xstride, int64_t K, int nthreads, int rows) {
  Prepared P;
  const bool grouped = base.sg != nullptr;
  const Transposed lay = grouped ? grouped_layout(base.isa) : Transposed{};
  const int rc = prepare(x, xstride, base.T, K, base.L, grouped, lay, P);
  if (rc < 0) return rc;
  base.xq = P.xq;
  base.xs = P.xs;
  base.sx = P.sx;
  base.sx8 = P.sx8;
  base.nbp = P.nbp;
  base.p2 = P.ex;
#ifdef HQ_HAS_AMX
  if (base.isa == AMX_INT8 && !base.sg && base.T >= AMX_MIN_T) {
    P.xb = amx_b(P.xq, P.xs, base.L, base.T, base.kb);
    if (!P.xb) return -2;
    base.xb = P.xb;
    base.xbg = amx_groups(base.T, base.L);
  }
#endif
  base.tb = tl_token_block;  // the calling thread's setting, for its workers too
  // prefetch at least ~12 KB ahead (one row tile of a 7168-wide row, more of a 2048-wide one)
  base.pf = base.kb > 0 ? (12288 + rows * base.kb - 1) / (rows * base.kb) : 1;
  const int64_t N = base.n1;
  const int64_t tile = base.xb ? 16 : 4;  // rows of the AMX blocks, of the other paths' tiles
  const int64_t blocks = (N + tile - 1) / tile;
  int64_t nt = nthreads < 1 ? 1 : nthreads;
  if (nt > blocks) nt = blocks;
  if (nt > 256) nt = 256;
  if (nt <= 1) {
    run_blocked(base);
  } else {  // ~8 chunks per thread, whole tiles
    const int64_t chunk = ((blocks + 8 * nt - 1) / (8 * nt)) * tile;
    tl_pool.run((int)nt, (N + chunk - 1) / chunk, [&](int64_t c) {
      Job j = base;
      j.n0 = c * chunk;
      j.n1 = std::min(N, (c + 1) * chunk);
      run_blocked(j);
    });
  }
  return base.isa;
}

static int pick_isa(int isa) {
  const int best = best_isa();
  return isa > 0 && runs_here(isa, best) ? isa : best;
}

}  // namespace

extern "C" {

// Best instruction path of this CPU: 4 = NEON dotprod (aarch64), 5 = AMX-INT8, 3 = AVX-512
// VNNI, 2 = AVX2 (x86-64), 1 = generic C++.
int hq_int4_best_isa(void) { return best_isa(); }

// Token blocking of the calling thread's next calls (see run_blocked): -1 auto (from
// GEMM_MIN_T tokens on), 0 never, n > 0 blocks of n tokens. Results do not depend on it.
void hq_int4_token_block(int tokens) { tl_token_block = tokens < 0 ? -1 : tokens; }

// Per-channel: y[t, n] = s[n] * sum_k (c[n, k] - 8) * x[t, k]   (c from the int4_cpu packing).
// w: row n at w + n*rs, K/2 bytes; s: float32 [N]; x: float32, row t at x + t*xstride;
// y: float32, row t at y + t*ys. isa: 0 = best, else that path if it runs here (else best).
// L: digit planes (3 or 2). Returns the path used (> 0), -1 bad arguments, -2 out of memory,
// -3 a NaN/Inf in x (nothing written).
int hq_int4_gemv(const uint8_t* w, int64_t rs, const float* s, int64_t N, int64_t K,
                 const float* x, int64_t xstride, int64_t T, float* y, int64_t ys,
                 int nthreads, int isa, int L) {
  if (K <= 0 || K % 2 || K > (int64_t)1 << 20 || N < 0 || T < 0 || L < 2 || L > LMAX) return -1;
  isa = pick_isa(isa);
  if (N == 0 || T == 0) return isa;
  Job base{w, rs, K / 2, s, nullptr, 0, 0, nullptr, 0, L, nullptr, nullptr, 0, nullptr,
           T, y, ys, 0, N, isa, 1};
  return gemv(base, x, xstride, K, nthreads, 4);
}

// Grouped: y[t, n] = sum_j bf16(sg[n, j]) * sum_{k in group j} (c[n, k] - 8) * x[t, k], groups
// of G = 32, 64 or 128 along K (K a multiple of G); sg: bf16 bits, row n at sg + n*ss. Other
// arguments and return values as hq_int4_gemv.
int hq_int4_gemv_grouped(const uint8_t* w, int64_t rs, const uint16_t* sg, int64_t ss,
                         int64_t N, int64_t K, int64_t G, const float* x, int64_t xstride,
                         int64_t T, float* y, int64_t ys, int nthreads, int isa, int L) {
  if (K <= 0 || K > (int64_t)1 << 20 || N < 0 || T < 0 || L < 2 || L > LMAX) return -1;
  if ((G != 32 && G != 64 && G != 128) || K % G) return -1;
  isa = pick_isa(isa);
  if (N == 0 || T == 0) return isa;
  Job base{w, rs, K / 2, nullptr, sg, ss, (int)(G / 32), nullptr, 0, L, nullptr, nullptr, 0,
           nullptr, T, y, ys, 0, N, isa, 1};
  return gemv(base, x, xstride, K, nthreads, 1);
}

}  // extern "C"
