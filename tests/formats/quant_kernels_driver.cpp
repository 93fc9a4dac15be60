// The converter's quantize kernels (formats/_quant_native.cpp + formats/_rows_native.cpp, the
// other translation unit of this program) run on inputs read from files, at the best path of the
// CPU it runs on, every output written to its own file: test_quant_kernels_aarch64.py builds it
// for aarch64 and compares its bytes with the x86 paths'.
//
//   driver awq   R K g             w.bin  out   ->  out.0 qweight, out.1 qzeros, out.2 scales
//   driver nvfp4 N K layout s2bits w.bin  out   ->  out.0 weight, out.1 weight_scale
//   driver w8a8  R K               w.bin  out   ->  out.0 q, out.1 scale
//   driver int4  R K pair          w.bin  out   ->  out.0 packed, out.1 scale (pair: rows of
//                                                    w.bin's two halves interleaved)
//   driver fp8   R C block         codes.bin scales.bin out  ->  out.0 BF16 bits
//   driver fp8max R C block        codes.bin scales.bin out  ->  out.0 max |dequantized| (F32;
//                                                    scales [ceil(R / block), ceil(C / block)])
//
// w.bin: BF16 bits [rows, K]. Exit status: the kernel's return code (0 ok), 9 on bad usage.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern "C" {
int hq_awq_quantize(const void* w, int bf16, int64_t R, int64_t K, int64_t g, int32_t* qw,
                    int32_t* qz, uint16_t* sc, int64_t NT, int64_t row0, int isa);
int hq_nvfp4_quantize(const void* w, int bf16, int64_t N, int64_t K, float s2, uint8_t* q,
                      uint8_t* sc, int layout, int64_t NT, int64_t row0, int isa);
int hq_w8a8_rows(const void* w, int bf16, int64_t R, int64_t K, int8_t* q, float* s, int isa);
int hq_int4_rows(const void* a, const void* b, int bf16, int64_t R, int64_t K, uint8_t* packed,
                 float* s, int isa);
int hq_fp8_dequant_rows(const uint8_t* codes, int64_t R, int64_t C, const float* s,
                        int64_t block, uint16_t* out, int isa);
int hq_fp8_absmax(const uint8_t* codes, int64_t R, int64_t C, const float* s, int64_t sC,
                  int64_t block, float* out);
}

namespace {

template <typename T>
std::vector<T> read_file(const char* path, size_t count) {
  std::vector<T> v(count);
  FILE* f = fopen(path, "rb");
  if (!f || fread(v.data(), sizeof(T), count, f) != count) exit(9);
  fclose(f);
  return v;
}

template <typename T>
void write_file(const std::string& path, const std::vector<T>& v) {
  FILE* f = fopen(path.c_str(), "wb");
  if (!f || fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) exit(9);
  fclose(f);
}

int64_t arg(char** argv, int i) { return atoll(argv[i]); }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 9;
  const std::string op = argv[1];
  if (op == "awq" && argc == 7) {
    const int64_t R = arg(argv, 2), K = arg(argv, 3), g = arg(argv, 4);
    const auto w = read_file<uint16_t>(argv[5], R * K);
    std::vector<int32_t> qw(K * R / 8), qz(K / g * R / 8);
    std::vector<uint16_t> sc(K / g * R);
    const int rc = hq_awq_quantize(w.data(), 1, R, K, g, qw.data(), qz.data(), sc.data(), R, 0, 0);
    const std::string out = argv[6];
    write_file(out + ".0", qw), write_file(out + ".1", qz), write_file(out + ".2", sc);
    return rc;
  }
  if (op == "nvfp4" && argc == 8) {
    const int64_t N = arg(argv, 2), K = arg(argv, 3);
    const int layout = (int)arg(argv, 4);
    const uint32_t s2_bits = (uint32_t)strtoul(argv[5], nullptr, 10);
    float s2;
    memcpy(&s2, &s2_bits, 4);
    const auto w = read_file<uint16_t>(argv[6], N * K);
    std::vector<uint8_t> q(N * K / 2), sc(N * K / 16);
    const int rc = hq_nvfp4_quantize(w.data(), 1, N, K, s2, q.data(), sc.data(), layout, N, 0, 0);
    const std::string out = argv[7];
    write_file(out + ".0", q), write_file(out + ".1", sc);
    return rc;
  }
  if (op == "w8a8" && argc == 6) {
    const int64_t R = arg(argv, 2), K = arg(argv, 3);
    const auto w = read_file<uint16_t>(argv[4], R * K);
    std::vector<int8_t> q(R * K);
    std::vector<float> s(R);
    const int rc = hq_w8a8_rows(w.data(), 1, R, K, q.data(), s.data(), 0);
    const std::string out = argv[5];
    write_file(out + ".0", q), write_file(out + ".1", s);
    return rc;
  }
  if (op == "int4" && argc == 7) {
    const int64_t R = arg(argv, 2), K = arg(argv, 3), pair = arg(argv, 4);
    const auto w = read_file<uint16_t>(argv[5], R * K);
    const int64_t r = pair ? R / 2 : R;  // with pair: a = the first R/2 rows, b = the rest
    std::vector<uint8_t> packed(R * K / 2);
    std::vector<float> s(R);
    const uint16_t* b = pair ? w.data() + r * K : nullptr;
    const int rc = hq_int4_rows(w.data(), b, 1, r, K, packed.data(), s.data(), 0);
    const std::string out = argv[6];
    write_file(out + ".0", packed), write_file(out + ".1", s);
    return rc;
  }
  if (op == "fp8" && argc == 8) {
    const int64_t R = arg(argv, 2), C = arg(argv, 3), block = arg(argv, 4);
    const auto codes = read_file<uint8_t>(argv[5], R * C);
    const auto scales = read_file<float>(argv[6], (C + block - 1) / block);
    std::vector<uint16_t> out(R * C);
    const int rc = hq_fp8_dequant_rows(codes.data(), R, C, scales.data(), block, out.data(), 0);
    write_file(std::string(argv[7]) + ".0", out);
    return rc;
  }
  if (op == "fp8max" && argc == 8) {
    const int64_t R = arg(argv, 2), C = arg(argv, 3), block = arg(argv, 4);
    const int64_t nc = (C + block - 1) / block;
    const auto codes = read_file<uint8_t>(argv[5], R * C);
    const auto scales = read_file<float>(argv[6], ((R + block - 1) / block) * nc);
    std::vector<float> out(1);
    const int rc = hq_fp8_absmax(codes.data(), R, C, scales.data(), nc, block, out.data());
    write_file(std::string(argv[7]) + ".0", out);
    return rc;
  }
  return 9;
}
