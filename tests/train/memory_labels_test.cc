// The memory labels (common/memory_label.h) held against the memory plan, label by label: real
// training steps on the CPU backends (cpu-ref and cpu), and at each phase's peak of a steady step
// (step 2: delayed scaling has its history, the backends' scratch slots their size) the
// backend's labelled bytes (StepStats::*_labels, from Backend::account()) must
//   * sum to the phase's peak as the backend counts it (PeakAllocatedBytes), with no unlabelled
//     byte: an allocation the labelling missed shows here;
//   * equal, label by label, the memory plan's bytes for that phase (MemoryPlan::*_terms), which
//     the plan sums from the step plan's tables without running anything: a wrong label, or a
//     tensor the plan and the model disagree on, shows here.
// Models: the default job's shape (data/default-job.yaml) and small models shaped as the 1b
// preset (bench/presets/1b.yaml: head_dim 128 -> 16, ffn 2.75 d_model, vocab 16 d_model, seq =
// d_model, FP8 linears with BF16 attention), under every precision plan (block linears FP8, BF16,
// FP32; attention FP32, BF16; per-block overrides; FP8 under the delayed and the CURRENT
// recipes), with and without activation recompute, BF16 AdamW moments and kept FP8 weight codes.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/memory_label.h"
#include "common/memory_plan.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/support/ranks.h"
#include "tests/train/trainer_test_util.h"
#include "train/trainer.h"

