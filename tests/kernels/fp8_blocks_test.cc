// The block-scaled FP8 ops of the rowwise and blockwise recipes (Backend::QuantizeFp8Blocks,
// GemmFp8Blocks) on both CPU backends, against hand computations: every expected code comes from
// the E4M3 table of the OCP FP8 specification (sign | 4 exponent bits, bias 7 | 3 mantissa bits)
// worked out in the comments, every scale from fp8_max / amax, every GEMM result from the codes'
// values and the scales by hand.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace fsdp8 {
namespace {

class Fp8BlocksTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string error;
    be_ = CreateBackend(GetParam(), 0, &error);
    ASSERT_NE(be_, nullptr) << error;
  }
  template <typename T>
  T* Dev(const std::vector<T>& host) {
    T* p = static_cast<T*>(be_->Alloc(sizeof(T) * std::max<size_t>(host.size(), 1)));
    if (!host.empty()) be_->CopyToDevice(p, host.data(), sizeof(T) * host.size());
    ptrs_.push_back(p);
    return p;
  }
  template <typename T>
  T* Out(size_t n) {
    T* p = static_cast<T*>(be_->Alloc(sizeof(T) * n));
    be_->Memset(p, 0xFF, sizeof(T) * n);  // poison: every element must be written
    ptrs_.push_back(p);
    return p;
  }
  template <typename T>
  std::vector<T> Host(const T* p, size_t n) {
    std::vector<T> h(n);
    be_->Synchronize();
    be_->CopyToHost(h.data(), p, sizeof(T) * n);
    return h;
  }
  void TearDown() override {
    for (void* p : ptrs_) be_->Free(p);
  }

  std::unique_ptr<Backend> be_;
  std::vector<void*> ptrs_;
};

// The 2 x 256 input of the quantization cases: row 0 has 448, 1, -0.5 in its first 128-column
// tile and 2, 1, 0.01 in its second; row 1 is zero in its first tile and has 1 and -3 in its
// second.
std::vector<float> Input2x256() {
  std::vector<float> x(2 * 256, 0.0f);
  x[0] = 448.0f;
  x[1] = 1.0f;
  x[2] = -0.5f;
  x[128] = 2.0f;
  x[129] = 1.0f;
  x[130] = 0.01f;
  x[256 + 128] = 1.0f;
  x[256 + 255] = -3.0f;
  return x;
}

// 1 / scale for amax 3: scale = 448 / 3 = 149.333... rounded to f32.
float InvScaleForAmax3() { return 1.0f / static_cast<float>(448.0 / 3.0); }

TEST(Fp8Blocks, ScaleCountsAndScaleRule) {
  EXPECT_EQ(Fp8ScaleCount(Fp8Blocks::kRow, 300, 200), 300);
  EXPECT_EQ(Fp8ScaleCount(Fp8Blocks::kTile128, 300, 200), 300 * 2);  // 200 -> 2 tiles
  EXPECT_EQ(Fp8ScaleCount(Fp8Blocks::kBlock128, 300, 200), 3 * 2);   // 300 -> 3 block rows
  EXPECT_EQ(Fp8ScaleCount(Fp8Blocks::kBlock128, 128, 128), 1);
  EXPECT_EQ(Fp8ScaleCount(Fp8Blocks::kTile128, 2, 129), 4);
  EXPECT_EQ(Fp8BlockScale(3.0f, 448.0f), static_cast<float>(448.0 / 3.0));
  EXPECT_EQ(Fp8BlockScale(448.0f, 448.0f), 1.0f);
  EXPECT_EQ(Fp8BlockScale(0.0f, 448.0f), 1.0f);  // amax 0: scale 1
  EXPECT_EQ(Fp8BlockScale(std::numeric_limits<float>::infinity(), 448.0f), 1.0f);
  EXPECT_EQ(Fp8BlockScale(std::numeric_limits<float>::quiet_NaN(), 448.0f), 1.0f);
  EXPECT_EQ(Fp8BlockScale(1e-40f, 448.0f), FLT_MAX);  // clamped, never inf
}

