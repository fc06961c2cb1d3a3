// Backend: the compute a worker's rank needs, behind one interface with a CPU reference
// (kernels/cpu/cpu_ref_backend.h, "cpu-ref"), a fast CPU implementation
// (kernels/cpu/cpu_fast_backend.h, "cpu") and a CUDA implementation (kernels/cuda).
//
// All pointers are *device* pointers of this backend (host memory for the CPU backend), obtained
// from Alloc(). Shapes are given as row-major dimensions in comments, e.g. x (M, K) means M rows of
// K contiguous elements. FP8 buffers hold one OCP FP8 code per byte (kernels/fp8.h). "f32" is IEEE
// float32, "bf16" bfloat16 bit patterns (uint16_t; f32 -> bf16 rounds to nearest even, NaN stays
// NaN).
//
// One op per computation: where an op's operands may be stored as f32 or as bf16, it takes them as
// typed views (TypedPtr / TypedCPtr: a pointer and its DType, converted implicitly from float* or
// uint16_t*), and where its result may go straight to FP8 it takes an Fp8Cast naming the codes'
// destination. Each op documents the combinations it accepts (others abort). Wherever an op reads
// bf16 storage, the result is that of the f32 op on the exactly widened values (bf16 recipes: see
// the attention ops); wherever it writes bf16, the f32 result rounded once. These typed ops are
// written once, here: each checks its operands, resolves row strides of 0 to dense and hands the
// combination to the backend's hook (Try*, below), which runs the f32 case and may fuse the
// others; a combination the backend declines runs as the reference composition (widen, run the
// f32 op, round), its result then differing from the reference only as much as the backend's f32
// op does (the conformance tolerances).
//
// Ops are enqueued on the backend's compute stream in call order; host-visible results (CopyToHost,
// the float returned by ReduceMax etc. are *not* returned: they land in device buffers) are ready
// after Synchronize(). The CPU backend runs everything synchronously.
//
// Thread-safety: a Backend is used by one thread (the rank's trainer thread).
//
// Errors: programming errors (null pointers, shape mismatch, an unsupported combination of
// operand types) abort with file:line (FSDP8_CHECK, common/check.h). Alloc returns nullptr when
// the memory is exhausted (device memory; host memory for the CPU backend) or when the allocation
// would take AllocatedBytes() above BackendOptions::memory_limit_bytes; the caller reports
// RESOURCE_EXHAUSTED (train/device_buffer.h). The reference compositions take scratch buffers
// through Alloc and throw std::bad_alloc when those do not fit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/allocation_account.h"

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

// How an activation buffer stores its values.
enum class DType : uint8_t {
  kF32 = 0,
  kBF16 = 1,  // bfloat16 bit patterns (uint16_t)
};

// A typed view of a device buffer an op writes: its address and element type. Converts from
// float* (f32) and uint16_t* (bf16); a null view (nullptr) stands for an absent operand.
struct TypedPtr {
  void* data = nullptr;
  DType dtype = DType::kF32;
  TypedPtr(std::nullptr_t = nullptr) {}                    // NOLINT: implicit by design
  TypedPtr(float* p) : data(p), dtype(DType::kF32) {}      // NOLINT
  TypedPtr(uint16_t* p) : data(p), dtype(DType::kBF16) {}  // NOLINT
  bool null() const { return data == nullptr; }
  bool bf16() const { return data != nullptr && dtype == DType::kBF16; }
  bool f32() const { return data != nullptr && dtype == DType::kF32; }
  float* f() const;     // the f32 pointer; aborts unless dtype is kF32 (null passes)
  uint16_t* h() const;  // the bf16 pointer; aborts unless dtype is kBF16 (null passes)
};
// A typed view of a buffer an op reads.
struct TypedCPtr {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  TypedCPtr(std::nullptr_t = nullptr) {}                          // NOLINT
  TypedCPtr(const float* p) : data(p), dtype(DType::kF32) {}      // NOLINT
  TypedCPtr(const uint16_t* p) : data(p), dtype(DType::kBF16) {}  // NOLINT
  TypedCPtr(TypedPtr b) : data(b.data), dtype(b.dtype) {}         // NOLINT
  bool null() const { return data == nullptr; }
  bool bf16() const { return data != nullptr && dtype == DType::kBF16; }
  bool f32() const { return data != nullptr && dtype == DType::kF32; }
  const float* f() const;
  const uint16_t* h() const;
};

