// AdamW on one flat f32 shard (Backend: AdamW).
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

// torch.optim.AdamW single-tensor path, with the scalars precomputed by the host in double:
//   p *= decay (= 1 - lr*wd);  m.lerp_(g', w1 = 1-b1);  v = v*b2 + w2*g'^2 (w2 = 1-b2);
//   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps),  step_size = lr / (1-b1^t),
//   bc2_sqrt = sqrt(1-b2^t), g' = g * grad_scale. The _rn intrinsics keep the compiler from
//   contracting into FMAs, so each operation rounds as the CPU reference's does.
// kAmax: also raises *amax_out to max |p| of the updated weights (one atomic per block).
template <bool kAmax>
__global__ void AdamWKernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                            float* __restrict__ v, int64_t n, float decay, float beta2, float w1,
                            float w2, float step_size, float bc2_sqrt, float eps, float grad_scale,
                            float* amax_out) {
  int amax_bits = 0;
  FSDP8_GRID_STRIDE(i, n) {
    const float gi = __fmul_rn(g[i], grad_scale);
    const float pi = __fmul_rn(p[i], decay);
    float mi = m[i];
    mi = w1 < 0.5f ? __fadd_rn(mi, __fmul_rn(w1, __fsub_rn(gi, mi)))
                   : __fsub_rn(gi, __fmul_rn(__fsub_rn(gi, mi), __fsub_rn(1.0f, w1)));
    const float vi = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(w2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
    const float pn = __fsub_rn(pi, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
    p[i] = pn;
    if (kAmax) amax_bits = max(amax_bits, AbsBits(pn));
  }
  if (kAmax) {
    __shared__ int red[kEltThreads / 32];
    amax_bits = BlockMaxInt<kEltThreads>(amax_bits, red);
    if (threadIdx.x == 0) AtomicMaxAbsBits(amax_out, amax_bits);
  }
}

}  // namespace

void LaunchAdamW(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                 float beta2, float w1, float w2, float step_size, float bc2_sqrt, float eps,
                 float grad_scale, float* amax_out, cudaStream_t stream) {
  if (n <= 0) return;
  if (amax_out != nullptr) {
    AdamWKernel<true><<<EltBlocks(n), kEltThreads, 0, stream>>>(
        p, g, m, v, n, decay, beta2, w1, w2, step_size, bc2_sqrt, eps, grad_scale, amax_out);
  } else {
    AdamWKernel<false><<<EltBlocks(n), kEltThreads, 0, stream>>>(
        p, g, m, v, n, decay, beta2, w1, w2, step_size, bc2_sqrt, eps, grad_scale, nullptr);
  }
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
