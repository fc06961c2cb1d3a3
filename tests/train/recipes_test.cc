// The rowwise and blockwise FP8 recipes (precision.fp8.granularity ROWWISE / BLOCKWISE) in
// training on CPU ranks, against the tensorwise recipe on the same job.
//
// Tolerance. Every recipe's GEMMs read E4M3 / E5M2 codes: each operand element carries a relative
// rounding error of up to 2^-4 (E4M3) whichever way it is scaled, so two recipes differ by
// rounding noise of the same size as FP8 against a reference; the C12 FP8 tolerance (5e-3
// relative per step's loss, as the hybrid and multi-rank FP8 tests use) applies. A recipe whose
// GEMM used a wrong scale (another row's, another tile's, a transposed layout) would be off by
// order 1 after the first update.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <unistd.h>

#include "common/spec.h"
#include "gtest/gtest.h"
#include "train/checkpoint.h"
#include "tests/support/ranks.h"
#include "tests/train/trainer_test_util.h"

namespace fsdp8 {
namespace {

using testing::MeanLoss;
using testing::Train;
using testing::RunRanks;
using testing::TrainFile;

constexpr double kFp8Tol = 5e-3;
constexpr int kSteps = 20;

// The default job's model (data/default-job.yaml: d 128, 4 layers, 4 heads, ffn 384, vocab 256,
// seq 256), FP8 linears, two sequences per step.
v1::JobSpec DefaultShape() {
  return testing::DefaultModelSpec(kSteps);
}

v1::JobSpec WithGranularity(v1::JobSpec s, v1::Fp8Granularity g) {
  s.mutable_precision()->mutable_fp8()->set_granularity(g);
  return s;
}

void ExpectTracksTensorwise(const v1::JobSpec& spec, const std::vector<double>& ref, int world,
                            const std::string& what) {
  SCOPED_TRACE(what + ", world " + std::to_string(world));
  ASSERT_TRUE(ValidateSpec(spec, world, {}, false).ok()) << ValidateSpec(spec, world, {}, false);
  const auto out = Train(spec, world, kSteps);
  std::vector<double> loss;
  for (int k = 0; k < kSteps; ++k) loss.push_back(MeanLoss(out, k));
  for (int k = 0; k < kSteps; ++k) {
    std::printf("%s world %d step %2d loss %.5f tensorwise %.5f rel %.2e\n", what.c_str(), world,
                k, loss[k], ref[k], std::fabs(loss[k] - ref[k]) / ref[k]);
    EXPECT_NEAR(loss[k], ref[k], kFp8Tol * ref[k]) << "step " << k;
  }
  // It trains: the last steps' mean loss well below the first step's (tensorwise falls by ~1.5
  // nats over these 20 steps).
  const double last = (loss[kSteps - 1] + loss[kSteps - 2] + loss[kSteps - 3]) / 3;
  EXPECT_LT(last, loss[0] - 0.5) << "loss did not fall: " << loss[0] << " -> " << last;
}

TEST(Recipes, RowwiseAndBlockwiseTrainWithinFp8ToleranceOfTensorwise) {
  for (int world : {1, 2}) {
    const auto ref_out = Train(DefaultShape(), world, kSteps);
    std::vector<double> ref;
    for (int k = 0; k < kSteps; ++k) ref.push_back(MeanLoss(ref_out, k));
    ExpectTracksTensorwise(WithGranularity(DefaultShape(), v1::FP8_GRANULARITY_ROWWISE), ref,
                           world, "rowwise");
    ExpectTracksTensorwise(WithGranularity(DefaultShape(), v1::FP8_GRANULARITY_BLOCKWISE), ref,
                           world, "blockwise");
  }
}

// One block blockwise by override under the default tensorwise (delayed) recipe: the other
// blocks keep their FP8 wire and delayed scales, the overridden one trains as blockwise.
TEST(Recipes, BlockwiseOverrideOfOneLayerTrains) {
  v1::JobSpec spec = DefaultShape();
  auto* o = spec.mutable_precision()->add_overrides();
  o->set_layer(2);
  o->set_linears(v1::PRECISION_FP8);
  o->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  const auto ref_out = Train(DefaultShape(), 2, kSteps);
  std::vector<double> ref;
  for (int k = 0; k < kSteps; ++k) ref.push_back(MeanLoss(ref_out, k));
  ExpectTracksTensorwise(spec, ref, 2, "layer 2 blockwise");
}

// The mean loss of step `step` over ranks from each rank's StepStats.
double Mean(const std::vector<StepStats>& per_rank) {
  double loss = 0, tokens = 0;
  for (const StepStats& s : per_rank) {
    loss += s.loss_sum;
    tokens += s.tokens;
  }
  return loss / tokens;
}

// Checkpoints stay recipe-independent one way: a checkpoint saved under tensorwise (FP8 blocks in
// fp8 buffers) resumes under blockwise (those blocks' linears in BF16 buffers), at the same and at
// another world size; the first resumed step's loss is within 1e-2 relative of the tensorwise
// run's own at that step (the weights, moments and step counter carried over; only the recipe of
// that one step differs). A load that dropped or misplaced a tensor would start near the untrained
// loss (ln 256 = 5.5) instead.
TEST(Recipes, TensorwiseCheckpointResumesUnderBlockwise) {
  constexpr int kSaveAfter = 6;
  for (auto [saved_world, world] : {std::pair{2, 2}, std::pair{2, 1}}) {
    SCOPED_TRACE("saved by " + std::to_string(saved_world) + " ranks, resumed on " +
                 std::to_string(world));
    const std::string dir = ::testing::TempDir() + "/recipes_ckpt_" +
                            std::to_string(static_cast<long>(::getpid())) + "_" +
                            std::to_string(world);
    const v1::JobSpec tw = DefaultShape();
    std::vector<StepStats> tw_step(saved_world);
    RunRanks(saved_world, [&](int r, Communicator* c) {
      auto be = testing::CpuBackend();
      auto t = Trainer::Create(WithDefaults(tw, saved_world), r, saved_world, be.get(), c);
      ASSERT_TRUE(t.ok()) << t.status();
      for (int k = 0; k < kSaveAfter; ++k) ASSERT_TRUE((*t)->Step(k, false, false).ok());
      v1::CheckpointSaved saved;
      ASSERT_TRUE(SaveShard(**t, kSaveAfter, dir, &saved).ok());
      auto res = (*t)->Step(kSaveAfter, false, false);
      ASSERT_TRUE(res.ok()) << res.status();
      tw_step[r] = *res;
    });
    const v1::JobSpec bw = WithGranularity(DefaultShape(), v1::FP8_GRANULARITY_BLOCKWISE);
    std::vector<StepStats> bw_step(world);
    RunRanks(world, [&](int r, Communicator* c) {
      auto be = testing::CpuBackend();
      auto t = Trainer::Create(WithDefaults(bw, world), r, world, be.get(), c);
      ASSERT_TRUE(t.ok()) << t.status();
      const absl::Status s = LoadShards(t->get(), dir, saved_world, kSaveAfter);
      ASSERT_TRUE(s.ok()) << s;
      auto res = (*t)->Step(kSaveAfter, false, false);
      ASSERT_TRUE(res.ok()) << res.status();
      bw_step[r] = *res;
    });
    const double want = Mean(tw_step), got = Mean(bw_step);
    std::printf("step %d: tensorwise %.5f, blockwise resumed %.5f (rel %.2e)\n", kSaveAfter, want,
                got, std::fabs(got - want) / want);
    EXPECT_NEAR(got, want, 1e-2 * want);
    EXPECT_LT(want, 5.0);  // trained well away from the untrained loss, so the check can fail
  }
}

// Blockwise resharded: saved by 4 ranks after step 2, resumed on 2 and on 3 ranks, its steps 2
// and 3 within the C12 FP8 tolerance of the uninterrupted 4-rank run's (the same weights and
// moments; the ranks' microbatches, and so the sums, differ).
TEST(Recipes, BlockwiseCheckpointReshards4To2And3) {
  constexpr int kSaveAfter = 2, kLast = 4;
  v1::JobSpec bw = WithGranularity(DefaultShape(), v1::FP8_GRANULARITY_BLOCKWISE);
  bw.mutable_training()->set_global_batch(12);  // divides over 4, 2 and 3 ranks
  const std::string dir = ::testing::TempDir() + "/recipes_ckpt_reshard_" +
                          std::to_string(static_cast<long>(::getpid()));
  std::vector<std::vector<StepStats>> ref(kLast, std::vector<StepStats>(4));
  RunRanks(4, [&](int r, Communicator* c) {
    auto be = testing::CpuBackend();
    auto t = Trainer::Create(WithDefaults(bw, 4), r, 4, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    for (int k = 0; k < kLast; ++k) {
      if (k == kSaveAfter) {
        v1::CheckpointSaved saved;
        ASSERT_TRUE(SaveShard(**t, kSaveAfter, dir, &saved).ok());
      }
      auto res = (*t)->Step(k, false, false);
      ASSERT_TRUE(res.ok()) << res.status();
      ref[k][r] = *res;
    }
  });
  for (int world : {2, 3}) {
    std::vector<std::vector<StepStats>> got(kLast, std::vector<StepStats>(world));
    RunRanks(world, [&](int r, Communicator* c) {
      auto be = testing::CpuBackend();
      auto t = Trainer::Create(WithDefaults(bw, world), r, world, be.get(), c);
      ASSERT_TRUE(t.ok()) << t.status();
      const absl::Status s = LoadShards(t->get(), dir, 4, kSaveAfter);
      ASSERT_TRUE(s.ok()) << s;
      for (int k = kSaveAfter; k < kLast; ++k) {
        auto res = (*t)->Step(k, false, false);
        ASSERT_TRUE(res.ok()) << res.status();
        got[k][r] = *res;
      }
    });
    for (int k = kSaveAfter; k < kLast; ++k) {
      const double want = Mean(ref[k]), have = Mean(got[k]);
      std::printf("blockwise 4 -> %d ranks, step %d: %.5f (4 ranks %.5f, rel %.2e)\n", world, k,
                  have, want, std::fabs(have - want) / want);
      EXPECT_NEAR(have, want, kFp8Tol * want) << "world " << world << " step " << k;
    }
  }
}

// The other way is refused: a blockwise checkpoint's layout is not a tensorwise job's.
TEST(Recipes, BlockwiseCheckpointDoesNotLoadIntoTensorwise) {
  const std::string dir = ::testing::TempDir() + "/recipes_ckpt_bw_" +
                          std::to_string(static_cast<long>(::getpid()));
  const v1::JobSpec bw = WithGranularity(DefaultShape(), v1::FP8_GRANULARITY_BLOCKWISE);
  RunRanks(1, [&](int r, Communicator* c) {
    auto be = testing::CpuBackend();
    auto t = Trainer::Create(WithDefaults(bw, 1), r, 1, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE((*t)->Step(0, false, false).ok());
    v1::CheckpointSaved saved;
    ASSERT_TRUE(SaveShard(**t, 1, dir, &saved).ok());
  });
  RunRanks(1, [&](int r, Communicator* c) {
    auto be = testing::CpuBackend();
    auto t = Trainer::Create(WithDefaults(DefaultShape(), 1), r, 1, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    const absl::Status s = LoadShards(t->get(), dir, 1, 1);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(std::string(s.message()).find("saved for a different model or precision plan"),
              std::string::npos)
        << s;
  });
}

}  // namespace
}  // namespace fsdp8
