// fsdp8-bench-cuda: throughput of the CUDA backend on the 1b preset's shapes (d 2048, ffn 5632,
// 16 heads, seq 2048, 8 sequences per GPU -> M = 16384 tokens), on one GPU.
//
//  (a) GemmFp8 exactly as the worker issues it (Backend::GemmFp8: the backend's descriptor cache,
//      workspace and device scale pointers; f32 output; casts excluded) next to a bare cuBLASLt
//      call on the same problem (fresh descriptors, the heuristic's best algorithm, same types and
//      scale pointers), for Y = X W^T, dX = dY W and dW = dY^T X of the QKV/O, gate/up and down
//      projections. TFLOP/s = 2 M N K / time.
//  (b) CastTransposeFp8 bandwidth (bytes read + written / time) at 16384 x 2048 and 16384 x 5632,
//      against cudaMemcpyDeviceToDevice of 1 GiB measured in the same run (2 bytes moved per byte).
//  (c) causal attention forward + backward at B 8, H 16, D 128, T 2048, FLOPs 2 B H T^2 D forward
//      and 2.5 x that backward: BF16 through cuDNN's fused flash attention
//      (kernels/cuda/attention_cudnn.h; backward timed deterministic, as training runs it, and
//      non-deterministic), then the Backend's f32 kernels (f32 storage) for comparison. When cuDNN
//      cannot build a graph the reason is printed and the f32 rows still run.
//
//  (f) the memory-bound backward passes of a 1b block (RMSNorm backward with bf16 dX parts, the
//      fused SwiGLU / RoPE backward + cast-transposes and their unfused compositions), GB/s.
//  (g) every candidate algorithm cuBLASLt's heuristic returns for each FP8 GEMM of the 1b step
//      (output type, fast accumulation and residual accumulation as the worker runs them): the
//      first candidate, which the backend takes, against the fastest.
//
//  (k) with --calibration FILE: the backend's Gemm with bf16-rounded and f32 inputs on the
//      shapes of (a), and AdamW (f32 moments, 64 M elements, 28 bytes per element); then FILE
//      gets the calibration of common/cost_model.h as JSON: GEMM classes of (a) (fp8, backend
//      path) and (k) (bf16, fp32; bf16 at the 1b and Llama 3 LM heads' shapes; fp8 at the
//      Llama-3-8B block's shapes), attention forward and deterministic / non-deterministic
//      backward from (c), "attention_classes" from (k) (cuDNN at 2048 and 8192 tokens per
//      sequence, 16 heads and 32 heads of which 8 kv, head_dim 128), "op_floor_us" (a tiny
//      backend call's time when calls are issued back to back), "launch_us", "alloc_us" and
//      "sync_us" (CalibrateHost: an empty kernel's launch, a workspace's Alloc + Free, a
//      synchronising 4-byte readback / upload's round trip), "memory_gbps" the bytes over
//      the time of (b)'s and (f)'s passes, "optimizer_gbps" from (k).
//      bench/calibrate.sh (BACKEND=cuda) adds the published NCCL bus bandwidths and the links.
//
// Timing: cudaEvents around each call on the backend's stream, 5 warm-up calls, median of 21,
// inputs rotated between two sets. Usage: fsdp8-bench-cuda [--device N] [--quick] [--only LETTERS]
// [--calibration FILE] (--only f: section (f) only; d and e run inside c; --calibration needs
// sections a, b, c and f: run it without --only).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#if defined(FSDP8_WITH_CUDNN)
#include "kernels/cuda/attention_cudnn.h"
#endif

namespace {

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s failed: %s at %s:%d\n", #x, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)
#define CKB(x)                                                                             \
  do {                                                                                     \
    cublasStatus_t s_ = (x);                                                               \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                     \
      std::fprintf(stderr, "%s failed: status %d at %s:%d\n", #x, static_cast<int>(s_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

int g_warm = 5, g_iters = 21;

// What --calibration writes (section (k)).
struct CalibrationFigures {
  std::string gemm;  // JSON objects of the GEMM classes, comma-separated
  double pass_bytes = 0, pass_ms = 0;
  double attention_fwd_tflops = 0, attention_bwd_tflops = 0, attention_bwd_nondet_tflops = 0;
  std::string attention_classes;  // JSON objects of (k)'s attention shapes, comma-separated
  double op_floor_us = 0;         // (k): a tiny backend call's time, issued back to back
  // (k) the host's per-call and per-synchronisation costs (CalibrateHost)
  double launch_us = 0, alloc_us = 0, sync_us = 0;
  double optimizer_gbps = 0;
  void AddGemm(const char* precision, int64_t m, int64_t n, int64_t k, double tflops) {
    char b[256];
    std::snprintf(b, sizeof(b), "%s\n    {\"precision\": \"%s\", \"m\": %lld, \"n\": %lld, \"k\": %lld, \"tflops\": %.6g}",
                  gemm.empty() ? "" : ",", precision, static_cast<long long>(m), static_cast<long long>(n),
                  static_cast<long long>(k), tflops);
    gemm += b;
  }
};
CalibrationFigures g_cal;

// Median milliseconds of fn(i) on `stream`.
double MedianMs(cudaStream_t stream, const std::function<void(int)>& fn) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < g_warm; ++i) fn(i);
  std::vector<double> ms;
  for (int i = 0; i < g_iters; ++i) {
    CK(cudaEventRecord(a, stream));
    fn(i);
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

__global__ void EmptyKernel() {}

__global__ void FillCodes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    // |value| in [2^-3, 2^3] for either format, random sign: finite, no NaN.
    p[i] = static_cast<uint8_t>((h & 0x80u) | (0x28u + (h >> 8) % 0x30u));
  }
}

__global__ void FillFloats(float* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = (static_cast<float>(h & 0xFFFFFF) / 16777216.0f - 0.5f) * 4.0f;
  }
}

#if defined(FSDP8_WITH_CUDNN)  // the kernels of section (c), cuDNN attention
// bf16 values uniform in [-2, 2).
__global__ void FillBf16(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = __float2bfloat16((static_cast<float>(h & 0xFFFFFF) / 16777216.0f - 0.5f) * 4.0f);
  }
}

// Keeps the stream busy for `cycles` clocks (one thread), so the host can enqueue ahead of it.
__global__ void Spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// Holds one SM per block (its shared memory) for `cycles` clocks; flags *started once running.
__global__ void HoldSms(long long cycles, volatile int* started) {
  extern __shared__ char smem[];
  const long long t0 = clock64();
  if (threadIdx.x == 0 && blockIdx.x == 0) *started = 1;
  while (clock64() - t0 < cycles) {
  }
  if (threadIdx.x == 0) smem[0] = 1;
}
#endif

struct Row {
  std::string section, name, value, ref, ratio;
};
std::vector<Row> g_rows;

struct GemmShape {
  const char* name;
  int64_t M, N, K;
  fsdp8::Fp8Format a, b;
};

// Operands of the GEMM sections: two rotating sets of random FP8 codes (A, B: `bytes` each), an
// output C of `c_bytes` (zeroed: finite for beta = 1), the two scale_invs in 16-byte slots as the
// worker keeps them (train/device_buffer.h: a at scales, b at scales + 4) and a cuBLASLt
// workspace of kWsBytes.
struct GemmOperands {
  static constexpr size_t kWsBytes = 32u << 20;
  GemmOperands(fsdp8::Backend* be, cudaStream_t st, size_t bytes, size_t c_bytes, uint32_t seed)
      : be_(be) {
    for (int i = 0; i < 2; ++i) {
      A[i] = static_cast<uint8_t*>(be->Alloc(bytes));
      B[i] = static_cast<uint8_t*>(be->Alloc(bytes));
      FillCodes<<<1024, 256, 0, st>>>(A[i], bytes, seed + i);
      FillCodes<<<1024, 256, 0, st>>>(B[i], bytes, seed + 50u + i);
    }
    C = be->Alloc(c_bytes);
    CK(cudaMemsetAsync(C, 0, c_bytes, st));
    scales = static_cast<float*>(be->Alloc(8 * sizeof(float)));
    const float hs[8] = {0.5f, 0, 0, 0, 0.25f, 0, 0, 0};
    be->CopyToDevice(scales, hs, sizeof(hs));
    CK(cudaMalloc(&ws, kWsBytes));
  }
  ~GemmOperands() {
    cudaDeviceSynchronize();
    cudaFree(ws);
    for (int i = 0; i < 2; ++i) {
      be_->Free(A[i]);
      be_->Free(B[i]);
    }
    be_->Free(C);
    be_->Free(scales);
  }
  fsdp8::Backend* be_;
  uint8_t* A[2];
  uint8_t* B[2];
  void* C = nullptr;
  float* scales = nullptr;
  void* ws = nullptr;
};

