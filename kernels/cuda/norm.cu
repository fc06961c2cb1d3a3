// RMSNorm (Zhang & Sennrich 2019; HF LlamaRMSNorm) forward and backward.
//   y = x * r * w,  r = 1 / sqrt(mean(x^2) + eps)                      x, y (N, C); w (C); r (N)
//   dx_i = r * w_i * dy_i - (r^3 / C) * x_i * sum_j (dy_j * w_j * x_j)   (overwrite)
//   dw_i += sum_n dy_ni * x_ni * r_n                                    (accumulate)
// dw is reduced deterministically: per chunk of kRowsPerChunk rows a partial per column, then one
// pass that sums the chunks in a fixed order (RmsNormDwFinalKernel). Row sums use a fixed block tree.
#include <algorithm>

#include <cuda_runtime.h>

#include "common/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

constexpr int kThreads = 256;
// Rows per block of the fused backward (and per dw partial): 16 gives 1024 blocks at N = 16384,
// about two full waves at 3-4 resident blocks per multiprocessor (32 left a 30 % full second wave).
constexpr int kRowsPerChunk = 16;
constexpr int64_t kMaxFusedNormCols = 16 * kThreads;  // RmsNormBackwardFusedKernel<16>

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

// grid (ceil(C / kThreads), min(chunks, 65535)): partials (chunks, C) = sum over the chunk's
// rows. grid.y is capped at 65535 (CUDA's limit), so a block strides over chunks when N is larger.
__global__ void RmsNormDwPartialKernel(const float* __restrict__ dy, const float* __restrict__ x,
                                       const float* __restrict__ rstd, int64_t N, int64_t C,
                                       float* __restrict__ partials) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= C) return;
  const int64_t chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
  for (int64_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    const int64_t n0 = chunk * kRowsPerChunk;
    const int64_t n1 = min(N, n0 + kRowsPerChunk);
    float acc = 0.0f;
    for (int64_t n = n0; n < n1; ++n) acc += dy[n * C + c] * x[n * C + c] * rstd[n];
    partials[chunk * C + c] = acc;
  }
}

// dx and the dw partials in one pass over dy and x: one block per chunk of kRowsPerChunk rows,
// each thread holding kCols columns (c = tid + j * kThreads) in registers. Same expressions and
// summation orders as RmsNormBackwardDxKernel + RmsNormDwPartialKernel, so the same bits.
// dy element i: stored f32, or the f32 sum (a + b) + c of bf16 parts (c optional), added in that
// order as the reference composition does.
struct DyF32 {
  const float* p;
  __device__ __forceinline__ float operator[](int64_t i) const { return p[i]; }
};
struct DyBf16Parts {
  const uint16_t* a;
  const uint16_t* b;
  const uint16_t* c;
  __device__ __forceinline__ float operator[](int64_t i) const {
    float v = LoadF32(a + i);
    if (b != nullptr) v = __fadd_rn(v, LoadF32(b + i));
    return c != nullptr ? __fadd_rn(v, LoadF32(c + i)) : v;
  }
};

