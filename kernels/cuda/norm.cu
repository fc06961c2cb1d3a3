// RMSNorm (Zhang & Sennrich 2019; HF LlamaRMSNorm) forward and backward.
//   y = x * r * w,  r = 1 / sqrt(mean(x^2) + eps)                      x, y (N, C); w (C); r (N)
//   dx_i = r * w_i * dy_i - (r^3 / C) * x_i * sum_j (dy_j * w_j * x_j)   (overwrite)
//   dw_i += sum_n dy_ni * x_ni * r_n                                    (accumulate)
// dw is reduced deterministically: per chunk of kRowsPerChunk rows a partial per column, then one
// pass that sums the chunks in order. Row sums use a fixed block tree.
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerChunk = 32;

// One block per row.
__global__ void __launch_bounds__(kThreads)
RmsNormForwardKernel(const float* __restrict__ x, const float* __restrict__ w, float eps,
                     int64_t C, float* __restrict__ y, float* __restrict__ rstd) {
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * C;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += kThreads) ss += xr[c] * xr[c];
  ss = BlockSum<kThreads>(ss, red);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(C) + eps);
  float* yr = y + row * C;
  for (int64_t c = threadIdx.x; c < C; c += kThreads) yr[c] = xr[c] * r * w[c];
  if (threadIdx.x == 0) rstd[row] = r;
}

// One block per row: dx.
__global__ void __launch_bounds__(kThreads)
RmsNormBackwardDxKernel(const float* __restrict__ dy, const float* __restrict__ x,
                        const float* __restrict__ w, const float* __restrict__ rstd, int64_t C,
                        float* __restrict__ dx, const float* __restrict__ dres) {
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * C;
  const float* dyr = dy + row * C;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += kThreads) s += dyr[c] * w[c] * xr[c];
  s = BlockSum<kThreads>(s, red);
  const float r = rstd[row];
  const float k = r * r * r * s / static_cast<float>(C);
  float* dxr = dx + row * C;
  if (dres == nullptr) {
    for (int64_t c = threadIdx.x; c < C; c += kThreads) dxr[c] = r * w[c] * dyr[c] - k * xr[c];
  } else {
    const float* dresr = dres + row * C;
    for (int64_t c = threadIdx.x; c < C; c += kThreads) {
      const float v = r * w[c] * dyr[c] - k * xr[c];
      dxr[c] = __fadd_rn(v, dresr[c]);
    }
  }
}

// grid (ceil(C / kThreads), chunks): partials (chunks, C) = sum over the chunk's rows.
__global__ void RmsNormDwPartialKernel(const float* __restrict__ dy, const float* __restrict__ x,
                                       const float* __restrict__ rstd, int64_t N, int64_t C,
                                       float* __restrict__ partials) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= C) return;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kRowsPerChunk;
  const int64_t n1 = min(N, n0 + kRowsPerChunk);
  float acc = 0.0f;
  for (int64_t n = n0; n < n1; ++n) acc += dy[n * C + c] * x[n * C + c] * rstd[n];
  partials[static_cast<int64_t>(blockIdx.y) * C + c] = acc;
}

// dw (C) += sum over chunks in order.
__global__ void RmsNormDwFinalKernel(const float* __restrict__ partials, int64_t chunks, int64_t C,
                                     float* __restrict__ dw) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= C) return;
  float acc = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) acc += partials[k * C + c];
  dw[c] += acc;
}

}  // namespace

void LaunchRmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C, float* y,
                          float* rstd, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  FSDP8_CUDA_REQUIRE(N <= 0x7FFFFFFF, "RmsNormForward: too many rows");
  RmsNormForwardKernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(x, w, eps, C, y, rstd);
  FSDP8_CUDA_LAUNCH_CHECK();
}

int64_t RmsNormBackwardScratchFloats(int64_t N, int64_t C) { return CeilDiv(N, kRowsPerChunk) * C; }

void LaunchRmsNormBackward(const float* dy, const float* x, const float* w, const float* rstd,
                           int64_t N, int64_t C, float* dx, float* dw, float* partials,
                           cudaStream_t stream, const float* dres) {
  if (N <= 0 || C <= 0) return;
  RmsNormBackwardDxKernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(dy, x, w, rstd, C, dx,
                                                                           dres);
  FSDP8_CUDA_LAUNCH_CHECK();
  const int64_t chunks = CeilDiv(N, kRowsPerChunk);
  FSDP8_CUDA_REQUIRE(chunks <= 65535, "RmsNormBackward: too many rows for the dw partial grid");
  const dim3 grid(static_cast<unsigned>(CeilDiv(C, kThreads)), static_cast<unsigned>(chunks));
  RmsNormDwPartialKernel<<<grid, kThreads, 0, stream>>>(dy, x, rstd, N, C, partials);
  FSDP8_CUDA_LAUNCH_CHECK();
  RmsNormDwFinalKernel<<<static_cast<unsigned>(CeilDiv(C, kThreads)), kThreads, 0, stream>>>(
      partials, chunks, C, dw);
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
