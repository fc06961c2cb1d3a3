// Conformance of the elementwise ops (SwiGLU, Axpy, Add ...), the embedding, RMSNorm and RoPE.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "kernels/fp8.h"
#include "tests/conformance/conformance.h"

namespace fsdp8::conformance {
namespace {

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
      r.b()->SwigluForward(r.In(g), r.In(u), 1, n, 0, h);
      r.F32(&o, "h", h, n);
      return o;
    });
    Check("SwigluBackward/" + std::to_string(n), kEltTol, [&](DevRun& r) {
      Outputs o;
      float* dg = r.Out<float>(n);
      float* du = r.Out<float>(n);
      r.b()->SwigluBackward(r.In(dh), r.In(g), r.In(u), 1, n, 0, dg, du);
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
      r.b()->SwigluBackward(r.In(dh), g16, u16, 1, n, 0, dg, du);
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

// RMSNorm's backward dx = rstd * (w*dy - xhat * mean(xhat * w*dy)) (eps 1e-5) is a difference of
// terms up to rstd * max(|w dy|, |xhat mean(...)|) each: where they cancel (few columns, dy nearly
// along xhat) their f32 roundings, not dx's size, set the error a normwise comparison of dx sees.
// With dres (the residual's gradient, RmsNormBackwardAdd) dx + dres is the result and |dres| one
// more term. Returns the largest term, in double from the inputs: dx is judged against it
// (F32Near0); dw, a plain sum over rows, against its own size.
double RmsNormBackwardLargestTerm(const std::vector<float>& x, const std::vector<float>& w,
                                  const std::vector<float>& dy, int64_t N, int64_t C,
                                  const std::vector<float>* dres = nullptr) {
  double terms = 0;
  for (int64_t r = 0; r < N; ++r) {
    const float* xr = x.data() + r * C;
    const float* dyr = dy.data() + r * C;
    double ms = 0, m = 0;
    for (int64_t i = 0; i < C; ++i) ms += static_cast<double>(xr[i]) * xr[i] / C;
    const double rstd = 1.0 / std::sqrt(ms + 1e-5);
    for (int64_t i = 0; i < C; ++i) m += xr[i] * rstd * w[i] * dyr[i] / C;
    for (int64_t i = 0; i < C; ++i) {
      const double g = static_cast<double>(w[i]) * dyr[i], h = xr[i] * rstd * m;
      const double res = dres != nullptr ? (*dres)[r * C + i] : 0.0;
      terms = std::max({terms, rstd * std::fabs(g), rstd * std::fabs(h), std::fabs(res)});
    }
  }
  return terms;
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
    const double dx_terms = RmsNormBackwardLargestTerm(x, w, dy, s.N, s.C);
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
      r.F32Near0(&o, "dx", dx, s.N * s.C, dx_terms);
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
      r.b()->RmsNormForward(r.In(x), r.In(w), 1e-5f, s.N, s.C, nullptr, rstd,
                            Fp8Cast{r.In(nscale), Fp8Format::kE4M3, out, nullptr, amax});
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
    const double dx_add_terms = RmsNormBackwardLargestTerm(x, w, dy, s.N, s.C, &dres);
    Check("RmsNormBackwardAdd/" + shape, Tol(static_cast<double>(s.C + s.N)), [&](DevRun& r) {
      Outputs o;
      float* y = r.Out<float>(s.N * s.C);
      float* rstd = r.Out<float>(s.N);
      const float* xd = r.In(x);
      const float* wd = r.In(w);
      r.b()->RmsNormForward(xd, wd, 1e-5f, s.N, s.C, y, rstd);
      float* dx = r.Out<float>(s.N * s.C);
      float* dw = r.In(dw0);
      r.b()->RmsNormBackward(r.In(dy), xd, wd, rstd, s.N, s.C, dx, dw, r.In(dres));
      r.F32Near0(&o, "dx", dx, s.N * s.C, dx_add_terms);
      r.F32(&o, "dw", dw, s.C);
      return o;
    });
    // dy as the f32 sum of bf16 parts (one: a fused q/k/v or gate/up dX; two: gate/up; three:
    // q/k/v). C 5632 is above the CUDA fused kernel's limit and takes the composition there.
    const auto dyb = Randn(s.N * s.C), dyc = Randn(s.N * s.C);
    for (int parts : {1, 2, 3}) {
      const bool three = parts == 3;
      std::vector<float> dy_sum(dy.size());  // the dy the backward sees: bf16 parts summed
      for (size_t i = 0; i < dy.size(); ++i) {
        dy_sum[i] = RoundBf16(dy[i]) + (parts > 1 ? RoundBf16(dyb[i]) : 0.0f) +
                    (three ? RoundBf16(dyc[i]) : 0.0f);
      }
      const double dx_terms_parts = RmsNormBackwardLargestTerm(x, w, dy_sum, s.N, s.C, &dres);
      Check("RmsNormBackwardAddBf16Parts/" + shape + "/" + std::to_string(parts),
            Tol(static_cast<double>(s.C + s.N)), [&](DevRun& r) {
              Outputs o;
              const int64_t n = s.N * s.C;
              float* y = r.Out<float>(n);
              float* rstd = r.Out<float>(s.N);
              const float* xd = r.In(x);
              const float* wd = r.In(w);
              r.b()->RmsNormForward(xd, wd, 1e-5f, s.N, s.C, y, rstd);
              float* dx = r.Out<float>(n);
              float* dw = r.In(dw0);
              r.b()->RmsNormBackward(r.InBf16(dy), xd, wd, rstd, s.N, s.C, dx, dw, r.In(dres),
                                     parts > 1 ? r.InBf16(dyb) : nullptr,
                                     three ? r.InBf16(dyc) : nullptr);
              r.F32Near0(&o, "dx", dx, n, dx_terms_parts);
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

}  // namespace
}  // namespace fsdp8::conformance
