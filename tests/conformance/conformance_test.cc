// Conformance: every Backend op (kernels/backend.h) on every available backend against the CPU
// reference backend.
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
#include <algorithm>
#include <limits>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend.h"
#if defined(FSDP8_WITH_CUDNN)
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/cuda_backend.h"
#endif

namespace fsdp8 {
namespace {

constexpr double kU = 1.0 / (1 << 24);
double Tol(double K) { return 2.0 * K * kU * 4.0; }
constexpr double kEltTol = 64 * kU;
// FP8 GEMMs on Hopper tensor cores do not accumulate in full FP32: the FP8 MMA keeps about 14
// mantissa bits in its accumulator before cuBLASLt promotes partial sums into FP32 (DeepSeek-V3
// technical report, arXiv 2412.19437, sec. 3.3.2). Each of the K additions then carries a
// relative error up to 2^-13 of the running sum; with the zero-mean inputs drawn here those errors
// have independent signs and grow like a random walk, so the normwise bound is
// max(tol(K), sqrt(K) * 2^-13): 2.8e-3 at K = 512, 5.5e-3 at K = 2048. Measured on H200:
// 2.2e-4 .. 5.1e-4 (largest at K = 512). A wrong layout, scale or operand gives O(1) errors.
double Fp8GemmTol(int64_t K) {
  return std::max(Tol(static_cast<double>(K) + 1), std::sqrt(static_cast<double>(K)) * std::ldexp(1.0, -13));
}

uint64_t Seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("FSDP8_CONFORMANCE_SEED");
    uint64_t s = env != nullptr ? std::strtoull(env, nullptr, 10)
                                : static_cast<uint64_t>(
                                      std::chrono::steady_clock::now().time_since_epoch().count());
    std::printf("conformance seed %llu (set FSDP8_CONFORMANCE_SEED to repeat)\n",
                static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

std::mt19937_64& Rng() {
  static std::mt19937_64 rng(Seed());
  return rng;
}

std::vector<float> Randn(int64_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(Rng());
  return v;
}

std::vector<float> Uniform(int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(Rng());
  return v;
}

std::vector<int32_t> Tokens(int64_t n, int32_t V) {
  std::uniform_int_distribution<int32_t> d(0, V - 1);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(Rng());
  return v;
}

// FP8 codes: every code except NaNs (and E5M2 infinities), so GEMM inputs stay finite.
std::vector<uint8_t> Fp8Codes(int64_t n, Fp8Format fmt) {
  std::uniform_int_distribution<int> d(0, 255);
  std::vector<uint8_t> v(static_cast<size_t>(n));
  for (auto& c : v) {
    while (true) {
      c = static_cast<uint8_t>(d(Rng()));
      const uint8_t a = c & 0x7F;
      if (fmt == Fp8Format::kE4M3 ? a != 0x7F : a < 0x7C) break;
    }
  }
  return v;
}

// One output buffer brought back to the host.
struct Output {
  std::string name;
  bool is_f32 = true;  // else compared as bytes
  // FP8 codes of a value the reference computes in f32 in another order: each code may be one
  // step (the neighbouring representable value) from the reference's, no further.
  bool fp8_within_one_code = false;
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

// Normwise relative error of `got` against `ref` (f32), with NaN positions required to agree.
double MaxRelErr(const Output& got, const Output& ref, std::string* why) {
  const size_t n = ref.bytes.size() / 4;
  const float* g = reinterpret_cast<const float*>(got.bytes.data());
  const float* r = reinterpret_cast<const float*>(ref.bytes.data());
  double maxref = 0.0, maxdiff = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const bool gn = std::isnan(g[i]), rn = std::isnan(r[i]);
    if (gn || rn) {
      if (gn != rn) {
        *why = got.name + "[" + std::to_string(i) + "] = " + std::to_string(g[i]) + ", reference " +
               std::to_string(r[i]);
        return INFINITY;
      }
      continue;
    }
    if (std::isinf(r[i]) || std::isinf(g[i])) {
      if (g[i] != r[i]) {
        *why = got.name + "[" + std::to_string(i) + "] infinity mismatch";
        return INFINITY;
      }
      continue;
    }
    maxref = std::max(maxref, std::fabs(static_cast<double>(r[i])));
    maxdiff = std::max(maxdiff, std::fabs(static_cast<double>(g[i]) - r[i]));
  }
  if (maxdiff == 0.0) return 0.0;
  // An analytically zero output (e.g. attention dq, dk at T = 1, where the one softmax weight is
  // exactly 1) comes out as rounding noise on a backend whose sums run in another order: judge it
  // by the absolute difference, the inputs here being O(1).
  return maxref > 0.0 ? maxdiff / maxref : maxdiff;
}

// Bytes equal, with any NaN f32 equal to any NaN when is_f32.
bool SameBits(const Output& a, const Output& b, size_t* first_diff) {
  if (a.bytes.size() != b.bytes.size()) {
    *first_diff = 0;
    return false;
  }
  if (!a.is_f32) {
    for (size_t i = 0; i < a.bytes.size(); ++i) {
      if (a.bytes[i] != b.bytes[i]) {
        *first_diff = i;
        return false;
      }
    }
    return true;
  }
  const uint32_t* x = reinterpret_cast<const uint32_t*>(a.bytes.data());
  const uint32_t* y = reinterpret_cast<const uint32_t*>(b.bytes.data());
  for (size_t i = 0; i < a.bytes.size() / 4; ++i) {
    const bool xn = (x[i] & 0x7FFFFFFFu) > 0x7F800000u, yn = (y[i] & 0x7FFFFFFFu) > 0x7F800000u;
    if (xn && yn) continue;
    if (x[i] != y[i]) {
      *first_diff = i;
      return false;
    }
  }
  return true;
}

class Conformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string err;
    ref_ = CreateBackend("cpu", 0, &err);
    ASSERT_NE(ref_, nullptr) << err;
    const char* dev = std::getenv("FSDP8_CONFORMANCE_DEVICE");
    dut_ = CreateBackend(GetParam(), dev != nullptr ? std::atoi(dev) : 0, &err);
    if (dut_ == nullptr) GTEST_SKIP() << "backend '" << GetParam() << "' unavailable: " << err;
  }

  // Runs `fn` on the reference and twice on the backend under test and compares.
  // tol < 0: exact bits required.
  void Check(const std::string& op, double tol, const OpFn& fn) {
    Outputs ref, a, b;
    {
      DevRun r(ref_.get());
      ref = fn(r);
    }
    {
      DevRun r(dut_.get());
      a = fn(r);
    }
    {
      DevRun r(dut_.get());
      b = fn(r);
    }
    ASSERT_EQ(ref.size(), a.size());
    double worst = 0.0;
    for (size_t k = 0; k < ref.size(); ++k) {
      size_t diff = 0;
      EXPECT_TRUE(SameBits(a[k], b[k], &diff))
          << op << " " << a[k].name << " on " << GetParam() << " is not deterministic (first difference at "
          << diff << ")";
      if (ref[k].fp8_within_one_code) {
        // Sign-magnitude codes to a monotone order: neighbours differ by 1.
        auto ord = [](uint8_t c) { return (c & 0x80) ? -static_cast<int>(c & 0x7F) : static_cast<int>(c & 0x7F); };
        size_t off_by_one = 0, bad = ref[k].bytes.size();
        for (size_t i = 0; i < ref[k].bytes.size(); ++i) {
          const int d = std::abs(ord(a[k].bytes[i]) - ord(ref[k].bytes[i]));
          if (d == 1) ++off_by_one;
          if (d > 1 && bad == ref[k].bytes.size()) bad = i;
        }
        EXPECT_EQ(bad, ref[k].bytes.size())
            << op << " " << a[k].name << " on " << GetParam() << ": code " << static_cast<int>(a[k].bytes[bad])
            << " at " << bad << ", reference " << static_cast<int>(ref[k].bytes[bad]);
        if (off_by_one > 0) std::printf("op %s %s: %zu codes one step from the reference\n", op.c_str(), a[k].name.c_str(), off_by_one);
        continue;
      }
      if (tol < 0 || !ref[k].is_f32) {
        const bool same = SameBits(a[k], ref[k], &diff);
        EXPECT_TRUE(same) << op << " " << a[k].name << " on " << GetParam()
                          << " differs from the CPU reference in bits (first at element/byte " << diff << ")";
        if (!same) worst = INFINITY;
        continue;
      }
      std::string why;
      const double e = MaxRelErr(a[k], ref[k], &why);
      EXPECT_LE(e, tol) << op << " " << a[k].name << " on " << GetParam() << ": max_rel_err " << e
                        << " > tolerance " << tol << (why.empty() ? "" : " (" + why + ")");
      worst = std::max(worst, e);
    }
    std::printf("op %s backend %s max_rel_err %.3g%s\n", op.c_str(), GetParam().c_str(), worst,
                tol < 0 ? " (exact)" : "");
  }

  std::unique_ptr<Backend> ref_, dut_;
};

const Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};
const char* FmtName(Fp8Format f) { return f == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }

// Inputs spanning the FP8 ranges: normals, subnormals, values that saturate, specials.
std::vector<float> CastInputs(int64_t n) {
  std::vector<float> v = Randn(n, 1.0f);
  std::uniform_real_distribution<float> e(-24.0f, 18.0f);
  for (size_t i = 0; i < v.size(); ++i) v[i] *= std::exp2(e(Rng()));
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 448.0f, 464.0f, 57344.0f, 61440.0f,
                            1e-9f, std::exp2(-10.0f), std::exp2(-17.0f), 3e38f};
  for (size_t i = 0; i < sizeof(specials) / sizeof(specials[0]) && i < v.size(); ++i) v[i * 7 % v.size()] = specials[i];
  return v;
}

TEST_P(Conformance, CastToFp8) {
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{4099}, int64_t{1} << 20}) {
    for (Fp8Format fmt : kFormats) {
      const auto x = CastInputs(n);
      const std::vector<float> scale = {std::exp2(static_cast<float>(Rng()() % 8) - 2.0f) * 1.37f};
      Check(std::string("CastToFp8/") + FmtName(fmt) + "/" + std::to_string(n), -1, [&](DevRun& r) {
        Outputs o;
        const float* in = r.In(x);
        uint8_t* out = r.Out<uint8_t>(n);
        float* amax = r.In(std::vector<float>{0.5f});
        r.b()->CastToFp8(in, out, n, r.In(scale), fmt, amax);
        r.Bytes(&o, "out", out, n);
        r.Bytes(&o, "amax", amax, 1);
        return o;
      });
    }
  }
}