// One FP8 problem set up from scratch in cuBLASLt (fresh handle, descriptors and layouts; see
// kernels/cuda/gemm.h for the row-major -> column-major mapping): the backend's problem, timed
// without the backend. out_type: CUDA_R_32F or CUDA_R_16BF; fast_accum:
// CUBLASLT_MATMUL_DESC_FAST_ACCUM (no promotion of the tensor cores' partial sums into full FP32
// every few K blocks); backend_prefs: exclude the split-K schemes that reduce in place with
// atomics, as kernels/cuda/gemm.cu asks.
struct BareProblem {
  BareProblem(const GemmShape& s, const float* sa, const float* sb, size_t ws_bytes,
              cudaDataType_t out_type, bool fast_accum, bool backend_prefs) {
    CKB(cublasLtCreate(&h));
    CKB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int8_t fa = fast_accum ? 1 : 0;
    CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, sizeof(fa)));
    const cublasOperation_t T = CUBLAS_OP_T, N = CUBLAS_OP_N;
    CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof(T)));
    CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &N, sizeof(N)));
    CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb, sizeof(sb)));
    CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa, sizeof(sa)));
    auto ty = [](fsdp8::Fp8Format f) { return f == fsdp8::Fp8Format::kE5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3; };
    CKB(cublasLtMatrixLayoutCreate(&la, ty(s.b), s.K, s.N, s.K));
    CKB(cublasLtMatrixLayoutCreate(&lb, ty(s.a), s.K, s.M, s.K));
    CKB(cublasLtMatrixLayoutCreate(&lc, out_type, s.N, s.M, s.N));
    CKB(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t wsb = ws_bytes;
    CKB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
    if (backend_prefs) {
      const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_MASK & ~static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_INPLACE);
      CKB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)));
    }
  }
  ~BareProblem() {
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    cublasLtDestroy(h);
  }
  // Up to n heuristic candidates, best first.
  std::vector<cublasLtMatmulHeuristicResult_t> Candidates(int n) {
    std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(n));
    int found = 0;
    CKB(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, n, res.data(), &found));
    res.resize(static_cast<size_t>(found));
    return res;
  }
  // D = C = ... (beta 0 or 1), our A and B swapped into cuBLASLt's B and A.
  cublasStatus_t Run(const cublasLtMatmulAlgo_t& algo, const void* A, const void* B, void* C,
                     float beta, void* ws, size_t ws_bytes, cudaStream_t stream) {
    const float alpha = 1.0f;
    return cublasLtMatmul(h, desc, &alpha, B, la, A, lb, &beta, C, lc, C, lc, &algo, ws, ws_bytes, stream);
  }
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
};

// Section (k) and the calibration file (see the file comment). false (with a message) when a
// figure the file needs was not measured or the file cannot be written.
#if defined(FSDP8_WITH_CUDNN)
// (k) cuDNN causal attention at one shape (bf16, dense): forward, deterministic and
// non-deterministic backward, TFLOP/s as in (c); appended to g_cal.attention_classes.
void CalibrateAttention(fsdp8::Backend* be, cudaStream_t st, int device, int64_t Bn, int64_t T,
                        int64_t H, int64_t Hkv, int64_t D) {
  const int64_t nq = Bn * T * H * D, nk = Bn * T * Hkv * D;
  std::vector<void*> bufs;
  auto alloc16 = [&](int64_t count, uint32_t seed) {
    auto* p = static_cast<__nv_bfloat16*>(be->Alloc(count * 2));
    FillBf16<<<1024, 256, 0, st>>>(p, count, seed);
    bufs.push_back(p);
    return p;
  };
  __nv_bfloat16 *q = alloc16(nq, 41), *k = alloc16(nk, 42), *v = alloc16(nk, 43), *o = alloc16(nq, 44),
                *dout = alloc16(nq, 45), *dq = alloc16(nq, 46), *dk = alloc16(nk, 47), *dv = alloc16(nk, 48);
  float* stats = static_cast<float*>(be->Alloc(Bn * H * T * sizeof(float)));
  bufs.push_back(stats);
  fsdp8::cuda::CudnnAttention att(device);
  std::string err;
  const double fwd_flop = 2.0 * Bn * H * static_cast<double>(T) * T * D;
  double tf[3] = {0, 0, 0};  // forward, deterministic backward, non-deterministic backward
  if (att.Forward(q, k, v, o, stats, Bn, T, H, Hkv, D, st, &err)) {
    tf[0] = fwd_flop / MedianMs(st, [&](int) { att.Forward(q, k, v, o, stats, Bn, T, H, Hkv, D, st, &err); }) / 1e9;
    for (int det = 1; det >= 0; --det) {
      att.set_deterministic_backward(det == 1);
      if (!att.Backward(q, k, v, o, dout, stats, dq, dk, dv, Bn, T, H, Hkv, D, st, &err)) continue;
      tf[2 - det] = 2.5 * fwd_flop / MedianMs(st, [&](int) {
        att.Backward(q, k, v, o, dout, stats, dq, dk, dv, Bn, T, H, Hkv, D, st, &err);
      }) / 1e9;
    }
  }
  CK(cudaStreamSynchronize(st));
  for (void* p : bufs) be->Free(p);
  std::printf("  attention B %lld T %5lld H %lld Hkv %lld D %lld: forward %6.1f  backward %6.1f (det) %6.1f (nondet)%s\n",
              static_cast<long long>(Bn), static_cast<long long>(T), static_cast<long long>(H),
              static_cast<long long>(Hkv), static_cast<long long>(D), tf[0], tf[1], tf[2],
              tf[0] > 0 && tf[1] > 0 ? "" : "  (unavailable, left out)");
  if (tf[0] <= 0 || tf[1] <= 0) return;
  char b[384];
  std::snprintf(b, sizeof(b),
                "%s\n    {\"batch\": %lld, \"seq\": %lld, \"heads\": %lld, \"kv_heads\": %lld, \"head_dim\": %lld, "
                "\"forward_tflops\": %.6g, \"backward_tflops\": %.6g, \"backward_nondeterministic_tflops\": %.6g}",
                g_cal.attention_classes.empty() ? "" : ",", static_cast<long long>(Bn),
                static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(Hkv),
                static_cast<long long>(D), tf[0], tf[1], tf[2] > 0 ? tf[2] : tf[1]);
  g_cal.attention_classes += b;
}
#endif

