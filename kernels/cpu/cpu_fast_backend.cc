#include "kernels/cpu/cpu_fast_backend.h"

#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <new>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "common/check.h"
#include "kernels/adamw_scalars.h"
#include "kernels/fp8.h"

// Everything below is compiled for AVX2 + FMA + F16C (x86-64-v3); CpuFastBackend::Supported()
// checks the CPU before CreateBackend("cpu") builds one. Only this file's own functions get the
// target, the headers above keep the default one.
#pragma GCC target("avx2,fma,f16c")

namespace fsdp8 {
namespace {

constexpr int64_t kAttnBlock = 64;  // query rows per block, as the reference

// C (M, N) = alpha * op(A) * op(B) + beta * C, row major, through oneDNN's sgemm: its JIT kernels
// are chosen by the CPU's instruction sets (AVX2, AVX-512), not by a table of CPU models. It runs on
// the calling thread's OpenMP team, sized here to the process's BLAS thread count
// (openblas_set_num_threads: the caller's business, as for the reference), so that two
// single-threaded workers on two cores never start four threads.
inline void Sgemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t M, int64_t N, int64_t K,
                  float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                  float* C, int64_t ldc) {
  omp_set_num_threads(std::max(1, openblas_get_num_threads()));
  const dnnl_status_t s = dnnl_sgemm(ta == CblasTrans ? 'T' : 'N', tb == CblasTrans ? 'T' : 'N', M,
                                     N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  if (s == dnnl_out_of_memory) throw std::bad_alloc();  // the worker's job error, as for a buffer
  FSDP8_CHECK(s == dnnl_success) << "dnnl_sgemm failed: status " << static_cast<int>(s);
}

// ---- vector helpers ---------------------------------------------------------------------------

// Lanes [0, r) on, the rest off (r in [0, 8]).
inline __m256i TailMask(int64_t r) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(r)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float HorizontalMax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 lanes: Cephes expf (x = n ln2 + r, |r| <= ln2 / 2, degree-7 polynomial), about
// 1 ulp; 0 below ln(2^-126), +inf above 88.38, NaN stays NaN.
inline __m256 Exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 lo = _mm256_set1_ps(-87.3365447504019f);
  const __m256 xc = _mm256_min_ps(hi, _mm256_max_ps(lo, x));  // NaN passes through
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y =
      _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i n = _mm256_cvtps_epi32(fx);
  const __m256 pow2n =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  __m256 res = _mm256_mul_ps(y, pow2n);
  res = _mm256_blendv_ps(res, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  res = _mm256_blendv_ps(res, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                         _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
  return res;
}

inline __m256 Sigmoid8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, Exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// Max over x[0, n) (n >= 1; NaNs ignored like std::max in the reference's loop).
inline float RowMax(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  float r = HorizontalMax(m);
  for (; i < n; ++i) r = std::max(r, x[i]);
  return r;
}

// x[j] = exp(x[j] - m) over [0, n); returns their sum.
inline float ExpShiftSum(float* x, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 s = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(x + i, e);
    s = _mm256_add_ps(s, e);
  }
  if (i < n) {
    const __m256i mask = TailMask(n - i);
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_maskload_ps(x + i, mask), mv));
    _mm256_maskstore_ps(x + i, mask, e);
    s = _mm256_add_ps(s, _mm256_and_ps(e, _mm256_castsi256_ps(mask)));
  }
  return HorizontalSum(s);
}

inline void ScaleRow(float* x, int64_t n, float k) {
  const __m256 kv = _mm256_set1_ps(k);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), kv));
  for (; i < n; ++i) x[i] *= k;
}