TEST_P(Conformance, CastTransposeFp8) {
  const int64_t shapes[][2] = {{1, 1}, {37, 129}, {64, 64}, {128, 2048}, {257, 96}, {1000, 37}};
  for (auto& s : shapes) {
    const int64_t rows = s[0], cols = s[1];
    for (Fp8Format fmt : kFormats) {
      auto x = Randn(rows * cols, 3.0f);
      x[static_cast<size_t>(rows * cols / 2)] = 1e6f;  // saturates
      const std::vector<float> scale = {20.0f};
      Check(std::string("CastTransposeFp8/") + FmtName(fmt) + "/" + std::to_string(rows) + "x" + std::to_string(cols), -1,
            [&](DevRun& r) {
              Outputs o;
              uint8_t* out = r.Out<uint8_t>(rows * cols);
              uint8_t* out_t = r.Out<uint8_t>(rows * cols);
              float* amax = r.In(std::vector<float>{0.0f});
              r.b()->CastTransposeFp8(r.In(x), rows, cols, r.In(scale), fmt, out, out_t, amax);
              r.Bytes(&o, "out", out, rows * cols);
              r.Bytes(&o, "out_t", out_t, rows * cols);
              r.Bytes(&o, "amax", amax, 1);
              // Transposed only, no amax.
              uint8_t* out_t2 = r.Out<uint8_t>(rows * cols);
              r.b()->CastTransposeFp8(r.In(x), rows, cols, r.In(scale), fmt, nullptr, out_t2, nullptr);
              r.Bytes(&o, "out_t_only", out_t2, rows * cols);
              return o;
            });
    }
  }
}

TEST_P(Conformance, TransposeBytes) {
  const int64_t shapes[][2] = {{1, 7}, {37, 129}, {64, 128}, {256, 192}, {300, 260}, {2048, 5632 / 4}};
  for (auto& s : shapes) {
    const int64_t rows = s[0], cols = s[1];
    const auto x = Fp8Codes(rows * cols, Fp8Format::kE5M2);
    Check("TransposeBytes/" + std::to_string(rows) + "x" + std::to_string(cols), -1, [&](DevRun& r) {
      Outputs o;
      uint8_t* out = r.Out<uint8_t>(rows * cols);
      r.b()->TransposeBytes(r.In(x), rows, cols, out);
      r.Bytes(&o, "out", out, rows * cols);
      // Misaligned input and output (the byte-by-byte paths of full tiles).
      std::vector<uint8_t> x1(x.size() + 1);
      std::copy(x.begin(), x.end(), x1.begin() + 1);
      uint8_t* out1 = r.Out<uint8_t>(rows * cols + 1);
      r.b()->TransposeBytes(r.In(x1) + 1, rows, cols, out1 + 1);
      r.Bytes(&o, "out_misaligned", out1 + 1, rows * cols);
      return o;
    });
  }
}

TEST_P(Conformance, DequantizeFp8) {
  for (Fp8Format fmt : kFormats) {
    std::vector<uint8_t> codes(256 * 5);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i);
    const std::vector<float> sinv = {0.0625f};
    Check(std::string("DequantizeFp8/") + FmtName(fmt), -1, [&](DevRun& r) {
      Outputs o;
      const int64_t n = static_cast<int64_t>(codes.size());
      float* out = r.Out<float>(n);
      r.b()->DequantizeFp8(r.In(codes), out, n, r.In(sinv), fmt);
      r.F32(&o, "out", out, n);
      return o;
    });
  }
}

TEST_P(Conformance, AmaxAccumulate) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{129}, int64_t{1} << 20}) {
    auto x = Randn(n, 2.0f);
    Check("AmaxAccumulate/" + std::to_string(n), -1, [&](DevRun& r) {
      Outputs o;
      float* amax = r.In(std::vector<float>{0.25f});
      r.b()->AmaxAccumulate(r.In(x), n, amax);
      r.Bytes(&o, "amax", amax, 1);
      return o;
    });
  }
  std::vector<float> with_nan = Randn(1000);
  with_nan[500] = NAN;
  Check("AmaxAccumulate/nan", 0.0, [&](DevRun& r) {
    Outputs o;
    float* amax = r.In(std::vector<float>{0.0f});
    r.b()->AmaxAccumulate(r.In(with_nan), 1000, amax);
    r.F32(&o, "amax", amax, 1);
    return o;
  });
}

TEST_P(Conformance, Bf16) {
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{100003}}) {
    auto x = CastInputs(n);
    Check("RoundToBf16/" + std::to_string(n), -1, [&](DevRun& r) {
      Outputs o;
      float* p = r.In(x);
      r.b()->RoundToBf16(p, n);
      r.F32(&o, "x", p, n);
      return o;
    });
    Check("PackUnpackBf16/" + std::to_string(n), -1, [&](DevRun& r) {
      Outputs o;
      uint16_t* packed = r.Out<uint16_t>(n);
      float* un = r.Out<float>(n);
      r.b()->PackBf16(r.In(x), packed, n);
      r.b()->UnpackBf16(packed, un, n);
      r.Bytes(&o, "packed", packed, n);
      r.F32(&o, "unpacked", un, n);
      return o;
    });
  }
}

TEST_P(Conformance, Fp8ScalesFromAmax) {
  // Random amaxes over many binades plus the special cases, random previous scales (some not
  // usable); exact: the device's double arithmetic must give the CPU's bits.
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> amax = Uniform(300, -40.0f, 40.0f), prev = Uniform(300, -5.0f, 5.0f);
  for (size_t i = 0; i < amax.size(); ++i) amax[i] = std::ldexp(1.0f + std::fabs(amax[i]) / 40.0f, static_cast<int>(amax[i]) * 3);
  for (size_t i = 0; i < prev.size(); ++i) prev[i] = std::exp(prev[i]);
  const float specials[] = {0.0f, -0.0f, -1.0f, inf, std::nanf(""), 1e-45f, FLT_MAX};
  for (size_t i = 0; i < 7; ++i) amax[i] = specials[i];
  prev[0] = inf;
  prev[1] = -2.0f;
  prev[2] = std::nanf("");
  const int64_t n = static_cast<int64_t>(amax.size()), stride = 4;
  std::vector<float> slots(n * stride, 0.0f);
  for (int64_t i = 0; i < n; ++i) slots[i * stride] = prev[i];
  for (int margin : {0, 3}) {
    for (float fmax : {448.0f, 57344.0f}) {
      Check("Fp8ScalesFromAmax/margin" + std::to_string(margin) + "/max" + std::to_string(static_cast<int>(fmax)), -1,
            [&](DevRun& r) {
              Outputs o;
              float* sc = r.In(slots);
              float* inv = r.Out<float>(n * stride);
              r.b()->Memset(inv, 0, n * stride * sizeof(float));
              r.b()->Fp8ScalesFromAmax(r.In(amax), n, fmax, margin, sc, inv, stride);
              r.F32(&o, "scale", sc, n * stride);
              r.F32(&o, "scale_inv", inv, n * stride);
              return o;
            });
    }
  }
}

TEST_P(Conformance, GroupMax) {
  // 300 amaxes in groups of 1 to 4 members (contiguous and interleaved), with a NaN and an inf in
  // two groups; exact.
  std::vector<float> in = Uniform(300, 0.0f, 100.0f);
  in[10] = std::nanf("");
  in[20] = std::numeric_limits<float>::infinity();
  std::vector<int32_t> group(in.size());
  for (size_t i = 0; i < group.size(); ++i) {
    group[i] = i < 200 ? static_cast<int32_t>(i / 3 * 3) : static_cast<int32_t>(200 + i % 7);
  }
  Check("GroupMax", -1, [&](DevRun& r) {
    Outputs o;
    const int64_t n = static_cast<int64_t>(in.size());
    float* out = r.Out<float>(n);
    r.b()->GroupMax(r.In(in), r.In(group), n, out);
    r.F32(&o, "out", out, n);
    return o;
  });
}

TEST_P(Conformance, GemmFp8) {
  struct S { int64_t M, N, K; };
  const S shapes[] = {{1, 1, 1}, {37, 129, 16}, {33, 17, 37}, {128, 256, 512}, {256, 2048, 2048},
                      {512, 5632, 2048}, {512, 2048, 5632}};
  const Fp8Format pairs[][2] = {{Fp8Format::kE4M3, Fp8Format::kE4M3},
                                {Fp8Format::kE5M2, Fp8Format::kE4M3},
                                {Fp8Format::kE4M3, Fp8Format::kE5M2}};
  for (const S& s : shapes) {
    for (auto& f : pairs) {
      // Codes limited to |v| <= 2^4 so that sums of K products stay far from overflow.
      auto codes = [&](int64_t n, Fp8Format fmt) {
        auto c = Fp8Codes(n, fmt);
        for (auto& x : c) x = static_cast<uint8_t>((x & 0x80) | ((x & 0x7F) % (fmt == Fp8Format::kE4M3 ? 0x58 : 0x4C)));
        return c;
      };
      const auto A = codes(s.M * s.K, f[0]);
      const auto B = codes(s.N * s.K, f[1]);
      const std::vector<float> sa = {0.375f}, sb = {1.0f / 3.0f};
      const auto C0 = Randn(s.M * s.N);
      // fast: the forward GEMMs' fast accumulation (SetFp8FastAccumulation), which keeps the
      // accumulator's ~14 bits over all of K instead of promoting to FP32 every few blocks: each
      // addition still carries at most 2^-13 of the running sum, the model Fp8GemmTol assumes.
      for (int mode = 0; mode < 3; ++mode) {
        const bool acc = mode == 1, fast = mode == 2;
        Check("GemmFp8/" + std::string(FmtName(f[0])) + "x" + FmtName(f[1]) + "/" + std::to_string(s.M) + "x" +
                  std::to_string(s.N) + "x" + std::to_string(s.K) + (acc ? "/acc" : "") + (fast ? "/fast" : ""),
              Fp8GemmTol(s.K), [&](DevRun& r) {
                Outputs o;
                float* C = acc ? r.In(C0) : r.Out<float>(s.M * s.N);
                r.b()->SetFp8FastAccumulation(fast);
                r.b()->GemmFp8(s.M, s.N, s.K, r.In(A), f[0], r.In(sa), r.In(B), f[1], r.In(sb), C, acc);
                r.b()->SetFp8FastAccumulation(false);
                r.F32(&o, "C", C, s.M * s.N);
                return o;
              });
      }
    }
  }
}

