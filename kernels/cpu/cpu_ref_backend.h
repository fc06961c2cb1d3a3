// CpuRefBackend ("cpu-ref"): the reference implementation of Backend (kernels/backend.h) on host
// memory, the oracle the conformance tests hold every other backend to (the fast CPU backend
// "cpu", kernels/cpu/cpu_fast_backend.h, and CUDA).
//
// Plain loops with FP32 accumulation; the matrix products go through OpenBLAS cblas_sgemm so that
// the tiny default model trains at interactive speed on one core:
//   * GemmFp8 decodes both FP8 operands to f32 through the 256-entry tables (kernels/fp8.h). A
//     product of two FP8 values is exact in f32 (at most 4 + 4 significant bits), so the only
//     rounding is the f32 accumulation inside sgemm and the final multiply by
//     (*a_scale_inv) * (*b_scale_inv).
//   * Gemm with GemmInputs::kBF16 rounds copies of A and B to bfloat16 (RNE) and calls sgemm.
//   * The block-scaled ops of the rowwise and blockwise recipes (QuantizeFp8Blocks,
//     GemmFp8Blocks) run as Backend's host composition (kernels/backend.cc: exact products, sums
//     in double, one rounding), which is their reference; this backend has no hook for them.
//   * Casts to FP8 look codes up in a 2 x 65536-entry table per format indexed by the top 16 bits
//     of the scaled f32 and a sticky bit for the low 16 (exact: built with kernels/fp8.h), and
//     transposing casts go through 64 x 64 byte tiles.
//   * Attention works one (batch, head) at a time on two T x T f32 scratch matrices (scores and
//     their gradient), kept in counted scratch slots (Scratch) between calls. The backward recomputes the probabilities
//     from the saved log-sum-exp.
//
// Every op runs synchronously on the calling thread, in a fixed order, so results are
// deterministic run to run (given a deterministic BLAS: the same OpenBLAS build and thread count).
// The backend starts no threads of its own; OpenBLAS's thread count is the caller's business.
//
// Memory: Alloc returns 64-byte aligned host memory and tracks bytes in a size map
// (AllocatedBytes / PeakAllocatedBytes). Host allocation failure aborts (see backend.h, Errors).
//
// Thread-safety: one thread per instance (as Backend). Distinct instances are independent.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/backend.h"

namespace fsdp8 {

class CpuRefBackend : public Backend {
 public:
  // Of the options only cpu_fill_nan applies (fresh allocations read as NaN until written).
  explicit CpuRefBackend(const BackendOptions& options);
  ~CpuRefBackend() override;

  std::string Name() const override { return "cpu-ref"; }

  void* Alloc(size_t bytes) override;
  void Free(void* p) override;
  void CopyToDevice(void* dst, const void* host_src, size_t bytes) override;
  void CopyToHost(void* host_dst, const void* src, size_t bytes) override;
  void Copy(void* dst, const void* src, size_t bytes) override;
  void Memset(void* dst, int value, size_t bytes) override;
  void Synchronize() override {}
  int64_t AllocatedBytes() const override { return allocated_; }
  int64_t PeakAllocatedBytes() const override { return peak_; }
  void ResetPeak() override {
    peak_ = allocated_;
    account_.ResetPeak();
  }