// Where an op's result goes as FP8 instead of f32/bf16: codes = fp8(value * (*scale)) (round to
// nearest even, saturating; CastFp8's rule) into `out` (rows, cols) with row stride `ld` (0:
// dense; the codes of several results can sit side by side in one matrix) and/or their transpose
// into `out_t` (cols, rows) dense; either may be null. *amax (nullable) is raised to the max
// |value| (NaN-propagating; the caller zeroes it once per step, so microbatches accumulate).
// An Fp8Cast with neither out nor out_t is "none".
struct Fp8Cast {
  const float* scale = nullptr;  // (1) f32 device scalar
  Fp8Format fmt = Fp8Format::kE4M3;
  uint8_t* out = nullptr;
  uint8_t* out_t = nullptr;
  float* amax = nullptr;
  int64_t ld = 0;
  bool none() const { return out == nullptr && out_t == nullptr; }
};

// An FP8 GEMM operand: codes, their format and the scale_inv device scalar (1) that decodes them.
struct Fp8Operand {
  const uint8_t* codes = nullptr;
  Fp8Format fmt = Fp8Format::kE4M3;
  const float* scale_inv = nullptr;
};

// The rowwise and blockwise FP8 recipes (precision.fp8.granularity ROWWISE / BLOCKWISE): how the
// f32 scales of one FP8 matrix (rows, cols) cover its elements. Each scale is current scaling from
// the amax of the elements it covers: scale = fp8_max / amax (computed in double, clamped to
// [2^-126, FLT_MAX], rounded once to f32; not rounded to a power of two), scale 1 when that amax is
// 0, inf or NaN (Fp8BlockScale); a code is fp8(x * scale) (CastFp8's rounding) and the operand
// carries scale_inv = 1 / scale (f32 division), as CastFp8 / GemmFp8 do per tensor.
enum class Fp8Blocks : uint8_t {
  kRow = 0,        // one scale per row: scale_inv (rows)
  kTile128 = 1,    // one per 1 x 128 tile of a row: scale_inv (rows, ceil(cols / 128))
  kBlock128 = 2,   // one per 128 x 128 block: scale_inv (ceil(rows / 128), ceil(cols / 128))
};
inline constexpr int64_t kFp8BlockSize = 128;
// ceil(n / 128): the tiles or blocks along a dimension of n elements (the tail padded up).
inline int64_t Fp8BlockCount(int64_t n) { return (n + kFp8BlockSize - 1) / kFp8BlockSize; }
// The scales (f32 each) of a (rows, cols) matrix under `blocks`.
int64_t Fp8ScaleCount(Fp8Blocks blocks, int64_t rows, int64_t cols);
// Current scaling of one block: fp8_max / amax as the enum above says (1 for amax 0, inf, NaN).
float Fp8BlockScale(float amax, float fp8_max);

// A block-scaled FP8 GEMM operand: codes (rows, cols) with scale_inv laid out per `blocks`.
struct Fp8BlockOperand {
  const uint8_t* codes = nullptr;
  Fp8Format fmt = Fp8Format::kE4M3;
  const float* scale_inv = nullptr;
  Fp8Blocks blocks = Fp8Blocks::kRow;
};

// Attention's precision and layout. bf16: the flash-attention recipe of fused kernels such as
// cuDNN's SDPA on f32 storage: q, k, v rounded to bfloat16 first, scores and softmax statistics
// (lse) f32, out rounded to bfloat16; the backward likewise rounds q, k, v, out and dout and
// returns dq, dk, dv rounded. bf16 storage of q, k, v implies it. q_ld, kv_ld: the token strides
// of q and of k, v in elements (0: dense, H * D and Hkv * D; (H + 2 Hkv) * D for q, k and v as
// parts of one fused q/k/v GEMM output); only bf16 storage takes strides.
struct AttentionOptions {
  bool bf16 = false;
  int64_t q_ld = 0;
  int64_t kv_ld = 0;
};