// GEMM autotuning (Backend::SetGemmAutotune): the first call of each shape times the candidate
// algorithms before computing its result. The result must still be the reference's: tuning may
// not run the product into the caller's output (an accumulating or in-place residual GEMM would
// then add it several times), and the tuned algorithm must be a correct one. Shapes not run
// elsewhere in this suite, so each Check's first call is the one that tunes.
TEST_P(Conformance, GemmAutotune) {
  const double bf16_ulp = 2.0 / 256;
  struct S { int64_t M, N, K; };
  auto codes = [&](int64_t n) {
    auto c = Fp8Codes(n, Fp8Format::kE4M3);
    for (auto& v : c) v = static_cast<uint8_t>((v & 0x80) | ((v & 0x7F) % 0x58));
    return c;
  };
  const std::vector<float> sa = {0.375f}, sb = {1.0f / 3.0f};
  for (const S& s : {S{48, 160, 64}, S{384, 2048, 2048}, S{768, 5632, 2048}, S{768, 2048, 5632}}) {
    const std::string shape = std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K);
    const auto A = codes(s.M * s.K), B = codes(s.N * s.K);
    const auto C0 = Randn(s.M * s.N, 4.0f);
    Check("GemmAutotune/GemmFp8/acc/" + shape, Fp8GemmTol(s.K), [&](DevRun& r) {
      Outputs o;
      float* C = r.In(C0);
      r.b()->SetGemmAutotune(true);
      r.b()->GemmFp8(s.M, s.N, s.K, r.In(A), Fp8Format::kE4M3, r.In(sa), r.In(B), Fp8Format::kE4M3,
                     r.In(sb), C, true);
      r.b()->SetGemmAutotune(false);
      r.F32(&o, "C", C, s.M * s.N);
      return o;
    });
    Check("GemmAutotune/GemmFp8AddResidual/fast/" + shape, Fp8GemmTol(s.K), [&](DevRun& r) {
      Outputs o;
      const float* R = r.In(C0);
      float* D = r.Out<float>(s.M * s.N);
      r.b()->SetGemmAutotune(true);
      r.b()->SetFp8FastAccumulation(true);
      r.b()->GemmFp8AddResidual(s.M, s.N, s.K, r.In(A), Fp8Format::kE4M3, r.In(sa), r.In(B),
                                Fp8Format::kE4M3, r.In(sb), R, D);
      r.b()->SetFp8FastAccumulation(false);
      r.b()->SetGemmAutotune(false);
      r.F32(&o, "D", D, s.M * s.N);
      r.F32(&o, "R", R, s.M * s.N);  // unchanged
      return o;
    });
    Check("GemmAutotune/GemmFp8Bf16/" + shape, Fp8GemmTol(s.K) + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t* C = r.Out<uint16_t>(s.M * s.N);
      r.b()->SetGemmAutotune(true);
      r.b()->GemmFp8Bf16(s.M, s.N, s.K, r.In(A), Fp8Format::kE4M3, r.In(sa), r.In(B),
                         Fp8Format::kE4M3, r.In(sb), C);
      r.b()->SetGemmAutotune(false);
      float* f = r.Out<float>(s.M * s.N);
      r.b()->UnpackBf16(C, f, s.M * s.N);
      r.F32(&o, "C", f, s.M * s.N);
      return o;
    });
  }
  const auto A = Randn(1000 * 96), B = Randn(160 * 96), C0 = Randn(1000 * 160);
  Check("GemmAutotune/GemmBf16/acc/1000x160x96", Tol(97), [&](DevRun& r) {
    Outputs o;
    uint16_t* a16 = r.Out<uint16_t>(1000 * 96);
    uint16_t* b16 = r.Out<uint16_t>(160 * 96);
    r.b()->PackBf16(r.In(A), a16, 1000 * 96);
    r.b()->PackBf16(r.In(B), b16, 160 * 96);
    float* C = r.In(C0);
    r.b()->SetGemmAutotune(true);
    r.b()->GemmBf16(false, true, 1000, 160, 96, a16, b16, C, true);
    r.b()->SetGemmAutotune(false);
    r.F32(&o, "C", C, 1000 * 160);
    return o;
  });
}

TEST_P(Conformance, Gemm) {
  struct S { int64_t M, N, K; };
  const S shapes[] = {{1, 1, 1}, {37, 129, 65}, {128, 96, 256}, {512, 1024, 768}};
  for (const S& s : shapes) {
    for (GemmInputs in : {GemmInputs::kF32, GemmInputs::kBF16}) {
      for (int t = 0; t < 4; ++t) {
        const bool ta = t & 1, tb = t & 2;
        const bool acc = t == 3;
        const auto A = Randn(s.M * s.K), B = Randn(s.N * s.K), C0 = Randn(s.M * s.N);
        Check("Gemm/" + std::string(in == GemmInputs::kF32 ? "f32" : "bf16") + (ta ? "/At" : "") + (tb ? "/Bt" : "") +
                  "/" + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K) + (acc ? "/acc" : ""),
              Tol(static_cast<double>(s.K) + 1), [&](DevRun& r) {
                Outputs o;
                float* C = acc ? r.In(C0) : r.Out<float>(s.M * s.N);
                r.b()->Gemm(ta, tb, s.M, s.N, s.K, r.In(A), r.In(B), C, acc, in);
                r.F32(&o, "C", C, s.M * s.N);
                return o;
              });
      }
    }
    // Inputs given as bf16 bit patterns (GemmBf16): the bf16 Gemm's values, without its packs.
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const bool acc = t == 3;
      const auto A = Randn(s.M * s.K), B = Randn(s.N * s.K), C0 = Randn(s.M * s.N);
      Check("GemmBf16" + std::string(ta ? "/At" : "") + (tb ? "/Bt" : "") + "/" +
                std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K) +
                (acc ? "/acc" : ""),
            Tol(static_cast<double>(s.K) + 1), [&](DevRun& r) {
              Outputs o;
              uint16_t* a16 = r.Out<uint16_t>(s.M * s.K);
              uint16_t* b16 = r.Out<uint16_t>(s.N * s.K);
              r.b()->PackBf16(r.In(A), a16, s.M * s.K);
              r.b()->PackBf16(r.In(B), b16, s.N * s.K);
              float* C = acc ? r.In(C0) : r.Out<float>(s.M * s.N);
              r.b()->GemmBf16(ta, tb, s.M, s.N, s.K, a16, b16, C, acc);
              r.F32(&o, "C", C, s.M * s.N);
              return o;
            });
    }
  }
}

TEST_P(Conformance, Elementwise) {
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{1} << 20}) {
    const auto a = Randn(n), b = Randn(n);
    Check("Add/" + std::to_string(n), kEltTol, [&](DevRun& r) {
      Outputs o;
      float* out = r.Out<float>(n);
      r.b()->Add(r.In(a), r.In(b), out, n);
      r.F32(&o, "out", out, n);
      return o;
    });
    Check("Axpy/" + std::to_string(n), kEltTol, [&](DevRun& r) {
      Outputs o;
      float* y = r.In(b);
      r.b()->Axpy(-0.37f, r.In(a), y, n);
      r.F32(&o, "y", y, n);
      return o;
    });
    const auto g = Randn(n, 3.0f), u = Randn(n), dh = Randn(n);
    Check("SwigluForward/" + std::to_string(n), kEltTol, [&](DevRun& r) {
      Outputs o;
      float* h = r.Out<float>(n);
      r.b()->SwigluForward(r.In(g), r.In(u), n, h);
      r.F32(&o, "h", h, n);
      return o;
    });
    Check("SwigluBackward/" + std::to_string(n), kEltTol, [&](DevRun& r) {
      Outputs o;
      float* dg = r.Out<float>(n);
      float* du = r.Out<float>(n);
      r.b()->SwigluBackward(r.In(dh), r.In(g), r.In(u), n, dg, du);
      r.F32(&o, "dgate", dg, n);
      r.F32(&o, "dup", du, n);
      return o;
    });
    Check("SwigluBackwardBf16Saved/" + std::to_string(n), kEltTol, [&](DevRun& r) {
      Outputs o;
      uint16_t* g16 = r.Out<uint16_t>(n);
      uint16_t* u16 = r.Out<uint16_t>(n);
      r.b()->PackBf16(r.In(g), g16, n);
      r.b()->PackBf16(r.In(u), u16, n);
      float* dg = r.Out<float>(n);
      float* du = r.Out<float>(n);
      r.b()->SwigluBackwardBf16Saved(r.In(dh), g16, u16, n, dg, du);
      r.F32(&o, "dgate", dg, n);
      r.F32(&o, "dup", du, n);
      return o;
    });
  }
}

TEST_P(Conformance, Embedding) {
  struct S { int64_t N, V, C; };
  for (const S& s : {S{1, 1, 1}, S{37, 129, 65}, S{4096, 1000, 256}, S{16384, 32768, 64}}) {
    const auto tok = Tokens(s.N, static_cast<int32_t>(s.V));
    const auto table = Randn(s.V * s.C), dout = Randn(s.N * s.C), dt0 = Randn(s.V * s.C);
    const std::string shape = std::to_string(s.N) + "x" + std::to_string(s.V) + "x" + std::to_string(s.C);
    Check("EmbeddingForward/" + shape, -1, [&](DevRun& r) {
      Outputs o;
      float* out = r.Out<float>(s.N * s.C);
      r.b()->EmbeddingForward(r.In(tok), s.N, r.In(table), s.C, out);
      r.F32(&o, "out", out, s.N * s.C);
      return o;
    });
    Check("EmbeddingBackward/" + shape, Tol(static_cast<double>(s.N)), [&](DevRun& r) {
      Outputs o;
      float* dt = r.In(dt0);
      r.b()->EmbeddingBackward(r.In(tok), s.N, r.In(dout), s.C, dt);
      r.F32(&o, "dtable", dt, s.V * s.C);
      return o;
    });
  }
}

