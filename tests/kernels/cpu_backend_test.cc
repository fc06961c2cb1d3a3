// Tests of the CPU reference backend against naive double-precision references written here,
// central finite differences (in double, of the double references) for gradients, and hand
// computations. Nothing expected is computed by the code under test.
//
// Tolerances. u = 2^-24 is the f32 unit roundoff. A length-K f32 dot product has error at most
// about K*u*sum|a_k b_k| (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1); blocked
// BLAS accumulation is far better in practice, and we allow that worst case times a small factor.
// Elementwise ops with a few f32 roundings (exp, sqrt, products) are checked to ~1e-6 relative.
// Finite differences in double with step h have truncation error O(h^2) and cancellation error
// O(eps_double/h), ~1e-9 at h = 1e-5, so their comparisons are limited by the f32 kernel (~1e-5).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/backend.h"
#include "tests/kernels/fp8_reference.h"

namespace fsdp8 {
namespace {

using testing::RefBf16;
using testing::RefDecode;
using testing::RefEncode;
using testing::RefIsFinite;

constexpr double kU = 1.0 / (1 << 24);  // f32 unit roundoff

std::vector<float> RandomVec(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Device buffer mirrored by a host vector.
template <typename T>
class Buf {
 public:
  Buf(Backend* be, const std::vector<T>& host) : be_(be), n_(host.size()) {
    p_ = static_cast<T*>(be_->Alloc(sizeof(T) * std::max<size_t>(n_, 1)));
    if (n_ > 0) be_->CopyToDevice(p_, host.data(), sizeof(T) * n_);
  }
  Buf(Backend* be, std::initializer_list<T> host) : Buf(be, std::vector<T>(host)) {}
  Buf(Backend* be, size_t n, T fill = T()) : Buf(be, std::vector<T>(n, fill)) {}
  ~Buf() { be_->Free(p_); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  T* get() { return p_; }
  std::vector<T> Host() {
    std::vector<T> h(n_);
    be_->Synchronize();
    if (n_ > 0) be_->CopyToHost(h.data(), p_, sizeof(T) * n_);
    return h;
  }

 private:
  Backend* be_;
  size_t n_;
  T* p_;
};

// Every case runs on both CPU backends: the fast one ("cpu") and the reference ("cpu-ref").
class CpuBackendBase : public ::testing::Test {
 protected:
  void Make(const std::string& name) {
    std::string error;
    be_ = CreateBackend(name, 0, &error);
    ASSERT_NE(be_, nullptr) << error;
  }
  std::unique_ptr<Backend> be_;
};
class CpuBackendTest : public CpuBackendBase, public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override { Make(GetParam()); }
};
std::string BackendCaseName(const std::string& name) {
  return name == "cpu" ? std::string("fast") : std::string("ref");
}

// ---- factory and memory ----------------------------------------------------------------------

TEST(CreateBackend, CpuAndUnavailable) {
  std::string error;
  auto cpu = CreateBackend("cpu", 0, &error);
  ASSERT_NE(cpu, nullptr);
  EXPECT_TRUE(cpu->Name() == "cpu" || cpu->Name() == "cpu-ref") << cpu->Name();
  auto ref = CreateBackend("cpu-ref", 0, &error);
  ASSERT_NE(ref, nullptr);
  EXPECT_EQ(ref->Name(), "cpu-ref");
  error.clear();
  EXPECT_EQ(CreateBackend("tpu", 0, &error), nullptr);
  EXPECT_NE(error.find("tpu"), std::string::npos);
#ifndef FSDP8_WITH_CUDA
  error.clear();
  EXPECT_EQ(CreateBackend("cuda", 0, &error), nullptr);
  EXPECT_NE(error.find("-DFSDP8_CUDA=ON"), std::string::npos) << error;
#endif
}

TEST_P(CpuBackendTest, AllocationAccounting) {
  EXPECT_EQ(be_->AllocatedBytes(), 0);
  void* a = be_->Alloc(1000);
  void* b = be_->Alloc(24);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(be_->AllocatedBytes(), 1024);
  EXPECT_EQ(be_->PeakAllocatedBytes(), 1024);
  be_->Free(a);
  EXPECT_EQ(be_->AllocatedBytes(), 24);
  EXPECT_EQ(be_->PeakAllocatedBytes(), 1024);
  be_->ResetPeak();
  EXPECT_EQ(be_->PeakAllocatedBytes(), 24);
  void* c = be_->Alloc(100);
  EXPECT_EQ(be_->PeakAllocatedBytes(), 124);
  be_->Free(b);
  be_->Free(c);
  be_->Free(nullptr);
  EXPECT_EQ(be_->AllocatedBytes(), 0);
}

TEST_P(CpuBackendTest, CopyAndMemset) {
  std::vector<float> h = RandomVec(100, 1);
  Buf<float> a(be_.get(), h), b(be_.get(), 100);
  be_->Copy(b.get(), a.get(), sizeof(float) * 100);
  EXPECT_EQ(b.Host(), h);
  be_->Memset(b.get(), 0, sizeof(float) * 50);
  auto got = b.Host();
  for (int i = 0; i < 100; ++i) EXPECT_EQ(got[i], i < 50 ? 0.0f : h[i]);
}

// ---- GEMM -------------------------------------------------------------------------------------

// Naive C (M, N) = op(A) op(B) in double; A, B given in their stored layouts.
std::vector<double> NaiveGemm(bool ta, bool tb, int M, int N, int K, const std::vector<double>& A,
                              const std::vector<double>& B, std::vector<double>* abs_sum) {
  std::vector<double> C(M * N, 0.0);
  abs_sum->assign(M * N, 0.0);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double s = 0, sa = 0;
      for (int k = 0; k < K; ++k) {
        const double a = ta ? A[k * M + i] : A[i * K + k];
        const double b = tb ? B[j * K + k] : B[k * N + j];
        s += a * b;
        sa += std::fabs(a * b);
      }
      C[i * N + j] = s;
      (*abs_sum)[i * N + j] = sa;
    }
  return C;
}

// Groups {0, 1}, {2, 3} (with a NaN), {4}, {5, 6} interleaved as group ids 0 0 2 2 4 5 5, and a
// member listed apart from its group (index 7 in group 0).
TEST_P(CpuBackendTest, GroupMaxHandValues) {
  const float nan = std::nanf("");
  const std::vector<float> in = {1.0f, 5.0f, 2.0f, nan, 3.0f, 0.5f, 0.25f, 7.0f};
  const std::vector<int32_t> group = {0, 0, 2, 2, 4, 5, 5, 0};
  std::vector<float> out(in.size(), -1.0f);
  be_->GroupMax(in.data(), group.data(), static_cast<int64_t>(in.size()), out.data());
  EXPECT_EQ(out[0], 7.0f);
  EXPECT_EQ(out[1], 7.0f);
  EXPECT_TRUE(std::isnan(out[2]));
  EXPECT_TRUE(std::isnan(out[3]));
  EXPECT_EQ(out[4], 3.0f);
  EXPECT_EQ(out[5], 0.5f);
  EXPECT_EQ(out[6], 0.5f);
  EXPECT_EQ(out[7], 7.0f);
}

// Current-scaling weight scales (scale = fp8_max / amax / 2^margin; unusable amax keeps the
// previous scale, an unusable previous scale falls back to 1), hand-computed, in slots of 4.
TEST_P(CpuBackendTest, Fp8ScalesFromAmaxHandValues) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  const std::vector<float> amax = {2.0f, 0.0f, nan, inf, -1.0f, 0.0f, 1e-38f, 448.0f};
  const std::vector<float> prev = {5.0f, 3.5f, 3.5f, 3.5f, 3.5f, inf, 7.0f, 9.0f};
  // margin 0, then 1 (halves every scale computed from an amax, not the kept ones).
  const float want0[] = {224.0f, 3.5f, 3.5f, 3.5f, 3.5f, 1.0f, FLT_MAX, 1.0f};
  const float want1[] = {112.0f, 3.5f, 3.5f, 3.5f, 3.5f, 1.0f, FLT_MAX, 0.5f};
  for (int margin : {0, 1}) {
    const int64_t n = static_cast<int64_t>(amax.size()), stride = 4;
    std::vector<float> slots(n * stride, -9.0f), inv(n * stride, -9.0f);
    for (int64_t i = 0; i < n; ++i) slots[i * stride] = prev[i];
    be_->Fp8ScalesFromAmax(amax.data(), n, 448.0f, margin, slots.data(), inv.data(), stride);
    for (int64_t i = 0; i < n; ++i) {
      const float want = (margin == 0 ? want0 : want1)[i];
      EXPECT_EQ(slots[i * stride], want) << "tensor " << i << " margin " << margin;
      EXPECT_EQ(inv[i * stride], 1.0f / want) << "tensor " << i << " margin " << margin;
      for (int64_t k = 1; k < stride; ++k) {
        EXPECT_EQ(slots[i * stride + k], -9.0f);  // only the slot's first float is written
        EXPECT_EQ(inv[i * stride + k], -9.0f);
      }
    }
  }
}

TEST_P(CpuBackendTest, GemmAllTransposeCombinationsF32) {
  const int M = 37, N = 29, K = 53;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      for (int acc = 0; acc < 2; ++acc) {
        auto A = RandomVec(M * K, 10 + ta), B = RandomVec(K * N, 20 + tb);
        auto C0 = RandomVec(M * N, 30);
        Buf<float> a(be_.get(), A), b(be_.get(), B), c(be_.get(), C0);
        be_->Gemm(ta, tb, M, N, K, a.get(), b.get(), c.get(), acc, GemmInputs::kF32);
        std::vector<double> abs_sum;
        auto want = NaiveGemm(ta, tb, M, N, K, ToDouble(A), ToDouble(B), &abs_sum);
        auto got = c.Host();
        for (int i = 0; i < M * N; ++i) {
          const double w = want[i] + (acc ? C0[i] : 0.0);
          // K*u*sum|ab| (+ one rounding of the add to C) -- see the header comment.
          const double tol = 2 * K * kU * (abs_sum[i] + std::fabs(w)) + 1e-30;
          ASSERT_NEAR(got[i], w, tol)
              << "ta=" << ta << " tb=" << tb << " acc=" << acc << " i=" << i;
        }
      }
    }
  }
}

