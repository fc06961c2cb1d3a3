// One whole training step on the CUDA backend against the CPU backend: the same job spec (d 64,
// 2 layers, 4 heads, ffn 192, seq 64, vocab 256, global batch 4 in 2 microbatches, one rank) runs
// 3 optimizer steps on Backend "cpu" + a 1-rank Gloo communicator and on Backend "cuda" (device
// $FSDP8_CUDA_STEP_DEVICE, default 0) + a 1-rank NCCL communicator. Compared, for the FP32 plan
// and the default plan (FP8 linears, BF16 embedding and head):
//   * the initial master weights (same initialisation rule on the host: bit for bit up to 4 u),
//   * the gradients of step 0 (Trainer::ForwardBackward(0), gathered), per tensor,
//   * the loss and the grad norm of steps 0, 1 and 2,
//   * every master weight after step 0, element by element (rule below), and the fraction of
//     elements whose step-0 update w1 - w0 has the same sign on both backends.
// Measured differences are printed ("cuda-step ...") so the margins show in the log.
//
// Tolerances (u = 2^-24).
// FP32 plan: both backends compute the same f32 math; only summation orders differ (cuBLASLt with
//   CUBLAS_COMPUTE_32F vs the CPU GEMM, the attention and norm reductions). For sums of K terms the
//   normwise bound used by tests/conformance is tol(K) = 2 K u * 4; the longest reductions here
//   have K = 256 (tokens per batch into a weight gradient, vocab in the cross-entropy), so
//   tol = 8 * 256 * u = 1.2e-4. Gradients: per tensor ||g_cuda - g_cpu||_2 <= 1.2e-4 ||g_cpu||_2.
//   Grad norm: relative 1.2e-4 (|(||a|| - ||b||)| <= ||a - b||). Loss: a mean over 256 tokens of
//   log-sum-exps, which move by at most max |d logit|; the logits are O(1) and their errors
//   behave like sqrt(K) u in practice, so 1e-5 relative (the bound the integration test uses
//   for the same model math across world sizes). TF32 (2^-11 per product) or BF16 (2^-9)
//   inputs slipping into the f32 GEMMs would exceed these.
// FP8 plan: Hopper FP8 GEMMs accumulate with a relative error up to ~2^-11 per output
//   (tests/conformance, Fp8GemmTol). That alone is small, but the next FP8 cast rounds each
//   activation / output gradient to E4M3 (ulp 2^-3 relative) / E5M2 (2^-2): an input that differs
//   by a relative d crosses a rounding boundary with probability ~d/ulp and then differs by a
//   whole ulp, so the RMS difference after a cast is sqrt(d * ulp). With d = 2^-11 amplified 4x
//   over the two layers (2^-9) and the E5M2 ulp this is 2^-5.5 ~ 0.022; with a safety factor of
//   ~3: per tensor ||g_cuda - g_cpu||_2 <= 2^-4 ||g_cpu||_2, grad norm relative 2^-4. Loss:
//   1e-3 relative (logit errors ~2^-5 of logits that are O(0.1) at initialisation move a loss of
//   ~5.5 by < 5e-3 absolute). A wrong scale, transpose or operand shows as O(1) here.
// Weights after step 0 (both plans). AdamW's first step moves each element by
//   -lr*wd*w - lr * g'/(|g'| + eps) (m-hat = g', sqrt(v-hat) = |g'|, g' = clipped gradient), so
//   the update is ±lr whenever |g'| >> eps and its sign is the gradient's. Hence, per element:
//   * where sign(g_cpu) == sign(g_cuda) and min(|g_cpu|, |g_cuda|) > |g_cpu - g_cuda| (the sign
//     does not hinge on the backend difference): |w_cuda - w_cpu| <= lr * (eps |g'_cpu - g'_cuda|
//     / (|g'_cpu| |g'_cuda|) + 64 u) + 8 u (|w0| + lr)  (the derivative of x/(|x|+eps), the
//     conformance AdamW tolerance, one rounding of w);
//   * elsewhere (gradient near zero, where the two backends may legitimately disagree on the
//     sign): |w_cuda - w_cpu| <= 2 lr (1 + 64 u) + 8 u (|w0| + lr).
//   Update sign agreement: >= 99.9% of elements (FP32: flips need |g| below ~1e-4 of the typical
//   gradient), >= 99% (FP8: with an RMS gradient difference of ~2^-5.5 of the RMS gradient, only
//   elements with |g| below that fraction can flip: < 1% for any unimodal gradient distribution).
//
// CudaStep.DeferredOptimizerGivesTheSerialBits: the default plan on CUDA with the optimizer
// deferred onto the side stream against the serial order, bit for bit (below).
//
// Without CUDA in the build, or without a device, every test skips with the reason.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/spec.h"
#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/support/ranks.h"
#include "train/trainer.h"
#if defined(FSDP8_WITH_CUDA)
#include "comm/nccl_communicator.h"
#endif

