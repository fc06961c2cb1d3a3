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
constexpr int kSlotScaleA = 6;   // GemmFp8Blocks: A's scales in cuBLASLt's layout
constexpr int kSlotScaleB = 7;   // GemmFp8Blocks: B's scales in cuBLASLt's layout

}  // namespace

CudaBackend::CudaBackend(int device, const BackendOptions& options)
    : device_(device), limit_(options.memory_limit_bytes) {
  FSDP8_CUDA_CHECK(cudaSetDevice(device_));
  FSDP8_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  compute_stream_ = stream_;
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
  uint64_t zero = 0;  // the pool's high-water marks from here on (reported at destruction)
  FSDP8_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero));
  FSDP8_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
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

// One line on stderr (the worker's log) per backend: what the stream-ordered pool reserved from the
// device at its peak against what it handed out and the backend's own count, so that the memory
// plan's allocator term (kPoolOverheadFraction, common/memory_plan.h) can be checked against the
// pool's behaviour rather than only against NVML.
void CudaBackend::ReportPoolPeaks() const {
  cudaMemPool_t pool;
  uint64_t reserved = 0, used = 0;
  if (cudaDeviceGetDefaultMemPool(&pool, device_) != cudaSuccess ||
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &reserved) != cudaSuccess ||
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used) != cudaSuccess) {
    return;
  }
  const double gib = 1024.0 * 1024.0 * 1024.0;
  std::fprintf(stderr,
               "fsdp8 cuda: memory pool peaks: reserved %.3f GiB, used %.3f GiB; backend count "
               "peak %.3f GiB (reserved / count %.4f)\n",
               reserved / gib, used / gib, PeakAllocatedBytes() / gib,
               PeakAllocatedBytes() > 0 ? static_cast<double>(reserved) / PeakAllocatedBytes() : 0.0);
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  if (in_side_) EndSideStream();
  JoinSideStream();  // the frees below come after the side stream's work
  cudaStreamSynchronize(stream_);
  ReportPoolPeaks();
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
  if (side_stream_ != nullptr) {
    cudaEventDestroy(side_fork_);
    cudaEventDestroy(side_done_);
    cudaStreamDestroy(side_stream_);
  }
  cudaStreamDestroy(stream_);
}

void CudaBackend::Bind() const { FSDP8_CUDA_CHECK(cudaSetDevice(device_)); }

cuda::OpScope CudaBackend::Op(const char* name) {
  Bind();
  return cuda::OpScope(Prof(), name);
}

cuda::OpScope CudaBackend::Op(const char* name, int64_t M, int64_t N, int64_t K) {
  Bind();
  return cuda::OpScope(Prof(), name, M, N, K);
}

bool CudaBackend::EmptyGemm(int64_t M, int64_t N, int64_t K, float* C, bool accumulate) {
  if (M > 0 && N > 0 && K > 0) return false;
  if (M > 0 && N > 0 && !accumulate) {
    FSDP8_CUDA_CHECK(cudaMemsetAsync(C, 0, sizeof(float) * M * N, stream_));
  }
  return true;
}

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
  cuda::OpScope op_scope(Prof(), "Copy");
  if (bytes == 0) return;
  Bind();
  FSDP8_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::Memset(void* dst, int value, size_t bytes) {
  cuda::OpScope op_scope(Prof(), "Memset");
  if (bytes == 0) return;
  Bind();
  FSDP8_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream_));
}

void CudaBackend::Synchronize() {
  Bind();
  FSDP8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (side_stream_ != nullptr) FSDP8_CUDA_CHECK(cudaStreamSynchronize(side_stream_));
  if (prof_) prof_->Harvest(/*block=*/false);
}

void CudaBackend::BeginSideStream() {
  FSDP8_CHECK(!in_side_) << "BeginSideStream inside a side-stream section";
  Bind();
  if (side_stream_ == nullptr) {
    FSDP8_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
    FSDP8_CUDA_CHECK(cudaEventCreateWithFlags(&side_fork_, cudaEventDisableTiming));
    FSDP8_CUDA_CHECK(cudaEventCreateWithFlags(&side_done_, cudaEventDisableTiming));
  }
  // After everything enqueued so far (the backward's gradients, the last reads of the weights).
  FSDP8_CUDA_CHECK(cudaEventRecord(side_fork_, compute_stream_));
  FSDP8_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, side_fork_, 0));
  stream_ = side_stream_;
  in_side_ = true;
}