// (k) FP8 GEMMs through the backend (f32 output, as (a)) at the Llama-3-8B block's shapes
// (M 8192 tokens, d 4096, ffn 14336, q/k/v fused 6144, gate/up fused 28672): classes for models
// far from the 1b shapes of (a).
void CalibrateFp8Large(fsdp8::Backend* be, cudaStream_t st) {
  using fsdp8::Fp8Format;
  const int64_t M = 8192, d = 4096, f = 14336, t = 6144;
  const GemmShape shapes[] = {
      {"qkv fwd", M, t, d, Fp8Format::kE4M3, Fp8Format::kE4M3},
      {"qkv dX", M, d, t, Fp8Format::kE5M2, Fp8Format::kE4M3},
      {"qkv dW", t, d, M, Fp8Format::kE5M2, Fp8Format::kE4M3},
      {"o fwd", M, d, d, Fp8Format::kE4M3, Fp8Format::kE4M3},
      {"o dW", d, d, M, Fp8Format::kE5M2, Fp8Format::kE4M3},
      {"gate/up fwd", M, 2 * f, d, Fp8Format::kE4M3, Fp8Format::kE4M3},
      {"gate/up dX", M, d, 2 * f, Fp8Format::kE5M2, Fp8Format::kE4M3},
      {"gate/up dW", 2 * f, d, M, Fp8Format::kE5M2, Fp8Format::kE4M3},
      {"down fwd", M, d, f, Fp8Format::kE4M3, Fp8Format::kE4M3},
      {"down dX", M, f, d, Fp8Format::kE5M2, Fp8Format::kE4M3},
      {"down dW", d, f, M, Fp8Format::kE5M2, Fp8Format::kE4M3},
  };
  GemmOperands op(be, st, static_cast<size_t>(M) * 2 * f, static_cast<size_t>(M) * 2 * f * sizeof(float), 29u);
  float* C = static_cast<float*>(op.C);
  for (const GemmShape& s : shapes) {
    const double ms = MedianMs(st, [&](int i) {
      be->GemmFp8(false, true, s.M, s.N, s.K, {op.A[i & 1], s.a, op.scales},
                  {op.B[i & 1], s.b, op.scales + 4}, C, false);
    });
    const double tf = 2.0 * s.M * s.N * s.K / ms / 1e9;
    std::printf("  fp8 %-12s M %6lld N %6lld K %6lld  %7.1f\n", s.name, static_cast<long long>(s.M),
                static_cast<long long>(s.N), static_cast<long long>(s.K), tf);
    g_cal.AddGemm("fp8", s.M, s.N, s.K, tf);
  }
}

// (k) The BF16 LM head's GEMMs (Gemm with bf16-rounded inputs, as the block shapes above):
// logits (M, V, C), dX (M, C, V), dW (V, C, M) at the 1b preset's head (M 16384, V 32768, C 2048)
// and Llama 3's (M 8192, V 128256, C 4096).
void CalibrateHeads(fsdp8::Backend* be, cudaStream_t st) {
  const int64_t heads[][3] = {{16384, 32768, 2048}, {8192, 128256, 4096}};
  size_t big = 0;
  for (const auto& h : heads) big = std::max<size_t>(big, static_cast<size_t>(h[0]) * h[1]);
  float* A = static_cast<float*>(be->Alloc(big * sizeof(float)));
  float* B = static_cast<float*>(be->Alloc(big * sizeof(float)));
  float* C = static_cast<float*>(be->Alloc(big * sizeof(float)));
  FillFloats<<<1024, 256, 0, st>>>(A, big, 23u);
  FillFloats<<<1024, 256, 0, st>>>(B, big, 24u);
  for (const auto& h : heads) {
    const int64_t M = h[0], V = h[1], Cd = h[2];
    const int64_t shapes[][3] = {{M, V, Cd}, {M, Cd, V}, {V, Cd, M}};
    for (const auto& sh : shapes) {
      const double ms = MedianMs(st, [&](int) {
        be->Gemm(false, true, sh[0], sh[1], sh[2], A, B, C, false, fsdp8::GemmInputs::kBF16);
      });
      const double tf = 2.0 * sh[0] * sh[1] * sh[2] / ms / 1e9;
      std::printf("  bf16 head    M %6lld N %6lld K %6lld  %7.1f\n", static_cast<long long>(sh[0]),
                  static_cast<long long>(sh[1]), static_cast<long long>(sh[2]), tf);
      g_cal.AddGemm("bf16", sh[0], sh[1], sh[2], tf);
    }
  }
  be->Free(A);
  be->Free(B);
  be->Free(C);
}

// (k) The floor of a backend call: tiny RMSNorm, FP8 cast and bf16 GEMM calls (16 rows of 128)
// issued back to back, 200 of each per timed call: the time per call when the host's issue
// bounds the stream (launch, the backend's checks and descriptor lookups), which bounds a step
// of small shapes.
void CalibrateOpFloor(fsdp8::Backend* be, cudaStream_t st) {
  const int64_t R = 16, K = 128;
  const int kOps = 200;
  float* x = static_cast<float*>(be->Alloc(R * K * sizeof(float)));
  float* w = static_cast<float*>(be->Alloc(K * K * sizeof(float)));
  float* y = static_cast<float*>(be->Alloc(R * K * sizeof(float)));
  float* rstd = static_cast<float*>(be->Alloc(R * sizeof(float)));
  float* c = static_cast<float*>(be->Alloc(R * K * sizeof(float)));
  float* sc = static_cast<float*>(be->Alloc(2 * sizeof(float)));
  auto* codes = static_cast<uint8_t*>(be->Alloc(R * K));
  FillFloats<<<64, 256, 0, st>>>(x, R * K, 51u);
  FillFloats<<<64, 256, 0, st>>>(w, K * K, 52u);
  const float hs[2] = {1.0f, 0.0f};
  be->CopyToDevice(sc, hs, sizeof(hs));
  const double ms = MedianMs(st, [&](int) {
    for (int i = 0; i < kOps; ++i) {
      be->RmsNormForward(x, w, 1e-5f, R, K, y, rstd);
      be->CastFp8(y, 1, R * K, sc, fsdp8::Fp8Format::kE4M3, codes, nullptr, sc + 1);
      be->Gemm(false, true, R, R, K, y, w, c, false, fsdp8::GemmInputs::kBF16);
    }
  });
  g_cal.op_floor_us = ms * 1e3 / (3 * kOps);
  std::printf("  a tiny backend call issued back to back: %.2f us\n", g_cal.op_floor_us);
  CK(cudaStreamSynchronize(st));
  for (void* p : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(y),
                  static_cast<void*>(rstd), static_cast<void*>(c), static_cast<void*>(sc),
                  static_cast<void*>(codes)}) {
    be->Free(p);
  }
}

