// Tests of the FP8 and bfloat16 codecs (kernels/fp8.h) against the independent bit-field
// reference in fp8_reference.h. Case C02 (saturation, round-to-nearest-even, all 256 codes).
#include "kernels/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "tests/kernels/fp8_reference.h"

namespace fsdp8 {
namespace {

using testing::RefBf16;
using testing::RefDecode;
using testing::RefEncode;
using testing::RefIsFinite;

constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};
const char* FmtName(Fp8Format f) { return f == Fp8Format::kE4M3 ? "E4M3" : "E5M2"; }
constexpr float kInf = std::numeric_limits<float>::infinity();

// Decoded values are exact (every FP8 value is an f32 value), so equality is exact, including the
// sign of zero; NaN must decode to NaN.
TEST(Fp8Codec, C02_All256CodesDecodeToOcpValues) {
  for (Fp8Format fmt : kFormats) {
    const float* table = Fp8DecodeTable(fmt);
    for (int c = 0; c < 256; ++c) {
      const double want = RefDecode(static_cast<uint8_t>(c), fmt);
      const float got = DecodeFp8(static_cast<uint8_t>(c), fmt);
      SCOPED_TRACE(::testing::Message() << FmtName(fmt) << " code 0x" << std::hex << c);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got));
        EXPECT_TRUE(std::isnan(table[c]));
      } else {
        EXPECT_EQ(static_cast<double>(got), want);
        EXPECT_EQ(std::signbit(got), std::signbit(want));
        EXPECT_EQ(std::memcmp(&table[c], &got, sizeof(float)), 0);
      }
    }
  }
}

// Spot values straight from the OCP spec tables (not derived from any formula).
TEST(Fp8Codec, C02_SpecTableValues) {
  const Fp8Format e4 = Fp8Format::kE4M3, e5 = Fp8Format::kE5M2;
  EXPECT_EQ(DecodeFp8(0x7E, e4), 448.0f);
  EXPECT_EQ(DecodeFp8(0xFE, e4), -448.0f);
  EXPECT_EQ(DecodeFp8(0x08, e4), std::ldexp(1.0f, -6));           // min normal
  EXPECT_EQ(DecodeFp8(0x07, e4), 0.875f * std::ldexp(1.0f, -6));  // max subnormal
  EXPECT_EQ(DecodeFp8(0x01, e4), std::ldexp(1.0f, -9));           // min subnormal
  EXPECT_EQ(DecodeFp8(0x38, e4), 1.0f);
  EXPECT_EQ(DecodeFp8(0x78, e4), 256.0f);  // S.1111.000 is a normal number in E4M3
  EXPECT_TRUE(std::isnan(DecodeFp8(0x7F, e4)));
  EXPECT_TRUE(std::isnan(DecodeFp8(0xFF, e4)));
  int e4_nans = 0, e4_infs = 0;
  for (int c = 0; c < 256; ++c) {
    e4_nans += std::isnan(DecodeFp8(static_cast<uint8_t>(c), e4));
    e4_infs += std::isinf(DecodeFp8(static_cast<uint8_t>(c), e4));
  }
  EXPECT_EQ(e4_nans, 2);
  EXPECT_EQ(e4_infs, 0);

  EXPECT_EQ(DecodeFp8(0x7B, e5), 57344.0f);
  EXPECT_EQ(DecodeFp8(0xFB, e5), -57344.0f);
  EXPECT_EQ(DecodeFp8(0x7C, e5), kInf);
  EXPECT_EQ(DecodeFp8(0xFC, e5), -kInf);
  EXPECT_TRUE(std::isnan(DecodeFp8(0x7D, e5)));
  EXPECT_TRUE(std::isnan(DecodeFp8(0x7E, e5)));
  EXPECT_TRUE(std::isnan(DecodeFp8(0x7F, e5)));
  EXPECT_EQ(DecodeFp8(0x04, e5), std::ldexp(1.0f, -14));
  EXPECT_EQ(DecodeFp8(0x01, e5), std::ldexp(1.0f, -16));
  EXPECT_EQ(DecodeFp8(0x3C, e5), 1.0f);
  EXPECT_EQ(Fp8Max(e4), 448.0f);
  EXPECT_EQ(Fp8Max(e5), 57344.0f);
}

TEST(Fp8Codec, C02_RoundTripEveryFiniteCode) {
  for (Fp8Format fmt : kFormats) {
    for (int c = 0; c < 256; ++c) {
      if (!RefIsFinite(static_cast<uint8_t>(c), fmt)) continue;
      const float v = static_cast<float>(RefDecode(static_cast<uint8_t>(c), fmt));
      EXPECT_EQ(EncodeFp8(v, fmt), c) << FmtName(fmt) << " value " << v;
    }
  }
}

