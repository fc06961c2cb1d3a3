// Hybrid sharding (common/mesh.h): R replicas x S-rank shard groups, ranks as threads, each with
// its world communicator and its shard-group and replica-group communicators (CPU communicators
// under their own rendezvous prefixes on one in-process KvStore). A hybrid job sees the same
// tokens per step as the flat world-W job, so it must do the same math up to the order of f32
// sums (C12): per step the global mean loss and the grad norm within 1e-5 relative with FP32
// linears, 5e-3 with FP8 linears (whose casts turn summation-order differences into rounding
// flips), and the first step's gradients within 2e-5 x max |g| per tensor (FP32), under both
// optimizer shardings (SHARD_GROUP: replicated optimizer state; WORLD: HFSDP). Checkpoints of a
// mesh resume on other meshes, flat included, within the same tolerances of the uninterrupted
// run, and have the files the design names (SHARD_GROUP: replica 0's ranks, one file per shard
// index; WORLD: one per rank at its optimizer index).
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_format.h"
#include "common/mesh.h"
#include "common/spec.h"
#include "gtest/gtest.h"
#include "tests/support/ranks.h"
#include "tests/train/trainer_test_util.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace fsdp8 {
namespace {

using testing::CpuBackend;
using testing::TinySpec;
using testing::TrainFile;

constexpr double kFp32Tol = 1e-5, kFp8Tol = 5e-3;

// TinySpec with a global batch of 12 (divisible by 3 and 4 ranks, 3 or 4 sequences a rank: several
// microbatches, so that only the last one's reduce-scatters are summed over the replicas).
v1::JobSpec Spec(bool fp8, v1::OptimizerSharding sharding, int replicas) {
  v1::JobSpec s = TinySpec(TrainFile());
  s.mutable_training()->set_global_batch(12);
  testing::AllPrecision(&s, fp8 ? v1::PRECISION_FP8 : v1::PRECISION_FP32);
  s.mutable_sharding()->set_max_workers(4);
  s.mutable_sharding()->set_replicas(replicas);
  s.mutable_sharding()->set_optimizer_sharding(sharding);
  return s;
}

const char* Name(v1::OptimizerSharding s) {
  return s == v1::OPTIMIZER_SHARDING_WORLD ? "WORLD" : "SHARD_GROUP";
}

// Runs fn(rank, trainer) on R x S ranks (threads): R = 1 is a flat job.
using RankFn = std::function<void(int rank, Trainer* t)>;
void RunMesh(const v1::JobSpec& spec, int R, int S, const RankFn& fn) {
  testing::RunMeshRanks(R, S, [&](int r, Communicator* world, const MeshComms& comms) {
    auto be = CpuBackend();
    auto t = Trainer::Create(WithDefaults(spec, R * S), r, R * S, be.get(), world, comms);
    ASSERT_TRUE(t.ok()) << t.status();
    fn(r, t->get());
  });
}

struct Run {
  std::vector<double> losses, norms;                // per step: global mean loss, grad norm
  std::map<std::string, std::vector<float>> grads;  // step 0's gradients (when asked)
  std::vector<v1::CheckpointSaved> saved;           // per rank (when saving)
};

// Steps [first, last) of `spec` on R x S ranks; grads: step 0's gradients first; load_dir (with
// its file count): resumes there; save_dir: saves after the last step.
Run Train(const v1::JobSpec& spec, int R, int S, int first, int last, bool grads = false,
          const std::string& load_dir = "", int load_files = 0,
          const std::string& save_dir = "") {
  const int W = R * S;
  std::vector<std::vector<StepStats>> stats(W);
  Run out;
  out.saved.resize(W);
  RunMesh(WithDefaults(spec, W), R, S, [&](int r, Trainer* t) {
    if (!load_dir.empty()) {
      absl::Status s = LoadShards(t, load_dir, load_files, first);
      ASSERT_TRUE(s.ok()) << s;
    }
    if (grads) {
      ASSERT_TRUE(t->ForwardBackward(first).ok());
      auto g = t->params().GatherAll(true);
      ASSERT_TRUE(g.ok()) << g.status();
      if (r == 0) out.grads = *g;
    }
    for (int k = first; k < last; ++k) {
      auto res = t->Step(k, false, false);
      ASSERT_TRUE(res.ok()) << res.status();
      stats[r].push_back(*res);
    }
    if (!save_dir.empty()) {
      absl::Status s = SaveShard(*t, last, save_dir, &out.saved[r]);
      ASSERT_TRUE(s.ok()) << s;
    }
  });
  for (int k = 0; k < last - first; ++k) {
    double loss = 0, tokens = 0;
    for (int r = 0; r < W; ++r) {
      EXPECT_EQ(stats[r].size(), static_cast<size_t>(last - first));
      if (stats[r].size() <= static_cast<size_t>(k)) return out;
      loss += stats[r][k].loss_sum;
      tokens += stats[r][k].tokens;
      // Every rank reports the same global grad norm.
      EXPECT_EQ(stats[r][k].grad_norm, stats[0][k].grad_norm) << "rank " << r << " step " << k;
    }
    out.losses.push_back(loss / tokens);
    out.norms.push_back(stats[0][k].grad_norm);
  }
  return out;
}

void ExpectSameLosses(const Run& got, const Run& want, double tol, int from = 0) {
  ASSERT_FALSE(got.losses.empty());
  ASSERT_LE(got.losses.size() + from, want.losses.size());
  for (size_t k = 0; k < got.losses.size(); ++k) {
    EXPECT_NEAR(got.losses[k], want.losses[k + from], tol * want.losses[k + from])
        << "loss of step " << k + from;
    EXPECT_NEAR(got.norms[k], want.norms[k + from], tol * want.norms[k + from])
        << "grad norm of step " << k + from;
  }
}

// The C12 gradient bound: max |g - g_flat| <= 2e-5 max |g_flat| per tensor.
void ExpectSameGrads(const std::map<std::string, std::vector<float>>& got,
                     const std::map<std::string, std::vector<float>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, w] : want) {
    const std::vector<float>& g = got.at(name);
    ASSERT_EQ(g.size(), w.size()) << name;
    double mx = 0, diff = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      mx = std::max(mx, static_cast<double>(std::abs(w[i])));
      diff = std::max(diff, static_cast<double>(std::abs(g[i] - w[i])));
    }
    EXPECT_GT(mx, 0) << name;
    EXPECT_LE(diff, 2e-5 * mx) << name;
  }
}

