// Internal to kernels/cuda: device versions of the FP8 / bfloat16 codecs of kernels/fp8.h (same
// conventions, same bit-level algorithm, so a CUDA cast gives the CPU reference's bits exactly),
// and block-reduction helpers.
//
// FP8 conventions (OCP OFP8 v1.0, see kernels/fp8.h): round to nearest even on the exact f32
// value; finite |x| > max and ±inf saturate to ±max; NaN -> sign | 0x7F; subnormals exact.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "kernels/backend.h"

namespace fsdp8::cuda {

// v >> s rounded to nearest, ties to even (1 <= s).
__device__ __forceinline__ uint32_t ShiftRneDev(uint32_t v, int s) {
  if (s >= 32) return 0u;
  const uint32_t half_minus_one = (1u << (s - 1)) - 1u;
  const uint32_t odd = (v >> s) & 1u;
  return static_cast<uint32_t>((static_cast<uint64_t>(v) + half_minus_one + odd) >> s);
}

template <int kMant, int kBias, uint32_t kMaxBits, uint32_t kMaxCode>
__device__ __forceinline__ uint32_t EncodeFp8Dev(float x) {
  const uint32_t u = __float_as_uint(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7Fu;          // NaN
  if (a >= kMaxBits) return sign | kMaxCode;          // saturate (includes inf)
  const int e = static_cast<int>(a >> 23) - 127;
  constexpr int kEmin = 1 - kBias;
  if (e >= kEmin) {
    const uint32_t r = ShiftRneDev(a, 23 - kMant);
    return sign | (r - (static_cast<uint32_t>(127 - kBias) << kMant));
  }
  if (e < -126) return sign;  // f32 zero or subnormal
  const uint32_t m24 = (a & 0x7FFFFFu) | 0x800000u;
  const int s = 23 + kEmin - kMant - e;
  return sign | ShiftRneDev(m24, s);
}

__device__ __forceinline__ uint32_t EncodeE4M3Dev(float x) {
  return EncodeFp8Dev<3, 7, 0x43E00000u, 0x7Eu>(x);
}
__device__ __forceinline__ uint32_t EncodeE5M2Dev(float x) {
  return EncodeFp8Dev<2, 15, 0x47600000u, 0x7Bu>(x);
}
template <bool kE5M2>
__device__ __forceinline__ uint32_t EncodeDev(float x) {
  return kE5M2 ? EncodeE5M2Dev(x) : EncodeE4M3Dev(x);
}

// Hardware conversion of two floats to FP8 codes, `lo` in bits 0-7 and `hi` in bits 8-15, plus the
// fix-up that makes it equal to EncodeDev. cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (PTX ISA, "cvt";
// sm_89+; operand a goes to the upper byte, b to the lower) rounds to nearest even on the exact
// value, keeps FP8 subnormals, and maps finite overflow and ±inf to ±max (0x7E / 0x7B), i.e. the
// same as EncodeDev on every non-NaN input (the reference model of the instruction, the non-sm_89
// branch of __nv_cvt_float_to_fp8 in cuda_fp8.hpp, has the same thresholds, ties and sign
// handling). NaN is where they may differ: the hardware gives a canonical NaN code whose sign is
// not specified, the reference keeps the input's sign. Fp8FixDev ORs back the input's sign and,
// for NaN, all seven magnitude bits, so any NaN code becomes sign | 0x7F; for other inputs it only
// restates the sign (the reference keeps it also for ±0 and for values that round to ±0).
template <bool kE5M2>
__device__ __forceinline__ uint32_t CvtFp8x2Dev(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  if (kE5M2) {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  }
  return static_cast<uint32_t>(r);
#else
  return EncodeDev<kE5M2>(lo) | (EncodeDev<kE5M2>(hi) << 8);
#endif
}

// Bits to OR into the hardware code of y: y's sign, and 0x7F when y is NaN (see CvtFp8x2Dev).
__device__ __forceinline__ uint32_t Fp8FixDev(float y) {
  const uint32_t u = __float_as_uint(y);
  return ((u >> 24) & 0x80u) | ((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7Fu : 0u);
}

// Four codes packed little-endian (a in bits 0-7); bit-exact with EncodeDev on each.
template <bool kE5M2>
__device__ __forceinline__ uint32_t Encode4Dev(float a, float b, float c, float d) {
  const uint32_t w = CvtFp8x2Dev<kE5M2>(a, b) | (CvtFp8x2Dev<kE5M2>(c, d) << 16);
  const uint32_t f = Fp8FixDev(a) | (Fp8FixDev(b) << 8) | (Fp8FixDev(c) << 16) | (Fp8FixDev(d) << 24);
  return w | f;
}

// One code; bit-exact with EncodeDev.
template <bool kE5M2>
__device__ __forceinline__ uint32_t Encode1Dev(float a) {
  return (CvtFp8x2Dev<kE5M2>(a, 0.0f) & 0xFFu) | Fp8FixDev(a);
}

// Exact value of an FP8 code. NaN codes give a quiet NaN with the code's sign; E5M2 0x7C/0xFC ±inf.
template <bool kE5M2>
__device__ __forceinline__ float DecodeDev(uint32_t c) {
  constexpr int kMant = kE5M2 ? 2 : 3;
  constexpr int kBias = kE5M2 ? 15 : 7;
  constexpr uint32_t kExpMask = kE5M2 ? 0x1Fu : 0x0Fu;
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t e = (c >> kMant) & kExpMask;
  const uint32_t m = c & ((1u << kMant) - 1u);
  if (kE5M2) {
    if (e == 31u) return __uint_as_float(sign | (m == 0u ? 0x7F800000u : 0x7FC00000u));
  } else {
    if (e == 15u && m == 7u) return __uint_as_float(sign | 0x7FC00000u);
  }
  if (e == 0u) {
    // m * 2^(1 - bias - mant), exact in f32.
    const float v = static_cast<float>(m) * __uint_as_float(static_cast<uint32_t>(127 + 1 - kBias - kMant) << 23);
    return __uint_as_float(__float_as_uint(v) | sign);
  }
  return __uint_as_float(sign | ((e - kBias + 127u) << 23) | (m << (23 - kMant)));
}

// Nearest bfloat16 (ties to even) as f32 bits; NaN quieted, same as fsdp8::RoundBf16.
__device__ __forceinline__ uint32_t RoundBf16BitsDev(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    u |= 0x00400000u;
  } else {
    u += 0x7FFFu + ((u >> 16) & 1u);
  }
  return u & 0xFFFF0000u;
}

// Element access for f32 or bfloat16 (bit pattern) storage, in f32: one element, or 4
// consecutive ones (16-byte f32 / 8-byte bf16 accesses: p must be 4-element aligned). Stores to
// bf16 round to nearest even. Little-endian: element 2k is the low half of 32-bit word k.
__device__ __forceinline__ float LoadF32(const float* p) { return *p; }
__device__ __forceinline__ float LoadF32(const uint16_t* p) {
  return __uint_as_float(static_cast<uint32_t>(*p) << 16);
}
__device__ __forceinline__ float4 Load4F32(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float4 Load4F32(const uint16_t* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xFFFF0000u),
                     __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xFFFF0000u));
}
__device__ __forceinline__ void StoreF32(float* p, float v) { *p = v; }
__device__ __forceinline__ void StoreF32(uint16_t* p, float v) {
  *p = static_cast<uint16_t>(RoundBf16BitsDev(v) >> 16);
}
__device__ __forceinline__ void Store4F32(float* p, float4 v) {
  *reinterpret_cast<float4*>(p) = v;
}
__device__ __forceinline__ void Store4F32(uint16_t* p, float4 v) {
  *reinterpret_cast<uint2*>(p) =
      make_uint2((RoundBf16BitsDev(v.x) >> 16) | RoundBf16BitsDev(v.y),
                 (RoundBf16BitsDev(v.z) >> 16) | RoundBf16BitsDev(v.w));
}

