// A/B of the grouped INT4 GEMV kernel: the per-channel kernel, the grouped kernel of a baseline
// tree (old_*) and the grouped kernel of this tree (new_*), on the same codes, in one process,
// interleaved repeat by repeat (order alternating). Built and driven by gemv_group_ab.py, which
// compiles each tree's kernel translation unit with its C entry points renamed.
//
// usage: gemv_group_ab N K MODE T L G ISA THREADS REPEATS
//   MODE: l1    every row reads the same weight bytes (row stride 0): pure arithmetic
//         cache one matrix, called again and again (from the last-level cache if it fits)
//         dram  copies cycled through 256 MB (weights stream from memory)
// Prints one JSON object: per kind, the thread-CPU and wall seconds of each repeat, and bytes.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

extern "C" {
int new_pc(const uint8_t* w, int64_t rs, const float* s, int64_t N, int64_t K, const float* x,
           int64_t xstride, int64_t T, float* y, int64_t ys, int nthreads, int isa, int L);
int new_g(const uint8_t* w, int64_t rs, const uint16_t* sg, int64_t ss, int64_t N, int64_t K,
          int64_t G, const float* x, int64_t xstride, int64_t T, float* y, int64_t ys,
          int nthreads, int isa, int L);
int old_g(const uint8_t* w, int64_t rs, const uint16_t* sg, int64_t ss, int64_t N, int64_t K,
          int64_t G, const float* x, int64_t xstride, int64_t T, float* y, int64_t ys,
          int nthreads, int isa, int L);
}

static double now(clockid_t c) {
  timespec t;
  clock_gettime(c, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc != 10) {
    fprintf(stderr, "usage: %s N K MODE T L G ISA THREADS REPEATS\n", argv[0]);
    return 2;
  }
  const int64_t N = atoll(argv[1]), K = atoll(argv[2]);
  const std::string mode = argv[3];
  const int T = atoi(argv[4]), L = atoi(argv[5]), G = atoi(argv[6]), isa = atoi(argv[7]);
  const int th = atoi(argv[8]), reps = atoi(argv[9]);
  const int64_t wb = N * K / 2, sb = N * (K / G) * 2;
  const int copies = mode == "dram" ? (int)std::max<int64_t>(4, (256ll << 20) / (wb + sb)) : 1;
  const int64_t rs = mode == "l1" ? 0 : K / 2, ss = mode == "l1" ? 0 : K / G;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(1e-4f, 1e-2f);
  std::normal_distribution<float> nd;
  std::vector<std::vector<uint8_t>> W(copies, std::vector<uint8_t>(wb));
  std::vector<std::vector<uint16_t>> S(copies, std::vector<uint16_t>(N * (K / G)));
  std::vector<std::vector<float>> SC(copies, std::vector<float>(N));
  for (auto& b : W[0]) b = (uint8_t)rng();  // copies of one random matrix, as the benchmark's
  for (auto& h : S[0]) {
    const float f = u(rng);
    uint32_t b;
    memcpy(&b, &f, 4);
    h = (uint16_t)(b >> 16);
  }
  for (auto& f : SC[0]) f = u(rng);
  for (int c = 1; c < copies; ++c) W[c] = W[0], S[c] = S[0], SC[c] = SC[0];
  std::vector<float> x((size_t)T * K), y0((size_t)T * N), y1((size_t)T * N);
  for (auto& v : x) v = nd(rng);
  // both grouped kernels must give the same bits (the result is defined by the reference order)
  int r0 = old_g(W[0].data(), K / 2, S[0].data(), K / G, N, K, G, x.data(), K, T, y0.data(), N, th, isa, L);
  int r1 = new_g(W[0].data(), K / 2, S[0].data(), K / G, N, K, G, x.data(), K, T, y1.data(), N, th, isa, L);
  const bool same = r0 > 0 && r0 == r1 && memcmp(y0.data(), y1.data(), y0.size() * 4) == 0;
  const int calls = std::max(copies, (int)(64e6 / (double)(wb + sb)) + 1);
  const char* names[3] = {"per_channel", "group_old", "group_new"};
  std::vector<double> cpu[3], wall[3];
  for (int r = 0; r < reps; ++r)
    for (int kk = 0; kk < 3; ++kk) {
      const int k = r % 2 ? 2 - kk : kk;
      const double c0 = now(CLOCK_THREAD_CPUTIME_ID), w0 = now(CLOCK_MONOTONIC);
      for (int i = 0; i < calls; ++i) {
        const int c = i % copies;
        if (k == 0)
          new_pc(W[c].data(), rs, SC[c].data(), N, K, x.data(), K, T, y0.data(), N, th, isa, L);
        else if (k == 1)
          old_g(W[c].data(), rs, S[c].data(), ss, N, K, G, x.data(), K, T, y0.data(), N, th, isa, L);
        else
          new_g(W[c].data(), rs, S[c].data(), ss, N, K, G, x.data(), K, T, y0.data(), N, th, isa, L);
      }
      cpu[k].push_back((now(CLOCK_THREAD_CPUTIME_ID) - c0) / calls);
      wall[k].push_back((now(CLOCK_MONOTONIC) - w0) / calls);
    }
  printf("{\"isa\": %d, \"identical\": %s, \"copies\": %d, \"calls\": %d, \"bytes\": {\"per_channel\": %lld, "
         "\"group\": %lld}",
         r1, same ? "true" : "false", copies, calls, (long long)(wb + 4 * N), (long long)(wb + sb));
  for (int k = 0; k < 3; ++k) {
    printf(", \"%s\": {\"cpu_s\": [", names[k]);
    for (int r = 0; r < reps; ++r) printf("%s%.9g", r ? ", " : "", cpu[k][r]);
    printf("], \"wall_s\": [");
    for (int r = 0; r < reps; ++r) printf("%s%.9g", r ? ", " : "", wall[k][r]);
    printf("]}");
  }
  printf("}\n");
  return same ? 0 : 1;
}
