#include "common/memory_plan.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/model_dims.h"
#include "common/spec.h"

namespace fsdp8 {

int64_t OptimizerStateBytesPerElement(const v1::JobSpec& spec) {
  return AdamStateBytesPerElement(spec);  // AdamW m and v in optimizer.state_precision
}

namespace {

enum Term {
  kParams, kGrads, kOptimizer, kScaling, kGathered, kUnitGrads, kSaved, kWork, kLogits, kBatch,
  kNumTerms
};
constexpr const char* kTermNames[kNumTerms] = {
    "parameter shards", "gradient shards",   "optimizer state", "FP8 scaling state",
    "gathered units",   "unit gradients",    "saved activations", "workspaces",
    "logits chunks",    "batch"};

// Byte counts in double: exact below 2^53 bytes, and no overflow for absurd sizes (PlanMemory
// saturates them when it reports).
using Bytes = std::array<double, kNumTerms>;

// Live bytes per term, and the peak of their sum since the last ResetPeak with the terms then.
class Ledger {
 public:
  int Alloc(Term t, double bytes) {
    int id;
    if (free_.empty()) {
      id = static_cast<int>(slots_.size());
      slots_.push_back({t, bytes});
    } else {  // ids are reused: a replay of a million blocks stays small
      id = free_.back();
      free_.pop_back();
      slots_[id] = {t, bytes};
    }
    live_[t] += bytes;
    total_ += bytes;
    if (total_ > peak_) {
      peak_ = total_;
      at_peak_ = live_;
    }
    return id;
  }
  // Frees *id (no-op for -1) and sets it to -1.
  void Free(int* id) {
    if (*id < 0) return;
    Slot& s = slots_[*id];
    live_[s.term] -= s.bytes;
    total_ -= s.bytes;
    s.bytes = 0;
    free_.push_back(*id);
    *id = -1;
  }
  void Retag(int id, Term t) {
    if (id < 0) return;
    Slot& s = slots_[id];
    live_[s.term] -= s.bytes;
    live_[t] += s.bytes;
    s.term = t;
  }
  // A transient of `bytes` (allocated and freed at once).
  void Scratch(Term t, double bytes) {
    int id = Alloc(t, bytes);
    Free(&id);
  }
  void ResetPeak() {
    peak_ = total_;
    at_peak_ = live_;
  }
  double peak() const { return peak_; }
  const Bytes& at_peak() const { return at_peak_; }

 private:
  struct Slot {
    Term term;
    double bytes;
  };
  std::vector<Slot> slots_;
  std::vector<int> free_;
  Bytes live_{}, at_peak_{};
  double total_ = 0, peak_ = 0;
};

struct PhasePeak {
  double bytes = 0;
  Bytes terms{};
  void Take(const Ledger& l) {
    if (l.peak() >= bytes) {
      bytes = l.peak();
      terms = l.at_peak();
    }
  }
};

enum Wire { kFp8 = 0, kBf16 = 1, kFp32 = 2 };

// One flat buffer of a unit and its device state in the replay (FsdpParams::Buf).
struct SimBuf {
  Wire wire;
  double padded = 0, shard = 0;
  int full = -1, full_u16 = -1, full_grad = -1;
  int grad = -1;            // the grad shard: from the step's first reduce-scatter to ZeroGrads
  int codes = -1;           // FP8 codes cast for an all-gather (no kept codes), until gathered
  std::vector<int> f32_of;  // bf16: the tensors' f32 copies made on first use (FsdpParams::W)
  bool grad_unset = true;
};
struct SimUnit {
  std::vector<SimBuf> bufs;
  bool in_flight = false;
};

// An FP8 linear's saved input (Fp8Input): its codes, its transpose once made, and how many
// LinearSaved hold it.
struct SimInput {
  int x8 = -1, xT = -1, refs = 0;
};

// BlockActs of train/model.cc: ids of the ledger, inputs as indices into Sim::inputs_.
struct SimActs {
  int x_in = -1, n1 = -1, rstd1 = -1, q = -1, k = -1, v = -1, att = -1, lse = -1, h = -1,
      n2 = -1, rstd2 = -1, gate = -1, up = -1, act = -1, q16 = -1, k16 = -1, v16 = -1,
      att16 = -1, gate16 = -1, up16 = -1, gu16 = -1, qkv16 = -1, x_in16 = -1, h16 = -1;
  int sq = -1, sk = -1, sv = -1, so = -1, sgate = -1, sup = -1, sdown = -1;
};

// Models with more blocks are planned by extrapolation (PlanMemory).
constexpr int kReplayLayers = 1024;

int64_t Saturate(double b) {
  if (!(b < 9.2e18)) return kBytesExceeded;
  return static_cast<int64_t>(std::llround(b));
}

// The replay of one rank's steps. Dimensions as in LlamaModel (train/model.h): ModelDims, in
// double (the byte counts' type).
class Sim {
 public:
  Sim(const v1::JobSpec& spec, const StepPlan& plan, int64_t opt_bytes);
  // Two steps (the second starts from the state the first leaves: prefetched first units);
  // returns the second's phase peaks.
  void Run(PhasePeak* fwd, PhasePeak* bwd, PhasePeak* opt);

