// The step plan (common/step_plan.h): each block's path, the fused groups, what the forward keeps
// and the head's chunk rows, against the rules written out by hand.
#include "common/step_plan.h"

#include <cstdint>
#include <vector>

#include "common/memory_plan.h"
#include "common/spec.h"
#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

// d 32, 2 layers, 2 heads (head_dim 16), ffn 64, vocab 256, seq 32; one sequence per microbatch,
// global batch 2; FP8 block linears under delayed scaling, BF16 attention, fused projections.
v1::JobSpec Tiny() {
  v1::JobSpec s;
  auto* m = s.mutable_model();
  m->set_d_model(32);
  m->set_n_layers(2);
  m->set_n_heads(2);
  m->set_ffn_dim(64);
  m->set_vocab_size(256);
  m->set_seq_len(32);
  s.mutable_training()->set_global_batch(2);
  s.mutable_training()->set_microbatch(1);
  s.mutable_sharding()->set_alignment(4);
  s.mutable_precision()->set_attention(v1::PRECISION_BF16);
  s.mutable_precision()->mutable_fp8()->set_fused_projections(true);
  return WithDefaults(s, 1);
}

StepPlan Plan(const v1::JobSpec& s, int world = 1, StepPlanOptions o = {}) {
  auto p = MakeStepPlan(s, world, BackendCapsOf("cpu"), o);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : StepPlan{};
}

// Groups share scales only for FP8 linears with BF16 attention under delayed scaling, with
// head_dim % 8 == 0 (q/k/v) and ffn_dim % 4 == 0 (gate/up); they run as one GEMM unless the
// unfused option asks for one GEMM per linear.
TEST(StepPlan, FusionRule) {
  StepPlan p = Plan(Tiny());
  ASSERT_EQ(p.blocks.size(), 2u);
  for (const BlockPlan& b : p.blocks) {
    EXPECT_TRUE(b.fp8_bf16);
    EXPECT_TRUE(b.group_qkv && b.group_mlp && b.fused_qkv && b.fused_mlp);
    EXPECT_TRUE(b.recast_down);
  }
  StepPlanOptions unfused;
  unfused.unfused_projections = true;
  p = Plan(Tiny(), 1, unfused);
  EXPECT_TRUE(p.blocks[0].group_qkv && p.blocks[0].group_mlp);
  EXPECT_FALSE(p.blocks[0].fused_qkv || p.blocks[0].fused_mlp);

  v1::JobSpec s = Tiny();
  s.mutable_precision()->mutable_fp8()->set_recipe(v1::SCALING_RECIPE_CURRENT);
  p = Plan(s);
  EXPECT_FALSE(p.blocks[0].group_qkv || p.blocks[0].group_mlp || p.blocks[0].recast_down);

  s = Tiny();
  s.mutable_precision()->set_attention(v1::PRECISION_FP32);
  p = Plan(s);
  EXPECT_FALSE(p.blocks[0].fp8_bf16 || p.blocks[0].group_qkv || p.blocks[0].recast_down);

  s = Tiny();
  s.mutable_model()->set_d_model(24);  // head_dim 12: q/k/v not grouped; ffn 64: gate/up are
  p = Plan(s);
  EXPECT_FALSE(p.blocks[0].group_qkv);
  EXPECT_TRUE(p.blocks[0].group_mlp && p.blocks[0].fused_mlp);

  s = Tiny();
  auto* o = s.mutable_precision()->add_overrides();
  o->set_layer(1);
  o->set_linears(v1::PRECISION_BF16);
  p = Plan(s);
  EXPECT_TRUE(p.blocks[0].fused_qkv);
  EXPECT_EQ(p.blocks[1].linears, v1::PRECISION_BF16);
  EXPECT_FALSE(p.blocks[1].fp8_bf16 || p.blocks[1].group_qkv);
}

int64_t SavedBytes(const BlockPlan& b) {
  int64_t n = 0;
  for (const PlannedTensor& t : b.saved) n += t.bytes;
  return n;
}

