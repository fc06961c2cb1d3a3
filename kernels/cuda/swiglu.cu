// SwiGLU activation (Backend: SwigluForward, SwigluBackward), elementwise over (N, F).
#include <cuda_runtime.h>

#include "common/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

// h (n) = silu(gate) * up.
__global__ void SwigluForwardKernel(const float* __restrict__ gate, const float* __restrict__ up,
                                    int64_t n, float* __restrict__ h) {
  FSDP8_GRID_STRIDE(i, n) { h[i] = SiluMulDev(gate[i], up[i]); }
}

// dgate, dup (n): SwigluGradDev per element.
template <typename In>
__global__ void SwigluBackwardKernel(const float* __restrict__ dh, const In* __restrict__ gate,
                                     const In* __restrict__ up, int64_t n,
                                     float* __restrict__ dgate, float* __restrict__ dup) {
  FSDP8_GRID_STRIDE(i, n) { SwigluGradDev(dh[i], LoadF32(gate + i), LoadF32(up + i), &dgate[i], &dup[i]); }
}

// All-bf16 backward, 4 elements per thread (8-byte loads and stores), the same math per element.
__global__ void SwigluBackward16Kernel(const uint16_t* __restrict__ dh, const uint16_t* __restrict__ gate,
                                       const uint16_t* __restrict__ up, int64_t n,
                                       uint16_t* __restrict__ dgate, uint16_t* __restrict__ dup,
                                       bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n4 = vec ? n / 4 : 0;
  for (int64_t i = tid; i < n4; i += stride) {
    const float4 d = Load4F32(dh + 4 * i), g = Load4F32(gate + 4 * i), u = Load4F32(up + 4 * i);
    float4 dg, du;
    SwigluGradDev(d.x, g.x, u.x, &dg.x, &du.x);
    SwigluGradDev(d.y, g.y, u.y, &dg.y, &du.y);
    SwigluGradDev(d.z, g.z, u.z, &dg.z, &du.z);
    SwigluGradDev(d.w, g.w, u.w, &dg.w, &du.w);
    Store4F32(dgate + 4 * i, dg);
    Store4F32(dup + 4 * i, du);
  }
  for (int64_t i = n4 * 4 + tid; i < n; i += stride) {
    float dg, du;
    SwigluGradDev(LoadF32(dh + i), LoadF32(gate + i), LoadF32(up + i), &dg, &du);
    StoreF32(dgate + i, dg);
    StoreF32(dup + i, du);
  }
}

// out = fp8(h * scale), h = silu(g) * up exactly as SwigluForwardKernel (same expression).
template <bool kE5M2>
__global__ void SwigluCastKernel(const uint16_t* __restrict__ gate, const uint16_t* __restrict__ up,
                                 int64_t n, const float* __restrict__ scale,
                                 uint8_t* __restrict__ out, float* amax_out, bool vec) {
  __shared__ int red[kEltThreads / 32];
  const float sc = *scale;
  int m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n4 = vec ? n / 4 : 0;
  for (int64_t i = tid; i < n4; i += stride) {
    const float4 g = Load4F32(gate + 4 * i), u = Load4F32(up + 4 * i);
    const float h0 = SiluMulDev(g.x, u.x), h1 = SiluMulDev(g.y, u.y), h2 = SiluMulDev(g.z, u.z),
                h3 = SiluMulDev(g.w, u.w);
    m = max(m, max(max(AbsBits(h0), AbsBits(h1)), max(AbsBits(h2), AbsBits(h3))));
    reinterpret_cast<uint32_t*>(out)[i] = Encode4Dev<kE5M2>(h0 * sc, h1 * sc, h2 * sc, h3 * sc);
  }
  for (int64_t i = n4 * 4 + tid; i < n; i += stride) {
    const float h = SiluMulDev(LoadF32(gate + i), LoadF32(up + i));
    m = max(m, AbsBits(h));
    out[i] = static_cast<uint8_t>(Encode1Dev<kE5M2>(h * sc));
  }
  if (amax_out != nullptr) {
    m = BlockMaxInt<kEltThreads>(m, red);
    if (threadIdx.x == 0) AtomicMaxAbsBits(amax_out, m);
  }
}

