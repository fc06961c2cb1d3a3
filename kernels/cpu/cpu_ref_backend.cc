#include "kernels/cpu/cpu_ref_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>

#include "common/check.h"
#include "kernels/adamw_scalars.h"
#include "kernels/fp8.h"

namespace fsdp8 {
namespace {

constexpr size_t kAlignment = 64;
// The size of the host block behind an allocation of `bytes`: whole kAlignment units, at least one.
size_t Rounded(size_t bytes) {
  return std::max<size_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
}
// Rows per block in the attention kernels: the causal structure lets a row block [i0, i1) touch
// only keys [0, i1), which skips about 3/8 of the T x T work at T = 256.
constexpr int64_t kAttnBlock = 64;

// max(a, b) that returns NaN when either is NaN (amax must surface NaN to the scaling logic).
inline float NanMax(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return a > b ? a : b;
}

// Max |x_i| over a range, NaN-propagating. Returns 0 for an empty range.
inline float AbsMax(const float* x, int64_t n) {
  float m = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a > m) m = a;
    nan |= (a != a);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// Encoding through a table. The FP8 code of an f32 is a function of its top 16 bits (sign,
// exponent and 7 mantissa bits: more than the kept bits + round bit that round-to-nearest-even to
// E4M3/E5M2 inspects at any exponent, subnormals included) and of whether any of its low 16 bits
// is set (the sticky bit). So code = table[sticky][bits >> 16], filled once by the exact encoder
// of kernels/fp8.h on one representative per entry. 128 KiB per format.
class Fp8EncodeTable {
 public:
  explicit Fp8EncodeTable(Fp8Format fmt) {
    for (uint32_t sticky = 0; sticky < 2; ++sticky) {
      for (uint32_t hi = 0; hi < 65536; ++hi) {
        const uint32_t bits = (hi << 16) | sticky;
        float x;
        std::memcpy(&x, &bits, sizeof(x));
        code_[sticky][hi] = EncodeFp8(x, fmt);
      }
    }
  }
  uint8_t Encode(float x) const {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    return code_[(bits & 0xFFFFu) != 0][bits >> 16];
  }

 private:
  uint8_t code_[2][65536];
};

const Fp8EncodeTable& EncodeTableFor(Fp8Format fmt) {
  static const Fp8EncodeTable e4m3(Fp8Format::kE4M3);
  static const Fp8EncodeTable e5m2(Fp8Format::kE5M2);
  return fmt == Fp8Format::kE4M3 ? e4m3 : e5m2;
}

// out[i] = fp8(in[i] * scale). (n)
void ScaleEncode(const float* in, uint8_t* out, int64_t n, float scale, Fp8Format fmt) {
  const Fp8EncodeTable& table = EncodeTableFor(fmt);
  for (int64_t i = 0; i < n; ++i) out[i] = table.Encode(in[i] * scale);
}

// Transposes one tile of at most kTile x kTile bytes: tile (nr, nc) with row stride kTile into
// out (cols, rows) at (c0, r0). Each destination row is a contiguous run of nr bytes, so the
// writes of a tile touch nc cache lines once each (strided single-byte writes to 64 lines per
// tile would thrash the L1 sets when rows is a power of two).
constexpr int64_t kTile = 64;
void StoreTransposedTile(const uint8_t (&tile)[kTile][kTile], int64_t nr, int64_t nc, int64_t r0,
                         int64_t c0, int64_t rows, uint8_t* out) {
  for (int64_t c = 0; c < nc; ++c) {
    uint8_t* dst = out + (c0 + c) * rows + r0;
    for (int64_t r = 0; r < nr; ++r) dst[r] = tile[r][c];
  }
}

// Transposing cast: in (rows, cols) -> out_t (cols, rows) [and out (rows, cols)], tile by tile.
void ScaleEncodeTranspose(const float* in, int64_t rows, int64_t cols, float scale, Fp8Format fmt,
                          uint8_t* out, uint8_t* out_t) {
  const Fp8EncodeTable& table = EncodeTableFor(fmt);
  uint8_t tile[kTile][kTile];
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t nr = std::min(kTile, rows - r0);
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t nc = std::min(kTile, cols - c0);
      for (int64_t r = 0; r < nr; ++r) {
        const float* src = in + (r0 + r) * cols + c0;
        for (int64_t c = 0; c < nc; ++c) tile[r][c] = table.Encode(src[c] * scale);
        if (out != nullptr) std::memcpy(out + (r0 + r) * cols + c0, tile[r], nc);
      }
      StoreTransposedTile(tile, nr, nc, r0, c0, rows, out_t);
    }
  }
}

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace

CpuRefBackend::CpuRefBackend(const BackendOptions& options)
    : fill_nan_(options.cpu_fill_nan), limit_(options.memory_limit_bytes) {}

CpuRefBackend::~CpuRefBackend() {
  for (auto& kv : sizes_) std::free(kv.first);
}

// ---- memory ---------------------------------------------------------------------------------

void* CpuRefBackend::TakeBlock(size_t rounded) { return std::aligned_alloc(kAlignment, rounded); }
void CpuRefBackend::GiveBlock(void* p, size_t /*rounded*/) { std::free(p); }

void* CpuRefBackend::Alloc(size_t bytes) {
  const size_t rounded = Rounded(bytes);
  if (limit_ > 0 && allocated_ + static_cast<int64_t>(bytes) > limit_) return nullptr;
  void* p = TakeBlock(rounded);
  if (p == nullptr) return nullptr;  // host out of memory: the caller reports it (backend.h)
  if (fill_nan_) std::memset(p, 0xFF, rounded);
  sizes_[p] = bytes;
  allocated_ += static_cast<int64_t>(bytes);
  peak_ = std::max(peak_, allocated_);
  account_.Allocated(p, static_cast<int64_t>(bytes));
  return p;
}

void CpuRefBackend::Free(void* p) {
  if (p == nullptr) return;
  auto it = sizes_.find(p);
  FSDP8_CHECK(it != sizes_.end());  // not from this backend's Alloc, or freed twice
  allocated_ -= static_cast<int64_t>(it->second);
  account_.Freed(p);
  const size_t rounded = Rounded(it->second);
  sizes_.erase(it);
  GiveBlock(p, rounded);
}

void CpuRefBackend::CopyToDevice(void* dst, const void* host_src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, host_src, bytes);
}
void CpuRefBackend::CopyToHost(void* host_dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(host_dst, src, bytes);
}
void CpuRefBackend::Copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
}
void CpuRefBackend::Memset(void* dst, int value, size_t bytes) {
  if (bytes > 0) std::memset(dst, value, bytes);
}

namespace {
// A scratch slot the backend could not allocate: std::bad_alloc naming the bytes (the worker's
// RESOURCE_EXHAUSTED carries what()).
class ScratchOutOfMemory : public std::bad_alloc {
 public:
  ScratchOutOfMemory(int64_t bytes, int64_t allocated)
      : message_("the CPU backend's scratch slot: " + std::to_string(bytes) + " bytes, " +
                 std::to_string(allocated) + " bytes in use") {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};
}  // namespace

float* CpuRefBackend::Scratch(int i, int64_t n) {
  FSDP8_CHECK(i >= 0 && i < kScratchSlots);
  if (scratch_[i] != nullptr && scratch_n_[i] >= n) return scratch_[i];
  Free(scratch_[i]);  // grows: the old contents are not kept
  scratch_[i] = nullptr;
  scratch_n_[i] = 0;
  const int64_t bytes = std::max<int64_t>(n, 1) * static_cast<int64_t>(sizeof(float));
  const MemoryLabelScope work(&account_, MemoryLabel::kWork);  // the backend's own
  auto* p = static_cast<float*>(Alloc(static_cast<size_t>(bytes)));
  if (p == nullptr) throw ScratchOutOfMemory(bytes, AllocatedBytes());
  scratch_[i] = p;
  scratch_n_[i] = n;
  return p;
}

// ---- FP8 --------------------------------------------------------------------------------------

void CpuRefBackend::CastToFp8(const float* in, uint8_t* out, int64_t n, const float* scale,
                              Fp8Format fmt, float* amax_out) {
  FSDP8_CHECK(n >= 0 && scale != nullptr);
  if (n == 0) return;
  FSDP8_CHECK(in != nullptr && out != nullptr);
  ScaleEncode(in, out, n, *scale, fmt);
  if (amax_out != nullptr) *amax_out = NanMax(*amax_out, AbsMax(in, n));
}

void CpuRefBackend::CastTransposeFp8(const float* in, int64_t rows, int64_t cols,
                                     const float* scale, Fp8Format fmt, uint8_t* out,
                                     uint8_t* out_t, float* amax_out) {
  FSDP8_CHECK(rows >= 0 && cols >= 0 && scale != nullptr);
  if (rows == 0 || cols == 0) return;
  FSDP8_CHECK(in != nullptr && out_t != nullptr);
  ScaleEncodeTranspose(in, rows, cols, *scale, fmt, out, out_t);
  if (amax_out != nullptr) *amax_out = NanMax(*amax_out, AbsMax(in, rows * cols));
}

void CpuRefBackend::TransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) {
  // in (rows, cols) -> out (cols, rows), tile by tile.
  uint8_t tile[kTile][kTile];
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t nr = std::min(kTile, rows - r0);
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t nc = std::min(kTile, cols - c0);
      for (int64_t r = 0; r < nr; ++r) std::memcpy(tile[r], in + (r0 + r) * cols + c0, nc);
      StoreTransposedTile(tile, nr, nc, r0, c0, rows, out);
    }
  }
}

