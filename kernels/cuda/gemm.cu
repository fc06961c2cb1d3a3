// cuBLASLt GEMMs: descriptor / layout / algorithm cache. The layout derivation is in gemm.h.
#include "kernels/cuda/gemm.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kernels/cuda/cuda_check.h"

namespace fsdp8::cuda {

void CheckCublas(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  std::fprintf(stderr, "fsdp8 cuda: %s failed: cuBLAS status %d (%s) at %s:%d\n", what,
               static_cast<int>(s), cublasLtGetStatusString(s), file, line);
  std::fflush(stderr);
  std::abort();
}

int PointerAlignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && (a % static_cast<uintptr_t>(align)) != 0) align >>= 1;
  return align;
}

LtGemm::LtGemm(cudaStream_t stream, void* workspace, size_t ws_bytes)
    : stream_(stream), workspace_(workspace), ws_bytes_(ws_bytes) {
  FSDP8_CUBLAS_CHECK(cublasLtCreate(&handle_));
  FSDP8_CUDA_CHECK(cudaMalloc(&scale_slots_, 2 * kScaleSlotBytes));
}

LtGemm::~LtGemm() {
  for (auto& kv : cache_) {
    Entry& e = kv.second;
    if (e.a) cublasLtMatrixLayoutDestroy(e.a);
    if (e.b) cublasLtMatrixLayoutDestroy(e.b);
    if (e.c) cublasLtMatrixLayoutDestroy(e.c);
    if (e.desc) cublasLtMatmulDescDestroy(e.desc);
  }
  for (cudaEvent_t ev : ev_) {
    if (ev) cudaEventDestroy(ev);
  }
  if (handle_) cublasLtDestroy(handle_);
  if (scale_slots_) cudaFree(scale_slots_);
}

LtGemm::Entry* LtGemm::Lookup(const LtProblem& p) {
  auto key = p.Key();
  auto it = cache_.find(key);
  if (it != cache_.end()) return &it->second;
  Entry e;
  FSDP8_CUBLAS_CHECK(cublasLtMatmulDescCreate(&e.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  FSDP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  FSDP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  // Stored shapes (before op): op = T means stored (k, m) for A, (n, k) for B.
  const uint64_t a_rows = p.trans_a ? p.k : p.m, a_cols = p.trans_a ? p.m : p.k;
  const uint64_t b_rows = p.trans_b ? p.n : p.k, b_cols = p.trans_b ? p.k : p.n;
  FSDP8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&e.a, p.a_type, a_rows, a_cols, p.lda));
  FSDP8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&e.b, p.b_type, b_rows, b_cols, p.ldb));
  FSDP8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&e.c, p.c_type, p.m, p.n, p.ldc));
  if (p.fast_accum) {
    const int8_t on = 1;
    FSDP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &on, sizeof(on)));
  }
  if (p.scaled) {
    // Placeholder pointers so that the heuristic sees a scaled FP8 problem; real ones per call.
    const void* none = nullptr;
    FSDP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &none, sizeof(none)));
    FSDP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &none, sizeof(none)));
    const int32_t mode_a = p.scale_mode_a, mode_b = p.scale_mode_b;
    if (mode_a != 0) {
      FSDP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
    }
    if (mode_b != 0) {
      FSDP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
    }
  }
  cublasLtMatmulPreference_t pref = nullptr;
  FSDP8_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = ws_bytes_;
  FSDP8_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_MASK & ~static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_INPLACE);
  FSDP8_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)));
  const uint32_t al_a = p.align_a, al_b = p.align_b, al_c = p.align_c;
  FSDP8_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  FSDP8_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  FSDP8_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  FSDP8_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));
  constexpr int kCandidates = 16;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle_, e.desc, e.a, e.b, e.c, e.c, pref, kCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs == CUBLAS_STATUS_SUCCESS) {
    for (int i = 0; i < found; ++i) {
      if (results[i].state == CUBLAS_STATUS_SUCCESS) e.algos.push_back(results[i].algo);
    }
  }
  e.ok = !e.algos.empty();
  const cublasLtMatmulHeuristicResult_t& result = results[0];
  if (verbose_) {
    std::fprintf(stderr,
                 "fsdp8 cuda gemm: m=%lld n=%lld k=%lld ta=%d tb=%d types=%d,%d scaled=%d modes=%d,%d "
                 "acc=%d align=%d,%d,%d -> %s (status %d, found %d, ws %zu)\n",
                 static_cast<long long>(p.m), static_cast<long long>(p.n), static_cast<long long>(p.k),
                 p.trans_a, p.trans_b, static_cast<int>(p.a_type), static_cast<int>(p.b_type),
                 p.scaled, p.scale_mode_a, p.scale_mode_b, p.accumulate, p.align_a, p.align_b, p.align_c,
                 e.ok ? "cuBLASLt" : "fallback", static_cast<int>(hs), found,
                 static_cast<size_t>(result.workspaceSize));
  }
  auto ins = cache_.emplace(key, e);
  return &ins.first->second;
}

