// CudnnAttention (attention_cudnn.h): cuDNN frontend SDPA graphs, cached per shape.
//
// Graph construction follows the cuDNN frontend's documented SDPA flow (docs/operations/
// Attention.md of NVIDIA/cudnn-frontend): tensors in (b, h, s, d) logical order with BSHD strides,
// graph.sdpa with generate_stats, graph.sdpa_backward with the saved stats, then validate,
// build_operation_graph, create_execution_plans({A}), check_support, build_plans.
#include "kernels/cuda/attention_cudnn.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <unordered_map>
#include <utility>

#include <cuda_runtime_api.h>
#include <cudnn.h>
#include <cudnn_frontend.h>

namespace fsdp8::cuda {

namespace fe = cudnn_frontend;

namespace {

enum Kind : int { kForward = 0, kBackwardDet = 1, kBackwardNonDet = 2 };

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

std::string ShapeText(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
  char buf[128];
  std::snprintf(buf, sizeof(buf), "B %lld T %lld H %lld Hkv %lld D %lld", static_cast<long long>(B),
                static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(Hkv),
                static_cast<long long>(D));
  return buf;
}

void SetError(std::string* error, const std::string& msg) {
  if (error != nullptr) *error = msg;
}

std::string VersionText(int64_t v) {
  // cuDNN 9 encodes major*10000 + minor*100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." + std::to_string(v % 100);
}

// (b, h, s, d) logical dims over a BSHD buffer whose tokens are ld elements apart (0: Hn * D).
std::shared_ptr<fe::graph::Tensor_attributes> Bshd(fe::graph::Graph& g, const char* name, int64_t uid,
                                                   int64_t B, int64_t T, int64_t Hn, int64_t D,
                                                   int64_t ld = 0) {
  if (ld == 0) ld = Hn * D;
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({B, Hn, T, D})
                      .set_stride({T * ld, D, ld, 1}));
}

}  // namespace

struct CudnnAttention::Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
  std::string error;  // non-empty: building failed, graph is null
};

CudnnAttention::CudnnAttention(int device) : device_(device) {}

CudnnAttention::~CudnnAttention() {
  plans_.clear();
  if (handle_ != nullptr) cudnnDestroy(static_cast<cudnnHandle_t>(handle_));
  if (workspace_ != nullptr) cudaFree(workspace_);
}

int64_t CudnnAttention::RuntimeVersion() { return static_cast<int64_t>(cudnnGetVersion()); }
std::string CudnnAttention::RuntimeVersionString() { return VersionText(RuntimeVersion()); }
int64_t CudnnAttention::CompiledVersion() { return CUDNN_VERSION; }

bool CudnnAttention::EnsureHandle(std::string* error) {
  const cudaError_t ce = cudaSetDevice(device_);
  if (ce != cudaSuccess) {
    SetError(error, std::string("cudaSetDevice: ") + cudaGetErrorString(ce));
    return false;
  }
  if (handle_ != nullptr) return true;
  cudnnHandle_t h = nullptr;
  const cudnnStatus_t st = cudnnCreate(&h);
  if (st != CUDNN_STATUS_SUCCESS) {
    SetError(error, std::string("cudnnCreate failed: ") + cudnnGetErrorString(st) + " (cuDNN runtime " +
                        RuntimeVersionString() + ")");
    return false;
  }
  handle_ = h;
  return true;
}

bool CudnnAttention::EnsureWorkspace(size_t bytes, std::string* error) {
  if (bytes <= workspace_bytes_) return true;
  if (workspace_ != nullptr) {
    cudaFree(workspace_);
    workspace_ = nullptr;
    workspace_bytes_ = 0;
  }
  const cudaError_t ce = cudaMalloc(&workspace_, bytes);
  if (ce != cudaSuccess) {
    workspace_ = nullptr;
    SetError(error, "cuDNN attention workspace: cudaMalloc of " + std::to_string(bytes) +
                        " bytes failed: " + cudaGetErrorString(ce));
    return false;
  }
  workspace_bytes_ = bytes;
  return true;
}

