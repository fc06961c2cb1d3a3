// The cost model's arithmetic against hand-computed cases: the overlap schedule of known unit
// times, a GEMM's and a collective's time from their rates, the optimizer's bytes, the GEMM
// term of a whole step from its FLOPs, the calibration file's rules, the memory-bound passes
// each block path runs (bytes counted by hand) and the CPU ranks' shared-host slowdown.
#include "common/cost_model.h"

#include <string>

#include "common/spec.h"
#include "common/step_plan.h"
#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

constexpr double kEps = 1e-12;

// Two units: forward 10 each, backward 20 each, all-gather 4 each, reduce-scatter 3 each.
// Forward: AG0 [0,4] (exposed), compute 0 [4,14], AG1 issued at 4 [4,8] (hidden), compute 1
// [14,24]. Backward: unit 1 stays gathered, compute [24,44]; AG0 issued at 24 [24,28] (hidden);
// RS1 issued at 44 [44,47] (hidden by unit 0's backward [44,64]); RS0 [64,67] (exposed).
TEST(CostModel, ScheduleOneGemmOneAllGatherOverlap) {
  std::vector<UnitTimes> u(2);
  for (UnitTimes& x : u) {
    x.forward = 10;
    x.backward = 20;
    x.gather = 4;
    x.reduce = 3;
  }
  const ScheduleResult r = Schedule(u, 1);
  EXPECT_NEAR(r.compute_s, 60, kEps);
  EXPECT_NEAR(r.end_s, 67, kEps);
  EXPECT_NEAR(r.exposed_s, 7, kEps);   // the first all-gather and the last reduce-scatter
  EXPECT_NEAR(r.comm_s, 18, kEps);     // AG0, AG1, AG0 again, RS1, RS0
}

// One unit: its all-gather precedes its compute, its reduce-scatter follows it: all exposed.
TEST(CostModel, ScheduleSingleUnitNothingHidden) {
  std::vector<UnitTimes> u(1);
  u[0] = {5, 7, 2, 3, 0};
  const ScheduleResult r = Schedule(u, 1);
  EXPECT_NEAR(r.end_s, 2 + 5 + 7 + 3, kEps);
  EXPECT_NEAR(r.exposed_s, 5, kEps);
}

// A gather longer than the compute it hides behind: the compute waits. Units forward 1, gather
// 6: AG0 [0,6], c0 [6,7], AG1 issued 6 [6,12], c1 [12,13]; backward c1 [13,15] (backward 2),
// AG0 issued 13 [13,19], RS1 issued 15 [19,19] (0 s), c0 [19,21]. End 21, compute 6.
TEST(CostModel, ScheduleComputeWaitsForSlowGather) {
  std::vector<UnitTimes> u(2);
  for (UnitTimes& x : u) x = {1, 2, 6, 0, 0};
  const ScheduleResult r = Schedule(u, 1);
  EXPECT_NEAR(r.end_s, 21, kEps);
  EXPECT_NEAR(r.exposed_s, 15, kEps);
}

// Hybrid: the first case with a replica reduction of 5 per unit after the last microbatch:
// RS1 [44,47] -> replica 1 [47,52] (hidden); RS0 [64,67] -> replica 0 [67,72] (exposed).
// With two microbatches the replica reductions follow only the second one.
TEST(CostModel, ScheduleHybridReplicaAllReduceExposed) {
  std::vector<UnitTimes> u(2);
  for (UnitTimes& x : u) x = {10, 20, 4, 3, 5};
  const ScheduleResult one = Schedule(u, 1);
  EXPECT_NEAR(one.end_s, 72, kEps);
  EXPECT_NEAR(one.exposed_s, 12, kEps);
  // Microbatch 2 starts at 64 (compute clock): AG0 issued at 64 queues behind RS0 [64,67]:
  // [67,71]; c0 [71,81]; AG1 [71,75] hidden; c1 [81,91]; backward c1 [91,111], AG0 [91,95],
  // RS1 [111,114] -> replica [114,119]; c0 [111,131]; RS0 [131,134] -> replica [134,139].
  const ScheduleResult two = Schedule(u, 2);
  EXPECT_NEAR(two.compute_s, 120, kEps);
  EXPECT_NEAR(two.end_s, 139, kEps);
  EXPECT_NEAR(two.comm_s, 2 * 18 + 2 * 5, kEps);
}

Calibration TwoClassCalibration() {
  Calibration c;
  c.backend = "cpu";
  c.intra_link = c.inter_link = "shm";
  c.gemm = {{"fp8", 2048, 128, 128, 0.1}, {"fp8", 128, 384, 2048, 0.05}, {"bf16", 1024, 1024, 1024, 0.2}};
  c.memory_gbps = 10;
  c.optimizer_gbps = 28;
  c.attention_forward_tflops = 0.01;
  c.attention_backward_tflops = 0.005;
  CollectiveCurve ag{"shm", CollectiveOp::kAllGather, 2, 5e-6, {{1e3, 1}, {1e6, 10}}};
  CollectiveCurve rs{"shm", CollectiveOp::kReduceScatter, 2, 5e-6, {{1e3, 1}, {1e6, 10}}};
  CollectiveCurve ar{"shm", CollectiveOp::kAllReduce, 4, 0, {{1e3, 2}}};
  c.collectives = {ag, rs, ar};
  return c;
}

TEST(CostModel, GemmSecondsTakesTheNearestShapeClass) {
  const Calibration c = TwoClassCalibration();
  // (2048, 384, 128) is nearer (2048, 128, 128) (distance ln 3) than (128, 384, 2048) (2 ln 16).
  EXPECT_NEAR(GemmSeconds(c, "fp8", 2048, 384, 128), 2.0 * 2048 * 384 * 128 / 0.1e12, 1e-15);
  // A weight-gradient shape takes the second class.
  EXPECT_NEAR(GemmSeconds(c, "fp8", 128, 384, 2048), 2.0 * 128 * 384 * 2048 / 0.05e12, 1e-15);
  // fp32 was not measured: the bf16 class stands in.
  EXPECT_NEAR(GemmSeconds(c, "fp32", 64, 64, 64), 2.0 * 64 * 64 * 64 / 0.2e12, 1e-15);
}

