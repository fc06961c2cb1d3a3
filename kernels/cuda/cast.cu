// FP8 casts, transposes, amax and bfloat16 rounding (Backend: CastToFp8, CastTransposeFp8,
// SwigluBackwardCastTransposeFp8 (the SwiGLU gradient computed in the cast-transpose tile),
// SwigluCastTransposeFp8 (a forward SwiGLU cast recomputed with its transpose),
// TransposeBytes, DequantizeFp8, AmaxAccumulate, Fp8ScalesFromAmax, RoundToBf16, PackBf16,
// UnpackBf16).
//
// Bit-exact with the CPU reference: the encoders in device_math.cuh (hardware cvt plus a NaN/sign
// fix-up, see CvtFp8x2Dev) give the codes of kernels/fp8.h. amax uses atomicMax on |x| bits, which is order-independent (device_math.cuh).
#include <cuda_runtime.h>

#include <cfloat>

#include "common/check.h"
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

// Fused cast + transpose of a source's values (one or two per element: PlainSource,
// SwigluBackwardSource below; each value has its own tileT). Tile: 128 rows x 64 cols, 256
// threads (8 warps).
// Thread (tx, ty), tx = 0..15 a group of 4 cols, ty = 0..15: owns rows 4ty..4ty+3 and
// 64+4ty..64+4ty+3 of those cols. Lanes 0-7 of a warp take 8 consecutive col groups (one full 128-byte
// line of a row), lanes 8-31 the next 3 row groups; this makes the smem stores below conflict-free.
// Fast path (interior tile, cols % 4 == 0): the 8 four-element loads of the source's inputs are
// issued before any encode (128 bytes in flight per thread and f32 input), or 4 at a time
// (Src::kPreloadBothHalves false); 4 codes per row go to `out` as one u32; a 4x4 byte transpose in registers
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

// What CastTransposeKernel casts: kOut values per element of the (rows, cols) grid, computed
// from the source's inputs. Load4 reads the inputs of 4 consecutive elements of a row (c % 4 ==
// 0, aligned); Values4 / Values1 turn them into the kOut values that are cast.
template <typename In>
struct PlainSource {  // the values of `in` (rows, cols) themselves
  static constexpr int kOut = 1;
  // Whether the fast path issues the loads of both 64-row halves before any compute (more bytes
  // in flight) or half by half (fewer live registers: higher occupancy for a compute-heavy source).
  static constexpr bool kPreloadBothHalves = true;
  const In* in;
  int64_t cols;
  struct Raw {
    float4 v;
  };
  __device__ __forceinline__ Raw Load4(int64_t r, int64_t c) const {
    return {Load4F32(in + r * cols + c)};
  }
  __device__ __forceinline__ void Values4(const Raw& x, float4* v) const { v[0] = x.v; }
  __device__ __forceinline__ void Values1(int64_t r, int64_t c, float* v) const {
    v[0] = LoadF32(in + r * cols + c);
  }
};

// dgate, dup of SwiGLU from bf16 dh, gate, up (rows, cols), each rounded to bf16 (SwigluGradDev,
// the math of SwigluBackwardBf16To16): the casts see exactly the values that op stores.
struct SwigluBackwardSource {
  static constexpr int kOut = 2;
  static constexpr bool kPreloadBothHalves = false;
  const uint16_t* dh;
  const uint16_t* gate;
  const uint16_t* up;
  int64_t cols;
  int64_t in_ld;  // row stride of gate and up (dh is dense)
  struct Raw {
    float4 d, g, u;
  };
  __device__ __forceinline__ Raw Load4(int64_t r, int64_t c) const {
    const int64_t i = r * cols + c, j = r * in_ld + c;
    return {Load4F32(dh + i), Load4F32(gate + j), Load4F32(up + j)};
  }
  __device__ __forceinline__ static void One(float d, float g, float u, float* dg, float* du) {
    SwigluGradDev(d, g, u, dg, du);
    *dg = __uint_as_float(RoundBf16BitsDev(*dg));
    *du = __uint_as_float(RoundBf16BitsDev(*du));
  }
  __device__ __forceinline__ void Values4(const Raw& x, float4* v) const {
    One(x.d.x, x.g.x, x.u.x, &v[0].x, &v[1].x);
    One(x.d.y, x.g.y, x.u.y, &v[0].y, &v[1].y);
    One(x.d.z, x.g.z, x.u.z, &v[0].z, &v[1].z);
    One(x.d.w, x.g.w, x.u.w, &v[0].w, &v[1].w);
  }
  __device__ __forceinline__ void Values1(int64_t r, int64_t c, float* v) const {
    const int64_t i = r * cols + c, j = r * in_ld + c;
    One(LoadF32(dh + i), LoadF32(gate + j), LoadF32(up + j), &v[0], &v[1]);
  }
};

