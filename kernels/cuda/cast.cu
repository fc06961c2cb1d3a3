// FP8 casts, transposes, amax and bfloat16 rounding (Backend: CastToFp8, CastTransposeFp8,
// TransposeBytes, DequantizeFp8, AmaxAccumulate, RoundToBf16, PackBf16, UnpackBf16).
//
// Bit-exact with the CPU reference: the encoders in device_math.cuh (hardware cvt plus a NaN/sign
// fix-up, see CvtFp8x2Dev) give the codes of kernels/fp8.h. amax uses atomicMax on |x| bits, which is order-independent (device_math.cuh).
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

constexpr int64_t kMaxCastBlocks = 8192;  // grid-stride beyond this
int CastBlocks(int64_t n_items) { return EltBlocks(n_items, kMaxCastBlocks); }

// in (n) -> out (n); 4 elements per iteration when in/out are 16/4-byte aligned (`vec`).
template <bool kE5M2>
__global__ void CastToFp8Kernel(const float* __restrict__ in, uint8_t* __restrict__ out, int64_t n,
                                const float* __restrict__ scale, float* amax_out, bool vec) {
  __shared__ int red[kEltThreads / 32];
  const float s = *scale;
  int m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    const int64_t n4 = n / 4;
    const float4* in4 = reinterpret_cast<const float4*>(in);
    uint32_t* out4 = reinterpret_cast<uint32_t*>(out);
    for (int64_t i = tid; i < n4; i += stride) {
      const float4 x = in4[i];
      m = max(m, max(max(AbsBits(x.x), AbsBits(x.y)), max(AbsBits(x.z), AbsBits(x.w))));
      out4[i] = Encode4Dev<kE5M2>(x.x * s, x.y * s, x.z * s, x.w * s);
    }
    for (int64_t i = n4 * 4 + tid; i < n; i += stride) {
      const float x = in[i];
      m = max(m, AbsBits(x));
      out[i] = static_cast<uint8_t>(Encode1Dev<kE5M2>(x * s));
    }
  } else {
    for (int64_t i = tid; i < n; i += stride) {
      const float x = in[i];
      m = max(m, AbsBits(x));
      out[i] = static_cast<uint8_t>(Encode1Dev<kE5M2>(x * s));
    }
  }
  if (amax_out != nullptr) {
    m = BlockMaxInt<kEltThreads>(m, red);
    if (threadIdx.x == 0) AtomicMaxAbsBits(amax_out, m);
  }
}

// in (n) bf16 bits -> out (n); 8 elements per iteration when in/out are 16/8-byte aligned.
template <bool kE5M2>
__global__ void CastBf16ToFp8Kernel(const uint16_t* __restrict__ in, uint8_t* __restrict__ out,
                                    int64_t n, const float* __restrict__ scale, float* amax_out,
                                    bool vec) {
  __shared__ int red[kEltThreads / 32];
  const float s = *scale;
  int m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n8 = vec ? n / 8 : 0;
  for (int64_t i = tid; i < n8; i += stride) {
    const float4 a = Load4F32(in + 8 * i), b = Load4F32(in + 8 * i + 4);
    m = max(m, max(max(AbsBits(a.x), AbsBits(a.y)), max(AbsBits(a.z), AbsBits(a.w))));
    m = max(m, max(max(AbsBits(b.x), AbsBits(b.y)), max(AbsBits(b.z), AbsBits(b.w))));
    reinterpret_cast<uint2*>(out)[i] =
        make_uint2(Encode4Dev<kE5M2>(a.x * s, a.y * s, a.z * s, a.w * s),
                   Encode4Dev<kE5M2>(b.x * s, b.y * s, b.z * s, b.w * s));
  }
  for (int64_t i = n8 * 8 + tid; i < n; i += stride) {
    const float x = LoadF32(in + i);
    m = max(m, AbsBits(x));
    out[i] = static_cast<uint8_t>(Encode1Dev<kE5M2>(x * s));
  }
  if (amax_out != nullptr) {
    m = BlockMaxInt<kEltThreads>(m, red);
    if (threadIdx.x == 0) AtomicMaxAbsBits(amax_out, m);
  }
}

