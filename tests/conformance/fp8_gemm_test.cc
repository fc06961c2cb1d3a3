// Conformance of the FP8 casts, transposes, amax and scale ops, bf16 packing and the GEMMs
// (f32, bf16, FP8, autotuned).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "kernels/fp8.h"
#include "tests/conformance/conformance.h"

namespace fsdp8::conformance {
namespace {

TEST_P(Conformance, CastToFp8) {
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{4099}, int64_t{1} << 20}) {
    for (Fp8Format fmt : kFormats) {
      const auto x = CastInputs(n);
      const std::vector<float> scale = {std::exp2(static_cast<float>(Rng()() % 8) - 2.0f) * 1.37f};
      Check(std::string("CastToFp8/") + FmtName(fmt) + "/" + std::to_string(n), -1, [&](DevRun& r) {
        Outputs o;
        const float* in = r.In(x);
        uint8_t* out = r.Out<uint8_t>(n);
        float* amax = r.In(std::vector<float>{0.5f});
        r.b()->CastFp8(in, 1, n, r.In(scale), fmt, out, nullptr, amax);
        r.Bytes(&o, "out", out, n);
        r.Bytes(&o, "amax", amax, 1);
        return o;
      });
    }
  }
}

TEST_P(Conformance, CastTransposeFp8) {
  const int64_t shapes[][2] = {{1, 1}, {37, 129}, {64, 64}, {128, 2048}, {257, 96}, {1000, 37}};
  for (auto& s : shapes) {
    const int64_t rows = s[0], cols = s[1];
    for (Fp8Format fmt : kFormats) {
      auto x = Randn(rows * cols, 3.0f);
      x[static_cast<size_t>(rows * cols / 2)] = 1e6f;  // saturates
      const std::vector<float> scale = {20.0f};
      Check(std::string("CastTransposeFp8/") + FmtName(fmt) + "/" + std::to_string(rows) + "x" + std::to_string(cols), -1,
            [&](DevRun& r) {
              Outputs o;
              uint8_t* out = r.Out<uint8_t>(rows * cols);
              uint8_t* out_t = r.Out<uint8_t>(rows * cols);
              float* amax = r.In(std::vector<float>{0.0f});
              r.b()->CastFp8(r.In(x), rows, cols, r.In(scale), fmt, out, out_t, amax);
              r.Bytes(&o, "out", out, rows * cols);
              r.Bytes(&o, "out_t", out_t, rows * cols);
              r.Bytes(&o, "amax", amax, 1);
              // Transposed only, no amax.
              uint8_t* out_t2 = r.Out<uint8_t>(rows * cols);
              r.b()->CastFp8(r.In(x), rows, cols, r.In(scale), fmt, nullptr, out_t2, nullptr);
              r.Bytes(&o, "out_t_only", out_t2, rows * cols);
              return o;
            });
    }
  }
}

TEST_P(Conformance, TransposeBytes) {
  const int64_t shapes[][2] = {{1, 7}, {37, 129}, {64, 128}, {256, 192}, {300, 260}, {2048, 5632 / 4}};
  for (auto& s : shapes) {
    const int64_t rows = s[0], cols = s[1];
    const auto x = Fp8Codes(rows * cols, Fp8Format::kE5M2);
    Check("TransposeBytes/" + std::to_string(rows) + "x" + std::to_string(cols), -1, [&](DevRun& r) {
      Outputs o;
      uint8_t* out = r.Out<uint8_t>(rows * cols);
      r.b()->TransposeBytes(r.In(x), rows, cols, out);
      r.Bytes(&o, "out", out, rows * cols);
      // Misaligned input and output (the byte-by-byte paths of full tiles).
      std::vector<uint8_t> x1(x.size() + 1);
      std::copy(x.begin(), x.end(), x1.begin() + 1);
      uint8_t* out1 = r.Out<uint8_t>(rows * cols + 1);
      r.b()->TransposeBytes(r.In(x1) + 1, rows, cols, out1 + 1);
      r.Bytes(&o, "out_misaligned", out1 + 1, rows * cols);
      return o;
    });
  }
}

