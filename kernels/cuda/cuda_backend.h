// CudaBackend: the Backend interface (kernels/backend.h) on one NVIDIA GPU (Hopper, sm_90a).
//
// Memory: Alloc/Free are stream-ordered on the compute stream (cudaMallocAsync / cudaFreeAsync
// from the device's default memory pool, release threshold unlimited, so freed blocks are reused
// without returning to the driver and without synchronizing the device), 256-byte aligned, with
// byte accounting in a size map (AllocatedBytes / PeakAllocatedBytes, the counterpart of
// torch.cuda.max_memory_allocated, which counts cuBLAS's and cuDNN's workspaces too); out of memory
// returns nullptr. A buffer freed while enqueued
// compute-stream work still reads it stays valid for that work (stream order); communicators order
// their stream against the compute stream (comm/nccl_communicator.h), so the same holds for
// collectives. The backend's own workspaces (GEMM workspace 32 MiB, reduction partials, conversion
// buffers, RoPE tables) are allocated with cudaMalloc and held until the backend is destroyed;
// cuDNN attention's workspace (1 GiB for the deterministic backward at the 1b shapes) is taken with
// Alloc for each call and freed after it. AllocatedBytes and PeakAllocatedBytes include all of
// them, so a peak is comparable with PyTorch's.
//
// Streams: every op is enqueued on one compute stream (a non-blocking stream created for this
// backend), in call order. CopyToHost and Synchronize wait for it. Communicators order their own
// stream against it with events, through the CudaStreams interface (kernels/cuda/cuda_streams.h,
// comm/nccl_communicator.h).
//
// Numerics (the CPU backend is the reference; tests/conformance checks every op against it):
//   * FP8 casts, transposes, dequantize, bf16 rounding / pack / unpack: bit-identical to the CPU.
//   * GemmFp8: cuBLASLt FP8 (TN layout; partial sums promoted to FP32 every few K blocks, or kept
//     in the tensor cores' accumulator over all of K (CUBLASLT_MATMUL_DESC_FAST_ACCUM) while
//     SetFp8FastAccumulation is on; scale pointers to the two scale_inv device scalars; f32
//     output). Shapes cuBLASLt refuses (K or rows not multiples of 16, E5M2 x
//     E5M2) take an exact fallback: dequantize to f32 (exact), f32 GEMM, multiply by the scales.
//   * Gemm: cuBLASLt with CUBLAS_COMPUTE_32F (no TF32) for kF32; kBF16 packs A and B to bfloat16
//     (RNE) and multiplies on tensor cores with FP32 accumulation into f32 C.
//   * Attention: f32 flash-style kernels (kernels/cuda/attention.cu). The BF16 variants
//     (AttentionForward / AttentionBackward with AttentionOptions::bf16) run cuDNN's fused SDPA
//     (attention_cudnn.h, deterministic backward) when built with it and D is a multiple of 8 up
//     to 128; otherwise, or if cuDNN refuses the shape, the Backend reference (a one-time message
//     says so).
//   * Every kernel is deterministic: same inputs, same bits (no order-dependent float atomics),
//     unless SetDeterministic(false) (then the cuDNN attention backward is not).
//
// Profiling: with BackendOptions::profile_ops_period_s (FSDP8_PROFILE_OPS=1 in the environment),
// the GPU time of every op (CUDA events around it on the compute stream) is summed per op name and
// GEMM shape and printed to stderr every 10 s (FSDP8_PROFILE_OPS=<seconds> when above 1) with the
// share of wall time the stream spent in ops (kernels/cuda/op_profile.h).
//
// Errors: a failing CUDA / cuBLASLt call aborts with the call, the error and file:line (backend.h).
// Thread-safety: one thread per instance (as Backend); the backend binds its device
// (cudaSetDevice) at construction and on every call, so several backends on several devices may
// live in one process if each is used from its own thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <map>

#include <cuda_runtime_api.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_streams.h"
#ifdef FSDP8_WITH_CUDNN
#include "kernels/cuda/attention_cudnn.h"
#endif

namespace fsdp8 {

namespace cuda {
class LtGemm;
class OpProfile;
class OpScope;
}

class CudaBackend final : public Backend, public CudaStreams {
 public:
  // Binds `device`; aborts on CUDA errors (use CreateCudaBackend for a checked creation). Of the
  // options, profile_ops_period_s and gemm_verbose apply.
  CudaBackend(int device, const BackendOptions& options);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string Name() const override { return "cuda"; }
  // The compute stream every op is enqueued on (CudaStreams).
  cudaStream_t stream() const override { return stream_; }
  int device() const override { return device_; }
  // Number of GemmFp8 calls that took the dequantize + f32 fallback (cuBLASLt refused the shape).
  int64_t gemm_fp8_fallbacks() const { return gemm_fp8_fallbacks_; }

