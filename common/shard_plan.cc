#include "common/shard_plan.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/spec.h"
#include "common/token_shard.h"

namespace fsdp8 {
namespace {

// FNV-1a 64 of the tensor name: stable across builds and platforms.
uint64_t NameHash(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

TensorSpec MakeTensor(const std::string& name, std::vector<int64_t> shape, Init init,
                      bool fp8_linear) {
  TensorSpec t;
  t.name = name;
  t.numel = 1;
  for (int64_t d : shape) t.numel *= d;
  t.shape = std::move(shape);
  t.init = init;
  t.fan_in = init == Init::kKaimingUniform ? t.shape.back() : 0;
  t.init_id = NameHash(name);
  t.is_fp8_linear = fp8_linear;
  return t;
}

WireDtype WireOf(v1::Precision p) {
  switch (p) {
    case v1::PRECISION_FP8: return WireDtype::kFp8;
    case v1::PRECISION_FP32: return WireDtype::kFp32;
    default: return WireDtype::kBf16;
  }
}

using UnitTensors = std::vector<std::vector<TensorSpec>>;  // index = WireDtype

void Add(UnitTensors* u, WireDtype w, TensorSpec t) {
  (*u)[static_cast<int>(w)].push_back(std::move(t));
}

}  // namespace

const char* WireDtypeName(WireDtype d) {
  switch (d) {
    case WireDtype::kFp8: return "fp8";
    case WireDtype::kBf16: return "bf16";
    case WireDtype::kFp32: return "fp32";
  }
  return "?";
}

bool ShardPlan::Find(const std::string& name, int* unit, int* buffer, int* tensor) const {
  for (size_t u = 0; u < units.size(); ++u) {
    for (size_t b = 0; b < units[u].buffers.size(); ++b) {
      const auto& ts = units[u].buffers[b].tensors;
      for (size_t t = 0; t < ts.size(); ++t) {
        if (ts[t].name == name) {
          if (unit) *unit = static_cast<int>(u);
          if (buffer) *buffer = static_cast<int>(b);
          if (tensor) *tensor = static_cast<int>(t);
          return true;
        }
      }
    }
  }
  return false;
}

absl::StatusOr<ShardPlan> MakeShardPlan(
    const std::vector<std::pair<std::string, std::vector<std::vector<TensorSpec>>>>& units,
    int world_size, int alignment, int replicas) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world_size: must be >= 1 (got ", world_size, ")"));
  }
  if (replicas < 1) {
    return absl::InvalidArgumentError(absl::StrCat("sharding.replicas: must be >= 1 (got ", replicas, ")"));
  }
  if (alignment < 1) {
    return absl::InvalidArgumentError(absl::StrCat("sharding.alignment: must be >= 1 (got ", alignment, ")"));
  }
  ShardPlan plan;
  plan.world_size = world_size;
  plan.replicas = replicas;
  plan.alignment = alignment;
  const int64_t quantum = static_cast<int64_t>(world_size) * replicas * alignment;
  std::set<std::string> names;
  for (const auto& [uname, lists] : units) {
    if (lists.size() > 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unit ", uname, ": at most 3 tensor lists (one per wire dtype), got ", lists.size()));
    }
    UnitPlan up;
    up.name = uname;
    for (size_t w = 0; w < lists.size(); ++w) {
      BufferPlan b;
      b.wire = static_cast<WireDtype>(w);
      for (TensorSpec t : lists[w]) {
        int64_t prod = 1;
        for (int64_t d : t.shape) {
          if (d < 0) {
            return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": negative dimension"));
          }
          prod *= d;
        }
        if (t.shape.empty()) {
          if (t.numel < 0) {
            return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": negative numel"));
          }
          t.shape = {t.numel};
        } else if (t.numel == 0) {
          t.numel = prod;
        } else if (t.numel != prod) {
          return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": numel ", t.numel,
                                                         " != product of shape ", prod));
        }
        if (!names.insert(t.name).second) {
          return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, ": duplicate name"));
        }
        if (t.init_id == 0) t.init_id = NameHash(t.name);
        b.offsets.push_back(b.numel);
        b.numel += t.numel;
        b.tensors.push_back(std::move(t));
      }
      if (b.numel == 0) continue;  // no buffer for an empty dtype
      b.padded_numel = (b.numel + quantum - 1) / quantum * quantum;
      b.shard_numel = b.padded_numel / world_size;
      up.buffers.push_back(std::move(b));
    }
    plan.units.push_back(std::move(up));
  }
  return plan;
}

