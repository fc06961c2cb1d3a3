// Job spec defaults, validation rules (code and message per rule) and YAML/JSON parsing.
#include "common/spec.h"

#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <thread>

#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "common/memory_plan.h"
#include "common/token_shard.h"

namespace fsdp8 {
namespace {

v1::JobSpec Valid() {
  v1::JobSpec s;
  s.mutable_data()->set_train_path("/data/train.bin");
  return WithDefaults(s, 2);
}

TEST(Spec, Defaults) {
  v1::JobSpec s;
  const v1::JobSpec d = WithDefaults(s, 2);
  EXPECT_EQ(d.model().d_model(), 128);
  EXPECT_EQ(d.model().n_layers(), 4);
  EXPECT_EQ(d.model().n_heads(), 4);
  EXPECT_EQ(d.model().n_kv_heads(), 4);
  EXPECT_EQ(d.model().ffn_dim(), 384);
  EXPECT_EQ(d.model().vocab_size(), 256);
  EXPECT_EQ(d.model().seq_len(), 256);
  EXPECT_EQ(d.model().rope_theta(), 10000.0);
  EXPECT_EQ(d.model().norm_eps(), 1e-5);
  EXPECT_EQ(d.optimizer().peak_lr(), 3e-3);
  EXPECT_EQ(d.optimizer().min_lr_ratio(), 0.1);
  EXPECT_EQ(d.optimizer().warmup_steps(), 30);  // 5% of 600
  EXPECT_EQ(d.optimizer().beta1(), 0.9);
  EXPECT_EQ(d.optimizer().beta2(), 0.95);
  EXPECT_EQ(d.optimizer().eps(), 1e-8);
  EXPECT_EQ(d.optimizer().weight_decay(), 0.1);
  EXPECT_EQ(d.optimizer().grad_clip(), 1.0);
  EXPECT_EQ(d.optimizer().state_precision(), v1::PRECISION_FP32);
  EXPECT_EQ(d.training().saved_norm_inputs(), v1::PRECISION_FP32);
  EXPECT_EQ(d.training().max_nonfinite_steps(), 0);  // the first non-finite step fails the job
  EXPECT_TRUE(d.training().has_max_nonfinite_steps());
  EXPECT_EQ(d.training().steps(), 600);
  EXPECT_EQ(d.training().global_batch(), 16);
  EXPECT_EQ(d.training().microbatch(), 8);  // 16 / 2
  EXPECT_EQ(d.training().seed(), 1234u);
  EXPECT_EQ(d.training().eval_every(), 100);
  EXPECT_EQ(d.training().eval_batches(), 4);
  EXPECT_TRUE(d.training().deterministic());
  EXPECT_FALSE(d.tuning().gemm_autotune());
  EXPECT_EQ(d.sharding().min_workers(), 1);
  EXPECT_EQ(d.sharding().max_workers(), 1);
  EXPECT_EQ(d.sharding().alignment(), 16);
  EXPECT_EQ(d.precision().linears(), v1::PRECISION_FP8);
  EXPECT_EQ(d.precision().embedding(), v1::PRECISION_BF16);
  EXPECT_EQ(d.precision().lm_head(), v1::PRECISION_BF16);
  EXPECT_EQ(d.precision().fp8().recipe(), v1::SCALING_RECIPE_DELAYED);
  EXPECT_EQ(d.precision().fp8().format(), v1::FP8_FORMAT_HYBRID);
  EXPECT_EQ(d.precision().fp8().amax_history_len(), 16);
  EXPECT_EQ(d.precision().fp8().amax_algorithm(), v1::AMAX_ALGORITHM_MAX);
  EXPECT_EQ(d.precision().fp8().margin(), 0);
  EXPECT_TRUE(d.precision().fp8().fused_projections());
  EXPECT_EQ(d.backend(), "cpu");
  // world_size 0: microbatch left unset.
  EXPECT_FALSE(WithDefaults(s, 0).training().has_microbatch());
}

TEST(Spec, DefaultsKeepExplicitValues) {
  v1::JobSpec s;
  s.mutable_model()->set_d_model(0);  // explicit 0 stays 0 (and is refused by ValidateSpec)
  s.mutable_model()->set_n_heads(8);
  s.mutable_training()->set_steps(10);
  s.mutable_training()->set_global_batch(12);
  s.mutable_sharding()->set_min_workers(3);
  const v1::JobSpec d = WithDefaults(s, 3);
  EXPECT_TRUE(d.model().has_d_model());
  EXPECT_EQ(d.model().d_model(), 0);
  EXPECT_EQ(d.model().n_kv_heads(), 8);        // follows n_heads
  EXPECT_EQ(d.optimizer().warmup_steps(), 1);  // round(0.5) = 1
  EXPECT_EQ(d.training().microbatch(), 4);     // 12 / 3
  EXPECT_EQ(d.sharding().max_workers(), 3);    // follows min_workers
  EXPECT_EQ(WithDefaults(d, 3).SerializeAsString(), d.SerializeAsString());  // idempotent
}

TEST(Spec, DefaultSpecIsValid) {
  EXPECT_TRUE(ValidateSpec(Valid(), 2, {}, false).ok()) << ValidateSpec(Valid(), 2, {}, false);
  EXPECT_TRUE(ValidateSpec(Valid(), 0, {}, false).ok());
  v1::JobSpec s;
  s.mutable_data()->set_train_path("/data/train.bin");
  for (int w : {1, 2, 4, 8, 16}) EXPECT_TRUE(ValidateSpec(s, w, {}, false).ok()) << w;
}

TEST(Spec, DerivedBatchSizes) {
  v1::JobSpec s = Valid();
  s.mutable_training()->set_microbatch(2);
  EXPECT_EQ(LocalBatch(s, 2), 8);
  EXPECT_EQ(Microbatches(s, 2), 4);
  EXPECT_EQ(LocalBatch(s, 4), 4);
  EXPECT_EQ(Microbatches(s, 4), 2);
  v1::JobSpec d;  // microbatch defaulted: one microbatch per step
  EXPECT_EQ(Microbatches(d, 2), 1);
}

TEST(Spec, LayerLinearPrecision) {
  v1::JobSpec s = Valid();
  auto* o = s.mutable_precision()->add_overrides();
  o->set_layer(2);
  o->set_linears(v1::PRECISION_BF16);
  EXPECT_EQ(LayerLinearPrecision(s, 0), v1::PRECISION_FP8);
  EXPECT_EQ(LayerLinearPrecision(s, 2), v1::PRECISION_BF16);
  s.mutable_precision()->set_linears(v1::PRECISION_FP32);
  EXPECT_EQ(LayerLinearPrecision(s, 1), v1::PRECISION_FP32);
  EXPECT_EQ(LayerLinearPrecision(v1::JobSpec(), 0), v1::PRECISION_FP8);
}

// ---- one case per rule ------------------------------------------------------------------------

struct RuleCase {
  std::string name;
  std::function<void(v1::JobSpec*)> mutate;
  int world_size;
  std::vector<std::string> want;  // substrings of the message: field path first, then rule words
};

class ValidateRule : public ::testing::TestWithParam<RuleCase> {};

TEST_P(ValidateRule, RefusedWithFieldAndRule) {
  const RuleCase& c = GetParam();
  v1::JobSpec s = Valid();
  c.mutate(&s);
  const absl::Status st = ValidateSpec(s, c.world_size, {}, false);
  ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  const std::string msg(st.message());
  EXPECT_EQ(msg.rfind(c.want[0] + ":", 0), 0u) << msg;  // starts with "<field.path>:"
  for (const std::string& w : c.want) EXPECT_NE(msg.find(w), std::string::npos) << msg << " / " << w;
}

const double kInf = std::numeric_limits<double>::infinity();
const double kNaN = std::numeric_limits<double>::quiet_NaN();

std::vector<RuleCase> Rules() {
  std::vector<RuleCase> r;
  auto add = [&](std::string name, std::function<void(v1::JobSpec*)> f, int w,
                 std::vector<std::string> want) { r.push_back({name, f, w, want}); };
  add("DModelZero", [](v1::JobSpec* s) { s->mutable_model()->set_d_model(0); }, 2,
      {"model.d_model", "must be > 0", "got 0"});
  add("NLayersNegative", [](v1::JobSpec* s) { s->mutable_model()->set_n_layers(-1); }, 2,
      {"model.n_layers", "must be > 0"});
  add("NHeadsZero", [](v1::JobSpec* s) { s->mutable_model()->set_n_heads(0); }, 2,
      {"model.n_heads", "must be > 0"});
  add("NKvHeadsZero", [](v1::JobSpec* s) { s->mutable_model()->set_n_kv_heads(0); }, 2,
      {"model.n_kv_heads", "must be > 0"});
  add("FfnDimZero", [](v1::JobSpec* s) { s->mutable_model()->set_ffn_dim(0); }, 2,
      {"model.ffn_dim", "must be > 0"});
  add("VocabZero", [](v1::JobSpec* s) { s->mutable_model()->set_vocab_size(0); }, 2,
      {"model.vocab_size", "must be > 0"});
  add("SeqLenZero", [](v1::JobSpec* s) { s->mutable_model()->set_seq_len(0); }, 2,
      {"model.seq_len", "must be > 0"});
  add("DModelNotDivisibleByHeads", [](v1::JobSpec* s) { s->mutable_model()->set_d_model(130); }, 2,
      {"model.d_model", "model.d_model: must be divisible by model.n_heads (130 % 4 != 0)"});
  add("HeadDimOdd", [](v1::JobSpec* s) { s->mutable_model()->set_d_model(12); }, 2,
      {"model.d_model", "must be even", "RoPE", "12 / 4 = 3"});
  add("HeadsNotDivisibleByKvHeads",
      [](v1::JobSpec* s) { s->mutable_model()->set_n_kv_heads(3); }, 2,
      {"model.n_heads", "divisible by model.n_kv_heads", "4 % 3 != 0"});
  add("VocabTooLarge", [](v1::JobSpec* s) { s->mutable_model()->set_vocab_size(1048577); }, 2,
      {"model.vocab_size", "<= 1048576", "got 1048577"});
  add("SamplingUnknown",
      [](v1::JobSpec* s) { s->mutable_data()->set_sampling(static_cast<v1::Sampling>(7)); }, 2,
      {"data.sampling", "must be EPOCH or RANDOM", "got 7"});
  add("RopeThetaZero", [](v1::JobSpec* s) { s->mutable_model()->set_rope_theta(0); }, 2,
      {"model.rope_theta", "must be > 0"});
  add("NormEpsNegative", [](v1::JobSpec* s) { s->mutable_model()->set_norm_eps(-1); }, 2,
      {"model.norm_eps", "must be > 0"});
  add("StepsZero", [](v1::JobSpec* s) { s->mutable_training()->set_steps(0); }, 2,
      {"training.steps", "must be > 0"});
  add("GlobalBatchZero", [](v1::JobSpec* s) { s->mutable_training()->set_global_batch(0); }, 2,
      {"training.global_batch", "must be > 0"});
  add("MicrobatchZero", [](v1::JobSpec* s) { s->mutable_training()->set_microbatch(0); }, 2,
      {"training.microbatch", "must be > 0"});
  add("EvalEveryNegative", [](v1::JobSpec* s) { s->mutable_training()->set_eval_every(-1); }, 2,
      {"training.eval_every", "must be >= 0"});
  add("EvalBatchesZero", [](v1::JobSpec* s) { s->mutable_training()->set_eval_batches(0); }, 2,
      {"training.eval_batches", "must be > 0"});
  add("GlobalBatchNotDivisible",
      [](v1::JobSpec* s) { s->mutable_training()->set_microbatch(4); }, 3,
      {"training.global_batch", "divisible by world_size * training.microbatch",
       "16 % (3 * 4) != 0"});
  add("GlobalBatchSmallerThanWorld", [](v1::JobSpec* s) { s->mutable_training()->clear_microbatch(); },
      32, {"training.global_batch", "divisible by world_size", "16 % (32 * 1) != 0"});
  add("PeakLrZero", [](v1::JobSpec* s) { s->mutable_optimizer()->set_peak_lr(0); }, 2,
      {"optimizer.peak_lr", "must be > 0 and finite"});
  add("PeakLrInf", [](v1::JobSpec* s) { s->mutable_optimizer()->set_peak_lr(kInf); }, 2,
      {"optimizer.peak_lr", "finite"});
  add("PeakLrNaN", [](v1::JobSpec* s) { s->mutable_optimizer()->set_peak_lr(kNaN); }, 2,
      {"optimizer.peak_lr", "finite"});
  add("MinLrRatioAboveOne", [](v1::JobSpec* s) { s->mutable_optimizer()->set_min_lr_ratio(1.5); }, 2,
      {"optimizer.min_lr_ratio", "in [0, 1]"});
  add("WarmupBeyondSteps", [](v1::JobSpec* s) { s->mutable_optimizer()->set_warmup_steps(601); }, 2,
      {"optimizer.warmup_steps", "in [0, training.steps]"});
  add("MaxNonfiniteStepsNegative",
      [](v1::JobSpec* s) { s->mutable_training()->set_max_nonfinite_steps(-1); }, 2,
      {"training.max_nonfinite_steps", "must be in [0, training.steps]", "got -1, steps 600"});
  add("MaxNonfiniteStepsBeyondSteps",
      [](v1::JobSpec* s) { s->mutable_training()->set_max_nonfinite_steps(601); }, 2,
      {"training.max_nonfinite_steps", "must be in [0, training.steps]", "got 601, steps 600"});
  add("WarmupNegative", [](v1::JobSpec* s) { s->mutable_optimizer()->set_warmup_steps(-1); }, 2,
      {"optimizer.warmup_steps", "in [0, training.steps]"});
  add("Beta1One", [](v1::JobSpec* s) { s->mutable_optimizer()->set_beta1(1.0); }, 2,
      {"optimizer.beta1", "in [0, 1)"});
  add("Beta2Negative", [](v1::JobSpec* s) { s->mutable_optimizer()->set_beta2(-0.1); }, 2,
      {"optimizer.beta2", "in [0, 1)"});
  add("EpsZero", [](v1::JobSpec* s) { s->mutable_optimizer()->set_eps(0); }, 2,
      {"optimizer.eps", "must be > 0"});
  add("WeightDecayNegative", [](v1::JobSpec* s) { s->mutable_optimizer()->set_weight_decay(-0.1); },
      2, {"optimizer.weight_decay", "must be >= 0"});
  add("GradClipNegative", [](v1::JobSpec* s) { s->mutable_optimizer()->set_grad_clip(-1); }, 2,
      {"optimizer.grad_clip", "must be >= 0"});
  add("StatePrecisionFp8",
      [](v1::JobSpec* s) { s->mutable_optimizer()->set_state_precision(v1::PRECISION_FP8); }, 2,
      {"optimizer.state_precision", "must be FP32 or BF16", "FP8"});
  add("SavedNormInputsFp8",
      [](v1::JobSpec* s) { s->mutable_training()->set_saved_norm_inputs(v1::PRECISION_FP8); }, 2,
      {"training.saved_norm_inputs", "must be FP32 or BF16", "FP8"});
  // bf16 keeps 8 significant bits: at beta2 0.999 the decay 0.001 v is below half a step of v.
  add("Beta2TooCloseToOneForBf16Moments", [](v1::JobSpec* s) {
        s->mutable_optimizer()->set_state_precision(v1::PRECISION_BF16);
        s->mutable_optimizer()->set_beta2(0.999);
      }, 2, {"optimizer.beta2", "<= 0.99 with optimizer.state_precision BF16", "0.999"});
  add("MinWorkersZero", [](v1::JobSpec* s) { s->mutable_sharding()->set_min_workers(0); }, 2,
      {"sharding.min_workers", "must be >= 1"});
  add("MaxBelowMin", [](v1::JobSpec* s) {
        s->mutable_sharding()->set_min_workers(3);
        s->mutable_sharding()->set_max_workers(2);
      }, 2, {"sharding.max_workers", "must be >= sharding.min_workers", "2 < 3"});
  add("AlignmentZero", [](v1::JobSpec* s) { s->mutable_sharding()->set_alignment(0); }, 2,
      {"sharding.alignment", "must be >= 1"});
  add("ReplicasNegative", [](v1::JobSpec* s) { s->mutable_sharding()->set_replicas(-1); }, 2,
      {"sharding.replicas", "must be >= 1, or 0 (auto)", "got -1"});
  add("ReplicasAboveMaxWorkers", [](v1::JobSpec* s) {
        s->mutable_sharding()->set_max_workers(2);
        s->mutable_sharding()->set_replicas(3);
      }, 2, {"sharding.replicas", "must be <= sharding.max_workers", "3 > 2"});
  add("ReplicasNotDividingTheWorld", [](v1::JobSpec* s) {
        s->mutable_sharding()->set_max_workers(4);
        s->mutable_sharding()->set_replicas(2);
        s->mutable_training()->set_global_batch(6);
        s->mutable_training()->set_microbatch(1);
      }, 3, {"sharding.replicas", "must divide the world size", "3 % 2 != 0"});
  // 3 replicas of 2 ranks, 12 sequences in microbatches of 2: valid as such (12 % (6 x 2) == 0),
  // but 2 surviving replicas could not take a lost one's microbatches: 12 % (2 x 2 x 2) != 0.
  add("ElasticBatchNotSplittingOverTheSurvivors", [](v1::JobSpec* s) {
        s->mutable_sharding()->set_max_workers(6);
        s->mutable_sharding()->set_replicas(3);
        s->mutable_sharding()->set_elastic(true);
        s->mutable_training()->set_global_batch(12);
        s->mutable_training()->set_microbatch(2);
      }, 6, {"sharding.elastic", "divisible by S x R' x training.microbatch",
             "S = 2, R' = 2: 12 % (2 * 2 * 2) != 0"});
  add("WorldOptimizerWithoutKeptCodes", [](v1::JobSpec* s) {
        s->mutable_sharding()->set_max_workers(2);
        s->mutable_sharding()->set_replicas(2);
        s->mutable_sharding()->set_optimizer_sharding(v1::OPTIMIZER_SHARDING_WORLD);
        s->mutable_precision()->mutable_fp8()->set_keep_weight_codes(false);
      }, 2, {"precision.fp8.keep_weight_codes", "must be true with sharding.optimizer_sharding WORLD"});
  add("EmbeddingFp8", [](v1::JobSpec* s) { s->mutable_precision()->set_embedding(v1::PRECISION_FP8); },
      2, {"precision.embedding", "precision.embedding: must be BF16 or FP32"});
  add("LmHeadFp8", [](v1::JobSpec* s) { s->mutable_precision()->set_lm_head(v1::PRECISION_FP8); }, 2,
      {"precision.lm_head", "must be BF16 or FP32"});
  add("AttentionFp8", [](v1::JobSpec* s) { s->mutable_precision()->set_attention(v1::PRECISION_FP8); },
      2, {"precision.attention", "must be BF16 or FP32"});
  add("FreeRunningWithEval", [](v1::JobSpec* s) {
        s->mutable_training()->set_free_running(true);
        s->mutable_training()->set_eval_every(10);
      }, 2, {"training.free_running", "needs training.eval_every: 0", "got eval_every 10"});
  add("HistoryLenZero",
      [](v1::JobSpec* s) { s->mutable_precision()->mutable_fp8()->set_amax_history_len(0); }, 2,
      {"precision.fp8.amax_history_len", "must be >= 1"});
  add("MarginNegative", [](v1::JobSpec* s) { s->mutable_precision()->mutable_fp8()->set_margin(-1); },
      2, {"precision.fp8.margin", "must be >= 0"});
  add("OverrideLayerOutOfRange", [](v1::JobSpec* s) {
        auto* o = s->mutable_precision()->add_overrides();
        o->set_layer(4);
        o->set_linears(v1::PRECISION_BF16);
      }, 2, {"precision.overrides[0].layer", "must be in [0, model.n_layers)", "4 not in [0, 4)"});
  add("OverrideLayerNegative", [](v1::JobSpec* s) {
        auto* o = s->mutable_precision()->add_overrides();
        o->set_layer(-1);
        o->set_linears(v1::PRECISION_BF16);
      }, 2, {"precision.overrides[0].layer", "must be in [0, model.n_layers)"});
  add("OverrideDuplicate", [](v1::JobSpec* s) {
        for (int i = 0; i < 2; ++i) {
          auto* o = s->mutable_precision()->add_overrides();
          o->set_layer(1);
          o->set_linears(v1::PRECISION_BF16);
        }
      }, 2, {"precision.overrides[1].layer", "duplicate override", "precision.overrides[0]"});
  add("OverrideUnspecified", [](v1::JobSpec* s) {
        s->mutable_precision()->add_overrides()->set_layer(0);
      }, 2, {"precision.overrides[0].linears", "must be set"});
  add("RowwiseWithDelayedScaling", [](v1::JobSpec* s) {
        s->mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_ROWWISE);
        s->mutable_precision()->mutable_fp8()->set_recipe(v1::SCALING_RECIPE_DELAYED);
      }, 2, {"precision.fp8.recipe", "must be CURRENT with precision.fp8.granularity ROWWISE",
             "no amax history", "got DELAYED"});
  add("BlockwiseWithDelayedScaling", [](v1::JobSpec* s) {
        s->mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
        s->mutable_precision()->mutable_fp8()->set_recipe(v1::SCALING_RECIPE_DELAYED);
      }, 2, {"precision.fp8.recipe", "must be CURRENT with precision.fp8.granularity BLOCKWISE"});
  add("OverrideGranularityOnBf16Layer", [](v1::JobSpec* s) {
        auto* o = s->mutable_precision()->add_overrides();
        o->set_layer(1);
        o->set_linears(v1::PRECISION_BF16);
        o->set_granularity(v1::FP8_GRANULARITY_ROWWISE);
      }, 2, {"precision.overrides[0].granularity", "applies to FP8 linears only",
             "linears BF16, granularity ROWWISE"});
  add("GranularityUndefinedValue", [](v1::JobSpec* s) {
        s->mutable_precision()->mutable_fp8()->set_granularity(static_cast<v1::Fp8Granularity>(7));
      }, 2, {"precision.fp8.granularity", "must be TENSORWISE, ROWWISE or BLOCKWISE",
             "undefined value 7"});
  add("OverrideGranularityUndefinedValue", [](v1::JobSpec* s) {
        auto* o = s->mutable_precision()->add_overrides();
        o->set_layer(0);
        o->set_linears(v1::PRECISION_BF16);
        o = s->mutable_precision()->add_overrides();
        o->set_layer(1);
        o->set_linears(v1::PRECISION_FP8);
        o->set_granularity(static_cast<v1::Fp8Granularity>(-3));
      }, 2, {"precision.overrides[1].granularity", "must be TENSORWISE, ROWWISE or BLOCKWISE",
             "undefined value -3"});
  add("BackendUnknown", [](v1::JobSpec* s) { s->set_backend("tpu"); }, 2,
      {"backend", "must be \"cpu\" or \"cuda\"", "tpu"});
  add("TrainPathMissing", [](v1::JobSpec* s) { s->mutable_data()->clear_train_path(); }, 2,
      {"data.train_path", "data.train_path: required"});
  return r;
}

INSTANTIATE_TEST_SUITE_P(Spec, ValidateRule, ::testing::ValuesIn(Rules()),
                         [](const ::testing::TestParamInfo<RuleCase>& i) { return i.param.name; });

TEST(Spec, GranularityDefaultsAndLayerGranularity) {
  v1::JobSpec s;  // nothing set: the defaults below all apply
  // Tensorwise by default, with every earlier default unchanged.
  v1::JobSpec d = WithDefaults(s, 2);
  EXPECT_EQ(d.precision().fp8().granularity(), v1::FP8_GRANULARITY_TENSORWISE);
  EXPECT_EQ(d.precision().fp8().recipe(), v1::SCALING_RECIPE_DELAYED);
  EXPECT_EQ(d.precision().fp8().format(), v1::FP8_FORMAT_HYBRID);
  // Blockwise: current scaling, E4M3 grad-outputs; an explicit hybrid format stays.
  s.mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  d = WithDefaults(s, 2);
  EXPECT_EQ(d.precision().fp8().recipe(), v1::SCALING_RECIPE_CURRENT);
  EXPECT_EQ(d.precision().fp8().format(), v1::FP8_FORMAT_E4M3);
  s.mutable_precision()->mutable_fp8()->set_format(v1::FP8_FORMAT_HYBRID);
  EXPECT_EQ(WithDefaults(s, 2).precision().fp8().format(), v1::FP8_FORMAT_HYBRID);
  // Rowwise: current scaling, the hybrid format.
  s.mutable_precision()->mutable_fp8()->clear_format();
  s.mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_ROWWISE);
  d = WithDefaults(s, 2);
  EXPECT_EQ(d.precision().fp8().recipe(), v1::SCALING_RECIPE_CURRENT);
  EXPECT_EQ(d.precision().fp8().format(), v1::FP8_FORMAT_HYBRID);
  // Per layer: the override's granularity, else the job's; non-FP8 layers are tensorwise.
  auto* o = d.mutable_precision()->add_overrides();
  o->set_layer(1);
  o->set_linears(v1::PRECISION_FP8);
  o->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  o = d.mutable_precision()->add_overrides();
  o->set_layer(2);
  o->set_linears(v1::PRECISION_BF16);
  EXPECT_EQ(LayerGranularity(d, 0), v1::FP8_GRANULARITY_ROWWISE);
  EXPECT_EQ(LayerGranularity(d, 1), v1::FP8_GRANULARITY_BLOCKWISE);
  EXPECT_EQ(LayerGranularity(d, 2), v1::FP8_GRANULARITY_TENSORWISE);
  EXPECT_TRUE(AnyScaledGranularity(d));
  EXPECT_FALSE(AnyScaledGranularity(WithDefaults(Valid(), 2)));
}