// N = 32 tokens, C = 32, F = 64, H = 2, T = 32, by hand.
TEST(StepPlan, SavedTensorsByHand) {
  // The fused FP8 block: x_in, h (N, C) f32; rstd1, rstd2 (N) f32; lse (1, 2, 32) f32; q/k/v's
  // shared input codes, o's, gate/up's shared ones (N, C) e4m3; qkv16 (N, 96) bf16, att16 (N, C)
  // bf16, gate_up16 (N, 128) bf16; no down_proj codes (recast in the backward).
  const int64_t fused = 2 * 32 * 32 * 4 + 2 * 32 * 4 + 2 * 32 * 4 + 3 * 32 * 32 + 32 * 96 * 2 +
                        32 * 32 * 2 + 32 * 128 * 2;
  EXPECT_EQ(SavedBytes(Plan(Tiny()).blocks[0]), fused);
  // The generic FP32 block: x_in, n1, q, k, v, att, h, n2 (N, C) and gate, up, act (N, F) f32;
  // rstd1, rstd2, lse.
  v1::JobSpec s = Tiny();
  s.mutable_precision()->set_linears(v1::PRECISION_FP32);
  s.mutable_precision()->set_attention(v1::PRECISION_FP32);
  const int64_t generic = 8 * 32 * 32 * 4 + 3 * 32 * 64 * 4 + 2 * 32 * 4 + 2 * 32 * 4;
  EXPECT_EQ(SavedBytes(Plan(s).blocks[0]), generic);
  // Recompute keeps only the block input; the rest is recomputed.
  s.mutable_training()->set_activation_recompute(true);
  const StepPlan r = Plan(s);
  EXPECT_EQ(SavedBytes(r.blocks[0]), 32 * 32 * 4);
  int64_t again = 0;
  for (const PlannedTensor& t : r.blocks[0].recomputed) again += t.bytes;
  EXPECT_EQ(again, generic);
}

int64_t Bytes(const std::vector<PlannedTensor>& table) {
  int64_t b = 0;
  for (const PlannedTensor& t : table) b += t.bytes;
  return b;
}