TEST_P(Conformance, DequantizeFp8) {
  for (Fp8Format fmt : kFormats) {
    std::vector<uint8_t> codes(256 * 5);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i);
    const std::vector<float> sinv = {0.0625f};
    Check(std::string("DequantizeFp8/") + FmtName(fmt), -1, [&](DevRun& r) {
      Outputs o;
      const int64_t n = static_cast<int64_t>(codes.size());
      float* out = r.Out<float>(n);
      r.b()->DequantizeFp8(r.In(codes), out, n, r.In(sinv), fmt);
      r.F32(&o, "out", out, n);
      return o;
    });
  }
}

TEST_P(Conformance, AmaxAccumulate) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{129}, int64_t{1} << 20}) {
    auto x = Randn(n, 2.0f);
    Check("AmaxAccumulate/" + std::to_string(n), -1, [&](DevRun& r) {
      Outputs o;
      float* amax = r.In(std::vector<float>{0.25f});
      r.b()->AmaxAccumulate(r.In(x), n, amax);
      r.Bytes(&o, "amax", amax, 1);
      return o;
    });
  }
  std::vector<float> with_nan = Randn(1000);
  with_nan[500] = NAN;
  Check("AmaxAccumulate/nan", 0.0, [&](DevRun& r) {
    Outputs o;
    float* amax = r.In(std::vector<float>{0.0f});
    r.b()->AmaxAccumulate(r.In(with_nan), 1000, amax);
    r.F32(&o, "amax", amax, 1);
    return o;
  });
}

TEST_P(Conformance, Bf16) {
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{100003}}) {
    auto x = CastInputs(n);
    Check("RoundToBf16/" + std::to_string(n), -1, [&](DevRun& r) {
      Outputs o;
      float* p = r.In(x);
      r.b()->RoundToBf16(p, n);
      r.F32(&o, "x", p, n);
      return o;
    });
    Check("PackUnpackBf16/" + std::to_string(n), -1, [&](DevRun& r) {
      Outputs o;
      uint16_t* packed = r.Out<uint16_t>(n);
      float* un = r.Out<float>(n);
      r.b()->PackBf16(r.In(x), packed, n);
      r.b()->UnpackBf16(packed, un, n);
      r.Bytes(&o, "packed", packed, n);
      r.F32(&o, "unpacked", un, n);
      return o;
    });
  }
}

TEST_P(Conformance, Fp8ScalesFromAmax) {
  // Random amaxes over many binades plus the special cases, random previous scales (some not
  // usable); exact: the device's double arithmetic must give the CPU's bits.
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> amax = Uniform(300, -40.0f, 40.0f), prev = Uniform(300, -5.0f, 5.0f);
  for (size_t i = 0; i < amax.size(); ++i) amax[i] = std::ldexp(1.0f + std::fabs(amax[i]) / 40.0f, static_cast<int>(amax[i]) * 3);
  for (size_t i = 0; i < prev.size(); ++i) prev[i] = std::exp(prev[i]);
  const float specials[] = {0.0f, -0.0f, -1.0f, inf, std::nanf(""), 1e-45f, FLT_MAX};
  for (size_t i = 0; i < 7; ++i) amax[i] = specials[i];
  prev[0] = inf;
  prev[1] = -2.0f;
  prev[2] = std::nanf("");
  const int64_t n = static_cast<int64_t>(amax.size()), stride = 4;
  std::vector<float> slots(n * stride, 0.0f);
  for (int64_t i = 0; i < n; ++i) slots[i * stride] = prev[i];
  for (int margin : {0, 3}) {
    for (float fmax : {448.0f, 57344.0f}) {
      Check("Fp8ScalesFromAmax/margin" + std::to_string(margin) + "/max" + std::to_string(static_cast<int>(fmax)), -1,
            [&](DevRun& r) {
              Outputs o;
              float* sc = r.In(slots);
              float* inv = r.Out<float>(n * stride);
              r.b()->Memset(inv, 0, n * stride * sizeof(float));
              r.b()->Fp8ScalesFromAmax(r.In(amax), n, fmax, margin, sc, inv, stride);
              r.F32(&o, "scale", sc, n * stride);
              r.F32(&o, "scale_inv", inv, n * stride);
              return o;
            });
    }
  }
}