// silu(gate) * up of bf16 gate, up (rows, cols) of row stride in_ld (SiluMulDev, the values
// LaunchSwigluCastFp8 casts).
struct SwigluSource {
  static constexpr int kOut = 1;
  static constexpr bool kPreloadBothHalves = false;
  const uint16_t* gate;
  const uint16_t* up;
  int64_t in_ld;
  struct Raw {
    float4 v;
  };
  __device__ __forceinline__ Raw Load4(int64_t r, int64_t c) const {
    const int64_t j = r * in_ld + c;
    const float4 g = Load4F32(gate + j), u = Load4F32(up + j);
    return {make_float4(SiluMulDev(g.x, u.x), SiluMulDev(g.y, u.y), SiluMulDev(g.z, u.z),
                        SiluMulDev(g.w, u.w))};
  }
  __device__ __forceinline__ void Values4(const Raw& x, float4* v) const { v[0] = x.v; }
  __device__ __forceinline__ void Values1(int64_t r, int64_t c, float* v) const {
    const int64_t j = r * in_ld + c;
    v[0] = SiluMulDev(LoadF32(gate + j), LoadF32(up + j));
  }
};

// RopeBackward of bf16 dx (rows = B * T, cols = H * D), each result rounded to bf16: the values
// LaunchRopeApplyBf16 (sign -1) stores in place, read here without being written. Element (r, c)
// is half j of head dimension i = c % D; its pair partner is D/2 columns away in the same row.
// Load4 needs D % 8 == 0 (4 elements never straddle a half).
struct RopeBackwardSource {
  static constexpr int kOut = 1;
  static constexpr bool kPreloadBothHalves = false;
  const uint16_t* dx;
  int64_t cols;
  uint32_t T, D;
  const float2* table;  // (T, D/2) {cos, sin}
  struct Raw {
    float4 v;
  };
  __device__ __forceinline__ static float Rotated(float own, float other, float c, float s,
                                                  bool low) {
    float y1, y2;
    if (low) {
      RopeRotateDev(own, other, c, -s, &y1, &y2);
      return __uint_as_float(RoundBf16BitsDev(y1));
    }
    RopeRotateDev(other, own, c, -s, &y1, &y2);
    return __uint_as_float(RoundBf16BitsDev(y2));
  }
  // 32-bit index math: a 64-bit remainder costs tens of instructions per load.
  __device__ __forceinline__ Raw Load4(int64_t r, int64_t c) const {
    const uint32_t half = D / 2, i = static_cast<uint32_t>(c) % D;
    const bool low = i < half;
    const uint16_t* p = dx + r * cols + c;
    const float4 own = Load4F32(p), other = Load4F32(low ? p + half : p - half);
    const float2* cs = table + (static_cast<uint32_t>(r) % T) * half + (low ? i : i - half);
    const float4 cs01 = *reinterpret_cast<const float4*>(cs);
    const float4 cs23 = *reinterpret_cast<const float4*>(cs + 2);
    return {make_float4(Rotated(own.x, other.x, cs01.x, cs01.y, low),
                        Rotated(own.y, other.y, cs01.z, cs01.w, low),
                        Rotated(own.z, other.z, cs23.x, cs23.y, low),
                        Rotated(own.w, other.w, cs23.z, cs23.w, low))};
  }
  __device__ __forceinline__ void Values4(const Raw& x, float4* v) const { v[0] = x.v; }
  __device__ __forceinline__ void Values1(int64_t r, int64_t c, float* v) const {
    const uint32_t half = D / 2, i = static_cast<uint32_t>(c) % D;
    const bool low = i < half;
    const uint16_t* p = dx + r * cols + c;
    const float2 cs = table[(static_cast<uint32_t>(r) % T) * half + (low ? i : i - half)];
    v[0] = Rotated(LoadF32(p), LoadF32(low ? p + half : p - half), cs.x, cs.y, low);
  }
};