  void* Alloc(size_t bytes) override;
  void Free(void* p) override;
  void CopyToDevice(void* dst, const void* host_src, size_t bytes) override;
  void CopyToHost(void* host_dst, const void* src, size_t bytes) override;
  void Copy(void* dst, const void* src, size_t bytes) override;
  void Memset(void* dst, int value, size_t bytes) override;
  void Synchronize() override;
  void BeginSideStream() override;
  void EndSideStream() override;
  void JoinSideStream() override;
  int64_t AllocatedBytes() const override { return allocated_ + workspace_; }
  int64_t PeakAllocatedBytes() const override { return peak_; }
  void ResetPeak() override {
    peak_ = allocated_ + workspace_;
    account_.ResetPeak();
  }

  void TransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) override;
  void DequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                     Fp8Format fmt) override;
  void AmaxAccumulate(const float* in, int64_t n, float* amax_out) override;
  void Fp8ScalesFromAmax(const float* amax, int64_t n, float fp8_max, int margin, float* scale,
                         float* scale_inv, int64_t stride) override;
  void GroupMax(const float* in, const int32_t* group, int64_t n, float* out) override;

  void RoundToBf16(float* x, int64_t n) override;
  void PackBf16(const float* in, uint16_t* out, int64_t n) override;
  void UnpackBf16(const uint16_t* in, float* out, int64_t n) override;

  void Add(const float* a, const float* b, float* out, int64_t n) override;
  void Axpy(float alpha, const float* x, float* y, int64_t n) override;

  void EmbeddingForward(const int32_t* tokens, int64_t N, const float* table, int64_t C,
                        float* out) override;
  // V (rows of dtable) is not passed by the interface: the backend takes it from the size of the
  // allocation that holds dtable (AllocatedSizeOf), so dtable must start an Alloc'd buffer or lie
  // inside one (then the rows up to the end of that buffer are considered).
  void EmbeddingBackward(const int32_t* tokens, int64_t N, const float* dout, int64_t C,
                         float* dtable) override;

  void SumSquares(const float* x, int64_t n, float* out) override;

  void AdamW(float* p, const float* g, TypedPtr m, TypedPtr v, int64_t n, float lr, float beta1,
             float beta2, float eps, float weight_decay, int64_t step, float grad_scale,
             float* amax_out, uint16_t* p16_out) override;

 protected:
  // The typed ops' hooks (backend.h): every combination has its kernel, fused where the op
  // describes one; declined are GemmFp8's layouts other than TN, shapes cuBLASLt or the fused
  // kernels refuse, and BF16 attention without cuDNN (CudnnAttentionUsable).
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
  // The block-scaled FP8 ops of the rowwise and blockwise recipes. The casts run on the device
  // for every shape (block_fp8.cu). The GEMMs run in cuBLASLt (CUDA >= 12.9, Hopper):
  // OUTER_VEC_32F scales for kRow x kRow, VEC128_32F for kTile128 and BLK128x128_32F for
  // kBlock128, the scales rewritten first into cuBLASLt's layouts (1 x 128: the K-chunk index
  // outer, rows contiguous; 128 x 128: rows of ceil(K / 128) padded to a multiple of 4). Declined
  // (the host composition runs, counted in gemm_fp8_fallbacks): both operands E5M2, a 1 x 128
  // operand with rows not a multiple of 4, shapes cuBLASLt refuses, calls on the side stream.
  bool TryQuantizeFp8Blocks(TypedCPtr in, int64_t rows, int64_t cols, Fp8Blocks blocks,
                            Fp8Format fmt, uint8_t* out, float* scale_inv, uint8_t* out_t,
                            float* scale_inv_t) override;
  bool TryGemmFp8Blocks(int64_t M, int64_t N, int64_t K, Fp8BlockOperand a, Fp8BlockOperand b,
                        float* C, bool accumulate) override;
  bool TryTransposeBlockScales(const float* in, int64_t rows, int64_t cols, float* out) override;
  // SetFp8FastAccumulation; SetGemmAutotune times cuBLASLt's candidates on each GEMM shape's first
  // call (cuda::LtGemm::set_autotune; the scratch output comes from Alloc, so it counts in the
  // peak while tuning); SetDeterministic(false): cuDNN attention's non-deterministic backward
  // (CudnnAttention::set_deterministic_backward).
  void ApplySettings(const ComputeSettings& settings) override;

 private:
  // The FP8 GEMM in the TN layout with f32 C; shapes cuBLASLt refuses take the exact fallback.
  void GemmFp8Tn(int64_t M, int64_t N, int64_t K, Fp8Operand a, Fp8Operand b, float* C,
                 bool accumulate);
  // The bf16-operand GEMM; false when cuBLASLt has no algorithm for the shape.
  // Operand x's scales as cuBLASLt's scale mode for it wants them (TryGemmFp8Blocks): the
  // caller's tensor when it already has that layout and 16-byte alignment, else a copy in
  // scratch slot `slot`. *mode: the cublasLtMatmulMatrixScale_t.
  const float* BlockScalesForLt(const Fp8BlockOperand& x, int64_t rows, int64_t K, int slot,
                                int* mode);
  bool GemmBf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const uint16_t* A16,
                const uint16_t* B16, float* C, bool accumulate);
  void GemmF32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
               const float* B, float* C, bool accumulate, GemmInputs inputs);
  // A GEMM without rows, columns or K (C zeroed unless accumulating): true, having done it.
  bool EmptyGemm(int64_t M, int64_t N, int64_t K, float* C, bool accumulate);
  // The profile scope of op `name` (op_profile.h; a GEMM's with its shape), the device bound.
  cuda::OpScope Op(const char* name);
  cuda::OpScope Op(const char* name, int64_t M, int64_t N, int64_t K);

 private:
  // Growable device scratch slot i of at least `bytes` (counted as a workspace). Growing
  // synchronizes the stream first, since enqueued work may still read the old buffer.
  void* Scratch(int i, size_t bytes);
  // Recounts the workspaces' bytes (after one may have grown) and raises the peak.
  void CountWorkspaces();
  void ReportPoolPeaks() const;  // one stderr line: the pool's reserved and used peaks
  // Bytes from p to the end of the Alloc'd buffer containing it; 0 when unknown.
  size_t BytesToEndOfAllocation(const void* p) const;
  void Bind() const;
  // The op profile of an op enqueued now: none on the side stream (its events are the compute
  // stream's).
  cuda::OpProfile* Prof() const { return in_side_ ? nullptr : prof_.get(); }
  // Builds the RoPE cos/sin table for (T, D, theta) and the set frequencies (SetRopeInvFreq:
  // tabulated on the host) unless it is the cached one.
  void EnsureRopeTable(int64_t T, int64_t D, float theta);
  // cuDNN's fused attention applies to this head dimension (and has not refused before).
  bool CudnnAttentionUsable(int64_t D) const;