namespace {

// A blockwise FP8 wire buffer of `tensors` (each K = cols columns), whole bands per shard.
BufferPlan MakeBandBuffer(std::vector<TensorSpec> tensors, int64_t cols, int world_size,
                          int replicas) {
  BufferPlan b;
  b.wire = WireDtype::kFp8;
  b.block_cols = cols;
  const int64_t band = b.BandNumel();
  for (TensorSpec& t : tensors) {
    const int64_t rows = t.shape.front();
    b.offsets.push_back(b.numel);
    b.numel += (rows + kWireBandRows - 1) / kWireBandRows * band;
    b.tensors.push_back(std::move(t));
  }
  const int64_t bands = b.numel / band, quantum = static_cast<int64_t>(world_size) * replicas;
  b.padded_numel = (bands + quantum - 1) / quantum * quantum * band;
  b.shard_numel = b.padded_numel / world_size;
  return b;
}

absl::StatusOr<ShardPlan> MakeSpecPlan(const v1::JobSpec& spec_in, int world_size, int replicas) {
  if (absl::Status s = CheckDefaulted(spec_in, 0); !s.ok()) return s;
  const v1::JobSpec& spec = spec_in;
  const v1::ModelConfig& m = spec.model();
  const int64_t C = m.d_model(), L = m.n_layers(), H = m.n_heads(), Hkv = m.n_kv_heads(),
                F = m.ffn_dim(), V = m.vocab_size();
  if (C <= 0 || L <= 0 || H <= 0 || Hkv <= 0 || F <= 0 || V <= 0 || C % H != 0) {
    return absl::InvalidArgumentError(
        "model: sizes must be > 0 and d_model divisible by n_heads (validate the spec first)");
  }
  const int64_t hd = C / H;
  std::vector<std::pair<std::string, UnitTensors>> units;
  // Per unit: its blockwise linears grouped by in_features (first appearance order).
  std::vector<std::vector<std::pair<int64_t, std::vector<TensorSpec>>>> banded;

  {
    UnitTensors u(3);
    Add(&u, WireOf(spec.precision().embedding()),
        MakeTensor("model.embed_tokens.weight", {V, C}, Init::kNormal, false));
    units.emplace_back("embedding", std::move(u));
    banded.emplace_back();
  }
  for (int64_t i = 0; i < L; ++i) {
    const v1::Precision p = LayerLinearPrecision(spec, static_cast<int>(i));
    // Rowwise FP8 linears travel in BF16 and are quantized at each use: a BF16 buffer, like BF16
    // linears. Blockwise ones travel as FP8 codes with 128 x 128 block scales, in band buffers.
    const v1::Fp8Granularity g = LayerGranularity(spec, static_cast<int>(i));
    const bool scaled = g != v1::FP8_GRANULARITY_TENSORWISE;
    const bool blockwise = p == v1::PRECISION_FP8 && g == v1::FP8_GRANULARITY_BLOCKWISE;
    const bool fp8 = p == v1::PRECISION_FP8 && !scaled;
    const WireDtype lw = scaled ? WireDtype::kBf16 : WireOf(p);
    const WireDtype nw = p == v1::PRECISION_FP32 ? WireDtype::kFp32 : WireDtype::kBf16;
    const std::string pre = absl::StrCat("model.layers.", i, ".");
    UnitTensors u(3);
    auto& bands = banded.emplace_back();
    auto lin = [&](const std::string& n, int64_t out, int64_t in) {
      if (!blockwise) {
        Add(&u, lw, MakeTensor(pre + n, {out, in}, Init::kKaimingUniform, fp8));
        return;
      }
      auto it = std::find_if(bands.begin(), bands.end(),
                             [in](const auto& kb) { return kb.first == in; });
      if (it == bands.end()) it = bands.insert(bands.end(), {in, {}});
      it->second.push_back(MakeTensor(pre + n, {out, in}, Init::kKaimingUniform, true));
    };
    Add(&u, nw, MakeTensor(pre + "input_layernorm.weight", {C}, Init::kOnes, false));
    lin("self_attn.q_proj.weight", C, C);
    lin("self_attn.k_proj.weight", Hkv * hd, C);
    lin("self_attn.v_proj.weight", Hkv * hd, C);
    lin("self_attn.o_proj.weight", C, C);
    Add(&u, nw, MakeTensor(pre + "post_attention_layernorm.weight", {C}, Init::kOnes, false));
    lin("mlp.gate_proj.weight", F, C);
    lin("mlp.up_proj.weight", F, C);
    lin("mlp.down_proj.weight", C, F);
    units.emplace_back(absl::StrCat("layers.", i), std::move(u));
  }
  {
    UnitTensors u(3);
    const WireDtype hw = WireOf(spec.precision().lm_head());
    Add(&u, hw, MakeTensor("model.norm.weight", {C}, Init::kOnes, false));
    if (!m.tie_word_embeddings()) {  // tied: the head reads model.embed_tokens.weight
      Add(&u, hw, MakeTensor("lm_head.weight", {V, C}, Init::kKaimingUniform, false));
    }
    units.emplace_back("head", std::move(u));
    banded.emplace_back();
  }
  absl::StatusOr<ShardPlan> plan =
      MakeShardPlan(units, world_size, spec.sharding().alignment(), replicas);
  if (!plan.ok()) return plan;
  // Blockwise units: their band buffers first (wire fp8), then the norms' buffer.
  for (size_t u = 0; u < banded.size(); ++u) {
    std::vector<BufferPlan> bufs;
    for (auto& [cols, tensors] : banded[u]) {
      bufs.push_back(MakeBandBuffer(std::move(tensors), cols, world_size, replicas));
    }
    auto& dst = plan->units[u].buffers;
    dst.insert(dst.begin(), std::make_move_iterator(bufs.begin()),
               std::make_move_iterator(bufs.end()));
  }
  return plan;
}

}  // namespace

