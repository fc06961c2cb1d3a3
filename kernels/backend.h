// Backend: the compute a worker's rank needs, behind one interface with a CPU reference
// (kernels/cpu/cpu_ref_backend.h, "cpu-ref"), a fast CPU implementation
// (kernels/cpu/cpu_fast_backend.h, "cpu") and a CUDA implementation (kernels/cuda).
//
// All pointers are *device* pointers of this backend (host memory for the CPU backend), obtained
// from Alloc(). Shapes are given as row-major dimensions in comments, e.g. x (M, K) means M rows of
// K contiguous elements. FP8 buffers hold one OCP FP8 code per byte (kernels/fp8.h). "f32" is IEEE
// float32; activations and gradients are f32 in memory on every backend, except where an op takes
// or gives bfloat16 bit patterns (uint16_t; the "bfloat16 activations" ops below).
//
// Names: "Bf16" in an op's name means bfloat16 storage (uint16_t bit patterns, parameters named
// *16) of the operands it names; every other operand is f32.
//   ...Bf16, ...Bf16Packed   the activations in and out (RopeForwardBf16, CastToFp8Bf16,
//                            AttentionForwardBf16Packed; GemmBf16: A and B; GemmFp8Bf16: C).
//   ...Bf16Saved             the saved forward activations it reads (dout and the results f32).
//   ...To16                  the gradient in and the results bf16 as well (lse stays f32).
//   ...Bf16Parts, ...Bf16Grad  the named operand (the dy parts; the gradient written).
//   ...Bf16Compute           no bf16 storage: f32 in and out, rounded to bf16 values where the
//                            bf16 recipe rounds (inputs, outputs), as a bf16 kernel computes.
//   RoundToBf16              rounds f32 values in place; PackBf16 / UnpackBf16 convert storage.
//
// Ops are enqueued on the backend's compute stream in call order; host-visible results (CopyToHost,
// the float returned by ReduceMax etc. are *not* returned: they land in device buffers) are ready
// after Synchronize(). The CPU backend runs everything synchronously.
//
// Thread-safety: a Backend is used by one thread (the rank's trainer thread).
//
// Errors: programming errors (null pointers, shape mismatch) abort with file:line (FSDP8_CHECK,
// common/check.h). Alloc returns nullptr when the memory is exhausted (device memory; host memory
// for the CPU backend) or when the allocation would take AllocatedBytes() above
// BackendOptions::memory_limit_bytes; the caller reports RESOURCE_EXHAUSTED (train/device_buffer.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp8 {

enum class Fp8Format : uint8_t {
  kE4M3 = 0,  // max 448, no infinities (OCP FP8 spec v1.0, table 1)
  kE5M2 = 1,  // max 57344, IEEE-style inf/NaN
};

// How a non-FP8 GEMM rounds its inputs before multiplying (accumulation is always FP32).
enum class GemmInputs : uint8_t {
  kF32 = 0,
  kBF16 = 1,  // inputs rounded to bfloat16 (round to nearest even) first
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string Name() const = 0;  // "cpu", "cpu-ref" or "cuda"