void CpuRefBackend::DequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                                  Fp8Format fmt) {
  const float* table = Fp8DecodeTable(fmt);
  const float si = *scale_inv;
  for (int64_t i = 0; i < n; ++i) out[i] = table[in[i]] * si;
}

void CpuRefBackend::AmaxAccumulate(const float* in, int64_t n, float* amax_out) {
  FSDP8_CHECK(amax_out != nullptr && n >= 0);
  *amax_out = NanMax(*amax_out, AbsMax(in, n));
}

void CpuRefBackend::Fp8ScalesFromAmax(const float* amax, int64_t n, float fp8_max, int margin,
                                      float* scale, float* scale_inv, int64_t stride) {
  FSDP8_CHECK(n >= 0 && stride >= 1 && margin >= 0);
  auto usable = [](float v) { return std::isfinite(v) && v > 0.0f; };
  for (int64_t i = 0; i < n; ++i) {
    float s = usable(scale[i * stride]) ? scale[i * stride] : 1.0f;
    if (usable(amax[i]) && usable(fp8_max)) {
      double d = static_cast<double>(fp8_max) / static_cast<double>(amax[i]);
      d = std::ldexp(d, -margin);
      d = std::min(std::max(d, static_cast<double>(FLT_MIN)), static_cast<double>(FLT_MAX));
      s = static_cast<float>(d);
    }
    scale[i * stride] = s;
    scale_inv[i * stride] = 1.0f / s;
  }
}

// ---- GEMMs ------------------------------------------------------------------------------------

void CpuRefBackend::GemmFp8Tn(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format a_fmt,
                              const float* a_scale_inv, const uint8_t* B, Fp8Format b_fmt,
                              const float* b_scale_inv, float* C, bool accumulate) {
  FSDP8_CHECK(M >= 0 && N >= 0 && K >= 0);
  if (M == 0 || N == 0) return;
  const float alpha = (*a_scale_inv) * (*b_scale_inv);
  if (K == 0) {  // empty sum
    if (!accumulate) std::memset(C, 0, sizeof(float) * M * N);
    return;
  }
  // A (M, K) and B (N, K) decoded to f32: exact, the FP8 values are f32 values.
  float* af = Scratch(0, M * K);
  float* bf = Scratch(1, N * K);
  const float* ta = Fp8DecodeTable(a_fmt);
  const float* tb = Fp8DecodeTable(b_fmt);
  for (int64_t i = 0; i < M * K; ++i) af[i] = ta[A[i]];
  for (int64_t i = 0; i < N * K; ++i) bf[i] = tb[B[i]];
  // C (M, N) = alpha * A · B^T + beta * C
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, alpha, af, K, bf, K,
              accumulate ? 1.0f : 0.0f, C, N);
}