TEST(Spec, RowwiseAndBlockwiseValidOnCpu) {
  for (v1::Fp8Granularity g : {v1::FP8_GRANULARITY_ROWWISE, v1::FP8_GRANULARITY_BLOCKWISE}) {
    v1::JobSpec s;
    s.mutable_data()->set_train_path("/data/train.bin");
    s.mutable_precision()->mutable_fp8()->set_granularity(g);
    EXPECT_TRUE(ValidateSpec(s, 2, {}, false).ok()) << ValidateSpec(s, 2, {}, false);
    // Also as one layer's override under the default tensorwise, delayed recipe.
    v1::JobSpec o;
    o.mutable_data()->set_train_path("/data/train.bin");
    auto* ov = o.mutable_precision()->add_overrides();
    ov->set_layer(1);
    ov->set_linears(v1::PRECISION_FP8);
    ov->set_granularity(g);
    EXPECT_TRUE(ValidateSpec(o, 2, {}, false).ok()) << ValidateSpec(o, 2, {}, false);
  }
}

// The CUDA backend runs the rowwise and blockwise recipes (its block-scaled casts and cuBLASLt
// GEMMs): the whole-job granularity and per-layer overrides validate there as on the CPU.
TEST(Spec, RowwiseAndBlockwiseValidOnCuda) {
  v1::JobSpec whole;
  whole.mutable_data()->set_train_path("/data/train.bin");
  whole.set_backend("cuda");
  whole.mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  whole.mutable_precision()->mutable_fp8()->set_recipe(v1::SCALING_RECIPE_CURRENT);
  EXPECT_TRUE(ValidateSpec(whole, 2, {}, false).ok()) << ValidateSpec(whole, 2, {}, false);
  v1::JobSpec one;
  one.mutable_data()->set_train_path("/data/train.bin");
  one.set_backend("cuda");
  auto* o = one.mutable_precision()->add_overrides();
  o->set_layer(2);
  o->set_linears(v1::PRECISION_FP8);
  o->set_granularity(v1::FP8_GRANULARITY_ROWWISE);
  EXPECT_TRUE(ValidateSpec(one, 2, {}, false).ok()) << ValidateSpec(one, 2, {}, false);
  v1::JobSpec second;
  second.mutable_data()->set_train_path("/data/train.bin");
  second.set_backend("cuda");
  o = second.mutable_precision()->add_overrides();
  o->set_layer(0);
  o->set_linears(v1::PRECISION_BF16);
  o = second.mutable_precision()->add_overrides();
  o->set_layer(3);
  o->set_linears(v1::PRECISION_FP8);
  o->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  EXPECT_TRUE(ValidateSpec(second, 2, {}, false).ok()) << ValidateSpec(second, 2, {}, false);
  // Still refused there as everywhere: delayed scaling with a scaled granularity.
  whole.mutable_precision()->mutable_fp8()->set_recipe(v1::SCALING_RECIPE_DELAYED);
  EXPECT_FALSE(ValidateSpec(whole, 2, {}, false).ok());
}