inline float Dot(const float* a, const float* b, int64_t n) {
  __m256 s = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
  float r = HorizontalSum(s);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// ---- FP8 encoding -----------------------------------------------------------------------------

// The parameters of one format for the vector encoder (kernels/fp8.h, Encode).
struct Fp8Params {
  int shift;            // 23 - mantissa bits
  uint32_t rebias;      // (127 - bias) << mantissa bits
  uint32_t min_normal;  // f32 bits of the smallest normal FP8 value
  uint32_t max_bits;    // f32 bits of the largest finite FP8 value (saturate at and above)
  uint32_t max_code;
  float magic;          // 2^23 * smallest subnormal: |x| + magic rounds |x| to a subnormal code
};

inline const Fp8Params& ParamsFor(Fp8Format fmt) {
  static const Fp8Params e4m3{20, 120u << 3, 0x3C800000u /*2^-6*/, 0x43E00000u, 0x7E, 16384.0f};
  static const Fp8Params e5m2{21, 112u << 2, 0x38800000u /*2^-14*/, 0x47600000u, 0x7B, 128.0f};
  return fmt == Fp8Format::kE4M3 ? e4m3 : e5m2;
}

// 8 codes (one per 32-bit lane) of the f32 values x: round to nearest even, saturating, NaN to
// 0x7F with the sign, subnormals exact.
inline __m256i Encode8(__m256 x, const Fp8Params& p) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  const __m128i sh = _mm_cvtsi32_si128(p.shift);
  const __m256i odd = _mm256_and_si256(_mm256_srl_epi32(a, sh), _mm256_set1_epi32(1));
  const __m256i half = _mm256_set1_epi32(static_cast<int>((1u << (p.shift - 1)) - 1u));
  __m256i normal = _mm256_srl_epi32(_mm256_add_epi32(_mm256_add_epi32(a, half), odd), sh);
  normal = _mm256_sub_epi32(normal, _mm256_set1_epi32(static_cast<int>(p.rebias)));
  const __m256 magic = _mm256_set1_ps(p.magic);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), magic)),
      _mm256_castps_si256(magic));
  const __m256i is_normal =
      _mm256_cmpgt_epi32(a, _mm256_set1_epi32(static_cast<int>(p.min_normal - 1)));
  __m256i code = _mm256_blendv_epi8(sub, normal, is_normal);
  const __m256i sat = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(static_cast<int>(p.max_bits - 1)));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(static_cast<int>(p.max_code)), sat);
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), nan);
  return _mm256_or_si256(code, sign);
}

// Running amax of |x| with NaN tracking.
struct AmaxAcc {
  AmaxAcc() : m(_mm256_setzero_ps()), nan(_mm256_setzero_ps()) {}
  __m256 m;
  __m256 nan;
  void Add(__m256 x) {
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    m = _mm256_max_ps(m, a);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  // max(*out, amax) NaN-propagating (as the reference's NanMax), plus the scalar tail's values.
  void Finish(float tail_max, bool tail_nan, float* out) const {
    const bool any_nan = tail_nan || _mm256_movemask_ps(nan) != 0 || std::isnan(*out);
    const float v = std::max(HorizontalMax(m), tail_max);
    *out = any_nan ? std::numeric_limits<float>::quiet_NaN() : std::max(*out, v);
  }
};

// out[i] = fp8(in[i] * scale) for i < n; the amax of |in| into *acc (and the scalar tail's).
void EncodeRun(const float* in, uint8_t* out, int64_t n, float scale, Fp8Format fmt, AmaxAcc* acc,
               float* tail_max, bool* tail_nan) {
  const Fp8Params& p = ParamsFor(fmt);
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 x[4];
    for (int j = 0; j < 4; ++j) {
      x[j] = _mm256_loadu_ps(in + i + 8 * j);
      acc->Add(x[j]);
    }
    const __m256i c01 = _mm256_packus_epi32(Encode8(_mm256_mul_ps(x[0], s), p),
                                            Encode8(_mm256_mul_ps(x[1], s), p));
    const __m256i c23 = _mm256_packus_epi32(Encode8(_mm256_mul_ps(x[2], s), p),
                                            Encode8(_mm256_mul_ps(x[3], s), p));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(c01, c23), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bytes);
  }
  for (; i < n; ++i) {
    const float a = std::fabs(in[i]);
    *tail_nan |= std::isnan(a);
    *tail_max = std::max(*tail_max, a);
    const float y = in[i] * scale;
    out[i] = fmt == Fp8Format::kE4M3 ? EncodeE4M3(y) : EncodeE5M2(y);
  }
}

// 16 FP8 codes (one per 16-bit lane) to their f32 values, exactly, through the half-precision
// converter (F16C): an E5M2 code is the top byte of the binary16 of the same value (infinities and
// NaNs included); an E4M3 code's exponent and mantissa bits, moved to the binary16 positions,
// read as a binary16 of bias 15 instead of 7, times 2^8 (exact: a power of two; FP8 subnormals
// land on binary16 subnormals, whose f32 values are normal), then its NaNs (S.1111.111) from the
// table. Writes out[0, 16).
inline void Decode16(__m256i c, Fp8Format fmt, float* out) {
  __m256i h;
  __m256i special = _mm256_setzero_si256();
  if (fmt == Fp8Format::kE5M2) {
    h = _mm256_slli_epi16(c, 8);
  } else {
    const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi16(0x7F));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8);
    h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), sign);
    special = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F));
  }
  __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  if (fmt == Fp8Format::kE4M3) {
    lo = _mm256_mul_ps(lo, _mm256_set1_ps(256.0f));
    hi = _mm256_mul_ps(hi, _mm256_set1_ps(256.0f));
  }
  _mm256_storeu_ps(out, lo);
  _mm256_storeu_ps(out + 8, hi);
  if (_mm256_movemask_epi8(special) != 0) {
    alignas(32) uint16_t codes[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes), c);
    const float* table = Fp8DecodeTable(fmt);
    for (int j = 0; j < 16; ++j) {
      if ((codes[j] & 0x7F) == 0x7F) out[j] = table[codes[j]];
    }
  }
}

