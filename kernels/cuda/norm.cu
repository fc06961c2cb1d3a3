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

// 1 / sqrt(mean(x^2) + eps) of one row, every thread of the block calling (fixed sum order:
// thread t sums columns t, t + kThreads, ..., then the block tree).
__device__ __forceinline__ float RowRstd(const float* xr, int64_t C, float eps, float* red) {
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += kThreads) ss += xr[c] * xr[c];
  ss = BlockSum<kThreads>(ss, red);
  return 1.0f / sqrtf(ss / static_cast<float>(C) + eps);
}

// One block per row.
__global__ void __launch_bounds__(kThreads)
RmsNormForwardKernel(const float* __restrict__ x, const float* __restrict__ w, float eps,
                     int64_t C, float* __restrict__ y, float* __restrict__ rstd) {
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * C;
  const float r = RowRstd(xr, C, eps, red);
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

// dx and the dw partials in one pass over dy and x: one block per chunk of kRowsPerChunk rows,
// each thread holding kCols columns (c = tid + j * kThreads) in registers. Same expressions and
// summation orders as RmsNormBackwardDxKernel + RmsNormDwPartialKernel, so the same bits.
template <int kCols>
__global__ void __launch_bounds__(kThreads)
RmsNormBackwardFusedKernel(const float* __restrict__ dy, const float* __restrict__ x,
                           const float* __restrict__ w, const float* __restrict__ rstd, int64_t N,
                           int64_t C, float* __restrict__ dx, const float* __restrict__ dres,
                           float* __restrict__ partials) {
  __shared__ float red[kThreads / 32];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRowsPerChunk;
  const int64_t n1 = min(N, n0 + kRowsPerChunk);
  float acc[kCols], wv[kCols];
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    const int64_t c = threadIdx.x + j * kThreads;
    acc[j] = 0.0f;
    wv[j] = c < C ? w[c] : 0.0f;
  }
  // Row n's dy and x are loaded while row n-1 is reduced (software pipelining: the block
  // reduction's barriers would otherwise serialise one row's loads behind the previous row).
  float dyv[kCols], xv[kCols], dyn[kCols] = {}, xn[kCols] = {}, rv[kCols];
  auto load = [&](int64_t n, float* d, float* xx) {
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int64_t c = threadIdx.x + j * kThreads;
      d[j] = c < C ? dy[n * C + c] : 0.0f;
      xx[j] = c < C ? x[n * C + c] : 0.0f;
    }
  };
  if (n0 < n1) load(n0, dyv, xv);
  for (int64_t n = n0; n < n1; ++n) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int64_t c = threadIdx.x + j * kThreads;
      if (c < C) s += dyv[j] * wv[j] * xv[j];
      rv[j] = dres != nullptr && c < C ? dres[n * C + c] : 0.0f;
    }
    if (n + 1 < n1) load(n + 1, dyn, xn);
    s = BlockSum<kThreads>(s, red);
    const float r = rstd[n];
    const float k = r * r * r * s / static_cast<float>(C);
    float* dxr = dx + n * C;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int64_t c = threadIdx.x + j * kThreads;
      if (c >= C) continue;
      const float v = r * wv[j] * dyv[j] - k * xv[j];
      dxr[c] = dres != nullptr ? __fadd_rn(v, rv[j]) : v;
      acc[j] += dyv[j] * xv[j] * r;
    }
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      dyv[j] = dyn[j];
      xv[j] = xn[j];
    }
  }
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    const int64_t c = threadIdx.x + j * kThreads;
    if (c < C) partials[static_cast<int64_t>(blockIdx.x) * C + c] = acc[j];
  }
}