// silu(g) * u, silu(g) = g * sigmoid(g): the one expression of every SwiGLU forward kernel
// (SwigluForward, SwigluCastFp8, SwigluCastTransposeFp8), so a recomputed cast sees the forward's
// values bit for bit.
__device__ __forceinline__ float SiluMulDev(float g, float u) {
  const float sig = 1.0f / (1.0f + expf(-g));
  return g * sig * u;
}

// SwiGLU gradient of one element, h = silu(g) * u: dgate = dh * u * s * (1 + g * (1 - s)),
// dup = dh * g * s, s = sigmoid(g). One expression for every kernel that needs it, so a fused
// kernel computes the same f32 values as SwigluBackward.
__device__ __forceinline__ void SwigluGradDev(float dh, float g, float u, float* dgate, float* dup) {
  // __frcp_rn is the correctly rounded 1 / x, the same value as the IEEE division, in fewer
  // instructions (these kernels are close to instruction-bound).
  const float s = __frcp_rn(1.0f + expf(-g));
  *dgate = dh * u * s * (1.0f + g * (1.0f - s));
  *dup = dh * g * s;
}

// One RoPE pair rotated by the angle whose cosine is c and sine s: y1 = x1 c - x2 s,
// y2 = x2 c + x1 s, each product and sum rounded on its own (no FMA contraction), as the CPU
// reference computes it; every RoPE kernel uses this expression.
__device__ __forceinline__ void RopeRotateDev(float x1, float x2, float c, float s, float* y1,
                                              float* y2) {
  *y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  *y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// |x| as int bits: for non-negative floats (and NaN with the sign cleared) integer order equals
// float order, and any NaN compares above +inf, so an integer max is a NaN-propagating float max
// whose result does not depend on the order of the operands (deterministic with atomicMax).
__device__ __forceinline__ int AbsBits(float x) {
  return static_cast<int>(__float_as_uint(x) & 0x7FFFFFFFu);
}

// Block-wide integer max; every thread must call it; result valid in all threads.
template <int kThreads>
__device__ __forceinline__ int BlockMaxInt(int v, int* smem /* kThreads/32 */) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? smem[lane] : 0;
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// Block-wide float sum in a fixed tree order (deterministic); result valid in all threads.
template <int kThreads, typename T>
__device__ __forceinline__ T BlockSum(T v, T* smem /* kThreads/32 */) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? smem[lane] : T(0);
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

__device__ __forceinline__ void AtomicMaxAbsBits(float* amax_out, int bits) {
  atomicMax(reinterpret_cast<int*>(amax_out), bits);
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Launch shape of the elementwise (grid-stride) kernels: kEltThreads per block, enough blocks for
// n_items, at most max_blocks (the loop strides over the rest).
constexpr int kEltThreads = 256;
inline int EltBlocks(int64_t n_items, int64_t max_blocks = 16384) {
  const int64_t b = CeilDiv(n_items, kEltThreads);
  return static_cast<int>(b < 1 ? 1 : (b < max_blocks ? b : max_blocks));
}
// Runs launch(std::true_type{}) for E5M2, launch(std::false_type{}) for E4M3: the kernels take
// the format as their compile-time flag kE5M2 (decltype(flag)::value).
template <typename Launch>
void ForFormat(Fp8Format fmt, Launch&& launch) {
  if (fmt == Fp8Format::kE5M2) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
}
#define FSDP8_GRID_STRIDE(i, n)                                                             \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

}  // namespace fsdp8::cuda