TEST(CostModel, CollectiveSecondsFromBusBandwidth) {
  const Calibration c = TwoClassCalibration();
  // All-gather of 1 MB on 2 ranks at 10 GB/s bus bandwidth: 5 us + 1e6 * (1/2) / 1e10.
  EXPECT_NEAR(CollectiveSeconds(c, "shm", CollectiveOp::kAllGather, 2, 1e6), 5e-6 + 50e-6, 1e-15);
  // Between the points busbw is interpolated in log(bytes): at sqrt(1e3 * 1e6) bytes, 5.5 GB/s.
  const double mid = std::sqrt(1e9);
  EXPECT_NEAR(CollectiveSeconds(c, "shm", CollectiveOp::kReduceScatter, 2, mid),
              5e-6 + mid * 0.5 / 5.5e9, 1e-15);
  // All-reduce on 4 ranks: 2 (n-1)/n = 1.5 of the bytes cross the bus; clamped at the one point.
  EXPECT_NEAR(CollectiveSeconds(c, "shm", CollectiveOp::kAllReduce, 4, 1e6), 1e6 * 1.5 / 2e9, 1e-15);
  EXPECT_EQ(CollectiveSeconds(c, "shm", CollectiveOp::kAllGather, 1, 1e6), 0);  // one rank
  EXPECT_EQ(CollectiveSeconds(c, "nvlink4", CollectiveOp::kAllGather, 2, 1e6), 0);  // no curve
}

TEST(CostModel, OptimizerTermFromBytesPerSecond) {
  const Calibration c = TwoClassCalibration();
  // 1e6 elements, f32 moments: 28 bytes each at 28 GB/s = 1 ms; the norm's read, the master's
  // read and the fp8 wire write (4 + 4 + 1 bytes) at 10 GB/s = 0.9 ms.
  EXPECT_NEAR(OptimizerSeconds(c, 1e6, 8, 1), 1e-3 + 0.9e-3, 1e-15);
  // bf16 moments: 20 bytes per element.
  EXPECT_NEAR(OptimizerSeconds(c, 1e6, 4, 1), 20e6 / 28e9 + 0.9e-3, 1e-15);
}

// d 32, 2 layers, 2 heads, ffn 64, vocab 256, seq 32; global batch 4, microbatch 1; FP8 linears.
v1::JobSpec Tiny() {
  v1::JobSpec s;
  auto* m = s.mutable_model();
  m->set_d_model(32);
  m->set_n_layers(2);
  m->set_n_heads(2);
  m->set_ffn_dim(64);
  m->set_vocab_size(256);
  m->set_seq_len(32);
  s.mutable_training()->set_global_batch(4);
  s.mutable_training()->set_microbatch(1);
  s.mutable_sharding()->set_alignment(4);
  return s;
}

// One GEMM class per precision: every GEMM runs at its precision's one rate, so the GEMM term
// is the step's GEMM FLOPs (3 x the forward's: dX and dW) over the rates.
TEST(CostModel, PredictStepGemmTermIsFlopsOverRate) {
  Calibration c = TwoClassCalibration();
  c.gemm = {{"fp8", 32, 32, 32, 0.1}, {"bf16", 32, 32, 32, 0.05}};
  v1::JobSpec serial = Tiny();  // the serial order: the compute is the passes alone
  serial.mutable_training()->set_overlap_optimizer(false);
  const v1::JobSpec spec = WithDefaults(serial, 1);
  auto p = PredictStep(spec, Mesh{1, 1, false}, c);
  ASSERT_TRUE(p.ok()) << p.status();
  const double N = 32;  // 1 sequence of 32 tokens per microbatch
  const double block = 2 * N * (32 * 96 + 32 * 32 + 32 * 128 + 64 * 32);  // qkv, o, gate+up, down
  const double head = 2 * N * 32 * 256;
  const double per_mb = 3 * (2 * block / 0.1e12 + head / 0.05e12);
  EXPECT_EQ(p->microbatches, 4);
  EXPECT_NEAR(p->gemm_s, 4 * per_mb, 1e-15);
  // One rank: no collective at all; the step is compute plus optimizer.
  EXPECT_NEAR(p->exposed_comm_s, 0, 1e-15);
  EXPECT_NEAR(p->step_s, p->compute_s + p->optimizer_s, 1e-15);
  EXPECT_NEAR(p->compute_s, p->gemm_s + p->attention_s + p->memory_s, 1e-12);
}

// A hybrid mesh on a slow inter-host link: the replica all-reduces after the backward cannot
// be hidden, so the step exposes at least the last unit's (the embedding's) replica all-reduce,
// and more than the flat group of the same shard size.
TEST(CostModel, PredictStepHybridReplicaAllReduceIsExposed) {
  Calibration c = TwoClassCalibration();
  c.ranks_per_host = 2;
  c.inter_link = "ib";
  c.collectives.push_back({"ib", CollectiveOp::kAllReduce, 2, 1e-3, {{1, 0.001}}});
  c.collectives.push_back({"ib", CollectiveOp::kAllGather, 2, 1e-3, {{1, 0.001}}});
  c.collectives.push_back({"ib", CollectiveOp::kReduceScatter, 2, 1e-3, {{1, 0.001}}});
  v1::JobSpec tiny = Tiny();
  auto flat = PredictStep(WithDefaults(tiny, 2), Mesh{1, 2, false}, c);
  ASSERT_TRUE(flat.ok()) << flat.status();
  tiny.mutable_training()->set_global_batch(8);  // the same 2 sequences per rank on 4 ranks
  auto hybrid = PredictStep(WithDefaults(tiny, 4), Mesh{2, 2, false}, c);
  ASSERT_TRUE(hybrid.ok()) << hybrid.status();
  EXPECT_EQ(hybrid->inter_link, "ib");
  EXPECT_EQ(hybrid->intra_link, "shm");
  // The embedding's shard: 256 * 32 bf16 elements padded to 8 / 2 ranks -> 4096 f32 = 16384
  // bytes all-reduced across 2 replicas at 1 MB/s (0.001 GB/s): 1 ms + 16384 / 1e6 s.
  const double embedding_replica = 1e-3 + 16384.0 / 1e6;
  EXPECT_GE(hybrid->exposed_comm_s, embedding_replica);
  EXPECT_GT(hybrid->exposed_comm_s, flat->exposed_comm_s + embedding_replica);
  EXPECT_NEAR(hybrid->compute_s, flat->compute_s, 1e-12);
}