TEST(Spec, ParseGranularityShortNames) {
  auto s = ParseSpec(
      "precision: {fp8: {granularity: blockwise}, overrides: [{layer: 0, linears: fp8, "
      "granularity: Rowwise}, {layer: 1, linears: fp8, granularity: TENSORWISE}]}\n");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->precision().fp8().granularity(), v1::FP8_GRANULARITY_BLOCKWISE);
  EXPECT_EQ(s->precision().overrides(0).granularity(), v1::FP8_GRANULARITY_ROWWISE);
  EXPECT_EQ(s->precision().overrides(1).granularity(), v1::FP8_GRANULARITY_TENSORWISE);
}

TEST(Spec, CudaBackendAccepted) {
  v1::JobSpec s = Valid();
  s.set_backend("cuda");
  EXPECT_TRUE(ValidateSpec(s, 2, {}, false).ok());
}

TEST(Spec, DataRoots) {
  const std::vector<std::string> roots = {"/data", "/srv/corpora/"};
  v1::JobSpec s = Valid();
  EXPECT_TRUE(ValidateSpec(s, 2, roots, false).ok());
  s.mutable_data()->set_train_path("/srv/corpora/a/./b/train.bin");
  EXPECT_TRUE(ValidateSpec(s, 2, roots, false).ok());
  for (const char* bad : {"/etc/passwd", "/data/../etc/passwd", "/data2/train.bin", "/srv/corp"}) {
    s.mutable_data()->set_train_path(bad);
    const absl::Status st = ValidateSpec(s, 2, roots, false);
    ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(std::string(st.message()),
              "data.train_path: must lie under one of the data roots (/data, /srv/corpora/)")
        << bad;
  }
  s.mutable_data()->set_train_path("data/train.bin");  // relative
  EXPECT_NE(std::string(ValidateSpec(s, 2, roots, false).message()).find("data.train_path: must be "
                                                                         "an absolute path"),
            std::string::npos);
  s.mutable_data()->set_train_path("/data/train.bin");
  s.mutable_data()->set_val_path("/tmp/val.bin");
  const absl::Status st = ValidateSpec(s, 2, roots, false);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(st.message()).rfind("data.val_path: must lie under", 0), 0u) << st;
  // No roots: anything goes.
  EXPECT_TRUE(ValidateSpec(s, 2, {}, false).ok());
}