template <int kCols, typename Dy>
__global__ void __launch_bounds__(kThreads)
RmsNormBackwardFusedKernel(const Dy dy, const float* __restrict__ x,
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

// RmsNormBackwardFusedKernel for dy given as bf16 parts (DyBf16Parts) with 4 consecutive
// columns per thread (c = 4 * (tid + j * kThreads)): 8-byte part loads and 16-byte f32 loads and
// stores, where one column per thread made the bf16 loads 2 bytes each and the kernel latency-
// bound. Same expressions per element; the block sum s adds each thread's 4 columns in order
// first, so its rounding differs from the f32 kernel's (both are within the CPU tolerance).
// Needs C % 4 == 0 and 16-byte aligned f32 rows (checked by the launcher).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
RmsNormBackwardParts4Kernel(const DyBf16Parts dy, const float* __restrict__ x,
                            const float* __restrict__ w, const float* __restrict__ rstd, int64_t N,
                            int64_t C, float* __restrict__ dx, const float* __restrict__ dres,
                            float* __restrict__ partials) {
  __shared__ float red[kThreads / 32];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRowsPerChunk;
  const int64_t n1 = min(N, n0 + kRowsPerChunk);
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float4 acc[kVec], wv[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int64_t c = 4 * (threadIdx.x + j * kThreads);
    acc[j] = zero;
    wv[j] = c < C ? *reinterpret_cast<const float4*>(w + c) : zero;
  }
  auto dy4 = [&](int64_t i) {
    float4 v = Load4F32(dy.a + i);
    if (dy.b != nullptr) {
      const float4 b = Load4F32(dy.b + i);
      v = make_float4(__fadd_rn(v.x, b.x), __fadd_rn(v.y, b.y), __fadd_rn(v.z, b.z), __fadd_rn(v.w, b.w));
    }
    if (dy.c != nullptr) {
      const float4 c = Load4F32(dy.c + i);
      v = make_float4(__fadd_rn(v.x, c.x), __fadd_rn(v.y, c.y), __fadd_rn(v.z, c.z), __fadd_rn(v.w, c.w));
    }
    return v;
  };
  float4 dyv[kVec], xv[kVec], dyn[kVec], xn[kVec], rv[kVec];
  auto load = [&](int64_t n, float4* d, float4* xx) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t c = 4 * (threadIdx.x + j * kThreads);
      d[j] = c < C ? dy4(n * C + c) : zero;
      xx[j] = c < C ? *reinterpret_cast<const float4*>(x + n * C + c) : zero;
    }
  };
  if (n0 < n1) load(n0, dyv, xv);
  for (int64_t n = n0; n < n1; ++n) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t c = 4 * (threadIdx.x + j * kThreads);
      s += dyv[j].x * wv[j].x * xv[j].x;
      s += dyv[j].y * wv[j].y * xv[j].y;
      s += dyv[j].z * wv[j].z * xv[j].z;
      s += dyv[j].w * wv[j].w * xv[j].w;
      rv[j] = dres != nullptr && c < C ? *reinterpret_cast<const float4*>(dres + n * C + c) : zero;
    }
    if (n + 1 < n1) load(n + 1, dyn, xn);
    s = BlockSum<kThreads>(s, red);
    const float r = rstd[n];
    const float k = r * r * r * s / static_cast<float>(C);
    float* dxr = dx + n * C;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t c = 4 * (threadIdx.x + j * kThreads);
      if (c >= C) continue;
      auto one = [&](float d, float ww, float xx, float res, float* a) {
        const float v = r * ww * d - k * xx;
        *a += d * xx * r;
        return dres != nullptr ? __fadd_rn(v, res) : v;
      };
      float4 o;
      o.x = one(dyv[j].x, wv[j].x, xv[j].x, rv[j].x, &acc[j].x);
      o.y = one(dyv[j].y, wv[j].y, xv[j].y, rv[j].y, &acc[j].y);
      o.z = one(dyv[j].z, wv[j].z, xv[j].z, rv[j].z, &acc[j].z);
      o.w = one(dyv[j].w, wv[j].w, xv[j].w, rv[j].w, &acc[j].w);
      *reinterpret_cast<float4*>(dxr + c) = o;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      dyv[j] = dyn[j];
      xv[j] = xn[j];
    }
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int64_t c = 4 * (threadIdx.x + j * kThreads);
    if (c < C) *reinterpret_cast<float4*>(partials + static_cast<int64_t>(blockIdx.x) * C + c) = acc[j];
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

// RmsNormCastKernel with the row held in registers: kVec float4 of x per thread (C <= 4 * kVec *
// kThreads, C % 4 == 0), so x is read from memory once (RmsNormCastKernel reads each row twice,
// the second time through the cache), and kCastRows rows per block, whose amax is one atomic.
// Each thread sums its 4 * kVec squares in order, then the block tree: r's rounding differs
// from RowRstd's by a few ulps (within the CPU tolerance, like the other fused norm kernels).
constexpr int kCastRows = 4;
template <int kVec, bool kE5M2>
__global__ void __launch_bounds__(kThreads)
RmsNormCastRegsKernel(const float* __restrict__ x, const float* __restrict__ w, float eps,
                      int64_t N, int64_t C, float* __restrict__ rstd,
                      const float* __restrict__ scale, uint8_t* __restrict__ out,
                      float* amax_out) {
  __shared__ float red[kThreads / 32];
  __shared__ int redi[kThreads / 32];
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float4 wv[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int64_t c = 4 * (threadIdx.x + j * kThreads);
    wv[j] = c < C ? *reinterpret_cast<const float4*>(w + c) : zero;
  }
  const float s = *scale;
  int m = 0;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kCastRows;
  const int64_t row1 = min(N, row0 + kCastRows);
  for (int64_t row = row0; row < row1; ++row) {
    const float* xr = x + row * C;
    float4 xv[kVec];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t c = 4 * (threadIdx.x + j * kThreads);
      xv[j] = c < C ? *reinterpret_cast<const float4*>(xr + c) : zero;
      ss += xv[j].x * xv[j].x;
      ss += xv[j].y * xv[j].y;
      ss += xv[j].z * xv[j].z;
      ss += xv[j].w * xv[j].w;
    }
    ss = BlockSum<kThreads>(ss, red);
    const float r = 1.0f / sqrtf(ss / static_cast<float>(C) + eps);
    uint8_t* outr = out + row * C;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t c = 4 * (threadIdx.x + j * kThreads);
      if (c < C) {
        const float y0 = xv[j].x * r * wv[j].x, y1 = xv[j].y * r * wv[j].y,
                    y2 = xv[j].z * r * wv[j].z, y3 = xv[j].w * r * wv[j].w;
        m = max(m, max(max(AbsBits(y0), AbsBits(y1)), max(AbsBits(y2), AbsBits(y3))));
        *reinterpret_cast<uint32_t*>(outr + c) = Encode4Dev<kE5M2>(y0 * s, y1 * s, y2 * s, y3 * s);
      }
    }
    if (threadIdx.x == 0) rstd[row] = r;
  }
  if (amax_out != nullptr) {
    m = BlockMaxInt<kThreads>(m, redi);
    if (threadIdx.x == 0) AtomicMaxAbsBits(amax_out, m);
  }
}