TEST(CostModel, CpuRanksShareTheCores) {
  Calibration c = TwoClassCalibration();
  c.cores = 2;
  v1::JobSpec tiny = Tiny();
  tiny.mutable_training()->set_global_batch(6);
  auto two = PredictStep(WithDefaults(tiny, 2), Mesh{1, 2, false}, c);
  auto three = PredictStep(WithDefaults(tiny, 3), Mesh{1, 3, false}, c);
  ASSERT_TRUE(two.ok() && three.ok());
  EXPECT_EQ(two->contention, 1.0);
  EXPECT_NEAR(three->contention, 1.5, 1e-15);
  // Per microbatch (one sequence) the same GEMMs: 2 ranks run 3 microbatches at full speed,
  // 3 ranks run 2 microbatches 1.5 x slower.
  EXPECT_NEAR(three->gemm_s, two->gemm_s * (2.0 / 3.0) * 1.5, 1e-12);
}

TEST(CostModel, CalibrationFileRules) {
  const std::string ok = R"({"backend": "cpu", "intra_link": "shm", "memory_gbps": 10,
    "optimizer_gbps": 5, "attention": {"forward_tflops": 0.01, "backward_tflops": 0.01},
    "gemm": [{"precision": "fp8", "m": 1, "n": 2, "k": 3, "tflops": 0.1}],
    "collectives": [{"link": "shm", "op": "all_gather", "ranks": 2, "latency_us": 3,
                     "points": [[1000, 1], [2000, 2]]}]})";
  auto c = ParseCalibration(ok, "cal.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->inter_link, "shm");  // defaults to the intra-host link
  EXPECT_NEAR(c->collectives[0].latency_s, 3e-6, 1e-18);
  std::string no_mem = ok;
  no_mem.replace(no_mem.find("\"memory_gbps\": 10"), 17, "\"memory_gbps\": 0");
  auto bad = ParseCalibration(no_mem, "cal.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cal.json: memory_gbps"), std::string::npos) << bad.status();
  std::string desc = ok;
  desc.replace(desc.find("[2000, 2]"), 9, "[500, 2]");
  bad = ParseCalibration(desc, "cal.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("collectives[0].points[1]"), std::string::npos) << bad.status();
  std::string op = ok;
  op.replace(op.find("all_gather"), 10, "broadcast!");
  EXPECT_FALSE(ParseCalibration(op, "cal.json").ok());
  EXPECT_FALSE(ParseCalibration("{", "cal.json").ok());
  // A calibration of another backend is refused by PredictStep.
  Calibration cuda = *c;
  cuda.backend = "cuda";
  auto p = PredictStep(WithDefaults(Tiny(), 1), Mesh{1, 1, false}, cuda);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("backend"), std::string::npos);
}

// The calibration files shipped in data/calibration parse, and the CUDA file's collectives are
// the published NCCL bus bandwidths its comments cite (NVLink 4: 370 GB/s all-gather and
// reduce-scatter; 400 Gb/s InfiniBand: 46 GB/s).
TEST(CostModel, ShippedCalibrationFilesParse) {
  auto cpu = LoadCalibration(std::string(FSDP8_SOURCE_DIR) + "/data/calibration/cpu.json");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->backend, "cpu");
  EXPECT_GT(cpu->cores, 0);
  auto cuda = LoadCalibration(std::string(FSDP8_SOURCE_DIR) + "/data/calibration/cuda-h100.json");
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  EXPECT_EQ(cuda->backend, "cuda");
  EXPECT_EQ(cuda->intra_link, "nvlink4");
  EXPECT_EQ(cuda->inter_link, "ib400");
  // 1 GiB all-gathered on 8 ranks: 15 us + 2^30 * 7/8 / 370e9 s; across hosts 46 us + ... / 46e9.
  const double gib = 1 << 30;
  EXPECT_NEAR(CollectiveSeconds(*cuda, "nvlink4", CollectiveOp::kAllGather, 8, gib),
              15e-6 + gib * 7 / 8 / 370e9, 1e-12);
  EXPECT_NEAR(CollectiveSeconds(*cuda, "ib400", CollectiveOp::kReduceScatter, 2, gib),
              46e-6 + gib / 2 / 46e9, 1e-12);
}

}  // namespace
}  // namespace fsdp8

