// Model features of published Llama-family checkpoints: tied embeddings (one shared weight,
// sharded once, its gradient the sum of both uses reduced once; C12 across world sizes) and
// Llama 3.1's RoPE scaling (the frequencies and their use by the model).
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/rope.h"
#include "common/shard_plan.h"
#include "common/spec.h"
#include "gtest/gtest.h"
#include "tests/support/ranks.h"
#include "tests/train/trainer_test_util.h"
#include "train/trainer.h"

namespace fsdp8 {
namespace {

using testing::AllPrecision;
using testing::CpuBackend;
using testing::RunRanks;
using testing::TinySpec;
using testing::TrainFile;
using Tensors = std::map<std::string, std::vector<float>>;

v1::JobSpec TiedSpec() {
  v1::JobSpec spec = TinySpec(TrainFile());
  spec.mutable_model()->set_tie_word_embeddings(true);
  AllPrecision(&spec, v1::PRECISION_FP32);
  return spec;
}

// max |a - b| over max |b| (0 when b is all zero and a equals it).
double RelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double mx = 0, diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    mx = std::max(mx, static_cast<double>(std::fabs(b[i])));
    diff = std::max(diff, static_cast<double>(std::fabs(a[i] - b[i])));
  }
  return mx > 0 ? diff / mx : diff;
}

struct RunOut {
  Tensors grads;                 // after ForwardBackward(0) from the initial weights
  std::vector<double> losses;    // ForwardLoss(100 + k) after step k
};

// On `world` ranks: the step-0 gradients, then `steps` steps with a validation-style loss after
// each. `prepare` may change the weights of each rank's trainer first (then recast).
RunOut TrainRanks(const v1::JobSpec& spec, int world, int steps,
               const std::function<void(Trainer*)>& prepare = nullptr) {
  std::vector<RunOut> out(world);
  RunRanks(world, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto t = Trainer::Create(WithDefaults(spec, world), r, world, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    if (prepare) {
      prepare(t->get());
      ASSERT_TRUE((*t)->RecastWeights().ok());
    }
    ASSERT_TRUE((*t)->ForwardBackward(0).ok());
    auto g = (*t)->params().GatherAll(true);
    ASSERT_TRUE(g.ok()) << g.status();
    out[r].grads = *g;
    for (int k = 0; k < steps; ++k) {
      auto res = (*t)->Step(k, false, false);
      ASSERT_TRUE(res.ok()) << res.status();
      auto l = (*t)->ForwardLoss(100 + k);
      ASSERT_TRUE(l.ok()) << l.status();
      out[r].losses.push_back(*l);
    }
  });
  return out[0];
}

TEST(TiedEmbeddings, OneSharedWeightShardedOnceInTheEmbeddingUnit) {
  const v1::JobSpec spec = TiedSpec();
  const ShardPlan plan = *MakeShardPlan(WithDefaults(spec, 3), 3);
  EXPECT_FALSE(plan.Find("lm_head.weight", nullptr, nullptr, nullptr));
  int u = -1, b = -1, t = -1;
  ASSERT_TRUE(plan.Find("model.embed_tokens.weight", &u, &b, &t));
  EXPECT_EQ(plan.units[u].name, "embedding");
  ASSERT_TRUE(plan.Find("model.norm.weight", &u, &b, &t));
  EXPECT_EQ(plan.units[u].name, "head");
  EXPECT_EQ(plan.units[u].buffers[b].numel, 32);  // the final norm alone
  // Untied, the same spec has the head weight: the tied plan is smaller by exactly V x C.
  v1::JobSpec untied = spec;
  untied.mutable_model()->set_tie_word_embeddings(false);
  const ShardPlan up = *MakeShardPlan(WithDefaults(untied, 3), 3);
  EXPECT_EQ(ToProto(up).total_numel() - ToProto(plan).total_numel(), 256 * 32);
}

// C12 with tied embeddings: the same job on 1, 2 and 3 ranks (FP32) has the same gradients
// within f32 summation-order error (the bound of Trainer.C12_WorldSizeOneAndThreeDoTheSameMath:
// 2e-5 x max |g| per tensor) and the same losses after 4 steps (1e-5 relative).
TEST(TiedEmbeddings, C12_TrainsOnOneTwoAndThreeRanksLikeOneRank) {
  const v1::JobSpec spec = TiedSpec();
  const RunOut one = TrainRanks(spec, 1, 4);
  ASSERT_EQ(one.grads.count("lm_head.weight"), 0u);
  for (int world : {2, 3}) {
    SCOPED_TRACE(world);
    const RunOut many = TrainRanks(spec, world, 4);
    ASSERT_EQ(many.grads.size(), one.grads.size());
    for (const auto& [name, g1] : one.grads) {
      EXPECT_LE(RelDiff(many.grads.at(name), g1), 2e-5) << name;
    }
    for (int k = 0; k < 4; ++k) {
      EXPECT_NEAR(many.losses[k], one.losses[k], 1e-5 * one.losses[k]) << "after step " << k;
    }
  }
  // The losses go down (the shared weight is being trained through both uses).
  EXPECT_LT(one.losses[3], one.losses[0]);
}