// out[i] = the value of FP8 code in[i] for i < n (exact in f32).
void Decode(const uint8_t* in, int64_t n, Fp8Format fmt, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i c =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    Decode16(c, fmt, out + i);
  }
  const float* table = Fp8DecodeTable(fmt);
  for (; i < n; ++i) out[i] = table[in[i]];
}

// ---- byte transposes --------------------------------------------------------------------------

// out (cols, rows) at (c0, r0) = transpose of the 16 x 16 bytes at in (row stride in_ld).
inline void Transpose16(const uint8_t* in, int64_t in_ld, uint8_t* out, int64_t out_ld) {
  __m128i r[16], a[16], b[16], c[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * in_ld));
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm_unpacklo_epi8(r[i], r[i + 1]);
    a[i + 1] = _mm_unpackhi_epi8(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // rows g..g+3: b = columns in groups of 4
    b[g] = _mm_unpacklo_epi16(a[g], a[g + 2]);
    b[g + 1] = _mm_unpackhi_epi16(a[g], a[g + 2]);
    b[g + 2] = _mm_unpacklo_epi16(a[g + 1], a[g + 3]);
    b[g + 3] = _mm_unpackhi_epi16(a[g + 1], a[g + 3]);
  }
  for (int h = 0; h < 16; h += 8) {  // rows h..h+7: c = columns in pairs
    for (int k = 0; k < 4; ++k) {
      c[h + 2 * k] = _mm_unpacklo_epi32(b[h + k], b[h + 4 + k]);
      c[h + 2 * k + 1] = _mm_unpackhi_epi32(b[h + k], b[h + 4 + k]);
    }
  }
  for (int k = 0; k < 8; ++k) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * k) * out_ld),
                     _mm_unpacklo_epi64(c[k], c[k + 8]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * k + 1) * out_ld),
                     _mm_unpackhi_epi64(c[k], c[k + 8]));
  }
}

// out[c * out_ld + r] = in[r * in_ld + c] for r < nr, c < nc: 16 x 16 blocks where they fit.
void TransposeBlock(const uint8_t* in, int64_t in_ld, int64_t nr, int64_t nc, uint8_t* out,
                    int64_t out_ld) {
  const int64_t cfull = nc / 16 * 16;
  int64_t r = 0;
  for (; r + 16 <= nr; r += 16) {
    for (int64_t c = 0; c < cfull; c += 16) {
      Transpose16(in + r * in_ld + c, in_ld, out + c * out_ld + r, out_ld);
    }
    for (int64_t c = cfull; c < nc; ++c) {
      for (int64_t i = 0; i < 16; ++i) out[c * out_ld + r + i] = in[(r + i) * in_ld + c];
    }
  }
  for (; r < nr; ++r) {
    for (int64_t c = 0; c < nc; ++c) out[c * out_ld + r] = in[r * in_ld + c];
  }
}

// ---- misc -------------------------------------------------------------------------------------

// The f32 bits of RoundBf16 (kernels/fp8.h) of 8 lanes: ties to even on the bits, NaN quieted.
inline __m256i RoundBf16Bits8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  return _mm256_and_si256(_mm256_blendv_epi8(rounded, quiet, nan),
                          _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// 8 bf16 values at p to f32 (exact).
inline __m256 LoadBf16x8(const uint16_t* p) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(c), 16));
}

inline void RoundBf16Run(const float* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        RoundBf16Bits8(_mm256_loadu_ps(in + i)));
  }
  for (; i < n; ++i) out[i] = RoundBf16(in[i]);
}

// out[i] = Bf16Bits(in[i]) for i < n.
inline void PackBf16Run(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = _mm256_srli_epi32(RoundBf16Bits8(_mm256_loadu_ps(in + i)), 16);
    const __m256i b = _mm256_srli_epi32(RoundBf16Bits8(_mm256_loadu_ps(in + i + 8)), 16);
    // packus works within 128-bit lanes: (a0-3, b0-3, a4-7, b4-7); put the 64-bit blocks in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  for (; i < n; ++i) out[i] = Bf16Bits(in[i]);
}