namespace fsdp8 {
namespace {

// A block of C 16, F 32, two q heads and one kv head of 8 (Q 16, K 8), N 4 rows.
PassShape TinyBlock() { return PassShape{4, 16, 32, 16, 8}; }

// The bf16-activation block (FP8 linears, BF16 attention) as the CUDA backend runs it: q/k/v
// and gate/up fused, down_proj's input recast in the backward. Each pass counted by hand from
// train/model.cc (elements x bytes per element).
TEST(CostModel, PassRuleOfTheBf16ActivationBlock) {
  BlockPlan b;
  b.linears = v1::PRECISION_FP8;
  b.fp8_bf16 = true;
  b.fused_qkv = b.fused_mlp = true;
  b.recast_down = true;
  const auto [fwd, bwd] = BlockPassBytes(b, TinyBlock(), PassRules{true, false});
  // Forward: input norm + cast: 4x16 elements, 4 read + 1 written = 320; RoPE on bf16 q (4x16)
  // and k (4x8), 2 + 2 each = 384; o_proj's cast of bf16 att (4x16), 2 + 1 = 192; post-norm +
  // cast 320; SwiGLU + cast: 4x32, gate 2 + up 2 read, 1 written = 640.
  EXPECT_DOUBLE_EQ(fwd, 320 + 384 + 192 + 320 + 640);
  // Backward, in order:
  const double recast = 4 * 32 * 5;            // down's input codes from gate/up: 640
  const double down_dy = 4 * 16 * 6;           // f32 dout read, codes + transpose: 384
  const double down_wt = 16 * 32 * 2;          // down's weight codes transposed: 1024
  const double swiglu = 4 * 32 * (2 + 2 + 2 + 2 + 2);  // dact, gate, up; codes, transposes: 1280
  const double gu_wt = 64 * 16 * 2;            // [gate; up] weight codes (2F x C): 2048
  const double n2_t = 4 * 16 * 2;              // post-norm output codes transposed: 128
  const double norm2 = 4 * 16 * (2 + 4 + 4 + 4);  // bf16 dn2, h, dout read; dh written: 896
  const double o_dy = 4 * 16 * 6;              // 384
  const double o_wt = 16 * 16 * 2;             // 512
  const double o_t = 4 * 16 * 2;               // att codes transposed: 128
  const double qkv = 4 * 16 * 4 + 4 * 8 * 4 + 4 * 8 * 4;  // dq, dk (RoPE + cast), dv cast: 512
  const double qkv_wt = 32 * 16 * 2;           // [q; k; v] weight codes (32 x C): 1024
  const double n1_t = 4 * 16 * 2;              // 128
  const double norm1 = 4 * 16 * (2 + 4 + 4 + 4);  // 896
  EXPECT_DOUBLE_EQ(bwd, recast + down_dy + down_wt + swiglu + gu_wt + n2_t + norm2 + o_dy + o_wt +
                            o_t + qkv + qkv_wt + n1_t + norm1);
  // Unfused groups: the norms' backward read 2 (MLP) and 3 (attention) bf16 parts; the
  // forward's kept down_proj codes are transposed (2 per element) instead of recast (5).
  b.fused_qkv = b.fused_mlp = false;
  b.recast_down = false;
  const auto [fwd2, bwd2] = BlockPassBytes(b, TinyBlock(), PassRules{true, false});
  EXPECT_DOUBLE_EQ(fwd2, fwd);
  EXPECT_DOUBLE_EQ(bwd2, bwd + 4 * 16 * 2 * (1 + 2) - 4 * 32 * (5 - 2));
  // bf16 saved norm inputs: x_in and h packed (4 read, 2 written) and unpacked (2 read, 4 written).
  const auto [fwd3, bwd3] = BlockPassBytes(b, TinyBlock(), PassRules{true, true});
  EXPECT_DOUBLE_EQ(fwd3, fwd2 + 2 * 4 * 16 * 6);
  EXPECT_DOUBLE_EQ(bwd3, bwd2 + 2 * 4 * 16 * 6);
}

// The generic block (f32 activations) with FP8 linears: on the fast CPU backend (any layout)
// against a one-layout backend the difference is exactly the transposes and the transposed
// grad-output copies.
TEST(CostModel, PassRuleOfTheGenericBlockByLayout) {
  BlockPlan b;
  b.linears = v1::PRECISION_FP8;
  const auto [fwd_any, bwd_any] = BlockPassBytes(b, TinyBlock(), PassRules{false, false});
  // Forward: norms 2 x 4x16 x 8 = 1024; RoPE on f32 q, k: 4x24 x 8 = 768; SwiGLU 4x32 x 12 =
  // 1536; residual adds 2 x 4x16 x 12 = 1536; gate and up packed to bf16: 2 x 4x32 x 6 = 1536;
  // each linear's input cast (5): q, k, v and gate, up read n (4x16) each, o att (4x16), down
  // act (4x32): (5 x 64 + 64 + 128) x 5 = 2560.
  EXPECT_DOUBLE_EQ(fwd_any, 1024 + 768 + 1536 + 1536 + 1536 + 2560);
  // Backward: norms 2 x 64 x 12 = 1536; RoPE 768; SwiGLU (f32 dact, bf16 gate and up read; f32
  // dgate, dup written) 4x32 x 16 = 2048; Axpys 2 x 64 x 12 = 1536; grad-output casts (5) of
  // q 64, k 32, v 32, o 64, gate 128, up 128, down 64 elements: 512 x 5 = 2560.
  EXPECT_DOUBLE_EQ(bwd_any, 1536 + 768 + 2048 + 1536 + 2560);
  const auto [fwd_tn, bwd_tn] = BlockPassBytes(b, TinyBlock(), PassRules{true, false});
  EXPECT_DOUBLE_EQ(fwd_tn, fwd_any);
  // One layout: +1 byte per grad-output element (512), weights transposed (2 bytes per weight
  // element: 16x16 + 16x8 x 2 + 16x16 + 16x32 x 3 = 2304 elements) and each linear's input codes
  // (2 per element: q, k, v, gate, up 64 each, o 64, down 128 = 512).
  EXPECT_DOUBLE_EQ(bwd_tn, bwd_any + 512 + 2 * 2304 + 2 * 512);
}

TEST(CostModel, HeadPassRule) {
  // N 4, C 16, V 32. BF16 head: final norm 4x16 x 8 = 512, nf to bf16 4x16 x 6 = 384, cross-entropy
  // 4x32 x (4 + 4 + 2) = 1280; backward: the norm's 4x16 x 12 = 768.
  EXPECT_EQ(HeadPassBytes(true, 4, 16, 32), std::make_pair(512.0 + 384 + 1280, 768.0));
  // F32 head: the gradient written over the logits in place, 4x32 x 12 = 1536.
  EXPECT_EQ(HeadPassBytes(false, 4, 16, 32), std::make_pair(512.0 + 1536, 768.0));
}

TEST(CostModel, OptimizerTermByWireDtype) {
  const Calibration c = TwoClassCalibration();  // AdamW 28 GB/s, memory 10 GB/s
  // 1e6 f32-wire, 2e6 bf16-wire, 3e6 FP8-wire elements, f32 moments: AdamW 28 bytes for all 6e6
  // and the bf16 pack 2 x 2e6 at 28 GB/s; the norm's 4 x 6e6 and the FP8 cast 5 x 3e6 at 10 GB/s.
  const ShardElements e{1e6, 2e6, 3e6};
  EXPECT_NEAR(OptimizerSeconds(c, e, 8), (168e6 + 4e6) / 28e9 + (24e6 + 15e6) / 10e9, 1e-15);
  // bf16 moments: 20 bytes per element.
  EXPECT_NEAR(OptimizerSeconds(c, e, 4), (120e6 + 4e6) / 28e9 + (24e6 + 15e6) / 10e9, 1e-15);
  // An all-FP8 shard gives the per-element rule's figure with a 1-byte wire.
  EXPECT_NEAR(OptimizerSeconds(c, ShardElements{0, 0, 1e6}, 8), OptimizerSeconds(c, 1e6, 8, 1),
              1e-15);
}

// The shared-host slowdown: measured points interpolated, scaled beyond the last, and the
// cores rule without points.
TEST(CostModel, HostSlowdownOfCpuRanks) {
  Calibration c = TwoClassCalibration();
  c.cores = 2;
  EXPECT_DOUBLE_EQ(HostSlowdown(c, 1), 1.0);
  EXPECT_DOUBLE_EQ(HostSlowdown(c, 3), 1.5);  // no points: 3 ranks on 2 cores
  c.host_slowdown = {{1, 1.0}, {2, 1.2}, {4, 2.8}};
  EXPECT_DOUBLE_EQ(HostSlowdown(c, 2), 1.2);
  EXPECT_DOUBLE_EQ(HostSlowdown(c, 3), 2.0);          // halfway between 1.2 and 2.8
  EXPECT_DOUBLE_EQ(HostSlowdown(c, 8), 2.8 * 8 / 4);  // beyond the last: x processes / 4
  // A table starting above 2 processes: below its first point, linear from (1, 1.0).
  c.host_slowdown = {{4, 2.5}, {8, 4.0}};
  EXPECT_DOUBLE_EQ(HostSlowdown(c, 2), 1.5);  // 1 + (2 - 1) / (4 - 1) x (2.5 - 1)
  EXPECT_DOUBLE_EQ(HostSlowdown(c, 3), 2.0);  // 1 + 2 / 3 x 1.5
  EXPECT_DOUBLE_EQ(HostSlowdown(c, 4), 2.5);
  EXPECT_DOUBLE_EQ(HostSlowdown(c, 6), 3.25);  // halfway between 2.5 and 4.0
  c.cores = 0;                                        // GPUs: one device per rank
  EXPECT_DOUBLE_EQ(HostSlowdown(c, 8), 1.0);
  // PredictStep applies it to the compute: 2 ranks at 1.2 against the same step at 1.
  Calibration flat = TwoClassCalibration();
  flat.cores = 2;
  flat.host_slowdown = {{1, 1.0}, {2, 1.0}};
  Calibration slow = flat;
  slow.host_slowdown = {{1, 1.0}, {2, 1.2}};
  auto a = PredictStep(WithDefaults(Tiny(), 2), Mesh{1, 2, false}, flat);
  auto s = PredictStep(WithDefaults(Tiny(), 2), Mesh{1, 2, false}, slow);
  ASSERT_TRUE(a.ok() && s.ok());
  EXPECT_NEAR(s->compute_s, 1.2 * a->compute_s, 1e-12);
  EXPECT_NEAR(s->optimizer_s, 1.2 * a->optimizer_s, 1e-12);
}

TEST(CostModel, HostSlowdownFileRules) {
  const std::string base = R"({"backend": "cpu", "intra_link": "shm", "memory_gbps": 10,
      "optimizer_gbps": 28, "attention": {"forward_tflops": 1, "backward_tflops": 1},
      "gemm": [{"precision": "fp8", "m": 1, "n": 1, "k": 1, "tflops": 1}], "cores": 2, )";
  auto c = ParseCalibration(base + R"("host_slowdown": [[1, 1.0], [2, 1.1], [3, 1.7]]})", "cal.json");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->host_slowdown.size(), 3u);
  EXPECT_EQ(c->host_slowdown[2].first, 3);
  EXPECT_DOUBLE_EQ(c->host_slowdown[2].second, 1.7);
  auto down = ParseCalibration(base + R"("host_slowdown": [[2, 1.1], [1, 1.0]]})", "cal.json");
  ASSERT_FALSE(down.ok());
  EXPECT_NE(down.status().message().find("cal.json: host_slowdown[1]"), std::string::npos)
      << down.status();
  EXPECT_FALSE(ParseCalibration(base + R"("host_slowdown": [[0, 1.0]]})", "cal.json").ok());
  EXPECT_FALSE(ParseCalibration(base + R"("host_slowdown": [[1, 0]]})", "cal.json").ok());
  EXPECT_FALSE(ParseCalibration(base + R"("host_slowdown": 3})", "cal.json").ok());
}