// Fused cast + transpose. Tile: 128 rows x 64 cols of `in`, 256 threads (8 warps).
// Thread (tx, ty), tx = 0..15 a group of 4 cols, ty = 0..15: owns rows 4ty..4ty+3 and
// 64+4ty..64+4ty+3 of those cols. Lanes 0-7 of a warp take 8 consecutive col groups (one full 128-byte
// line of a row), lanes 8-31 the next 3 row groups; this makes the smem stores below conflict-free.
// Fast path (interior tile, cols % 4 == 0): all 8 float4 loads are issued before any encode (128 bytes
// in flight per thread); 4 codes per row go to `out` as one u32; a 4x4 byte transpose in registers
// gives, per col, 4 consecutive rows' codes as one u32 that is stored into the transposed smem tile
// tileT[col][row]. Then each thread copies 16-byte chunks of tileT to out_t, a warp writing 4 full
// 128-byte lines of out_t per instruction (when rows % 16 == 0 and out_t is 16-byte aligned).
// tileT is XOR-swizzled in 16-byte units: word w of col c lives at word w ^ (4 * ((c >> 2) & 7)).
constexpr int kTileRows = 128;
constexpr int kTileCols = 64;
constexpr int kTileThreads = 256;

__device__ __forceinline__ int TileTByte(int c, int r) {
  return c * kTileRows + ((((r >> 2) ^ (4 * ((c >> 2) & 7)))) << 2) + (r & 3);
}

// Writes the transposed tile tileT (col-major: kTileCols cols of kTileRows bytes) to out (cols,
// rows) at (c0, r0). vec (interior tile, rows % 16 == 0, out 16-byte aligned): chunk k (16 rows)
// of col c per lane, lanes 0-7 one col, so each 8-lane phase reads all 32 banks; else byte by
// byte within bounds. Call after the __syncthreads that completes tileT.
__device__ __forceinline__ void StoreTileT(const uint8_t* tileT, int64_t rows, int64_t cols,
                                           int64_t r0, int64_t c0, bool vec, uint8_t* out) {
  if (vec) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int c = 4 * (warp + 8 * p) + (lane >> 3);
      const int k = lane & 7;
      const uint4 v = *reinterpret_cast<const uint4*>(&tileT[TileTByte(c, 16 * k)]);
      *reinterpret_cast<uint4*>(out + (c0 + c) * rows + r0 + 16 * k) = v;
    }
    return;
  }
  for (int idx = threadIdx.x; idx < kTileCols * kTileRows; idx += kTileThreads) {
    const int c = idx / kTileRows, r = idx % kTileRows;
    if (r0 + r < rows && c0 + c < cols) out[(c0 + c) * rows + r0 + r] = tileT[TileTByte(c, r)];
  }
}

// Column j of the 4x4 byte matrix whose row i is a_i (byte j = column j): byte i of t_j = byte j of a_i.
__device__ __forceinline__ void Transpose4x4Bytes(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                  uint32_t t[4]) {
  const uint32_t p01l = __byte_perm(a0, a1, 0x5140), p01h = __byte_perm(a0, a1, 0x7362);
  const uint32_t p23l = __byte_perm(a2, a3, 0x5140), p23h = __byte_perm(a2, a3, 0x7362);
  t[0] = __byte_perm(p01l, p23l, 0x5410);
  t[1] = __byte_perm(p01l, p23l, 0x7632);
  t[2] = __byte_perm(p01h, p23h, 0x5410);
  t[3] = __byte_perm(p01h, p23h, 0x7632);
}

