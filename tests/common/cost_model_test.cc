// The cost model's arithmetic against hand-computed cases: the overlap schedule of known unit
// times, a GEMM's and a collective's time from their rates, the optimizer's bytes, the GEMM
// term of a whole step from its FLOPs, and the calibration file's rules.
#include "common/cost_model.h"

#include <string>

#include "common/spec.h"
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
  const v1::JobSpec spec = WithDefaults(Tiny(), 1);
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
