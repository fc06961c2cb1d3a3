// Internal to kernels/cuda: cuBLASLt matrix multiplies with a per-shape cache of descriptors,
// layouts and the heuristic's chosen algorithm (Backend: GemmFp8, Gemm).
//
// Row-major to column-major: cuBLASLt is column-major, and a row-major X (r, c) is the
// column-major X^T (c, r) with leading dimension c. The row-major product C (M, N) is therefore
// computed as the column-major C^T (N, M) = op(B)^T · op(A)^T, i.e. cuBLASLt's "A" operand is our
// B and its "B" operand is our A, with m = N, n = M, k = K. For the FP8 TN case (our A (M, K), B
// (N, K), both contiguous along K): cuBLASLt A = our B stored (K, N) ld K with TRANSA = T, and
// cuBLASLt B = our A stored (K, M) ld K with TRANSB = N; D = C stored (N, M) ld N, f32. The
// scales: CUBLASLT_MATMUL_DESC_A_SCALE_POINTER <- our b_scale_inv, B_SCALE_POINTER <- our
// a_scale_inv; D = (scaleA · scaleB) · A·B + beta · C with beta = 1 when accumulating.
//
// Accumulation is FP32 (CUBLAS_COMPUTE_32F: no TF32), and FP8 products promote partial sums to
// FP32 every few K blocks unless the problem asks for fast accumulation. Split-K schemes
// that reduce in place with atomics are excluded (CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK), and
// a cached algorithm is reused for a given key, so results are deterministic run to run. With
// autotuning on (set_autotune), the algorithm of a key is the fastest candidate timed on its first
// call instead; that choice can differ between runs.
//
// Thread-safety: one instance per stream, used by one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>
#include <tuple>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

namespace fsdp8::cuda {

// Checks a cuBLASLt status; aborts with the call and file:line on failure.
void CheckCublas(cublasStatus_t s, const char* what, const char* file, int line);
#define FSDP8_CUBLAS_CHECK(expr) ::fsdp8::cuda::CheckCublas((expr), #expr, __FILE__, __LINE__)

struct LtProblem {
  // cuBLASLt's view (column-major): D (m, n) = op(A) (m, k) · op(B) (k, n).
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;  // cuBLASLt ops on its A and B
  cudaDataType_t a_type = CUDA_R_32F, b_type = CUDA_R_32F;
  cudaDataType_t c_type = CUDA_R_32F;  // C and D: CUDA_R_32F, or CUDA_R_16BF (FP8 inputs only)
  int64_t lda = 0, ldb = 0, ldc = 0;
  bool scaled = false;     // FP8: A/B scale pointers are set
  // FP8 scale modes of A and B (cublasLtMatmulMatrixScale_t; 0 = one f32 scalar each). The
  // vector and block modes (OUTER_VEC_32F, VEC128_32F, BLK128x128_32F) take the caller's scale
  // tensors as they are, in cuBLASLt's layouts (CudaBackend::TryGemmFp8Blocks).
  int scale_mode_a = 0, scale_mode_b = 0;
  bool accumulate = false; // beta = 1 (else 0)
  bool fast_accum = false; // FP8: CUBLASLT_MATMUL_DESC_FAST_ACCUM (no periodic FP32 promotion)
  int align_a = 256, align_b = 256, align_c = 256;  // pointer alignments (bytes, power of 2)

  auto Key() const {
    return std::make_tuple(m, n, k, trans_a, trans_b, static_cast<int>(a_type),
                           static_cast<int>(b_type), static_cast<int>(c_type), lda, ldb, ldc,
                           scaled, accumulate, fast_accum, align_a, align_b, align_c,
                           scale_mode_a, scale_mode_b);
  }
};

// Largest power of two (<= 256) dividing the address.
int PointerAlignment(const void* p);

class LtGemm {
 public:
  // workspace: device memory of ws_bytes, used only on `stream`.
  LtGemm(cudaStream_t stream, void* workspace, size_t ws_bytes);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Enqueues D = (scale_a · scale_b) op(A)·op(B) + beta C (C == D in place). scale_a / scale_b
  // are device scalars (only when p.scaled). Returns false, enqueuing nothing, when cuBLASLt
  // has no algorithm for the problem (e.g. FP8 with K or a leading dimension not a multiple of
  // 16); the caller then takes a fallback path. The outcome is cached per problem key.
  // c_in (optional, with p.accumulate): read C from c_in instead of D (D = ... + c_in).
  bool Run(const LtProblem& p, const void* A, const void* B, void* C, const float* scale_a,
           const float* scale_b, const void* c_in = nullptr);

  // Autotuning: while on, a problem's first Run times each heuristic candidate (kTuneReps calls
  // after one warm-up, on the real A and B with a scratch D taken from `alloc`, beta as the
  // problem's; the median of kTuneRounds rounds) and uses the fastest from then on; candidate 0
  // is kept unless another is more than kTuneMinGain faster. The tuning call first waits for the
  // whole device (cudaDeviceSynchronize: collectives on other streams included), so that the
  // candidates are timed alone. Choices are kept for the process, per device and problem key:
  // later instances (the next job's backend) take the same candidate without timing again. When `alloc` returns nullptr the heuristic's order is kept for
  // that problem. Tuned choices persist across set_autotune(false)/(true).
  void set_autotune(bool on) { autotune_ = on; }
  // On: each problem's algorithm choice, refused candidates and tuning times go to stderr.
  void set_verbose(bool on) { verbose_ = on; }
  void set_scratch_allocator(std::function<void*(size_t)> alloc, std::function<void(void*)> free) {
    alloc_ = std::move(alloc);
    free_ = std::move(free);
  }
  static constexpr int kTuneReps = 5;
  static constexpr int kTuneRounds = 3;
  static constexpr double kTuneMinGain = 0.03;

 private:
  struct Entry {
    bool ok = false;
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    // Heuristic candidates, best first; `next` is the one in use. cuBLASLt's heuristic can
    // propose an algorithm that cublasLtMatmul then refuses (CUBLAS_STATUS_NOT_SUPPORTED, seen
    // on H200 with cuBLASLt 13.1 for FP8 -> f32): the next candidate is tried, and the outcome
    // is cached.
    std::vector<cublasLtMatmulAlgo_t> algos;
    size_t next = 0;
    bool tuned = false;  // autotuning ran for this key
    int best = -1;       // index in algos of the tuned choice (-1: none)
  };
  Entry* Lookup(const LtProblem& p);
  // Times e's candidates for p (see set_autotune) and sets e.tuned / e.best.
  void Tune(Entry& e, const LtProblem& p, const void* A, const void* B);

  cudaStream_t stream_;
  void* workspace_;
  size_t ws_bytes_;
  cublasLtHandle_t handle_ = nullptr;
  static constexpr size_t kScaleSlotBytes = 256;
  void* scale_slots_ = nullptr;  // two aligned device scalars for misaligned scale pointers
  std::map<decltype(LtProblem().Key()), Entry> cache_;
  bool autotune_ = false;
  bool verbose_ = false;
  std::function<void*(size_t)> alloc_;
  std::function<void(void*)> free_;
  cudaEvent_t ev_[2] = {nullptr, nullptr};  // tuning timers
};

}  // namespace fsdp8::cuda