 private:
  double Wb(Wire w) const { return w == kFp8 ? 1 : w == kBf16 ? 2 : 4; }
  // ---- FsdpParams ----
  void Prefetch(int u);
  void Gather(int u);
  void Release(int u);
  // The f32 copies FsdpParams::W makes of a gathered unit's bf16 tensors (numel elements in all),
  // taken at once when the unit starts computing.
  void UnpackF32(int u, double numel);
  void BeginGrads(int u);
  void ReduceGrads(int u);
  void FlushGrads();
  void DropPrefetches();
  // ---- Linear (train/fp8_linear.cc) ----
  int NewInput(double bytes);
  // The end of the local handle of input `in` (its shared_ptr): freed unless a LinearSaved
  // holds it.
  void EndInput(int in);
  void Keep(int in, int* saved, bool train);
  void Drop(int* saved);
  // A non-fused FP8 forward of a linear reading an f32 x (M, K) (Linear::Forward).
  void LinearForward(bool fp8, double M, double K, int* saved, bool train);
  // Linear::Backward / BackwardFp8 of an FP8 linear: grad-output (M, Nout), weight (Nout, K).
  void LinearBackward(bool fp8, bool dy_bf16, double M, double K, double Nout, int saved,
                      bool dx_bf16);
  void BackwardFp8(double M, double K, double Nout, int saved, bool dx_bf16, int* dy8, int* dyT8);
  // ---- LlamaModel ----
  void Step(PhasePeak* fwd, PhasePeak* bwd, PhasePeak* opt);
  void RunMicrobatch(PhasePeak* fwd, PhasePeak* bwd);
  void Head(PhasePeak* fwd, int* x, int* dx, int* dnf, int* nf, int* rstdf);
  void HeadBf16();
  void BlockForward(int l, int* x, SimActs* a, bool train);
  void AttentionForward(bool fp8, SimActs* a, bool train);
  int MlpForward(bool fp8, SimActs* a, bool train);
  void BlockBackward(int l, SimActs* a, int* dout);
  void AttentionForwardFp8(int l, SimActs* a, bool train);
  int MlpForwardFp8(int l, SimActs* a, bool train);
  int MlpBackward(bool fp8, SimActs* a, int* dout);
  void AttentionBackward(bool fp8, SimActs* a, int* dh, int* dout);
  int MlpBackwardFp8(int l, SimActs* a, int* dout);
  void AttentionBackwardFp8(int l, SimActs* a, int* dh, int* dout);
  void FreeActs(SimActs* a);
  // LlamaModel::KeepNormInput of an (N, C) f32 *x.
  void KeepNormInput(int* x, int* x16) {
    if (!norm_inputs_bf16_) return;
    *x16 = led_.Alloc(kWork, N_ * C_ * 2);
    led_.Free(x);
  }
  void KeepActs(SimActs* a, Term t);
  int BlockUnit(int l) const { return l < L_ ? 1 + l : 1 + L_; }
  // Elements of block l's bf16 tensors read in f32: its norms, and its linears in a BF16 block.
  double BlockF32Numel(int l) const {
    const double norms = 2 * C_;
    return prec_[l] == v1::PRECISION_BF16 ? norms + 2 * C_ * C_ + 2 * nk_ * C_ + 3 * F_ * C_
                                          : norms;
  }
  // The CPU backends' scratch slots (CpuRefBackend::Scratch), grown in the first step and kept:
  // the GEMMs' decoded or rounded operands (FP8 and BF16 linears; a linear of `in` inputs and
  // `out` outputs over N tokens takes N * max(in, out) in slot 0, max(in * out, N * in) in slot
  // 1), the attention's two T x T f32 matrices, and the RoPE cos/sin tables (T * D/2 each).
  double CpuScratchBytes() const {
    double s0 = 0, s1 = 0;
    auto linear = [&](double in, double out) {
      s0 = std::max(s0, N_ * std::max(in, out));
      s1 = std::max(s1, std::max(in * out, N_ * in));
    };
    for (int l = 0; l < L_; ++l) {
      if (prec_[l] == v1::PRECISION_FP32) continue;  // f32 GEMMs read their operands in place
      if (fused_qkv_[l]) {
        linear(C_, nq_ + 2 * nk_);
      } else {
        linear(C_, nq_);
        linear(C_, nk_);
      }
      linear(nq_, C_);
      linear(C_, fused_mlp_[l] ? 2 * F_ : F_);
      linear(F_, C_);
    }
    return (s0 + s1 + 2 * T_ * T_ + T_ * D_) * 4;
  }
  // Backend scratch of one composed op: `cpu` on the CPU backends (the Backend compositions of
  // kernels/backend.cc), `cuda` on the CUDA backend.
  void Scratch(double cpu, double cuda) { led_.Scratch(kWork, cuda_ ? cuda : cpu); }