TEST_P(CpuBackendTest, GemmBf16RoundsInputs) {
  const int M = 16, N = 24, K = 64;
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      auto A = RandomVec(M * K, 40), B = RandomVec(K * N, 41);
      Buf<float> a(be_.get(), A), b(be_.get(), B), c(be_.get(), M * N);
      be_->Gemm(ta, tb, M, N, K, a.get(), b.get(), c.get(), false, GemmInputs::kBF16);
      std::vector<double> Ar(A.size()), Br(B.size()), abs_sum, abs_sum2;
      for (size_t i = 0; i < A.size(); ++i) Ar[i] = RefBf16(A[i]);
      for (size_t i = 0; i < B.size(); ++i) Br[i] = RefBf16(B[i]);
      auto want = NaiveGemm(ta, tb, M, N, K, Ar, Br, &abs_sum);
      auto unrounded = NaiveGemm(ta, tb, M, N, K, ToDouble(A), ToDouble(B), &abs_sum2);
      auto got = c.Host();
      int differs = 0;
      for (int i = 0; i < M * N; ++i) {
        const double tol = 2 * K * kU * abs_sum[i];  // products of bf16 values are exact in f32
        ASSERT_NEAR(got[i], want[i], tol) << i;
        differs += std::fabs(unrounded[i] - want[i]) > 10 * tol;
      }
      EXPECT_GT(differs, M * N / 2);  // the test can tell rounded from unrounded inputs
      // Inputs are left untouched.
      EXPECT_EQ(a.Host(), A);
    }
  }
}

std::vector<uint8_t> RandomFiniteCodes(size_t n, Fp8Format fmt, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, 255);
  std::vector<uint8_t> v(n);
  for (auto& c : v) {
    do c = static_cast<uint8_t>(d(rng));
    while (!RefIsFinite(c, fmt));
  }
  return v;
}

TEST_P(CpuBackendTest, GemmFp8MatchesDecodedDoubleReference) {
  const int M = 33, N = 19, K = 70;
  const Fp8Format fmts[][2] = {{Fp8Format::kE4M3, Fp8Format::kE4M3},
                               {Fp8Format::kE4M3, Fp8Format::kE5M2},
                               {Fp8Format::kE5M2, Fp8Format::kE4M3}};
  for (auto& f : fmts) {
    for (int acc = 0; acc < 2; ++acc) {
      auto A = RandomFiniteCodes(M * K, f[0], 50), B = RandomFiniteCodes(N * K, f[1], 51);
      const float sa = 0.3f, sb = 1.7f;
      auto C0 = RandomVec(M * N, 52, -1000, 1000);
      Buf<uint8_t> a(be_.get(), A), b(be_.get(), B);
      Buf<float> c(be_.get(), C0), sai(be_.get(), {sa}), sbi(be_.get(), {sb});
      be_->GemmFp8(false, true, M, N, K, {a.get(), f[0], sai.get()}, {b.get(), f[1], sbi.get()},
                   c.get(), acc);
      std::vector<double> Ad(A.size()), Bd(B.size()), abs_sum;
      for (size_t i = 0; i < A.size(); ++i) Ad[i] = RefDecode(A[i], f[0]);
      for (size_t i = 0; i < B.size(); ++i) Bd[i] = RefDecode(B[i], f[1]);
      auto want = NaiveGemm(false, true, M, N, K, Ad, Bd, &abs_sum);
      auto got = c.Host();
      const double alpha = static_cast<double>(sa) * sb;
      for (int i = 0; i < M * N; ++i) {
        const double w = alpha * want[i] + (acc ? C0[i] : 0.0);
        const double tol = 3 * K * kU * (alpha * abs_sum[i] + std::fabs(w));
        ASSERT_NEAR(got[i], w, tol) << i;
      }
    }
  }
}