// The transients at a block's and the head's largest moments, by hand (N = 32, C = 32, F = 64,
// q/k/v widths 32, V = 256; one f32 (N, C) is 4,096 bytes, one f32 (N, F) 8,192).
TEST(StepPlan, WorkTablesByHand) {
  v1::JobSpec s = Tiny();
  s.mutable_precision()->set_linears(v1::PRECISION_FP32);
  s.mutable_precision()->set_attention(v1::PRECISION_FP32);
  StepPlan p = Plan(s);
  // The generic FP32 block's forward: the MLP's f32 output and the block output (the
  // attention's moment holds only o).
  EXPECT_EQ(Bytes(p.blocks[0].forward_work), 2 * 4096);
  // Its backward: dout and the SwiGLU's dact, dgate, dup at the MLP's moment; dh, datt, dq, dk,
  // dv at the attention's (the MLP's saved n2, gate, up, act are dropped by then).
  EXPECT_EQ(Bytes(p.blocks[0].backward_mlp), 4096 + 3 * 8192);
  EXPECT_EQ(Bytes(p.blocks[0].backward_attention), 5 * 4096);
  int64_t after_mlp = 0;
  for (const PlannedTensor& t : p.blocks[0].saved) {
    if (t.lifetime == Lifetime::kBlock) after_mlp += t.bytes;
  }
  // x_in, n1, q, k, v, att, h (N, C) f32, rstd1, rstd2 (N) and lse (1, 2, 32) stay to the
  // block's end.
  EXPECT_EQ(after_mlp, 7 * 4096 + 2 * 32 * 4 + 2 * 32 * 4);
  // The BF16 head's one full chunk of 32 rows: nf16 (N, C) bf16, the bf16 logit gradient (N, V),
  // the f32 logits (32, V); beside them x, nf, dnf (N, C) f32, rstdf (N) and the CPU backends'
  // largest scratch above those tables. The candidates (kernels/backend.cc: a bf16 GEMM widens
  // both operands to f32): the logits GEMM's nf16 rows and W, (32 * 32 + 256 * 32) f32 = 36,864
  // bytes; the cross-entropy through f32, 32 * 256 f32 = 32,768; dnf's GEMM widens the chunk's
  // bf16 gradient and W, (32 * 256 + 256 * 32) f32, after the chunk's f32 logits (32 * 256 f32,
  // in head_logits) are freed: 32,768 more than head_logits; dW's GEMM over every row, (256 * 32 +
  // 32 * 32) f32 less the freed logits: 4,096. The largest is the logits GEMM's.
  EXPECT_EQ(Bytes(p.head_logits), 32 * 32 * 2 + 32 * 256 * 2 + 32 * 256 * 4);
  EXPECT_EQ(Bytes(p.head_work), 3 * 4096 + 32 * 4 + (32 * 32 + 256 * 32) * 4);

  // The fused FP8 block with BF16 attention, backward on the CPU backends: the MLP's moment
  // (dout; dact16 (N, F) and dn2 (N, C) bf16; gate_up's grad-output codes and their transpose,
  // (N, 2F) e4m3 each; the SwiGLU backward's scratch 4n + 4(n + 2) + 20n bytes, n = N * F) and
  // the attention's (dh; dq16, dk16, dv16, datt16; dense q/k/v copies (N, 96) bf16 and
  // (7 * 32 + 6 * 32) * N f32).
  const int64_t n = 32 * 64;
  p = Plan(Tiny());
  EXPECT_EQ(Bytes(p.blocks[0].backward_mlp),
            4096 + n * 2 + 32 * 32 * 2 + 2 * 32 * 128 + 4 * n + 4 * (n + 2) + 20 * n);
  EXPECT_EQ(Bytes(p.blocks[0].backward_attention),
            4096 + 4 * 32 * 32 * 2 + 32 * 96 * 2 + (7 * 32 + 6 * 32) * 32 * 4);
  // On CUDA no composed-op scratch; the attention's moment takes cuDNN's deterministic
  // workspace, B * H * T * T bf16.
  auto cuda = MakeStepPlan(Tiny(), 1, BackendCapsOf("cuda"), {});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  EXPECT_EQ(Bytes(cuda->blocks[0].backward_mlp), 4096 + n * 2 + 32 * 32 * 2 + 2 * 32 * 128);
  EXPECT_EQ(Bytes(cuda->blocks[0].backward_attention), 4096 + 4 * 32 * 32 * 2 + 2 * 32 * 32 * 2);
  // The CUDA block's forward: the output beside down_proj's input codes, cast for the GEMM and
  // dropped (the backward recasts them under delayed scaling).
  EXPECT_EQ(Bytes(cuda->blocks[0].forward_work), 4096 + 32 * 64);
}

// The units are the shard plan's: at 2 ranks (quantum 8), the embedding's bf16 256 * 32 = 8192
// elements hold 4096 per rank; a block's FP8 linears 10240 -> 5120 and its bf16 norms 64 -> 32;
// the head's bf16 norm and lm_head 32 + 8192 = 8224 -> 4112.
TEST(StepPlan, UnitsAreTheShardPlans) {
  const StepPlan p = Plan(Tiny(), 2);
  ASSERT_EQ(p.units.size(), 4u);
  EXPECT_EQ(p.units[0].buffers.at(0).shard, 4096);
  ASSERT_EQ(p.units[1].buffers.size(), 2u);
  EXPECT_EQ(p.units[1].buffers[0].wire, WireDtype::kFp8);
  EXPECT_EQ(p.units[1].buffers[0].shard, 5120);
  EXPECT_EQ(p.units[1].buffers[1].padded, 64);
  EXPECT_EQ(p.units[3].buffers.at(0).shard, 4112);
  EXPECT_EQ(p.tokens, 32);
  EXPECT_EQ(p.microbatches, 1);
}

