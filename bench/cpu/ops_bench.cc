// fsdp8-bench-cpu-ops: per-op timing of the CPU backend on the default model's shapes
// (d 128, 4 layers, 4 heads of 32, ffn 384, seq 256, vocab 256, 8 sequences per rank = 2048
// tokens), followed by the time of one synthetic training step that issues the ops of a full
// forward + backward + AdamW of that model with FP8 (E4M3 activations/weights, E5M2 grad-outputs)
// linears, in the order and number a trainer would. Inputs are random: this measures time, not
// math.
//
// Usage: fsdp8-bench-cpu-ops [--threads N] [--json] [--copies N]   (OpenBLAS threads, default 1)
//   --json: instead of the table, the non-GEMM rates of a calibration file (common/cost_model.h)
//   as one JSON object, each from the best of 3 rounds (bench_util.h BestSeconds: the lower of
//   wall-clock and process-CPU time): "memory_gbps", the
//   bytes of the memory-bound passes (counted as common/cost_model.cc counts them: RMSNorm
//   forward 8 and backward 12 bytes per element, FP8 cast 5, cast + transpose 6, RoPE 8,
//   SwiGLU forward 12 and backward 20 per (N, F) element, cross-entropy in place 12 per logit
//   (the f32 row read twice, the gradient written), embedding backward 8) over their summed time; "attention" forward and backward TFLOP/s (FLOPs
//   2 B H T^2 D forward, 2.5 x that backward, as bench/cuda/bench_cuda.cu counts them);
//   "optimizer_gbps", AdamW's 28 bytes per f32 element (p, g, m, v read; p, m, v written).
//   --copies N: instead, N processes (forked) each run the synthetic training step below on
//   their own operands, meeting at a process-shared barrier before each block's forward and
//   backward, before the head and before AdamW (where a job's ranks wait for each other in
//   their collectives); prints one JSON object {"processes": N, "wall_s": ..., "cpu_s": ...}:
//   the copies' mean wall-clock and process-CPU seconds per step, the round with the lowest wall
//   time of 3 (8 timed steps each, after one untimed). bench/calibrate.sh divides the wall time
//   at N by the CPU time at 1: the shared-host slowdown of the cost model (each rank's step
//   with N ranks sharing the host's cores, caches and memory bandwidth, and waiting for each
//   other).
#include <cblas.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <utility>
#include <random>
#include <string>
#include <vector>

#include "bench/cpu/bench_util.h"
#include "kernels/backend.h"

namespace {

using fsdp8::Backend;
using fsdp8::Fp8Format;

constexpr int64_t kB = 8, kT = 256, kC = 128, kH = 4, kD = 32, kF = 384, kV = 256, kLayers = 4;
constexpr int64_t kN = kB * kT;
constexpr float kTheta = 10000.0f;

// Backend buffers filled with small random values, freed at exit.
class Arena {
 public:
  explicit Arena(Backend* be) : be_(be) {}
  ~Arena() {
    for (void* p : ptrs_) be_->Free(p);
  }
  float* F(int64_t n, float lo = -1.0f, float hi = 1.0f) {
    std::vector<float> h(n);
    std::uniform_real_distribution<float> d(lo, hi);
    for (auto& x : h) x = d(rng_);
    auto* p = static_cast<float*>(Alloc(n * 4));
    be_->CopyToDevice(p, h.data(), n * 4);
    return p;
  }
  uint8_t* U8(int64_t n) {
    std::vector<uint8_t> h(n);
    // E4M3/E5M2 codes of magnitude below 1 (0x00..0x37 / 0x00..0x3B), random sign, so that
    // the GEMM outputs that feed the next ops stay O(10) as in a trained model.
    for (auto& c : h) c = static_cast<uint8_t>((rng_() % 0x38) | (rng_() & 0x80));
    auto* p = static_cast<uint8_t*>(Alloc(n));
    be_->CopyToDevice(p, h.data(), n);
    return p;
  }
  int32_t* Tokens(int64_t n) {
    std::vector<int32_t> h(n);
    for (auto& t : h) t = static_cast<int32_t>(rng_() % kV);
    auto* p = static_cast<int32_t*>(Alloc(n * 4));
    be_->CopyToDevice(p, h.data(), n * 4);
    return p;
  }

