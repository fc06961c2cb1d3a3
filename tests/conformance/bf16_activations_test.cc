// Conformance of the bf16-activation ops and of the fused backward cast-transposes against their
// composition.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "tests/conformance/conformance.h"

namespace fsdp8::conformance {
namespace {

// The bfloat16-activation ops (backend.h): inputs packed to bf16 on the device (PackBf16 is
// bit-exact on every backend), bf16 outputs unpacked to f32 for the comparison. Casts from bf16
// must match bit for bit; an op whose f32 math may differ by a few ulps (kEltTol, the attention
// tolerances above) can then round to the neighbouring bf16 value, one bf16 ulp away: up to 2^-7
// of that element, so of the largest one too (normwise), and its bound gains 2^-7 (bf16_ulp).
// FP8 codes of such a value can likewise land one code step apart: the fused casts are compared
// code by code, at most one step (Output::fp8_within_one_code).
TEST_P(Conformance, Bf16Activations) {
  const double ub = 1.0 / 256;          // bf16 unit roundoff, 2^-8
  const double bf16_ulp = 2 * ub;       // one bf16 step, relative: 2^-7
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{4099}, int64_t{1} << 16}) {
    for (Fp8Format fmt : kFormats) {
      const auto x = CastInputs(n);
      const std::vector<float> scale = {2.75f};
      Check(std::string("CastToFp8Bf16/") + FmtName(fmt) + "/" + std::to_string(n), -1, [&](DevRun& r) {
        Outputs o;
        uint8_t* out = r.Out<uint8_t>(n);
        float* amax = r.In(std::vector<float>{0.5f});
        r.b()->CastFp8(r.InBf16(x), 1, n, r.In(scale), fmt, out, nullptr, amax);
        r.Bytes(&o, "out", out, n);
        r.Bytes(&o, "amax", amax, 1);
        return o;
      });
    }
    const auto g = Randn(n, 2.0f), u = Randn(n), dh = Randn(n);
    const std::vector<float> scale = {16.0f};
    Check("SwigluCastFp8/" + std::to_string(n), kEltTol, [&](DevRun& r) {
      Outputs o;
      uint8_t* out = r.Out<uint8_t>(n);
      float* amax = r.In(std::vector<float>{0.0f});
      r.b()->SwigluForward(r.InBf16(g), r.InBf16(u), 1, n, n, nullptr,
                           Fp8Cast{r.In(scale), Fp8Format::kE4M3, out, nullptr, amax});
      r.Fp8CodesNear(&o, "out", out, n);
      r.F32(&o, "amax", amax, 1);
      return o;
    });
    // gate and up as the two halves of one (rows, 2 * cols) matrix (a fused gate/up GEMM's output).
    if (n % 8 == 0 && n >= 8) {
      const int64_t cols = 4, rows = n / cols;
      std::vector<float> gu(static_cast<size_t>(2 * n));
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t c = 0; c < cols; ++c) {
          gu[i * 2 * cols + c] = g[i * cols + c];
          gu[i * 2 * cols + cols + c] = u[i * cols + c];
        }
      }
      Check("SwigluCastFp8/side-by-side/" + std::to_string(n), kEltTol, [&](DevRun& r) {
        Outputs o;
        uint8_t* out = r.Out<uint8_t>(n);
        float* amax = r.In(std::vector<float>{0.0f});
        const uint16_t* p = r.InBf16(gu);
        r.b()->SwigluForward(p, p + cols, rows, cols, 2 * cols, nullptr,
                             Fp8Cast{r.In(scale), Fp8Format::kE4M3, out, nullptr, amax});
        r.Fp8CodesNear(&o, "out", out, n);
        r.F32(&o, "amax", amax, 1);
        return o;
      });
    }
    Check("SwigluBackwardBf16To16/" + std::to_string(n), kEltTol + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t* dg = r.Out<uint16_t>(n);
      uint16_t* du = r.Out<uint16_t>(n);
      r.b()->SwigluBackward(r.InBf16(dh), r.InBf16(g), r.InBf16(u), 1, n, 0, dg, du);
      r.Bf16AsF32(&o, "dgate", dg, n);
      r.Bf16AsF32(&o, "dup", du, n);
      return o;
    });
  }
  const int64_t shapes[][2] = {{1, 1}, {37, 129}, {256, 192}, {1000, 36}, {2048, 1408}};
  for (auto& sh : shapes) {
    const int64_t rows = sh[0], cols = sh[1];
    auto x = Randn(rows * cols, 3.0f);
    x[static_cast<size_t>(rows * cols / 2)] = 1e6f;  // saturates
    const std::vector<float> scale = {20.0f};
    for (Fp8Format fmt : kFormats) {
      Check(std::string("CastTransposeFp8Bf16/") + FmtName(fmt) + "/" + std::to_string(rows) + "x" +
                std::to_string(cols),
            -1, [&](DevRun& r) {
              Outputs o;
              uint8_t* out = r.Out<uint8_t>(rows * cols);
              uint8_t* out_t = r.Out<uint8_t>(rows * cols);
              float* amax = r.In(std::vector<float>{0.0f});
              r.b()->CastFp8(r.InBf16(x), rows, cols, r.In(scale), fmt, out, out_t, amax, cols);
              r.Bytes(&o, "out", out, rows * cols);
              r.Bytes(&o, "out_t", out_t, rows * cols);
              r.Bytes(&o, "amax", amax, 1);
              return o;
            });
      // Row stride out_ld > cols (the codes of several grad-outputs side by side): the same codes
      // per row, the bytes between rows untouched (pre-filled 0x5A on both backends). +4 keeps the
      // 4-byte row stores where cols allows them; +3 forces the byte path.
      for (int64_t pad : {4, 3}) {
        const int64_t ld = cols + pad;
        Check(std::string("CastTransposeFp8Bf16/strided+") + std::to_string(pad) + "/" +
                  FmtName(fmt) + "/" + std::to_string(rows) + "x" + std::to_string(cols),
              -1, [&](DevRun& r) {
                Outputs o;
                uint8_t* out = r.In(std::vector<uint8_t>(static_cast<size_t>(rows * ld), 0x5A));
                uint8_t* out_t = r.Out<uint8_t>(rows * cols);
                float* amax = r.In(std::vector<float>{0.0f});
                r.b()->CastFp8(r.InBf16(x), rows, cols, r.In(scale), fmt, out, out_t, amax, ld);
                r.Bytes(&o, "out", out, rows * ld);
                r.Bytes(&o, "out_t", out_t, rows * cols);
                r.Bytes(&o, "amax", amax, 1);
                return o;
              });
      }
    }
  }
  // The SwiGLU backward fused with the cast-transposes of its two gradients: codes one step apart
  // at most (a bf16 gradient one ulp apart, as SwigluBackwardBf16To16 allows), amaxes within that
  // ulp. The tile edges (37 x 129, 1000 x 36) take the kernel's element-by-element path.
  for (auto& sh : shapes) {
    const int64_t rows = sh[0], cols = sh[1], n = rows * cols;
    const auto g = Randn(n, 2.0f), u = Randn(n);
    auto dh = Randn(n, 4.0f);
    dh[static_cast<size_t>(n / 3)] = 3e4f;  // saturates E4M3 at these scales
    const std::vector<float> sg = {20.0f}, su = {8.0f};
    for (Fp8Format fmt : kFormats) {
      Check(std::string("SwigluBackwardCastTransposeFp8/") + FmtName(fmt) + "/" +
                std::to_string(rows) + "x" + std::to_string(cols),
            kEltTol + bf16_ulp, [&](DevRun& r) {
              Outputs o;
              uint8_t* dg8 = r.Out<uint8_t>(n);
              uint8_t* dgT8 = r.Out<uint8_t>(n);
              uint8_t* du8 = r.Out<uint8_t>(n);
              uint8_t* duT8 = r.Out<uint8_t>(n);
              float* amax = r.In(std::vector<float>{0.0f, 0.0f});
              r.b()->SwigluBackward(r.InBf16(dh), r.InBf16(g), r.InBf16(u), rows, cols, cols,
                                    nullptr, nullptr, Fp8Cast{r.In(sg), fmt, dg8, dgT8, amax, cols},
                                    Fp8Cast{r.In(su), fmt, du8, duT8, amax + 1, cols});
              r.Fp8CodesNear(&o, "dgate8", dg8, n);
              r.Fp8CodesNear(&o, "dgate8_t", dgT8, n);
              r.Fp8CodesNear(&o, "dup8", du8, n);
              r.Fp8CodesNear(&o, "dup8_t", duT8, n);
              r.F32(&o, "amax", amax, 2);
              return o;
            });
      // The fused gate/up layout (LlamaModel): gate and up read as the two halves of one
      // (rows, 2 * cols) matrix, dgate and dup written side by side in another, their transposes
      // one after the other in one buffer (dup8_t from the next 16-byte boundary: the kernel's
      // transposed stores need 4-byte aligned rows).
      // (CUDA reads gate, up and dh 4 elements at a time: cols % 4 == 0, as F is in the model.)
      if (cols % 4 != 0) continue;
      const int64_t at = (n + 15) / 16 * 16;
      std::vector<float> gu(static_cast<size_t>(2 * n));
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t c = 0; c < cols; ++c) {
          gu[i * 2 * cols + c] = g[i * cols + c];
          gu[i * 2 * cols + cols + c] = u[i * cols + c];
        }
      }
      Check(std::string("SwigluBackwardCastTransposeFp8/side-by-side/") + FmtName(fmt) + "/" +
                std::to_string(rows) + "x" + std::to_string(cols),
            kEltTol + bf16_ulp, [&](DevRun& r) {
              Outputs o;
              uint8_t* d8 = r.Out<uint8_t>(2 * n);
              uint8_t* dT8 = r.In(std::vector<uint8_t>(static_cast<size_t>(at + n), 0x5A));
              float* amax = r.In(std::vector<float>{0.0f, 0.0f});
              const uint16_t* p = r.InBf16(gu);
              r.b()->SwigluBackward(
                  r.InBf16(dh), p, p + cols, rows, cols, 2 * cols, nullptr, nullptr,
                  Fp8Cast{r.In(sg), fmt, d8, dT8, amax, 2 * cols},
                  Fp8Cast{r.In(su), fmt, d8 + cols, dT8 + at, amax + 1, 2 * cols});
              r.Fp8CodesNear(&o, "[dgate8 | dup8]", d8, 2 * n);
              r.Fp8CodesNear(&o, "[dgate8_t ; dup8_t]", dT8, at + n);
              r.F32(&o, "amax", amax, 2);
              return o;
            });
    }
  }
  // RoPE's backward fused with the cast-transpose of its result. (B, T, H, D): tile edges and a
  // partial last tile (2, 37, 3, 16), full tiles (2, 128, 4, 64), D 8 (halves of 4) in full
  // tiles (2, 128, 8, 8) and at an edge (1, 64, 2, 8), and D 6 (the CUDA backend falls back to the
  // composition). dx16 must be left as it was.
  struct RopeShape { int64_t B, T, H, D; };
  for (const RopeShape& q : {RopeShape{2, 37, 3, 16}, RopeShape{2, 128, 4, 64},
                             RopeShape{2, 128, 8, 8}, RopeShape{1, 64, 2, 8},
                             RopeShape{1, 20, 2, 6}}) {
    const int64_t n = q.B * q.T * q.H * q.D;
    const auto dx = Randn(n, 3.0f);
    const std::vector<float> scale = {12.0f};
    for (Fp8Format fmt : kFormats) {
      // Dense rows, and row stride H * D + 8 (q's codes beside k's and v's in the fused q/k/v
      // backward), whose bytes past each row must stay as pre-filled.
      for (int64_t pad : {0, 8}) {
        const int64_t ld = q.H * q.D + pad, rows = q.B * q.T;
        Check(std::string("RopeBackwardCastTransposeFp8Bf16/") + (pad ? "strided/" : "") +
                  FmtName(fmt) + "/" + std::to_string(q.B) + "x" + std::to_string(q.T) + "x" +
                  std::to_string(q.H) + "x" + std::to_string(q.D),
              kEltTol + bf16_ulp, [&](DevRun& r) {
                Outputs o;
                uint16_t* x16 = r.InBf16(dx);
                uint8_t* out = r.In(std::vector<uint8_t>(static_cast<size_t>(rows * ld), 0x5A));
                uint8_t* out_t = r.Out<uint8_t>(n);
                float* amax = r.In(std::vector<float>{0.0f});
                r.b()->RopeBackward(x16, q.B, q.T, q.H, q.D, 10000.0f,
                                    Fp8Cast{r.In(scale), fmt, out, out_t, amax, ld});
                r.Fp8CodesNear(&o, "out", out, rows * ld);
                r.Fp8CodesNear(&o, "out_t", out_t, n);
                r.F32(&o, "amax", amax, 1);
                r.Bytes(&o, "dx16 unchanged", x16, n);
                return o;
              });
      }
    }
  }
  struct G { int64_t M, N, K; };
  for (const G& s : {G{1, 1, 16}, G{37, 130, 32}, G{256, 512, 256}, G{512, 2048, 2048}}) {
    auto codes = [&](int64_t n) {
      auto c = Fp8Codes(n, Fp8Format::kE4M3);
      for (auto& v : c) v = static_cast<uint8_t>((v & 0x80) | ((v & 0x7F) % 0x58));
      return c;
    };
    const auto A = codes(s.M * s.K), B = codes(s.N * s.K);
    const std::vector<float> sa = {0.375f}, sb = {1.0f / 3.0f};
    Check("GemmFp8Bf16/" + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K),
          Fp8GemmTol(s.K) + bf16_ulp, [&](DevRun& r) {
            Outputs o;
            uint16_t* C = r.Out<uint16_t>(s.M * s.N);
            r.b()->GemmFp8(false, true, s.M, s.N, s.K, {r.In(A), Fp8Format::kE4M3, r.In(sa)},
                           {r.In(B), Fp8Format::kE4M3, r.In(sb)}, C, false);
            r.Bf16AsF32(&o, "C", C, s.M * s.N);
            return o;
          });
  }
  for (const G& s : {G{1, 1, 16}, G{37, 130, 32}, G{512, 2048, 2048}}) {
    auto codes = [&](int64_t n) {
      auto c = Fp8Codes(n, Fp8Format::kE4M3);
      for (auto& v : c) v = static_cast<uint8_t>((v & 0x80) | ((v & 0x7F) % 0x58));
      return c;
    };
    const auto A = codes(s.M * s.K), B = codes(s.N * s.K);
    const auto R0 = Randn(s.M * s.N, 4.0f);
    const std::vector<float> sa = {0.375f}, sb = {1.0f / 3.0f};
    Check("GemmFp8AddResidual/" + std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K),
          Fp8GemmTol(s.K), [&](DevRun& r) {
            Outputs o;
            const float* R = r.In(R0);
            float* D = r.Out<float>(s.M * s.N);
            r.b()->GemmFp8(false, true, s.M, s.N, s.K, {r.In(A), Fp8Format::kE4M3, r.In(sa)},
                           {r.In(B), Fp8Format::kE4M3, r.In(sb)}, D, false, R);
            r.F32(&o, "D", D, s.M * s.N);
            r.F32(&o, "R", R, s.M * s.N);  // unchanged
            return o;
          });
  }
  struct R { int64_t B, T, H, D; };
  for (const R& s : {R{1, 1, 1, 2}, R{2, 37, 3, 18}, R{2, 2048, 4, 128}}) {
    const int64_t n = s.B * s.T * s.H * s.D;
    const auto x = Randn(n);
    const std::string shape = std::to_string(s.B) + "x" + std::to_string(s.T) + "x" + std::to_string(s.H) + "x" + std::to_string(s.D);
    Check("RopeForwardBf16/" + shape, kEltTol + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t* p = r.InBf16(x);
      r.b()->RopeForward(p, s.B, s.T, s.H, s.D, 10000.0f, s.H * s.D);
      r.Bf16AsF32(&o, "x", p, n);
      return o;
    });
    // Tokens ld = H * D + 2 * D apart (q's part of a fused q/k/v output); the columns between
    // them must come back untouched.
    const int64_t ld = s.H * s.D + 2 * s.D;
    const auto xs = Randn(s.B * s.T * ld);
    Check("RopeForwardBf16/strided/" + shape, kEltTol + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t* p = r.InBf16(xs);
      r.b()->RopeForward(p, s.B, s.T, s.H, s.D, 10000.0f, ld);
      r.Bf16AsF32(&o, "x", p, s.B * s.T * ld);
      return o;
    });
    Check("RopeBackwardBf16/" + shape, kEltTol + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t* p = r.InBf16(x);
      r.b()->RopeBackward(p, s.B, s.T, s.H, s.D, 500000.0f);
      r.Bf16AsF32(&o, "dx", p, n);
      return o;
    });
  }
  struct A { int64_t B, T, H, Hkv, D; };
  for (const A& s : {A{1, 1, 1, 1, 4}, A{2, 37, 4, 2, 16}, A{2, 256, 4, 4, 128}}) {
    const int64_t nq = s.B * s.T * s.H * s.D, nk = s.B * s.T * s.Hkv * s.D;
    const auto q = Randn(nq), k = Randn(nk), v = Randn(nk), dout = Randn(nq);
    const std::string shape = std::to_string(s.B) + "x" + std::to_string(s.T) + "x" + std::to_string(s.H) + "/" +
                              std::to_string(s.Hkv) + "x" + std::to_string(s.D);
    Check("AttentionBf16Packed/" + shape, 8 * ub + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      uint16_t *q16 = r.InBf16(q), *k16 = r.InBf16(k), *v16 = r.InBf16(v);
      uint16_t* out16 = r.Out<uint16_t>(nq);
      float* lse = r.Out<float>(s.B * s.H * s.T);
      r.b()->AttentionForward(q16, k16, v16, s.B, s.T, s.H, s.Hkv, s.D, out16, lse,
                              AttentionOptions{true, s.H * s.D, s.Hkv * s.D});
      r.Bf16AsF32(&o, "out", out16, nq);
      r.F32(&o, "lse", lse, s.B * s.H * s.T);
      uint16_t* dq = r.Out<uint16_t>(nq);
      uint16_t* dk = r.Out<uint16_t>(nk);
      uint16_t* dv = r.Out<uint16_t>(nk);
      r.b()->AttentionBackward(q16, k16, v16, out16, r.InBf16(dout), lse, s.B, s.T, s.H, s.Hkv, s.D,
                               dq, dk, dv, AttentionOptions{true, s.H * s.D, s.Hkv * s.D});
      r.Bf16AsF32(&o, "dq", dq, nq);
      r.Bf16AsF32(&o, "dk", dk, nk);
      r.Bf16AsF32(&o, "dv", dv, nk);
      return o;
    });
    // q, k, v as the three parts of one (B * T, (H + 2 Hkv) * D) matrix (the fused q/k/v GEMM's
    // output): the same values as the dense call above.
    const int64_t hq = s.H * s.D, hk = s.Hkv * s.D, ld = hq + 2 * hk, rows = s.B * s.T;
    std::vector<float> qkv(static_cast<size_t>(rows * ld));
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t c = 0; c < hq; ++c) qkv[t * ld + c] = q[t * hq + c];
      for (int64_t c = 0; c < hk; ++c) {
        qkv[t * ld + hq + c] = k[t * hk + c];
        qkv[t * ld + hq + hk + c] = v[t * hk + c];
      }
    }
    Check("AttentionBf16Packed/fused-qkv/" + shape, 8 * ub + bf16_ulp, [&](DevRun& r) {
      Outputs o;
      const uint16_t* p = r.InBf16(qkv);
      uint16_t* out16 = r.Out<uint16_t>(nq);
      float* lse = r.Out<float>(s.B * s.H * s.T);
      r.b()->AttentionForward(p, p + hq, p + hq + hk, s.B, s.T, s.H, s.Hkv, s.D, out16, lse,
                              AttentionOptions{true, ld, ld});
      r.Bf16AsF32(&o, "out", out16, nq);
      r.F32(&o, "lse", lse, s.B * s.H * s.T);
      uint16_t* dq = r.Out<uint16_t>(nq);
      uint16_t* dk = r.Out<uint16_t>(nk);
      uint16_t* dv = r.Out<uint16_t>(nk);
      r.b()->AttentionBackward(p, p + hq, p + hq + hk, out16, r.InBf16(dout), lse, s.B, s.T, s.H,
                               s.Hkv, s.D, dq, dk, dv, AttentionOptions{true, ld, ld});
      r.Bf16AsF32(&o, "dq", dq, nq);
      r.Bf16AsF32(&o, "dk", dk, nk);
      r.Bf16AsF32(&o, "dv", dv, nk);
      return o;
    });
  }
}