CudnnAttention::Plan* CudnnAttention::GetPlan(int kind, int64_t B, int64_t T, int64_t H, int64_t Hkv,
                                              int64_t D, std::string* error, int64_t q_ld,
                                              int64_t kv_ld) {
  const std::string what = std::string("cuDNN ") + RuntimeVersionString() +
                           (kind == kForward ? " SDPA forward (" : " SDPA backward (") +
                           ShapeText(B, T, H, Hkv, D) +
                           (kind == kBackwardDet ? ", deterministic" : kind == kBackwardNonDet ? ", non-deterministic" : "") +
                           ")";
  if (B <= 0 || T <= 0 || H <= 0 || Hkv <= 0 || D <= 0 || H % Hkv != 0) {
    SetError(error, what + ": invalid shape (sizes must be positive and Hkv must divide H)");
    return nullptr;
  }
  if (q_ld == H * D) q_ld = 0;
  if (kv_ld == Hkv * D) kv_ld = 0;
  if ((q_ld != 0 && q_ld < H * D) || (kv_ld != 0 && kv_ld < Hkv * D)) {
    SetError(error, what + ": token stride below the heads' width");
    return nullptr;
  }
  const Key key{B, T, H, Hkv, D, kind, q_ld, kv_ld};
  auto it = plans_.find(key);
  if (it != plans_.end()) {
    if (!it->second->error.empty()) {
      SetError(error, it->second->error);
      return nullptr;
    }
    return it->second.get();
  }
  auto plan = std::make_unique<Plan>();
  Plan* p = plan.get();
  plans_.emplace(key, std::move(plan));
  auto fail = [&](const std::string& stage, const std::string& msg) -> Plan* {
    p->graph.reset();
    p->error = what + ": " + stage + ": " + msg;
    SetError(error, p->error);
    return nullptr;
  };
  if (!EnsureHandle(error)) {
    plans_.erase(key);  // not a property of the shape; retry next time
    return nullptr;
  }
  cudnnHandle_t handle = static_cast<cudnnHandle_t>(handle_);
  try {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    auto q = Bshd(*g, "Q", kQ, B, T, H, D, q_ld);
    auto k = Bshd(*g, "K", kK, B, T, Hkv, D, kv_ld);
    auto v = Bshd(*g, "V", kV, B, T, Hkv, D, kv_ld);
    if (kind == kForward) {
      auto opts = fe::graph::SDPA_attributes()
                      .set_name("fsdp8_sdpa_fwd")
                      .set_generate_stats(true)
                      .set_causal_mask(true)
                      .set_attn_scale(scale);
      auto [o, stats] = g->sdpa(q, k, v, opts);
      o->set_output(true).set_uid(kO).set_dim({B, H, T, D}).set_stride({T * H * D, D, H * D, 1});
      stats->set_output(true)
          .set_uid(kStats)
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim({B, H, T, 1})
          .set_stride({H * T, T, 1, 1});
    } else {
      auto o = Bshd(*g, "O", kO, B, T, H, D);
      auto dout = Bshd(*g, "dO", kDO, B, T, H, D);
      auto stats = g->tensor(fe::graph::Tensor_attributes()
                                 .set_name("Stats")
                                 .set_uid(kStats)
                                 .set_dim({B, H, T, 1})
                                 .set_stride({H * T, T, 1, 1})
                                 .set_data_type(fe::DataType_t::FLOAT));
      auto opts = fe::graph::SDPA_backward_attributes()
                      .set_name("fsdp8_sdpa_bwd")
                      .set_causal_mask(true)
                      .set_attn_scale(scale);
      if (kind == kBackwardDet) opts.set_deterministic_algorithm(true);
      auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, opts);
      dq->set_output(true).set_uid(kDQ).set_dim({B, H, T, D}).set_stride({T * H * D, D, H * D, 1});
      dk->set_output(true).set_uid(kDK).set_dim({B, Hkv, T, D}).set_stride({T * Hkv * D, D, Hkv * D, 1});
      dv->set_output(true).set_uid(kDV).set_dim({B, Hkv, T, D}).set_stride({T * Hkv * D, D, Hkv * D, 1});
    }
    fe::error_t e = g->validate();
    if (e.is_bad()) return fail("validate", e.get_message());
    e = g->build_operation_graph(handle);
    if (e.is_bad()) return fail("build_operation_graph", e.get_message());
    e = g->create_execution_plans({fe::HeurMode_t::A});
    if (e.is_bad()) return fail("create_execution_plans", e.get_message());
    e = g->check_support(handle);
    if (e.is_bad()) return fail("check_support", e.get_message());
    e = g->build_plans(handle);
    if (e.is_bad()) return fail("build_plans", e.get_message());
    int64_t ws = 0;
    e = g->get_workspace_size(ws);
    if (e.is_bad()) return fail("get_workspace_size", e.get_message());
    p->graph = std::move(g);
    p->workspace = ws;
  } catch (const std::exception& ex) {
    return fail("exception", ex.what());
  }
  return p;
}