 private:
  void* Alloc(size_t bytes) {
    void* p = be_->Alloc(bytes);
    ptrs_.push_back(p);
    return p;
  }
  Backend* be_;
  std::vector<void*> ptrs_;
  std::mt19937 rng_{42};
};

void Report(const char* name, const fsdp8::bench::Timing& t) {
  std::printf("  %-44s %9.3f %9.3f\n", name, t.wall * 1e3, t.cpu * 1e3);
}

// The --copies mode's shared state: a process-shared barrier and each copy's figures per round.
constexpr int kCopyRounds = 3, kCopySteps = 8, kMaxCopies = 64;
struct CopiesShared {
  pthread_barrier_t barrier;
  double wall[kCopyRounds][kMaxCopies];
  double cpu[kCopyRounds][kMaxCopies];
};
CopiesShared* g_copies = nullptr;  // set in the copies (null: no waits)

void CopiesSync() {
  if (g_copies != nullptr) pthread_barrier_wait(&g_copies->barrier);
}

double WallSeconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Forks `copies` processes that return from here (true, *index = 0..copies-1) to run the
// copies' work; the parent waits for them, prints the JSON figure and returns false (*failed on
// a failed copy).
bool StartCopies(int copies, int* index, bool* failed) {
  void* mem = mmap(nullptr, sizeof(CopiesShared), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::perror("mmap");
    *failed = true;
    return false;
  }
  auto* sh = static_cast<CopiesShared*>(mem);
  pthread_barrierattr_t attr;
  pthread_barrierattr_init(&attr);
  pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_barrier_init(&sh->barrier, &attr, static_cast<unsigned>(copies));
  for (int i = 0; i < copies; ++i) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      *failed = true;
      return false;
    }
    if (pid == 0) {
      g_copies = sh;
      *index = i;
      return true;
    }
  }
  *failed = false;
  for (int i = 0; i < copies; ++i) {
    int status = 0;
    if (wait(&status) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) *failed = true;
  }
  if (*failed) {
    std::fprintf(stderr, "a copy failed\n");
    return false;
  }
  int best = 0;
  double best_wall = 0, best_cpu = 0;
  for (int r = 0; r < kCopyRounds; ++r) {
    double w = 0, c = 0;
    for (int i = 0; i < copies; ++i) {
      w += sh->wall[r][i] / copies;
      c += sh->cpu[r][i] / copies;
    }
    if (r == 0 || w < best_wall) {
      best = r;
      best_wall = w;
      best_cpu = c;
    }
  }
  (void)best;
  std::printf("{\"processes\": %d, \"wall_s\": %.6g, \"cpu_s\": %.6g}\n", copies, best_wall,
              best_cpu);
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1;
  bool json = false;
  int copies = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (std::strcmp(argv[i], "--copies") == 0 && i + 1 < argc) {
      copies = std::atoi(argv[++i]);
      if (copies < 1 || copies > kMaxCopies) {
        std::fprintf(stderr, "--copies: must be 1..%d\n", kMaxCopies);
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--threads N] [--json] [--copies N]\n", argv[0]);
      return 2;
    }
  }
  int copy = -1;
  if (copies > 0) {
    bool failed = false;
    if (!StartCopies(copies, &copy, &failed)) return failed ? 1 : 0;
  }
  openblas_set_num_threads(threads);
  std::string error;
  auto be_owner = fsdp8::CreateBackend("cpu", 0, &error);
  if (!be_owner) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return 1;
  }
  Backend* be = be_owner.get();
  Arena a(be);
  const Fp8Format e4 = Fp8Format::kE4M3, e5 = Fp8Format::kE5M2;

  // Activations and scratch of one layer, reused by every layer (timing only).
  float* x = a.F(kN * kC);   // residual stream (N, C)
  float* xn = a.F(kN * kC);  // normed (N, C)
  float* rstd = a.F(kN);
  float* wn = a.F(kC, 0.5f, 1.5f);
  float* q = a.F(kN * kC);  // (B, T, H, D)
  float* k = a.F(kN * kC);
  float* v = a.F(kN * kC);
  float* att = a.F(kN * kC);
  float* lse = a.F(kB * kH * kT);
  float* g = a.F(kN * kF, -3, 3);  // (N, F)
  float* u = a.F(kN * kF);
  float* h = a.F(kN * kF);
  float* dNC = a.F(kN * kC);
  float* dNC2 = a.F(kN * kC);
  float* dq = a.F(kN * kC);
  float* dk = a.F(kN * kC);
  float* dv = a.F(kN * kC);
  float* dNF = a.F(kN * kF);
  float* dNF2 = a.F(kN * kF);
  float* logits = a.F(kN * kV, -4, 4);
  float* losses = a.F(kN);
  float* wf32 = a.F(kV * kC);  // LM head (V, C), f32/bf16
  float* dwf32 = a.F(kV * kC);
  float* emb = a.F(kV * kC);
  float* demb = a.F(kV * kC);
  float* dwn = a.F(kC);
  float* dwbuf = a.F(kF * kC);  // a dW of the largest linear (F, C)
  float* ybuf = a.F(kN * kF);   // GEMM output of the per-op timings
  int32_t* tokens = a.Tokens(kN);
  uint8_t* x8 = a.U8(kN * kF);   // FP8 activation (N, K)
  uint8_t* x8t = a.U8(kN * kF);  // its transpose (K, N)
  uint8_t* dy8 = a.U8(kN * kF);
  uint8_t* dy8t = a.U8(kN * kF);
  uint8_t* w8 = a.U8(kF * kC);  // FP8 weight (N_out, K)
  uint8_t* w8t = a.U8(kF * kC);
  float* scale = a.F(1, 1.0f, 1.0f);
  float* amax = a.F(1, 0.0f, 0.0f);
  const int64_t shard = 920000 / 2;  // AdamW on one rank's half of the 0.92 M parameters
  float* p = a.F(shard);
  float* pg = a.F(shard, -1e-3f, 1e-3f);
  float* pm = a.F(shard, 0.0f, 0.0f);
  float* pv = a.F(shard, 0.0f, 0.0f);
  float* norm = a.F(1, 0.0f, 0.0f);

  // One FP8 linear: Y (N, Nout) = X (N, Kin) W^T; backward dX = dY W, dW = dY^T X.
  auto linear_fwd = [&](int64_t nout, int64_t kin, float* y) {
    be->GemmFp8(false, true, kN, nout, kin, {x8, e4, scale}, {w8, e4, scale}, y, false);
  };
  auto linear_bwd = [&](const float* dy, int64_t nout, int64_t kin, float* dx, bool acc) {
    be->CastFp8(dy, kN, nout, scale, e5, dy8, dy8t, amax);                      // dY (N,Nout), dY^T
    be->TransposeBytes(w8, nout, kin, w8t);                                     // W^T (Kin, Nout)
    be->GemmFp8(false, true, kN, kin, nout, {dy8, e5, scale}, {w8t, e4, scale}, dx,
                acc);  // dX (N, Kin)
    be->GemmFp8(false, true, nout, kin, kN, {dy8t, e5, scale}, {x8t, e4, scale}, dwbuf,
                false);  // dW (Nout, Kin)
  };

  if (json) {
    using fsdp8::bench::BestSeconds;
    const double nc = static_cast<double>(kN * kC), nf = static_cast<double>(kN * kF);
    const std::pair<double, std::function<void()>> passes[] = {
        {8 * nc, [&] { be->RmsNormForward(x, wn, 1e-5f, kN, kC, xn, rstd); }},
        {12 * nc, [&] { be->RmsNormBackward(dNC, x, wn, rstd, kN, kC, dNC2, dwn); }},
        {5 * nc, [&] { be->CastFp8(x, 1, kN * kC, scale, e4, x8, nullptr, amax); }},
        {6 * nf, [&] { be->CastFp8(g, kN, kF, scale, e5, dy8, dy8t, amax); }},
        {8 * nc, [&] { be->RopeForward(q, kB, kT, kH, kD, kTheta); }},
        {12 * nf, [&] { be->SwigluForward(g, u, 1, kN * kF, 0, h); }},
        {20 * nf, [&] { be->SwigluBackward(h, g, u, 1, kN * kF, 0, dNF, dNF2); }},
        {12.0 * kN * kV, [&] { be->CrossEntropyForwardBackward(logits, tokens, kN, kV, 1.0f / kN, losses); }},
        {8 * nc, [&] { be->EmbeddingBackward(tokens, kN, dNC, kC, demb); }},
    };
    double bytes = 0, seconds = 0;
    for (const auto& [b, fn] : passes) {
      bytes += b;
      seconds += BestSeconds(fn);
    }
    const double att_flops = 2.0 * kB * kH * kT * kT * kD;
    const double af = BestSeconds([&] { be->AttentionForward(q, k, v, kB, kT, kH, kH, kD, att, lse); });
    const double ab = BestSeconds([&] {
      be->AttentionBackward(q, k, v, att, dNC, lse, kB, kT, kH, kH, kD, dq, dk, dv);
    });
    const double adamw = BestSeconds([&] {
      be->AdamW(p, pg, pm, pv, shard, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 10, 1.0f, nullptr, nullptr);
    });
    std::printf("{\"memory_gbps\": %.6g, \"attention\": {\"forward_tflops\": %.6g, "
                "\"backward_tflops\": %.6g}, \"optimizer_gbps\": %.6g}\n",
                bytes / seconds / 1e9, att_flops / af / 1e12, 2.5 * att_flops / ab / 1e12,
                28.0 * shard / adamw / 1e9);
    return 0;
  }
  if (copy < 0) {
    std::printf("CPU backend, default model shapes (N = %lld tokens), OpenBLAS threads %d\n",
                static_cast<long long>(kN), threads);
    std::printf("  %-44s %9s %9s\n", "op", "wall ms", "cpu ms");
    Report("RmsNormForward (2048x128)",
           fsdp8::bench::TimeIt([&] { be->RmsNormForward(x, wn, 1e-5f, kN, kC, xn, rstd); }));
    Report("RmsNormBackward (2048x128)",
           fsdp8::bench::TimeIt([&] { be->RmsNormBackward(dNC, x, wn, rstd, kN, kC, dNC2, dwn); }));
    Report("CastToFp8 E4M3 (2048x128)",
           fsdp8::bench::TimeIt([&] { be->CastFp8(x, 1, kN * kC, scale, e4, x8, nullptr, amax); }));
    Report("CastTransposeFp8 E4M3 (2048x128, both)",
           fsdp8::bench::TimeIt([&] { be->CastFp8(x, kN, kC, scale, e4, x8, x8t, amax); }));
    Report("CastTransposeFp8 E5M2 (2048x384, both)",
           fsdp8::bench::TimeIt([&] { be->CastFp8(g, kN, kF, scale, e5, dy8, dy8t, amax); }));
    Report("GemmFp8 fwd 2048x128x128", fsdp8::bench::TimeIt([&] { linear_fwd(kC, kC, ybuf); }));
    Report("GemmFp8 fwd 2048x384x128", fsdp8::bench::TimeIt([&] { linear_fwd(kF, kC, ybuf); }));
    Report("GemmFp8 fwd 2048x128x384", fsdp8::bench::TimeIt([&] { linear_fwd(kC, kF, ybuf); }));
    Report("FP8 linear bwd (dX + dW + casts), 384x128",
           fsdp8::bench::TimeIt([&] { linear_bwd(g, kF, kC, ybuf, false); }));
    Report("Gemm f32 LM head fwd 2048x256x128", fsdp8::bench::TimeIt([&] {
             be->Gemm(false, true, kN, kV, kC, xn, wf32, logits, false, fsdp8::GemmInputs::kF32);
           }));
    Report("Gemm bf16 LM head fwd 2048x256x128", fsdp8::bench::TimeIt([&] {
             be->Gemm(false, true, kN, kV, kC, xn, wf32, logits, false, fsdp8::GemmInputs::kBF16);
           }));
    Report("RopeForward q (8,256,4,32)",
           fsdp8::bench::TimeIt([&] { be->RopeForward(q, kB, kT, kH, kD, kTheta); }));
    Report("AttentionForward (8,256,4,32)", fsdp8::bench::TimeIt([&] {
             be->AttentionForward(q, k, v, kB, kT, kH, kH, kD, att, lse);
           }));
    Report("AttentionBackward (8,256,4,32)", fsdp8::bench::TimeIt([&] {
             be->AttentionBackward(q, k, v, att, dNC, lse, kB, kT, kH, kH, kD, dq, dk, dv);
           }));
    Report("SwigluForward (2048x384)",
           fsdp8::bench::TimeIt([&] { be->SwigluForward(g, u, 1, kN * kF, 0, h); }));
    Report("SwigluBackward (2048x384)",
           fsdp8::bench::TimeIt([&] { be->SwigluBackward(h, g, u, 1, kN * kF, 0, dNF, dNF2); }));
    Report("CrossEntropyForwardBackward (2048x256)", fsdp8::bench::TimeIt([&] {
             be->CrossEntropyForwardBackward(logits, tokens, kN, kV, 1.0f / kN, losses);
           }));
    Report("EmbeddingBackward (2048 tokens, 128)",
           fsdp8::bench::TimeIt([&] { be->EmbeddingBackward(tokens, kN, dNC, kC, demb); }));
    Report("AdamW (460k params)", fsdp8::bench::TimeIt([&] {
             be->AdamW(p, pg, pm, pv, shard, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 10, 1.0f, nullptr, nullptr);
           }));
    Report("SumSquares (460k)", fsdp8::bench::TimeIt([&] { be->SumSquares(pg, shard, norm); }));
  }

  // ---- one synthetic training step ----
  auto step = [&] {
    be->EmbeddingForward(tokens, kN, emb, kC, x);
    for (int l = 0; l < kLayers; ++l) {
      CopiesSync();  // the block's all-gather
      // attention block
      be->RmsNormForward(x, wn, 1e-5f, kN, kC, xn, rstd);
      be->CastFp8(xn, kN, kC, scale, e4, x8, x8t, amax);
      linear_fwd(kC, kC, q);
      linear_fwd(kC, kC, k);
      linear_fwd(kC, kC, v);
      be->RopeForward(q, kB, kT, kH, kD, kTheta);
      be->RopeForward(k, kB, kT, kH, kD, kTheta);
      be->AttentionForward(q, k, v, kB, kT, kH, kH, kD, att, lse);
      be->CastFp8(att, kN, kC, scale, e4, x8, x8t, amax);
      linear_fwd(kC, kC, dNC);
      be->Axpy(1.0f, dNC, x, kN * kC);
      // MLP block
      be->RmsNormForward(x, wn, 1e-5f, kN, kC, xn, rstd);
      be->CastFp8(xn, kN, kC, scale, e4, x8, x8t, amax);
      linear_fwd(kF, kC, g);
      linear_fwd(kF, kC, u);
      be->SwigluForward(g, u, 1, kN * kF, 0, h);
      be->CastFp8(h, kN, kF, scale, e4, x8, x8t, amax);
      linear_fwd(kC, kF, dNC);
      be->Axpy(1.0f, dNC, x, kN * kC);
    }
    CopiesSync();  // the head's all-gather
    be->RmsNormForward(x, wn, 1e-5f, kN, kC, xn, rstd);
    be->Gemm(false, true, kN, kV, kC, xn, wf32, logits, false, fsdp8::GemmInputs::kBF16);
    be->CrossEntropyForwardBackward(logits, tokens, kN, kV, 1.0f / kN, losses);
    be->Gemm(false, false, kN, kC, kV, logits, wf32, dNC, false, fsdp8::GemmInputs::kBF16);
    be->Gemm(true, false, kV, kC, kN, logits, xn, dwf32, true, fsdp8::GemmInputs::kBF16);
    be->RmsNormBackward(dNC, x, wn, rstd, kN, kC, dNC2, dwn);
    for (int l = 0; l < kLayers; ++l) {
      CopiesSync();  // the block's re-gather and the previous unit's reduce-scatter
      // MLP block backward (activations recomputed or kept: the kept case is timed here)
      linear_bwd(dNC2, kC, kF, dNF, false);  // down
      be->SwigluBackward(dNF, g, u, 1, kN * kF, 0, h, dNF2);
      linear_bwd(h, kF, kC, dNC, false);    // gate
      linear_bwd(dNF2, kF, kC, dNC, true);  // up
      be->RmsNormBackward(dNC, x, wn, rstd, kN, kC, dNC, dwn);
      be->Axpy(1.0f, dNC, dNC2, kN * kC);
      // attention block backward
      linear_bwd(dNC2, kC, kC, dNC, false);  // o
      be->AttentionBackward(q, k, v, att, dNC, lse, kB, kT, kH, kH, kD, dq, dk, dv);
      be->RopeBackward(dq, kB, kT, kH, kD, kTheta);
      be->RopeBackward(dk, kB, kT, kH, kD, kTheta);
      linear_bwd(dq, kC, kC, dNC, false);
      linear_bwd(dk, kC, kC, dNC, true);
      linear_bwd(dv, kC, kC, dNC, true);
      be->RmsNormBackward(dNC, x, wn, rstd, kN, kC, dNC, dwn);
      be->Axpy(1.0f, dNC, dNC2, kN * kC);
    }
    be->EmbeddingBackward(tokens, kN, dNC2, kC, demb);
    be->SumSquares(pg, shard, norm);
    CopiesSync();  // the gradient norm's all-reduce
    be->AdamW(p, pg, pm, pv, shard, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 10, 1.0f, nullptr, nullptr);
    be->Synchronize();
  };
  if (copy >= 0) {  // --copies: rounds of timed steps, all copies together
    step();
    for (int r = 0; r < kCopyRounds; ++r) {
      CopiesSync();
      const double w0 = WallSeconds(), c0 = fsdp8::bench::ProcessCpuSeconds();
      for (int i = 0; i < kCopySteps; ++i) step();
      g_copies->wall[r][copy] = (WallSeconds() - w0) / kCopySteps;
      g_copies->cpu[r][copy] = (fsdp8::bench::ProcessCpuSeconds() - c0) / kCopySteps;
    }
    std::fflush(stdout);
    _exit(0);
  }
  const fsdp8::bench::Timing t_step = fsdp8::bench::TimeIt(step, 2.0);
  std::printf(
      "synthetic training step (fwd+bwd+AdamW, FP8 linears, 2048 tokens): "
      "%.1f ms wall, %.1f ms cpu\n",
      t_step.wall * 1e3, t_step.cpu * 1e3);
  return 0;
}
