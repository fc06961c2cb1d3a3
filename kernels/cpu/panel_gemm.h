// PanelGemm: a register-tiled f32 GEMM on a panel of at most kPanelRows rows, for the fast CPU
// backend's attention (kernels/cpu/cpu_fast_backend.cc). There the products are small (K = the
// head dim, or N = the head dim) and causal (each query row needs only the keys up to itself), so
// a library GEMM's per-call packing costs more than the arithmetic, and square blocks waste the
// masked half of the diagonal blocks; a panel of a few rows needs no packing and ends each row's
// work at its own causal bound.
//
// x86-64 only (AVX2 + FMA); callers check CpuFastBackend::Supported() first.
#pragma once

#include <cstdint>

namespace fsdp8 {

// The most rows PanelGemm takes: 6 rows x 16 columns of accumulators fill 12 of the 16 AVX2
// registers.
constexpr int kPanelRows = 6;

// C (rows, N) = alpha * A (rows, K) * B (K, N), or C += that when accumulate.
//   A(m, k) = a[m * a_row_stride + k * a_col_stride]: row major (a_col_stride 1) or the transpose
//             of a row-major matrix (a_row_stride 1) without a copy.
//   B(k, n) = b[k * ldb + n] (row major; n contiguous).
//   C(m, n) = c[m * ldc + n].
// Shapes: 1 <= rows <= kPanelRows, N >= 1 (any width: the last 8 columns are masked), K >= 0
// (K = 0 gives C = 0, or leaves C when accumulate). All f32. Each C element is one fused
// multiply-add chain over k = 0, 1, ..., K-1 in that order, then times alpha (then plus the old C):
// deterministic, and independent of the other rows and columns. Reads only the A, B and C elements
// named above. Thread-safe (no state).
void PanelGemm(int rows, int64_t N, int64_t K, float alpha, const float* a, int64_t a_row_stride,
               int64_t a_col_stride, const float* b, int64_t ldb, float* c, int64_t ldc,
               bool accumulate);

}  // namespace fsdp8