TEST_P(Conformance, RmsNorm) {
  struct S { int64_t N, C; };
  // C = 1 is left out: there dx = dy w rstd eps / (x^2 + eps) is a pure cancellation of two
  // equal terms, which no normwise tolerance can judge. C = 2 keeps the single-row edge case.
  for (const S& s : {S{1, 2}, S{37, 129}, S{64, 1000}, S{333, 2048}, S{40, 4096}, S{4096, 5632}}) {
    const auto x = Randn(s.N * s.C, 2.0f), w = Uniform(s.C, 0.5f, 1.5f), dy = Randn(s.N * s.C);
    const auto dw0 = Randn(s.C);
    const std::string shape = std::to_string(s.N) + "x" + std::to_string(s.C);
    Check("RmsNormForward/" + shape, Tol(static_cast<double>(s.C)), [&](DevRun& r) {
      Outputs o;
      float* y = r.Out<float>(s.N * s.C);
      float* rstd = r.Out<float>(s.N);
      r.b()->RmsNormForward(r.In(x), r.In(w), 1e-5f, s.N, s.C, y, rstd);
      r.F32(&o, "y", y, s.N * s.C);
      r.F32(&o, "rstd", rstd, s.N);
      return o;
    });
    Check("RmsNormBackward/" + shape, Tol(static_cast<double>(s.C + s.N)), [&](DevRun& r) {
      Outputs o;
      float* y = r.Out<float>(s.N * s.C);
      float* rstd = r.Out<float>(s.N);
      const float* xd = r.In(x);
      const float* wd = r.In(w);
      r.b()->RmsNormForward(xd, wd, 1e-5f, s.N, s.C, y, rstd);
      float* dx = r.Out<float>(s.N * s.C);
      float* dw = r.In(dw0);
      r.b()->RmsNormBackward(r.In(dy), xd, wd, rstd, s.N, s.C, dx, dw);
      r.F32(&o, "dx", dx, s.N * s.C);
      r.F32(&o, "dw", dw, s.C);
      return o;
    });
    const std::vector<float> nscale = {24.0f};
    // Codes within one step; rstd as RmsNormForward's; amax of the f32 y (a few ulps).
    auto norm_cast = [&](DevRun& r, bool codes) {
      Outputs o;
      float* rstd = r.Out<float>(s.N);
      uint8_t* out = r.Out<uint8_t>(s.N * s.C);
      float* amax = r.In(std::vector<float>{0.0f});
      r.b()->RmsNormCastFp8(r.In(x), r.In(w), 1e-5f, s.N, s.C, rstd, r.In(nscale), Fp8Format::kE4M3,
                            out, amax);
      if (codes) {
        r.Fp8CodesNear(&o, "out", out, s.N * s.C);
      } else {
        r.F32(&o, "rstd", rstd, s.N);
        r.F32(&o, "amax", amax, 1);
      }
      return o;
    };
    Check("RmsNormCastFp8/" + shape, -1, [&](DevRun& r) { return norm_cast(r, true); });
    Check("RmsNormCastFp8/" + shape + "/rstd,amax", Tol(static_cast<double>(s.C)),
          [&](DevRun& r) { return norm_cast(r, false); });
    const auto dres = Randn(s.N * s.C);
    Check("RmsNormBackwardAdd/" + shape, Tol(static_cast<double>(s.C + s.N)), [&](DevRun& r) {
      Outputs o;
      float* y = r.Out<float>(s.N * s.C);
      float* rstd = r.Out<float>(s.N);
      const float* xd = r.In(x);
      const float* wd = r.In(w);
      r.b()->RmsNormForward(xd, wd, 1e-5f, s.N, s.C, y, rstd);
      float* dx = r.Out<float>(s.N * s.C);
      float* dw = r.In(dw0);
      r.b()->RmsNormBackwardAdd(r.In(dy), xd, wd, rstd, r.In(dres), s.N, s.C, dx, dw);
      r.F32(&o, "dx", dx, s.N * s.C);
      r.F32(&o, "dw", dw, s.C);
      return o;
    });
    // dy as the f32 sum of bf16 parts (one: a fused q/k/v or gate/up dX; two: gate/up; three:
    // q/k/v). C 5632 is above the CUDA fused kernel's limit and takes the composition there.
    const auto dyb = Randn(s.N * s.C), dyc = Randn(s.N * s.C);
    for (int parts : {1, 2, 3}) {
      const bool three = parts == 3;
      Check("RmsNormBackwardAddBf16Parts/" + shape + "/" + std::to_string(parts),
            Tol(static_cast<double>(s.C + s.N)), [&](DevRun& r) {
              Outputs o;
              const int64_t n = s.N * s.C;
              auto packed = [&](const std::vector<float>& v) {
                uint16_t* p = r.Out<uint16_t>(n);
                r.b()->PackBf16(r.In(v), p, n);
                return p;
              };
              float* y = r.Out<float>(n);
              float* rstd = r.Out<float>(s.N);
              const float* xd = r.In(x);
              const float* wd = r.In(w);
              r.b()->RmsNormForward(xd, wd, 1e-5f, s.N, s.C, y, rstd);
              float* dx = r.Out<float>(n);
              float* dw = r.In(dw0);
              r.b()->RmsNormBackwardAddBf16Parts(packed(dy), parts > 1 ? packed(dyb) : nullptr,
                                                 three ? packed(dyc) : nullptr, xd, wd, rstd,
                                                 r.In(dres), s.N, s.C, dx, dw);
              r.F32(&o, "dx", dx, n);
              r.F32(&o, "dw", dw, s.C);
              return o;
            });
    }
  }
}

TEST_P(Conformance, Rope) {
  struct S { int64_t B, T, H, D; };
  for (const S& s : {S{1, 1, 1, 2}, S{2, 37, 3, 18}, S{2, 2048, 4, 128}}) {
    const int64_t n = s.B * s.T * s.H * s.D;
    const auto x = Randn(n);
    const std::string shape = std::to_string(s.B) + "x" + std::to_string(s.T) + "x" + std::to_string(s.H) + "x" + std::to_string(s.D);
    Check("RopeForward/" + shape, kEltTol, [&](DevRun& r) {
      Outputs o;
      float* p = r.In(x);
      r.b()->RopeForward(p, s.B, s.T, s.H, s.D, 10000.0f);
      r.F32(&o, "x", p, n);
      return o;
    });
    Check("RopeBackward/" + shape, kEltTol, [&](DevRun& r) {
      Outputs o;
      float* p = r.In(x);
      r.b()->RopeBackward(p, s.B, s.T, s.H, s.D, 500000.0f);
      r.F32(&o, "dx", p, n);
      return o;
    });
  }
}

TEST_P(Conformance, Attention) {
  struct S { int64_t B, T, H, Hkv, D; };
  for (const S& s : {S{1, 1, 1, 1, 4}, S{2, 37, 4, 2, 16}, S{1, 129, 3, 1, 64}, S{2, 256, 4, 4, 128},
                     S{1, 100, 2, 2, 160}}) {
    const int64_t nq = s.B * s.T * s.H * s.D, nk = s.B * s.T * s.Hkv * s.D;
    const auto q = Randn(nq), k = Randn(nk), v = Randn(nk), dout = Randn(nq);
    const std::string shape = std::to_string(s.B) + "x" + std::to_string(s.T) + "x" + std::to_string(s.H) + "/" +
                              std::to_string(s.Hkv) + "x" + std::to_string(s.D);
    const double tol = 4 * Tol(static_cast<double>(s.T + s.D));
    Check("AttentionForward/" + shape, tol, [&](DevRun& r) {
      Outputs o;
      float* out = r.Out<float>(nq);
      float* lse = r.Out<float>(s.B * s.H * s.T);
      r.b()->AttentionForward(r.In(q), r.In(k), r.In(v), s.B, s.T, s.H, s.Hkv, s.D, out, lse);
      r.F32(&o, "out", out, nq);
      r.F32(&o, "lse", lse, s.B * s.H * s.T);
      return o;
    });
    Check("AttentionBackward/" + shape, tol * (s.H / s.Hkv), [&](DevRun& r) {
      Outputs o;
      const float* qd = r.In(q);
      const float* kd = r.In(k);
      const float* vd = r.In(v);
      float* out = r.Out<float>(nq);
      float* lse = r.Out<float>(s.B * s.H * s.T);
      r.b()->AttentionForward(qd, kd, vd, s.B, s.T, s.H, s.Hkv, s.D, out, lse);
      float* dq = r.Out<float>(nq);
      float* dk = r.Out<float>(nk);
      float* dv = r.Out<float>(nk);
      r.b()->AttentionBackward(qd, kd, vd, out, r.In(dout), lse, s.B, s.T, s.H, s.Hkv, s.D, dq, dk, dv);
      r.F32(&o, "dq", dq, nq);
      r.F32(&o, "dk", dk, nk);
      r.F32(&o, "dv", dv, nk);
      return o;
    });
  }
}

