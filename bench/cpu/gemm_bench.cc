// fsdp8-bench-cpu-gemm: GEMM throughput of the CPU backend.
//
// For each shape prints the FP8-emulated GEMM rate (Backend::GemmFp8: decode both operands, then
// oneDNN sgemm), the backend's f32 Gemm (oneDNN sgemm) and OpenBLAS's f32 sgemm (the reference
// backend's) on the same shape, in GFLOP/s counted as 2*M*N*K / seconds. Shapes: the default model's linears (M = 2048 tokens = 8 sequences x 256,
// (N, K) in {(128,128), (384,128), (128,384)}), their weight gradients' shapes (the reduction over
// the 2048 tokens) and a 1024^3 square. Rates are given per wall-clock
// second and per process-CPU second (the machine may be shared).
//
// Also prints the instruction set oneDNN's kernels use on this CPU.
//
// Usage: fsdp8-bench-cpu-gemm [--threads N] [--json]   (BLAS threads, default 1)
//   --json: instead of the table, one JSON list of GEMM shape classes for a calibration file
//   (common/cost_model.h): the backend's GemmFp8 ("fp8"), its Gemm with bf16 inputs ("bf16") and
//   with f32 inputs ("fp32"), TFLOP/s per second of the lower of wall-clock and process-CPU time, the best of 3 rounds
//   (bench_util.h BestSeconds), on the default
//   model's forward, input-gradient and weight-gradient shapes (fused q|k|v and gate|up
//   included, the head's) and a 1024^3 square.
#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "bench/cpu/bench_util.h"
#include "kernels/backend.h"

namespace {
const char* IsaName(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_avx2: return "AVX2";
    case dnnl_cpu_isa_avx2_vnni: return "AVX2 + VNNI";
    case dnnl_cpu_isa_avx512_core: return "AVX-512";
    case dnnl_cpu_isa_avx512_core_vnni: return "AVX-512 + VNNI";
    case dnnl_cpu_isa_avx512_core_bf16: return "AVX-512 + BF16";
    case dnnl_cpu_isa_avx512_core_amx: return "AVX-512 + AMX";
    default: return "other";
  }
}
// The operands of one GEMM shape on the backend: random E4M3 codes (from fp8_code, sign bit
// random) and f32 values in [-1, 1) for A (M x K) and B (N x K), an f32 C, a unit FP8 scale.
struct GemmOperands {
  template <typename Code>
  GemmOperands(fsdp8::Backend* backend, int64_t M, int64_t N, int64_t K, std::mt19937& rng,
               Code fp8_code)
      : be(backend) {
    std::uniform_real_distribution<float> val(-1.0f, 1.0f);
    std::vector<uint8_t> a8(M * K), b8(N * K);
    for (auto& c : a8) c = static_cast<uint8_t>(fp8_code() | (rng() & 0x80));
    for (auto& c : b8) c = static_cast<uint8_t>(fp8_code() | (rng() & 0x80));
    std::vector<float> af(M * K), bf(N * K);
    for (auto& x : af) x = val(rng);
    for (auto& x : bf) x = val(rng);
    const float one = 1.0f;
    A8 = static_cast<uint8_t*>(be->Alloc(a8.size()));
    B8 = static_cast<uint8_t*>(be->Alloc(b8.size()));
    AF = static_cast<float*>(be->Alloc(af.size() * 4));
    BF = static_cast<float*>(be->Alloc(bf.size() * 4));
    C = static_cast<float*>(be->Alloc(M * N * 4));
    S = static_cast<float*>(be->Alloc(4));
    be->CopyToDevice(A8, a8.data(), a8.size());
    be->CopyToDevice(B8, b8.data(), b8.size());
    be->CopyToDevice(AF, af.data(), af.size() * 4);
    be->CopyToDevice(BF, bf.data(), bf.size() * 4);
    be->CopyToDevice(S, &one, 4);
  }
  ~GemmOperands() {
    for (void* p : {static_cast<void*>(A8), static_cast<void*>(B8), static_cast<void*>(AF),
                    static_cast<void*>(BF), static_cast<void*>(C), static_cast<void*>(S)})
      be->Free(p);
  }
  GemmOperands(const GemmOperands&) = delete;
  GemmOperands& operator=(const GemmOperands&) = delete;
  fsdp8::Backend* be;
  uint8_t *A8, *B8;
  float *AF, *BF, *C, *S;
};

