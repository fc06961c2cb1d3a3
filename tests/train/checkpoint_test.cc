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
    auto t = Trainer::Create(WithDefaults(spec, world), r, world, be.get(), c);
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
void ExpectResumeBitIdentical(const v1::JobSpec& spec, const std::string& dir) {
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

TEST(Checkpoint, C07_ResumeIsBitIdenticalToAnUninterruptedRun) {
  // FP8 linears, delayed scaling (default plan), FP32 moments.
  ExpectResumeBitIdentical(TinySpec(TrainFile()), FreshDir("c07"));
}

TEST(Checkpoint, C07_ResumeIsBitIdenticalWithBf16Moments) {
  v1::JobSpec spec = TinySpec(TrainFile());
  spec.mutable_optimizer()->set_state_precision(v1::PRECISION_BF16);
  ExpectResumeBitIdentical(spec, FreshDir("c07_bf16"));
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

// ---- BF16 moments (optimizer.state_precision) ----------------------------------------------
v1::JobSpec Bf16MomentsSpec(v1::JobSpec spec) {
  spec.mutable_optimizer()->set_state_precision(v1::PRECISION_BF16);
  return spec;
}

// Elements of one rank's shards, every flat buffer, on a world of `world` (for the file sizes).
int64_t ShardElements(const v1::JobSpec& spec, int world) {
  auto plan = MakeShardPlan(WithDefaults(spec, world), world);
  EXPECT_TRUE(plan.ok()) << plan.status();
  int64_t n = 0;
  for (const UnitPlan& u : plan->units) {
    for (const BufferPlan& b : u.buffers) n += b.shard_numel;
  }
  return n;
}

// A checkpoint with BF16 moments saved on 2 ranks loads on 3: saved again from 3 ranks and loaded
// back on 2 it reproduces the original files byte for byte (the moments stay bf16 and reshard
// exactly), its files hold the moments in 2 bytes each, and training resumes on 3 ranks: the
// losses of steps 2..4 follow the uninterrupted 2-rank run's. The plan is all FP32 so that only
// the order of f32 sums differs between 2 and 3 ranks (C12: 1e-5 relative); a moment of the two
// runs that lands on different sides of a bf16 rounding boundary adds at most lr * 2^-8 to one
// weight's step, hence 1e-4.
TEST(Checkpoint, Bf16MomentsSavedOnTwoRanksResumeOnThree) {
  v1::JobSpec spec = Bf16MomentsSpec(TinySpec(TrainFile()));
  spec.mutable_precision()->set_linears(v1::PRECISION_FP32);
  spec.mutable_precision()->set_embedding(v1::PRECISION_FP32);
  spec.mutable_precision()->set_lm_head(v1::PRECISION_FP32);
  const std::string dir = FreshDir("bf16_two");
  const JobRun full = RunJob(spec, 2, 0, 5, "", 0, "");
  const JobRun saved = RunJob(spec, 2, 0, 2, "", 0, dir);
  // 12 bytes per element (f32 master, two bf16 moments) instead of 4 * 3.
  v1::JobSpec fp32_moments = spec;
  fp32_moments.mutable_optimizer()->set_state_precision(v1::PRECISION_FP32);
  const std::string dir32 = FreshDir("bf16_two_fp32");
  const JobRun saved32 = RunJob(fp32_moments, 2, 0, 2, "", 0, dir32);
  EXPECT_EQ(saved32.saved[0].bytes() - saved.saved[0].bytes(), 4 * ShardElements(spec, 2));

  const std::string mid = FreshDir("bf16_mid3");
  const std::string back = FreshDir("bf16_back2");
  const JobRun loaded = RunJob(spec, 3, 2, 2, dir, 2, mid);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(loaded.load_status[r].ok()) << loaded.load_status[r];
  ExpectBitEqual(saved.master, loaded.master, "2 -> 3");
  const JobRun again = RunJob(spec, 2, 2, 2, mid, 3, back);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(again.load_status[r].ok()) << again.load_status[r];
    EXPECT_TRUE(ReadAll(dir + "/" + CheckpointFileName(r)) ==
                ReadAll(back + "/" + CheckpointFileName(r)))
        << "rank " << r << " file after 2 -> 3 -> 2";
  }

  const JobRun resumed = RunJob(spec, 3, 2, 5, dir, 2);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(resumed.load_status[r].ok()) << resumed.load_status[r];
  ASSERT_EQ(resumed.results[0].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    double loss2 = 0, loss3 = 0, tokens2 = 0, tokens3 = 0;
    for (int r = 0; r < 2; ++r) {
      loss2 += full.results[r][2 + i].loss_sum;
      tokens2 += full.results[r][2 + i].tokens;
    }
    for (int r = 0; r < 3; ++r) {
      loss3 += resumed.results[r][i].loss_sum;
      tokens3 += resumed.results[r][i].tokens;
    }
    ASSERT_EQ(tokens2, tokens3);
    EXPECT_EQ(resumed.results[0][i].step, 2 + i);
    EXPECT_NEAR(loss3 / tokens3, loss2 / tokens2, 1e-4 * loss2 / tokens2) << "step " << 2 + i;
  }
}

// The nearest bfloat16 value of a finite f32 x (ties to even), by nearbyint (round to nearest
// even in the default rounding mode) on the value's quantum: 2^(e - 8) for x = f * 2^e with
// 0.5 <= |f| < 1, at least 2^-133 (bfloat16's subnormal spacing). Independent of Bf16Bits.
float NearestBf16(float x) {
  int e = 0;
  std::frexp(static_cast<double>(x), &e);
  const double q = std::ldexp(1.0, std::max(e - 8, -133));
  return static_cast<float>(std::nearbyint(static_cast<double>(x) / q) * q);
}

// Every moment of a trainer's shards, in plan order, as f32.
std::vector<float> AllMoments(FsdpParams& p) {
  std::vector<float> all;
  for (size_t u = 0; u < p.plan().units.size(); ++u) {
    for (size_t b = 0; b < p.plan().units[u].buffers.size(); ++b) {
      std::vector<float> host(p.plan().units[u].buffers[b].shard_numel);
      for (ShardArray a : {ShardArray::kAdamM, ShardArray::kAdamV}) {
        p.DownloadShard(static_cast<int>(u), static_cast<int>(b), a, host.data());
        all.insert(all.end(), host.begin(), host.end());
      }
    }
  }
  return all;
}

// A checkpoint whose moments are in another precision than the job's state_precision is
// converted on load: FP32 moments into a BF16 job round to the nearest bfloat16 (computed here
// independently), BF16 moments into an FP32 job widen exactly; both then train on.
TEST(Checkpoint, MomentsOfAnotherStatePrecisionAreConvertedOnLoad) {
  const v1::JobSpec spec32 = TinySpec(TrainFile());
  const v1::JobSpec spec16 = Bf16MomentsSpec(spec32);
  const std::string dir32 = FreshDir("conv32"), dir16 = FreshDir("conv16");
  RunJob(spec32, 1, 0, 2, "", 0, dir32);
  RunJob(spec16, 1, 0, 2, "", 0, dir16);
  RunRanks(1, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto same32 = Trainer::Create(WithDefaults(spec32, 1), r, 1, be.get(), c);  // FP32 file, FP32 job
    auto into16 = Trainer::Create(WithDefaults(spec16, 1), r, 1, be.get(), c);  // FP32 file, BF16 job
    auto same16 = Trainer::Create(WithDefaults(spec16, 1), r, 1, be.get(), c);  // BF16 file, BF16 job
    auto into32 = Trainer::Create(WithDefaults(spec32, 1), r, 1, be.get(), c);  // BF16 file, FP32 job
    ASSERT_TRUE(same32.ok() && into16.ok() && same16.ok() && into32.ok());
    ASSERT_TRUE(LoadShards(same32->get(), dir32, 1, 2).ok());
    ASSERT_TRUE(LoadShards(same16->get(), dir16, 1, 2).ok());
    absl::Status s = LoadShards(into16->get(), dir32, 1, 2);
    ASSERT_TRUE(s.ok()) << s;
    s = LoadShards(into32->get(), dir16, 1, 2);
    ASSERT_TRUE(s.ok()) << s;
    const std::vector<float> m32 = AllMoments((*same32)->params());
    const std::vector<float> m16 = AllMoments((*same16)->params());
    const std::vector<float> got16 = AllMoments((*into16)->params());
    const std::vector<float> got32 = AllMoments((*into32)->params());
    ASSERT_EQ(m32.size(), got16.size());
    ASSERT_EQ(m16.size(), got32.size());
    int64_t rounded = 0;
    for (size_t i = 0; i < m32.size(); ++i) {
      ASSERT_EQ(Bits(got16[i]), Bits(NearestBf16(m32[i]))) << "element " << i << " " << m32[i];
      rounded += Bits(got16[i]) != Bits(m32[i]);
    }
    EXPECT_GT(rounded, 0) << "the FP32 moments were all bfloat16 values already";
    for (size_t i = 0; i < m16.size(); ++i) {
      ASSERT_EQ(Bits(m16[i]) & 0xFFFFu, 0u) << "element " << i << " is not a bfloat16";
      ASSERT_EQ(Bits(got32[i]), Bits(m16[i])) << "element " << i;
    }
    for (auto* t : {into16->get(), into32->get()}) {
      auto res = t->Step(2, false, true);
      ASSERT_TRUE(res.ok()) << res.status();
      EXPECT_TRUE(std::isfinite(res->loss_sum));
    }
  });
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
    auto t = Trainer::Create(WithDefaults(spec, 2), r, 2, be.get(), c);
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
    auto t = Trainer::Create(WithDefaults(spec, 2), r, 2, be.get(), c);
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
    auto resumed = Trainer::Create(WithDefaults(spec, 2), r, 2, be.get(), c);
    auto full = Trainer::Create(WithDefaults(spec, 2), r, 2, be.get(), c);
    auto weights = Trainer::Create(WithDefaults(spec, 2), r, 2, be.get(), c);
    auto fresh = Trainer::Create(WithDefaults(spec, 2), r, 2, be.get(), c);
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
    auto t = Trainer::Create(WithDefaults(spec, 1), r, 1, be.get(), c);
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
    auto t = Trainer::Create(WithDefaults(spec, 1), r, 1, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    v1::CheckpointSaved out;
    absl::Status e = SaveShard(**t, 0, blocker + "/step-0", &out);
    EXPECT_FALSE(e.ok());
    EXPECT_NE(e.message().find(blocker), std::string::npos) << e;
  });
}

}  // namespace
}  // namespace fsdp8