namespace fsdp8 {
namespace {

using testing::TrainFile;

// The default job's model (d 128, 4 layers, 4 heads, ffn 384, vocab 256, seq 256), FP8 linears,
// global batch 2.
v1::JobSpec DefaultModel() {
  return testing::DefaultModelSpec(10);
}

// The 1b preset's proportions at d_model 64: 4 heads of 16, ffn 176, vocab 1024, seq 64, 2
// layers, two microbatches of 2; FP8 linears, BF16 attention and head.
v1::JobSpec OneBShaped() {
  v1::JobSpec s = DefaultModel();
  s.mutable_model()->set_d_model(64);
  s.mutable_model()->set_n_layers(2);
  s.mutable_model()->set_n_heads(4);
  s.mutable_model()->set_ffn_dim(176);
  s.mutable_model()->set_vocab_size(1024);
  s.mutable_model()->set_seq_len(64);
  s.mutable_training()->set_global_batch(4);
  s.mutable_training()->set_microbatch(2);
  s.mutable_precision()->set_attention(v1::PRECISION_BF16);
  return s;
}

struct Phase {
  const char* name;
  int64_t StepStats::*peak;
  LabelBytes StepStats::*labels;
  std::vector<MemoryTerm> MemoryPlan::*terms;
};
constexpr Phase kPhases[] = {
    {"forward", &StepStats::forward_peak_bytes, &StepStats::forward_peak_labels,
     &MemoryPlan::forward_terms},
    {"backward", &StepStats::backward_peak_bytes, &StepStats::backward_peak_labels,
     &MemoryPlan::backward_terms},
    {"optimizer", &StepStats::optimizer_peak_bytes, &StepStats::optimizer_peak_labels,
     &MemoryPlan::optimizer_terms},
};

// The phase's labels, measured and planned, one a line: the whole moment, to read a mismatch by.
std::string Table(const LabelBytes& measured, const std::vector<MemoryTerm>& planned) {
  std::string out;
  for (int l = 0; l + 1 < kNumMemoryLabels && l < static_cast<int>(planned.size()); ++l) {
    char line[128];
    std::snprintf(line, sizeof(line), "  %-20s measured %12lld plan %12lld\n",
                  kMemoryLabelNames[l], static_cast<long long>(measured[l]),
                  static_cast<long long>(planned[l].bytes));
    out += line;
  }
  return out;
}

// Three steps of `spec` on `world` ranks (threads, Gloo) on `backend`; rank 0's step 2 against
// the plan, every phase and label: a steady step (step 0 measures every scale first and runs no
// fused GEMM, step 1 grows the backends' kept scratch to the fused GEMMs' shapes).
void ExpectLabelsMatchPlan(const v1::JobSpec& spec_in, const std::string& backend, int world,
                           const std::string& what) {
  SCOPED_TRACE(what + " on " + backend + ", world " + std::to_string(world));
  // Resolved at this world size, as the coordinator sends it to the ranks.
  const absl::StatusOr<v1::JobSpec> resolved = ResolveSpec(spec_in, world, {}, false);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  const v1::JobSpec& spec = *resolved;
  MemoryPlanOptions options;  // the plan of the backend that runs: cpu-ref's compositions
  options.cpu_reference = backend == "cpu-ref";
  const absl::StatusOr<MemoryPlan> plan = PlanMemory(spec, world, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<StepStats> steps;
  int64_t after_init_unlabelled = -1;
  auto rank = [&](int r, Communicator* c, const MeshComms& mesh) {
    std::string err;
    BackendOptions backend_options;
    backend_options.cpu_fill_nan = true;
    std::unique_ptr<Backend> be = CreateBackend(backend, 0, &err, backend_options);
    ASSERT_NE(be, nullptr) << err;
    auto t = Trainer::Create(spec, r, world, be.get(), c, mesh);
    ASSERT_TRUE(t.ok()) << t.status();
    if (r == 0) {
      // After init: every live byte labelled, the labels summing to the backend's count.
      const LabelBytes& live = be->account().Live();
      int64_t sum = 0;
      for (int64_t b : live) sum += b;
      EXPECT_EQ(sum, be->AllocatedBytes()) << "after init";
      after_init_unlabelled = live[static_cast<int>(MemoryLabel::kUnlabelled)];
    }
    for (int k = 0; k < 3; ++k) {
      absl::StatusOr<StepStats> res = (*t)->Step(k, false, false);
      ASSERT_TRUE(res.ok()) << res.status();
      if (r == 0) steps.push_back(*res);
    }
  };
  // A hybrid-sharded spec (sharding.replicas R > 1) runs on its mesh's communicators.
  const int R = std::max(1, spec.sharding().replicas());
  if (R > 1) {
    testing::RunMeshRanks(R, world / R, rank);
  } else {
    testing::RunRanksOver(testing::Transport::kGloo, world,
                          [&](int r, Communicator* c) { rank(r, c, MeshComms{}); });
  }
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(after_init_unlabelled, 0) << "after init";
  const StepStats& st = steps[2];
  for (const Phase& ph : kPhases) {
    const LabelBytes& measured = st.*ph.labels;
    const std::vector<MemoryTerm>& planned = (*plan).*ph.terms;
    int64_t sum = 0;
    for (int64_t b : measured) sum += b;
    EXPECT_EQ(sum, st.*ph.peak) << ph.name << ": labelled bytes vs PeakAllocatedBytes";
    EXPECT_EQ(measured[static_cast<int>(MemoryLabel::kUnlabelled)], 0)
        << ph.name << ": unlabelled bytes";
    ASSERT_EQ(planned.size(), static_cast<size_t>(kNumMemoryLabels - 1));
    for (int l = 0; l + 1 < kNumMemoryLabels; ++l) {
      EXPECT_EQ(planned[l].name, kMemoryLabelNames[l]);
      EXPECT_EQ(measured[l], planned[l].bytes)
          << ph.name << " peak, label \"" << kMemoryLabelNames[l] << "\": measured vs plan\n"
          << Table(measured, planned);
    }
  }
}

// linears, attention, head and embedding of one precision plan.
struct Precisions {
  const char* name;
  v1::Precision linears, attention;
};
constexpr Precisions kPrecisions[] = {
    {"FP8 linears, f32 attention", v1::PRECISION_FP8, v1::PRECISION_FP32},
    {"FP8 linears, BF16 attention", v1::PRECISION_FP8, v1::PRECISION_BF16},
    {"BF16 linears, f32 attention", v1::PRECISION_BF16, v1::PRECISION_FP32},
    {"BF16 linears, BF16 attention", v1::PRECISION_BF16, v1::PRECISION_BF16},
    {"FP32 linears, f32 attention", v1::PRECISION_FP32, v1::PRECISION_FP32},
    {"FP32 linears, BF16 attention", v1::PRECISION_FP32, v1::PRECISION_BF16},
};

v1::JobSpec WithPrecision(v1::JobSpec s, const Precisions& p) {
  testing::AllPrecision(&s, p.linears);
  s.mutable_precision()->set_attention(p.attention);
  return s;
}

// `s` as it is, with recompute, and with BF16 moments and codes cast per gather.
void EveryVariant(v1::JobSpec s, const std::string& backend, int world, const std::string& what) {
  ExpectLabelsMatchPlan(s, backend, world, what);
  s.mutable_training()->set_activation_recompute(true);
  ExpectLabelsMatchPlan(s, backend, world, what + ", recompute");
  s.mutable_training()->set_activation_recompute(false);
  s.mutable_optimizer()->set_state_precision(v1::PRECISION_BF16);
  s.mutable_precision()->mutable_fp8()->set_keep_weight_codes(false);
  ExpectLabelsMatchPlan(s, backend, world, what + ", BF16 moments, codes cast per gather");
}

// Each precision plan (delayed scaling) in every variant.
void EveryPrecisionAndVariant(const v1::JobSpec& base, const std::string& model, int world) {
  for (const char* backend : {"cpu-ref", "cpu"}) {
    for (const Precisions& p : kPrecisions) {
      EveryVariant(WithPrecision(base, p), backend, world, model + ", " + p.name);
    }
  }
}

// Each precision plan with FP8 linears under the CURRENT recipe (activation and grad-output
// scales measured before every cast: f32 copies, per-linear casts, kept scale_inv copies) in
// every variant.
void CurrentRecipeEveryVariant(const v1::JobSpec& base, const std::string& model, int world) {
  for (const char* backend : {"cpu-ref", "cpu"}) {
    for (const Precisions& p : kPrecisions) {
      if (p.linears != v1::PRECISION_FP8) continue;
      v1::JobSpec s = WithPrecision(base, p);
      s.mutable_precision()->mutable_fp8()->set_recipe(v1::SCALING_RECIPE_CURRENT);
      EveryVariant(s, backend, world, model + ", " + p.name + ", CURRENT recipe");
    }
  }
}

TEST(MemoryLabels, DefaultModelEveryPrecisionPlan) {
  EveryPrecisionAndVariant(DefaultModel(), "default model", 1);
}

TEST(MemoryLabels, OneBShapedEveryPrecisionPlan) {
  EveryPrecisionAndVariant(OneBShaped(), "1b-shaped", 1);
}

TEST(MemoryLabels, DefaultModelCurrentRecipe) {
  CurrentRecipeEveryVariant(DefaultModel(), "default model", 1);
}

TEST(MemoryLabels, OneBShapedCurrentRecipe) {
  CurrentRecipeEveryVariant(OneBShaped(), "1b-shaped", 1);
}

// Two ranks: gathered units, unit gradients in flight and later microbatches' parts.
TEST(MemoryLabels, TwoRanks) {
  for (const char* backend : {"cpu-ref", "cpu"}) {
    ExpectLabelsMatchPlan(DefaultModel(), backend, 2, "default model");
    v1::JobSpec s = OneBShaped();
    ExpectLabelsMatchPlan(s, backend, 2, "1b-shaped");
    s.mutable_training()->set_activation_recompute(true);
    s.mutable_optimizer()->set_state_precision(v1::PRECISION_BF16);
    s.mutable_precision()->mutable_fp8()->set_keep_weight_codes(false);
    ExpectLabelsMatchPlan(s, backend, 2, "1b-shaped, recompute, BF16 moments, codes per gather");
  }
}

// Hybrid sharding (R replicas x S-rank shard groups): under SHARD_GROUP each rank holds a flat
// world-S rank's shards (padded to W x alignment); under WORLD the master weights and moments are
// 1/R pieces of them, fp32 buffers keep an f32 wire shard, the last microbatch's gradient shards
// turn into pieces as their replica-group reduce-scatters finish, and the optimizer copies out
// one wire piece at a time for its all-gather. 2 x 2 and 2 x 1 (one rank per shard group: no
// reduce-scatter), one to three microbatches, FP8, BF16 and FP32 linears.
TEST(MemoryLabels, HybridSharding) {
  auto mesh = [](v1::JobSpec s, int replicas, v1::OptimizerSharding sh) {
    s.mutable_sharding()->set_max_workers(4);
    s.mutable_sharding()->set_replicas(replicas);
    s.mutable_sharding()->set_optimizer_sharding(sh);
    return s;
  };
  constexpr auto kGroup = v1::OPTIMIZER_SHARDING_SHARD_GROUP;
  constexpr auto kWorld = v1::OPTIMIZER_SHARDING_WORLD;
  for (const char* backend : {"cpu-ref", "cpu"}) {
    v1::JobSpec d = DefaultModel();
    d.mutable_training()->set_global_batch(4);
    ExpectLabelsMatchPlan(mesh(d, 2, kGroup), backend, 4, "default model, 2 x 2 SHARD_GROUP");
    ExpectLabelsMatchPlan(mesh(d, 2, kWorld), backend, 4, "default model, 2 x 2 WORLD");
    v1::JobSpec b = OneBShaped();
    b.mutable_training()->set_global_batch(12);
    b.mutable_training()->set_microbatch(1);
    ExpectLabelsMatchPlan(mesh(b, 2, kWorld), backend, 4, "1b-shaped, 2 x 2 WORLD, 3 microbatches");
    b.mutable_training()->set_global_batch(4);
    ExpectLabelsMatchPlan(mesh(b, 2, kWorld), backend, 2, "1b-shaped, 2 x 1 WORLD, 2 microbatches");
    ExpectLabelsMatchPlan(mesh(b, 2, kGroup), backend, 2, "1b-shaped, 2 x 1 SHARD_GROUP");
    for (const Precisions& p : {kPrecisions[3], kPrecisions[4]}) {
      ExpectLabelsMatchPlan(mesh(WithPrecision(b, p), 2, kWorld), backend, 4,
                            std::string("1b-shaped, 2 x 2 WORLD, ") + p.name);
    }
  }
}

// Per-block precision overrides (the first block BF16, the last FP32), tied embeddings, bf16
// saved norm inputs, the CURRENT recipe.
TEST(MemoryLabels, OverridesTiedNormInputsAndCurrentRecipe) {
  for (const char* backend : {"cpu-ref", "cpu"}) {
    v1::JobSpec s = OneBShaped();
    auto* o = s.mutable_precision()->add_overrides();
    o->set_layer(0);
    o->set_linears(v1::PRECISION_BF16);
    o = s.mutable_precision()->add_overrides();
    o->set_layer(1);
    o->set_linears(v1::PRECISION_FP32);
    ExpectLabelsMatchPlan(s, backend, 1, "1b-shaped, overrides");
    s = OneBShaped();
    s.mutable_model()->set_tie_word_embeddings(true);
    s.mutable_training()->set_saved_norm_inputs(v1::PRECISION_BF16);
    ExpectLabelsMatchPlan(s, backend, 1, "1b-shaped, tied, bf16 norm inputs");
    s = OneBShaped();
    s.mutable_precision()->mutable_fp8()->set_recipe(v1::SCALING_RECIPE_CURRENT);
    ExpectLabelsMatchPlan(s, backend, 1, "1b-shaped, CURRENT recipe");
  }
}

// The optimizer deferred into the next forward (training.overlap_optimizer, the default) keeps
// the previous step's grad shards of the units not yet prefetched through the first microbatch's
// forward (its start, the embedding's and each block's forward, each unit's update before its
// shards go), and frees the rest as it goes; the serial order holds every shard from the step's
// start until ZeroGrads. Wide blocks, 16 tokens a step: the shards outweigh the activations, so
// the forward peaks with shards held: in the plan, some but fewer under the deferral than in the
// serial order, and the measured labels equal the plan's. One and two ranks, two microbatches,
// recompute, codes cast per gather, both CPU backends.
TEST(MemoryLabels, DeferredOptimizerGradsInTheForward) {
  v1::JobSpec s = DefaultModel();
  s.mutable_model()->set_d_model(128);
  s.mutable_model()->set_n_layers(3);
  s.mutable_model()->set_ffn_dim(512);
  s.mutable_model()->set_seq_len(16);
  s.mutable_training()->set_global_batch(2);
  const int grads = static_cast<int>(MemoryLabel::kGrads);
  for (int world : {1, 2}) {
    int64_t forward_grads[2] = {0, 0};  // serial, deferred
    for (bool overlap : {false, true}) {
      s.mutable_training()->set_overlap_optimizer(overlap);
      const absl::StatusOr<v1::JobSpec> resolved = ResolveSpec(s, world, {}, false);
      ASSERT_TRUE(resolved.ok()) << resolved.status();
      const absl::StatusOr<MemoryPlan> plan = PlanMemory(*resolved, world);
      ASSERT_TRUE(plan.ok()) << plan.status();
      forward_grads[overlap] = plan->forward_terms[grads].bytes;
    }
    EXPECT_GT(forward_grads[1], 0) << "world " << world;
    EXPECT_LT(forward_grads[1], forward_grads[0]) << "world " << world;
  }
  for (bool overlap : {true, false}) {
    s.mutable_training()->set_overlap_optimizer(overlap);
    const std::string what = overlap ? "deferred optimizer" : "serial optimizer";
    for (const char* backend : {"cpu-ref", "cpu"}) {
      v1::JobSpec v = s;
      ExpectLabelsMatchPlan(v, backend, 1, what);
      ExpectLabelsMatchPlan(v, backend, 2, what);
      v.mutable_training()->set_global_batch(4);
      v.mutable_training()->set_microbatch(1);
      ExpectLabelsMatchPlan(v, backend, 2, what + ", two microbatches");
      v.mutable_training()->set_activation_recompute(true);
      v.mutable_precision()->mutable_fp8()->set_keep_weight_codes(false);
      ExpectLabelsMatchPlan(v, backend, 1, what + ", recompute, codes cast per gather");
    }
  }
}

// The rowwise and blockwise recipes (precision.fp8.granularity): their linears' codes and scales
// made and freed around each GEMM, f32 copies of their BF16-travelling weights, no scaling state;
// for the whole job on one and two ranks, with recompute, and for one block among tensorwise ones.
TEST(MemoryLabels, RowwiseAndBlockwiseRecipes) {
  for (const char* backend : {"cpu-ref", "cpu"}) {
    for (v1::Fp8Granularity g : {v1::FP8_GRANULARITY_ROWWISE, v1::FP8_GRANULARITY_BLOCKWISE}) {
      const std::string name = g == v1::FP8_GRANULARITY_ROWWISE ? "rowwise" : "blockwise";
      v1::JobSpec s = DefaultModel();
      s.mutable_precision()->mutable_fp8()->set_granularity(g);
      ExpectLabelsMatchPlan(s, backend, 1, "default model, " + name);
      ExpectLabelsMatchPlan(s, backend, 2, "default model, " + name);
      s.mutable_training()->set_activation_recompute(true);
      ExpectLabelsMatchPlan(s, backend, 1, "default model, " + name + ", recompute");
      s = OneBShaped();
      auto* o = s.mutable_precision()->add_overrides();
      o->set_layer(1);
      o->set_linears(v1::PRECISION_FP8);
      o->set_granularity(g);
      ExpectLabelsMatchPlan(s, backend, 1, "1b-shaped, layer 1 " + name);
    }
  }
}

// The blockwise FP8 wire: a block's linears travel as E4M3 codes with 128 x 128 block scales, in
// whole 128-row bands per rank (shard and gathered codes and scales, no f32 copies, no W cast at
// use). d 192 (3 heads, one kv head), ffn 320: shards that do not divide into 128-row blocks, and
// at 3 ranks a rank whose down_proj shard is all padding; with and without kept codes, and under
// hybrid sharding (the WORLD optimizer rebuilds the codes and scales over the replicas).
TEST(MemoryLabels, BlockwiseFp8Wire) {
  v1::JobSpec s = DefaultModel();
  s.mutable_model()->set_d_model(192);
  s.mutable_model()->set_n_layers(2);
  s.mutable_model()->set_n_heads(3);
  s.mutable_model()->set_n_kv_heads(1);
  s.mutable_model()->set_ffn_dim(320);
  s.mutable_model()->set_seq_len(64);
  s.mutable_training()->set_global_batch(6);
  s.mutable_training()->set_microbatch(1);
  s.mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  for (const char* backend : {"cpu-ref", "cpu"}) {
    for (int world : {1, 2, 3}) ExpectLabelsMatchPlan(s, backend, world, "blockwise wire");
    v1::JobSpec u = s;
    u.mutable_precision()->mutable_fp8()->set_keep_weight_codes(false);
    ExpectLabelsMatchPlan(u, backend, 1, "blockwise wire, codes cast per gather");
    ExpectLabelsMatchPlan(u, backend, 3, "blockwise wire, codes cast per gather");
    v1::JobSpec h = s;
    h.mutable_training()->set_global_batch(4);
    h.mutable_sharding()->set_max_workers(4);
    h.mutable_sharding()->set_replicas(2);
    h.mutable_sharding()->set_optimizer_sharding(v1::OPTIMIZER_SHARDING_WORLD);
    ExpectLabelsMatchPlan(h, backend, 4, "blockwise wire, 2 x 2 WORLD");
  }
}

}  // namespace
}  // namespace fsdp8