// RMSNorm of one row: y = (x * r) * w, returns r = 1 / sqrt(mean(x^2) + eps).
inline float NormRow(const float* x, const float* w, float eps, int64_t C, float* y) {
  const float r = 1.0f / std::sqrt(Dot(x, x, C) / static_cast<float>(C) + eps);
  for (int64_t c = 0; c < C; ++c) y[c] = (x[c] * r) * w[c];
  return r;
}

}  // namespace

bool CpuFastBackend::Supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

CpuFastBackend::CpuFastBackend(const BackendOptions& options) : CpuRefBackend(options) {
  fp8_gemm_any_layout_ = true;
}

CpuFastBackend::~CpuFastBackend() {
  for (auto& kv : free_) {
    for (void* p : kv.second) std::free(p);
  }
}

// ---- memory -----------------------------------------------------------------------------------

void* CpuFastBackend::TakeBlock(size_t rounded) {
  auto it = free_.find(rounded);
  if (it == free_.end() || it->second.empty()) return CpuRefBackend::TakeBlock(rounded);
  void* p = it->second.back();
  it->second.pop_back();
  cached_ -= rounded;
  return p;
}

void CpuFastBackend::GiveBlock(void* p, size_t rounded) {
  if (cached_ + rounded > kMaxCachedBytes) {
    CpuRefBackend::GiveBlock(p, rounded);
    return;
  }
  free_[rounded].push_back(p);
  cached_ += rounded;
}

// ---- FP8 --------------------------------------------------------------------------------------

void CpuFastBackend::CastToFp8(const float* in, uint8_t* out, int64_t n, const float* scale,
                               Fp8Format fmt, float* amax_out) {
  FSDP8_CHECK(n >= 0 && scale != nullptr);
  if (n == 0) return;
  FSDP8_CHECK(in != nullptr && out != nullptr);
  AmaxAcc acc;
  float tail_max = 0.0f;
  bool tail_nan = false;
  EncodeRun(in, out, n, *scale, fmt, &acc, &tail_max, &tail_nan);
  if (amax_out != nullptr) acc.Finish(tail_max, tail_nan, amax_out);
}

void CpuFastBackend::CastTransposeFp8(const float* in, int64_t rows, int64_t cols,
                                      const float* scale, Fp8Format fmt, uint8_t* out,
                                      uint8_t* out_t, float* amax_out) {
  FSDP8_CHECK(rows >= 0 && cols >= 0 && scale != nullptr);
  if (rows == 0 || cols == 0) return;
  FSDP8_CHECK(in != nullptr && out_t != nullptr);
  // Strips of 64 rows: encoded into `out` (or a scratch strip), then transposed into out_t, whose
  // rows then get 64-byte runs (whole cache lines) per strip.
  constexpr int64_t kStrip = 64;
  std::vector<uint8_t> strip(out == nullptr ? static_cast<size_t>(kStrip * cols) : 0);
  AmaxAcc acc;
  float tail_max = 0.0f;
  bool tail_nan = false;
  for (int64_t r0 = 0; r0 < rows; r0 += kStrip) {
    const int64_t nr = std::min(kStrip, rows - r0);
    uint8_t* codes = out != nullptr ? out + r0 * cols : strip.data();
    EncodeRun(in + r0 * cols, codes, nr * cols, *scale, fmt, &acc, &tail_max, &tail_nan);
    TransposeBlock(codes, cols, nr, cols, out_t + r0, rows);
  }
  if (amax_out != nullptr) acc.Finish(tail_max, tail_nan, amax_out);
}

void CpuFastBackend::TransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) {
  // Strips of 64 rows, so that the 16-byte stores of a strip stay within a few cache lines of
  // each output row.
  for (int64_t r0 = 0; r0 < rows; r0 += 64) {
    TransposeBlock(in + r0 * cols, cols, std::min<int64_t>(64, rows - r0), cols, out + r0, rows);
  }
}

void CpuFastBackend::DequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                                   Fp8Format fmt) {
  Decode(in, n, fmt, out);
  const float si = *scale_inv;
  for (int64_t i = 0; i < n; ++i) out[i] *= si;
}

void CpuFastBackend::AmaxAccumulate(const float* in, int64_t n, float* amax_out) {
  AmaxAcc acc;
  float tail_max = 0.0f;
  bool tail_nan = false;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc.Add(_mm256_loadu_ps(in + i));
  for (; i < n; ++i) {
    const float a = std::fabs(in[i]);
    tail_nan |= std::isnan(a);
    tail_max = std::max(tail_max, a);
  }
  acc.Finish(tail_max, tail_nan, amax_out);
}

// ---- GEMMs ------------------------------------------------------------------------------------


