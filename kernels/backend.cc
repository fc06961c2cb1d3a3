#include "kernels/backend.h"

#include <cstdlib>

#include "kernels/cpu/cpu_backend.h"

#ifdef FSDP8_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace fsdp8 {
namespace {

// A rounded-to-bf16 device copy of n f32 values.
float* Bf16Copy(Backend* be, const float* x, int64_t n) {
  float* c = static_cast<float*>(be->Alloc(static_cast<size_t>(n) * sizeof(float)));
  if (c == nullptr) abort();  // device out of memory: the trainer sizes buffers from the spec
  be->Copy(c, x, static_cast<size_t>(n) * sizeof(float));
  be->RoundToBf16(c, n);
  return c;
}

}  // namespace

void Backend::AttentionForwardBf16(const float* q, const float* k, const float* v, int64_t B,
                                   int64_t T, int64_t H, int64_t Hkv, int64_t D, float* out,
                                   float* lse) {
  float* q16 = Bf16Copy(this, q, B * T * H * D);
  float* k16 = Bf16Copy(this, k, B * T * Hkv * D);
  float* v16 = Bf16Copy(this, v, B * T * Hkv * D);
  AttentionForward(q16, k16, v16, B, T, H, Hkv, D, out, lse);
  RoundToBf16(out, B * T * H * D);
  Free(q16);
  Free(k16);
  Free(v16);
}

void Backend::AttentionBackwardBf16Saved(const uint16_t* q16, const uint16_t* k16,
                                         const uint16_t* v16, const uint16_t* out16,
                                         const float* dout, const float* lse, int64_t B,
                                         int64_t T, int64_t H, int64_t Hkv, int64_t D, float* dq,
                                         float* dk, float* dv) {
  const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
  float* buf = static_cast<float*>(Alloc(static_cast<size_t>(2 * nq + 2 * nk) * sizeof(float)));
  if (buf == nullptr) abort();
  float *q = buf, *o = q + nq, *k = o + nq, *v = k + nk;
  UnpackBf16(q16, q, nq);
  UnpackBf16(out16, o, nq);
  UnpackBf16(k16, k, nk);
  UnpackBf16(v16, v, nk);
  AttentionBackwardBf16(q, k, v, o, dout, lse, B, T, H, Hkv, D, dq, dk, dv);
  Free(buf);
}

void Backend::SwigluBackwardBf16(const float* dh, const uint16_t* gate16, const uint16_t* up16,
                                 int64_t n, float* dgate, float* dup) {
  float* buf = static_cast<float*>(Alloc(static_cast<size_t>(2 * n) * sizeof(float)));
  if (buf == nullptr) abort();
  UnpackBf16(gate16, buf, n);
  UnpackBf16(up16, buf + n, n);
  SwigluBackward(dh, buf, buf + n, n, dgate, dup);
  Free(buf);
}

void Backend::AttentionBackwardBf16(const float* q, const float* k, const float* v,
                                    const float* out, const float* dout, const float* lse,
                                    int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                    float* dq, float* dk, float* dv) {
  float* q16 = Bf16Copy(this, q, B * T * H * D);
  float* k16 = Bf16Copy(this, k, B * T * Hkv * D);
  float* v16 = Bf16Copy(this, v, B * T * Hkv * D);
  float* o16 = Bf16Copy(this, out, B * T * H * D);
  float* do16 = Bf16Copy(this, dout, B * T * H * D);
  AttentionBackward(q16, k16, v16, o16, do16, lse, B, T, H, Hkv, D, dq, dk, dv);
  RoundToBf16(dq, B * T * H * D);
  RoundToBf16(dk, B * T * Hkv * D);
  RoundToBf16(dv, B * T * Hkv * D);
  for (float* p : {q16, k16, v16, o16, do16}) Free(p);
}

std::unique_ptr<Backend> CreateBackend(const std::string& name, int device, std::string* error) {
  if (name == "cpu") return std::make_unique<CpuBackend>();
  if (name == "cuda") {
#ifdef FSDP8_WITH_CUDA
    return CreateCudaBackend(device, error);
#else
    (void)device;
    if (error != nullptr) {
      *error = "backend 'cuda' is not built: configure with -DFSDP8_CUDA=ON on a machine with nvcc";
    }
    return nullptr;
#endif
  }
  if (error != nullptr) *error = "unknown backend '" + name + "': expected 'cpu' or 'cuda'";
  return nullptr;
}

}  // namespace fsdp8
