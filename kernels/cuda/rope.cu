// Rotary position embedding, HF rotate_half convention (Backend: RopeForward, RopeBackward).
//   x (B, T, H, D), pairs (x[i], x[i + D/2]) for i in [0, D/2), position t:
//   angle = t * theta^(-2i/D); forward rotates by +angle, backward by -angle (inverse rotation).
// cos/sin are tabulated once per (T, D, theta) as Hugging Face (and the CPU reference) computes
// them: inv_freq_i = f32(1 / theta^(2i/D)) (in double), angle = f32(t) * inv_freq_i in f32, and
// cos/sin of that f32 angle evaluated in double, rounded to f32.
#include <cuda_runtime.h>

#include "common/check.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"

namespace fsdp8::cuda {
namespace {

constexpr int kThreads = 256;

// table (T, D/2) of float2 {cos, sin}.
__global__ void RopeTableKernel(int64_t T, int64_t D, float theta, float2* __restrict__ table) {
  const int64_t half = D / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= T * half) return;
  const int64_t t = idx / half, i = idx % half;
  const float inv_freq = static_cast<float>(
      1.0 / pow(static_cast<double>(theta), static_cast<double>(2 * i) / static_cast<double>(D)));
  const float angle = __fmul_rn(static_cast<float>(t), inv_freq);
  const double a = static_cast<double>(angle);
  table[idx] = make_float2(static_cast<float>(cos(a)), static_cast<float>(sin(a)));
}

// One thread per pair.
template <typename T_>
__global__ void RopeApplyKernel(T_* __restrict__ x, int64_t B, int64_t T, int64_t H, int64_t D,
                                int64_t ld, const float2* __restrict__ table, float sign) {
  const int64_t half = D / 2;
  const int64_t total = B * T * H * half;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const int64_t i = idx % half;
    const int64_t row = idx / half;       // (b, t, h) flattened
    const int64_t t = (row / H) % T;
    const float2 cs = table[t * half + i];
    const float c = cs.x, s = sign * cs.y;
    T_* p = x + (row / H) * ld + (row % H) * D;
    float y1, y2;
    RopeRotateDev(LoadF32(p + i), LoadF32(p + i + half), c, s, &y1, &y2);
    StoreF32(p + i, y1);
    StoreF32(p + i + half, y2);
  }
}

// Four consecutive pairs per thread (half % 4 == 0, fewer than 2^31 chunks): 32-bit index math
// (64-bit division dominated the one-pair kernel) and 4-element loads of each half.
template <typename T_>
__global__ void RopeApply4Kernel(T_* __restrict__ x, uint32_t rows, uint32_t T, uint32_t H,
                                 uint32_t D, int64_t ld, const float2* __restrict__ table,
                                 float sign) {
  const uint32_t half = D / 2, chunks = half / 4;
  const uint32_t total = rows * chunks;
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const uint32_t row = idx / chunks, i = 4 * (idx % chunks);
    const uint32_t token = row / H, t = token % T;
    const float2* cs = table + static_cast<size_t>(t) * half + i;
    T_* p = x + static_cast<size_t>(token) * ld + static_cast<size_t>(row - token * H) * D;
    const float4 a = Load4F32(p + i), b = Load4F32(p + i + half);
    const float x1[4] = {a.x, a.y, a.z, a.w}, x2[4] = {b.x, b.y, b.z, b.w};
    float y1[4], y2[4];
    const float4 cs01 = *reinterpret_cast<const float4*>(cs);
    const float4 cs23 = *reinterpret_cast<const float4*>(cs + 2);
    const float cc[4] = {cs01.x, cs01.z, cs23.x, cs23.z};
    const float ss[4] = {cs01.y, cs01.w, cs23.y, cs23.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      RopeRotateDev(x1[j], x2[j], cc[j], sign * ss[j], &y1[j], &y2[j]);
    }
    Store4F32(p + i, make_float4(y1[0], y1[1], y1[2], y1[3]));
    Store4F32(p + i + half, make_float4(y2[0], y2[1], y2[2], y2[3]));
  }
}

}  // namespace

void LaunchRopeTable(int64_t T, int64_t D, float theta, float* table, cudaStream_t stream) {
  const int64_t n = T * (D / 2);
  if (n <= 0) return;
  RopeTableKernel<<<static_cast<unsigned>(CeilDiv(n, kThreads)), kThreads, 0, stream>>>(
      T, D, theta, reinterpret_cast<float2*>(table));
  FSDP8_CUDA_LAUNCH_CHECK();
}

namespace {
template <typename T_>
void RopeApplyImpl(T_* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t ld,
                   const float* table, float sign, cudaStream_t stream) {
  FSDP8_CHECK(D % 2 == 0) << "RoPE needs an even head dimension";
  FSDP8_CHECK(ld >= H * D) << "RoPE: token stride below H * D";
  const int64_t total = B * T * H * (D / 2);
  if (total <= 0) return;
  // The 4-pair kernel's vector accesses need 4-element alignment of x (rows of D % 8 == 0
  // elements, so both halves start aligned) and of the table (cudaMalloc'd, half % 4 == 0).
  if ((D / 2) % 4 == 0 && total / 4 < (int64_t{1} << 31) && ld % 4 == 0 &&
      reinterpret_cast<uintptr_t>(x) % (4 * sizeof(T_)) == 0) {
    int64_t blocks = CeilDiv(total / 4, kThreads);
    if (blocks > 65536) blocks = 65536;
    RopeApply4Kernel<T_><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        x, static_cast<uint32_t>(B * T * H), static_cast<uint32_t>(T), static_cast<uint32_t>(H),
        static_cast<uint32_t>(D), ld, reinterpret_cast<const float2*>(table), sign);
    FSDP8_CUDA_LAUNCH_CHECK();
    return;
  }
  int64_t blocks = CeilDiv(total, kThreads);
  if (blocks > 65536) blocks = 65536;
  RopeApplyKernel<T_><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      x, B, T, H, D, ld, reinterpret_cast<const float2*>(table), sign);
  FSDP8_CUDA_LAUNCH_CHECK();
}
}  // namespace

void LaunchRopeApply(float* x, int64_t B, int64_t T, int64_t H, int64_t D, const float* table,
                     float sign, cudaStream_t stream) {
  RopeApplyImpl(x, B, T, H, D, H * D, table, sign, stream);
}

void LaunchRopeApplyBf16(uint16_t* x, int64_t B, int64_t T, int64_t H, int64_t D, int64_t ld,
                         const float* table, float sign, cudaStream_t stream) {
  RopeApplyImpl(x, B, T, H, D, ld, table, sign, stream);
}

}  // namespace fsdp8::cuda