TEST_P(Fp8BlocksTest, QuantizeTile128HandValues) {
  const std::vector<float> x = Input2x256();
  uint8_t* out = Out<uint8_t>(512);
  float* s = Out<float>(4);
  uint8_t* out_t = Out<uint8_t>(512);
  float* s_t = Out<float>(256);
  be_->QuantizeFp8Blocks(Dev(x), 2, 256, Fp8Blocks::kTile128, Fp8Format::kE4M3, out, s, out_t,
                         s_t);
  const auto q = Host(out, 512);
  const auto si = Host(s, 4);
  // Tile (0, 0): amax 448, scale 1. 448 = 1.75 * 2^8 -> 0 1111 110 = 0x7E; 1 = 0 0111 000 = 0x38;
  // -0.5 = 1 0110 000 = 0xB0.
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[1], 0x38);
  EXPECT_EQ(q[2], 0xB0);
  // Tile (0, 1): amax 2, scale 224. 2 * 224 = 448 -> 0x7E; 1 * 224 = 1.75 * 2^7 -> 0 1110 110 =
  // 0x76; 0.01 * 224 = 2.24 -> nearest of 2.0 and 2.25 is 2.25 = 1.125 * 2 -> 0 1000 001 = 0x41.
  EXPECT_EQ(q[128], 0x7E);
  EXPECT_EQ(q[129], 0x76);
  EXPECT_EQ(q[130], 0x41);
  // Tile (1, 0): all zero, amax 0 -> scale 1, codes 0.
  EXPECT_EQ(q[256], 0x00);
  // Tile (1, 1): amax 3, scale 149.33: 1 -> 149.33, nearest of 144 (1.125 * 2^7 = 0 1110 001 =
  // 0x71) and 160 is 144; -3 -> -448 -> 0xFE.
  EXPECT_EQ(q[256 + 128], 0x71);
  EXPECT_EQ(q[256 + 255], 0xFE);
  EXPECT_EQ(si[0], 1.0f);
  EXPECT_EQ(si[1], 1.0f / 224.0f);
  EXPECT_EQ(si[2], 1.0f);
  EXPECT_EQ(si[3], InvScaleForAmax3());
  // The transpose (256, 2) in 1 x 128 tiles along its rows: each row of it (a column of x, two
  // values) is one tile. Column 0: amax 448, scale 1. Column 128: 2 and 1, amax 2, scale 224:
  // 0x7E, 0x76. Column 255: 0 and -3, scale 149.33: 0x00, 0xFE. Column 5: zero, scale 1.
  const auto qt = Host(out_t, 512);
  const auto st = Host(s_t, 256);
  EXPECT_EQ(qt[0], 0x7E);
  EXPECT_EQ(qt[1], 0x00);
  EXPECT_EQ(qt[2 * 128], 0x7E);
  EXPECT_EQ(qt[2 * 128 + 1], 0x76);
  EXPECT_EQ(qt[2 * 255], 0x00);
  EXPECT_EQ(qt[2 * 255 + 1], 0xFE);
  EXPECT_EQ(st[0], 1.0f);
  EXPECT_EQ(st[5], 1.0f);
  EXPECT_EQ(st[128], 1.0f / 224.0f);
  EXPECT_EQ(st[255], InvScaleForAmax3());
}