template <bool kE5M2>
bool LaunchRmsNormCastRegs(const float* x, const float* w, float eps, int64_t N, int64_t C,
                           float* rstd, const float* scale, uint8_t* out, float* amax_out,
                           cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(CeilDiv(N, kCastRows));
  if (C <= 4 * kThreads) {
    RmsNormCastRegsKernel<1, kE5M2><<<blocks, kThreads, 0, stream>>>(x, w, eps, N, C, rstd, scale, out, amax_out);
  } else if (C <= 8 * kThreads) {
    RmsNormCastRegsKernel<2, kE5M2><<<blocks, kThreads, 0, stream>>>(x, w, eps, N, C, rstd, scale, out, amax_out);
  } else if (C <= 16 * kThreads) {
    RmsNormCastRegsKernel<4, kE5M2><<<blocks, kThreads, 0, stream>>>(x, w, eps, N, C, rstd, scale, out, amax_out);
  } else {
    return false;
  }
  FSDP8_CUDA_LAUNCH_CHECK();
  return true;
}

// dw (C) += sum over chunks in a fixed order.
// dw (C) += sum over chunks of partials (chunks, C). Block: 32 columns x 8 lanes; lane j adds
// chunks j, j + 8, ... in order, then lane 0 adds the 8 lane sums in lane order (a fixed order,
// so deterministic). One thread per column had left a 2048-column sum on 8 multiprocessors, each
// thread walking all chunks.
constexpr int kDwLanes = kThreads / 32;
__global__ void __launch_bounds__(kThreads)
RmsNormDwFinalKernel(const float* __restrict__ partials, int64_t chunks, int64_t C,
                     float* __restrict__ dw) {
  __shared__ float part[kDwLanes][33];
  const int col = threadIdx.x & 31, lane = threadIdx.x >> 5;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + col;
  float acc = 0.0f;
  if (c < C) {
    for (int64_t k = lane; k < chunks; k += kDwLanes) acc += partials[k * C + c];
  }
  part[lane][col] = acc;
  __syncthreads();
  if (lane == 0 && c < C) {
    float sum = part[0][col];
#pragma unroll
    for (int j = 1; j < kDwLanes; ++j) sum += part[j][col];
    dw[c] += sum;
  }
}

}  // namespace

void LaunchRmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C, float* y,
                          float* rstd, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  FSDP8_CHECK(N <= 0x7FFFFFFF) << "RmsNormForward: too many rows";
  RmsNormForwardKernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(x, w, eps, C, y, rstd);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchRmsNormCastFp8(const float* x, const float* w, float eps, int64_t N, int64_t C,
                          float* rstd, const float* scale, Fp8Format fmt, uint8_t* out,
                          float* amax_out, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  FSDP8_CHECK(N <= 0x7FFFFFFF) << "RmsNormCastFp8: too many rows";
  const bool vec = C % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 4 == 0;
  if (vec && (fmt == Fp8Format::kE5M2
                  ? LaunchRmsNormCastRegs<true>(x, w, eps, N, C, rstd, scale, out, amax_out, stream)
                  : LaunchRmsNormCastRegs<false>(x, w, eps, N, C, rstd, scale, out, amax_out, stream))) {
    return;
  }
  ForFormat(fmt, [&](auto e5m2) {
    RmsNormCastKernel<decltype(e5m2)::value><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(x, w, eps, C, rstd, scale, out, amax_out, vec);
  });
  FSDP8_CUDA_LAUNCH_CHECK();
}