  void TransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) override;
  void DequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                     Fp8Format fmt) override;
  void AmaxAccumulate(const float* in, int64_t n, float* amax_out) override;
  void Fp8ScalesFromAmax(const float* amax, int64_t n, float fp8_max, int margin, float* scale,
                         float* scale_inv, int64_t stride) override;

  void RoundToBf16(float* x, int64_t n) override;
  void PackBf16(const float* in, uint16_t* out, int64_t n) override;
  void UnpackBf16(const uint16_t* in, float* out, int64_t n) override;

  void Add(const float* a, const float* b, float* out, int64_t n) override;
  void Axpy(float alpha, const float* x, float* y, int64_t n) override;

  void EmbeddingForward(const int32_t* tokens, int64_t N, const float* table, int64_t C,
                        float* out) override;
  void EmbeddingBackward(const int32_t* tokens, int64_t N, const float* dout, int64_t C,
                         float* dtable) override;

  void SumSquares(const float* x, int64_t n, float* out) override;

  void AdamW(float* p, const float* g, TypedPtr m, TypedPtr v, int64_t n, float lr, float beta1,
             float beta2, float eps, float weight_decay, int64_t step, float grad_scale,
             float* amax_out, uint16_t* p16_out) override;

 protected:
  // The hooks of the typed ops (backend.h): the f32 combinations through the f32 kernels below,
  // every other one declined (the reference compositions).
  bool TryCastFp8(TypedCPtr in, int64_t rows, int64_t cols, const float* scale, Fp8Format fmt,
                  uint8_t* out, uint8_t* out_t, float* amax_out, int64_t out_ld) override;
  bool TryGemmFp8(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Fp8Operand a,
                  Fp8Operand b, TypedPtr C, bool accumulate, const float* residual) override;
  bool TryGemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, TypedCPtr A,
               TypedCPtr B, float* C, bool accumulate, GemmInputs inputs) override;
  bool TryRmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C, float* y,
                         float* rstd, const Fp8Cast& cast) override;
  bool TryRmsNormBackward(TypedCPtr dy, const float* x, const float* w, const float* rstd,
                          int64_t N, int64_t C, float* dx, float* dw, const float* dres,
                          TypedCPtr dy_b, TypedCPtr dy_c) override;
  bool TryRopeForward(TypedPtr x, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                      int64_t ld) override;
  bool TryRopeBackward(TypedPtr dx, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                       const Fp8Cast& cast) override;
  bool TryAttentionForward(TypedCPtr q, TypedCPtr k, TypedCPtr v, int64_t B, int64_t T, int64_t H,
                           int64_t Hkv, int64_t D, TypedPtr out, float* lse,
                           const AttentionOptions& opts) override;
  bool TryAttentionBackward(TypedCPtr q, TypedCPtr k, TypedCPtr v, TypedCPtr out, TypedCPtr dout,
                            const float* lse, int64_t B, int64_t T, int64_t H, int64_t Hkv,
                            int64_t D, TypedPtr dq, TypedPtr dk, TypedPtr dv,
                            const AttentionOptions& opts) override;
  bool TrySwigluForward(TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols, int64_t in_ld,
                        float* h, const Fp8Cast& cast) override;
  bool TrySwigluBackward(TypedCPtr dh, TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols,
                         int64_t in_ld, TypedPtr dgate, TypedPtr dup, const Fp8Cast& gate_cast,
                         const Fp8Cast& up_cast) override;
  bool TryCrossEntropy(float* logits, const int32_t* targets, int64_t N, int64_t V,
                       float grad_scale, float* losses, TypedPtr dlogits) override;

  // The f32 kernels (dense operands, n = rows * cols elements); the fast CPU backend overrides
  // them. RopeF32 rotates by sign * angle (1: RopeForward, -1: RopeBackward).
  virtual void CastToFp8(const float* in, uint8_t* out, int64_t n, const float* scale,
                         Fp8Format fmt, float* amax_out);
  virtual void CastTransposeFp8(const float* in, int64_t rows, int64_t cols, const float* scale,
                                Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out);
  virtual void GemmF32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                       const float* A, const float* B, float* C, bool accumulate,
                       GemmInputs inputs);
  virtual void RmsNormForwardF32(const float* x, const float* w, float eps, int64_t N, int64_t C,
                                 float* y, float* rstd);
  virtual void RmsNormBackwardF32(const float* dy, const float* x, const float* w,
                                  const float* rstd, int64_t N, int64_t C, float* dx, float* dw);
  virtual void RopeF32(float* x, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                       float sign);
  virtual void AttentionForwardF32(const float* q, const float* k, const float* v, int64_t B,
                                   int64_t T, int64_t H, int64_t Hkv, int64_t D, float* out,
                                   float* lse);
  virtual void AttentionBackwardF32(const float* q, const float* k, const float* v,
                                    const float* out, const float* dout, const float* lse,
                                    int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                    float* dq, float* dk, float* dv);
  virtual void SwigluForwardF32(const float* gate, const float* up, int64_t n, float* h);
  virtual void SwigluBackwardF32(const float* dh, const float* gate, const float* up, int64_t n,
                                 float* dgate, float* dup);
  virtual void CrossEntropyF32(float* logits, const int32_t* targets, int64_t N, int64_t V,
                               float grad_scale, float* losses);
  // The host blocks behind Alloc and Free, of `rounded` bytes (whole 64-byte units, 64-byte
  // aligned): taken from the C allocator and given back to it at once; the fast backend keeps
  // freed blocks for reuse. TakeBlock returns nullptr when the host is out of memory.
  virtual void* TakeBlock(size_t rounded);
  virtual void GiveBlock(void* p, size_t rounded);

 private:
  // The FP8 GEMM in the TN layout (backend.h), f32 C.
  void GemmFp8Tn(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format a_fmt,
                 const float* a_scale_inv, const uint8_t* B, Fp8Format b_fmt,
                 const float* b_scale_inv, float* C, bool accumulate);
  void AdamWF32(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
                float beta2, float eps, float weight_decay, int64_t step, float grad_scale,
                float* amax_out, uint16_t* p16_out);

 protected:
  // BackendOptions::cpu_fill_nan (FSDP8_CPU_FILL_NAN=1, set by the tests): fresh allocations read
  // as NaN (all-ones bytes) until written, as an uninitialised device allocation may hold
  // anything, so that a read before the first write shows in every result. Off by default: it
  // costs CPU training about 15 %.
  bool fill_nan_ = false;
  int64_t limit_ = 0;  // BackendOptions::memory_limit_bytes
  // Growable f32 scratch slot `i` (< kScratchSlots) of at least n elements, reused across calls
  // and kept until the backend goes: 0 and 1 the decoded or rounded GEMM operands, 2 and 3 the
  // attention's T x T scores and their gradient, 4 and 5 the RoPE cos/sin tables. Taken through
  // Alloc, so AllocatedBytes counts them (the memory plan's "workspaces") and the memory limit
  // applies; a std::bad_alloc whose what() names the bytes when Alloc fails (the worker reports
  // RESOURCE_EXHAUSTED with it).
  float* Scratch(int i, int64_t n);
  static constexpr int kScratchSlots = 6;
  // cos/sin tables (T, D/2) for RoPE, rebuilt when (T, D, theta) or the set frequencies change.
  void RopeTables(int64_t T, int64_t D, float theta);

  std::unordered_map<void*, size_t> sizes_;
  int64_t allocated_ = 0;
  int64_t peak_ = 0;
  float* scratch_[kScratchSlots] = {};
  int64_t scratch_n_[kScratchSlots] = {};
  int64_t rope_T_ = -1, rope_D_ = -1;
  float rope_theta_ = 0.0f;
  int64_t rope_version_ = -1;  // rope_freq_version() of the tables
  float* rope_cos_ = nullptr;  // scratch slots 4 and 5
  float* rope_sin_ = nullptr;
};

}  // namespace fsdp8
