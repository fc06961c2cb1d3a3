// Conformance of the cross-entropy loss, the sum of squares (gradient norm) and AdamW (f32 and
// bf16 moments).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "tests/conformance/conformance.h"

namespace fsdp8::conformance {
namespace {

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
            r.b()->CrossEntropyForwardBackward(lg, r.In(tgt), s.N, s.V,
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

// p16_out's contract (Backend::AdamW): PackBf16 of the updated p, bit for bit, on the backend
// that ran the update (the comparison with the reference's values below allows a bf16 step).
void ExpectPackBf16Of(DevRun& r, const float* p, const uint16_t* p16, int64_t n,
                      const std::string& what) {
  uint16_t* want = r.Out<uint16_t>(n);
  r.b()->PackBf16(p, want, n);
  std::vector<uint16_t> got_h(static_cast<size_t>(n)), want_h(static_cast<size_t>(n));
  r.b()->CopyToHost(got_h.data(), p16, n * sizeof(uint16_t));
  r.b()->CopyToHost(want_h.data(), want, n * sizeof(uint16_t));
  int64_t differ = 0, first = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (got_h[i] != want_h[i] && differ++ == 0) first = i;
  }
  EXPECT_EQ(differ, 0) << what << ": p16_out differs from PackBf16 of the updated p in " << differ
                       << " of " << n << " elements (first at " << first << ")";
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
                             0.95f, 1e-8f, 0.1f, step, 0.5f, amax, nullptr);
                r.F32(&o, "p", pd, n);
                r.F32(&o, "amax", amax, 1);
                r.F32(&o, "m", md, n);
                r.F32(&o, "v", vd, n);
                return o;
              });
        // The updated weights packed to bfloat16 by the update itself: the reference's are
        // PackBf16 of its p; one bf16 step apart where the f32 values straddle a rounding
        // boundary.
        Check("AdamW/" + std::to_string(n) + "/step" + std::to_string(step) + "/skip" +
                  std::to_string(skip) + "/p16",
              kEltTol + 1.0 / 128, [&](DevRun& r) {
                Outputs o;
                float* pd = r.In(p);
                uint16_t* p16 = r.Out<uint16_t>(n);
                r.b()->AdamW(pd + skip, r.In(g) + skip, r.In(m) + skip, r.In(v) + skip, n - skip,
                             3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f, nullptr, p16 + skip);
                ExpectPackBf16Of(r, pd + skip, p16 + skip, n - skip, "AdamW");
                r.Bf16AsF32(&o, "p16", p16 + skip, n - skip);
                return o;
              });
      }
    }
  }
}

// BF16 moments (optimizer.state_precision BF16): p and the amax as AdamW (kEltTol: the f32
// moments before rounding feed the update); the stored moments, unpacked to f32, may sit one
// bf16 step (2^-7 of the element, so of the largest one normwise) from the reference's where
// the f32 values differ by a few ulps across a rounding boundary.
TEST_P(Conformance, AdamWBf16Moments) {
  const double bf16_ulp = 1.0 / 128;
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{1} << 20}) {
    const auto p = Randn(n), g = Randn(n, 0.1f), m = Randn(n, 0.01f);
    auto v = Randn(n, 0.001f);
    for (auto& x : v) x = std::fabs(x);
    for (int64_t step : {int64_t{1}, int64_t{1000}}) {
      // skip: a shard slice that starts off the vector alignment (odd: the bf16 moments too).
      for (int64_t skip : {int64_t{0}, int64_t{3}}) {
        if (skip >= n) continue;
        const std::string name = "AdamWBf16Moments/" + std::to_string(n) + "/step" +
                                 std::to_string(step) + "/skip" + std::to_string(skip);
        // The op once per output group: p and amax at AdamW's tolerance, the moments at theirs.
        for (bool moments : {false, true}) {
          Check(name + (moments ? "/moments" : "/p"), moments ? kEltTol + bf16_ulp : kEltTol,
                [&](DevRun& r) {
                  Outputs o;
                  float* pd = r.In(p);
                  uint16_t* md = r.InBf16(m);
                  uint16_t* vd = r.InBf16(v);
                  float* amax = r.In(std::vector<float>{0.5f});
                  uint16_t* p16 = r.Out<uint16_t>(n);
                  r.b()->AdamW(pd + skip, r.In(g) + skip, md + skip, vd + skip, n - skip, 3e-4f,
                               0.9f, 0.95f, 1e-8f, 0.1f, step, 0.5f, amax, p16 + skip);
                  if (!moments) {
                    r.F32(&o, "p", pd, n);
                    r.F32(&o, "amax", amax, 1);
                  } else {
                    r.Bf16AsF32(&o, "m", md, n);
                    r.Bf16AsF32(&o, "v", vd, n);
                    ExpectPackBf16Of(r, pd + skip, p16 + skip, n - skip, "AdamWBf16Moments");
                    r.Bf16AsF32(&o, "p16", p16 + skip, n - skip);  // PackBf16 of p
                  }
                  return o;
                });
        }
      }
    }
  }
}

}  // namespace
}  // namespace fsdp8::conformance
