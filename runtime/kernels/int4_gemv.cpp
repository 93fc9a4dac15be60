// hetquant int4_cpu GEMV (see hetquant/runtime/int4_gemv.py for the math and the error bound).
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
#if defined(__x86_64__)
#include <immintrin.h>
#define HQ_X86 1
#endif

namespace {

constexpr int LMAX = 3;        // signed-byte digits per activation: L = 3 (|X| < 2^22) or 2 (2^14)
constexpr int64_t PAD = 64;    // digit rows padded to a multiple of 64 bytes (zeros)

struct Job {
  const uint8_t* w; int64_t rs; int64_t kb;   // packed rows: stride rs bytes, kb = K/2 bytes used
  const float* s;                             // scales [N]
  const int8_t* xq; int64_t xs; int L;        // digits [T][L][2][xs]: d_l of x[2i] (h=0), x[2i+1] (h=1)
  const int64_t* sx; const double* p2;        // per token: sum of X, 2^e
  int64_t T; float* y; int64_t ys;            // y [T, N], row stride ys
  int64_t n0, n1;                             // rows of this worker
  int isa;
  int64_t pf;                                 // prefetch distance in tiles (>= 1)
};

static inline const int8_t* digits(const Job& j, int64_t t, int l, int h) {
  return j.xq + ((t * j.L + l) * 2 + h) * j.xs;
}

static inline void finish(const Job& j, int64_t t, int64_t n, int64_t acc) {
  // (acc - 8 ΣX) and its product with 2^e are exact in double; one rounding by s, one to float
  const double v = (double)j.s[n] * ((double)(acc - 8 * j.sx[t]) * j.p2[t]);
  j.y[t * j.ys + n] = (float)v;
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

#ifdef HQ_X86
// ---------------------------------------------------------------- AVX2: vpmaddubsw + vpmaddwd
#define HQ_AVX2 __attribute__((target("avx2,fma")))
template <int R, int TT, int L>
HQ_AVX2 static inline void tile_avx2(const Job& j, int64_t n, int64_t t0) {
  const __m256i m15 = _mm256_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][TT][L];
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 64
      for (int l = 0; l < L; ++l) acc[r][t][l] = _mm256_setzero_si256();
  for (int64_t i = 0; i < j.kb; i += 32) {
    const int64_t left = j.kb - i;
    __m256i lo[R], hi[R];
#pragma GCC unroll 64
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = j.w + (n + r) * j.rs + i;
      _mm_prefetch((const char*)(p + R * j.pf * j.rs), _MM_HINT_T1);
      __m256i v;
      if (left >= 32) {
        v = _mm256_loadu_si256((const __m256i*)p);
      } else {
        alignas(32) uint8_t tmp[32] = {0};
        memcpy(tmp, p, (size_t)left);
        v = _mm256_load_si256((const __m256i*)tmp);
      }
      lo[r] = _mm256_and_si256(v, m15);
      hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
    }
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 64
      for (int l = 0; l < L; ++l) {
        const __m256i de = _mm256_loadu_si256((const __m256i*)(digits(j, t0 + t, l, 0) + i));
        const __m256i dd = _mm256_loadu_si256((const __m256i*)(digits(j, t0 + t, l, 1) + i));
#pragma GCC unroll 64
        for (int r = 0; r < R; ++r) {
          // |c·d| ≤ 15·128: pair sums ≤ 3840, lo + hi ≤ 7680: no int16 saturation
          const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], de),
                                               _mm256_maddubs_epi16(hi[r], dd));
          acc[r][t][l] = _mm256_add_epi32(acc[r][t][l], _mm256_madd_epi16(p16, ones));
        }
      }
  }
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t) {
      int64_t a = 0;
      for (int l = L - 1; l >= 0; --l) {
        __m128i q = _mm_add_epi32(_mm256_castsi256_si128(acc[r][t][l]),
                                  _mm256_extracti128_si256(acc[r][t][l], 1));
        q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4E));
        q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1));
        a = a * 256 + _mm_cvtsi128_si32(q);
      }
      finish(j, t0 + t, n + r, a);
    }
}

template <int L>
HQ_AVX2 static void run_avx2_l(const Job& j) {
  int64_t n = j.n0;
  if (j.T == 1) {
    for (; n + 2 <= j.n1; n += 2) tile_avx2<2, 1, L>(j, n, 0);
  }
  for (; n < j.n1; ++n) {
    int64_t t = 0;
    for (; t + 2 <= j.T; t += 2) tile_avx2<1, 2, L>(j, n, t);
    if (t < j.T) tile_avx2<1, 1, L>(j, n, t);
  }
}

HQ_AVX2 static void run_avx2(const Job& j) {
  if (j.L == 2) run_avx2_l<2>(j); else run_avx2_l<3>(j);
}