// BF16 attention through the Backend (precision.attention = bf16): on CUDA, cuDNN's fused SDPA
// where D is a multiple of 8 up to 128, the reference otherwise (D 4, D 160). Against the CPU
// reference (bf16-rounded inputs, f32 math, bf16-rounded outputs) the fused kernel differs by its
// bf16 probabilities before P·V: tolerances as the CudnnAttention test (unit roundoff 2^-8:
// forward 4 ub, backward 8 ub).
TEST_P(Conformance, AttentionBf16) {
  struct S { int64_t B, T, H, Hkv, D; };
  const double ub = 1.0 / 256;
  for (const S& s : {S{1, 1, 1, 1, 4}, S{2, 37, 4, 2, 16}, S{1, 129, 3, 1, 64}, S{2, 256, 4, 4, 128},
                     S{1, 100, 2, 2, 160}}) {
    const int64_t nq = s.B * s.T * s.H * s.D, nk = s.B * s.T * s.Hkv * s.D;
    const auto q = Randn(nq), k = Randn(nk), v = Randn(nk), dout = Randn(nq);
    const std::string shape = std::to_string(s.B) + "x" + std::to_string(s.T) + "x" + std::to_string(s.H) + "/" +
                              std::to_string(s.Hkv) + "x" + std::to_string(s.D);
    Check("AttentionForwardBf16Compute/" + shape, 4 * ub, [&](DevRun& r) {
      Outputs o;
      float* out = r.Out<float>(nq);
      float* lse = r.Out<float>(s.B * s.H * s.T);
      r.b()->AttentionForwardBf16Compute(r.In(q), r.In(k), r.In(v), s.B, s.T, s.H, s.Hkv, s.D, out,
                                         lse);
      r.F32(&o, "out", out, nq);
      r.F32(&o, "lse", lse, s.B * s.H * s.T);
      return o;
    });
    Check("AttentionBackwardBf16Compute/" + shape, 8 * ub, [&](DevRun& r) {
      Outputs o;
      const float* qd = r.In(q);
      const float* kd = r.In(k);
      const float* vd = r.In(v);
      float* out = r.Out<float>(nq);
      float* lse = r.Out<float>(s.B * s.H * s.T);
      r.b()->AttentionForwardBf16Compute(qd, kd, vd, s.B, s.T, s.H, s.Hkv, s.D, out, lse);
      float* dq = r.Out<float>(nq);
      float* dk = r.Out<float>(nk);
      float* dv = r.Out<float>(nk);
      r.b()->AttentionBackwardBf16Compute(qd, kd, vd, out, r.In(dout), lse, s.B, s.T, s.H, s.Hkv,
                                          s.D, dq, dk, dv);
      r.F32(&o, "dq", dq, nq);
      r.F32(&o, "dk", dk, nk);
      r.F32(&o, "dv", dv, nk);
      return o;
    });
    // From the bf16 activations the model saves (exactly the values the backward rounds to).
    Check("AttentionBackwardBf16Saved/" + shape, 8 * ub, [&](DevRun& r) {
      Outputs o;
      const float* qd = r.In(q);
      const float* kd = r.In(k);
      const float* vd = r.In(v);
      float* out = r.Out<float>(nq);
      float* lse = r.Out<float>(s.B * s.H * s.T);
      r.b()->AttentionForwardBf16Compute(qd, kd, vd, s.B, s.T, s.H, s.Hkv, s.D, out, lse);
      uint16_t* q16 = r.Out<uint16_t>(nq);
      uint16_t* o16 = r.Out<uint16_t>(nq);
      uint16_t* k16 = r.Out<uint16_t>(nk);
      uint16_t* v16 = r.Out<uint16_t>(nk);
      r.b()->PackBf16(qd, q16, nq);
      r.b()->PackBf16(out, o16, nq);
      r.b()->PackBf16(kd, k16, nk);
      r.b()->PackBf16(vd, v16, nk);
      float* dq = r.Out<float>(nq);
      float* dk = r.Out<float>(nk);
      float* dv = r.Out<float>(nk);
      r.b()->AttentionBackwardBf16Saved(q16, k16, v16, o16, r.In(dout), lse, s.B, s.T, s.H, s.Hkv, s.D,
                                        dq, dk, dv);
      r.F32(&o, "dq", dq, nq);
      r.F32(&o, "dk", dk, nk);
      r.F32(&o, "dv", dv, nk);
      return o;
    });
  }
}

TEST_P(Conformance, CrossEntropy) {
  struct S { int64_t N, V; };
  for (const S& s : {S{1, 1}, S{37, 129}, S{64, 32768}, S{1024, 50257}}) {
    const auto logits = Randn(s.N * s.V, 4.0f);
    const auto tgt = Tokens(s.N, static_cast<int32_t>(s.V));
    for (float gs : {1.0f / static_cast<float>(s.N), 0.0f}) {
      Check("CrossEntropy/" + std::to_string(s.N) + "x" + std::to_string(s.V) + (gs == 0.0f ? "/loss_only" : ""),
            Tol(static_cast<double>(s.V)), [&](DevRun& r) {
              Outputs o;
              float* lg = r.In(logits);
              float* losses = r.Out<float>(s.N);
              r.b()->CrossEntropyForwardBackward(lg, r.In(tgt), s.N, s.V, gs, losses);
              r.F32(&o, "losses", losses, s.N);
              if (gs != 0.0f) r.F32(&o, "dlogits", lg, s.N * s.V);
              return o;
            });
    }
    // The gradient as bf16 into its own buffer; the logits must be left as they were. A bf16
    // gradient may be one bf16 step from the reference's where the f32 values differ by ulps.
    Check("CrossEntropyBf16Grad/" + std::to_string(s.N) + "x" + std::to_string(s.V),
          Tol(static_cast<double>(s.V)) + 1.0 / 128, [&](DevRun& r) {
            Outputs o;
            float* lg = r.In(logits);
            float* losses = r.Out<float>(s.N);
            uint16_t* g16 = r.Out<uint16_t>(s.N * s.V);
            r.b()->CrossEntropyForwardBackwardBf16Grad(lg, r.In(tgt), s.N, s.V,
                                                       1.0f / static_cast<float>(s.N), losses, g16);
            float* g = r.Out<float>(s.N * s.V);
            r.b()->UnpackBf16(g16, g, s.N * s.V);
            r.F32(&o, "losses", losses, s.N);
            r.F32(&o, "dlogits", g, s.N * s.V);
            r.Bytes(&o, "logits unchanged", lg, s.N * s.V);
            return o;
          });
  }
}

TEST_P(Conformance, SumSquares) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{37}, int64_t{1} << 22}) {
    const auto x = Randn(n);
    Check("SumSquares/" + std::to_string(n), Tol(1), [&](DevRun& r) {
      Outputs o;
      float* out = r.In(std::vector<float>{1.5f});
      r.b()->SumSquares(r.In(x), n, out);
      r.F32(&o, "out", out, 1);
      return o;
    });
  }
}

TEST_P(Conformance, AdamW) {
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{1} << 20}) {
    const auto p = Randn(n), g = Randn(n, 0.1f), m = Randn(n, 0.01f);
    auto v = Randn(n, 0.001f);
    for (auto& x : v) x = std::fabs(x);
    // skip: the update starts that many elements in (a shard slice, unaligned vectors).
    for (int64_t step : {int64_t{1}, int64_t{1000}}) {
      for (int64_t skip : {int64_t{0}, int64_t{3}}) {
        if (skip >= n) continue;
        Check("AdamW/" + std::to_string(n) + "/step" + std::to_string(step) + "/skip" +
                  std::to_string(skip),
              kEltTol, [&](DevRun& r) {
                Outputs o;
                float* pd = r.In(p);
                float* md = r.In(m);
                float* vd = r.In(v);
                // The fused amax of the updated weights starts above some |p| and below others.
                float* amax = r.In(std::vector<float>{0.5f});
                r.b()->AdamW(pd + skip, r.In(g) + skip, md + skip, vd + skip, n - skip, 3e-4f, 0.9f,
                             0.95f, 1e-8f, 0.1f, step, 0.5f, amax);
                r.F32(&o, "p", pd, n);
                r.F32(&o, "amax", amax, 1);
                r.F32(&o, "m", md, n);
                r.F32(&o, "v", vd, n);
                return o;
              });
      }
    }
  }
}

