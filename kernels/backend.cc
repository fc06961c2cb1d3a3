#include "kernels/backend.h"
#include "kernels/device_memory.h"

#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/env_settings.h"
#include "kernels/cpu/cpu_ref_backend.h"
#include "kernels/fp8.h"
#ifdef FSDP8_WITH_FAST_CPU
#include "kernels/cpu/cpu_fast_backend.h"
#endif

#ifdef FSDP8_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace fsdp8 {

float* TypedPtr::f() const {
  FSDP8_CHECK(data == nullptr || dtype == DType::kF32) << "expected an f32 buffer, got bf16";
  return static_cast<float*>(data);
}
uint16_t* TypedPtr::h() const {
  FSDP8_CHECK(data == nullptr || dtype == DType::kBF16) << "expected a bf16 buffer, got f32";
  return static_cast<uint16_t*>(data);
}
const float* TypedCPtr::f() const {
  FSDP8_CHECK(data == nullptr || dtype == DType::kF32) << "expected an f32 buffer, got bf16";
  return static_cast<const float*>(data);
}
const uint16_t* TypedCPtr::h() const {
  FSDP8_CHECK(data == nullptr || dtype == DType::kBF16) << "expected a bf16 buffer, got f32";
  return static_cast<const uint16_t*>(data);
}

namespace {

// Scratch buffer of n elements of T (at least one) on `be`; std::bad_alloc when out of memory
// (backend.h, Errors: the worker reports RESOURCE_EXHAUSTED).
template <typename T>
T* Scratch(Backend* be, int64_t n) {
  T* p = static_cast<T*>(be->Alloc(static_cast<size_t>(n > 0 ? n : 1) * sizeof(T)));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

// A device copy of n f32 values, each rounded to the nearest bfloat16 (f32 storage).
float* RoundedToBf16Copy(Backend* be, const float* x, int64_t n) {
  float* c = Scratch<float>(be, n);
  be->Copy(c, x, static_cast<size_t>(n) * sizeof(float));
  be->RoundToBf16(c, n);
  return c;
}

void CheckRowStride(int64_t ld, int64_t cols) {
  FSDP8_CHECK(ld >= cols) << "row stride " << ld << " < cols " << cols;
}

// Unpacks the (rows, cols) bf16 matrix x16 of row stride ld into dense f32 x.
void UnpackRows(Backend* be, const uint16_t* x16, int64_t rows, int64_t cols, int64_t ld,
                float* x) {
  CheckRowStride(ld, cols);
  if (ld == cols) {
    be->UnpackBf16(x16, x, rows * cols);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) be->UnpackBf16(x16 + r * ld, x + r * cols, cols);
}

// Dense bf16 copy (rows, cols) of x16 (row stride ld); nullptr when ld == cols (use x16).
uint16_t* DenseRows16(Backend* be, const uint16_t* x16, int64_t rows, int64_t cols, int64_t ld) {
  if (ld == cols) return nullptr;
  CheckRowStride(ld, cols);
  uint16_t* d = Scratch<uint16_t>(be, rows * cols + 1);
  for (int64_t r = 0; r < rows; ++r) be->Copy(d + r * cols, x16 + r * ld, cols * sizeof(uint16_t));
  return d;
}

// RopeForward (backward = false) or RopeBackward in place on dense bf16 x16 through an f32 copy.
void RopeBf16(Backend* be, uint16_t* x16, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
              bool backward) {
  const int64_t n = B * T * H * D;
  float* x = Scratch<float>(be, n);
  be->UnpackBf16(x16, x, n);
  if (backward) {
    be->RopeBackward(x, B, T, H, D, theta);
  } else {
    be->RopeForward(x, B, T, H, D, theta);
  }
  be->PackBf16(x, x16, n);
  be->Free(x);
}

int64_t Ld(int64_t ld, int64_t dense) { return ld == 0 ? dense : ld; }

}  // namespace

void Backend::SetRopeInvFreq(float theta, std::vector<float> inv_freq) {
  rope_freq_theta_ = theta;
  rope_inv_freq_ = std::move(inv_freq);
  ++rope_freq_version_;
}

const std::vector<float>* Backend::RopeInvFreqFor(int64_t D, float theta) const {
  if (rope_inv_freq_.empty() || theta != rope_freq_theta_ ||
      D != 2 * static_cast<int64_t>(rope_inv_freq_.size())) {
    return nullptr;
  }
  return &rope_inv_freq_;
}

void Backend::SetFp8FastAccumulation(bool on) {
  settings_.fp8_fast_accumulation = on;
  ApplySettings(settings_);
}
void Backend::SetGemmAutotune(bool on) {
  settings_.gemm_autotune = on;
  ApplySettings(settings_);
}
void Backend::SetDeterministic(bool on) {
  settings_.deterministic = on;
  ApplySettings(settings_);
}

// ---- the typed ops: checks, the backend's hook, else the reference composition ----------------

void Backend::CastFp8(TypedCPtr in, int64_t rows, int64_t cols, const float* scale, Fp8Format fmt,
                      uint8_t* out, uint8_t* out_t, float* amax_out, int64_t out_ld) {
  out_ld = Ld(out_ld, cols);
  FSDP8_CHECK(in.bf16() || out_ld == cols) << "CastFp8: f32 input takes dense codes";
  if (TryCastFp8(in, rows, cols, scale, fmt, out, out_t, amax_out, out_ld)) return;
  const uint16_t* in16 = in.h();
  FSDP8_CHECK(out_ld >= cols) << "CastFp8: out_ld " << out_ld << " < cols " << cols;
  const int64_t n = rows * cols;
  float* x = Scratch<float>(this, n);
  UnpackBf16(in16, x, n);
  if (out_t == nullptr && out_ld == cols) {
    CastFp8(x, 1, n, scale, fmt, out, nullptr, amax_out);
  } else if (out == nullptr || out_ld == cols) {
    CastFp8(x, rows, cols, scale, fmt, out, out_t, amax_out);
  } else {  // dense codes first, then row by row into the strided matrix
    uint8_t* dense = Scratch<uint8_t>(this, n);
    CastFp8(x, rows, cols, scale, fmt, dense, out_t, amax_out);
    for (int64_t r = 0; r < rows; ++r) Copy(out + r * out_ld, dense + r * cols, cols);
    Free(dense);
  }
  Free(x);
}

// ---- block-scaled FP8 (rowwise, blockwise): the reference, on the host ----------------------

int64_t Fp8ScaleCount(Fp8Blocks blocks, int64_t rows, int64_t cols) {
  switch (blocks) {
    case Fp8Blocks::kRow: return rows;
    case Fp8Blocks::kTile128: return rows * Fp8BlockCount(cols);
    case Fp8Blocks::kBlock128: return Fp8BlockCount(rows) * Fp8BlockCount(cols);
  }
  return 0;
}

float Fp8BlockScale(float amax, float fp8_max) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  double d = static_cast<double>(fp8_max) / static_cast<double>(amax);
  d = std::min(std::max(d, static_cast<double>(FLT_MIN)), static_cast<double>(FLT_MAX));
  return static_cast<float>(d);
}