template <bool kE5M2, typename In>
__global__ void __launch_bounds__(kTileThreads)
CastTransposeKernel(const In* __restrict__ in, int64_t rows, int64_t cols,
                    const float* __restrict__ scale, uint8_t* __restrict__ out,
                    uint8_t* __restrict__ out_t, float* amax_out, bool out_t_vec) {
  __shared__ __align__(16) uint8_t tileT[kTileCols * kTileRows];
  __shared__ int red[kTileThreads / 32];
  const float s = *scale;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tx = (lane & 7) + 8 * (warp & 1);
  const int ty = (lane >> 3) + 4 * (warp >> 1);
  int m = 0;
  const bool full = (r0 + kTileRows <= rows) && (c0 + kTileCols <= cols);
  if (full && (cols % 4) == 0) {
    float4 x[2][4];
    const In* src = in + (r0 + 4 * ty) * cols + c0 + 4 * tx;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[h][i] = Load4F32(src + (64 * h + i) * cols);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 v = x[h][i];
        m = max(m, max(max(AbsBits(v.x), AbsBits(v.y)), max(AbsBits(v.z), AbsBits(v.w))));
        w[i] = Encode4Dev<kE5M2>(v.x * s, v.y * s, v.z * s, v.w * s);
        if (out != nullptr) {
          *reinterpret_cast<uint32_t*>(out + (r0 + 64 * h + 4 * ty + i) * cols + c0 + 4 * tx) = w[i];
        }
      }
      uint32_t t[4];
      Transpose4x4Bytes(w[0], w[1], w[2], w[3], t);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        *reinterpret_cast<uint32_t*>(&tileT[TileTByte(4 * tx + j, 64 * h + 4 * ty)]) = t[j];
      }
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = 64 * h + 4 * ty + i;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = 4 * tx + j;
          if (r0 + r < rows && c0 + c < cols) {
            const float v = LoadF32(in + (r0 + r) * cols + c0 + c);
            m = max(m, AbsBits(v));
            const uint32_t code = Encode1Dev<kE5M2>(v * s);
            if (out != nullptr) out[(r0 + r) * cols + c0 + c] = static_cast<uint8_t>(code);
            tileT[TileTByte(c, r)] = static_cast<uint8_t>(code);
          }
        }
      }
    }
  }
  __syncthreads();
  if (out_t != nullptr) StoreTileT(tileT, rows, cols, r0, c0, full && out_t_vec, out_t);
  if (amax_out != nullptr) {
    m = BlockMaxInt<kTileThreads>(m, red);
    if (threadIdx.x == 0) AtomicMaxAbsBits(amax_out, m);
  }
}

// out (cols, rows) = in (rows, cols)^T, bytes, on the tiles of CastTransposeKernel: 4-byte row
// loads (one 32-byte sector per 8 lanes), the 4x4 register transpose into the swizzled tileT, and
// 16-byte column stores. Edge tiles and unaligned shapes go byte by byte.
__global__ void __launch_bounds__(kTileThreads)
TransposeBytesKernel(const uint8_t* __restrict__ in, int64_t rows, int64_t cols,
                     uint8_t* __restrict__ out, bool in_vec, bool out_vec) {
  __shared__ __align__(16) uint8_t tileT[kTileCols * kTileRows];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tx = (lane & 7) + 8 * (warp & 1);
  const int ty = (lane >> 3) + 4 * (warp >> 1);
  const bool full = (r0 + kTileRows <= rows) && (c0 + kTileCols <= cols);
  if (full && in_vec) {
    uint32_t x[2][4];
    const uint8_t* src = in + (r0 + 4 * ty) * cols + c0 + 4 * tx;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[h][i] = *reinterpret_cast<const uint32_t*>(src + (64 * h + i) * cols);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t t[4];
      Transpose4x4Bytes(x[h][0], x[h][1], x[h][2], x[h][3], t);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        *reinterpret_cast<uint32_t*>(&tileT[TileTByte(4 * tx + j, 64 * h + 4 * ty)]) = t[j];
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < kTileCols * kTileRows; idx += kTileThreads) {
      const int r = idx / kTileCols, c = idx % kTileCols;
      if (r0 + r < rows && c0 + c < cols) tileT[TileTByte(c, r)] = in[(r0 + r) * cols + c0 + c];
    }
  }
  __syncthreads();
  StoreTileT(tileT, rows, cols, r0, c0, full && out_vec, out);
}

