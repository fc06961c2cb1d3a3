// The conformance harness: every Backend op (kernels/backend.h) on every available backend (the
// fast CPU backend "cpu", CUDA) against the CPU reference backend "cpu-ref".
//
// For each op and shape: fresh random inputs (the seed comes from the clock unless
// FSDP8_CONFORMANCE_SEED is set, and is printed), outputs poisoned with 0xFF bytes (a NaN in f32)
// before the op runs, the op run on the backend under test and on a separate CPU reference, the
// results compared with the op's tolerance, and one line per op and backend printed:
//   op <name> backend <b> max_rel_err <x>
// max_rel_err is normwise: max_i |out_i - ref_i| / max_i |ref_i| (the absolute difference when the reference is all zero; NaNs
// must sit at the same positions). Exact-bit ops (casts, transposes, pack/unpack, dequantize,
// amax, embedding forward) must match bit for bit. Every op runs twice on the backend under test
// and the two results must be the same bits (determinism).
//
// Tolerances (u = 2^-24, the f32 unit roundoff). For a sum of K terms computed in two different
// orders, the classical bound is |error| <= K u sum|terms| per order (Higham, "Accuracy and
// Stability of Numerical Algorithms", 2nd ed., eq. 3.5); normwise against max|result| and with
// both orders counted this is <= 2 K u (sum|terms| / max|result|). With the zero-mean inputs
// drawn here sum|terms| / |result| grows like sqrt(K) in the worst rows, and the observed error
// grows like sqrt(K) u, so the bound we use is
//   tol(K) = 2 K u * kSafety,   kSafety = 4   (sum order, transcendental ulps, one rounding of the
//                                               scale product)
// i.e. ~ K * 4.8e-7. The ops then take:
//   GEMM (f32, bf16 inputs, FP8)     tol(K)      (bf16/FP8 products are exact in f32, so only the
//                                                 summation order differs)
//   RMSNorm fwd / dx                 tol(C); dw  tol(N)
//   attention fwd / bwd              tol(T + D) * 4  (two chained reductions and exp/log)
//   cross-entropy                    tol(V)
//   SwiGLU, RoPE, AdamW, Axpy, Add   64 u        (a few roundings and one exp/sin of <= 2 ulp)
//   SumSquares                       tol(1)      (both accumulate in double, one final rounding)
//   embedding backward               tol(N)      (same order on both backends: usually exact)
// The cuDNN BF16 attention (kernels/cuda/attention_cudnn.h; test CudnnAttention_cuda) is compared
// with the CPU f32 attention run on the same bf16-rounded inputs; its tolerances come from BF16
// (unit roundoff ub = 2^-8): out 4 ub (the output and the probabilities feeding P·V are rounded
// to bf16), lse 64 u·T (f32 scores of exact bf16 products), dq/dk/dv 8 ub (dP and dS are rounded
// to bf16 before their GEMMs, the outputs once more).
//
// The tests are split by op family, in one binary (fsdp8-conformance): fp8_gemm_test.cc (casts,
// scales, GEMMs), elementwise_norm_test.cc (elementwise ops, embedding, RMSNorm, RoPE),
// attention_test.cc, loss_optimizer_test.cc (cross-entropy, sum of squares, AdamW),
// bf16_activations_test.cc (the bf16-activation ops and fused backward cast-transposes);
// conformance.cc holds the harness, the backend instances and the memory-counter test.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend.h"