namespace {

// The values of a device matrix of n elements, f32 or bf16 (widened exactly), on the host.
std::vector<float> HostValues(Backend* be, TypedCPtr in, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  if (in.f32()) {
    be->CopyToHost(v.data(), in.f(), static_cast<size_t>(n) * sizeof(float));
  } else {
    std::vector<uint16_t> h(static_cast<size_t>(n));
    be->CopyToHost(h.data(), in.h(), static_cast<size_t>(n) * sizeof(uint16_t));
    for (int64_t i = 0; i < n; ++i) v[i] = Bf16Value(h[i]);
  }
  return v;
}

// Quantizes the host matrix x (rows, cols) in blocks of gr rows x gc columns (the tails padded up)
// with current scaling per block: codes (rows, cols), scale_inv (ceil(rows/gr), ceil(cols/gc)).
void QuantizeHostBlocks(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t gr,
                        int64_t gc, Fp8Format fmt, std::vector<uint8_t>* codes,
                        std::vector<float>* scale_inv) {
  const int64_t br = (rows + gr - 1) / gr, bc = (cols + gc - 1) / gc;
  std::vector<float> amax(static_cast<size_t>(br * bc), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float& m = amax[(r / gr) * bc + c / gc];
      const float a = std::fabs(x[r * cols + c]);
      if (std::isnan(a) || a > m) m = std::isnan(m) ? m : a;
    }
  }
  const float fp8_max = Fp8Max(fmt);
  std::vector<float> scale(amax.size());
  scale_inv->resize(amax.size());
  for (size_t b = 0; b < amax.size(); ++b) {
    scale[b] = Fp8BlockScale(amax[b], fp8_max);
    (*scale_inv)[b] = 1.0f / scale[b];
  }
  codes->resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      (*codes)[r * cols + c] = EncodeFp8(x[r * cols + c] * scale[(r / gr) * bc + c / gc], fmt);
    }
  }
}

