// FSDP: shards of tensors smaller than the world size (C05), world-size-independent
// initialisation of the sharded master weights (C06), FP8 gradients accumulated over microbatches
// into the gradient shards, and the bytes the all-gathers and reduce-scatters move.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "common/shard_plan.h"
#include "common/spec.h"
#include "gtest/gtest.h"
#include "tests/support/ranks.h"
#include "tests/train/trainer_test_util.h"
#include "train/fsdp.h"
#include "train/trainer.h"

namespace fsdp8 {
namespace {

using testing::AllPrecision;
using testing::Bits;
using testing::CpuBackend;
using testing::MeanLoss;
using testing::RunRanks;
using testing::TinySpec;
using testing::Train;
using testing::TrainFile;

// ---- C05 ------------------------------------------------------------------------------------
// d_model 2 and alignment 1 on 3 ranks: the norm weights (2 elements) are smaller than the world
// size, some ranks own all-padding slices and some FP8 tensors lie wholly on one rank.
v1::JobSpec SmallerThanWorldSpec() {
  v1::JobSpec spec = TinySpec(TrainFile());
  spec.mutable_model()->set_d_model(2);
  spec.mutable_model()->set_n_heads(1);
  spec.mutable_model()->set_ffn_dim(4);
  spec.mutable_model()->set_seq_len(16);
  spec.mutable_sharding()->set_alignment(1);
  return spec;
}

TEST(Trainer, C05_TensorsSmallerThanWorldSizeTrainLikeOneRank) {
  for (v1::Precision p : {v1::PRECISION_FP32, v1::PRECISION_FP8}) {
    SCOPED_TRACE(v1::Precision_Name(p));
    v1::JobSpec spec = SmallerThanWorldSpec();
    AllPrecision(&spec, p);
    // The premise: some buffer is smaller than the world size x alignment on some rank.
    const ShardPlan plan = *MakeShardPlan(WithDefaults(spec, 3), 3);
    int u, b, t;
    ASSERT_TRUE(plan.Find("model.layers.0.input_layernorm.weight", &u, &b, &t));
    EXPECT_LT(plan.units[u].buffers[b].tensors[t].numel, 3);
    const auto one = Train(spec, 1, 4);
    const auto three = Train(spec, 3, 4);
    // FP32: only the order of f32 sums differs. FP8: the first step scales activations from each
    // rank's own amax (current scaling before any history exists), so FP8 quantisation differs.
    const double tol = p == v1::PRECISION_FP32 ? 1e-5 : 2e-2;
    for (int k = 0; k < 4; ++k) {
      const double a = MeanLoss(one, k), c = MeanLoss(three, k);
      EXPECT_TRUE(std::isfinite(c));
      EXPECT_NEAR(a, c, tol * a) << "step " << k;
    }
  }
}

// ---- C06 / world-size-independent initialisation through FsdpParams ----------------------------
// Master weights straight after construction, gathered on `world` ranks (rank 0's copy; every
// rank's copy must agree).
std::map<std::string, std::vector<float>> InitialMaster(
    const std::function<ShardPlan(int world)>& make_plan, int world, uint64_t seed) {
  std::vector<std::map<std::string, std::vector<float>>> got(world);
  RunRanks(world, [&](int r, Communicator* c) {
    const ShardPlan plan = make_plan(world);
    auto be = CpuBackend();
    CommClock clock;
    FsdpParams params(plan, r, seed, be.get(), c, &clock);
    auto m = params.GatherAll(false);
    ASSERT_TRUE(m.ok()) << m.status();
    got[r] = *m;
  });
  for (int r = 1; r < world; ++r) EXPECT_EQ(got[r].size(), got[0].size()) << "rank " << r;
  for (int r = 1; r < world; ++r) {
    for (const auto& [name, v] : got[0]) {
      EXPECT_EQ(std::memcmp(v.data(), got[r].at(name).data(), v.size() * 4), 0) << name;
    }
  }
  return got[0];
}

void ExpectBitEqual(const std::map<std::string, std::vector<float>>& a,
                    const std::map<std::string, std::vector<float>>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, v] : a) {
    ASSERT_EQ(b.count(name), 1u) << what << ": " << name;
    const std::vector<float>& w = b.at(name);
    ASSERT_EQ(v.size(), w.size()) << what << ": " << name;
    EXPECT_EQ(std::memcmp(v.data(), w.data(), v.size() * 4), 0) << what << ": " << name;
  }
}

