// Causal scaled-dot-product attention with f32 storage, flash-attention style (Dao et al. 2022,
// "FlashAttention", algorithm 1 forward / algorithm 2 backward): keys stream through shared
// memory in tiles of kKeyTile, each query row keeps an online softmax (running max m, sum l) and
// its output accumulator in registers; only the log-sum-exp per row is saved. No T x T matrix is
// ever stored. Grouped-query: query head h reads kv head h / (H / Hkv).
//
//   q, out, dout, dq (B, T, H, D); k, v, dk, dv (B, T, Hkv, D); lse, delta (B, H, T); D <= 256.
//   s_ij = scale * q_i . k_j (scale = 1/sqrt(D)), j <= i;  p_ij = exp(s_ij - lse_i)
//   out_i = sum_j p_ij v_j;  delta_i = dout_i . out_i;  dp_ij = dout_i . v_j
//   ds_ij = p_ij (dp_ij - delta_i);  dq_i = scale sum_j ds_ij k_j
//   dk_j = scale sum_{h in group} sum_i ds_ij q_i;  dv_j = sum_{h in group} sum_i p_ij dout_i
//
// Work split (all sums in fixed order, no atomics, so results are deterministic):
//   forward / dq: one block = 4 warps = 16 query rows of one (b, h); lane j of a warp scores key
//     j of the tile, then the 32 probabilities are broadcast by shuffles and each lane
//     accumulates the output dims d = lane + 32 e.
//   dk / dv: one block = 16 keys of one (b, kv head); the queries stream through in tiles of 32
//     for every query head of the group in order.
#include <cmath>

#include <cuda_runtime.h>

#include "common/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;  // 16
constexpr int kKeyTile = 32;
constexpr int kThreads = kWarps * 32;

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}
__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// grid (ceil(T / 16), H, B). Dynamic smem: Ks (32, D+1), Vs (32, D), Qs (16, D).
template <int DPL>
__global__ void __launch_bounds__(kThreads)
AttnForwardKernel(const float* __restrict__ q, const float* __restrict__ k,
                  const float* __restrict__ v, int T, int H, int Hkv, int D, float scale,
                  float* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ float smem[];
  float* Ks = smem;                          // (32, D+1)
  float* Vs = Ks + kKeyTile * (D + 1);       // (32, D)
  float* Qs = Vs + kKeyTile * D;             // (16, D)
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
  const int q0 = blockIdx.x * kRowsPerBlock;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t qstride = static_cast<int64_t>(H) * D, kstride = static_cast<int64_t>(Hkv) * D;
  const float* qb = q + static_cast<int64_t>(b) * T * qstride + static_cast<int64_t>(h) * D;
  const float* kb = k + static_cast<int64_t>(b) * T * kstride + static_cast<int64_t>(hk) * D;
  const float* vb = v + static_cast<int64_t>(b) * T * kstride + static_cast<int64_t>(hk) * D;

  for (int idx = threadIdx.x; idx < kRowsPerBlock * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    Qs[idx] = (q0 + r < T) ? qb[static_cast<int64_t>(q0 + r) * qstride + d] : 0.0f;
  }
  float m[kRowsPerWarp], l[kRowsPerWarp], o[kRowsPerWarp][DPL];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) o[rr][e] = 0.0f;
  }
  const int last_q = min(T - 1, q0 + kRowsPerBlock - 1);
  for (int k0 = 0; k0 <= last_q; k0 += kKeyTile) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < kKeyTile * D; idx += kThreads) {
      const int j = idx / D, d = idx % D;
      const bool ok = k0 + j < T;
      Ks[j * (D + 1) + d] = ok ? kb[static_cast<int64_t>(k0 + j) * kstride + d] : 0.0f;
      Vs[j * D + d] = ok ? vb[static_cast<int64_t>(k0 + j) * kstride + d] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      const int i = q0 + r;
      if (i >= T || k0 > i) continue;  // warp-uniform
      const int j = k0 + lane;
      float s = -INFINITY;
      if (j <= i) {
        const float* qr = Qs + r * D;
        const float* kr = Ks + lane * (D + 1);
        float acc = 0.0f;
        for (int d = 0; d < D; ++d) acc += qr[d] * kr[d];
        s = acc * scale;
      }
      const float mt = WarpMax(s);
      const float m_new = fmaxf(m[rr], mt);
      const float corr = expf(m[rr] - m_new);  // 0 on the first tile (m = -inf)
      const float p = expf(s - m_new);         // 0 for masked keys
      l[rr] = l[rr] * corr + WarpSum(p);
      m[rr] = m_new;
#pragma unroll
      for (int e = 0; e < DPL; ++e) o[rr][e] *= corr;
      const int jmax = min(kKeyTile, i - k0 + 1);
      for (int jj = 0; jj < jmax; ++jj) {
        const float pj = __shfl_sync(0xFFFFFFFFu, p, jj);
        const float* vr = Vs + jj * D;
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
          const int d = lane + 32 * e;
          if (d < D) o[rr][e] += pj * vr[d];
        }
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int i = q0 + warp * kRowsPerWarp + rr;
    if (i >= T) continue;
    const float inv_l = 1.0f / l[rr];
    float* orow = out + (static_cast<int64_t>(b) * T + i) * qstride + static_cast<int64_t>(h) * D;
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      const int d = lane + 32 * e;
      if (d < D) orow[d] = o[rr][e] * inv_l;
    }
    if (lane == 0) lse[(static_cast<int64_t>(b) * H + h) * T + i] = m[rr] + logf(l[rr]);
  }
}