// Run-time settings of a backend's kernels (Backend::Set*): see the setters.
struct ComputeSettings {
  bool fp8_fast_accumulation = false;
  bool gemm_autotune = false;
  bool deterministic = true;
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
  // The side stream (the deferred optimizer's updates beside the forward, FsdpParams::Prefetch):
  // the ops enqueued between BeginSideStream() and EndSideStream(), their allocations and frees,
  // and the collectives issued then (which order against the backend's current stream,
  // CudaStreams::stream()) go to a second stream. They run after every op enqueued before
  // BeginSideStream(), and may run beside the ops enqueued after EndSideStream(), which do not wait
  // for them until JoinSideStream(): the compute stream's later ops then wait for every side-stream
  // op so far (inside a section it does nothing). Sections do not nest; the op profile leaves the
  // side stream's ops out, and they may use no scratch slot (CUDA aborts). CopyToHost
  // and Synchronize wait for the compute stream only, Synchronize for the side stream too. The CPU
  // backends run every op when it is called: the three do nothing there.
  virtual void BeginSideStream() {}
  virtual void EndSideStream() {}
  virtual void JoinSideStream() {}
  // Bytes currently allocated through Alloc (plus the backend's own workspaces: CUDA's, and the
  // CPU backends' kept scratch slots) and the high-water mark since the last reset.
  virtual int64_t AllocatedBytes() const = 0;
  virtual int64_t PeakAllocatedBytes() const = 0;
  virtual void ResetPeak() = 0;  // also the account's peak (AllocationAccount::ResetPeak)
  // The bytes Alloc holds per memory label, live and at the peak (kernels/allocation_account.h):
  // every Alloc takes the account's current label (MemoryLabelScope); the backend's own scratch
  // is labelled workspaces. On the CPU backends the account's Total() and Peak() are
  // AllocatedBytes() and PeakAllocatedBytes(); on CUDA they leave out its own workspaces.
  AllocationAccount& account() { return account_; }
  const AllocationAccount& account() const { return account_; }

  // ---- FP8 --------------------------------------------------------------------------------------
  // FP8 cast (+ transpose, + amax) of in (rows, cols), f32 or bf16: out (rows, cols), row stride
  // out_ld >= cols (0: dense; bf16 input only otherwise) = fp8(in * (*scale)), round to nearest
  // even, saturating to ±max of `fmt`; out_t (cols, rows) dense = the transpose of those codes;
  // either may be null. *amax_out = max(*amax_out, max |in|) (NaN-propagating) when not null: the
  // caller zeroes it once per step so that microbatches accumulate (C03). scale (1), amax_out (1)
  // f32 device scalars.
  void CastFp8(TypedCPtr in, int64_t rows, int64_t cols, const float* scale, Fp8Format fmt,
               uint8_t* out, uint8_t* out_t = nullptr, float* amax_out = nullptr,
               int64_t out_ld = 0);
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