// Attention classes: the nearest head layout's classes, interpolated in log(seq); the
// non-deterministic backward only where measured and asked for.
TEST(CostModel, AttentionRatesFromTheNearestClasses) {
  Calibration c = TwoClassCalibration();  // "attention": 0.01 forward, 0.005 backward
  EXPECT_EQ(AttentionRates(c, 16, 16, 128, 4096, true), std::make_pair(0.01, 0.005));
  EXPECT_EQ(AttentionRates(c, 16, 16, 128, 4096, false), std::make_pair(0.01, 0.005));
  c.attention_backward_nondeterministic_tflops = 0.006;
  EXPECT_EQ(AttentionRates(c, 16, 16, 128, 4096, false), std::make_pair(0.01, 0.006));
  c.attention_classes = {{8, 2048, 16, 16, 128, 400, 300, 350},
                         {2, 8192, 16, 16, 128, 500, 400, 0},
                         {8, 2048, 32, 8, 128, 100, 100, 100}};
  // 16 heads at seq 4096: halfway in log between 2048 and 8192: forward 450, backward 350; the
  // non-deterministic backward: 350 at 2048, the deterministic 400 at 8192 (not measured there).
  EXPECT_DOUBLE_EQ(AttentionRates(c, 16, 16, 128, 4096, true).first, 450);
  EXPECT_DOUBLE_EQ(AttentionRates(c, 16, 16, 128, 4096, true).second, 350);
  EXPECT_DOUBLE_EQ(AttentionRates(c, 16, 16, 128, 4096, false).second, 375);
  // Clamped beyond the last class; a 32/8 layout takes its own class, not the nearer seq.
  EXPECT_EQ(AttentionRates(c, 16, 16, 128, 32768, true), std::make_pair(500.0, 400.0));
  EXPECT_EQ(AttentionRates(c, 32, 8, 128, 8192, true), std::make_pair(100.0, 100.0));
  // The file's keys.
  const std::string base = R"({"backend": "cuda", "intra_link": "nvlink4", "memory_gbps": 10,
      "optimizer_gbps": 28, "attention": {"forward_tflops": 1, "backward_tflops": 1,
      "backward_nondeterministic_tflops": 2},
      "gemm": [{"precision": "fp8", "m": 1, "n": 1, "k": 1, "tflops": 1}], )";
  auto parsed = ParseCalibration(base + R"("attention_classes": [{"batch": 2, "seq": 8192,
      "heads": 32, "kv_heads": 8, "head_dim": 128, "forward_tflops": 500,
      "backward_tflops": 380, "backward_nondeterministic_tflops": 420}]})", "cal.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_DOUBLE_EQ(parsed->attention_backward_nondeterministic_tflops, 2);
  ASSERT_EQ(parsed->attention_classes.size(), 1u);
  EXPECT_EQ(parsed->attention_classes[0].kv_heads, 8);
  EXPECT_DOUBLE_EQ(parsed->attention_classes[0].backward_nondeterministic_tflops, 420);
  auto bad = ParseCalibration(base + R"("attention_classes": [{"batch": 2, "seq": 8192,
      "heads": 32, "kv_heads": 8, "head_dim": 128, "forward_tflops": 500}]})", "cal.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("attention_classes[0].backward_tflops"), std::string::npos)
      << bad.status();
}

