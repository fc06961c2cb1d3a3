#include "kernels/backend.h"
#include "kernels/device_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <vector>

#include "common/check.h"
#include "common/env_settings.h"
#include "kernels/cpu/cpu_ref_backend.h"
#ifdef FSDP8_WITH_FAST_CPU
#include "kernels/cpu/cpu_fast_backend.h"
#endif

#ifdef FSDP8_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace fsdp8 {
namespace {

// A device copy of n f32 values, each rounded to the nearest bfloat16 (f32 storage).
float* RoundedToBf16Copy(Backend* be, const float* x, int64_t n) {
  float* c = static_cast<float*>(be->Alloc(static_cast<size_t>(n) * sizeof(float)));
  if (c == nullptr) throw std::bad_alloc();  // out of memory: the worker reports it (backend.h)
  be->Copy(c, x, static_cast<size_t>(n) * sizeof(float));
  be->RoundToBf16(c, n);
  return c;
}

}  // namespace

void Backend::SetRopeInvFreq(float theta, std::vector<float> inv_freq) {
  rope_freq_theta_ = theta;
  rope_inv_freq_ = std::move(inv_freq);
  ++rope_freq_version_;
}

const std::vector<float>* Backend::RopeInvFreqFor(int64_t D, float theta) const {
  if (rope_inv_freq_.empty() || theta != rope_freq_theta_ ||
      D != 2 * static_cast<int64_t>(rope_inv_freq_.size())) {
    return nullptr;
  }
  return &rope_inv_freq_;
}

void Backend::AttentionForwardBf16Compute(const float* q, const float* k, const float* v, int64_t B,
                                          int64_t T, int64_t H, int64_t Hkv, int64_t D, float* out,
                                          float* lse) {
  float* qr = RoundedToBf16Copy(this, q, B * T * H * D);
  float* kr = RoundedToBf16Copy(this, k, B * T * Hkv * D);
  float* vr = RoundedToBf16Copy(this, v, B * T * Hkv * D);
  AttentionForward(qr, kr, vr, B, T, H, Hkv, D, out, lse);
  RoundToBf16(out, B * T * H * D);
  Free(qr);
  Free(kr);
  Free(vr);
}

void Backend::AttentionBackwardBf16Saved(const uint16_t* q16, const uint16_t* k16,
                                         const uint16_t* v16, const uint16_t* out16,
                                         const float* dout, const float* lse, int64_t B,
                                         int64_t T, int64_t H, int64_t Hkv, int64_t D, float* dq,
                                         float* dk, float* dv) {
  const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
  float* buf = static_cast<float*>(Alloc(static_cast<size_t>(2 * nq + 2 * nk) * sizeof(float)));
  FSDP8_CHECK(buf != nullptr) << "device out of memory";
  float *q = buf, *o = q + nq, *k = o + nq, *v = k + nk;
  UnpackBf16(q16, q, nq);
  UnpackBf16(out16, o, nq);
  UnpackBf16(k16, k, nk);
  UnpackBf16(v16, v, nk);
  AttentionBackwardBf16Compute(q, k, v, o, dout, lse, B, T, H, Hkv, D, dq, dk, dv);
  Free(buf);
}

void Backend::SwigluBackwardBf16Saved(const float* dh, const uint16_t* gate16, const uint16_t* up16,
                                      int64_t n, float* dgate, float* dup) {
  float* buf = static_cast<float*>(Alloc(static_cast<size_t>(2 * n) * sizeof(float)));
  FSDP8_CHECK(buf != nullptr) << "device out of memory";
  UnpackBf16(gate16, buf, n);
  UnpackBf16(up16, buf + n, n);
  SwigluBackward(dh, buf, buf + n, n, dgate, dup);
  Free(buf);
}

// ---- bfloat16 activations: the reference compositions ---------------------------------------

