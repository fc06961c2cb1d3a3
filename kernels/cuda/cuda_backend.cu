// CudaBackend: memory, streams and the op entry points; kernels live in the per-family .cu files.
#include "kernels/cuda/cuda_backend.h"
#include "kernels/device_memory.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include <cuda_runtime.h>

#include "common/check.h"
#include "kernels/adamw_scalars.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/op_profile.h"

namespace fsdp8 {

namespace {
constexpr size_t kGemmWorkspaceBytes = 32u << 20;  // one workspace per stream (cuBLASLt advice)

// Scratch slots.
constexpr int kSlotA = 0;        // GEMM fallback / bf16 operand A
constexpr int kSlotB = 1;        // GEMM fallback / bf16 operand B
constexpr int kSlotTmp = 2;      // GEMM fallback product
constexpr int kSlotPartials = 3; // reductions
constexpr int kSlotDelta = 4;    // attention backward delta
constexpr int kSlotMisc = 5;     // small host-visible values

}  // namespace

CudaBackend::CudaBackend(int device, const BackendOptions& options)
    : device_(device), limit_(options.memory_limit_bytes) {
  FSDP8_CUDA_CHECK(cudaSetDevice(device_));
  FSDP8_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  FSDP8_CUDA_CHECK(cudaMalloc(&gemm_workspace_, kGemmWorkspaceBytes));
  lt_ = std::make_unique<cuda::LtGemm>(stream_, gemm_workspace_, kGemmWorkspaceBytes);
  lt_->set_verbose(options.gemm_verbose);
  lt_->set_scratch_allocator([this](size_t bytes) { return Alloc(bytes); },
                             [this](void* p) { Free(p); });
  CountWorkspaces();
  // Keep freed blocks in the pool: a step frees and re-allocates the same activation sizes.
  cudaMemPool_t pool;
  FSDP8_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
  uint64_t threshold = UINT64_MAX;
  FSDP8_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
#ifdef FSDP8_WITH_CUDNN
  cudnn_ = std::make_unique<cuda::CudnnAttention>(device_);
  // cuDNN's workspace (1 GiB for the deterministic backward at the 1b shapes) from the stream-
  // ordered pool per call: counted in AllocatedBytes while attention runs, free the rest of the step.
  // Out of memory there throws std::bad_alloc, as for the backend's other transient buffers (a
  // refusal would switch cuDNN off for the rest of the job): the worker fails the job with
  // RESOURCE_EXHAUSTED and drops it, backend included.
  cudnn_->set_workspace_allocator(
      [this](size_t bytes) {
        void* p = Alloc(bytes);
        if (p == nullptr) throw std::bad_alloc();
        return p;
      },
      [this](void* p) { Free(p); });
#endif
  if (options.profile_ops_period_s > 0) {
    prof_ = std::make_unique<cuda::OpProfile>(stream_, device_, options.profile_ops_period_s);
  }
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  prof_.reset();
  lt_.reset();
#ifdef FSDP8_WITH_CUDNN
  cudnn_.reset();
#endif
  for (auto& kv : sizes_) cudaFreeAsync(reinterpret_cast<void*>(kv.first), stream_);
  cudaStreamSynchronize(stream_);
  for (int i = 0; i < kScratchSlots; ++i) cudaFree(scratch_[i]);
  cudaFree(rope_table_);
  cudaFree(gemm_workspace_);
  cudaStreamDestroy(stream_);
}

void CudaBackend::Bind() const { FSDP8_CUDA_CHECK(cudaSetDevice(device_)); }

// ---- memory ------------------------------------------------------------------------------------

void* CudaBackend::Alloc(size_t bytes) {
  Bind();
  if (limit_ > 0 && allocated_ + static_cast<int64_t>(bytes) > limit_) return nullptr;
  void* p = nullptr;
  const cudaError_t e = cudaMallocAsync(&p, bytes == 0 ? 1 : bytes, stream_);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear the sticky-free allocation error
    return nullptr;
  }
  FSDP8_CUDA_CHECK(e);
  sizes_[reinterpret_cast<uintptr_t>(p)] = bytes;
  allocated_ += static_cast<int64_t>(bytes);
  peak_ = std::max(peak_, allocated_ + workspace_);
  account_.Allocated(p, static_cast<int64_t>(bytes));
  return p;
}

void CudaBackend::ApplySettings(const ComputeSettings& settings) {
  fp8_fast_accum_ = settings.fp8_fast_accumulation;
  lt_->set_autotune(settings.gemm_autotune);
#ifdef FSDP8_WITH_CUDNN
  cudnn_->set_deterministic_backward(settings.deterministic);
#endif
}

void CudaBackend::Free(void* p) {
  if (p == nullptr) return;
  Bind();
  auto it = sizes_.find(reinterpret_cast<uintptr_t>(p));
  FSDP8_CHECK(it != sizes_.end()) << "Free of a pointer not from Alloc";
  // Stream-ordered: work already enqueued on the compute stream (and collectives ordered before
  // it) still reads p; later allocations reuse it only after that work.
  FSDP8_CUDA_CHECK(cudaFreeAsync(p, stream_));
  allocated_ -= static_cast<int64_t>(it->second);
  account_.Freed(p);
  sizes_.erase(it);
}

size_t CudaBackend::BytesToEndOfAllocation(const void* p) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = sizes_.upper_bound(a);
  if (it == sizes_.begin()) return 0;
  --it;
  if (a >= it->first + it->second) return 0;
  return it->first + it->second - a;
}

void CudaBackend::CopyToDevice(void* dst, const void* host_src, size_t bytes) {
  if (bytes == 0) return;
  Bind();
  // Synchronous with respect to the host buffer: the caller may reuse host_src on return.
  FSDP8_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
  FSDP8_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::CopyToHost(void* host_dst, const void* src, size_t bytes) {
  Bind();
  if (bytes > 0) FSDP8_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  FSDP8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (prof_) prof_->Harvest(/*block=*/false);
}

void CudaBackend::Copy(void* dst, const void* src, size_t bytes) {
  cuda::OpScope op_scope(prof_.get(), "Copy");
  if (bytes == 0) return;
  Bind();
  FSDP8_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::Memset(void* dst, int value, size_t bytes) {
  cuda::OpScope op_scope(prof_.get(), "Memset");
  if (bytes == 0) return;
  Bind();
  FSDP8_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream_));
}

void CudaBackend::Synchronize() {
  Bind();
  FSDP8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (prof_) prof_->Harvest(/*block=*/false);
}

void CudaBackend::CountWorkspaces() {
  int64_t w = kGemmWorkspaceBytes + static_cast<int64_t>(rope_table_bytes_);
  for (size_t b : scratch_bytes_) w += static_cast<int64_t>(b);
  workspace_ = w;
  peak_ = std::max(peak_, allocated_ + workspace_);
}

void* CudaBackend::Scratch(int i, size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (scratch_bytes_[i] < bytes) {
    FSDP8_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (scratch_[i] != nullptr) FSDP8_CUDA_CHECK(cudaFree(scratch_[i]));
    scratch_[i] = nullptr;
    size_t grow = bytes + bytes / 4;
    FSDP8_CUDA_CHECK(cudaMalloc(&scratch_[i], grow));
    scratch_bytes_[i] = grow;
    CountWorkspaces();
  }
  return scratch_[i];
}