// ---- FP8 casts --------------------------------------------------------------------------------

TEST_P(CpuBackendTest, C02_CastToFp8RoundsAndSaturatesLikeTheReference) {
  for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    auto x = RandomVec(5000, 60, -3, 3);
    x[0] = 1e9f;
    x[1] = -std::numeric_limits<float>::infinity();
    x[2] = 0.0f;
    x[3] = 1e-12f;
    const float scale = fmt == Fp8Format::kE4M3 ? 150.0f : 20000.0f;  // pushes some past max
    Buf<float> in(be_.get(), x), s(be_.get(), {scale}), amax(be_.get(), {0.0f});
    Buf<uint8_t> out(be_.get(), x.size());
    be_->CastFp8(in.get(), 1, x.size(), s.get(), fmt, out.get(), nullptr, amax.get());
    auto got = out.Host();
    int saturated = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const float scaled = x[i] * scale;  // the f32 product, as the contract says
      ASSERT_EQ(got[i], RefEncode(scaled, fmt)) << i << " " << scaled;
      ASSERT_TRUE(std::isfinite(RefDecode(got[i], fmt)));
      saturated += std::fabs(RefDecode(got[i], fmt)) == (fmt == Fp8Format::kE4M3 ? 448 : 57344);
    }
    EXPECT_GT(saturated, 10);
    EXPECT_EQ(amax.Host()[0], std::numeric_limits<float>::infinity());  // |-inf| is the amax
  }
}

// Every f32 exponent/top-mantissa pattern (the top 16 bits) with several low-half patterns, both
// signs, through CastToFp8 with scale 1, against the nearest-value search.
TEST_P(CpuBackendTest, C02_CastToFp8SweepOfAllTopBitPatterns) {
  const uint32_t lows[] = {0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF};
  std::vector<float> x;
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : lows) {
      const uint32_t bits = (hi << 16) | lo;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      x.push_back(f);
    }
  for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    Buf<float> in(be_.get(), x), s(be_.get(), {1.0f});
    Buf<uint8_t> out(be_.get(), x.size());
    be_->CastFp8(in.get(), 1, x.size(), s.get(), fmt, out.get(), nullptr, nullptr);
    auto got = out.Host();
    for (size_t i = 0; i < x.size(); ++i) {
      if (std::isnan(x[i])) {
        ASSERT_TRUE(std::isnan(RefDecode(got[i], fmt))) << i;
      } else {
        ASSERT_EQ(got[i], RefEncode(x[i], fmt)) << "x=" << x[i] << " i=" << i;
      }
    }
  }
}

TEST_P(CpuBackendTest, C03_AmaxAccumulatesMaxAcrossCalls) {
  // Four microbatches; the largest magnitude is in the second (negative, to catch a signed max).
  std::vector<std::vector<float>> mb = {{0.5f, -1.0f}, {2.0f, -7.5f}, {3.0f, 1.0f}, {0.1f, 0.2f}};
  Buf<float> s(be_.get(), {1.0f}), amax(be_.get(), {0.0f}), amax2(be_.get(), {0.0f});
  Buf<uint8_t> out(be_.get(), 2), out_t(be_.get(), 2);
  for (auto& v : mb) {
    Buf<float> in(be_.get(), v);
    be_->CastFp8(in.get(), 1, 2, s.get(), Fp8Format::kE4M3, out.get(), nullptr, amax.get());
    be_->CastFp8(in.get(), 1, 2, s.get(), Fp8Format::kE5M2, nullptr, out_t.get(), amax2.get());
  }
  EXPECT_EQ(amax.Host()[0], 7.5f);
  EXPECT_EQ(amax2.Host()[0], 7.5f);
  Buf<float> amax3(be_.get(), {0.0f});
  for (auto& v : mb) {
    Buf<float> in(be_.get(), v);
    be_->AmaxAccumulate(in.get(), 2, amax3.get());
  }
  be_->AmaxAccumulate(nullptr, 0, amax3.get());  // empty shard is neutral
  EXPECT_EQ(amax3.Host()[0], 7.5f);
}

TEST_P(CpuBackendTest, C01_AmaxSurfacesNonFiniteAndCastNeverProducesInf) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  Buf<float> s(be_.get(), {1.0f});
  {
    Buf<float> in(be_.get(), {1.0f, nan, 2.0f}), amax(be_.get(), {5.0f});
    Buf<uint8_t> out(be_.get(), 3);
    be_->CastFp8(in.get(), 1, 3, s.get(), Fp8Format::kE5M2, out.get(), nullptr, amax.get());
    EXPECT_TRUE(
        std::isnan(amax.Host()[0]));  // NaN reaches the scaling logic, which keeps the old scale
    EXPECT_TRUE(std::isnan(RefDecode(out.Host()[1], Fp8Format::kE5M2)));
    Buf<float> amax2(be_.get(), {nan});
    be_->AmaxAccumulate(in.get(), 1, amax2.get());
    EXPECT_TRUE(std::isnan(amax2.Host()[0]));  // an earlier NaN is not forgotten
  }
  {
    Buf<float> in(be_.get(), {inf, -inf, 3.0f}), amax(be_.get(), {0.0f});
    Buf<uint8_t> out(be_.get(), 3), out_t(be_.get(), 3);
    be_->CastFp8(in.get(), 3, 1, s.get(), Fp8Format::kE5M2, out.get(), out_t.get(), amax.get());
    EXPECT_EQ(amax.Host()[0], inf);
    auto o = out.Host();
    EXPECT_EQ(RefDecode(o[0], Fp8Format::kE5M2), 57344.0);
    EXPECT_EQ(RefDecode(o[1], Fp8Format::kE5M2), -57344.0);
  }
}

TEST_P(CpuBackendTest, CastTransposeEqualsTransposeOfCast) {
  // Shapes with partial tiles in one or both dimensions, and a power-of-two one.
  const std::pair<int, int> shapes[] = {{37, 70}, {130, 200}, {256, 128}, {1, 5}};
  for (auto [rows, cols] : shapes)
    for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      SCOPED_TRACE(::testing::Message() << rows << "x" << cols);
      auto x = RandomVec(rows * cols, 70, -10, 10);
      x[(rows / 2) * cols + cols - 1] = -12.25f;  // the amax
      Buf<float> in(be_.get(), x), s(be_.get(), {30.0f}), amax_a(be_.get(), {0.0f}),
          amax_b(be_.get(), {0.0f});
      Buf<uint8_t> plain(be_.get(), rows * cols), out(be_.get(), rows * cols),
          out_t(be_.get(), rows * cols), out_t_only(be_.get(), rows * cols);
      be_->CastFp8(in.get(), 1, rows * cols, s.get(), fmt, plain.get(), nullptr, amax_a.get());
      be_->CastFp8(in.get(), rows, cols, s.get(), fmt, out.get(), out_t.get(), amax_b.get());
      be_->CastFp8(in.get(), rows, cols, s.get(), fmt, nullptr, out_t_only.get(), nullptr);
      auto p = plain.Host(), o = out.Host(), t = out_t.Host(), t2 = out_t_only.Host();
      EXPECT_EQ(o, p);
      EXPECT_EQ(t2, t);
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) ASSERT_EQ(t[c * rows + r], p[r * cols + c]) << r << "," << c;
      EXPECT_EQ(amax_a.Host()[0], 12.25f);
      EXPECT_EQ(amax_b.Host()[0], 12.25f);
      // TransposeBytes of the transposed codes gives back the original layout.
      Buf<uint8_t> back(be_.get(), rows * cols);
      be_->TransposeBytes(out_t.get(), cols, rows, back.get());
      EXPECT_EQ(back.Host(), p);
    }
}

