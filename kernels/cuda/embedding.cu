// Token embedding (Backend: EmbeddingForward, EmbeddingBackward).
//   forward:  out (N, C) = table (V, C)[tokens (N)]
//   backward: dtable (V, C) += dout rows, per token, in token order.
// The backward gives each block kRowsPerBlock vocabulary rows; the block scans all tokens in
// order, compacts (order-preserving, by warp ballots) the positions whose token falls in its
// rows, then each thread adds, for its columns, the matching dout rows one after the other in
// token order. Every dtable element therefore receives its additions in the same order as the
// CPU loop over tokens, with no atomics: same bits as the reference, run after run.
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = 16;

__global__ void EmbeddingForwardKernel(const int32_t* __restrict__ tokens, int64_t N,
                                       const float* __restrict__ table, int64_t C,
                                       float* __restrict__ out) {
  const int64_t total = N * C;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const int64_t n = idx / C, c = idx % C;
    out[idx] = table[static_cast<int64_t>(tokens[n]) * C + c];
  }
}

__global__ void __launch_bounds__(kThreads)
EmbeddingBackwardKernel(const int32_t* __restrict__ tokens, int64_t N,
                        const float* __restrict__ dout, int64_t C, float* __restrict__ dtable) {
  __shared__ int32_t hits[kThreads];      // positions (relative to the chunk) that match
  __shared__ int32_t warp_counts[kThreads / 32];
  const int64_t v0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int64_t v1 = v0 + kRowsPerBlock;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t base = 0; base < N; base += kThreads) {
    const int64_t n = base + threadIdx.x;
    bool match = false;
    if (n < N) {
      const int64_t tok = tokens[n];
      match = tok >= v0 && tok < v1;
    }
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, match);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int offset = 0, total = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      if (w < warp) offset += warp_counts[w];
      total += warp_counts[w];
    }
    if (match) hits[offset + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int32_t>(threadIdx.x);
    __syncthreads();
    for (int h = 0; h < total; ++h) {
      const int64_t pos = base + hits[h];
      const int64_t row = tokens[pos];
      const float* src = dout + pos * C;
      float* dst = dtable + row * C;
      for (int64_t c = threadIdx.x; c < C; c += kThreads) dst[c] += src[c];
    }
    __syncthreads();
  }
}

}  // namespace

void LaunchEmbeddingForward(const int32_t* tokens, int64_t N, const float* table, int64_t C,
                            float* out, cudaStream_t stream) {
  const int64_t total = N * C;
  if (total <= 0) return;
  int64_t blocks = CeilDiv(total, kThreads);
  if (blocks > 65536) blocks = 65536;
  EmbeddingForwardKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(tokens, N, table, C, out);
  FSDP8_CUDA_LAUNCH_CHECK();
}

void LaunchEmbeddingBackward(const int32_t* tokens, int64_t N, const float* dout, int64_t C,
                             float* dtable, int64_t V, cudaStream_t stream) {
  if (N <= 0 || C <= 0 || V <= 0) return;
  EmbeddingBackwardKernel<<<static_cast<unsigned>(CeilDiv(V, kRowsPerBlock)), kThreads, 0, stream>>>(
      tokens, N, dout, C, dtable);
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