// ---- FP8 ---------------------------------------------------------------------------------------

void CudaBackend::CastToFp8(const float* in, uint8_t* out, int64_t n, const float* scale,
                            Fp8Format fmt, float* amax_out) {
  cuda::OpScope op_scope(prof_.get(), "CastToFp8");
  Bind();
  cuda::LaunchCastToFp8(in, out, n, scale, fmt, amax_out, stream_);
}

void CudaBackend::CastTransposeFp8(const float* in, int64_t rows, int64_t cols, const float* scale,
                                   Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out) {
  cuda::OpScope op_scope(prof_.get(), "CastTransposeFp8");
  Bind();
  cuda::LaunchCastTransposeFp8(in, rows, cols, scale, fmt, out, out_t, amax_out, stream_);
}

void CudaBackend::TransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) {
  cuda::OpScope op_scope(prof_.get(), "TransposeBytes");
  Bind();
  cuda::LaunchTransposeBytes(in, rows, cols, out, stream_);
}

void CudaBackend::DequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                                Fp8Format fmt) {
  cuda::OpScope op_scope(prof_.get(), "DequantizeFp8");
  Bind();
  cuda::LaunchDequantizeFp8(in, out, n, scale_inv, fmt, stream_);
}

void CudaBackend::Fp8ScalesFromAmax(const float* amax, int64_t n, float fp8_max, int margin,
                                    float* scale, float* scale_inv, int64_t stride) {
  cuda::OpScope op_scope(prof_.get(), "Fp8ScalesFromAmax");
  Bind();
  FSDP8_CHECK(n >= 0 && stride >= 1 && margin >= 0) << "Fp8ScalesFromAmax: bad arguments";
  cuda::LaunchFp8ScalesFromAmax(amax, n, fp8_max, margin, scale, scale_inv, stride, stream_);
}

void CudaBackend::GroupMax(const float* in, const int32_t* group, int64_t n, float* out) {
  cuda::OpScope op_scope(prof_.get(), "GroupMax");
  Bind();
  cuda::LaunchGroupMax(in, group, n, out, stream_);
}

void CudaBackend::AmaxAccumulate(const float* in, int64_t n, float* amax_out) {
  cuda::OpScope op_scope(prof_.get(), "AmaxAccumulate");
  Bind();
  cuda::LaunchAmaxAccumulate(in, n, amax_out, stream_);
}

namespace {
cudaDataType_t Fp8Type(Fp8Format f) {
  return f == Fp8Format::kE5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
}

// cuBLASLt's view of our TN FP8 product C (M, N) = A (M, K) · B (N, K)^T (see gemm.h): cuBLASLt A
// is our B, its B our A; fast_accum for the forward GEMMs (SetFp8FastAccumulation); c_type and
// accumulate as the caller needs.
cuda::LtProblem Fp8Problem(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format a_fmt,
                           const uint8_t* B, Fp8Format b_fmt, const void* C, bool fast_accum) {
  cuda::LtProblem p;
  p.m = N;
  p.n = M;
  p.k = K;
  p.trans_a = true;
  p.trans_b = false;
  p.a_type = Fp8Type(b_fmt);
  p.b_type = Fp8Type(a_fmt);
  p.lda = K;
  p.ldb = K;
  p.ldc = N;
  p.scaled = true;
  p.fast_accum = fast_accum;
  p.align_a = cuda::PointerAlignment(B);
  p.align_b = cuda::PointerAlignment(A);
  p.align_c = cuda::PointerAlignment(C);
  return p;
}
}  // namespace

void CudaBackend::GemmFp8(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format a_fmt,
                          const float* a_scale_inv, const uint8_t* B, Fp8Format b_fmt,
                          const float* b_scale_inv, float* C, bool accumulate) {
  cuda::OpScope op_scope(prof_.get(), "GemmFp8", M, N, K);
  Bind();
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate) FSDP8_CUDA_CHECK(cudaMemsetAsync(C, 0, sizeof(float) * M * N, stream_));
    return;
  }
  // See gemm.h: column-major D (N, M) = B_stored(K, N)^T · A_stored(K, M).
  cuda::LtProblem p = Fp8Problem(M, N, K, A, a_fmt, B, b_fmt, C, fp8_fast_accum_);
  p.accumulate = accumulate;
  const bool both_e5m2 = a_fmt == Fp8Format::kE5M2 && b_fmt == Fp8Format::kE5M2;
  if (!both_e5m2 && lt_->Run(p, B, A, C, b_scale_inv, a_scale_inv)) return;

  // Fallback (shapes cuBLASLt FP8 refuses): exact decode, f32 GEMM, then the scales.
  ++gemm_fp8_fallbacks_;
  float* a32 = static_cast<float*>(Scratch(kSlotA, sizeof(float) * M * K));
  float* b32 = static_cast<float*>(Scratch(kSlotB, sizeof(float) * N * K));
  float* tmp = static_cast<float*>(Scratch(kSlotTmp, sizeof(float) * M * N));
  cuda::LaunchDequantizeFp8(A, a32, M * K, nullptr, a_fmt, stream_);
  cuda::LaunchDequantizeFp8(B, b32, N * K, nullptr, b_fmt, stream_);
  Gemm(false, true, M, N, K, a32, b32, tmp, false, GemmInputs::kF32);
  cuda::LaunchScaleAccumulate(tmp, a_scale_inv, b_scale_inv, C, M * N, accumulate, stream_);
}

namespace {
// Backend::Gemm's row-major C (M, N) = op(A) op(B) as cuBLASLt's column-major problem
// D (N, M) = op(B)^T · op(A)^T (gemm.h): our B (K, N) is stored col-major (N, K), no op, and
// (N, K) takes op T; likewise A. Types and operand alignments are the caller's.
cuda::LtProblem RowMajorProblem(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                                const float* C, bool accumulate) {
  cuda::LtProblem p;
  p.m = N;
  p.n = M;
  p.k = K;
  p.trans_a = trans_b;
  p.lda = trans_b ? K : N;
  p.trans_b = trans_a;
  p.ldb = trans_a ? M : K;
  p.ldc = N;
  p.accumulate = accumulate;
  p.align_c = cuda::PointerAlignment(C);
  return p;
}
}  // namespace

void CudaBackend::GemmBf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                           const uint16_t* A16, const uint16_t* B16, float* C, bool accumulate) {
  cuda::OpScope op_scope(prof_.get(), "GemmBf16", M, N, K);
  Bind();
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate) FSDP8_CUDA_CHECK(cudaMemsetAsync(C, 0, sizeof(float) * M * N, stream_));
    return;
  }
  // As Gemm's bf16 path, without the packs.
  cuda::LtProblem p = RowMajorProblem(trans_a, trans_b, M, N, K, C, accumulate);
  p.a_type = CUDA_R_16BF;
  p.b_type = CUDA_R_16BF;
  p.align_a = cuda::PointerAlignment(B16);
  p.align_b = cuda::PointerAlignment(A16);
  if (lt_->Run(p, B16, A16, C, nullptr, nullptr)) return;
  // No bf16 algorithm for this shape: the same values in f32 (bf16 values are exact in f32).
  Backend::Gemm(trans_a, trans_b, M, N, K, A16, B16, C, accumulate, GemmInputs::kBF16);
}

