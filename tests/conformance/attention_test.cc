// Conformance of attention (f32 and bf16), and cuDNN's fused BF16 attention against the CPU f32
// reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend.h"
#if defined(FSDP8_WITH_CUDNN)
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/cuda_backend.h"
#endif
#include "tests/conformance/conformance.h"

namespace fsdp8::conformance {
namespace {

// max |x_i|.
double MaxAbs(const std::vector<float>& x) {
  double m = 0.0;
  for (float v : x) m = std::max(m, std::fabs(static_cast<double>(v)));
  return m;
}

TEST_P(Conformance, Attention) {
  struct S { int64_t B, T, H, Hkv, D; };
  for (const S& s : {S{1, 1, 1, 1, 4}, S{2, 1, 4, 2, 64}, S{2, 37, 4, 2, 16}, S{1, 129, 3, 1, 64},
                     S{2, 256, 4, 4, 128}, S{1, 100, 2, 2, 160}}) {
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
      if (s.T == 1) {
        // One key per query: lse is that key's score, q.k / sqrt(D), whose D terms can cancel to
        // near 0 (seed 17136784729985: 3e-4 relative, 3e-8 absolute); its rounding is bounded by
        // the size of those terms, D max|q| max|k| / sqrt(D).
        r.F32Near0(&o, "lse", lse, s.B * s.H * s.T,
                   std::sqrt(static_cast<double>(s.D)) * MaxAbs(q) * MaxAbs(k));
      } else {
        r.F32(&o, "lse", lse, s.B * s.H * s.T);
      }
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
      if (s.T == 1) {
        // One key per query: the softmax weight is 1, dq = dk = 0 exactly, and what comes out is
        // the rounding of dP - delta (two length-D sums of dout * v) times the scale and k (for
        // dq) or q summed over the group's heads (for dk): bounded by the size of those terms.
        const double terms = static_cast<double>(s.D) * MaxAbs(dout) * MaxAbs(v) /
                             std::sqrt(static_cast<double>(s.D));
        r.F32Near0(&o, "dq", dq, nq, terms * MaxAbs(k));
        r.F32Near0(&o, "dk", dk, nk, terms * MaxAbs(q) * static_cast<double>(s.H / s.Hkv));
      } else {
        r.F32(&o, "dq", dq, nq);
        r.F32(&o, "dk", dk, nk);
      }
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
      r.b()->AttentionForward(r.In(q), r.In(k), r.In(v), s.B, s.T, s.H, s.Hkv, s.D, out, lse,
                              AttentionOptions{true});
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
      r.b()->AttentionForward(qd, kd, vd, s.B, s.T, s.H, s.Hkv, s.D, out, lse,
                              AttentionOptions{true});
      float* dq = r.Out<float>(nq);
      float* dk = r.Out<float>(nk);
      float* dv = r.Out<float>(nk);
      r.b()->AttentionBackward(qd, kd, vd, out, r.In(dout), lse, s.B, s.T, s.H, s.Hkv, s.D, dq, dk,
                               dv, AttentionOptions{true});
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
      r.b()->AttentionForward(qd, kd, vd, s.B, s.T, s.H, s.Hkv, s.D, out, lse,
                              AttentionOptions{true});
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
      r.b()->AttentionBackward(q16, k16, v16, o16, r.In(dout), lse, s.B, s.T, s.H, s.Hkv, s.D, dq,
                               dk, dv, AttentionOptions{true});
      r.F32(&o, "dq", dq, nq);
      r.F32(&o, "dk", dk, nk);
      r.F32(&o, "dv", dv, nk);
      return o;
    });
  }
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
  std::unique_ptr<Backend> cpu = CreateBackend("cpu-ref", 0, &err);
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

}  // namespace
}  // namespace fsdp8::conformance