// --json: the calibration's GEMM classes (see the file comment).
int PrintCalibrationJson(fsdp8::Backend* be) {
  struct Shape {
    int64_t M, N, K;
  };
  // (M, N, K) of Y = X W^T (N tokens, out, in), dX (N, in, out) and dW (out, in, N) of the
  // default model's GEMMs at 2048 tokens: q|k|v (128 -> 384), o (128 -> 128), gate|up
  // (128 -> 768), down (384 -> 128), the head (128 -> 256); and a square.
  std::vector<Shape> shapes;
  for (auto [in, out] : {std::pair<int64_t, int64_t>{128, 384}, {128, 128}, {128, 768}, {384, 128},
                         {128, 256}}) {
    shapes.push_back({2048, out, in});
    shapes.push_back({2048, in, out});
    shapes.push_back({out, in, 2048});
  }
  shapes.push_back({1024, 1024, 1024});
  std::mt19937 rng(1);
  std::printf("[");
  bool first = true;
  for (const Shape& s : shapes) {
    GemmOperands op(be, s.M, s.N, s.K, rng, [&] { return rng() % 0x38; });
    auto [A8, B8, AF, BF, C, S] = std::tuple(op.A8, op.B8, op.AF, op.BF, op.C, op.S);
    const double flops = 2.0 * s.M * s.N * s.K;
    const double t8 = fsdp8::bench::BestSeconds([&] {
      be->GemmFp8(false, true, s.M, s.N, s.K, {A8, fsdp8::Fp8Format::kE4M3, S},
                  {B8, fsdp8::Fp8Format::kE4M3, S}, C, false);
    });
    const double t16 = fsdp8::bench::BestSeconds(
        [&] { be->Gemm(false, true, s.M, s.N, s.K, AF, BF, C, false, fsdp8::GemmInputs::kBF16); });
    const double t32 = fsdp8::bench::BestSeconds(
        [&] { be->Gemm(false, true, s.M, s.N, s.K, AF, BF, C, false, fsdp8::GemmInputs::kF32); });
    for (auto [name, t] : {std::pair{"fp8", t8}, std::pair{"bf16", t16}, std::pair{"fp32", t32}}) {
      std::printf("%s\n {\"precision\": \"%s\", \"m\": %lld, \"n\": %lld, \"k\": %lld, \"tflops\": %.6g}",
                  first ? "" : ",", name, static_cast<long long>(s.M), static_cast<long long>(s.N),
                  static_cast<long long>(s.K), flops / t / 1e12);
      first = false;
    }
  }
  std::printf("\n]\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else {
      std::fprintf(stderr, "usage: %s [--threads N] [--json]\n", argv[0]);
      return 2;
    }
  }
  openblas_set_num_threads(threads);
  std::string error;
  auto be = fsdp8::CreateBackend("cpu", 0, &error);
  if (!be) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return 1;
  }
  struct Shape {
    int64_t M, N, K;
  };
  const Shape shapes[] = {{2048, 128, 128}, {2048, 384, 128}, {2048, 128, 384},
                          {384, 128, 2048}, {128, 384, 2048}, {1024, 1024, 1024}};
  if (json) return PrintCalibrationJson(be.get());
  std::printf("BLAS threads: %d; oneDNN ISA: %s\n", threads, IsaName(dnnl_get_effective_cpu_isa()));
  std::printf("GFLOP/s = 2*M*N*K / time, as wall-clock / process-CPU time\n");
  std::printf("%6s %6s %6s  %16s  %16s  %16s\n", "M", "N", "K", "fp8-emul (cpu)",
              "f32 Gemm (cpu)", "OpenBLAS sgemm");
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> code(0, 0x7D);  // finite E4M3 magnitudes, both signs below
  for (const Shape& s : shapes) {
    GemmOperands op(be.get(), s.M, s.N, s.K, rng, [&] { return code(rng); });
    auto [A8, B8, AF, BF, C, S] = std::tuple(op.A8, op.B8, op.AF, op.BF, op.C, op.S);
    const double flops = 2.0 * s.M * s.N * s.K;
    const fsdp8::bench::Timing t8 = fsdp8::bench::TimeIt([&] {
      be->GemmFp8(false, true, s.M, s.N, s.K, {A8, fsdp8::Fp8Format::kE4M3, S},
                  {B8, fsdp8::Fp8Format::kE4M3, S}, C, false);
    });
    const fsdp8::bench::Timing tg = fsdp8::bench::TimeIt(
        [&] { be->Gemm(false, true, s.M, s.N, s.K, AF, BF, C, false, fsdp8::GemmInputs::kF32); });
    const fsdp8::bench::Timing t32 = fsdp8::bench::TimeIt([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.M, s.N, s.K, 1.0f, AF, s.K, BF, s.K,
                  0.0f, C, s.N);
    });
    std::printf("%6lld %6lld %6lld  %7.1f / %6.1f  %7.1f / %6.1f  %7.1f / %6.1f\n",
                static_cast<long long>(s.M), static_cast<long long>(s.N),
                static_cast<long long>(s.K), flops / t8.wall / 1e9, flops / t8.cpu / 1e9,
                flops / tg.wall / 1e9, flops / tg.cpu / 1e9, flops / t32.wall / 1e9,
                flops / t32.cpu / 1e9);
  }
  return 0;
}