#ifdef FSDP8_WITH_CUDNN
  // cuDNN refused a graph (`err` says why): one message, then the reference path from now on.
  void CudnnRefused(const std::string& err);
#endif

  int device_;
  int64_t limit_ = 0;  // BackendOptions::memory_limit_bytes
  cudaStream_t stream_ = nullptr;  // the current stream: compute_stream_, or side_stream_
  cudaStream_t compute_stream_ = nullptr;
  cudaStream_t side_stream_ = nullptr;  // created by the first BeginSideStream
  cudaEvent_t side_fork_ = nullptr, side_done_ = nullptr;
  bool in_side_ = false;       // between BeginSideStream and EndSideStream
  bool side_unjoined_ = false;  // side-stream work the compute stream has not waited for
  void* gemm_workspace_ = nullptr;
  std::unique_ptr<cuda::LtGemm> lt_;
  std::map<uintptr_t, size_t> sizes_;  // base address -> bytes
  int64_t allocated_ = 0;  // Alloc'd bytes
  int64_t workspace_ = 0;  // the backend's own workspaces (CountWorkspaces)
  int64_t peak_ = 0;       // of allocated_ + workspace_
  static constexpr int kScratchSlots = 8;
  void* scratch_[kScratchSlots] = {};
  size_t scratch_bytes_[kScratchSlots] = {};
  int64_t rope_T_ = -1, rope_D_ = -1;
  float rope_theta_ = 0.0f;
  int64_t rope_version_ = -1;  // rope_freq_version() of the table
  float* rope_table_ = nullptr;
  size_t rope_table_bytes_ = 0;
  int64_t gemm_fp8_fallbacks_ = 0;
  std::unique_ptr<cuda::OpProfile> prof_;  // profile_ops_period_s > 0 (kernels/cuda/op_profile.h)
  bool fp8_fast_accum_ = false;  // SetFp8FastAccumulation
#ifdef FSDP8_WITH_CUDNN
  std::unique_ptr<cuda::CudnnAttention> cudnn_;
  bool cudnn_failed_ = false;
#endif
};

// Creates a CudaBackend on GPU `device`. Returns nullptr and sets *error (naming the device and
// the CUDA error) when there is no such device or the context cannot be created.
std::unique_ptr<Backend> CreateCudaBackend(int device, std::string* error,
                                           const BackendOptions& options);

}  // namespace fsdp8
