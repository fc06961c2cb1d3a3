// Independent FP8 / bfloat16 reference math for the kernel tests, written from the OCP FP8 v1.0
// bit-field definitions (table 1: exponent bias 7 for E4M3 and 15 for E5M2; subnormals when the
// exponent field is 0; table 2: E4M3 has no infinity and only S.1111.111 is NaN; E5M2 exponent
// field 31 is infinity with mantissa 0 and NaN otherwise). Nothing here calls kernels/fp8.h, so the
// tests can catch a wrong codec.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/backend.h"

namespace fsdp8::testing {

struct Fp8Layout {
  int exp_bits;
  int mant_bits;
  int bias;
  bool ieee_specials;  // E5M2: all-ones exponent = inf/NaN
};

inline Fp8Layout LayoutOf(Fp8Format fmt) {
  return fmt == Fp8Format::kE4M3 ? Fp8Layout{4, 3, 7, false} : Fp8Layout{5, 2, 15, true};
}

// Value of a code from its bit fields, in double.
inline double RefDecode(uint8_t code, Fp8Format fmt) {
  const Fp8Layout l = LayoutOf(fmt);
  const double sign = (code >> 7) ? -1.0 : 1.0;
  const int e = (code >> l.mant_bits) & ((1 << l.exp_bits) - 1);
  const int m = code & ((1 << l.mant_bits) - 1);
  const int e_max_field = (1 << l.exp_bits) - 1;
  if (l.ieee_specials && e == e_max_field) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  }
  if (!l.ieee_specials && e == e_max_field && m == (1 << l.mant_bits) - 1) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  const double frac = static_cast<double>(m) / static_cast<double>(1 << l.mant_bits);
  if (e == 0) return sign * std::pow(2.0, 1 - l.bias) * frac;  // subnormal
  return sign * std::pow(2.0, e - l.bias) * (1.0 + frac);      // normal
}

inline bool RefIsFinite(uint8_t code, Fp8Format fmt) { return std::isfinite(RefDecode(code, fmt)); }

// Nearest code to x by search over all positive finite codes (ties to the even code), with
// saturation of |x| >= max (and inf) to max, NaN -> a NaN code (returned as 0x7F | sign).
inline uint8_t RefEncode(double x, Fp8Format fmt) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return sign | 0x7F;
  const double a = std::fabs(x);
  static const auto build = [](Fp8Format f) {
    std::vector<std::pair<double, int>> v;  // (value, code) of positive finite codes, ascending
    for (int c = 0; c < 128; ++c) {
      const double d = RefDecode(static_cast<uint8_t>(c), f);
      if (std::isfinite(d)) v.emplace_back(d, c);
    }
    std::sort(v.begin(), v.end());
    return v;
  };
  static const std::vector<std::pair<double, int>> e4m3 = build(Fp8Format::kE4M3);
  static const std::vector<std::pair<double, int>> e5m2 = build(Fp8Format::kE5M2);
  const std::vector<std::pair<double, int>>& pos = fmt == Fp8Format::kE4M3 ? e4m3 : e5m2;
  if (a >= pos.back().first) return sign | static_cast<uint8_t>(pos.back().second);
  auto hi = std::upper_bound(pos.begin(), pos.end(), std::make_pair(a, 1000));
  auto lo = hi - 1;  // lo->first <= a < hi->first
  const double dlo = a - lo->first, dhi = hi->first - a;
  int code;
  if (dlo < dhi)
    code = lo->second;
  else if (dhi < dlo)
    code = hi->second;
  else
    code = (lo->second % 2 == 0) ? lo->second : hi->second;
  return sign | static_cast<uint8_t>(code);
}

// Nearest bfloat16 (8 significant bits), ties to even, via frexp and an integer rounding in
// double (the default FE_TONEAREST mode of nearbyint is ties-to-even).
inline float RefBf16(float x) {
  if (!std::isfinite(x) || x == 0.0f) return x;
  int e;
  const double f = std::frexp(static_cast<double>(x), &e);  // |f| in [0.5, 1)
  const double r = std::nearbyint(std::ldexp(f, 8));        // 8 significant bits
  return static_cast<float>(std::ldexp(r, e - 8));
}

}  // namespace fsdp8::testing