template <typename T>
std::vector<T> Transposed(const std::vector<T>& x, int64_t rows, int64_t cols) {
  std::vector<T> t(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = x[r * cols + c];
  }
  return t;
}

template <typename T>
void ToDevice(Backend* be, T* dst, const std::vector<T>& v) {
  be->CopyToDevice(dst, v.data(), v.size() * sizeof(T));
}

// An operand's scale_inv for row `row` and K chunk `chunk` (GemmFp8Blocks), chunks = ceil(K/128).
float BlockScaleInv(const std::vector<float>& s, Fp8Blocks blocks, int64_t row, int64_t chunk,
                    int64_t chunks) {
  switch (blocks) {
    case Fp8Blocks::kRow: return s[row];
    case Fp8Blocks::kTile128: return s[row * chunks + chunk];
    case Fp8Blocks::kBlock128: return s[(row / kFp8BlockSize) * chunks + chunk];
  }
  return 0.0f;
}

}  // namespace

void Backend::QuantizeFp8Blocks(TypedCPtr in, int64_t rows, int64_t cols, Fp8Blocks blocks,
                                Fp8Format fmt, uint8_t* out, float* scale_inv, uint8_t* out_t,
                                float* scale_inv_t) {
  FSDP8_CHECK(rows >= 0 && cols >= 0 && !in.null());
  FSDP8_CHECK((out == nullptr) == (scale_inv == nullptr) &&
              (out_t == nullptr) == (scale_inv_t == nullptr) &&
              (out != nullptr || out_t != nullptr))
      << "QuantizeFp8Blocks: codes and scales come in pairs, at least one pair";
  if (rows == 0 || cols == 0) return;
  if (TryQuantizeFp8Blocks(in, rows, cols, blocks, fmt, out, scale_inv, out_t, scale_inv_t)) {
    return;
  }
  const std::vector<float> x = HostValues(this, in, rows * cols);
  std::vector<uint8_t> codes;
  std::vector<float> s;
  // Row groups x column groups of the matrix that is quantized as it stands.
  const int64_t gr = blocks == Fp8Blocks::kBlock128 ? kFp8BlockSize : 1;
  const int64_t gc = blocks == Fp8Blocks::kRow ? cols : kFp8BlockSize;
  if (out != nullptr || blocks == Fp8Blocks::kBlock128) {
    QuantizeHostBlocks(x, rows, cols, gr, gc, fmt, &codes, &s);
    if (out != nullptr) {
      ToDevice(this, out, codes);
      ToDevice(this, scale_inv, s);
    }
  }
  if (out_t == nullptr) return;
  if (blocks == Fp8Blocks::kBlock128) {  // the same codes and scales, transposed
    ToDevice(this, out_t, Transposed(codes, rows, cols));
    ToDevice(this, scale_inv_t, Transposed(s, Fp8BlockCount(rows), Fp8BlockCount(cols)));
    return;
  }
  // Rows of the transpose: per row (kRow) or per 1 x 128 tile of it (kTile128), requantized.
  std::vector<uint8_t> codes_t;
  std::vector<float> s_t;
  QuantizeHostBlocks(Transposed(x, rows, cols), cols, rows, 1,
                     blocks == Fp8Blocks::kRow ? rows : kFp8BlockSize, fmt, &codes_t, &s_t);
  ToDevice(this, out_t, codes_t);
  ToDevice(this, scale_inv_t, s_t);
}

void Backend::TransposeFp8Block128(const uint8_t* codes, const float* scale_inv, int64_t rows,
                                   int64_t cols, uint8_t* out_t, float* scale_inv_t) {
  TransposeBytes(codes, rows, cols, out_t);
  const int64_t br = Fp8BlockCount(rows), bc = Fp8BlockCount(cols);
  if (br * bc == 0 || TryTransposeBlockScales(scale_inv, br, bc, scale_inv_t)) return;
  std::vector<float> s(static_cast<size_t>(br * bc));
  CopyToHost(s.data(), scale_inv, s.size() * sizeof(float));
  ToDevice(this, scale_inv_t, Transposed(s, br, bc));
}

