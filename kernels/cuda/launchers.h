// Internal to kernels/cuda: the kernel launchers, one group per .cu file. Each enqueues its kernels
// on `stream` and returns immediately; shapes are row-major as in kernels/backend.h. Scratch
// buffers (`partials`, `ws`) are device memory owned by the caller (CudaBackend) with the size
// the matching *ScratchFloats() function returns; launchers never allocate.
//
// Determinism: every launcher chooses its grid from the problem shape and compile-time constants
// only (never from the device's multiprocessor count), and no kernel adds floats with atomics, so
// a launcher gives the same bits for the same inputs on any Hopper GPU.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/backend.h"

namespace fsdp8::cuda {

// ---- cast.cu ---------------------------------------------------------------------------------
// out (n) u8 = fp8(in (n) * *scale); amax_out (1) = max(amax, |in|) when non-null.
void LaunchCastToFp8(const float* in, uint8_t* out, int64_t n, const float* scale, Fp8Format fmt,
                     float* amax_out, cudaStream_t stream);
// in (rows, cols) f32 -> out (rows, cols) u8 (optional), out_t (cols, rows) u8 (optional).
void LaunchCastTransposeFp8(const float* in, int64_t rows, int64_t cols, const float* scale,
                            Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out,
                            cudaStream_t stream);
// The same two casts from bfloat16 bit patterns (f32 values exact; same codes and amax).
void LaunchCastToFp8Bf16(const uint16_t* in, uint8_t* out, int64_t n, const float* scale,
                         Fp8Format fmt, float* amax_out, cudaStream_t stream);
// out_ld: out's row stride in elements (>= cols, a multiple of 4 when out is not null and
// cols % 4 == 0 for the vector stores; otherwise byte stores).
void LaunchCastTransposeFp8Bf16(const uint16_t* in, int64_t rows, int64_t cols, const float* scale,
                                Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out,
                                int64_t out_ld, cudaStream_t stream);
// dgate, dup (rows, cols) of SwiGLU from bf16 dh16, gate16, up16 (the values, rounded to bf16,
// of LaunchSwigluBackwardBf16To16), each cast with its own scale to row-major (optional) and
// transposed (cols, rows) (optional) codes; amax of each into its accumulator when non-null.
// Inputs 8-byte aligned.
void LaunchSwigluBackwardCastTransposeFp8(const uint16_t* dh16, const uint16_t* gate16,
                                          const uint16_t* up16, int64_t rows, int64_t cols,
                                          const float* scale_gate, const float* scale_up,
                                          Fp8Format fmt, uint8_t* dgate8, uint8_t* dgate8_t,
                                          uint8_t* dup8, uint8_t* dup8_t, float* amax_gate,
                                          float* amax_up, int64_t out_ld, int64_t in_ld,
                                          cudaStream_t stream);
// The codes of LaunchSwigluCastFp8 (the same f32 products, bit for bit) written row-major to out
// (dense; may be null) and transposed (cols, rows) to out_t; amax into *amax_out when non-null.
// gate16, up16 8-byte aligned; in_ld % 4 == 0 unless cols % 4 != 0.
void LaunchSwigluCastTransposeFp8(const uint16_t* gate16, const uint16_t* up16, int64_t rows,
                                  int64_t cols, int64_t in_ld, const float* scale, Fp8Format fmt,
                                  uint8_t* out, uint8_t* out_t, float* amax_out,
                                  cudaStream_t stream);
// dx16 (B, T, H, D) bf16 rotated back as LaunchRopeApplyBf16(sign -1) would (not in place: dx16
// is only read), then cast as LaunchCastTransposeFp8Bf16 of the (B * T, H * D) result. table as
// LaunchRopeTable wrote it (16-byte aligned); D % 8 == 0, dx16 8-byte aligned.
void LaunchRopeBackwardCastTransposeFp8Bf16(const uint16_t* dx16, int64_t B, int64_t T,
                                            int64_t H, int64_t D, const float* table,
                                            const float* scale, Fp8Format fmt, uint8_t* out,
                                            uint8_t* out_t, float* amax_out, int64_t out_ld,
                                            cudaStream_t stream);
// out (cols, rows) = in (rows, cols)^T, bytes.
void LaunchTransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out,
                          cudaStream_t stream);
// out (n) f32 = decode(in) * *scale_inv; scale_inv may be null (then 1).
void LaunchDequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                         Fp8Format fmt, cudaStream_t stream);
void LaunchAmaxAccumulate(const float* in, int64_t n, float* amax_out, cudaStream_t stream);
void LaunchFp8ScalesFromAmax(const float* amax, int64_t n, float fp8_max, int margin, float* scale,
                             float* scale_inv, int64_t stride, cudaStream_t stream);