namespace fsdp8::conformance {

constexpr double kU = 1.0 / (1 << 24);
inline double Tol(double K) { return 2.0 * K * kU * 4.0; }
constexpr double kEltTol = 64 * kU;
// FP8 GEMMs on Hopper tensor cores do not accumulate in full FP32: the FP8 MMA keeps about 14
// mantissa bits in its accumulator before cuBLASLt promotes partial sums into FP32 (DeepSeek-V3
// technical report, arXiv 2412.19437, sec. 3.3.2). Each of the K additions then carries a
// relative error up to 2^-13 of the running sum; with the zero-mean inputs drawn here those errors
// have independent signs and grow like a random walk, so the normwise bound is
// max(tol(K), sqrt(K) * 2^-13): 2.8e-3 at K = 512, 5.5e-3 at K = 2048. Measured on H200:
// 2.2e-4 .. 5.1e-4 (largest at K = 512). A wrong layout, scale or operand gives O(1) errors.
inline double Fp8GemmTol(int64_t K) {
  return std::max(Tol(static_cast<double>(K) + 1), std::sqrt(static_cast<double>(K)) * std::ldexp(1.0, -13));
}

// The seed of this run: FSDP8_CONFORMANCE_SEED, else FSDP8_CONFORMANCE_DEFAULT_SEED (set by ctest),
// else the clock; printed on first use.
uint64_t Seed();
// The generator every input is drawn from, seeded with Seed().
std::mt19937_64& Rng();
// n values from N(0, scale^2).
std::vector<float> Randn(int64_t n, float scale = 1.0f);
// n values uniform in [lo, hi).
std::vector<float> Uniform(int64_t n, float lo, float hi);
// n token ids uniform in [0, V).
std::vector<int32_t> Tokens(int64_t n, int32_t V);
// FP8 codes: every code except NaNs (and E5M2 infinities), so GEMM inputs stay finite.
std::vector<uint8_t> Fp8Codes(int64_t n, Fp8Format fmt);

// One output buffer brought back to the host.
struct Output {
  std::string name;
  bool is_f32 = true;  // else compared as bytes
  // FP8 codes of a value the reference computes in f32 in another order: each code may be one
  // step (the neighbouring representable value) from the reference's, no further.
  bool fp8_within_one_code = false;
  // For an output whose exact value is 0 or nearly so (cancelling terms): the size of those terms.
  // The error is then taken against max(max|reference|, abs_scale), an absolute bound where the
  // reference itself is only rounding noise.
  double abs_scale = 0.0;
  std::vector<uint8_t> bytes;
};
using Outputs = std::vector<Output>;

// Device allocations of one run on one backend; frees on destruction.
class DevRun {
 public:
  explicit DevRun(Backend* b) : b_(b) {}
  ~DevRun() {
    for (void* p : ptrs_) b_->Free(p);
  }
  template <typename T>
  T* In(const std::vector<T>& host) {
    T* p = static_cast<T*>(Alloc(sizeof(T) * host.size()));
    if (!host.empty()) b_->CopyToDevice(p, host.data(), sizeof(T) * host.size());
    return p;
  }
  // Output buffer poisoned with 0xFF bytes (NaN in f32).
  template <typename T>
  T* Out(int64_t n) {
    T* p = static_cast<T*>(Alloc(sizeof(T) * n));
    b_->Memset(p, 0xFF, sizeof(T) * n);
    return p;
  }
  template <typename T>
  void Get(Outputs* outs, const std::string& name, const T* p, int64_t n, bool is_f32) {
    Output o;
    o.name = name;
    o.is_f32 = is_f32;
    o.bytes.resize(sizeof(T) * n);
    b_->CopyToHost(o.bytes.data(), p, o.bytes.size());
    outs->push_back(std::move(o));
  }
  void F32(Outputs* outs, const std::string& name, const float* p, int64_t n) { Get(outs, name, p, n, true); }
  // As F32, judged against at least abs_scale (Output::abs_scale).
  void F32Near0(Outputs* outs, const std::string& name, const float* p, int64_t n, double abs_scale) {
    F32(outs, name, p, n);
    outs->back().abs_scale = abs_scale;
  }
  // x packed to bfloat16 on this run's backend (PackBf16), in a buffer of its own.
  uint16_t* InBf16(const std::vector<float>& x) {
    const int64_t n = static_cast<int64_t>(x.size());
    uint16_t* p = Out<uint16_t>(n);
    b_->PackBf16(In(x), p, n);
    return p;
  }
  // The bfloat16 values p (n) as an f32 output (UnpackBf16 on this run's backend).
  void Bf16AsF32(Outputs* outs, const std::string& name, const uint16_t* p, int64_t n) {
    float* f = Out<float>(n);
    b_->UnpackBf16(p, f, n);
    F32(outs, name, f, n);
  }
  void Fp8CodesNear(Outputs* outs, const std::string& name, const uint8_t* p, int64_t n) {
    Get(outs, name, p, n, false);
    outs->back().fp8_within_one_code = true;
  }
  template <typename T>
  void Bytes(Outputs* outs, const std::string& name, const T* p, int64_t n) { Get(outs, name, p, n, false); }
  Backend* b() { return b_; }

 private:
  void* Alloc(size_t bytes) {
    void* p = b_->Alloc(bytes == 0 ? 4 : bytes);
    EXPECT_NE(p, nullptr);
    ptrs_.push_back(p);
    return p;
  }
  Backend* b_;
  std::vector<void*> ptrs_;
};

using OpFn = std::function<Outputs(DevRun&)>;

// Normwise relative error of `got` against `ref` (f32), with NaN positions required to agree;
// *why says where they do not.
double MaxRelErr(const Output& got, const Output& ref, std::string* why);
// Bytes equal, with any NaN f32 equal to any NaN when is_f32; *first_diff: the first element (f32)
// or byte that differs.
bool SameBits(const Output& a, const Output& b, size_t* first_diff);

// The fixture of every op's test; its parameter names the backend under test ("cpu", "cuda",
// "cpu-ref"), compared with the reference "cpu-ref";
// skipped when unavailable. FSDP8_CONFORMANCE_DEVICE picks the device (default 0).
class Conformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string err;
    ref_ = CreateBackend("cpu-ref", 0, &err);
    ASSERT_NE(ref_, nullptr) << err;
    const char* dev = std::getenv("FSDP8_CONFORMANCE_DEVICE");
    dut_ = CreateBackend(GetParam(), dev != nullptr ? std::atoi(dev) : 0, &err);
    if (dut_ == nullptr) GTEST_SKIP() << "backend '" << GetParam() << "' unavailable: " << err;
  }

  // Runs `fn` on the reference and twice on the backend under test and compares.
  // tol < 0: exact bits required.
  void Check(const std::string& op, double tol, const OpFn& fn);

  std::unique_ptr<Backend> ref_, dut_;
};

inline constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};
inline const char* FmtName(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }
// Inputs spanning the FP8 ranges: normals, subnormals, values that saturate, specials.
std::vector<float> CastInputs(int64_t n);

}  // namespace fsdp8::conformance