void CudaBackend::EndSideStream() {
  FSDP8_CHECK(in_side_) << "EndSideStream without BeginSideStream";
  Bind();
  FSDP8_CUDA_CHECK(cudaEventRecord(side_done_, side_stream_));
  stream_ = compute_stream_;
  in_side_ = false;
  side_unjoined_ = true;
}

void CudaBackend::JoinSideStream() {
  // Inside a section the current stream is the side stream: in order with its ops already.
  if (!side_unjoined_ || in_side_) return;
  Bind();
  // side_done_ was last recorded by the latest EndSideStream: after every side-stream op.
  FSDP8_CUDA_CHECK(cudaStreamWaitEvent(compute_stream_, side_done_, 0));
  side_unjoined_ = false;
}

void CudaBackend::CountWorkspaces() {
  int64_t w = kGemmWorkspaceBytes + static_cast<int64_t>(rope_table_bytes_);
  for (size_t b : scratch_bytes_) w += static_cast<int64_t>(b);
  workspace_ = w;
  peak_ = std::max(peak_, allocated_ + workspace_);
}

void* CudaBackend::Scratch(int i, size_t bytes) {
  // The slots are shared with the compute stream's ops, which may run beside the side stream's.
  FSDP8_CHECK(!in_side_) << "scratch slot " << i << " used on the side stream";
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

void CudaBackend::TransposeBytes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) {
  const auto op = Op("TransposeBytes");
  cuda::LaunchTransposeBytes(in, rows, cols, out, stream_);
}

void CudaBackend::DequantizeFp8(const uint8_t* in, float* out, int64_t n, const float* scale_inv,
                                Fp8Format fmt) {
  const auto op = Op("DequantizeFp8");
  cuda::LaunchDequantizeFp8(in, out, n, scale_inv, fmt, stream_);
}

void CudaBackend::Fp8ScalesFromAmax(const float* amax, int64_t n, float fp8_max, int margin,
                                    float* scale, float* scale_inv, int64_t stride) {
  const auto op = Op("Fp8ScalesFromAmax");
  FSDP8_CHECK(n >= 0 && stride >= 1 && margin >= 0) << "Fp8ScalesFromAmax: bad arguments";
  cuda::LaunchFp8ScalesFromAmax(amax, n, fp8_max, margin, scale, scale_inv, stride, stream_);
}

void CudaBackend::GroupMax(const float* in, const int32_t* group, int64_t n, float* out) {
  const auto op = Op("GroupMax");
  cuda::LaunchGroupMax(in, group, n, out, stream_);
}

void CudaBackend::AmaxAccumulate(const float* in, int64_t n, float* amax_out) {
  const auto op = Op("AmaxAccumulate");
  cuda::LaunchAmaxAccumulate(in, n, amax_out, stream_);
}

namespace {
cudaDataType_t Fp8Type(Fp8Format f) {
  return f == Fp8Format::kE5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
}

// Backend::Gemm's row-major C (M, N) = op(A) op(B) as cuBLASLt's column-major problem
// D (N, M) = op(B)^T · op(A)^T (gemm.h): our B (K, N) is stored col-major (N, K), no op, and
// (N, K) takes op T; likewise A. cuBLASLt's A is our B, its B our A, both of `type`.
cuda::LtProblem RowMajorProblem(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                                const void* A, const void* B, const void* C, cudaDataType_t type,
                                bool accumulate) {
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
  p.a_type = type;
  p.b_type = type;
  p.align_a = cuda::PointerAlignment(B);
  p.align_b = cuda::PointerAlignment(A);
  p.align_c = cuda::PointerAlignment(C);
  return p;
}

// Our TN FP8 product C (M, N) = A (M, K) · B (N, K)^T (see gemm.h); fast_accum for the forward
// GEMMs (SetFp8FastAccumulation); c_type and accumulate as the caller needs.
cuda::LtProblem Fp8Problem(int64_t M, int64_t N, int64_t K, const uint8_t* A, Fp8Format a_fmt,
                           const uint8_t* B, Fp8Format b_fmt, const void* C, bool fast_accum) {
  cuda::LtProblem p = RowMajorProblem(false, true, M, N, K, A, B, C, Fp8Type(b_fmt), false);
  p.b_type = Fp8Type(a_fmt);
  p.scaled = true;
  p.fast_accum = fast_accum;
  return p;
}
}  // namespace