// Per value k of the source: its scale, row-major codes (optional), transposed codes (optional)
// and amax accumulator (optional).
template <int kOut>
struct CastOutputs {
  const float* scale[kOut];
  uint8_t* out[kOut];
  uint8_t* out_t[kOut];
  float* amax[kOut];
  int64_t ld = 0;  // row stride of every out[k] in elements (>= cols)
};

template <bool kE5M2, typename Src>
__global__ void __launch_bounds__(kTileThreads)
CastTransposeKernel(Src src, int64_t rows, int64_t cols, CastOutputs<Src::kOut> o,
                    bool row_vec, bool out_t_vec) {
  constexpr int kOut = Src::kOut;
  __shared__ __align__(16) uint8_t tileT[kOut][kTileCols * kTileRows];
  __shared__ int red[kTileThreads / 32];
  float s[kOut];
  int m[kOut];
#pragma unroll
  for (int k = 0; k < kOut; ++k) {
    s[k] = *o.scale[k];
    m[k] = 0;
  }
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tx = (lane & 7) + 8 * (warp & 1);
  const int ty = (lane >> 3) + 4 * (warp >> 1);
  const bool full = (r0 + kTileRows <= rows) && (c0 + kTileCols <= cols);
  if (full && row_vec) {
    typename Src::Raw x[2][4];
    auto load = [&](int h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) x[h][i] = src.Load4(r0 + 64 * h + 4 * ty + i, c0 + 4 * tx);
    };
    if (Src::kPreloadBothHalves) {
      load(0);
      load(1);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!Src::kPreloadBothHalves) load(h);
      uint32_t w[kOut][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float4 v[kOut];
        src.Values4(x[h][i], v);
#pragma unroll
        for (int k = 0; k < kOut; ++k) {
          m[k] = max(m[k], max(max(AbsBits(v[k].x), AbsBits(v[k].y)),
                               max(AbsBits(v[k].z), AbsBits(v[k].w))));
          w[k][i] = Encode4Dev<kE5M2>(v[k].x * s[k], v[k].y * s[k], v[k].z * s[k], v[k].w * s[k]);
          if (o.out[k] != nullptr) {
            *reinterpret_cast<uint32_t*>(o.out[k] + (r0 + 64 * h + 4 * ty + i) * o.ld + c0 +
                                         4 * tx) = w[k][i];
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kOut; ++k) {
        uint32_t t[4];
        Transpose4x4Bytes(w[k][0], w[k][1], w[k][2], w[k][3], t);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          *reinterpret_cast<uint32_t*>(&tileT[k][TileTByte(4 * tx + j, 64 * h + 4 * ty)]) = t[j];
        }
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
            float v[kOut];
            src.Values1(r0 + r, c0 + c, v);
#pragma unroll
            for (int k = 0; k < kOut; ++k) {
              m[k] = max(m[k], AbsBits(v[k]));
              const uint32_t code = Encode1Dev<kE5M2>(v[k] * s[k]);
              if (o.out[k] != nullptr) o.out[k][(r0 + r) * o.ld + c0 + c] = static_cast<uint8_t>(code);
              tileT[k][TileTByte(c, r)] = static_cast<uint8_t>(code);
            }
          }
        }
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kOut; ++k) {
    if (o.out_t[k] != nullptr) StoreTileT(tileT[k], rows, cols, r0, c0, full && out_t_vec, o.out_t[k]);
  }