  Ledger led_;
  int64_t opt_bytes_ = 8;
  bool cuda_ = false, attn16_ = false, recompute_ = false, tied_ = false, det_ = true;
  bool keep_codes_ = true;  // Fp8Recipe.keep_weight_codes
  bool head_bf16_ = true;
  bool norm_inputs_bf16_ = false;  // training.saved_norm_inputs BF16
  bool grouped_ = false;           // some block shares scales in a group (BlockPlan::group_*)
  int L_ = 0, microbatches_ = 1;
  double C_, H_, Hkv_, D_, F_, V_, T_, B_, N_, nq_, nk_, local_tokens_, head_rows_;
  std::vector<v1::Precision> prec_;
  // Per block, from the step plan: the path (FP8 linears with BF16 attention, or the generic
  // block), fused groups, and down_proj's input recast in the backward
  // (Linear::RecastSwiglu) instead of kept from the forward.
  std::vector<bool> fp8_bf16_, fused_qkv_, fused_mlp_, recast_down_;
  std::vector<SimUnit> units_;
  std::vector<SimInput> inputs_;
  std::vector<int> free_inputs_;
  std::vector<std::pair<int, int>> reducing_;  // (full_grad, part) ids in flight
};

Sim::Sim(const v1::JobSpec& spec, const StepPlan& plan, int64_t opt_bytes)
    : opt_bytes_(opt_bytes) {
  const v1::ModelConfig& m = spec.model();
  const ModelDims d = ModelDimsOf(m);
  C_ = d.d_model;
  H_ = d.n_heads;
  Hkv_ = d.n_kv_heads;
  D_ = d.head_dim;
  F_ = d.ffn_dim;
  V_ = d.vocab_size;
  T_ = d.seq_len;
  L_ = d.n_layers;
  nq_ = d.q_width();
  nk_ = d.kv_width();
  const v1::TrainingSpec& tr = spec.training();
  B_ = tr.microbatch();
  N_ = static_cast<double>(plan.tokens);
  local_tokens_ = static_cast<double>(tr.global_batch()) / plan.world_size * T_;
  microbatches_ = plan.microbatches;
  cuda_ = spec.backend() == "cuda";
  attn16_ = spec.precision().attention() == v1::PRECISION_BF16;
  recompute_ = plan.recompute;
  keep_codes_ = spec.precision().fp8().keep_weight_codes();
  norm_inputs_bf16_ = tr.saved_norm_inputs() == v1::PRECISION_BF16;
  det_ = tr.deterministic();
  tied_ = m.tie_word_embeddings();
  head_bf16_ = plan.head_bf16;
  head_rows_ = static_cast<double>(plan.head_chunk_rows);
  // The step plan decides each block's path; the units are the shard plan's buffers.
  for (const BlockPlan& b : plan.blocks) {
    prec_.push_back(b.linears);
    fp8_bf16_.push_back(b.fp8_bf16);
    fused_qkv_.push_back(b.fused_qkv);
    fused_mlp_.push_back(b.fused_mlp);
    grouped_ = grouped_ || b.group_qkv || b.group_mlp;
    recast_down_.push_back(b.recast_down);
  }
  for (const PlannedUnit& u : plan.units) {
    SimUnit& su = units_.emplace_back();
    for (const PlannedBuffer& b : u.buffers) {
      SimBuf sb;
      sb.wire = b.wire == WireDtype::kFp8 ? kFp8 : b.wire == WireDtype::kBf16 ? kBf16 : kFp32;
      sb.padded = static_cast<double>(b.padded);
      sb.shard = static_cast<double>(b.shard);
      su.bufs.push_back(sb);
    }
  }
}

// ---- FsdpParams (train/fsdp.cc) ----

void Sim::Prefetch(int u) {
  SimUnit& su = units_[u];
  if (su.in_flight) return;
  for (SimBuf& b : su.bufs) {
    // `full = DevBuf(...)` allocates before the old buffer (if any) goes; one rank: a view.
    int* slot = b.wire == kBf16 ? &b.full_u16 : &b.full;
    int old = *slot;
    if (b.wire == kFp8 && !keep_codes_) {  // the slice is cast first; on one rank it is the unit
      int old_codes = b.codes;
      b.codes = led_.Alloc(kGathered, b.shard);
      led_.Free(&old_codes);
      if (b.shard == b.padded) {
        *slot = b.codes;
        b.codes = -1;
        led_.Free(&old);
        continue;
      }
    }
    *slot = b.shard == b.padded ? -1 : led_.Alloc(kGathered, b.padded * Wb(b.wire));
    led_.Free(&old);
  }
  su.in_flight = true;
}

void Sim::Gather(int u) {
  Prefetch(u);  // bf16 buffers stay bf16: their tensors are unpacked to f32 on first use
  for (SimBuf& b : units_[u].bufs) led_.Free(&b.codes);
  units_[u].in_flight = false;
}

void Sim::UnpackF32(int u, double numel) {
  for (SimBuf& b : units_[u].bufs) {
    if (b.wire == kBf16) b.f32_of.push_back(led_.Alloc(kGathered, numel * 4));
  }
}

void Sim::Release(int u) {
  for (SimBuf& b : units_[u].bufs) {
    led_.Free(&b.full);
    led_.Free(&b.full_u16);
    for (int& id : b.f32_of) led_.Free(&id);
    b.f32_of.clear();
  }
}

void Sim::BeginGrads(int u) {
  for (SimBuf& b : units_[u].bufs) {
    int old = b.full_grad;
    b.full_grad = led_.Alloc(kUnitGrads, b.padded * 4);
    led_.Free(&old);
  }
}

void Sim::FlushGrads() {
  for (auto& [g, part] : reducing_) {
    led_.Free(&g);
    led_.Free(&part);
  }
  reducing_.clear();
}

void Sim::ReduceGrads(int u) {
  FlushGrads();
  for (SimBuf& b : units_[u].bufs) {
    if (b.shard == b.padded) {  // one rank: the full gradient becomes, or is added to, the shard
      if (b.grad_unset) {
        led_.Retag(b.full_grad, kGrads);
        b.grad = b.full_grad;
        b.full_grad = -1;
      }
      led_.Free(&b.full_grad);
      b.grad_unset = false;
      continue;
    }
    if (b.grad_unset) b.grad = led_.Alloc(kGrads, b.shard * 4);
    int part = b.grad_unset ? -1 : led_.Alloc(kUnitGrads, b.shard * 4);
    b.grad_unset = false;
    reducing_.push_back({b.full_grad, part});
    b.full_grad = -1;
  }
}

void Sim::DropPrefetches() {
  for (SimUnit& u : units_) {
    if (!u.in_flight) continue;
    for (SimBuf& b : u.bufs) {
      led_.Free(&b.codes);
      led_.Free(&b.full);
      led_.Free(&b.full_u16);
    }
    u.in_flight = false;
  }
}

// ---- Linear (train/fp8_linear.cc) ----

int Sim::NewInput(double bytes) {
  const SimInput in{led_.Alloc(kWork, bytes), -1, 0};
  if (!free_inputs_.empty()) {
    const int i = free_inputs_.back();
    free_inputs_.pop_back();
    inputs_[i] = in;
    return i;
  }
  inputs_.push_back(in);
  return static_cast<int>(inputs_.size()) - 1;
}

void Sim::EndInput(int in) {
  if (inputs_[in].refs > 0) return;  // kept by a LinearSaved
  led_.Free(&inputs_[in].x8);
  led_.Free(&inputs_[in].xT);
  free_inputs_.push_back(in);
}

void Sim::Keep(int in, int* saved, bool train) {
  if (!train) return;
  ++inputs_[in].refs;
  *saved = in;
}

void Sim::Drop(int* saved) {
  if (*saved < 0) return;
  SimInput& in = inputs_[*saved];
  if (--in.refs <= 0) EndInput(*saved);
  *saved = -1;
}

void Sim::LinearForward(bool fp8, double M, double K, int* saved, bool train) {
  if (!fp8) return;  // Gemm: no allocation; the caller keeps the f32 input
  int in = NewInput(M * K);  // CastInput: the E4M3 codes of x
  Keep(in, saved, train);
  EndInput(in);
}

void Sim::BackwardFp8(double M, double K, double Nout, int saved, bool dx_bf16, int* dy8,
                      int* dyT8) {
  int wT = led_.Alloc(kWork, Nout * K);  // TransposeBytes(W)
  if (dx_bf16) Scratch(M * K * 4, 0);    // GemmFp8Bf16's f32 output
  led_.Free(&wT);
  led_.Free(dy8);
  SimInput& in = inputs_[saved];
  if (in.xT < 0) in.xT = led_.Alloc(kWork, M * K);  // the saved input's transpose
  led_.Free(dyT8);
}

void Sim::LinearBackward(bool fp8, bool dy_bf16, double M, double K, double Nout, int saved,
                         bool dx_bf16) {
  if (!fp8) return;  // Gemm dX and dW: no allocation
  int dy8 = led_.Alloc(kWork, M * Nout), dyT8 = led_.Alloc(kWork, M * Nout);
  if (dy_bf16) Scratch(M * Nout * 4, 0);  // CastTransposeFp8Bf16 through f32
  BackwardFp8(M, K, Nout, saved, dx_bf16, &dy8, &dyT8);
}

// ---- the generic block (LlamaModel::AttentionForward, MlpForward and their backwards) ----

void Sim::AttentionForward(bool fp8, SimActs* a, bool train) {
  const double N = N_;
  const bool keep_f32 = !fp8;
  a->n1 = led_.Alloc(kWork, N * C_ * 4);
  a->rstd1 = led_.Alloc(kWork, N * 4);
  a->q = led_.Alloc(kWork, N * nq_ * 4);
  a->k = led_.Alloc(kWork, N * nk_ * 4);
  a->v = led_.Alloc(kWork, N * nk_ * 4);
  LinearForward(fp8, N, C_, &a->sq, train);  // each linear casts n1 on its own here
  LinearForward(fp8, N, C_, &a->sk, train);
  LinearForward(fp8, N, C_, &a->sv, train);
  if (!keep_f32 || !train) led_.Free(&a->n1);
  a->att = led_.Alloc(kWork, N * C_ * 4);
  a->lse = led_.Alloc(kWork, B_ * H_ * T_ * 4);
  if (attn16_) {  // AttentionForwardBf16Compute: rounded f32 copies / bf16 operands for cuDNN
    Scratch((nq_ + 2 * nk_) * N * 4, (2 * nq_ + 2 * nk_) * N * 2);
  }
  int o = led_.Alloc(kWork, N * C_ * 4);
  LinearForward(fp8, N, C_, &a->so, train);
  if (train && attn16_) {
    auto pack = [&](int* f32, int* b16, double n, bool keep) {
      *b16 = led_.Alloc(kWork, n * 2);
      if (!keep) led_.Free(f32);
    };
    pack(&a->q, &a->q16, N * nq_, false);
    pack(&a->k, &a->k16, N * nk_, false);
    pack(&a->v, &a->v16, N * nk_, false);
    pack(&a->att, &a->att16, N * C_, keep_f32);
  }
  a->h = led_.Alloc(kWork, N * C_ * 4);
  led_.Free(&o);
}

int Sim::MlpForward(bool fp8, SimActs* a, bool train) {
  const double N = N_;
  a->n2 = led_.Alloc(kWork, N * C_ * 4);
  a->rstd2 = led_.Alloc(kWork, N * 4);
  a->gate = led_.Alloc(kWork, N * F_ * 4);
  a->up = led_.Alloc(kWork, N * F_ * 4);
  LinearForward(fp8, N, C_, &a->sgate, train);
  LinearForward(fp8, N, C_, &a->sup, train);
  if (fp8 || !train) led_.Free(&a->n2);
  a->act = led_.Alloc(kWork, N * F_ * 4);
  if (train && fp8) {
    a->gate16 = led_.Alloc(kWork, N * F_ * 2);
    a->up16 = led_.Alloc(kWork, N * F_ * 2);
    led_.Free(&a->gate);
    led_.Free(&a->up);
  }
  int mlp = led_.Alloc(kWork, N * C_ * 4);
  LinearForward(fp8, N, F_, &a->sdown, train);
  if (fp8 || !train) led_.Free(&a->act);
  int out = led_.Alloc(kWork, N * C_ * 4);
  led_.Free(&mlp);
  return out;
}

int Sim::MlpBackward(bool fp8, SimActs* a, int* dout) {
  const double N = N_;
  int dact = led_.Alloc(kWork, N * F_ * 4);
  LinearBackward(fp8, false, N, F_, C_, a->sdown, false);
  Drop(&a->sdown);
  led_.Free(&a->act);
  int dgate = led_.Alloc(kWork, N * F_ * 4), dup = led_.Alloc(kWork, N * F_ * 4);
  if (a->gate16 >= 0) Scratch(2 * N * F_ * 4, 0);  // SwigluBackwardBf16Saved
  led_.Free(&dact);
  for (int* p : {&a->gate, &a->up, &a->gate16, &a->up16}) led_.Free(p);
  int dn2 = led_.Alloc(kWork, N * C_ * 4);
  LinearBackward(fp8, false, N, C_, F_, a->sgate, false);
  LinearBackward(fp8, false, N, C_, F_, a->sup, false);
  led_.Free(&dgate);
  led_.Free(&dup);
  Drop(&a->sgate);
  Drop(&a->sup);
  led_.Free(&a->n2);
  int dh = led_.Alloc(kWork, N * C_ * 4);
  led_.Free(&dn2);
  led_.Free(dout);
  return dh;
}

void Sim::AttentionBackward(bool fp8, SimActs* a, int* dh, int* dout) {
  const double N = N_;
  int datt = led_.Alloc(kWork, N * C_ * 4);
  LinearBackward(fp8, false, N, C_, C_, a->so, false);
  Drop(&a->so);
  int dq = led_.Alloc(kWork, N * nq_ * 4), dk = led_.Alloc(kWork, N * nk_ * 4),
      dv = led_.Alloc(kWork, N * nk_ * 4);
  if (attn16_) {
    // AttentionBackwardBf16Saved: f32 q, o, k, v, then the Compute's rounded copies (CPU); bf16
    // operands and cuDNN's workspace (CUDA).
    const double cudnn = det_ ? B_ * H_ * T_ * T_ * 2 : N * nq_ * 4;
    Scratch((2 * nq_ + 2 * nk_) * N * 4 + (3 * nq_ + 2 * nk_) * N * 4,
            (2 * nq_ + 2 * nk_) * N * 2 + cudnn);
  }
  led_.Free(&datt);
  int dn1 = led_.Alloc(kWork, N * C_ * 4);
  LinearBackward(fp8, false, N, C_, nq_, a->sq, false);
  LinearBackward(fp8, false, N, C_, nk_, a->sk, false);
  LinearBackward(fp8, false, N, C_, nk_, a->sv, false);
  for (int* s : {&a->sq, &a->sk, &a->sv}) Drop(s);
  for (int* p : {&dq, &dk, &dv}) led_.Free(p);
  int dx = led_.Alloc(kWork, N * C_ * 4);
  FreeActs(a);
  led_.Free(&dn1);
  led_.Free(dh);
  *dout = dx;
}

// ---- FP8 blocks with BF16 attention (LlamaModel::...Fp8) ----

void Sim::AttentionForwardFp8(int l, SimActs* a, bool train) {
  const double N = N_, nt = nq_ + 2 * nk_;
  a->rstd1 = led_.Alloc(kWork, N * 4);
  int in1 = NewInput(N * C_);  // NormCastInput: one cast of n1 for q, k and v
  if (fused_qkv_[l]) {
    a->qkv16 = led_.Alloc(kWork, N * nt * 2);
    Scratch(N * nt * 4, 0);  // GemmFp8Bf16
    for (int* s : {&a->sq, &a->sk, &a->sv}) Keep(in1, s, train);
    // RopeForwardBf16 on strided rows: a dense bf16 copy and its f32 rotation.
    Scratch(N * nq_ * 6, 0);
    Scratch(N * nk_ * 6, 0);
  } else {
    a->q16 = led_.Alloc(kWork, N * nq_ * 2);
    a->k16 = led_.Alloc(kWork, N * nk_ * 2);
    a->v16 = led_.Alloc(kWork, N * nk_ * 2);
    Scratch(N * nq_ * 4, 0);
    for (int* s : {&a->sq, &a->sk, &a->sv}) Keep(in1, s, train);
  }
  EndInput(in1);
  a->att16 = led_.Alloc(kWork, N * C_ * 2);
  a->lse = led_.Alloc(kWork, B_ * H_ * T_ * 4);
  // AttentionForwardBf16Packed: f32 q, o, k, v and the Compute's rounded q, k, v (CPU).
  Scratch((2 * nq_ + 2 * nk_) * N * 4 + (nq_ + 2 * nk_) * N * 4, 0);
  if (!train) {
    for (int* p : {&a->q16, &a->k16, &a->v16, &a->qkv16}) led_.Free(p);
  }
  a->h = led_.Alloc(kWork, N * C_ * 4);
  int in = NewInput(N * C_);  // o_proj's input cast from att16
  Scratch(N * C_ * 4, 0);     // CastToFp8Bf16 through f32
  Keep(in, &a->so, train);
  EndInput(in);
  if (!train) led_.Free(&a->att16);
}

int Sim::MlpForwardFp8(int l, SimActs* a, bool train) {
  const double N = N_;
  a->rstd2 = led_.Alloc(kWork, N * 4);
  int in2 = NewInput(N * C_);
  if (fused_mlp_[l]) {
    a->gu16 = led_.Alloc(kWork, N * 2 * F_ * 2);
    Scratch(N * 2 * F_ * 4, 0);
  } else {
    a->gate16 = led_.Alloc(kWork, N * F_ * 2);
    a->up16 = led_.Alloc(kWork, N * F_ * 2);
    Scratch(N * F_ * 4, 0);
  }
  Keep(in2, &a->sgate, train);
  Keep(in2, &a->sup, train);
  EndInput(in2);
  int in_act = NewInput(N * F_);  // CastSwiglu
  Scratch(3 * N * F_ * 4, 0);
  if (!train) {
    for (int* p : {&a->gate16, &a->up16, &a->gu16}) led_.Free(p);
  }
  int out = led_.Alloc(kWork, N * C_ * 4);
  if (!recast_down_[l]) Keep(in_act, &a->sdown, train);
  EndInput(in_act);
  return out;
}

int Sim::MlpBackwardFp8(int l, SimActs* a, int* dout) {
  const double N = N_, n = N_ * F_;
  int dact16 = led_.Alloc(kWork, n * 2);
  if (a->sdown < 0) {  // Linear::RecastSwiglu: the transpose, from dense codes (CPU) through f32
    const int in = NewInput(n);
    std::swap(inputs_[in].x8, inputs_[in].xT);
    Keep(in, &a->sdown, true);
    Scratch(n + 3 * n * 4, 0);
  }
  LinearBackward(true, false, N, F_, C_, a->sdown, true);
  Drop(&a->sdown);
  int dn2g = led_.Alloc(kWork, N * C_ * 2), dn2u = -1;
  // SwigluBackwardCastTransposeFp8 (CPU): two bf16 gradients, then the larger of the SwiGLU
  // backward's f32 buffers and a cast-transpose through f32.
  const double swiglu = (n + 2) * 4 + std::max(3 * n * 4 + 2 * n * 4, n * 4 + n);
  if (fused_mlp_[l]) {
    int d8 = led_.Alloc(kWork, N * 2 * F_), dT8 = led_.Alloc(kWork, N * 2 * F_);
    Scratch(2 * n * 2 + swiglu, 0);  // dense copies of the strided gate and up first
    led_.Free(&dact16);
    led_.Free(&a->gu16);
    BackwardFp8(N, C_, 2 * F_, a->sgate, true, &d8, &dT8);
  } else {
    dn2u = led_.Alloc(kWork, N * C_ * 2);
    int dg8 = led_.Alloc(kWork, n), dgT8 = led_.Alloc(kWork, n), du8 = led_.Alloc(kWork, n),
        duT8 = led_.Alloc(kWork, n);
    Scratch((n + 2) * 4 + std::max(5 * n * 4, n * 4), 0);
    led_.Free(&dact16);
    led_.Free(&a->gate16);
    led_.Free(&a->up16);
    BackwardFp8(N, C_, F_, a->sgate, true, &dg8, &dgT8);
    BackwardFp8(N, C_, F_, a->sup, true, &du8, &duT8);
  }
  Drop(&a->sgate);
  Drop(&a->sup);
  int dh = led_.Alloc(kWork, N * C_ * 4);
  int h32 = a->h16 >= 0 ? led_.Alloc(kWork, N * C_ * 4) : -1;  // NormInput
  Scratch(2 * N * C_ * 4, 0);  // RmsNormBackwardAddBf16Parts
  led_.Free(&h32);
  led_.Free(&dn2g);
  led_.Free(&dn2u);
  led_.Free(dout);
  return dh;
}

void Sim::AttentionBackwardFp8(int l, SimActs* a, int* dh, int* dout) {
  const double N = N_, nt = nq_ + 2 * nk_;
  int dq16 = led_.Alloc(kWork, N * nq_ * 2), dk16 = led_.Alloc(kWork, N * nk_ * 2),
      dv16 = led_.Alloc(kWork, N * nk_ * 2);
  {  // OutputAttentionBackwardFp8
    int datt16 = led_.Alloc(kWork, N * C_ * 2);
    LinearBackward(true, false, N, C_, C_, a->so, true);
    Drop(&a->so);
    // AttentionBackwardBf16SavedTo16 (CPU): dense copies of strided q, k, v; f32 dq, dk, dv,
    // dout; the Saved's f32 q, o, k, v; the Compute's rounded copies. CUDA: cuDNN's workspace.
    const double dense = fused_qkv_[l] ? (nq_ + 2 * nk_) * N * 2 : 0;
    const double cudnn = det_ ? B_ * H_ * T_ * T_ * 2 : N * nq_ * 4;
    Scratch(dense + 2 * (2 * nq_ + 2 * nk_) * N * 4 + (3 * nq_ + 2 * nk_) * N * 4, cudnn);
    led_.Free(&datt16);
  }
  for (int* p : {&a->q16, &a->k16, &a->v16, &a->qkv16, &a->att16}) led_.Free(p);
  int dn1q = led_.Alloc(kWork, N * C_ * 2), dn1k = -1, dn1v = -1;
  // RopeBackwardCastTransposeFp8Bf16 (CPU): a bf16 copy, then its rotation or its cast through
  // f32 (plus dense codes when written into a wider matrix).
  auto rope_cast = [&](double n, bool strided) {
    Scratch(n * 2 + std::max(n * 4, n * 4 + (strided ? n : 0)), 0);
  };
  if (fused_qkv_[l]) {
    int d8 = led_.Alloc(kWork, N * nt), dT8 = led_.Alloc(kWork, N * nt);
    rope_cast(N * nq_, true);
    rope_cast(N * nk_, true);
    Scratch(N * nk_ * 5, 0);  // CastTransposeFp8Bf16 of dv into the wider matrix
    for (int* p : {&dq16, &dk16, &dv16}) led_.Free(p);
    BackwardFp8(N, C_, nt, a->sq, true, &d8, &dT8);
  } else {
    dn1k = led_.Alloc(kWork, N * C_ * 2);
    dn1v = led_.Alloc(kWork, N * C_ * 2);
    for (auto [d16, heads, saved] :
         {std::tuple{&dq16, nq_, a->sq}, std::tuple{&dk16, nk_, a->sk}}) {
      int d8 = led_.Alloc(kWork, N * heads), dT8 = led_.Alloc(kWork, N * heads);
      rope_cast(N * heads, false);
      led_.Free(d16);
      BackwardFp8(N, C_, heads, saved, true, &d8, &dT8);
    }
    LinearBackward(true, true, N, C_, nk_, a->sv, true);
  }
  for (int* p : {&dq16, &dk16, &dv16}) led_.Free(p);
  for (int* s : {&a->sq, &a->sk, &a->sv}) Drop(s);
  int dx = led_.Alloc(kWork, N * C_ * 4);
  int x32 = a->x_in16 >= 0 ? led_.Alloc(kWork, N * C_ * 4) : -1;  // NormInput
  Scratch(2 * N * C_ * 4, 0);  // RmsNormBackwardAddBf16Parts
  led_.Free(&x32);
  FreeActs(a);
  for (int* p : {&dn1q, &dn1k, &dn1v}) led_.Free(p);
  led_.Free(dh);
  *dout = dx;
}

// ---- blocks ----

void Sim::FreeActs(SimActs* a) {
  for (int* p : {&a->x_in, &a->n1, &a->rstd1, &a->q, &a->k, &a->v, &a->att, &a->lse, &a->h,
                 &a->n2, &a->rstd2, &a->gate, &a->up, &a->act, &a->q16, &a->k16, &a->v16,
                 &a->att16, &a->gate16, &a->up16, &a->gu16, &a->qkv16, &a->x_in16, &a->h16}) {
    led_.Free(p);
  }
  for (int* s : {&a->sq, &a->sk, &a->sv, &a->so, &a->sgate, &a->sup, &a->sdown}) Drop(s);
}

void Sim::KeepActs(SimActs* a, Term t) {
  for (int id : {a->x_in, a->n1, a->rstd1, a->q, a->k, a->v, a->att, a->lse, a->h, a->n2,
                 a->rstd2, a->gate, a->up, a->act, a->q16, a->k16, a->v16, a->att16, a->gate16,
                 a->up16, a->gu16, a->qkv16, a->x_in16, a->h16}) {
    led_.Retag(id, t);
  }
  for (int s : {a->sq, a->sk, a->sv, a->so, a->sgate, a->sup, a->sdown}) {
    if (s >= 0) led_.Retag(inputs_[s].x8, t);
  }
}

void Sim::BlockForward(int l, int* x, SimActs* a, bool train) {
  SimActs local;
  if (!train) a = &local;
  a->x_in = *x;
  const bool fp8 = prec_[l] == v1::PRECISION_FP8;
  if (fp8_bf16_[l]) {  // BlockPlan::fp8_bf16
    AttentionForwardFp8(l, a, train);
    if (train) KeepNormInput(&a->x_in, &a->x_in16);
    *x = MlpForwardFp8(l, a, train);
    if (train) KeepNormInput(&a->h, &a->h16);
  } else {
    AttentionForward(fp8, a, train);
    *x = MlpForward(fp8, a, train);
  }
  if (train) {
    // Kept for the backward: saved activations; a recomputed block's are its backward's workspace.
    KeepActs(a, recompute_ ? kWork : kSaved);
  } else {
    FreeActs(&local);
  }
}

void Sim::BlockBackward(int l, SimActs* a, int* dout) {
  const bool fp8 = prec_[l] == v1::PRECISION_FP8;
  if (fp8_bf16_[l]) {
    int dh = MlpBackwardFp8(l, a, dout);
    AttentionBackwardFp8(l, a, &dh, dout);
  } else {
    int dh = MlpBackward(fp8, a, dout);
    AttentionBackward(fp8, a, &dh, dout);
  }
}

// ---- the head and the step (LlamaModel::Run, Trainer::Step) ----

void Sim::HeadBf16() {
  const double N = N_;
  const double rows = head_rows_;  // StepPlan::head_chunk_rows
  // The GEMMs read the gathered bf16 weight; nf in bf16 once; every row's bf16 logit gradient.
  int nf16 = led_.Alloc(kLogits, N * C_ * 2), g16 = led_.Alloc(kLogits, N * V_ * 2);
  // The first chunk is a full one: the largest.
  int logits = led_.Alloc(kLogits, rows * V_ * 4);
  Scratch((rows * C_ + V_ * C_) * 4, 0);  // GemmBf16's f32 operands
  Scratch(rows * V_ * 4, 0);              // CrossEntropyForwardBackwardBf16Grad through f32
  led_.Free(&logits);
  Scratch((rows * V_ + C_ * V_) * 4, 0);
  Scratch((V_ * N + C_ * N) * 4, 0);  // dW over every row at once
  led_.Free(&g16);
  led_.Free(&nf16);
}

void Sim::Head(PhasePeak* fwd, int* x, int* dx, int* dnf, int* nf, int* rstdf) {
  const double N = N_;
  const int head = 1 + L_;
  if (tied_) Gather(0);
  Gather(head);
  if (L_ > 0) Prefetch(BlockUnit(L_ - 1));
  UnpackF32(head, head_bf16_ ? C_ : C_ + V_ * C_);  // the final norm (an f32 head: all)
  *nf = led_.Alloc(kWork, N * C_ * 4);
  *rstdf = led_.Alloc(kWork, N * 4);
  if (head_bf16_) {
    BeginGrads(head);
    if (tied_) BeginGrads(0);
    *dnf = led_.Alloc(kWork, N * C_ * 4);
    HeadBf16();
    fwd->Take(led_);
    led_.ResetPeak();
  } else {
    int logits = led_.Alloc(kLogits, N * V_ * 4);
    fwd->Take(led_);
    led_.ResetPeak();
    BeginGrads(head);
    if (tied_) BeginGrads(0);
    *dnf = led_.Alloc(kWork, N * C_ * 4);
    led_.Free(&logits);
  }
  *dx = led_.Alloc(kWork, N * C_ * 4);
  led_.Free(nf);
  led_.Free(x);
  Release(head);
  if (tied_) Release(0);
  ReduceGrads(head);
}

void Sim::RunMicrobatch(PhasePeak* fwd, PhasePeak* bwd) {
  const double N = N_;
  std::vector<SimActs> acts(L_);
  Gather(0);
  Prefetch(BlockUnit(0));
  int x = led_.Alloc(kWork, N * C_ * 4);
  UnpackF32(0, V_ * C_);  // EmbeddingForward reads the table in f32
  Release(0);
  for (int l = 0; l < L_; ++l) {
    Gather(BlockUnit(l));
    Prefetch(BlockUnit(l + 1));
    UnpackF32(BlockUnit(l), BlockF32Numel(l));
    if (recompute_) acts[l].x_in = led_.Alloc(kSaved, N * C_ * 4);  // a copy of the input
    BlockForward(l, &x, &acts[l], !recompute_);
    Release(BlockUnit(l));
  }
  int dx = -1, dnf = -1, nf = -1, rstdf = -1;
  Head(fwd, &x, &dx, &dnf, &nf, &rstdf);
  for (int l = L_ - 1; l >= 0; --l) {
    Gather(BlockUnit(l));
    if (l > 0) Prefetch(BlockUnit(l - 1));
    UnpackF32(BlockUnit(l), BlockF32Numel(l));
    if (recompute_) {
      int xin = acts[l].x_in;
      acts[l].x_in = -1;
      BlockForward(l, &xin, &acts[l], true);
      led_.Free(&xin);  // the recomputed block output
    }
    BeginGrads(BlockUnit(l));
    BlockBackward(l, &acts[l], &dx);
    Release(BlockUnit(l));
    ReduceGrads(BlockUnit(l));
  }
  if (!tied_) BeginGrads(0);
  ReduceGrads(0);
  FlushGrads();
  bwd->Take(led_);
  led_.ResetPeak();
  for (int* p : {&dx, &dnf, &rstdf}) led_.Free(p);
}

void Sim::Step(PhasePeak* fwd, PhasePeak* bwd, PhasePeak* opt) {
  led_.ResetPeak();
  FlushGrads();  // ZeroGrads
  for (SimUnit& u : units_) {
    for (SimBuf& b : u.bufs) {
      led_.Free(&b.grad);
      b.grad_unset = true;
    }
  }
  // Trainer::RunBatch: token ids and targets of a microbatch, the step's losses.
  int in = led_.Alloc(kBatch, N_ * 4), tg = led_.Alloc(kBatch, N_ * 4),
      losses = led_.Alloc(kBatch, local_tokens_ * 4);
  // Microbatches after the second repeat it (the same buffers, reduce-scatter parts included).
  for (int mb = 0; mb < std::min(microbatches_, 2); ++mb) RunMicrobatch(fwd, bwd);
  FlushGrads();  // StartGradSquaredNorm (MaterializeGrads: shards no gradient reached)
  for (SimUnit& u : units_) {
    for (SimBuf& b : u.bufs) {
      if (b.grad_unset) b.grad = led_.Alloc(kGrads, b.shard * 4);
      b.grad_unset = false;
    }
  }
  int grad_sq = led_.Alloc(kWork, 8);  // the grad norm's and the losses' sums of squares
  for (int* p : {&in, &tg, &losses}) led_.Free(p);
  bwd->Take(led_);  // the tail after the last phase boundary
  led_.ResetPeak();
  led_.Free(&grad_sq);  // FinishGradSquaredNorm
  DropPrefetches();     // CastWeights
  Prefetch(0);          // PrefetchFirstUnits
  Prefetch(BlockUnit(0));
  opt->Take(led_);
}

void Sim::Run(PhasePeak* fwd, PhasePeak* bwd, PhasePeak* opt) {
  int fp8_tensors = 0;
  for (v1::Precision p : prec_) fp8_tensors += p == v1::PRECISION_FP8 ? 7 : 0;
  // FsdpParams: per buffer master, m, v and the wire shard (grads: ReduceGrads); the weight scales.
  for (SimUnit& u : units_) {
    for (SimBuf& b : u.bufs) {
      const double wire =
          b.wire == kFp8 ? (keep_codes_ ? b.shard : 0) : b.wire == kBf16 ? b.shard * 2 : 0;
      led_.Alloc(kParams, b.shard * 4 + wire);
      led_.Alloc(kOptimizer, b.shard * static_cast<double>(opt_bytes_));
    }
  }
  const double nw = std::max(fp8_tensors, 1), na = std::max(2 * fp8_tensors, 1);
  // Projections sharing scales: the group table on the device (SetWeightScaleGroup).
  led_.Alloc(kScaling, nw * 40 + (grouped_ ? nw * 4 : 0) + na * 36 + 4);
  // CUDA: the cuBLASLt workspace, the RoPE table (T, D/2) x cos and sin, and the f32 attention
  // backward's delta slot (B, H, T), grown by a quarter (CudaBackend::Scratch).
  if (cuda_) {
    led_.Alloc(kWork, static_cast<double>(kCudaGemmWorkspaceBytes) + T_ * D_ * 4 +
                          (attn16_ ? 0 : B_ * H_ * T_ * 4 * 1.25));
  }
  if (!cuda_) led_.Alloc(kWork, CpuScratchBytes());
  PhasePeak f, b, o;
  Step(&f, &b, &o);
  Step(fwd, bwd, opt);
}

}  // namespace

absl::StatusOr<MemoryPlan> PlanMemory(const v1::JobSpec& spec_in, int world_size,
                                      const MemoryPlanOptions& options) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: must be >= 1 (got ", world_size, ")"));
  }
  const v1::JobSpec spec = WithDefaults(spec_in, world_size);
  const v1::ModelConfig& m = spec.model();
  if (m.d_model() <= 0 || m.n_layers() <= 0 || m.n_heads() <= 0 || m.n_kv_heads() <= 0 ||
      m.ffn_dim() <= 0 || m.vocab_size() <= 0 || m.seq_len() <= 0 ||
      m.d_model() % m.n_heads() != 0 || spec.training().microbatch() <= 0 ||
      spec.sharding().alignment() < 1) {
    return absl::InvalidArgumentError(
        "memory plan: model sizes, microbatch and alignment must be > 0 and d_model divisible by "
        "n_heads (validate the spec first)");
  }
  // The step plan of `s` (at most kReplayLayers blocks), replayed.
  auto replay = [&](const v1::JobSpec& s, PhasePeak* f, PhasePeak* b, PhasePeak* o) {
    absl::StatusOr<StepPlan> plan =
        MakeStepPlan(s, world_size, BackendCapsOf(s.backend()), options);
    if (!plan.ok()) return plan.status();
    Sim(s, *plan, OptimizerStateBytesPerElement(s)).Run(f, b, o);
    return absl::OkStatus();
  };
  PhasePeak fwd, bwd, opt;
  if (m.n_layers() <= kReplayLayers) {
    if (absl::Status st = replay(spec, &fwd, &bwd, &opt); !st.ok()) return st;
  } else {
    // Beyond kReplayLayers blocks every figure grows linearly with the blocks (shards, saved
    // activations; the transients are one block's): replays of K / 2 and K blocks, extrapolated.
    std::array<PhasePeak, 3> a, b;
    for (auto [n, out] : {std::pair{kReplayLayers / 2, &a}, std::pair{kReplayLayers, &b}}) {
      v1::JobSpec s = spec;
      s.mutable_model()->set_n_layers(n);
      if (absl::Status st = replay(s, &(*out)[0], &(*out)[1], &(*out)[2]); !st.ok()) return st;
    }
    const double f = (static_cast<double>(m.n_layers()) - kReplayLayers) / (kReplayLayers / 2);
    for (auto [x, y, out] : {std::tuple{&a[0], &b[0], &fwd}, std::tuple{&a[1], &b[1], &bwd},
                             std::tuple{&a[2], &b[2], &opt}}) {
      out->bytes = y->bytes + (y->bytes - x->bytes) * f;
      for (int t = 0; t < kNumTerms; ++t) {
        out->terms[t] = y->terms[t] + (y->terms[t] - x->terms[t]) * f;
      }
    }
  }
  MemoryPlan p;
  p.backend = spec.backend();
  p.world_size = world_size;
  p.forward_peak_bytes = Saturate(fwd.bytes);
  p.backward_peak_bytes = Saturate(bwd.bytes);
  p.optimizer_peak_bytes = Saturate(opt.bytes);
  const PhasePeak* top = &fwd;
  p.peak_phase = "forward";
  if (bwd.bytes > top->bytes) {
    top = &bwd;
    p.peak_phase = "backward";
  }
  if (opt.bytes > top->bytes) {
    top = &opt;
    p.peak_phase = "optimizer";
  }
  p.peak_bytes = Saturate(top->bytes);
  for (int t = 0; t < kNumTerms; ++t) p.terms.push_back({kTermNames[t], Saturate(top->terms[t])});
  double device = top->bytes;
  if (p.backend == "cuda") {
    p.device_extra.push_back({"CUDA context", kCudaContextBytes});
    if (world_size > 1) p.device_extra.push_back({"NCCL buffers", kNcclBufferBytes});
    p.device_extra.push_back({"allocator rounding", Saturate(top->bytes * kPoolOverheadFraction)});
    for (const MemoryTerm& t : p.device_extra) device += static_cast<double>(t.bytes);
  }
  p.device_bytes = Saturate(device);
  p.exceeds_int64 = p.device_bytes == kBytesExceeded || p.peak_bytes == kBytesExceeded ||
                    p.forward_peak_bytes == kBytesExceeded ||
                    p.backward_peak_bytes == kBytesExceeded ||
                    p.optimizer_peak_bytes == kBytesExceeded;
  for (const MemoryTerm& t : p.terms) p.exceeds_int64 = p.exceeds_int64 || t.bytes == kBytesExceeded;
  return p;
}

