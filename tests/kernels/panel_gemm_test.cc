// PanelGemm (kernels/cpu/panel_gemm.h) against a double-precision triple loop written here.
// Inputs are small integers, so every product and partial sum is exact in f32 (|sum| < 2^24) and
// the kernel must match the loop exactly, whatever its order of operations; alpha = 0.5 and the
// accumulate step keep that (halving and adding integers stay exact). A second case with random
// reals checks the documented order: one fused multiply-add chain per element, then alpha.
#include "kernels/cpu/panel_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_fast_backend.h"

namespace fsdp8 {
namespace {

constexpr float kSentinel = -12345.0f;

struct Case {
  int rows;
  int64_t N, K;
  bool a_transposed, accumulate;
};

// The panel product of integer-valued operands; C's columns past N hold a sentinel that must stay.
void CheckExact(const Case& c, std::mt19937* rng) {
  std::uniform_int_distribution<int> val(-4, 4);
  const int64_t lda = c.a_transposed ? c.rows + 3 : c.K + 2;  // padded strides
  const int64_t ldb = c.N + 5, ldc = c.N + 9;
  std::vector<float> a(static_cast<size_t>(lda * (c.a_transposed ? c.K : c.rows) + 1));
  std::vector<float> b(static_cast<size_t>(ldb * c.K + 1)), cm(static_cast<size_t>(ldc * c.rows));
  for (float& x : a) x = static_cast<float>(val(*rng));
  for (float& x : b) x = static_cast<float>(val(*rng));
  for (float& x : cm) x = static_cast<float>(val(*rng));
  std::vector<float> old = cm;
  const int64_t rs = c.a_transposed ? 1 : lda, cs = c.a_transposed ? lda : 1;
  PanelGemm(c.rows, c.N, c.K, 0.5f, a.data(), rs, cs, b.data(), ldb, cm.data(), ldc, c.accumulate);
  for (int m = 0; m < c.rows; ++m) {
    for (int64_t n = 0; n < ldc; ++n) {
      const float got = cm[m * ldc + n];
      if (n >= c.N) {
        ASSERT_EQ(got, old[m * ldc + n]) << "wrote past N at row " << m << " col " << n;
        continue;
      }
      double want = 0.0;
      for (int64_t k = 0; k < c.K; ++k) {
        want += static_cast<double>(a[m * rs + k * cs]) * static_cast<double>(b[k * ldb + n]);
      }
      want *= 0.5;
      if (c.accumulate) want += old[m * ldc + n];
      ASSERT_EQ(static_cast<double>(got), want)
          << "rows " << c.rows << " N " << c.N << " K " << c.K << " transposed "
          << c.a_transposed << " accumulate " << c.accumulate << " at (" << m << ", " << n << ")";
    }
  }
}

TEST(PanelGemm, MatchesExactProductsForEveryRowCountWidthAndLayout) {
  if (!CpuFastBackend::Supported()) GTEST_SKIP() << "needs AVX2 + FMA";
  std::mt19937 rng(7);
  for (int rows = 1; rows <= kPanelRows; ++rows) {
    for (int64_t N : {1, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40}) {
      for (int64_t K : {0, 1, 2, 5, 32, 67}) {
        for (bool tr : {false, true}) {
          for (bool acc : {false, true}) CheckExact({rows, N, K, tr, acc}, &rng);
        }
      }
    }
  }
}

TEST(PanelGemm, EachElementIsOneFusedChainInKOrderThenAlpha) {
  if (!CpuFastBackend::Supported()) GTEST_SKIP() << "needs AVX2 + FMA";
  std::mt19937 rng(11);
  std::normal_distribution<float> val(0.0f, 1.0f);
  const int rows = 5;
  const int64_t N = 21, K = 50;
  std::vector<float> a(rows * K), b(K * N), c(rows * N);
  for (float& x : a) x = val(rng);
  for (float& x : b) x = val(rng);
  PanelGemm(rows, N, K, 0.3f, a.data(), K, 1, b.data(), N, c.data(), N, false);
  for (int m = 0; m < rows; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(a[m * K + k], b[k * N + n], s);
      ASSERT_EQ(c[m * N + n], s * 0.3f) << "(" << m << ", " << n << ")";
    }
  }
}

TEST(PanelGemm, RefusesMoreRowsThanAPanel) {
  if (!CpuFastBackend::Supported()) GTEST_SKIP() << "needs AVX2 + FMA";
  std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64);
  EXPECT_DEATH(PanelGemm(kPanelRows + 1, 4, 4, 1.0f, a.data(), 4, 1, b.data(), 4, c.data(), 4,
                         false),
               "PanelGemm: rows 7");
}

}  // namespace
}  // namespace fsdp8
