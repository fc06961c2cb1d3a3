// Deterministic reductions (Backend: SumSquares).
//
// SumSquares: kBlocks fixed-size blocks each sum a fixed strided subset of x in double (thread
// partials, then a fixed shuffle tree), writing partials[block]; one final block sums the partials
// in a fixed order and adds the total to out[0] (in double, rounded once to f32). The grid does not
// depend on the device, so the bits do not either.
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

__global__ void SumSquaresPartialKernel(const float* __restrict__ x, int64_t n,
                                        double* __restrict__ partials) {
  __shared__ double red[kThreads / 32];
  double acc = 0.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = x[i];
    acc += v * v;
  }
  acc = BlockSum<kThreads>(acc, red);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void SumSquaresFinalKernel(const double* __restrict__ partials, int nparts, float* out) {
  __shared__ double red[kThreads / 32];
  double acc = 0.0;
  for (int i = threadIdx.x; i < nparts; i += kThreads) acc += partials[i];
  acc = BlockSum<kThreads>(acc, red);
  if (threadIdx.x == 0) out[0] = static_cast<float>(static_cast<double>(out[0]) + acc);
}

}  // namespace

int64_t SumSquaresScratchDoubles() { return kMaxBlocks; }

void LaunchSumSquares(const float* x, int64_t n, float* out, double* partials, cudaStream_t stream) {
  if (n <= 0) return;
  int64_t blocks = CeilDiv(n, kThreads * 8);
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  SumSquaresPartialKernel<<<static_cast<int>(blocks), kThreads, 0, stream>>>(x, n, partials);
  FSDP8_CUDA_LAUNCH_CHECK();
  SumSquaresFinalKernel<<<1, kThreads, 0, stream>>>(partials, static_cast<int>(blocks), out);
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