TEST_P(CpuBackendTest, DequantizeFp8) {
  for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    auto codes = RandomFiniteCodes(1000, fmt, 80);
    Buf<uint8_t> in(be_.get(), codes);
    Buf<float> out(be_.get(), codes.size()), si(be_.get(), {0.25f});
    be_->DequantizeFp8(in.get(), out.get(), codes.size(), si.get(), fmt);
    auto got = out.Host();
    for (size_t i = 0; i < codes.size(); ++i)
      ASSERT_EQ(got[i], static_cast<float>(RefDecode(codes[i], fmt) * 0.25)) << i;  // exact
  }
}

// Every code of both formats, specials included (NaN codes decode to NaN, E5M2 infinities to inf),
// with scale 1: the decoded value itself, against the independent decoder.
TEST_P(CpuBackendTest, DequantizeFp8EveryCode) {
  for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    std::vector<uint8_t> codes(256 * 3);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 7 % 256);
    Buf<uint8_t> in(be_.get(), codes);
    Buf<float> out(be_.get(), codes.size()), si(be_.get(), {1.0f});
    be_->DequantizeFp8(in.get(), out.get(), codes.size(), si.get(), fmt);
    auto got = out.Host();
    for (size_t i = 0; i < codes.size(); ++i) {
      const double want = RefDecode(codes[i], fmt);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got[i])) << "code " << int(codes[i]);
      } else {
        ASSERT_EQ(got[i], static_cast<float>(want)) << "code " << int(codes[i]);
        ASSERT_EQ(std::signbit(got[i]), std::signbit(want)) << "code " << int(codes[i]);
      }
    }
  }
}

TEST_P(CpuBackendTest, RoundToBf16AddAxpy) {
  auto x = RandomVec(1000, 90, -100, 100), y = RandomVec(1000, 91);
  Buf<float> a(be_.get(), x), b(be_.get(), y), o(be_.get(), x.size());
  be_->Add(a.get(), b.get(), o.get(), x.size());
  auto sum = o.Host();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(sum[i], x[i] + y[i]);
  be_->Axpy(0.5f, a.get(), b.get(), x.size());
  auto ax = b.Host();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(ax[i], y[i] + 0.5 * x[i], 2 * kU * 100);
  be_->RoundToBf16(a.get(), x.size());
  auto r = a.Host();
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(r[i], RefBf16(x[i]));
}

TEST_P(CpuBackendTest, PackUnpackBf16) {
  auto x = RandomVec(1000, 92, -1e3, 1e3);
  x[0] = std::numeric_limits<float>::quiet_NaN();
  x[1] = -std::numeric_limits<float>::infinity();
  x[2] = 1.0f + std::ldexp(1.0f, -8);  // tie -> 1.0 (0x3F80)
  x[3] = -0.0f;
  Buf<float> in(be_.get(), x), back(be_.get(), x.size());
  Buf<uint16_t> packed(be_.get(), x.size());
  be_->PackBf16(in.get(), packed.get(), x.size());
  be_->UnpackBf16(packed.get(), back.get(), x.size());
  auto p = packed.Host();
  auto b = back.Host();
  EXPECT_EQ(p[1], 0xFF80);  // -inf
  EXPECT_EQ(p[2], 0x3F80);
  EXPECT_EQ(p[3], 0x8000);
  EXPECT_TRUE(std::isnan(b[0]));
  for (size_t i = 1; i < x.size(); ++i) {
    const float want = RefBf16(x[i]);
    ASSERT_EQ(std::memcmp(&b[i], &want, sizeof(float)), 0) << i << " " << x[i];
    uint32_t bits;
    std::memcpy(&bits, &want, sizeof(bits));
    ASSERT_EQ(p[i], bits >> 16) << i;
  }
}

// ---- embedding --------------------------------------------------------------------------------

TEST_P(CpuBackendTest, EmbeddingForwardBackward) {
  const int V = 11, C = 6, N = 40;
  std::vector<int32_t> tok(N);
  for (int i = 0; i < N; ++i) tok[i] = (i * 7) % 5;  // repeats; tokens 5..10 unused
  auto table = RandomVec(V * C, 100), dout = RandomVec(N * C, 101);
  auto dtable0 = RandomVec(V * C, 102);
  Buf<int32_t> t(be_.get(), tok);
  Buf<float> tb(be_.get(), table), out(be_.get(), N * C), d(be_.get(), dout),
      dt(be_.get(), dtable0);
  be_->EmbeddingForward(t.get(), N, tb.get(), C, out.get());
  auto o = out.Host();
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) ASSERT_EQ(o[i * C + c], table[tok[i] * C + c]);
  be_->EmbeddingBackward(t.get(), N, d.get(), C, dt.get());
  auto g = dt.Host();
  for (int v = 0; v < V; ++v)
    for (int c = 0; c < C; ++c) {
      double want = dtable0[v * C + c];
      double abs = std::fabs(want);
      for (int i = 0; i < N; ++i)
        if (tok[i] == v) want += dout[i * C + c], abs += std::fabs(dout[i * C + c]);
      ASSERT_NEAR(g[v * C + c], want, N * kU * abs) << v << "," << c;
    }
  // Deterministic: the same call from the same start gives the same bits.
  Buf<float> dt2(be_.get(), dtable0);
  be_->EmbeddingBackward(t.get(), N, d.get(), C, dt2.get());
  EXPECT_EQ(dt2.Host(), g);
}

// ---- RMSNorm ----------------------------------------------------------------------------------

// y = x / sqrt(mean(x^2) + eps) * w in double.
std::vector<double> RefRmsNorm(const std::vector<double>& x, const std::vector<double>& w,
                               double eps, int N, int C) {
  std::vector<double> y(N * C);
  for (int n = 0; n < N; ++n) {
    double ss = 0;
    for (int c = 0; c < C; ++c) ss += x[n * C + c] * x[n * C + c];
    const double r = 1.0 / std::sqrt(ss / C + eps);
    for (int c = 0; c < C; ++c) y[n * C + c] = x[n * C + c] * r * w[c];
  }
  return y;
}

double Dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central difference of f at x along coordinate i, in double (step h; see header for error).
double CentralDiff(const std::function<double(const std::vector<double>&)>& f,
                   std::vector<double> x, size_t i, double h = 1e-5) {
  const double x0 = x[i];
  x[i] = x0 + h;
  const double fp = f(x);
  x[i] = x0 - h;
  const double fm = f(x);
  return (fp - fm) / (2 * h);
}

TEST_P(CpuBackendTest, RmsNormForwardBackward) {
  const int N = 5, C = 24;
  const float eps = 1e-5f;
  auto x = RandomVec(N * C, 110, -2, 2), w = RandomVec(C, 111, 0.5, 1.5);
  auto dy = RandomVec(N * C, 112), dw0 = RandomVec(C, 113);
  Buf<float> bx(be_.get(), x), bw(be_.get(), w), by(be_.get(), N * C), rstd(be_.get(), N),
      bdy(be_.get(), dy), bdx(be_.get(), N * C), bdw(be_.get(), dw0);
  be_->RmsNormForward(bx.get(), bw.get(), eps, N, C, by.get(), rstd.get());
  const auto xd = ToDouble(x), wd = ToDouble(w), dyd = ToDouble(dy);
  auto want = RefRmsNorm(xd, wd, eps, N, C);
  auto y = by.Host();
  // C-term f32 sum of squares plus a few roundings: ~ (C + 5) u relative to |x|*w*r.
  for (int i = 0; i < N * C; ++i) ASSERT_NEAR(y[i], want[i], 1e-5 * (1 + std::fabs(want[i])));
  auto r = rstd.Host();
  for (int n = 0; n < N; ++n) {
    double ss = 0;
    for (int c = 0; c < C; ++c) ss += xd[n * C + c] * xd[n * C + c];
    EXPECT_NEAR(r[n], 1.0 / std::sqrt(ss / C + eps), 1e-5 * r[n]);
  }
  be_->RmsNormBackward(bdy.get(), bx.get(), bw.get(), rstd.get(), N, C, bdx.get(), bdw.get());
  auto dx = bdx.Host(), dw = bdw.Host();
  auto loss_x = [&](const std::vector<double>& xv) {
    return Dot(RefRmsNorm(xv, wd, eps, N, C), dyd);
  };
  auto loss_w = [&](const std::vector<double>& wv) {
    return Dot(RefRmsNorm(xd, wv, eps, N, C), dyd);
  };
  for (int i = 0; i < N * C; ++i) ASSERT_NEAR(dx[i], CentralDiff(loss_x, xd, i), 2e-5) << i;
  for (int c = 0; c < C; ++c)
    ASSERT_NEAR(dw[c], dw0[c] + CentralDiff(loss_w, wd, c), 2e-5) << c;  // accumulates
}

// ---- RoPE -------------------------------------------------------------------------------------

// Hugging Face rotate_half RoPE in double: out = x*cos + rotate_half(x)*sin with
// rotate_half(x) = cat(-x2, x1), angle(t, i) = t * theta^(-2i/D) for both halves' index i.
std::vector<double> RefRope(const std::vector<double>& x, int B, int T, int H, int D,
                            double theta) {
  std::vector<double> out(x.size());
  const int half = D / 2;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        const size_t base = ((static_cast<size_t>(b) * T + t) * H + h) * D;
        for (int d = 0; d < D; ++d) {
          const int i = d % half;  // emb = cat(freqs, freqs)
          const double ang = t * std::pow(theta, -2.0 * i / D);
          const double rot = d < half ? -x[base + d + half] : x[base + d - half];
          out[base + d] = x[base + d] * std::cos(ang) + rot * std::sin(ang);
        }
      }
  return out;
}

TEST_P(CpuBackendTest, RopeMatchesHfRotateHalfAndBackwardIsTranspose) {
  const int B = 2, T = 50, H = 3, D = 16;
  const float theta = 10000.0f;
  auto x = RandomVec(B * T * H * D, 120);
  Buf<float> bx(be_.get(), x);
  be_->RopeForward(bx.get(), B, T, H, D, theta);
  auto got = bx.Host();
  auto want = RefRope(ToDouble(x), B, T, H, D, theta);
  // The f32 angle t*inv_freq (t < 50) is off by up to ~50*u rad from the exact one; values are
  // O(1).
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5) << i;
  // Backward: dL/dx for L = <dy, rope(x)>, by finite differences of the double reference
  // (spot-check every 7th coordinate; the op is linear so the difference is exact to ~1e-10).
  auto dy = RandomVec(x.size(), 121);
  Buf<float> bdy(be_.get(), dy);
  be_->RopeBackward(bdy.get(), B, T, H, D, theta);
  auto dx = bdy.Host();
  const auto dyd = ToDouble(dy);
  auto loss = [&](const std::vector<double>& xv) {
    return Dot(RefRope(xv, B, T, H, D, theta), dyd);
  };
  const auto xd = ToDouble(x);
  for (size_t i = 0; i < x.size(); i += 7)
    ASSERT_NEAR(dx[i], CentralDiff(loss, xd, i, 1e-3), 1e-5) << i;
}

// ---- attention --------------------------------------------------------------------------------