bool LtGemm::Run(const LtProblem& p, const void* A, const void* B, void* C, const float* scale_a,
                 const float* scale_b, const void* c_in) {
  Entry* e = Lookup(p);
  if (!e->ok) return false;
  if (p.scaled) {
    // cuBLASLt refuses FP8 scale pointers that are not 16-byte aligned (NOT_SUPPORTED at run
    // time; measured on H200, cuBLASLt 13.1): stage such scalars into aligned slots.
    auto aligned = [&](const float* s, int slot) -> const float* {
      if (reinterpret_cast<uintptr_t>(s) % 16 == 0) return s;
      float* dst = reinterpret_cast<float*>(static_cast<char*>(scale_slots_) + slot * kScaleSlotBytes);
      FSDP8_CUDA_CHECK(cudaMemcpyAsync(dst, s, sizeof(float), cudaMemcpyDeviceToDevice, stream_));
      return dst;
    };
    if (p.scale_mode_a == 0) scale_a = aligned(scale_a, 0);  // tensors: the caller aligns them
    if (p.scale_mode_b == 0) scale_b = aligned(scale_b, 1);
    FSDP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof(scale_a)));
    FSDP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof(scale_b)));
  }
  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  if (autotune_ && !e->tuned) Tune(*e, p, A, B);
  if (autotune_ && e->best >= 0) {
    const cublasStatus_t s = cublasLtMatmul(handle_, e->desc, &alpha, A, e->a, B, e->b, &beta,
                                            c_in != nullptr ? c_in : C, e->c, C, e->c,
                                            &e->algos[e->best], workspace_, ws_bytes_, stream_);
    if (s == CUBLAS_STATUS_SUCCESS) return true;
    if (s != CUBLAS_STATUS_NOT_SUPPORTED) FSDP8_CUBLAS_CHECK(s);
    e->best = -1;  // refused after all: the heuristic's order below
  }
  while (e->next < e->algos.size()) {
    const cublasStatus_t s = cublasLtMatmul(handle_, e->desc, &alpha, A, e->a, B, e->b, &beta,
                                            c_in != nullptr ? c_in : C, e->c, C, e->c,
                                            &e->algos[e->next], workspace_, ws_bytes_, stream_);
    if (s == CUBLAS_STATUS_SUCCESS) return true;
    if (s != CUBLAS_STATUS_NOT_SUPPORTED) FSDP8_CUBLAS_CHECK(s);
    if (verbose_) {
      std::fprintf(stderr, "fsdp8 cuda gemm: m=%lld n=%lld k=%lld candidate %zu refused at run time, trying the next\n",
                   static_cast<long long>(p.m), static_cast<long long>(p.n), static_cast<long long>(p.k), e->next);
    }
    ++e->next;
  }
  e->ok = false;  // every candidate refused: the caller's fallback from now on
  return false;
}

namespace {

// Tuned choices of this process, per device and problem: each job creates its own backend, and
// without this every job would time the candidates again and could choose differently.
struct TunedChoices {
  std::mutex mu;
  std::map<std::pair<int, decltype(LtProblem().Key())>, cublasLtMatmulAlgo_t> chosen;
};
TunedChoices& Tuned() {
  static TunedChoices* t = new TunedChoices();  // never destroyed: used until exit
  return *t;
}

}  // namespace