bool CpuFastBackend::TryGemmFp8(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                                Fp8Operand a, Fp8Operand b, TypedPtr C, bool accumulate,
                                const float* residual) {
  if (C.bf16() || residual != nullptr) return false;
  FSDP8_CHECK(M >= 0 && N >= 0 && K >= 0);
  if (M == 0 || N == 0) return true;
  const float alpha = (*a.scale_inv) * (*b.scale_inv);
  if (K == 0) {  // empty sum
    if (!accumulate) std::memset(C.f(), 0, sizeof(float) * M * N);
    return true;
  }
  // The codes decoded in their own layout; sgemm reads either.
  float* af = Scratch(0, M * K);
  float* bf = Scratch(1, N * K);
  Decode(a.codes, M * K, a.fmt, af);
  Decode(b.codes, N * K, b.fmt, bf);
  Sgemm(trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha,
        af, trans_a ? M : K, bf, trans_b ? K : N, accumulate ? 1.0f : 0.0f, C.f(), N);
  return true;
}

namespace {

// x (rows, K) decoded codes, each multiplied by its scale_inv (GemmFp8Blocks' layouts).
void ApplyBlockScales(float* x, int64_t rows, int64_t K, const float* s, Fp8Blocks blocks) {
  const int64_t chunks = Fp8BlockCount(K);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * K;
    if (blocks == Fp8Blocks::kRow) {
      for (int64_t k = 0; k < K; ++k) row[k] *= s[r];
      continue;
    }
    const float* rs = blocks == Fp8Blocks::kTile128 ? s + r * chunks
                                                     : s + (r / kFp8BlockSize) * chunks;
    for (int64_t k = 0; k < K; ++k) row[k] *= rs[k / kFp8BlockSize];
  }
}

}  // namespace

bool CpuFastBackend::TryGemmFp8Blocks(int64_t M, int64_t N, int64_t K, Fp8BlockOperand a,
                                      Fp8BlockOperand b, float* C, bool accumulate) {
  if (K == 0) {  // empty sum
    if (!accumulate) std::memset(C, 0, sizeof(float) * M * N);
    return true;
  }
  float* af = Scratch(0, M * K);
  float* bf = Scratch(1, N * K);
  Decode(a.codes, M * K, a.fmt, af);
  Decode(b.codes, N * K, b.fmt, bf);
  ApplyBlockScales(af, M, K, a.scale_inv, a.blocks);
  ApplyBlockScales(bf, N, K, b.scale_inv, b.blocks);
  Sgemm(CblasNoTrans, CblasTrans, M, N, K, 1.0f, af, K, bf, K, accumulate ? 1.0f : 0.0f, C, N);
  return true;
}

void CpuFastBackend::GemmF32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                             const float* A, const float* B, float* C, bool accumulate,
                             GemmInputs inputs) {
  FSDP8_CHECK(M >= 0 && N >= 0 && K >= 0);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // empty sum
    if (!accumulate) std::memset(C, 0, sizeof(float) * M * N);
    return;
  }
  if (inputs == GemmInputs::kBF16) {
    float* ar = Scratch(0, M * K);
    float* br = Scratch(1, K * N);
    RoundBf16Run(A, ar, M * K);
    RoundBf16Run(B, br, K * N);
    A = ar;
    B = br;
  }
  // A is (M, K) or (K, M); B is (K, N) or (N, K); C (M, N).
  Sgemm(trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A,
        trans_a ? M : K, B, trans_b ? K : N, accumulate ? 1.0f : 0.0f, C, N);
}

void CpuFastBackend::RoundToBf16(float* x, int64_t n) { RoundBf16Run(x, x,
                                 n); }  void CpuFastBackend::PackBf16(const float* in,
                                 uint16_t* out, int64_t n) {
  PackBf16Run(in, out, n);
}

void CpuFastBackend::UnpackBf16(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {  // the bf16 bits become the f32's upper half
    const __m256i w =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(w, 16));
  }
  for (; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(&out[i], &u, sizeof(float));
  }
}

// ---- elementwise ------------------------------------------------------------------------------