TEST_P(Conformance, GroupMax) {
  // 300 amaxes in groups of 1 to 4 members (contiguous and interleaved), with a NaN and an inf in
  // two groups; exact.
  std::vector<float> in = Uniform(300, 0.0f, 100.0f);
  in[10] = std::nanf("");
  in[20] = std::numeric_limits<float>::infinity();
  std::vector<int32_t> group(in.size());
  for (size_t i = 0; i < group.size(); ++i) {
    group[i] = i < 200 ? static_cast<int32_t>(i / 3 * 3) : static_cast<int32_t>(200 + i % 7);
  }
  Check("GroupMax", -1, [&](DevRun& r) {
    Outputs o;
    const int64_t n = static_cast<int64_t>(in.size());
    float* out = r.Out<float>(n);
    r.b()->GroupMax(r.In(in), r.In(group), n, out);
    r.F32(&o, "out", out, n);
    return o;
  });
}

TEST_P(Conformance, GemmFp8) {
  struct S { int64_t M, N, K; };
  const S shapes[] = {{1, 1, 1}, {37, 129, 16}, {33, 17, 37}, {128, 256, 512}, {256, 2048, 2048},
                      {512, 5632, 2048}, {512, 2048, 5632}};
  const Fp8Format pairs[][2] = {{Fp8Format::kE4M3, Fp8Format::kE4M3},
                                {Fp8Format::kE5M2, Fp8Format::kE4M3},
                                {Fp8Format::kE4M3, Fp8Format::kE5M2}};
  for (const S& s : shapes) {
    for (auto& f : pairs) {
      // Codes limited to |v| <= 2^4 so that sums of K products stay far from overflow.
      auto codes = [&](int64_t n, Fp8Format fmt) {
        auto c = Fp8Codes(n, fmt);
        for (auto& x : c) x = static_cast<uint8_t>((x & 0x80) | ((x & 0x7F) % (fmt == Fp8Format::kE4M3 ? 0x58 : 0x4C)));
        return c;
      };
      const auto A = codes(s.M * s.K, f[0]);
      const auto B = codes(s.N * s.K, f[1]);
      const std::vector<float> sa = {0.375f}, sb = {1.0f / 3.0f};
      const auto C0 = Randn(s.M * s.N);
      // fast: the forward GEMMs' fast accumulation (SetFp8FastAccumulation), which keeps the
      // accumulator's ~14 bits over all of K instead of promoting to FP32 every few blocks: each
      // addition still carries at most 2^-13 of the running sum, the model Fp8GemmTol assumes.
      for (int mode = 0; mode < 3; ++mode) {
        const bool acc = mode == 1, fast = mode == 2;
        Check("GemmFp8/" + std::string(FmtName(f[0])) + "x" + FmtName(f[1]) + "/" + std::to_string(s.M) + "x" +
                  std::to_string(s.N) + "x" + std::to_string(s.K) + (acc ? "/acc" : "") + (fast ? "/fast" : ""),
              Fp8GemmTol(s.K), [&](DevRun& r) {
                Outputs o;
                float* C = acc ? r.In(C0) : r.Out<float>(s.M * s.N);
                r.b()->SetFp8FastAccumulation(fast);
                r.b()->GemmFp8(false, true, s.M, s.N, s.K, {r.In(A), f[0], r.In(sa)},
                               {r.In(B), f[1], r.In(sb)}, C, acc);
                r.b()->SetFp8FastAccumulation(false);
                r.F32(&o, "C", C, s.M * s.N);
                return o;
              });
      }
    }
  }
}