void Backend::GemmFp8Blocks(int64_t M, int64_t N, int64_t K, Fp8BlockOperand a,
                            Fp8BlockOperand b, float* C, bool accumulate) {
  FSDP8_CHECK(M >= 0 && N >= 0 && K >= 0);
  const bool rowwise = a.blocks == Fp8Blocks::kRow && b.blocks == Fp8Blocks::kRow;
  const bool blockwise = a.blocks == Fp8Blocks::kTile128 && b.blocks != Fp8Blocks::kRow;
  FSDP8_CHECK(rowwise || blockwise)
      << "GemmFp8Blocks: operands kRow x kRow, kTile128 x kBlock128 or kTile128 x kTile128";
  if (M == 0 || N == 0) return;
  if (TryGemmFp8Blocks(M, N, K, a, b, C, accumulate)) return;
  const int64_t chunks = rowwise ? 1 : Fp8BlockCount(K);
  const int64_t chunk = rowwise ? K : kFp8BlockSize;
  std::vector<uint8_t> qa(static_cast<size_t>(M * K)), qb(static_cast<size_t>(N * K));
  if (K > 0) {
    CopyToHost(qa.data(), a.codes, qa.size());
    CopyToHost(qb.data(), b.codes, qb.size());
  }
  std::vector<float> sa(static_cast<size_t>(Fp8ScaleCount(a.blocks, M, K))),
      sb(static_cast<size_t>(Fp8ScaleCount(b.blocks, N, K)));
  if (K > 0) {
    CopyToHost(sa.data(), a.scale_inv, sa.size() * sizeof(float));
    CopyToHost(sb.data(), b.scale_inv, sb.size() * sizeof(float));
  }
  std::vector<float> c(static_cast<size_t>(M * N), 0.0f);
  if (accumulate) CopyToHost(c.data(), C, c.size() * sizeof(float));
  const float* ta = Fp8DecodeTable(a.fmt);
  const float* tb = Fp8DecodeTable(b.fmt);
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double sum = 0.0;
      for (int64_t ch = 0; ch < chunks; ++ch) {
        double part = 0.0;  // products of FP8 values are exact in double
        for (int64_t k = ch * chunk; k < std::min(K, (ch + 1) * chunk); ++k) {
          part += static_cast<double>(ta[qa[i * K + k]]) * static_cast<double>(tb[qb[j * K + k]]);
        }
        sum += part * BlockScaleInv(sa, a.blocks, i, ch, chunks) *
               BlockScaleInv(sb, b.blocks, j, ch, chunks);
      }
      if (accumulate) sum += static_cast<double>(c[i * N + j]);
      c[i * N + j] = static_cast<float>(sum);
    }
  }
  ToDevice(this, C, c);
}

void Backend::GroupMax(const float* in, const int32_t* group, int64_t n, float* out) {
  if (n <= 0) return;
  std::vector<float> v(n), r(n);
  std::vector<int32_t> g(n);
  CopyToHost(v.data(), in, n * sizeof(float));
  CopyToHost(g.data(), group, n * sizeof(int32_t));
  for (int64_t i = 0; i < n; ++i) {
    float m = v[i];
    for (int64_t j = 0; j < n; ++j) {
      if (g[j] == g[i] && (std::isnan(v[j]) || v[j] > m)) m = v[j];
      if (std::isnan(m)) break;
    }
    r[i] = m;
  }
  CopyToDevice(out, r.data(), n * sizeof(float));
}

void Backend::GemmFp8(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Fp8Operand a,
                      Fp8Operand b, TypedPtr C, bool accumulate, const float* residual) {
  FSDP8_CHECK((!C.bf16() && residual == nullptr) ||
              (!trans_a && trans_b && !accumulate && !(C.bf16() && residual != nullptr)))
      << "GemmFp8: bf16 C or a residual (not both) takes the TN layout, without accumulation";
  if (TryGemmFp8(trans_a, trans_b, M, N, K, a, b, C, accumulate, residual)) return;
  if (C.bf16()) {
    float* c = Scratch<float>(this, M * N);
    GemmFp8(false, true, M, N, K, a, b, c, false);
    PackBf16(c, C.h(), M * N);
    Free(c);
    return;
  }
  if (residual != nullptr) {
    Copy(C.f(), residual, static_cast<size_t>(M * N) * sizeof(float));
    GemmFp8(false, true, M, N, K, a, b, C, true);
    return;
  }
  FSDP8_CHECK(trans_a || !trans_b) << "GemmFp8: the TN layout is the backend's own";
  auto transposed = [this](const uint8_t* x, int64_t rows, int64_t cols) {
    uint8_t* t = Scratch<uint8_t>(this, rows * cols);
    TransposeBytes(x, rows, cols, t);
    return t;
  };
  uint8_t* at = trans_a ? transposed(a.codes, K, M) : nullptr;
  uint8_t* bt = trans_b ? nullptr : transposed(b.codes, K, N);
  if (at != nullptr) a.codes = at;
  if (bt != nullptr) b.codes = bt;
  GemmFp8(false, true, M, N, K, a, b, C, accumulate);
  if (at != nullptr) Free(at);
  if (bt != nullptr) Free(bt);
}