// out[i] = max of in[j] over j with group[j] == group[i] (NaN wins), Backend::GroupMax.
void LaunchGroupMax(const float* in, const int32_t* group, int64_t n, float* out,
                    cudaStream_t stream);
void LaunchRoundToBf16(float* x, int64_t n, cudaStream_t stream);
void LaunchPackBf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream);
void LaunchUnpackBf16(const uint16_t* in, float* out, int64_t n, cudaStream_t stream);
// out (n) bf16 bits = round_bf16(in) (same as PackBf16; used to feed bf16 GEMMs).
// C (n) = alpha_a * alpha_b * tmp (+ C when accumulate), alpha_* device scalars (nullable = 1).
void LaunchScaleAccumulate(const float* tmp, const float* alpha_a, const float* alpha_b, float* C,
                           int64_t n, bool accumulate, cudaStream_t stream);

// ---- elementwise.cu --------------------------------------------------------------------------
void LaunchAdd(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream);
void LaunchAxpy(float alpha, const float* x, float* y, int64_t n, cudaStream_t stream);

// ---- reduce.cu -------------------------------------------------------------------------------
// out[0] += sum x^2, in double, fixed order. partials: SumSquaresScratchDoubles() doubles.
int64_t SumSquaresScratchDoubles();
void LaunchSumSquares(const float* x, int64_t n, float* out, double* partials,
                      cudaStream_t stream);

// ---- norm.cu ---------------------------------------------------------------------------------
void LaunchRmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C, float* y,
                          float* rstd, cudaStream_t stream);
// RMSNorm forward straight to FP8: out (N, C) = fp8(x * r * w * *scale), rstd (N), amax of y.
void LaunchRmsNormCastFp8(const float* x, const float* w, float eps, int64_t N, int64_t C,
                          float* rstd, const float* scale, Fp8Format fmt, uint8_t* out,
                          float* amax_out, cudaStream_t stream);
// partials: RmsNormBackwardScratchFloats(N, C) floats.
int64_t RmsNormBackwardScratchFloats(int64_t N, int64_t C);
// dres (N, C), when non-null, is added to dx (after dx is rounded, as a separate Axpy would).
void LaunchRmsNormBackward(const float* dy, const float* x, const float* w, const float* rstd,
                           int64_t N, int64_t C, float* dx, float* dw, float* partials,
                           cudaStream_t stream, const float* dres = nullptr);
// The same with dy = (dy_a + dy_b) + dy_c summed in f32 from bf16 (N, C) parts (dy_c may be
// null; dy_b and dy_c null: dy_a alone). Returns false, launching nothing, for C above the fused
// kernel's limit (4096) or dy_c without dy_b.
bool LaunchRmsNormBackwardBf16Parts(const uint16_t* dy_a, const uint16_t* dy_b,
                                    const uint16_t* dy_c, const float* x, const float* w,
                                    const float* rstd, int64_t N, int64_t C, float* dx, float* dw,
                                    float* partials, cudaStream_t stream, const float* dres);

// ---- rope.cu ---------------------------------------------------------------------------------
// table (T, D/2, 2) f32: cos and sin of t * theta^(-2i/D), computed in double.
void LaunchRopeTable(int64_t T, int64_t D, float theta, float* table, cudaStream_t stream);
// x (B, T, H, D) rotated in place by +angle (sign = +1) or -angle (sign = -1).
void LaunchRopeApply(float* x, int64_t B, int64_t T, int64_t H, int64_t D, const float* table,
                     float sign, cudaStream_t stream);
// The same on bfloat16 bit patterns: f32 math on the exact values, each result rounded (RNE);
// tokens ld >= H * D elements apart (H * D: dense).
void LaunchRopeApplyBf16(uint16_t* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t ld,
                         const float* table, float sign, cudaStream_t stream);

// ---- swiglu.cu -------------------------------------------------------------------------------
void LaunchSwigluForward(const float* gate, const float* up, int64_t n, float* h,
                         cudaStream_t stream);
void LaunchSwigluBackwardBf16Saved(const float* dh, const uint16_t* gate16, const uint16_t* up16,
                                   int64_t n, float* dgate, float* dup, cudaStream_t stream);
void LaunchSwigluBackward(const float* dh, const float* gate, const float* up, int64_t n,
                          float* dgate, float* dup, cudaStream_t stream);