TEST_P(Fp8BlocksTest, QuantizeRowHandValues) {
  const std::vector<float> x = Input2x256();
  uint8_t* out = Out<uint8_t>(512);
  float* s = Out<float>(2);
  be_->QuantizeFp8Blocks(Dev(x), 2, 256, Fp8Blocks::kRow, Fp8Format::kE4M3, out, s);
  const auto q = Host(out, 512);
  const auto si = Host(s, 2);
  // Row 0: amax 448, scale 1. 2 -> 0 1000 000 = 0x40; 0.01 is an E4M3 subnormal: 0.01 / 2^-9 =
  // 5.12 -> 5 -> 0x05.
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[128], 0x40);
  EXPECT_EQ(q[129], 0x38);
  EXPECT_EQ(q[130], 0x05);
  // Row 1: amax 3, scale 149.33 (as tile (1, 1) above).
  EXPECT_EQ(q[256 + 128], 0x71);
  EXPECT_EQ(q[256 + 255], 0xFE);
  EXPECT_EQ(si[0], 1.0f);
  EXPECT_EQ(si[1], InvScaleForAmax3());
  // The transposed cast alone: per column of x (as the tiled transpose, each column one row).
  uint8_t* out_t = Out<uint8_t>(512);
  float* s_t = Out<float>(256);
  be_->QuantizeFp8Blocks(Dev(x), 2, 256, Fp8Blocks::kRow, Fp8Format::kE4M3, nullptr, nullptr,
                         out_t, s_t);
  const auto qt = Host(out_t, 512);
  const auto st = Host(s_t, 256);
  EXPECT_EQ(qt[2 * 128], 0x7E);
  EXPECT_EQ(qt[2 * 128 + 1], 0x76);
  EXPECT_EQ(qt[2 * 255 + 1], 0xFE);
  EXPECT_EQ(st[128], 1.0f / 224.0f);
  EXPECT_EQ(st[255], InvScaleForAmax3());
}

TEST_P(Fp8BlocksTest, QuantizeBlock128HandValuesAndTransposeWithoutRequantization) {
  const std::vector<float> x = Input2x256();
  uint8_t* out = Out<uint8_t>(512);
  float* s = Out<float>(2);
  uint8_t* out_t = Out<uint8_t>(512);
  float* s_t = Out<float>(2);
  be_->QuantizeFp8Blocks(Dev(x), 2, 256, Fp8Blocks::kBlock128, Fp8Format::kE4M3, out, s, out_t,
                         s_t);
  const auto q = Host(out, 512);
  const auto si = Host(s, 2);
  // Block (0, 0) (rows 0-1, columns 0-127): amax 448, scale 1.
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[1], 0x38);
  EXPECT_EQ(q[2], 0xB0);
  // Block (0, 1) (rows 0-1, columns 128-255): amax 3, scale 149.33. 2 -> 298.67, nearest of 288
  // (1.125 * 2^8 = 0 1111 001 = 0x79) and 320 is 288; 1 -> 0x71; 0.01 -> 1.493, nearest of 1.375
  // and 1.5 (0 0111 100 = 0x3C) is 1.5; -3 -> 0xFE.
  EXPECT_EQ(q[128], 0x79);
  EXPECT_EQ(q[129], 0x71);
  EXPECT_EQ(q[130], 0x3C);
  EXPECT_EQ(q[256 + 128], 0x71);
  EXPECT_EQ(q[256 + 255], 0xFE);
  EXPECT_EQ(si[0], 1.0f);
  EXPECT_EQ(si[1], InvScaleForAmax3());
  // The transpose: the same codes, transposed, and the (1, 2) scales as (2, 1).
  const auto qt = Host(out_t, 512);
  for (int r = 0; r < 2; ++r) {
    for (int c = 0; c < 256; ++c) ASSERT_EQ(qt[c * 2 + r], q[r * 256 + c]) << r << "," << c;
  }
  const auto st = Host(s_t, 2);
  EXPECT_EQ(st[0], 1.0f);
  EXPECT_EQ(st[1], InvScaleForAmax3());
}

TEST_P(Fp8BlocksTest, QuantizeBf16InputAndE5M2) {
  // bf16 input: the values widened exactly. 3 in bf16 is 0x4040; amax 3 in E5M2 (max 57344):
  // scale 57344 / 3 = 19114.67; 3 -> 57344 -> 0 11110 11 = 0x7B; 1 -> 19114.67, E5M2 at 2^14
  // (step 4096): nearest of 16384 (0 11101 00 = 0x74) and 20480 (1.25 * 2^14 = 0 11101 01 = 0x75)
  // is 20480.
  const std::vector<uint16_t> x16 = {0x4040, 0x3F80};  // 3, 1
  uint8_t* out = Out<uint8_t>(2);
  float* s = Out<float>(1);
  be_->QuantizeFp8Blocks(Dev(x16), 1, 2, Fp8Blocks::kRow, Fp8Format::kE5M2, out, s);
  const auto q = Host(out, 2);
  EXPECT_EQ(q[0], 0x7B);
  EXPECT_EQ(q[1], 0x75);
  EXPECT_EQ(Host(s, 1)[0], 1.0f / static_cast<float>(57344.0 / 3.0));
}

