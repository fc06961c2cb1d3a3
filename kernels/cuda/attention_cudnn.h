// CudnnAttention: causal scaled-dot-product attention (forward and backward) in BF16 through
// cuDNN's fused flash-attention engines, built with the cuDNN frontend graph API
// (https://github.com/NVIDIA/cudnn-frontend, graph.sdpa / graph.sdpa_backward).
//
// Built only when CMake finds the cuDNN frontend headers (cache variable
// FSDP8_CUDNN_FRONTEND_INCLUDE, auto-detected from the `nvidia-cudnn-frontend` pip package) and
// libcudnn; the build then defines FSDP8_WITH_CUDNN for every target linking fsdp8_kernels_cuda.
// libcudnn.so.9 is linked dynamically: the version actually loaded is RuntimeVersion().
//
// Layouts and types (all device pointers, all on the device bound at construction):
//   q, o, dq, do   (B, T, H, D)   bf16, contiguous ("BSHD": D fastest, then heads, then time)
//   k, v, dk, dv   (B, T, Hkv, D) bf16, contiguous; Hkv divides H (grouped-query attention:
//                                query head h uses kv head h / (H / Hkv)); dk, dv are the sums
//                                over each kv head's group.
//   stats          (B, H, T)      f32, natural-log log-sum-exp of the scaled, masked scores of
//                                each query row: stats[b,h,t] = log sum_{s<=t} exp(scale q·k_s)
//                                (the same quantity as Backend::AttentionForward's lse).
// Causal mask (key s visible to query t iff s <= t), scale 1/sqrt(D), no dropout, no bias.
// Supported D: multiples of 8 up to 128 for the backward on Hopper (cuDNN's limits; up to 256 for
// the forward); T any positive length.
//
// Determinism: the backward requests cuDNN's deterministic algorithm (set_deterministic_algorithm)
// by default, which on Hopper uses a dP workspace of about B*H*T^2*2 bytes (1 GiB at B 8, H 16,
// T 2048) instead of order-dependent atomics; set_deterministic_backward(false) selects the
// faster atomic dQ accumulation (results then vary in the last bits from run to run). The forward
// is deterministic.
//
// Graphs (one forward, one backward per shape and determinism setting) are built on first use
// and cached; Prepare() builds them ahead of time. Building takes milliseconds to a second.
// The workspace is one device buffer grown to the largest graph's need (cudaFree + cudaMalloc,
// which synchronize the device, only while growing), or, with set_workspace_allocator, a buffer
// taken from the caller's allocator for each call and given back right after it is enqueued
// (stream-ordered allocators only), so that it is held only while attention runs.
//
// Errors: every entry point returns false and sets *error (when non-null) to a message naming the
// stage and cuDNN's reason, e.g. "cuDNN 9.14.0 SDPA backward (B 8 T 2048 H 16 Hkv 16 D 128):
// check_support: ..."; a shape whose graph failed to build fails again at once with the same
// message (it is not rebuilt). Null pointers and non-positive sizes are reported the same way.
// Nothing aborts.
//
// Thread-safety: none; one thread per instance (like Backend). Calls enqueue work on `stream` and
// return without synchronizing.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include <cuda_runtime_api.h>

namespace fsdp8::cuda {

class CudnnAttention {
 public:
  // Binds `device` (cudaSetDevice) now and before each call. The cuDNN handle is created lazily,
  // on the first call, so that constructing never fails.
  explicit CudnnAttention(int device);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // cudnnGetVersion() of the loaded library (e.g. 91400 for 9.14.0) and the same as "9.14.0";
  // the version of the headers this was compiled against.
  static int64_t RuntimeVersion();
  static std::string RuntimeVersionString();
  static int64_t CompiledVersion();

  void set_deterministic_backward(bool on) { deterministic_ = on; }

  // Builds (or finds) the forward and backward graphs of this shape; optional.
  bool Prepare(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, std::string* error);

  // o = softmax(scale q k^T + causal mask) v; stats as above (saved for Backward). q_ld, kv_ld:
  // the elements between consecutive tokens of q and of k, v (0: dense, H * D and Hkv * D; the
  // fused q/k/v GEMM's output has (H + 2 Hkv) * D for all three); o is dense.
  bool Forward(const void* q, const void* k, const void* v, void* o, float* stats, int64_t B,
               int64_t T, int64_t H, int64_t Hkv, int64_t D, cudaStream_t stream,
               std::string* error, int64_t q_ld = 0, int64_t kv_ld = 0);
  // dq, dk, dv (overwritten, dense) from the forward's q, k, v (token strides q_ld, kv_ld as in
  // Forward), o, stats and the output gradient dout.
  bool Backward(const void* q, const void* k, const void* v, const void* o, const void* dout,
                const float* stats, void* dq, void* dk, void* dv, int64_t B, int64_t T, int64_t H,
                int64_t Hkv, int64_t D, cudaStream_t stream, std::string* error,
                int64_t q_ld = 0, int64_t kv_ld = 0);

  // Bytes of the workspace buffer currently held (0 before the first call, and always 0 with
  // set_workspace_allocator). The attention benchmark prints it.
  size_t workspace_bytes() const { return workspace_bytes_; }

  // Per-call workspaces from `alloc` (nullptr: out of memory), returned through `release` once
  // the call's work is enqueued on its stream; both must be ordered on that stream (e.g.
  // cudaMallocAsync / cudaFreeAsync on it).
  void set_workspace_allocator(std::function<void*(size_t)> alloc,
                               std::function<void(void*)> release) {
    alloc_ = std::move(alloc);
    release_ = std::move(release);
  }

 private:
  struct Plan;  // a built graph (or the error that prevented building it)
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int /*kind*/,
                         int64_t /*q_ld*/, int64_t /*kv_ld*/>;

  bool EnsureHandle(std::string* error);
  Plan* GetPlan(int kind, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                std::string* error, int64_t q_ld = 0, int64_t kv_ld = 0);
  bool EnsureWorkspace(size_t bytes, std::string* error);
  // One call's workspace: the held buffer, or one from alloc_, given back when the lease goes out
  // of scope (after the call has enqueued its work: stream order keeps it valid for that work).
  struct Lease {
    CudnnAttention* owner = nullptr;
    void* ptr = nullptr;
    bool taken = false;
    Lease() = default;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() {
      if (taken) owner->release_(ptr);
    }
  };
  // Sets the handle's stream and takes the workspace of `bytes` into *lease.
  bool BeginCall(cudaStream_t stream, int64_t bytes, Lease* lease, std::string* error);

  int device_;
  bool deterministic_ = true;
  void* handle_ = nullptr;  // cudnnHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::function<void*(size_t)> alloc_;
  std::function<void(void*)> release_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace fsdp8::cuda