namespace {
// Scratch f32 buffer of n elements on `be`; std::bad_alloc when out of memory (the worker reports
// RESOURCE_EXHAUSTED).
float* F32Scratch(Backend* be, int64_t n) {
  float* p = static_cast<float*>(be->Alloc(static_cast<size_t>(n > 0 ? n : 1) * sizeof(float)));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void Backend::RmsNormCastFp8(const float* x, const float* w, float eps, int64_t N, int64_t C,
                             float* rstd, const float* scale, Fp8Format fmt, uint8_t* out,
                             float* amax_out) {
  float* y = F32Scratch(this, N * C);
  RmsNormForward(x, w, eps, N, C, y, rstd);
  CastToFp8(y, out, N * C, scale, fmt, amax_out);
  Free(y);
}

void Backend::RmsNormBackwardAdd(const float* dy, const float* x, const float* w,
                                 const float* rstd, const float* dres, int64_t N, int64_t C,
                                 float* dx, float* dw) {
  RmsNormBackward(dy, x, w, rstd, N, C, dx, dw);
  Axpy(1.0f, dres, dx, N * C);
}

void Backend::RmsNormBackwardAddBf16Parts(const uint16_t* dy_a, const uint16_t* dy_b,
                                          const uint16_t* dy_c, const float* x, const float* w,
                                          const float* rstd, const float* dres, int64_t N,
                                          int64_t C, float* dx, float* dw) {
  const int64_t n = N * C;
  float* dy = static_cast<float*>(Alloc(static_cast<size_t>(2 * (n > 0 ? n : 1)) * sizeof(float)));
  FSDP8_CHECK(dy != nullptr) << "device out of memory";
  float* part = dy + n;
  FSDP8_CHECK(dy_b != nullptr || dy_c == nullptr)
      << "RmsNormBackwardAddBf16Parts: dy_c without dy_b";
  UnpackBf16(dy_a, dy, n);
  if (dy_b != nullptr) {
    UnpackBf16(dy_b, part, n);
    Axpy(1.0f, part, dy, n);
  }
  if (dy_c != nullptr) {
    UnpackBf16(dy_c, part, n);
    Axpy(1.0f, part, dy, n);
  }
  RmsNormBackwardAdd(dy, x, w, rstd, dres, N, C, dx, dw);
  Free(dy);
}

void Backend::GemmFp8Layout(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                            const uint8_t* A, Fp8Format a_fmt, const float* a_scale_inv,
                            const uint8_t* B, Fp8Format b_fmt, const float* b_scale_inv, float* C,
                            bool accumulate) {
  // GemmFp8 takes A (M, K) and B (N, K).
  auto transposed = [this](const uint8_t* x, int64_t rows, int64_t cols) {
    auto* t = static_cast<uint8_t*>(Alloc(static_cast<size_t>(std::max<int64_t>(rows * cols, 1))));
    if (t == nullptr) throw std::bad_alloc();
    TransposeBytes(x, rows, cols, t);
    return t;
  };
  uint8_t* at = trans_a ? transposed(A, K, M) : nullptr;
  uint8_t* bt = trans_b ? nullptr : transposed(B, K, N);
  GemmFp8(M, N, K, at != nullptr ? at : A, a_fmt, a_scale_inv, bt != nullptr ? bt : B, b_fmt,
          b_scale_inv, C, accumulate);
  if (at != nullptr) Free(at);
  if (bt != nullptr) Free(bt);
}

void Backend::GemmFp8AddResidual(int64_t M, int64_t N, int64_t K, const uint8_t* A,
                                 Fp8Format a_fmt, const float* a_scale_inv, const uint8_t* B,
                                 Fp8Format b_fmt, const float* b_scale_inv, const float* R,
                                 float* D) {
  Copy(D, R, static_cast<size_t>(M * N) * sizeof(float));
  GemmFp8(M, N, K, A, a_fmt, a_scale_inv, B, b_fmt, b_scale_inv, D, true);
}

void Backend::GemmBf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                       const uint16_t* A16, const uint16_t* B16, float* C, bool accumulate) {
  float* a = F32Scratch(this, M * K);
  float* b = F32Scratch(this, N * K);
  UnpackBf16(A16, a, M * K);
  UnpackBf16(B16, b, N * K);
  Gemm(trans_a, trans_b, M, N, K, a, b, C, accumulate, GemmInputs::kF32);
  Free(a);
  Free(b);
}

void Backend::CrossEntropyForwardBackwardBf16Grad(const float* logits, const int32_t* targets,
                                                  int64_t N, int64_t V, float grad_scale,
                                                  float* losses, uint16_t* dlogits16) {
  float* g = F32Scratch(this, N * V);
  Copy(g, logits, static_cast<size_t>(N * V) * sizeof(float));
  CrossEntropyForwardBackward(g, targets, N, V, grad_scale, losses);
  PackBf16(g, dlogits16, N * V);
  Free(g);
}

void Backend::GemmFp8Bf16(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format a_fmt,
                          const float* a_scale_inv, const uint8_t* B, Fp8Format b_fmt,
                          const float* b_scale_inv, uint16_t* C16) {
  float* c = F32Scratch(this, M * N);
  GemmFp8(M, N, K, A, a_fmt, a_scale_inv, B, b_fmt, b_scale_inv, c, false);
  PackBf16(c, C16, M * N);
  Free(c);
}

namespace {
void CheckRowStride(int64_t ld, int64_t cols) {
  FSDP8_CHECK(ld >= cols) << "row stride " << ld << " < cols " << cols;
}

// Unpacks the (rows, cols) bf16 matrix x16 of row stride ld into dense f32 x.
void UnpackRows(Backend* be, const uint16_t* x16, int64_t rows, int64_t cols, int64_t ld,
                float* x) {
  CheckRowStride(ld, cols);
  if (ld == cols) {
    be->UnpackBf16(x16, x, rows * cols);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) be->UnpackBf16(x16 + r * ld, x + r * cols, cols);
}

// Dense bf16 copy (rows, cols) of x16 (row stride ld); nullptr when ld == cols (use x16).
uint16_t* DenseRows16(Backend* be, const uint16_t* x16, int64_t rows, int64_t cols, int64_t ld) {
  if (ld == cols) return nullptr;
  CheckRowStride(ld, cols);
  uint16_t* d = static_cast<uint16_t*>(be->Alloc(static_cast<size_t>(rows * cols + 1) * 2));
  if (d == nullptr) throw std::bad_alloc();
  for (int64_t r = 0; r < rows; ++r) be->Copy(d + r * cols, x16 + r * ld, cols * sizeof(uint16_t));
  return d;
}
}  // namespace

void Backend::CastToFp8Bf16(const uint16_t* in16, uint8_t* out, int64_t n, const float* scale,
                            Fp8Format fmt, float* amax_out) {
  float* x = F32Scratch(this, n);
  UnpackBf16(in16, x, n);
  CastToFp8(x, out, n, scale, fmt, amax_out);
  Free(x);
}

void Backend::CastTransposeFp8Bf16(const uint16_t* in16, int64_t rows, int64_t cols,
                                   const float* scale, Fp8Format fmt, uint8_t* out,
                                   uint8_t* out_t, float* amax_out, int64_t out_ld) {
  FSDP8_CHECK(out_ld >= cols) << "CastTransposeFp8Bf16: out_ld " << out_ld << " < cols " << cols;
  float* x = F32Scratch(this, rows * cols);
  UnpackBf16(in16, x, rows * cols);
  if (out == nullptr || out_ld == cols) {
    CastTransposeFp8(x, rows, cols, scale, fmt, out, out_t, amax_out);
  } else {  // dense codes first, then row by row into the strided matrix
    uint8_t* dense = static_cast<uint8_t*>(Alloc(static_cast<size_t>(rows * cols > 0 ? rows * cols : 1)));
    FSDP8_CHECK(dense != nullptr) << "device out of memory";
    CastTransposeFp8(x, rows, cols, scale, fmt, dense, out_t, amax_out);
    for (int64_t r = 0; r < rows; ++r) Copy(out + r * out_ld, dense + r * cols, cols);
    Free(dense);
  }
  Free(x);
}

void Backend::GroupMax(const float* in, const int32_t* group, int64_t n, float* out) {
  if (n <= 0) return;
  std::vector<float> v(n), r(n);
  std::vector<int32_t> g(n);
  CopyToHost(v.data(), in, n * sizeof(float));
  CopyToHost(g.data(), group, n * sizeof(int32_t));
  for (int64_t i = 0; i < n; ++i) {
    float m = v[i];
    for (int64_t j = 0; j < n; ++j) {
      if (g[j] == g[i] && (std::isnan(v[j]) || v[j] > m)) m = v[j];
      if (std::isnan(m)) break;
    }
    r[i] = m;
  }
  CopyToDevice(out, r.data(), n * sizeof(float));
}

namespace {
// RopeForward (backward = false) or RopeBackward in place on bf16 x16 through an f32 copy.
void RopeBf16(Backend* be, uint16_t* x16, int64_t B, int64_t T, int64_t H, int64_t D,
              float theta, bool backward) {
  const int64_t n = B * T * H * D;
  float* x = F32Scratch(be, n);
  be->UnpackBf16(x16, x, n);
  if (backward) {
    be->RopeBackward(x, B, T, H, D, theta);
  } else {
    be->RopeForward(x, B, T, H, D, theta);
  }
  be->PackBf16(x, x16, n);
  be->Free(x);
}
}  // namespace

void Backend::RopeForwardBf16(uint16_t* x16, int64_t B, int64_t T, int64_t H, int64_t D,
                              float theta, int64_t ld) {
  if (ld == H * D) {
    RopeBf16(this, x16, B, T, H, D, theta, /*backward=*/false);
    return;
  }
  uint16_t* d = DenseRows16(this, x16, B * T, H * D, ld);
  RopeBf16(this, d, B, T, H, D, theta, /*backward=*/false);
  for (int64_t r = 0; r < B * T; ++r) Copy(x16 + r * ld, d + r * H * D, H * D * sizeof(uint16_t));
  Free(d);
}

void Backend::RopeBackwardBf16(uint16_t* dx16, int64_t B, int64_t T, int64_t H, int64_t D,
                               float theta) {
  RopeBf16(this, dx16, B, T, H, D, theta, /*backward=*/true);
}

void Backend::RopeBackwardCastTransposeFp8Bf16(const uint16_t* dx16, int64_t B, int64_t T,
                                               int64_t H, int64_t D, float theta,
                                               const float* scale, Fp8Format fmt, uint8_t* out,
                                               uint8_t* out_t, float* amax_out, int64_t out_ld) {
  const int64_t n = B * T * H * D;
  uint16_t* r16 = reinterpret_cast<uint16_t*>(F32Scratch(this, (n + 1) / 2));
  Copy(r16, dx16, static_cast<size_t>(n) * sizeof(uint16_t));
  RopeBackwardBf16(r16, B, T, H, D, theta);
  CastTransposeFp8Bf16(r16, B * T, H * D, scale, fmt, out, out_t, amax_out, out_ld);
  Free(r16);
}

void Backend::AttentionForwardBf16Packed(const uint16_t* q16, const uint16_t* k16,
                                         const uint16_t* v16, int64_t B, int64_t T, int64_t H,
                                         int64_t Hkv, int64_t D, uint16_t* out16, float* lse,
                                         int64_t q_ld, int64_t kv_ld) {
  const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
  float* buf = F32Scratch(this, 2 * nq + 2 * nk);
  float *q = buf, *o = q + nq, *k = o + nq, *v = k + nk;
  UnpackRows(this, q16, B * T, H * D, q_ld, q);
  UnpackRows(this, k16, B * T, Hkv * D, kv_ld, k);
  UnpackRows(this, v16, B * T, Hkv * D, kv_ld, v);
  AttentionForwardBf16Compute(q, k, v, B, T, H, Hkv, D, o, lse);
  PackBf16(o, out16, nq);
  Free(buf);
}

void Backend::AttentionBackwardBf16SavedTo16(const uint16_t* q16, const uint16_t* k16,
                                             const uint16_t* v16, const uint16_t* out16,
                                             const uint16_t* dout16, const float* lse, int64_t B,
                                             int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                             uint16_t* dq16, uint16_t* dk16, uint16_t* dv16,
                                             int64_t q_ld, int64_t kv_ld) {
  uint16_t* qd = DenseRows16(this, q16, B * T, H * D, q_ld);
  uint16_t* kd = DenseRows16(this, k16, B * T, Hkv * D, kv_ld);
  uint16_t* vd = DenseRows16(this, v16, B * T, Hkv * D, kv_ld);
  if (qd != nullptr || kd != nullptr || vd != nullptr) {
    AttentionBackwardBf16SavedTo16(qd ? qd : q16, kd ? kd : k16, vd ? vd : v16, out16, dout16, lse,
                                   B, T, H, Hkv, D, dq16, dk16, dv16, H * D, Hkv * D);
    for (uint16_t* p : {qd, kd, vd}) {
      if (p != nullptr) Free(p);
    }
    return;
  }
  const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
  float* buf = F32Scratch(this, 2 * nq + 2 * nk);
  float *dq = buf, *dk = dq + nq, *dv = dk + nk, *dout = dv + nk;
  UnpackBf16(dout16, dout, nq);
  AttentionBackwardBf16Saved(q16, k16, v16, out16, dout, lse, B, T, H, Hkv, D, dq, dk, dv);
  PackBf16(dq, dq16, nq);
  PackBf16(dk, dk16, nk);
  PackBf16(dv, dv16, nk);
  Free(buf);
}


void Backend::SwigluCastFp8(const uint16_t* gate16, const uint16_t* up16, int64_t rows,
                            int64_t cols, int64_t in_ld, const float* scale, Fp8Format fmt,
                            uint8_t* out, float* amax_out) {
  const int64_t n = rows * cols;
  float* buf = F32Scratch(this, 3 * n);
  UnpackRows(this, gate16, rows, cols, in_ld, buf);
  UnpackRows(this, up16, rows, cols, in_ld, buf + n);
  SwigluForward(buf, buf + n, n, buf + 2 * n);
  CastToFp8(buf + 2 * n, out, n, scale, fmt, amax_out);
  Free(buf);
}

void Backend::SwigluCastTransposeFp8(const uint16_t* gate16, const uint16_t* up16, int64_t rows,
                                     int64_t cols, int64_t in_ld, const float* scale,
                                     Fp8Format fmt, uint8_t* out, uint8_t* out_t,
                                     float* amax_out) {
  uint8_t* codes = out;
  if (codes == nullptr) {
    codes = static_cast<uint8_t*>(Alloc(static_cast<size_t>(rows * cols > 0 ? rows * cols : 1)));
    if (codes == nullptr) throw std::bad_alloc();
  }
  SwigluCastFp8(gate16, up16, rows, cols, in_ld, scale, fmt, codes, amax_out);
  TransposeBytes(codes, rows, cols, out_t);
  if (out == nullptr) Free(codes);
}

void Backend::SwigluBackwardBf16To16(const uint16_t* dh16, const uint16_t* gate16,
                                     const uint16_t* up16, int64_t n, uint16_t* dgate16,
                                     uint16_t* dup16) {
  float* buf = F32Scratch(this, 3 * n);
  UnpackBf16(dh16, buf + 2 * n, n);
  SwigluBackwardBf16Saved(buf + 2 * n, gate16, up16, n, buf, buf + n);
  PackBf16(buf, dgate16, n);
  PackBf16(buf + n, dup16, n);
  Free(buf);
}

void Backend::SwigluBackwardCastTransposeFp8(const uint16_t* dh16, const uint16_t* gate16,
                                             const uint16_t* up16, int64_t rows, int64_t cols,
                                             const float* scale_gate, const float* scale_up,
                                             Fp8Format fmt, uint8_t* dgate8, uint8_t* dgate8_t,
                                             uint8_t* dup8, uint8_t* dup8_t, float* amax_gate,
                                             float* amax_up, int64_t out_ld, int64_t in_ld) {
  const int64_t n = rows * cols;
  if (in_ld != cols) {  // dense copies of gate and up first
    uint16_t* g16 = DenseRows16(this, gate16, rows, cols, in_ld);
    uint16_t* u16 = DenseRows16(this, up16, rows, cols, in_ld);
    SwigluBackwardCastTransposeFp8(dh16, g16, u16, rows, cols, scale_gate, scale_up, fmt, dgate8,
                                   dgate8_t, dup8, dup8_t, amax_gate, amax_up, out_ld, cols);
    Free(u16);
    Free(g16);
    return;
  }
  // Two bf16 gradients in one scratch buffer, the second starting 8-byte aligned.
  uint16_t* dgate16 = reinterpret_cast<uint16_t*>(F32Scratch(this, n + 2));
  uint16_t* dup16 = dgate16 + ((n + 3) & ~int64_t{3});
  SwigluBackwardBf16To16(dh16, gate16, up16, n, dgate16, dup16);
  CastTransposeFp8Bf16(dgate16, rows, cols, scale_gate, fmt, dgate8, dgate8_t, amax_gate, out_ld);
  CastTransposeFp8Bf16(dup16, rows, cols, scale_up, fmt, dup8, dup8_t, amax_up, out_ld);
  Free(dgate16);
}

void Backend::AttentionBackwardBf16Compute(const float* q, const float* k, const float* v,
                                           const float* out, const float* dout, const float* lse,
                                           int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                           float* dq, float* dk, float* dv) {
  float* qr = RoundedToBf16Copy(this, q, B * T * H * D);
  float* kr = RoundedToBf16Copy(this, k, B * T * Hkv * D);
  float* vr = RoundedToBf16Copy(this, v, B * T * Hkv * D);
  float* outr = RoundedToBf16Copy(this, out, B * T * H * D);
  float* doutr = RoundedToBf16Copy(this, dout, B * T * H * D);
  AttentionBackward(qr, kr, vr, outr, doutr, lse, B, T, H, Hkv, D, dq, dk, dv);
  RoundToBf16(dq, B * T * H * D);
  RoundToBf16(dk, B * T * Hkv * D);
  RoundToBf16(dv, B * T * Hkv * D);
  for (float* p : {qr, kr, vr, outr, doutr}) Free(p);
}

BackendOptions BackendOptions::FromEnvironment() {
  BackendOptions o;
  o.cpu_fill_nan = env::IsOn(env::kCpuFillNan);
  if (env::IsOn(env::kProfileOps)) {
    const double every_s = std::atof(env::GetOrEmpty(env::kProfileOps).c_str());
    o.profile_ops_period_s = every_s > 1.0 ? every_s : 10.0;
  }
  o.gemm_verbose = env::Get(env::kGemmVerbose).has_value();
  return o;
}

std::unique_ptr<Backend> CreateBackend(const std::string& name, int device, std::string* error,
                                       const BackendOptions& options) {
  if (name == "cpu") {
#ifdef FSDP8_WITH_FAST_CPU
    if (CpuFastBackend::Supported()) return std::make_unique<CpuFastBackend>(options);
#endif
    return std::make_unique<CpuRefBackend>(options);  // named "cpu-ref": Name() says which runs
  }
  if (name == "cpu-ref") return std::make_unique<CpuRefBackend>(options);
  if (name == "cuda") {
#ifdef FSDP8_WITH_CUDA
    return CreateCudaBackend(device, error, options);
#else
    (void)device;
    if (error != nullptr) {
      *error = "backend 'cuda' is not built: configure with -DFSDP8_CUDA=ON on a machine with nvcc";
    }
    return nullptr;
#endif
  }
  if (error != nullptr) *error = "unknown backend '" + name + "': expected 'cpu', 'cpu-ref' or 'cuda'";
  return nullptr;
}

int64_t DeviceMemoryBytes(const std::string& backend, int device, std::string* error) {
  if (backend == "cuda") {
#ifdef FSDP8_WITH_CUDA
    return CudaDeviceTotalMemory(device, error);
#else
    (void)device;
    if (error != nullptr) *error = "backend 'cuda' is not built";
    return 0;
#endif
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) {
    if (error != nullptr) *error = "sysconf: physical memory unknown";
    return 0;
  }
  const int64_t physical = static_cast<int64_t>(pages) * page;
  const int64_t limit = CgroupMemoryLimitBytes();
  return limit > 0 && limit < physical ? limit : physical;
}

}  // namespace fsdp8