void CudaBackend::GemmFp8Tn(int64_t M, int64_t N, int64_t K, Fp8Operand a, Fp8Operand b, float* C,
                            bool accumulate) {
  const auto op = Op("GemmFp8", M, N, K);
  if (EmptyGemm(M, N, K, C, accumulate)) return;
  // See gemm.h: column-major D (N, M) = B_stored(K, N)^T · A_stored(K, M).
  cuda::LtProblem p = Fp8Problem(M, N, K, a.codes, a.fmt, b.codes, b.fmt, C, fp8_fast_accum_);
  p.accumulate = accumulate;
  const bool both_e5m2 = a.fmt == Fp8Format::kE5M2 && b.fmt == Fp8Format::kE5M2;
  if (!both_e5m2 && lt_->Run(p, b.codes, a.codes, C, b.scale_inv, a.scale_inv)) return;

  // Fallback (shapes cuBLASLt FP8 refuses): exact decode, f32 GEMM, then the scales.
  ++gemm_fp8_fallbacks_;
  float* a32 = static_cast<float*>(Scratch(kSlotA, sizeof(float) * M * K));
  float* b32 = static_cast<float*>(Scratch(kSlotB, sizeof(float) * N * K));
  float* tmp = static_cast<float*>(Scratch(kSlotTmp, sizeof(float) * M * N));
  cuda::LaunchDequantizeFp8(a.codes, a32, M * K, nullptr, a.fmt, stream_);
  cuda::LaunchDequantizeFp8(b.codes, b32, N * K, nullptr, b.fmt, stream_);
  GemmF32(false, true, M, N, K, a32, b32, tmp, false, GemmInputs::kF32);
  cuda::LaunchScaleAccumulate(tmp, a.scale_inv, b.scale_inv, C, M * N, accumulate, stream_);
}

bool CudaBackend::GemmBf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                           const uint16_t* A16, const uint16_t* B16, float* C, bool accumulate) {
  const auto op = Op("GemmBf16", M, N, K);
  if (EmptyGemm(M, N, K, C, accumulate)) return true;
  const cuda::LtProblem p =
      RowMajorProblem(trans_a, trans_b, M, N, K, A16, B16, C, CUDA_R_16BF, accumulate);
  // false: no bf16 algorithm for this shape (the reference: the same values in f32, exactly).
  return lt_->Run(p, B16, A16, C, nullptr, nullptr);
}

void CudaBackend::GemmF32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                          const float* A, const float* B, float* C, bool accumulate,
                          GemmInputs inputs) {
  const auto op = Op("Gemm", M, N, K);
  if (EmptyGemm(M, N, K, C, accumulate)) return;
  if (inputs == GemmInputs::kBF16) {
    // The inputs rounded to bf16 once, then the bf16-operand GEMM (or its reference).
    uint16_t* a16 = static_cast<uint16_t*>(Scratch(kSlotA, sizeof(uint16_t) * M * K));
    uint16_t* b16 = static_cast<uint16_t*>(Scratch(kSlotB, sizeof(uint16_t) * N * K));
    cuda::LaunchPackBf16(A, a16, M * K, stream_);
    cuda::LaunchPackBf16(B, b16, N * K, stream_);
    Gemm(trans_a, trans_b, M, N, K, a16, b16, C, accumulate, GemmInputs::kBF16);
    return;
  }
  const cuda::LtProblem p =
      RowMajorProblem(trans_a, trans_b, M, N, K, A, B, C, CUDA_R_32F, accumulate);
  const bool ok = lt_->Run(p, B, A, C, nullptr, nullptr);
  FSDP8_CHECK(ok) << "cuBLASLt has no f32 algorithm for this GEMM";
}

void CudaBackend::RoundToBf16(float* x, int64_t n) {
  const auto op = Op("RoundToBf16");
  cuda::LaunchRoundToBf16(x, n, stream_);
}

void CudaBackend::PackBf16(const float* in, uint16_t* out, int64_t n) {
  const auto op = Op("PackBf16");
  cuda::LaunchPackBf16(in, out, n, stream_);
}

void CudaBackend::UnpackBf16(const uint16_t* in, float* out, int64_t n) {
  const auto op = Op("UnpackBf16");
  cuda::LaunchUnpackBf16(in, out, n, stream_);
}

// ---- elementwise and layers ----------------------------------------------------------------------

void CudaBackend::Add(const float* a, const float* b, float* out, int64_t n) {
  const auto op = Op("Add");
  cuda::LaunchAdd(a, b, out, n, stream_);
}

void CudaBackend::Axpy(float alpha, const float* x, float* y, int64_t n) {
  const auto op = Op("Axpy");
  cuda::LaunchAxpy(alpha, x, y, n, stream_);
}