TEST_P(Fp8BlocksTest, GemmRowwiseHandValues) {
  // A (2, 3) codes [1, 2, -0.5; 448, 0, 1] with row scales_inv [0.5, 3]; B (2, 3) codes
  // [1, 1, 1; 2, -0.5, 448] with [2, 0.25]. C[i, j] = sa[i] sb[j] Σ_k a[i, k] b[j, k]:
  // C00 = 0.5 * 2 * 2.5 = 2.5, C01 = 0.5 * 0.25 * (2 - 1 - 224) = -27.875,
  // C10 = 3 * 2 * 449 = 2694, C11 = 3 * 0.25 * (896 + 0 + 448) = 1008.
  const std::vector<uint8_t> a = {0x38, 0x40, 0xB0, 0x7E, 0x00, 0x38};
  const std::vector<uint8_t> b = {0x38, 0x38, 0x38, 0x40, 0xB0, 0x7E};
  float* C = Out<float>(4);
  be_->GemmFp8Blocks(2, 2, 3, {Dev(a), Fp8Format::kE4M3, Dev(std::vector<float>{0.5f, 3.0f}),
                               Fp8Blocks::kRow},
                     {Dev(b), Fp8Format::kE4M3, Dev(std::vector<float>{2.0f, 0.25f}),
                      Fp8Blocks::kRow},
                     C, false);
  const auto c = Host(C, 4);
  EXPECT_EQ(c[0], 2.5f);
  EXPECT_EQ(c[1], -27.875f);
  EXPECT_EQ(c[2], 2694.0f);
  EXPECT_EQ(c[3], 1008.0f);
}

TEST_P(Fp8BlocksTest, GemmTileByBlockHandValuesPerChunk) {
  // A (2, 256) in 1 x 128 tiles: a[0,0] = 1, a[0,128] = 2, a[1,5] = -0.5, a[1,200] = 448, scales_inv
  // [0.5, 0.25; 2, 0.125]. B (1, 256) in 128 x 128 blocks: b[0,0] = 2, b[0,5] = 1, b[0,128] = 1,
  // b[0,200] = -0.5, scales_inv [4, 8]. Per chunk:
  // C0 = 0.5 * 4 * (1 * 2) + 0.25 * 8 * (2 * 1) = 8;
  // C1 = 2 * 4 * (-0.5 * 1) + 0.125 * 8 * (448 * -0.5) = -4 - 224 = -228.
  // (Row 1 with its first tile's scale throughout would give 2 * 4 * (-0.5 - 224) = -1796.)
  std::vector<uint8_t> a(512, 0), b(256, 0);
  a[0] = 0x38;
  a[128] = 0x40;
  a[256 + 5] = 0xB0;
  a[256 + 200] = 0x7E;
  b[0] = 0x40;
  b[5] = 0x38;
  b[128] = 0x38;
  b[200] = 0xB0;
  const std::vector<float> sa = {0.5f, 0.25f, 2.0f, 0.125f}, sb = {4.0f, 8.0f};
  for (int acc = 0; acc < 2; ++acc) {
    float* C = Dev(std::vector<float>{1.0f, 2.0f});
    be_->GemmFp8Blocks(2, 1, 256, {Dev(a), Fp8Format::kE4M3, Dev(sa), Fp8Blocks::kTile128},
                       {Dev(b), Fp8Format::kE4M3, Dev(sb), Fp8Blocks::kBlock128}, C, acc == 1);
    const auto c = Host(C, 2);
    EXPECT_EQ(c[0], acc ? 9.0f : 8.0f);
    EXPECT_EQ(c[1], acc ? -226.0f : -228.0f);
  }
}

