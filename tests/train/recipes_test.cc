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

#include "common/spec.h"
#include "gtest/gtest.h"
#include "tests/support/ranks.h"
#include "tests/train/trainer_test_util.h"

namespace fsdp8 {
namespace {

using testing::MeanLoss;
using testing::Train;
using testing::TrainFile;

constexpr double kFp8Tol = 5e-3;
constexpr int kSteps = 20;

// The default job's model (data/default-job.yaml: d 128, 4 layers, 4 heads, ffn 384, vocab 256,
// seq 256), FP8 linears, two sequences per step.
v1::JobSpec DefaultShape() {
  v1::JobSpec s;
  s.mutable_data()->set_train_path(TrainFile());
  s.mutable_model()->set_d_model(128);
  s.mutable_model()->set_n_layers(4);
  s.mutable_model()->set_n_heads(4);
  s.mutable_model()->set_ffn_dim(384);
  s.mutable_model()->set_vocab_size(256);
  s.mutable_model()->set_seq_len(256);
  s.mutable_training()->set_global_batch(2);
  s.mutable_training()->set_steps(kSteps);
  s.mutable_optimizer()->set_warmup_steps(2);
  s.set_backend("cpu");
  return s;
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

}  // namespace
}  // namespace fsdp8