template <bool kE5M2>
__global__ void DequantizeKernel(const uint8_t* __restrict__ in, float* __restrict__ out, int64_t n,
                                 const float* __restrict__ scale_inv) {
  const float s = scale_inv != nullptr ? *scale_inv : 1.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = DecodeDev<kE5M2>(in[i]) * s;
  }
}

__global__ void AmaxKernel(const float* __restrict__ in, int64_t n, float* amax_out) {
  __shared__ int red[kEltThreads / 32];
  int m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    m = max(m, AbsBits(in[i]));
  }
  m = BlockMaxInt<kEltThreads>(m, red);
  if (threadIdx.x == 0) AtomicMaxAbsBits(amax_out, m);
}

__global__ void RoundBf16Kernel(float* x, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = __uint_as_float(RoundBf16BitsDev(x[i]));
  }
}

__global__ void PackBf16Kernel(const float* __restrict__ in, uint16_t* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = static_cast<uint16_t>(RoundBf16BitsDev(in[i]) >> 16);
  }
}

__global__ void UnpackBf16Kernel(const uint16_t* __restrict__ in, float* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);
  }
}

// C = (*a) * (*b) * tmp (+ C). The scalar product is formed first, as the CPU does.
__global__ void ScaleAccumulateKernel(const float* __restrict__ tmp, const float* alpha_a,
                                      const float* alpha_b, float* C, int64_t n, bool accumulate) {
  const float alpha = (alpha_a != nullptr ? *alpha_a : 1.0f) * (alpha_b != nullptr ? *alpha_b : 1.0f);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = alpha * tmp[i];
    C[i] = accumulate ? C[i] + v : v;
  }
}

}  // namespace

void LaunchCastToFp8(const float* in, uint8_t* out, int64_t n, const float* scale, Fp8Format fmt,
                     float* amax_out, cudaStream_t stream) {
  if (n <= 0) return;
  const bool vec = (reinterpret_cast<uintptr_t>(in) % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(out) % 4 == 0);
  const int blocks = CastBlocks(vec ? CeilDiv(n, 4) : n);
  if (fmt == Fp8Format::kE5M2) {
    CastToFp8Kernel<true><<<blocks, kEltThreads, 0, stream>>>(in, out, n, scale, amax_out, vec);
  } else {
    CastToFp8Kernel<false><<<blocks, kEltThreads, 0, stream>>>(in, out, n, scale, amax_out, vec);
  }
  FSDP8_CUDA_LAUNCH_CHECK();
}

namespace {
template <typename In>
void CastTransposeImpl(const In* in, int64_t rows, int64_t cols, const float* scale, Fp8Format fmt,
                       uint8_t* out, uint8_t* out_t, float* amax_out, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  FSDP8_CUDA_REQUIRE(CeilDiv(rows, kTileRows) <= 65535, "CastTransposeFp8: rows too large");
  FSDP8_CUDA_REQUIRE(reinterpret_cast<uintptr_t>(in) % (4 * sizeof(In)) == 0, "CastTransposeFp8: in not aligned to 4 elements");
  FSDP8_CUDA_REQUIRE(out == nullptr || reinterpret_cast<uintptr_t>(out) % 4 == 0, "CastTransposeFp8: out not 4-byte aligned");
  FSDP8_CUDA_REQUIRE(out_t == nullptr || reinterpret_cast<uintptr_t>(out_t) % 4 == 0, "CastTransposeFp8: out_t not 4-byte aligned");
  // 16-byte out_t stores need every out_t row start (col * rows) and chunk 16-byte aligned.
  const bool out_t_vec = (rows % 16 == 0) && (reinterpret_cast<uintptr_t>(out_t) % 16 == 0);
  const dim3 grid(static_cast<unsigned>(CeilDiv(cols, kTileCols)), static_cast<unsigned>(CeilDiv(rows, kTileRows)));
  if (fmt == Fp8Format::kE5M2) {
    CastTransposeKernel<true, In><<<grid, kTileThreads, 0, stream>>>(in, rows, cols, scale, out, out_t, amax_out, out_t_vec);
  } else {
    CastTransposeKernel<false, In><<<grid, kTileThreads, 0, stream>>>(in, rows, cols, scale, out, out_t, amax_out, out_t_vec);
  }
  FSDP8_CUDA_LAUNCH_CHECK();
}
}  // namespace