// On each backend the fused SwiGLU backward + cast-transposes gives exactly the codes and amaxes
// of its unfused composition (SwigluBackwardBf16To16, then CastTransposeFp8Bf16 of each
// gradient): the model takes one path or the other depending on whether the grad-output scales
// are known before the cast, and the two must train identically.
TEST_P(Conformance, SwigluBackwardCastTransposeIsItsComposition) {
  for (Fp8Format fmt : kFormats) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{300, 200}, {256, 1408}, {37, 129}}) {
      const int64_t n = rows * cols;
      const auto dh = Randn(n, 4.0f), g = Randn(n, 2.0f), u = Randn(n);
      DevRun r(dut_.get());
      Backend* b = r.b();
      const uint16_t *dh16 = r.InBf16(dh), *g16 = r.InBf16(g), *u16 = r.InBf16(u);
      const float* sg = r.In(std::vector<float>{24.0f});
      const float* su = r.In(std::vector<float>{6.0f});
      Outputs fused, unfused;
      {
        uint8_t* c[4];
        for (auto& p : c) p = r.Out<uint8_t>(n);
        float* amax = r.In(std::vector<float>{0.0f, 0.0f});
        b->SwigluBackward(dh16, g16, u16, rows, cols, cols, nullptr, nullptr,
                          Fp8Cast{sg, fmt, c[0], c[1], amax, cols},
                          Fp8Cast{su, fmt, c[2], c[3], amax + 1, cols});
        for (uint8_t* p : c) r.Bytes(&fused, "codes", p, n);
        r.Bytes(&fused, "amax", amax, 2);
      }
      {
        uint16_t* dg16 = r.Out<uint16_t>(n);
        uint16_t* du16 = r.Out<uint16_t>(n);
        b->SwigluBackward(dh16, g16, u16, 1, n, 0, dg16, du16);
        uint8_t* c[4];
        for (auto& p : c) p = r.Out<uint8_t>(n);
        float* amax = r.In(std::vector<float>{0.0f, 0.0f});
        b->CastFp8(dg16, rows, cols, sg, fmt, c[0], c[1], amax, cols);
        b->CastFp8(du16, rows, cols, su, fmt, c[2], c[3], amax + 1, cols);
        for (uint8_t* p : c) r.Bytes(&unfused, "codes", p, n);
        r.Bytes(&unfused, "amax", amax, 2);
      }
      const char* names[] = {"dgate8", "dgate8_t", "dup8", "dup8_t", "amax"};
      for (size_t k = 0; k < fused.size(); ++k) {
        size_t diff = 0;
        EXPECT_TRUE(SameBits(fused[k], unfused[k], &diff))
            << FmtName(fmt) << " " << rows << "x" << cols << " " << names[k] << " on " << GetParam()
            << ": fused differs from unfused at byte " << diff;
      }
    }
  }
}

