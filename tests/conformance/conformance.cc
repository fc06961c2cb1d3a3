#include "tests/conformance/conformance.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace fsdp8::conformance {

uint64_t Seed() {
  static const uint64_t seed = [] {
    // The user's seed, else the one ctest passes (tests/conformance/CMakeLists.txt), else the clock.
    const char* env = std::getenv("FSDP8_CONFORMANCE_SEED");
    if (env == nullptr || *env == '\0') env = std::getenv("FSDP8_CONFORMANCE_DEFAULT_SEED");
    uint64_t s = env != nullptr && *env != '\0'
                     ? std::strtoull(env, nullptr, 10)
                     : static_cast<uint64_t>(
                           std::chrono::steady_clock::now().time_since_epoch().count());
    std::printf("conformance seed %llu (FSDP8_CONFORMANCE_SEED=%llu with the same --gtest_filter "
                "repeats this run's inputs)\n",
                static_cast<unsigned long long>(s), static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

std::mt19937_64& Rng() {
  static std::mt19937_64 rng(Seed());
  return rng;
}

std::vector<float> Randn(int64_t n, float scale) {
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
  // against the size of the terms that cancel (ref.abs_scale) or, without one, by the absolute
  // difference, the inputs here being O(1).
  const double denom = std::max(maxref, ref.abs_scale);
  return denom > 0.0 ? maxdiff / denom : maxdiff;
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

void Conformance::Check(const std::string& op, double tol, const OpFn& fn) {
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

std::vector<float> CastInputs(int64_t n) {
  std::vector<float> v = Randn(n, 1.0f);
  std::uniform_real_distribution<float> e(-24.0f, 18.0f);
  for (size_t i = 0; i < v.size(); ++i) v[i] *= std::exp2(e(Rng()));
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 448.0f, 464.0f, 57344.0f, 61440.0f,
                            1e-9f, std::exp2(-10.0f), std::exp2(-17.0f), 3e38f};
  for (size_t i = 0; i < sizeof(specials) / sizeof(specials[0]) && i < v.size(); ++i) v[i * 7 % v.size()] = specials[i];
  return v;
}

namespace {

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

// The backends under test against the reference "cpu-ref": the fast CPU backend "cpu" and CUDA.
// The "cpu_ref" instance compares the reference with a second instance of itself: it checks
// determinism, poisoned-output coverage and the harness, not accuracy (the reference is checked
// against independent references in tests/kernels).
INSTANTIATE_TEST_SUITE_P(Backends, Conformance,
                         ::testing::Values(std::string("cpu"), std::string("cuda"),
                                           std::string("cpu-ref")),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param == "cpu-ref" ? std::string("cpu_ref") : i.param;
                         });

}  // namespace
}  // namespace fsdp8::conformance