TEST_P(Fp8BlocksTest, GemmTileByTileHandValues) {
  // dW's pair: both operands in 1 x 128 tiles along K. a[0,0] = 1, a[0,130] = 2 with [1, 2];
  // b[0,0] = 2, b[0,130] = -0.5 (E5M2: 1 01110 00 = 0xB8) with [4, 0.5]:
  // C = 1 * 4 * 2 + 2 * 0.5 * (2 * -0.5) = 7.
  std::vector<uint8_t> a(256, 0), b(256, 0);
  a[0] = 0x38;
  a[130] = 0x40;
  b[0] = 0x40;   // E5M2 2 = 0 10000 00
  b[130] = 0xB8;
  float* C = Out<float>(1);
  be_->GemmFp8Blocks(1, 1, 256,
                     {Dev(a), Fp8Format::kE4M3, Dev(std::vector<float>{1.0f, 2.0f}),
                      Fp8Blocks::kTile128},
                     {Dev(b), Fp8Format::kE5M2, Dev(std::vector<float>{4.0f, 0.5f}),
                      Fp8Blocks::kTile128},
                     C, false);
  EXPECT_EQ(Host(C, 1)[0], 7.0f);
}

TEST_P(Fp8BlocksTest, QuantizeThenGemmRecoversTheProductOfPowerOfTwoRatioInputs) {
  // Inputs whose nonzero values within any tile or block differ by powers of two (x in
  // {0, ±0.5, ±1}, w in {0, ±0.75, ±1.5}): scaled by fp8_max / amax they land on 448 * 2^-k,
  // E4M3 values, so the codes are exact and the blockwise GEMM gives the f32 product of the inputs
  // up to the roundings of the scales (scale and 1 / scale: 2 u per operand) and the sums (K u).
  const int64_t M = 3, N = 130, K = 300;  // tails in every dimension
  const float xv[] = {-1.0f, -0.5f, 0.0f, 0.5f, 1.0f}, wv[] = {-1.5f, -0.75f, 0.0f, 0.75f, 1.5f};
  std::vector<float> x(M * K), w(N * K);
  for (int64_t i = 0; i < M * K; ++i) x[i] = xv[(i * 7) % 5];
  for (int64_t i = 0; i < N * K; ++i) w[i] = wv[(i * 3) % 5];
  uint8_t* xq = Out<uint8_t>(M * K);
  float* xs = Out<float>(Fp8ScaleCount(Fp8Blocks::kTile128, M, K));
  uint8_t* wq = Out<uint8_t>(N * K);
  float* ws = Out<float>(Fp8ScaleCount(Fp8Blocks::kBlock128, N, K));
  be_->QuantizeFp8Blocks(Dev(x), M, K, Fp8Blocks::kTile128, Fp8Format::kE4M3, xq, xs);
  be_->QuantizeFp8Blocks(Dev(w), N, K, Fp8Blocks::kBlock128, Fp8Format::kE4M3, wq, ws);
  float* C = Out<float>(M * N);
  be_->GemmFp8Blocks(M, N, K, {xq, Fp8Format::kE4M3, xs, Fp8Blocks::kTile128},
                     {wq, Fp8Format::kE4M3, ws, Fp8Blocks::kBlock128}, C, false);
  const auto c = Host(C, M * N);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double want = 0, abs_sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double t = static_cast<double>(x[i * K + k]) * w[j * K + k];
        want += t;
        abs_sum += std::fabs(t);
      }
      ASSERT_NEAR(c[i * N + j], want, (K + 8) * std::ldexp(1.0, -24) * abs_sum) << i << "," << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, Fp8BlocksTest, ::testing::Values("cpu", "cpu-ref"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param == "cpu" ? std::string("fast") : std::string("ref");
                         });

}  // namespace
}  // namespace fsdp8
