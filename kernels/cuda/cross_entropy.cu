// Softmax cross-entropy fused with its gradient (Backend: CrossEntropyForwardBackward).
//   logits (N, V) f32 in -> dlogits (N, V) = (softmax - onehot(target)) * grad_scale (in place,
//   or as bf16 into a separate buffer)
//   losses (N) = logsumexp(row) - row[target]   (nats)
// One block per row. Pass 1 reads the row once with an online max/sum (Milakov & Gimelshein 2018,
// "Online normalizer calculation for softmax"); the per-thread (max, sum) pairs merge in a fixed
// tree. Pass 2 reads the row again and writes the gradient; no probability buffer is kept.
#include <cuda_runtime.h>

#include "common/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ void Merge(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;  // both empty
  s = s * expf(m - mn) + s2 * expf(m2 - mn);
  m = mn;
}

// G: float (the gradient over the logits, in place: grad == logits) or uint16_t (bf16 bits).
template <typename G>
__global__ void __launch_bounds__(kThreads)
CrossEntropyKernel(const float* logits, const int32_t* __restrict__ targets, int64_t V,
                   float grad_scale, float* __restrict__ losses, G* grad) {
  __shared__ float sm_m[kThreads / 32], sm_s[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * V;
  G* g = grad + row * V;
  const int64_t target = targets[row];
  const float xt = x[target];
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) {
    const float v = x[j];
    if (v > m) {
      s = s * expf(m - v) + 1.0f;
      m = v;
    } else {
      s += expf(v - m);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, o);
    const float s2 = __shfl_xor_sync(0xFFFFFFFFu, s, o);
    Merge(m, s, m2, s2);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sm_m[warp] = m;
    sm_s[warp] = s;
  }
  __syncthreads();
  m = lane < kThreads / 32 ? sm_m[lane] : -INFINITY;
  s = lane < kThreads / 32 ? sm_s[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, o);
    const float s2 = __shfl_xor_sync(0xFFFFFFFFu, s, o);
    Merge(m, s, m2, s2);
  }
  const float lse = m + logf(s);
  if (threadIdx.x == 0) losses[row] = lse - xt;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) {
    const float p = expf(x[j] - lse);
    StoreF32(g + j, (p - (j == target ? 1.0f : 0.0f)) * grad_scale);
  }
}

}  // namespace

void LaunchCrossEntropy(float* logits, const int32_t* targets, int64_t N, int64_t V,
                        float grad_scale, float* losses, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  FSDP8_CHECK(N <= 0x7FFFFFFF) << "CrossEntropy: too many rows";
  CrossEntropyKernel<float><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(logits, targets, V, grad_scale, losses, logits);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchCrossEntropyBf16Grad(const float* logits, const int32_t* targets, int64_t N, int64_t V,
                                float grad_scale, float* losses, uint16_t* dlogits16,
                                cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  FSDP8_CHECK(N <= 0x7FFFFFFF) << "CrossEntropy: too many rows";
  CrossEntropyKernel<uint16_t><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(logits, targets, V, grad_scale, losses, dlogits16);
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
