// The optimizer deferred into the next step's forward (training.overlap_optimizer, FsdpParams::
// DeferAdamW): each unit's AdamW update and wire-shard cast run before the unit's next
// all-gather instead of at the step's end. The serial order (overlap_optimizer false, the order
// before the deferral existed) is the reference: with clipping active (grad_clip low enough that
// every step clips), FP8 delayed scaling and several microbatches per step, on 1 and 2 ranks and
// on hybrid meshes, the losses, gradient norms, validation losses, scaling state, final master
// weights and checkpoint files must be bit-identical, and a checkpoint saved with the deferral
// must resume to the serial run's next losses.
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/spec.h"
#include "gtest/gtest.h"
#include "tests/support/ranks.h"
#include "tests/train/trainer_test_util.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace fsdp8 {
namespace {

using testing::CpuBackend;
using testing::RunRanks;
using testing::TrainFile;
using testing::ValFile;
namespace fs = std::filesystem;

using Weights = std::map<std::string, std::vector<float>>;

constexpr double kClip = 0.05;  // below every step's gradient norm here: every step clips

// TinySpec with a validation file, 10 steps, 6 sequences a step in microbatches of 1 (6 per step
// on one rank, 3 on two), FP8 linears with delayed scaling (the default plan), grad_clip kClip.
v1::JobSpec Spec(bool overlap) {
  v1::JobSpec s = testing::TinySpec(TrainFile(), ValFile());
  s.mutable_training()->set_steps(10);
  s.mutable_training()->set_overlap_optimizer(overlap);
  s.mutable_optimizer()->set_grad_clip(kClip);
  return s;
}

struct RankRun {
  std::vector<StepStats> steps;
  Weights master;  // GatherAll at the end
  v1::ScalingState scaling;  // ScalingReport at the end
  bool defers = false;       // Trainer::defers_optimizer()
  std::vector<bool> pending_after;  // per step: FsdpParams::UpdatePending() after it
};

// Steps [first, last) of `spec` on an R x S mesh (ranks as threads; R = 1: a flat job),
// evaluating after the steps in `eval`; `load` (optional) a checkpoint directory of the state
// after `first` steps (saved by W ranks), `save` (optional) one to save the state after `last`.
std::vector<RankRun> TrainRun(const v1::JobSpec& spec, int R, int S, int64_t first, int64_t last,
                         const std::set<int64_t>& eval = {}, const std::string& load = "",
                         const std::string& save = "") {
  const int W = R * S;
  v1::JobSpec s = spec;
  if (R > 1) {  // 12 sequences: 3 or 6 microbatches a rank
    s.mutable_sharding()->set_max_workers(W);
    s.mutable_sharding()->set_replicas(R);
    s.mutable_training()->set_global_batch(12);
  }
  std::vector<RankRun> out(W);
  testing::RunMeshRanks(R, S, [&](int r, Communicator* world, const MeshComms& comms) {
    auto be = CpuBackend();
    auto t = Trainer::Create(WithDefaults(s, W), r, W, be.get(), world, comms);
    ASSERT_TRUE(t.ok()) << t.status();
    if (!load.empty()) {
      absl::Status st = LoadShards(t->get(), load, W, first);
      ASSERT_TRUE(st.ok()) << st;
    }
    out[r].defers = (*t)->defers_optimizer();
    for (int64_t k = first; k < last; ++k) {
      // No scaling report: it would apply the deferred updates at the step's end.
      auto res = (*t)->Step(k, eval.count(k) > 0, false);
      ASSERT_TRUE(res.ok()) << res.status();
      out[r].steps.push_back(*res);
      out[r].pending_after.push_back((*t)->params().UpdatePending());
    }
    if (!save.empty()) {
      v1::CheckpointSaved saved;
      absl::Status st = SaveShard(**t, last, save, &saved);
      ASSERT_TRUE(st.ok()) << st;
    }
    auto scaling = (*t)->ScalingReport();
    ASSERT_TRUE(scaling.ok()) << scaling.status();
    out[r].scaling = *scaling;
    auto m = (*t)->params().GatherAll(false);
    ASSERT_TRUE(m.ok()) << m.status();
    out[r].master = *m;
  });
  return out;
}

bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void ExpectSameBits(const std::vector<RankRun>& serial, const std::vector<RankRun>& deferred,
                    const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(serial.size(), deferred.size());
  for (size_t r = 0; r < serial.size(); ++r) {
    const RankRun& a = serial[r];
    const RankRun& b = deferred[r];
    ASSERT_EQ(a.steps.size(), b.steps.size()) << "rank " << r;
    for (size_t i = 0; i < a.steps.size(); ++i) {
      const StepStats& x = a.steps[i];
      const StepStats& y = b.steps[i];
      SCOPED_TRACE(::testing::Message() << "rank " << r << " step " << x.step);
      EXPECT_FALSE(x.skipped);
      EXPECT_FALSE(y.skipped);
      EXPECT_TRUE(SameBits(x.loss_sum, y.loss_sum)) << x.loss_sum << " vs " << y.loss_sum;
      EXPECT_TRUE(SameBits(x.grad_norm, y.grad_norm)) << x.grad_norm << " vs " << y.grad_norm;
      EXPECT_GT(x.grad_norm, kClip) << "the step does not clip";
      if (std::isnan(x.val_loss)) {
        EXPECT_TRUE(std::isnan(y.val_loss));
      } else {
        EXPECT_TRUE(SameBits(x.val_loss, y.val_loss)) << x.val_loss << " vs " << y.val_loss;
      }
    }
    EXPECT_EQ(a.scaling.SerializeAsString(), b.scaling.SerializeAsString()) << "rank " << r;
    ASSERT_EQ(a.master.size(), b.master.size());
    for (const auto& [name, v] : a.master) {
      ASSERT_TRUE(b.master.count(name)) << name;
      const std::vector<float>& w = b.master.at(name);
      ASSERT_EQ(v.size(), w.size()) << name;
      EXPECT_EQ(std::memcmp(v.data(), w.data(), v.size() * sizeof(float)), 0)
          << "rank " << r << " master " << name;
    }
  }
}

// The deferral really happened: after each step updates were pending (the units beyond the
// first two), except after the job's last step and after a step that evaluated (the
// evaluation's forward gathered, hence updated, every unit); the serial order never leaves one
// pending.
void ExpectDeferred(const std::vector<RankRun>& serial, const std::vector<RankRun>& deferred,
                    int64_t last_step_of_job) {
  for (size_t r = 0; r < deferred.size(); ++r) {
    EXPECT_FALSE(serial[r].defers);
    EXPECT_TRUE(deferred[r].defers);
    for (size_t i = 0; i < deferred[r].steps.size(); ++i) {
      const StepStats& st = deferred[r].steps[i];
      const bool settled = st.step == last_step_of_job || !std::isnan(st.val_loss);
      EXPECT_EQ(deferred[r].pending_after[i], !settled) << "rank " << r << " step " << st.step;
      EXPECT_FALSE(serial[r].pending_after[i]);
    }
  }
}

TEST(DeferredOptimizer, OverlapOptimizerDefaultsToTrue) {
  v1::JobSpec s = testing::TinySpec(TrainFile());
  EXPECT_TRUE(WithDefaults(s, 1).training().overlap_optimizer());
  s.mutable_training()->set_overlap_optimizer(false);
  EXPECT_FALSE(WithDefaults(s, 1).training().overlap_optimizer());
}

// 10 steps (the job's whole length, so the last applies its updates at once), evaluations after
// steps 2 and 6 (their forwards apply the pending updates unit by unit), on 1 rank (6
// microbatches a step) and 2 ranks (3).
TEST(DeferredOptimizer, SameBitsAsTheSerialOrderOnOneAndTwoRanks) {
  for (int world : {1, 2}) {
    const auto serial = TrainRun(Spec(false), 1, world, 0, 10, {2, 6});
    const auto deferred = TrainRun(Spec(true), 1, world, 0, 10, {2, 6});
    ExpectSameBits(serial, deferred, "world " + std::to_string(world));
    ExpectDeferred(serial, deferred, 9);
    EXPECT_FALSE(std::isnan(deferred[0].steps[2].val_loss));
  }
}

// BF16 AdamW moments and FP8 codes cast per gather (no kept codes: each prefetch casts from the
// master weights with the scales its unit's deferred update computed); BF16 linears (bf16 wire
// shards packed by the update); one rank, 8 steps of a 10-step job.
TEST(DeferredOptimizer, SameBitsWithBf16MomentsCodesPerGatherAndBf16Linears) {
  auto variant = [](bool overlap, bool bf16_linears) {
    v1::JobSpec s = Spec(overlap);
    if (bf16_linears) {
      testing::AllPrecision(&s, v1::PRECISION_BF16);
    } else {
      s.mutable_optimizer()->set_state_precision(v1::PRECISION_BF16);
      s.mutable_precision()->mutable_fp8()->set_keep_weight_codes(false);
    }
    return s;
  };
  for (bool bf16_linears : {false, true}) {
    const auto serial = TrainRun(variant(false, bf16_linears), 1, 2, 0, 8, {4});
    const auto deferred = TrainRun(variant(true, bf16_linears), 1, 2, 0, 8, {4});
    ExpectSameBits(serial, deferred, bf16_linears ? "bf16 linears" : "bf16 moments, no codes");
    ExpectDeferred(serial, deferred, 9);
  }
}

// Hybrid meshes under SHARD_GROUP (2 x 1: no reduce-scatter; 2 x 2) defer and give the serial
// bits; WORLD with R > 1 runs the serial order whatever the field says (its wire shards are
// rebuilt over the replicas), with the same bits.
TEST(DeferredOptimizer, HybridMeshes) {
  for (int S : {1, 2}) {
    const auto serial = TrainRun(Spec(false), 2, S, 0, 8, {5});
    const auto deferred = TrainRun(Spec(true), 2, S, 0, 8, {5});
    ExpectSameBits(serial, deferred, "2 x " + std::to_string(S) + " SHARD_GROUP");
    ExpectDeferred(serial, deferred, 9);
  }
  v1::JobSpec world_sharded = Spec(true);
  world_sharded.mutable_sharding()->set_optimizer_sharding(v1::OPTIMIZER_SHARDING_WORLD);
  const auto on = TrainRun(world_sharded, 2, 2, 0, 8);
  world_sharded.mutable_training()->set_overlap_optimizer(false);
  const auto off = TrainRun(world_sharded, 2, 2, 0, 8);
  ExpectSameBits(off, on, "2 x 2 WORLD");
  for (const RankRun& r : on) EXPECT_FALSE(r.defers);
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::string FreshDir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/defer_opt_" + name;
  fs::remove_all(d);
  return d + "/step";
}

// A checkpoint saved after 4 steps with the deferral (updates pending when the save starts) is
// byte-identical, file by file, to the serial order's; resumed with the deferral on, steps 4..7
// give the uninterrupted serial run's losses, gradient norms and final weights. Two ranks.
TEST(DeferredOptimizer, CheckpointIsByteIdenticalAndResumesTheSameBits) {
  const std::string dir_serial = FreshDir("serial"), dir_deferred = FreshDir("deferred");
  const auto full = TrainRun(Spec(false), 1, 2, 0, 8);
  const auto saved_serial = TrainRun(Spec(false), 1, 2, 0, 4, {}, "", dir_serial);
  const auto saved_deferred = TrainRun(Spec(true), 1, 2, 0, 4, {}, "", dir_deferred);
  for (const RankRun& r : saved_deferred) EXPECT_TRUE(r.pending_after.back());
  for (int r = 0; r < 2; ++r) {
    const std::string a = ReadAll(dir_serial + "/" + CheckpointFileName(r));
    const std::string b = ReadAll(dir_deferred + "/" + CheckpointFileName(r));
    ASSERT_GT(a.size(), 0u) << CheckpointFileName(r);
    EXPECT_TRUE(a == b) << CheckpointFileName(r) << ": " << a.size() << " vs " << b.size()
                        << " bytes";
  }
  const auto resumed = TrainRun(Spec(true), 1, 2, 4, 8, {}, dir_deferred);
  std::vector<RankRun> tail = full;
  for (RankRun& r : tail) r.steps.erase(r.steps.begin(), r.steps.begin() + 4);
  ExpectSameBits(tail, resumed, "resumed at step 4");
}

// A world communicator whose all-reduces fail once `fail` is set; everything else passes through.
class FailingAllReduce : public Communicator {
 public:
  explicit FailingAllReduce(Communicator* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  absl::Status AllGather(const void* send, void* recv, int64_t bytes_per_rank) override {
    return inner_->AllGather(send, recv, bytes_per_rank);
  }
  absl::Status ReduceScatterSum(const float* send, float* recv, int64_t count) override {
    return inner_->ReduceScatterSum(send, recv, count);
  }
  absl::Status AllReduce(float* buf, int64_t count, ReduceOp op) override {
    if (fail) return absl::UnavailableError("injected all-reduce failure");
    return inner_->AllReduce(buf, count, op);
  }
  absl::Status Broadcast(void* buf, int64_t bytes, int root) override {
    return inner_->Broadcast(buf, bytes, root);
  }
  absl::Status Barrier() override { return inner_->Barrier(); }
  void Abort(const std::string& reason) override { inner_->Abort(reason); }
  bool fail = false;

 private:
  Communicator* inner_;
};

// The pending updates' failure (their amax all-reduce) is ScalingReport's error, not dropped.
TEST(DeferredOptimizer, ScalingReportReturnsThePendingUpdatesFailure) {
  RunRanks(1, [&](int r, Communicator* c) {
    FailingAllReduce world(c);
    auto be = CpuBackend();
    auto t = Trainer::Create(WithDefaults(Spec(true), 1), r, 1, be.get(), &world);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE((*t)->defers_optimizer());
    auto res = (*t)->Step(0, false, false);
    ASSERT_TRUE(res.ok()) << res.status();
    ASSERT_TRUE((*t)->params().UpdatePending());
    world.fail = true;
    auto report = (*t)->ScalingReport();
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status().code(), absl::StatusCode::kUnavailable) << report.status();
    EXPECT_NE(report.status().message().find("injected all-reduce failure"), std::string::npos)
        << report.status();
  });
}

// Gradients asked for while a deferred update is pending: FAILED_PRECONDITION (the update frees
// the grad shards it reads), not zeros; the master weights are still gathered (the update
// applied), and after a ForwardBackward the gradients are there, nonzero.
TEST(DeferredOptimizer, GatherGradsWhileAnUpdateIsPendingIsAnError) {
  RunRanks(1, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto t = Trainer::Create(WithDefaults(Spec(true), 1), r, 1, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE((*t)->Step(0, false, false).ok());
    ASSERT_TRUE((*t)->params().UpdatePending());
    auto g = (*t)->params().GatherAll(true);
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition) << g.status();
    EXPECT_NE(g.status().message().find("training.overlap_optimizer"), std::string::npos)
        << g.status();
    auto m = (*t)->params().GatherAll(false);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_FALSE((*t)->params().UpdatePending());
    ASSERT_TRUE((*t)->ForwardBackward(1).ok());
    auto g2 = (*t)->params().GatherAll(true);
    ASSERT_TRUE(g2.ok()) << g2.status();
    double sq = 0;
    for (const auto& [name, v] : *g2) {
      for (float x : v) sq += static_cast<double>(x) * x;
    }
    EXPECT_GT(sq, 0.0);
  });
}

}  // namespace
}  // namespace fsdp8