void LtGemm::Tune(Entry& e, const LtProblem& p, const void* A, const void* B) {
  e.tuned = true;
  e.best = -1;
  if (e.algos.size() < 2 || !alloc_) return;
  int device = 0;
  FSDP8_CUDA_CHECK(cudaGetDevice(&device));
  const auto tuned_key = std::make_pair(device, p.Key());
  {
    std::lock_guard<std::mutex> l(Tuned().mu);
    auto it = Tuned().chosen.find(tuned_key);
    if (it != Tuned().chosen.end()) {  // chosen by an earlier job: the same candidate again
      for (size_t i = 0; i < e.algos.size(); ++i) {
        if (std::memcmp(&e.algos[i], &it->second, sizeof(cublasLtMatmulAlgo_t)) == 0) {
          e.best = static_cast<int>(i);
          return;
        }
      }
    }
  }
  const size_t elt = p.c_type == CUDA_R_16BF ? 2 : 4;
  const size_t bytes = static_cast<size_t>(p.ldc) * static_cast<size_t>(p.n) * elt;
  void* D = alloc_(bytes);
  if (D == nullptr) return;  // no room for the scratch output: keep the heuristic's order
  for (cudaEvent_t& ev : ev_) {
    if (ev == nullptr) FSDP8_CUDA_CHECK(cudaEventCreate(&ev));
  }
  // Finite values for beta = 1 (the scratch starts uninitialised).
  FSDP8_CUDA_CHECK(cudaMemsetAsync(D, 0, bytes, stream_));
  // Timed with the device to itself: collectives running next to the candidates (a step's
  // prefetches and reduce-scatters) made the timings of successive candidates incomparable, and
  // the choices then lost as much as they won (measured on the 1b step).
  FSDP8_CUDA_CHECK(cudaDeviceSynchronize());
  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  auto run = [&](size_t i) {
    return cublasLtMatmul(handle_, e.desc, &alpha, A, e.a, B, e.b, &beta, D, e.c, D, e.c,
                          &e.algos[i], workspace_, ws_bytes_, stream_);
  };
  std::vector<double> ms(e.algos.size(), -1.0);
  for (size_t i = 0; i < e.algos.size(); ++i) {
    const cublasStatus_t s0 = run(i);  // warm-up; refused candidates are skipped
    if (s0 == CUBLAS_STATUS_NOT_SUPPORTED) continue;
    FSDP8_CUBLAS_CHECK(s0);
    std::vector<double> rounds;
    for (int r = 0; r < kTuneRounds; ++r) {
      FSDP8_CUDA_CHECK(cudaEventRecord(ev_[0], stream_));
      for (int k = 0; k < kTuneReps; ++k) FSDP8_CUBLAS_CHECK(run(i));
      FSDP8_CUDA_CHECK(cudaEventRecord(ev_[1], stream_));
      FSDP8_CUDA_CHECK(cudaEventSynchronize(ev_[1]));
      float t = 0;
      FSDP8_CUDA_CHECK(cudaEventElapsedTime(&t, ev_[0], ev_[1]));
      rounds.push_back(t / kTuneReps);
    }
    std::sort(rounds.begin(), rounds.end());
    ms[i] = rounds[rounds.size() / 2];
  }
  free_(D);
  int best = -1;
  for (size_t i = 0; i < ms.size(); ++i) {
    if (ms[i] >= 0 && (best < 0 || ms[i] < ms[best])) best = static_cast<int>(i);
  }
  // The heuristic's first working candidate unless another is clearly faster: fewer changes of
  // algorithm between runs from timing noise.
  int first = -1;
  for (size_t i = 0; i < ms.size() && first < 0; ++i) {
    if (ms[i] >= 0) first = static_cast<int>(i);
  }
  if (first >= 0 && best >= 0 && ms[first] <= ms[best] * (1.0 + kTuneMinGain)) best = first;
  e.best = best;
  if (best >= 0) {
    std::lock_guard<std::mutex> l(Tuned().mu);
    Tuned().chosen[tuned_key] = e.algos[best];
  }
  if (verbose_) {
    std::fprintf(stderr, "fsdp8 cuda gemm: tuned m=%lld n=%lld k=%lld acc=%d:",
                 static_cast<long long>(p.m), static_cast<long long>(p.n),
                 static_cast<long long>(p.k), p.accumulate);
    for (double t : ms) std::fprintf(stderr, " %.1f", 1e3 * t);
    std::fprintf(stderr, " us -> candidate %d\n", best);
  }
}

}  // namespace fsdp8::cuda