void CpuRefBackend::GemmF32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                            const float* A, const float* B, float* C, bool accumulate,
                            GemmInputs inputs) {
  FSDP8_CHECK(M >= 0 && N >= 0 && K >= 0);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate) std::memset(C, 0, sizeof(float) * M * N);
    return;
  }
  const float* a = A;
  const float* b = B;
  if (inputs == GemmInputs::kBF16) {
    float* ar = Scratch(0, M * K);
    float* br = Scratch(1, K * N);
    for (int64_t i = 0; i < M * K; ++i) ar[i] = RoundBf16(A[i]);
    for (int64_t i = 0; i < K * N; ++i) br[i] = RoundBf16(B[i]);
    a = ar;
    b = br;
  }
  // A is (M, K) or (K, M); B is (K, N) or (N, K); C (M, N).
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, a, trans_a ? M : K, b,
              trans_b ? K : N, accumulate ? 1.0f : 0.0f, C, N);
}

void CpuRefBackend::RoundToBf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = RoundBf16(x[i]);
}

void CpuRefBackend::PackBf16(const float* in, uint16_t* out, int64_t n) {
  // The upper 16 bits of the RNE-rounded f32 are the bfloat16 bit pattern.
  for (int64_t i = 0; i < n; ++i) {
    const float r = RoundBf16(in[i]);
    uint32_t u;
    std::memcpy(&u, &r, sizeof(u));
    out[i] = static_cast<uint16_t>(u >> 16);
  }
}

void CpuRefBackend::UnpackBf16(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(&out[i], &u, sizeof(float));
  }
}

// ---- elementwise ------------------------------------------------------------------------------

void CpuRefBackend::Add(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void CpuRefBackend::Axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// ---- embedding --------------------------------------------------------------------------------

void CpuRefBackend::EmbeddingForward(const int32_t* tokens, int64_t N, const float* table,
                                     int64_t C, float* out) {
  // out (N, C) = table (V, C) [tokens (N)]
  for (int64_t i = 0; i < N; ++i) {
    FSDP8_CHECK(tokens[i] >= 0);
    std::memcpy(out + i * C, table + static_cast<int64_t>(tokens[i]) * C, sizeof(float) * C);
  }
}

void CpuRefBackend::EmbeddingBackward(const int32_t* tokens, int64_t N, const float* dout,
                                      int64_t C, float* dtable) {
  // dtable (V, C) += dout (N, C) scattered by tokens, rows visited in order i = 0..N-1.
  for (int64_t i = 0; i < N; ++i) {
    FSDP8_CHECK(tokens[i] >= 0);
    float* row = dtable + static_cast<int64_t>(tokens[i]) * C;
    const float* d = dout + i * C;
    for (int64_t c = 0; c < C; ++c) row[c] += d[c];
  }
}

// ---- RMSNorm ----------------------------------------------------------------------------------

void CpuRefBackend::RmsNormForwardF32(const float* x, const float* w, float eps, int64_t N,
                                      int64_t C, float* y, float* rstd) {
  // x, y (N, C); w (C); rstd (N) = 1 / sqrt(mean(x^2) + eps)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    float ss = 0.0f;
    for (int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
    rstd[n] = r;
    float* yr = y + n * C;
    for (int64_t c = 0; c < C; ++c) yr[c] = (xr[c] * r) * w[c];
  }
}

void CpuRefBackend::RmsNormBackwardF32(const float* dy, const float* x, const float* w,
                                       const float* rstd, int64_t N, int64_t C, float* dx,
                                       float* dw) {
  // y_c = x_c r w_c with r = (mean(x^2) + eps)^(-1/2), dr/dx_c = -r^3 x_c / C, so
  // dx_c = r w_c dy_c - (r^3 / C) x_c sum_k dy_k w_k x_k;   dw_c += sum_n dy_nc x_nc r_n.
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    const float* dyr = dy + n * C;
    float* dxr = dx + n * C;
    const float r = rstd[n];
    float dot = 0.0f;
    for (int64_t c = 0; c < C; ++c) dot += dyr[c] * w[c] * xr[c];
    const float k = r * r * r * dot / static_cast<float>(C);
    for (int64_t c = 0; c < C; ++c) {
      dxr[c] = r * w[c] * dyr[c] - k * xr[c];
      dw[c] += dyr[c] * xr[c] * r;
    }
  }
}

// ---- RoPE -------------------------------------------------------------------------------------