absl::StatusOr<ShardPlan> MakeShardPlan(const v1::JobSpec& spec, int world_size) {
  return MakeSpecPlan(spec, world_size, 1);
}

absl::StatusOr<ShardPlan> MakeShardPlan(const v1::JobSpec& spec, const Mesh& mesh) {
  return MakeSpecPlan(spec, mesh.shard_size, mesh.replicas);
}

absl::StatusOr<ShardPlan> MakeCheckpointShardPlan(const v1::JobSpec& spec, int files) {
  const v1::ShardingSpec& sh = spec.sharding();
  const bool per_shard = sh.optimizer_sharding() != v1::OPTIMIZER_SHARDING_WORLD;
  return MakeSpecPlan(spec, files, per_shard ? std::max(1, sh.replicas()) : 1);
}

v1::ShardPlan ToProto(const ShardPlan& plan) {
  v1::ShardPlan out;
  out.set_world_size(plan.world_size * plan.replicas);  // the job's ranks (W = R x S)
  out.set_alignment(plan.alignment);
  int64_t total = 0, padded = 0;
  for (const UnitPlan& u : plan.units) {
    v1::FsdpUnit* pu = out.add_units();
    pu->set_name(u.name);
    for (const BufferPlan& b : u.buffers) {
      v1::FlatBuffer* pb = pu->add_buffers();
      pb->set_wire_dtype(WireDtypeName(b.wire));
      pb->set_numel(b.numel);
      pb->set_padded_numel(b.padded_numel);
      pb->set_shard_numel(b.shard_numel);
      const int64_t eb = b.wire == WireDtype::kFp8 ? 1 : b.wire == WireDtype::kBf16 ? 2 : 4;
      pb->set_element_bytes(static_cast<int32_t>(eb));
      for (int r = 0; r < plan.world_size; ++r) {
        v1::RankShard* rs = pb->add_ranks();
        const int64_t begin = b.ShardBegin(r), end = b.ShardEnd(r);
        const int64_t padding = end - std::max(begin, std::min(end, b.numel));
        rs->set_rank(r);
        rs->set_offset(begin);
        rs->set_numel(b.shard_numel);
        rs->set_padding(padding);
        rs->set_offset_bytes(begin * eb);
        rs->set_bytes(b.shard_numel * eb);
        rs->set_padding_bytes(padding * eb);
      }
      for (size_t i = 0; i < b.tensors.size(); ++i) {
        v1::TensorSlot* s = pb->add_tensors();
        s->set_name(b.tensors[i].name);
        for (int64_t d : b.tensors[i].shape) s->add_shape(d);
        s->set_offset(b.offsets[i]);
        s->set_numel(b.tensors[i].numel);
      }
      total += b.numel;
      padded += b.padded_numel;
    }
  }
  out.set_total_numel(total);
  out.set_total_padded_numel(padded);
  return out;
}

float InitValue(const TensorSpec& t, int64_t index, uint64_t seed) {
  switch (t.init) {
    case Init::kOnes:
      return 1.0f;
    case Init::kKaimingUniform: {
      const uint64_t h =
          SplitMix64(SplitMix64(SplitMix64(seed) ^ t.init_id) ^ static_cast<uint64_t>(index));
      const double u = static_cast<double>(h >> 11) * 0x1.0p-53;  // [0, 1)
      const double bound = 1.0 / std::sqrt(static_cast<double>(t.fan_in > 0 ? t.fan_in : 1));
      return static_cast<float>((2.0 * u - 1.0) * bound);
    }
    case Init::kNormal: {
      const uint64_t h1 =
          SplitMix64(SplitMix64(SplitMix64(seed) ^ t.init_id) ^ static_cast<uint64_t>(index));
      const uint64_t h2 = SplitMix64(h1);
      const double u1 = (static_cast<double>(h1 >> 11) + 0.5) * 0x1.0p-53;  // (0, 1)
      const double u2 = static_cast<double>(h2 >> 11) * 0x1.0p-53;          // [0, 1)
      const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
      return static_cast<float>(z);
    }
  }
  return 0.0f;
}

}  // namespace fsdp8