void Backend::Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, TypedCPtr A,
                   TypedCPtr B, float* C, bool accumulate, GemmInputs inputs) {
  FSDP8_CHECK(A.bf16() == B.bf16()) << "Gemm: A and B take one dtype";
  if (TryGemm(trans_a, trans_b, M, N, K, A, B, C, accumulate, inputs)) return;
  float* a = Scratch<float>(this, M * K);
  float* b = Scratch<float>(this, N * K);
  UnpackBf16(A.h(), a, M * K);
  UnpackBf16(B.h(), b, N * K);
  Gemm(trans_a, trans_b, M, N, K, a, b, C, accumulate, GemmInputs::kF32);
  Free(a);
  Free(b);
}

void Backend::RmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C,
                             float* y, float* rstd, const Fp8Cast& cast) {
  FSDP8_CHECK(cast.none() || (y == nullptr && cast.out_t == nullptr && Ld(cast.ld, C) == C))
      << "RmsNormForward: FP8 takes dense codes only";
  if (TryRmsNormForward(x, w, eps, N, C, y, rstd, cast)) return;
  float* s = Scratch<float>(this, N * C);
  RmsNormForward(x, w, eps, N, C, s, rstd);
  CastFp8(s, 1, N * C, cast.scale, cast.fmt, cast.out, nullptr, cast.amax);
  Free(s);
}

void Backend::RmsNormBackward(TypedCPtr dy, const float* x, const float* w, const float* rstd,
                              int64_t N, int64_t C, float* dx, float* dw, const float* dres,
                              TypedCPtr dy_b, TypedCPtr dy_c) {
  FSDP8_CHECK(!dy.bf16() || dres != nullptr) << "RmsNormBackward: bf16 parts need dres";
  if (TryRmsNormBackward(dy, x, w, rstd, N, C, dx, dw, dres, dy_b, dy_c)) return;
  if (!dy.bf16()) {
    FSDP8_CHECK(dy_b.null() && dy_c.null()) << "RmsNormBackward: parts are bf16";
    RmsNormBackward(dy, x, w, rstd, N, C, dx, dw);
    Axpy(1.0f, dres, dx, N * C);
    return;
  }
  const int64_t n = N * C;
  float* sum = Scratch<float>(this, 2 * n);
  float* part = sum + n;
  FSDP8_CHECK(!dy_b.null() || dy_c.null()) << "RmsNormBackward: dy_c without dy_b";
  UnpackBf16(dy.h(), sum, n);
  if (!dy_b.null()) {
    UnpackBf16(dy_b.h(), part, n);
    Axpy(1.0f, part, sum, n);
  }
  if (!dy_c.null()) {
    UnpackBf16(dy_c.h(), part, n);
    Axpy(1.0f, part, sum, n);
  }
  RmsNormBackward(sum, x, w, rstd, N, C, dx, dw, dres);
  Free(sum);
}

void Backend::RopeForward(TypedPtr x, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                          int64_t ld) {
  ld = Ld(ld, H * D);
  FSDP8_CHECK(x.bf16() || ld == H * D) << "RopeForward: f32 x is dense";
  if (TryRopeForward(x, B, T, H, D, theta, ld)) return;
  uint16_t* x16 = x.h();
  if (ld == H * D) {
    RopeBf16(this, x16, B, T, H, D, theta, /*backward=*/false);
    return;
  }
  uint16_t* d = DenseRows16(this, x16, B * T, H * D, ld);
  RopeBf16(this, d, B, T, H, D, theta, /*backward=*/false);
  for (int64_t r = 0; r < B * T; ++r) Copy(x16 + r * ld, d + r * H * D, H * D * sizeof(uint16_t));
  Free(d);
}

