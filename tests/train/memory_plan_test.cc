// The memory plan (common/memory_plan.h) against what the CPU backend counts: each spec trains a
// few steps on 1 or 2 ranks (threads, Gloo) and the plan's peak must be within 10% of the peak
// the trainer reports (StepStats.peak_memory_bytes, Backend::PeakAllocatedBytes through the same
// DevBuf path the workers use) at a steady step.
#include <cstdio>
#include <string>

#include "common/spec.h"
#include "common/memory_plan.h"
#include "gtest/gtest.h"
#include "tests/train/trainer_test_util.h"

namespace fsdp8 {
namespace {

using testing::Train;
using testing::TrainFile;

// The default model (d 128, 4 layers, seq 256, vocab 256, FP8 block linears), global batch
// `batch`.
v1::JobSpec DefaultModel(int batch) {
  v1::JobSpec s;
  s.mutable_data()->set_train_path(TrainFile());
  s.mutable_training()->set_global_batch(batch);
  s.mutable_training()->set_steps(10);
  s.mutable_optimizer()->set_warmup_steps(2);
  s.set_backend("cpu");
  return s;
}

// Rank 0's peak of step 1 (a steady step: delayed scaling has its history) against the plan.
void ExpectWithinTenPercent(const v1::JobSpec& spec, int world, const char* what) {
  auto plan = PlanMemory(WithDefaults(spec, world), world);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto out = Train(spec, world, 2);
  const int64_t measured = out[0].results[1].peak_memory_bytes;
  const double ratio = static_cast<double>(plan->peak_bytes) / static_cast<double>(measured);
  std::printf("%-40s world %d: predicted %lld (%s), measured %lld, ratio %.3f\n", what, world,
              static_cast<long long>(plan->peak_bytes), plan->peak_phase.c_str(),
              static_cast<long long>(measured), ratio);
  const auto& r = out[0].results[1];
  std::printf("    phases predicted %lld %lld %lld, measured %lld %lld %lld\n",
              static_cast<long long>(plan->forward_peak_bytes),
              static_cast<long long>(plan->backward_peak_bytes),
              static_cast<long long>(plan->optimizer_peak_bytes),
              static_cast<long long>(r.forward_peak_bytes),
              static_cast<long long>(r.backward_peak_bytes),
              static_cast<long long>(r.optimizer_peak_bytes));
  for (const MemoryTerm& t : plan->terms) {
    std::printf("    %-20s %12lld\n", t.name.c_str(), static_cast<long long>(t.bytes));
  }
  EXPECT_GT(ratio, 0.9) << what;
  EXPECT_LT(ratio, 1.1) << what;
}

TEST(MemoryPlan, DefaultModelOneAndTwoRanks) {
  ExpectWithinTenPercent(DefaultModel(2), 1, "default model");
  ExpectWithinTenPercent(DefaultModel(2), 2, "default model");
}

// Smaller shapes for the other paths (seconds each): d 64, seq 64.
v1::JobSpec Small() {
  v1::JobSpec s = DefaultModel(4);
  s.mutable_model()->set_d_model(64);
  s.mutable_model()->set_ffn_dim(192);
  s.mutable_model()->set_seq_len(64);
  return s;
}

TEST(MemoryPlan, Bf16AttentionFusedFp8AndGqa) {
  v1::JobSpec s = Small();
  s.mutable_precision()->set_attention(v1::PRECISION_BF16);
  ExpectWithinTenPercent(s, 2, "FP8, BF16 attention");
  s.mutable_model()->set_n_kv_heads(2);
  ExpectWithinTenPercent(s, 2, "GQA, FP8, BF16 attention");
  s.mutable_training()->set_saved_norm_inputs(v1::PRECISION_BF16);
  ExpectWithinTenPercent(s, 2, "GQA, FP8, BF16 attention, bf16 norm inputs");
  s.mutable_training()->set_saved_norm_inputs(v1::PRECISION_FP32);
  s.mutable_precision()->set_attention(v1::PRECISION_FP32);
  ExpectWithinTenPercent(s, 1, "GQA, FP8");
}

TEST(MemoryPlan, ActivationRecompute) {
  v1::JobSpec s = Small();
  s.mutable_training()->set_activation_recompute(true);
  ExpectWithinTenPercent(s, 1, "recompute");
  s.mutable_training()->set_activation_recompute(true);
  s.mutable_precision()->set_attention(v1::PRECISION_BF16);
  ExpectWithinTenPercent(s, 2, "recompute, BF16 attention");
  s.mutable_training()->set_saved_norm_inputs(v1::PRECISION_BF16);
  ExpectWithinTenPercent(s, 2, "recompute, BF16 attention, bf16 norm inputs");
}

// Fp8Recipe.keep_weight_codes false: no FP8 wire shards; each gather's cast slice (and, on one
// rank, the gathered unit itself).
TEST(MemoryPlan, FP8WeightCodesCastPerGather) {
  v1::JobSpec s = Small();
  s.mutable_precision()->mutable_fp8()->set_keep_weight_codes(false);
  ExpectWithinTenPercent(s, 1, "codes cast per gather");
  ExpectWithinTenPercent(s, 2, "codes cast per gather");
  s.mutable_training()->set_activation_recompute(true);
  s.mutable_precision()->set_attention(v1::PRECISION_BF16);
  ExpectWithinTenPercent(s, 2, "codes cast per gather, recompute");
}

TEST(MemoryPlan, Bf16AndFp32LinearsMicrobatchesTied) {
  v1::JobSpec s = Small();
  testing::AllPrecision(&s, v1::PRECISION_BF16);
  s.mutable_training()->set_microbatch(1);
  ExpectWithinTenPercent(s, 2, "BF16, microbatches");
  testing::AllPrecision(&s, v1::PRECISION_FP32);
  s.mutable_model()->set_tie_word_embeddings(true);
  ExpectWithinTenPercent(s, 1, "FP32, tied");
}

// A long sequence on one block (seq 2048, one sequence per step): the CPU attention's two T x T
// f32 matrices (32 MiB) and the GEMMs' f32 operands, counted by the backend as its scratch slots,
// are most of the peak; the plan holds them too. Both ways, f32 and BF16 attention.
TEST(MemoryPlan, CpuAttentionScratchAtLongSequence) {
  v1::JobSpec s = Small();
  s.mutable_model()->set_n_layers(1);
  s.mutable_model()->set_seq_len(2048);
  s.mutable_training()->set_global_batch(1);
  s.mutable_training()->set_steps(3);
  ExpectWithinTenPercent(s, 1, "seq 2048, f32 attention");
  s.mutable_precision()->set_attention(v1::PRECISION_BF16);
  ExpectWithinTenPercent(s, 1, "seq 2048, BF16 attention");
}

}  // namespace
}  // namespace fsdp8