  // FP8 GEMM: C (M, N) = alpha_dev * op(A) · op(B) [+ C if accumulate] [+ residual], with
  // alpha_dev = (*a.scale_inv) * (*b.scale_inv); op(A) (M, K) = A (M, K), or A (K, M) transposed
  // when trans_a; op(B) (K, N) = B (N, K) transposed when trans_b, else B (K, N). Products and sums
  // are exact-FP32 emulated on the CPU (cuBLASLt on CUDA, whose FP8 GEMMs want the "TN" layout
  // trans_a = false, trans_b = true; the others go through transposed copies of the codes unless
  // Fp8GemmAnyLayout). C is f32, or bf16 (the f32 result rounded once, cuBLASLt's BF16 output on
  // CUDA; TN, no accumulate). residual (M, N) f32 or null (TN, no accumulate, f32 C not aliasing
  // A, B or residual): the residual add folded into the GEMM (the reference: Copy(C, residual),
  // then the GEMM accumulating). On CUDA, scale pointers that are not 16-byte aligned cost one
  // extra device copy each (cuBLASLt only takes 16-byte-aligned FP8 scale pointers).
  void GemmFp8(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Fp8Operand a,
               Fp8Operand b, TypedPtr C, bool accumulate, const float* residual = nullptr);
  // Block-scaled FP8 cast (the rowwise and blockwise recipes): in (rows, cols) f32 or bf16 to
  // codes out (rows, cols) dense with scale_inv (Fp8ScaleCount(blocks, rows, cols)) per `blocks`,
  // and/or the quantized transpose for the GEMM that contracts the other dimension: out_t
  // (cols, rows) dense with scale_inv_t:
  //   kRow:      inᵀ scaled per row of inᵀ (per column of in), scale_inv_t (cols): requantized.
  //   kTile128:  inᵀ in 1 x 128 tiles along its rows (128-row groups of each column of in),
  //              scale_inv_t (cols, ceil(rows / 128)): requantized.
  //   kBlock128: the transpose of out's codes with the transposed block scales, scale_inv_t
  //              (ceil(cols / 128), ceil(rows / 128)): the same codes, no requantization.
  // out/scale_inv and out_t/scale_inv_t come in pairs; either pair may be null, not both.
  // Exact (every backend gives the same bits). The reference composition goes through the host
  // (CopyToHost, a synchronisation).
  void QuantizeFp8Blocks(TypedCPtr in, int64_t rows, int64_t cols, Fp8Blocks blocks,
                         Fp8Format fmt, uint8_t* out, float* scale_inv, uint8_t* out_t = nullptr,
                         float* scale_inv_t = nullptr);
  // Block-scaled FP8 GEMM, TN: C (M, N) [+]= A (M, K) · B (N, K)ᵀ with each operand's scales,
  // exact in the scales: per 128-wide chunk c of K (kRow: one chunk, all of K)
  //   C[i, j] = Σ_c sa(i, c) · sb(j, c) · Σ_{k in c} qa[i, k] · qb[j, k]
  // where sa(i, c) is A's scale_inv of row i and chunk c (kRow: of row i) and sb(j, c) B's (kRow:
  // of row j; kBlock128: of block row j / 128). Pairs: a kRow with b kRow (rowwise: forward, dX,
  // dW), a kTile128 with b kBlock128 (blockwise forward and dX: activations or grad-outputs against
  // a weight or its transpose) or with b kTile128 (blockwise dW: both tiled along the tokens).
  // Others abort. C f32 (M, N). The reference (the host composition, which cpu-ref runs): products
  // exact, every sum in double, C rounded once to f32 (after adding C's old value when
  // accumulate); other backends are within the accumulation error of f32 GEMMs
  // (tests/conformance: (K + 4) · 2^-24 · Σ_k |a_k b_k| per element, a_k and b_k the scaled
  // values).
  void GemmFp8Blocks(int64_t M, int64_t N, int64_t K, Fp8BlockOperand a, Fp8BlockOperand b,
                     float* C, bool accumulate);
  // The kBlock128 transpose of codes (rows, cols) with their block scale_inv (ceil(rows / 128),
  // ceil(cols / 128)): out_t (cols, rows) = the codes transposed (TransposeBytes) and scale_inv_t
  // (ceil(cols / 128), ceil(rows / 128)) = the scales transposed; no requantization, the same
  // bytes as QuantizeFp8Blocks' out_t / scale_inv_t of the values that gave the codes. Exact.
  // The scales go through the host (a synchronisation) unless TryTransposeBlockScales runs them.
  void TransposeFp8Block128(const uint8_t* codes, const float* scale_inv, int64_t rows,
                            int64_t cols, uint8_t* out_t, float* scale_inv_t);
  // True when GemmFp8 makes no transposed copies for any layout (the CPU backend, whose GEMM
  // decodes the codes for an f32 BLAS): the FP8 linears' backward then casts the grad-output once,
  // without its transpose, and leaves the inputs untransposed (train/fp8_linear.h).
  bool Fp8GemmAnyLayout() const { return fp8_gemm_any_layout_; }
  // While on, the FP8 GEMMs may accumulate in the tensor cores' native precision instead of
  // promoting partial sums to FP32 every few K blocks (CUDA: CUBLASLT_MATMUL_DESC_FAST_ACCUM;
  // NVIDIA's Hopper FP8 GEMMs keep about 14 mantissa bits in that mode, per the DeepSeek-V3
  // report, section 3.3.2). Off by default; backends that always accumulate in FP32 (CPU) ignore
  // it.
  void SetFp8FastAccumulation(bool on);
  // GEMM autotuning (TuningSpec.gemm_autotune): a backend with several algorithms per GEMM
  // shape times them on the shape's first call and keeps the fastest. Results stay within each
  // algorithm's rounding; only which algorithm runs changes. Default off; the CPU backend has one
  // algorithm and ignores it. Not thread-safe (set between steps).
  void SetGemmAutotune(bool on);
  // Deterministic kernels (TrainingSpec.deterministic; default on): off lets a backend use
  // order-dependent float atomics where that is faster (CUDA: the cuDNN attention backward's dQ).
  // Results then vary in the last bits between runs, within each op's tolerance. The CPU backend
  // is always deterministic and ignores it. Not thread-safe (set between steps).
  void SetDeterministic(bool on);
  // C (M, N) = op(A) · op(B) [+ C if accumulate], op(X) = X or X^T; A is (M, K) or (K, M) when
  // trans_a, B is (K, N) or (N, K) when trans_b. A and B both f32, inputs rounded per `inputs`, or
  // both bf16 (`inputs` then changes nothing: the same result as kBF16 on the widened values). C
  // f32.
  void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, TypedCPtr A,
            TypedCPtr B, float* C, bool accumulate, GemmInputs inputs);
  // Rounds every element to the nearest bfloat16 (ties to even), in place. x (n) f32.
  virtual void RoundToBf16(float* x, int64_t n) = 0;
  // Packs f32 to bfloat16 bit patterns (round to nearest even; NaN stays NaN) and back (exact).
  // in/out (n).
  virtual void PackBf16(const float* in, uint16_t* out, int64_t n) = 0;
  virtual void UnpackBf16(const uint16_t* in, float* out, int64_t n) = 0;

  // ---- elementwise and layers ----------------------------------------------------------------
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
  // x (N, C), w (C) f32; rstd (N) saved for the backward. The result goes to y (N, C) f32, or,
  // with y null, to FP8 through `cast` (out only: fp8(y * scale), amax of y; the reference:
  // RmsNormForward into a scratch y, then CastFp8).
  void RmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C,
                      float* y, float* rstd, const Fp8Cast& cast = {});
  // dx (N, C) = (overwrite) the gradient of x, [+ dres (N, C) f32, the residual branch's
  // gradient, when not null]; dw (C) += (accumulate, deterministic). dy (N, C) is f32, or bf16
  // parts whose f32 sum it is: dy = (dy + dy_b) + dy_c, added in that order and rounded once per
  // addition (dy_c may be null: dy + dy_b; both null: dy alone; bf16 parts need dres). The parts
  // are the dX of the FP8 linears that read the norm's output (q/k/v, gate/up), each from its own
  // GEMM with bf16 output, or one part from their fused GEMM.
  void RmsNormBackward(TypedCPtr dy, const float* x, const float* w, const float* rstd,
                       int64_t N, int64_t C, float* dx, float* dw,
                       const float* dres = nullptr, TypedCPtr dy_b = nullptr,
                       TypedCPtr dy_c = nullptr);

  // RoPE in HF rotate_half convention, in place on x (B, T, H, D), position = t:
  // x1 = x[..., :D/2], x2 = x[..., D/2:], out = (x1*cos - x2*sin, x2*cos + x1*sin) with
  // angle = t * theta^(-2i/D), i in [0, D/2). x f32, or bf16 (each result rounded to bf16); the
  // tokens of bf16 x are ld >= H * D elements apart (0: dense; the q or k part of the fused q/k/v
  // GEMM's (B * T, (H + 2 Hkv) * D) output), elements between them left alone.
  void RopeForward(TypedPtr x, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                   int64_t ld = 0);
  // The inverse rotation (angle -> -angle), in place on the gradient dx (B, T, H, D), f32 or bf16
  // (dense). With `cast` (bf16 dx only), dx is left as it was and the rotated gradient goes to FP8
  // as a (B * T, H * D) matrix (a q or k grad-output: codes, transpose and amax as Fp8Cast says).
  void RopeBackward(TypedPtr dx, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                    const Fp8Cast& cast = {});
  // Replaces the inverse frequencies of the RoPE calls whose theta equals `theta` and whose head
  // dimension is D = 2 * inv_freq.size(): they rotate by angle = f32(t) * inv_freq[i] instead of
  // t * theta^(-2i/D) (RoPE scaling such as Llama 3.1's, computed by the caller). An empty
  // inv_freq restores the default for every call. Not concurrent with RoPE calls.
  void SetRopeInvFreq(float theta, std::vector<float> inv_freq);

  // Causal scaled-dot-product attention, scale 1/sqrt(D), grouped-query when Hkv < H
  // (query head h uses kv head h / (H / Hkv)).
  // q, out (B, T, H, D); k, v (B, T, Hkv, D); lse (B, H, T) f32 log-sum-exp of the scaled scores,
  // saved for the backward (no T x T matrix is kept). q, k, v and out all f32 (opts.bf16: the
  // bf16 recipe, AttentionOptions) or all bf16 (the bf16 recipe; token strides from opts). The
  // reference of the bf16 recipe rounds copies of the inputs, calls the f32 kernel and rounds the
  // output; a fused kernel may differ from it by the rounding of the probabilities to bfloat16
  // before P·V (relative error about 2^-8 per element).
  void AttentionForward(TypedCPtr q, TypedCPtr k, TypedCPtr v, int64_t B, int64_t T,
                        int64_t H, int64_t Hkv, int64_t D, TypedPtr out, float* lse,
                        const AttentionOptions& opts = {});
  // dq (B, T, H, D), dk, dv (B, T, Hkv, D) overwritten. Storage: all f32 (opts.bf16 as in the
  // forward); q, k, v, out bf16 (the saved activations, exactly the values the bf16 recipe rounds
  // to) with dout, dq, dk, dv f32; or all bf16 (q, k, v with token strides from opts; dq, dk, dv
  // dense).
  void AttentionBackward(TypedCPtr q, TypedCPtr k, TypedCPtr v, TypedCPtr out,
                         TypedCPtr dout, const float* lse, int64_t B, int64_t T, int64_t H,
                         int64_t Hkv, int64_t D, TypedPtr dq, TypedPtr dk, TypedPtr dv,
                         const AttentionOptions& opts = {});

  // SwiGLU: h = silu(gate) * up, silu(x) = x * sigmoid(x), over (rows, cols) elements. gate and
  // up have row stride in_ld >= cols (0: dense). f32 gate, up give h f32 (dense). bf16 gate, up
  // (in_ld = 2 * cols, up = gate + cols: both halves of one fused gate/up GEMM output) go to FP8
  // through `cast` with h null: the f32 products' codes (out, dense) and/or their transpose
  // (out_t) and amax; out_t is the transpose of the very codes out receives (a backward
  // recomputes a forward's cast this way). CUDA reads strided bf16 rows 4 elements at a time:
  // cols % 4 == 0, in_ld % 4 == 0, 8-byte aligned gate and up, 4-byte aligned out_t.
  void SwigluForward(TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols,
                     int64_t in_ld, float* h, const Fp8Cast& cast = {});
  // dgate, dup (rows, cols) overwritten from dh (rows, cols); gate and up as in the forward (row
  // stride in_ld, 0: dense). Storage: all f32; gate, up bf16 (saved) with dh, dgate, dup f32; or
  // all bf16 (dense; dgate, dup rounded to bf16). With gate_cast and up_cast (dh, gate, up bf16;
  // dgate, dup null) the two bf16 gradients go to FP8 instead, without their round trip through
  // memory (the reference: the all-bf16 backward, then CastFp8 of each); both casts take one
  // format and one ld (0: dense; 2 * cols with up's out = gate's out + cols: both in one
  // (rows, 2 * cols) matrix).
  void SwigluBackward(TypedCPtr dh, TypedCPtr gate, TypedCPtr up, int64_t rows,
                      int64_t cols, int64_t in_ld, TypedPtr dgate, TypedPtr dup,
                      const Fp8Cast& gate_cast = {}, const Fp8Cast& up_cast = {});

  // Softmax cross-entropy over V classes, fused with its gradient.
  // logits (N, V) f32; losses (N) f32 receives -log softmax[target] in nats; targets (N) int32 in
  // [0, V). The gradient (softmax - onehot(target)) * grad_scale overwrites the logits when
  // dlogits is null, else goes to dlogits (N, V) bf16 (the logits are then left as they were: the
  // gradient of a BF16 head goes to its GEMMs once, in the precision they read it). With
  // grad_scale = 0 only losses are produced (the logits are still overwritten).
  void CrossEntropyForwardBackward(float* logits, const int32_t* targets, int64_t N,
                                   int64_t V, float grad_scale, float* losses,
                                   TypedPtr dlogits = nullptr);

  // ---- optimizer ---------------------------------------------------------------------------
  // out[0] += sum_i x[i]^2. x (n) f32, n may be 0; out (1) f32 device scalar. The sum is taken in
  // a fixed order (deterministic) with at least FP64 accumulation on the CPU backend, then added
  // to out[0] and rounded to f32 once.
  virtual void SumSquares(const float* x, int64_t n, float* out) = 0;
  // AdamW (Loshchilov & Hutter 2019; torch.optim.AdamW semantics) on one flat shard:
  // p -= lr * wd * p; m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'^2;
  // p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps), with g' = g * grad_scale.
  // p, g (n) f32; step t >= 1. m, v (n) both f32, or both bf16 (optimizer.state_precision BF16,
  // as DeepSeek-V3 keeps its AdamW moments, arXiv 2412.19437 sec. 3.3.3: read exactly widened,
  // updated by the same per-element f32 operations, stored rounded to the nearest bf16; this
  // step's update of p uses the f32 moments before that rounding). amax_out (1) f32 device scalar
  // or null: raised to at least max |p| over the updated p (the next FP8 cast's amax, without a
  // second pass over p). p16_out (n) or null: the updated p as bfloat16 bits, equal to PackBf16
  // of it (a BF16 wire shard; the CUDA backend writes them from the update's registers, without
  // reading p again; the CPU backends pack after the update).
  virtual void AdamW(float* p, const float* g, TypedPtr m, TypedPtr v, int64_t n, float lr,
                     float beta1, float beta2, float eps, float weight_decay, int64_t step,
                     float grad_scale, float* amax_out, uint16_t* p16_out) = 0;

 protected:
  // ---- the backends' hooks behind the typed ops ------------------------------------------------
  // Each Try* takes its op's arguments as the op received them, checked, with the row strides
  // out_ld, ld, in_ld, q_ld and kv_ld resolved (0 -> dense). It runs that combination of operand
  // types and FP8 outputs on this backend and returns true, or returns false and the op runs the
  // reference composition (backend.cc) through other combinations. Every backend runs the all-f32
  // combination without FP8 output (Try* never declines it), where the compositions end.
  virtual bool TryCastFp8(TypedCPtr in, int64_t rows, int64_t cols, const float* scale,
                          Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out,
                          int64_t out_ld) = 0;
  virtual bool TryGemmFp8(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                          Fp8Operand a, Fp8Operand b, TypedPtr C, bool accumulate,
                          const float* residual) = 0;
  virtual bool TryGemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, TypedCPtr A,
                       TypedCPtr B, float* C, bool accumulate, GemmInputs inputs) = 0;
  virtual bool TryRmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C,
                                 float* y, float* rstd, const Fp8Cast& cast) = 0;
  virtual bool TryRmsNormBackward(TypedCPtr dy, const float* x, const float* w, const float* rstd,
                                  int64_t N, int64_t C, float* dx, float* dw, const float* dres,
                                  TypedCPtr dy_b, TypedCPtr dy_c) = 0;
  virtual bool TryRopeForward(TypedPtr x, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                              int64_t ld) = 0;
  virtual bool TryRopeBackward(TypedPtr dx, int64_t B, int64_t T, int64_t H, int64_t D,
                               float theta, const Fp8Cast& cast) = 0;
  virtual bool TryAttentionForward(TypedCPtr q, TypedCPtr k, TypedCPtr v, int64_t B, int64_t T,
                                   int64_t H, int64_t Hkv, int64_t D, TypedPtr out, float* lse,
                                   const AttentionOptions& opts) = 0;
  virtual bool TryAttentionBackward(TypedCPtr q, TypedCPtr k, TypedCPtr v, TypedCPtr out,
                                    TypedCPtr dout, const float* lse, int64_t B, int64_t T,
                                    int64_t H, int64_t Hkv, int64_t D, TypedPtr dq, TypedPtr dk,
                                    TypedPtr dv, const AttentionOptions& opts) = 0;
  virtual bool TrySwigluForward(TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols,
                                int64_t in_ld, float* h, const Fp8Cast& cast) = 0;
  virtual bool TrySwigluBackward(TypedCPtr dh, TypedCPtr gate, TypedCPtr up, int64_t rows,
                                 int64_t cols, int64_t in_ld, TypedPtr dgate, TypedPtr dup,
                                 const Fp8Cast& gate_cast, const Fp8Cast& up_cast) = 0;
  virtual bool TryCrossEntropy(float* logits, const int32_t* targets, int64_t N, int64_t V,
                               float grad_scale, float* losses, TypedPtr dlogits) = 0;
  // The block-scaled FP8 ops' hooks. Unlike the others they may decline every combination (the
  // default: the host composition, backend.cc, runs instead, on any backend).
  virtual bool TryQuantizeFp8Blocks(TypedCPtr in, int64_t rows, int64_t cols, Fp8Blocks blocks,
                                    Fp8Format fmt, uint8_t* out, float* scale_inv,
                                    uint8_t* out_t, float* scale_inv_t) {
    (void)in, (void)rows, (void)cols, (void)blocks, (void)fmt, (void)out, (void)scale_inv,
        (void)out_t, (void)scale_inv_t;
    return false;
  }
  virtual bool TryGemmFp8Blocks(int64_t M, int64_t N, int64_t K, Fp8BlockOperand a,
                                Fp8BlockOperand b, float* C, bool accumulate) {
    (void)M, (void)N, (void)K, (void)a, (void)b, (void)C, (void)accumulate;
    return false;
  }
  // out (cols, rows) = in (rows, cols)ᵀ for f32 block scales (TransposeFp8Block128).
  virtual bool TryTransposeBlockScales(const float* in, int64_t rows, int64_t cols, float* out) {
    (void)in, (void)rows, (void)cols, (void)out;
    return false;
  }

  // Applies settings changed through the Set* calls above (all of them, every time).
  virtual void ApplySettings(const ComputeSettings& settings) { (void)settings; }
  // A backend whose GemmFp8 takes every layout as it is sets this (Fp8GemmAnyLayout).
  bool fp8_gemm_any_layout_ = false;

  // The inverse frequencies SetRopeInvFreq set for (D, theta), or null when the default applies.
  const std::vector<float>* RopeInvFreqFor(int64_t D, float theta) const;
  // Changes with every SetRopeInvFreq (a key of the backends' RoPE table caches).
  int64_t rope_freq_version() const { return rope_freq_version_; }

  AllocationAccount account_;  // what Alloc holds, by label (account())

 private:
  ComputeSettings settings_;
  float rope_freq_theta_ = 0.0f;
  std::vector<float> rope_inv_freq_;
  int64_t rope_freq_version_ = 0;
};

// A backend's settings from the environment (common/env_settings.h); all off by default.
struct BackendOptions {
  // CPU: fresh allocations read as NaN (all-ones bytes) until written (FSDP8_CPU_FILL_NAN on).
  bool cpu_fill_nan = false;
  // CUDA: the GPU time of every op, reported every this many seconds (FSDP8_PROFILE_OPS on: 10 s,
  // =<seconds> when above 1; env::ProfileOpsPeriod); 0: off.
  double profile_ops_period_s = 0;
  // CUDA: each GEMM shape's cuBLASLt algorithm choice logged to stderr (FSDP8_GEMM_VERBOSE on).
  bool gemm_verbose = false;
  // Bytes Alloc may hold at once (AllocatedBytes(); CUDA's own workspaces not counted, the CPU
  // backends' scratch slots counted);
  // 0: no limit but the memory itself. The worker's --memory_limit_mb.
  int64_t memory_limit_bytes = 0;

  // The switches read under env::ParseOnOff's rule; a value that breaks it exits the process
  // (env::SwitchOrExit).
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