#pragma unroll
  for (int k = 0; k < kOut; ++k) {  // uniform over the block: BlockMaxInt's barriers are safe
    if (o.amax[k] != nullptr) {
      const int mk = BlockMaxInt<kTileThreads>(m[k], red);
      if (threadIdx.x == 0) AtomicMaxAbsBits(o.amax[k], mk);
    }
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

__global__ void RoundToBf16Kernel(float* x, int64_t n) {
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
  ForFormat(fmt, [&](auto e5m2) {
    CastToFp8Kernel<decltype(e5m2)::value><<<blocks, kEltThreads, 0, stream>>>(in, out, n, scale, amax_out, vec);
  });
  FSDP8_CUDA_LAUNCH_CHECK();
}

namespace {
template <typename Src>
void CastTransposeImpl(const Src& src, int64_t rows, int64_t cols, Fp8Format fmt,
                       const CastOutputs<Src::kOut>& o, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  FSDP8_CHECK(CeilDiv(rows, kTileRows) <= 65535) << "CastTransposeFp8: rows too large";
  FSDP8_CHECK(o.ld >= cols) << "CastTransposeFp8: out row stride below cols";
  bool out_t_vec = rows % 16 == 0;
  // 4-byte row loads and stores: every row start of the source and of each out 4-aligned.
  bool row_vec = cols % 4 == 0;
  for (int k = 0; k < Src::kOut; ++k) {
    row_vec = row_vec && (o.out[k] == nullptr ||
                          (o.ld % 4 == 0 && reinterpret_cast<uintptr_t>(o.out[k]) % 4 == 0));
    FSDP8_CHECK(o.out_t[k] == nullptr || reinterpret_cast<uintptr_t>(o.out_t[k]) % 4 == 0)
        << "CastTransposeFp8: out_t not 4-byte aligned";
    // 16-byte out_t stores need every out_t row start (col * rows) and chunk 16-byte aligned.
    out_t_vec = out_t_vec && reinterpret_cast<uintptr_t>(o.out_t[k]) % 16 == 0;
  }
  const dim3 grid(static_cast<unsigned>(CeilDiv(cols, kTileCols)), static_cast<unsigned>(CeilDiv(rows, kTileRows)));
  ForFormat(fmt, [&](auto e5m2) {
    CastTransposeKernel<decltype(e5m2)::value, Src><<<grid, kTileThreads, 0, stream>>>(src, rows, cols, o, row_vec, out_t_vec);
  });
  FSDP8_CUDA_LAUNCH_CHECK();
}

template <typename In>
void PlainCastTranspose(const In* in, int64_t rows, int64_t cols, const float* scale,
                        Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out,
                        int64_t out_ld, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  FSDP8_CHECK(reinterpret_cast<uintptr_t>(in) % (4 * sizeof(In)) == 0)
      << "CastTransposeFp8: in not aligned to 4 elements";
  CastTransposeImpl(PlainSource<In>{in, cols}, rows, cols, fmt,
                    CastOutputs<1>{{scale}, {out}, {out_t}, {amax_out}, out_ld}, stream);
}
}  // namespace

void LaunchCastTransposeFp8(const float* in, int64_t rows, int64_t cols, const float* scale,
                            Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out,
                            cudaStream_t stream) {
  PlainCastTranspose(in, rows, cols, scale, fmt, out, out_t, amax_out, cols, stream);
}

void LaunchCastTransposeFp8Bf16(const uint16_t* in, int64_t rows, int64_t cols, const float* scale,
                                Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out,
                                int64_t out_ld, cudaStream_t stream) {
  PlainCastTranspose(in, rows, cols, scale, fmt, out, out_t, amax_out, out_ld, stream);
}

void LaunchSwigluBackwardCastTransposeFp8(const uint16_t* dh16, const uint16_t* gate16,
                                          const uint16_t* up16, int64_t rows, int64_t cols,
                                          const float* scale_gate, const float* scale_up,
                                          Fp8Format fmt, uint8_t* dgate8, uint8_t* dgate8_t,
                                          uint8_t* dup8, uint8_t* dup8_t, float* amax_gate,
                                          float* amax_up, int64_t out_ld, int64_t in_ld,
                                          cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  for (const void* p : {static_cast<const void*>(dh16), static_cast<const void*>(gate16),
                        static_cast<const void*>(up16)}) {
    FSDP8_CHECK(reinterpret_cast<uintptr_t>(p) % 8 == 0)
        << "SwigluBackwardCastTransposeFp8: input not aligned to 4 elements";
  }
  FSDP8_CHECK(in_ld >= cols && (in_ld % 4 == 0 || cols % 4 != 0))
      << "SwigluBackwardCastTransposeFp8: gate/up row stride below cols or not a multiple of 4";
  CastTransposeImpl(SwigluBackwardSource{dh16, gate16, up16, cols, in_ld}, rows, cols, fmt,
                    CastOutputs<2>{{scale_gate, scale_up}, {dgate8, dup8}, {dgate8_t, dup8_t},
                                   {amax_gate, amax_up}, out_ld},
                    stream);
}

void LaunchSwigluCastTransposeFp8(const uint16_t* gate16, const uint16_t* up16, int64_t rows,
                                  int64_t cols, int64_t in_ld, const float* scale, Fp8Format fmt,
                                  uint8_t* out, uint8_t* out_t, float* amax_out,
                                  cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  FSDP8_CHECK(reinterpret_cast<uintptr_t>(gate16) % 8 == 0 &&
              reinterpret_cast<uintptr_t>(up16) % 8 == 0)
      << "SwigluCastTransposeFp8: gate or up not aligned to 4 elements";
  FSDP8_CHECK(in_ld >= cols && (in_ld % 4 == 0 || cols % 4 != 0))
      << "SwigluCastTransposeFp8: gate/up row stride below cols or not a multiple of 4";
  CastTransposeImpl(SwigluSource{gate16, up16, in_ld}, rows, cols, fmt,
                    CastOutputs<1>{{scale}, {out}, {out_t}, {amax_out}, cols}, stream);
}

void LaunchRopeBackwardCastTransposeFp8Bf16(const uint16_t* dx16, int64_t B, int64_t T,
                                            int64_t H, int64_t D, const float* table,
                                            const float* scale, Fp8Format fmt, uint8_t* out,
                                            uint8_t* out_t, float* amax_out, int64_t out_ld,
                                            cudaStream_t stream) {
  if (B * T <= 0 || H * D <= 0) return;
  FSDP8_CHECK(D % 8 == 0 && reinterpret_cast<uintptr_t>(dx16) % 8 == 0 &&
              reinterpret_cast<uintptr_t>(table) % 16 == 0 && T < (int64_t{1} << 32))
      << "RopeBackwardCastTransposeFp8Bf16: D % 8, dx16 8-byte or table 16-byte alignment";
  CastTransposeImpl(RopeBackwardSource{dx16, H * D, static_cast<uint32_t>(T),
                                       static_cast<uint32_t>(D),
                                       reinterpret_cast<const float2*>(table)},
                    B * T, H * D, fmt, CastOutputs<1>{{scale}, {out}, {out_t}, {amax_out}, out_ld},
                    stream);
}

void LaunchCastToFp8Bf16(const uint16_t* in, uint8_t* out, int64_t n, const float* scale,
                         Fp8Format fmt, float* amax_out, cudaStream_t stream) {
  if (n <= 0) return;
  const bool vec = (reinterpret_cast<uintptr_t>(in) % 16 == 0) &&
                   (reinterpret_cast<uintptr_t>(out) % 8 == 0);
  const int blocks = CastBlocks(vec ? CeilDiv(n, 8) : n);
  ForFormat(fmt, [&](auto e5m2) {
    CastBf16ToFp8Kernel<decltype(e5m2)::value><<<blocks, kEltThreads, 0, stream>>>(in, out, n, scale, amax_out, vec);
  });
  FSDP8_CUDA_LAUNCH_CHECK();
}

// One thread per tensor; the double arithmetic is IEEE (correctly rounded division, exact
// scaling by 2^-margin), so the scales are the host's bits (CpuRefBackend::Fp8ScalesFromAmax).
__global__ void Fp8ScalesKernel(const float* __restrict__ amax, int64_t n, float fp8_max, int margin,
                                float* scale, float* scale_inv, int64_t stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  auto usable = [](float v) { return isfinite(v) && v > 0.0f; };
  float s = scale[i * stride];
  if (!usable(s)) s = 1.0f;
  const float a = amax[i];
  if (usable(a) && usable(fp8_max)) {
    double d = __ddiv_rn(static_cast<double>(fp8_max), static_cast<double>(a));
    d = ldexp(d, -margin);
    d = fmin(fmax(d, static_cast<double>(FLT_MIN)), static_cast<double>(FLT_MAX));
    s = __double2float_rn(d);
  }
  scale[i * stride] = s;
  scale_inv[i * stride] = __fdiv_rn(1.0f, s);
}

void LaunchFp8ScalesFromAmax(const float* amax, int64_t n, float fp8_max, int margin, float* scale,
                             float* scale_inv, int64_t stride, cudaStream_t stream) {
  if (n <= 0) return;
  Fp8ScalesKernel<<<static_cast<unsigned>(CeilDiv(n, 128)), 128, 0, stream>>>(amax, n, fp8_max, margin,
                                                                              scale, scale_inv, stride);
  FSDP8_CUDA_LAUNCH_CHECK();
}

// One block; each thread takes its tensors' group maximum over all n (n is the number of FP8
// tensors, a few hundred): no atomics, deterministic.
__global__ void GroupMaxKernel(const float* __restrict__ in, const int32_t* __restrict__ group,
                               int64_t n, float* __restrict__ out) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t g = group[i];
    float m = in[i];
    for (int64_t j = 0; j < n && !isnan(m); ++j) {
      const float v = in[j];
      if (group[j] == g && (isnan(v) || v > m)) m = v;
    }
    out[i] = m;
  }
}