void Backend::RopeBackward(TypedPtr dx, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                           const Fp8Cast& cast) {
  if (TryRopeBackward(dx, B, T, H, D, theta, cast)) return;
  uint16_t* dx16 = dx.h();
  if (cast.none()) {
    RopeBf16(this, dx16, B, T, H, D, theta, /*backward=*/true);
    return;
  }
  const int64_t n = B * T * H * D;
  uint16_t* r16 = reinterpret_cast<uint16_t*>(Scratch<float>(this, (n + 1) / 2));
  Copy(r16, dx16, static_cast<size_t>(n) * sizeof(uint16_t));
  RopeBackward(r16, B, T, H, D, theta);
  CastFp8(r16, B * T, H * D, cast.scale, cast.fmt, cast.out, cast.out_t, cast.amax, cast.ld);
  Free(r16);
}

void Backend::AttentionForward(TypedCPtr q, TypedCPtr k, TypedCPtr v, int64_t B, int64_t T,
                               int64_t H, int64_t Hkv, int64_t D, TypedPtr out, float* lse,
                               const AttentionOptions& options) {
  const AttentionOptions opts{options.bf16, Ld(options.q_ld, H * D), Ld(options.kv_ld, Hkv * D)};
  if (TryAttentionForward(q, k, v, B, T, H, Hkv, D, out, lse, opts)) return;
  const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
  if (!q.bf16()) {  // the bf16 recipe on f32 storage
    float* qr = RoundedToBf16Copy(this, q.f(), nq);
    float* kr = RoundedToBf16Copy(this, k.f(), nk);
    float* vr = RoundedToBf16Copy(this, v.f(), nk);
    AttentionForward(qr, kr, vr, B, T, H, Hkv, D, out.f(), lse);
    RoundToBf16(out.f(), nq);
    for (float* p : {qr, kr, vr}) Free(p);
    return;
  }
  float* buf = Scratch<float>(this, 2 * nq + 2 * nk);
  float *qf = buf, *o = qf + nq, *kf = o + nq, *vf = kf + nk;
  UnpackRows(this, q.h(), B * T, H * D, opts.q_ld, qf);
  UnpackRows(this, k.h(), B * T, Hkv * D, opts.kv_ld, kf);
  UnpackRows(this, v.h(), B * T, Hkv * D, opts.kv_ld, vf);
  AttentionForward(qf, kf, vf, B, T, H, Hkv, D, o, lse, AttentionOptions{true});
  PackBf16(o, out.h(), nq);
  Free(buf);
}

void Backend::AttentionBackward(TypedCPtr q, TypedCPtr k, TypedCPtr v, TypedCPtr out,
                                TypedCPtr dout, const float* lse, int64_t B, int64_t T, int64_t H,
                                int64_t Hkv, int64_t D, TypedPtr dq, TypedPtr dk, TypedPtr dv,
                                const AttentionOptions& options) {
  const AttentionOptions opts{options.bf16, Ld(options.q_ld, H * D), Ld(options.kv_ld, Hkv * D)};
  FSDP8_CHECK(!q.bf16() || dout.bf16() || (opts.q_ld == H * D && opts.kv_ld == Hkv * D))
      << "AttentionBackward: strided q, k, v take bf16 gradients";
  if (TryAttentionBackward(q, k, v, out, dout, lse, B, T, H, Hkv, D, dq, dk, dv, opts)) return;
  const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
  if (!q.bf16()) {  // the bf16 recipe on f32 storage
    float* qr = RoundedToBf16Copy(this, q.f(), nq);
    float* kr = RoundedToBf16Copy(this, k.f(), nk);
    float* vr = RoundedToBf16Copy(this, v.f(), nk);
    float* outr = RoundedToBf16Copy(this, out.f(), nq);
    float* doutr = RoundedToBf16Copy(this, dout.f(), nq);
    AttentionBackward(qr, kr, vr, outr, doutr, lse, B, T, H, Hkv, D, dq.f(), dk.f(), dv.f());
    RoundToBf16(dq.f(), nq);
    RoundToBf16(dk.f(), nk);
    RoundToBf16(dv.f(), nk);
    for (float* p : {qr, kr, vr, outr, doutr}) Free(p);
    return;
  }
  if (!dout.bf16()) {  // saved bf16 activations, f32 gradients
    float* buf = Scratch<float>(this, 2 * nq + 2 * nk);
    float *qf = buf, *o = qf + nq, *kf = o + nq, *vf = kf + nk;
    UnpackBf16(q.h(), qf, nq);
    UnpackBf16(out.h(), o, nq);
    UnpackBf16(k.h(), kf, nk);
    UnpackBf16(v.h(), vf, nk);
    AttentionBackward(qf, kf, vf, o, dout, lse, B, T, H, Hkv, D, dq.f(), dk.f(), dv.f(),
                      AttentionOptions{true});
    Free(buf);
    return;
  }
  // everything bf16
  uint16_t* qd = DenseRows16(this, q.h(), B * T, H * D, opts.q_ld);
  uint16_t* kd = DenseRows16(this, k.h(), B * T, Hkv * D, opts.kv_ld);
  uint16_t* vd = DenseRows16(this, v.h(), B * T, Hkv * D, opts.kv_ld);
  if (qd != nullptr || kd != nullptr || vd != nullptr) {
    AttentionBackward(qd ? qd : q.h(), kd ? kd : k.h(), vd ? vd : v.h(), out, dout, lse, B, T, H,
                      Hkv, D, dq, dk, dv, AttentionOptions{true, H * D, Hkv * D});
    for (uint16_t* p : {qd, kd, vd}) {
      if (p != nullptr) Free(p);
    }
    return;
  }
  float* buf = Scratch<float>(this, 2 * nq + 2 * nk);
  float *dqf = buf, *dkf = dqf + nq, *dvf = dkf + nk, *doutf = dvf + nk;
  UnpackBf16(dout.h(), doutf, nq);
  AttentionBackward(q, k, v, out, doutf, lse, B, T, H, Hkv, D, dqf, dkf, dvf,
                    AttentionOptions{true});
  PackBf16(dqf, dq.h(), nq);
  PackBf16(dkf, dk.h(), nk);
  PackBf16(dvf, dv.h(), nk);
  Free(buf);
}

