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

  void* Alloc(size_t bytes) override;
  void Free(void* p) override;

  void TransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) override;
  void DequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                     Fp8Format fmt) override;
  void AmaxAccumulate(const float* in, int64_t n, float* amax_out) override;

  void RoundToBf16(float* x, int64_t n) override;
  void PackBf16(const float* in, uint16_t* out, int64_t n) override;
  void UnpackBf16(const uint16_t* in, float* out, int64_t n) override;

  void Add(const float* a, const float* b, float* out, int64_t n) override;
  void Axpy(float alpha, const float* x, float* y, int64_t n) override;

  // ---- the ops, each dispatching its variants (backend.h) ----
  void CastFp8(TypedCPtr in, int64_t rows, int64_t cols, const float* scale, Fp8Format fmt,
               uint8_t* out, uint8_t* out_t = nullptr, float* amax_out = nullptr,
               int64_t out_ld = 0) override;
  void GemmFp8(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Fp8Operand a,
               Fp8Operand b, TypedPtr C, bool accumulate, const float* residual = nullptr) override;
  void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, TypedCPtr A, TypedCPtr B,
            float* C, bool accumulate, GemmInputs inputs) override;
  void RmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C, float* y,
                      float* rstd, const Fp8Cast& cast = {}) override;
  void RmsNormBackward(TypedCPtr dy, const float* x, const float* w, const float* rstd, int64_t N,
                       int64_t C, float* dx, float* dw, const float* dres = nullptr,
                       TypedCPtr dy_b = nullptr, TypedCPtr dy_c = nullptr) override;
  void RopeForward(TypedPtr x, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                   int64_t ld = 0) override;
  void RopeBackward(TypedPtr dx, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                    const Fp8Cast& cast = {}) override;
  void AttentionForward(TypedCPtr q, TypedCPtr k, TypedCPtr v, int64_t B, int64_t T, int64_t H,
                        int64_t Hkv, int64_t D, TypedPtr out, float* lse,
                        const AttentionOptions& opts = {}) override;
  void AttentionBackward(TypedCPtr q, TypedCPtr k, TypedCPtr v, TypedCPtr out, TypedCPtr dout,
                         const float* lse, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                         TypedPtr dq, TypedPtr dk, TypedPtr dv,
                         const AttentionOptions& opts = {}) override;
  void SwigluForward(TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols, int64_t in_ld,
                     float* h, const Fp8Cast& cast = {}) override;
  void SwigluBackward(TypedCPtr dh, TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols,
                      int64_t in_ld, TypedPtr dgate, TypedPtr dup, const Fp8Cast& gate_cast = {},
                      const Fp8Cast& up_cast = {}) override;
  void CrossEntropyForwardBackward(float* logits, const int32_t* targets, int64_t N, int64_t V,
                                   float grad_scale, float* losses,
                                   TypedPtr dlogits = nullptr) override;
  void AdamW(float* p, const float* g, TypedPtr m, TypedPtr v, int64_t n, float lr, float beta1,
             float beta2, float eps, float weight_decay, int64_t step, float grad_scale,
             float* amax_out, uint16_t* p16_out) override;

 private:
  // The variants the ops above dispatch to.
  void CastToFp8(const float* in, uint8_t* out, int64_t n, const float* scale, Fp8Format fmt,
                 float* amax_out);
  void CastTransposeFp8(const float* in, int64_t rows, int64_t cols, const float* scale,
                        Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out);
  void GemmFp8(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format a_fmt,
               const float* a_scale_inv, const uint8_t* B, Fp8Format b_fmt,
               const float* b_scale_inv, float* C, bool accumulate);
  void GemmFp8Layout(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const uint8_t* A,
                     Fp8Format a_fmt, const float* a_scale_inv, const uint8_t* B, Fp8Format b_fmt,
                     const float* b_scale_inv, float* C, bool accumulate);
  void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
            const float* B, float* C, bool accumulate, GemmInputs inputs);
  void RmsNormForwardF32(const float* x, const float* w, float eps, int64_t N, int64_t C, float* y,
                         float* rstd);
  void RmsNormBackward(const float* dy, const float* x, const float* w, const float* rstd,
                       int64_t N, int64_t C, float* dx, float* dw);
  void RmsNormCastFp8(const float* x, const float* w, float eps, int64_t N, int64_t C, float* rstd,
                      const float* scale, Fp8Format fmt, uint8_t* out, float* amax_out);
  void RopeForward(float* x, int64_t B, int64_t T, int64_t H, int64_t D, float theta);
  void RopeBackward(float* dx, int64_t B, int64_t T, int64_t H, int64_t D, float theta);
  void AttentionForward(const float* q, const float* k, const float* v, int64_t B, int64_t T,
                        int64_t H, int64_t Hkv, int64_t D, float* out, float* lse);
  void AttentionBackward(const float* q, const float* k, const float* v, const float* out,
                         const float* dout, const float* lse, int64_t B, int64_t T, int64_t H,
                         int64_t Hkv, int64_t D, float* dq, float* dk, float* dv);
  void SwigluForward(const float* gate, const float* up, int64_t n, float* h);
  void SwigluBackward(const float* dh, const float* gate, const float* up, int64_t n, float* dgate,
                      float* dup);
  void SwigluBackwardBf16Saved(const float* dh, const uint16_t* gate16, const uint16_t* up16,
                               int64_t n, float* dgate, float* dup);
  void CrossEntropyF32(float* logits, const int32_t* targets, int64_t N, int64_t V,
                       float grad_scale, float* losses);
  void AdamW(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
             float beta2, float eps, float weight_decay, int64_t step, float grad_scale,
             float* amax_out, uint16_t* p16_out);
  void AdamWBf16Moments(float* p, const float* g, uint16_t* m16, uint16_t* v16, int64_t n, float lr,
                        float beta1, float beta2, float eps, float weight_decay, int64_t step,
                        float grad_scale, float* amax_out, uint16_t* p16_out);

 private:
  static constexpr size_t kMaxCachedBytes = size_t{1} << 30;
  // Freed blocks by rounded size, reused by Alloc; cached_ bytes in total.
  std::unordered_map<size_t, std::vector<void*>> free_;
  std::unordered_map<void*, size_t> rounded_;  // live and cached blocks: their rounded size
  size_t cached_ = 0;
};

}  // namespace fsdp8
