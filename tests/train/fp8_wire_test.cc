// The blockwise FP8 wire (precision.fp8.granularity BLOCKWISE): each rank casts its whole 128-row
// bands of the FP32 master to E4M3 codes with 128 x 128 block scales, the all-gathers move codes
// and scales, and the linears consume them. On CPU ranks (threads, Gloo), with a model whose
// linear shapes do not divide into 128-row blocks per rank (d_model 192, ffn 320, k / v 64 rows).
//
// Bit identity: a gathered weight's codes and scales equal QuantizeFp8Blocks(kBlock128) of the
// full master weight cast on its own by the cpu-ref backend (the reference composition), at world
// sizes 1, 2 and 3, after training steps (the casts of the deferred optimizer's per-unit updates,
// of the serial order's CastWeights, and of each prefetch without kept codes).
//
// Losses: against the same job trained before the wire existed (blockwise linears travelled in
// BF16 and were quantized at each use), recorded on this repository's CPU backend. Not bit for
// bit: the old path quantized the BF16 rounding of each master weight (its wire), the wire casts
// the FP32 master itself (as the tensorwise wire does), so a code can differ by one E4M3 step
// where the BF16 rounding moved a value across a rounding boundary or changed a block's amax. That
// is rounding noise of FP8's own size, so the C12 FP8 tolerance (5e-3 relative per step's loss)
// applies; a wrong code or scale (another block's scale, a misplaced band, a transposed layout in
// dX) would be off by order 1 within a few steps.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include "common/shard_plan.h"
#include "common/spec.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/support/ranks.h"
#include "tests/train/trainer_test_util.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace fsdp8 {
namespace {

constexpr double kFp8Tol = 5e-3;  // C12
constexpr int kSteps = 6;

// d 192 (3 heads of 64, one kv head: k and v 64 x 192), ffn 320, 2 layers, vocab 256, seq 64,
// blockwise FP8 linears. Bands of 192 columns: q 2 (the second half padding), k 1, v 1, o 2,
// gate 3, up 3 = 12; of 320 columns: down 2. Over 2 ranks 6 + 6 and 1 + 1; over 3 ranks 4 + 4 +
// 4 and 1 + 1 + padding; q's rows split 128 + 64 between bands, never between ranks mid-block.
v1::JobSpec WireShape(int global_batch = 2) {
  v1::JobSpec s = testing::DefaultModelSpec(kSteps);
  s.mutable_model()->set_d_model(192);
  s.mutable_model()->set_n_layers(2);
  s.mutable_model()->set_n_heads(3);
  s.mutable_model()->set_n_kv_heads(1);
  s.mutable_model()->set_ffn_dim(320);
  s.mutable_model()->set_seq_len(64);
  s.mutable_training()->set_global_batch(global_batch);
  s.mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  return s;
}

const char* const kLinears[] = {"self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                "mlp.gate_proj.weight",    "mlp.up_proj.weight",
                                "mlp.down_proj.weight"};

struct Cast {
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;
};

// QuantizeFp8Blocks(kBlock128) of a full (rows, cols) weight on the cpu-ref backend.
Cast ReferenceCast(const std::vector<float>& w, int64_t rows, int64_t cols) {
  std::string err;
  std::unique_ptr<Backend> be = CreateBackend("cpu-ref", 0, &err);
  EXPECT_NE(be, nullptr) << err;
  Cast c;
  c.codes.resize(rows * cols);
  c.scale_inv.resize(Fp8ScaleCount(Fp8Blocks::kBlock128, rows, cols));
  void* in = be->Alloc(w.size() * sizeof(float));
  void* codes = be->Alloc(c.codes.size());
  void* scales = be->Alloc(c.scale_inv.size() * sizeof(float));
  be->CopyToDevice(in, w.data(), w.size() * sizeof(float));
  be->QuantizeFp8Blocks(static_cast<const float*>(in), rows, cols, Fp8Blocks::kBlock128,
                        Fp8Format::kE4M3, static_cast<uint8_t*>(codes), static_cast<float*>(scales));
  be->CopyToHost(c.codes.data(), codes, c.codes.size());
  be->CopyToHost(c.scale_inv.data(), scales, c.scale_inv.size() * sizeof(float));
  be->Free(in);
  be->Free(codes);
  be->Free(scales);
  return c;
}

// Trains `steps` steps of `spec` on `world` ranks, then on every rank gathers each layer unit
// and checks each blockwise linear's gathered codes and scales against the reference cast of
// its full master weight (GatherAll). Returns how many block scales differed from 1 (so that the
// comparison is not one of trivial scales).
// A spec with sharding.replicas R > 1 runs on its mesh (R x world / R ranks; the plan's shards
// are the shard group's).
int ExpectGatheredEqualsFullCast(const v1::JobSpec& spec, int world, int steps,
                                 const std::string& what) {
  SCOPED_TRACE(what + ", world " + std::to_string(world));
  std::vector<int> nontrivial(world, 0);
  const int R = std::max(1, spec.sharding().replicas());
  auto rank = [&](int r, Communicator* c, const MeshComms& mesh) {
    auto be = testing::CpuBackend();
    auto t = Trainer::Create(WithDefaults(spec, world), r, world, be.get(), c, mesh);
    ASSERT_TRUE(t.ok()) << t.status();
    for (int k = 0; k < steps; ++k) ASSERT_TRUE((*t)->Step(k, false, false).ok());
    FsdpParams& p = (*t)->params();
    // The full masters first (collective; applies the deferred updates), then each unit's wire.
    auto masters = p.GatherAll(false);
    ASSERT_TRUE(masters.ok()) << masters.status();
    for (int l = 0; l < spec.model().n_layers(); ++l) {
      const std::string pre = "model.layers." + std::to_string(l) + ".";
      const TensorRef first = p.Ref(pre + kLinears[0]);
      ASSERT_TRUE(p.Gather(first.unit).ok());
      for (const char* name : kLinears) {
        const TensorRef ref = p.Ref(pre + name);
        const TensorSpec& ts = p.plan().units[ref.unit].buffers[ref.buffer].tensors[ref.index];
        const int64_t rows = ts.shape[0], cols = ts.shape[1];
        ASSERT_EQ(ref.wire, WireDtype::kFp8) << name;
        ASSERT_EQ(ref.block_cols, cols) << name;
        const Cast want = ReferenceCast(masters->at(pre + name), rows, cols);
        Cast got;
        got.codes.resize(want.codes.size());
        got.scale_inv.resize(want.scale_inv.size());
        be->CopyToHost(got.codes.data(), p.W8(ref), got.codes.size());
        be->CopyToHost(got.scale_inv.data(), p.WBlockScaleInv(ref),
                       got.scale_inv.size() * sizeof(float));
        int64_t bad_codes = 0, first_bad = -1;
        for (size_t i = 0; i < want.codes.size(); ++i) {
          if (got.codes[i] != want.codes[i] && bad_codes++ == 0) first_bad = static_cast<int64_t>(i);
        }
        EXPECT_EQ(bad_codes, 0) << "rank " << r << " " << pre << name << ": first at row "
                                << first_bad / cols << " col " << first_bad % cols;
        for (size_t i = 0; i < want.scale_inv.size(); ++i) {
          EXPECT_EQ(std::memcmp(&got.scale_inv[i], &want.scale_inv[i], sizeof(float)), 0)
              << "rank " << r << " " << pre << name << " block " << i << ": "
              << got.scale_inv[i] << " vs " << want.scale_inv[i];
          nontrivial[r] += want.scale_inv[i] != 1.0f;
        }
      }
      p.Release(first.unit);
    }
    // Padding (rows past a tensor's last, whole padding bands) never receives a gradient: its
    // masters and AdamW moments stay exactly 0 on every rank.
    for (size_t u = 0; u < p.plan().units.size(); ++u) {
      for (size_t bi = 0; bi < p.plan().units[u].buffers.size(); ++bi) {
        const BufferPlan& bp = p.plan().units[u].buffers[bi];
        if (!bp.Banded()) continue;
        // This rank's optimizer piece: flat elements [begin, begin + n) (its shard, or under WORLD
        // optimizer sharding its part of the group's shard).
        const int ui = static_cast<int>(u), bj = static_cast<int>(bi);
        const int64_t begin = p.OptimizerBegin(ui, bj), n = p.OptimizerNumel(ui, bj);
        std::vector<bool> inside(n, false);
        for (size_t t = 0; t < bp.tensors.size(); ++t) {
          for (int64_t g = std::max(bp.offsets[t], begin);
               g < std::min(bp.offsets[t] + bp.tensors[t].numel, begin + n); ++g) {
            inside[g - begin] = true;
          }
        }
        for (ShardArray a : {ShardArray::kMaster, ShardArray::kAdamM, ShardArray::kAdamV}) {
          std::vector<float> host(n);
          p.DownloadShard(ui, bj, a, host.data());
          int64_t nonzero = 0, in_tensors = 0;
          for (int64_t i = 0; i < n; ++i) {
            nonzero += !inside[i] && host[i] != 0.0f;
            in_tensors += inside[i] && host[i] != 0.0f;
          }
          EXPECT_EQ(nonzero, 0) << "rank " << r << " unit " << u << " buffer " << bi << " array "
                                << static_cast<int>(a) << ": padding changed";
          // The tensors' own elements did change (masters from the start, moments once trained).
          const bool holds_tensor = std::find(inside.begin(), inside.end(), true) != inside.end();
          if (holds_tensor && (a == ShardArray::kMaster || steps > 0)) {
            EXPECT_GT(in_tensors, 0) << "rank " << r << " unit " << u << " buffer " << bi;
          }
        }
      }
    }
  };
  if (R > 1) {
    testing::RunMeshRanks(R, world / R, rank);
  } else {
    testing::RunRanks(world, [&](int r, Communicator* c) { rank(r, c, MeshComms{}); });
  }
  for (int r = 1; r < world; ++r) EXPECT_EQ(nontrivial[r], nontrivial[0]);
  std::printf("%s, world %d: every rank's gathered codes and %d block scales checked\n",
              what.c_str(), world, nontrivial[0]);
  return nontrivial[0];
}

TEST(Fp8Wire, GatheredBlockwiseWeightsEqualFullWeightCast) {
  // Per layer: q 2 x 2 blocks, k 1 x 2, v 1 x 2, o 2 x 2, gate 3 x 2, up 3 x 2, down 2 x 3.
  constexpr int kBlocks = 2 * (4 + 2 + 2 + 4 + 6 + 6 + 6);
  for (int world : {1, 2, 3}) {
    // The initial casts (no step), then after steps of the deferred optimizer (its per-unit casts).
    EXPECT_EQ(ExpectGatheredEqualsFullCast(WireShape(6), world, 0, "initial"), kBlocks);
    EXPECT_EQ(ExpectGatheredEqualsFullCast(WireShape(6), world, 2, "deferred optimizer"), kBlocks);
  }
  v1::JobSpec serial = WireShape(6);
  serial.mutable_training()->set_overlap_optimizer(false);
  EXPECT_EQ(ExpectGatheredEqualsFullCast(serial, 3, 2, "serial optimizer"), kBlocks);
  v1::JobSpec uncached = WireShape(6);
  uncached.mutable_precision()->mutable_fp8()->set_keep_weight_codes(false);
  EXPECT_EQ(ExpectGatheredEqualsFullCast(uncached, 3, 2, "codes cast per prefetch"), kBlocks);
  EXPECT_EQ(ExpectGatheredEqualsFullCast(uncached, 1, 2, "codes cast per prefetch"), kBlocks);
  // Hybrid sharding, 2 replicas x 2 ranks: the optimizer sharded over the world casts each rank's
  // half of its group's shard and rebuilds the codes and scales over the replicas; over the
  // shard group each rank casts its whole shard.
  for (v1::OptimizerSharding sh : {v1::OPTIMIZER_SHARDING_WORLD, v1::OPTIMIZER_SHARDING_SHARD_GROUP}) {
    v1::JobSpec hybrid = WireShape(4);
    hybrid.mutable_sharding()->set_max_workers(4);
    hybrid.mutable_sharding()->set_replicas(2);
    hybrid.mutable_sharding()->set_optimizer_sharding(sh);
    EXPECT_EQ(ExpectGatheredEqualsFullCast(hybrid, 4, 2, v1::OptimizerSharding_Name(sh)), kBlocks);
  }
}

// The losses of WireShape() before the wire (blockwise linears in BF16 buffers, quantized at each
// use), 6 steps at world 1 and 2, as this repository's CPU backend gave them.
constexpr double kBefore[2][kSteps] = {
    {5.72158508, 5.06371734, 3.77100445, 3.32204406, 2.53842087, 2.64598171},
    {5.72158508, 5.06337173, 3.77001225, 3.32197842, 2.53958112, 2.64734601},
};

TEST(Fp8Wire, BlockwiseTrainingTracksQuantizeAtUse) {
  for (int world : {1, 2}) {
    const auto out = testing::Train(WireShape(), world, kSteps);
    for (int k = 0; k < kSteps; ++k) {
      const double loss = testing::MeanLoss(out, k), want = kBefore[world - 1][k];
      std::printf("world %d step %d loss %.6f before %.6f rel %.2e\n", world, k, loss, want,
                  std::fabs(loss - want) / want);
      EXPECT_NEAR(loss, want, kFp8Tol * want) << "world " << world << " step " << k;
    }
  }
}

// The mean loss of one step over ranks from each rank's StepStats.
double Mean(const std::vector<StepStats>& per_rank) {
  double loss = 0, tokens = 0;
  for (const StepStats& st : per_rank) {
    loss += st.loss_sum;
    tokens += st.tokens;
  }
  return loss / tokens;
}

// Checkpoints stay recipe-independent across the two layouts: a rowwise job's checkpoint (BF16
// buffers) resumes under blockwise (band buffers) at another world size, and the other way. The
// resumed job's FP32 masters equal the saved job's bit for bit (tensors mapped by name, no
// padding read), and its first step's loss is within 1e-2 relative of the saved job's own at that
// step (only that step's recipe differs), as for a tensorwise checkpoint resumed under blockwise.
TEST(Fp8Wire, RowwiseAndBlockwiseCheckpointsResumeAcrossLayouts) {
  constexpr int kSaveAfter = 3;
  const v1::Fp8Granularity kRow = v1::FP8_GRANULARITY_ROWWISE, kBlock = v1::FP8_GRANULARITY_BLOCKWISE;
  struct Case {
    v1::Fp8Granularity from, to;
    int saved_world, world;
  };
  for (const Case& c : {Case{kRow, kBlock, 2, 3}, Case{kBlock, kRow, 3, 2}, Case{kBlock, kRow, 1, 1}}) {
    const std::string what = std::string(c.from == kRow ? "rowwise" : "blockwise") + " on " +
                             std::to_string(c.saved_world) + " ranks -> " +
                             (c.to == kRow ? "rowwise" : "blockwise") + " on " +
                             std::to_string(c.world);
    SCOPED_TRACE(what);
    const std::string dir = ::testing::TempDir() + "/fp8wire_ckpt_" +
                            std::to_string(static_cast<long>(::getpid())) + "_" +
                            std::to_string(c.saved_world) + std::to_string(c.world);
    v1::JobSpec from = WireShape(6), to = WireShape(6);
    from.mutable_precision()->mutable_fp8()->set_granularity(c.from);
    to.mutable_precision()->mutable_fp8()->set_granularity(c.to);
    std::vector<StepStats> saved_step(c.saved_world);
    std::map<std::string, std::vector<float>> saved_masters;
    testing::RunRanks(c.saved_world, [&](int r, Communicator* comm) {
      auto be = testing::CpuBackend();
      auto t = Trainer::Create(WithDefaults(from, c.saved_world), r, c.saved_world, be.get(), comm);
      ASSERT_TRUE(t.ok()) << t.status();
      for (int k = 0; k < kSaveAfter; ++k) ASSERT_TRUE((*t)->Step(k, false, false).ok());
      v1::CheckpointSaved saved;
      ASSERT_TRUE(SaveShard(**t, kSaveAfter, dir, &saved).ok());
      auto m = (*t)->params().GatherAll(false);
      ASSERT_TRUE(m.ok()) << m.status();
      if (r == 0) saved_masters = *m;
      auto res = (*t)->Step(kSaveAfter, false, false);
      ASSERT_TRUE(res.ok()) << res.status();
      saved_step[r] = *res;
    });
    std::vector<StepStats> resumed_step(c.world);
    std::map<std::string, std::vector<float>> loaded_masters;
    testing::RunRanks(c.world, [&](int r, Communicator* comm) {
      auto be = testing::CpuBackend();
      auto t = Trainer::Create(WithDefaults(to, c.world), r, c.world, be.get(), comm);
      ASSERT_TRUE(t.ok()) << t.status();
      const absl::Status st = LoadShards(t->get(), dir, c.saved_world, kSaveAfter);
      ASSERT_TRUE(st.ok()) << st;
      auto m = (*t)->params().GatherAll(false);
      ASSERT_TRUE(m.ok()) << m.status();
      if (r == 0) loaded_masters = *m;
      auto res = (*t)->Step(kSaveAfter, false, false);
      ASSERT_TRUE(res.ok()) << res.status();
      resumed_step[r] = *res;
    });
    ASSERT_EQ(loaded_masters.size(), saved_masters.size());
    for (const auto& [name, values] : saved_masters) {
      ASSERT_EQ(loaded_masters.count(name), 1u) << name;
      EXPECT_EQ(std::memcmp(loaded_masters[name].data(), values.data(),
                            values.size() * sizeof(float)),
                0)
          << name << " differs after the load";
    }
    const double want = Mean(saved_step), got = Mean(resumed_step);
    std::printf("%s, step %d: saved run %.5f, resumed %.5f (rel %.2e)\n", what.c_str(),
                kSaveAfter, want, got, std::fabs(got - want) / want);
    EXPECT_NEAR(got, want, 1e-2 * want);
    EXPECT_LT(want, 5.0);  // trained away from the untrained loss (ln 256 = 5.5)
  }
}

}  // namespace
}  // namespace fsdp8