// The bfloat16-activation ops (backend.h): inputs packed to bf16 on the device (PackBf16 is
// bit-exact on every backend), bf16 outputs unpacked to f32 for the comparison. Casts from bf16
// must match bit for bit; an op whose f32 math may differ by a few ulps (kEltTol, the attention
// tolerances above) can then round to the neighbouring bf16 value, one bf16 ulp away: up to 2^-7
// of that element, so of the largest one too (normwise), and its bound gains 2^-7 (bf16_ulp).
// FP8 codes of such a value can likewise land one code step apart: the fused casts are compared
// code by code, at most one step (Output::fp8_within_one_code).
TEST_P(Conformance, Bf16Activations) {
  const double ub = 1.0 / 256;          // bf16 unit roundoff, 2^-8
  const double bf16_ulp = 2 * ub;       // one bf16 step, relative: 2^-7
  auto packed = [](DevRun& r, const std::vector<float>& x) {
    uint16_t* p = r.Out<uint16_t>(static_cast<int64_t>(x.size()));
    r.b()->PackBf16(r.In(x), p, static_cast<int64_t>(x.size()));
    return p;
  };
  auto unpacked = [](DevRun& r, Outputs* o, const std::string& name, const uint16_t* p, int64_t n) {
    float* f = r.Out<float>(n);
    r.b()->UnpackBf16(p, f, n);
    r.F32(o, name, f, n);
  };
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{4099}, int64_t{1} << 16}) {
    for (Fp8Format fmt : kFormats) {
      const auto x = CastInputs(n);
      const std::vector<float> scale = {2.75f};
      Check(std::string("CastToFp8Bf16/") + FmtName(fmt) + "/" + std::to_string(n), -1, [&](DevRun& r) {
        Outputs o;
        uint8_t* out = r.Out<uint8_t>(n);
        float* amax = r.In(std::vector<float>{0.5f});
        r.b()->CastToFp8Bf16(packed(r, x), out, n, r.In(scale), fmt, amax);
        r.Bytes(&o, "out", out, n);
        r.Bytes(&o, "amax", amax, 1);
        return o;
      });
    }
    const auto g = Randn(n, 2.0f), u = Randn(n), dh = Randn(n);
    const std::vector<float> scale = {16.0f};
    Check("SwigluCastFp8/" + std::to_string(n), kEltTol, [&](DevRun& r) {
      Outputs o;
      uint8_t* out = r.Out<uint8_t>(n);
      float* amax = r.In(std::vector<float>{0.0f});
      r.b()->SwigluCastFp8(packed(r, g), packed(r, u), 1, n, n, r.In(scale), Fp8Format::kE4M3, out,
                           amax);
      r.Fp8CodesNear(&o, "out", out, n);
      r.F32(&o, "amax", amax, 1);
      return o;
    });
    // gate and up as the two halves of one (rows, 2 * cols) matrix (a fused gate/up GEMM's output).
    if (n % 8 == 0 && n >= 8) {
      const int64_t cols = 4, rows = n / cols;
      std::vector<float> gu(static_cast<size_t>(2 * n));
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t c = 0; c < cols; ++c) {
          gu[i * 2 * cols + c] = g[i * cols + c];
          gu[i * 2 * cols + cols + c] = u[i * cols + c];
        }
      }
      Check("SwigluCastFp8/side-by-side/" + std::to_string(n), kEltTol, [&](DevRun& r) {
        Outputs o;
        uint8_t* out = r.Out<uint8_t>(n);
        float* amax = r.In(std::vector<float>{0.0f});
        const uint16_t* p = packed(r, gu);
        r.b()->SwigluCastFp8(p, p + cols, rows, cols, 2 * cols, r.In(scale), Fp8Format::kE4M3, out,
                             amax);
        r.Fp8CodesNear(&o, "out", out, n);
        r.F32(&o, "amax", amax, 1);
        return o;
      });
    }
    Check("SwigluBackwardBf16To16/" + std::to_string(n), kEltTol + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t* dg = r.Out<uint16_t>(n);
      uint16_t* du = r.Out<uint16_t>(n);
      r.b()->SwigluBackwardBf16To16(packed(r, dh), packed(r, g), packed(r, u), n, dg, du);
      unpacked(r, &o, "dgate", dg, n);
      unpacked(r, &o, "dup", du, n);
      return o;
    });
  }
  const int64_t shapes[][2] = {{1, 1}, {37, 129}, {256, 192}, {1000, 36}, {2048, 1408}};
  for (auto& sh : shapes) {
    const int64_t rows = sh[0], cols = sh[1];
    auto x = Randn(rows * cols, 3.0f);
    x[static_cast<size_t>(rows * cols / 2)] = 1e6f;  // saturates
    const std::vector<float> scale = {20.0f};
    for (Fp8Format fmt : kFormats) {
      Check(std::string("CastTransposeFp8Bf16/") + FmtName(fmt) + "/" + std::to_string(rows) + "x" +
                std::to_string(cols),
            -1, [&](DevRun& r) {
              Outputs o;
              uint8_t* out = r.Out<uint8_t>(rows * cols);
              uint8_t* out_t = r.Out<uint8_t>(rows * cols);
              float* amax = r.In(std::vector<float>{0.0f});
              r.b()->CastTransposeFp8Bf16(packed(r, x), rows, cols, r.In(scale), fmt, out, out_t, amax,
                                          cols);
              r.Bytes(&o, "out", out, rows * cols);
              r.Bytes(&o, "out_t", out_t, rows * cols);
              r.Bytes(&o, "amax", amax, 1);
              return o;
            });
      // Row stride out_ld > cols (the codes of several grad-outputs side by side): the same codes
      // per row, the bytes between rows untouched (pre-filled 0x5A on both backends). +4 keeps the
      // 4-byte row stores where cols allows them; +3 forces the byte path.
      for (int64_t pad : {4, 3}) {
        const int64_t ld = cols + pad;
        Check(std::string("CastTransposeFp8Bf16/strided+") + std::to_string(pad) + "/" +
                  FmtName(fmt) + "/" + std::to_string(rows) + "x" + std::to_string(cols),
              -1, [&](DevRun& r) {
                Outputs o;
                uint8_t* out = r.In(std::vector<uint8_t>(static_cast<size_t>(rows * ld), 0x5A));
                uint8_t* out_t = r.Out<uint8_t>(rows * cols);
                float* amax = r.In(std::vector<float>{0.0f});
                r.b()->CastTransposeFp8Bf16(packed(r, x), rows, cols, r.In(scale), fmt, out, out_t,
                                            amax, ld);
                r.Bytes(&o, "out", out, rows * ld);
                r.Bytes(&o, "out_t", out_t, rows * cols);
                r.Bytes(&o, "amax", amax, 1);
                return o;
              });
      }
    }
  }
  // The SwiGLU backward fused with the cast-transposes of its two gradients: codes one step apart
  // at most (a bf16 gradient one ulp apart, as SwigluBackwardBf16To16 allows), amaxes within that
  // ulp. The tile edges (37 x 129, 1000 x 36) take the kernel's element-by-element path.
  for (auto& sh : shapes) {
    const int64_t rows = sh[0], cols = sh[1], n = rows * cols;
    const auto g = Randn(n, 2.0f), u = Randn(n);
    auto dh = Randn(n, 4.0f);
    dh[static_cast<size_t>(n / 3)] = 3e4f;  // saturates E4M3 at these scales
    const std::vector<float> sg = {20.0f}, su = {8.0f};
    for (Fp8Format fmt : kFormats) {
      Check(std::string("SwigluBackwardCastTransposeFp8/") + FmtName(fmt) + "/" +
                std::to_string(rows) + "x" + std::to_string(cols),
            kEltTol + bf16_ulp, [&](DevRun& r) {
              Outputs o;
              uint8_t* dg8 = r.Out<uint8_t>(n);
              uint8_t* dgT8 = r.Out<uint8_t>(n);
              uint8_t* du8 = r.Out<uint8_t>(n);
              uint8_t* duT8 = r.Out<uint8_t>(n);
              float* amax = r.In(std::vector<float>{0.0f, 0.0f});
              r.b()->SwigluBackwardCastTransposeFp8(packed(r, dh), packed(r, g), packed(r, u), rows,
                                                    cols, r.In(sg), r.In(su), fmt, dg8, dgT8, du8,
                                                    duT8, amax, amax + 1, cols, cols);
              r.Fp8CodesNear(&o, "dgate8", dg8, n);
              r.Fp8CodesNear(&o, "dgate8_t", dgT8, n);
              r.Fp8CodesNear(&o, "dup8", du8, n);
              r.Fp8CodesNear(&o, "dup8_t", duT8, n);
              r.F32(&o, "amax", amax, 2);
              return o;
            });
      // The fused gate/up layout (LlamaModel): gate and up read as the two halves of one
      // (rows, 2 * cols) matrix, dgate and dup written side by side in another, their transposes
      // one after the other in one buffer (dup8_t from the next 16-byte boundary: the kernel's
      // transposed stores need 4-byte aligned rows).
      // (CUDA reads gate, up and dh 4 elements at a time: cols % 4 == 0, as F is in the model.)
      if (cols % 4 != 0) continue;
      const int64_t at = (n + 15) / 16 * 16;
      std::vector<float> gu(static_cast<size_t>(2 * n));
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t c = 0; c < cols; ++c) {
          gu[i * 2 * cols + c] = g[i * cols + c];
          gu[i * 2 * cols + cols + c] = u[i * cols + c];
        }
      }
      Check(std::string("SwigluBackwardCastTransposeFp8/side-by-side/") + FmtName(fmt) + "/" +
                std::to_string(rows) + "x" + std::to_string(cols),
            kEltTol + bf16_ulp, [&](DevRun& r) {
              Outputs o;
              uint8_t* d8 = r.Out<uint8_t>(2 * n);
              uint8_t* dT8 = r.In(std::vector<uint8_t>(static_cast<size_t>(at + n), 0x5A));
              float* amax = r.In(std::vector<float>{0.0f, 0.0f});
              const uint16_t* p = packed(r, gu);
              r.b()->SwigluBackwardCastTransposeFp8(packed(r, dh), p, p + cols, rows, cols,
                                                    r.In(sg), r.In(su), fmt, d8, dT8, d8 + cols,
                                                    dT8 + at, amax, amax + 1, 2 * cols, 2 * cols);
              r.Fp8CodesNear(&o, "[dgate8 | dup8]", d8, 2 * n);
              r.Fp8CodesNear(&o, "[dgate8_t ; dup8_t]", dT8, at + n);
              r.F32(&o, "amax", amax, 2);
              return o;
            });
    }
  }
  // RoPE's backward fused with the cast-transpose of its result. (B, T, H, D): tile edges and a
  // partial last tile (2, 37, 3, 16), full tiles (2, 128, 4, 64), D 8 (halves of 4) in full
  // tiles (2, 128, 8, 8) and at an edge (1, 64, 2, 8), and D 6 (the CUDA backend falls back to the
  // composition). dx16 must be left as it was.
  struct RopeShape { int64_t B, T, H, D; };
  for (const RopeShape& q : {RopeShape{2, 37, 3, 16}, RopeShape{2, 128, 4, 64},
                             RopeShape{2, 128, 8, 8}, RopeShape{1, 64, 2, 8},
                             RopeShape{1, 20, 2, 6}}) {
    const int64_t n = q.B * q.T * q.H * q.D;
    const auto dx = Randn(n, 3.0f);
    const std::vector<float> scale = {12.0f};
    for (Fp8Format fmt : kFormats) {
      // Dense rows, and row stride H * D + 8 (q's codes beside k's and v's in the fused q/k/v
      // backward), whose bytes past each row must stay as pre-filled.
      for (int64_t pad : {0, 8}) {
        const int64_t ld = q.H * q.D + pad, rows = q.B * q.T;
        Check(std::string("RopeBackwardCastTransposeFp8Bf16/") + (pad ? "strided/" : "") +
                  FmtName(fmt) + "/" + std::to_string(q.B) + "x" + std::to_string(q.T) + "x" +
                  std::to_string(q.H) + "x" + std::to_string(q.D),
              kEltTol + bf16_ulp, [&](DevRun& r) {
                Outputs o;
                uint16_t* x16 = packed(r, dx);
                uint8_t* out = r.In(std::vector<uint8_t>(static_cast<size_t>(rows * ld), 0x5A));
                uint8_t* out_t = r.Out<uint8_t>(n);
                float* amax = r.In(std::vector<float>{0.0f});
                r.b()->RopeBackwardCastTransposeFp8Bf16(x16, q.B, q.T, q.H, q.D, 10000.0f,
                                                        r.In(scale), fmt, out, out_t, amax, ld);
                r.Fp8CodesNear(&o, "out", out, rows * ld);
                r.Fp8CodesNear(&o, "out_t", out_t, n);
                r.F32(&o, "amax", amax, 1);
                r.Bytes(&o, "dx16 unchanged", x16, n);
                return o;
              });
      }
    }
  }
  struct G { int64_t M, N, K; };
  for (const G& s : {G{1, 1, 16}, G{37, 130, 32}, G{256, 512, 256}, G{512, 2048, 2048}}) {
    auto codes = [&](int64_t n) {
      auto c = Fp8Codes(n, Fp8Format::kE4M3);
      for (auto& v : c) v = static_cast<uint8_t>((v & 0x80) | ((v & 0x7F) % 0x58));
      return c;
    };
    const auto A = codes(s.M * s.K), B = codes(s.N * s.K);
    const std::vector<float> sa = {0.375f}, sb = {1.0f / 3.0f};
    Check("GemmFp8Bf16/" + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K),
          Fp8GemmTol(s.K) + bf16_ulp, [&](DevRun& r) {
            Outputs o;
            uint16_t* C = r.Out<uint16_t>(s.M * s.N);
            r.b()->GemmFp8Bf16(s.M, s.N, s.K, r.In(A), Fp8Format::kE4M3, r.In(sa), r.In(B),
                               Fp8Format::kE4M3, r.In(sb), C);
            unpacked(r, &o, "C", C, s.M * s.N);
            return o;
          });
  }
  for (const G& s : {G{1, 1, 16}, G{37, 130, 32}, G{512, 2048, 2048}}) {
    auto codes = [&](int64_t n) {
      auto c = Fp8Codes(n, Fp8Format::kE4M3);
      for (auto& v : c) v = static_cast<uint8_t>((v & 0x80) | ((v & 0x7F) % 0x58));
      return c;
    };
    const auto A = codes(s.M * s.K), B = codes(s.N * s.K);
    const auto R0 = Randn(s.M * s.N, 4.0f);
    const std::vector<float> sa = {0.375f}, sb = {1.0f / 3.0f};
    Check("GemmFp8AddResidual/" + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K),
          Fp8GemmTol(s.K), [&](DevRun& r) {
            Outputs o;
            const float* R = r.In(R0);
            float* D = r.Out<float>(s.M * s.N);
            r.b()->GemmFp8AddResidual(s.M, s.N, s.K, r.In(A), Fp8Format::kE4M3, r.In(sa), r.In(B),
                                      Fp8Format::kE4M3, r.In(sb), R, D);
            r.F32(&o, "D", D, s.M * s.N);
            r.F32(&o, "R", R, s.M * s.N);  // unchanged
            return o;
          });
  }
  struct R { int64_t B, T, H, D; };
  for (const R& s : {R{1, 1, 1, 2}, R{2, 37, 3, 18}, R{2, 2048, 4, 128}}) {
    const int64_t n = s.B * s.T * s.H * s.D;
    const auto x = Randn(n);
    const std::string shape = std::to_string(s.B) + "x" + std::to_string(s.T) + "x" + std::to_string(s.H) + "x" + std::to_string(s.D);
    Check("RopeForwardBf16/" + shape, kEltTol + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t* p = packed(r, x);
      r.b()->RopeForwardBf16(p, s.B, s.T, s.H, s.D, 10000.0f, s.H * s.D);
      unpacked(r, &o, "x", p, n);
      return o;
    });
    // Tokens ld = H * D + 2 * D apart (q's part of a fused q/k/v output); the columns between
    // them must come back untouched.
    const int64_t ld = s.H * s.D + 2 * s.D;
    const auto xs = Randn(s.B * s.T * ld);
    Check("RopeForwardBf16/strided/" + shape, kEltTol + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t* p = packed(r, xs);
      r.b()->RopeForwardBf16(p, s.B, s.T, s.H, s.D, 10000.0f, ld);
      unpacked(r, &o, "x", p, s.B * s.T * ld);
      return o;
    });
    Check("RopeBackwardBf16/" + shape, kEltTol + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t* p = packed(r, x);
      r.b()->RopeBackwardBf16(p, s.B, s.T, s.H, s.D, 500000.0f);
      unpacked(r, &o, "dx", p, n);
      return o;
    });
  }
  struct A { int64_t B, T, H, Hkv, D; };
  for (const A& s : {A{1, 1, 1, 1, 4}, A{2, 37, 4, 2, 16}, A{2, 256, 4, 4, 128}}) {
    const int64_t nq = s.B * s.T * s.H * s.D, nk = s.B * s.T * s.Hkv * s.D;
    const auto q = Randn(nq), k = Randn(nk), v = Randn(nk), dout = Randn(nq);
    const std::string shape = std::to_string(s.B) + "x" + std::to_string(s.T) + "x" + std::to_string(s.H) + "/" +
                              std::to_string(s.Hkv) + "x" + std::to_string(s.D);
    Check("AttentionBf16Packed/" + shape, 8 * ub + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t *q16 = packed(r, q), *k16 = packed(r, k), *v16 = packed(r, v);
      uint16_t* out16 = r.Out<uint16_t>(nq);
      float* lse = r.Out<float>(s.B * s.H * s.T);
      r.b()->AttentionForwardBf16Packed(q16, k16, v16, s.B, s.T, s.H, s.Hkv, s.D, out16, lse,
                                        s.H * s.D, s.Hkv * s.D);
      unpacked(r, &o, "out", out16, nq);
      r.F32(&o, "lse", lse, s.B * s.H * s.T);
      uint16_t* dq = r.Out<uint16_t>(nq);
      uint16_t* dk = r.Out<uint16_t>(nk);
      uint16_t* dv = r.Out<uint16_t>(nk);
      r.b()->AttentionBackwardBf16SavedTo16(q16, k16, v16, out16, packed(r, dout), lse, s.B, s.T, s.H,
                                            s.Hkv, s.D, dq, dk, dv, s.H * s.D, s.Hkv * s.D);
      unpacked(r, &o, "dq", dq, nq);
      unpacked(r, &o, "dk", dk, nk);
      unpacked(r, &o, "dv", dv, nk);
      return o;
    });
    // q, k, v as the three parts of one (B * T, (H + 2 Hkv) * D) matrix (the fused q/k/v GEMM's
    // output): the same values as the dense call above.
    const int64_t hq = s.H * s.D, hk = s.Hkv * s.D, ld = hq + 2 * hk, rows = s.B * s.T;
    std::vector<float> qkv(static_cast<size_t>(rows * ld));
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t c = 0; c < hq; ++c) qkv[t * ld + c] = q[t * hq + c];
      for (int64_t c = 0; c < hk; ++c) {
        qkv[t * ld + hq + c] = k[t * hk + c];
        qkv[t * ld + hq + hk + c] = v[t * hk + c];
      }
    }
    Check("AttentionBf16Packed/fused-qkv/" + shape, 8 * ub + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      const uint16_t* p = packed(r, qkv);
      uint16_t* out16 = r.Out<uint16_t>(nq);
      float* lse = r.Out<float>(s.B * s.H * s.T);
      r.b()->AttentionForwardBf16Packed(p, p + hq, p + hq + hk, s.B, s.T, s.H, s.Hkv, s.D, out16,
                                        lse, ld, ld);
      unpacked(r, &o, "out", out16, nq);
      r.F32(&o, "lse", lse, s.B * s.H * s.T);
      uint16_t* dq = r.Out<uint16_t>(nq);
      uint16_t* dk = r.Out<uint16_t>(nk);
      uint16_t* dv = r.Out<uint16_t>(nk);
      r.b()->AttentionBackwardBf16SavedTo16(p, p + hq, p + hq + hk, out16, packed(r, dout), lse, s.B,
                                            s.T, s.H, s.Hkv, s.D, dq, dk, dv, ld, ld);
      unpacked(r, &o, "dq", dq, nq);
      unpacked(r, &o, "dk", dk, nk);
      unpacked(r, &o, "dv", dv, nk);
      return o;
    });
  }
}