// The block-scaled casts of the rowwise and blockwise recipes (QuantizeFp8Blocks): codes and
// scales of the cast and of the transposed cast, bit for bit (the cast is exact), from f32 and
// bf16 inputs, with 128-tails in both dimensions, a zero row (amax 0: scale 1) and a saturating
// value.
TEST_P(Conformance, QuantizeFp8Blocks) {
  const int64_t shapes[][2] = {{1, 1}, {37, 129}, {128, 256}, {257, 300}, {1000, 37}};
  const Fp8Blocks kinds[] = {Fp8Blocks::kRow, Fp8Blocks::kTile128, Fp8Blocks::kBlock128};
  const char* kind_names[] = {"row", "tile128", "block128"};
  for (auto& sh : shapes) {
    const int64_t rows = sh[0], cols = sh[1], n = rows * cols;
    auto x = Randn(n, 3.0f);
    if (rows > 1) std::fill(x.begin(), x.begin() + cols, 0.0f);
    x[static_cast<size_t>(n / 2)] = 1e6f;
    for (int k = 0; k < 3; ++k) {
      const Fp8Blocks kind = kinds[k];
      const int64_t ns = Fp8ScaleCount(kind, rows, cols), nst = Fp8ScaleCount(kind, cols, rows);
      for (Fp8Format fmt : kFormats) {
        for (int bf16 = 0; bf16 < 2; ++bf16) {
          Check(std::string("QuantizeFp8Blocks/") + kind_names[k] + "/" + FmtName(fmt) +
                    (bf16 ? "/bf16/" : "/f32/") + std::to_string(rows) + "x" + std::to_string(cols),
                -1, [&](DevRun& r) {
                  Outputs o;
                  uint8_t* out = r.Out<uint8_t>(n);
                  uint8_t* out_t = r.Out<uint8_t>(n);
                  float* s = r.Out<float>(ns);
                  float* s_t = r.Out<float>(nst);
                  if (bf16) {
                    r.b()->QuantizeFp8Blocks(r.InBf16(x), rows, cols, kind, fmt, out, s, out_t,
                                             s_t);
                  } else {
                    r.b()->QuantizeFp8Blocks(r.In(x), rows, cols, kind, fmt, out, s, out_t, s_t);
                  }
                  r.Bytes(&o, "out", out, n);
                  r.Bytes(&o, "scale_inv", s, ns);
                  r.Bytes(&o, "out_t", out_t, n);
                  r.Bytes(&o, "scale_inv_t", s_t, nst);
                  return o;
                });
        }
      }
    }
  }
}