void LaunchGroupMax(const float* in, const int32_t* group, int64_t n, float* out,
                    cudaStream_t stream) {
  if (n <= 0) return;
  GroupMaxKernel<<<1, 256, 0, stream>>>(in, group, n, out);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchTransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out,
                          cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  FSDP8_CHECK(CeilDiv(rows, kTileRows) <= 65535) << "TransposeBytes: rows too large";
  const bool in_vec = (cols % 4 == 0) && (reinterpret_cast<uintptr_t>(in) % 4 == 0);
  const bool out_vec = (rows % 16 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
  const dim3 grid(static_cast<unsigned>(CeilDiv(cols, kTileCols)), static_cast<unsigned>(CeilDiv(rows, kTileRows)));
  TransposeBytesKernel<<<grid, kTileThreads, 0, stream>>>(in, rows, cols, out, in_vec, out_vec);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchDequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                         Fp8Format fmt, cudaStream_t stream) {
  if (n <= 0) return;
  ForFormat(fmt, [&](auto e5m2) {
    DequantizeKernel<decltype(e5m2)::value><<<CastBlocks(n), kEltThreads, 0, stream>>>(in, out, n, scale_inv);
  });
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchAmaxAccumulate(const float* in, int64_t n, float* amax_out, cudaStream_t stream) {
  if (n <= 0) return;
  AmaxKernel<<<CastBlocks(n), kEltThreads, 0, stream>>>(in, n, amax_out);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchRoundToBf16(float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  RoundToBf16Kernel<<<CastBlocks(n), kEltThreads, 0, stream>>>(x, n);
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