TEST(StepPlan, HeadChunkRows) {
  const int64_t mib512 = kDefaultHeadChunkLogitBytes;
  EXPECT_EQ(mib512, int64_t{512} << 20);
  EXPECT_EQ(HeadChunkRows(8192, 32768, mib512), 4096);  // 512 MiB / (32768 * 4)
  // 536870912 / (128256 * 4) = 1046 rows, rounded down to 1024 (a multiple of 128).
  EXPECT_EQ(HeadChunkRows(10000, 128256, mib512), 1024);
  EXPECT_EQ(HeadChunkRows(100, 256, mib512), 100);  // the whole microbatch
  EXPECT_EQ(HeadChunkRows(100, 256, 1), 1);
  EXPECT_EQ(HeadChunkRows(1000, 256, 200 * 1024), 128);  // 200 rows, rounded down to 128
  EXPECT_EQ(HeadChunkRows(1000, 256, 100 * 1024), 100);  // 128 rows or fewer: as they come
}

// The memory plan follows the model's options through the step plan: unfused projections take
// less GEMM scratch on the CPU (N x F rather than N x 2F for gate/up).
TEST(StepPlan, MemoryPlanFollowsTheUnfusedOption) {
  v1::JobSpec s = Tiny();
  s.mutable_model()->set_seq_len(256);
  auto fused = PlanMemory(WithDefaults(s, 1), 1);
  StepPlanOptions o;
  o.unfused_projections = true;
  auto unfused = PlanMemory(WithDefaults(s, 1), 1, o);
  ASSERT_TRUE(fused.ok() && unfused.ok());
  EXPECT_LT(unfused->peak_bytes, fused->peak_bytes);
}

