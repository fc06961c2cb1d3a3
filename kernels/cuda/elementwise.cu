// Elementwise f32 ops (Backend: Add, Axpy).
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

// out (n) = a + b
__global__ void AddKernel(const float* __restrict__ a, const float* __restrict__ b,
                          float* __restrict__ out, int64_t n) {
  FSDP8_GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

// y (n) += alpha * x. Written as a separate multiply and add (no FMA contraction) so that the
// result rounds as the CPU's `y + alpha * x` does.
__global__ void AxpyKernel(float alpha, const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  FSDP8_GRID_STRIDE(i, n) y[i] = __fadd_rn(y[i], __fmul_rn(alpha, x[i]));
}

}  // namespace

void LaunchAdd(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  AddKernel<<<EltBlocks(n), kEltThreads, 0, stream>>>(a, b, out, n);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchAxpy(float alpha, const float* x, float* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  AxpyKernel<<<EltBlocks(n), kEltThreads, 0, stream>>>(alpha, x, y, n);
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
