// AdamW on one flat f32 shard (Backend: AdamW). The bias corrections 1 - beta^t are computed by
// the caller in double and passed as f32.
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

constexpr int kThreads = 256;
int Blocks(int64_t n) {
  const int64_t b = CeilDiv(n, kThreads);
  return static_cast<int>(b < 16384 ? (b < 1 ? 1 : b) : 16384);
}
#define FSDP8_GRID_STRIDE(i, n)                                                             \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// torch.optim.AdamW, one flat shard (see backend.h). bc1 = 1 - beta1^t, bc2 = 1 - beta2^t.
__global__ void AdamWKernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                            float* __restrict__ v, int64_t n, float lr, float beta1, float beta2,
                            float eps, float weight_decay, float bc1, float bc2, float grad_scale) {
  FSDP8_GRID_STRIDE(i, n) {
    float pi = p[i];
    pi -= lr * weight_decay * pi;
    const float gi = g[i] * grad_scale;
    const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    pi -= lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
    p[i] = pi;
  }
}

}  // namespace

void LaunchAdamW(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
                 float beta2, float eps, float weight_decay, float bc1, float bc2,
                 float grad_scale, cudaStream_t stream) {
  if (n <= 0) return;
  AdamWKernel<<<Blocks(n), kThreads, 0, stream>>>(p, g, m, v, n, lr, beta1, beta2, eps,
                                                  weight_decay, bc1, bc2, grad_scale);
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