  // ---- memory -------------------------------------------------------------------------------
  // Bytes on this backend's device; returns nullptr when exhausted. Contents are undefined (the
  // CPU backend fills them with NaN bytes under BackendOptions::cpu_fill_nan, as the tests run it).
  virtual void* Alloc(size_t bytes) = 0;
  virtual void Free(void* p) = 0;
  virtual void CopyToDevice(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;  // synchronizes
  virtual void Copy(void* dst, const void* src, size_t bytes) = 0;            // device to device
  virtual void Memset(void* dst, int value, size_t bytes) = 0;
  virtual void Synchronize() = 0;
  // Bytes currently allocated through Alloc (plus the backend's own workspaces: CUDA's, and the
  // CPU backends' kept scratch slots) and the high-water mark since the last reset.
  virtual int64_t AllocatedBytes() const = 0;
  virtual int64_t PeakAllocatedBytes() const = 0;
  virtual void ResetPeak() = 0;

  // ---- FP8 --------------------------------------------------------------------------------------
  // out[i] = fp8(in[i] * (*scale)), round to nearest even, saturating to ±max of `fmt`.
  // *amax_out = max(*amax_out, max_i |in[i]|) (NaN-propagating) when amax_out != nullptr: the
  // caller zeroes it once per step so that microbatches accumulate (C03).
  // in (n) f32, out (n) u8, scale (1) f32 device scalar, amax_out (1) f32 device scalar.
  virtual void CastToFp8(const float* in, uint8_t* out, int64_t n, const float* scale, Fp8Format fmt,
                         float* amax_out) = 0;
  // Fused cast + transpose (+ amax): out_t (cols, rows) = fp8(in (rows, cols) * scale)^T, and
  // optionally out (rows, cols) non-transposed in the same pass (nullptr to skip).
  virtual void CastTransposeFp8(const float* in, int64_t rows, int64_t cols, const float* scale,
                                Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out) = 0;
  // out (cols, rows) = in (rows, cols)^T for one-byte elements (FP8 codes keep their scale).
  virtual void TransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) = 0;
  // out[i] = decode(in[i]) * (*scale_inv).
  virtual void DequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                             Fp8Format fmt) = 0;
  // *amax_out = max(*amax_out, max_i |in[i]|). in (n) f32; n may be 0.
  virtual void AmaxAccumulate(const float* in, int64_t n, float* amax_out) = 0;
  // Current-scaling FP8 scales from amaxes, on the device (no host round trip), for i < n:
  //   scale[i*stride] = fp8_max / amax[i] / 2^margin, computed in double, clamped to
  //   [2^-126, FLT_MAX], rounded once to f32 (common/scaling.h ComputeScale: the same bits);
  //   an amax[i] that is 0, negative, inf or NaN keeps the previous scale[i*stride] (1 when that
  //   is not finite and positive); scale_inv[i*stride] = 1 / scale (f32 division, nearest).
  // amax (n) f32; scale (in/out), scale_inv (out): n slots of `stride` floats; margin >= 0.
  virtual void Fp8ScalesFromAmax(const float* amax, int64_t n, float fp8_max, int margin,
                                 float* scale, float* scale_inv, int64_t stride) = 0;
  // Scaling groups, on the device: out[i] = the maximum of in[j] over every j < n with
  // group[j] == group[i], NaN when any of them is NaN (a NaN amax stays unusable for
  // Fp8ScalesFromAmax). Tensors that must share one FP8 scale (the q/k/v or gate/up weights of a
  // fused projection, as TransformerEngine's fused QKV weight has one) get their scale from this
  // group amax. in, out (n) f32, distinct buffers; group (n) int32. The base implementation goes
  // through the host; a backend may run it on the device.
  virtual void GroupMax(const float* in, const int32_t* group, int64_t n, float* out);

  // C (M, N) = alpha_dev * A (M, K) · B (N, K)^T  [+ C if accumulate], where
  // alpha_dev = (*a_scale_inv) * (*b_scale_inv): the "TN" layout Hopper FP8 GEMMs require.
  // A and B hold FP8 codes of formats a_fmt / b_fmt; products and sums are exact-FP32 emulated on
  // the CPU (cuBLASLt on CUDA). C is f32. On CUDA, scale pointers that are not 16-byte aligned
  // cost one extra device copy each (cuBLASLt only takes 16-byte-aligned FP8 scale pointers).
  virtual void GemmFp8(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format a_fmt,
                       const float* a_scale_inv, const uint8_t* B, Fp8Format b_fmt,
                       const float* b_scale_inv, float* C, bool accumulate) = 0;
  // GemmFp8 with the operands in either layout: C (M, N) = alpha_dev * op(A) · op(B) [+ C if
  // accumulate], op(A) (M, K) = A (M, K), or A (K, M) transposed when trans_a; op(B) (K, N) =
  // B (N, K) transposed when trans_b (GemmFp8's layout), else B (K, N). The base implementation
  // transposes the codes into GemmFp8's layout (TransposeBytes into scratch buffers; std::bad_alloc
  // when those do not fit); a backend whose GEMM takes every layout as it is overrides it and says
  // so through Fp8GemmAnyLayout.
  virtual void GemmFp8Layout(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                             const uint8_t* A, Fp8Format a_fmt, const float* a_scale_inv,
                             const uint8_t* B, Fp8Format b_fmt, const float* b_scale_inv, float* C,
                             bool accumulate);
  // True when GemmFp8Layout makes no transposed copies for any layout (the CPU backend, whose GEMM
  // decodes the codes for an f32 BLAS): the FP8 linears' backward then casts the grad-output once,
  // without its transpose, and leaves the inputs untransposed (train/fp8_linear.h).
  virtual bool Fp8GemmAnyLayout() const { return false; }
  // While on, the FP8 GEMMs (GemmFp8, GemmFp8AddResidual, GemmFp8Bf16) may accumulate in the
  // tensor cores' native precision instead of promoting partial sums to FP32 every few K blocks
  // (CUDA: CUBLASLT_MATMUL_DESC_FAST_ACCUM; NVIDIA's Hopper FP8 GEMMs keep about 14 mantissa
  // bits in that mode, per the DeepSeek-V3 report, section 3.3.2). Off by default; backends that
  // always accumulate in FP32 (CPU) ignore it.
  virtual void SetFp8FastAccumulation(bool on) { (void)on; }
  // GEMM autotuning (TrainingSpec.gemm_autotune): a backend with several algorithms per GEMM
  // shape times them on the shape's first call and keeps the fastest. Results stay within each
  // algorithm's rounding; only which algorithm runs changes. Default off; the CPU backend has one
  // algorithm and ignores it. Not thread-safe (set between steps).
  virtual void SetGemmAutotune(bool on) { (void)on; }
  // Deterministic kernels (TrainingSpec.deterministic; default on): off lets a backend use
  // order-dependent float atomics where that is faster (CUDA: the cuDNN attention backward's dQ).
  // Results then vary in the last bits between runs, within each op's tolerance. The CPU backend
  // is always deterministic and ignores it. Not thread-safe (set between steps).
  virtual void SetDeterministic(bool on) { (void)on; }
  // C (M, N) = op(A) · op(B) [+ C if accumulate], op(X) = X or X^T; A is (M, K) or (K, M) when
  // trans_a, B is (K, N) or (N, K) when trans_b. f32 storage; inputs rounded per `inputs`.
  virtual void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
                    const float* B, float* C, bool accumulate, GemmInputs inputs) = 0;
  // Rounds every element to the nearest bfloat16 (ties to even), in place. x (n) f32.
  virtual void RoundToBf16(float* x, int64_t n) = 0;
  // Packs f32 to bfloat16 bit patterns (round to nearest even; NaN stays NaN) and back (exact).
  // Used for BF16 weights on the wire. in/out (n).
  virtual void PackBf16(const float* in, uint16_t* out, int64_t n) = 0;
  virtual void UnpackBf16(const uint16_t* in, float* out, int64_t n) = 0;

  // ---- elementwise and layers (activations f32) --------------------------------------------
  // out = a + b. (n)
  virtual void Add(const float* a, const float* b, float* out, int64_t n) = 0;
  // y += alpha * x. (n)
  virtual void Axpy(float alpha, const float* x, float* y, int64_t n) = 0;

  // Embedding: out (N, C) = table[tokens[i]], tokens (N) int32 < V, table (V, C).
  virtual void EmbeddingForward(const int32_t* tokens, int64_t N, const float* table, int64_t C,
                                float* out) = 0;
  // dtable (V, C) += sum of dout rows per token. Deterministic (fixed summation order).
  virtual void EmbeddingBackward(const int32_t* tokens, int64_t N, const float* dout, int64_t C,
                                 float* dtable) = 0;

  // RMSNorm (Zhang & Sennrich 2019; HF LlamaRMSNorm): y = x / sqrt(mean(x^2) + eps) * w.
  // x, y (N, C); w (C); rstd (N) saved for the backward.
  virtual void RmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C,
                              float* y, float* rstd) = 0;
  // dx (N, C) = (overwrite); dw (C) += (accumulate, deterministic).
  virtual void RmsNormBackward(const float* dy, const float* x, const float* w, const float* rstd,
                               int64_t N, int64_t C, float* dx, float* dw) = 0;

  // RoPE in HF rotate_half convention, in place on x (B, T, H, D), position = t:
  // x1 = x[..., :D/2], x2 = x[..., D/2:], out = (x1*cos - x2*sin, x2*cos + x1*sin) with
  // angle = t * theta^(-2i/D), i in [0, D/2). The backward applies the inverse rotation
  // (angle -> -angle) to the gradient in place.
  virtual void RopeForward(float* x, int64_t B, int64_t T, int64_t H, int64_t D, float theta) = 0;
  virtual void RopeBackward(float* dx, int64_t B, int64_t T, int64_t H, int64_t D,
                            float theta) = 0;
  // Replaces the inverse frequencies of the RoPE calls (every Rope* op) whose theta equals `theta`
  // and whose head dimension is D = 2 * inv_freq.size(): they rotate by angle = f32(t) *
  // inv_freq[i] instead of t * theta^(-2i/D) (RoPE scaling such as Llama 3.1's, computed by the
  // caller). An empty inv_freq restores the default for every call. Not concurrent with RoPE calls.
  void SetRopeInvFreq(float theta, std::vector<float> inv_freq);

  // Causal scaled-dot-product attention, scale 1/sqrt(D), grouped-query when Hkv < H
  // (query head h uses kv head h / (H / Hkv)).
  // q, out (B, T, H, D); k, v (B, T, Hkv, D); lse (B, H, T) log-sum-exp of the scaled scores,
  // saved for the backward (no T x T matrix is kept).
  virtual void AttentionForward(const float* q, const float* k, const float* v, int64_t B,
                                int64_t T, int64_t H, int64_t Hkv, int64_t D, float* out,
                                float* lse) = 0;
  // dq (B, T, H, D), dk, dv (B, T, Hkv, D) overwritten.
  virtual void AttentionBackward(const float* q, const float* k, const float* v, const float* out,
                                 const float* dout, const float* lse, int64_t B, int64_t T,
                                 int64_t H, int64_t Hkv, int64_t D, float* dq, float* dk,
                                 float* dv) = 0;

  // BF16 attention (precision.attention = bf16) on f32 storage, the flash-attention recipe of
  // fused kernels such as cuDNN's SDPA: q, k, v are rounded to bfloat16 (round to nearest even)
  // first, scores and softmax statistics (lse) are f32, and out is rounded to bfloat16; backward
  // likewise rounds q, k, v, out and dout to bfloat16 and returns dq, dk, dv rounded to bfloat16.
  // Shapes, layout and causal/GQA semantics as AttentionForward/Backward; storage stays f32.
  // The base implementation is the reference: it rounds copies of the inputs, calls the f32
  // kernels above and rounds the outputs. A fused kernel may differ from it by the rounding of the
  // probabilities to bfloat16 before P·V (relative error about 2^-8 per element).
  virtual void AttentionForwardBf16Compute(const float* q, const float* k, const float* v,
                                           int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                           float* out, float* lse);
  virtual void AttentionBackwardBf16Compute(const float* q, const float* k, const float* v,
                                            const float* out, const float* dout, const float* lse,
                                            int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                            float* dq, float* dk, float* dv);

  // The backward of AttentionForwardBf16Compute from activations saved as bfloat16 bit patterns:
  // q16 (B, T, H, D), k16, v16 (B, T, Hkv, D) and out16 (B, T, H, D) hold exactly the bf16 values
  // AttentionBackwardBf16Compute would round q, k, v and out to, so the result is the same; dout,
  // lse, dq, dk, dv (f32) as there. The base implementation unpacks and calls
  // AttentionBackwardBf16Compute.
  virtual void AttentionBackwardBf16Saved(const uint16_t* q16, const uint16_t* k16,
                                          const uint16_t* v16, const uint16_t* out16,
                                          const float* dout, const float* lse, int64_t B,
                                          int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                          float* dq, float* dk, float* dv);

  // SwiGLU: h (N, F) = silu(gate) * up, silu(x) = x * sigmoid(x).
  virtual void SwigluForward(const float* gate, const float* up, int64_t n, float* h) = 0;
  // dgate, dup (n) overwritten from dh (n).
  virtual void SwigluBackward(const float* dh, const float* gate, const float* up, int64_t n,
                              float* dgate, float* dup) = 0;
  // As SwigluBackward with gate and up given as bfloat16 bit patterns (activations saved in bf16);
  // dh, dgate, dup f32; the math is f32 on their exact values. The base implementation unpacks
  // and calls SwigluBackward.
  virtual void SwigluBackwardBf16Saved(const float* dh, const uint16_t* gate16,
                                       const uint16_t* up16, int64_t n, float* dgate, float* dup);

  // RmsNormForward whose output goes straight to FP8: out (N, C) = fp8(y * (*scale)) with
  // y = RMSNorm(x) * w as RmsNormForward computes it (y itself is not returned), rstd (N) as
  // there, and max |y| into *amax_out (nullable) as CastToFp8. The reference: RmsNormForward into
  // a scratch y, then CastToFp8.
  virtual void RmsNormCastFp8(const float* x, const float* w, float eps, int64_t N, int64_t C,
                              float* rstd, const float* scale, Fp8Format fmt, uint8_t* out,
                              float* amax_out);
  // RmsNormBackward, then dx += dres (the residual branch's gradient, (N, C) f32): the reference
  // is RmsNormBackward followed by Axpy(1, dres, dx); a backend may add it in the same pass.
  virtual void RmsNormBackwardAdd(const float* dy, const float* x, const float* w,
                                  const float* rstd, const float* dres, int64_t N, int64_t C,
                                  float* dx, float* dw);
  // RmsNormBackwardAdd with dy given as bf16 parts whose f32 sum it is: dy = (dy_a + dy_b) + dy_c,
  // added in that order and rounded once per addition (dy_c may be null: a + b; dy_b and dy_c
  // both null: dy_a alone). The parts are the dX of the FP8 linears that read the norm's output
  // (q/k/v, gate/up), each from its own GEMM with bf16 output, or one part from their fused GEMM;
  // no GEMM reads and rewrites an f32 accumulator. The reference: UnpackBf16 of each part, Axpy
  // the sum, RmsNormBackwardAdd. dy_a, dy_b, dy_c (N, C) bf16.
  virtual void RmsNormBackwardAddBf16Parts(const uint16_t* dy_a, const uint16_t* dy_b,
                                           const uint16_t* dy_c, const float* x, const float* w,
                                           const float* rstd, const float* dres, int64_t N,
                                           int64_t C, float* dx, float* dw);

  // ---- bfloat16 activations ------------------------------------------------------------------
  // Variants that take or give activations as bfloat16 bit patterns (uint16_t; f32 -> bf16 is
  // round to nearest even, NaN stays NaN), so that the memory-bound passes between FP8 GEMMs move
  // half the bytes. Each base implementation is the reference: unpack the bf16 inputs (exact),
  // run the f32 op above, pack the outputs. A backend may fuse these steps; its result then
  // differs from the reference only as much as its f32 op does (the conformance tolerances).
  // Shapes as for the f32 ops.

  // D (M, N) = A · Bᵀ · a_scale_inv · b_scale_inv + R (R (M, N) f32 unchanged; D may not alias
  // A, B or R): the residual add folded into the GEMM. The reference: Copy(D, R), then GemmFp8
  // accumulating into D.
  virtual void GemmFp8AddResidual(int64_t M, int64_t N, int64_t K, const uint8_t* A,
                                  Fp8Format a_fmt, const float* a_scale_inv, const uint8_t* B,
                                  Fp8Format b_fmt, const float* b_scale_inv, const float* R,
                                  float* D);
  // Gemm with inputs already bf16: A16, B16 hold bf16 bit patterns with the shapes of Gemm's A,
  // B; C (M, N) f32. The same result as Gemm(..., GemmInputs::kBF16) on the unpacked values (which
  // rounding to bf16 leaves unchanged). The reference: UnpackBf16 both, Gemm with kF32.
  virtual void GemmBf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                        const uint16_t* A16, const uint16_t* B16, float* C, bool accumulate);
  // C16 (M, N) = bf16(A · Bᵀ · a_scale_inv · b_scale_inv): GemmFp8 without accumulation, its f32
  // result rounded once to bf16 (cuBLASLt's BF16 output on CUDA).
  virtual void GemmFp8Bf16(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format a_fmt,
                           const float* a_scale_inv, const uint8_t* B, Fp8Format b_fmt,
                           const float* b_scale_inv, uint16_t* C16);
  // CastToFp8 / CastTransposeFp8 of bf16 values (the amax is of those values). in16 (n) or
  // (rows, cols).
  virtual void CastToFp8Bf16(const uint16_t* in16, uint8_t* out, int64_t n, const float* scale,
                             Fp8Format fmt, float* amax_out);
  // out_ld: the row stride of out in elements (>= cols; cols when dense), so that the codes of
  // several grad-outputs can sit side by side in one (rows, out_ld) matrix, the A operand of one
  // fused dX GEMM (LlamaModel's q/k/v and gate/up); out_t is always dense (cols, rows).
  virtual void CastTransposeFp8Bf16(const uint16_t* in16, int64_t rows, int64_t cols,
                                    const float* scale, Fp8Format fmt, uint8_t* out,
                                    uint8_t* out_t, float* amax_out, int64_t out_ld);
  // RopeForward / RopeBackward in place on bf16 x16 (B, T, H, D): each result rounded to bf16.
  // The forward's tokens are ld >= H * D elements apart (H * D when dense; the q or k part of the
  // fused q/k/v GEMM's (B * T, (H + 2 Hkv) * D) output); elements between them are left alone.
  virtual void RopeForwardBf16(uint16_t* x16, int64_t B, int64_t T, int64_t H, int64_t D,
                               float theta, int64_t ld);
  virtual void RopeBackwardBf16(uint16_t* dx16, int64_t B, int64_t T, int64_t H, int64_t D,
                                float theta);
  // RopeBackwardBf16 fused with the FP8 cast-transpose of its result (a q or k grad-output),
  // leaving dx16 as it was. The reference: a copy of dx16, RopeBackwardBf16 on it, then
  // CastTransposeFp8Bf16 of the (B * T, H * D) result. dx16 (B, T, H, D) bf16; out (B * T, H * D)
  // codes (may be null; row stride out_ld >= H * D, as CastTransposeFp8Bf16) and out_t
  // (H * D, B * T) codes; scale (1), amax_out (1, or null) as CastTransposeFp8.
  virtual void RopeBackwardCastTransposeFp8Bf16(const uint16_t* dx16, int64_t B, int64_t T,
                                                int64_t H, int64_t D, float theta,
                                                const float* scale, Fp8Format fmt, uint8_t* out,
                                                uint8_t* out_t, float* amax_out, int64_t out_ld);
  // AttentionForwardBf16Compute on bf16 operands, its (bf16-rounded) output returned as bf16:
  // q16, out16 (B, T, H, D); k16, v16 (B, T, Hkv, D); lse (B, H, T) f32. The tokens of q16 are
  // q_ld >= H * D elements apart, those of k16 and v16 kv_ld >= Hkv * D (dense: H * D and
  // Hkv * D; q, k and v as parts of one fused q/k/v GEMM output: (H + 2 Hkv) * D for all three).
  virtual void AttentionForwardBf16Packed(const uint16_t* q16, const uint16_t* k16,
                                          const uint16_t* v16, int64_t B, int64_t T, int64_t H,
                                          int64_t Hkv, int64_t D, uint16_t* out16, float* lse,
                                          int64_t q_ld, int64_t kv_ld);
  // AttentionBackwardBf16Saved with dout given as bf16 (dout16 (B, T, H, D)) and dq, dk, dv
  // (bf16-rounded there) returned as bf16, dense; q16, k16, v16 with token strides q_ld, kv_ld
  // as in AttentionForwardBf16Packed.
  virtual void AttentionBackwardBf16SavedTo16(const uint16_t* q16, const uint16_t* k16,
                                              const uint16_t* v16, const uint16_t* out16,
                                              const uint16_t* dout16, const float* lse, int64_t B,
                                              int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                              uint16_t* dq16, uint16_t* dk16, uint16_t* dv16,
                                              int64_t q_ld, int64_t kv_ld);
  // out (rows, cols) = fp8(silu(gate) * up * (*scale)): SwigluForward of the unpacked gate16, up16,
  // then CastToFp8 (amax of the f32 products into *amax_out as there). gate16 and up16 are
  // (rows, cols) with row stride in_ld >= cols (in_ld = 2 * cols, up16 = gate16 + cols: both
  // halves of one fused gate/up GEMM output); out is dense. CUDA reads strided rows 4 elements at
  // a time: cols % 4 == 0, in_ld % 4 == 0 and 8-byte aligned gate16, up16 (aborts otherwise).
  virtual void SwigluCastFp8(const uint16_t* gate16, const uint16_t* up16, int64_t rows,
                             int64_t cols, int64_t in_ld, const float* scale, Fp8Format fmt,
                             uint8_t* out, float* amax_out);
  // SwigluCastFp8 fused with the transpose of its codes: out_t (cols, rows) dense = the
  // transpose of the codes SwigluCastFp8(gate16, up16, rows, cols, in_ld, scale, fmt) writes on
  // this backend, bit for bit (a backward recomputes a forward's cast this way instead of keeping
  // its codes); out (rows, cols) dense receives those codes themselves (may be null: not
  // written); amax_out as SwigluCastFp8 (may be null). gate16, up16 as SwigluCastFp8; CUDA also
  // needs them 8-byte aligned, and out_t 4-byte aligned (aborts otherwise).
  virtual void SwigluCastTransposeFp8(const uint16_t* gate16, const uint16_t* up16, int64_t rows,
                                      int64_t cols, int64_t in_ld, const float* scale,
                                      Fp8Format fmt, uint8_t* out, uint8_t* out_t,
                                      float* amax_out);
  // SwigluBackwardBf16Saved with dh given as bf16 and dgate, dup rounded to bf16. All (n).
  virtual void SwigluBackwardBf16To16(const uint16_t* dh16, const uint16_t* gate16,
                                      const uint16_t* up16, int64_t n, uint16_t* dgate16,
                                      uint16_t* dup16);
  // The SwiGLU backward fused with the FP8 cast-transposes of its two gradients (the grad-outputs
  // of the gate and up linears), without the bf16 round trip through memory. The reference:
  // SwigluBackwardBf16To16(dh16, gate16, up16) into bf16 dgate16, dup16 (rows, cols), then
  // CastTransposeFp8Bf16(dgate16, ..., scale_gate, fmt, dgate8, dgate8_t, amax_gate) and the same
  // for dup16 with scale_up. dh16, gate16, up16 (rows, cols) bf16; dgate8, dup8 (rows, cols) FP8 codes
  // with row stride out_ld >= cols (either may be null: not written; out_ld = 2 * cols with
  // dup8 = dgate8 + cols puts both in one (rows, 2 * cols) matrix) and dgate8_t, dup8_t (cols, rows)
  // dense FP8 codes; scales (1) f32 device scalars; amax_gate, amax_up (1) f32 device scalars or
  // null, raised to the max |value| of the bf16 gradient they belong to. gate16 and up16 have row
  // stride in_ld >= cols (as SwigluCastFp8); dh16 is dense.
  virtual void SwigluBackwardCastTransposeFp8(const uint16_t* dh16, const uint16_t* gate16,
                                              const uint16_t* up16, int64_t rows, int64_t cols,
                                              const float* scale_gate, const float* scale_up,
                                              Fp8Format fmt, uint8_t* dgate8, uint8_t* dgate8_t,
                                              uint8_t* dup8, uint8_t* dup8_t, float* amax_gate,
                                              float* amax_up, int64_t out_ld, int64_t in_ld);

  // CrossEntropyForwardBackward with the gradient written as bf16 to dlogits16 (N, V) instead of
  // over the logits, which are left as they were: the gradient of a BF16 head goes to its GEMMs
  // once, in the precision they read it. The reference: a copy of the logits,
  // CrossEntropyForwardBackward on it, PackBf16.
  virtual void CrossEntropyForwardBackwardBf16Grad(const float* logits, const int32_t* targets,
                                                   int64_t N, int64_t V, float grad_scale,
                                                   float* losses, uint16_t* dlogits16);

  // Softmax cross-entropy over V classes, fused with its gradient.
  // logits (N, V) f32 is overwritten with dlogits = (softmax - onehot(target)) * grad_scale;
  // losses (N) f32 receives -log softmax[target] in nats. targets (N) int32 in [0, V).
  // With grad_scale = 0 only losses are produced (logits are still overwritten).
  virtual void CrossEntropyForwardBackward(float* logits, const int32_t* targets, int64_t N,
                                           int64_t V, float grad_scale, float* losses) = 0;

  // ---- optimizer ---------------------------------------------------------------------------
  // out[0] += sum_i x[i]^2. x (n) f32, n may be 0; out (1) f32 device scalar. The sum is taken in
  // a fixed order (deterministic) with at least FP64 accumulation on the CPU backend, then added
  // to out[0] and rounded to f32 once.
  virtual void SumSquares(const float* x, int64_t n, float* out) = 0;
  // AdamW (Loshchilov & Hutter 2019; torch.optim.AdamW semantics) on one flat shard:
  // p -= lr * wd * p; m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'^2;
  // p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps), with g' = g * grad_scale.
  // p, g, m, v (n) f32; step t >= 1. amax_out (1) f32 device scalar or null: raised to at least
  // max |p| over the updated p (the next FP8 cast's amax, without a second pass over p).
  // p16_out (n) or null: the updated p as bfloat16 bits, equal to PackBf16 of it (a BF16 wire
  // shard; the CUDA backend writes them from the update's registers, without reading p again; the
  // CPU backends pack after the update).
  virtual void AdamW(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
                     float beta2, float eps, float weight_decay, int64_t step, float grad_scale,
                     float* amax_out, uint16_t* p16_out) = 0;
  // AdamW with both moments stored as bfloat16 (optimizer.state_precision BF16, as DeepSeek-V3
  // keeps its AdamW moments, arXiv 2412.19437 sec. 3.3.3): m16 and v16 (n) are read (exactly
  // widened to f32), updated by AdamW's per-element f32 operations, and stored rounded to the
  // nearest bfloat16 (ties to even; NaN stays NaN). This step's update of p uses the f32 moments
  // before that rounding. p, g (n) f32; the rest as AdamW. The reference: UnpackBf16 of m16 and
  // v16, AdamW on the f32 copies, PackBf16 of them.
  virtual void AdamWBf16Moments(float* p, const float* g, uint16_t* m16, uint16_t* v16, int64_t n,
                                float lr, float beta1, float beta2, float eps, float weight_decay,
                                int64_t step, float grad_scale, float* amax_out,
                                uint16_t* p16_out) = 0;

 protected:
  // The inverse frequencies SetRopeInvFreq set for (D, theta), or null when the default applies.
  const std::vector<float>* RopeInvFreqFor(int64_t D, float theta) const;
  // Changes with every SetRopeInvFreq (a key of the backends' RoPE table caches).
  int64_t rope_freq_version() const { return rope_freq_version_; }

 private:
  float rope_freq_theta_ = 0.0f;
  std::vector<float> rope_inv_freq_;
  int64_t rope_freq_version_ = 0;
};