void CudaBackend::Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
                       const float* B, float* C, bool accumulate, GemmInputs inputs) {
  cuda::OpScope op_scope(prof_.get(), "Gemm", M, N, K);
  Bind();
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate) FSDP8_CUDA_CHECK(cudaMemsetAsync(C, 0, sizeof(float) * M * N, stream_));
    return;
  }
  if (inputs == GemmInputs::kBF16) {
    // The inputs rounded to bf16 once, then the bf16-operand GEMM (and its f32 fallback).
    uint16_t* a16 = static_cast<uint16_t*>(Scratch(kSlotA, sizeof(uint16_t) * M * K));
    uint16_t* b16 = static_cast<uint16_t*>(Scratch(kSlotB, sizeof(uint16_t) * N * K));
    cuda::LaunchPackBf16(A, a16, M * K, stream_);
    cuda::LaunchPackBf16(B, b16, N * K, stream_);
    GemmBf16(trans_a, trans_b, M, N, K, a16, b16, C, accumulate);
    return;
  }
  cuda::LtProblem p = RowMajorProblem(trans_a, trans_b, M, N, K, C, accumulate);
  p.a_type = CUDA_R_32F;
  p.b_type = CUDA_R_32F;
  p.align_a = cuda::PointerAlignment(B);
  p.align_b = cuda::PointerAlignment(A);
  const bool ok = lt_->Run(p, B, A, C, nullptr, nullptr);
  FSDP8_CHECK(ok) << "cuBLASLt has no f32 algorithm for this GEMM";
}

void CudaBackend::RoundToBf16(float* x, int64_t n) {
  cuda::OpScope op_scope(prof_.get(), "RoundToBf16");
  Bind();
  cuda::LaunchRoundToBf16(x, n, stream_);
}

void CudaBackend::PackBf16(const float* in, uint16_t* out, int64_t n) {
  cuda::OpScope op_scope(prof_.get(), "PackBf16");
  Bind();
  cuda::LaunchPackBf16(in, out, n, stream_);
}

void CudaBackend::UnpackBf16(const uint16_t* in, float* out, int64_t n) {
  cuda::OpScope op_scope(prof_.get(), "UnpackBf16");
  Bind();
  cuda::LaunchUnpackBf16(in, out, n, stream_);
}

// ---- elementwise and layers ----------------------------------------------------------------------

void CudaBackend::Add(const float* a, const float* b, float* out, int64_t n) {
  cuda::OpScope op_scope(prof_.get(), "Add");
  Bind();
  cuda::LaunchAdd(a, b, out, n, stream_);
}

void CudaBackend::Axpy(float alpha, const float* x, float* y, int64_t n) {
  cuda::OpScope op_scope(prof_.get(), "Axpy");
  Bind();
  cuda::LaunchAxpy(alpha, x, y, n, stream_);
}

void CudaBackend::EmbeddingForward(const int32_t* tokens, int64_t N, const float* table, int64_t C,
                                   float* out) {
  cuda::OpScope op_scope(prof_.get(), "EmbeddingForward");
  Bind();
  cuda::LaunchEmbeddingForward(tokens, N, table, C, out, stream_);
}

void CudaBackend::EmbeddingBackward(const int32_t* tokens, int64_t N, const float* dout, int64_t C,
                                    float* dtable) {
  cuda::OpScope op_scope(prof_.get(), "EmbeddingBackward");
  Bind();
  if (N <= 0 || C <= 0) return;
  int64_t V = static_cast<int64_t>(BytesToEndOfAllocation(dtable) / (sizeof(float) * C));
  if (V <= 0) {
    // dtable is not inside an Alloc'd buffer: take V = max token + 1 (one host round trip).
    std::vector<int32_t> host(static_cast<size_t>(N));
    CopyToHost(host.data(), tokens, sizeof(int32_t) * N);
    int32_t mx = 0;
    for (int32_t t : host) mx = t > mx ? t : mx;
    V = static_cast<int64_t>(mx) + 1;
  }
  cuda::LaunchEmbeddingBackward(tokens, N, dout, C, dtable, V, stream_);
}

void CudaBackend::RmsNormForwardF32(const float* x, const float* w, float eps, int64_t N, int64_t C,
                                    float* y, float* rstd) {
  cuda::OpScope op_scope(prof_.get(), "RmsNormForward");
  Bind();
  cuda::LaunchRmsNormForward(x, w, eps, N, C, y, rstd, stream_);
}

void CudaBackend::RmsNormBackward(const float* dy, const float* x, const float* w, const float* rstd,
                                  int64_t N, int64_t C, float* dx, float* dw) {
  cuda::OpScope op_scope(prof_.get(), "RmsNormBackward");
  Bind();
  float* partials = static_cast<float*>(
      Scratch(kSlotPartials, sizeof(float) * cuda::RmsNormBackwardScratchFloats(N, C)));
  cuda::LaunchRmsNormBackward(dy, x, w, rstd, N, C, dx, dw, partials, stream_);
}

void CudaBackend::RmsNormCastFp8(const float* x, const float* w, float eps, int64_t N, int64_t C,
                                 float* rstd, const float* scale, Fp8Format fmt, uint8_t* out,
                                 float* amax_out) {
  cuda::OpScope op_scope(prof_.get(), "RmsNormCastFp8");
  Bind();
  cuda::LaunchRmsNormCastFp8(x, w, eps, N, C, rstd, scale, fmt, out, amax_out, stream_);
}

void CudaBackend::RmsNormBackwardAdd(const float* dy, const float* x, const float* w,
                                     const float* rstd, const float* dres, int64_t N, int64_t C,
                                     float* dx, float* dw) {
  cuda::OpScope op_scope(prof_.get(), "RmsNormBackwardAdd");
  Bind();
  float* partials = static_cast<float*>(
      Scratch(kSlotPartials, sizeof(float) * cuda::RmsNormBackwardScratchFloats(N, C)));
  cuda::LaunchRmsNormBackward(dy, x, w, rstd, N, C, dx, dw, partials, stream_, dres);
}

void CudaBackend::RmsNormBackwardAddBf16Parts(const uint16_t* dy_a, const uint16_t* dy_b,
                                              const uint16_t* dy_c, const float* x,
                                              const float* w, const float* rstd,
                                              const float* dres, int64_t N, int64_t C, float* dx,
                                              float* dw) {
  {
    cuda::OpScope op_scope(prof_.get(), "RmsNormBackwardAddBf16Parts");
    Bind();
    float* partials = static_cast<float*>(
        Scratch(kSlotPartials, sizeof(float) * cuda::RmsNormBackwardScratchFloats(N, C)));
    if (cuda::LaunchRmsNormBackwardBf16Parts(dy_a, dy_b, dy_c, x, w, rstd, N, C, dx, dw, partials,
                                             stream_, dres)) {
      return;
    }
  }
  Backend::RmsNormBackward(dy_a, x, w, rstd, N, C, dx, dw, dres, dy_b, dy_c);
}