// A hybrid spec (sharding.replicas set, as `fsdp8 plan --predict --replicas` resolves it): each
// rank holds 1 / (shard group size) of the state, as the flat job on one shard group does, so the
// optimizer's time is that job's; the plan must not be made at the shard group's size with the
// spec's replicas (1 rank per shard group: the whole state).
TEST(CostModel, PredictStepHybridShardsOverTheShardGroup) {
  Calibration c = TwoClassCalibration();
  c.ranks_per_host = 2;
  c.inter_link = "ib";
  c.collectives.push_back({"ib", CollectiveOp::kAllReduce, 2, 1e-3, {{1, 0.001}}});
  v1::JobSpec tiny = Tiny();
  auto flat = PredictStep(WithDefaults(tiny, 2), Mesh{1, 2, false}, c);
  ASSERT_TRUE(flat.ok()) << flat.status();
  tiny.mutable_training()->set_global_batch(8);
  tiny.mutable_sharding()->set_replicas(2);
  auto hybrid = PredictStep(WithDefaults(tiny, 4), Mesh{2, 2, false}, c);
  ASSERT_TRUE(hybrid.ok()) << hybrid.status();
  EXPECT_NEAR(hybrid->optimizer_s, flat->optimizer_s, 1e-15);
  EXPECT_GT(hybrid->optimizer_s, 0);
}

// Rowwise / blockwise blocks are not priced: refused naming the field that asks for them.
TEST(CostModel, PredictStepRefusesRowwiseAndBlockwiseNamingTheField) {
  const Calibration c = TwoClassCalibration();
  v1::JobSpec s = Tiny();
  s.mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_ROWWISE);
  s.mutable_precision()->mutable_fp8()->set_recipe(v1::SCALING_RECIPE_CURRENT);
  auto rowwise = PredictStep(WithDefaults(s, 1), Mesh{1, 1, false}, c);
  ASSERT_FALSE(rowwise.ok());
  EXPECT_EQ(rowwise.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(rowwise.status().message().find("precision.fp8.granularity: the cost model prices "
                                            "tensorwise FP8 linears only"),
            std::string::npos)
      << rowwise.status();
  v1::JobSpec o = Tiny();
  auto* bf16 = o.mutable_precision()->add_overrides();
  bf16->set_layer(0);
  bf16->set_linears(v1::PRECISION_BF16);
  auto* blockwise = o.mutable_precision()->add_overrides();
  blockwise->set_layer(1);
  blockwise->set_linears(v1::PRECISION_FP8);
  blockwise->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  auto over = PredictStep(WithDefaults(o, 1), Mesh{1, 1, false}, c);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("precision.overrides[1].granularity"), std::string::npos)
      << over.status();
  // Tensorwise (the default) is priced.
  EXPECT_TRUE(PredictStep(WithDefaults(Tiny(), 1), Mesh{1, 1, false}, c).ok());
}

// The optimizer is priced in the order training runs it; the cost says whether training defers
// it (training.overlap_optimizer, not under a WORLD optimizer with replicas). On CPU ranks the
// deferred updates run inline in the next forward: the same work, moved from the tail (which
// keeps the gradient norm and units 0 and 1's updates) into the compute.
TEST(CostModel, PredictStepSaysWhetherTrainingDefersTheOptimizer) {
  const Calibration c = TwoClassCalibration();
  v1::JobSpec on = Tiny();
  on.mutable_training()->set_overlap_optimizer(true);
  v1::JobSpec off = Tiny();
  off.mutable_training()->set_overlap_optimizer(false);
  auto deferred = PredictStep(WithDefaults(on, 1), Mesh{1, 1, false}, c);
  auto serial = PredictStep(WithDefaults(off, 1), Mesh{1, 1, false}, c);
  ASSERT_TRUE(deferred.ok()) << deferred.status();
  ASSERT_TRUE(serial.ok()) << serial.status();
  EXPECT_TRUE(deferred->optimizer_deferred);
  EXPECT_FALSE(serial->optimizer_deferred);
  EXPECT_NEAR(deferred->step_s, serial->step_s, 1e-12 * serial->step_s);
  EXPECT_EQ(deferred->step_s,
            deferred->compute_s + deferred->exposed_comm_s + deferred->optimizer_s);
  EXPECT_GT(deferred->optimizer_s, 0);
  EXPECT_LT(deferred->optimizer_s, serial->optimizer_s);
  EXPECT_EQ(serial->optimizer_in_forward_s, 0);
  EXPECT_NEAR(deferred->compute_s, serial->compute_s + deferred->optimizer_in_forward_s, 1e-15);
  EXPECT_NEAR(deferred->optimizer_in_forward_s, serial->optimizer_s - deferred->optimizer_s,
              1e-12 * serial->optimizer_s);
}

// Backend calls per block, counted by hand from train/model.cc and train/fp8_linear.cc.
TEST(CostModel, BlockOpCountByPath) {
  BlockPlan b;
  b.linears = v1::PRECISION_FP8;
  // Generic FP8 block: forward norm, 7 x (cast + GEMM), RoPE x2, attention, add, norm, SwiGLU,
  // gate/up packs x2, add = 24; backward 7 x (cast, weight and input transposes, dX, dW) + SwiGLU
  // + 2 norms + 2 Axpys + attention + RoPE x2 = 43; without the transposes 29.
  EXPECT_EQ(BlockOpCount(b, PassRules{true, false}), std::make_pair(24, 43));
  EXPECT_EQ(BlockOpCount(b, PassRules{false, false}), std::make_pair(24, 29));
  // The fused bf16-activation block: forward norm cast, q/k/v GEMM, RoPE x2, attention, o cast,
  // o GEMM, norm cast, gate/up GEMM, SwiGLU cast, down GEMM = 11; backward recast, down (cast,
  // weight transpose, dX, dW), SwiGLU, gate/up (weight and input transposes, dX, dW), norm, o
  // (cast, two transposes, dX, dW), attention, RoPE q, k and v's cast, q/k/v (two transposes, dX,
  // dW), norm = 25.
  b.fp8_bf16 = b.fused_qkv = b.fused_mlp = b.recast_down = true;
  EXPECT_EQ(BlockOpCount(b, PassRules{true, false}), std::make_pair(11, 25));
  // Unfused: three more GEMMs forward (q/k/v 3, gate/up 2); backward 6 more calls for q/k/v
  // (weight transposes, dX and dW: 3 each instead of 1) and 3 more for gate/up (2 each).
  b.fused_qkv = b.fused_mlp = false;
  EXPECT_EQ(BlockOpCount(b, PassRules{true, false}), std::make_pair(14, 25 + 6 + 3));
}