// Symlinks are resolved before the data-root check: a link inside a root that leads outside it is
// refused, for data paths and checkpoint.dir alike; links that stay inside, and a root that is
// itself reached through a link, are fine.
TEST(Spec, DataRootsResolveSymlinks) {
  namespace fs = std::filesystem;
  char tmpl[] = "/tmp/fsdp8-roots-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const fs::path base = tmpl;
  const fs::path root = base / "root", outside = base / "outside";
  fs::create_directories(root / "corpus");
  fs::create_directories(outside);
  fs::create_directory_symlink(outside, root / "escape");          // root/escape -> outside
  fs::create_directory_symlink(root / "corpus", root / "alias");   // stays inside
  fs::create_directory_symlink(root, base / "root-link");          // the root via a link
  const std::vector<std::string> roots = {root.string()};
  v1::JobSpec s = Valid();
  auto check = [&](const std::string& train) {
    s.mutable_data()->set_train_path(train);
    return ValidateSpec(s, 2, roots, false);
  };
  EXPECT_TRUE(check((root / "corpus/train.bin").string()).ok());
  EXPECT_TRUE(check((root / "alias/train.bin").string()).ok());
  const absl::Status esc = check((root / "escape/train.bin").string());
  EXPECT_EQ(esc.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(esc.message()),
            "data.train_path: must lie under one of the data roots (" + root.string() +
                ") after resolving symlinks (\"" + (root / "escape/train.bin").string() +
                "\" resolves to \"" + (outside / "train.bin").string() + "\")");
  // ".." tricks are refused before any resolution.
  const absl::Status dots = check((root / "corpus/../../outside/train.bin").string());
  EXPECT_EQ(std::string(dots.message()),
            "data.train_path: must lie under one of the data roots (" + root.string() + ")");
  // A root configured through a link accepts paths written through that link.
  s.mutable_data()->set_train_path((base / "root-link/corpus/train.bin").string());
  EXPECT_TRUE(ValidateSpec(s, 2, {(base / "root-link").string()}, false).ok());
  // checkpoint.dir follows the same rule, also for a directory that does not exist yet.
  s.mutable_data()->set_train_path((root / "corpus/train.bin").string());
  s.mutable_checkpoint()->set_dir((root / "escape/ck/run1").string());
  const absl::Status ck = ValidateSpec(s, 2, roots, false);
  EXPECT_EQ(ck.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(ck.message()).rfind("checkpoint.dir: must lie under one of the data roots", 0),
            0u)
      << ck;
  s.mutable_checkpoint()->set_dir((root / "ck/run1").string());
  EXPECT_TRUE(ValidateSpec(s, 2, roots, false).ok());
  fs::remove_all(base);
}