// The tiny model (every tensor, FP8 linears included) initialises identically on 1, 2 and 3 ranks.
TEST(FsdpParams, C06_TinyModelInitIsIndependentOfWorldSize) {
  const v1::JobSpec spec = TinySpec(TrainFile());
  auto make = [&](int world) { return *MakeShardPlan(WithDefaults(spec, world), world); };
  const auto one = InitialMaster(make, 1, 1234);
  EXPECT_EQ(one.size(), 3u + 2 * 9);  // embedding, final norm, head, 9 per block
  ExpectBitEqual(one, InitialMaster(make, 2, 1234), "world 2");
  ExpectBitEqual(one, InitialMaster(make, 3, 1234), "world 3");
}

// A 57-element and a 1x17 parameter (plus a 3-element one) in an fp32 and a bf16 buffer: on 2 ranks
// (alignment 1 and 16) GatherAll returns exactly the unpadded elements, each equal to the
// initialisation rule, and bit-identical to the 1- and 3-rank results.
TEST(FsdpParams, C06_FiftySevenAndOneBySeventeenOnTwoRanks) {
  const auto tensor = testing::PlanTensor;
  for (int align : {1, 16}) {
    SCOPED_TRACE(align);
    auto make = [&](int world) {
      // Lists by wire dtype: none fp8, bf16 {1x17, 3}, fp32 {57}.
      auto plan = MakeShardPlan({{"u", {{},
                                        {tensor("w1x17", {1, 17}), tensor("w3", {3})},
                                        {tensor("w57", {57})}}}},
                                world, align);
      EXPECT_TRUE(plan.ok()) << plan.status();
      return *plan;
    };
    const ShardPlan two_plan = make(2);
    int u, b, t;
    ASSERT_TRUE(two_plan.Find("w57", &u, &b, &t));
    EXPECT_GT(two_plan.units[u].buffers[b].padded_numel, 57);  // padding exists
    const auto two = InitialMaster(make, 2, 99);
    ASSERT_EQ(two.size(), 3u);
    ASSERT_EQ(two.at("w57").size(), 57u);
    ASSERT_EQ(two.at("w1x17").size(), 17u);
    ASSERT_EQ(two.at("w3").size(), 3u);
    for (const char* name : {"w57", "w1x17", "w3"}) {
      ASSERT_TRUE(two_plan.Find(name, &u, &b, &t));
      const TensorSpec& ts = two_plan.units[u].buffers[b].tensors[t];
      const std::vector<float>& v = two.at(name);
      for (size_t i = 0; i < v.size(); ++i) {
        EXPECT_EQ(Bits(v[i]), Bits(static_cast<float>(InitValue(ts, i, 99)))) << name << "[" << i
                                                                              << "]";
      }
    }
    ExpectBitEqual(two, InitialMaster(make, 1, 99), "world 1");
    ExpectBitEqual(two, InitialMaster(make, 3, 99), "world 3");
  }
}