// Likewise RoPE's backward fused with the cast-transpose of its result, against RopeBackwardBf16
// followed by CastTransposeFp8Bf16 on the same backend.
TEST_P(Conformance, RopeBackwardCastTransposeIsItsComposition) {
  const int64_t B = 2, T = 160, H = 3, D = 64, n = B * T * H * D;
  const auto dx = Randn(n, 3.0f);
  for (Fp8Format fmt : kFormats) {
    DevRun r(dut_.get());
    Backend* b = r.b();
    uint16_t* x16 = r.Out<uint16_t>(n);
    b->PackBf16(r.In(dx), x16, n);
    const float* scale = r.In(std::vector<float>{16.0f});
    Outputs fused, unfused;
    uint8_t* out = r.Out<uint8_t>(n);
    uint8_t* out_t = r.Out<uint8_t>(n);
    float* amax = r.In(std::vector<float>{0.0f});
    b->RopeBackward(x16, B, T, H, D, 10000.0f, Fp8Cast{scale, fmt, out, out_t, amax, H * D});
    r.Bytes(&fused, "out", out, n);
    r.Bytes(&fused, "out_t", out_t, n);
    r.Bytes(&fused, "amax", amax, 1);
    b->RopeBackward(x16, B, T, H, D, 10000.0f);
    uint8_t* out2 = r.Out<uint8_t>(n);
    uint8_t* out2_t = r.Out<uint8_t>(n);
    float* amax2 = r.In(std::vector<float>{0.0f});
    b->CastFp8(x16, B * T, H * D, scale, fmt, out2, out2_t, amax2, H * D);
    r.Bytes(&unfused, "out", out2, n);
    r.Bytes(&unfused, "out_t", out2_t, n);
    r.Bytes(&unfused, "amax", amax2, 1);
    for (size_t k = 0; k < fused.size(); ++k) {
      size_t diff = 0;
      EXPECT_TRUE(SameBits(fused[k], unfused[k], &diff))
          << FmtName(fmt) << " " << fused[k].name << " on " << GetParam()
          << ": fused differs from unfused at byte " << diff;
    }
  }
}