TEST(Spec, CheckpointDefaults) {
  const v1::JobSpec d = WithDefaults(v1::JobSpec(), 2);
  EXPECT_EQ(d.checkpoint().dir(), "");
  EXPECT_EQ(d.checkpoint().every_steps(), 0);
  EXPECT_EQ(d.checkpoint().keep_last(), 3);
  EXPECT_EQ(d.checkpoint().resume_from(), "");
  EXPECT_EQ(d.checkpoint().max_failed_saves(), 3);
  v1::JobSpec s;
  s.mutable_checkpoint()->set_every_steps(7);
  s.mutable_checkpoint()->set_keep_last(1);
  const v1::JobSpec e = WithDefaults(s, 2);
  EXPECT_EQ(e.checkpoint().every_steps(), 7);
  EXPECT_EQ(e.checkpoint().keep_last(), 1);
}

TEST(Spec, CheckpointRules) {
  const std::vector<std::string> roots = {"/data"};
  auto msg = [&](const v1::JobSpec& s) {
    const absl::Status st = ValidateSpec(s, 2, roots, false);
    EXPECT_TRUE(st.ok() || st.code() == absl::StatusCode::kInvalidArgument) << st;
    return std::string(st.message());
  };
  v1::JobSpec s = Valid();
  s.mutable_checkpoint()->set_dir("/data/ckpt");
  s.mutable_checkpoint()->set_every_steps(10);
  EXPECT_EQ(msg(s), "");
  s.mutable_checkpoint()->set_keep_last(0);
  EXPECT_EQ(msg(s), "checkpoint.keep_last: must be >= 1 (got 0)");
  s.mutable_checkpoint()->set_keep_last(2);
  s.mutable_checkpoint()->set_max_failed_saves(0);
  EXPECT_EQ(msg(s), "checkpoint.max_failed_saves: must be >= 1 (got 0)");
  s.mutable_checkpoint()->set_max_failed_saves(1);
  EXPECT_EQ(msg(s), "");
  s.mutable_checkpoint()->set_every_steps(-1);
  EXPECT_EQ(msg(s), "checkpoint.every_steps: must be >= 0 (got -1)");
  s.mutable_checkpoint()->set_every_steps(0);
  // Same root rule as the data paths.
  s.mutable_checkpoint()->set_dir("/tmp/ckpt");
  EXPECT_EQ(msg(s), "checkpoint.dir: must lie under one of the data roots (/data)");
  s.mutable_checkpoint()->set_dir("/data/../etc");
  EXPECT_EQ(msg(s), "checkpoint.dir: must lie under one of the data roots (/data)");
  s.mutable_checkpoint()->set_dir("ckpt");
  EXPECT_EQ(msg(s).rfind("checkpoint.dir: must be an absolute path", 0), 0u) << msg(s);
  s.mutable_checkpoint()->set_dir("/data/ckpt/");
  // resume_from: empty, "latest" or a path under checkpoint.dir.
  for (const char* ok : {"", "latest", "/data/ckpt/step-10", "/data/ckpt/./step-10/"}) {
    s.mutable_checkpoint()->set_resume_from(ok);
    EXPECT_EQ(msg(s), "") << ok;
  }
  for (const char* bad : {"/data/ckpt", "/data/ckpt/", "/data/other/step-10",
                          "/data/ckpt/../other/step-1", "Latest"}) {
    s.mutable_checkpoint()->set_resume_from(bad);
    EXPECT_EQ(msg(s).rfind("checkpoint.resume_from: must be empty, \"latest\" or a step directory "
                           "under checkpoint.dir", 0), 0u)
        << bad << ": " << msg(s);
  }
  // Without a dir, nothing that needs one.
  s.mutable_checkpoint()->set_dir("");
  s.mutable_checkpoint()->set_resume_from("latest");
  EXPECT_EQ(msg(s).rfind("checkpoint.resume_from: needs checkpoint.dir", 0), 0u) << msg(s);
  s.mutable_checkpoint()->set_resume_from("");
  s.mutable_checkpoint()->set_every_steps(5);
  EXPECT_EQ(msg(s).rfind("checkpoint.every_steps: needs checkpoint.dir", 0), 0u) << msg(s);
  s.mutable_checkpoint()->set_every_steps(0);
  EXPECT_EQ(msg(s), "");
  // No roots: any dir.
  s.mutable_checkpoint()->set_dir("/tmp/ckpt");
  EXPECT_TRUE(ValidateSpec(s, 2, {}, false).ok());
}

TEST(Spec, CheckFiles) {
  const std::string dir = ::testing::TempDir();
  const std::string good = dir + "/fsdp8_spec_good_" + std::to_string(getpid()) + ".bin";
  const std::string small = dir + "/fsdp8_spec_small_" + std::to_string(getpid()) + ".bin";
  // seq_len = 256: exactly seq_len + 1 tokens is one window (WindowStart accepts it); one less is
  // not.
  ASSERT_TRUE(WriteTokenShard(good, std::vector<uint16_t>(257, 1)).ok());   // == seq_len + 1
  ASSERT_TRUE(WriteTokenShard(small, std::vector<uint16_t>(256, 1)).ok());  // == seq_len
  ASSERT_EQ(WindowStart(1, 0, 0, 257, 256, kTrainStream), 0);
  ASSERT_EQ(WindowStart(1, 0, 0, 256, 256, kTrainStream), -1);
  v1::JobSpec s = Valid();
  s.mutable_data()->set_train_path(good);
  EXPECT_TRUE(ValidateSpec(s, 2, {}, true).ok()) << ValidateSpec(s, 2, {}, true);
  s.mutable_data()->set_val_path(good);
  EXPECT_TRUE(ValidateSpec(s, 2, {}, true).ok()) << ValidateSpec(s, 2, {}, true);
  s.mutable_data()->set_val_path(small);
  absl::Status st = ValidateSpec(s, 2, {}, true);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(st.message()).rfind("data.val_path: too few tokens", 0), 0u) << st;
  EXPECT_NE(std::string(st.message()).find("256 tokens, need at least seq_len + 1 = 257"),
            std::string::npos)
      << st;
  s.mutable_data()->set_val_path("");
  s.mutable_data()->set_train_path(dir + "/does_not_exist.bin");
  st = ValidateSpec(s, 2, {}, true);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(st.message()).rfind("data.train_path: must be a readable token shard", 0), 0u)
      << st;
  EXPECT_NE(std::string(st.message()).find("does_not_exist.bin"), std::string::npos);
  // Not checked when check_files is false.
  EXPECT_TRUE(ValidateSpec(s, 2, {}, false).ok());
  std::remove(good.c_str());
  std::remove(small.c_str());
}

// Bounded inputs: every string field has a limit (paths 1024 bytes, other strings 256), and so
// has the serialized spec (64 KiB); the message names the field and the limit.
// ReadSpecFile (the CLI's reader): a regular file over kMaxSpecBytes is refused from its size,
// naming the path, the size and the limit; at the limit it is read whole; a pipe, whose size
// fstat does not know, is read up to one byte past the limit and refused as larger; a missing
// file is NOT_FOUND naming it.
TEST(Spec, ReadSpecFileIsBoundedByTheSpecLimit) {
  const std::string dir = ::testing::TempDir() + "/fsdp8_specfile_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string at = dir + "/at.yaml", over = dir + "/over.yaml";
  const std::string text = "name: x\n#" + std::string(65536 - 10, 'c') + "\n";
  ASSERT_EQ(text.size(), 65536u);
  std::ofstream(at, std::ios::binary) << text;
  std::ofstream(over, std::ios::binary) << text << "\n";
  auto ok = ReadSpecFile(at);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, text);
  auto big = ReadSpecFile(over);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(big.status().message(),
            over + ": 65537 bytes exceeds the limit of 65536 bytes on a job spec");
  auto missing = ReadSpecFile(dir + "/none.yaml");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(dir + "/none.yaml"), std::string::npos);

  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  std::thread writer([&] {  // more than the pipe holds: the reader must stop reading
    const std::string chunk(4096, 'y');
    for (int i = 0; i < 64; ++i)
      if (write(fds[1], chunk.data(), chunk.size()) < 0) break;  // EPIPE once the reader is gone
    close(fds[1]);
  });
  signal(SIGPIPE, SIG_IGN);
  const std::string pipe_path = "/proc/self/fd/" + std::to_string(fds[0]);
  auto piped = ReadSpecFile(pipe_path);
  close(fds[0]);
  writer.join();
  EXPECT_EQ(piped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(piped.status().message().find("more than 65536 bytes exceeds the limit of 65536"),
            std::string::npos)
      << piped.status();
  std::filesystem::remove_all(dir);
}