// The FP8 recipes are plan entries: each linear's granularity and scaling recipe, and its
// operands' scale counts (hand-computed below); a rowwise / blockwise block runs the generic path
// of a BF16 block (the same saved tensors); a rowwise unit's linears travel in BF16, a blockwise
// unit's as FP8 codes with 128 x 128 block scales (its blockwise FP8 wire buffers).
TEST(StepPlan, RecipeEntriesPerLinear) {
  // d 192 (2 heads of 96), ffn 320, seq 200, one sequence per microbatch: N = 200 tokens.
  v1::JobSpec s;
  auto* m = s.mutable_model();
  m->set_d_model(192);
  m->set_n_layers(2);
  m->set_n_heads(2);
  m->set_ffn_dim(320);
  m->set_vocab_size(256);
  m->set_seq_len(200);
  s.mutable_training()->set_global_batch(2);
  s.mutable_training()->set_microbatch(1);
  s.mutable_sharding()->set_alignment(4);
  auto* o = s.mutable_precision()->add_overrides();
  o->set_layer(1);
  o->set_linears(v1::PRECISION_FP8);
  o->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  StepPlan p = Plan(WithDefaults(s, 1));
  ASSERT_EQ(p.blocks.size(), 2u);
  const BlockPlan& t = p.blocks[0];
  const BlockPlan& b = p.blocks[1];
  EXPECT_EQ(t.granularity, v1::FP8_GRANULARITY_TENSORWISE);
  EXPECT_EQ(b.granularity, v1::FP8_GRANULARITY_BLOCKWISE);
  EXPECT_EQ(b.linears, v1::PRECISION_FP8);
  for (const PlannedLinear& pl : t.proj) {
    EXPECT_EQ(pl.granularity, v1::FP8_GRANULARITY_TENSORWISE) << pl.name;
    EXPECT_EQ(pl.recipe, v1::SCALING_RECIPE_DELAYED) << pl.name;
    EXPECT_EQ(pl.forward_scales + pl.dx_scales + pl.dw_scales, 0) << pl.name;
  }
  // Blockwise, N = 200 (2 tiles of tokens): q_proj 192 -> 192 (2 tiles / blocks each way):
  // forward X 200 * 2 + W 2 * 2 = 404; dX dY 200 * 2 + Wᵀ 2 * 2 = 404; dW dYᵀ 192 * 2 + Xᵀ 192 * 2
  // = 768. gate_proj 192 -> 320 (3 blocks of outputs): forward 200 * 2 + 3 * 2 = 406; dX 200 * 3 +
  // 2 * 3 = 606; dW 320 * 2 + 192 * 2 = 1024.
  ASSERT_EQ(b.proj.size(), 7u);
  EXPECT_EQ(b.proj[0].name, "q_proj");
  EXPECT_EQ(b.proj[0].granularity, v1::FP8_GRANULARITY_BLOCKWISE);
  EXPECT_EQ(b.proj[0].recipe, v1::SCALING_RECIPE_CURRENT);
  EXPECT_EQ(b.proj[0].precision, v1::PRECISION_FP8);
  EXPECT_EQ(b.proj[0].forward_scales, 404);
  EXPECT_EQ(b.proj[0].dx_scales, 404);
  EXPECT_EQ(b.proj[0].dw_scales, 768);
  EXPECT_EQ(b.proj[4].name, "gate_proj");
  EXPECT_EQ(b.proj[4].forward_scales, 406);
  EXPECT_EQ(b.proj[4].dx_scales, 606);
  EXPECT_EQ(b.proj[4].dw_scales, 1024);
  // No groups, fused GEMMs or recast; the generic path (f32 activations).
  EXPECT_FALSE(b.fp8_bf16 || b.group_qkv || b.group_mlp || b.fused_qkv || b.fused_mlp ||
               b.recast_down);
  // The same saved tensors as the block with BF16 linears.
  v1::JobSpec bf = s;
  bf.mutable_precision()->mutable_overrides(0)->set_linears(v1::PRECISION_BF16);
  bf.mutable_precision()->mutable_overrides(0)->clear_granularity();
  const StepPlan pb = Plan(WithDefaults(bf, 1));
  ASSERT_EQ(pb.blocks[1].saved.size(), b.saved.size());
  for (size_t i = 0; i < b.saved.size(); ++i) {
    EXPECT_EQ(b.saved[i].name, pb.blocks[1].saved[i].name);
    EXPECT_EQ(b.saved[i].bytes, pb.blocks[1].saved[i].bytes);
  }
  // Units: layers.0 has its fp8 linears and bf16 norms; layers.1 (blockwise) its linears in two
  // blockwise FP8 wire buffers, in_features 192 (q, k, v, o 2 bands each, gate and up 3: 14 bands
  // of 2 blocks) and 320 (down: 2 bands of 3 blocks), then its bf16 norms.
  ASSERT_EQ(p.units[1].buffers.size(), 2u);
  EXPECT_EQ(p.units[1].buffers[0].padded_scales, 0);  // tensorwise: no block scales
  ASSERT_EQ(p.units[2].buffers.size(), 3u);
  EXPECT_EQ(p.units[2].buffers[0].wire, WireDtype::kFp8);
  EXPECT_EQ(p.units[2].buffers[0].padded, 14 * 128 * 192);
  EXPECT_EQ(p.units[2].buffers[0].padded_scales, 14 * 2);
  EXPECT_EQ(p.units[2].buffers[1].wire, WireDtype::kFp8);
  EXPECT_EQ(p.units[2].buffers[1].padded, 2 * 128 * 320);
  EXPECT_EQ(p.units[2].buffers[1].shard_scales, 2 * 3);
  EXPECT_EQ(p.units[2].buffers[2].wire, WireDtype::kBf16);

  // Rowwise for the whole job: current scaling; gate_proj forward X 200 + W 320 = 520, dX dY 200 +
  // Wᵀ 192 = 392, dW dYᵀ 320 + Xᵀ 192 = 512.
  v1::JobSpec r = s;
  r.mutable_precision()->clear_overrides();
  r.mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_ROWWISE);
  p = Plan(WithDefaults(r, 1));
  for (const BlockPlan& blk : p.blocks) {
    EXPECT_EQ(blk.granularity, v1::FP8_GRANULARITY_ROWWISE);
    EXPECT_EQ(blk.proj[4].recipe, v1::SCALING_RECIPE_CURRENT);
    EXPECT_EQ(blk.proj[4].forward_scales, 520);
    EXPECT_EQ(blk.proj[4].dx_scales, 392);
    EXPECT_EQ(blk.proj[4].dw_scales, 512);
  }
}

}  // namespace
}  // namespace fsdp8