// On each backend the fused SwiGLU backward + cast-transposes gives exactly the codes and amaxes
// of its unfused composition (SwigluBackwardBf16To16, then CastTransposeFp8Bf16 of each
// gradient): the model takes one path or the other depending on whether the grad-output scales
// are known before the cast, and the two must train identically.
TEST_P(Conformance, SwigluBackwardCastTransposeIsItsComposition) {
  for (Fp8Format fmt : kFormats) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{300, 200}, {256, 1408}, {37, 129}}) {
      const int64_t n = rows * cols;
      const auto dh = Randn(n, 4.0f), g = Randn(n, 2.0f), u = Randn(n);
      DevRun r(dut_.get());
      Backend* b = r.b();
      auto packed = [&](const std::vector<float>& x) {
        uint16_t* p = r.Out<uint16_t>(n);
        b->PackBf16(r.In(x), p, n);
        return p;
      };
      const uint16_t *dh16 = packed(dh), *g16 = packed(g), *u16 = packed(u);
      const float* sg = r.In(std::vector<float>{24.0f});
      const float* su = r.In(std::vector<float>{6.0f});
      Outputs fused, unfused;
      {
        uint8_t* c[4];
        for (auto& p : c) p = r.Out<uint8_t>(n);
        float* amax = r.In(std::vector<float>{0.0f, 0.0f});
        b->SwigluBackwardCastTransposeFp8(dh16, g16, u16, rows, cols, sg, su, fmt, c[0], c[1], c[2],
                                          c[3], amax, amax + 1, cols, cols);
        for (uint8_t* p : c) r.Bytes(&fused, "codes", p, n);
        r.Bytes(&fused, "amax", amax, 2);
      }
      {
        uint16_t* dg16 = r.Out<uint16_t>(n);
        uint16_t* du16 = r.Out<uint16_t>(n);
        b->SwigluBackwardBf16To16(dh16, g16, u16, n, dg16, du16);
        uint8_t* c[4];
        for (auto& p : c) p = r.Out<uint8_t>(n);
        float* amax = r.In(std::vector<float>{0.0f, 0.0f});
        b->CastTransposeFp8Bf16(dg16, rows, cols, sg, fmt, c[0], c[1], amax, cols);
        b->CastTransposeFp8Bf16(du16, rows, cols, su, fmt, c[2], c[3], amax + 1, cols);
        for (uint8_t* p : c) r.Bytes(&unfused, "codes", p, n);
        r.Bytes(&unfused, "amax", amax, 2);
      }
      const char* names[] = {"dgate8", "dgate8_t", "dup8", "dup8_t", "amax"};
      for (size_t k = 0; k < fused.size(); ++k) {
        size_t diff = 0;
        EXPECT_TRUE(SameBits(fused[k], unfused[k], &diff))
            << FmtName(fmt) << " " << rows << "x" << cols << " " << names[k] << " on " << GetParam()
            << ": fused differs from unfused at byte " << diff;
      }
    }
  }
}

// Likewise RoPE's backward fused with the cast-transpose of its result, against RopeBackwardBf16
// followed by CastTransposeFp8Bf16 on the same backend.
TEST_P(Conformance, RopeBackwardCastTransposeIsItsComposition) {
  const int64_t B = 2, T = 160, H = 3, D = 64, n = B * T * H * D;
  const auto dx = Randn(n, 3.0f);
  for (Fp8Format fmt : kFormats) {
    DevRun r(dut_.get());
    Backend* b = r.b();
    uint16_t* x16 = r.Out<uint16_t>(n);
    b->PackBf16(r.In(dx), x16, n);
    const float* scale = r.In(std::vector<float>{16.0f});
    Outputs fused, unfused;
    uint8_t* out = r.Out<uint8_t>(n);
    uint8_t* out_t = r.Out<uint8_t>(n);
    float* amax = r.In(std::vector<float>{0.0f});
    b->RopeBackwardCastTransposeFp8Bf16(x16, B, T, H, D, 10000.0f, scale, fmt, out, out_t, amax,
                                        H * D);
    r.Bytes(&fused, "out", out, n);
    r.Bytes(&fused, "out_t", out_t, n);
    r.Bytes(&fused, "amax", amax, 1);
    b->RopeBackwardBf16(x16, B, T, H, D, 10000.0f);
    uint8_t* out2 = r.Out<uint8_t>(n);
    uint8_t* out2_t = r.Out<uint8_t>(n);
    float* amax2 = r.In(std::vector<float>{0.0f});
    b->CastTransposeFp8Bf16(x16, B * T, H * D, scale, fmt, out2, out2_t, amax2, H * D);
    r.Bytes(&unfused, "out", out2, n);
    r.Bytes(&unfused, "out_t", out2_t, n);
    r.Bytes(&unfused, "amax", amax2, 1);
    for (size_t k = 0; k < fused.size(); ++k) {
      size_t diff = 0;
      EXPECT_TRUE(SameBits(fused[k], unfused[k], &diff))
          << FmtName(fmt) << " " << fused[k].name << " on " << GetParam()
          << ": fused differs from unfused at byte " << diff;
    }
  }
}