void LaunchCastTransposeFp8(const float* in, int64_t rows, int64_t cols, const float* scale,
                            Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out,
                            cudaStream_t stream) {
  CastTransposeImpl(in, rows, cols, scale, fmt, out, out_t, amax_out, stream);
}

void LaunchCastTransposeFp8Bf16(const uint16_t* in, int64_t rows, int64_t cols, const float* scale,
                                Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out,
                                cudaStream_t stream) {
  CastTransposeImpl(in, rows, cols, scale, fmt, out, out_t, amax_out, stream);
}

void LaunchCastToFp8Bf16(const uint16_t* in, uint8_t* out, int64_t n, const float* scale,
                         Fp8Format fmt, float* amax_out, cudaStream_t stream) {
  if (n <= 0) return;
  const bool vec = (reinterpret_cast<uintptr_t>(in) % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(out) % 8 == 0);
  const int blocks = CastBlocks(vec ? CeilDiv(n, 8) : n);
  if (fmt == Fp8Format::kE5M2) {
    CastBf16ToFp8Kernel<true><<<blocks, kEltThreads, 0, stream>>>(in, out, n, scale, amax_out, vec);
  } else {
    CastBf16ToFp8Kernel<false><<<blocks, kEltThreads, 0, stream>>>(in, out, n, scale, amax_out, vec);
  }
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchTransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out,
                          cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  FSDP8_CUDA_REQUIRE(CeilDiv(rows, kTileRows) <= 65535, "TransposeBytes: rows too large");
  const bool in_vec = (cols % 4 == 0) && (reinterpret_cast<uintptr_t>(in) % 4 == 0);
  const bool out_vec = (rows % 16 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
  const dim3 grid(static_cast<unsigned>(CeilDiv(cols, kTileCols)), static_cast<unsigned>(CeilDiv(rows, kTileRows)));
  TransposeBytesKernel<<<grid, kTileThreads, 0, stream>>>(in, rows, cols, out, in_vec, out_vec);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchDequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                         Fp8Format fmt, cudaStream_t stream) {
  if (n <= 0) return;
  if (fmt == Fp8Format::kE5M2) {
    DequantizeKernel<true><<<CastBlocks(n), kEltThreads, 0, stream>>>(in, out, n, scale_inv);
  } else {
    DequantizeKernel<false><<<CastBlocks(n), kEltThreads, 0, stream>>>(in, out, n, scale_inv);
  }
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchAmaxAccumulate(const float* in, int64_t n, float* amax_out, cudaStream_t stream) {
  if (n <= 0) return;
  AmaxKernel<<<CastBlocks(n), kEltThreads, 0, stream>>>(in, n, amax_out);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchRoundToBf16(float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  RoundBf16Kernel<<<CastBlocks(n), kEltThreads, 0, stream>>>(x, n);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchPackBf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  PackBf16Kernel<<<CastBlocks(n), kEltThreads, 0, stream>>>(in, out, n);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchUnpackBf16(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  UnpackBf16Kernel<<<CastBlocks(n), kEltThreads, 0, stream>>>(in, out, n);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchScaleAccumulate(const float* tmp, const float* alpha_a, const float* alpha_b, float* C,
                           int64_t n, bool accumulate, cudaStream_t stream) {
  if (n <= 0) return;
  ScaleAccumulateKernel<<<CastBlocks(n), kEltThreads, 0, stream>>>(tmp, alpha_a, alpha_b, C, n, accumulate);
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