// Naive causal attention in double; returns out (B, T, H, D) and lse (B, H, T).
std::vector<double> RefAttention(const std::vector<double>& q, const std::vector<double>& k,
                                 const std::vector<double>& v, int B, int T, int H, int Hkv, int D,
                                 std::vector<double>* lse) {
  std::vector<double> out(static_cast<size_t>(B) * T * H * D, 0.0);
  if (lse) lse->assign(static_cast<size_t>(B) * H * T, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> s(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int g = h / (H / Hkv);
      for (int i = 0; i < T; ++i) {
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          double dot = 0;
          for (int d = 0; d < D; ++d)
            dot += q[((b * T + i) * H + h) * D + d] * k[((b * T + j) * Hkv + g) * D + d];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += std::exp(s[j] - mx);
        if (lse) (*lse)[(b * H + h) * T + i] = mx + std::log(sum);
        for (int j = 0; j <= i; ++j) {
          const double p = std::exp(s[j] - mx) / sum;
          for (int d = 0; d < D; ++d)
            out[((b * T + i) * H + h) * D + d] += p * v[((b * T + j) * Hkv + g) * D + d];
        }
      }
    }
  return out;
}

// Analytic gradients of L = <dout, attention(q, k, v)> in double, the textbook softmax backward:
// dP = dO V^T, dS = P (dP - rowsum(P dP)) / sqrt(D), dQ = dS K, dK = dS^T Q, dV = P^T dO, summed
// over the query heads of each kv group. Checked against finite differences on the small shapes.
void RefAttentionBackward(const std::vector<double>& q, const std::vector<double>& k,
                          const std::vector<double>& v, const std::vector<double>& dout, int B,
                          int T, int H, int Hkv, int D, std::vector<double>* dq,
                          std::vector<double>* dk, std::vector<double>* dv) {
  dq->assign(q.size(), 0.0);
  dk->assign(k.size(), 0.0);
  dv->assign(v.size(), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> p(T), dp(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int g = h / (H / Hkv);
      auto Q = [&](int t, int d) { return q[((b * T + t) * H + h) * D + d]; };
      auto K = [&](int t, int d) { return k[((b * T + t) * Hkv + g) * D + d]; };
      auto V = [&](int t, int d) { return v[((b * T + t) * Hkv + g) * D + d]; };
      auto dO = [&](int t, int d) { return dout[((b * T + t) * H + h) * D + d]; };
      for (int i = 0; i < T; ++i) {
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          double s = 0;
          for (int d = 0; d < D; ++d) s += Q(i, d) * K(j, d);
          p[j] = s * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
        double pdp = 0;
        for (int j = 0; j <= i; ++j) {
          p[j] /= sum;
          dp[j] = 0;
          for (int d = 0; d < D; ++d) dp[j] += dO(i, d) * V(j, d);
          pdp += p[j] * dp[j];
        }
        for (int j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - pdp) * scale;
          for (int d = 0; d < D; ++d) {
            (*dq)[((b * T + i) * H + h) * D + d] += ds * K(j, d);
            (*dk)[((b * T + j) * Hkv + g) * D + d] += ds * Q(i, d);
            (*dv)[((b * T + j) * Hkv + g) * D + d] += p[j] * dO(i, d);
          }
        }
      }
    }
}

struct AttnShape {
  int B, T, H, Hkv, D;
};
void PrintTo(const AttnShape& s, std::ostream* os) {
  *os << "B=" << s.B << " T=" << s.T << " H=" << s.H << " Hkv=" << s.Hkv << " D=" << s.D;
}

class AttentionTest
    : public CpuBackendBase,
      public ::testing::WithParamInterface<std::tuple<std::string, AttnShape>> {
 protected:
  void SetUp() override { Make(std::get<0>(GetParam())); }
};

TEST_P(AttentionTest, ForwardMatchesNaiveSoftmax) {
  const AttnShape s = std::get<1>(GetParam());
  auto q = RandomVec(s.B * s.T * s.H * s.D, 130, -2, 2);
  auto k = RandomVec(s.B * s.T * s.Hkv * s.D, 131, -2, 2);
  auto v = RandomVec(s.B * s.T * s.Hkv * s.D, 132);
  Buf<float> bq(be_.get(), q), bk(be_.get(), k), bv(be_.get(), v), bo(be_.get(), q.size()),
      bl(be_.get(), s.B * s.H * s.T);
  be_->AttentionForward(bq.get(), bk.get(), bv.get(), s.B, s.T, s.H, s.Hkv, s.D, bo.get(),
                        bl.get());
  std::vector<double> lse;
  auto want = RefAttention(ToDouble(q), ToDouble(k), ToDouble(v), s.B, s.T, s.H, s.Hkv, s.D, &lse);
  auto out = bo.Host(), l = bl.Host();
  // Scores are O(D) sums of products of O(1) values; softmax and P·V add a T-term f32 sum of
  // values bounded by max|v| = 1: ~T*u plus exp's few ulps -> 2e-5 absolute is ample.
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], want[i], 2e-5) << i;
  for (size_t i = 0; i < l.size(); ++i)
    ASSERT_NEAR(l[i], lse[i], 2e-5 * (1 + std::fabs(lse[i]))) << i;
}

TEST_P(AttentionTest, BackwardMatchesAnalyticAndFiniteDifferences) {
  const AttnShape s = std::get<1>(GetParam());
  auto q = RandomVec(s.B * s.T * s.H * s.D, 140, -2, 2);
  auto k = RandomVec(s.B * s.T * s.Hkv * s.D, 141, -2, 2);
  auto v = RandomVec(s.B * s.T * s.Hkv * s.D, 142);
  auto dout = RandomVec(q.size(), 143);
  Buf<float> bq(be_.get(), q), bk(be_.get(), k), bv(be_.get(), v), bo(be_.get(), q.size()),
      bl(be_.get(), s.B * s.H * s.T), bdo(be_.get(), dout), bdq(be_.get(), q.size(), 9.0f),
      bdk(be_.get(), k.size(), 9.0f), bdv(be_.get(), v.size(), 9.0f);  // 9: must be overwritten
  be_->AttentionForward(bq.get(), bk.get(), bv.get(), s.B, s.T, s.H, s.Hkv, s.D, bo.get(),
                        bl.get());
  be_->AttentionBackward(bq.get(), bk.get(), bv.get(), bo.get(), bdo.get(), bl.get(), s.B, s.T, s.H,
                         s.Hkv, s.D, bdq.get(), bdk.get(), bdv.get());
  const auto qd = ToDouble(q), kd = ToDouble(k), vd = ToDouble(v), dod = ToDouble(dout);
  auto dq = bdq.Host(), dk = bdk.Host(), dv = bdv.Host();
  std::vector<double> rdq, rdk, rdv;
  RefAttentionBackward(qd, kd, vd, dod, s.B, s.T, s.H, s.Hkv, s.D, &rdq, &rdk, &rdv);
  // Gradients are f32 sums of up to T*H/Hkv terms of O(1) values (plus the recomputed softmax,
  // a few ulps): (T*H/Hkv) * u * O(1) * small factor -> 1e-4 absolute covers T = 256.
  for (size_t i = 0; i < q.size(); ++i) ASSERT_NEAR(dq[i], rdq[i], 1e-4) << "dq " << i;
  for (size_t i = 0; i < k.size(); ++i) ASSERT_NEAR(dk[i], rdk[i], 1e-4) << "dk " << i;
  for (size_t i = 0; i < v.size(); ++i) ASSERT_NEAR(dv[i], rdv[i], 1e-4) << "dv " << i;
  if (s.T > 80) return;  // finite differences of the double forward only on the small shapes
  auto Lq = [&](const std::vector<double>& x) {
    return Dot(RefAttention(x, kd, vd, s.B, s.T, s.H, s.Hkv, s.D, nullptr), dod);
  };
  auto Lk = [&](const std::vector<double>& x) {
    return Dot(RefAttention(qd, x, vd, s.B, s.T, s.H, s.Hkv, s.D, nullptr), dod);
  };
  auto Lv = [&](const std::vector<double>& x) {
    return Dot(RefAttention(qd, kd, x, s.B, s.T, s.H, s.Hkv, s.D, nullptr), dod);
  };
  // Every 3rd coordinate of q (cost), every coordinate of k and v (GQA accumulation).
  for (size_t i = 0; i < q.size(); i += 3)
    ASSERT_NEAR(dq[i], CentralDiff(Lq, qd, i), 1e-4) << "dq " << i;
  for (size_t i = 0; i < k.size(); ++i)
    ASSERT_NEAR(dk[i], CentralDiff(Lk, kd, i), 1e-4) << "dk " << i;
  for (size_t i = 0; i < v.size(); ++i)
    ASSERT_NEAR(dv[i], CentralDiff(Lv, vd, i), 1e-4) << "dv " << i;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionTest,
    ::testing::Combine(::testing::Values(std::string("cpu"), std::string("cpu-ref")),
                       ::testing::Values(AttnShape{2, 9, 2, 2, 4},      // MHA, tiny
                                         AttnShape{1, 70, 4, 2, 4},     // GQA, crosses a block
                                         AttnShape{2, 130, 4, 2, 8},    // GQA, 3 blocks
                                         AttnShape{1, 256, 4, 4, 32})),  // default model's head
    [](const ::testing::TestParamInfo<std::tuple<std::string, AttnShape>>& info) {
      const AttnShape& s = std::get<1>(info.param);
      return BackendCaseName(std::get<0>(info.param)) + "_B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_H" + std::to_string(s.H) +
             "_Hkv" + std::to_string(s.Hkv) + "_D" + std::to_string(s.D);
    });