bool CudnnAttention::BeginCall(cudaStream_t stream, int64_t bytes, Lease* lease,
                               std::string* error) {
  const cudnnStatus_t st = cudnnSetStream(static_cast<cudnnHandle_t>(handle_), stream);
  if (st != CUDNN_STATUS_SUCCESS) {
    SetError(error, std::string("cudnnSetStream: ") + cudnnGetErrorString(st));
    return false;
  }
  const size_t n = static_cast<size_t>(bytes);
  if (!alloc_) {
    if (!EnsureWorkspace(n, error)) return false;
    lease->ptr = workspace_;
    return true;
  }
  if (n == 0) return true;
  lease->ptr = alloc_(n);
  if (lease->ptr == nullptr) {
    SetError(error, "cuDNN attention workspace: allocating " + std::to_string(n) +
                        " bytes failed (device out of memory)");
    return false;
  }
  lease->owner = this;
  lease->taken = true;
  return true;
}

bool CudnnAttention::Prepare(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D, std::string* error) {
  Plan* f = GetPlan(kForward, B, T, H, Hkv, D, error);
  if (f == nullptr) return false;
  Plan* b = GetPlan(deterministic_ ? kBackwardDet : kBackwardNonDet, B, T, H, Hkv, D, error);
  if (b == nullptr) return false;
  if (alloc_) return true;  // per-call workspaces
  return EnsureWorkspace(static_cast<size_t>(std::max(f->workspace, b->workspace)), error);
}

bool CudnnAttention::Forward(const void* q, const void* k, const void* v, void* o, float* stats, int64_t B,
                             int64_t T, int64_t H, int64_t Hkv, int64_t D, cudaStream_t stream,
                             std::string* error, int64_t q_ld, int64_t kv_ld) {
  if (q == nullptr || k == nullptr || v == nullptr || o == nullptr || stats == nullptr) {
    SetError(error, "CudnnAttention::Forward: null pointer argument");
    return false;
  }
  if (!EnsureHandle(error)) return false;
  Plan* p = GetPlan(kForward, B, T, H, Hkv, D, error, q_ld, kv_ld);
  if (p == nullptr) return false;
  Lease lease;
  if (!BeginCall(stream, p->workspace, &lease, error)) return false;
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(q)}, {kK, const_cast<void*>(k)},
                                             {kV, const_cast<void*>(v)}, {kO, o},
                                             {kStats, stats}};
  try {
    fe::error_t e = p->graph->execute(static_cast<cudnnHandle_t>(handle_), pack, lease.ptr);
    if (e.is_bad()) {
      SetError(error, "cuDNN SDPA forward (" + ShapeText(B, T, H, Hkv, D) + "): execute: " + e.get_message());
      return false;
    }
  } catch (const std::exception& ex) {
    SetError(error, std::string("cuDNN SDPA forward: execute threw: ") + ex.what());
    return false;
  }
  return true;
}