void CudaBackend::EmbeddingForward(const int32_t* tokens, int64_t N, const float* table, int64_t C,
                                   float* out) {
  const auto op = Op("EmbeddingForward");
  cuda::LaunchEmbeddingForward(tokens, N, table, C, out, stream_);
}

void CudaBackend::EmbeddingBackward(const int32_t* tokens, int64_t N, const float* dout, int64_t C,
                                    float* dtable) {
  const auto op = Op("EmbeddingBackward");
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

// ---- bfloat16 activations -------------------------------------------------------------------------

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

// ---- optimizer -----------------------------------------------------------------------------------

void CudaBackend::SumSquares(const float* x, int64_t n, float* out) {
  const auto op = Op("SumSquares");
  double* partials = static_cast<double*>(
      Scratch(kSlotMisc, sizeof(double) * cuda::SumSquaresScratchDoubles()));
  cuda::LaunchSumSquares(x, n, out, partials, stream_);
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

// ---- the typed ops' hooks (backend.h): each combination to its kernel ---------------------------

bool CudaBackend::TryCastFp8(TypedCPtr in, int64_t rows, int64_t cols, const float* scale,
                             Fp8Format fmt, uint8_t* out, uint8_t* out_t, float* amax_out,
                             int64_t out_ld) {
  if (in.bf16() && (out_t != nullptr || out_ld != cols)) {
    const auto op = Op("CastTransposeFp8Bf16");
    cuda::LaunchCastTransposeFp8Bf16(in.h(), rows, cols, scale, fmt, out, out_t, amax_out, out_ld,
                                     stream_);
  } else if (in.bf16()) {
    const auto op = Op("CastToFp8Bf16");
    cuda::LaunchCastToFp8Bf16(in.h(), out, rows * cols, scale, fmt, amax_out, stream_);
  } else if (out_t != nullptr) {
    const auto op = Op("CastTransposeFp8");
    cuda::LaunchCastTransposeFp8(in.f(), rows, cols, scale, fmt, out, out_t, amax_out, stream_);
  } else {
    const auto op = Op("CastToFp8");
    cuda::LaunchCastToFp8(in.f(), out, rows * cols, scale, fmt, amax_out, stream_);
  }
  return true;
}

bool CudaBackend::TryGemmFp8(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                             Fp8Operand a, Fp8Operand b, TypedPtr C, bool accumulate,
                             const float* residual) {
  if (trans_a || !trans_b) return false;  // cuBLASLt's FP8 layout is TN: transposed copies first
  if (C.f32() && residual == nullptr) {
    GemmFp8Tn(M, N, K, a, b, C.f(), accumulate);
    return true;
  }
  // bf16 C (cuBLASLt's BF16 output), or the residual as cuBLASLt's C input (accumulating).
  const auto op = Op(C.bf16() ? "GemmFp8Bf16" : "GemmFp8AddResidual", M, N, K);
  if (M <= 0 || N <= 0) return true;
  const bool both_e5m2 = a.fmt == Fp8Format::kE5M2 && b.fmt == Fp8Format::kE5M2;
  if (K <= 0 || both_e5m2) return false;
  if (residual != nullptr && cuda::PointerAlignment(residual) < cuda::PointerAlignment(C.data)) {
    return false;
  }
  cuda::LtProblem p = Fp8Problem(M, N, K, a.codes, a.fmt, b.codes, b.fmt, C.data, fp8_fast_accum_);
  if (C.bf16()) p.c_type = CUDA_R_16BF;
  p.accumulate = residual != nullptr;
  return lt_->Run(p, b.codes, a.codes, C.data, b.scale_inv, a.scale_inv, residual);
}

bool CudaBackend::TryQuantizeFp8Blocks(TypedCPtr in, int64_t rows, int64_t cols, Fp8Blocks blocks,
                                       Fp8Format fmt, uint8_t* out, float* scale_inv,
                                       uint8_t* out_t, float* scale_inv_t) {
  const auto op = Op("QuantizeFp8Blocks");
  cuda::LaunchQuantizeFp8Blocks(in, rows, cols, blocks, fmt, out, scale_inv, out_t, scale_inv_t,
                                stream_);
  return true;
}

const float* CudaBackend::BlockScalesForLt(const Fp8BlockOperand& x, int64_t rows, int64_t K,
                                           int slot, int* mode) {
  const int64_t kb = Fp8BlockCount(K);
  const bool aligned = cuda::PointerAlignment(x.scale_inv) >= 16;
  switch (x.blocks) {
    case Fp8Blocks::kRow: {  // one per row: the layout as it is
      *mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      if (aligned) return x.scale_inv;
      float* s = static_cast<float*>(Scratch(slot, sizeof(float) * rows));
      cuda::LaunchCopyScales(x.scale_inv, rows, 1, s, 1, 1, stream_);
      return s;
    }
    case Fp8Blocks::kTile128: {  // (rows, kb) -> (kb, rows)
      *mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      if (kb == 1 && aligned) return x.scale_inv;
      float* s = static_cast<float*>(Scratch(slot, sizeof(float) * rows * kb));
      cuda::LaunchCopyScales(x.scale_inv, rows, kb, s, 1, rows, stream_);
      return s;
    }
    case Fp8Blocks::kBlock128: {  // (rb, kb) -> (rb, kb) with rows padded to a multiple of 4
      *mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      const int64_t rb = Fp8BlockCount(rows), ld = (kb + 3) / 4 * 4;
      if (ld == kb && aligned) return x.scale_inv;
      float* s = static_cast<float*>(Scratch(slot, sizeof(float) * rb * ld));
      if (ld != kb) FSDP8_CUDA_CHECK(cudaMemsetAsync(s, 0, sizeof(float) * rb * ld, stream_));
      cuda::LaunchCopyScales(x.scale_inv, rb, kb, s, ld, 1, stream_);
      return s;
    }
  }
  return nullptr;
}

bool CudaBackend::TryGemmFp8Blocks(int64_t M, int64_t N, int64_t K, Fp8BlockOperand a,
                                   Fp8BlockOperand b, float* C, bool accumulate) {
  const auto op = Op("GemmFp8Blocks", M, N, K);
  if (EmptyGemm(M, N, K, C, accumulate)) return true;
  if (in_side_ || (a.fmt == Fp8Format::kE5M2 && b.fmt == Fp8Format::kE5M2) ||
      (a.blocks == Fp8Blocks::kTile128 && M % 4 != 0) ||
      (b.blocks == Fp8Blocks::kTile128 && N % 4 != 0)) {
    ++gemm_fp8_fallbacks_;
    return false;
  }
  // See gemm.h: cuBLASLt's A is our b (m = N), its B our a (n = M).
  cuda::LtProblem p = Fp8Problem(M, N, K, a.codes, a.fmt, b.codes, b.fmt, C, false);
  p.accumulate = accumulate;
  const float* sb = BlockScalesForLt(b, N, K, kSlotScaleB, &p.scale_mode_a);
  const float* sa = BlockScalesForLt(a, M, K, kSlotScaleA, &p.scale_mode_b);
  if (lt_->Run(p, b.codes, a.codes, C, sb, sa)) return true;
  if (accumulate) {
    // No block-scaled algorithm with beta = 1 for this shape: the product into scratch, then
    // added (C = C + AB, one more f32 rounding).
    p.accumulate = false;
    float* tmp = static_cast<float*>(Scratch(kSlotTmp, sizeof(float) * M * N));
    p.align_c = cuda::PointerAlignment(tmp);
    if (lt_->Run(p, b.codes, a.codes, tmp, sb, sa)) {
      cuda::LaunchAdd(C, tmp, C, M * N, stream_);
      return true;
    }
  }
  ++gemm_fp8_fallbacks_;
  if (gemm_fp8_fallbacks_ <= 8) {
    std::fprintf(stderr,
                 "fsdp8 cuda: GemmFp8Blocks M=%lld N=%lld K=%lld (scale modes %d, %d): no "
                 "cuBLASLt algorithm; the host composition runs instead (slow)\n",
                 static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K),
                 p.scale_mode_a, p.scale_mode_b);
  }
  return false;
}

bool CudaBackend::TryTransposeBlockScales(const float* in, int64_t rows, int64_t cols,
                                          float* out) {
  const auto op = Op("TransposeBlockScales");
  cuda::LaunchCopyScales(in, rows, cols, out, 1, rows, stream_);
  return true;
}

bool CudaBackend::TryGemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, TypedCPtr A,
                          TypedCPtr B, float* C, bool accumulate, GemmInputs inputs) {
  if (A.bf16()) return GemmBf16(trans_a, trans_b, M, N, K, A.h(), B.h(), C, accumulate);
  GemmF32(trans_a, trans_b, M, N, K, A.f(), B.f(), C, accumulate, inputs);
  return true;
}