TEST_P(Conformance, MemoryAccounting) {
  const int64_t before = dut_->AllocatedBytes();
  void* p = dut_->Alloc(1 << 20);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(dut_->AllocatedBytes(), before + (1 << 20));
  EXPECT_GE(dut_->PeakAllocatedBytes(), before + (1 << 20));
  std::vector<uint8_t> h(1 << 20), back(1 << 20);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint8_t>(i * 131);
  void* q = dut_->Alloc(1 << 20);
  dut_->CopyToDevice(p, h.data(), h.size());
  dut_->Copy(q, p, h.size());
  dut_->CopyToHost(back.data(), q, back.size());
  EXPECT_EQ(h, back);
  dut_->Free(p);
  dut_->Free(q);
  EXPECT_EQ(dut_->AllocatedBytes(), before);
}

// ---- cuDNN BF16 attention against the CPU f32 reference -------------------------------------
#if defined(FSDP8_WITH_CUDNN)
uint16_t ToBf16(float f) {  // round to nearest even; inputs here are finite
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::vector<float> F32Of(const std::vector<uint16_t>& h) {
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = FromBf16(h[i]);
  return f;
}
std::vector<uint16_t> Bf16Of(const std::vector<float>& f) {
  std::vector<uint16_t> h(f.size());
  for (size_t i = 0; i < f.size(); ++i) h[i] = ToBf16(f[i]);
  return h;
}
// Normwise relative error (as MaxRelErr) of got against ref; NaN anywhere gives infinity.
double NormRel(const std::vector<float>& got, const std::vector<float>& ref) {
  double maxref = 0, maxdiff = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    maxref = std::max(maxref, std::fabs(static_cast<double>(ref[i])));
    maxdiff = std::max(maxdiff, std::fabs(static_cast<double>(got[i]) - ref[i]));
  }
  return maxdiff == 0 ? 0.0 : (maxref > 0 ? maxdiff / maxref : INFINITY);
}
#endif

TEST(CudnnAttention_cuda, Bf16ForwardBackwardMatchesCpu) {
#if !defined(FSDP8_WITH_CUDNN)
  GTEST_SKIP() << "built without the cuDNN frontend (FSDP8_CUDNN_FRONTEND_INCLUDE)";
#else
  std::string err;
  const char* devs = std::getenv("FSDP8_CONFORMANCE_DEVICE");
  const int dev = devs != nullptr ? std::atoi(devs) : 0;
  std::unique_ptr<Backend> cuda_be = CreateBackend("cuda", dev, &err);
  if (cuda_be == nullptr) GTEST_SKIP() << "backend 'cuda' unavailable: " << err;
  std::unique_ptr<Backend> cpu = CreateBackend("cpu", 0, &err);
  ASSERT_NE(cpu, nullptr) << err;
  auto* cb = dynamic_cast<CudaBackend*>(cuda_be.get());
  ASSERT_NE(cb, nullptr);
  std::printf("cuDNN runtime %s (compiled against %lld)\n", cuda::CudnnAttention::RuntimeVersionString().c_str(),
              static_cast<long long>(cuda::CudnnAttention::CompiledVersion()));
  cuda::CudnnAttention att(dev);
  const double ub = 1.0 / 256;
  struct S { int64_t B, T, H, Hkv, D; };
  // Deterministic backward (the default), then the non-deterministic one (TrainingSpec.deterministic
  // false): same tolerances; only the deterministic one must repeat its bits.
  for (const bool det : {true, false})
  for (const S& s : {S{1, 17, 1, 1, 64}, S{2, 128, 4, 4, 64}, S{2, 200, 4, 2, 128}, S{1, 512, 2, 2, 128},
                     S{2, 256, 4, 1, 128}}) {
    att.set_deterministic_backward(det);
    const int64_t nq = s.B * s.T * s.H * s.D, nk = s.B * s.T * s.Hkv * s.D, ns = s.B * s.H * s.T;
    const std::string shape = std::to_string(s.B) + "x" + std::to_string(s.T) + "x" + std::to_string(s.H) + "/" +
                              std::to_string(s.Hkv) + "x" + std::to_string(s.D) + (det ? "" : "/nondeterministic");
    const auto qh = Bf16Of(Randn(nq)), kh = Bf16Of(Randn(nk)), vh = Bf16Of(Randn(nk)), doh = Bf16Of(Randn(nq));
    const auto q = F32Of(qh), k = F32Of(kh), v = F32Of(vh), dout = F32Of(doh);

    // CPU reference in f32 on the rounded inputs.
    std::vector<float> ref_out(nq), ref_lse(ns), ref_dq(nq), ref_dk(nk), ref_dv(nk);
    {
      DevRun r(cpu.get());
      float* out = r.Out<float>(nq);
      float* lse = r.Out<float>(ns);
      const float *qd = r.In(q), *kd = r.In(k), *vd = r.In(v);
      cpu->AttentionForward(qd, kd, vd, s.B, s.T, s.H, s.Hkv, s.D, out, lse);
      float* dq = r.Out<float>(nq);
      float* dk = r.Out<float>(nk);
      float* dv = r.Out<float>(nk);
      cpu->AttentionBackward(qd, kd, vd, out, r.In(dout), lse, s.B, s.T, s.H, s.Hkv, s.D, dq, dk, dv);
      cpu->CopyToHost(ref_out.data(), out, nq * 4);
      cpu->CopyToHost(ref_lse.data(), lse, ns * 4);
      cpu->CopyToHost(ref_dq.data(), dq, nq * 4);
      cpu->CopyToHost(ref_dk.data(), dk, nk * 4);
      cpu->CopyToHost(ref_dv.data(), dv, nk * 4);
    }

    // cuDNN, twice (the second run's bits must equal the first's; the backward's only when det).
    std::vector<uint16_t> o_h[2], dq_h[2], dk_h[2], dv_h[2];
    std::vector<float> lse_h[2];
    bool ok = true;
    for (int rep = 0; rep < 2 && ok; ++rep) {
      DevRun r(cuda_be.get());
      const uint16_t *qd = r.In(qh), *kd = r.In(kh), *vd = r.In(vh), *dod = r.In(doh);
      uint16_t* o = r.Out<uint16_t>(nq);
      float* lse = r.Out<float>(ns);
      uint16_t* dq = r.Out<uint16_t>(nq);
      uint16_t* dk = r.Out<uint16_t>(nk);
      uint16_t* dv = r.Out<uint16_t>(nk);
      ok = att.Forward(qd, kd, vd, o, lse, s.B, s.T, s.H, s.Hkv, s.D, cb->stream(), &err) &&
           att.Backward(qd, kd, vd, o, dod, lse, dq, dk, dv, s.B, s.T, s.H, s.Hkv, s.D, cb->stream(), &err);
      EXPECT_TRUE(ok) << shape << ": " << err;
      if (!ok) break;
      o_h[rep].resize(nq);
      dq_h[rep].resize(nq);
      dk_h[rep].resize(nk);
      dv_h[rep].resize(nk);
      lse_h[rep].resize(ns);
      cuda_be->CopyToHost(o_h[rep].data(), o, nq * 2);
      cuda_be->CopyToHost(lse_h[rep].data(), lse, ns * 4);
      cuda_be->CopyToHost(dq_h[rep].data(), dq, nq * 2);
      cuda_be->CopyToHost(dk_h[rep].data(), dk, nk * 2);
      cuda_be->CopyToHost(dv_h[rep].data(), dv, nk * 2);
    }
    if (!ok) continue;
    EXPECT_TRUE(o_h[0] == o_h[1] && lse_h[0] == lse_h[1]) << shape << ": cuDNN forward is not deterministic";
    if (det) {
      EXPECT_TRUE(dq_h[0] == dq_h[1] && dk_h[0] == dk_h[1] && dv_h[0] == dv_h[1])
          << shape << ": cuDNN backward is not deterministic";
    }
    const double e_out = NormRel(F32Of(o_h[0]), ref_out), e_lse = NormRel(lse_h[0], ref_lse);
    const double e_dq = NormRel(F32Of(dq_h[0]), ref_dq), e_dk = NormRel(F32Of(dk_h[0]), ref_dk),
                 e_dv = NormRel(F32Of(dv_h[0]), ref_dv);
    const double tol_out = 4 * ub, tol_lse = 64 * kU * static_cast<double>(s.T + s.D), tol_bwd = 8 * ub;
    EXPECT_LE(e_out, tol_out) << shape << " out";
    EXPECT_LE(e_lse, tol_lse) << shape << " lse";
    EXPECT_LE(e_dq, tol_bwd) << shape << " dq";
    EXPECT_LE(e_dk, tol_bwd) << shape << " dk";
    EXPECT_LE(e_dv, tol_bwd) << shape << " dv";
    std::printf("op CudnnAttentionForward/%s backend cuda max_rel_err %.3g (out %.3g lse %.3g)\n", shape.c_str(),
                std::max(e_out, e_lse), e_out, e_lse);
    std::printf("op CudnnAttentionBackward/%s backend cuda max_rel_err %.3g (dq %.3g dk %.3g dv %.3g)\n",
                shape.c_str(), std::max(e_dq, std::max(e_dk, e_dv)), e_dq, e_dk, e_dv);
  }
#endif
}

// The "cpu" instance compares the CPU backend with a second CPU backend: it checks determinism,
// poisoned-output coverage and the harness itself, not accuracy (the CPU kernels are checked against
// independent references in tests/kernels). The "cuda" instance is the conformance check proper.
INSTANTIATE_TEST_SUITE_P(Backends, Conformance, ::testing::Values(std::string("cpu"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace fsdp8