// ---------------------------------------------------------------- AVX-512 VNNI: vpdpbusd
#define HQ_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
template <int R, int TT, int L>
HQ_VNNI static inline void tile_vnni(const Job& j, int64_t n, int64_t t0) {
  const __m512i m15 = _mm512_set1_epi8(15);
  __m512i acc[R][TT][L];
#pragma GCC unroll 64
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 64
      for (int l = 0; l < L; ++l) acc[r][t][l] = _mm512_setzero_si512();
  for (int64_t i = 0; i < j.kb; i += 64) {
    const int64_t left = j.kb - i;
    const __mmask64 mk = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
    __m512i lo[R], hi[R];
#pragma GCC unroll 64
    for (int r = 0; r < R; ++r) {
      // rows R·pf ahead (pf tiles, >= ~12 KB) into L2; into L1 they would evict the digits
      _mm_prefetch((const char*)(j.w + (n + R * j.pf + r) * j.rs + i), _MM_HINT_T1);
      const __m512i v = _mm512_maskz_loadu_epi8(mk, j.w + (n + r) * j.rs + i);
      lo[r] = _mm512_and_si512(v, m15);
      hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
    }
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t)
#pragma GCC unroll 64
      for (int l = 0; l < L; ++l) {
        const __m512i de = _mm512_loadu_si512(digits(j, t0 + t, l, 0) + i);
        const __m512i dd = _mm512_loadu_si512(digits(j, t0 + t, l, 1) + i);
#pragma GCC unroll 64
        for (int r = 0; r < R; ++r) {
          acc[r][t][l] = _mm512_dpbusd_epi32(acc[r][t][l], lo[r], de);
          acc[r][t][l] = _mm512_dpbusd_epi32(acc[r][t][l], hi[r], dd);
        }
      }
  }
  if constexpr (R == 4) {
    // Reduce the four rows of a digit plane together: 4 × 16 lanes → [r0, r1, r2, r3].
#pragma GCC unroll 64
    for (int t = 0; t < TT; ++t) {
      __m256i tot = _mm256_setzero_si256();  // int64 per row: sum over planes of 256^l · plane
#pragma GCC unroll 8
      for (int l = 0; l < L; ++l) {
        const __m512i a0 = acc[0][t][l], a1 = acc[1][t][l], a2 = acc[2][t][l], a3 = acc[3][t][l];
        const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
        const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
        const __m512i q = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
        const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(q), _mm512_extracti64x4_epi64(q, 1));
        const __m128i v = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        tot = _mm256_add_epi64(tot, _mm256_slli_epi64(_mm256_cvtepi32_epi64(v), 8 * l));
      }
      alignas(32) int64_t out[4];
      _mm256_store_si256((__m256i*)out, tot);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) finish(j, t0 + t, n + r, out[r]);
    }
  } else {
#pragma GCC unroll 64
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 64
      for (int t = 0; t < TT; ++t) {
        int64_t a = 0;
        for (int l = L - 1; l >= 0; --l) a = a * 256 + _mm512_reduce_add_epi32(acc[r][t][l]);
        finish(j, t0 + t, n + r, a);
      }
  }
}

template <int L>
HQ_VNNI static void run_vnni_l(const Job& j) {
  int64_t n = j.n0;
  if (j.T == 1) {
    for (; n + 4 <= j.n1; n += 4) tile_vnni<4, 1, L>(j, n, 0);
  } else if (j.T == 2) {
    for (; n + 2 <= j.n1; n += 2) tile_vnni<2, 2, L>(j, n, 0);
  }
  for (; n < j.n1; ++n) {
    int64_t t = 0;
    for (; t + 4 <= j.T; t += 4) tile_vnni<1, 4, L>(j, n, t);
    switch (j.T - t) {
      case 3: tile_vnni<1, 3, L>(j, n, t); break;
      case 2: tile_vnni<1, 2, L>(j, n, t); break;
      case 1: tile_vnni<1, 1, L>(j, n, t); break;
      default: break;
    }
  }
}

HQ_VNNI static void run_vnni(const Job& j) {
  if (j.L == 2) run_vnni_l<2>(j); else run_vnni_l<3>(j);
}
#endif

static void run(const Job& j) {
#ifdef HQ_X86
  if (j.isa == 3) { run_vnni(j); return; }
  if (j.isa == 2) { run_avx2(j); return; }
#endif
  run_generic(j);
}

// Worker threads of one calling thread, kept between calls (creating threads per call cost about
// as much as a second thread gained on a 0.5-1 ms GEMV). The rows are dealt in chunks through an
// atomic counter, so a thread slowed by another process does not hold the call up; every row is
// computed by exactly one thread with the same code, so the result does not depend on the split.
// One pool per calling thread (thread_local): concurrent callers (CPU expert subpools) never
// share workers. The workers are joined when the calling thread exits; after a fork() the child
// forgets the parent's workers (they do not exist there) and starts its own.
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

  // Run rows [0, base.n1) of base in chunks of `chunk` rows on up to `nt` threads (this one too).
  void run_all(const Job& base, int64_t chunk, int nt) {
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
      base_ = &base;
      chunk_ = chunk;
      chunks_ = (base.n1 + chunk - 1) / chunk;
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
      const int64_t c = next_.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks_) return;
      Job j = *base_;
      j.n0 = c * chunk_;
      j.n1 = std::min(base_->n1, (c + 1) * chunk_);
      run(j);
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
  const Job* base_ = nullptr;
  int64_t chunk_ = 4, chunks_ = 0;
  std::atomic<int64_t> next_{0};
};