// The tied gradient is the sum of the embedding's and the head's contributions: an untied model
// whose lm_head.weight is set to the same values as its embedding computes the two separately
// (1 rank); the tied model on 3 ranks must have embed_grad = untied embed_grad + untied head_grad
// (f32 sums in another order: 2e-5 x max |g|), and every other gradient the untied one's.
TEST(TiedEmbeddings, GradientIsTheSumOfBothUsesReducedOnce) {
  const v1::JobSpec tied = TiedSpec();
  v1::JobSpec untied = tied;
  untied.mutable_model()->set_tie_word_embeddings(false);
  const int64_t n = 256 * 32;
  const RunOut t3 = TrainRanks(tied, 3, 0);
  const RunOut u1 = TrainRanks(untied, 1, 0, [&](Trainer* t) {
    auto m = t->params().GatherAll(false);
    ASSERT_TRUE(m.ok());
    const std::vector<float>& e = m->at("model.embed_tokens.weight");
    ASSERT_EQ(static_cast<int64_t>(e.size()), n);
    for (int64_t i = 0; i < n; ++i) t->params().SetMasterElement("lm_head.weight", i, e[i]);
  });
  std::vector<float> sum(n);
  const std::vector<float>& ge = u1.grads.at("model.embed_tokens.weight");
  const std::vector<float>& gh = u1.grads.at("lm_head.weight");
  for (int64_t i = 0; i < n; ++i) sum[i] = ge[i] + gh[i];
  // Both parts matter (the test would pass for a model that dropped one otherwise).
  EXPECT_GT(RelDiff(ge, sum), 0.05);
  EXPECT_GT(RelDiff(gh, sum), 0.05);
  EXPECT_LE(RelDiff(t3.grads.at("model.embed_tokens.weight"), sum), 2e-5);
  for (const auto& [name, g] : t3.grads) {
    if (name != "model.embed_tokens.weight") {
      EXPECT_LE(RelDiff(g, u1.grads.at(name)), 2e-5) << name;
    }
  }
}