// SwigluCastTransposeFp8, the backward's recast of down_proj's input: its codes and their
// transpose as the reference's within one code step (the f32 SwiGLU may round differently there,
// as SwigluCastFp8 allows), and, on every backend, bit for bit the transpose of the codes that
// backend's own SwigluCastFp8 writes (the forward's cast, which training's bit-identity rests on):
// "same as SwigluCastFp8" is 1 exactly when all bytes agree. Dense gate/up and the two halves of
// one (rows, 2 * cols) matrix; tile edges (37 x 129, 1000 x 36) take the element-by-element path.
TEST_P(Conformance, SwigluCastTransposeRecastsTheForwardCodes) {
  const int64_t shapes[][2] = {{1, 1}, {37, 129}, {256, 192}, {1000, 36}, {2048, 1408}};
  for (auto& sh : shapes) {
    const int64_t rows = sh[0], cols = sh[1], n = rows * cols;
    auto gu = Randn(2 * n, 2.0f);
    gu[static_cast<size_t>(n / 2)] = 300.0f;  // with its up partner, saturates at these scales
    gu[static_cast<size_t>(n / 2 + cols)] = 200.0f;
    const std::vector<float> scale = {16.0f};
    for (Fp8Format fmt : kFormats) {
      for (bool side_by_side : {false, true}) {
        if (side_by_side && cols % 4 != 0) continue;  // CUDA reads strided rows 4 at a time
        const int64_t ld = side_by_side ? 2 * cols : cols;
        Check(std::string("SwigluCastTransposeFp8/") + (side_by_side ? "side-by-side/" : "") +
                  FmtName(fmt) + "/" + std::to_string(rows) + "x" + std::to_string(cols),
              kEltTol, [&](DevRun& r) {
                Outputs o;
                // Side by side: up follows gate in each row (the fused gate/up GEMM's output);
                // else separate buffers, as separate GEMMs write them (aligned as allocations are).
                const uint16_t* g16 = r.InBf16(gu);
                const uint16_t* u16 =
                    side_by_side ? g16 + cols
                                 : r.InBf16(std::vector<float>(gu.begin() + n, gu.end()));
                uint8_t* out = r.Out<uint8_t>(n);
                uint8_t* out_t = r.Out<uint8_t>(n);
                uint8_t* fwd = r.Out<uint8_t>(n);
                float* amax = r.In(std::vector<float>{0.0f});
                const float* sc = r.In(scale);
                r.b()->SwigluForward(g16, u16, rows, cols, ld, nullptr,
                                     Fp8Cast{sc, fmt, out, out_t, amax});
                r.b()->SwigluForward(g16, u16, rows, cols, ld, nullptr,
                                     Fp8Cast{sc, fmt, fwd, nullptr, nullptr});
                std::vector<uint8_t> t(static_cast<size_t>(n)), f(static_cast<size_t>(n));
                r.b()->CopyToHost(t.data(), out_t, t.size());
                r.b()->CopyToHost(f.data(), fwd, f.size());
                bool same = true;
                for (int64_t i = 0; i < rows && same; ++i) {
                  for (int64_t c = 0; c < cols; ++c) same = same && t[c * rows + i] == f[i * cols + c];
                }
                // Without out: out_t alone, the same bytes again.
                uint8_t* only_t = r.Out<uint8_t>(n);
                r.b()->SwigluForward(g16, u16, rows, cols, ld, nullptr,
                                     Fp8Cast{sc, fmt, nullptr, only_t, nullptr});
                std::vector<uint8_t> t2(static_cast<size_t>(n));
                r.b()->CopyToHost(t2.data(), only_t, t2.size());
                Output flag;
                flag.name = "same as SwigluCastFp8";
                flag.is_f32 = false;
                flag.bytes = {static_cast<uint8_t>(same && t2 == t ? 1 : 0)};
                o.push_back(flag);
                r.Fp8CodesNear(&o, "out", out, n);
                r.Fp8CodesNear(&o, "out_t", out_t, n);
                r.F32(&o, "amax", amax, 1);
                return o;
              });
      }
    }
  }
}

}  // namespace
}  // namespace fsdp8::conformance
