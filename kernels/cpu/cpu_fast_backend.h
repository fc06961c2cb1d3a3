// CpuFastBackend ("cpu"): the CPU backend workers train with. Same contracts and results as the
// reference CpuRefBackend (kernels/cpu/cpu_ref_backend.h) within the conformance tolerances
// (tests/conformance: bit for bit where the reference is exact), faster:
//   * Alloc/Free keep freed blocks by size for reuse (no page faults and zeroing of fresh pages
//     per op); up to kMaxCachedBytes are kept.
//   * The elementwise, norm, RoPE, SwiGLU, softmax and optimizer loops are written for the
//     compiler's vectorizer (AVX2 + FMA on x86-64), with a polynomial exp (Cephes expf, about
//     1 ulp on [-87, 88]) instead of libm's scalar expf.
//   * FP8 casts encode 8 values at a time with integer arithmetic (round to nearest even on the
//     bits, float addition of a magic constant for subnormals; bit-exact with kernels/fp8.h),
//     with the amax taken in the same pass; RMSNorm + cast runs in one pass per row.
//   * The linears' GEMMs (FP8 ones after decoding the codes to f32, 16 at a time through the
//     half-precision converter F16C: exact) through oneDNN's sgemm instead of the reference's
//     OpenBLAS: JIT kernels picked by the CPU's instruction sets (AVX2, AVX-512). GemmFp8
//     takes every layout as it is (Fp8GemmAnyLayout), so the FP8 linears' backward makes no
//     transposed copies of codes.
//   * bfloat16 rounding and packing 8 or 16 values at a time on the bits; the SwiGLU backward
//     reads its bf16-saved inputs directly (no f32 copies).
//   * Attention works as the reference does (row blocks of the causal T x T scores), its GEMMs
//     through oneDNN's sgemm too, with the vectorized softmax. No op of a training step goes
//     through OpenBLAS, whose kernel choice depends on its table of CPU models.
// On an x86-64 CPU without AVX2, FMA and F16C, CreateBackend("cpu") returns the reference instead.
//
// Deterministic: a fixed order of operations for given shapes and thread count. The backend starts
// no threads of its own; its GEMMs use as many OpenMP threads as the process's OpenBLAS thread
// count (openblas_set_num_threads, the caller's business, as for the reference), one by default.
//
// Thread-safety: one thread per instance (as Backend). Distinct instances are independent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/cpu_ref_backend.h"

namespace fsdp8 {

class CpuFastBackend final : public CpuRefBackend {
 public:
  // Whether this CPU can run it (AVX2, FMA and F16C on x86-64; always elsewhere).
  static bool Supported();

  explicit CpuFastBackend(const BackendOptions& options);
  ~CpuFastBackend() override;

  std::string Name() const override { return "cpu"; }

  void TransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) override;
  void DequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                     Fp8Format fmt) override;
  void AmaxAccumulate(const float* in, int64_t n, float* amax_out) override;

  void RoundToBf16(float* x, int64_t n) override;
  void PackBf16(const float* in, uint16_t* out, int64_t n) override;
  void UnpackBf16(const uint16_t* in, float* out, int64_t n) override;

  void Add(const float* a, const float* b, float* out, int64_t n) override;
  void Axpy(float alpha, const float* x, float* y, int64_t n) override;

  void AdamW(float* p, const float* g, TypedPtr m, TypedPtr v, int64_t n, float lr, float beta1,
             float beta2, float eps, float weight_decay, int64_t step, float grad_scale,
             float* amax_out, uint16_t* p16_out) override;

 protected:
  // Freed blocks are kept by size for reuse, up to kMaxCachedBytes in all.
  void* TakeBlock(size_t rounded) override;
  void GiveBlock(void* p, size_t rounded) override;
  // The reference's hooks (cpu_ref_backend.h) run every layout of GemmFp8, RMSNorm + FP8 cast in
  // one pass and the SwiGLU backward on bf16-saved inputs with f32 gradients; the f32 kernels are
  // this backend's.
  bool TryGemmFp8(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Fp8Operand a,
                  Fp8Operand b, TypedPtr C, bool accumulate, const float* residual) override;
  bool TryRmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C, float* y,
                         float* rstd, const Fp8Cast& cast) override;
  // The block-scaled GEMM: each operand decoded and multiplied by its scales into f32 (one
  // rounding per element), then one sgemm. The block-scaled casts are declined: they run as the
  // host composition (backend.cc), bit for bit the reference's.
  bool TryGemmFp8Blocks(int64_t M, int64_t N, int64_t K, Fp8BlockOperand a, Fp8BlockOperand b,
                        float* C, bool accumulate) override;
  bool TrySwigluBackward(TypedCPtr dh, TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols,
                         int64_t in_ld, TypedPtr dgate, TypedPtr dup, const Fp8Cast& gate_cast,
                         const Fp8Cast& up_cast) override;
  void CastToFp8(const float* in, uint8_t* out, int64_t n, const float* scale, Fp8Format fmt,
                 float* amax_out) override;
  void CastTransposeFp8(const float* in, int64_t rows, int64_t cols, const float* scale,
                        Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out) override;
  void GemmF32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
               const float* B, float* C, bool accumulate, GemmInputs inputs) override;
  void RmsNormForwardF32(const float* x, const float* w, float eps, int64_t N, int64_t C, float* y,
                         float* rstd) override;
  void RmsNormBackwardF32(const float* dy, const float* x, const float* w, const float* rstd,
                          int64_t N, int64_t C, float* dx, float* dw) override;
  void RopeF32(float* x, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
               float sign) override;
  void AttentionForwardF32(const float* q, const float* k, const float* v, int64_t B, int64_t T,
                           int64_t H, int64_t Hkv, int64_t D, float* out, float* lse) override;
  void AttentionBackwardF32(const float* q, const float* k, const float* v, const float* out,
                            const float* dout, const float* lse, int64_t B, int64_t T, int64_t H,
                            int64_t Hkv, int64_t D, float* dq, float* dk, float* dv) override;
  void SwigluForwardF32(const float* gate, const float* up, int64_t n, float* h) override;
  void SwigluBackwardF32(const float* dh, const float* gate, const float* up, int64_t n,
                         float* dgate, float* dup) override;
  void CrossEntropyF32(float* logits, const int32_t* targets, int64_t N, int64_t V,
                       float grad_scale, float* losses) override;

 private:
  static constexpr size_t kMaxCachedBytes = size_t{1} << 30;
  // Freed blocks by rounded size, reused by Alloc; cached_ bytes in total.
  std::unordered_map<size_t, std::vector<void*>> free_;
  size_t cached_ = 0;
};

}  // namespace fsdp8