int64_t RmsNormBackwardScratchFloats(int64_t N, int64_t C) { return CeilDiv(N, kRowsPerChunk) * C; }

namespace {
template <typename Dy>
void LaunchRmsNormBackwardFused(const Dy& dy, const float* x, const float* w, const float* rstd,
                                int64_t N, int64_t C, float* dx, const float* dres,
                                float* partials, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(CeilDiv(N, kRowsPerChunk));
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
}
}  // namespace

bool LaunchRmsNormBackwardBf16Parts(const uint16_t* dy_a, const uint16_t* dy_b,
                                    const uint16_t* dy_c, const float* x, const float* w,
                                    const float* rstd, int64_t N, int64_t C, float* dx, float* dw,
                                    float* partials, cudaStream_t stream, const float* dres) {
  if (C > kMaxFusedNormCols || (dy_b == nullptr && dy_c != nullptr)) return false;
  if (N <= 0 || C <= 0) return true;
  bool vec4 = C % 4 == 0;
  for (const void* p : {static_cast<const void*>(x), static_cast<const void*>(w),
                        static_cast<const void*>(dx), static_cast<const void*>(dres),
                        static_cast<const void*>(partials)}) {
    vec4 = vec4 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  }
  for (const void* p : {static_cast<const void*>(dy_a), static_cast<const void*>(dy_b),
                        static_cast<const void*>(dy_c)}) {
    vec4 = vec4 && reinterpret_cast<uintptr_t>(p) % 8 == 0;
  }
  const DyBf16Parts dy{dy_a, dy_b, dy_c};
  const unsigned blocks = static_cast<unsigned>(CeilDiv(N, kRowsPerChunk));
  if (vec4 && C <= 4 * kThreads) {
    RmsNormBackwardParts4Kernel<1><<<blocks, kThreads, 0, stream>>>(dy, x, w, rstd, N, C, dx, dres, partials);
    FSDP8_CUDA_LAUNCH_CHECK();
  } else if (vec4 && C <= 8 * kThreads) {
    RmsNormBackwardParts4Kernel<2><<<blocks, kThreads, 0, stream>>>(dy, x, w, rstd, N, C, dx, dres, partials);
    FSDP8_CUDA_LAUNCH_CHECK();
  } else if (vec4) {
    RmsNormBackwardParts4Kernel<4><<<blocks, kThreads, 0, stream>>>(dy, x, w, rstd, N, C, dx, dres, partials);
    FSDP8_CUDA_LAUNCH_CHECK();
  } else {
    LaunchRmsNormBackwardFused(dy, x, w, rstd, N, C, dx, dres, partials, stream);
  }
  RmsNormDwFinalKernel<<<static_cast<unsigned>(CeilDiv(C, 32)), kThreads, 0, stream>>>(
      partials, CeilDiv(N, kRowsPerChunk), C, dw);
  FSDP8_CUDA_LAUNCH_CHECK();
  return true;
}

void LaunchRmsNormBackward(const float* dy, const float* x, const float* w, const float* rstd,
                           int64_t N, int64_t C, float* dx, float* dw, float* partials,
                           cudaStream_t stream, const float* dres) {
  if (N <= 0 || C <= 0) return;
  const int64_t chunks = CeilDiv(N, kRowsPerChunk);
  if (C <= kMaxFusedNormCols) {
    LaunchRmsNormBackwardFused(DyF32{dy}, x, w, rstd, N, C, dx, dres, partials, stream);
  } else {
    RmsNormBackwardDxKernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(dy, x, w, rstd, C, dx,
                                                                             dres);
    FSDP8_CUDA_LAUNCH_CHECK();
    const dim3 grid(static_cast<unsigned>(CeilDiv(C, kThreads)),
                    static_cast<unsigned>(std::min<int64_t>(chunks, 65535)));
    RmsNormDwPartialKernel<<<grid, kThreads, 0, stream>>>(dy, x, rstd, N, C, partials);
    FSDP8_CUDA_LAUNCH_CHECK();
  }
  RmsNormDwFinalKernel<<<static_cast<unsigned>(CeilDiv(C, 32)), kThreads, 0, stream>>>(
      partials, chunks, C, dw);
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