void CudaBackend::EnsureRopeTable(int64_t T, int64_t D, float theta) {
  if (rope_T_ == T && rope_D_ == D && rope_theta_ == theta && rope_version_ == rope_freq_version()) {
    return;
  }
  const size_t bytes = sizeof(float) * 2 * T * (D / 2);
  if (rope_table_bytes_ < bytes) {
    FSDP8_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (rope_table_ != nullptr) FSDP8_CUDA_CHECK(cudaFree(rope_table_));
    FSDP8_CUDA_CHECK(cudaMalloc(&rope_table_, bytes == 0 ? 1 : bytes));
    rope_table_bytes_ = bytes;
    CountWorkspaces();
  }
  if (const std::vector<float>* inv_freq = RopeInvFreqFor(D, theta); inv_freq != nullptr) {
    // Set frequencies: the table of RopeTableKernel's rule (f32 angle, cos/sin in double) on the
    // host, once per job.
    const int64_t half = D / 2;
    std::vector<float> host(static_cast<size_t>(2 * T * half));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const double a = static_cast<double>(static_cast<float>(t) * (*inv_freq)[i]);
        host[2 * (t * half + i)] = static_cast<float>(std::cos(a));
        host[2 * (t * half + i) + 1] = static_cast<float>(std::sin(a));
      }
    }
    FSDP8_CUDA_CHECK(cudaMemcpyAsync(rope_table_, host.data(), bytes, cudaMemcpyHostToDevice, stream_));
    FSDP8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } else {
    cuda::LaunchRopeTable(T, D, theta, rope_table_, stream_);
  }
  rope_version_ = rope_freq_version();
  rope_T_ = T;
  rope_D_ = D;
  rope_theta_ = theta;
}

void CudaBackend::RopeForward(float* x, int64_t B, int64_t T, int64_t H, int64_t D, float theta) {
  cuda::OpScope op_scope(prof_.get(), "RopeForward");
  Bind();
  EnsureRopeTable(T, D, theta);
  cuda::LaunchRopeApply(x, B, T, H, D, rope_table_, 1.0f, stream_);
}

void CudaBackend::RopeBackward(float* dx, int64_t B, int64_t T, int64_t H, int64_t D, float theta) {
  cuda::OpScope op_scope(prof_.get(), "RopeBackward");
  Bind();
  EnsureRopeTable(T, D, theta);
  cuda::LaunchRopeApply(dx, B, T, H, D, rope_table_, -1.0f, stream_);
}

void CudaBackend::AttentionForward(const float* q, const float* k, const float* v, int64_t B,
                                   int64_t T, int64_t H, int64_t Hkv, int64_t D, float* out,
                                   float* lse) {
  cuda::OpScope op_scope(prof_.get(), "AttentionForward");
  Bind();
  cuda::LaunchAttentionForward(q, k, v, B, T, H, Hkv, D, out, lse, stream_);
}

void CudaBackend::AttentionBackward(const float* q, const float* k, const float* v, const float* out,
                                    const float* dout, const float* lse, int64_t B, int64_t T,
                                    int64_t H, int64_t Hkv, int64_t D, float* dq, float* dk,
                                    float* dv) {
  cuda::OpScope op_scope(prof_.get(), "AttentionBackward");
  Bind();
  float* delta = static_cast<float*>(Scratch(kSlotDelta, sizeof(float) * B * H * T));
  cuda::LaunchAttentionBackward(q, k, v, out, dout, lse, B, T, H, Hkv, D, dq, dk, dv, delta, stream_);
}

void CudaBackend::AttentionForwardBf16Compute(const float* q, const float* k, const float* v,
                                              int64_t B, int64_t T, int64_t H, int64_t Hkv,
                                              int64_t D, float* out, float* lse) {
  cuda::OpScope op_scope(prof_.get(), "AttentionForwardBf16Compute");
#ifdef FSDP8_WITH_CUDNN
  if (CudnnAttentionUsable(D)) {
    Bind();
    const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
    auto* q16 = static_cast<uint16_t*>(Alloc(nq * 2));
    auto* k16 = static_cast<uint16_t*>(Alloc(nk * 2));
    auto* v16 = static_cast<uint16_t*>(Alloc(nk * 2));
    auto* o16 = static_cast<uint16_t*>(Alloc(nq * 2));
    if (!(q16 && k16 && v16 && o16)) {  // out of memory: give back what was taken
      for (void* p : {static_cast<void*>(q16), static_cast<void*>(k16), static_cast<void*>(v16),
                      static_cast<void*>(o16)})
        if (p != nullptr) Free(p);
      throw std::bad_alloc();
    }
    PackBf16(q, q16, nq);
    PackBf16(k, k16, nk);
    PackBf16(v, v16, nk);
    std::string err;
    const bool ok = cudnn_->Forward(q16, k16, v16, o16, lse, B, T, H, Hkv, D, stream_, &err);
    if (ok) UnpackBf16(o16, out, nq);
    for (void* p : {static_cast<void*>(q16), static_cast<void*>(k16), static_cast<void*>(v16),
                    static_cast<void*>(o16)}) {
      Free(p);
    }
    if (ok) return;
    CudnnRefused(err);
  }
#endif
  Backend::AttentionForward(q, k, v, B, T, H, Hkv, D, out, lse, AttentionOptions{true});
}

void CudaBackend::AttentionBackwardBf16Compute(const float* q, const float* k, const float* v,
                                               const float* out, const float* dout,
                                               const float* lse, int64_t B, int64_t T, int64_t H,
                                               int64_t Hkv, int64_t D, float* dq, float* dk,
                                               float* dv) {
  cuda::OpScope op_scope(prof_.get(), "AttentionBackwardBf16Compute");
#ifdef FSDP8_WITH_CUDNN
  if (CudnnAttentionUsable(D)) {
    // Round the operands to bf16 once and take the saved-activation path (same cuDNN call).
    Bind();
    const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
    auto* buf = static_cast<uint16_t*>(Alloc((2 * nq + 2 * nk) * 2));  // q, o (nq); k, v (nk)
    if (buf == nullptr) throw std::bad_alloc();  // out of memory (backend.h, Errors)
    uint16_t *q16 = buf, *o16 = q16 + nq, *k16 = o16 + nq, *v16 = k16 + nk;
    PackBf16(q, q16, nq);
    PackBf16(k, k16, nk);
    PackBf16(v, v16, nk);
    PackBf16(out, o16, nq);  // exact: out holds the forward's bf16 output
    AttentionBackwardBf16Saved(q16, k16, v16, o16, dout, lse, B, T, H, Hkv, D, dq, dk, dv);
    Free(buf);
    return;
  }
#endif
  Backend::AttentionBackward(q, k, v, out, dout, lse, B, T, H, Hkv, D, dq, dk, dv,
                             AttentionOptions{true});
}

