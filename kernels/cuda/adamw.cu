// AdamW on one flat f32 shard, moments in f32 or bf16 (Backend::AdamW).
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

struct AdamWScalars {
  float decay, beta2, w1, w2, step_size, bc2_sqrt, eps, grad_scale;
};

// torch.optim.AdamW single-tensor path, with the scalars precomputed by the host in double
// (AdamWHostScalarsFor, kernels/adamw_scalars.h):
//   p *= decay (= 1 - lr*wd);  m.lerp_(g', w1 = 1-b1);  v = v*b2 + w2*g'^2 (w2 = 1-b2);
//   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps),  step_size = lr / (1-b1^t),
//   bc2_sqrt = sqrt(1-b2^t), g' = g * grad_scale. The _rn intrinsics keep the compiler from
//   contracting into FMAs, so each operation rounds as the CPU reference's does.
__device__ __forceinline__ float AdamWElt(float p, float g, float& m, float& v,
                                          const AdamWScalars& s) {
  const float gi = __fmul_rn(g, s.grad_scale);
  const float pi = __fmul_rn(p, s.decay);
  m = s.w1 < 0.5f ? __fadd_rn(m, __fmul_rn(s.w1, __fsub_rn(gi, m)))
                  : __fsub_rn(gi, __fmul_rn(__fsub_rn(gi, m), __fsub_rn(1.0f, s.w1)));
  v = __fadd_rn(__fmul_rn(v, s.beta2), __fmul_rn(__fmul_rn(s.w2, gi), gi));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), s.eps);
  return __fsub_rn(pi, __fmul_rn(s.step_size, __fdiv_rn(m, denom)));
}

// M: the moments' storage, float or uint16_t (bfloat16 bits: widened on load, rounded to
// nearest even on store by device_math.cuh's Load/Store; the update of p reads the f32 values).
// kVec: four elements per iteration (p, g 16-byte aligned, m, v 4-element aligned), the n % 4
// tail scalar.
// kAmax: also raises *amax_out to max |p| of the updated weights. The grid is capped at 1024
// blocks (about 8 per SM on an H200) so that each thread covers many elements before the one
// block reduction and atomic per block.
// kPack: also writes the updated p as bfloat16 bits to p16 (8-byte aligned when kVec).
template <typename M, bool kVec, bool kAmax, bool kPack>
__global__ void AdamWKernel(float* __restrict__ p, const float* __restrict__ g, M* __restrict__ m,
                            M* __restrict__ v, int64_t n, AdamWScalars s, float* amax_out,
                            uint16_t* __restrict__ p16) {
  int amax_bits = 0;
  int64_t done = 0;
  if (kVec) {
    const int64_t n4 = n / 4;
    FSDP8_GRID_STRIDE(i, n4) {
      float4 pv = reinterpret_cast<const float4*>(p)[i];
      const float4 gv = reinterpret_cast<const float4*>(g)[i];
      float4 mv = Load4F32(m + 4 * i);
      float4 vv = Load4F32(v + 4 * i);
      pv.x = AdamWElt(pv.x, gv.x, mv.x, vv.x, s);
      pv.y = AdamWElt(pv.y, gv.y, mv.y, vv.y, s);
      pv.z = AdamWElt(pv.z, gv.z, mv.z, vv.z, s);
      pv.w = AdamWElt(pv.w, gv.w, mv.w, vv.w, s);
      reinterpret_cast<float4*>(p)[i] = pv;
      if (kPack) Store4F32(p16 + 4 * i, pv);
      Store4F32(m + 4 * i, mv);
      Store4F32(v + 4 * i, vv);
      if (kAmax) {
        amax_bits = max(amax_bits, max(max(AbsBits(pv.x), AbsBits(pv.y)),
                                       max(AbsBits(pv.z), AbsBits(pv.w))));
      }
    }
    done = n4 * 4;
  }
  for (int64_t i = done + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float mi = LoadF32(m + i), vi = LoadF32(v + i);
    const float pn = AdamWElt(p[i], g[i], mi, vi, s);
    p[i] = pn;
    if (kPack) StoreF32(p16 + i, pn);
    StoreF32(m + i, mi);
    StoreF32(v + i, vi);
    if (kAmax) amax_bits = max(amax_bits, AbsBits(pn));
  }
  if (kAmax) {
    __shared__ int red[kEltThreads / 32];
    amax_bits = BlockMaxInt<kEltThreads>(amax_bits, red);
    if (threadIdx.x == 0) AtomicMaxAbsBits(amax_out, amax_bits);
  }
}

template <typename M, bool kVec, bool kAmax>
void LaunchPack(float* p, const float* g, M* m, M* v, int64_t n, const AdamWScalars& s,
                float* amax_out, uint16_t* p16, int blocks, cudaStream_t stream) {
  if (p16 != nullptr) {
    AdamWKernel<M, kVec, kAmax, true><<<blocks, kEltThreads, 0, stream>>>(p, g, m, v, n, s,
                                                                         amax_out, p16);
  } else {
    AdamWKernel<M, kVec, kAmax, false><<<blocks, kEltThreads, 0, stream>>>(p, g, m, v, n, s,
                                                                          amax_out, nullptr);
  }
}

template <typename M, bool kVec>
void Launch(float* p, const float* g, M* m, M* v, int64_t n, const AdamWScalars& s,
            float* amax_out, uint16_t* p16, cudaStream_t stream) {
  const int blocks = EltBlocks(kVec ? CeilDiv(n, 4) : n, 1024);
  if (amax_out != nullptr) {
    LaunchPack<M, kVec, true>(p, g, m, v, n, s, amax_out, p16, blocks, stream);
  } else {
    LaunchPack<M, kVec, false>(p, g, m, v, n, s, nullptr, p16, blocks, stream);
  }
}

bool Aligned(const void* x, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(x) & (bytes - 1)) == 0;
}

template <typename M>
void LaunchAny(float* p, const float* g, M* m, M* v, int64_t n, const AdamWScalars& s,
               float* amax_out, uint16_t* p16, cudaStream_t stream) {
  if (n <= 0) return;
  const uintptr_t four = 4 * sizeof(M);  // four moments' bytes
  if (Aligned(p, 16) && Aligned(g, 16) && Aligned(m, four) && Aligned(v, four) &&
      (p16 == nullptr || Aligned(p16, 8))) {
    Launch<M, true>(p, g, m, v, n, s, amax_out, p16, stream);
  } else {
    Launch<M, false>(p, g, m, v, n, s, amax_out, p16, stream);
  }
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace

void LaunchAdamW(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                 float beta2, float w1, float w2, float step_size, float bc2_sqrt, float eps,
                 float grad_scale, float* amax_out, uint16_t* p16_out, cudaStream_t stream) {
  const AdamWScalars s{decay, beta2, w1, w2, step_size, bc2_sqrt, eps, grad_scale};
  LaunchAny(p, g, m, v, n, s, amax_out, p16_out, stream);
}

void LaunchAdamWBf16Moments(float* p, const float* g, uint16_t* m16, uint16_t* v16, int64_t n,
                            float decay, float beta2, float w1, float w2, float step_size,
                            float bc2_sqrt, float eps, float grad_scale, float* amax_out,
                            uint16_t* p16_out, cudaStream_t stream) {
  const AdamWScalars s{decay, beta2, w1, w2, step_size, bc2_sqrt, eps, grad_scale};
  LaunchAny(p, g, m16, v16, n, s, amax_out, p16_out, stream);
}

}  // namespace fsdp8::cuda
