#include "common/step_plan.h"

#include <algorithm>
#include <initializer_list>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "common/check.h"
#include "common/model_dims.h"
#include "common/spec.h"

namespace fsdp8 {

BackendCaps BackendCapsOf(const std::string& backend) {
  BackendCaps c;
  c.cuda = backend == "cuda";
  c.cpu_reference = backend == "cpu-ref";
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

// What block `bp`'s forward keeps for its backward (train/model.cc BlockActs), in order.
std::vector<PlannedTensor> SavedInOrder(const BlockPlan& bp, const ModelDims& d, int64_t N, int64_t B,
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

// SavedInOrder with the MLP's tensors marked: its backward drops them. scale_copies: each kept
// FP8 input keeps a copy of its scale_inv (activation scales measured per cast: CURRENT).
std::vector<PlannedTensor> Saved(const BlockPlan& bp, const ModelDims& d, int64_t N, int64_t B,
                                 bool norm_inputs_bf16, bool scale_copies) {
  std::vector<PlannedTensor> s;
  for (PlannedTensor& t : SavedInOrder(bp, d, N, B, norm_inputs_bf16)) {
    const bool x8 = absl::EndsWith(t.name, ".x8");
    s.push_back(std::move(t));
    if (x8 && scale_copies) s.push_back(Tensor(s.back().name + ".scale_inv", Dtype::kF32, {1}));
  }
  for (PlannedTensor& t : s) {
    for (const char* mlp : {"n2", "gate", "up", "act", "gate16", "up16", "gate_up16", "gate_up.x8",
                            "gate_proj.x8", "up_proj.x8", "down_proj.x8"}) {
      if (t.name == mlp) t.lifetime = Lifetime::kMlpBackward;
    }
  }
  return s;
}

// `bytes` of a backend's composed-op scratch, as a byte tensor.
PlannedTensor Scratch(const std::string& what, int64_t bytes) {
  return Tensor("scratch:" + what, Dtype::kE4M3, {bytes});
}


// The tensors of one block alive while its forward runs, allocation by allocation as
// train/model.cc allocates them, and the largest moment (the first to reach the largest total,
// as the backend's account records its peak).
class Walk {
 public:
  enum Kind { kSaved, kWork, kGathered };
  // keep: a training forward without recompute, keeping the tensors `saved` names.
  Walk(const std::vector<PlannedTensor>& saved, bool keep) : saved_(saved), keep_(keep) {}
  void Add(const std::string& name, Dtype dtype, std::vector<int64_t> shape) {
    Push(Tensor(name, dtype, std::move(shape)), Kept(name) ? kSaved : kWork);
  }
  void Gathered(const std::string& name, int64_t numel) {  // a bf16 tensor's f32 copy
    Push(Tensor(name, Dtype::kF32, {numel}), kGathered);
  }
  void Scratch(const std::string& what, int64_t bytes) {  // a composed op's, while it runs
    Push(fsdp8::Scratch(what, bytes), kWork);
    Drop("scratch:" + what);
  }
  // An FP8 input's codes: with a copy of their scale_inv where scales are measured per cast.
  void AddCodes(const std::string& name, std::vector<int64_t> shape, bool scale_copy) {
    Add(name, Dtype::kE4M3, std::move(shape));
    if (scale_copy) Add(name + ".scale_inv", Dtype::kF32, {1});
  }
  void Drop(const std::string& name) {  // codes: with their scale_inv copy
    for (size_t i = live_.size(); i-- > 0;) {
      if (live_[i].first.name == name) {
        live_.erase(live_.begin() + static_cast<int64_t>(i));
        if (absl::EndsWith(name, ".x8")) DropIfAlive(name + ".scale_inv");
        return;
      }
    }
    FSDP8_CHECK(false) << "step plan walk: " << name << " dropped but not alive";
  }
  void AddTensor(const PlannedTensor& t) { Push(t, Kept(t.name) ? kSaved : kWork); }
  // A bf16 tensor's f32 copy, made by its first read (FsdpParams::W) until the unit's release.
  void GatheredOnce(const std::string& name, int64_t numel) {
    if (!Alive(name)) Gathered(name, numel);
  }
  bool Alive(const std::string& name) const {
    for (const auto& [t, k] : live_) {
      if (t.name == name) return true;
    }
    return false;
  }
  void DropIfAlive(const std::string& name) {
    if (Alive(name)) Drop(name);
  }
  // Drops every tensor but the f32 copies and those named in `keep`.
  void DropAllBut(std::initializer_list<const char*> keep) {
    std::vector<std::pair<PlannedTensor, Kind>> kept;
    for (auto& e : live_) {
      bool k = e.second == kGathered;
      for (const char* n : keep) k = k || e.first.name == n;
      if (k) kept.push_back(std::move(e));
    }
    live_ = std::move(kept);
  }
  void ResetPeak() {
    best_ = -1;
    peak_ = PlannedMoment();
  }
  const PlannedMoment& peak() const { return peak_; }

 private:
  bool Kept(const std::string& name) const {
    if (!keep_) return false;
    for (const PlannedTensor& t : saved_) {
      if (t.name == name) return true;
    }
    return false;
  }
  void Push(PlannedTensor t, Kind kind) {
    live_.emplace_back(std::move(t), kind);
    int64_t total = 0;
    for (const auto& [x, k] : live_) total += x.bytes;
    if (total <= best_) return;
    best_ = total;
    peak_ = PlannedMoment();
    for (const auto& [x, k] : live_) {
      (k == kSaved ? peak_.saved : k == kWork ? peak_.work : peak_.gathered).push_back(x);
    }
  }

  const std::vector<PlannedTensor>& saved_;
  bool keep_;
  std::vector<std::pair<PlannedTensor, Kind>> live_;
  int64_t best_ = -1;
  PlannedMoment peak_;
};

// ceil(n / 128): the 128-wide tiles or blocks along n elements, the tail padded up.
int64_t Blocks128(int64_t n) { return (n + 127) / 128; }

// The f32 scales of a rowwise / blockwise linear's GEMM operands (Backend::QuantizeFp8Blocks'
// layouts) over N tokens: forward X and W, dX's dY and Wᵀ, dW's dYᵀ and Xᵀ.
struct ScaleCounts {
  int64_t x = 0, w = 0, dy = 0, wt = 0, dyt = 0, xt = 0;
};
ScaleCounts ScaledCounts(v1::Fp8Granularity g, int64_t in, int64_t out, int64_t N) {
  if (g == v1::FP8_GRANULARITY_ROWWISE) {
    // X per token, W per output row; dY per token, W per input column; dYᵀ per output feature,
    // Xᵀ per input feature.
    return {N, out, N, in, out, in};
  }
  // Blockwise: activations and grad-outputs in 1 x 128 tiles along the contracted dimension, W
  // in 128 x 128 blocks (its transpose: the same blocks, transposed).
  const int64_t bw = Blocks128(out) * Blocks128(in);
  return {N * Blocks128(in), bw, N * Blocks128(out), bw, out * Blocks128(N), in * Blocks128(N)};
}

// A rowwise / blockwise FP8 linear's entry: current scaling, its granularity and its operands'
// scale counts (PlannedLinear) for N tokens.
void SetScaled(PlannedLinear* pl, v1::Fp8Granularity g, int64_t N) {
  pl->precision = v1::PRECISION_FP8;
  pl->recipe = v1::SCALING_RECIPE_CURRENT;
  pl->granularity = g;
  const ScaleCounts c = ScaledCounts(g, pl->in, pl->out, N);
  pl->forward_scales = c.x + c.w;
  pl->dx_scales = c.dy + c.wt;
  pl->dw_scales = c.dyt + c.xt;
}

// Linear::ForwardScaled's transients (a rowwise / blockwise linear `name`, in -> out features
// over N tokens): X's codes and scales, then, rowwise, W's, alive around the GEMM (a blockwise
// W is the gathered FP8 wire: its codes and block scales, no cast).
void WalkScaledForward(Walk* w, const std::string& name, v1::Fp8Granularity g, int64_t N,
                       int64_t in, int64_t out) {
  const ScaleCounts c = ScaledCounts(g, in, out, N);
  w->Add(name + ".x8", Dtype::kE4M3, {N, in});
  w->Add(name + ".x8 scales", Dtype::kF32, {c.x});
  if (g == v1::FP8_GRANULARITY_BLOCKWISE) {
    for (const char* t : {".x8", ".x8 scales"}) w->Drop(name + t);
    return;
  }
  w->Add(name + ".w8", Dtype::kE4M3, {out, in});
  w->Add(name + ".w8 scales", Dtype::kF32, {c.w});
  for (const char* t : {".x8", ".x8 scales", ".w8", ".w8 scales"}) w->Drop(name + t);
}

// Linear::BackwardScaled's: dY's codes and its transposed codes with their scales; Wᵀ's for dX;
// then, dY's own freed, Xᵀ's for dW.
void WalkScaledBackward(Walk* w, const std::string& name, v1::Fp8Granularity g, int64_t N,
                        int64_t in, int64_t out) {
  const ScaleCounts c = ScaledCounts(g, in, out, N);
  w->Add(name + ".dy8", Dtype::kE4M3, {N, out});
  w->Add(name + ".dy8 scales", Dtype::kF32, {c.dy});
  w->Add(name + ".dyT8", Dtype::kE4M3, {out, N});
  w->Add(name + ".dyT8 scales", Dtype::kF32, {c.dyt});
  w->Add(name + ".wT8", Dtype::kE4M3, {in, out});
  w->Add(name + ".wT8 scales", Dtype::kF32, {c.wt});
  for (const char* t : {".wT8", ".wT8 scales", ".dy8", ".dy8 scales"}) w->Drop(name + t);
  w->Add(name + ".xT8", Dtype::kE4M3, {in, N});
  w->Add(name + ".xT8 scales", Dtype::kF32, {c.xt});
  for (const char* t : {".dyT8", ".dyT8 scales", ".xT8", ".xT8 scales"}) w->Drop(name + t);
}

// How a block's forward runs beyond its BlockPlan.
struct ForwardRun {
  bool train = true;          // the tensors for the backward are kept (else dropped once used)
  bool measure_first = false; // activation scales measured before each cast (CURRENT recipe)
  bool norm16 = false;        // training.saved_norm_inputs BF16
  bool save_down = false;     // StepPlanOptions::save_down_proj_input
};

// The generic block's forward (LlamaModel::BlockForward without Block::acts16): f32
// activations, each linear casting its own input.
// Whether a generic block's linears read their gathered weights as f32 copies (FsdpParams::W):
// BF16 linears and rowwise ones (BF16 wire); blockwise ones read their FP8 wire codes.
bool F32Weights(const BlockPlan& bp) {
  return bp.linears == v1::PRECISION_BF16 && bp.granularity != v1::FP8_GRANULARITY_BLOCKWISE;
}

void WalkGenericForward(const BlockPlan& bp, const ModelDims& d, int64_t N, int64_t B,
                        const BackendCaps& caps, const ForwardRun& run, Walk* w) {
  const int64_t C = d.d_model, F = d.ffn_dim, nq = d.q_width(), nk = d.kv_width();
  const bool fp8 = bp.linears == v1::PRECISION_FP8, a16 = bp.attention == Dtype::kBf16;
  const bool train = run.train;
  const bool norms16 = bp.linears != v1::PRECISION_FP32;  // norms on the bf16 wire
  auto linear = [&](const std::string& name, int64_t in, int64_t out) {
    if (F32Weights(bp)) w->Gathered(name + ".weight", in * out);
    if (bp.granularity != v1::FP8_GRANULARITY_TENSORWISE) {
      WalkScaledForward(w, name, bp.granularity, N, in, out);
    }
    if (!fp8) return;
    w->AddCodes(name + ".x8", {N, in}, run.measure_first);
    if (!train) w->Drop(name + ".x8");
  };
  w->Add("n1", Dtype::kF32, {N, C});
  w->Add("rstd1", Dtype::kF32, {N});
  if (norms16) w->Gathered("input_layernorm.weight", C);
  for (auto [n, width] : {std::pair{"q", nq}, std::pair{"k", nk}, std::pair{"v", nk}}) {
    w->Add(n, Dtype::kF32, {N, width});
  }
  linear("q_proj", C, nq);
  linear("k_proj", C, nk);
  linear("v_proj", C, nk);
  if (fp8 || !train) w->Drop("n1");
  w->Add("att", Dtype::kF32, {N, C});
  w->Add("lse", Dtype::kF32, {B, d.n_heads, d.seq_len});
  if (a16 && caps.cuda) w->Scratch("attention", (2 * nq + 2 * nk) * N * 2);
  if (a16 && caps.cpu_reference) w->Scratch("attention", (nq + 2 * nk) * N * 4);
  w->Add("o", Dtype::kF32, {N, C});
  linear("o_proj", nq, C);
  if (train && a16) {  // the attention's bf16 operands kept instead of the f32 ones
    for (auto [n, width] : {std::pair{"q", nq}, std::pair{"k", nk}, std::pair{"v", nk}}) {
      w->Add(std::string(n) + "16", Dtype::kBf16, {N, width});
      w->Drop(n);
    }
    w->Add("att16", Dtype::kBf16, {N, C});
    if (fp8) w->Drop("att");
  }
  w->Add("h", Dtype::kF32, {N, C});
  w->Drop("o");
  w->Add("n2", Dtype::kF32, {N, C});
  w->Add("rstd2", Dtype::kF32, {N});
  if (norms16) w->Gathered("post_attention_layernorm.weight", C);
  w->Add("gate", Dtype::kF32, {N, F});
  w->Add("up", Dtype::kF32, {N, F});
  linear("gate_proj", C, F);
  linear("up_proj", C, F);
  if (fp8 || !train) w->Drop("n2");
  w->Add("act", Dtype::kF32, {N, F});
  if (train && fp8) {  // bf16 gate and up kept instead of the f32 ones
    w->Add("gate16", Dtype::kBf16, {N, F});
    w->Add("up16", Dtype::kBf16, {N, F});
    w->Drop("gate");
    w->Drop("up");
  }
  w->Add("mlp", Dtype::kF32, {N, C});
  linear("down_proj", F, C);
  if (fp8 || !train) w->Drop("act");
  w->Add("out", Dtype::kF32, {N, C});
  w->Drop("mlp");
}

// The block with FP8 linears and BF16 attention (LlamaModel::BlockForward with Block::acts16):
// bf16 activations, the norms cast straight to the shared FP8 inputs.
void WalkFp8Bf16Forward(const BlockPlan& bp, const ModelDims& d, int64_t N, int64_t B,
                        const BackendCaps& caps, const ForwardRun& run, Walk* w) {
  const int64_t C = d.d_model, F = d.ffn_dim, nq = d.q_width(), nk = d.kv_width();
  const bool train = run.train, cpu = !caps.cuda;
  const bool fused_mlp = bp.fused_mlp && !run.measure_first;
  // A cast of `n` f32 elements measured first goes through an f32 copy (Linear::CastInput).
  w->Add("rstd1", Dtype::kF32, {N});
  w->Gathered("input_layernorm.weight", C);
  if (run.measure_first) w->Add("n1", Dtype::kF32, {N, C});
  w->AddCodes("qkv.x8", {N, C}, run.measure_first);
  if (run.measure_first) w->Drop("n1");
  // On a CPU backend a bf16 GEMM result goes through f32, and RoPE on bf16 through an f32 copy
  // (of dense rows of the fused [q | k | v]).
  if (bp.fused_qkv) {
    w->Add("qkv16", Dtype::kBf16, {N, nq + 2 * nk});
    if (cpu) {
      w->Scratch("gemm bf16", N * (nq + 2 * nk) * 4);
      for (int64_t width : {nq, nk}) w->Scratch("rope", (N * width + 1) * 2 + N * width * 4);
    }
  } else {
    w->Add("q16", Dtype::kBf16, {N, nq});
    w->Add("k16", Dtype::kBf16, {N, nk});
    w->Add("v16", Dtype::kBf16, {N, nk});
    if (cpu) {
      for (int64_t width : {nq, nk, nk}) w->Scratch("gemm bf16", N * width * 4);
      for (int64_t width : {nq, nk}) w->Scratch("rope", N * width * 4);
    }
  }
  if (!train) w->Drop("qkv.x8");
  w->Add("att16", Dtype::kBf16, {N, C});
  w->Add("lse", Dtype::kF32, {B, d.n_heads, d.seq_len});
  if (cpu) w->Scratch("attention", (3 * nq + 4 * nk) * N * 4);
  if (!train) {
    for (const char* n : {"qkv16", "q16", "k16", "v16"}) {
      if ((n[1] == 'k') == bp.fused_qkv) w->Drop(n);
    }
  }
  w->Add("h", Dtype::kF32, {N, C});
  w->Add("o_proj.x8", Dtype::kE4M3, {N, C});
  if (run.measure_first) {
    w->Add("att32", Dtype::kF32, {N, C});
    w->Drop("att32");
    w->Add("o_proj.x8.scale_inv", Dtype::kF32, {1});
  } else if (cpu) {
    w->Scratch("cast", N * C * 4);
  }
  if (!train) {
    w->Drop("o_proj.x8");
    w->Drop("att16");
  }
  if (train && run.norm16) {
    w->Add("x_in16", Dtype::kBf16, {N, C});
    w->Drop("x_in");
  }
  w->Add("rstd2", Dtype::kF32, {N});
  w->Gathered("post_attention_layernorm.weight", C);
  if (run.measure_first) w->Add("n2", Dtype::kF32, {N, C});
  w->AddCodes("gate_up.x8", {N, C}, run.measure_first);
  if (run.measure_first) w->Drop("n2");
  if (fused_mlp) {
    w->Add("gate_up16", Dtype::kBf16, {N, 2 * F});
    if (cpu) w->Scratch("gemm bf16", N * 2 * F * 4);
  } else {
    w->Add("gate16", Dtype::kBf16, {N, F});
    w->Add("up16", Dtype::kBf16, {N, F});
    if (cpu) {
      w->Scratch("gemm bf16", N * F * 4);
      w->Scratch("gemm bf16", N * F * 4);
    }
  }
  if (!train) w->Drop("gate_up.x8");
  if (run.measure_first) {
    for (const char* n : {"gate32", "up32", "act32"}) w->Add(n, Dtype::kF32, {N, F});
  }
  w->AddCodes("down_proj.x8", {N, F}, run.measure_first);
  if (run.measure_first) {
    for (const char* n : {"gate32", "up32", "act32"}) w->Drop(n);
  } else if (cpu) {
    w->Scratch("swiglu cast", 3 * N * F * 4);
  }
  if (!train) {
    for (const char* n : {"gate_up16", "gate16", "up16"}) {
      if ((n[4] == '_') == fused_mlp) w->Drop(n);
    }
  }
  w->Add("out", Dtype::kF32, {N, C});
  if (!(train && (run.save_down || run.measure_first))) w->Drop("down_proj.x8");
  if (train && run.norm16) {
    w->Add("h16", Dtype::kBf16, {N, C});
    w->Drop("h");
  }
}

// How a block's backward runs beyond its BlockPlan: the forward's, and the backend's FP8 GEMMs.
struct BackwardRun : ForwardRun {
  bool any_layout = false;  // Backend::Fp8GemmAnyLayout (the fast CPU backend)
  bool cpu_reference = false;
  bool cpu = false;  // a CPU backend (the compositions' f32 scratch, kernels/backend.cc)
};

// Linear::Backward of an FP8 linear (dy (M, n) -> dx (M, k), its input's codes `in`.x8 saved):
// the grad-output's codes (and their transpose), then BackwardFp8.
void WalkFp8Backward(Walk* w, const std::string& name, const std::string& in, int64_t M,
                     int64_t k, int64_t n, bool dy_bf16, bool dx_bf16, const BackwardRun& run);

// Linear::BackwardFp8: W's transpose for dx, the input's transpose for dW (made by the first
// linear of those sharing the input, kept with it).
// dx_bf16 on a CPU backend: the GEMM's f32 result before its rounding (kernels/backend.cc).
void WalkBackwardFp8(Walk* w, const std::string& dy8, const std::string& dyT8,
                     const std::string& in, int64_t M, int64_t k, int64_t n, bool dx,
                     bool cpu_dx_bf16 = false) {
  if (dx) {
    w->Add("wT8", Dtype::kE4M3, {n, k});
    if (cpu_dx_bf16) w->Scratch("gemm bf16", M * k * 4);
    w->Drop("wT8");
  }
  w->Drop(dy8);
  if (!w->Alive(in + ".xT8")) w->Add(in + ".xT8", Dtype::kE4M3, {k, M});
  w->Drop(dyT8);
}

void WalkFp8Backward(Walk* w, const std::string& name, const std::string& in, int64_t M,
                     int64_t k, int64_t n, bool dy_bf16, bool dx_bf16, const BackwardRun& run) {
  w->Add(name + ".dy8", Dtype::kE4M3, {M, n});
  const bool unpack = dy_bf16 && run.measure_first;  // measured through f32
  if (run.any_layout && !dx_bf16) {
    if (unpack) {
      w->Add("dy32", Dtype::kF32, {M, n});
      w->Drop("dy32");
    }
    w->Drop(name + ".dy8");
    return;
  }
  w->Add(name + ".dyT8", Dtype::kE4M3, {M, n});
  if (unpack) {
    w->Add("dy32", Dtype::kF32, {M, n});
    w->Drop("dy32");
  } else if (dy_bf16 && run.cpu) {
    w->Scratch("cast", M * n * 4);
  }
  WalkBackwardFp8(w, name + ".dy8", name + ".dyT8", in, M, k, n, true, run.cpu && dx_bf16);
}

// A non-FP8 linear's backward: its weight's f32 copy (BF16 and rowwise linears).
void WalkPlainBackward(Walk* w, const BlockPlan& bp, const std::string& name, int64_t numel) {
  if (F32Weights(bp)) w->GatheredOnce(name + ".weight", numel);
}

// The generic block's backward (LlamaModel::MlpBackward and AttentionBackward without acts16).
void WalkGenericBackward(const BlockPlan& bp, const ModelDims& d, int64_t N,
                         const BackwardRun& run, Walk* w) {
  const int64_t C = d.d_model, F = d.ffn_dim, nq = d.q_width(), nk = d.kv_width();
  const bool fp8 = bp.linears == v1::PRECISION_FP8, a16 = bp.attention == Dtype::kBf16;
  const bool norms16 = bp.linears != v1::PRECISION_FP32;
  auto backward = [&](const std::string& name, int64_t k, int64_t n) {
    if (fp8) {
      WalkFp8Backward(w, name, name, N, k, n, false, false, run);
    } else {
      WalkPlainBackward(w, bp, name, k * n);
      if (bp.granularity != v1::FP8_GRANULARITY_TENSORWISE) {
        WalkScaledBackward(w, name, bp.granularity, N, k, n);
      }
    }
  };
  auto drop_input = [&](const std::string& name) {  // LinearSaved reset: codes, transpose
    if (!fp8) return;
    w->Drop(name + ".x8");
    w->DropIfAlive(name + ".xT8");
  };
  w->Add("dact", Dtype::kF32, {N, F});
  backward("down_proj", F, C);
  drop_input("down_proj");
  if (!fp8) w->Drop("act");
  w->Add("dgate", Dtype::kF32, {N, F});
  w->Add("dup", Dtype::kF32, {N, F});
  if (fp8 && run.cpu_reference) w->Scratch("swiglu backward", 2 * N * F * 4);
  w->Drop("dact");
  w->Drop(fp8 ? "gate16" : "gate");
  w->Drop(fp8 ? "up16" : "up");
  w->Add("dn2", Dtype::kF32, {N, C});
  backward("gate_proj", C, F);
  backward("up_proj", C, F);
  w->Drop("dgate");
  w->Drop("dup");
  drop_input("gate_proj");
  drop_input("up_proj");
  if (!fp8) w->Drop("n2");
  w->Add("dh", Dtype::kF32, {N, C});
  if (norms16) w->GatheredOnce("post_attention_layernorm.weight", C);
  w->Drop("dn2");
  w->Drop("dout");
  w->Add("datt", Dtype::kF32, {N, C});
  backward("o_proj", nq, C);
  drop_input("o_proj");
  w->Add("dq", Dtype::kF32, {N, nq});
  w->Add("dk", Dtype::kF32, {N, nk});
  w->Add("dv", Dtype::kF32, {N, nk});
  // f32 gradients from bf16 operands: f32 copies, then rounded f32 copies (kernels/backend.cc).
  if (a16 && run.cpu) w->Scratch("attention", (5 * nq + 4 * nk) * N * 4);
  w->Drop("datt");
  w->Add("dn1", Dtype::kF32, {N, C});
  backward("q_proj", C, nq);
  backward("k_proj", C, nk);
  backward("v_proj", C, nk);
  drop_input("q_proj");
  drop_input("k_proj");
  drop_input("v_proj");
  w->Drop("dq");
  w->Drop("dk");
  w->Drop("dv");
  w->Add("dx", Dtype::kF32, {N, C});
  if (norms16) w->GatheredOnce("input_layernorm.weight", C);
  w->DropAllBut({"dx", "dh"});
}

// The FP8 block with BF16 attention's backward (acts16).
void WalkFp8Bf16Backward(const BlockPlan& bp, const ModelDims& d, int64_t N,
                         const BackwardRun& run, Walk* w) {
  const int64_t C = d.d_model, F = d.ffn_dim, nq = d.q_width(), nk = d.kv_width();
  const int64_t nt = nq + 2 * nk;
  const bool mf = run.measure_first, cpu = run.cpu;
  const int64_t n = N * F, ref2n = run.cpu_reference ? 2 * n * 4 : 0;
  const bool fused_mlp = bp.fused_mlp && !mf, fused_qkv = bp.fused_qkv && !mf;
  w->Add("dact16", Dtype::kBf16, {N, F});
  if (!w->Alive("down_proj.x8")) {  // recast from gate and up (delayed scaling)
    w->Add("down_proj.xT8", Dtype::kE4M3, {F, N});
    if (cpu) w->Scratch("swiglu cast", n + 3 * n * 4);  // the codes, then the f32 SwiGLU
  }
  WalkFp8Backward(w, "down_proj", "down_proj", N, F, C, false, true, run);
  w->DropIfAlive("down_proj.x8");
  w->DropIfAlive("down_proj.xT8");
  w->Add("dn2g", Dtype::kBf16, {N, C});
  if (fused_mlp) {
    w->Add("gate_up.dy8", Dtype::kE4M3, {N, 2 * F});
    w->Add("gate_up.dyT8", Dtype::kE4M3, {2 * F, N});
    // Dense gate and up, their bf16 gradients, the f32 SwiGLU backward.
    // (The reference's f32 SwiGLU backward widens bf16 gate and up once more.)
    if (cpu) w->Scratch("swiglu backward", 2 * (n + 1) * 2 + (n + 2) * 4 + 3 * n * 4 + ref2n);
    w->Drop("dact16");
    w->Drop("gate_up16");
    WalkBackwardFp8(w, "gate_up.dy8", "gate_up.dyT8", "gate_up", N, C, 2 * F, true, cpu);
  } else {
    w->Add("dn2u", Dtype::kBf16, {N, C});
    if (!mf) {
      for (const char* n : {"gate_proj.dy8", "gate_proj.dyT8", "up_proj.dy8", "up_proj.dyT8"}) {
        w->Add(n, Dtype::kE4M3, {N, F});
      }
      if (cpu) w->Scratch("swiglu backward", (n + 2) * 4 + 3 * n * 4 + ref2n);
      w->Drop("dact16");
      w->Drop("gate16");
      w->Drop("up16");
      WalkBackwardFp8(w, "gate_proj.dy8", "gate_proj.dyT8", "gate_up", N, C, F, true, cpu);
      WalkBackwardFp8(w, "up_proj.dy8", "up_proj.dyT8", "gate_up", N, C, F, true, cpu);
    } else {
      w->Add("dgate16", Dtype::kBf16, {N, F});
      w->Add("dup16", Dtype::kBf16, {N, F});
      // The SwiGLU backward through f32 (dh, then the gradients); the reference's widens gate
      // and up once more.
      if (cpu) w->Scratch("swiglu backward", 3 * n * 4 + ref2n);
      w->Drop("dact16");
      w->Drop("gate16");
      w->Drop("up16");
      WalkFp8Backward(w, "gate_proj", "gate_up", N, C, F, true, true, run);
      WalkFp8Backward(w, "up_proj", "gate_up", N, C, F, true, true, run);
      w->Drop("dup16");  // freed in the reverse order of their declaration
      w->Drop("dgate16");
    }
  }
  w->Drop("gate_up.x8");
  w->DropIfAlive("gate_up.xT8");
  w->Add("dh", Dtype::kF32, {N, C});
  if (w->Alive("h16")) w->Add("h32", Dtype::kF32, {N, C});
  w->GatheredOnce("post_attention_layernorm.weight", C);
  if (cpu) w->Scratch("norm backward", 2 * N * C * 4);  // the bf16 parts' f32 sum
  w->DropIfAlive("h32");
  w->Drop("dn2g");
  w->DropIfAlive("dn2u");
  w->Drop("dout");
  // The attention half.
  w->Add("dq16", Dtype::kBf16, {N, nq});
  w->Add("dk16", Dtype::kBf16, {N, nk});
  w->Add("dv16", Dtype::kBf16, {N, nk});
  w->Add("datt16", Dtype::kBf16, {N, C});
  WalkFp8Backward(w, "o_proj", "o_proj", N, nq, C, false, true, run);
  w->Drop("o_proj.x8");
  w->DropIfAlive("o_proj.xT8");
  // Dense q, k, v (fused), f32 gradients, then f32 operands rounded to bf16.
  if (cpu) {
    w->Scratch("attention", (bp.fused_qkv ? (N * nq + 1) * 2 + 2 * (N * nk + 1) * 2 : 0) +
                                2 * (2 * nq + 2 * nk) * N * 4 + (3 * nq + 2 * nk) * N * 4);
  }
  w->Drop("datt16");
  for (const char* n : {"q16", "k16", "v16", "qkv16", "att16"}) w->DropIfAlive(n);
  w->Add("dn1q", Dtype::kBf16, {N, C});
  if (fused_qkv) {
    w->Add("qkv.dy8", Dtype::kE4M3, {N, nt});
    w->Add("qkv.dyT8", Dtype::kE4M3, {nt, N});
    if (cpu) {  // RoPE's backward and the casts through f32, dense codes into the strided ones
      for (int64_t width : {nq, nk}) {
        w->Scratch("rope", (N * width + 1) / 2 * 4 + N * width * 4 + N * width);
      }
      w->Scratch("cast", N * nk * 4 + N * nk);
    }
    w->Drop("dq16");
    w->Drop("dk16");
    w->Drop("dv16");
    WalkBackwardFp8(w, "qkv.dy8", "qkv.dyT8", "qkv", N, C, nt, true, cpu);
  } else {
    w->Add("dn1k", Dtype::kBf16, {N, C});
    w->Add("dn1v", Dtype::kBf16, {N, C});
    for (auto [n, width, d16] : {std::tuple{"q_proj", nq, "dq16"}, std::tuple{"k_proj", nk, "dk16"}}) {
      if (mf) {
        WalkFp8Backward(w, n, "qkv", N, C, width, true, true, run);
        continue;
      }
      w->Add(std::string(n) + ".dy8", Dtype::kE4M3, {N, width});
      w->Add(std::string(n) + ".dyT8", Dtype::kE4M3, {N, width});
      if (cpu) w->Scratch("rope", (N * width + 1) / 2 * 4 + N * width * 4);
      w->Drop(d16);
      WalkBackwardFp8(w, std::string(n) + ".dy8", std::string(n) + ".dyT8", "qkv", N, C, width,
                      true, cpu);
    }
    WalkFp8Backward(w, "v_proj", "qkv", N, C, nk, true, true, run);
    for (const char* n : {"dq16", "dk16", "dv16"}) w->DropIfAlive(n);
  }
  for (const char* n : {"dq16", "dk16", "dv16"}) w->DropIfAlive(n);
  w->Drop("qkv.x8");
  w->DropIfAlive("qkv.xT8");
  w->Add("dx", Dtype::kF32, {N, C});
  if (w->Alive("x_in16")) w->Add("x32", Dtype::kF32, {N, C});
  w->GatheredOnce("input_layernorm.weight", C);
  if (cpu) w->Scratch("norm backward", 2 * N * C * 4);
  w->DropAllBut({"dx", "dh"});
}

// Block `bp`'s forward from its input x_in: the largest moment.
PlannedMoment ForwardPeak(const BlockPlan& bp, const ModelDims& d, int64_t N, int64_t B,
                          const BackendCaps& caps, const ForwardRun& run) {
  Walk w(bp.saved, run.train);
  w.Add("x_in", Dtype::kF32, {N, d.d_model});
  if (bp.fp8_bf16) {
    WalkFp8Bf16Forward(bp, d, N, B, caps, run, &w);
  } else {
    WalkGenericForward(bp, d, N, B, caps, run, &w);
  }
  return w.peak();
}

// Block `bp`'s backward transients at the largest moments of its MLP and of its attention: the
// incoming gradient, the activations' gradients, FP8 grad-output codes and their transposes, and the backends' scratch
// (the CPU compositions' f32 copies; cuDNN's attention workspace, deterministic: B*H*T*T bf16).
void BackwardWork(BlockPlan* block, const ModelDims& d, int64_t N, int64_t B, bool cuda,
                  bool deterministic) {
  const BlockPlan& bp = *block;
  const int64_t C = d.d_model, F = d.ffn_dim, nq = d.q_width(), nk = d.kv_width(), n = N * F;
  const bool fp8 = bp.linears == v1::PRECISION_FP8, a16 = bp.attention == Dtype::kBf16;
  const int64_t cudnn = deterministic ? B * d.n_heads * d.seq_len * d.seq_len * 2 : N * nq * 4;
  std::vector<PlannedTensor>& mlp = block->backward_mlp;
  std::vector<PlannedTensor>& attn = block->backward_attention;
  mlp = {Tensor("dout", Dtype::kF32, {N, C})};
  attn = {Tensor("dh", Dtype::kF32, {N, C})};  // the MLP's backward turned dout into dh
  if (bp.fp8_bf16) {
    mlp.push_back(Tensor("dact16", Dtype::kBf16, {N, F}));
    mlp.push_back(Tensor("dn2", Dtype::kBf16, {N, C}));
    if (bp.fused_mlp) {
      mlp.push_back(Tensor("gate_up.dy8", Dtype::kE4M3, {N, 2 * F}));
      mlp.push_back(Tensor("gate_up.dyT8", Dtype::kE4M3, {2 * F, N}));
      if (!cuda) mlp.push_back(Scratch("swiglu backward", 4 * n + (n + 2) * 4 + 20 * n));
    } else {
      mlp.push_back(Tensor("dn2_up", Dtype::kBf16, {N, C}));
      for (const char* p : {"gate_proj.dy8", "gate_proj.dyT8", "up_proj.dy8", "up_proj.dyT8"}) {
        mlp.push_back(Tensor(p, Dtype::kE4M3, {N, F}));
      }
      if (!cuda) mlp.push_back(Scratch("swiglu backward", (n + 2) * 4 + 20 * n));
    }
    attn.push_back(Tensor("dq16", Dtype::kBf16, {N, nq}));
    attn.push_back(Tensor("dk16", Dtype::kBf16, {N, nk}));
    attn.push_back(Tensor("dv16", Dtype::kBf16, {N, nk}));
    attn.push_back(Tensor("datt16", Dtype::kBf16, {N, C}));
    const int64_t dense = bp.fused_qkv ? (nq + 2 * nk) * N * 2 : 0;
    attn.push_back(cuda ? Scratch("attention", cudnn)
                        : Scratch("attention", dense + (7 * nq + 6 * nk) * N * 4));
    return;
  }
  for (const char* p : {"dact", "dgate", "dup"}) mlp.push_back(Tensor(p, Dtype::kF32, {N, F}));
  if (fp8 && !cuda) mlp.push_back(Scratch("swiglu backward", 2 * n * 4));
  attn.push_back(Tensor("datt", Dtype::kF32, {N, C}));
  attn.push_back(Tensor("dq", Dtype::kF32, {N, nq}));
  attn.push_back(Tensor("dk", Dtype::kF32, {N, nk}));
  attn.push_back(Tensor("dv", Dtype::kF32, {N, nk}));
  if (a16) {
    attn.push_back(cuda ? Scratch("attention", (2 * nq + 2 * nk) * N * 2 + cudnn)
                        : Scratch("attention", (5 * nq + 4 * nk) * N * 4));
  }
}

// The head's tables (StepPlan::head_logits, head_work): the BF16 head's first, full chunk.
void HeadTables(StepPlan* p, const ModelDims& d, bool cuda) {
  const int64_t N = p->tokens, C = d.d_model, V = d.vocab_size, rows = p->head_chunk_rows;
  p->head_work = {Tensor("x", Dtype::kF32, {N, C}), Tensor("nf", Dtype::kF32, {N, C}),
                  Tensor("rstdf", Dtype::kF32, {N}), Tensor("dnf", Dtype::kF32, {N, C})};
  p->backward_held = {Tensor("dnf", Dtype::kF32, {N, C}), Tensor("rstdf", Dtype::kF32, {N})};
  p->embedding_backward = {Tensor("dx", Dtype::kF32, {N, C})};
  if (!p->head_bf16) {
    p->head_logits = {Tensor("logits", Dtype::kF32, {N, V})};
    return;
  }
  p->head_logits = {Tensor("nf16", Dtype::kBf16, {N, C}), Tensor("dlogits16", Dtype::kBf16, {N, V}),
                    Tensor("logits", Dtype::kF32, {rows, V})};
  // GemmBf16's f32 operands and the cross-entropy through f32 while the chunk's logits live;
  // dnf's GEMM (the chunk's f32 logit gradient and W) and dW over every row once they are gone.
  if (!cuda) {
    p->head_work.push_back(Scratch(
        "head", std::max({(rows * C + V * C) * 4, rows * V * 4, C * V * 4,
                          (V * N + C * N) * 4 - rows * V * 4})));
  }
}

// Block `bp`'s backward (and recompute) from the incoming gradient: BlockPlan::backward_peak,
// recompute_peak.
void BackwardPeaks(BlockPlan* bp, const ModelDims& d, int64_t N, int64_t B,
                   const BackendCaps& caps, const ForwardRun& forward, bool recompute) {
  BackwardRun run;
  static_cast<ForwardRun&>(run) = forward;
  run.train = true;
  run.any_layout = !caps.cuda && !caps.cpu_reference;
  run.cpu_reference = caps.cpu_reference;
  run.cpu = !caps.cuda;
  Walk w(bp->saved, !recompute);
  w.Add("dout", Dtype::kF32, {N, d.d_model});
  if (recompute) {  // the block's forward again, keeping what its backward reads (as work)
    w.Add("x_in", Dtype::kF32, {N, d.d_model});
    if (bp->fp8_bf16) {
      WalkFp8Bf16Forward(*bp, d, N, B, caps, run, &w);
    } else {
      WalkGenericForward(*bp, d, N, B, caps, run, &w);
    }
    bp->recompute_peak = w.peak();
    w.ResetPeak();
    w.Drop("out");  // the recompute's output, not read (LlamaModel::BackwardBlocks)
  } else {
    for (const PlannedTensor& t : bp->saved) w.AddTensor(t);
  }
  if (bp->fp8_bf16) {
    WalkFp8Bf16Backward(*bp, d, N, run, &w);
  } else {
    WalkGenericBackward(*bp, d, N, run, &w);
  }
  bp->backward_peak = w.peak();
}

}  // namespace

absl::StatusOr<StepPlan> MakeStepPlan(const v1::JobSpec& spec, int world_size,
                                      const BackendCaps& caps, const StepPlanOptions& options) {
  // A hybrid-sharded job's units are laid out at its mesh (sharding.replicas; auto, 0, as flat).
  Mesh mesh;
  mesh.shard_size = world_size;
  if (spec.sharding().replicas() > 1) {
    absl::StatusOr<Mesh> m = MeshOf(spec, world_size);
    if (!m.ok()) return m.status();
    mesh = *m;
  }
  absl::StatusOr<ShardPlan> shards = MakeShardPlan(spec, mesh);
  if (!shards.ok()) return shards.status();
  const ModelDims d = ModelDimsOf(spec.model());
  const v1::TrainingSpec& tr = spec.training();
  const v1::PrecisionSpec& pp = spec.precision();
  StepPlan p;
  p.world_size = world_size;
  p.mesh = mesh;
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
      pu.buffers.push_back({b.wire, b.padded_numel, b.shard_numel, b.PaddedScales(),
                            b.ShardScales()});
    }
  }
  const bool attn16 = pp.attention() == v1::PRECISION_BF16;
  const v1::Fp8Recipe& r = pp.fp8();
  const bool delayed = r.recipe() != v1::SCALING_RECIPE_CURRENT;
  const bool norm_inputs_bf16 = tr.saved_norm_inputs() == v1::PRECISION_BF16;
  for (int l = 0; l < d.n_layers; ++l) {
    BlockPlan& bp = p.blocks.emplace_back();
    bp.linears = LayerLinearPrecision(spec, l);
    bp.granularity = LayerGranularity(spec, l);
    // A rowwise / blockwise block runs the generic path of a BF16 block (f32 activations, f32
    // inputs kept, BF16 weights): its tables are that block's; its linears are FP8 below.
    const bool scaled = bp.granularity != v1::FP8_GRANULARITY_TENSORWISE;
    if (scaled) bp.linears = v1::PRECISION_BF16;
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
      if (fp8) bp.proj.back().granularity = v1::FP8_GRANULARITY_TENSORWISE;
    }
    bp.saved = Saved(bp, d, p.tokens, B, norm_inputs_bf16, fp8 && !delayed);
    ForwardRun run;
    run.train = !p.recompute;  // the training forward under recompute keeps nothing
    run.measure_first = fp8 && !delayed;
    run.norm16 = norm_inputs_bf16;
    run.save_down = options.save_down_proj_input;
    BackendCaps bc = caps;
    bc.cpu_reference = bc.cpu_reference || (!caps.cuda && options.cpu_reference);
    p.cpu_reference = bc.cpu_reference;
    bp.forward_peak = ForwardPeak(bp, d, p.tokens, B, bc, run);
    bp.forward_work = bp.forward_peak.work;
    BackwardPeaks(&bp, d, p.tokens, B, bc, run, p.recompute);
    BackwardWork(&bp, d, p.tokens, B, caps.cuda, tr.deterministic());
    if (scaled) {
      bp.linears = v1::PRECISION_FP8;
      for (PlannedLinear& pl : bp.proj) SetScaled(&pl, bp.granularity, p.tokens);
    }
    if (p.recompute) {
      bp.recomputed = std::move(bp.saved);
      bp.saved = {Tensor("x_in", Dtype::kF32, {p.tokens, C})};
    }
  }
  HeadTables(&p, d, caps.cuda);
  return p;
}

}  // namespace fsdp8