void CudaBackend::AttentionBackwardBf16Saved(const uint16_t* q16, const uint16_t* k16,
                                             const uint16_t* v16, const uint16_t* out16,
                                             const float* dout, const float* lse, int64_t B,
                                             int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                             float* dq, float* dk, float* dv) {
  cuda::OpScope op_scope(prof_.get(), "AttentionBackwardBf16Saved");
#ifdef FSDP8_WITH_CUDNN
  if (CudnnAttentionUsable(D)) {
    Bind();
    const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
    // do, dq (nq) and dk, dv (nk) in bf16.
    auto* buf = static_cast<uint16_t*>(Alloc((2 * nq + 2 * nk) * 2));
    if (buf == nullptr) throw std::bad_alloc();  // out of memory (backend.h, Errors)
    uint16_t *do16 = buf, *dq16 = do16 + nq, *dk16 = dq16 + nq, *dv16 = dk16 + nk;
    PackBf16(dout, do16, nq);
    std::string err;
    const bool ok = cudnn_->Backward(q16, k16, v16, out16, do16, lse, dq16, dk16, dv16, B, T, H,
                                     Hkv, D, stream_, &err);
    if (ok) {
      UnpackBf16(dq16, dq, nq);
      UnpackBf16(dk16, dk, nk);
      UnpackBf16(dv16, dv, nk);
    }
    Free(buf);
    if (ok) return;
    CudnnRefused(err);
  }
#endif
  Backend::AttentionBackward(q16, k16, v16, out16, dout, lse, B, T, H, Hkv, D, dq, dk, dv,
                             AttentionOptions{true});
}

void CudaBackend::SwigluBackwardBf16Saved(const float* dh, const uint16_t* gate16,
                                          const uint16_t* up16, int64_t n, float* dgate,
                                          float* dup) {
  cuda::OpScope op_scope(prof_.get(), "SwigluBackwardBf16Saved");
  Bind();
  cuda::LaunchSwigluBackwardBf16Saved(dh, gate16, up16, n, dgate, dup, stream_);
}

void CudaBackend::SwigluForward(const float* gate, const float* up, int64_t n, float* h) {
  cuda::OpScope op_scope(prof_.get(), "SwigluForward");
  Bind();
  cuda::LaunchSwigluForward(gate, up, n, h, stream_);
}

void CudaBackend::SwigluBackward(const float* dh, const float* gate, const float* up, int64_t n,
                                 float* dgate, float* dup) {
  cuda::OpScope op_scope(prof_.get(), "SwigluBackward");
  Bind();
  cuda::LaunchSwigluBackward(dh, gate, up, n, dgate, dup, stream_);
}

void CudaBackend::CrossEntropyForwardBackwardBf16Grad(const float* logits, const int32_t* targets,
                                                      int64_t N, int64_t V, float grad_scale,
                                                      float* losses, uint16_t* dlogits16) {
  cuda::OpScope op_scope(prof_.get(), "CrossEntropyForwardBackwardBf16Grad");
  Bind();
  cuda::LaunchCrossEntropyBf16Grad(logits, targets, N, V, grad_scale, losses, dlogits16, stream_);
}

void CudaBackend::CrossEntropyF32(float* logits, const int32_t* targets, int64_t N, int64_t V,
                                  float grad_scale, float* losses) {
  cuda::OpScope op_scope(prof_.get(), "CrossEntropyForwardBackward");
  Bind();
  cuda::LaunchCrossEntropy(logits, targets, N, V, grad_scale, losses, stream_);
}

// ---- bfloat16 activations -------------------------------------------------------------------------

void CudaBackend::GemmFp8AddResidual(int64_t M, int64_t N, int64_t K, const uint8_t* A,
                                     Fp8Format a_fmt, const float* a_scale_inv, const uint8_t* B,
                                     Fp8Format b_fmt, const float* b_scale_inv, const float* R,
                                     float* D) {
  cuda::OpScope op_scope(prof_.get(), "GemmFp8AddResidual", M, N, K);
  Bind();
  if (M <= 0 || N <= 0) return;
  const bool both_e5m2 = a_fmt == Fp8Format::kE5M2 && b_fmt == Fp8Format::kE5M2;
  if (K > 0 && !both_e5m2 && cuda::PointerAlignment(R) >= cuda::PointerAlignment(D)) {
    // Accumulating, C = R.
    cuda::LtProblem p = Fp8Problem(M, N, K, A, a_fmt, B, b_fmt, D, fp8_fast_accum_);
    p.accumulate = true;
    if (lt_->Run(p, B, A, D, b_scale_inv, a_scale_inv, R)) return;
  }
  Backend::GemmFp8(false, true, M, N, K, {A, a_fmt, a_scale_inv}, {B, b_fmt, b_scale_inv}, D, false,
                   R);
}

void CudaBackend::GemmFp8Bf16(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format a_fmt,
                              const float* a_scale_inv, const uint8_t* B, Fp8Format b_fmt,
                              const float* b_scale_inv, uint16_t* C16) {
  cuda::OpScope op_scope(prof_.get(), "GemmFp8Bf16", M, N, K);
  Bind();
  if (M <= 0 || N <= 0) return;
  const bool both_e5m2 = a_fmt == Fp8Format::kE5M2 && b_fmt == Fp8Format::kE5M2;
  if (K > 0 && !both_e5m2) {
    cuda::LtProblem p = Fp8Problem(M, N, K, A, a_fmt, B, b_fmt, C16, fp8_fast_accum_);
    p.c_type = CUDA_R_16BF;
    if (lt_->Run(p, B, A, C16, b_scale_inv, a_scale_inv)) return;
  }
  Backend::GemmFp8(false, true, M, N, K, {A, a_fmt, a_scale_inv}, {B, b_fmt, b_scale_inv}, C16,
                   false);
}

void CudaBackend::CastToFp8Bf16(const uint16_t* in16, uint8_t* out, int64_t n, const float* scale,
                                Fp8Format fmt, float* amax_out) {
  cuda::OpScope op_scope(prof_.get(), "CastToFp8Bf16");
  Bind();
  cuda::LaunchCastToFp8Bf16(in16, out, n, scale, fmt, amax_out, stream_);
}

void CudaBackend::CastTransposeFp8Bf16(const uint16_t* in16, int64_t rows, int64_t cols,
                                       const float* scale, Fp8Format fmt, uint8_t* out,
                                       uint8_t* out_t, float* amax_out, int64_t out_ld) {
  cuda::OpScope op_scope(prof_.get(), "CastTransposeFp8Bf16");
  Bind();
  cuda::LaunchCastTransposeFp8Bf16(in16, rows, cols, scale, fmt, out, out_t, amax_out, out_ld,
                                   stream_);
}

void CudaBackend::RopeForwardBf16(uint16_t* x16, int64_t B, int64_t T, int64_t H, int64_t D,
                                  float theta, int64_t ld) {
  cuda::OpScope op_scope(prof_.get(), "RopeForwardBf16");
  Bind();
  EnsureRopeTable(T, D, theta);
  cuda::LaunchRopeApplyBf16(x16, B, T, H, D, ld, rope_table_, 1.0f, stream_);
}