// The default precision plan (FP8 blocks, BF16 embedding and head) with a tied head also trains
// on 2 ranks: finite, decreasing losses.
TEST(TiedEmbeddings, DefaultPrecisionPlanTrainsOnTwoRanks) {
  v1::JobSpec spec = TinySpec(TrainFile());
  spec.mutable_model()->set_tie_word_embeddings(true);
  const RunOut r = TrainRanks(spec, 2, 6);
  for (double l : r.losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(r.losses.back(), r.losses.front());
}

// ---- RoPE scaling ----------------------------------------------------------------------------

v1::ModelConfig Llama31Rope() {  // Llama 3.1 8B's head dimension, theta and rope_scaling
  v1::ModelConfig m;
  m.set_d_model(4096);
  m.set_n_heads(32);
  m.set_rope_theta(500000.0);
  v1::RopeScaling* r = m.mutable_rope_scaling();
  r->set_rope_type("llama3");
  r->set_factor(8.0);
  r->set_low_freq_factor(1.0);
  r->set_high_freq_factor(4.0);
  r->set_original_max_position_embeddings(8192);
  return m;
}

// The llama3 rule evaluated here in double from its definition (Llama 3.1's reference
// apply_scaling): wavelengths below 8192 / 4 keep their frequency, above 8192 / 1 are slowed by
// 8, in between interpolated by s = (8192 / wavelen - 1) / (4 - 1). f32 steps in RopeInvFreq
// change each value by a few ulp at most: 1e-6 relative.
TEST(RopeScaling, Llama3FrequenciesFollowTheRule) {
  const std::vector<float> f = RopeInvFreq(Llama31Rope());
  ASSERT_EQ(f.size(), 64u);
  int kept = 0, slowed = 0, mixed = 0;
  for (int i = 0; i < 64; ++i) {
    const double base = 1.0 / std::pow(500000.0, 2.0 * i / 128.0);
    const double wavelen = 2 * M_PI / base;
    double want = base;
    if (wavelen > 8192) {
      want = base / 8;
      ++slowed;
    } else if (wavelen >= 2048) {
      const double s = (8192 / wavelen - 1) / 3;
      want = (1 - s) * base / 8 + s * base;
      ++mixed;
    } else {
      ++kept;
    }
    EXPECT_NEAR(f[i], want, 1e-6 * want) << "i " << i;
  }
  // Each regime occurs (so each branch is checked).
  EXPECT_GT(kept, 0);
  EXPECT_GT(slowed, 0);
  EXPECT_GT(mixed, 0);
  v1::ModelConfig plain = Llama31Rope();
  plain.clear_rope_scaling();
  const std::vector<float> p = RopeInvFreq(plain);
  EXPECT_EQ(p[0], 1.0f);
  EXPECT_EQ(f[0], p[0]);            // the fastest frequency is untouched
  EXPECT_EQ(f[63], p[63] / 8.0f);   // the slowest is divided by the factor
}

TEST(RopeScaling, InvalidScalingIsRefusedNamingTheField) {
  v1::JobSpec spec = TinySpec(TrainFile());
  *spec.mutable_model()->mutable_rope_scaling() = Llama31Rope().rope_scaling();
  EXPECT_TRUE(ValidateSpec(spec, 1, {}, false).ok()) << ValidateSpec(spec, 1, {}, false);
  spec.mutable_model()->mutable_rope_scaling()->set_rope_type("yarn");
  EXPECT_EQ(ValidateSpec(spec, 1, {}, false).message(),
            "model.rope_scaling.rope_type: must be \"llama3\" (the only RoPE scaling implemented; "
            "got \"yarn\")");
  spec.mutable_model()->mutable_rope_scaling()->set_rope_type("llama3");
  spec.mutable_model()->mutable_rope_scaling()->set_high_freq_factor(0.5);
  EXPECT_NE(ValidateSpec(spec, 1, {}, false).message().find("model.rope_scaling.high_freq_factor"),
            std::string::npos);
  spec.mutable_model()->mutable_rope_scaling()->clear_factor();
  EXPECT_NE(ValidateSpec(spec, 1, {}, false).message().find("model.rope_scaling.factor"),
            std::string::npos);
}

// The backends rotate by the frequencies SetRopeInvFreq gave: pair (x_i, x_{i+D/2}) = (1, 0) at
// position t becomes (cos(t f_i), sin(t f_i)); another theta still gets the plain frequencies.
TEST(RopeScaling, BackendRotatesByTheSetFrequencies) {
  auto be = CpuBackend();
  const int64_t T = 5, D = 8;
  const std::vector<float> freq = {0.5f, 0.25f, 0.125f, 0.01f};
  be->SetRopeInvFreq(10000.0f, freq);
  std::vector<float> host(T * D, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < D / 2; ++i) host[t * D + i] = 1.0f;
  }
  float* x = static_cast<float*>(be->Alloc(host.size() * 4));
  be->CopyToDevice(x, host.data(), host.size() * 4);
  be->RopeForward(x, 1, T, 1, D, 10000.0f);
  std::vector<float> out(host.size());
  be->CopyToHost(out.data(), x, out.size() * 4);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < D / 2; ++i) {
      const double a = static_cast<double>(static_cast<float>(t) * freq[i]);
      EXPECT_NEAR(out[t * D + i], std::cos(a), 1e-6) << t << " " << i;
      EXPECT_NEAR(out[t * D + i + D / 2], std::sin(a), 1e-6) << t << " " << i;
    }
  }
  // theta 500000: not the set one, so plain RoPE (frequency of pair 1 = 500000^(-2/8)).
  be->CopyToDevice(x, host.data(), host.size() * 4);
  be->RopeForward(x, 1, T, 1, D, 500000.0f);
  be->CopyToHost(out.data(), x, out.size() * 4);
  EXPECT_NEAR(out[4 * D + 1], std::cos(4.0 * std::pow(500000.0, -0.25)), 1e-6);
  be->Free(x);
}

// The model uses the scaled frequencies: a llama3 scaling with factor 1 changes no frequency (up
// to f32 rounding), so the loss equals plain RoPE's; factor 8 with original length 8 (every
// wavelength of d 32 / 2 heads beyond 8 / 4 is changed) changes the loss.
TEST(RopeScaling, ModelLossFollowsTheFrequencies) {
  v1::JobSpec plain = TinySpec(TrainFile());
  AllPrecision(&plain, v1::PRECISION_FP32);
  auto loss = [](const v1::JobSpec& spec) {
    double out = 0;
    RunRanks(1, [&](int r, Communicator* c) {
      auto be = CpuBackend();
      auto t = Trainer::Create(WithDefaults(spec, 1), r, 1, be.get(), c);
      ASSERT_TRUE(t.ok()) << t.status();
      auto l = (*t)->ForwardLoss(0);
      ASSERT_TRUE(l.ok()) << l.status();
      out = *l;
    });
    return out;
  };
  v1::JobSpec one = plain;
  v1::RopeScaling* r = one.mutable_model()->mutable_rope_scaling();
  r->set_rope_type("llama3");
  r->set_factor(1.0);
  r->set_low_freq_factor(1.0);
  r->set_high_freq_factor(4.0);
  r->set_original_max_position_embeddings(8);
  v1::JobSpec eight = one;
  eight.mutable_model()->mutable_rope_scaling()->set_factor(8.0);
  const double lp = loss(plain), l1 = loss(one), l8 = loss(eight);
  EXPECT_NEAR(l1, lp, 1e-6 * lp);
  EXPECT_GT(std::fabs(l8 - lp), 1e-4 * lp);
}

}  // namespace
}  // namespace fsdp8
