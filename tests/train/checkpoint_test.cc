// Checkpoint rank files (train/checkpoint.h): C06 (reshard 2 -> 1 / 3, odd sizes), C07 (resume
// is bit-identical to an uninterrupted run), C08 (FP8 weight scales re-derived from the loaded
// weights), corruption and missing-file errors.
#include "train/checkpoint.h"

#include <sys/stat.h>
#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "common/scaling.h"
#include "common/shard_plan.h"
#include "common/spec.h"
#include "gtest/gtest.h"
#include "tests/support/ranks.h"
#include "train/fsdp.h"
#include "train/trainer.h"

namespace fsdp8 {
namespace {

using testing::CpuBackend;
using testing::MakeTokenFile;
using testing::RunRanks;
using testing::TinySpec;

namespace fs = std::filesystem;

const std::string& TrainFile() {
  static const std::string p = MakeTokenFile("ckpt_train.bin", 20000, 7);
  return p;
}

uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

std::string FreshDir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/ckpt_" + name;
  fs::remove_all(d);
  return d + "/step";
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

using Weights = std::map<std::string, std::vector<float>>;

void ExpectBitEqual(const Weights& a, const Weights& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, v] : a) {
    ASSERT_TRUE(b.count(name)) << what << ": " << name;
    ASSERT_EQ(v.size(), b.at(name).size()) << what << ": " << name;
    EXPECT_EQ(std::memcmp(v.data(), b.at(name).data(), v.size() * 4), 0) << what << ": " << name;
  }
}

struct JobRun {
  std::vector<std::vector<StepStats>> results;  // [rank][i]
  Weights master;                                    // rank 0's GatherAll
  std::vector<v1::CheckpointSaved> saved;            // per rank
  std::vector<absl::Status> load_status;             // per rank
};

// On `world` ranks: builds a trainer, loads `load_dir` (saved by load_world ranks) when not
// empty, runs steps [first, last), saves into `save_dir` when not empty, gathers the masters.
// `edit` (optional) runs on each rank's trainer before the steps.
JobRun RunJob(const v1::JobSpec& spec, int world, int64_t first, int64_t last,
           const std::string& load_dir = "", int load_world = 0, const std::string& save_dir = "",
           const std::function<void(Trainer*)>& edit = nullptr) {
  JobRun out;
  out.results.resize(world);
  out.saved.resize(world);
  out.load_status.resize(world);
  RunRanks(world, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto t = Trainer::Create(spec, r, world, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    if (!load_dir.empty()) {
      out.load_status[r] = LoadShards(t->get(), load_dir, load_world, first);
      if (!out.load_status[r].ok()) return;
    }
    if (edit) edit(t->get());
    for (int64_t k = first; k < last; ++k) {
      auto res = (*t)->Step(k, false, true);
      ASSERT_TRUE(res.ok()) << res.status();
      out.results[r].push_back(*res);
    }
    if (!save_dir.empty()) {
      absl::Status s = SaveShard(**t, last, save_dir, &out.saved[r]);
      ASSERT_TRUE(s.ok()) << s;
    }
    auto m = (*t)->params().GatherAll(false);
    ASSERT_TRUE(m.ok()) << m.status();
    if (r == 0) out.master = *m;
  });
  return out;
}