// R x S against the flat world R * S, both optimizer shardings; FP32 also the step-0 gradients.
void ExpectMatchesFlat(int R, int S, bool fp8) {
  const double tol = fp8 ? kFp8Tol : kFp32Tol;
  const Run flat = Train(Spec(fp8, v1::OPTIMIZER_SHARDING_SHARD_GROUP, 1), 1, R * S, 0, 3, !fp8);
  for (v1::OptimizerSharding sh : {v1::OPTIMIZER_SHARDING_SHARD_GROUP, v1::OPTIMIZER_SHARDING_WORLD}) {
    SCOPED_TRACE(absl::StrCat(R, " x ", S, " ", Name(sh), fp8 ? " FP8" : " FP32"));
    const Run mesh = Train(Spec(fp8, sh, R), R, S, 0, 3, !fp8);
    ExpectSameLosses(mesh, flat, tol);
    if (!fp8) ExpectSameGrads(mesh.grads, flat.grads);
  }
}

TEST(Hybrid, TwoByTwoMatchesFlatFourFp32) { ExpectMatchesFlat(2, 2, false); }
TEST(Hybrid, TwoByTwoMatchesFlatFourFp8) { ExpectMatchesFlat(2, 2, true); }
TEST(Hybrid, ThreeByOneMatchesFlatThreeFp32) { ExpectMatchesFlat(3, 1, false); }
TEST(Hybrid, ThreeByOneMatchesFlatThreeFp8) { ExpectMatchesFlat(3, 1, true); }