void CpuFastBackend::Add(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void CpuFastBackend::Axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// ---- RMSNorm ----------------------------------------------------------------------------------

void CpuFastBackend::RmsNormForwardF32(const float* x, const float* w, float eps, int64_t N,
                                       int64_t C, float* y, float* rstd) {
  for (int64_t n = 0; n < N; ++n) rstd[n] = NormRow(x + n * C, w, eps, C, y + n * C);
}

void CpuFastBackend::RmsNormBackwardF32(const float* dy, const float* x, const float* w,
                                        const float* rstd, int64_t N, int64_t C, float* dx,
                                        float* dw) {
  // As the reference: dx_c = r w_c dy_c - (r^3 / C) x_c sum_k dy_k w_k x_k; dw_c += dy_c x_c r.
  std::vector<float> wx(static_cast<size_t>(C));
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    const float* dyr = dy + n * C;
    float* dxr = dx + n * C;
    const float r = rstd[n];
    for (int64_t c = 0; c < C; ++c) wx[c] = w[c] * xr[c];
    const float k = r * r * r * Dot(dyr, wx.data(), C) / static_cast<float>(C);
    for (int64_t c = 0; c < C; ++c) {
      dxr[c] = r * w[c] * dyr[c] - k * xr[c];
      dw[c] += dyr[c] * xr[c] * r;
    }
  }
}

bool CpuFastBackend::TryRmsNormForward(const float* x, const float* w, float eps, int64_t N,
                                       int64_t C, float* y_out, float* rstd, const Fp8Cast& cast) {
  if (cast.none()) {
    RmsNormForwardF32(x, w, eps, N, C, y_out, rstd);
    return true;
  }
  // RMSNorm and the cast in one pass per row.
  std::vector<float> y(static_cast<size_t>(C));
  AmaxAcc acc;
  float tail_max = 0.0f;
  bool tail_nan = false;
  for (int64_t n = 0; n < N; ++n) {
    rstd[n] = NormRow(x + n * C, w, eps, C, y.data());
    EncodeRun(y.data(), cast.out + n * C, C, *cast.scale, cast.fmt, &acc, &tail_max, &tail_nan);
  }
  if (cast.amax != nullptr) acc.Finish(tail_max, tail_nan, cast.amax);
  return true;
}

// ---- RoPE -------------------------------------------------------------------------------------

void CpuFastBackend::RopeF32(float* x, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                             float sign) {
  FSDP8_CHECK(D % 2 == 0);
  RopeTables(T, D, theta);
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const float* cs = rope_cos_ + t * half;
      const float* sn = rope_sin_ + t * half;
      for (int64_t h = 0; h < H; ++h) {
        float* x1 = x + ((b * T + t) * H + h) * D;
        float* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], c = x2[i], s = sign * sn[i];
          x1[i] = a * cs[i] - c * s;
          x2[i] = c * cs[i] + a * s;
        }
      }
    }
  }
}

// ---- attention --------------------------------------------------------------------------------
// The reference's blocks, with its GEMMs through oneDNN's sgemm (as the linears'): the speed does
// not depend on OpenBLAS's choice of kernels for this CPU. At T = 1 (one key per query) dq and dk
// are analytically zero and come out as the rounding of dP - delta, as on the reference.

void CpuFastBackend::AttentionForwardF32(const float* q, const float* k, const float* v, int64_t B,
                                         int64_t T, int64_t H, int64_t Hkv, int64_t D, float* out,
                                         float* lse) {
  FSDP8_CHECK(Hkv > 0 && H % Hkv == 0);
  if (B == 0 || T == 0 || H == 0) return;
  const int64_t group = H / Hkv, ldq = H * D, ldk = Hkv * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  float* P = Scratch(2, T * T);  // (T, T) scores, then probabilities
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
        Sgemm(CblasNoTrans, CblasTrans, i1 - i0, i1, D, scale, qh + i0 * ldq, ldq, kg, ldk, 0.0f,
              P + i0 * T, T);
        for (int64_t i = i0; i < i1; ++i) {
          float* row = P + i * T;
          const float mx = RowMax(row, i + 1);
          const float sum = ExpShiftSum(row, i + 1, mx);
          ScaleRow(row, i + 1, 1.0f / sum);
          std::fill(row + i + 1, row + i1, 0.0f);  // causal mask
          lh[i] = mx + std::log(sum);
        }
        Sgemm(CblasNoTrans, CblasNoTrans, i1 - i0, D, i1, 1.0f, P + i0 * T, T, vg, ldk, 0.0f,
              oh + i0 * ldq, ldq);
      }
    }
  }
}

namespace {
// One row of the attention backward: p[j] = exp(p[j] - lse), s[j] = scale * p[j] * (s[j] - delta)
// for j < n; both zero on [n, n_end).
void SoftmaxGradRow(float* p, float* s, int64_t n, int64_t n_end, float lse, float delta,
                    float scale) {
  const __m256 l = _mm256_set1_ps(lse), d = _mm256_set1_ps(delta), sc = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 po = Exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), l));
    _mm256_storeu_ps(p + j, po);
    _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_mul_ps(sc, po),
                                          _mm256_sub_ps(_mm256_loadu_ps(s + j), d)));
  }
  if (j < n) {
    const __m256i m = TailMask(n - j);
    const __m256 po = Exp8(_mm256_sub_ps(_mm256_maskload_ps(p + j, m), l));
    _mm256_maskstore_ps(p + j, m, po);
    _mm256_maskstore_ps(s + j, m, _mm256_mul_ps(_mm256_mul_ps(sc, po),
                                                _mm256_sub_ps(_mm256_maskload_ps(s + j, m), d)));
  }
  std::fill(p + n, p + n_end, 0.0f);
  std::fill(s + n, s + n_end, 0.0f);
}
}  // namespace