bool CudaBackend::TryRmsNormForward(const float* x, const float* w, float eps, int64_t N, int64_t C,
                                    float* y, float* rstd, const Fp8Cast& cast) {
  if (cast.none()) {
    const auto op = Op("RmsNormForward");
    cuda::LaunchRmsNormForward(x, w, eps, N, C, y, rstd, stream_);
  } else {
    const auto op = Op("RmsNormCastFp8");
    cuda::LaunchRmsNormCastFp8(x, w, eps, N, C, rstd, cast.scale, cast.fmt, cast.out, cast.amax,
                               stream_);
  }
  return true;
}

bool CudaBackend::TryRmsNormBackward(TypedCPtr dy, const float* x, const float* w,
                                     const float* rstd, int64_t N, int64_t C, float* dx, float* dw,
                                     const float* dres, TypedCPtr dy_b, TypedCPtr dy_c) {
  const auto op = Op(dy.bf16()           ? "RmsNormBackwardAddBf16Parts"
                     : dres != nullptr ? "RmsNormBackwardAdd"
                                       : "RmsNormBackward");
  float* partials = static_cast<float*>(
      Scratch(kSlotPartials, sizeof(float) * cuda::RmsNormBackwardScratchFloats(N, C)));
  if (dy.bf16()) {  // false: no kernel for this shape (the reference sums the parts first)
    return cuda::LaunchRmsNormBackwardBf16Parts(dy.h(), dy_b.h(), dy_c.h(), x, w, rstd, N, C, dx,
                                                dw, partials, stream_, dres);
  }
  cuda::LaunchRmsNormBackward(dy.f(), x, w, rstd, N, C, dx, dw, partials, stream_, dres);
  return true;
}