// SHARD_GROUP keeps the replicas' state identical: every rank's master weights, gathered over its
// own shard group, are the same bits after training (a replica that skipped its replica-group sum
// or summed twice would drift).
TEST(Hybrid, ShardGroupReplicasStayIdentical) {
  const v1::JobSpec spec = Spec(true, v1::OPTIMIZER_SHARDING_SHARD_GROUP, 2);
  std::vector<std::map<std::string, std::vector<float>>> master(4);
  RunMesh(WithDefaults(spec, 4), 2, 2, [&](int r, Trainer* t) {
    for (int k = 0; k < 2; ++k) ASSERT_TRUE(t->Step(k, false, false).ok());
    auto m = t->params().GatherAll(false);
    ASSERT_TRUE(m.ok()) << m.status();
    master[r] = *m;
  });
  for (int r = 1; r < 4; ++r) {
    ASSERT_EQ(master[r].size(), master[0].size());
    for (const auto& [name, w] : master[0]) {
      const std::vector<float>& x = master[r].at(name);
      ASSERT_EQ(x.size(), w.size());
      for (size_t i = 0; i < w.size(); ++i) {
        ASSERT_EQ(testing::Bits(x[i]), testing::Bits(w[i])) << "rank " << r << " " << name << "[" << i << "]";
      }
    }
  }
}

std::string FreshDir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/hybrid_ckpt_" + std::to_string(::getpid()) + "_" + name;
  std::filesystem::remove_all(d);
  return d;
}

// The files of a (2, 2) checkpoint: SHARD_GROUP: ranks 0 and 1 (replica 0) write rank-0 and
// rank-1, ranks 2 and 3 nothing (empty file name); WORLD: rank r writes file s * 2 + p for shard
// index s = r % 2 of replica p = r / 2: ranks 0..3 -> 0, 2, 1, 3.
void ExpectCheckpointFiles(const Run& saved, v1::OptimizerSharding sh, const std::string& dir) {
  const bool world = sh == v1::OPTIMIZER_SHARDING_WORLD;
  const std::vector<std::string> want =
      world ? std::vector<std::string>{"rank-0.ckpt", "rank-2.ckpt", "rank-1.ckpt", "rank-3.ckpt"}
            : std::vector<std::string>{"rank-0.ckpt", "rank-1.ckpt", "", ""};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(saved.saved[r].file(), want[r]) << "rank " << r;
    EXPECT_EQ(saved.saved[r].rank(), r);
  }
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.path().extension() == ".ckpt";
  EXPECT_EQ(files, world ? 4 : 2);
}

// A (2, 2) checkpoint after 2 steps resumes at (1, 3) (flat) and at (3, 1) (in the same optimizer
// sharding) for steps 2 and 3 like the uninterrupted (2, 2) run; and a flat world-3 checkpoint
// resumes at (2, 2).
void ExpectResumesAcrossMeshes(bool fp8) {
  const double tol = fp8 ? kFp8Tol : kFp32Tol;
  for (v1::OptimizerSharding sh : {v1::OPTIMIZER_SHARDING_SHARD_GROUP, v1::OPTIMIZER_SHARDING_WORLD}) {
    SCOPED_TRACE(absl::StrCat(Name(sh), fp8 ? " FP8" : " FP32"));
    const v1::JobSpec mesh22 = Spec(fp8, sh, 2);
    const Run full = Train(mesh22, 2, 2, 0, 4);
    const std::string dir = FreshDir(absl::StrCat(Name(sh), fp8));
    const Run saved = Train(mesh22, 2, 2, 0, 2, false, "", 0, dir);
    ExpectSameLosses(saved, full, 0);  // the same job: the same bits
    ExpectCheckpointFiles(saved, sh, dir);
    const int files = CheckpointRoleOf(*MeshOf(WithDefaults(mesh22, 4), 4), 0).files;
    EXPECT_EQ(files, sh == v1::OPTIMIZER_SHARDING_WORLD ? 4 : 2);
    {
      SCOPED_TRACE("resumed at 1 x 3");
      ExpectSameLosses(Train(Spec(fp8, sh, 1), 1, 3, 2, 4, false, dir, files), full, tol, 2);
    }
    {
      SCOPED_TRACE("resumed at 3 x 1");
      ExpectSameLosses(Train(Spec(fp8, sh, 3), 3, 1, 2, 4, false, dir, files), full, tol, 2);
    }
    {
      SCOPED_TRACE("flat world 3 resumed at 2 x 2");
      const std::string flat_dir = FreshDir(absl::StrCat("flat", Name(sh), fp8));
      Train(Spec(fp8, sh, 1), 1, 3, 0, 2, false, "", 0, flat_dir);
      ExpectSameLosses(Train(mesh22, 2, 2, 2, 4, false, flat_dir, 3), full, tol, 2);
    }
  }
}