// SwigluBackwardBf16Saved with dh given as bfloat16 and dgate, dup rounded to bfloat16 (RNE).
void LaunchSwigluBackwardBf16To16(const uint16_t* dh16, const uint16_t* gate16, const uint16_t* up16,
                                  int64_t n, uint16_t* dgate16, uint16_t* dup16,
                                  cudaStream_t stream);
// out (rows, cols) = fp8(silu(gate) * up * *scale) from bfloat16 gate, up (rows, cols) of row
// stride in_ld: the f32 product exactly as LaunchSwigluForward computes it; amax of the products
// into *amax_out when non-null.
void LaunchSwigluCastFp8(const uint16_t* gate16, const uint16_t* up16, int64_t rows,
                         int64_t cols, int64_t in_ld,
                         const float* scale, Fp8Format fmt, uint8_t* out, float* amax_out,
                         cudaStream_t stream);

// ---- embedding.cu ----------------------------------------------------------------------------
void LaunchEmbeddingForward(const int32_t* tokens, int64_t N, const float* table, int64_t C,
                            float* out, cudaStream_t stream);
// V: rows of dtable (the launcher needs it to split the vocabulary between blocks).
void LaunchEmbeddingBackward(const int32_t* tokens, int64_t N, const float* dout, int64_t C,
                             float* dtable, int64_t V, cudaStream_t stream);

// ---- attention.cu (f32 storage) --------------------------------------------------------------
void LaunchAttentionForward(const float* q, const float* k, const float* v, int64_t B, int64_t T,
                            int64_t H, int64_t Hkv, int64_t D, float* out, float* lse,
                            cudaStream_t stream);
// delta: (B, H, T) f32 scratch (rowwise dout . out).
void LaunchAttentionBackward(const float* q, const float* k, const float* v, const float* out,
                             const float* dout, const float* lse, int64_t B, int64_t T, int64_t H,
                             int64_t Hkv, int64_t D, float* dq, float* dk, float* dv,
                             float* delta, cudaStream_t stream);

// ---- cross_entropy.cu ------------------------------------------------------------------------
void LaunchCrossEntropy(float* logits, const int32_t* targets, int64_t N, int64_t V,
                        float grad_scale, float* losses, cudaStream_t stream);
// The same with the gradient written as bf16 to dlogits16 (N, V); logits are only read.
void LaunchCrossEntropyBf16Grad(const float* logits, const int32_t* targets, int64_t N, int64_t V,
                                float grad_scale, float* losses, uint16_t* dlogits16,
                                cudaStream_t stream);

// ---- adamw.cu --------------------------------------------------------------------------------
// decay, w1, w2, step_size, bc2_sqrt: the caller's AdamWHostScalarsFor (kernels/adamw_scalars.h).
// p16_out (n) or null: the updated p as bfloat16 bits (Backend::AdamW).
void LaunchAdamW(float* p, const float* g, float* m, float* v, int64_t n, float decay,
                 float beta2, float w1, float w2, float step_size, float bc2_sqrt, float eps,
                 float grad_scale, float* amax_out, uint16_t* p16_out, cudaStream_t stream);
// The same with the moments stored as bfloat16 (Backend::AdamW with bf16 moments).
void LaunchAdamWBf16Moments(float* p, const float* g, uint16_t* m16, uint16_t* v16, int64_t n,
                            float decay, float beta2, float w1, float w2, float step_size,
                            float bc2_sqrt, float eps, float grad_scale, float* amax_out,
                            uint16_t* p16_out, cudaStream_t stream);

// ---- block_fp8.cu ----------------------------------------------------------------------------
// Backend::QuantizeFp8Blocks on the device (its contract: codes and scale_inv of `blocks`, the
// transpose's when out_t; bit-identical to the host reference). Uses scale_inv / scale_inv_t as
// the amax accumulators while it runs.
void LaunchQuantizeFp8Blocks(TypedCPtr in, int64_t rows, int64_t cols, Fp8Blocks blocks,
                             Fp8Format fmt, uint8_t* out, float* scale_inv, uint8_t* out_t,
                             float* scale_inv_t, cudaStream_t stream);
// out[o * stride_outer + i * stride_inner] = in[o * inner + i] for o < outer, i < inner: a scale
// matrix (outer, inner) row-major rewritten in another layout (transposed, or with padded rows).
void LaunchCopyScales(const float* in, int64_t outer, int64_t inner, float* out,
                      int64_t stride_outer, int64_t stride_inner, cudaStream_t stream);

}  // namespace fsdp8::cuda