bool CudaBackend::TryRopeForward(TypedPtr x, int64_t B, int64_t T, int64_t H, int64_t D,
                                 float theta, int64_t ld) {
  const auto op = Op(x.bf16() ? "RopeForwardBf16" : "RopeForward");
  EnsureRopeTable(T, D, theta);
  if (x.bf16()) {
    cuda::LaunchRopeApplyBf16(x.h(), B, T, H, D, ld, rope_table_, 1.0f, stream_);
  } else {
    cuda::LaunchRopeApply(x.f(), B, T, H, D, rope_table_, 1.0f, stream_);
  }
  return true;
}

bool CudaBackend::TryRopeBackward(TypedPtr dx, int64_t B, int64_t T, int64_t H, int64_t D,
                                  float theta, const Fp8Cast& cast) {
  const bool fp8 = !cast.none();
  if (fp8 && (D % 8 != 0 || reinterpret_cast<uintptr_t>(dx.h()) % 8 != 0)) return false;
  const auto op = Op(fp8 ? "RopeBackwardCastTransposeFp8Bf16"
                         : dx.bf16() ? "RopeBackwardBf16" : "RopeBackward");
  EnsureRopeTable(T, D, theta);
  if (fp8) {
    cuda::LaunchRopeBackwardCastTransposeFp8Bf16(dx.h(), B, T, H, D, rope_table_, cast.scale,
                                                 cast.fmt, cast.out, cast.out_t, cast.amax,
                                                 cast.ld == 0 ? H * D : cast.ld, stream_);
  } else if (dx.bf16()) {
    cuda::LaunchRopeApplyBf16(dx.h(), B, T, H, D, H * D, rope_table_, -1.0f, stream_);
  } else {
    cuda::LaunchRopeApply(dx.f(), B, T, H, D, rope_table_, -1.0f, stream_);
  }
  return true;
}