// A backend's settings from the environment (common/env_settings.h); all off by default.
struct BackendOptions {
  // CPU: fresh allocations read as NaN (all-ones bytes) until written (FSDP8_CPU_FILL_NAN=1).
  bool cpu_fill_nan = false;
  // CUDA: the GPU time of every op, reported every this many seconds (FSDP8_PROFILE_OPS=1: 10 s,
  // =<seconds> when above 1); 0: off.
  double profile_ops_period_s = 0;
  // CUDA: each GEMM shape's cuBLASLt algorithm choice logged to stderr (FSDP8_GEMM_VERBOSE set).
  bool gemm_verbose = false;
  // Bytes Alloc may hold at once (AllocatedBytes(); CUDA's own workspaces not counted, the CPU
  // backends' scratch slots counted);
  // 0: no limit but the memory itself. The worker's --memory_limit_mb.
  int64_t memory_limit_bytes = 0;

  static BackendOptions FromEnvironment();
};

// Creates the named backend: "cpu" always (the fast CPU backend; the reference where the CPU
// lacks what it needs, AVX2, FMA and F16C on x86-64, or on other architectures: Name() then says
// "cpu-ref"); "cpu-ref" always (the reference the conformance tests compare against); "cuda"
// when built with CUDA and a device is present. device: GPU ordinal (ignored by the CPU ones). Returns nullptr and sets *error when unavailable.
std::unique_ptr<Backend> CreateBackend(const std::string& name, int device, std::string* error,
                                       const BackendOptions& options =
                                           BackendOptions::FromEnvironment());

}  // namespace fsdp8