// ---- SwiGLU -----------------------------------------------------------------------------------

TEST_P(CpuBackendTest, SwigluForwardBackward) {
  const int n = 500;
  auto g = RandomVec(n, 150, -6, 6), u = RandomVec(n, 151, -2, 2), dh = RandomVec(n, 152);
  Buf<float> bg(be_.get(), g), bu(be_.get(), u), bh(be_.get(), n), bdh(be_.get(), dh),
      bdg(be_.get(), n), bdu(be_.get(), n);
  be_->SwigluForward(bg.get(), bu.get(), 1, n, 0, bh.get());
  be_->SwigluBackward(bdh.get(), bg.get(), bu.get(), 1, n, 0, bdg.get(), bdu.get());
  auto h = bh.Host(), dg = bdg.Host(), du = bdu.Host();
  auto f = [](double gv, double uv) { return gv / (1 + std::exp(-gv)) * uv; };
  for (int i = 0; i < n; ++i) {
    const double want = f(g[i], u[i]);
    ASSERT_NEAR(h[i], want, 1e-6 * (1 + std::fabs(want))) << i;  // a handful of f32 roundings
    const double hstep = 1e-5;
    const double fd_g = dh[i] * (f(g[i] + hstep, u[i]) - f(g[i] - hstep, u[i])) / (2 * hstep);
    const double fd_u = dh[i] * (f(g[i], u[i] + hstep) - f(g[i], u[i] - hstep)) / (2 * hstep);
    ASSERT_NEAR(dg[i], fd_g, 1e-5 * (1 + std::fabs(fd_g))) << i;
    ASSERT_NEAR(du[i], fd_u, 1e-5 * (1 + std::fabs(fd_u))) << i;
  }
}

// ---- cross-entropy ----------------------------------------------------------------------------

TEST_P(CpuBackendTest, CrossEntropyLossAndGradient) {
  const int N = 7, V = 33;
  auto logits = RandomVec(N * V, 160, -8, 8);
  logits[3] = 60.0f;  // a large logit: the max-subtraction must keep things finite
  std::vector<int32_t> tgt = {0, 5, 32, 3, 17, 17, 1};
  const float gs = 0.125f;
  Buf<float> bl(be_.get(), logits), loss(be_.get(), N);
  Buf<int32_t> bt(be_.get(), tgt);
  be_->CrossEntropyForwardBackward(bl.get(), bt.get(), N, V, gs, loss.get());
  auto got_loss = loss.Host(), dl = bl.Host();
  auto row_loss = [&](const std::vector<double>& z, int n) {
    double mx = -1e300;
    for (int j = 0; j < V; ++j) mx = std::max(mx, z[n * V + j]);
    double s = 0;
    for (int j = 0; j < V; ++j) s += std::exp(z[n * V + j] - mx);
    return mx + std::log(s) - z[n * V + tgt[n]];
  };
  auto total = [&](const std::vector<double>& z) {
    double s = 0;
    for (int n = 0; n < N; ++n) s += row_loss(z, n);
    return s;
  };
  const auto zd = ToDouble(logits);
  for (int n = 0; n < N; ++n) {
    // log-sum-exp of values up to 60 in f32: absolute error ~ a few ulps of 60 (~2e-5).
    const double w = row_loss(zd, n);
    ASSERT_NEAR(got_loss[n], w, 3e-5 * (1 + std::fabs(w))) << n;
  }
  for (int i = 0; i < N * V; ++i)
    ASSERT_NEAR(dl[i], gs * CentralDiff(total, zd, i), 1e-6) << i;  // probabilities: ~1e-7 abs
  // grad_scale = 0: losses only, gradient zeroed.
  Buf<float> bl0(be_.get(), logits), loss0(be_.get(), N);
  be_->CrossEntropyForwardBackward(bl0.get(), bt.get(), N, V, 0.0f, loss0.get());
  EXPECT_EQ(loss0.Host(), got_loss);
  for (float d : bl0.Host()) EXPECT_EQ(d, 0.0f);
}

// ---- optimizer --------------------------------------------------------------------------------

TEST_P(CpuBackendTest, SumSquaresAccumulatesInDouble) {
  // 1 + 2^20 * (2^-12)^2 = 1 + 2^-4 exactly; an f32 running sum of 2^-24 steps onto 1 loses them.
  std::vector<float> x(1 << 20, std::ldexp(1.0f, -12));
  x[0] = 1.0f;
  Buf<float> bx(be_.get(), x), out(be_.get(), {2.0f});
  be_->SumSquares(bx.get(), x.size(), out.get());
  EXPECT_EQ(out.Host()[0], 2.0f + 1.0f + (std::ldexp(1.0f, -4) - std::ldexp(1.0f, -24)));
  be_->SumSquares(nullptr, 0, out.get());
  EXPECT_EQ(out.Host()[0], 2.0f + 1.0f + (std::ldexp(1.0f, -4) - std::ldexp(1.0f, -24)));
}