void CpuRefBackend::RopeTables(int64_t T, int64_t D, float theta) {
  if (T == rope_T_ && D == rope_D_ && theta == rope_theta_ &&
      rope_freq_version() == rope_version_) {
    return;
  }
  // As Hugging Face computes them: inv_freq_i = theta^(-2i/D) (or the frequencies SetRopeInvFreq
  // gave) and angle = t * inv_freq_i, both rounded to f32; cos/sin of that f32 angle, rounded to
  // f32. (T, D/2)
  const int64_t half = D / 2;
  const std::vector<float>* scaled = RopeInvFreqFor(D, theta);
  rope_T_ = -1;  // until rebuilt (Scratch may throw)
  rope_cos_ = Scratch(4, T * half);
  rope_sin_ = Scratch(5, T * half);
  for (int64_t i = 0; i < half; ++i) {
    const float inv_freq = scaled != nullptr
        ? (*scaled)[i]
        : static_cast<float>(1.0 / std::pow(static_cast<double>(theta), static_cast<double>(2 * i) / D));
    for (int64_t t = 0; t < T; ++t) {
      const float angle = static_cast<float>(t) * inv_freq;
      rope_cos_[t * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      rope_sin_[t * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
  rope_T_ = T;
  rope_D_ = D;
  rope_theta_ = theta;
  rope_version_ = rope_freq_version();
}

void CpuRefBackend::RopeF32(float* x, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                            float sign) {
  FSDP8_CHECK(D % 2 == 0);
  RopeTables(T, D, theta);
  const int64_t half = D / 2;
  // x (B, T, H, D): rotate the pair (x[i], x[i + D/2]) by sign * angle(t, i).
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const float* cs = rope_cos_ + t * half;
      const float* sn = rope_sin_ + t * half;
      for (int64_t h = 0; h < H; ++h) {
        float* xh = x + ((b * T + t) * H + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = xh[i];
          const float x2 = xh[i + half];
          const float s = sign * sn[i];
          xh[i] = x1 * cs[i] - x2 * s;
          xh[i + half] = x2 * cs[i] + x1 * s;
        }
      }
    }
  }
}

// ---- attention --------------------------------------------------------------------------------

void CpuRefBackend::AttentionForwardF32(const float* q, const float* k, const float* v, int64_t B,
                                        int64_t T, int64_t H, int64_t Hkv, int64_t D, float* out,
                                        float* lse) {
  FSDP8_CHECK(Hkv > 0 && H % Hkv == 0);
  if (B == 0 || T == 0 || H == 0) return;
  const int64_t group = H / Hkv;
  const int64_t ldq = H * D;    // row stride of q/out for one head: (T, D) with stride H*D
  const int64_t ldk = Hkv * D;  // row stride of k/v for one kv head
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  float* P = Scratch(2, T * T);  // (T, T) scores, then probabilities; row i valid on [0, i1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      const float* qh = q + b * T * ldq + h * D;
      const float* kg = k + b * T * ldk + g * D;
      const float* vg = v + b * T * ldk + g * D;
      float* oh = out + b * T * ldq + h * D;
      float* lh = lse + (b * H + h) * T;
      for (int64_t i0 = 0; i0 < T; i0 += kAttnBlock) {
        const int64_t i1 = std::min(T, i0 + kAttnBlock);
        // S[i0:i1, 0:i1] = scale * Q[i0:i1] · K[0:i1]^T
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, i1 - i0, i1, D, scale, qh + i0 * ldq,
                    ldq, kg, ldk, 0.0f, P + i0 * T, T);
        for (int64_t i = i0; i < i1; ++i) {
          float* row = P + i * T;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j <= i; ++j) mx = std::max(mx, row[j]);
          float sum = 0.0f;
          for (int64_t j = 0; j <= i; ++j) {
            row[j] = std::exp(row[j] - mx);
            sum += row[j];
          }
          const float inv = 1.0f / sum;
          for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
          for (int64_t j = i + 1; j < i1; ++j) row[j] = 0.0f;  // causal mask
          lh[i] = mx + std::log(sum);
        }
        // O[i0:i1] = P[i0:i1, 0:i1] · V[0:i1]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, i1 - i0, D, i1, 1.0f, P + i0 * T, T,
                    vg, ldk, 0.0f, oh + i0 * ldq, ldq);
      }
    }
  }
}

