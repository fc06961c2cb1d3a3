// Shard planner: C05 (tensors smaller than the world), C06 (57 and 1x17 elements on 2 ranks), the
// default model's plan and world-size-independent initialisation.
#include "common/shard_plan.h"

#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "common/spec.h"

namespace fsdp8 {
namespace {

using UnitList = std::vector<std::pair<std::string, std::vector<std::vector<TensorSpec>>>>;

TensorSpec T(const std::string& name, std::vector<int64_t> shape) {
  TensorSpec t;
  t.name = name;
  t.shape = std::move(shape);
  t.init = Init::kKaimingUniform;
  t.fan_in = t.shape.back();
  return t;
}

// A one-unit plan with a single bf16 buffer holding `tensors`.
ShardPlan OneBuffer(const std::vector<TensorSpec>& tensors, int world, int align) {
  UnitList units = {{"u", {{}, tensors}}};
  auto plan = MakeShardPlan(units, world, align);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

std::vector<float> RandomBits(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits = rng();
    std::memcpy(&v[i], &bits, 4);
  }
  // Special patterns: -0, +0, quiet NaN with payload, signalling-NaN payload, -inf, denormal.
  const uint32_t special[] = {0x80000000u, 0x00000000u, 0x7fc12345u, 0xff800001u,
                              0xff800000u, 0x00000001u};
  for (size_t i = 0; i < 6 && i < n; ++i) std::memcpy(&v[i], &special[i], 4);
  return v;
}

// Shards `full` over the plan's ranks, concatenates them, unpads, and returns the result.
std::vector<float> RoundTrip(const BufferPlan& b, int world, const std::vector<float>& full,
                             std::vector<float>* gathered_out = nullptr) {
  std::vector<float> gathered(b.padded_numel);
  for (int r = 0; r < world; ++r) {
    std::vector<float> shard(b.shard_numel, 123.0f);
    ExtractShard(b, r, full.data(), shard.data());
    std::memcpy(gathered.data() + r * b.shard_numel, shard.data(), b.shard_numel * 4);
  }
  std::vector<float> out(b.numel);
  Unpad(b, gathered.data(), out.data());
  if (gathered_out) *gathered_out = gathered;
  return out;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// ---- C05 --------------------------------------------------------------------------------------

TEST(ShardPlan, C05_ThreeElementsOnFourAndEightRanks) {
  for (int world : {4, 8}) {
    ShardPlan p = OneBuffer({T("tiny", {3})}, world, 1);
    ASSERT_EQ(p.units.size(), 1u);
    ASSERT_EQ(p.units[0].buffers.size(), 1u);
    const BufferPlan& b = p.units[0].buffers[0];
    EXPECT_EQ(b.wire, WireDtype::kBf16);
    EXPECT_EQ(b.numel, 3);
    EXPECT_EQ(b.padded_numel, world);  // ceil(3 / world) * world
    EXPECT_EQ(b.shard_numel, 1);
    // Ranks 3.. own only padding.
    for (int r = 3; r < world; ++r) EXPECT_GE(b.ShardBegin(r), b.numel) << r;
    const std::vector<float> full = {1.5f, -0.0f, 7.0f};
    std::vector<float> gathered;
    EXPECT_TRUE(BitEqual(RoundTrip(b, world, full, &gathered), full));
    for (int64_t i = 3; i < b.padded_numel; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &gathered[i], 4);
      EXPECT_EQ(bits, 0u) << "padding must be +0 at " << i;
    }
  }
}

TEST(ShardPlan, C05_ModelSmallerThanWorld) {
  // d_model 2, 1 head, vocab 3: the embedding (3 x 2 = 6 elements) on 8 ranks, alignment 1.
  v1::JobSpec spec;
  spec.mutable_model()->set_d_model(2);
  spec.mutable_model()->set_n_heads(1);
  spec.mutable_model()->set_n_layers(1);
  spec.mutable_model()->set_ffn_dim(2);
  spec.mutable_model()->set_vocab_size(3);
  spec.mutable_sharding()->set_alignment(1);
  auto plan = MakeShardPlan(WithDefaults(spec, 8), 8);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const BufferPlan& emb = plan->units[0].buffers[0];
  EXPECT_EQ(emb.numel, 6);
  EXPECT_EQ(emb.padded_numel, 8);
  EXPECT_EQ(emb.shard_numel, 1);
  EXPECT_GE(emb.ShardBegin(6), emb.numel);
  EXPECT_GE(emb.ShardBegin(7), emb.numel);
  for (const UnitPlan& u : plan->units) {
    for (const BufferPlan& b : u.buffers) {
      EXPECT_EQ(b.padded_numel % 8, 0) << u.name;
      const std::vector<float> full = RandomBits(b.numel, 7);
      EXPECT_TRUE(BitEqual(RoundTrip(b, 8, full), full)) << u.name;
    }
  }
}

// ---- C06 --------------------------------------------------------------------------------------

TEST(ShardPlan, C06_FiftySevenElementsOnTwoRanks) {
  for (int align : {1, 16}) {
    ShardPlan p = OneBuffer({T("w57", {57})}, 2, align);
    const BufferPlan& b = p.units[0].buffers[0];
    EXPECT_EQ(b.numel, 57);
    EXPECT_EQ(b.padded_numel, align == 1 ? 58 : 64);  // ceil(57/2)*2, ceil(57/32)*32
    EXPECT_EQ(b.shard_numel, b.padded_numel / 2);
    const std::vector<float> full = RandomBits(57, 57);
    const std::vector<float> back = RoundTrip(b, 2, full);
    ASSERT_TRUE(BitEqual(back, full));
    // Re-shard the unpadded tensor to 1 and 3 ranks: exactly 57 elements come back.
    for (int world : {1, 3}) {
      ShardPlan q = OneBuffer({T("w57", {57})}, world, align);
      const BufferPlan& bq = q.units[0].buffers[0];
      EXPECT_EQ(bq.numel, 57);
      EXPECT_EQ(bq.padded_numel % (world * align), 0);
      const std::vector<float> again = RoundTrip(bq, world, back);
      EXPECT_EQ(again.size(), 57u);
      EXPECT_TRUE(BitEqual(again, full)) << world;
    }
  }
}

TEST(ShardPlan, C06_OneBySeventeenOnTwoRanks) {
  ShardPlan p = OneBuffer({T("w1x17", {1, 17})}, 2, 1);
  const BufferPlan& b = p.units[0].buffers[0];
  EXPECT_EQ(b.numel, 17);
  EXPECT_EQ(b.padded_numel, 18);
  EXPECT_EQ(b.shard_numel, 9);
  EXPECT_EQ(b.tensors[0].shape, (std::vector<int64_t>{1, 17}));
  const std::vector<float> full = RandomBits(17, 17);
  EXPECT_TRUE(BitEqual(RoundTrip(b, 2, full), full));
}

TEST(ShardPlan, C06_SeveralTensorsKeepOffsets) {
  ShardPlan p = OneBuffer({T("a", {57}), T("b", {1, 17}), T("c", {3})}, 2, 1);
  const BufferPlan& b = p.units[0].buffers[0];
  EXPECT_EQ(b.offsets, (std::vector<int64_t>{0, 57, 74}));
  EXPECT_EQ(b.numel, 77);
  EXPECT_EQ(b.padded_numel, 78);
  const std::vector<float> full = RandomBits(77, 3);
  EXPECT_TRUE(BitEqual(RoundTrip(b, 2, full), full));
}

TEST(ShardPlan, ExplicitPlanErrors) {
  UnitList bad = {{"u", {{}, {T("x", {3})}}}};
  EXPECT_EQ(MakeShardPlan(bad, 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeShardPlan(bad, 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
  UnitList dup = {{"u", {{}, {T("x", {3}), T("x", {2})}}}};
  EXPECT_EQ(MakeShardPlan(dup, 2, 1).status().code(), absl::StatusCode::kInvalidArgument);
  UnitList empty = {{"u", {{}, {}, {}}}};
  auto p = MakeShardPlan(empty, 2, 1);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->units[0].buffers.empty());  // no buffer for an empty dtype
}

// ---- default model ----------------------------------------------------------------------------

v1::JobSpec DefaultSpec() {
  v1::JobSpec s;
  s.mutable_data()->set_train_path("/data/train.bin");
  return s;
}

const char* kLinears[] = {"self_attn.q_proj.weight", "self_attn.k_proj.weight",
                          "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                          "mlp.gate_proj.weight",    "mlp.up_proj.weight",
                          "mlp.down_proj.weight"};

TEST(ShardPlan, DefaultModelParameterCount) {
  // Hand count, d 128, 4 layers, 4 heads (no GQA), ffn 384, vocab 256:
  //   embedding + lm_head 2 * 256 * 128 = 65536; final norm 128;
  //   per layer: 2 norms 256 + q,k,v,o 4 * 128 * 128 = 65536 + gate,up,down 3 * 128 * 384 = 147456
  //              = 213248; 4 layers = 852992.  Total 918656.
  const int64_t C = 128, L = 4, F = 384, V = 256;
  const int64_t formula = V * C * 2 + C + L * (2 * C + 4 * C * C + 3 * C * F);
  ASSERT_EQ(formula, 918656);
  for (int world : {1, 2, 3}) {
    auto plan = MakeShardPlan(WithDefaults(DefaultSpec(), world), world);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->world_size, world);
    EXPECT_EQ(plan->alignment, 16);
    ASSERT_EQ(plan->units.size(), 6u);
    EXPECT_EQ(plan->units[0].name, "embedding");
    EXPECT_EQ(plan->units[1].name, "layers.0");
    EXPECT_EQ(plan->units[4].name, "layers.3");
    EXPECT_EQ(plan->units[5].name, "head");
    int64_t total = 0, total_padded = 0;
    for (const UnitPlan& u : plan->units) {
      int last_wire = -1;
      for (const BufferPlan& b : u.buffers) {
        EXPECT_GT(static_cast<int>(b.wire), last_wire) << "WireDtype order in " << u.name;
        last_wire = static_cast<int>(b.wire);
        EXPECT_GT(b.numel, 0);
        EXPECT_EQ(b.padded_numel % (world * 16), 0);
        EXPECT_GE(b.padded_numel, b.numel);
        EXPECT_LT(b.padded_numel - b.numel, world * 16);
        EXPECT_EQ(b.shard_numel * world, b.padded_numel);
        int64_t off = 0;
        for (size_t i = 0; i < b.tensors.size(); ++i) {
          EXPECT_EQ(b.offsets[i], off);
          off += b.tensors[i].numel;
        }
        EXPECT_EQ(off, b.numel);
        total += b.numel;
        total_padded += b.padded_numel;
      }
    }
    EXPECT_EQ(total, formula);
    const v1::ShardPlan proto = ToProto(*plan);
    EXPECT_EQ(proto.total_numel(), formula);
    EXPECT_EQ(proto.total_padded_numel(), total_padded);
    EXPECT_EQ(proto.units_size(), 6);
    EXPECT_EQ(proto.units(1).buffers(0).wire_dtype(), "fp8");
  }
}

TEST(ShardPlan, DefaultModelShapesAndInits) {
  auto plan = MakeShardPlan(WithDefaults(DefaultSpec(), 2), 2);
  ASSERT_TRUE(plan.ok());
  int u, b, t;
  ASSERT_TRUE(plan->Find("model.embed_tokens.weight", &u, &b, &t));
  const TensorSpec& emb = plan->units[u].buffers[b].tensors[t];
  EXPECT_EQ(u, 0);
  EXPECT_EQ(emb.shape, (std::vector<int64_t>{256, 128}));
  EXPECT_EQ(emb.init, Init::kNormal);
  EXPECT_EQ(plan->units[u].buffers[b].wire, WireDtype::kBf16);
  ASSERT_TRUE(plan->Find("model.layers.3.mlp.down_proj.weight", &u, &b, &t));
  const TensorSpec& down = plan->units[u].buffers[b].tensors[t];
  EXPECT_EQ(u, 4);
  EXPECT_EQ(down.shape, (std::vector<int64_t>{128, 384}));
  EXPECT_EQ(down.fan_in, 384);
  EXPECT_EQ(down.init, Init::kKaimingUniform);
  ASSERT_TRUE(plan->Find("model.layers.0.input_layernorm.weight", &u, &b, &t));
  EXPECT_EQ(plan->units[u].buffers[b].tensors[t].init, Init::kOnes);
  ASSERT_TRUE(plan->Find("lm_head.weight", &u, &b, &t));
  EXPECT_EQ(u, 5);
  EXPECT_EQ(plan->units[u].buffers[b].tensors[t].fan_in, 128);
  ASSERT_TRUE(plan->Find("model.norm.weight", &u, &b, &t));
  EXPECT_EQ(u, 5);
  EXPECT_FALSE(plan->Find("model.layers.4.mlp.up_proj.weight", &u, &b, &t));
  // init_id distinct per tensor.
  std::set<uint64_t> ids;
  int n = 0;
  for (const UnitPlan& up : plan->units)
    for (const BufferPlan& bp : up.buffers)
      for (const TensorSpec& ts : bp.tensors) {
        ids.insert(ts.init_id);
        ++n;
      }
  EXPECT_EQ(static_cast<int>(ids.size()), n);
  EXPECT_EQ(n, 1 + 4 * 9 + 2);
}

TEST(ShardPlan, GroupedQueryShapes) {
  v1::JobSpec s = DefaultSpec();
  s.mutable_model()->set_n_kv_heads(2);  // head_dim 32 -> k/v (64, 128)
  auto plan = MakeShardPlan(WithDefaults(s, 1), 1);
  ASSERT_TRUE(plan.ok());
  int u, b, t;
  ASSERT_TRUE(plan->Find("model.layers.1.self_attn.k_proj.weight", &u, &b, &t));
  EXPECT_EQ(plan->units[u].buffers[b].tensors[t].shape, (std::vector<int64_t>{64, 128}));
}

TEST(ShardPlan, Fp8BuffersHoldExactlyTheBlockLinears) {
  v1::JobSpec s = DefaultSpec();
  s.mutable_precision()->set_linears(v1::PRECISION_FP8);
  auto plan = MakeShardPlan(WithDefaults(s, 2), 2);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->units[0].buffers.size(), 1u);  // embedding: bf16 only
  EXPECT_EQ(plan->units[5].buffers.size(), 1u);  // head: bf16 only
  for (int i = 0; i < 4; ++i) {
    const UnitPlan& u = plan->units[1 + i];
    ASSERT_EQ(u.buffers.size(), 2u);
    const BufferPlan& f8 = u.buffers[0];
    EXPECT_EQ(f8.wire, WireDtype::kFp8);
    ASSERT_EQ(f8.tensors.size(), 7u);
    for (int k = 0; k < 7; ++k) {
      EXPECT_EQ(f8.tensors[k].name, "model.layers." + std::to_string(i) + "." + kLinears[k]);
      EXPECT_TRUE(f8.tensors[k].is_fp8_linear);
    }
    const BufferPlan& bf = u.buffers[1];
    EXPECT_EQ(bf.wire, WireDtype::kBf16);
    ASSERT_EQ(bf.tensors.size(), 2u);
    EXPECT_EQ(bf.tensors[0].name, "model.layers." + std::to_string(i) + ".input_layernorm.weight");
    EXPECT_EQ(bf.tensors[1].name,
              "model.layers." + std::to_string(i) + ".post_attention_layernorm.weight");
  }
  for (const UnitPlan& u : {plan->units[0], plan->units[5]})
    for (const BufferPlan& b : u.buffers)
      for (const TensorSpec& t : b.tensors) EXPECT_FALSE(t.is_fp8_linear) << t.name;
}

TEST(ShardPlan, LayerOverrideMovesLinearsOutOfFp8) {
  v1::JobSpec s = DefaultSpec();
  auto* o = s.mutable_precision()->add_overrides();
  o->set_layer(2);
  o->set_linears(v1::PRECISION_BF16);
  auto* o3 = s.mutable_precision()->add_overrides();
  o3->set_layer(3);
  o3->set_linears(v1::PRECISION_FP32);
  s.mutable_precision()->set_embedding(v1::PRECISION_FP32);
  auto plan = MakeShardPlan(WithDefaults(s, 3), 3);
  ASSERT_TRUE(plan.ok());
  const UnitPlan& l2 = plan->units[3];
  ASSERT_EQ(l2.buffers.size(), 1u);
  EXPECT_EQ(l2.buffers[0].wire, WireDtype::kBf16);
  EXPECT_EQ(l2.buffers[0].tensors.size(), 9u);
  EXPECT_EQ(l2.buffers[0].tensors[1].name, "model.layers.2.self_attn.q_proj.weight");
  for (const TensorSpec& t : l2.buffers[0].tensors) EXPECT_FALSE(t.is_fp8_linear);
  const UnitPlan& l3 = plan->units[4];
  ASSERT_EQ(l3.buffers.size(), 1u);
  EXPECT_EQ(l3.buffers[0].wire, WireDtype::kFp32);  // FP32 linears: norms travel in fp32 too
  EXPECT_EQ(l3.buffers[0].tensors.size(), 9u);
  EXPECT_EQ(plan->units[1].buffers[0].wire, WireDtype::kFp8);  // layer 0 unaffected
  EXPECT_EQ(plan->units[0].buffers[0].wire, WireDtype::kFp32); // embedding FP32
  EXPECT_EQ(plan->units[5].buffers[0].wire, WireDtype::kBf16); // head default BF16
}

// ---- initialisation ---------------------------------------------------------------------------

// The whole flat buffer as the ranks of a `world`-rank plan would initialise their shards.
std::vector<float> InitByShards(const ShardPlan& p, int unit, int buffer, uint64_t seed) {
  const BufferPlan& b = p.units[unit].buffers[buffer];
  std::vector<float> out;
  for (int r = 0; r < p.world_size; ++r) {
    for (int64_t g = b.ShardBegin(r); g < b.ShardEnd(r); ++g) {
      if (g >= b.numel) break;
      size_t t = 0;
      while (t + 1 < b.tensors.size() && b.offsets[t + 1] <= g) ++t;
      out.push_back(InitValue(b.tensors[t], g - b.offsets[t], seed));
    }
  }
  return out;
}

TEST(ShardPlan, InitIndependentOfWorldSize) {
  auto p1 = MakeShardPlan(WithDefaults(DefaultSpec(), 1), 1);
  auto p2 = MakeShardPlan(WithDefaults(DefaultSpec(), 2), 2);
  auto p3 = MakeShardPlan(WithDefaults(DefaultSpec(), 3), 3);
  ASSERT_TRUE(p1.ok() && p2.ok() && p3.ok());
  for (size_t u = 0; u < p1->units.size(); ++u) {
    for (size_t b = 0; b < p1->units[u].buffers.size(); ++b) {
      const auto a = InitByShards(*p1, u, b, 1234);
      EXPECT_EQ(static_cast<int64_t>(a.size()), p1->units[u].buffers[b].numel);
      EXPECT_TRUE(BitEqual(a, InitByShards(*p2, u, b, 1234))) << u << "/" << b;
      EXPECT_TRUE(BitEqual(a, InitByShards(*p3, u, b, 1234))) << u << "/" << b;
    }
  }
  // Another seed changes the values; different tensors get different streams.
  int u, b, t;
  ASSERT_TRUE(p1->Find("model.layers.0.self_attn.q_proj.weight", &u, &b, &t));
  const TensorSpec q = p1->units[u].buffers[b].tensors[t];
  ASSERT_TRUE(p1->Find("model.layers.0.self_attn.k_proj.weight", &u, &b, &t));
  const TensorSpec k = p1->units[u].buffers[b].tensors[t];
  int same_seed = 0, same_tensor = 0;
  for (int i = 0; i < 100; ++i) {
    same_seed += InitValue(q, i, 1234) == InitValue(q, i, 1235);
    same_tensor += InitValue(q, i, 1234) == InitValue(k, i, 1234);
  }
  EXPECT_LT(same_seed, 3);
  EXPECT_LT(same_tensor, 3);
}

TEST(ShardPlan, KaimingUniformBound) {
  auto plan = MakeShardPlan(WithDefaults(DefaultSpec(), 1), 1);
  ASSERT_TRUE(plan.ok());
  int u, b, t;
  for (const char* name : {"model.layers.1.self_attn.q_proj.weight",
                           "model.layers.1.mlp.down_proj.weight", "lm_head.weight"}) {
    ASSERT_TRUE(plan->Find(name, &u, &b, &t));
    const TensorSpec& ts = plan->units[u].buffers[b].tensors[t];
    const double bound = 1.0 / std::sqrt(static_cast<double>(ts.fan_in));  // 1/sqrt(128), 1/sqrt(384)
    double maxabs = 0, sum = 0, sumsq = 0;
    for (int64_t i = 0; i < ts.numel; ++i) {
      const double v = InitValue(ts, i, 99);
      maxabs = std::max(maxabs, std::fabs(v));
      sum += v;
      sumsq += v * v;
    }
    EXPECT_LE(maxabs, bound * (1 + 1e-6)) << name;
    EXPECT_GT(maxabs, 0.99 * bound) << name;  // the whole interval is used
    // Uniform(-a, a): variance a^2 / 3; numel >= 16384, tolerance 3%.
    EXPECT_NEAR(sumsq / ts.numel, bound * bound / 3, 0.03 * bound * bound / 3) << name;
    EXPECT_NEAR(sum / ts.numel, 0.0, 0.02 * bound) << name;
  }
  ASSERT_TRUE(plan->Find("model.norm.weight", &u, &b, &t));
  EXPECT_EQ(InitValue(plan->units[u].buffers[b].tensors[t], 5, 1), 1.0f);
}

TEST(ShardPlan, NormalInitMoments) {
  TensorSpec t;
  t.name = "n";
  t.shape = {100000};
  t.numel = 100000;
  t.init = Init::kNormal;
  t.init_id = 42;
  double sum = 0, sumsq = 0;
  int within1 = 0;
  for (int64_t i = 0; i < t.numel; ++i) {
    const double v = InitValue(t, i, 1234);
    ASSERT_TRUE(std::isfinite(v));
    sum += v;
    sumsq += v * v;
    within1 += std::fabs(v) < 1.0;
  }
  const double mean = sum / t.numel;
  const double sd = std::sqrt(sumsq / t.numel - mean * mean);
  // n = 1e5: standard error of the mean 1/sqrt(n) = 0.0032, of the std 1/sqrt(2n) = 0.0022,
  // of P(|z| < 1) = 0.6827: sqrt(p(1-p)/n) = 0.0015. Tolerances are about 4.5 standard errors.
  EXPECT_NEAR(mean, 0.0, 0.015);
  EXPECT_NEAR(sd, 1.0, 0.01);
  EXPECT_NEAR(within1 / 1e5, 0.6827, 0.007);
}

}  // namespace
}  // namespace fsdp8