// delta (B, H, T) = rowwise dout . out; one warp per row, grid-stride over rows.
__global__ void AttnDeltaKernel(const float* __restrict__ out, const float* __restrict__ dout,
                                int B, int T, int H, int D, float* __restrict__ delta) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = static_cast<int64_t>(B) * T * H;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
       row < rows; row += warps) {
    const float* o = out + row * D;
    const float* g = dout + row * D;
    float acc = 0.0f;
    for (int d = lane; d < D; d += 32) acc += o[d] * g[d];
    acc = WarpSum(acc);
    // row = (b * T + t) * H + h  ->  delta index (b * H + h) * T + t
    const int64_t h = row % H, bt = row / H, t = bt % T, b = bt / T;
    if (lane == 0) delta[(b * H + h) * T + t] = acc;
  }
}

// dq. grid (ceil(T / 16), H, B). Dynamic smem: Ks (32, D+1), Vs (32, D+1), Qs (16, D), dOs (16, D).
template <int DPL>
__global__ void __launch_bounds__(kThreads)
AttnBackwardDqKernel(const float* __restrict__ q, const float* __restrict__ k,
                     const float* __restrict__ v, const float* __restrict__ dout,
                     const float* __restrict__ lse, const float* __restrict__ delta, int T, int H,
                     int Hkv, int D, float scale, float* __restrict__ dq) {
  extern __shared__ float smem[];
  float* Ks = smem;                        // (32, D+1)
  float* Vs = Ks + kKeyTile * (D + 1);     // (32, D+1)
  float* Qs = Vs + kKeyTile * (D + 1);     // (16, D)
  float* dOs = Qs + kRowsPerBlock * D;     // (16, D)
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (H / Hkv);
  const int q0 = blockIdx.x * kRowsPerBlock;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t qstride = static_cast<int64_t>(H) * D, kstride = static_cast<int64_t>(Hkv) * D;
  const int64_t qoff = static_cast<int64_t>(b) * T * qstride + static_cast<int64_t>(h) * D;
  const float* kb = k + static_cast<int64_t>(b) * T * kstride + static_cast<int64_t>(hk) * D;
  const float* vb = v + static_cast<int64_t>(b) * T * kstride + static_cast<int64_t>(hk) * D;
  const float* lse_bh = lse + (static_cast<int64_t>(b) * H + h) * T;
  const float* delta_bh = delta + (static_cast<int64_t>(b) * H + h) * T;

  for (int idx = threadIdx.x; idx < kRowsPerBlock * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    const bool ok = q0 + r < T;
    Qs[idx] = ok ? q[qoff + static_cast<int64_t>(q0 + r) * qstride + d] : 0.0f;
    dOs[idx] = ok ? dout[qoff + static_cast<int64_t>(q0 + r) * qstride + d] : 0.0f;
  }
  float acc[kRowsPerWarp][DPL];
  float row_lse[kRowsPerWarp], row_delta[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int i = q0 + warp * kRowsPerWarp + rr;
    row_lse[rr] = i < T ? lse_bh[i] : 0.0f;
    row_delta[rr] = i < T ? delta_bh[i] : 0.0f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[rr][e] = 0.0f;
  }
  const int last_q = min(T - 1, q0 + kRowsPerBlock - 1);
  for (int k0 = 0; k0 <= last_q; k0 += kKeyTile) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < kKeyTile * D; idx += kThreads) {
      const int j = idx / D, d = idx % D;
      const bool ok = k0 + j < T;
      Ks[j * (D + 1) + d] = ok ? kb[static_cast<int64_t>(k0 + j) * kstride + d] : 0.0f;
      Vs[j * (D + 1) + d] = ok ? vb[static_cast<int64_t>(k0 + j) * kstride + d] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      const int i = q0 + r;
      if (i >= T || k0 > i) continue;
      const int j = k0 + lane;
      float ds = 0.0f;
      if (j <= i) {
        const float* qr = Qs + r * D;
        const float* gr = dOs + r * D;
        const float* kr = Ks + lane * (D + 1);
        const float* vr = Vs + lane * (D + 1);
        float sacc = 0.0f, dpacc = 0.0f;
        for (int d = 0; d < D; ++d) {
          sacc += qr[d] * kr[d];
          dpacc += gr[d] * vr[d];
        }
        const float p = expf(sacc * scale - row_lse[rr]);
        ds = p * (dpacc - row_delta[rr]);
      }
      const int jmax = min(kKeyTile, i - k0 + 1);
      for (int jj = 0; jj < jmax; ++jj) {
        const float dsj = __shfl_sync(0xFFFFFFFFu, ds, jj);
        const float* kr = Ks + jj * (D + 1);
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
          const int d = lane + 32 * e;
          if (d < D) acc[rr][e] += dsj * kr[d];
        }
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int i = q0 + warp * kRowsPerWarp + rr;
    if (i >= T) continue;
    float* row = dq + qoff + static_cast<int64_t>(i) * qstride;
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      const int d = lane + 32 * e;
      if (d < D) row[d] = acc[rr][e] * scale;
    }
  }
}