bool CudaBackend::TryAttentionForward(TypedCPtr q, TypedCPtr k, TypedCPtr v, int64_t B, int64_t T,
                                      int64_t H, int64_t Hkv, int64_t D, TypedPtr out, float* lse,
                                      const AttentionOptions& opts) {
  if (!q.bf16() && !opts.bf16) {
    const auto op = Op("AttentionForward");
    cuda::LaunchAttentionForward(q.f(), k.f(), v.f(), B, T, H, Hkv, D, out.f(), lse, stream_);
    return true;
  }
#ifdef FSDP8_WITH_CUDNN
  if (!CudnnAttentionUsable(D)) return false;
  std::string err;
  if (q.bf16()) {
    const auto op = Op("AttentionForwardBf16Packed");
    if (cudnn_->Forward(q.h(), k.h(), v.h(), out.h(), lse, B, T, H, Hkv, D, stream_, &err,
                        opts.q_ld, opts.kv_ld)) {
      return true;
    }
  } else {  // the bf16 recipe on f32 storage: bf16 copies in and out
    const auto op = Op("AttentionForwardBf16Compute");
    const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
    const int64_t n[4] = {nq, nk, nk, nq};
    uint16_t* b16[4];  // q, k, v, out
    for (int i = 0; i < 4; ++i) b16[i] = static_cast<uint16_t*>(Alloc(n[i] * 2));
    if (!(b16[0] && b16[1] && b16[2] && b16[3])) {  // out of memory: give back what was taken
      for (uint16_t* p : b16) {
        if (p != nullptr) Free(p);
      }
      throw std::bad_alloc();
    }
    PackBf16(q.f(), b16[0], nq);
    PackBf16(k.f(), b16[1], nk);
    PackBf16(v.f(), b16[2], nk);
    const bool ok = cudnn_->Forward(b16[0], b16[1], b16[2], b16[3], lse, B, T, H, Hkv, D, stream_,
                                    &err);
    if (ok) UnpackBf16(b16[3], out.f(), nq);
    for (uint16_t* p : b16) Free(p);
    if (ok) return true;
  }
  CudnnRefused(err);
#endif
  return false;
}

bool CudaBackend::TryAttentionBackward(TypedCPtr q, TypedCPtr k, TypedCPtr v, TypedCPtr out,
                                       TypedCPtr dout, const float* lse, int64_t B, int64_t T,
                                       int64_t H, int64_t Hkv, int64_t D, TypedPtr dq, TypedPtr dk,
                                       TypedPtr dv, const AttentionOptions& opts) {
  if (!q.bf16() && !opts.bf16) {
    const auto op = Op("AttentionBackward");
    float* delta = static_cast<float*>(Scratch(kSlotDelta, sizeof(float) * B * H * T));
    cuda::LaunchAttentionBackward(q.f(), k.f(), v.f(), out.f(), dout.f(), lse, B, T, H, Hkv, D,
                                  dq.f(), dk.f(), dv.f(), delta, stream_);
    return true;
  }
#ifdef FSDP8_WITH_CUDNN
  if (!CudnnAttentionUsable(D)) return false;
  const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
  std::string err;
  if (q.bf16() && dout.bf16()) {
    const auto op = Op("AttentionBackwardBf16SavedTo16");
    if (cudnn_->Backward(q.h(), k.h(), v.h(), out.h(), dout.h(), lse, dq.h(), dk.h(), dv.h(), B, T,
                         H, Hkv, D, stream_, &err, opts.q_ld, opts.kv_ld)) {
      return true;
    }
  } else if (q.bf16()) {  // saved bf16 activations, f32 gradients: bf16 copies of those
    const auto op = Op("AttentionBackwardBf16Saved");
    auto* buf = static_cast<uint16_t*>(Alloc((2 * nq + 2 * nk) * 2));  // do, dq (nq); dk, dv (nk)
    if (buf == nullptr) throw std::bad_alloc();  // out of memory (backend.h, Errors)
    uint16_t *do16 = buf, *dq16 = do16 + nq, *dk16 = dq16 + nq, *dv16 = dk16 + nk;
    PackBf16(dout.f(), do16, nq);
    const bool ok = cudnn_->Backward(q.h(), k.h(), v.h(), out.h(), do16, lse, dq16, dk16, dv16, B,
                                     T, H, Hkv, D, stream_, &err);
    if (ok) {
      UnpackBf16(dq16, dq.f(), nq);
      UnpackBf16(dk16, dk.f(), nk);
      UnpackBf16(dv16, dv.f(), nk);
    }
    Free(buf);
    if (ok) return true;
  } else {  // the bf16 recipe on f32 storage: q, k, v, out rounded once, then the saved path
    const auto op = Op("AttentionBackwardBf16Compute");
    auto* buf = static_cast<uint16_t*>(Alloc((2 * nq + 2 * nk) * 2));  // q, o (nq); k, v (nk)
    if (buf == nullptr) throw std::bad_alloc();  // out of memory (backend.h, Errors)
    uint16_t *q16 = buf, *o16 = q16 + nq, *k16 = o16 + nq, *v16 = k16 + nk;
    PackBf16(q.f(), q16, nq);
    PackBf16(k.f(), k16, nk);
    PackBf16(v.f(), v16, nk);
    PackBf16(out.f(), o16, nq);  // exact: out holds the forward's bf16 output
    AttentionBackward(q16, k16, v16, o16, dout, lse, B, T, H, Hkv, D, dq, dk, dv);
    Free(buf);
    return true;
  }
  CudnnRefused(err);
#endif
  return false;
}