// The exact kBlock128 transpose of cast codes with their block scales (TransposeFp8Block128, the
// blockwise FP8 wire's Wᵀ for dX): bit for bit the reference's, and on every backend the same
// bytes as QuantizeFp8Blocks' own transposed output (out_t, scale_inv_t) of the values cast, read
// back to the host and compared there; 128-tails in both dimensions.
TEST_P(Conformance, TransposeFp8Block128) {
  const int64_t shapes[][2] = {{1, 1}, {37, 129}, {128, 256}, {257, 300}, {300, 64}};
  for (auto& sh : shapes) {
    const int64_t rows = sh[0], cols = sh[1], n = rows * cols;
    const auto x = Randn(n, 3.0f);
    const int64_t ns = Fp8ScaleCount(Fp8Blocks::kBlock128, rows, cols);
    Check("TransposeFp8Block128/" + std::to_string(rows) + "x" + std::to_string(cols), -1,
          [&](DevRun& r) {
            Outputs o;
            uint8_t* codes = r.Out<uint8_t>(n);
            uint8_t* cast_t = r.Out<uint8_t>(n);
            uint8_t* out_t = r.Out<uint8_t>(n);
            float* s = r.Out<float>(ns);
            float* cast_st = r.Out<float>(ns);
            float* st = r.Out<float>(ns);
            r.b()->QuantizeFp8Blocks(r.In(x), rows, cols, Fp8Blocks::kBlock128, Fp8Format::kE4M3,
                                     codes, s, cast_t, cast_st);
            r.b()->TransposeFp8Block128(codes, s, rows, cols, out_t, st);
            std::vector<uint8_t> a(n), b(n);
            std::vector<float> sa(ns), sb(ns);
            r.b()->CopyToHost(a.data(), out_t, n);
            r.b()->CopyToHost(b.data(), cast_t, n);
            r.b()->CopyToHost(sa.data(), st, ns * sizeof(float));
            r.b()->CopyToHost(sb.data(), cast_st, ns * sizeof(float));
            EXPECT_EQ(a, b) << r.b()->Name() << ": codes differ from the cast's transpose";
            EXPECT_EQ(std::memcmp(sa.data(), sb.data(), ns * sizeof(float)), 0)
                << r.b()->Name() << ": scales differ from the cast's transposed scales";
            r.Bytes(&o, "out_t", out_t, n);
            r.Bytes(&o, "scale_inv_t", st, ns);
            return o;
          });
  }
}

