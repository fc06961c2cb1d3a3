#include "common/step_plan.h"

#include <algorithm>
#include <initializer_list>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "common/model_dims.h"
#include "common/spec.h"

namespace fsdp8 {

BackendCaps BackendCapsOf(const std::string& backend) {
  BackendCaps c;
  c.cuda = backend == "cuda";
  return c;
}

int64_t DtypeBytes(Dtype d) { return d == Dtype::kF32 ? 4 : d == Dtype::kBf16 ? 2 : 1; }

int64_t HeadChunkRows(int64_t N, int64_t V, int64_t chunk_bytes) {
  int64_t rows = std::max<int64_t>(1, std::min<int64_t>(N, std::max<int64_t>(1, chunk_bytes) /
                                                               (V * 4)));
  if (rows < N && rows > 128) rows -= rows % 128;
  return rows;
}

namespace {

PlannedTensor Tensor(std::string name, Dtype dtype, std::vector<int64_t> shape) {
  int64_t bytes = DtypeBytes(dtype);
  for (int64_t s : shape) bytes *= s;
  return PlannedTensor{std::move(name), dtype, std::move(shape), bytes};
}

// Whether the tensors ending in `names` lie one after the other, in this order, in one flat
// buffer of `unit` (one matrix: a fused GEMM reads them as one weight).
bool Adjacent(const UnitPlan& unit, std::initializer_list<const char*> names) {
  int buf = -1;
  int64_t next = -1;
  for (const char* n : names) {
    bool hit = false;
    for (size_t b = 0; b < unit.buffers.size() && !hit; ++b) {
      const BufferPlan& bp = unit.buffers[b];
      for (size_t t = 0; t < bp.tensors.size() && !hit; ++t) {
        if (!absl::EndsWith(bp.tensors[t].name, n)) continue;
        if (buf >= 0 && (static_cast<int>(b) != buf || bp.offsets[t] != next)) return false;
        buf = static_cast<int>(b);
        next = bp.offsets[t] + bp.tensors[t].numel;
        hit = true;
      }
    }
    if (!hit) return false;
  }
  return true;
}

// What block `bp`'s forward keeps for its backward (train/model.cc BlockActs).
std::vector<PlannedTensor> Saved(const BlockPlan& bp, const ModelDims& d, int64_t N, int64_t B,
                                 bool norm_inputs_bf16) {
  const int64_t C = d.d_model, F = d.ffn_dim, nq = d.q_width(), nk = d.kv_width();
  const bool fp8 = bp.linears == v1::PRECISION_FP8, a16 = bp.attention == Dtype::kBf16;
  std::vector<PlannedTensor> s;
  const bool norm16 = bp.fp8_bf16 && norm_inputs_bf16;
  s.push_back(Tensor(norm16 ? "x_in16" : "x_in", norm16 ? Dtype::kBf16 : Dtype::kF32, {N, C}));
  s.push_back(Tensor("rstd1", Dtype::kF32, {N}));
  s.push_back(Tensor("lse", Dtype::kF32, {B, d.n_heads, d.seq_len}));
  s.push_back(Tensor(norm16 ? "h16" : "h", norm16 ? Dtype::kBf16 : Dtype::kF32, {N, C}));
  s.push_back(Tensor("rstd2", Dtype::kF32, {N}));
  if (bp.fp8_bf16) {
    s.push_back(Tensor("qkv.x8", Dtype::kE4M3, {N, C}));  // n1 cast once for q, k and v
    if (bp.fused_qkv) {
      s.push_back(Tensor("qkv16", Dtype::kBf16, {N, nq + 2 * nk}));
    } else {
      s.push_back(Tensor("q16", Dtype::kBf16, {N, nq}));
      s.push_back(Tensor("k16", Dtype::kBf16, {N, nk}));
      s.push_back(Tensor("v16", Dtype::kBf16, {N, nk}));
    }
    s.push_back(Tensor("att16", Dtype::kBf16, {N, C}));
    s.push_back(Tensor("o_proj.x8", Dtype::kE4M3, {N, C}));
    s.push_back(Tensor("gate_up.x8", Dtype::kE4M3, {N, C}));  // n2 cast once for gate and up
    if (bp.fused_mlp) {
      s.push_back(Tensor("gate_up16", Dtype::kBf16, {N, 2 * F}));
    } else {
      s.push_back(Tensor("gate16", Dtype::kBf16, {N, F}));
      s.push_back(Tensor("up16", Dtype::kBf16, {N, F}));
    }
    if (!bp.recast_down) s.push_back(Tensor("down_proj.x8", Dtype::kE4M3, {N, F}));
    return s;
  }
  // The generic block: f32 activations; FP8 linears keep their own input codes, the others the
  // f32 inputs.
  if (!fp8) s.push_back(Tensor("n1", Dtype::kF32, {N, C}));
  const Dtype qkv = a16 ? Dtype::kBf16 : Dtype::kF32;
  const char* sfx = a16 ? "16" : "";
  s.push_back(Tensor(std::string("q") + sfx, qkv, {N, nq}));
  s.push_back(Tensor(std::string("k") + sfx, qkv, {N, nk}));
  s.push_back(Tensor(std::string("v") + sfx, qkv, {N, nk}));
  if (a16) s.push_back(Tensor("att16", Dtype::kBf16, {N, C}));
  if (!a16 || !fp8) s.push_back(Tensor("att", Dtype::kF32, {N, C}));
  if (!fp8) {
    s.push_back(Tensor("n2", Dtype::kF32, {N, C}));
    s.push_back(Tensor("gate", Dtype::kF32, {N, F}));
    s.push_back(Tensor("up", Dtype::kF32, {N, F}));
    s.push_back(Tensor("act", Dtype::kF32, {N, F}));
    return s;
  }
  s.push_back(Tensor("gate16", Dtype::kBf16, {N, F}));
  s.push_back(Tensor("up16", Dtype::kBf16, {N, F}));
  for (const char* n : {"q_proj.x8", "k_proj.x8", "v_proj.x8", "o_proj.x8", "gate_proj.x8",
                        "up_proj.x8"}) {
    s.push_back(Tensor(n, Dtype::kE4M3, {N, C}));
  }
  s.push_back(Tensor("down_proj.x8", Dtype::kE4M3, {N, F}));
  return s;
}

}  // namespace

absl::StatusOr<StepPlan> MakeStepPlan(const v1::JobSpec& spec, int world_size,
                                      const BackendCaps& caps, const StepPlanOptions& options) {
  (void)caps;  // no decision of the step depends on it yet; the memory plan reads it
  absl::StatusOr<ShardPlan> shards = MakeShardPlan(spec, world_size);
  if (!shards.ok()) return shards.status();
  const ModelDims d = ModelDimsOf(spec.model());
  const v1::TrainingSpec& tr = spec.training();
  const v1::PrecisionSpec& pp = spec.precision();
  StepPlan p;
  p.world_size = world_size;
  const int64_t B = std::max(1, tr.microbatch());
  p.tokens = B * d.seq_len;
  const int64_t local_batch = tr.global_batch() / std::max(1, world_size);
  p.microbatches = static_cast<int>(std::max<int64_t>(1, local_batch / B));
  p.recompute = tr.activation_recompute();
  p.head_bf16 = pp.lm_head() != v1::PRECISION_FP32;
  p.head_chunk_rows = HeadChunkRows(p.tokens, d.vocab_size, options.head_chunk_logit_bytes);
  for (const UnitPlan& u : shards->units) {
    PlannedUnit& pu = p.units.emplace_back();
    pu.name = u.name;
    for (const BufferPlan& b : u.buffers) {
      pu.buffers.push_back({b.wire, b.padded_numel, b.shard_numel});
    }
  }
  const bool attn16 = pp.attention() == v1::PRECISION_BF16;
  const v1::Fp8Recipe& r = pp.fp8();
  const bool delayed = r.recipe() != v1::SCALING_RECIPE_CURRENT;
  const bool norm_inputs_bf16 = tr.saved_norm_inputs() == v1::PRECISION_BF16;
  for (int l = 0; l < d.n_layers; ++l) {
    BlockPlan& bp = p.blocks.emplace_back();
    bp.linears = LayerLinearPrecision(spec, l);
    bp.attention = attn16 ? Dtype::kBf16 : Dtype::kF32;
    const bool fp8 = bp.linears == v1::PRECISION_FP8;
    bp.fp8_bf16 = fp8 && attn16;
    // Groups share scales only where the fused path runs, under delayed scaling (the CURRENT
    // recipe measures every grad-output first, so its backward never fuses).
    if (bp.fp8_bf16 && r.fused_projections() && delayed) {
      const UnitPlan& unit = shards->units[1 + l];
      bp.group_qkv = Adjacent(unit, {"q_proj.weight", "k_proj.weight", "v_proj.weight"}) &&
                     d.head_dim % 8 == 0;
      bp.group_mlp = Adjacent(unit, {"gate_proj.weight", "up_proj.weight"}) && d.ffn_dim % 4 == 0;
      bp.fused_qkv = bp.group_qkv && !options.unfused_projections;
      bp.fused_mlp = bp.group_mlp && !options.unfused_projections;
    }
    bp.recast_down = bp.fp8_bf16 && delayed && !options.save_down_proj_input;
    const v1::ScalingRecipe recipe = fp8 ? r.recipe() : v1::SCALING_RECIPE_UNSPECIFIED;
    const int64_t C = d.d_model, F = d.ffn_dim;
    for (auto [name, in, out] : {std::tuple{"q_proj", C, d.q_width()},
                                 std::tuple{"k_proj", C, d.kv_width()},
                                 std::tuple{"v_proj", C, d.kv_width()},
                                 std::tuple{"o_proj", d.q_width(), C}, std::tuple{"gate_proj", C, F},
                                 std::tuple{"up_proj", C, F}, std::tuple{"down_proj", F, C}}) {
      bp.proj.push_back({name, in, out, bp.linears, recipe});
    }
    bp.saved = Saved(bp, d, p.tokens, B, norm_inputs_bf16);
    if (p.recompute) {
      bp.recomputed = std::move(bp.saved);
      bp.saved = {Tensor("x_in", Dtype::kF32, {p.tokens, C})};
    }
  }
  return p;
}

}  // namespace fsdp8