// ---- C07 -------------------------------------------------------------------------------------
// 6 uninterrupted steps vs 3 steps, save, a fresh trainer from the checkpoint, steps 3..5: every
// loss, grad norm, LR and scaling state, and the final master weights are bit-identical.
TEST(Checkpoint, C07_ResumeIsBitIdenticalToAnUninterruptedRun) {
  const v1::JobSpec spec = TinySpec(TrainFile());  // FP8 linears, delayed scaling (default plan)
  const std::string dir = FreshDir("c07");
  const JobRun full = RunJob(spec, 2, 0, 6);
  const JobRun before = RunJob(spec, 2, 0, 3, "", 0, dir);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(before.saved[r].file(), CheckpointFileName(r));
    EXPECT_EQ(before.saved[r].step(), 3);
    EXPECT_EQ(before.saved[r].rank(), r);
    const std::string bytes = ReadAll(dir + "/" + CheckpointFileName(r));
    EXPECT_EQ(before.saved[r].bytes(), static_cast<int64_t>(bytes.size()));
    EXPECT_EQ(before.saved[r].crc32(),
              static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(bytes.data()),
                                          bytes.size())));
    EXPECT_FALSE(fs::exists(dir + "/" + CheckpointFileName(r) + ".tmp"));
  }
  const JobRun after = RunJob(spec, 2, 3, 6, dir, 2);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(after.load_status[r].ok()) << after.load_status[r];
    ASSERT_EQ(after.results[r].size(), 3u);
    for (int i = 0; i < 3; ++i) {
      const StepStats& a = full.results[r][3 + i];
      const StepStats& b = after.results[r][i];
      SCOPED_TRACE(::testing::Message() << "rank " << r << " step " << 3 + i);
      EXPECT_EQ(b.step, a.step);
      EXPECT_EQ(a.loss_sum, b.loss_sum);
      EXPECT_EQ(a.grad_norm, b.grad_norm);
      EXPECT_EQ(a.lr, b.lr);
      ASSERT_TRUE(a.scaling.has_value() && b.scaling.has_value());
      ASSERT_EQ(a.scaling->tensors_size(), b.scaling->tensors_size());
      for (int k = 0; k < a.scaling->tensors_size(); ++k) {
        const v1::TensorScaling& x = a.scaling->tensors(k);
        const v1::TensorScaling& y = b.scaling->tensors(k);
        EXPECT_EQ(x.name(), y.name());
        EXPECT_EQ(Bits(x.scale()), Bits(y.scale())) << x.name();
        ASSERT_EQ(x.amax_history_size(), y.amax_history_size()) << x.name();
        for (int h = 0; h < x.amax_history_size(); ++h) {
          EXPECT_EQ(Bits(x.amax_history(h)), Bits(y.amax_history(h))) << x.name();
        }
      }
    }
  }
  ExpectBitEqual(full.master, after.master, "final master weights");
}

// ---- C06: reshard ---------------------------------------------------------------------------
// The tiny model saved on 2 ranks (after 2 steps, so the moments are non-zero) loads on 1 and 3
// ranks with bit-identical full weights (world 3 pads e.g. the 64-element norm buffers to 72);
// saving again from there and loading back on 2 ranks reproduces the original files byte for
// byte, so the moments and the scaling state survive the reshard too.
TEST(Checkpoint, C06_SavedOnTwoRanksReloadsOnOneAndThree) {
  const v1::JobSpec spec = TinySpec(TrainFile());
  const std::string dir = FreshDir("c06_two");
  const JobRun saved = RunJob(spec, 2, 0, 2, "", 0, dir);
  for (int world : {1, 3}) {
    SCOPED_TRACE(world);
    const std::string mid = FreshDir(absl::StrCat("c06_mid", world));
    const std::string back = FreshDir(absl::StrCat("c06_back", world));
    const JobRun loaded = RunJob(spec, world, 2, 2, dir, 2, mid);
    for (int r = 0; r < world; ++r) ASSERT_TRUE(loaded.load_status[r].ok()) << loaded.load_status[r];
    ExpectBitEqual(saved.master, loaded.master, absl::StrCat("2 -> ", world));
    const JobRun again = RunJob(spec, 2, 2, 2, mid, world, back);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(again.load_status[r].ok()) << again.load_status[r];
      EXPECT_TRUE(ReadAll(dir + "/" + CheckpointFileName(r)) ==
                  ReadAll(back + "/" + CheckpointFileName(r)))
          << "rank " << r << " file after 2 -> " << world << " -> 2";
    }
  }
}

