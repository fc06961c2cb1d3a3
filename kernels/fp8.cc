#include "kernels/fp8.h"

#include <cmath>
#include <limits>

namespace fsdp8 {
namespace {

// Value of a code from its bit fields (OCP FP8 v1.0, tables 1 and 2).
float DecodeFromFields(uint8_t code, int exp_bits, int mant_bits, bool ieee_specials) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const bool negative = (code & 0x80) != 0;
  const int exp_field = (code >> mant_bits) & ((1 << exp_bits) - 1);
  const int mant_field = code & ((1 << mant_bits) - 1);
  const int exp_all_ones = (1 << exp_bits) - 1;
  float magnitude;
  if (ieee_specials && exp_field == exp_all_ones) {
    magnitude = mant_field == 0 ? std::numeric_limits<float>::infinity()
                                : std::numeric_limits<float>::quiet_NaN();
  } else if (!ieee_specials && exp_field == exp_all_ones && mant_field == (1 << mant_bits) - 1) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exp_field == 0) {
    magnitude = std::ldexp(static_cast<float>(mant_field), 1 - bias - mant_bits);
  } else {
    magnitude =
        std::ldexp(static_cast<float>((1 << mant_bits) | mant_field), exp_field - bias - mant_bits);
  }
  return negative ? -magnitude : magnitude;
}

struct Tables {
  float e4m3[256];
  float e5m2[256];
  Tables() {
    for (int c = 0; c < 256; ++c) {
      e4m3[c] = DecodeFromFields(static_cast<uint8_t>(c), 4, 3, /*ieee_specials=*/false);
      e5m2[c] = DecodeFromFields(static_cast<uint8_t>(c), 5, 2, /*ieee_specials=*/true);
    }
  }
};

const Tables& GetTables() {
  static const Tables tables;
  return tables;
}

}  // namespace

float Fp8Max(Fp8Format fmt) { return fmt == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }

const float* Fp8DecodeTable(Fp8Format fmt) {
  return fmt == Fp8Format::kE4M3 ? GetTables().e4m3 : GetTables().e5m2;
}

float DecodeFp8(uint8_t code, Fp8Format fmt) { return Fp8DecodeTable(fmt)[code]; }

uint8_t EncodeFp8(float x, Fp8Format fmt) {
  return fmt == Fp8Format::kE4M3 ? EncodeE4M3(x) : EncodeE5M2(x);
}

}  // namespace fsdp8