void CudaBackend::RopeBackwardBf16(uint16_t* dx16, int64_t B, int64_t T, int64_t H, int64_t D,
                                   float theta) {
  cuda::OpScope op_scope(prof_.get(), "RopeBackwardBf16");
  Bind();
  EnsureRopeTable(T, D, theta);
  cuda::LaunchRopeApplyBf16(dx16, B, T, H, D, H * D, rope_table_, -1.0f, stream_);
}

void CudaBackend::RopeBackwardCastTransposeFp8Bf16(const uint16_t* dx16, int64_t B, int64_t T,
                                                   int64_t H, int64_t D, float theta,
                                                   const float* scale, Fp8Format fmt, uint8_t* out,
                                                   uint8_t* out_t, float* amax_out,
                                                   int64_t out_ld) {
  if (D % 8 != 0 || reinterpret_cast<uintptr_t>(dx16) % 8 != 0) {  // the unfused reference
    Backend::RopeBackward(const_cast<uint16_t*>(dx16), B, T, H, D, theta,
                          Fp8Cast{scale, fmt, out, out_t, amax_out, out_ld});
    return;
  }
  cuda::OpScope op_scope(prof_.get(), "RopeBackwardCastTransposeFp8Bf16");
  Bind();
  EnsureRopeTable(T, D, theta);
  cuda::LaunchRopeBackwardCastTransposeFp8Bf16(dx16, B, T, H, D, rope_table_, scale, fmt, out,
                                               out_t, amax_out, out_ld, stream_);
}

#ifdef FSDP8_WITH_CUDNN
void CudaBackend::CudnnRefused(const std::string& err) {
  fprintf(stderr, "fsdp8: cuDNN attention refused (%s); using the reference BF16 attention\n",
          err.c_str());
  cudnn_failed_ = true;
}
#endif

bool CudaBackend::CudnnAttentionUsable(int64_t D) const {
#ifdef FSDP8_WITH_CUDNN
  return !cudnn_failed_ && D % 8 == 0 && D <= 128;
#else
  (void)D;
  return false;
#endif
}

void CudaBackend::AttentionForwardBf16Packed(const uint16_t* q16, const uint16_t* k16,
                                             const uint16_t* v16, int64_t B, int64_t T, int64_t H,
                                             int64_t Hkv, int64_t D, uint16_t* out16, float* lse,
                                             int64_t q_ld, int64_t kv_ld) {
  cuda::OpScope op_scope(prof_.get(), "AttentionForwardBf16Packed");
#ifdef FSDP8_WITH_CUDNN
  if (CudnnAttentionUsable(D)) {
    Bind();
    std::string err;
    if (cudnn_->Forward(q16, k16, v16, out16, lse, B, T, H, Hkv, D, stream_, &err, q_ld, kv_ld)) {
      return;
    }
    CudnnRefused(err);
  }
#endif
  Backend::AttentionForward(q16, k16, v16, B, T, H, Hkv, D, out16, lse,
                            AttentionOptions{true, q_ld, kv_ld});
}

void CudaBackend::AttentionBackwardBf16SavedTo16(const uint16_t* q16, const uint16_t* k16,
                                                 const uint16_t* v16, const uint16_t* out16,
                                                 const uint16_t* dout16, const float* lse, int64_t B,
                                                 int64_t T, int64_t H, int64_t Hkv, int64_t D,
                                                 uint16_t* dq16, uint16_t* dk16, uint16_t* dv16,
                                                 int64_t q_ld, int64_t kv_ld) {
  cuda::OpScope op_scope(prof_.get(), "AttentionBackwardBf16SavedTo16");
#ifdef FSDP8_WITH_CUDNN
  if (CudnnAttentionUsable(D)) {
    Bind();
    std::string err;
    if (cudnn_->Backward(q16, k16, v16, out16, dout16, lse, dq16, dk16, dv16, B, T, H, Hkv, D,
                         stream_, &err, q_ld, kv_ld)) {
      return;
    }
    CudnnRefused(err);
  }
#endif
  Backend::AttentionBackward(q16, k16, v16, out16, dout16, lse, B, T, H, Hkv, D, dq16, dk16, dv16,
                             AttentionOptions{true, q_ld, kv_ld});
}

void CudaBackend::SwigluCastFp8(const uint16_t* gate16, const uint16_t* up16, int64_t rows,
                                int64_t cols, int64_t in_ld, const float* scale, Fp8Format fmt,
                                uint8_t* out, float* amax_out) {
  cuda::OpScope op_scope(prof_.get(), "SwigluCastFp8");
  Bind();
  cuda::LaunchSwigluCastFp8(gate16, up16, rows, cols, in_ld, scale, fmt, out, amax_out, stream_);
}

void CudaBackend::SwigluCastTransposeFp8(const uint16_t* gate16, const uint16_t* up16,
                                         int64_t rows, int64_t cols, int64_t in_ld,
                                         const float* scale, Fp8Format fmt, uint8_t* out,
                                         uint8_t* out_t, float* amax_out) {
  cuda::OpScope op_scope(prof_.get(), "SwigluCastTransposeFp8");
  Bind();
  cuda::LaunchSwigluCastTransposeFp8(gate16, up16, rows, cols, in_ld, scale, fmt, out, out_t,
                                     amax_out, stream_);
}

void CudaBackend::SwigluBackwardBf16To16(const uint16_t* dh16, const uint16_t* gate16,
                                         const uint16_t* up16, int64_t n, uint16_t* dgate16,
                                         uint16_t* dup16) {
  cuda::OpScope op_scope(prof_.get(), "SwigluBackwardBf16To16");
  Bind();
  cuda::LaunchSwigluBackwardBf16To16(dh16, gate16, up16, n, dgate16, dup16, stream_);
}

void CudaBackend::SwigluBackwardCastTransposeFp8(const uint16_t* dh16, const uint16_t* gate16,
                                                 const uint16_t* up16, int64_t rows, int64_t cols,
                                                 const float* scale_gate, const float* scale_up,
                                                 Fp8Format fmt, uint8_t* dgate8, uint8_t* dgate8_t,
                                                 uint8_t* dup8, uint8_t* dup8_t, float* amax_gate,
                                                 float* amax_up, int64_t out_ld, int64_t in_ld) {
  cuda::OpScope op_scope(prof_.get(), "SwigluBackwardCastTransposeFp8");
  Bind();
  cuda::LaunchSwigluBackwardCastTransposeFp8(dh16, gate16, up16, rows, cols, scale_gate, scale_up,
                                             fmt, dgate8, dgate8_t, dup8, dup8_t, amax_gate,
                                             amax_up, out_ld, in_ld, stream_);
}

// ---- optimizer -----------------------------------------------------------------------------------

void CudaBackend::SumSquares(const float* x, int64_t n, float* out) {
  cuda::OpScope op_scope(prof_.get(), "SumSquares");
  Bind();
  double* partials = static_cast<double*>(
      Scratch(kSlotMisc, sizeof(double) * cuda::SumSquaresScratchDoubles()));
  cuda::LaunchSumSquares(x, n, out, partials, stream_);
}