void CpuFastBackend::AttentionBackwardF32(const float* q, const float* k, const float* v,
                                          const float* out, const float* dout, const float* lse,
                                          int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                          float* dq, float* dk, float* dv) {
  FSDP8_CHECK(Hkv > 0 && H % Hkv == 0);
  if (B == 0 || T == 0 || H == 0) return;
  const int64_t group = H / Hkv, ldq = H * D, ldk = Hkv * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::memset(dk, 0, sizeof(float) * B * T * ldk);
  std::memset(dv, 0, sizeof(float) * B * T * ldk);
  float* P = Scratch(2, T * T);
  float* dS = Scratch(3, T * T);
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
        Sgemm(CblasNoTrans, CblasTrans, i1 - i0, i1, D, scale, qh + i0 * ldq, ldq, kg, ldk, 0.0f,
              P + i0 * T, T);
        Sgemm(CblasNoTrans, CblasTrans, i1 - i0, i1, D, 1.0f, doh + i0 * ldq, ldq, vg, ldk, 0.0f,
              dS + i0 * T, T);
        for (int64_t i = i0; i < i1; ++i) {
          const float delta = Dot(doh + i * ldq, oh + i * ldq, D);
          SoftmaxGradRow(P + i * T, dS + i * T, i + 1, i1, lh[i], delta, scale);
        }
        Sgemm(CblasNoTrans, CblasNoTrans, i1 - i0, D, i1, 1.0f, dS + i0 * T, T, kg, ldk, 0.0f,
              dqh + i0 * ldq, ldq);
      }
      for (int64_t j0 = 0; j0 < T; j0 += kAttnBlock) {
        const int64_t j1 = std::min(T, j0 + kAttnBlock);
        Sgemm(CblasTrans, CblasNoTrans, j1 - j0, D, T - j0, 1.0f, dS + j0 * T + j0, T,
              qh + j0 * ldq, ldq, 1.0f, dkg + j0 * ldk, ldk);
        Sgemm(CblasTrans, CblasNoTrans, j1 - j0, D, T - j0, 1.0f, P + j0 * T + j0, T,
              doh + j0 * ldq, ldq, 1.0f, dvg + j0 * ldk, ldk);
      }
    }
  }
}

// ---- SwiGLU -----------------------------------------------------------------------------------

namespace {
// h = (g * sigmoid(g)) * u, as the reference orders it.
inline __m256 Swiglu8(__m256 g, __m256 u) {
  return _mm256_mul_ps(_mm256_mul_ps(g, Sigmoid8(g)), u);
}

// The SwiGLU backward of 8 lanes: h = g s(g) u, dh/dg = u (s + g s (1 - s)), dh/du = g s.
inline void SwigluGrad8(__m256 d, __m256 g, __m256 u, __m256* dg, __m256* du) {
  const __m256 s = Sigmoid8(g);
  const __m256 gs = _mm256_mul_ps(g, s);
  *dg = _mm256_mul_ps(_mm256_mul_ps(d, u),
                      _mm256_add_ps(s, _mm256_mul_ps(gs, _mm256_sub_ps(_mm256_set1_ps(1.0f), s))));
  *du = _mm256_mul_ps(_mm256_mul_ps(d, g), s);
}
}  // namespace

void CpuFastBackend::SwigluForwardF32(const float* gate, const float* up, int64_t n, float* h) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(h + i, Swiglu8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  }
  if (i < n) {
    const __m256i m = TailMask(n - i);
    _mm256_maskstore_ps(h + i, m,
                        Swiglu8(_mm256_maskload_ps(gate + i, m), _mm256_maskload_ps(up + i, m)));
  }
}

