// Test driver for the FP4 GEMV on another machine (aarch64 under qemu user mode): linked with the
// kernel library's one translation unit (hetquant.runtime.kernels.int4_gemv._CPP_SOURCE), it runs
// the cases of an input file and writes the results (test_fp4_gemv_crossisa.py writes and reads
// both).
//
// Input, little-endian: "HQF1", int64 case count, then per case: int64 N, K, T, isa, rs, ss,
// threads; N*rs code bytes; N*ss UE8M0 scale bytes; T*K float32 activations. Output: "HQR1",
// int64 best isa, then per case: int64 return code (the path used, or < 0), T*N float32 results.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

extern "C" {
int hq_int4_best_isa(void);
int hq_fp4_gemv(const uint8_t* w, int64_t rs, const uint8_t* s, int64_t ss, int64_t N, int64_t K,
                const float* x, int64_t xstride, int64_t T, float* y, int64_t ys, int nthreads,
                int isa);
}

static void need(bool ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "driver: %s\n", what);
    exit(2);
  }
}

template <class V>
static void read_into(FILE* f, V* dst, size_t n) {
  need(fread(dst, sizeof(V), n, f) == n, "short input file");
}

int main(int argc, char** argv) {
  need(argc == 3, "usage: driver INPUT OUTPUT");
  FILE* in = fopen(argv[1], "rb");
  FILE* out = fopen(argv[2], "wb");
  need(in && out, "cannot open the files");
  char magic[4];
  read_into(in, magic, 4);
  need(memcmp(magic, "HQF1", 4) == 0, "bad magic");
  int64_t cases;
  read_into(in, &cases, 1);
  const int64_t best = hq_int4_best_isa();
  fwrite("HQR1", 1, 4, out);
  fwrite(&best, sizeof best, 1, out);
  for (int64_t c = 0; c < cases; ++c) {
    int64_t h[7];
    read_into(in, h, 7);
    const int64_t N = h[0], K = h[1], T = h[2], isa = h[3], rs = h[4], ss = h[5], threads = h[6];
    std::vector<uint8_t> w((size_t)(N * rs)), s((size_t)(N * ss));
    std::vector<float> x((size_t)(T * K)), y((size_t)(T * N), -1.0f);
    read_into(in, w.data(), w.size());
    read_into(in, s.data(), s.size());
    read_into(in, x.data(), x.size());
    const int64_t rc = hq_fp4_gemv(w.data(), rs, s.data(), ss, N, K, x.data(), K, T, y.data(), N,
                                   (int)threads, (int)isa);
    fwrite(&rc, sizeof rc, 1, out);
    fwrite(y.data(), sizeof(float), y.size(), out);
  }
  need(fclose(out) == 0, "cannot write the output");
  fclose(in);
  return 0;
}