// RmsNormForwardKernel whose output y goes straight to FP8 codes: the same r (same sum order)
// and y = x * r * w, out = fp8(y * scale), amax of y; y is never stored.
template <bool kE5M2>
__global__ void __launch_bounds__(kThreads)
RmsNormCastKernel(const float* __restrict__ x, const float* __restrict__ w, float eps, int64_t C,
                  float* __restrict__ rstd, const float* __restrict__ scale,
                  uint8_t* __restrict__ out, float* amax_out, bool vec) {
  __shared__ float red[kThreads / 32];
  __shared__ int redi[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * C;
  const float r = RowRstd(xr, C, eps, red);
  const float s = *scale;
  uint8_t* outr = out + row * C;
  int m = 0;
  if (vec) {
    for (int64_t c4 = threadIdx.x; c4 < C / 4; c4 += kThreads) {
      const float4 xv = reinterpret_cast<const float4*>(xr)[c4];
      const float4 wv = reinterpret_cast<const float4*>(w)[c4];
      const float y0 = xv.x * r * wv.x, y1 = xv.y * r * wv.y, y2 = xv.z * r * wv.z,
                  y3 = xv.w * r * wv.w;
      m = max(m, max(max(AbsBits(y0), AbsBits(y1)), max(AbsBits(y2), AbsBits(y3))));
      reinterpret_cast<uint32_t*>(outr)[c4] = Encode4Dev<kE5M2>(y0 * s, y1 * s, y2 * s, y3 * s);
    }
  } else {
    for (int64_t c = threadIdx.x; c < C; c += kThreads) {
      const float y = xr[c] * r * w[c];
      m = max(m, AbsBits(y));
      outr[c] = static_cast<uint8_t>(Encode1Dev<kE5M2>(y * s));
    }
  }
  if (threadIdx.x == 0) rstd[row] = r;
  if (amax_out != nullptr) {
    m = BlockMaxInt<kThreads>(m, redi);
    if (threadIdx.x == 0) AtomicMaxAbsBits(amax_out, m);
  }
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

void LaunchRmsNormCastFp8(const float* x, const float* w, float eps, int64_t N, int64_t C,
                          float* rstd, const float* scale, Fp8Format fmt, uint8_t* out,
                          float* amax_out, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  FSDP8_CUDA_REQUIRE(N <= 0x7FFFFFFF, "RmsNormCastFp8: too many rows");
  const bool vec = C % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 4 == 0;
  if (fmt == Fp8Format::kE5M2) {
    RmsNormCastKernel<true><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(x, w, eps, C, rstd, scale, out, amax_out, vec);
  } else {
    RmsNormCastKernel<false><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(x, w, eps, C, rstd, scale, out, amax_out, vec);
  }
  FSDP8_CUDA_LAUNCH_CHECK();
}

int64_t RmsNormBackwardScratchFloats(int64_t N, int64_t C) { return CeilDiv(N, kRowsPerChunk) * C; }

void LaunchRmsNormBackward(const float* dy, const float* x, const float* w, const float* rstd,
                           int64_t N, int64_t C, float* dx, float* dw, float* partials,
                           cudaStream_t stream, const float* dres) {
  if (N <= 0 || C <= 0) return;
  const int64_t chunks = CeilDiv(N, kRowsPerChunk);
  if (C <= 16 * kThreads) {
    const unsigned blocks = static_cast<unsigned>(chunks);
    if (C <= 2 * kThreads) {
      RmsNormBackwardFusedKernel<2><<<blocks, kThreads, 0, stream>>>(dy, x, w, rstd, N, C, dx, dres, partials);
    } else if (C <= 4 * kThreads) {
      RmsNormBackwardFusedKernel<4><<<blocks, kThreads, 0, stream>>>(dy, x, w, rstd, N, C, dx, dres, partials);
    } else if (C <= 8 * kThreads) {
      RmsNormBackwardFusedKernel<8><<<blocks, kThreads, 0, stream>>>(dy, x, w, rstd, N, C, dx, dres, partials);
    } else {
      RmsNormBackwardFusedKernel<16><<<blocks, kThreads, 0, stream>>>(dy, x, w, rstd, N, C, dx, dres, partials);
    }
    FSDP8_CUDA_LAUNCH_CHECK();
  } else {
    RmsNormBackwardDxKernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(dy, x, w, rstd, C, dx,
                                                                             dres);
    FSDP8_CUDA_LAUNCH_CHECK();
    FSDP8_CUDA_REQUIRE(chunks <= 65535, "RmsNormBackward: too many rows for the dw partial grid");
    const dim3 grid(static_cast<unsigned>(CeilDiv(C, kThreads)), static_cast<unsigned>(chunks));
    RmsNormDwPartialKernel<<<grid, kThreads, 0, stream>>>(dy, x, rstd, N, C, partials);
    FSDP8_CUDA_LAUNCH_CHECK();
  }
  RmsNormDwFinalKernel<<<static_cast<unsigned>(CeilDiv(C, kThreads)), kThreads, 0, stream>>>(
      partials, chunks, C, dw);
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