thread_local Pool tl_pool;

}  // namespace

extern "C" {

// Best instruction path of this CPU: 3 = AVX-512 VNNI, 2 = AVX2, 1 = generic C++.
int hq_int4_best_isa(void) {
#ifdef HQ_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return 3;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 2;
#endif
  return 1;
}

// y[t, n] = s[n] * sum_k (c[n, k] - 8) * x[t, k]   (c from the int4_cpu packing).
// w: row n at w + n*rs, K/2 bytes; s: float32 [N]; x: float32, row t at x + t*xstride;
// y: float32, row t at y + t*ys. isa: 0 = best, else min(isa, best). Returns the path used
// (> 0), -1 bad arguments, -2 out of memory, -3 a NaN/Inf in x (nothing written).
int hq_int4_gemv(const uint8_t* w, int64_t rs, const float* s, int64_t N, int64_t K,
                 const float* x, int64_t xstride, int64_t T, float* y, int64_t ys,
                 int nthreads, int isa, int L) {
  if (K <= 0 || K % 2 || K > (int64_t)1 << 20 || N < 0 || T < 0 || L < 2 || L > LMAX) return -1;
  const int best = hq_int4_best_isa();
  if (isa <= 0 || isa > best) isa = best;
  if (N == 0 || T == 0) return isa;
  const int64_t kb = K / 2;
  const int64_t xs = (kb + PAD - 1) / PAD * PAD;
  int8_t* xq = (int8_t*)calloc((size_t)(T * L * 2 * xs), 1);
  int64_t* sx = (int64_t*)malloc((size_t)T * sizeof(int64_t));
  double* ex = (double*)malloc((size_t)T * sizeof(double));
  if (!xq || !sx || !ex) { free(xq); free(sx); free(ex); return -2; }
  int32_t* X = (int32_t*)malloc((size_t)K * sizeof(int32_t));
  if (!X) { free(xq); free(sx); free(ex); return -2; }
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * xstride;
    uint32_t abits = 0;  // max of |x| as IEEE bits: integer max vectorises, NaN sorts above Inf
    for (int64_t k = 0; k < K; ++k) {
      uint32_t b;
      memcpy(&b, xr + k, 4);
      b &= 0x7FFFFFFFu;
      abits = b > abits ? b : abits;
    }
    if (abits >= 0x7F800000u) { free(X); free(xq); free(sx); free(ex); return -3; }  // NaN/Inf
    float amax;
    memcpy(&amax, &abits, 4);
    int E = 0;
    if (amax > 0.0f) frexpf(amax, &E);  // amax < 2^E
    const int e = amax > 0.0f ? E - (8 * L - 2) : 0;  // |X| < 2^(8L-2): top digit within ±64
    int64_t sum = 0;
    if (-e >= -126 && -e <= 127) {  // 2^-e is a normal float: x * 2^-e is exact (or rounds to 0)
      const float scf = ldexpf(1.0f, -e);
      for (int64_t k = 0; k < K; ++k) X[k] = (int32_t)__builtin_lrintf(xr[k] * scf);  // RNE
    } else {
      const double sc = ldexp(1.0, -e);
      for (int64_t k = 0; k < K; ++k) X[k] = (int32_t)__builtin_lrint((double)xr[k] * sc);
    }
    for (int64_t k = 0; k < K; ++k) sum += X[k];
    for (int l = 0; l < L; ++l) {  // balanced base-256 digits in [-128, 127], low digit first
      int8_t* de = xq + ((t * L + l) * 2 + 0) * xs;
      int8_t* dd = xq + ((t * L + l) * 2 + 1) * xs;
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
    }
    sx[t] = sum;
    ex[t] = ldexp(1.0, e);
  }
  free(X);
  // prefetch at least ~12 KB ahead (one 4-row tile of a 7168-wide row, three of a 2048-wide)
  const int64_t pf = kb > 0 ? (12288 + 4 * kb - 1) / (4 * kb) : 1;
  Job base{w, rs, kb, s, xq, xs, L, sx, ex, T, y, ys, 0, N, isa, pf};
  const int64_t blocks = (N + 3) / 4;
  int64_t nt = nthreads < 1 ? 1 : nthreads;
  if (nt > blocks) nt = blocks;
  if (nt > 256) nt = 256;
  if (nt <= 1) {
    run(base);
  } else {  // ~8 chunks per thread, whole 4-row tiles
    const int64_t chunk = ((blocks + 8 * nt - 1) / (8 * nt)) * 4;
    tl_pool.run_all(base, chunk, (int)nt);
  }
  free(xq); free(sx); free(ex);
  return isa;
}

}  // extern "C"