bool CudnnAttention::Backward(const void* q, const void* k, const void* v, const void* o, const void* dout,
                              const float* stats, void* dq, void* dk, void* dv, int64_t B, int64_t T,
                              int64_t H, int64_t Hkv, int64_t D, cudaStream_t stream, std::string* error,
                              int64_t q_ld, int64_t kv_ld) {
  if (q == nullptr || k == nullptr || v == nullptr || o == nullptr || dout == nullptr || stats == nullptr ||
      dq == nullptr || dk == nullptr || dv == nullptr) {
    SetError(error, "CudnnAttention::Backward: null pointer argument");
    return false;
  }
  if (!EnsureHandle(error)) return false;
  Plan* p = GetPlan(deterministic_ ? kBackwardDet : kBackwardNonDet, B, T, H, Hkv, D, error, q_ld,
                    kv_ld);
  if (p == nullptr) return false;
  Lease lease;
  if (!BeginCall(stream, p->workspace, &lease, error)) return false;
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<void*>(q)},     {kK, const_cast<void*>(k)},
      {kV, const_cast<void*>(v)},     {kO, const_cast<void*>(o)},
      {kDO, const_cast<void*>(dout)}, {kStats, const_cast<float*>(stats)},
      {kDQ, dq},                      {kDK, dk},
      {kDV, dv}};
  try {
    fe::error_t e = p->graph->execute(static_cast<cudnnHandle_t>(handle_), pack, lease.ptr);
    if (e.is_bad()) {
      SetError(error, "cuDNN SDPA backward (" + ShapeText(B, T, H, Hkv, D) + "): execute: " + e.get_message());
      return false;
    }
  } catch (const std::exception& ex) {
    SetError(error, std::string("cuDNN SDPA backward: execute threw: ") + ex.what());
    return false;
  }
  return true;
}

}  // namespace fsdp8::cuda

// The frontend headers reference NVRTC for experimental runtime-compiled kernels that this file
// never requests (only the standard SDPA graphs). Rather than adding libnvrtc (about 100 MB, not
// shipped with the cuDNN runtime) as a hard dependency, weak definitions that report failure
// satisfy the linker; a program that links the real libnvrtc overrides them.
extern "C" {
#define FSDP8_NVRTC_UNAVAILABLE return NVRTC_ERROR_INTERNAL_ERROR
__attribute__((weak)) nvrtcResult nvrtcCreateProgram(nvrtcProgram*, const char*, const char*, int,
                                                     const char* const*, const char* const*) {
  FSDP8_NVRTC_UNAVAILABLE;
}
__attribute__((weak)) nvrtcResult nvrtcDestroyProgram(nvrtcProgram*) { FSDP8_NVRTC_UNAVAILABLE; }
__attribute__((weak)) nvrtcResult nvrtcCompileProgram(nvrtcProgram, int, const char* const*) {
  FSDP8_NVRTC_UNAVAILABLE;
}
__attribute__((weak)) nvrtcResult nvrtcGetCUBINSize(nvrtcProgram, size_t*) { FSDP8_NVRTC_UNAVAILABLE; }
__attribute__((weak)) nvrtcResult nvrtcGetCUBIN(nvrtcProgram, char*) { FSDP8_NVRTC_UNAVAILABLE; }
__attribute__((weak)) nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram, size_t*) { FSDP8_NVRTC_UNAVAILABLE; }
__attribute__((weak)) nvrtcResult nvrtcGetProgramLog(nvrtcProgram, char*) { FSDP8_NVRTC_UNAVAILABLE; }
#undef FSDP8_NVRTC_UNAVAILABLE
}