void CpuRefBackend::AttentionBackwardF32(const float* q, const float* k, const float* v,
                                         const float* out, const float* dout, const float* lse,
                                         int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                         float* dq, float* dk, float* dv) {
  FSDP8_CHECK(Hkv > 0 && H % Hkv == 0);
  if (B == 0 || T == 0 || H == 0) return;
  const int64_t group = H / Hkv;
  const int64_t ldq = H * D;
  const int64_t ldk = Hkv * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::memset(dk, 0, sizeof(float) * B * T * ldk);
  std::memset(dv, 0, sizeof(float) * B * T * ldk);
  float* P = Scratch(2, T * T);   // (T, T) probabilities recomputed from lse
  float* dS = Scratch(3, T * T);  // (T, T) dP, then scale * dS
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / group;
      const float* qh = q + b * T * ldq + h * D;
      const float* kg = k + b * T * ldk + g * D;
      const float* vg = v + b * T * ldk + g * D;
      const float* oh = out + b * T * ldq + h * D;
      const float* doh = dout + b * T * ldq + h * D;
      const float* lh = lse + (b * H + h) * T;
      float* dqh = dq + b * T * ldq + h * D;
      float* dkg = dk + b * T * ldk + g * D;
      float* dvg = dv + b * T * ldk + g * D;
      for (int64_t i0 = 0; i0 < T; i0 += kAttnBlock) {
        const int64_t i1 = std::min(T, i0 + kAttnBlock);
        // P[i0:i1, 0:i1] = exp(scale * Q K^T - lse), zero above the diagonal.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, i1 - i0, i1, D, scale, qh + i0 * ldq,
                    ldq, kg, ldk, 0.0f, P + i0 * T, T);
        // dP[i0:i1, 0:i1] = dO[i0:i1] · V[0:i1]^T
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, i1 - i0, i1, D, 1.0f, doh + i0 * ldq,
                    ldq, vg, ldk, 0.0f, dS + i0 * T, T);
        for (int64_t i = i0; i < i1; ++i) {
          float* prow = P + i * T;
          float* srow = dS + i * T;
          // delta_i = sum_j P_ij dP_ij = dO_i · O_i
          float delta = 0.0f;
          for (int64_t d = 0; d < D; ++d) delta += doh[i * ldq + d] * oh[i * ldq + d];
          for (int64_t j = 0; j <= i; ++j) {
            prow[j] = std::exp(prow[j] - lh[i]);
            srow[j] = scale * prow[j] * (srow[j] - delta);  // d(raw score) incl. the 1/sqrt(D)
          }
          for (int64_t j = i + 1; j < i1; ++j) {
            prow[j] = 0.0f;
            srow[j] = 0.0f;
          }
        }
        // dQ[i0:i1] = dS[i0:i1, 0:i1] · K[0:i1]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, i1 - i0, D, i1, 1.0f, dS + i0 * T, T,
                    kg, ldk, 0.0f, dqh + i0 * ldq, ldq);
      }
      // Column blocks for dK/dV: keys [j0, j1) are used by queries [j0, T) only, and every row
      // block at or below j0 has these columns filled (zeros above the diagonal).
      for (int64_t j0 = 0; j0 < T; j0 += kAttnBlock) {
        const int64_t j1 = std::min(T, j0 + kAttnBlock);
        // dK[j0:j1] += dS[j0:T, j0:j1]^T · Q[j0:T]
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, j1 - j0, D, T - j0, 1.0f,
                    dS + j0 * T + j0, T, qh + j0 * ldq, ldq, 1.0f, dkg + j0 * ldk, ldk);
        // dV[j0:j1] += P[j0:T, j0:j1]^T · dO[j0:T]
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, j1 - j0, D, T - j0, 1.0f,
                    P + j0 * T + j0, T, doh + j0 * ldq, ldq, 1.0f, dvg + j0 * ldk, ldk);
      }
    }
  }
}

// ---- SwiGLU -----------------------------------------------------------------------------------

void CpuRefBackend::SwigluForwardF32(const float* gate, const float* up, int64_t n, float* h) {
  for (int64_t i = 0; i < n; ++i) h[i] = gate[i] * Sigmoid(gate[i]) * up[i];
}

void CpuRefBackend::SwigluBackwardF32(const float* dh, const float* gate, const float* up,
                                      int64_t n, float* dgate, float* dup) {
  // h = g s(g) u:  dh/dg = u (s + g s (1 - s)),  dh/du = g s.
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float s = Sigmoid(g);
    const float d = dh[i];
    const float u = up[i];
    dgate[i] = d * u * (s + g * s * (1.0f - s));
    dup[i] = d * g * s;
  }
}