// A floor of one second per call dwarfs every rate: the step's compute is its calls.
TEST(CostModel, PredictStepCallFloor) {
  Calibration c = TwoClassCalibration();
  c.op_floor_s = 1;
  v1::JobSpec serial = Tiny();  // the serial order's optimizer (deferred: below)
  serial.mutable_training()->set_overlap_optimizer(false);
  const v1::JobSpec spec = WithDefaults(serial, 1);
  auto p = PredictStep(spec, Mesh{1, 1, false}, c);
  ASSERT_TRUE(p.ok()) << p.status();
  // Per microbatch: embedding 1 + 1; 2 generic FP8 blocks on the fast CPU backend, 24 + 29 each;
  // the head (one chunk of 32 rows): BF16 4 + 3, f32 3 + 3.
  const bool bf16_head = spec.precision().lm_head() == v1::PRECISION_BF16;
  const double per_mb = 2 + 2 * (24 + 29) + (bf16_head ? 7 : 6);
  EXPECT_EQ(p->microbatches, 4);
  EXPECT_NEAR(p->compute_s, 4 * per_mb, 1e-9);
  EXPECT_GT(p->floor_s, 0);
  // The optimizer: per buffer 2 calls, per FP8 linear 2, and 4 for the scales.
  EXPECT_GE(p->optimizer_s, 4 + 2 * 14);
}

// The deferred update's window beside a unit's forward, by hand. Side stream: the device
// finishes both streams' work in the sum of their device times (10 + 4 = 14), unless the host's
// issue of both units' calls is longer ((2 + 3) x 1 = 5 < 14; x 3 = 15 > 14). Inline (CPU): the
// forward's larger time, then the update's (max(10, 6) + max(4, 9) = 19 at 3 per call).
TEST(CostModel, DeferredWindowSharesTheDeviceOrRunsInline) {
  EXPECT_DOUBLE_EQ(DeferredWindow(10, 2, 4, 3, 1, true), 14);
  EXPECT_DOUBLE_EQ(DeferredWindow(10, 2, 4, 3, 3, true), 15);
  EXPECT_DOUBLE_EQ(DeferredWindow(10, 2, 4, 3, 0, false), 14);
  EXPECT_DOUBLE_EQ(DeferredWindow(10, 2, 4, 3, 3, false), 19);
}

// The first case's two units (forward 10, backward 20, all-gather 4, reduce-scatter 3) with unit
// 1's deferred update of 6 and unit 0's forward lengthened by 3 (it runs beside unit 0):
// AG0 [0,4]; c0 [4,17]; AG1 issued at 4 + 6: [10,14]; c1 [17,27]; backward c1 [27,47], AG0
// [27,31], RS1 [47,50], c0 [47,67], RS0 [67,70]. An update of 12 makes c1 wait for AG1 [16,20]:
// c1 [20,30], ..., RS0 [73]. A second microbatch has no deferred work (60 more of compute).
TEST(CostModel, ScheduleDeferredUpdateDelaysTheGatherAndLengthensTheForward) {
  std::vector<UnitTimes> u(2);
  for (UnitTimes& x : u) x = {10, 20, 4, 3, 0};
  u[1].update = 6;
  u[0].deferred = 3;
  ScheduleResult r = Schedule(u, 1);
  EXPECT_NEAR(r.compute_s, 63, kEps);
  EXPECT_NEAR(r.end_s, 70, kEps);
  EXPECT_NEAR(r.exposed_s, 7, kEps);
  u[1].update = 12;
  r = Schedule(u, 1);
  EXPECT_NEAR(r.end_s, 73, kEps);
  EXPECT_NEAR(r.exposed_s, 10, kEps);
  EXPECT_NEAR(Schedule(u, 2).compute_s, 63 + 60, kEps);
}

// Elements of one unit's shard by wire dtype, and the update's seconds by hand at the
// TwoClassCalibration rates (AdamW 28 GB/s: 28 bytes per element with f32 moments and 2 more per
// bf16 wire element; the FP8 cast, 5 bytes per element, at 10 GB/s).
struct UnitShard {
  double f32 = 0, bf16 = 0, fp8 = 0;
  int buffers = 0;
  double total() const { return f32 + bf16 + fp8; }
  double update_s() const { return (28 * total() + 2 * bf16) / 28e9 + 5 * fp8 / 10e9; }
};
std::vector<UnitShard> ShardsOf(const StepPlan& plan) {
  std::vector<UnitShard> out;
  for (const PlannedUnit& u : plan.units) {
    UnitShard s;
    for (const PlannedBuffer& b : u.buffers) {
      (b.wire == WireDtype::kFp8 ? s.fp8 : b.wire == WireDtype::kBf16 ? s.bf16 : s.f32) +=
          static_cast<double>(b.shard);
      ++s.buffers;
    }
    out.push_back(s);
  }
  return out;
}

// The deferred optimizer on a CUDA rank (one rank, one microbatch). Device-bound (no call floor):
// the updates of units 2.. (the second block and the head) run beside the forward of the unit
// before and the device does both in the sum of their times, so the step equals the serial
// order's, the tail keeps the gradient norm's read (4 bytes per element at 10 GB/s) and units 0
// and 1's updates, and the forward gains exactly the other units' updates. Host-bound (a call
// floor of 1 s): the forward gains each moved update's calls (per buffer AdamW, per FP8 tensor
// AdamW's slice and the cast, and 3 for an FP8 unit's scales: the block 7 FP8 tensors), and the
// tail is its calls (one norm call per buffer plus units 0 and 1's update calls).
TEST(CostModel, PredictStepDeferredOptimizerOnCuda) {
  Calibration c = TwoClassCalibration();
  c.backend = "cuda";
  v1::JobSpec on = Tiny();
  on.set_backend("cuda");
  on.mutable_training()->set_global_batch(1);
  v1::JobSpec off = on;
  on.mutable_training()->set_overlap_optimizer(true);
  off.mutable_training()->set_overlap_optimizer(false);
  const v1::JobSpec spec = WithDefaults(on, 1);
  auto plan = MakeStepPlan(spec, 1, BackendCapsOf("cuda"), StepPlanOptions{});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<UnitShard> shard = ShardsOf(*plan);
  ASSERT_EQ(shard.size(), 4u);  // embedding, 2 blocks, head
  double total = 0;
  int buffers = 0;
  for (const UnitShard& u : shard) {
    total += u.total();
    buffers += u.buffers;
  }
  auto deferred = PredictStep(spec, Mesh{1, 1, false}, c);
  auto serial = PredictStep(WithDefaults(off, 1), Mesh{1, 1, false}, c);
  ASSERT_TRUE(deferred.ok()) << deferred.status();
  ASSERT_TRUE(serial.ok()) << serial.status();
  EXPECT_TRUE(deferred->optimizer_deferred);
  EXPECT_NEAR(deferred->optimizer_in_forward_s, shard[2].update_s() + shard[3].update_s(), 1e-15);
  EXPECT_NEAR(deferred->optimizer_s,
              4 * total / 10e9 + shard[0].update_s() + shard[1].update_s(), 1e-15);
  EXPECT_NEAR(deferred->step_s, serial->step_s, 1e-12 * serial->step_s);
  // Host-bound.
  c.op_floor_s = 1;
  auto host = PredictStep(spec, Mesh{1, 1, false}, c);
  ASSERT_TRUE(host.ok()) << host.status();
  const auto calls = [&](int u, int fp8) { return shard[u].buffers + 2 * fp8 + (fp8 > 0 ? 3 : 0); };
  EXPECT_NEAR(host->optimizer_in_forward_s, calls(2, 7) + calls(3, 0), 1e-9);
  EXPECT_NEAR(host->optimizer_s, buffers + calls(0, 0) + calls(1, 7), 1e-9);
}