// sharding.elastic: 3 replicas of 2 ranks with 24 sequences in microbatches of 2 split over every
// surviving mesh (2 x 2: 24 % 8 == 0; 1 x 2: 24 % 4 == 0); 12 would not (see ElasticBatch... above).
TEST(Spec, ElasticAcceptsABatchEverySurvivingMeshSplits) {
  v1::JobSpec s = Valid();
  s.mutable_sharding()->set_max_workers(6);
  s.mutable_sharding()->set_replicas(3);
  s.mutable_sharding()->set_elastic(true);
  s.mutable_training()->set_global_batch(24);
  s.mutable_training()->set_microbatch(2);
  EXPECT_TRUE(ValidateSpec(s, 6, {}, false).ok()) << ValidateSpec(s, 6, {}, false);
  s.mutable_training()->set_global_batch(12);
  EXPECT_FALSE(ValidateSpec(s, 6, {}, false).ok());
  s.mutable_sharding()->set_elastic(false);  // the global batch may shrink instead
  EXPECT_TRUE(ValidateSpec(s, 6, {}, false).ok()) << ValidateSpec(s, 6, {}, false);
}

TEST(Spec, StringFieldsAndSizeAreBounded) {
  auto msg = [](const v1::JobSpec& s) { return std::string(ValidateSpec(s, 2, {}, false).message()); };
  v1::JobSpec s = Valid();
  s.set_name(std::string(256, 'n'));
  s.mutable_data()->set_train_path("/" + std::string(1023, 'p'));
  s.mutable_data()->set_val_path("/" + std::string(1023, 'v'));
  s.mutable_checkpoint()->set_dir("/" + std::string(1023, 'd'));
  s.mutable_checkpoint()->set_resume_from("latest");
  s.mutable_init()->set_from_hf("/" + std::string(1023, 'h'));
  EXPECT_EQ(msg(s), "");  // every one at its limit
  struct Case {
    std::function<void(v1::JobSpec*)> grow;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](v1::JobSpec* x) { x->set_name(std::string(257, 'n')); },
       "name: longer than the limit of 256 bytes (got 257)"},
      {[](v1::JobSpec* x) { x->set_name(std::string(10 << 20, 'n')); },
       "spec: serialized size "},  // the 10 MiB name and the rest: the whole spec is too large
      {[](v1::JobSpec* x) { x->set_backend(std::string(300, 'b')); },
       "backend: longer than the limit of 256 bytes (got 300)"},
      {[](v1::JobSpec* x) { x->mutable_data()->set_train_path("/" + std::string(1024, 'p')); },
       "data.train_path: longer than the limit of 1024 bytes (got 1025)"},
      {[](v1::JobSpec* x) { x->mutable_data()->set_val_path(std::string(2000, 'p')); },
       "data.val_path: longer than the limit of 1024 bytes (got 2000)"},
      {[](v1::JobSpec* x) { x->mutable_checkpoint()->set_dir(std::string(1025, 'd')); },
       "checkpoint.dir: longer than the limit of 1024 bytes (got 1025)"},
      {[](v1::JobSpec* x) { x->mutable_checkpoint()->set_resume_from(std::string(1025, 'r')); },
       "checkpoint.resume_from: longer than the limit of 1024 bytes (got 1025)"},
      {[](v1::JobSpec* x) { x->mutable_init()->set_from_hf(std::string(1025, 'h')); },
       "init.from_hf: longer than the limit of 1024 bytes (got 1025)"},
  };
  for (const Case& c : cases) {
    v1::JobSpec t = s;
    c.grow(&t);
    const absl::Status st = ValidateSpec(t, 2, {}, false);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(std::string(st.message()).rfind(c.message, 0), 0u) << st;
  }
  // The size limit, with strings inside theirs: many precision overrides.
  v1::JobSpec big = Valid();
  big.mutable_model()->set_n_layers(100000);
  for (int i = 0; i < 20000; ++i) {
    v1::LayerPrecision* o = big.mutable_precision()->add_overrides();
    o->set_layer(i);
    o->set_linears(v1::PRECISION_BF16);
  }
  ASSERT_GT(big.ByteSizeLong(), 65536u);
  const absl::Status st = ValidateSpec(big, 2, {}, false);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("exceeds the limit of 65536 bytes"), std::string::npos) << st;
}

// init.from_checkpoint: a path under the data roots, not with init.from_hf; its load flags need it.
TEST(Spec, InitFromCheckpointRules) {
  auto msg = [](const v1::JobSpec& s) {
    return std::string(ValidateSpec(s, 2, {"/data"}, false).message());
  };
  v1::JobSpec s = Valid();
  s.mutable_init()->set_from_checkpoint("/data/ck/step-4");
  s.mutable_init()->set_load_optimizer_state(true);
  s.mutable_init()->set_load_fp8_state(true);
  EXPECT_EQ(msg(s), "");
  s.mutable_init()->set_from_hf("/data/hf");
  EXPECT_EQ(msg(s).rfind("init.from_checkpoint: cannot be combined with init.from_hf", 0), 0u) << msg(s);
  s.mutable_init()->clear_from_hf();
  s.mutable_init()->set_from_checkpoint("/elsewhere/ck/step-4");
  EXPECT_EQ(msg(s).rfind("init.from_checkpoint: must lie under one of the data roots", 0), 0u) << msg(s);
  s.mutable_init()->clear_from_checkpoint();
  EXPECT_EQ(msg(s).rfind("init.load_optimizer_state: needs init.from_checkpoint", 0), 0u) << msg(s);
  s.mutable_init()->set_load_optimizer_state(false);
  EXPECT_EQ(msg(s).rfind("init.load_fp8_state: needs init.from_checkpoint", 0), 0u) << msg(s);
}

// A derived size in a message is computed in 64 bits: seq_len + 1 of the largest int32 seq_len is
// 2^31 = 2147483648, not a wrapped negative number.
TEST(Spec, TooFewTokensMessageForMaxSeqLen) {
  const std::string path =
      ::testing::TempDir() + "/fsdp8_spec_maxseq_" + std::to_string(getpid()) + ".bin";
  ASSERT_TRUE(WriteTokenShard(path, std::vector<uint16_t>(300, 1)).ok());
  v1::JobSpec s = Valid();
  s.mutable_model()->set_seq_len(2147483647);
  s.mutable_data()->set_train_path(path);
  const absl::Status st = ValidateSpec(s, 2, {}, true);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("300 tokens, need at least seq_len + 1 = 2147483648"),
            std::string::npos)
      << st;
  EXPECT_EQ(std::string(st.message()).find("-2147483648"), std::string::npos) << st;
  std::remove(path.c_str());
}

// A dataset of several shards: a directory or a glob; every shard's header is checked (the error
// names the shard), a pattern matching nothing is named, the shards must lie under the data roots,
// and a vocabulary beyond uint16 is accepted with uint32 shards.
TEST(Spec, CheckDatasetOfShards) {
  const std::string dir = ::testing::TempDir() + "/fsdp8_spec_ds_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/corpus");
  const std::vector<uint32_t> toks(300, 128000);
  for (const char* n : {"train_000.bin", "train_001.bin", "train_002.bin"}) {
    ASSERT_TRUE(WriteTokenShard(dir + "/corpus/" + n, toks.data(), 300, 4).ok());
  }
  v1::JobSpec s = Valid();
  s.mutable_model()->set_vocab_size(128256);
  s.mutable_data()->set_train_path(dir + "/corpus");
  EXPECT_TRUE(ValidateSpec(s, 2, {dir}, true).ok()) << ValidateSpec(s, 2, {dir}, true);
  s.mutable_data()->set_train_path(dir + "/corpus/train_*.bin");
  EXPECT_TRUE(ValidateSpec(s, 2, {dir}, true).ok()) << ValidateSpec(s, 2, {dir}, true);
  s.mutable_data()->set_train_path(dir + "/corpus/val_*.bin");
  absl::Status st = ValidateSpec(s, 2, {dir}, true);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("data.train_path"), std::string::npos) << st;
  EXPECT_NE(st.message().find(dir + "/corpus/val_*.bin"), std::string::npos) << st;
  // One corrupt shard among three: named.
  std::FILE* f = std::fopen((dir + "/corpus/train_001.bin").c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  const int32_t wrong = 12345;
  std::fwrite(&wrong, 4, 1, f);
  std::fclose(f);
  s.mutable_data()->set_train_path(dir + "/corpus");
  st = ValidateSpec(s, 2, {dir}, true);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find(dir + "/corpus/train_001.bin"), std::string::npos) << st;
  EXPECT_NE(st.message().find("magic"), std::string::npos) << st;
  // A link inside the root to a shard outside it is refused like a plain path outside.
  const std::string outside = ::testing::TempDir() + "/fsdp8_spec_out_" + std::to_string(getpid());
  std::filesystem::remove_all(outside);
  std::filesystem::create_directories(outside);
  ASSERT_TRUE(WriteTokenShard(outside + "/x.bin", toks.data(), 300, 4).ok());
  std::filesystem::remove(dir + "/corpus/train_001.bin");
  std::filesystem::create_symlink(outside + "/x.bin", dir + "/corpus/train_001.bin");
  st = ValidateSpec(s, 2, {dir}, true);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("data roots"), std::string::npos) << st;
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(outside);
}