// The values riding in the grad-norm all-reduce (the trainer's per-token losses): every rank gets
// the sum of all ranks' squares, non-finite on both ranks when one rank holds an infinity or a NaN,
// and the grad norm's own sum is untouched (zero gradients here: exactly 0).
TEST(FsdpParams, ValuesInTheGradNormAllReduceReachEveryRank) {
  auto plan = MakeShardPlan({{"u", {{}, {}, {testing::PlanTensor("w57", {57})}}}}, 2, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const float kInf = std::numeric_limits<float>::infinity();
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  // rank 0 {1, 2}, rank 1 {3, 4}: 1 + 4 + 9 + 16 = 30; then rank 1 {3, inf}, then {NaN, 4}.
  const std::vector<std::vector<std::vector<float>>> cases = {
      {{1, 2}, {3, 4}}, {{1, 2}, {3, kInf}}, {{1, 2}, {kNaN, 4}}};
  RunRanks(2, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    CommClock clock;
    FsdpParams params(*plan, r, 5, be.get(), c, &clock);
    for (size_t i = 0; i < cases.size(); ++i) {
      params.ZeroGrads();
      DevBuf values(be.get(), 2 * sizeof(float));
      be->CopyToDevice(values.get(), cases[i][r].data(), 2 * sizeof(float));
      ASSERT_TRUE(params.StartGradSquaredNorm(values.f32(), 2).ok());
      double values_squared = -1;
      EXPECT_EQ(params.FinishGradSquaredNorm(&values_squared), 0.0) << "case " << i;
      if (i == 0) {
        EXPECT_EQ(values_squared, 30.0) << "rank " << r;
      } else {
        EXPECT_FALSE(std::isfinite(values_squared)) << "case " << i << " rank " << r;
      }
    }
    // Without values the second sum is 0.
    params.ZeroGrads();
    ASSERT_TRUE(params.StartGradSquaredNorm().ok());
    double values_squared = -1;
    EXPECT_EQ(params.FinishGradSquaredNorm(&values_squared), 0.0);
    EXPECT_EQ(values_squared, 0.0);
  });
}

// A tensor large enough that its rank's slice is initialised on several host threads (4 Mi
// elements each): every element equals InitValue of its index, on 1 and 2 ranks.
TEST(FsdpParams, C06_LargeTensorInitialisedOnThreadsFollowsTheRule) {
  constexpr int64_t kNumel = 3 * (int64_t{1} << 22) + 5;
  auto make = [&](int world) {
    auto plan = MakeShardPlan({{"u", {{}, {}, {testing::PlanTensor("big", {kNumel})}}}}, world, 1);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return *plan;
  };
  const ShardPlan plan = make(1);
  int u, b, t;
  ASSERT_TRUE(plan.Find("big", &u, &b, &t));
  const TensorSpec& ts = plan.units[u].buffers[b].tensors[t];
  for (int world : {1, 2}) {
    const auto got = InitialMaster(make, world, 7);
    const std::vector<float>& v = got.at("big");
    ASSERT_EQ(v.size(), static_cast<size_t>(kNumel));
    int64_t wrong = 0;
    for (int64_t i = 0; i < kNumel; ++i) wrong += Bits(v[i]) != Bits(InitValue(ts, i, 7));
    EXPECT_EQ(wrong, 0) << "world " << world;
  }
}