// The block-scaled GEMM (GemmFp8Blocks) for the three operand pairs of the rowwise and blockwise
// recipes. Tolerance: the reference sums exact products in double and rounds once; a backend that
// multiplies each decoded code by its scale in f32 (one rounding per operand element, two per
// product) and accumulates in f32 has the error of a K + 3 term f32 sum (the harness's model,
// conformance.h), so tol(K + 4), judged against at least the size of the terms (abs_scale: the
// largest |C0| + Σ_k |a_k b_k|, a_k and b_k the scaled values), since a short sum (K = 1, with
// accumulation) may cancel to nearly 0. On Hopper's tensor cores the FP8 products of one 128-wide
// K chunk accumulate in the MMA's ~14-bit accumulator before the chunk's scales are applied in
// FP32 (DeepSeek-V3's promotion, which cuBLASLt's block-scaled kernels implement), so the bound
// is GemmFp8's (Fp8GemmTol) where that is larger. The shapes with M, N multiples of 4 reach
// cuBLASLt on the CUDA backend: K = 512 (whole chunks) and K = 320 (a 64-wide tail chunk, the
// 128 x 128 scales' rows padded from 3 to 4), M = 192 (a partial 128-row block of B's scales).
TEST_P(Conformance, GemmFp8Blocks) {
  struct S { int64_t M, N, K; };
  const S shapes[] = {{1, 1, 1}, {37, 129, 16}, {33, 130, 300}, {256, 384, 512}, {192, 256, 320}};
  const Fp8Blocks pairs[][2] = {{Fp8Blocks::kRow, Fp8Blocks::kRow},
                                {Fp8Blocks::kTile128, Fp8Blocks::kBlock128},
                                {Fp8Blocks::kTile128, Fp8Blocks::kTile128}};
  const char* pair_names[] = {"row", "tile128xblock128", "tile128xtile128"};
  const Fp8Format fmts[][2] = {{Fp8Format::kE4M3, Fp8Format::kE4M3},
                               {Fp8Format::kE5M2, Fp8Format::kE4M3}};
  for (const S& s : shapes) {
    for (int p = 0; p < 3; ++p) {
      for (auto& f : fmts) {
        // Codes limited to |v| <= 2^4, as GemmFp8's test.
        auto codes = [&](int64_t n, Fp8Format fmt) {
          auto c = Fp8Codes(n, fmt);
          for (auto& x : c) x = static_cast<uint8_t>((x & 0x80) | ((x & 0x7F) % (fmt == Fp8Format::kE4M3 ? 0x58 : 0x4C)));
          return c;
        };
        const auto A = codes(s.M * s.K, f[0]);
        const auto B = codes(s.N * s.K, f[1]);
        const auto sa = Uniform(Fp8ScaleCount(pairs[p][0], s.M, s.K), 0.01f, 4.0f);
        const auto sb = Uniform(Fp8ScaleCount(pairs[p][1], s.N, s.K), 0.01f, 4.0f);
        const auto C0 = Randn(s.M * s.N);
        // The scaled values' largest Σ_k |a_k b_k| (decoded through the format tables).
        auto scale_of = [](const std::vector<float>& sc, Fp8Blocks kind, int64_t row, int64_t k,
                           int64_t K) {
          const int64_t chunks = Fp8BlockCount(K);
          if (kind == Fp8Blocks::kRow) return sc[row];
          if (kind == Fp8Blocks::kTile128) return sc[row * chunks + k / kFp8BlockSize];
          return sc[(row / kFp8BlockSize) * chunks + k / kFp8BlockSize];
        };
        double terms = 0;
        const float* ta = Fp8DecodeTable(f[0]);
        const float* tb = Fp8DecodeTable(f[1]);
        for (int64_t i = 0; i < s.M; ++i) {
          for (int64_t j = 0; j < s.N; ++j) {
            double t = 0;
            for (int64_t k = 0; k < s.K; ++k) {
              t += std::fabs(ta[A[i * s.K + k]] * scale_of(sa, pairs[p][0], i, k, s.K) *
                             tb[B[j * s.K + k]] * scale_of(sb, pairs[p][1], j, k, s.K));
            }
            terms = std::max(terms, t);
          }
        }
        double c0max = 0;
        for (float v : C0) c0max = std::max(c0max, static_cast<double>(std::fabs(v)));
        for (int acc = 0; acc < 2; ++acc) {
          Check("GemmFp8Blocks/" + std::string(pair_names[p]) + "/" + FmtName(f[0]) + "x" +
                    FmtName(f[1]) + "/" + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" +
                    std::to_string(s.K) + (acc ? "/acc" : ""),
                std::max(Tol(static_cast<double>(s.K) + 4), Fp8GemmTol(s.K)), [&](DevRun& r) {
                  Outputs o;
                  float* C = acc ? r.In(C0) : r.Out<float>(s.M * s.N);
                  r.b()->GemmFp8Blocks(s.M, s.N, s.K, {r.In(A), f[0], r.In(sa), pairs[p][0]},
                                       {r.In(B), f[1], r.In(sb), pairs[p][1]}, C, acc == 1);
                  r.F32Near0(&o, "C", C, s.M * s.N, terms + (acc ? c0max : 0.0));
                  return o;
                });
        }
      }
    }
  }
}

// GemmFp8Layout: every operand layout (the linears' backward on a backend with
// Fp8GemmAnyLayout takes dY and x untransposed) against the reference's transposes + GemmFp8.
TEST_P(Conformance, GemmFp8Layout) {
  struct S { int64_t M, N, K; };
  for (const S& s : {S{1, 1, 1}, S{37, 129, 16}, S{33, 17, 37}, S{128, 384, 2048}}) {
    auto codes = [&](int64_t n, Fp8Format fmt) {  // |v| <= 2^4, as GemmFp8's test
      auto c = Fp8Codes(n, fmt);
      for (auto& x : c) x = static_cast<uint8_t>((x & 0x80) | ((x & 0x7F) % (fmt == Fp8Format::kE4M3 ? 0x58 : 0x4C)));
      return c;
    };
    const auto A = codes(s.M * s.K, Fp8Format::kE5M2);
    const auto B = codes(s.N * s.K, Fp8Format::kE4M3);
    const std::vector<float> sa = {0.375f}, sb = {1.0f / 3.0f};
    const auto C0 = Randn(s.M * s.N);
    for (int layout = 0; layout < 4; ++layout) {
      const bool ta = (layout & 1) != 0, tb = (layout & 2) != 0, acc = layout == 1;
      Check("GemmFp8Layout/" + std::string(ta ? "T" : "N") + (tb ? "T" : "N") + "/" + std::to_string(s.M) + "x" +
                std::to_string(s.N) + "x" + std::to_string(s.K) + (acc ? "/acc" : ""),
            Fp8GemmTol(s.K), [&](DevRun& r) {
              Outputs o;
              float* C = acc ? r.In(C0) : r.Out<float>(s.M * s.N);
              r.b()->GemmFp8(ta, tb, s.M, s.N, s.K, {r.In(A), Fp8Format::kE5M2, r.In(sa)},
                             {r.In(B), Fp8Format::kE4M3, r.In(sb)}, C, acc);
              r.F32(&o, "C", C, s.M * s.N);
              return o;
            });
    }
  }
}