// The host's serial terms: 4 microbatches of the FP8 Tiny job (2 blocks x 7 FP8 linears) make
// 2 x 4 uploads + the losses' and the gradient norm's readbacks + the step's end + 3 for the
// delayed scales + 0.3 for the scaling report = 14.3 synchronisations; at 1 ms each with a 2 ms
// step round trip the step gains 16.3 ms. The CURRENT recipe adds 3 per scaled cast: 2 casts per
// FP8 linear per microbatch, 3 x 2 x 14 x 4 = 336. The calls' workspace allocation counts
// beside the floor: 0.5 + 0.5 per call prices as a 1 s floor.
TEST(CostModel, PredictStepHostTerms) {
  Calibration c = TwoClassCalibration();
  c.sync_s = 1e-3;
  c.step_overhead_s = 2e-3;
  auto p = PredictStep(WithDefaults(Tiny(), 1), Mesh{1, 1, false}, c);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->microbatches, 4);
  EXPECT_NEAR(p->syncs, 14.3, 1e-12);
  EXPECT_NEAR(p->host_s, 16.3e-3, 1e-15);
  EXPECT_NEAR(p->step_s, p->compute_s + p->exposed_comm_s + p->optimizer_s + 16.3e-3, 1e-15);
  v1::JobSpec current = Tiny();
  current.mutable_precision()->mutable_fp8()->set_recipe(v1::SCALING_RECIPE_CURRENT);
  auto cur = PredictStep(WithDefaults(current, 1), Mesh{1, 1, false}, c);
  ASSERT_TRUE(cur.ok()) << cur.status();
  EXPECT_NEAR(cur->syncs, 14.3 + 336, 1e-12);
  EXPECT_NEAR(HostSyncsPerStep(1, 0, false), 5, 1e-12);  // no FP8: uploads 2, readbacks 2, end 1
  v1::JobSpec serial = Tiny();
  serial.mutable_training()->set_overlap_optimizer(false);
  Calibration one = TwoClassCalibration(), halves = one;
  one.op_floor_s = 1;
  halves.op_floor_s = halves.alloc_s = 0.5;
  auto a = PredictStep(WithDefaults(serial, 1), Mesh{1, 1, false}, one);
  auto b = PredictStep(WithDefaults(serial, 1), Mesh{1, 1, false}, halves);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NEAR(b->compute_s, a->compute_s, 1e-9);
  EXPECT_NEAR(b->optimizer_s, a->optimizer_s, 1e-9);
  EXPECT_EQ(b->calls, a->calls);
  // The coordinator's cycle bounds the step from below: a 10 s cycle is the whole step; a cycle
  // shorter than the step changes nothing.
  c.step_cycle_s = 10;
  auto cyc = PredictStep(WithDefaults(Tiny(), 1), Mesh{1, 1, false}, c);
  ASSERT_TRUE(cyc.ok());
  EXPECT_DOUBLE_EQ(cyc->step_s, 10);
  EXPECT_NEAR(cyc->host_s, 10 - (p->step_s - p->host_s), 1e-12);
  c.step_cycle_s = 1e-3;
  cyc = PredictStep(WithDefaults(Tiny(), 1), Mesh{1, 1, false}, c);
  ASSERT_TRUE(cyc.ok());
  EXPECT_DOUBLE_EQ(cyc->step_s, p->step_s);
}

// The host figures parse from microseconds; a negative one is refused naming the field. A
// table entry at 1 process slows a lone rank (the host as it is against when the rates were
// measured); a table without one leaves it at 1.
TEST(CostModel, HostFiguresAndOneRankSlowdown) {
  const std::string base = R"({"backend": "cuda", "intra_link": "nvlink4", "memory_gbps": 10,
      "optimizer_gbps": 28, "attention": {"forward_tflops": 1, "backward_tflops": 1},
      "gemm": [{"precision": "fp8", "m": 1, "n": 1, "k": 1, "tflops": 1}], )";
  auto c = ParseCalibration(base + R"("sync_us": 12, "alloc_us": 1.5, "launch_us": 2.5,
      "step_overhead_us": 300, "step_cycle_us": 450})", "cal.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NEAR(c->sync_s, 12e-6, 1e-18);
  EXPECT_NEAR(c->alloc_s, 1.5e-6, 1e-18);
  EXPECT_NEAR(c->launch_s, 2.5e-6, 1e-18);
  EXPECT_NEAR(c->step_overhead_s, 300e-6, 1e-18);
  EXPECT_NEAR(c->step_cycle_s, 450e-6, 1e-18);
  auto bad = ParseCalibration(base + R"("sync_us": -1})", "cal.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cal.json: sync_us"), std::string::npos) << bad.status();
  Calibration h = TwoClassCalibration();
  h.cores = 2;
  h.host_slowdown = {{1, 1.15}};
  EXPECT_DOUBLE_EQ(HostSlowdown(h, 1), 1.15);
  h.host_slowdown = {{2, 1.3}};
  EXPECT_DOUBLE_EQ(HostSlowdown(h, 1), 1.0);
  EXPECT_DOUBLE_EQ(HostSlowdown(h, 2), 1.3);
}

}  // namespace
}  // namespace fsdp8