namespace fsdp8 {
namespace {

using testing::CpuBackend;
using testing::MakeTokenFile;
using testing::RunRanks;

constexpr double kU = 1.0 / (1 << 24);
constexpr int kSteps = 3;

const std::string& TrainFile() {
  static const std::string p = MakeTokenFile("cuda_step_train.bin", 40000, 11);
  return p;
}

v1::JobSpec StepSpec(bool fp32) {
  v1::JobSpec s;
  s.set_name("cuda-step");
  auto* m = s.mutable_model();
  m->set_d_model(64);
  m->set_n_layers(2);
  m->set_n_heads(4);
  m->set_ffn_dim(192);
  m->set_vocab_size(256);
  m->set_seq_len(64);
  s.mutable_data()->set_train_path(TrainFile());
  auto* t = s.mutable_training();
  t->set_steps(kSteps);
  t->set_global_batch(4);
  t->set_microbatch(2);
  t->set_seed(4321);
  t->set_eval_batches(1);
  auto* o = s.mutable_optimizer();
  o->set_warmup_steps(1);
  o->set_peak_lr(3e-3);
  if (fp32) {
    s.mutable_precision()->set_linears(v1::PRECISION_FP32);
    s.mutable_precision()->set_embedding(v1::PRECISION_FP32);
    s.mutable_precision()->set_lm_head(v1::PRECISION_FP32);
  }  // else the default plan: FP8 linears, BF16 embedding and head
  return s;
}

using Tensors = std::map<std::string, std::vector<float>>;

struct RunOut {
  Tensors w0, grad, w1;  // master before, step-0 gradient, master after step 0
  std::vector<StepStats> results;
  double lr0 = 0, eps = 0, grad_clip = 0;  // from the trainer's spec (defaults applied)
};

// Runs the spec for kSteps steps on `be` + `comm` (one rank), gathering what the test compares.
void Drive(const v1::JobSpec& spec_in, Backend* be, Communicator* comm, RunOut* out) {
  v1::JobSpec spec = spec_in;
  spec.set_backend(be->Name());
  auto t = Trainer::Create(WithDefaults(spec, 1), 0, 1, be, comm);
  ASSERT_TRUE(t.ok()) << t.status();
  Trainer& tr = **t;
  auto w0 = tr.params().GatherAll(false);
  ASSERT_TRUE(w0.ok()) << w0.status();
  out->w0 = std::move(*w0);
  ASSERT_TRUE(tr.ForwardBackward(0).ok());
  auto g = tr.params().GatherAll(true);
  ASSERT_TRUE(g.ok()) << g.status();
  out->grad = std::move(*g);
  out->lr0 = tr.LearningRate(0);
  out->eps = tr.spec().optimizer().eps();
  out->grad_clip = tr.spec().optimizer().grad_clip();
  for (int k = 0; k < kSteps; ++k) {
    auto r = tr.Step(k, false, false);
    ASSERT_TRUE(r.ok()) << "step " << k << ": " << r.status();
    out->results.push_back(*r);
    if (k == 0) {
      auto w1 = tr.params().GatherAll(false);
      ASSERT_TRUE(w1.ok()) << w1.status();
      out->w1 = std::move(*w1);
    }
  }
}

RunOut RunCpu(const v1::JobSpec& spec) {
  RunOut out;
  RunRanks(1, [&](int, Communicator* c) {
    auto be = CpuBackend();
    ASSERT_NE(be, nullptr);
    Drive(spec, be.get(), c, &out);
  });
  return out;
}

int CudaDevice() {
  const char* d = std::getenv("FSDP8_CUDA_STEP_DEVICE");
  return d != nullptr ? std::atoi(d) : 0;
}

struct Tol {
  double loss, grad_norm, grad_l2, sign_agree;
};

// The trainer's clipping factor (train/trainer.cc, Step).
double Clip(double grad_clip, double norm) {
  return grad_clip > 0 ? std::min(1.0, grad_clip / (norm + 1e-6)) : 1.0;
}

void Compare(const char* plan, const RunOut& a /*cpu*/,
             const RunOut& b /*cuda*/, const Tol& tol) {
  ASSERT_EQ(a.results.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(b.results.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(a.w0.size(), b.w0.size());
  ASSERT_FALSE(a.w0.empty());

  // Losses and grad norms of every step.
  double max_loss = 0, max_gn = 0;
  for (int k = 0; k < kSteps; ++k) {
    const double la = a.results[k].loss_sum / a.results[k].tokens;
    const double lb = b.results[k].loss_sum / b.results[k].tokens;
    ASSERT_TRUE(std::isfinite(lb)) << "step " << k;
    const double rl = std::abs(lb - la) / std::abs(la);
    const double ga = a.results[k].grad_norm, gb = b.results[k].grad_norm;
    const double rg = std::abs(gb - ga) / ga;
    std::printf("cuda-step %s step %d: loss cpu %.7f cuda %.7f rel %.3g; grad_norm cpu %.7g "
                "cuda %.7g rel %.3g\n", plan, k, la, lb, rl, ga, gb, rg);
    EXPECT_LE(rl, tol.loss) << "loss, step " << k;
    EXPECT_LE(rg, tol.grad_norm) << "grad norm, step " << k;
    max_loss = std::max(max_loss, rl);
    max_gn = std::max(max_gn, rg);
  }
  // The step-0 results and ForwardBackward(0) must describe the same gradient.
  EXPECT_EQ(a.lr0, b.lr0);
  const double lr = a.lr0, eps = a.eps;
  EXPECT_EQ(a.grad_clip, b.grad_clip);
  const double ca = Clip(a.grad_clip, a.results[0].grad_norm);
  const double cb = Clip(b.grad_clip, b.results[0].grad_norm);

  double max_w0 = 0, max_gl2 = 0, max_tight = 0, max_loose = 0;
  std::string worst_g = "-";
  int64_t n = 0, n_tight = 0, agree = 0;
  for (const auto& [name, w0a] : a.w0) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(b.w0.count(name) && a.grad.count(name) && b.grad.count(name) &&
                a.w1.count(name) && b.w1.count(name));
    const auto &w0b = b.w0.at(name), &ga = a.grad.at(name), &gb = b.grad.at(name);
    const auto &w1a = a.w1.at(name), &w1b = b.w1.at(name);
    ASSERT_EQ(w0a.size(), w0b.size());
    ASSERT_EQ(w0a.size(), ga.size());
    ASSERT_EQ(w0a.size(), gb.size());
    ASSERT_EQ(w0a.size(), w1a.size());
    ASSERT_EQ(w0a.size(), w1b.size());
    // Initial weights: the same host-side initialisation.
    double wmax = 0, dw0 = 0;
    for (size_t i = 0; i < w0a.size(); ++i) {
      wmax = std::max(wmax, static_cast<double>(std::abs(w0a[i])));
      dw0 = std::max(dw0, static_cast<double>(std::abs(w0a[i] - w0b[i])));
    }
    EXPECT_LE(dw0, 4 * kU * wmax) << "initial weights differ";
    max_w0 = std::max(max_w0, wmax > 0 ? dw0 / wmax : dw0);
    // Gradients, per tensor, L2-relative.
    double s2 = 0, d2 = 0;
    for (size_t i = 0; i < ga.size(); ++i) {
      ASSERT_TRUE(std::isfinite(gb[i])) << "gradient[" << i << "]";
      s2 += static_cast<double>(ga[i]) * ga[i];
      const double d = static_cast<double>(gb[i]) - ga[i];
      d2 += d * d;
    }
    const double gl2 = s2 > 0 ? std::sqrt(d2 / s2) : std::sqrt(d2);
    EXPECT_LE(gl2, tol.grad_l2) << "gradient ||cuda - cpu|| / ||cpu||";
    if (gl2 > max_gl2) max_gl2 = gl2, worst_g = name;
    // Weights after step 0, element by element.
    int64_t bad = 0;
    for (size_t i = 0; i < w0a.size(); ++i) {
      ++n;
      const double ua = static_cast<double>(w1a[i]) - w0a[i];
      const double ub = static_cast<double>(w1b[i]) - w0a[i];
      if ((ua > 0) == (ub > 0) && (ua < 0) == (ub < 0)) ++agree;
      const double gpa = ga[i] * ca, gpb = gb[i] * cb;
      const double gd = std::abs(static_cast<double>(ga[i]) - gb[i]);
      const bool firm = ((ga[i] > 0 && gb[i] > 0) || (ga[i] < 0 && gb[i] < 0)) &&
                        std::min(std::abs(ga[i]), std::abs(gb[i])) > gd;
      const double round = 8 * kU * (std::abs(w0a[i]) + lr);
      const double diff = std::abs(static_cast<double>(w1b[i]) - w1a[i]);
      double bound;
      if (firm) {
        ++n_tight;
        bound = lr * (eps * std::abs(gpa - gpb) / (std::abs(gpa) * std::abs(gpb)) + 64 * kU) +
                round;
        max_tight = std::max(max_tight, diff / lr);
      } else {
        bound = 2 * lr * (1 + 64 * kU) + round;
        max_loose = std::max(max_loose, diff / lr);
      }
      if (!(diff <= bound) && ++bad <= 5) {
        ADD_FAILURE() << "weight[" << i << "] after step 0: cpu " << w1a[i] << " cuda " << w1b[i]
                      << " (before " << w0a[i] << ", grad cpu " << ga[i] << " cuda " << gb[i]
                      << ") |diff| " << diff << " > bound " << bound;
      }
    }
    if (bad > 5) ADD_FAILURE() << bad << " weights out of bounds after step 0 (5 shown)";
  }
  const double agree_frac = static_cast<double>(agree) / n;
  std::printf("cuda-step %s: %lld weights; initial max rel diff %.3g; gradient max "
              "||d||/||g|| %.3g (%s; tolerance %.3g); weights after step 0: max |d|/lr %.3g on "
              "%lld sign-firm elements, %.3g on the %lld others; update sign agreement %.6f "
              "(min %.4f); max loss rel %.3g (tol %.3g), grad norm rel %.3g (tol %.3g)\n",
              plan, static_cast<long long>(n), max_w0, max_gl2, worst_g.c_str(), tol.grad_l2,
              max_tight, static_cast<long long>(n_tight), max_loose,
              static_cast<long long>(n - n_tight), agree_frac, tol.sign_agree, max_loss, tol.loss,
              max_gn, tol.grad_norm);
  EXPECT_GE(agree_frac, tol.sign_agree) << "update sign agreement";
}

#if defined(FSDP8_WITH_CUDA)
void RunBoth(bool fp32) {
  std::string err;
  std::unique_ptr<Backend> cuda = CreateBackend("cuda", CudaDevice(), &err);
  if (cuda == nullptr) GTEST_SKIP() << "backend 'cuda' unavailable: " << err;
  const v1::JobSpec spec = StepSpec(fp32);
  const auto t0 = std::chrono::steady_clock::now();
  RunOut cpu = RunCpu(spec);
  if (::testing::Test::HasFatalFailure()) return;
  const auto t1 = std::chrono::steady_clock::now();
  RunOut gpu;
  {
    testing::MemKvStore kv;
    auto comm = CreateNcclCommunicator(0, 1, &kv, "cuda_step/", cuda.get(),
                                       std::chrono::seconds(60));
    ASSERT_TRUE(comm.ok()) << comm.status();
    Drive(spec, cuda.get(), comm->get(), &gpu);
    if (::testing::Test::HasFatalFailure()) return;
  }
  const auto t2 = std::chrono::steady_clock::now();
  std::printf("cuda-step %s: cpu %.2f s, cuda %.2f s (device %d)\n", fp32 ? "fp32" : "fp8",
              std::chrono::duration<double>(t1 - t0).count(),
              std::chrono::duration<double>(t2 - t1).count(), CudaDevice());
  const double fp32_tol = 8 * 256 * kU;  // tol(K = 256) of tests/conformance
  const Tol tol = fp32 ? Tol{1e-5, fp32_tol, fp32_tol, 0.999}
                       : Tol{1e-3, std::ldexp(1.0, -4), std::ldexp(1.0, -4), 0.99};
  Compare(fp32 ? "fp32" : "fp8", cpu, gpu, tol);
}
#endif

#if defined(FSDP8_WITH_CUDA)
// The default plan on CUDA with training.overlap_optimizer true (each unit's AdamW and casts on
// the side stream, beside the previous unit's forward) and false (the serial order): 6 steps of
// an 8-step job, so the last ones leave updates pending; an evaluation after step 3 (its forward
// applies them on the side stream). Every loss, grad norm and validation loss, and the final
// master weights, bit for bit.
void DeferredAgainstSerial() {
  std::string err;
  std::unique_ptr<Backend> probe = CreateBackend("cuda", CudaDevice(), &err);
  if (probe == nullptr) GTEST_SKIP() << "backend 'cuda' unavailable: " << err;
  probe.reset();
  struct Out {
    std::vector<StepStats> steps;
    Tensors master;
    bool defers = false;
  };
  auto run = [&](bool overlap, Out* out) {
    std::unique_ptr<Backend> be = CreateBackend("cuda", CudaDevice(), &err);
    ASSERT_NE(be, nullptr) << err;
    testing::MemKvStore kv;
    auto comm = CreateNcclCommunicator(0, 1, &kv, overlap ? "defer_on/" : "defer_off/", be.get(),
                                       std::chrono::seconds(60));
    ASSERT_TRUE(comm.ok()) << comm.status();
    v1::JobSpec spec = StepSpec(/*fp32=*/false);
    spec.set_backend("cuda");
    spec.mutable_data()->set_val_path(TrainFile());
    spec.mutable_training()->set_steps(8);
    spec.mutable_training()->set_overlap_optimizer(overlap);
    spec.mutable_optimizer()->set_grad_clip(0.05);  // every step clips
    auto t = Trainer::Create(WithDefaults(spec, 1), 0, 1, be.get(), comm->get());
    ASSERT_TRUE(t.ok()) << t.status();
    out->defers = (*t)->defers_optimizer();
    for (int k = 0; k < 6; ++k) {
      auto r = (*t)->Step(k, k == 3, false);
      ASSERT_TRUE(r.ok()) << "step " << k << ": " << r.status();
      out->steps.push_back(*r);
    }
    auto m = (*t)->params().GatherAll(false);
    ASSERT_TRUE(m.ok()) << m.status();
    out->master = std::move(*m);
  };
  Out serial, deferred;
  run(false, &serial);
  if (::testing::Test::HasFatalFailure()) return;
  run(true, &deferred);
  if (::testing::Test::HasFatalFailure()) return;
  EXPECT_FALSE(serial.defers);
  EXPECT_TRUE(deferred.defers);
  auto same = [](double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  for (size_t k = 0; k < serial.steps.size(); ++k) {
    const StepStats& a = serial.steps[k];
    const StepStats& b = deferred.steps[k];
    std::printf("cuda-step deferred step %zu: loss %.9g / %.9g, grad norm %.9g / %.9g\n", k,
                a.loss_sum, b.loss_sum, a.grad_norm, b.grad_norm);
    EXPECT_TRUE(same(a.loss_sum, b.loss_sum)) << "step " << k;
    EXPECT_TRUE(same(a.grad_norm, b.grad_norm)) << "step " << k;
    EXPECT_GT(a.grad_norm, 0.05) << "step " << k << " does not clip";
    if (k == 3) {
      EXPECT_TRUE(same(a.val_loss, b.val_loss)) << a.val_loss << " vs " << b.val_loss;
    }
  }
  ASSERT_EQ(serial.master.size(), deferred.master.size());
  for (const auto& [name, w] : serial.master) {
    ASSERT_TRUE(deferred.master.count(name)) << name;
    const std::vector<float>& v = deferred.master.at(name);
    ASSERT_EQ(w.size(), v.size()) << name;
    EXPECT_EQ(std::memcmp(w.data(), v.data(), w.size() * sizeof(float)), 0) << name;
  }
}
#endif

TEST(CudaStep, DeferredOptimizerGivesTheSerialBits) {
#if defined(FSDP8_WITH_CUDA)
  DeferredAgainstSerial();
#else
  GTEST_SKIP() << "built without CUDA (configure with -DFSDP8_CUDA=ON)";
#endif
}

TEST(CudaStep, Fp32PlanMatchesCpu) {
#if defined(FSDP8_WITH_CUDA)
  RunBoth(/*fp32=*/true);
#else
  GTEST_SKIP() << "built without CUDA (configure with -DFSDP8_CUDA=ON)";
#endif
}

TEST(CudaStep, DefaultFp8PlanMatchesCpu) {
#if defined(FSDP8_WITH_CUDA)
  RunBoth(/*fp32=*/false);
#else
  GTEST_SKIP() << "built without CUDA (configure with -DFSDP8_CUDA=ON)";
#endif
}

// The comparison itself, CPU against CPU (runs everywhere): identical runs pass with zero
// differences, and a run whose step-0 update is perturbed fails -- the check can fail.
TEST(CudaStep, ComparisonCatchesAWrongUpdate) {
  const Tol tol{1e-5, 8 * 256 * kU, 8 * 256 * kU, 0.999};
  {
    const RunOut f = RunCpu(StepSpec(/*fp32=*/false));  // the default plan runs this way too
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    Compare("fp8-cpu-vs-cpu", f, f, tol);
  }
  const RunOut a = RunCpu(StepSpec(/*fp32=*/true));
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  Compare("fp32-cpu-vs-cpu", a, a, tol);
  RunOut b = a;
  // A backend whose AdamW moved by 1.5 lr instead of lr: every firm element is off by 0.5 lr.
  for (auto& [name, w1] : b.w1) {
    const auto& w0 = b.w0.at(name);
    for (size_t i = 0; i < w1.size(); ++i) w1[i] = w0[i] + 1.5f * (w1[i] - w0[i]);
  }
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    Compare("cpu-vs-perturbed", a, b, tol);
  }
  EXPECT_GT(failures.size(), 0) << "a 1.5x update was not detected";
  // A gradient off by 10% in one tensor (weights untouched).
  RunOut c = a;
  for (float& g : c.grad.begin()->second) g *= 1.1f;
  ::testing::TestPartResultArray failures2;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures2);
    Compare("cpu-vs-wrong-grad", a, c, tol);
  }
  EXPECT_GT(failures2.size(), 0) << "a 10% gradient error was not detected";
}

}  // namespace
// C09 on NCCL with the deferred header check (the default): two ranks on GPUs 0 and 1 as threads;
// after a correct all-gather (values checked), rank 0 gathers 64 bytes per rank and rank 1 128.
// Neither may hang: both must fail within the timeout with a message naming the size mismatch and
// both sizes.
TEST(NcclCommunicator, C09_MismatchedAllGatherFailsOnEveryRankWithBothSizes) {
#if defined(FSDP8_WITH_CUDA)
  std::string err;
  {
    std::unique_ptr<Backend> probe = CreateBackend("cuda", 1, &err);
    if (probe == nullptr) GTEST_SKIP() << "needs 2 GPUs: " << err;
  }
  testing::MemKvStore kv;
  std::vector<std::string> errors(2);
  std::vector<std::vector<uint8_t>> first(2);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      std::string e;
      std::unique_ptr<Backend> be = CreateBackend("cuda", r, &e);
      ASSERT_NE(be, nullptr) << e;
      auto comm = CreateNcclCommunicator(r, 2, &kv, "c09/", be.get(), std::chrono::seconds(10));
      ASSERT_TRUE(comm.ok()) << comm.status();
      void* send = be->Alloc(128);
      void* recv = be->Alloc(256);
      be->Memset(send, r + 1, 128);
      absl::Status s = (*comm)->AllGather(send, recv, 16);
      ASSERT_TRUE(s.ok()) << s;
      first[r].resize(32);
      be->CopyToHost(first[r].data(), recv, 32);
      s = (*comm)->AllGather(send, recv, r == 0 ? 64 : 128);
      // The mismatch is found by this call (sync mode), the watchdog, or Verify() at the latest
      // (what the trainer calls at the end of every step); later collectives fail too.
      if (s.ok()) s = (*comm)->Verify();
      errors[r] = s.ToString();
      absl::Status after = (*comm)->AllGather(send, recv, 16);
      EXPECT_FALSE(after.ok()) << "rank " << r << ": a collective after a detected mismatch succeeded";
      be->Free(send);
      be->Free(recv);
    });
  }
  for (auto& t : ranks) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("nccl C09: rank 0: %s\nnccl C09: rank 1: %s\n(%.2f s)\n", errors[0].c_str(),
              errors[1].c_str(), secs);
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < 32; ++i) EXPECT_EQ(first[r][i], i < 16 ? 1 : 2) << "rank " << r << " byte " << i;
    EXPECT_NE(errors[r].find("size mismatch"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("64"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("128"), std::string::npos) << errors[r];
  }
  EXPECT_LT(secs, 10.0);
#else
  GTEST_SKIP() << "built without CUDA (configure with -DFSDP8_CUDA=ON)";
#endif
}

}  // namespace fsdp8