// dk, dv. grid (ceil(T / 16), Hkv, B). Dynamic smem: Qs (32, D+1), dOs (32, D+1), Kj (16, D),
// Vj (16, D), lse (32), delta (32).
template <int DPL>
__global__ void __launch_bounds__(kThreads)
AttnBackwardDkvKernel(const float* __restrict__ q, const float* __restrict__ k,
                      const float* __restrict__ v, const float* __restrict__ dout,
                      const float* __restrict__ lse, const float* __restrict__ delta, int T, int H,
                      int Hkv, int D, float scale, float* __restrict__ dk, float* __restrict__ dv) {
  extern __shared__ float smem[];
  float* Qs = smem;                          // (32, D+1)
  float* dOs = Qs + kKeyTile * (D + 1);      // (32, D+1)
  float* Kj = dOs + kKeyTile * (D + 1);      // (16, D)
  float* Vj = Kj + kRowsPerBlock * D;        // (16, D)
  float* lse_s = Vj + kRowsPerBlock * D;     // (32)
  float* delta_s = lse_s + kKeyTile;         // (32)
  const int b = blockIdx.z, hk = blockIdx.y;
  const int group = H / Hkv;
  const int j0 = blockIdx.x * kRowsPerBlock;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t qstride = static_cast<int64_t>(H) * D, kstride = static_cast<int64_t>(Hkv) * D;
  const int64_t koff = static_cast<int64_t>(b) * T * kstride + static_cast<int64_t>(hk) * D;

  for (int idx = threadIdx.x; idx < kRowsPerBlock * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    const bool ok = j0 + r < T;
    Kj[idx] = ok ? k[koff + static_cast<int64_t>(j0 + r) * kstride + d] : 0.0f;
    Vj[idx] = ok ? v[koff + static_cast<int64_t>(j0 + r) * kstride + d] : 0.0f;
  }
  float dka[kRowsPerWarp][DPL], dva[kRowsPerWarp][DPL];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
#pragma unroll
    for (int e = 0; e < DPL; ++e) dka[rr][e] = dva[rr][e] = 0.0f;
  }
  const int first_tile = (j0 / kKeyTile) * kKeyTile;
  for (int g = 0; g < group; ++g) {
    const int h = hk * group + g;
    const int64_t qoff = static_cast<int64_t>(b) * T * qstride + static_cast<int64_t>(h) * D;
    const float* lse_bh = lse + (static_cast<int64_t>(b) * H + h) * T;
    const float* delta_bh = delta + (static_cast<int64_t>(b) * H + h) * T;
    for (int i0 = first_tile; i0 < T; i0 += kKeyTile) {
      __syncthreads();
      for (int idx = threadIdx.x; idx < kKeyTile * D; idx += kThreads) {
        const int r = idx / D, d = idx % D;
        const bool ok = i0 + r < T;
        Qs[r * (D + 1) + d] = ok ? q[qoff + static_cast<int64_t>(i0 + r) * qstride + d] : 0.0f;
        dOs[r * (D + 1) + d] = ok ? dout[qoff + static_cast<int64_t>(i0 + r) * qstride + d] : 0.0f;
      }
      if (threadIdx.x < kKeyTile) {
        const int i = i0 + threadIdx.x;
        lse_s[threadIdx.x] = i < T ? lse_bh[i] : 0.0f;
        delta_s[threadIdx.x] = i < T ? delta_bh[i] : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const int r = warp * kRowsPerWarp + rr;
        const int j = j0 + r;
        if (j >= T || i0 + kKeyTile - 1 < j) continue;  // no query in this tile sees key j
        const int i = i0 + lane;
        float p = 0.0f, ds = 0.0f;
        if (i >= j && i < T) {
          const float* qr = Qs + lane * (D + 1);
          const float* gr = dOs + lane * (D + 1);
          const float* kr = Kj + r * D;
          const float* vr = Vj + r * D;
          float sacc = 0.0f, dpacc = 0.0f;
          for (int d = 0; d < D; ++d) {
            sacc += qr[d] * kr[d];
            dpacc += gr[d] * vr[d];
          }
          p = expf(sacc * scale - lse_s[lane]);
          ds = p * (dpacc - delta_s[lane]);
        }
        const int iimin = max(0, j - i0);
        const int iimax = min(kKeyTile, T - i0);
        for (int ii = iimin; ii < iimax; ++ii) {
          const float pi = __shfl_sync(0xFFFFFFFFu, p, ii);
          const float dsi = __shfl_sync(0xFFFFFFFFu, ds, ii);
          const float* qr = Qs + ii * (D + 1);
          const float* gr = dOs + ii * (D + 1);
#pragma unroll
          for (int e = 0; e < DPL; ++e) {
            const int d = lane + 32 * e;
            if (d < D) {
              dva[rr][e] += pi * gr[d];
              dka[rr][e] += dsi * qr[d];
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int j = j0 + warp * kRowsPerWarp + rr;
    if (j >= T) continue;
    float* dkr = dk + koff + static_cast<int64_t>(j) * kstride;
    float* dvr = dv + koff + static_cast<int64_t>(j) * kstride;
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      const int d = lane + 32 * e;
      if (d < D) {
        dkr[d] = dka[rr][e] * scale;
        dvr[d] = dva[rr][e];
      }
    }
  }
}

template <typename Kernel>
void SetSmem(Kernel kernel, size_t bytes) {
  // Raising the limit is needed above 48 KB; setting it every call is cheap and idempotent.
  FSDP8_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
}

void CheckShapes(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
  FSDP8_CHECK(D >= 1 && D <= 256) << "attention head dim must be in [1, 256]";
  FSDP8_CHECK(Hkv >= 1 && H % Hkv == 0) << "attention: H must be a multiple of Hkv";
  FSDP8_CHECK(B <= 65535 && H <= 65535 && T < (1LL << 30)) << "attention: shape too large";
}

}  // namespace

#define FSDP8_ATTN_DISPATCH(D, KERNEL, ...)                 \
  do {                                                      \
    if ((D) <= 32) { __VA_ARGS__(KERNEL<1>); }              \
    else if ((D) <= 64) { __VA_ARGS__(KERNEL<2>); }         \
    else if ((D) <= 128) { __VA_ARGS__(KERNEL<4>); }        \
    else { __VA_ARGS__(KERNEL<8>); }                        \
  } while (0)

void LaunchAttentionForward(const float* q, const float* k, const float* v, int64_t B, int64_t T,
                            int64_t H, int64_t Hkv, int64_t D, float* out, float* lse,
                            cudaStream_t stream) {
  if (B <= 0 || T <= 0 || H <= 0) return;
  CheckShapes(B, T, H, Hkv, D);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const size_t smem = sizeof(float) * (kKeyTile * (D + 1) + kKeyTile * D + kRowsPerBlock * D);
  const dim3 grid(static_cast<unsigned>(CeilDiv(T, kRowsPerBlock)), static_cast<unsigned>(H),
                  static_cast<unsigned>(B));
  auto launch = [&](auto kernel) {
    SetSmem(kernel, smem);
    kernel<<<grid, kThreads, smem, stream>>>(q, k, v, static_cast<int>(T), static_cast<int>(H),
                                             static_cast<int>(Hkv), static_cast<int>(D), scale, out, lse);
    FSDP8_CUDA_LAUNCH_CHECK();
  };
  FSDP8_ATTN_DISPATCH(D, AttnForwardKernel, launch);
}

void LaunchAttentionBackward(const float* q, const float* k, const float* v, const float* out,
                             const float* dout, const float* lse, int64_t B, int64_t T, int64_t H,
                             int64_t Hkv, int64_t D, float* dq, float* dk, float* dv,
                             float* delta, cudaStream_t stream) {
  if (B <= 0 || T <= 0 || H <= 0) return;
  CheckShapes(B, T, H, Hkv, D);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  {
    const int64_t rows = B * T * H;
    int64_t blocks = CeilDiv(rows, 8);
    if (blocks > 65536) blocks = 65536;
    AttnDeltaKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        out, dout, static_cast<int>(B), static_cast<int>(T), static_cast<int>(H), static_cast<int>(D), delta);
    FSDP8_CUDA_LAUNCH_CHECK();
  }
  {
    const size_t smem = sizeof(float) * (2 * kKeyTile * (D + 1) + 2 * kRowsPerBlock * D);
    const dim3 grid(static_cast<unsigned>(CeilDiv(T, kRowsPerBlock)), static_cast<unsigned>(H),
                    static_cast<unsigned>(B));
    auto launch = [&](auto kernel) {
      SetSmem(kernel, smem);
      kernel<<<grid, kThreads, smem, stream>>>(q, k, v, dout, lse, delta, static_cast<int>(T),
                                               static_cast<int>(H), static_cast<int>(Hkv),
                                               static_cast<int>(D), scale, dq);
      FSDP8_CUDA_LAUNCH_CHECK();
    };
    FSDP8_ATTN_DISPATCH(D, AttnBackwardDqKernel, launch);
  }
  {
    const size_t smem = sizeof(float) * (2 * kKeyTile * (D + 1) + 2 * kRowsPerBlock * D + 2 * kKeyTile);
    const dim3 grid(static_cast<unsigned>(CeilDiv(T, kRowsPerBlock)), static_cast<unsigned>(Hkv),
                    static_cast<unsigned>(B));
    auto launch = [&](auto kernel) {
      SetSmem(kernel, smem);
      kernel<<<grid, kThreads, smem, stream>>>(q, k, v, dout, lse, delta, static_cast<int>(T),
                                               static_cast<int>(H), static_cast<int>(Hkv),
                                               static_cast<int>(D), scale, dk, dv);
      FSDP8_CUDA_LAUNCH_CHECK();
    };
    FSDP8_ATTN_DISPATCH(D, AttnBackwardDkvKernel, launch);
  }
}

}  // namespace fsdp8::cuda