// SwigluCastKernel over a (rows, cols) matrix whose gate and up rows are in_ld apart (the two
// halves of one fused GEMM output): 4 columns per item, cols % 4 == 0, in_ld % 4 == 0.
template <bool kE5M2>
__global__ void SwigluCastRowsKernel(const uint16_t* __restrict__ gate,
                                     const uint16_t* __restrict__ up, int64_t rows, int64_t cols,
                                     int64_t in_ld, const float* __restrict__ scale,
                                     uint8_t* __restrict__ out, float* amax_out) {
  __shared__ int red[kEltThreads / 32];
  const float sc = *scale;
  int m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t c4 = cols / 4, n4 = rows * c4;
  for (int64_t i = tid; i < n4; i += stride) {
    const int64_t r = i / c4, c = 4 * (i - r * c4);
    const float4 g = Load4F32(gate + r * in_ld + c), u = Load4F32(up + r * in_ld + c);
    const float y0 = SiluMulDev(g.x, u.x), y1 = SiluMulDev(g.y, u.y), y2 = SiluMulDev(g.z, u.z),
                y3 = SiluMulDev(g.w, u.w);
    m = max(m, max(max(AbsBits(y0), AbsBits(y1)), max(AbsBits(y2), AbsBits(y3))));
    *reinterpret_cast<uint32_t*>(out + r * cols + c) = Encode4Dev<kE5M2>(y0 * sc, y1 * sc, y2 * sc, y3 * sc);
  }
  if (amax_out != nullptr) {
    m = BlockMaxInt<kEltThreads>(m, red);
    if (threadIdx.x == 0) AtomicMaxAbsBits(amax_out, m);
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

void LaunchSwigluBackwardBf16Saved(const float* dh, const uint16_t* gate16, const uint16_t* up16,
                                   int64_t n, float* dgate, float* dup, cudaStream_t stream) {
  if (n <= 0) return;
  SwigluBackwardKernel<uint16_t>
      <<<EltBlocks(n), kEltThreads, 0, stream>>>(dh, gate16, up16, n, dgate, dup);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchSwigluBackwardBf16To16(const uint16_t* dh16, const uint16_t* gate16, const uint16_t* up16,
                                  int64_t n, uint16_t* dgate16, uint16_t* dup16,
                                  cudaStream_t stream) {
  if (n <= 0) return;
  bool vec = true;
  for (const void* p : {static_cast<const void*>(dh16), static_cast<const void*>(gate16),
                        static_cast<const void*>(up16), static_cast<const void*>(dgate16),
                        static_cast<const void*>(dup16)}) {
    vec = vec && reinterpret_cast<uintptr_t>(p) % 8 == 0;
  }
  SwigluBackward16Kernel<<<EltBlocks(vec ? CeilDiv(n, 4) : n, 8192), kEltThreads, 0, stream>>>(
      dh16, gate16, up16, n, dgate16, dup16, vec);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchSwigluCastFp8(const uint16_t* gate16, const uint16_t* up16, int64_t rows,
                         int64_t cols, int64_t in_ld, const float* scale, Fp8Format fmt,
                         uint8_t* out, float* amax_out, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  FSDP8_CHECK(in_ld >= cols) << "SwigluCastFp8: row stride below cols";
  if (in_ld != cols) {
    FSDP8_CHECK(cols % 4 == 0 && in_ld % 4 == 0 && reinterpret_cast<uintptr_t>(gate16) % 8 == 0 &&
                reinterpret_cast<uintptr_t>(up16) % 8 == 0 &&
                reinterpret_cast<uintptr_t>(out) % 4 == 0)
        << "SwigluCastFp8: strided rows need cols % 4, in_ld % 4 and aligned pointers";
    const int blocks = EltBlocks(rows * (cols / 4), 8192);
    ForFormat(fmt, [&](auto e5m2) {
      SwigluCastRowsKernel<decltype(e5m2)::value><<<blocks, kEltThreads, 0, stream>>>(gate16, up16, rows, cols, in_ld, scale, out, amax_out);
    });
    FSDP8_CUDA_LAUNCH_CHECK();
    return;
  }
  const int64_t n = rows * cols;
  const bool vec = reinterpret_cast<uintptr_t>(gate16) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(up16) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 4 == 0;
  const int blocks = EltBlocks(vec ? CeilDiv(n, 4) : n, 8192);
  ForFormat(fmt, [&](auto e5m2) {
    SwigluCastKernel<decltype(e5m2)::value><<<blocks, kEltThreads, 0, stream>>>(gate16, up16, n, scale, out, amax_out, vec);
  });
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