void CudaBackend::AdamW(float* p, const float* g, float* m, float* v, int64_t n, float lr,
                        float beta1, float beta2, float eps, float weight_decay, int64_t step,
                        float grad_scale, float* amax_out, uint16_t* p16_out) {
  cuda::OpScope op_scope(prof_.get(), "AdamW");
  Bind();
  const auto [decay, w1, w2, step_size, bc2_sqrt] =
      AdamWHostScalarsFor(lr, beta1, beta2, weight_decay, step);
  cuda::LaunchAdamW(p, g, m, v, n, decay, beta2, w1, w2, step_size, bc2_sqrt, eps, grad_scale,
                    amax_out, p16_out, stream_);
}

void CudaBackend::AdamWBf16Moments(float* p, const float* g, uint16_t* m16, uint16_t* v16,
                                   int64_t n, float lr, float beta1, float beta2, float eps,
                                   float weight_decay, int64_t step, float grad_scale,
                                   float* amax_out, uint16_t* p16_out) {
  cuda::OpScope op_scope(prof_.get(), "AdamWBf16Moments");
  Bind();
  const auto [decay, w1, w2, step_size, bc2_sqrt] =
      AdamWHostScalarsFor(lr, beta1, beta2, weight_decay, step);
  cuda::LaunchAdamWBf16Moments(p, g, m16, v16, n, decay, beta2, w1, w2, step_size, bc2_sqrt, eps,
                               grad_scale, amax_out, p16_out, stream_);
}

// ---- factory -------------------------------------------------------------------------------------

int64_t CudaDeviceTotalMemory(int device, std::string* error) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    if (error) *error = "no CUDA device " + std::to_string(device);
    return 0;
  }
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t e = cudaSetDevice(device) == cudaSuccess ? cudaMemGetInfo(&free_bytes, &total_bytes)
                                                              : cudaGetLastError();
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (error) *error = std::string("cudaMemGetInfo: ") + cudaGetErrorString(e);
    return 0;
  }
  return static_cast<int64_t>(total_bytes);
}

std::unique_ptr<Backend> CreateCudaBackend(int device, std::string* error,
                                           const BackendOptions& options) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    if (error) {
      *error = std::string("cuda backend: no usable CUDA driver/device (cudaGetDeviceCount: ") +
               cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")";
    }
    cudaGetLastError();
    return nullptr;
  }
  if (device < 0 || device >= count) {
    if (error) {
      *error = "cuda backend: device " + std::to_string(device) + " does not exist (" +
               std::to_string(count) + " CUDA device(s) visible; check CUDA_VISIBLE_DEVICES)";
    }
    return nullptr;
  }
  cudaDeviceProp prop{};
  e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    if (error) *error = std::string("cuda backend: cudaGetDeviceProperties: ") + cudaGetErrorString(e);
    return nullptr;
  }
  if (prop.major < 9) {
    if (error) {
      *error = "cuda backend: device " + std::to_string(device) + " (" + prop.name +
               ") has compute capability " + std::to_string(prop.major) + "." +
               std::to_string(prop.minor) + "; FP8 GEMMs need 9.0 (Hopper) or newer";
    }
    return nullptr;
  }
  e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaFree(nullptr);  // creates the context
  if (e != cudaSuccess) {
    if (error) {
      *error = "cuda backend: cannot create a context on device " + std::to_string(device) + ": " +
               cudaGetErrorString(e);
    }
    cudaGetLastError();
    return nullptr;
  }
  return std::make_unique<CudaBackend>(device, options);
}

// ---- the ops: each variant to its kernel (the declarations' order of cuda_backend.h) ----------

namespace {
int64_t LdOr(int64_t ld, int64_t dense) { return ld == 0 ? dense : ld; }
}  // namespace

void CudaBackend::CastFp8(TypedCPtr in, int64_t rows, int64_t cols, const float* scale,
                          Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out,
                          int64_t out_ld) {
  out_ld = LdOr(out_ld, cols);
  if (in.bf16()) {
    if (out_t == nullptr && out_ld == cols) {
      return CastToFp8Bf16(in.h(), out, rows * cols, scale, fmt, amax_out);
    }
    return CastTransposeFp8Bf16(in.h(), rows, cols, scale, fmt, out, out_t, amax_out, out_ld);
  }
  FSDP8_CHECK(out_ld == cols) << "CastFp8: f32 input takes dense codes";
  if (out_t == nullptr) return CastToFp8(in.f(), out, rows * cols, scale, fmt, amax_out);
  CastTransposeFp8(in.f(), rows, cols, scale, fmt, out, out_t, amax_out);
}

void CudaBackend::GemmFp8(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Fp8Operand a,
                          Fp8Operand b, TypedPtr C, bool accumulate, const float* residual) {
  const bool tn = !trans_a && trans_b;
  if (C.bf16()) {
    FSDP8_CHECK(tn && !accumulate && residual == nullptr)
        << "GemmFp8: bf16 C takes the TN layout, without accumulation or residual";
    return GemmFp8Bf16(M, N, K, a.codes, a.fmt, a.scale_inv, b.codes, b.fmt, b.scale_inv, C.h());
  }
  if (residual != nullptr) {
    FSDP8_CHECK(tn && !accumulate) << "GemmFp8: a residual takes the TN layout, no accumulation";
    return GemmFp8AddResidual(M, N, K, a.codes, a.fmt, a.scale_inv, b.codes, b.fmt, b.scale_inv,
                              residual, C.f());
  }
  if (!tn) return Backend::GemmFp8(trans_a, trans_b, M, N, K, a, b, C, accumulate);
  GemmFp8(M, N, K, a.codes, a.fmt, a.scale_inv, b.codes, b.fmt, b.scale_inv, C.f(), accumulate);
}

void CudaBackend::Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, TypedCPtr A,
                       TypedCPtr B, float* C, bool accumulate, GemmInputs inputs) {
  if (A.bf16() || B.bf16()) return GemmBf16(trans_a, trans_b, M, N, K, A.h(), B.h(), C, accumulate);
  Gemm(trans_a, trans_b, M, N, K, A.f(), B.f(), C, accumulate, inputs);
}

void CudaBackend::RmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C,
                                 float* y, float* rstd, const Fp8Cast& cast) {
  if (cast.none()) return RmsNormForwardF32(x, w, eps, N, C, y, rstd);
  FSDP8_CHECK(y == nullptr && cast.out_t == nullptr && LdOr(cast.ld, C) == C)
      << "RmsNormForward: FP8 takes dense codes only";
  RmsNormCastFp8(x, w, eps, N, C, rstd, cast.scale, cast.fmt, cast.out, cast.amax);
}

void CudaBackend::RmsNormBackward(TypedCPtr dy, const float* x, const float* w, const float* rstd,
                                  int64_t N, int64_t C, float* dx, float* dw, const float* dres,
                                  TypedCPtr dy_b, TypedCPtr dy_c) {
  if (dy.bf16()) {
    FSDP8_CHECK(dres != nullptr) << "RmsNormBackward: bf16 parts need dres";
    return RmsNormBackwardAddBf16Parts(dy.h(), dy_b.h(), dy_c.h(), x, w, rstd, dres, N, C, dx, dw);
  }
  if (dres != nullptr) return RmsNormBackwardAdd(dy.f(), x, w, rstd, dres, N, C, dx, dw);
  RmsNormBackward(dy.f(), x, w, rstd, N, C, dx, dw);
}

