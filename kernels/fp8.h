// Software codecs for the OCP 8-bit floating-point formats and for bfloat16 rounding.
//
// Source: "OCP 8-bit Floating Point Specification (OFP8)", revision 1.0, Open Compute Project,
// 2023-06-20 — table 1 (E4M3 / E5M2 parameters: exponent bias 7 / 15, max normal 448 / 57344,
// min normal 2^-6 / 2^-14, min subnormal 2^-9 / 2^-16) and table 2 (special-value encodings: E4M3
// has no infinities and its only NaNs are S.1111.111; E5M2 follows IEEE 754: exponent field 31 is
// infinity when the mantissa is 0 and NaN otherwise), and section 5 (conversion: round to nearest,
// ties to even, with saturation to the largest finite value as the saturating mode).
//
// Conventions used by every fsdp8 backend:
//   * Encoding rounds to nearest, ties to even, on the exact value of the f32 input.
//   * Finite values with |x| > max and ±inf SATURATE to ±max (448 for E4M3, 57344 for E5M2): a cast
//     never produces an infinity, in either format.
//   * NaN encodes to the NaN code with the input's sign bit (0x7F / 0xFF), a NaN in both formats.
//   * Subnormals are exact: values below half the smallest subnormal become (signed) zero, the
//     exact half rounds to zero (ties to even), just above it rounds to the smallest subnormal.
//   * -0.0 encodes to 0x80 and decodes to -0.0.
//
// Thread-safety: all functions are pure; the decode tables are immutable after static
// initialisation and may be read from any thread.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/backend.h"

namespace fsdp8 {

// Largest finite value: 448 (E4M3) or 57344 (E5M2).
float Fp8Max(Fp8Format fmt);

// Value of one FP8 code (exact in f32; NaN codes decode to a quiet NaN, E5M2 infinity codes
// 0x7C / 0xFC decode to ±inf).
float DecodeFp8(uint8_t code, Fp8Format fmt);

// The 256-entry decode table of `fmt`: Fp8DecodeTable(fmt)[c] == DecodeFp8(c, fmt).
const float* Fp8DecodeTable(Fp8Format fmt);

// Nearest FP8 code to x (ties to even), saturating, see the conventions above.
uint8_t EncodeFp8(float x, Fp8Format fmt);

// The same, with the format fixed at compile time (the CPU backend builds its cast tables
// with it).
// Bit-level algorithm: kMant = mantissa bits, kBias = exponent bias, kMaxBits = f32 bits of max.
namespace fp8_internal {

inline uint32_t FloatBits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

// Right shift by s (1 <= s) rounding to nearest, ties to even.
inline uint32_t ShiftRne(uint32_t v, int s) {
  if (s >= 32) return 0;
  const uint32_t half_minus_one = (1u << (s - 1)) - 1u;
  const uint32_t odd = (v >> s) & 1u;
  return static_cast<uint32_t>((static_cast<uint64_t>(v) + half_minus_one + odd) >> s);
}

template <int kMant, int kBias, uint32_t kMaxBits, uint8_t kMaxCode>
inline uint8_t Encode(float x) {
  const uint32_t u = FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);   // NaN
  if (a >= kMaxBits) return static_cast<uint8_t>(sign | kMaxCode);  // saturate (includes inf)
  const int e = static_cast<int>(a >> 23) - 127;                    // unbiased f32 exponent
  constexpr int kEmin = 1 - kBias;                                  // smallest normal exponent
  if (e >= kEmin) {
    // Normal in FP8: drop 23 - kMant mantissa bits with RNE, then rebias the exponent. A carry out
    // of the mantissa correctly bumps the exponent; it cannot pass max (max is representable).
    const uint32_t r = ShiftRne(a, 23 - kMant);
    return static_cast<uint8_t>(sign | (r - (static_cast<uint32_t>(127 - kBias) << kMant)));
  }
  if (e < -127 + 1) return sign;  // f32 zero or subnormal: far below the FP8 subnormal range
  // FP8 subnormal range: code = round(|x| / 2^(kEmin - kMant)) = round(M24 * 2^(e - kEmin + kMant -
  // 23)).
  const uint32_t m24 = (a & 0x7FFFFFu) | 0x800000u;
  const int s = 23 + kEmin - kMant - e;                  // > 23 - kMant
  return static_cast<uint8_t>(sign | ShiftRne(m24, s));  // 1 << kMant (min normal) is also right
}

}  // namespace fp8_internal

inline uint8_t EncodeE4M3(float x) {
  return fp8_internal::Encode<3, 7, 0x43E00000u /*448.0f*/, 0x7E>(x);
}
inline uint8_t EncodeE5M2(float x) {
  return fp8_internal::Encode<2, 15, 0x47600000u /*57344.0f*/, 0x7B>(x);
}

// bfloat16 rounding: the nearest bfloat16 value (ties to even) returned as an f32; NaN stays NaN
// (quieted), ±inf stays ±inf, values beyond the bfloat16 range round to ±inf as IEEE 754 does.
inline float RoundBf16(float x) {
  uint32_t u = fp8_internal::FloatBits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    u |= 0x00400000u;  // quiet NaN, keep payload's top bits
  } else {
    u += 0x7FFFu + ((u >> 16) & 1u);
  }
  u &= 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}

// The bfloat16 bit pattern of RoundBf16(x), and the f32 value of a bit pattern (exact).
inline uint16_t Bf16Bits(float x) {
  return static_cast<uint16_t>(fp8_internal::FloatBits(RoundBf16(x)) >> 16);
}
inline float Bf16Value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}

}  // namespace fsdp8