void Backend::SwigluForward(TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols, int64_t in_ld,
                            float* h, const Fp8Cast& cast) {
  in_ld = Ld(in_ld, cols);
  FSDP8_CHECK(cast.none() ? in_ld == cols && h != nullptr : h == nullptr)
      << "SwigluForward: f32 gate and up are dense; FP8 output takes h null";
  if (TrySwigluForward(gate, up, rows, cols, in_ld, h, cast)) return;
  FSDP8_CHECK(!cast.none() && gate.bf16() && up.bf16()) << "SwigluForward: FP8 takes bf16 gate, up";
  if (cast.out_t != nullptr) {  // the codes, then their transpose
    uint8_t* codes = cast.out;
    if (codes == nullptr) codes = Scratch<uint8_t>(this, rows * cols);
    Fp8Cast c = cast;
    c.out = codes;
    c.out_t = nullptr;
    SwigluForward(gate, up, rows, cols, in_ld, nullptr, c);
    TransposeBytes(codes, rows, cols, cast.out_t);
    if (cast.out == nullptr) Free(codes);
    return;
  }
  const int64_t n = rows * cols;
  float* buf = Scratch<float>(this, 3 * n);
  UnpackRows(this, gate.h(), rows, cols, in_ld, buf);
  UnpackRows(this, up.h(), rows, cols, in_ld, buf + n);
  SwigluForward(buf, buf + n, 1, n, 0, buf + 2 * n);
  CastFp8(buf + 2 * n, 1, n, cast.scale, cast.fmt, cast.out, nullptr, cast.amax);
  Free(buf);
}