// Midpoints between adjacent positive codes (exact in f32: one more bit than the format) must
// go to the code with the even mantissa; one f32 ulp either side must go to the nearer code.
TEST(Fp8Codec, C02_TiesRoundToEven) {
  for (Fp8Format fmt : kFormats) {
    int ties = 0;
    for (int c = 0; c < 127; ++c) {
      const double lo = RefDecode(static_cast<uint8_t>(c), fmt);
      const double hi = RefDecode(static_cast<uint8_t>(c + 1), fmt);
      if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
      const float mid = static_cast<float>((lo + hi) / 2);
      ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);  // exact
      const int even = (c % 2 == 0) ? c : c + 1;
      SCOPED_TRACE(::testing::Message() << FmtName(fmt) << " between codes " << c << ", " << c + 1);
      EXPECT_EQ(EncodeFp8(mid, fmt), even);
      EXPECT_EQ(EncodeFp8(-mid, fmt), 0x80 | even);
      EXPECT_EQ(EncodeFp8(std::nextafter(mid, 0.0f), fmt), c);
      EXPECT_EQ(EncodeFp8(std::nextafter(mid, kInf), fmt), c + 1);
      EXPECT_EQ(EncodeFp8(-std::nextafter(mid, kInf), fmt), 0x80 | (c + 1));
      ++ties;
    }
    EXPECT_GT(ties, 100);
  }
  // A concrete case: E4M3 1.0 (0x38) and 1.125 (0x39): 1.0625 -> 1.0; 1.1875 -> 1.25 (0x3A).
  EXPECT_EQ(EncodeFp8(1.0625f, Fp8Format::kE4M3), 0x38);
  EXPECT_EQ(EncodeFp8(1.1875f, Fp8Format::kE4M3), 0x3A);
}

TEST(Fp8Codec, C02_SaturatesNeverInf) {
  const Fp8Format e4 = Fp8Format::kE4M3, e5 = Fp8Format::kE5M2;
  for (float x : {448.0f, 449.0f, 464.0f, 479.0f, 480.0f, 500.0f, 1e6f,
                  std::numeric_limits<float>::max(), kInf}) {
    EXPECT_EQ(EncodeFp8(x, e4), 0x7E) << x;
    EXPECT_EQ(EncodeFp8(-x, e4), 0xFE) << -x;
    EXPECT_EQ(DecodeFp8(EncodeFp8(x, e4), e4), 448.0f) << x;
  }
  for (float x :
       {57344.0f, 60000.0f, 61440.0f, 65536.0f, 1e9f, std::numeric_limits<float>::max(), kInf}) {
    EXPECT_EQ(EncodeFp8(x, e5), 0x7B) << x;
    EXPECT_EQ(EncodeFp8(-x, e5), 0xFB) << -x;
    EXPECT_EQ(DecodeFp8(EncodeFp8(x, e5), e5), 57344.0f) << x;
    EXPECT_EQ(DecodeFp8(EncodeFp8(-x, e5), e5), -57344.0f) << x;
  }
  // Just below max still rounds normally: E4M3 420 is between 416 and 448 -> 416 (0x7D).
  EXPECT_EQ(EncodeFp8(420.0f, e4), 0x7D);
  EXPECT_EQ(EncodeFp8(440.0f, e4), 0x7E);
}

TEST(Fp8Codec, C02_NaNStaysNaN) {
  for (Fp8Format fmt : kFormats) {
    for (float x :
         {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
          std::numeric_limits<float>::signaling_NaN()}) {
      EXPECT_TRUE(std::isnan(DecodeFp8(EncodeFp8(x, fmt), fmt))) << FmtName(fmt);
    }
  }
}

TEST(Fp8Codec, C02_TinyValuesAndSubnormals) {
  for (Fp8Format fmt : kFormats) {
    const double min_sub = RefDecode(0x01, fmt);
    const float half = static_cast<float>(min_sub / 2);
    EXPECT_EQ(EncodeFp8(half, fmt), 0x00) << FmtName(fmt);  // tie -> even (zero)
    EXPECT_EQ(EncodeFp8(-half, fmt), 0x80) << FmtName(fmt);
    EXPECT_EQ(EncodeFp8(std::nextafter(half, 0.0f), fmt), 0x00);
    EXPECT_EQ(EncodeFp8(half * 0.25f, fmt), 0x00);
    EXPECT_EQ(EncodeFp8(1e-30f, fmt), 0x00);
    EXPECT_EQ(EncodeFp8(std::numeric_limits<float>::denorm_min(), fmt), 0x00);
    EXPECT_EQ(EncodeFp8(std::nextafter(half, 1.0f), fmt), 0x01);
    EXPECT_EQ(EncodeFp8(0.0f, fmt), 0x00);
    EXPECT_EQ(EncodeFp8(-0.0f, fmt), 0x80);
    // 1.5 * min subnormal is a tie between codes 1 and 2 -> 2 (even).
    EXPECT_EQ(EncodeFp8(static_cast<float>(1.5 * min_sub), fmt), 0x02);
  }
}

// Random f32 values over the whole FP8 range and beyond, against the nearest-value search.
TEST(Fp8Codec, C02_RandomValuesMatchNearestSearch) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-26, 20);
  for (Fp8Format fmt : kFormats) {
    for (int i = 0; i < 200000; ++i) {
      float x = std::ldexp(mant(rng), expo(rng));
      if (i & 1) x = -x;
      ASSERT_EQ(EncodeFp8(x, fmt), RefEncode(x, fmt)) << FmtName(fmt) << " x=" << x;
    }
  }
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(RoundBf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);  // tie, 1.0 is even
  EXPECT_EQ(RoundBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_EQ(RoundBf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)),
            1.0f + std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(RoundBf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(RoundBf16(kInf), kInf);
  EXPECT_EQ(RoundBf16(-kInf), -kInf);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-100, 100);
  for (int i = 0; i < 100000; ++i) {
    float x = std::ldexp(mant(rng), expo(rng));
    if (i & 1) x = -x;
    ASSERT_EQ(RoundBf16(x), RefBf16(x)) << x;
  }
}

}  // namespace
}  // namespace fsdp8