// A 57-element and a 1x17 tensor (plus a 3-element one) on an explicit plan (alignment 4: 57 pads
// to 64 on 2 ranks, 60 on 1 and 3), saved on 2 ranks with
// distinct master, m and v values, load on 1 and 3 ranks: exactly those elements, padding zero.
TEST(Checkpoint, C06_FiftySevenElementsReshardExactly) {
  const auto tensor = testing::PlanTensor;
  auto make = [&](int world) {
    auto plan = MakeShardPlan({{"u", {{},
                                      {tensor("w1x17", {1, 17}), tensor("w3", {3})},
                                      {tensor("w57", {57})}}}},
                              world, 4);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return *plan;
  };
  // Element g of flat buffer b, array a: a value unique to (a, b, g).
  auto value = [](int a, int b, int64_t g) { return 1000.0f * a + 100.0f * b + 0.25f * g + 0.125f; };
  const std::string dir = FreshDir("c06_57");
  const ShardPlan plan2 = make(2);
  RunRanks(2, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    CommClock clock;
    FsdpParams p(plan2, r, 99, be.get(), c, &clock);
    for (size_t b = 0; b < plan2.units[0].buffers.size(); ++b) {
      const BufferPlan& bp = plan2.units[0].buffers[b];
      for (int a = 0; a < 3; ++a) {
        std::vector<float> host(bp.shard_numel);
        for (int64_t i = 0; i < bp.shard_numel; ++i) {
          const int64_t g = bp.ShardBegin(r) + i;
          host[i] = g < bp.numel ? value(a, b, g) : 0.0f;
        }
        p.UploadShardRange(0, b, static_cast<ShardArray>(a), 0, host.data(), bp.shard_numel);
      }
    }
    v1::CheckpointSaved out;
    absl::Status s = WriteShardFile(p, r, 2, "explicit", ReplicatedState{}, dir, &out);
    ASSERT_TRUE(s.ok()) << s;
  });
  for (int world : {1, 3}) {
    SCOPED_TRACE(world);
    const ShardPlan plan = make(world);
    int u, b, t;
    ASSERT_TRUE(plan.Find("w57", &u, &b, &t));
    EXPECT_GT(plan.units[u].buffers[b].padded_numel, 57);  // padding on every world size
    RunRanks(world, [&](int r, Communicator* c) {
      auto be = CpuBackend();
      CommClock clock;
      FsdpParams p(plan, r, 12345 /* a different init: everything must come from the file */,
                   be.get(), c, &clock);
      ReplicatedState st;
      absl::Status s = ReadShardFiles(dir, 2, "explicit", &p, &st);
      ASSERT_TRUE(s.ok()) << s;
      for (size_t bi = 0; bi < plan.units[0].buffers.size(); ++bi) {
        const BufferPlan& bp = plan.units[0].buffers[bi];
        for (int a = 0; a < 3; ++a) {
          std::vector<float> host(bp.shard_numel);
          p.DownloadShard(0, bi, static_cast<ShardArray>(a), host.data());
          for (int64_t i = 0; i < bp.shard_numel; ++i) {
            const int64_t g = bp.ShardBegin(r) + i;
            const float want = g < bp.numel ? value(a, bi, g) : 0.0f;
            ASSERT_EQ(Bits(host[i]), Bits(want)) << "buffer " << bi << " array " << a << " [" << g
                                                 << "] rank " << r;
          }
        }
      }
      auto m = p.GatherAll(false);
      ASSERT_TRUE(m.ok()) << m.status();
      ASSERT_EQ(m->at("w57").size(), 57u);
      ASSERT_EQ(m->at("w1x17").size(), 17u);
      ASSERT_EQ(m->at("w3").size(), 3u);
    });
  }
}