v1::MemoryPlan ToProto(const MemoryPlan& plan) {
  v1::MemoryPlan out;
  out.set_backend(plan.backend);
  out.set_world_size(plan.world_size);
  out.set_forward_peak_bytes(plan.forward_peak_bytes);
  out.set_backward_peak_bytes(plan.backward_peak_bytes);
  out.set_optimizer_peak_bytes(plan.optimizer_peak_bytes);
  out.set_peak_bytes(plan.peak_bytes);
  out.set_peak_phase(plan.peak_phase);
  for (const MemoryTerm& t : plan.terms) {
    v1::MemoryTerm* o = out.add_terms();
    o->set_name(t.name);
    o->set_bytes(t.bytes);
  }
  for (const MemoryTerm& t : plan.device_extra) {
    v1::MemoryTerm* o = out.add_device_extra();
    o->set_name(t.name);
    o->set_bytes(t.bytes);
  }
  out.set_device_bytes(plan.device_bytes);
  out.set_exceeds_int64(plan.exceeds_int64);
  return out;
}

std::string MemoryBytes(int64_t bytes) {
  if (bytes == kBytesExceeded) return "exceeds 8 EiB";
  const double b = static_cast<double>(bytes);
  const double tib = static_cast<double>(int64_t{1} << 40);
  if (b >= tib) return absl::StrFormat("%.2f TiB", b / tib);
  if (b >= double(1 << 30)) return absl::StrFormat("%.2f GiB", b / double(1 << 30));
  if (b >= double(1 << 20)) return absl::StrFormat("%.1f MiB", b / double(1 << 20));
  if (b >= 1024) return absl::StrFormat("%.1f KiB", b / 1024);
  return absl::StrCat(bytes, " B");
}

std::string MemoryBytesAndCount(int64_t bytes) {
  if (bytes == kBytesExceeded) return MemoryBytes(bytes);
  return absl::StrCat(MemoryBytes(bytes), " (", bytes, " bytes)");
}

std::string LargestTerms(const MemoryPlan& plan, int n) {
  std::vector<MemoryTerm> all = plan.terms;
  all.insert(all.end(), plan.device_extra.begin(), plan.device_extra.end());
  std::stable_sort(all.begin(), all.end(),
                   [](const MemoryTerm& a, const MemoryTerm& b) { return a.bytes > b.bytes; });
  std::string out;
  for (int i = 0; i < n && i < static_cast<int>(all.size()) && all[i].bytes > 0; ++i) {
    absl::StrAppend(&out, i > 0 ? ", " : "", all[i].name, " ", MemoryBytes(all[i].bytes));
  }
  return out;
}

}  // namespace fsdp8
