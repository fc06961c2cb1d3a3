// Block-scaled FP8 casts (Backend::QuantizeFp8Blocks: the rowwise and blockwise recipes) and the
// repacking of their scales into the layouts of cuBLASLt's block-scaled GEMMs.
//
// A cast is three kernels on the stream: the amax of every group (as int bits, atomicMax: order-
// independent, so deterministic) into the scale_inv buffer itself, the codes (each thread derives
// its group's scale from that amax exactly as Fp8BlockScale does on the host), then the amax is
// replaced in place by scale_inv = 1 / scale. The codes therefore equal the host reference's bit
// for bit (same scale in f32, same f32 product, EncodeDev's rounding).
//
// Two thread mappings cover the six group shapes (in the input's coordinates):
//   row groups (1 x 128 tiles, whole rows):   one warp per (row, 128-column segment);
//   column groups (128 x 128 blocks, 128-row groups of a column, whole columns): a block of 32 x 8
//   threads per (128-row band, 32-column strip), the codes of the transpose staged in shared
//   memory so both outputs are written coalesced.
#include <cfloat>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/fp8.h"

namespace fsdp8::cuda {
namespace {

constexpr int kSeg = 128;    // columns per warp of the row-group kernels
constexpr int kBand = 128;   // rows per block of the column-group kernels
constexpr int kStrip = 32;   // columns per block of the column-group kernels
constexpr int kWarps = 8;    // warps per block (both mappings)

// Where the scale of input element (r, c) lives: groups of gr rows x gc columns, laid out as the
// scale_inv of the matrix as cast (trans false: (nr, nc) row-major) or of its transpose (trans
// true: (nc, nr) row-major).
struct Groups {
  int64_t gr = 1, gc = 1, nr = 1, nc = 1;
  bool trans = false;
  __device__ int64_t Index(int64_t r, int64_t c) const {
    const int64_t a = r / gr, b = c / gc;
    return trans ? b * nr + a : a * nc + b;
  }
};

Groups MakeGroups(int64_t rows, int64_t cols, int64_t gr, int64_t gc, bool trans) {
  Groups g;
  g.gr = gr;
  g.gc = gc;
  g.nr = CeilDiv(rows, gr);
  g.nc = CeilDiv(cols, gc);
  g.trans = trans;
  return g;
}

// Fp8BlockScale (kernels/backend.cc) on the device: fp8_max / amax in double, clamped to
// [FLT_MIN, FLT_MAX], rounded once to f32; 1 for amax 0, inf or NaN.
__device__ __forceinline__ float BlockScaleDev(float amax, float fp8_max) {
  if (!(amax > 0.0f) || isinf(amax)) return 1.0f;
  double d = static_cast<double>(fp8_max) / static_cast<double>(amax);
  d = fmin(fmax(d, static_cast<double>(FLT_MIN)), static_cast<double>(FLT_MAX));
  return __double2float_rn(d);
}

__device__ __forceinline__ int64_t CeilDivDev(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ int WarpMaxInt(int v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// ---- row groups (gr = 1) ---------------------------------------------------------------------

template <typename T>
__global__ void AmaxRowsKernel(const T* __restrict__ in, int64_t rows, int64_t cols, Groups g,
                               int* __restrict__ amax_bits) {
  const int64_t segs = CeilDivDev(cols, kSeg);
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= rows * segs) return;  // whole warps leave together
  const int64_t r = w / segs, c0 = (w % segs) * kSeg;
  int m = 0;
  for (int j = 0; j < kSeg / 32; ++j) {
    const int64_t c = c0 + j * 32 + lane;
    if (c < cols) m = max(m, AbsBits(LoadF32(in + r * cols + c)));
  }
  m = WarpMaxInt(m);
  if (lane == 0) atomicMax(amax_bits + g.Index(r, c0), m);
}

template <typename T, bool kE5M2>
__global__ void QuantizeRowsKernel(const T* __restrict__ in, int64_t rows, int64_t cols, Groups g,
                                   const int* __restrict__ amax_bits, float fp8_max,
                                   uint8_t* __restrict__ out) {
  const int64_t segs = CeilDivDev(cols, kSeg);
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= rows * segs) return;
  const int64_t r = w / segs, c0 = (w % segs) * kSeg;
  const float s = BlockScaleDev(__int_as_float(amax_bits[g.Index(r, c0)]), fp8_max);
  for (int j = 0; j < kSeg / 32; ++j) {
    const int64_t c = c0 + j * 32 + lane;
    if (c < cols) {
      out[r * cols + c] = static_cast<uint8_t>(EncodeDev<kE5M2>(__fmul_rn(LoadF32(in + r * cols + c), s)));
    }
  }
}

// ---- column groups (gr = 128 or all rows; gc = 1 or 128) -------------------------------------

template <typename T>
__global__ void AmaxColsKernel(const T* __restrict__ in, int64_t rows, int64_t cols, Groups g,
                               int* __restrict__ amax_bits) {
  __shared__ int part[kWarps][kStrip];
  const int lane = threadIdx.x, wy = threadIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kStrip + lane;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBand;
  int m = 0;
  if (c < cols) {
    for (int i = wy; i < kBand; i += kWarps) {
      const int64_t r = r0 + i;
      if (r < rows) m = max(m, AbsBits(LoadF32(in + r * cols + c)));
    }
  }
  part[wy][lane] = m;
  __syncthreads();
  if (wy != 0) return;
  for (int k = 1; k < kWarps; ++k) m = max(m, part[k][lane]);
  if (g.gc == 1) {
    if (c < cols) atomicMax(amax_bits + g.Index(r0, c), m);
    return;
  }
  m = WarpMaxInt(m);  // the strip lies inside one 128-column group
  if (lane == 0) atomicMax(amax_bits + g.Index(r0, static_cast<int64_t>(blockIdx.x) * kStrip), m);
}

template <typename T, bool kE5M2>
__global__ void QuantizeColsKernel(const T* __restrict__ in, int64_t rows, int64_t cols, Groups g,
                                   const int* __restrict__ amax_bits, float fp8_max,
                                   uint8_t* __restrict__ out, uint8_t* __restrict__ out_t) {
  __shared__ uint8_t tile[kStrip][kBand + 4];
  const int lane = threadIdx.x, wy = threadIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kStrip + lane;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kBand;
  if (c < cols) {
    const float s = BlockScaleDev(__int_as_float(amax_bits[g.Index(r0, c)]), fp8_max);
    for (int i = wy; i < kBand; i += kWarps) {
      const int64_t r = r0 + i;
      if (r >= rows) break;
      const uint8_t code =
          static_cast<uint8_t>(EncodeDev<kE5M2>(__fmul_rn(LoadF32(in + r * cols + c), s)));
      if (out != nullptr) out[r * cols + c] = code;
      tile[lane][i] = code;
    }
  }
  if (out_t == nullptr) return;
  __syncthreads();
  const int t = wy * kStrip + lane;
  for (int idx = t; idx < kStrip * kBand; idx += kStrip * kWarps) {
    const int cl = idx / kBand, rl = idx % kBand;
    const int64_t cc = static_cast<int64_t>(blockIdx.x) * kStrip + cl, rr = r0 + rl;
    if (cc < cols && rr < rows) out_t[cc * rows + rr] = tile[cl][rl];
  }
}

// amax bits (n) -> scale_inv (n) in place; copy_t (nullable): the same values transposed, the n
// values read as (nr, nc) row-major and written (nc, nr).
__global__ void FinalizeScalesKernel(float* __restrict__ buf, int64_t n, float fp8_max,
                                     float* __restrict__ copy_t, int64_t nr, int64_t nc) {
  FSDP8_GRID_STRIDE(i, n) {
    const float s = BlockScaleDev(buf[i], fp8_max);
    const float inv = __frcp_rn(s);
    buf[i] = inv;
    if (copy_t != nullptr) copy_t[(i % nc) * nr + i / nc] = inv;
  }
}

template <typename T>
void LaunchRowGroups(const T* in, int64_t rows, int64_t cols, const Groups& g, Fp8Format fmt,
                     float fp8_max, uint8_t* out, float* scale_inv, int64_t n_scales,
                     cudaStream_t stream) {
  FSDP8_CUDA_CHECK(cudaMemsetAsync(scale_inv, 0, sizeof(float) * n_scales, stream));
  const int64_t warps = rows * CeilDiv(cols, kSeg);
  const unsigned blocks = static_cast<unsigned>(CeilDiv(warps, kWarps));
  int* bits = reinterpret_cast<int*>(scale_inv);
  AmaxRowsKernel<T><<<blocks, 32 * kWarps, 0, stream>>>(in, rows, cols, g, bits);
  FSDP8_CUDA_LAUNCH_CHECK();
  ForFormat(fmt, [&](auto e5m2) {
    QuantizeRowsKernel<T, decltype(e5m2)::value>
        <<<blocks, 32 * kWarps, 0, stream>>>(in, rows, cols, g, bits, fp8_max, out);
  });
  FSDP8_CUDA_LAUNCH_CHECK();
  FinalizeScalesKernel<<<EltBlocks(n_scales), kEltThreads, 0, stream>>>(scale_inv, n_scales,
                                                                        fp8_max, nullptr, 1, 1);
  FSDP8_CUDA_LAUNCH_CHECK();
}

template <typename T>
void LaunchColGroups(const T* in, int64_t rows, int64_t cols, const Groups& g, Fp8Format fmt,
                     float fp8_max, uint8_t* out, uint8_t* out_t, float* amax_buf,
                     int64_t n_scales, float* copy_t, cudaStream_t stream) {
  FSDP8_CUDA_CHECK(cudaMemsetAsync(amax_buf, 0, sizeof(float) * n_scales, stream));
  const dim3 grid(static_cast<unsigned>(CeilDiv(cols, kStrip)),
                  static_cast<unsigned>(CeilDiv(rows, kBand)));
  const dim3 block(kStrip, kWarps);
  int* bits = reinterpret_cast<int*>(amax_buf);
  AmaxColsKernel<T><<<grid, block, 0, stream>>>(in, rows, cols, g, bits);
  FSDP8_CUDA_LAUNCH_CHECK();
  ForFormat(fmt, [&](auto e5m2) {
    QuantizeColsKernel<T, decltype(e5m2)::value>
        <<<grid, block, 0, stream>>>(in, rows, cols, g, bits, fp8_max, out, out_t);
  });
  FSDP8_CUDA_LAUNCH_CHECK();
  FinalizeScalesKernel<<<EltBlocks(n_scales), kEltThreads, 0, stream>>>(
      amax_buf, n_scales, fp8_max, copy_t, g.nr, g.nc);
  FSDP8_CUDA_LAUNCH_CHECK();
}

template <typename T>
void QuantizeBlocks(const T* in, int64_t rows, int64_t cols, Fp8Blocks blocks, Fp8Format fmt,
                    uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t,
                    cudaStream_t stream) {
  const float fp8_max = Fp8Max(fmt);
  if (blocks == Fp8Blocks::kBlock128) {
    // One set of 128 x 128 blocks serves both outputs: the transpose has the same codes and the
    // transposed scales.
    const bool normal = out != nullptr;
    const Groups g = MakeGroups(rows, cols, kFp8BlockSize, kFp8BlockSize, !normal);
    LaunchColGroups(in, rows, cols, g, fmt, fp8_max, out, out_t, normal ? scale_inv : scale_inv_t,
                    g.nr * g.nc, normal ? scale_inv_t : nullptr, stream);
    return;
  }
  if (out != nullptr) {  // rows, or 1 x 128 tiles of rows
    const int64_t gc = blocks == Fp8Blocks::kRow ? cols : kFp8BlockSize;
    const Groups g = MakeGroups(rows, cols, 1, gc, false);
    LaunchRowGroups(in, rows, cols, g, fmt, fp8_max, out, scale_inv, g.nr * g.nc, stream);
  }
  if (out_t != nullptr) {  // rows of the transpose: whole columns, or 128-row groups of them
    const int64_t gr = blocks == Fp8Blocks::kRow ? rows : kFp8BlockSize;
    const Groups g = MakeGroups(rows, cols, gr, 1, true);
    LaunchColGroups(in, rows, cols, g, fmt, fp8_max, nullptr, out_t, scale_inv_t, g.nr * g.nc,
                    nullptr, stream);
  }
}

__global__ void CopyScalesKernel(const float* __restrict__ in, int64_t outer, int64_t inner,
                                 float* __restrict__ out, int64_t stride_outer,
                                 int64_t stride_inner) {
  FSDP8_GRID_STRIDE(i, outer * inner) {
    out[(i / inner) * stride_outer + (i % inner) * stride_inner] = in[i];
  }
}

}  // namespace

void LaunchQuantizeFp8Blocks(TypedCPtr in, int64_t rows, int64_t cols, Fp8Blocks blocks,
                             Fp8Format fmt, uint8_t* out, float* scale_inv, uint8_t* out_t,
                             float* scale_inv_t, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  if (in.bf16()) {
    QuantizeBlocks(in.h(), rows, cols, blocks, fmt, out, scale_inv, out_t, scale_inv_t, stream);
  } else {
    QuantizeBlocks(in.f(), rows, cols, blocks, fmt, out, scale_inv, out_t, scale_inv_t, stream);
  }
}

void LaunchCopyScales(const float* in, int64_t outer, int64_t inner, float* out,
                      int64_t stride_outer, int64_t stride_inner, cudaStream_t stream) {
  if (outer <= 0 || inner <= 0) return;
  CopyScalesKernel<<<EltBlocks(outer * inner), kEltThreads, 0, stream>>>(
      in, outer, inner, out, stride_outer, stride_inner);
  FSDP8_CUDA_LAUNCH_CHECK();
}

}  // namespace fsdp8::cuda