// Median over 21 rounds (after 3 discarded) of fn's host wall-clock microseconds per call, fn
// running `calls` calls back to back; the stream is synchronised after each round, outside the
// timing.
double MedianHostUs(cudaStream_t st, int calls, const std::function<void()>& fn) {
  std::vector<double> us;
  for (int r = 0; r < 24; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) fn();
    const auto t1 = std::chrono::steady_clock::now();
    CK(cudaStreamSynchronize(st));
    if (r >= 3) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// (k) The host's costs a step pays per call and per synchronisation, whatever the model's size:
// an empty kernel's launch issued back to back (launch_us); a workspace's Alloc and Free through
// the backend (stream-ordered; alloc_us: the model's calls each write a fresh workspace); and a
// synchronisation: an empty kernel then the backend's 4-byte CopyToHost (a readback: losses,
// gradient norm, amaxes) or 4-byte CopyToDevice (an upload: tokens, scales; it waits for the
// stream too), each less the launch: sync_us, the mean of the two round trips.
void CalibrateHost(fsdp8::Backend* be, cudaStream_t st) {
  const int kCalls = 500;
  g_cal.launch_us = MedianHostUs(st, kCalls, [&] { EmptyKernel<<<1, 32, 0, st>>>(); });
  g_cal.alloc_us = MedianHostUs(st, kCalls, [&] { be->Free(be->Alloc(4096)); });
  float* d = static_cast<float*>(be->Alloc(sizeof(float)));
  float h = 1.0f;
  be->CopyToDevice(d, &h, sizeof(h));
  const double readback = MedianHostUs(st, 100, [&] {
    EmptyKernel<<<1, 32, 0, st>>>();
    be->CopyToHost(&h, d, sizeof(h));
  });
  const double upload = MedianHostUs(st, 100, [&] {
    EmptyKernel<<<1, 32, 0, st>>>();
    be->CopyToDevice(d, &h, sizeof(h));
  });
  be->Free(d);
  g_cal.sync_us = std::max(0.0, (readback + upload) / 2 - g_cal.launch_us);
  std::printf("  host: empty kernel launch %.2f us, workspace Alloc + Free %.2f us, "
              "readback %.2f us, upload %.2f us -> sync %.2f us\n",
              g_cal.launch_us, g_cal.alloc_us, readback, upload, g_cal.sync_us);
}

bool WriteCalibration(fsdp8::Backend* be, cudaStream_t st, int device, const char* device_name,
                      const std::string& path) {
  const int64_t M = 16384, d = 2048, f = 5632;
  const int64_t shapes[][3] = {{M, d, d}, {M, d, d}, {d, d, M}, {M, f, d}, {M, d, f},
                               {f, d, M}, {M, d, f}, {M, f, d}, {d, f, M}};
  const size_t big = static_cast<size_t>(M) * f;
  float* A = static_cast<float*>(be->Alloc(big * sizeof(float)));
  float* B = static_cast<float*>(be->Alloc(big * sizeof(float)));
  float* C = static_cast<float*>(be->Alloc(big * sizeof(float)));
  FillFloats<<<1024, 256, 0, st>>>(A, big, 21u);
  FillFloats<<<1024, 256, 0, st>>>(B, big, 22u);
  std::printf("\n(k) Gemm with bf16-rounded / f32 inputs, TFLOP/s; AdamW\n");
  for (const auto& sh : shapes) {
    const double flop = 2.0 * sh[0] * sh[1] * sh[2];
    double t[2];
    for (int v = 0; v < 2; ++v) {
      const fsdp8::GemmInputs in = v == 0 ? fsdp8::GemmInputs::kBF16 : fsdp8::GemmInputs::kF32;
      const double ms = MedianMs(st, [&](int) { be->Gemm(false, true, sh[0], sh[1], sh[2], A, B, C, false, in); });
      t[v] = flop / ms / 1e9;
      g_cal.AddGemm(v == 0 ? "bf16" : "fp32", sh[0], sh[1], sh[2], t[v]);
    }
    std::printf("  M %6lld N %5lld K %6lld  bf16 %7.1f  f32 %7.1f\n", static_cast<long long>(sh[0]),
                static_cast<long long>(sh[1]), static_cast<long long>(sh[2]), t[0], t[1]);
  }
  be->Free(A);
  be->Free(B);
  be->Free(C);
  CalibrateHeads(be, st);
  CalibrateFp8Large(be, st);
  CalibrateOpFloor(be, st);
  CalibrateHost(be, st);
#if defined(FSDP8_WITH_CUDNN)
  // Attention classes: the 1b preset's heads (16 of 128) and Llama 3's (32, 8 kv heads), at
  // 2048 and 8192 tokens per sequence (16384 tokens per call).
  const int64_t att_shapes[][4] = {{8, 2048, 16, 16}, {2, 8192, 16, 16}, {8, 2048, 32, 8}, {2, 8192, 32, 8}};
  for (const auto& a : att_shapes) CalibrateAttention(be, st, device, a[0], a[1], a[2], a[3], 128);
#else
  (void)device;
#endif
  const int64_t n = int64_t{64} << 20;
  float* p = static_cast<float*>(be->Alloc(n * 4));
  float* g = static_cast<float*>(be->Alloc(n * 4));
  float* m = static_cast<float*>(be->Alloc(n * 4));
  float* v = static_cast<float*>(be->Alloc(n * 4));
  FillFloats<<<1024, 256, 0, st>>>(p, n, 31u);
  FillFloats<<<1024, 256, 0, st>>>(g, n, 32u);
  CK(cudaMemsetAsync(m, 0, n * 4, st));
  CK(cudaMemsetAsync(v, 0, n * 4, st));
  const double ms = MedianMs(st, [&](int i) {
    be->AdamW(p, g, m, v, n, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 10 + i, 1.0f, nullptr, nullptr);
  });
  g_cal.optimizer_gbps = 28.0 * n / ms / 1e6;
  std::printf("  AdamW %lld elements: %.3f ms, %.0f GB/s (28 bytes per element)\n",
              static_cast<long long>(n), ms, g_cal.optimizer_gbps);
  for (void* x : {static_cast<void*>(p), static_cast<void*>(g), static_cast<void*>(m), static_cast<void*>(v)}) be->Free(x);
  if (g_cal.gemm.empty() || g_cal.pass_ms <= 0 || g_cal.attention_fwd_tflops <= 0 ||
      g_cal.attention_bwd_tflops <= 0) {
    std::fprintf(stderr, "--calibration: sections a, b, c (cuDNN attention) and f must run\n");
    return false;
  }
  FILE* out = std::fopen(path.c_str(), "w");
  if (out == nullptr) {
    std::fprintf(stderr, "--calibration: cannot write %s\n", path.c_str());
    return false;
  }
  const double nondet =
      g_cal.attention_bwd_nondet_tflops > 0 ? g_cal.attention_bwd_nondet_tflops : g_cal.attention_bwd_tflops;
  std::fprintf(out,
               "{\"backend\": \"cuda\", \"device\": \"%s\",\n \"memory_gbps\": %.6g, \"optimizer_gbps\": %.6g,\n"
               " \"op_floor_us\": %.6g, \"launch_us\": %.6g, \"alloc_us\": %.6g, \"sync_us\": %.6g,\n"
               " \"attention\": {\"forward_tflops\": %.6g, \"backward_tflops\": %.6g, "
               "\"backward_nondeterministic_tflops\": %.6g},\n \"attention_classes\": [%s\n ],\n"
               " \"gemm\": [%s\n ]}\n",
               device_name, g_cal.pass_bytes / g_cal.pass_ms / 1e6, g_cal.optimizer_gbps,
               g_cal.op_floor_us, g_cal.launch_us, g_cal.alloc_us, g_cal.sync_us,
               g_cal.attention_fwd_tflops, g_cal.attention_bwd_tflops, nondet,
               g_cal.attention_classes.c_str(), g_cal.gemm.c_str());
  std::fclose(out);
  std::printf("calibration written to %s\n", path.c_str());
  return true;
}

// Bare cuBLASLt: the heuristic's best algorithm with default preferences.
double BareLt(cudaStream_t stream, const GemmShape& s, uint8_t* const A[2], uint8_t* const B[2],
              void* C, const float* sa, const float* sb, void* ws, size_t ws_bytes,
              cudaDataType_t out_type = CUDA_R_32F, bool fast_accum = false) {
  BareProblem p(s, sa, sb, ws_bytes, out_type, fast_accum, /*backend_prefs=*/false);
  const auto res = p.Candidates(1);
  if (res.empty()) {
    std::fprintf(stderr, "bare cuBLASLt: no algorithm for %s\n", s.name);
    return -1;
  }
  return MedianMs(stream, [&](int i) { CKB(p.Run(res[0].algo, A[i & 1], B[i & 1], C, 0.0f, ws, ws_bytes, stream)); });
}

// Every candidate the heuristic returns (up to 16) for one problem, timed: returns the index and
// time of the fastest, and the time of candidate 0 (the one LtGemm takes) in *first_ms.
// accumulate: beta = 1 with C = D (f32), as the residual and accumulating GEMMs run.
int SweepLt(cudaStream_t stream, const GemmShape& s, uint8_t* const A[2], uint8_t* const B[2],
            void* C, const float* sa, const float* sb, void* ws, size_t ws_bytes,
            cudaDataType_t out_type, bool fast_accum, bool accumulate, double* first_ms,
            double* best_ms, int* found_out) {
  BareProblem p(s, sa, sb, ws_bytes, out_type, fast_accum, /*backend_prefs=*/true);
  const auto res = p.Candidates(16);
  const float beta = accumulate ? 1.0f : 0.0f;
  int best = -1;
  *best_ms = 1e30;
  *first_ms = -1;
  for (size_t a = 0; a < res.size(); ++a) {
    if (res[a].state != CUBLAS_STATUS_SUCCESS) continue;
    if (p.Run(res[a].algo, A[0], B[0], C, beta, ws, ws_bytes, stream) != CUBLAS_STATUS_SUCCESS) continue;
    const double ms = MedianMs(stream, [&](int i) {
      CKB(p.Run(res[a].algo, A[i & 1], B[i & 1], C, beta, ws, ws_bytes, stream));
    });
    if (a == 0) *first_ms = ms;
    if (ms < *best_ms) {
      *best_ms = ms;
      best = static_cast<int>(a);
    }
  }
  *found_out = static_cast<int>(res.size());
  return best;
}

char* Fmt(double v, const char* unit) {
  static char buf[8][64];
  static int k = 0;
  char* b = buf[k++ & 7];
  std::snprintf(b, 64, "%.1f %s", v, unit);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  int device = 0;
  bool quick = false;
  std::string only;  // section letters to run (all when empty)
  std::string calibration;  // --calibration FILE
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--calibration") && i + 1 < argc) calibration = argv[++i];
    if (!std::strcmp(argv[i], "--device") && i + 1 < argc) device = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
  }
  auto want = [&](const char* letters) {
    if (only.empty()) return true;
    for (const char* l = letters; *l; ++l) {
      if (only.find(*l) != std::string::npos) return true;
    }
    return false;
  };
  if (quick) {
    g_warm = 2;
    g_iters = 5;
  }
  std::string err;
  std::unique_ptr<fsdp8::Backend> be = fsdp8::CreateBackend("cuda", device, &err);
  if (!be) {
    std::fprintf(stderr, "fsdp8-bench-cuda: %s\n", err.c_str());
    return 2;
  }
  auto* cb = dynamic_cast<fsdp8::CudaBackend*>(be.get());
  cudaStream_t st = cb->stream();
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, device));
  int cublas_ver = static_cast<int>(cublasLtGetVersion());
  std::printf("device %d: %s, %d SMs, cuBLASLt %d, runtime cudart %d\n", device, prop.name,
              prop.multiProcessorCount, cublas_ver, CUDART_VERSION);

  // ---- (a) GEMMs ------------------------------------------------------------------------------
  if (want("a")) {
    using fsdp8::Fp8Format;
    const int64_t M = 16384;
    const int64_t d = 2048, f = 5632;
    const GemmShape shapes[] = {
        {"qkv/o fwd  Y=XW^T", M, d, d, Fp8Format::kE4M3, Fp8Format::kE4M3},
        {"qkv/o dX=dY W", M, d, d, Fp8Format::kE5M2, Fp8Format::kE4M3},
        {"qkv/o dW=dY^T X", d, d, M, Fp8Format::kE5M2, Fp8Format::kE4M3},
        {"gate/up fwd", M, f, d, Fp8Format::kE4M3, Fp8Format::kE4M3},
        {"gate/up dX", M, d, f, Fp8Format::kE5M2, Fp8Format::kE4M3},
        {"gate/up dW", f, d, M, Fp8Format::kE5M2, Fp8Format::kE4M3},
        {"down fwd", M, d, f, Fp8Format::kE4M3, Fp8Format::kE4M3},
        {"down dX", M, f, d, Fp8Format::kE5M2, Fp8Format::kE4M3},
        {"down dW", d, f, M, Fp8Format::kE5M2, Fp8Format::kE4M3},
    };
    GemmOperands op(be.get(), st, static_cast<size_t>(M) * f, static_cast<size_t>(M) * f * sizeof(float), 17u);
    float* C = static_cast<float*>(op.C);
    std::printf("\n(a) FP8 GEMM, f32 output, TFLOP/s (backend GemmFp8 vs bare cuBLASLt)\n");
    for (const GemmShape& s : shapes) {
      const int64_t fb0 = cb->gemm_fp8_fallbacks();
      const double ms_be = MedianMs(st, [&](int i) {
        be->GemmFp8(false, true, s.M, s.N, s.K, {op.A[i & 1], s.a, op.scales},
                    {op.B[i & 1], s.b, op.scales + 4}, C, false);
      });
      const bool fell_back = cb->gemm_fp8_fallbacks() != fb0;
      const double ms_lt = BareLt(st, s, op.A, op.B, C, op.scales, op.scales + 4, op.ws, op.kWsBytes);
      const double flop = 2.0 * s.M * s.N * s.K;
      const double t_be = flop / ms_be / 1e9, t_lt = ms_lt > 0 ? flop / ms_lt / 1e9 : 0;
      std::printf("  %-18s M %6lld N %5lld K %6lld  backend %7.1f  bare %7.1f  ratio %5.1f%%%s\n", s.name,
                  static_cast<long long>(s.M), static_cast<long long>(s.N), static_cast<long long>(s.K), t_be,
                  t_lt, t_lt > 0 ? 100.0 * t_be / t_lt : 0.0, fell_back ? "  (FALLBACK path!)" : "");
      char ratio[32];
      std::snprintf(ratio, sizeof(ratio), "%.1f%%", t_lt > 0 ? 100.0 * t_be / t_lt : 0.0);
      g_rows.push_back({"gemm", s.name, Fmt(t_be, "TF/s"), Fmt(t_lt, "TF/s"), ratio});
      g_cal.AddGemm("fp8", s.M, s.N, s.K, t_be);
    }
    // Bare cuBLASLt: bf16 / f32 output, with and without fast accumulation, and the shapes of
    // q/k/v and gate/up fused into one GEMM (N or K = 3d, 2f).
    std::printf("\n(a2) bare cuBLASLt FP8 GEMM TFLOP/s: f32 out | bf16 out | f32 out fast-accum | bf16 out fast-accum\n");
    const GemmShape more[] = {
        {"qkv fused fwd", M, 3 * d, d, Fp8Format::kE4M3, Fp8Format::kE4M3},
        {"qkv fused dX", M, d, 3 * d, Fp8Format::kE5M2, Fp8Format::kE4M3},
        {"qkv fused dW", 3 * d, d, M, Fp8Format::kE5M2, Fp8Format::kE4M3},
        {"gate|up fused fwd", M, 2 * f, d, Fp8Format::kE4M3, Fp8Format::kE4M3},
        {"gate|up fused dX", M, d, 2 * f, Fp8Format::kE5M2, Fp8Format::kE4M3},
        {"gate|up fused dW", 2 * f, d, M, Fp8Format::kE5M2, Fp8Format::kE4M3},
    };
    std::vector<GemmShape> all(std::begin(shapes), std::end(shapes));
    all.insert(all.end(), std::begin(more), std::end(more));
    const size_t big = static_cast<size_t>(M) * 2 * f;
    GemmOperands op2(be.get(), st, big, big * sizeof(float), 7u);
    for (const GemmShape& s : all) {
      const double flop = 2.0 * s.M * s.N * s.K;
      double t[4];
      for (int v = 0; v < 4; ++v) {
        const double ms = BareLt(st, s, op2.A, op2.B, op2.C, op2.scales, op2.scales + 4, op2.ws,
                                 op2.kWsBytes, (v & 1) ? CUDA_R_16BF : CUDA_R_32F, v >= 2);
        t[v] = ms > 0 ? flop / ms / 1e9 : 0;
      }
      std::printf("  %-18s M %6lld N %5lld K %6lld  %7.1f %7.1f %7.1f %7.1f\n", s.name,
                  static_cast<long long>(s.M), static_cast<long long>(s.N), static_cast<long long>(s.K),
                  t[0], t[1], t[2], t[3]);
    }
  }

  // ---- (b) cast + transpose bandwidth -----------------------------------------------------------
  if (want("b")) {
    const size_t copy_bytes = size_t{1} << 30;
    void* src = be->Alloc(copy_bytes);
    void* dst = be->Alloc(copy_bytes);
    CK(cudaMemsetAsync(src, 1, copy_bytes, st));
    const double ms_copy = MedianMs(st, [&](int) { CK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, st)); });
    const double copy_gbs = 2.0 * copy_bytes / ms_copy / 1e6;
    be->Free(src);
    be->Free(dst);
    std::printf("\n(b) cudaMemcpy D2D 1 GiB: %.0f GB/s (read + write)\n", copy_gbs);
    std::printf("    CastTransposeFp8 (f32 in, fp8 out_t [+ out], amax), GB/s and %% of copy\n");
    const int64_t M = 16384;
    for (int64_t cols : {int64_t{2048}, int64_t{5632}}) {
      const int64_t n = M * cols;
      float* in[2];
      for (int i = 0; i < 2; ++i) {
        in[i] = static_cast<float*>(be->Alloc(n * sizeof(float)));
        FillFloats<<<1024, 256, 0, st>>>(in[i], n, 7u + i);
      }
      uint8_t* out = static_cast<uint8_t*>(be->Alloc(n));
      uint8_t* out_t = static_cast<uint8_t*>(be->Alloc(n));
      float* sc = static_cast<float*>(be->Alloc(2 * sizeof(float)));
      const float hs[2] = {16.0f, 0.0f};
      be->CopyToDevice(sc, hs, sizeof(hs));
      for (int both = 0; both < 2; ++both) {
        const double ms = MedianMs(st, [&](int i) {
          be->CastFp8(in[i & 1], M, cols, sc, fsdp8::Fp8Format::kE4M3, both ? out : nullptr, out_t,
                      sc + 1);
        });
        const double bytes = static_cast<double>(n) * (4 + 1 + both);
        const double gbs = bytes / ms / 1e6;
        g_cal.pass_bytes += bytes;
        g_cal.pass_ms += ms;
        char name[64], ratio[32];
        std::snprintf(name, sizeof(name), "%lldx%lld %s", static_cast<long long>(M), static_cast<long long>(cols),
                      both ? "out+out_t" : "out_t");
        std::snprintf(ratio, sizeof(ratio), "%.1f%%", 100.0 * gbs / copy_gbs);
        std::printf("  %-24s %8.0f GB/s  %6.1f%% of copy  (%.3f ms)\n", name, gbs, 100.0 * gbs / copy_gbs, ms);
        g_rows.push_back({"cast+T", name, Fmt(gbs, "GB/s"), Fmt(copy_gbs, "GB/s"), ratio});
      }
      for (int i = 0; i < 2; ++i) be->Free(in[i]);
      be->Free(out);
      be->Free(out_t);
      be->Free(sc);
    }
  }

  // ---- (c) attention ---------------------------------------------------------------------------
  if (want("cde")) {
    const int64_t Bn = 8, H = 16, D = 128, T = 2048;
    std::printf("\n(c) causal attention B %lld H %lld D %lld T %lld, BF16 through cuDNN fused attention\n",
                static_cast<long long>(Bn), static_cast<long long>(H), static_cast<long long>(D),
                static_cast<long long>(T));
#if defined(FSDP8_WITH_CUDNN)
    const double fwd_flop = 2.0 * Bn * H * static_cast<double>(T) * T * D;
    const double bwd_flop = 2.5 * fwd_flop;
    std::printf("  cuDNN runtime %s (headers %lld)\n", fsdp8::cuda::CudnnAttention::RuntimeVersionString().c_str(),
                static_cast<long long>(fsdp8::cuda::CudnnAttention::CompiledVersion()));
    const int64_t n = Bn * T * H * D;
    std::vector<void*> bufs;
    auto alloc16 = [&](int64_t count, uint32_t seed) {
      auto* p = static_cast<__nv_bfloat16*>(be->Alloc(count * 2));
      FillBf16<<<1024, 256, 0, st>>>(p, count, seed);
      bufs.push_back(p);
      return p;
    };
    __nv_bfloat16 *q = alloc16(n, 11), *k = alloc16(n, 12), *v = alloc16(n, 13), *o = alloc16(n, 14),
                  *dout = alloc16(n, 15), *dq = alloc16(n, 16), *dk = alloc16(n, 17), *dv = alloc16(n, 18);
    float* stats = static_cast<float*>(be->Alloc(Bn * H * T * sizeof(float)));
    bufs.push_back(stats);
    fsdp8::cuda::CudnnAttention att(device);
    std::string aerr;
    bool ok = att.Forward(q, k, v, o, stats, Bn, T, H, H, D, st, &aerr);
    double ms_f = -1;
    if (ok) {
      ms_f = MedianMs(st, [&](int) {
        if (!att.Forward(q, k, v, o, stats, Bn, T, H, H, D, st, &aerr)) {
          std::fprintf(stderr, "cuDNN forward failed: %s\n", aerr.c_str());
          std::exit(1);
        }
      });
    } else {
      std::printf("  cuDNN forward unavailable: %s\n", aerr.c_str());
    }
    const double tf_f = ms_f > 0 ? fwd_flop / ms_f / 1e9 : 0;
    g_cal.attention_fwd_tflops = tf_f;
    if (ms_f > 0) {
      std::printf("  forward                    %7.3f ms %7.1f TFLOP/s\n", ms_f, tf_f);
      g_rows.push_back({"attention", "cudnn bf16 fwd", Fmt(tf_f, "TF/s"), "-", "-"});
    }
    for (int det = 1; det >= 0 && ok; --det) {
      att.set_deterministic_backward(det == 1);
      const char* label = det ? "deterministic" : "non-deterministic";
      if (!att.Backward(q, k, v, o, dout, stats, dq, dk, dv, Bn, T, H, H, D, st, &aerr)) {
        std::printf("  cuDNN backward (%s) unavailable: %s\n", label, aerr.c_str());
        continue;
      }
      const double ms_b = MedianMs(st, [&](int) {
        if (!att.Backward(q, k, v, o, dout, stats, dq, dk, dv, Bn, T, H, H, D, st, &aerr)) {
          std::fprintf(stderr, "cuDNN backward failed: %s\n", aerr.c_str());
          std::exit(1);
        }
      });
      const double tf_b = bwd_flop / ms_b / 1e9;
      if (det == 1) g_cal.attention_bwd_tflops = tf_b;  // training's default backward
      if (det == 0) g_cal.attention_bwd_nondet_tflops = tf_b;  // training.deterministic: false
      const double tf_fb = (fwd_flop + bwd_flop) / (ms_f + ms_b) / 1e9;
      std::printf("  backward %-17s %7.3f ms %7.1f TFLOP/s   fwd+bwd %7.1f TFLOP/s (%s 350 target)  workspace %zu MiB\n",
                  label, ms_b, tf_b, tf_fb, tf_fb >= 350 ? "meets" : "below", att.workspace_bytes() >> 20);
      char ratio[32];
      std::snprintf(ratio, sizeof(ratio), "%.1f%%", 100.0 * tf_fb / 350.0);
      g_rows.push_back({"attention", det ? "cudnn bf16 bwd (det)" : "cudnn bf16 bwd (nondet)", Fmt(tf_b, "TF/s"), "-", "-"});
      g_rows.push_back({"attention", det ? "cudnn bf16 fwd+bwd (det)" : "cudnn bf16 fwd+bwd (nondet)", Fmt(tf_fb, "TF/s"),
                        "350 TF/s target", ratio});
    }

    // (d) Next to a kernel that holds some SMs on another stream (as NCCL's collective kernels do
    // while a prefetch or reduce-scatter is in flight): the op is launched once the holder runs.
    {
      cudaStream_t side;
      CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
      int* started = nullptr;
      CK(cudaHostAlloc(&started, sizeof(int), cudaHostAllocMapped));
      int* started_dev = nullptr;
      CK(cudaHostGetDevicePointer(&started_dev, started, 0));
      int clock_khz = 0;
      CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
      const int smem = 200 * 1024;
      CK(cudaFuncSetAttribute(HoldSms, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const double hold_us = 400;
      auto timed = [&](int held, const std::function<void()>& op) {
        std::vector<double> v;
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        for (int r = 0; r < 7; ++r) {
          CK(cudaDeviceSynchronize());
          if (held > 0) {
            *started = 0;
            HoldSms<<<held, 128, smem, side>>>(static_cast<long long>(hold_us * clock_khz / 1e3), started_dev);
            CK(cudaGetLastError());  // a failed launch would never set *started
            while (*reinterpret_cast<volatile int*>(started) == 0) {
            }
          }
          CK(cudaEventRecord(a, st));
          op();
          CK(cudaEventRecord(b, st));
          CK(cudaEventSynchronize(b));
          float t = 0;
          CK(cudaEventElapsedTime(&t, a, b));
          v.push_back(t * 1e3);
        }
        CK(cudaDeviceSynchronize());
        CK(cudaEventDestroy(a));
        CK(cudaEventDestroy(b));
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      std::printf("\n(d) op time (us) with N SMs held for %.0f us by a kernel on another stream\n", hold_us);
      std::printf("  %-34s %8s %8s %8s\n", "op", "N=0", "N=16", "N=32");
      auto row = [&](const char* name, const std::function<void()>& op) {
        std::printf("  %-34s %8.1f %8.1f %8.1f\n", name, timed(0, op), timed(16, op), timed(32, op));
      };
      att.set_deterministic_backward(true);
      row("cuDNN attention fwd", [&] { att.Forward(q, k, v, o, stats, Bn, T, H, H, D, st, &aerr); });
      row("cuDNN attention bwd det", [&] { att.Backward(q, k, v, o, dout, stats, dq, dk, dv, Bn, T, H, H, D, st, &aerr); });
      {
        const int64_t M = 16384, N = 2048, K = 2048;
        auto* xa = static_cast<uint8_t*>(be->Alloc(M * K));
        auto* wb = static_cast<uint8_t*>(be->Alloc(N * K));
        auto* y16 = static_cast<uint16_t*>(be->Alloc(M * N * 2));
        auto* sc = static_cast<float*>(be->Alloc(2 * sizeof(float)));
        FillCodes<<<1024, 256, 0, st>>>(xa, M * K, 5u);
        FillCodes<<<1024, 256, 0, st>>>(wb, N * K, 6u);
        const float one[2] = {1.0f, 1.0f};
        be->CopyToDevice(sc, one, sizeof(one));
        row("GemmFp8Bf16 16384x2048x2048", [&] {
          be->GemmFp8(false, true, M, N, K, {xa, fsdp8::Fp8Format::kE4M3, sc},
                      {wb, fsdp8::Fp8Format::kE4M3, sc + 1}, y16, false);
        });
        be->Free(xa);
        be->Free(wb);
        be->Free(y16);
        be->Free(sc);
      }
      CK(cudaFreeHost(started));
      CK(cudaStreamDestroy(side));
    }

    // (e) Host time to enqueue one call against the GPU time of one call: n calls are enqueued
    // behind a kernel that keeps the stream busy, so the GPU time excludes the host's. An op that
    // synchronised inside (a cudaFree, a blocking copy) would show the 200 ms spin as host time.
    {
      int clock_khz = 0;
      CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
      auto split = [&](const char* name, const std::function<void()>& op) {
        const int n = 20;
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        op();
        CK(cudaDeviceSynchronize());
        Spin<<<1, 1, 0, st>>>(static_cast<long long>(200e3 * clock_khz / 1e3));  // 200 ms
        CK(cudaEventRecord(a, st));
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < n; ++i) op();
        const double host_us = 1e6 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        std::printf("  %-34s host %8.1f us/call   GPU %8.1f us/call\n", name, host_us, 1e3 * ms / n);
        CK(cudaEventDestroy(a));
        CK(cudaEventDestroy(b));
      };
      std::printf("\n(e) host enqueue time against GPU time per call\n");
      att.set_deterministic_backward(true);
      split("cuDNN attention fwd", [&] { att.Forward(q, k, v, o, stats, Bn, T, H, H, D, st, &aerr); });
      split("cuDNN attention bwd det", [&] { att.Backward(q, k, v, o, dout, stats, dq, dk, dv, Bn, T, H, H, D, st, &aerr); });
      split("AttentionForwardBf16Packed", [&] {
        be->AttentionForward(reinterpret_cast<uint16_t*>(q), reinterpret_cast<uint16_t*>(k),
                             reinterpret_cast<uint16_t*>(v), Bn, T, H, H, D,
                             reinterpret_cast<uint16_t*>(o), stats,
                             fsdp8::AttentionOptions{true, H * D, H * D});
      });
      split("AttentionBackwardBf16SavedTo16", [&] {
        be->AttentionBackward(reinterpret_cast<uint16_t*>(q), reinterpret_cast<uint16_t*>(k),
                              reinterpret_cast<uint16_t*>(v), reinterpret_cast<uint16_t*>(o),
                              reinterpret_cast<uint16_t*>(dout), stats, Bn, T, H, H, D,
                              reinterpret_cast<uint16_t*>(dq), reinterpret_cast<uint16_t*>(dk),
                              reinterpret_cast<uint16_t*>(dv),
                              fsdp8::AttentionOptions{true, H * D, H * D});
      });
    }
    for (void* p : bufs) be->Free(p);
#else
    std::printf("  not built: cuDNN frontend headers not found at configure time "
                "(pip install nvidia-cudnn-frontend; FSDP8_CUDNN_FRONTEND_INCLUDE)\n");
    g_rows.push_back({"attention", "cudnn bf16", "not built", "350 TF/s target", "-"});
#endif
  }
  if (want("c")) {
    const int64_t Bn = 8, H = 16, D = 128, T = 2048;
    const int64_t n = Bn * T * H * D;
    std::vector<float*> bufs;
    auto alloc = [&](int64_t count, uint32_t seed) {
      float* p = static_cast<float*>(be->Alloc(count * sizeof(float)));
      FillFloats<<<1024, 256, 0, st>>>(p, count, seed);
      bufs.push_back(p);
      return p;
    };
    float *q = alloc(n, 1), *k = alloc(n, 2), *v = alloc(n, 3), *out = alloc(n, 4), *dout = alloc(n, 5);
    float *dq = alloc(n, 6), *dk = alloc(n, 7), *dv = alloc(n, 8), *lse = alloc(Bn * H * T, 9);
    const double fwd_flop = 2.0 * Bn * H * static_cast<double>(T) * T * D;
    const double bwd_flop = 2.5 * fwd_flop;
    const int saved_iters = g_iters;
    g_iters = quick ? 3 : 7;  // the f32 kernels are slow; fewer repetitions
    const double ms_f = MedianMs(st, [&](int) { be->AttentionForward(q, k, v, Bn, T, H, H, D, out, lse); });
    const double ms_b = MedianMs(st, [&](int) {
      be->AttentionBackward(q, k, v, out, dout, lse, Bn, T, H, H, D, dq, dk, dv);
    });
    g_iters = saved_iters;
    const double tf_f = fwd_flop / ms_f / 1e9, tf_b = bwd_flop / ms_b / 1e9;
    const double tf_fb = (fwd_flop + bwd_flop) / (ms_f + ms_b) / 1e9;
    std::printf("\n(c) causal attention B %lld H %lld D %lld T %lld, f32 kernels (Backend path, f32 storage)\n",
                static_cast<long long>(Bn), static_cast<long long>(H), static_cast<long long>(D),
                static_cast<long long>(T));
    std::printf("  forward %.2f ms %.1f TFLOP/s, backward %.2f ms %.1f TFLOP/s, fwd+bwd %.1f TFLOP/s\n", ms_f, tf_f,
                ms_b, tf_b, tf_fb);
    std::printf("  (f32 CUDA-core kernels, for comparison with the cuDNN BF16 rows above)\n");
    g_rows.push_back({"attention", "f32 fwd", Fmt(tf_f, "TF/s"), "-", "-"});
    g_rows.push_back({"attention", "f32 bwd", Fmt(tf_b, "TF/s"), "-", "-"});
    g_rows.push_back({"attention", "f32 fwd+bwd", Fmt(tf_fb, "TF/s"), "350 TF/s target", "-"});
    for (float* p : bufs) be->Free(p);
  }

  // ---- (g) the heuristic's candidates for each GEMM of the 1b step, as the worker runs them ----
  // Candidate 0 is what the backend takes; the fastest candidate shows what tuning could gain.
  if (want("g")) {
    using fsdp8::Fp8Format;
    const int64_t M = 16384, d = 2048, f = 5632;
    struct Case {
      GemmShape s;
      cudaDataType_t out;
      bool fast, accumulate;
    };
    const Case cases[] = {
        {{"q/k/v fwd bf16", M, d, d, Fp8Format::kE4M3, Fp8Format::kE4M3}, CUDA_R_16BF, true, false},
        {{"o fwd +residual", M, d, d, Fp8Format::kE4M3, Fp8Format::kE4M3}, CUDA_R_32F, true, true},
        {{"gate/up fwd bf16", M, f, d, Fp8Format::kE4M3, Fp8Format::kE4M3}, CUDA_R_16BF, true, false},
        {{"down fwd +residual", M, d, f, Fp8Format::kE4M3, Fp8Format::kE4M3}, CUDA_R_32F, true, true},
        {{"q/k/v/o dX bf16", M, d, d, Fp8Format::kE5M2, Fp8Format::kE4M3}, CUDA_R_16BF, true, false},
        {{"gate/up dX bf16", M, d, f, Fp8Format::kE5M2, Fp8Format::kE4M3}, CUDA_R_16BF, true, false},
        {{"down dX bf16", M, f, d, Fp8Format::kE5M2, Fp8Format::kE4M3}, CUDA_R_16BF, true, false},
        {{"q/k/v/o dW", d, d, M, Fp8Format::kE5M2, Fp8Format::kE4M3}, CUDA_R_32F, true, false},
        {{"gate/up dW", f, d, M, Fp8Format::kE5M2, Fp8Format::kE4M3}, CUDA_R_32F, true, false},
        {{"down dW", d, f, M, Fp8Format::kE5M2, Fp8Format::kE4M3}, CUDA_R_32F, true, false},
    };
    const size_t big = static_cast<size_t>(M) * f;
    GemmOperands op(be.get(), st, big, big * sizeof(float), 5u);
    std::printf("\n(g) cuBLASLt candidates per GEMM of the 1b step (us): candidate 0 | fastest (index of found)\n");
    for (const Case& c : cases) {
      double first = 0, best = 0;
      int found = 0;
      const int bi = SweepLt(st, c.s, op.A, op.B, op.C, op.scales, op.scales + 4, op.ws, op.kWsBytes,
                             c.out, c.fast, c.accumulate, &first, &best, &found);
      std::printf("  %-20s M %6lld N %5lld K %6lld  %8.1f | %8.1f (%d of %d)  gain %5.1f%%\n", c.s.name,
                  static_cast<long long>(c.s.M), static_cast<long long>(c.s.N),
                  static_cast<long long>(c.s.K), 1e3 * first, 1e3 * best, bi, found,
                  first > 0 ? 100.0 * (first - best) / first : 0.0);
    }
  }

  // ---- (f) the memory-bound backward passes of a 1b block ---------------------------------------
  // Backend ops at M 16384, C 2048, F 5632 (H 16, D 128): time and bytes moved (reads + writes,
  // as each op's documentation counts them) per time, against the copy bandwidth of (b).
  if (want("f")) {
    const int64_t M = 16384, C = 2048, F = 5632, B = 8, T = 2048, H = 16, D = 128;
    std::vector<void*> bufs;
    auto alloc = [&](size_t bytes) {
      void* p = be->Alloc(bytes);
      be->Memset(p, 0x3C, bytes);  // f32 and bf16 values near 0.0115, FP8 codes: all finite
      bufs.push_back(p);
      return p;
    };
    auto f32 = [&](int64_t n) { return static_cast<float*>(alloc(n * 4)); };
    auto b16 = [&](int64_t n) { return static_cast<uint16_t*>(alloc(n * 2)); };
    auto u8 = [&](int64_t n) { return static_cast<uint8_t*>(alloc(n)); };
    float *x = f32(M * C), *dres = f32(M * C), *dx = f32(M * C), *dy = f32(M * C);
    float *w = f32(C), *rstd = f32(M), *dw = f32(C);
    uint16_t *pa = b16(M * C), *pb = b16(M * C), *pc = b16(M * C);
    uint16_t *dh = b16(M * F), *g = b16(M * F), *u = b16(M * F), *dg16 = b16(M * F), *du16 = b16(M * F);
    uint8_t *o1 = u8(M * F), *o2 = u8(M * F), *o3 = u8(M * F), *o4 = u8(M * F);
    float* sc = f32(8);
    float* amax = f32(2);
    const float one[8] = {1, 0, 0, 0, 1, 0, 0, 0};
    be->CopyToDevice(sc, one, sizeof(one));
    std::printf("\n(f) memory-bound passes of a 1b block, backward then forward (us, GB/s of bytes read + written)\n");
    auto row = [&](const char* name, double bytes, const std::function<void(int)>& fn) {
      const double ms = MedianMs(st, fn);
      g_cal.pass_bytes += bytes;
      g_cal.pass_ms += ms;
      std::printf("  %-44s %8.1f us %8.1f GB/s\n", name, 1e3 * ms, bytes / ms / 1e6);
      g_rows.push_back({"backward", name, Fmt(1e3 * ms, "us"), Fmt(bytes / ms / 1e6, "GB/s"), "-"});
    };
    const double mc = static_cast<double>(M * C), mf = static_cast<double>(M * F);
    row("RmsNormBackwardAdd f32", 16 * mc,
        [&](int) { be->RmsNormBackward(dy, x, w, rstd, M, C, dx, dw, dres); });
    row("RmsNormBackwardAddBf16Parts 1 part", 2 * mc + 12 * mc,
        [&](int) { be->RmsNormBackward(pa, x, w, rstd, M, C, dx, dw, dres, nullptr, nullptr); });
    row("RmsNormBackwardAddBf16Parts 2 parts", 4 * mc + 12 * mc,
        [&](int) { be->RmsNormBackward(pa, x, w, rstd, M, C, dx, dw, dres, pb, nullptr); });
    row("RmsNormBackwardAddBf16Parts 3 parts", 6 * mc + 12 * mc,
        [&](int) { be->RmsNormBackward(pa, x, w, rstd, M, C, dx, dw, dres, pb, pc); });
    row("SwigluBackwardCastTransposeFp8", 6 * mf + 4 * mf, [&](int) {
      be->SwigluBackward(dh, g, u, M, F, F, nullptr, nullptr,
                         fsdp8::Fp8Cast{sc, fsdp8::Fp8Format::kE5M2, o1, o2, amax, F},
                         fsdp8::Fp8Cast{sc + 4, fsdp8::Fp8Format::kE5M2, o3, o4, amax + 1, F});
    });
    row("SwigluBackwardBf16To16 + 2 CastTransposeFp8Bf16", 10 * mf + 8 * mf, [&](int) {
      be->SwigluBackward(dh, g, u, 1, M * F, 0, dg16, du16);
      be->CastFp8(dg16, M, F, sc, fsdp8::Fp8Format::kE5M2, o1, o2, amax, F);
      be->CastFp8(du16, M, F, sc + 4, fsdp8::Fp8Format::kE5M2, o3, o4, amax + 1, F);
    });
    row("CastTransposeFp8Bf16 16384x5632", 2 * mf + 2 * mf,
        [&](int) { be->CastFp8(dg16, M, F, sc, fsdp8::Fp8Format::kE5M2, o1, o2, amax, F); });
    row("RopeBackwardCastTransposeFp8Bf16 (q)", 2 * mc + 2 * mc, [&](int) {
      be->RopeBackward(pa, B, T, H, D, 10000.0f,
                       fsdp8::Fp8Cast{sc, fsdp8::Fp8Format::kE5M2, o1, o2, amax, C});
    });
    row("RopeBackwardBf16 + CastTransposeFp8Bf16 (q)", 4 * mc + 4 * mc, [&](int) {
      be->RopeBackward(pb, B, T, H, D, 10000.0f);
      be->CastFp8(pb, M, C, sc, fsdp8::Fp8Format::kE5M2, o1, o2, amax, C);
    });
    // The forward's memory-bound passes of the same block, for comparison.
    row("RmsNormCastFp8 (forward)", 4 * mc + mc, [&](int) {
      be->RmsNormForward(x, w, 1e-5f, M, C, nullptr, rstd,
                         fsdp8::Fp8Cast{sc, fsdp8::Fp8Format::kE4M3, o1, nullptr, amax});
    });
    row("SwigluCastFp8 (forward)", 4 * mf + mf, [&](int) {
      be->SwigluForward(g, u, M, F, F, nullptr,
                        fsdp8::Fp8Cast{sc, fsdp8::Fp8Format::kE4M3, o1, nullptr, amax});
    });
    row("RopeForwardBf16 (q, forward)", 4 * mc,
        [&](int) { be->RopeForward(pa, B, T, H, D, 10000.0f, H * D); });
    for (void* p : bufs) be->Free(p);
  }

  if (!calibration.empty()) {
    if (!WriteCalibration(be.get(), st, device, prop.name, calibration)) return 1;
  }

  std::printf("\n%-10s %-26s %-14s %-18s %s\n", "section", "case", "fsdp8", "reference", "ratio");
  for (const Row& r : g_rows) {
    std::printf("%-10s %-26s %-14s %-18s %s\n", r.section.c_str(), r.name.c_str(), r.value.c_str(), r.ref.c_str(),
                r.ratio.c_str());
  }
  return 0;
}