// ---- cross-entropy ----------------------------------------------------------------------------

void CpuRefBackend::CrossEntropyF32(float* logits, const int32_t* targets, int64_t N, int64_t V,
                                    float grad_scale, float* losses) {
  // logits (N, V) -> dlogits; losses (N) = logsumexp(row) - row[target]
  for (int64_t n = 0; n < N; ++n) {
    float* row = logits + n * V;
    const int32_t tgt = targets[n];
    FSDP8_CHECK(tgt >= 0 && tgt < V);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, row[j]);
    const float target_logit = row[tgt];
    float sum = 0.0f;
    for (int64_t j = 0; j < V; ++j) {
      row[j] = std::exp(row[j] - mx);  // unnormalised probabilities, in place
      sum += row[j];
    }
    losses[n] = mx + std::log(sum) - target_logit;
    const float k = grad_scale / sum;
    for (int64_t j = 0; j < V; ++j) row[j] *= k;
    row[tgt] -= grad_scale;
  }
}

// ---- optimizer --------------------------------------------------------------------------------

void CpuRefBackend::SumSquares(const float* x, int64_t n, float* out) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  out[0] = static_cast<float>(static_cast<double>(out[0]) + s);
}

void CpuRefBackend::AdamWF32(float* p, const float* g, float* m, float* v, int64_t n, float lr,
                             float beta1, float beta2, float eps, float weight_decay, int64_t step,
                             float grad_scale, float* amax_out, uint16_t* p16_out) {
  // torch.optim.AdamW (single-tensor path): scalars in double, then the f32 tensor ops
  //   p *= 1 - lr*wd;  m.lerp_(g, 1-b1);  v = b2 v + (1-b2) g^2;
  //   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),  bc_k = 1 - b_k^t.
  const auto [decay, w1, w2, step_size, bc2_sqrt] =
      AdamWHostScalarsFor(lr, beta1, beta2, weight_decay, step);
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * grad_scale;
    p[i] *= decay;
    m[i] = w1 < 0.5f ? m[i] + w1 * (gi - m[i]) : gi - (gi - m[i]) * (1.0f - w1);
    v[i] = v[i] * beta2 + w2 * gi * gi;
    const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
    p[i] -= step_size * (m[i] / denom);
  }
  if (amax_out != nullptr) AmaxAccumulate(p, n, amax_out);
  if (p16_out != nullptr) PackBf16(p, p16_out, n);
}

void CpuRefBackend::AdamW(float* p, const float* g, TypedPtr m, TypedPtr v, int64_t n, float lr,
                          float beta1, float beta2, float eps, float weight_decay, int64_t step,
                          float grad_scale, float* amax_out, uint16_t* p16_out) {
  if (!m.bf16()) {
    return AdamWF32(p, g, m.f(), v.f(), n, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                    amax_out, p16_out);
  }
  // bf16 moments, as the contract says: widen, the f32 AdamW, round to nearest even when stored.
  std::vector<float> mf(n), vf(n);
  CpuRefBackend::UnpackBf16(m.h(), mf.data(), n);
  CpuRefBackend::UnpackBf16(v.h(), vf.data(), n);
  CpuRefBackend::AdamWF32(p, g, mf.data(), vf.data(), n, lr, beta1, beta2, eps, weight_decay, step,
                          grad_scale, amax_out, p16_out);
  CpuRefBackend::PackBf16(mf.data(), m.h(), n);
  CpuRefBackend::PackBf16(vf.data(), v.h(), n);
}

// ---- the hooks of the typed ops: the f32 combinations, the others declined --------------------

bool CpuRefBackend::TryCastFp8(TypedCPtr in, int64_t rows, int64_t cols, const float* scale,
                               Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out,
                               int64_t) {
  if (in.bf16()) return false;
  if (out_t == nullptr) {
    CastToFp8(in.f(), out, rows * cols, scale, fmt, amax_out);
  } else {
    CastTransposeFp8(in.f(), rows, cols, scale, fmt, out, out_t, amax_out);
  }
  return true;
}

