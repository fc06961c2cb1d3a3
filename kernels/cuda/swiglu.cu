// SwiGLU activation (Backend: SwigluForward, SwigluBackward), elementwise over (N, F).
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

// h (n) = silu(gate) * up, silu(g) = g * sigmoid(g) = g / (1 + exp(-g)).
__global__ void SwigluForwardKernel(const float* __restrict__ gate, const float* __restrict__ up,
                                    int64_t n, float* __restrict__ h) {
  FSDP8_GRID_STRIDE(i, n) {
    const float g = gate[i];
    const float sig = 1.0f / (1.0f + expf(-g));
    h[i] = g * sig * up[i];
  }
}

// f32 values of f32 or bfloat16 (bit pattern) storage.
__device__ __forceinline__ float Load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float Load(const uint16_t* p, int64_t i) {
  return __uint_as_float(static_cast<uint32_t>(p[i]) << 16);
}

// dgate = dh * up * s * (1 + g * (1 - s)), dup = dh * g * s, s = sigmoid(g).
template <typename In>
__global__ void SwigluBackwardKernel(const float* __restrict__ dh, const In* __restrict__ gate,
                                     const In* __restrict__ up, int64_t n,
                                     float* __restrict__ dgate, float* __restrict__ dup) {
  FSDP8_GRID_STRIDE(i, n) {
    const float g = Load(gate, i);
    const float s = 1.0f / (1.0f + expf(-g));
    const float d = dh[i];
    dgate[i] = d * Load(up, i) * s * (1.0f + g * (1.0f - s));
    dup[i] = d * g * s;
  }
}

}  // namespace

void LaunchSwigluForward(const float* gate, const float* up, int64_t n, float* h, cudaStream_t stream) {
  if (n <= 0) return;
  SwigluForwardKernel<<<EltBlocks(n), kEltThreads, 0, stream>>>(gate, up, n, h);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchSwigluBackward(const float* dh, const float* gate, const float* up, int64_t n,
                          float* dgate, float* dup, cudaStream_t stream) {
  if (n <= 0) return;
  SwigluBackwardKernel<float><<<EltBlocks(n), kEltThreads, 0, stream>>>(dh, gate, up, n, dgate, dup);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchSwigluBackwardBf16(const float* dh, const uint16_t* gate16, const uint16_t* up16,
                              int64_t n, float* dgate, float* dup, cudaStream_t stream) {
  if (n <= 0) return;
  SwigluBackwardKernel<uint16_t>
      <<<EltBlocks(n), kEltThreads, 0, stream>>>(dh, gate16, up16, n, dgate, dup);
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