namespace fsdp8 {
namespace {

// A mesh's plan is made at its S ranks and padded to W x alignment: 40 elements, alignment 4, on
// 2 replicas x 2 ranks pad to a multiple of 16 (48, shards of 24), where a flat world-2 plan pads
// to a multiple of 8 (40, shards of 20). One replica is the flat plan.
TEST(ShardPlan, MeshPadsToTheWorldAndShardsOverTheGroup) {
  const std::vector<TensorSpec> t = {T("w", {40})};
  UnitList units = {{"u", {{}, t}}};
  auto mesh = MakeShardPlan(units, 2, 4, 2);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->world_size, 2);
  EXPECT_EQ(mesh->replicas, 2);
  const BufferPlan& b = mesh->units[0].buffers[0];
  EXPECT_EQ(b.padded_numel, 48);
  EXPECT_EQ(b.shard_numel, 24);
  EXPECT_EQ(b.ShardBegin(1), 24);
  const BufferPlan& flat = OneBuffer(t, 2, 4).units[0].buffers[0];
  EXPECT_EQ(flat.padded_numel, 40);
  EXPECT_EQ(flat.shard_numel, 20);
  EXPECT_EQ(MakeShardPlan(units, 2, 4, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// The spec overloads: a flat mesh gives the world-size plan bit for bit; 2 x 2 and 3 x 1 give
// the group's S ranks, every buffer padded to a multiple of W x 16 (the default alignment).
TEST(ShardPlan, MeshOfSpec) {
  const v1::JobSpec spec = WithDefaults(DefaultSpec(), 4);
  Mesh flat;
  flat.shard_size = 4;
  auto a = MakeShardPlan(spec, flat);
  auto b = MakeShardPlan(spec, 4);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(ToProto(*a).SerializeAsString(), ToProto(*b).SerializeAsString());
  for (auto [R, S] : {std::pair{2, 2}, std::pair{3, 1}}) {
    Mesh m;
    m.replicas = R;
    m.shard_size = S;
    auto plan = MakeShardPlan(spec, m);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->world_size, S);
    EXPECT_EQ(plan->replicas, R);
    for (const UnitPlan& u : plan->units) {
      for (const BufferPlan& buf : u.buffers) {
        EXPECT_EQ(buf.padded_numel % (R * S * 16), 0) << u.name;
        EXPECT_LT(buf.padded_numel - buf.numel, R * S * 16) << u.name;
        EXPECT_EQ(buf.shard_numel * S, buf.padded_numel) << u.name;
      }
    }
  }
}

// A checkpoint's layout: SHARD_GROUP files of a 2-replica job are shards of a plan padded for
// both replicas (files x 2 x 16); WORLD files are a flat plan over the files (files x 16).
TEST(ShardPlan, CheckpointLayoutOfAMesh) {
  v1::JobSpec spec = WithDefaults(DefaultSpec(), 4);
  spec.mutable_sharding()->set_replicas(2);
  auto group = MakeCheckpointShardPlan(spec, 2);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(group->world_size, 2);
  for (const UnitPlan& u : group->units) {
    for (const BufferPlan& buf : u.buffers) EXPECT_EQ(buf.padded_numel % 64, 0) << u.name;
  }
  spec.mutable_sharding()->set_optimizer_sharding(v1::OPTIMIZER_SHARDING_WORLD);
  auto world = MakeCheckpointShardPlan(spec, 4);
  auto flat4 = MakeShardPlan(spec, 4);
  ASSERT_TRUE(world.ok() && flat4.ok());
  EXPECT_EQ(ToProto(*world).SerializeAsString(), ToProto(*flat4).SerializeAsString());
}

// The blockwise FP8 wire (granularity BLOCKWISE): a block's linears go to band buffers, one per
// in_features, each tensor in whole 128-row bands and each rank's shard whole bands, so that no
// 128 x 128 block (nor its scale) is split between ranks. d 192 (3 heads, 1 kv head: k, v 64 x
// 192), ffn 320: bands of 192 columns q 2, k 1, v 1, o 2, gate 3, up 3 = 12; of 320: down 2.
v1::JobSpec BlockwiseWireSpec() {
  v1::JobSpec s = DefaultSpec();
  s.mutable_model()->set_d_model(192);
  s.mutable_model()->set_n_heads(3);
  s.mutable_model()->set_n_kv_heads(1);
  s.mutable_model()->set_ffn_dim(320);
  s.mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  return s;
}

TEST(ShardPlan, BlockwiseWireLaysLinearsOutInWholeBands) {
  // By hand: 192-column bands hold 128 x 192 = 24576 elements, 320-column ones 40960.
  const int64_t b192 = 128 * 192, b320 = 128 * 320;
  struct Want {
    int world;
    int64_t shard192, shard320;  // bands per shard: ceil(12 / W), ceil(2 / W)
  };
  for (const Want& w : {Want{1, 12, 2}, Want{2, 6, 1}, Want{3, 4, 1}, Want{5, 3, 1}}) {
    SCOPED_TRACE("world " + std::to_string(w.world));
    auto plan = MakeShardPlan(WithDefaults(BlockwiseWireSpec(), w.world), w.world);
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (int l = 0; l < 4; ++l) {
      const UnitPlan& u = plan->units[1 + l];
      ASSERT_EQ(u.buffers.size(), 3u);
      const BufferPlan& a = u.buffers[0];
      const BufferPlan& d = u.buffers[1];
      EXPECT_EQ(u.buffers[2].wire, WireDtype::kBf16);  // the norms, as before
      EXPECT_EQ(u.buffers[2].tensors.size(), 2u);
      EXPECT_FALSE(u.buffers[2].Banded());
      EXPECT_EQ(a.wire, WireDtype::kFp8);
      EXPECT_EQ(a.block_cols, 192);
      EXPECT_EQ(d.block_cols, 320);
      ASSERT_EQ(a.tensors.size(), 6u);
      ASSERT_EQ(d.tensors.size(), 1u);
      EXPECT_EQ(d.tensors[0].name, "model.layers." + std::to_string(l) + ".mlp.down_proj.weight");
      // q at 0 (2 bands), k at 2, v at 3, o at 4, gate at 6, up at 9; 12 bands.
      const std::vector<int64_t> bands = {0, 2, 3, 4, 6, 9};
      for (size_t t = 0; t < bands.size(); ++t) EXPECT_EQ(a.offsets[t], bands[t] * b192) << t;
      EXPECT_EQ(a.tensors[1].numel, 64 * 192);  // the tensor itself: its rows, not its band
      EXPECT_EQ(a.numel, 12 * b192);
      EXPECT_EQ(a.shard_numel, w.shard192 * b192);
      EXPECT_EQ(a.padded_numel, w.world * w.shard192 * b192);
      EXPECT_EQ(d.shard_numel, w.shard320 * b320);
      EXPECT_EQ(d.padded_numel, w.world * w.shard320 * b320);
      EXPECT_EQ(a.ShardScales(), w.shard192 * 2);  // 2 blocks per 192-column band
      EXPECT_EQ(d.ShardScales(), w.shard320 * 3);
      EXPECT_EQ(a.ScaleOffset(a.offsets[4]), 6 * 2);  // gate's first block row: band 6
    }
  }
}

// No world size, mesh or shape splits a block: every 128 x 128 block of every blockwise tensor
// (rows r0..r0+127 of its band, any 128 columns) lies inside one rank's [begin, end), and the
// shards are equal, whole bands.
TEST(ShardPlan, BlockwiseWireNeverSplitsABlock) {
  for (auto [C, F, kv] : {std::tuple{192, 320, 1}, std::tuple{128, 384, 4}, std::tuple{64, 176, 2},
                          std::tuple{320, 200, 5}}) {
    v1::JobSpec s = BlockwiseWireSpec();
    s.mutable_model()->set_d_model(C);
    s.mutable_model()->set_ffn_dim(F);
    s.mutable_model()->set_n_heads(kv == 5 ? 5 : 4);
    s.mutable_model()->set_n_kv_heads(kv);
    for (int world = 1; world <= 8; ++world) {
      for (int replicas : {1, 2}) {
        SCOPED_TRACE("d " + std::to_string(C) + " ffn " + std::to_string(F) + " world " +
                     std::to_string(world) + " replicas " + std::to_string(replicas));
        Mesh mesh;
        mesh.shard_size = world;
        mesh.replicas = replicas;
        auto plan = MakeShardPlan(WithDefaults(s, world * replicas), mesh);
        ASSERT_TRUE(plan.ok()) << plan.status();
        int banded = 0;
        for (const UnitPlan& u : plan->units) {
          for (const BufferPlan& b : u.buffers) {
            if (!b.Banded()) continue;
            ++banded;
            const int64_t band = 128 * b.block_cols;
            EXPECT_EQ(b.shard_numel % (band * replicas), 0);  // whole bands, whole pieces
            EXPECT_EQ(b.padded_numel, b.shard_numel * world);
            EXPECT_GE(b.padded_numel, b.numel);
            int64_t end = 0;
            for (size_t t = 0; t < b.tensors.size(); ++t) {
              const TensorSpec& ts = b.tensors[t];
              EXPECT_EQ(ts.shape[1], b.block_cols) << ts.name;
              EXPECT_EQ(b.offsets[t], end) << ts.name;  // packed, band after band
              EXPECT_EQ(b.offsets[t] % band, 0) << ts.name;
              for (int64_t r0 = 0; r0 < ts.shape[0]; r0 += 128) {
                const int64_t first = b.offsets[t] + r0 * b.block_cols;
                const int64_t last =
                    b.offsets[t] + (std::min<int64_t>(r0 + 128, ts.shape[0]) * b.block_cols) - 1;
                EXPECT_EQ(first / b.shard_numel, last / b.shard_numel)
                    << ts.name << " block row " << r0 / 128 << " split between ranks";
              }
              end = b.offsets[t] + (ts.shape[0] + 127) / 128 * band;
            }
            EXPECT_EQ(b.numel, end);
          }
        }
        EXPECT_EQ(banded, C == F ? 4 : 8);  // one or two per layer
      }
    }
  }
}

// Rowwise keeps the BF16 wire: no band buffers, its layout that of a BF16 block.
TEST(ShardPlan, RowwiseKeepsTheBf16Wire) {
  v1::JobSpec s = BlockwiseWireSpec();
  s.mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_ROWWISE);
  auto plan = MakeShardPlan(WithDefaults(s, 2), 2);
  ASSERT_TRUE(plan.ok());
  v1::JobSpec bf = BlockwiseWireSpec();
  bf.mutable_precision()->mutable_fp8()->clear_granularity();
  bf.mutable_precision()->set_linears(v1::PRECISION_BF16);
  auto want = MakeShardPlan(WithDefaults(bf, 2), 2);
  ASSERT_TRUE(want.ok());
  for (size_t u = 1; u + 1 < plan->units.size(); ++u) {
    ASSERT_EQ(plan->units[u].buffers.size(), 1u);
    const BufferPlan& b = plan->units[u].buffers[0];
    EXPECT_EQ(b.wire, WireDtype::kBf16);
    EXPECT_FALSE(b.Banded());
    EXPECT_EQ(b.offsets, want->units[u].buffers[0].offsets);
    EXPECT_EQ(b.padded_numel, want->units[u].buffers[0].padded_numel);
  }
}

}  // namespace
}  // namespace fsdp8