TEST_P(CpuBackendTest, AdamWTwoStepsByHand) {
  // Hand computation of torch.optim.AdamW for two steps with lr 0.01, betas (0.9, 0.999),
  // eps 1e-8, weight decay 0.1, grad_scale 0.5, on p = [1, -2, 0.5], g = [0.2, -0.4, 0] then
  // g = [0.1, 0.3, -1]. Step 1 (bias-corrected m/v give m_hat = g', v_hat = g'^2):
  //   p1 = p0 (1 - 0.001) - 0.01 * g'/(|g'| + 1e-8)  -> [0.989, -1.988, 0.4995]
  // Step 2 computed in double below from the same formulas.
  // The hyperparameters cross the interface as f32, so the reference uses their f32 values
  // (1 - 0.999f differs from 0.001 by 1.3e-5 relative, far above the tolerance below).
  const double lr = 0.01f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
  std::vector<double> p = {1, -2, 0.5}, m(3, 0), v(3, 0);
  const std::vector<std::vector<double>> grads = {{0.2, -0.4, 0}, {0.1, 0.3, -1}};
  Buf<float> bp(be_.get(), {1.0f, -2.0f, 0.5f}), bm(be_.get(), 3), bv(be_.get(), 3);
  // Step 2 also raises an amax slot (starting at 0.25) to max |p| of its updated weights.
  Buf<float> amax(be_.get(), {0.25f});
  for (int t = 1; t <= 2; ++t) {
    std::vector<float> gf(grads[t - 1].begin(), grads[t - 1].end());
    Buf<float> bg(be_.get(), gf);
    be_->AdamW(bp.get(), bg.get(), bm.get(), bv.get(), 3, lr, b1, b2, eps, wd, t, gs,
               t == 2 ? amax.get() : nullptr, nullptr);
    for (int i = 0; i < 3; ++i) {
      const double g = grads[t - 1][i] * gs;
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      const double mh = m[i] / (1 - std::pow(b1, t)), vh = v[i] / (1 - std::pow(b2, t));
      p[i] -= lr * mh / (std::sqrt(vh) + eps);
    }
    if (t == 1) {
      // (1e-7: eps in the denominator shifts each update by lr * eps / |g'| ~ 1e-9, and the f32
      // values of lr and wd differ from 0.01 and 0.1 by ~1e-9 relative.)
      EXPECT_NEAR(p[0], 0.989, 1e-7);
      EXPECT_NEAR(p[1], -1.988, 1e-7);
      EXPECT_NEAR(p[2], 0.4995, 1e-7);
    }
    auto gp = bp.Host(), gm = bm.Host(), gv = bv.Host();
    for (int i = 0; i < 3; ++i) {
      // A dozen f32 roundings on O(1) values: 1e-6 relative.
      EXPECT_NEAR(gp[i], p[i], 1e-6 * std::fabs(p[i])) << "t=" << t << " i=" << i;
      EXPECT_NEAR(gm[i], m[i], 1e-6 * std::fabs(m[i]) + 1e-12) << "t=" << t << " i=" << i;
      EXPECT_NEAR(gv[i], v[i], 1e-6 * std::fabs(v[i]) + 1e-15) << "t=" << t << " i=" << i;
    }
  }
  const double want = std::max({std::fabs(p[0]), std::fabs(p[1]), std::fabs(p[2])});
  EXPECT_NEAR(amax.Host()[0], want, 1e-6 * want);
}

// The nearest value with 8 significant bits (bfloat16's precision), ties to even, by frexp and
// nearbyint (round to nearest even in the default rounding mode) in double: independent of the
// backends' bit manipulation. Normal range only (the values below are far from its ends).
double NearestBf16(double x) {
  int e = 0;
  const double f = std::frexp(x, &e);  // x = f * 2^e, 0.5 <= |f| < 1
  return std::ldexp(std::nearbyint(std::ldexp(f, 8)), e - 8);
}

// How far x is from the nearest bfloat16 rounding boundary (a midpoint between two bfloat16
// values), relative to |x|.
double Bf16MidpointDistance(double x) {
  int e = 0;
  const double f = std::ldexp(std::frexp(x, &e), 8);  // 128 <= |f| < 256
  return std::fabs(std::fabs(f - std::trunc(f)) - 0.5) / std::fabs(f);
}

TEST_P(CpuBackendTest, AdamWBf16MomentsTwoStepsByHand) {
  // The double model of AdamWTwoStepsByHand with both moments rounded to bfloat16 after each
  // step (stored rounded), while each step's update of p uses the moments before the rounding.
  // Where the double model's moment is more than 1e-5 relative from a rounding boundary (checked
  // below), the f32 kernel's ~1e-6 relative error cannot cross it, so the stored bits must equal
  // the model's rounding exactly: a truncation instead of round-to-nearest, or no rounding, fails.
  // Using the rounded moments for p would move p by ~lr * 2^-9 ~ 2e-5, far above 1e-6.
  const double lr = 0.01f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
  const int n = 6;
  std::vector<double> p = {1, -2, 0.5, 0.75, -0.3, 1.7}, m(n, 0), v(n, 0);
  const std::vector<std::vector<double>> grads = {{0.2, -0.4, 0.013, 0.7, -0.09, 0.31},
                                                  {0.1, 0.3, -1, 0.017, 0.55, -0.23}};
  std::vector<float> pf(p.begin(), p.end());
  Buf<float> bp(be_.get(), pf), amax(be_.get(), {0.25f});
  Buf<uint16_t> bm(be_.get(), n), bv(be_.get(), n);  // bf16 zeros
  // Step 2 also writes the updated weights as bfloat16 (the BF16 wire shard).
  Buf<uint16_t> p16(be_.get(), n);
  for (int t = 1; t <= 2; ++t) {
    std::vector<float> gf(grads[t - 1].begin(), grads[t - 1].end());
    Buf<float> bg(be_.get(), gf);
    be_->AdamW(bp.get(), bg.get(), bm.get(), bv.get(), n, lr, b1, b2, eps, wd, t, gs,
               t == 2 ? amax.get() : nullptr, t == 2 ? p16.get() : nullptr);
    for (int i = 0; i < n; ++i) {
      const double g = grads[t - 1][i] * gs;
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      const double mh = m[i] / (1 - std::pow(b1, t)), vh = v[i] / (1 - std::pow(b2, t));
      p[i] -= lr * mh / (std::sqrt(vh) + eps);
    }
    const std::vector<float> gp = bp.Host();
    const std::vector<uint16_t> gm = bm.Host(), gv = bv.Host();
    for (int i = 0; i < n; ++i) {
      SCOPED_TRACE(::testing::Message() << "t=" << t << " i=" << i);
      EXPECT_NEAR(gp[i], p[i], 1e-6 * std::fabs(p[i]));
      ASSERT_GT(Bf16MidpointDistance(m[i]), 1e-5) << "test data: m too close to a tie";
      ASSERT_GT(Bf16MidpointDistance(v[i]), 1e-5) << "test data: v too close to a tie";
      m[i] = NearestBf16(m[i]);
      v[i] = NearestBf16(v[i]);
      uint32_t um = static_cast<uint32_t>(gm[i]) << 16, uv = static_cast<uint32_t>(gv[i]) << 16;
      float fm, fv;
      std::memcpy(&fm, &um, 4);
      std::memcpy(&fv, &uv, 4);
      EXPECT_EQ(fm, m[i]);
      EXPECT_EQ(fv, v[i]);
      if (t == 2) {
        ASSERT_GT(Bf16MidpointDistance(gp[i]), 1e-5) << "test data: p too close to a tie";
        const uint32_t up = static_cast<uint32_t>(p16.Host()[i]) << 16;
        float fp;
        std::memcpy(&fp, &up, 4);
        EXPECT_EQ(fp, NearestBf16(gp[i]));
      }
    }
  }
  double want = 0;
  for (double x : p) want = std::max(want, std::fabs(x));
  EXPECT_NEAR(amax.Host()[0], want, 1e-6 * want);
}

INSTANTIATE_TEST_SUITE_P(Cpu, CpuBackendTest,
                         ::testing::Values(std::string("cpu"), std::string("cpu-ref")),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return BackendCaseName(i.param);
                         });

}  // namespace
}  // namespace fsdp8