// ---- C08 -------------------------------------------------------------------------------------
// Master weights scaled by 10 before saving (the saved weight scales are still the init ones):
// after loading, every FP8 weight's scale is fp8_max / amax of the loaded weight, computed here,
// and the first step trains with those weights.
TEST(Checkpoint, C08_LoadedWeightsGetFreshScales) {
  const v1::JobSpec spec = TinySpec(TrainFile());
  const std::string dir = FreshDir("c08");
  std::vector<WeightScaling> init_scales;
  RunRanks(2, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto t = Trainer::Create(spec, r, 2, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    FsdpParams& p = (*t)->params();
    for (size_t u = 0; u < p.plan().units.size(); ++u) {
      for (size_t b = 0; b < p.plan().units[u].buffers.size(); ++b) {
        std::vector<float> host(p.plan().units[u].buffers[b].shard_numel);
        p.DownloadShard(u, b, ShardArray::kMaster, host.data());
        for (float& x : host) x *= 10.0f;
        p.UploadShardRange(u, b, ShardArray::kMaster, 0, host.data(), host.size());
      }
    }
    if (r == 0) init_scales = p.weight_scaling();
    v1::CheckpointSaved out;
    absl::Status s = SaveShard(**t, 0, dir, &out);
    ASSERT_TRUE(s.ok()) << s;
  });
  ASSERT_FALSE(init_scales.empty());
  RunRanks(2, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto t = Trainer::Create(spec, r, 2, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    absl::Status s = LoadShards(t->get(), dir, 2, 0);
    ASSERT_TRUE(s.ok()) << s;
    auto m = (*t)->params().GatherAll(false);
    ASSERT_TRUE(m.ok()) << m.status();
    const std::vector<WeightScaling> ws = (*t)->params().weight_scaling();
    ASSERT_EQ(ws.size(), init_scales.size());
    for (size_t i = 0; i < ws.size(); ++i) {
      float amax = 0;
      for (float x : m->at(ws[i].tensor)) amax = std::max(amax, std::fabs(x));
      const float want = static_cast<float>(448.0 / static_cast<double>(amax));
      EXPECT_EQ(Bits(ws[i].amax), Bits(amax)) << ws[i].name;
      EXPECT_EQ(Bits(ws[i].scale), Bits(want)) << ws[i].name;
      EXPECT_NEAR(ws[i].scale * 10.0f, init_scales[i].scale, 1e-3f * init_scales[i].scale)
          << ws[i].name << ": not the init scale";
    }
    auto res = (*t)->Step(0, false, true);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_TRUE(std::isfinite(res->loss_sum));
  });
}

// ---- corruption, missing files, mismatches -------------------------------------------------
// init.from_checkpoint: a fresh job takes another job's master weights; its AdamW moments and
// step counter and its FP8 scaling state only when asked. The reference is LoadShards (a resume
// of the same checkpoint), whose loads C07 shows to be exact.
TEST(Checkpoint, InitialShardsTakeWeightsAndOptionallyOptimizerAndFp8State) {
  const v1::JobSpec spec = TinySpec(TrainFile());
  const std::string dir = FreshDir("init");
  RunJob(spec, 2, 0, 3, "", 0, dir);
  RunRanks(2, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto resumed = Trainer::Create(spec, r, 2, be.get(), c);
    auto full = Trainer::Create(spec, r, 2, be.get(), c);
    auto weights = Trainer::Create(spec, r, 2, be.get(), c);
    auto fresh = Trainer::Create(spec, r, 2, be.get(), c);
    ASSERT_TRUE(resumed.ok() && full.ok() && weights.ok() && fresh.ok());
    ASSERT_TRUE(LoadShards(resumed->get(), dir, 2, 3).ok());
    ASSERT_TRUE(LoadInitialShards(full->get(), dir, 2, true, true).ok());
    ASSERT_TRUE(LoadInitialShards(weights->get(), dir, 2, false, false).ok());
    EXPECT_EQ((*full)->adamw_offset(), 3);
    EXPECT_EQ((*weights)->adamw_offset(), 0);
    EXPECT_EQ((*full)->CompletedSteps(), 0);  // starts at step 0
    const ShardPlan& plan = (*resumed)->params().plan();
    for (size_t u = 0; u < plan.units.size(); ++u) {
      for (size_t b = 0; b < plan.units[u].buffers.size(); ++b) {
        const size_t n = static_cast<size_t>(plan.units[u].buffers[b].shard_numel);
        for (ShardArray a : {ShardArray::kMaster, ShardArray::kAdamM, ShardArray::kAdamV}) {
          std::vector<float> want(n), got_full(n), got_weights(n);
          (*resumed)->params().DownloadShard(static_cast<int>(u), static_cast<int>(b), a, want.data());
          (*full)->params().DownloadShard(static_cast<int>(u), static_cast<int>(b), a, got_full.data());
          (*weights)->params().DownloadShard(static_cast<int>(u), static_cast<int>(b), a,
                                             got_weights.data());
          EXPECT_EQ(std::memcmp(want.data(), got_full.data(), n * 4), 0) << u << "/" << b;
          if (a == ShardArray::kMaster) {
            EXPECT_EQ(std::memcmp(want.data(), got_weights.data(), n * 4), 0) << u << "/" << b;
          } else {
            for (float x : got_weights) ASSERT_EQ(Bits(x), 0u) << "moments start at zero";
          }
        }
      }
    }
    // FP8 state: the checkpoint's with load_fp8_state, a fresh trainer's without.
    auto same = [](const std::vector<ScalingState>& x, const std::vector<ScalingState>& y) {
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (x[i].name != y[i].name || Bits(x[i].scale) != Bits(y[i].scale) ||
            x[i].history != y[i].history || x[i].initialised != y[i].initialised)
          return false;
      }
      return true;
    };
    EXPECT_TRUE(same((*full)->scaling().states(), (*resumed)->scaling().states()));
    EXPECT_TRUE(same((*weights)->scaling().states(), (*fresh)->scaling().states()));
    EXPECT_FALSE(same((*fresh)->scaling().states(), (*resumed)->scaling().states()));
    auto step = (*full)->Step(0, false, true);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_TRUE(std::isfinite(step->loss_sum));
  });
}