bool CpuRefBackend::TryGemmFp8(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                               Fp8Operand a, Fp8Operand b, TypedPtr C, bool accumulate,
                               const float* residual) {
  if (C.bf16() || residual != nullptr || trans_a || !trans_b) return false;
  GemmFp8Tn(M, N, K, a.codes, a.fmt, a.scale_inv, b.codes, b.fmt, b.scale_inv, C.f(), accumulate);
  return true;
}

bool CpuRefBackend::TryGemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                            TypedCPtr A, TypedCPtr B, float* C, bool accumulate,
                            GemmInputs inputs) {
  if (A.bf16()) return false;
  GemmF32(trans_a, trans_b, M, N, K, A.f(), B.f(), C, accumulate, inputs);
  return true;
}

bool CpuRefBackend::TryRmsNormForward(const float* x, const float* w, float eps, int64_t N,
                                      int64_t C, float* y, float* rstd, const Fp8Cast& cast) {
  if (!cast.none()) return false;
  RmsNormForwardF32(x, w, eps, N, C, y, rstd);
  return true;
}

bool CpuRefBackend::TryRmsNormBackward(TypedCPtr dy, const float* x, const float* w,
                                       const float* rstd, int64_t N, int64_t C, float* dx,
                                       float* dw, const float* dres, TypedCPtr, TypedCPtr) {
  if (dy.bf16() || dres != nullptr) return false;
  RmsNormBackwardF32(dy.f(), x, w, rstd, N, C, dx, dw);
  return true;
}

bool CpuRefBackend::TryRopeForward(TypedPtr x, int64_t B, int64_t T, int64_t H, int64_t D,
                                   float theta, int64_t) {
  if (x.bf16()) return false;
  RopeF32(x.f(), B, T, H, D, theta, 1.0f);
  return true;
}

bool CpuRefBackend::TryRopeBackward(TypedPtr dx, int64_t B, int64_t T, int64_t H, int64_t D,
                                    float theta, const Fp8Cast& cast) {
  if (dx.bf16() || !cast.none()) return false;
  // The rotation is orthogonal: its Jacobian transpose is the rotation by -angle.
  RopeF32(dx.f(), B, T, H, D, theta, -1.0f);
  return true;
}

bool CpuRefBackend::TryAttentionForward(TypedCPtr q, TypedCPtr k, TypedCPtr v, int64_t B, int64_t T,
                                        int64_t H, int64_t Hkv, int64_t D, TypedPtr out, float* lse,
                                        const AttentionOptions& opts) {
  if (q.bf16() || opts.bf16) return false;
  AttentionForwardF32(q.f(), k.f(), v.f(), B, T, H, Hkv, D, out.f(), lse);
  return true;
}

bool CpuRefBackend::TryAttentionBackward(TypedCPtr q, TypedCPtr k, TypedCPtr v, TypedCPtr out,
                                         TypedCPtr dout, const float* lse, int64_t B, int64_t T,
                                         int64_t H, int64_t Hkv, int64_t D, TypedPtr dq,
                                         TypedPtr dk, TypedPtr dv, const AttentionOptions& opts) {
  if (q.bf16() || opts.bf16) return false;
  AttentionBackwardF32(q.f(), k.f(), v.f(), out.f(), dout.f(), lse, B, T, H, Hkv, D, dq.f(),
                       dk.f(), dv.f());
  return true;
}

bool CpuRefBackend::TrySwigluForward(TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols,
                                     int64_t, float* h, const Fp8Cast& cast) {
  if (gate.bf16() || !cast.none()) return false;
  SwigluForwardF32(gate.f(), up.f(), rows * cols, h);
  return true;
}

bool CpuRefBackend::TrySwigluBackward(TypedCPtr dh, TypedCPtr gate, TypedCPtr up, int64_t rows,
                                      int64_t cols, int64_t, TypedPtr dgate, TypedPtr dup,
                                      const Fp8Cast&, const Fp8Cast&) {
  if (gate.bf16()) return false;
  SwigluBackwardF32(dh.f(), gate.f(), up.f(), rows * cols, dgate.f(), dup.f());
  return true;
}

bool CpuRefBackend::TryCrossEntropy(float* logits, const int32_t* targets, int64_t N, int64_t V,
                                    float grad_scale, float* losses, TypedPtr dlogits) {
  if (!dlogits.null()) return false;
  CrossEntropyF32(logits, targets, N, V, grad_scale, losses);
  return true;
}

}  // namespace fsdp8