bool CudaBackend::TrySwigluForward(TypedCPtr gate, TypedCPtr up, int64_t rows, int64_t cols,
                                   int64_t in_ld, float* h, const Fp8Cast& cast) {
  if (cast.none()) {
    const auto op = Op("SwigluForward");
    cuda::LaunchSwigluForward(gate.f(), up.f(), rows * cols, h, stream_);
  } else if (cast.out_t != nullptr) {
    const auto op = Op("SwigluCastTransposeFp8");
    cuda::LaunchSwigluCastTransposeFp8(gate.h(), up.h(), rows, cols, in_ld, cast.scale, cast.fmt,
                                       cast.out, cast.out_t, cast.amax, stream_);
  } else {
    const auto op = Op("SwigluCastFp8");
    cuda::LaunchSwigluCastFp8(gate.h(), up.h(), rows, cols, in_ld, cast.scale, cast.fmt, cast.out,
                              cast.amax, stream_);
  }
  return true;
}

bool CudaBackend::TrySwigluBackward(TypedCPtr dh, TypedCPtr gate, TypedCPtr up, int64_t rows,
                                    int64_t cols, int64_t in_ld, TypedPtr dgate, TypedPtr dup,
                                    const Fp8Cast& gate_cast, const Fp8Cast& up_cast) {
  const int64_t n = rows * cols;
  if (dgate.null() && dup.null()) {  // the gradients straight to FP8
    const auto op = Op("SwigluBackwardCastTransposeFp8");
    cuda::LaunchSwigluBackwardCastTransposeFp8(
        dh.h(), gate.h(), up.h(), rows, cols, gate_cast.scale, up_cast.scale, gate_cast.fmt,
        gate_cast.out, gate_cast.out_t, up_cast.out, up_cast.out_t, gate_cast.amax, up_cast.amax,
        gate_cast.ld == 0 ? cols : gate_cast.ld, in_ld, stream_);
  } else if (!gate.bf16()) {
    const auto op = Op("SwigluBackward");
    cuda::LaunchSwigluBackward(dh.f(), gate.f(), up.f(), n, dgate.f(), dup.f(), stream_);
  } else if (!dh.bf16()) {
    const auto op = Op("SwigluBackwardBf16Saved");
    cuda::LaunchSwigluBackwardBf16Saved(dh.f(), gate.h(), up.h(), n, dgate.f(), dup.f(), stream_);
  } else {
    const auto op = Op("SwigluBackwardBf16To16");
    cuda::LaunchSwigluBackwardBf16To16(dh.h(), gate.h(), up.h(), n, dgate.h(), dup.h(), stream_);
  }
  return true;
}

bool CudaBackend::TryCrossEntropy(float* logits, const int32_t* targets, int64_t N, int64_t V,
                                  float grad_scale, float* losses, TypedPtr dlogits) {
  if (dlogits.null()) {
    const auto op = Op("CrossEntropyForwardBackward");
    cuda::LaunchCrossEntropy(logits, targets, N, V, grad_scale, losses, stream_);
  } else {
    const auto op = Op("CrossEntropyForwardBackwardBf16Grad");
    cuda::LaunchCrossEntropyBf16Grad(logits, targets, N, V, grad_scale, losses, dlogits.h(),
                                     stream_);
  }
  return true;
}

void CudaBackend::AdamW(float* p, const float* g, TypedPtr m, TypedPtr v, int64_t n, float lr,
                        float beta1, float beta2, float eps, float weight_decay, int64_t step,
                        float grad_scale, float* amax_out, uint16_t* p16_out) {
  const auto op = Op(m.bf16() ? "AdamWBf16Moments" : "AdamW");
  const auto [decay, w1, w2, step_size, bc2_sqrt] =
      AdamWHostScalarsFor(lr, beta1, beta2, weight_decay, step);
  if (m.bf16()) {
    cuda::LaunchAdamWBf16Moments(p, g, m.h(), v.h(), n, decay, beta2, w1, w2, step_size, bc2_sqrt,
                                 eps, grad_scale, amax_out, p16_out, stream_);
  } else {
    cuda::LaunchAdamW(p, g, m.f(), v.f(), n, decay, beta2, w1, w2, step_size, bc2_sqrt, eps,
                      grad_scale, amax_out, p16_out, stream_);
  }
}

}  // namespace fsdp8