// GEMM autotuning (Backend::SetGemmAutotune): the first call of each shape times the candidate
// algorithms before computing its result. The result must still be the reference's: tuning may
// not run the product into the caller's output (an accumulating or in-place residual GEMM would
// then add it several times), and the tuned algorithm must be a correct one. Shapes not run
// elsewhere in this suite, so each Check's first call is the one that tunes.
TEST_P(Conformance, GemmAutotune) {
  const double bf16_ulp = 2.0 / 256;
  struct S { int64_t M, N, K; };
  auto codes = [&](int64_t n) {
    auto c = Fp8Codes(n, Fp8Format::kE4M3);
    for (auto& v : c) v = static_cast<uint8_t>((v & 0x80) | ((v & 0x7F) % 0x58));
    return c;
  };
  const std::vector<float> sa = {0.375f}, sb = {1.0f / 3.0f};
  for (const S& s : {S{48, 160, 64}, S{384, 2048, 2048}, S{768, 5632, 2048}, S{768, 2048, 5632}}) {
    const std::string shape = std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K);
    const auto A = codes(s.M * s.K), B = codes(s.N * s.K);
    const auto C0 = Randn(s.M * s.N, 4.0f);
    Check("GemmAutotune/GemmFp8/acc/" + shape, Fp8GemmTol(s.K), [&](DevRun& r) {
      Outputs o;
      float* C = r.In(C0);
      r.b()->SetGemmAutotune(true);
      r.b()->GemmFp8(false, true, s.M, s.N, s.K, {r.In(A), Fp8Format::kE4M3, r.In(sa)},
                     {r.In(B), Fp8Format::kE4M3, r.In(sb)}, C, true);
      r.b()->SetGemmAutotune(false);
      r.F32(&o, "C", C, s.M * s.N);
      return o;
    });
    Check("GemmAutotune/GemmFp8AddResidual/fast/" + shape, Fp8GemmTol(s.K), [&](DevRun& r) {
      Outputs o;
      const float* R = r.In(C0);
      float* D = r.Out<float>(s.M * s.N);
      r.b()->SetGemmAutotune(true);
      r.b()->SetFp8FastAccumulation(true);
      r.b()->GemmFp8(false, true, s.M, s.N, s.K, {r.In(A), Fp8Format::kE4M3, r.In(sa)},
                     {r.In(B), Fp8Format::kE4M3, r.In(sb)}, D, false, R);
      r.b()->SetFp8FastAccumulation(false);
      r.b()->SetGemmAutotune(false);
      r.F32(&o, "D", D, s.M * s.N);
      r.F32(&o, "R", R, s.M * s.N);  // unchanged
      return o;
    });
    Check("GemmAutotune/GemmFp8Bf16/" + shape, Fp8GemmTol(s.K) + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t* C = r.Out<uint16_t>(s.M * s.N);
      r.b()->SetGemmAutotune(true);
      r.b()->GemmFp8(false, true, s.M, s.N, s.K, {r.In(A), Fp8Format::kE4M3, r.In(sa)},
                     {r.In(B), Fp8Format::kE4M3, r.In(sb)}, C, false);
      r.b()->SetGemmAutotune(false);
      float* f = r.Out<float>(s.M * s.N);
      r.b()->UnpackBf16(C, f, s.M * s.N);
      r.F32(&o, "C", f, s.M * s.N);
      return o;
    });
  }
  const auto A = Randn(1000 * 96), B = Randn(160 * 96), C0 = Randn(1000 * 160);
  Check("GemmAutotune/GemmBf16/acc/1000x160x96", Tol(97), [&](DevRun& r) {
    Outputs o;
    uint16_t* a16 = r.Out<uint16_t>(1000 * 96);
    uint16_t* b16 = r.Out<uint16_t>(160 * 96);
    r.b()->PackBf16(r.In(A), a16, 1000 * 96);
    r.b()->PackBf16(r.In(B), b16, 160 * 96);
    float* C = r.In(C0);
    r.b()->SetGemmAutotune(true);
    r.b()->Gemm(false, true, 1000, 160, 96, a16, b16, C, true, GemmInputs::kBF16);
    r.b()->SetGemmAutotune(false);
    r.F32(&o, "C", C, 1000 * 160);
    return o;
  });
}