TEST(Checkpoint, CorruptMissingOrMismatchedFilesAreRefused) {
  const v1::JobSpec spec = TinySpec(TrainFile());
  const std::string dir = FreshDir("bad");
  RunJob(spec, 2, 0, 1, "", 0, dir);
  auto load = [&](const v1::JobSpec& s, const std::string& d, int saved_world, int64_t step) {
    return RunJob(s, 1, step, step, d, saved_world).load_status[0];
  };
  ASSERT_TRUE(load(spec, dir, 2, 1).ok());

  // One flipped byte in the middle of rank-1.ckpt.
  const std::string flipped = FreshDir("bad_flip");
  fs::create_directories(flipped);
  for (int r = 0; r < 2; ++r) {
    fs::copy_file(dir + "/" + CheckpointFileName(r), flipped + "/" + CheckpointFileName(r));
  }
  {
    const std::string path = flipped + "/rank-1.ckpt";
    std::string bytes = ReadAll(path);
    bytes[bytes.size() / 2] ^= 0x10;
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  }
  absl::Status s = load(spec, flipped, 2, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("rank-1.ckpt"), std::string::npos) << s;
  EXPECT_NE(s.message().find("checksum"), std::string::npos) << s;

  // Truncated rank-0.ckpt.
  {
    const std::string path = flipped + "/rank-0.ckpt";
    const std::string bytes = ReadAll(path);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 100);
  }
  s = load(spec, flipped, 2, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("rank-0.ckpt"), std::string::npos) << s;

  // Missing rank file (and a saved world size larger than what was written).
  s = load(spec, dir, 3, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("rank-2.ckpt is missing"), std::string::npos) << s;
  const std::string missing = FreshDir("bad_missing");
  fs::create_directories(missing);
  fs::copy_file(dir + "/rank-0.ckpt", missing + "/rank-0.ckpt");
  s = load(spec, missing, 2, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("rank-1.ckpt is missing"), std::string::npos) << s;

  // Another model / precision plan.
  v1::JobSpec other = spec;
  other.mutable_model()->set_ffn_dim(96);
  s = load(other, dir, 2, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("different model or precision plan"), std::string::npos) << s;
  EXPECT_NE(s.message().find("ffn_dim 64"), std::string::npos) << s;
  v1::JobSpec bf16 = spec;
  bf16.mutable_precision()->set_linears(v1::PRECISION_BF16);
  s = load(bf16, dir, 2, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;

  // A step other than the checkpoint's.
  s = load(spec, dir, 2, 5);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("after step 1"), std::string::npos) << s;

  // A save whose step is not the trainer's state.
  RunRanks(1, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto t = Trainer::Create(spec, r, 1, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    v1::CheckpointSaved out;
    absl::Status e = SaveShard(**t, 3, FreshDir("bad_step"), &out);
    EXPECT_EQ(e.code(), absl::StatusCode::kFailedPrecondition) << e;
  });

  // Saving where the directory cannot be created names the path and leaves nothing behind.
  const std::string blocker = ::testing::TempDir() + "/ckpt_blocker_file";
  std::ofstream(blocker) << "x";
  RunRanks(1, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto t = Trainer::Create(spec, r, 1, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    v1::CheckpointSaved out;
    absl::Status e = SaveShard(**t, 0, blocker + "/step-0", &out);
    EXPECT_FALSE(e.ok());
    EXPECT_NE(e.message().find(blocker), std::string::npos) << e;
  });
}

}  // namespace
}  // namespace fsdp8
