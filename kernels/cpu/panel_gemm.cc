#include "kernels/cpu/panel_gemm.h"

#include <immintrin.h>

#include "common/check.h"

// AVX2 + FMA (x86-64-v3) for this file's functions; see the header.
#pragma GCC target("avx2,fma")

namespace fsdp8 {
namespace {

// Lanes [0, r) on, the rest off (r in [1, 8]).
inline __m256i Mask(int64_t r) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(r)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// One tile: MR rows x NV vectors of 8 columns; with kTail the last vector's lanes outside `tail`
// are neither read from B nor written to C.
template <int MR, int NV, bool kTail>
void Tile(int64_t K, float alpha, const float* a, int64_t ars, int64_t acs, const float* b,
          int64_t ldb, float* c, int64_t ldc, bool accumulate, __m256i tail) {
  __m256 acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    __m256 bv[NV];
    for (int v = 0; v < NV; ++v) {
      bv[v] = (kTail && v == NV - 1) ? _mm256_maskload_ps(bk + 8 * v, tail)
                                     : _mm256_loadu_ps(bk + 8 * v);
    }
    const float* ak = a + k * acs;
    for (int r = 0; r < MR; ++r) {
      const __m256 av = _mm256_broadcast_ss(ak + r * ars);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  const __m256 al = _mm256_set1_ps(alpha);
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NV; ++v) {
      float* cp = c + r * ldc + 8 * v;
      __m256 x = _mm256_mul_ps(acc[r][v], al);
      if (kTail && v == NV - 1) {
        if (accumulate) x = _mm256_add_ps(x, _mm256_maskload_ps(cp, tail));
        _mm256_maskstore_ps(cp, tail, x);
      } else {
        if (accumulate) x = _mm256_add_ps(x, _mm256_loadu_ps(cp));
        _mm256_storeu_ps(cp, x);
      }
    }
  }
}

// All of C's columns for MR rows, 16 at a time, then the remainder (8 + a masked vector, or one
// masked vector).
template <int MR>
void Rows(int64_t N, int64_t K, float alpha, const float* a, int64_t ars, int64_t acs,
          const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  const __m256i none = _mm256_setzero_si256();
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) {
    Tile<MR, 2, false>(K, alpha, a, ars, acs, b + n, ldb, c + n, ldc, accumulate, none);
  }
  const int64_t rest = N - n;
  if (rest > 8) {
    Tile<MR, 2, true>(K, alpha, a, ars, acs, b + n, ldb, c + n, ldc, accumulate, Mask(rest - 8));
  } else if (rest == 8) {
    Tile<MR, 1, false>(K, alpha, a, ars, acs, b + n, ldb, c + n, ldc, accumulate, none);
  } else if (rest > 0) {
    Tile<MR, 1, true>(K, alpha, a, ars, acs, b + n, ldb, c + n, ldc, accumulate, Mask(rest));
  }
}

}  // namespace

void PanelGemm(int rows, int64_t N, int64_t K, float alpha, const float* a, int64_t a_row_stride,
               int64_t a_col_stride, const float* b, int64_t ldb, float* c, int64_t ldc,
               bool accumulate) {
  FSDP8_CHECK(rows >= 1 && rows <= kPanelRows && N >= 1 && K >= 0)
      << "PanelGemm: rows " << rows << ", N " << N << ", K " << K;
  switch (rows) {
    case 1: return Rows<1>(N, K, alpha, a, a_row_stride, a_col_stride, b, ldb, c, ldc, accumulate);
    case 2: return Rows<2>(N, K, alpha, a, a_row_stride, a_col_stride, b, ldb, c, ldc, accumulate);
    case 3: return Rows<3>(N, K, alpha, a, a_row_stride, a_col_stride, b, ldb, c, ldc, accumulate);
    case 4: return Rows<4>(N, K, alpha, a, a_row_stride, a_col_stride, b, ldb, c, ldc, accumulate);
    case 5: return Rows<5>(N, K, alpha, a, a_row_stride, a_col_stride, b, ldb, c, ldc, accumulate);
    default: return Rows<6>(N, K, alpha, a, a_row_stride, a_col_stride, b, ldb, c, ldc, accumulate);
  }
}

}  // namespace fsdp8
