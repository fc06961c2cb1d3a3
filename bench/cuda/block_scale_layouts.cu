// Which scale-tensor layouts cuBLASLt's block-scaled FP8 GEMMs read on this GPU (the layouts
// CudaBackend::TryGemmFp8Blocks writes: kernels/cuda/cuda_backend.h). Codes are all 1.0 (E4M3
// 0x38), so each output is a sum over K chunks of the two operands' scales; every candidate layout
// of the OUTER_VEC_32F, VEC128_32F and BLK128x128_32F scales is tried for f32 and bf16 outputs
// and the one whose result matches the host's sum is marked MATCH. cuBLASLt's A is the (N, K)
// operand (m = N = 384 rows), its B the (M, K) one (n = M = 256), K = 320 (chunks 128, 128, 64).
// Not part of the build (GPU only, standalone):
//   nvcc -std=c++17 -arch=sm_90a -o block_scale_layouts bench/cuda/block_scale_layouts.cu -lcublasLt
// Seen on an H100 (CUDA 13.0): OUTER_VEC one f32 per row; VEC128 index kb * rows + r (layout 1) for
// both operands; BLK128x128 index rb * roundup(kb, 4) + kb (layout 0); f32 and bf16 outputs.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include <functional>
#define CK(x) do { auto e = (x); if ((int)e != 0) { printf("ERR %s = %d line %d\n", #x, (int)e, __LINE__); } } while (0)
int main() {
  cublasLtHandle_t h; CK(cublasLtCreate(&h));
  const int M = 256, N = 384, K = 320, KB = 3, KB4 = 4;  // our A (M,K), B (N,K)
  std::vector<unsigned char> ones((size_t)N * K, 0x38);
  unsigned char *dA, *dB; float* dD; float *sA, *sB;
  cudaMalloc(&dA, (size_t)M * K); cudaMalloc(&dB, (size_t)N * K); cudaMalloc(&dD, (size_t)M * N * 4);
  cudaMalloc(&sA, 1 << 20); cudaMalloc(&sB, 1 << 20);
  cudaMemcpy(dA, ones.data(), (size_t)M * K, cudaMemcpyHostToDevice);
  cudaMemcpy(dB, ones.data(), (size_t)N * K, cudaMemcpyHostToDevice);
  void* ws; cudaMalloc(&ws, 32 << 20);
  int cnt[3] = {128, 128, 64};
  // scale values: distinct per (row, kb): val(r, kb) = 1 + (r % 97) * 0.01 + kb * 0.25
  auto val = [](int r, int kb) { return 1.0f + (r % 97) * 0.01f + kb * 0.25f; };
  // Modes for cuBLAS A (=our B, rows N) and cuBLAS B (=our A, rows M).
  struct Case { const char* name; int ma, mb; };
  Case cases[] = {{"outer/outer", 3, 3}, {"vec128/vec128", 4, 4}, {"blk128(A)/vec128(B)", 5, 4}};
  for (auto& c : cases) {
    for (int outtype = 0; outtype < 2; ++outtype) {
      cudaDataType_t ct = outtype ? CUDA_R_16BF : CUDA_R_32F;
      // Fill scales by candidate layout L for each operand; try a set of candidate layouts.
      // Candidates for a (rows R, KB) 1x128: 0: r*KB+kb, 1: kb*R+r. For 128x128 (RB, KB): 0: rb*KB4+kb, 1: kb*RB+rb, 2: rb*KB+kb.
      int nla = c.ma == 3 ? 1 : (c.ma == 4 ? 2 : 3), nlb = c.mb == 3 ? 1 : 2;
      for (int la = 0; la < nla; ++la) for (int lb = 0; lb < nlb; ++lb) {
        auto fill = [&](int mode, int layout, int R, std::vector<float>& s) {
          s.assign(65536, 0.0f);
          if (mode == 3) { for (int r = 0; r < R; ++r) s[r] = val(r, 0); return; }
          if (mode == 4) { for (int r = 0; r < R; ++r) for (int kb = 0; kb < KB; ++kb) s[layout ? kb * R + r : r * KB + kb] = val(r, kb); return; }
          int RB = (R + 127) / 128;
          for (int rb = 0; rb < RB; ++rb) for (int kb = 0; kb < KB; ++kb) s[layout == 0 ? rb * KB4 + kb : layout == 1 ? kb * RB + rb : rb * KB + kb] = val(rb, kb);
        };
        std::vector<float> ha, hb;
        fill(c.ma, la, N, ha); fill(c.mb, lb, M, hb);
        cudaMemcpy(sA, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(sB, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice);
        cublasLtMatmulDesc_t d; CK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t T = CUBLAS_OP_T, Nn = CUBLAS_OP_N;
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &T, sizeof(T)));
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &Nn, sizeof(Nn)));
        int32_t ma = c.ma, mb = c.mb;
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, 4));
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, 4));
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sA, sizeof(sA)));
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sB, sizeof(sB)));
        cublasLtMatrixLayout_t la_, lb_, lc_;
        CK(cublasLtMatrixLayoutCreate(&la_, CUDA_R_8F_E4M3, K, N, K));
        CK(cublasLtMatrixLayoutCreate(&lb_, CUDA_R_8F_E4M3, K, M, K));
        CK(cublasLtMatrixLayoutCreate(&lc_, ct, N, M, N));
        cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
        uint64_t wsb = 32 << 20; CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
        cublasLtMatmulHeuristicResult_t res[4]; int found = 0;
        auto hs = cublasLtMatmulAlgoGetHeuristic(h, d, la_, lb_, lc_, lc_, pref, 4, res, &found);
        if (hs != 0 || found == 0) { printf("%s out=%s: heuristic status %d found %d\n", c.name, outtype ? "bf16" : "f32", (int)hs, found); continue; }
        float alpha = 1, beta = 0;
        cudaMemset(dD, 0, (size_t)M * N * 4);
        auto st = cublasLtMatmul(h, d, &alpha, dB, la_, dA, lb_, &beta, dD, lc_, dD, lc_, &res[0].algo, ws, wsb, 0);
        cudaDeviceSynchronize();
        if (st != 0) { printf("%s out=%s: matmul status %d\n", c.name, outtype ? "bf16" : "f32", (int)st); continue; }
        std::vector<float> D((size_t)M * N);
        if (outtype) { std::vector<unsigned short> d16((size_t)M * N); cudaMemcpy(d16.data(), dD, d16.size() * 2, cudaMemcpyDeviceToHost); for (size_t i = 0; i < D.size(); ++i) { unsigned u = (unsigned)d16[i] << 16; memcpy(&D[i], &u, 4); } }
        else cudaMemcpy(D.data(), dD, D.size() * 4, cudaMemcpyDeviceToHost);
        double maxrel = 0;
        for (int i = 0; i < M; ++i) for (int j = 0; j < N; ++j) {
          double ref = 0;
          for (int kb = 0; kb < KB; ++kb) {
            float a_ = c.ma == 3 ? val(j, 0) : (c.ma == 4 ? val(j, kb) : val(j / 128, kb));
            float b_ = c.mb == 3 ? val(i, 0) : val(i, kb);
            ref += (double)cnt[kb] * a_ * b_;
          }
          if (c.ma == 3) ref = (double)K * val(j, 0) * val(i, 0);
          double got = D[(size_t)i * N + j];
          maxrel = std::max(maxrel, std::fabs(got - ref) / std::fabs(ref));
        }
        printf("%s out=%s layoutA=%d layoutB=%d: max rel err %.3g %s\n", c.name, outtype ? "bf16" : "f32", la, lb, maxrel, maxrel < 1e-2 ? "MATCH" : "");
      }
    }
  }
  return 0;
}