namespace {
// The SwiGLU backward over n elements; gate and up f32, or bf16 widened exactly as they are read.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) { return LoadBf16x8(p); }
inline float Widen(float x) { return x; }
inline float Widen(uint16_t x) { return Bf16Value(x); }
template <typename T>
void SwigluBackwardRun(const float* dh, const T* gate, const T* up, int64_t n, float* dgate,
                       float* dup) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 dg, du;
    SwigluGrad8(_mm256_loadu_ps(dh + i), Load8(gate + i), Load8(up + i), &dg, &du);
    _mm256_storeu_ps(dgate + i, dg);
    _mm256_storeu_ps(dup + i, du);
  }
  if (i < n) {  // the tail in zero-padded lanes
    alignas(32) float d[8] = {}, g[8] = {}, u[8] = {}, dg_out[8], du_out[8];
    for (int64_t j = i; j < n; ++j) {
      d[j - i] = dh[j];
      g[j - i] = Widen(gate[j]);
      u[j - i] = Widen(up[j]);
    }
    __m256 dg, du;
    SwigluGrad8(_mm256_load_ps(d), _mm256_load_ps(g), _mm256_load_ps(u), &dg, &du);
    _mm256_store_ps(dg_out, dg);
    _mm256_store_ps(du_out, du);
    for (int64_t j = i; j < n; ++j) {
      dgate[j] = dg_out[j - i];
      dup[j] = du_out[j - i];
    }
  }
}
}  // namespace

void CpuFastBackend::SwigluBackwardF32(const float* dh, const float* gate, const float* up,
                                       int64_t n, float* dgate, float* dup) {
  SwigluBackwardRun(dh, gate, up, n, dgate, dup);
}

bool CpuFastBackend::TrySwigluBackward(TypedCPtr dh, TypedCPtr gate, TypedCPtr up, int64_t rows,
                                       int64_t cols, int64_t in_ld, TypedPtr dgate, TypedPtr dup,
                                       const Fp8Cast& gate_cast, const Fp8Cast& up_cast) {
  if (!gate.bf16() || dh.bf16()) {
    return CpuRefBackend::TrySwigluBackward(dh, gate, up, rows, cols, in_ld, dgate, dup, gate_cast,
                                            up_cast);
  }
  SwigluBackwardRun(dh.f(), gate.h(), up.h(), rows * cols, dgate.f(), dup.f());  // bf16-saved
  return true;
}

// ---- cross-entropy ----------------------------------------------------------------------------

void CpuFastBackend::CrossEntropyF32(float* logits, const int32_t* targets, int64_t N, int64_t V,
                                     float grad_scale, float* losses) {
  for (int64_t n = 0; n < N; ++n) {
    float* row = logits + n * V;
    const int32_t tgt = targets[n];
    FSDP8_CHECK(tgt >= 0 && tgt < V);
    const float mx = RowMax(row, V);
    const float target_logit = row[tgt];
    const float sum = ExpShiftSum(row, V, mx);
    losses[n] = mx + std::log(sum) - target_logit;
    ScaleRow(row, V, grad_scale / sum);
    row[tgt] -= grad_scale;
  }
}

// ---- optimizer --------------------------------------------------------------------------------

namespace {
inline void Narrow(float x, float* to) { *to = x; }
inline void Narrow(float x, uint16_t* to) { *to = Bf16Bits(x); }

// The reference's scalars and per-element operations (torch.optim.AdamW, single-tensor path), the
// moments f32, or bf16 widened on load and rounded (RoundBf16) on store.
template <typename T>
void AdamWRun(float* p, const float* g, T* m, T* v, int64_t n, float lr, float beta1, float beta2,
              float eps, float weight_decay, int64_t step, float grad_scale) {
  const auto [decay, w1, w2, step_size, bc2_sqrt] =
      AdamWHostScalarsFor(lr, beta1, beta2, weight_decay, step);
  const bool lerp_from_m = w1 < 0.5f;
  const float one_minus_w1 = 1.0f - w1;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * grad_scale;
    const float pi = p[i] * decay;
    const float m0 = Widen(m[i]);
    const float mi = lerp_from_m ? m0 + w1 * (gi - m0) : gi - (gi - m0) * one_minus_w1;
    const float vi = Widen(v[i]) * beta2 + w2 * gi * gi;
    Narrow(mi, m + i);
    Narrow(vi, v + i);
    p[i] = pi - step_size * (mi / (std::sqrt(vi) / bc2_sqrt + eps));
  }
}
}  // namespace

void CpuFastBackend::AdamW(float* p, const float* g, TypedPtr m, TypedPtr v, int64_t n, float lr,
                           float beta1, float beta2, float eps, float weight_decay, int64_t step,
                           float grad_scale, float* amax_out, uint16_t* p16_out) {
  if (m.bf16()) {
    AdamWRun(p, g, m.h(), v.h(), n, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  } else {
    AdamWRun(p, g, m.f(), v.f(), n, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  }
  if (amax_out != nullptr) AmaxAccumulate(p, n, amax_out);
  if (p16_out != nullptr) PackBf16(p, p16_out, n);
}

}  // namespace fsdp8