// ---- parsing ----------------------------------------------------------------------------------

const char* kYaml = R"(
name: tiny
model:
  d_model: 64
  n_layers: 2
  rope_theta: 500000.0
  norm_eps: 1e-6
data:
  train_path: /data/train.bin
  val_path: "/data/val.bin"
training:
  seed: 18446744073709551615
  microbatch: 4
optimizer:
  peak_lr: 0.001
  warmup_steps: 0
precision:
  linears: fp8
  embedding: FP32
  lm_head: precision_bf16
  fp8:
    recipe: current
    format: E4M3
    amax_algorithm: most_recent
    margin: 1
  overrides:
    - layer: 1
      linears: bf16
    - {layer: 0, linears: Fp32}
backend: cpu
)";

const char* kJson = R"({
  "name": "tiny",
  "model": {"dModel": 64, "n_layers": 2, "ropeTheta": 500000, "normEps": 0.000001},
  "data": {"trainPath": "/data/train.bin", "val_path": "/data/val.bin"},
  "training": {"seed": "18446744073709551615", "microbatch": 4},
  "optimizer": {"peakLr": 1e-3, "warmupSteps": "0"},
  "precision": {
    "linears": "PRECISION_FP8", "embedding": "PRECISION_FP32", "lmHead": "PRECISION_BF16",
    "fp8": {"recipe": "SCALING_RECIPE_CURRENT", "format": "FP8_FORMAT_E4M3",
            "amaxAlgorithm": "AMAX_ALGORITHM_MOST_RECENT", "margin": 1},
    "overrides": [{"layer": 1, "linears": "PRECISION_BF16"}, {"layer": 0, "linears": 3}]
  },
  "backend": "cpu"
})";

// optimizer.state_precision: the short spelling parses, BF16 validates, and the memory plan's
// bytes per element of the AdamW state follow it (two moments of 4 or 2 bytes).
TEST(Spec, OptimizerStatePrecision) {
  auto y = ParseSpec("data: {train_path: /data/train.bin}\noptimizer:\n  state_precision: bf16\n");
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->optimizer().state_precision(), v1::PRECISION_BF16);
  EXPECT_TRUE(ValidateSpec(*y, 2, {}, false).ok());
  EXPECT_EQ(AdamStateBytesPerElement(WithDefaults(*y, 2)), 4);
  EXPECT_EQ(AdamStateBytesPerElement(Valid()), 8);
  auto bad = ParseSpec("optimizer: {state_precision: fp16}\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("optimizer.state_precision"), std::string::npos)
      << bad.status();
}

// training.max_nonfinite_steps: parsed from YAML; 0 and training.steps are the bounds accepted
// (the refusals are ValidateRule cases).
TEST(Spec, MaxNonfiniteStepsBounds) {
  auto y = ParseSpec("data: {train_path: /data/train.bin}\ntraining:\n  steps: 20\n"
                     "  max_nonfinite_steps: 3\n");
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->training().max_nonfinite_steps(), 3);
  EXPECT_TRUE(ValidateSpec(*y, 2, {}, false).ok());
  for (int64_t n : {0, 20}) {
    y->mutable_training()->set_max_nonfinite_steps(n);
    EXPECT_TRUE(ValidateSpec(*y, 2, {}, false).ok()) << n;
  }
  y->mutable_training()->set_max_nonfinite_steps(21);
  EXPECT_EQ(ValidateSpec(*y, 2, {}, false).code(), absl::StatusCode::kInvalidArgument);
}

// training.saved_norm_inputs: the short spelling parses and BF16 validates; the memory plan keeps
// 2 bytes instead of 4 per element of the two norm inputs of each FP8 block with BF16 attention
// (hand count: 2 * 2 bytes * N * d_model per block less, N the microbatch's tokens).
TEST(Spec, SavedNormInputs) {
  auto y = ParseSpec("data: {train_path: /data/train.bin}\ntraining:\n  saved_norm_inputs: bf16\n");
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->training().saved_norm_inputs(), v1::PRECISION_BF16);
  EXPECT_TRUE(ValidateSpec(*y, 2, {}, false).ok());
  v1::JobSpec s = Valid();
  s.mutable_precision()->set_linears(v1::PRECISION_FP8);
  s.mutable_precision()->set_attention(v1::PRECISION_BF16);
  auto f32 = PlanMemory(WithDefaults(s, 1), 1);
  s.mutable_training()->set_saved_norm_inputs(v1::PRECISION_BF16);
  auto bf16 = PlanMemory(WithDefaults(s, 1), 1);
  ASSERT_TRUE(f32.ok() && bf16.ok());
  const v1::JobSpec d = WithDefaults(s, 1);
  const int64_t N = int64_t{d.training().microbatch()} * d.model().seq_len();
  const int64_t want = d.model().n_layers() * 2 * 2 * N * d.model().d_model();
  auto saved = [](const MemoryPlan& p) {
    for (const MemoryTerm& t : p.terms) {
      if (t.name == "saved activations") return t.bytes;
    }
    return int64_t{-1};
  };
  EXPECT_EQ(saved(*f32) - saved(*bf16), want);
  auto bad = ParseSpec("training: {saved_norm_inputs: fp16}\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("training.saved_norm_inputs"), std::string::npos)
      << bad.status();
}

TEST(Spec, ParseYamlAndJsonAgree) {
  auto y = ParseSpec(kYaml);
  ASSERT_TRUE(y.ok()) << y.status();
  auto j = ParseSpec(kJson);
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*y, *j))
      << y->DebugString() << "\n---\n" << j->DebugString();
  EXPECT_EQ(y->name(), "tiny");
  EXPECT_EQ(y->model().d_model(), 64);
  EXPECT_EQ(y->model().rope_theta(), 500000.0);
  EXPECT_EQ(y->model().norm_eps(), 1e-6);
  EXPECT_FALSE(y->model().has_n_heads());  // unset stays unset
  EXPECT_EQ(y->data().val_path(), "/data/val.bin");
  EXPECT_EQ(y->training().seed(), 18446744073709551615ull);
  EXPECT_TRUE(y->optimizer().has_warmup_steps());
  EXPECT_EQ(y->optimizer().warmup_steps(), 0);
  EXPECT_EQ(y->precision().linears(), v1::PRECISION_FP8);
  EXPECT_EQ(y->precision().embedding(), v1::PRECISION_FP32);
  EXPECT_EQ(y->precision().lm_head(), v1::PRECISION_BF16);
  EXPECT_EQ(y->precision().fp8().recipe(), v1::SCALING_RECIPE_CURRENT);
  EXPECT_EQ(y->precision().fp8().format(), v1::FP8_FORMAT_E4M3);
  EXPECT_EQ(y->precision().fp8().amax_algorithm(), v1::AMAX_ALGORITHM_MOST_RECENT);
  EXPECT_EQ(y->precision().fp8().margin(), 1);
  ASSERT_EQ(y->precision().overrides_size(), 2);
  EXPECT_EQ(y->precision().overrides(0).linears(), v1::PRECISION_BF16);
  EXPECT_EQ(y->precision().overrides(1).linears(), v1::PRECISION_FP32);
}

TEST(Spec, ParseShortEnumSpellingsOnlyOnEnumFields) {
  auto s = ParseSpec("name: fp8\nbackend: cpu\nprecision: {linears: BF16, fp8: {recipe: Delayed, "
                     "format: hybrid, amax_algorithm: MAX}}\n");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->name(), "fp8");  // a string field is never rewritten
  EXPECT_EQ(s->precision().linears(), v1::PRECISION_BF16);
  EXPECT_EQ(s->precision().fp8().recipe(), v1::SCALING_RECIPE_DELAYED);
  EXPECT_EQ(s->precision().fp8().format(), v1::FP8_FORMAT_HYBRID);
  EXPECT_EQ(s->precision().fp8().amax_algorithm(), v1::AMAX_ALGORITHM_MAX);
}