void Backend::SwigluBackward(TypedCPtr dh, TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols,
                             int64_t in_ld, TypedPtr dgate, TypedPtr dup, const Fp8Cast& gate_cast,
                             const Fp8Cast& up_cast) {
  const int64_t n = rows * cols;
  in_ld = Ld(in_ld, cols);
  const bool fp8 = dgate.null() && dup.null();  // the gradients straight to FP8
  FSDP8_CHECK(fp8 ? dh.bf16() && gate.bf16() && gate_cast.fmt == up_cast.fmt &&
                        gate_cast.ld == up_cast.ld
                  : in_ld == cols)
      << "SwigluBackward: FP8 gradients take bf16 inputs and one format and ld; others dense";
  if (TrySwigluBackward(dh, gate, up, rows, cols, in_ld, dgate, dup, gate_cast, up_cast)) return;
  if (fp8) {
    if (in_ld != cols) {  // dense copies of gate and up first
      uint16_t* g16 = DenseRows16(this, gate.h(), rows, cols, in_ld);
      uint16_t* u16 = DenseRows16(this, up.h(), rows, cols, in_ld);
      SwigluBackward(dh, g16, u16, rows, cols, cols, nullptr, nullptr, gate_cast, up_cast);
      Free(u16);
      Free(g16);
      return;
    }
    // Two bf16 gradients in one scratch buffer, the second starting 8-byte aligned.
    uint16_t* dgate16 = reinterpret_cast<uint16_t*>(Scratch<float>(this, n + 2));
    uint16_t* dup16 = dgate16 + ((n + 3) & ~int64_t{3});
    SwigluBackward(dh, gate, up, 1, n, 0, dgate16, dup16);
    for (const auto& [g16, c] : {std::pair<uint16_t*, const Fp8Cast*>{dgate16, &gate_cast},
                                 std::pair<uint16_t*, const Fp8Cast*>{dup16, &up_cast}}) {
      CastFp8(g16, rows, cols, c->scale, c->fmt, c->out, c->out_t, c->amax, c->ld);
    }
    Free(dgate16);
    return;
  }
  if (!dh.bf16()) {  // bf16-saved inputs, f32 gradients
    float* buf = Scratch<float>(this, 2 * n);
    UnpackBf16(gate.h(), buf, n);
    UnpackBf16(up.h(), buf + n, n);
    SwigluBackward(dh, buf, buf + n, 1, n, 0, dgate.f(), dup.f());
    Free(buf);
    return;
  }
  float* buf = Scratch<float>(this, 3 * n);  // everything bf16
  UnpackBf16(dh.h(), buf + 2 * n, n);
  SwigluBackward(buf + 2 * n, gate, up, 1, n, 0, buf, buf + n);
  PackBf16(buf, dgate.h(), n);
  PackBf16(buf + n, dup.h(), n);
  Free(buf);
}

void Backend::CrossEntropyForwardBackward(float* logits, const int32_t* targets, int64_t N,
                                          int64_t V, float grad_scale, float* losses,
                                          TypedPtr dlogits) {
  if (TryCrossEntropy(logits, targets, N, V, grad_scale, losses, dlogits)) return;
  FSDP8_CHECK(dlogits.bf16()) << "CrossEntropyForwardBackward: dlogits is bf16";
  float* g = Scratch<float>(this, N * V);
  Copy(g, logits, static_cast<size_t>(N * V) * sizeof(float));
  CrossEntropyForwardBackward(g, targets, N, V, grad_scale, losses);
  PackBf16(g, dlogits.h(), N * V);
  Free(g);
}

BackendOptions BackendOptions::FromEnvironment() {
  BackendOptions o;
  o.cpu_fill_nan = env::SwitchOrExit(env::kCpuFillNan);
  absl::StatusOr<std::optional<double>> period = env::ProfileOpsPeriod();
  if (!period.ok()) {
    std::fprintf(stderr, "fsdp8: %s\n", std::string(period.status().message()).c_str());
    std::exit(2);
  }
  if (period->has_value()) o.profile_ops_period_s = **period;
  o.gemm_verbose = env::SwitchOrExit(env::kGemmVerbose);
  return o;
}

std::unique_ptr<Backend> CreateBackend(const std::string& name, int device, std::string* error,
                                       const BackendOptions& options) {
  if (name == "cpu") {
#ifdef FSDP8_WITH_FAST_CPU
    if (CpuFastBackend::Supported()) return std::make_unique<CpuFastBackend>(options);
#endif
    return std::make_unique<CpuRefBackend>(options);  // named "cpu-ref": Name() says which runs
  }
  if (name == "cpu-ref") return std::make_unique<CpuRefBackend>(options);
  if (name == "cuda") {
#ifdef FSDP8_WITH_CUDA
    return CreateCudaBackend(device, error, options);
#else
    (void)device;
    if (error != nullptr) {
      *error = "backend 'cuda' is not built: configure with -DFSDP8_CUDA=ON on a machine with nvcc";
    }
    return nullptr;
#endif
  }
  if (error != nullptr) *error = "unknown backend '" + name + "': expected 'cpu', 'cpu-ref' or 'cuda'";
  return nullptr;
}

int64_t DeviceMemoryBytes(const std::string& backend, int device, std::string* error) {
  if (backend == "cuda") {
#ifdef FSDP8_WITH_CUDA
    return CudaDeviceTotalMemory(device, error);
#else
    (void)device;
    if (error != nullptr) *error = "backend 'cuda' is not built";
    return 0;
#endif
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) {
    if (error != nullptr) *error = "sysconf: physical memory unknown";
    return 0;
  }
  const int64_t physical = static_cast<int64_t>(pages) * page;
  const int64_t limit = CgroupMemoryLimitBytes();
  return limit > 0 && limit < physical ? limit : physical;
}

}  // namespace fsdp8