// ---- FP8 gradients over microbatches ------------------------------------------------------------
// FP8 weights' gradients are written by one dW GEMM per microbatch into buffers that are not
// zeroed first, and reach the grad shard directly (a step's first microbatch) or through a part
// that is added (later microbatches). The FP8 model's gradients of one batch of 4 sequences —
// as 1 microbatch of 4 on one rank, and as 2 microbatches of 1 on each of 2 ranks — are
// compared with the FP32 model's. FP8 rounding (E4M3 X and W, E5M2 dY: 2^-4 and 2^-3 relative
// per element, partly averaging out over each dot product) moves a gradient by a few percent
// normwise; the bound is 0.15. A gradient that kept only a rank's last microbatch would miss a
// quarter of the batch on top of that, one summed over a stale buffer would carry NaN (the CPU
// backend's fresh memory).
TEST(Trainer, Fp8GradientsAreTheSameOverMicrobatchesAndRanks) {
  v1::JobSpec spec = TinySpec(TrainFile());
  spec.mutable_training()->set_global_batch(4);
  auto grads = [&](v1::Precision p, int world, int microbatch) {
    v1::JobSpec s = spec;
    AllPrecision(&s, p);
    s.mutable_training()->set_microbatch(microbatch);
    std::map<std::string, std::vector<float>> out;
    RunRanks(world, [&](int r, Communicator* c) {
      auto be = CpuBackend();
      auto t = Trainer::Create(WithDefaults(s, world), r, world, be.get(), c);
      ASSERT_TRUE(t.ok()) << t.status();
      ASSERT_TRUE((*t)->ForwardBackward(0).ok());
      auto g = (*t)->params().GatherAll(true);
      ASSERT_TRUE(g.ok()) << g.status();
      if (r == 0) out = *g;
    });
    return out;
  };
  const auto ref = grads(v1::PRECISION_FP32, 1, 4);
  for (auto [world, microbatch] : {std::pair{1, 4}, std::pair{2, 1}}) {
    const auto g8 = grads(v1::PRECISION_FP8, world, microbatch);
    ASSERT_EQ(g8.size(), ref.size());
    int fp8_tensors = 0;
    for (const auto& [name, g] : ref) {
      const auto& h = g8.at(name);
      ASSERT_EQ(h.size(), g.size()) << name;
      double d2 = 0, n2 = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        d2 += (static_cast<double>(h[i]) - g[i]) * (static_cast<double>(h[i]) - g[i]);
        n2 += static_cast<double>(g[i]) * g[i];
      }
      const double rel = std::sqrt(d2 / n2);
      EXPECT_LE(rel, 0.15) << name << " world " << world << " microbatch " << microbatch;
      fp8_tensors += name.find("_proj") != std::string::npos;
    }
    EXPECT_EQ(fp8_tensors, 2 * 7);
  }
}

// FP8 weights travel as one byte per element: the all-gather and reduce-scatter bytes a step
// reports, counted at the communicator, against a hand count for TinySpec (d 32, 2 layers, ffn 64,
// vocab 256) on 2 ranks, alignment 4 (buffers padded to multiples of 8 elements, which every size
// below already is), 3 microbatches per rank:
//   embedding (bf16, 256 x 32 = 8192 el.): 16384 B per gather, gathered once per microbatch;
//   each block: fp8 linears 4*32*32 + 3*32*64 = 10240 B, bf16 norms 2*32 el. = 128 B, gathered
//     twice per microbatch (forward, backward re-gather);
//   head (bf16, final norm 32 + lm_head 8192 el.): 16448 B, once (its backward reuses the gather).
// Reduce-scatters take f32 full gradients: (8192 + 2 * (10240 + 64) + 8224) * 4 B per microbatch.
TEST(Trainer, Fp8AllGatherMovesOneBytePerWeight) {
  v1::JobSpec spec = TinySpec(TrainFile());
  spec.mutable_precision()->set_linears(v1::PRECISION_FP8);
  constexpr int64_t kMicro = 3;
  const int64_t ag = kMicro * (16384 + 2 * 2 * (10240 + 128) + 16448);
  const int64_t rs = kMicro * (8192 + 2 * (10240 + 64) + 8224) * 4;
  std::vector<StepStats> res(2);
  RunRanks(2, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto t = Trainer::Create(WithDefaults(spec, 2), r, 2, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    for (int k = 0; k < 2; ++k) {
      auto step = (*t)->Step(k, false, false);
      ASSERT_TRUE(step.ok()) << step.status();
      res[r] = *step;
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(res[r].all_gather_bytes, ag) << "rank " << r;
    EXPECT_EQ(res[r].reduce_scatter_bytes, rs) << "rank " << r;
    EXPECT_GT(res[r].optimizer_seconds, 0.0);
    EXPECT_GT(res[r].compute_seconds, 0.0);
  }
}

}  // namespace
}  // namespace fsdp8