TEST(Spec, ParseNumberLikeStringsStayStrings) {
  auto s = ParseSpec("name: 123\ndata: {train_path: '0001'}\n");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->name(), "123");
  EXPECT_EQ(s->data().train_path(), "0001");
}

TEST(Spec, ParseExplicitZeroIsKept) {
  auto s = ParseSpec("model: {d_model: 0}\ndata: {train_path: /d/t.bin}\n");
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->model().has_d_model());
  const absl::Status st = ValidateSpec(*s, 1, {}, false);
  EXPECT_EQ(std::string(st.message()).rfind("model.d_model: must be > 0", 0), 0u) << st;
}

void ExpectParseError(const std::string& text, const std::vector<std::string>& want) {
  auto s = ParseSpec(text);
  ASSERT_FALSE(s.ok()) << text;
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(s.status().message());
  for (const std::string& w : want) EXPECT_NE(msg.find(w), std::string::npos) << msg << " / " << w;
}

TEST(Spec, ParseUnknownFieldNamed) {
  ExpectParseError("model:\n  dmodel: 3\n", {"unknown field \"dmodel\"", "model.dmodel", "line 2"});
  ExpectParseError("{\"model\": {\"dModle\": 3}}", {"unknown field \"dModle\"", "model.dModle"});
  ExpectParseError("foo: 1\n", {"unknown field \"foo\"", "line 1"});
  ExpectParseError("precision:\n  overrides:\n    - {layer: 1, lin: bf16}\n",
                   {"precision.overrides[0].lin", "unknown field \"lin\"", "line 3"});
}

TEST(Spec, ParseWrongTypes) {
  ExpectParseError("model:\n  d_model: abc\n", {"model.d_model", "expected an integer", "abc", "line 2"});
  ExpectParseError("model:\n  d_model: 1.5\n", {"model.d_model", "expected an integer"});
  ExpectParseError("model: 3\n", {"model", "expected a mapping"});
  ExpectParseError("optimizer: {peak_lr: fast}\n", {"optimizer.peak_lr", "expected a number"});
  ExpectParseError("precision: {linears: fp16}\n", {"precision.linears", "unknown value \"fp16\""});
  ExpectParseError("precision: {overrides: {layer: 1}}\n", {"precision.overrides", "expected a list"});
  ExpectParseError("model: {d_model: 99999999999}\n", {"model.d_model", "out of range", "int32"});
  ExpectParseError("training: {seed: -1}\n", {"training.seed", "out of range", "uint64"});
  ExpectParseError("training: {steps: 9223372036854775808}\n", {"training.steps", "out of range"});
  ExpectParseError("model: {d_model: 1, d_model: 2}\n", {"model.d_model"});
}

TEST(Spec, ParseMalformedGivesLine) {
  ExpectParseError("model:\n  d_model: 3\n  n_layers: [1, 2\n", {"parse error", "line"});
  ExpectParseError("{\"model\": {\"d_model\": 3,}", {"parse error", "line"});
  ExpectParseError("", {"empty"});
  ExpectParseError("- 1\n- 2\n", {"expected a mapping"});
}

}  // namespace
}  // namespace fsdp8

namespace fsdp8 {
namespace {

// A spec of the release before the tuning section: both moved fields in their old places.
constexpr char kOldPlaces[] = R"(
data: {train_path: /data/train.bin}
training: {gemm_autotune: true}
precision: {fp8: {forward_fast_accumulation: false}}
)";
constexpr char kNewPlaces[] = R"(
data: {train_path: /data/train.bin}
tuning: {gemm_autotune: true, forward_fast_accumulation: false}
)";

TEST(SpecMovedFields, MigrateMovesEachToItsNewPlaceWithAWarningNamingIt) {
  auto old_spec = ParseSpec(kOldPlaces);
  ASSERT_TRUE(old_spec.ok()) << old_spec.status();
  v1::JobSpec moved = *old_spec;
  auto warnings = MigrateSpec(&moved);
  ASSERT_TRUE(warnings.ok()) << warnings.status();
  EXPECT_EQ(*warnings, (std::vector<std::string>{
                           "training.gemm_autotune: moved to tuning.gemm_autotune (read from the "
                           "old place for now; write it there)",
                           "precision.fp8.forward_fast_accumulation: moved to "
                           "tuning.forward_fast_accumulation (read from the old place for now; "
                           "write it there)"}));
  auto new_spec = ParseSpec(kNewPlaces);
  ASSERT_TRUE(new_spec.ok()) << new_spec.status();
  // The same spec as one written in the new places (the old sections left empty), and no warning
  // for that one.
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equivalent(moved, *new_spec))
      << moved.ShortDebugString() << " vs " << new_spec->ShortDebugString();
  v1::JobSpec again = *new_spec;
  EXPECT_TRUE(MigrateSpec(&again)->empty());
  // Defaults, resolution and the memory plan see the same spec either way.
  EXPECT_EQ(WithDefaults(*old_spec, 2).SerializeAsString(),
            WithDefaults(*new_spec, 2).SerializeAsString());
  auto r = ResolveSpec(*old_spec, 2, {}, false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->tuning().gemm_autotune());
  EXPECT_FALSE(r->tuning().forward_fast_accumulation());
  // Defaults of the new section: the ones the old places had.
  const v1::JobSpec d = WithDefaults(Valid(), 2);
  EXPECT_FALSE(d.tuning().gemm_autotune());
  EXPECT_TRUE(d.tuning().forward_fast_accumulation());
}

TEST(SpecMovedFields, BothPlacesDisagreeingIsRefusedNamingBoth) {
  auto s = ParseSpec(std::string(kOldPlaces) + "tuning: {gemm_autotune: false}\n");
  ASSERT_TRUE(s.ok()) << s.status();
  auto w = MigrateSpec(&*s);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.status().message(),
            "training.gemm_autotune: moved to tuning.gemm_autotune, which says false where the "
            "old place says true (give it only in tuning.gemm_autotune)");
  // Agreeing: accepted, one warning.
  auto same = ParseSpec(std::string(kOldPlaces) + "tuning: {gemm_autotune: true}\n");
  ASSERT_TRUE(same.ok());
  auto ok = MigrateSpec(&*same);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->size(), 2u);
}

// Stored records of the last release (a state db row's binary proto, a MANIFEST's JSON) hold the
// old fields under their old numbers and names: they still decode, and migrate on load.
TEST(SpecMovedFields, OldStoredSpecsDecodeAndMigrate) {
  auto old_spec = ParseSpec(kOldPlaces);
  ASSERT_TRUE(old_spec.ok());
  const std::string bytes = old_spec->SerializeAsString();  // as a state db row holds it
  v1::JobSpec row;
  ASSERT_TRUE(row.ParseFromString(bytes));
  const v1::JobSpec loaded = MigrateStoredSpec(row);
  EXPECT_TRUE(loaded.tuning().gemm_autotune());
  EXPECT_FALSE(loaded.tuning().forward_fast_accumulation());
  EXPECT_TRUE(CheckDefaulted(loaded, 0).ok()) << CheckDefaulted(loaded, 0);
  // A MANIFEST's JSON of the last release (proto field names).
  v1::JobSpec manifest_spec;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(
                  R"({"training": {"gemm_autotune": true},
                      "precision": {"fp8": {"forward_fast_accumulation": false}}})",
                  &manifest_spec)
                  .ok());
  const v1::JobSpec m = MigrateStoredSpec(manifest_spec);
  EXPECT_TRUE(m.tuning().gemm_autotune());
  EXPECT_FALSE(m.tuning().forward_fast_accumulation());
}

// What a worker checks: a resolved spec passes; one the coordinator did not resolve is refused
// naming the field that would have been filled in, never defaulted.
TEST(SpecResolved, CheckResolvedNamesTheFirstFieldNotFilledIn) {
  v1::JobSpec s;
  s.mutable_data()->set_train_path("/data/train.bin");
  auto r = ResolveSpec(s, 2, {}, false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(CheckResolved(*r, 2).ok()) << CheckResolved(*r, 2);
  EXPECT_EQ(r->training().microbatch(), 8);  // 16 / 2
  v1::JobSpec no_micro = *r;
  no_micro.mutable_training()->clear_microbatch();
  const absl::Status st = CheckResolved(no_micro, 2);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(st.message(), "spec: not resolved at world size 2")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "training.microbatch")) << st;
  // The rules too: resolved, but not at this world size.
  EXPECT_EQ(CheckResolved(*r, 3).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fsdp8