void CudaBackend::RopeForward(TypedPtr x, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                              int64_t ld) {
  if (x.bf16()) return RopeForwardBf16(x.h(), B, T, H, D, theta, LdOr(ld, H * D));
  FSDP8_CHECK(LdOr(ld, H * D) == H * D) << "RopeForward: f32 x is dense";
  RopeForward(x.f(), B, T, H, D, theta);
}

void CudaBackend::RopeBackward(TypedPtr dx, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                               const Fp8Cast& cast) {
  if (!cast.none()) {
    return RopeBackwardCastTransposeFp8Bf16(dx.h(), B, T, H, D, theta, cast.scale, cast.fmt,
                                            cast.out, cast.out_t, cast.amax, LdOr(cast.ld, H * D));
  }
  if (dx.bf16()) return RopeBackwardBf16(dx.h(), B, T, H, D, theta);
  RopeBackward(dx.f(), B, T, H, D, theta);
}

void CudaBackend::AttentionForward(TypedCPtr q, TypedCPtr k, TypedCPtr v, int64_t B, int64_t T,
                                   int64_t H, int64_t Hkv, int64_t D, TypedPtr out, float* lse,
                                   const AttentionOptions& opts) {
  if (q.bf16()) {
    return AttentionForwardBf16Packed(q.h(), k.h(), v.h(), B, T, H, Hkv, D, out.h(), lse,
                                      LdOr(opts.q_ld, H * D), LdOr(opts.kv_ld, Hkv * D));
  }
  if (opts.bf16) {
    return AttentionForwardBf16Compute(q.f(), k.f(), v.f(), B, T, H, Hkv, D, out.f(), lse);
  }
  AttentionForward(q.f(), k.f(), v.f(), B, T, H, Hkv, D, out.f(), lse);
}

void CudaBackend::AttentionBackward(TypedCPtr q, TypedCPtr k, TypedCPtr v, TypedCPtr out,
                                    TypedCPtr dout, const float* lse, int64_t B, int64_t T,
                                    int64_t H, int64_t Hkv, int64_t D, TypedPtr dq, TypedPtr dk,
                                    TypedPtr dv, const AttentionOptions& opts) {
  if (q.bf16() && dout.bf16()) {
    return AttentionBackwardBf16SavedTo16(q.h(), k.h(), v.h(), out.h(), dout.h(), lse, B, T, H, Hkv,
                                          D, dq.h(), dk.h(), dv.h(), LdOr(opts.q_ld, H * D),
                                          LdOr(opts.kv_ld, Hkv * D));
  }
  if (q.bf16()) {
    FSDP8_CHECK(LdOr(opts.q_ld, H * D) == H * D && LdOr(opts.kv_ld, Hkv * D) == Hkv * D)
        << "AttentionBackward: strided q, k, v take bf16 gradients";
    return AttentionBackwardBf16Saved(q.h(), k.h(), v.h(), out.h(), dout.f(), lse, B, T, H, Hkv, D,
                                      dq.f(), dk.f(), dv.f());
  }
  if (opts.bf16) {
    return AttentionBackwardBf16Compute(q.f(), k.f(), v.f(), out.f(), dout.f(), lse, B, T, H, Hkv,
                                        D, dq.f(), dk.f(), dv.f());
  }
  AttentionBackward(q.f(), k.f(), v.f(), out.f(), dout.f(), lse, B, T, H, Hkv, D, dq.f(), dk.f(),
                    dv.f());
}

void CudaBackend::SwigluForward(TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols,
                                int64_t in_ld, float* h, const Fp8Cast& cast) {
  in_ld = LdOr(in_ld, cols);
  if (cast.none()) {
    FSDP8_CHECK(in_ld == cols && h != nullptr) << "SwigluForward: f32 gate and up are dense";
    return SwigluForward(gate.f(), up.f(), rows * cols, h);
  }
  FSDP8_CHECK(h == nullptr) << "SwigluForward: FP8 output takes h null";
  if (cast.out_t != nullptr) {
    return SwigluCastTransposeFp8(gate.h(), up.h(), rows, cols, in_ld, cast.scale, cast.fmt,
                                  cast.out, cast.out_t, cast.amax);
  }
  SwigluCastFp8(gate.h(), up.h(), rows, cols, in_ld, cast.scale, cast.fmt, cast.out, cast.amax);
}

void CudaBackend::SwigluBackward(TypedCPtr dh, TypedCPtr gate, TypedCPtr up, int64_t rows,
                                 int64_t cols, int64_t in_ld, TypedPtr dgate, TypedPtr dup,
                                 const Fp8Cast& gate_cast, const Fp8Cast& up_cast) {
  in_ld = LdOr(in_ld, cols);
  const int64_t n = rows * cols;
  if (dgate.null() && dup.null()) {  // the gradients straight to FP8
    FSDP8_CHECK(gate_cast.fmt == up_cast.fmt && gate_cast.ld == up_cast.ld)
        << "SwigluBackward: FP8 gradients take one format and ld";
    return SwigluBackwardCastTransposeFp8(
        dh.h(), gate.h(), up.h(), rows, cols, gate_cast.scale, up_cast.scale, gate_cast.fmt,
        gate_cast.out, gate_cast.out_t, up_cast.out, up_cast.out_t, gate_cast.amax, up_cast.amax,
        LdOr(gate_cast.ld, cols), in_ld);
  }
  FSDP8_CHECK(in_ld == cols) << "SwigluBackward: strided gate and up take FP8 gradients";
  if (!gate.bf16()) return SwigluBackward(dh.f(), gate.f(), up.f(), n, dgate.f(), dup.f());
  if (!dh.bf16()) return SwigluBackwardBf16Saved(dh.f(), gate.h(), up.h(), n, dgate.f(), dup.f());
  SwigluBackwardBf16To16(dh.h(), gate.h(), up.h(), n, dgate.h(), dup.h());
}

void CudaBackend::CrossEntropyForwardBackward(float* logits, const int32_t* targets, int64_t N,
                                              int64_t V, float grad_scale, float* losses,
                                              TypedPtr dlogits) {
  if (!dlogits.null()) {
    return CrossEntropyForwardBackwardBf16Grad(logits, targets, N, V, grad_scale, losses,
                                               dlogits.h());
  }
  CrossEntropyF32(logits, targets, N, V, grad_scale, losses);
}

void CudaBackend::AdamW(float* p, const float* g, TypedPtr m, TypedPtr v, int64_t n, float lr,
                        float beta1, float beta2, float eps, float weight_decay, int64_t step,
                        float grad_scale, float* amax_out, uint16_t* p16_out) {
  if (m.bf16()) {
    return AdamWBf16Moments(p, g, m.h(), v.h(), n, lr, beta1, beta2, eps, weight_decay, step,
                            grad_scale, amax_out, p16_out);
  }
  AdamW(p, g, m.f(), v.f(), n, lr, beta1, beta2, eps, weight_decay, step, grad_scale, amax_out,
        p16_out);
}

}  // namespace fsdp8