TEST(Hybrid, CheckpointOfTwoByTwoResumesOnOtherMeshesFp32) { ExpectResumesAcrossMeshes(false); }
TEST(Hybrid, CheckpointOfTwoByTwoResumesOnOtherMeshesFp8) { ExpectResumesAcrossMeshes(true); }

// The roles by hand: SHARD_GROUP (3 x 2): replica 0's ranks 0, 1 write files 0, 1 of 2; WORLD
// (3 x 2): rank 4 (shard 0 of replica 2) writes file 0 * 3 + 2 = 2 of 6; flat: rank r file r.
TEST(Hybrid, CheckpointRoles) {
  Mesh m;
  m.replicas = 3;
  m.shard_size = 2;
  for (int r = 0; r < 6; ++r) {
    const CheckpointRole c = CheckpointRoleOf(m, r);
    EXPECT_EQ(c.writes, r < 2) << r;
    EXPECT_EQ(c.file_index, r % 2) << r;
    EXPECT_EQ(c.files, 2);
  }
  m.optimizer_over_world = true;
  const int want[6] = {0, 3, 1, 4, 2, 5};
  for (int r = 0; r < 6; ++r) {
    const CheckpointRole c = CheckpointRoleOf(m, r);
    EXPECT_TRUE(c.writes);
    EXPECT_EQ(c.file_index, want[r]) << r;
    EXPECT_EQ(c.files, 6);
  }
  Mesh flat;
  flat.shard_size = 4;
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(CheckpointRoleOf(flat, r).writes);
    EXPECT_EQ(CheckpointRoleOf(flat, r).file_index, r);
    EXPECT_EQ(CheckpointRoleOf(flat, r).files, 4);
  }
}

// A non-flat mesh without its group communicators is INVALID_ARGUMENT naming what is missing;
// one of the wrong size names it; WORLD without kept FP8 codes names the field.
TEST(Hybrid, CreateRequiresTheMeshCommunicators) {
  const v1::JobSpec spec = WithDefaults(Spec(true, v1::OPTIMIZER_SHARDING_SHARD_GROUP, 2), 2);
  testing::RunRanks(2, [&](int r, Communicator* world) {
    auto be = CpuBackend();
    auto none = Trainer::Create(spec, r, 2, be.get(), world);
    ASSERT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(none.status().message().find("MeshComms.shard"), std::string::npos) << none.status();
    EXPECT_NE(none.status().message().find("MeshComms.replica"), std::string::npos) << none.status();
    // The world (2 ranks) is a fine replica group of 2 x 1, but no shard group of 1 rank.
    auto wrong = Trainer::Create(spec, r, 2, be.get(), world, MeshComms{world, world});
    ASSERT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(wrong.status().message().find("MeshComms.shard is rank"), std::string::npos)
        << wrong.status();
    v1::JobSpec no_codes = WithDefaults(Spec(true, v1::OPTIMIZER_SHARDING_WORLD, 2), 2);
    no_codes.mutable_precision()->mutable_fp8()->set_keep_weight_codes(false);
    auto codes = Trainer::Create(no_codes, r, 2, be.get(), world);
    ASSERT_EQ(codes.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(codes.status().message().find("keep_weight_codes"), std::string::npos)
        << codes.status();
  });
}

}  // namespace
}  // namespace fsdp8