TEST_P(Conformance, Gemm) {
  struct S { int64_t M, N, K; };
  const S shapes[] = {{1, 1, 1}, {37, 129, 65}, {128, 96, 256}, {512, 1024, 768}};
  for (const S& s : shapes) {
    for (GemmInputs in : {GemmInputs::kF32, GemmInputs::kBF16}) {
      for (int t = 0; t < 4; ++t) {
        const bool ta = t & 1, tb = t & 2;
        const bool acc = t == 3;
        const auto A = Randn(s.M * s.K), B = Randn(s.N * s.K), C0 = Randn(s.M * s.N);
        Check("Gemm/" + std::string(in == GemmInputs::kF32 ? "f32" : "bf16") + (ta ? "/At" : "") + (tb ? "/Bt" : "") +
                  "/" + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K) + (acc ? "/acc" : ""),
              Tol(static_cast<double>(s.K) + 1), [&](DevRun& r) {
                Outputs o;
                float* C = acc ? r.In(C0) : r.Out<float>(s.M * s.N);
                r.b()->Gemm(ta, tb, s.M, s.N, s.K, r.In(A), r.In(B), C, acc, in);
                r.F32(&o, "C", C, s.M * s.N);
                return o;
              });
      }
    }
    // Inputs given as bf16 bit patterns (GemmBf16): the bf16 Gemm's values, without its packs.
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const bool acc = t == 3;
      const auto A = Randn(s.M * s.K), B = Randn(s.N * s.K), C0 = Randn(s.M * s.N);
      Check("GemmBf16" + std::string(ta ? "/At" : "") + (tb ? "/Bt" : "") + "/" +
                std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K) +
                (acc ? "/acc" : ""),
            Tol(static_cast<double>(s.K) + 1), [&](DevRun& r) {
              Outputs o;
              uint16_t* a16 = r.Out<uint16_t>(s.M * s.K);
              uint16_t* b16 = r.Out<uint16_t>(s.N * s.K);
              r.b()->PackBf16(r.In(A), a16, s.M * s.K);
              r.b()->PackBf16(r.In(B), b16, s.N * s.K);
              float* C = acc ? r.In(C0) : r.Out<float>(s.M * s.N);
              r.b()->Gemm(ta, tb, s.M, s.N, s.K, a16, b16, C, acc, GemmInputs::kBF16);
              r.F32(&o, "C", C, s.M * s.N);
              return o;
            });
    }
  }
}

}  // namespace
}  // namespace fsdp8::conformance
