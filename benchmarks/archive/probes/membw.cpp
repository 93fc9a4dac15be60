// Streaming read bandwidth of this machine: T threads each sum their own contiguous part of a
// 2 GiB buffer with AVX-512 loads, without and with a software prefetch 4 KB / 16 KB ahead (best
// of 3). benchmarks/README.md "One call per layer, and AMX" quotes it (the H100 host, 2026-11-24).
//   g++ -O2 -std=c++17 benchmarks/archive/probes/membw.cpp -o /tmp/membw -lpthread && /tmp/membw
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <vector>

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

struct Part {
  const uint8_t* p;
  size_t n;
  int pf;
  long long out;
};

__attribute__((target("avx512f,avx512bw"))) static void* body(void* arg) {
  Part* a = (Part*)arg;
  __m512i s0 = _mm512_setzero_si512(), s1 = s0;
  for (size_t i = 0; i < a->n; i += 128) {
    if (a->pf) _mm_prefetch((const char*)a->p + i + a->pf, _MM_HINT_T1);
    s0 = _mm512_add_epi64(s0, _mm512_load_si512(a->p + i));
    s1 = _mm512_add_epi64(s1, _mm512_load_si512(a->p + i + 64));
  }
  a->out = _mm512_reduce_add_epi64(_mm512_add_epi64(s0, s1));
  return nullptr;
}

int main() {
  const size_t total = (size_t)2 << 30;
  uint8_t* buf = (uint8_t*)aligned_alloc(4096, total);
  memset(buf, 1, total);
  for (int pf : {0, 4096, 16384})
    for (int T : {1, 2, 4, 8, 16}) {
      double best = 1e9;
      for (int rep = 0; rep < 3; ++rep) {
        std::vector<pthread_t> th(T);
        std::vector<Part> a(T);
        const size_t per = total / T / 128 * 128;
        const double t0 = now();
        for (int i = 0; i < T; ++i) {
          a[i] = {buf + i * per, per, pf, 0};
          pthread_create(&th[i], nullptr, body, &a[i]);
        }
        for (int i = 0; i < T; ++i) pthread_join(th[i], nullptr);
        const double dt = now() - t0;
        if (dt < best) best = dt;
      }
      printf("bw threads %d prefetch %d: %.1f GB/s\n", T, pf, total / best / 1e9);
    }
  free(buf);
  return 0;
}
