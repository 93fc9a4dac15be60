// Test driver for the int4 GEMV kernel on another machine (aarch64 under qemu user mode): linked
// with the kernel's one translation unit (hetquant.runtime.kernels.int4_gemv._CPP_SOURCE), it runs the
// cases of an input file and writes the results (test_int4_gemv_aarch64.py writes and reads both).
//
// Input, little-endian: "HQG1", int64 case count, then per case: int64 grouped, N, K, G, T, L,
// isa, rs, ss, threads; N*rs weight bytes; scales (per-channel: N float32; grouped: N*ss bf16
// bits); T*K float32 activations. Output: "HQR1", int64 best isa, then per case: int64 return
// code (the path used, or < 0), T*N float32 results.
// A routed-expert case (hq_int4_moe) has grouped = 2, N = 2I, K = H, G = experts E, rs = groups,
// ss = entries n; then gate_up codes E*2I*H/2, scales E*2I float32, down codes E*H*I/2, scales
// E*H float32, x T*H float32, int64 experts [groups], offsets [groups + 1], tokens [n], float32
// weights [n]; its result is T*H float32.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

extern "C" {
int hq_int4_best_isa(void);
int hq_int4_gemv(const uint8_t* w, int64_t rs, const float* s, int64_t N, int64_t K,
                 const float* x, int64_t xstride, int64_t T, float* y, int64_t ys,
                 int nthreads, int isa, int L);
int hq_int4_moe(const uint8_t* gw, int64_t ges, int64_t grs, const float* gs, int64_t gss,
                int64_t N1, const uint8_t* dw, int64_t des, int64_t drs, const float* ds,
                int64_t dss, int64_t H, int64_t E, const float* x, int64_t T, int64_t G,
                const int64_t* eids, const int64_t* offs, const int64_t* tok, const float* wts,
                float* out, int nthreads, int isa, int L);
int hq_int4_gemv_grouped(const uint8_t* w, int64_t rs, const uint16_t* sg, int64_t ss,
                         int64_t N, int64_t K, int64_t G, const float* x, int64_t xstride,
                         int64_t T, float* y, int64_t ys, int nthreads, int isa, int L);
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

// One routed-expert case (header h, see the top): runs hq_int4_moe, writes rc and the result.
static void run_moe(FILE* in, FILE* out, const int64_t* h) {
  const int64_t N1 = h[1], H = h[2], E = h[3], T = h[4], L = h[5], isa = h[6], G = h[7], n = h[8];
  std::vector<uint8_t> gw((size_t)(E * N1 * H / 2)), dw((size_t)(E * H * N1 / 4));
  std::vector<float> gs((size_t)(E * N1)), ds((size_t)(E * H)), x((size_t)(T * H)), w((size_t)n);
  std::vector<float> y((size_t)(T * H), -1.0f);
  std::vector<int64_t> eids((size_t)G), offs((size_t)G + 1), tok((size_t)n);
  read_into(in, gw.data(), gw.size());
  read_into(in, gs.data(), gs.size());
  read_into(in, dw.data(), dw.size());
  read_into(in, ds.data(), ds.size());
  read_into(in, x.data(), x.size());
  read_into(in, eids.data(), eids.size());
  read_into(in, offs.data(), offs.size());
  read_into(in, tok.data(), tok.size());
  read_into(in, w.data(), w.size());
  const int64_t rc = hq_int4_moe(gw.data(), N1 * H / 2, H / 2, gs.data(), N1, N1, dw.data(),
                                 H * N1 / 4, N1 / 4, ds.data(), H, H, E, x.data(), T, G,
                                 eids.data(), offs.data(), tok.data(), w.data(), y.data(),
                                 (int)h[9], (int)isa, (int)L);
  fwrite(&rc, sizeof rc, 1, out);
  fwrite(y.data(), sizeof(float), y.size(), out);
}

int main(int argc, char** argv) {
  need(argc == 3, "usage: driver INPUT OUTPUT");
  FILE* in = fopen(argv[1], "rb");
  FILE* out = fopen(argv[2], "wb");
  need(in && out, "cannot open the files");
  char magic[4];
  read_into(in, magic, 4);
  need(memcmp(magic, "HQG1", 4) == 0, "bad magic");
  int64_t cases;
  read_into(in, &cases, 1);
  const int64_t best = hq_int4_best_isa();
  fwrite("HQR1", 1, 4, out);
  fwrite(&best, sizeof best, 1, out);
  for (int64_t c = 0; c < cases; ++c) {
    int64_t h[10];
    read_into(in, h, 10);
    if (h[0] == 2) {
      run_moe(in, out, h);
      continue;
    }
    const int64_t grouped = h[0], N = h[1], K = h[2], G = h[3], T = h[4], L = h[5], isa = h[6];
    const int64_t rs = h[7], ss = h[8], threads = h[9];
    std::vector<uint8_t> w((size_t)(N * rs));
    std::vector<float> s(grouped ? 0 : (size_t)N);
    std::vector<uint16_t> sg(grouped ? (size_t)(N * ss) : 0);
    std::vector<float> x((size_t)(T * K)), y((size_t)(T * N), -1.0f);
    read_into(in, w.data(), w.size());
    if (grouped) read_into(in, sg.data(), sg.size());
    else read_into(in, s.data(), s.size());
    read_into(in, x.data(), x.size());
    const int64_t rc =
        grouped ? hq_int4_gemv_grouped(w.data(), rs, sg.data(), ss, N, K, G, x.data(), K, T,
                                       y.data(), N, (int)threads, (int)isa, (int)L)
                : hq_int4_gemv(w.data(), rs, s.data(), N, K, x.data(), K, T, y.data(), N,
                               (int)threads, (int)isa, (int)L);
    fwrite(&rc, sizeof rc, 1, out);
    fwrite(y.data(), sizeof(float), y.size(), out);
  }
  need(fclose(out) == 0, "cannot write the output");
  fclose(in);
  return 0;
}
