#include "train/model.h"

#include <algorithm>
#include <string>

#include "common/check.h"
#include "absl/strings/str_cat.h"
#include "common/model_dims.h"
#include "common/rope.h"
#include "common/spec.h"
#include "common/step_plan.h"

namespace fsdp8 {
namespace {

// A block activation buffer as the typed operand of a backend op: bf16 or f32.
TypedPtr Act(DevBuf& d, bool bf16) { return bf16 ? TypedPtr(d.u16()) : TypedPtr(d.f32()); }

}  // namespace

// Everything a block's backward needs from its forward.
struct LlamaModel::BlockActs {
  DevBuf x_in;          // (N, C) block input (residual stream)
  DevBuf n1, rstd1;     // (N, C), (N); n1 kept only for non-FP8 blocks
  DevBuf q, k, v;       // (B, T, H, D), (B, T, Hkv, D) x2; q, k after RoPE
  DevBuf att, lse;      // (N, C), (B, H, T)
  DevBuf h;             // (N, C) after the attention residual
  DevBuf n2, rstd2;     // (N, C), (N)
  DevBuf gate, up, act; // (N, F)
  // bf16 copies kept instead of the f32 ones above: q, k, v (after RoPE) and att when attention
  // is BF16 (exactly the values its backward uses); gate and up in FP8 blocks.
  DevBuf q16, k16, v16, att16, gate16, up16;
  DevBuf gu16;  // (N, 2F) [gate | up] bf16: the fused gate/up GEMM's output (MlpFused)
  // (N, (H + 2 Hkv) D) [q | k | v] bf16, q and k after RoPE: the fused q/k/v GEMM's output
  // (Block::fused_qkv), kept instead of q16, k16, v16.
  DevBuf qkv16;
  // x_in and h rounded to bf16, kept instead of them in FP8 blocks with training.saved_norm_inputs
  // BF16 (KeepNormInput).
  DevBuf x_in16, h16;
  LinearSaved sq, sk, sv, so, sgate, sup, sdown;
};

LlamaModel::LlamaModel(const v1::JobSpec& spec, FsdpParams* params, ActScaling* scaling,
                       Backend* be, const ModelOptions& options)
    : be_(be), p_(params), scaling_(scaling),
      head_chunk_bytes_(std::max<int64_t>(1, options.head_chunk_logit_bytes)) {
  const v1::ModelConfig& m = spec.model();
  const ModelDims d = ModelDimsOf(m);
  C_ = d.d_model;
  H_ = d.n_heads;
  Hkv_ = d.n_kv_heads;
  D_ = d.head_dim;
  F_ = d.ffn_dim;
  V_ = d.vocab_size;
  T_ = d.seq_len;
  eps_ = static_cast<float>(m.norm_eps());
  theta_ = static_cast<float>(m.rope_theta());
  // Every RoPE op of this model uses these frequencies (empty: the plain theta^(-2i/D)).
  be_->SetRopeInvFreq(theta_, HasRopeScaling(m) ? RopeInvFreq(m) : std::vector<float>());
  const bool hybrid = spec.precision().fp8().format() != v1::FP8_FORMAT_E4M3;
  attention_bf16_ = spec.precision().attention() == v1::PRECISION_BF16;
  recompute_ = spec.training().activation_recompute();
  save_down_input_ = options.save_down_proj_input;
  norm_inputs_bf16_ = spec.training().saved_norm_inputs() == v1::PRECISION_BF16;

  embed_ = p_->Ref("model.embed_tokens.weight");
  final_norm_ = p_->Ref("model.norm.weight");
  tied_ = m.tie_word_embeddings();
  // Tied: the head GEMM reads the embedding's weight (its unit is gathered again for the head).
  head_ = tied_ ? embed_ : p_->Ref("lm_head.weight");
  embedding_unit_ = embed_.unit;
  head_unit_ = final_norm_.unit;

  auto make_linear = [&](v1::Precision prec, const TensorRef& w, const std::string& hf) {
    if (prec != v1::PRECISION_FP8) return Linear(be, scaling, prec, -1, -1);
    FSDP8_CHECK(w.fp8_id >= 0) << hf << ": FP8 precision but its buffer is not fp8";
    const std::string base = ScalingBaseName(hf);
    const int xi = scaling->Add(base + ".x", false);
    const int di = scaling->Add(base + ".dy", hybrid);
    return Linear(be, scaling, prec, xi, di);
  };
  // Which path each block takes: the step plan (common/step_plan.h).
  StepPlanOptions step_options;
  step_options.unfused_projections = options.unfused_projections;
  step_options.save_down_proj_input = options.save_down_proj_input;
  step_options.head_chunk_logit_bytes = head_chunk_bytes_;
  const absl::StatusOr<StepPlan> step_or =
      MakeStepPlan(spec, p_->plan().world_size * p_->plan().replicas, BackendCapsOf(be->Name()),
                   step_options);
  FSDP8_CHECK(step_or.ok()) << step_or.status().message();
  const StepPlan& step = *step_or;
  const Fp8Format dy_format = hybrid ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
  for (int l = 0; l < d.n_layers; ++l) {
    Block b;
    b.prec = step.blocks[l].linears;
    // A rowwise / blockwise block runs the generic path of a BF16 block (f32 activations, f32
    // inputs kept; BlockPlan::granularity), its linears quantizing at each use (Linear::Scaled).
    const v1::Fp8Granularity granularity = step.blocks[l].granularity;
    const bool scaled = granularity != v1::FP8_GRANULARITY_TENSORWISE;
    if (scaled) b.prec = v1::PRECISION_BF16;
    const std::string pre = absl::StrCat("model.layers.", l, ".");
    b.in_norm = p_->Ref(pre + "input_layernorm.weight");
    b.post_norm = p_->Ref(pre + "post_attention_layernorm.weight");
    auto lin = [&](TensorRef* r, Linear* lin, const std::string& n) {
      *r = p_->Ref(pre + n);
      *lin = scaled ? Linear::Scaled(be, granularity, dy_format) : make_linear(b.prec, *r, pre + n);
    };
    lin(&b.q, &b.lq, "self_attn.q_proj.weight");
    lin(&b.k, &b.lk, "self_attn.k_proj.weight");
    lin(&b.v, &b.lv, "self_attn.v_proj.weight");
    lin(&b.o, &b.lo, "self_attn.o_proj.weight");
    lin(&b.gate, &b.lgate, "mlp.gate_proj.weight");
    lin(&b.up, &b.lup, "mlp.up_proj.weight");
    lin(&b.down, &b.ldown, "mlp.down_proj.weight");
    // The block's path, shared scales and fused GEMMs where the step plan puts them
    // (BlockPlan::fp8_bf16, group_*, fused_*).
    const BlockPlan& bp = step.blocks[l];
    b.acts16 = bp.fp8_bf16;
    if (bp.group_qkv) {
      const absl::Status st = p_->SetWeightScaleGroup({b.q, b.k, b.v});
      FSDP8_CHECK(st.ok()) << st.message();
      scaling->GroupAmax({b.lq.dy_index(), b.lk.dy_index(), b.lv.dy_index()});
    }
    if (bp.group_mlp) {
      const absl::Status st = p_->SetWeightScaleGroup({b.gate, b.up});
      FSDP8_CHECK(st.ok()) << st.message();
      scaling->GroupAmax({b.lgate.dy_index(), b.lup.dy_index()});
    }
    b.fused_qkv = bp.fused_qkv;
    b.fused_mlp = bp.fused_mlp;
    for (const PlannedTensor& t : recompute_ ? bp.recomputed : bp.saved) b.saved.push_back(t.name);
    blocks_.push_back(std::move(b));
  }
  v1::Precision hp = spec.precision().lm_head();
  if (hp == v1::PRECISION_UNSPECIFIED) hp = v1::PRECISION_BF16;
  lhead_ = make_linear(hp, head_, "lm_head.weight");
}

MemoryLabel LlamaModel::Keep(const Block& b, bool train, const char* name) const {
  if (!train || recompute_) return MemoryLabel::kWork;  // recomputed tensors are workspace
  return std::find(b.saved.begin(), b.saved.end(), name) != b.saved.end() ? MemoryLabel::kSaved
                                                                          : MemoryLabel::kWork;
}

void LlamaModel::TakePeak(int64_t* peak, LabelBytes* labels) {
  if (be_->PeakAllocatedBytes() > *peak) {
    *peak = be_->PeakAllocatedBytes();
    *labels = be_->account().AtPeak();
  }
}

bool LlamaModel::QkvBackwardFused(const Block& b) const {
  const Fp8Format f = b.lq.dy_format();
  return b.fused_qkv && !b.lq.DyNeedsAmaxFirst() && !b.lk.DyNeedsAmaxFirst() &&
         !b.lv.DyNeedsAmaxFirst() && b.lk.dy_format() == f && b.lv.dy_format() == f &&
         scaling_->SameScale(b.lq.dy_index(), b.lk.dy_index()) &&
         scaling_->SameScale(b.lq.dy_index(), b.lv.dy_index());
}

bool LlamaModel::MlpFused(const Block& b) const {
  return b.fused_mlp && !b.lgate.DyNeedsAmaxFirst() && !b.lup.DyNeedsAmaxFirst() &&
         !b.ldown.XNeedsAmaxFirst() && b.lgate.dy_format() == b.lup.dy_format() &&
         scaling_->SameScale(b.lgate.dy_index(), b.lup.dy_index());
}

WeightView LlamaModel::View(const TensorRef& t) const {
  WeightView w;
  if (t.wire == WireDtype::kFp8 && t.block_cols > 0) {  // blockwise FP8 wire
    w.fp8 = p_->W8(t);
    w.block_scale_inv = p_->WBlockScaleInv(t);
  } else if (t.wire == WireDtype::kFp8) {
    w.fp8 = p_->W8(t);
    w.scale_inv = p_->WScaleInv(t);
  } else {
    w.f32 = p_->W(t);
  }
  return w;
}

// One block for every precision. The linears' precision is their own (Linear); the activations
// between the GEMMs are f32, or bf16 in a block with FP8 linears and BF16 attention
// (Block::acts16): there they feed only an FP8 cast or the attention (q, k, v, att, gate, up and
// their gradients), so each memory-bound pass moves half the bytes, the norms cast straight to
// the shared FP8 input of q/k/v (gate/up), and o_proj and down_proj add the residual in their
// GEMMs. The residual stream, the norms' inputs and the GEMM outputs that join it stay f32.
absl::Status LlamaModel::BlockForward(int l, int64_t B, DevBuf* x, BlockActs* a) {
  Block& b = blocks_[l];
  const bool train = a != nullptr;
  BlockActs local;
  if (!train) a = &local;
  a->x_in = std::move(*x);
  a->x_in.Relabel(Keep(b, train, "x_in"));
  AttentionForward(b, B, train, a);
  if (train) KeepNormInput(b, &a->x_in, &a->x_in16, B * T_ * C_, "x_in16");
  *x = MlpForward(b, B, train, a);
  if (train) KeepNormInput(b, &a->h, &a->h16, B * T_ * C_, "h16");
  return absl::OkStatus();
}

void LlamaModel::KeepNormInput(const Block& b, DevBuf* x, DevBuf* x16, int64_t n,
                                const char* name) {
  if (!b.acts16 || !norm_inputs_bf16_) return;
  *x16 = DevBuf(be_, n * 2, Keep(b, true, name));
  be_->PackBf16(x->f32(), x16->u16(), n);
  x->Reset();
}

const float* LlamaModel::NormInput(const DevBuf& x, const DevBuf& x16, int64_t n, DevBuf* tmp) {
  if (x16.empty()) return x.f32();
  *tmp = DevBuf(be_, n * 4);
  be_->UnpackBf16(x16.u16(), tmp->f32(), n);
  return tmp->f32();
}

// h (N, C) = x_in + o_proj(att), att = attn(rope(q(n1)), rope(k(n1)), v(n1)), n1 = RMSNorm(x_in)
// (bf16 activations: cast straight to FP8, one cast for q, k and v).
void LlamaModel::AttentionForward(Block& b, int64_t B, bool train, BlockActs* a) {
  const int64_t N = B * T_;
  if (!b.acts16) a->n1 = DevBuf(be_, N * C_ * 4, Keep(b, train, "n1"));  // (N, C)
  a->rstd1 = DevBuf(be_, N * 4, Keep(b, train, "rstd1"));                  // (N)
  std::shared_ptr<Fp8Input> in1;
  if (b.acts16) {
    in1 = b.lq.NormCastInput(a->x_in.f32(), p_->W(b.in_norm), eps_, N, C_, a->rstd1.f32(),
                             {&b.lk, &b.lv}, Keep(b, train, "qkv.x8"));
  } else {
    be_->RmsNormForward(a->x_in.f32(), p_->W(b.in_norm), eps_, N, C_, a->n1.f32(), a->rstd1.f32());
  }
  const Qkv qkv = QkvForward(b, B, train, in1, a);
  in1.reset();
  DevBuf& att = b.acts16 ? a->att16 : a->att;
  att = DevBuf(be_, N * C_ * (b.acts16 ? 2 : 4), Keep(b, train, b.acts16 ? "att16" : "att"));
  a->lse = DevBuf(be_, B * H_ * T_ * 4, Keep(b, train, "lse"));  // (B, H, T)
  be_->AttentionForward(qkv.q, qkv.k, qkv.v, B, T_, H_, Hkv_, D_, Act(att, b.acts16), a->lse.f32(),
                        AttentionOptions{attention_bf16_, qkv.q_ld, qkv.kv_ld});
  if (b.acts16) {
    if (!train) {
      a->q16.Reset();
      a->k16.Reset();
      a->v16.Reset();
      a->qkv16.Reset();
    }
    // h = x + o_proj(att), the residual added in the GEMM.
    a->h = DevBuf(be_, N * C_ * 4, Keep(b, train, "h"));
    b.lo.ForwardFp8(b.lo.CastInput(ActivationView::Bf16(a->att16.u16()), N, C_, {},
                                   Keep(b, train, "o_proj.x8")),
                    N, C_, C_,
                    View(b.o), LinearOutput::F32PlusResidual(a->h.f32(), a->x_in.f32()),
                    train ? &a->so : nullptr);
    if (!train) a->att16.Reset();
    return;
  }
  DevBuf o(be_, N * C_ * 4);  // (N, C)
  b.lo.Forward(a->att.f32(), N, C_, C_, View(b.o), o.f32(), train ? &a->so : nullptr,
               Keep(b, train, "o_proj.x8"));
  if (train && attention_bf16_) {  // keep the attention's bf16 operands only
    auto pack = [&](DevBuf* f32, DevBuf* b16, int64_t n, bool keep_f32, const char* name) {
      *b16 = DevBuf(be_, n * 2, Keep(b, train, name));
      be_->PackBf16(f32->f32(), b16->u16(), n);
      if (!keep_f32) f32->Reset();
    };
    pack(&a->q, &a->q16, N * H_ * D_, false, "q16");
    pack(&a->k, &a->k16, N * Hkv_ * D_, false, "k16");
    pack(&a->v, &a->v16, N * Hkv_ * D_, false, "v16");
    // A non-FP8 o_proj keeps a pointer to its f32 input for its weight gradient.
    pack(&a->att, &a->att16, N * C_, b.prec != v1::PRECISION_FP8, "att16");
  }
  a->h = DevBuf(be_, N * C_ * 4, Keep(b, train, "h"));  // (N, C)
  be_->Add(a->x_in.f32(), o.f32(), a->h.f32(), N * C_);
  o.Reset();
}

// q, k, v from n1 (its FP8 codes in1 with bf16 activations, else a->n1 f32) with RoPE applied
// to q and k: f32 in acts' q, k, v; or bf16, from one GEMM into acts->qkv16 when b.fused_qkv,
// else three into q16, k16, v16.
LlamaModel::Qkv LlamaModel::QkvForward(Block& b, int64_t B, bool train,
                                       const std::shared_ptr<Fp8Input>& in1, BlockActs* a) {
  const int64_t N = B * T_;
  const int64_t nq = H_ * D_, nk = Hkv_ * D_;
  Qkv r;
  if (!b.acts16) {
    a->q = DevBuf(be_, N * nq * 4, Keep(b, train, "q"));  // (B, T, H, D)
    a->k = DevBuf(be_, N * nk * 4, Keep(b, train, "k"));  // (B, T, Hkv, D)
    a->v = DevBuf(be_, N * nk * 4, Keep(b, train, "v"));  // (B, T, Hkv, D)
    b.lq.Forward(a->n1.f32(), N, C_, nq, View(b.q), a->q.f32(), train ? &a->sq : nullptr,
                 Keep(b, train, "q_proj.x8"));
    b.lk.Forward(a->n1.f32(), N, C_, nk, View(b.k), a->k.f32(), train ? &a->sk : nullptr,
                 Keep(b, train, "k_proj.x8"));
    b.lv.Forward(a->n1.f32(), N, C_, nk, View(b.v), a->v.f32(), train ? &a->sv : nullptr,
                 Keep(b, train, "v_proj.x8"));
    // A non-FP8 linear keeps a pointer to its f32 input for its weight gradient.
    if (b.prec == v1::PRECISION_FP8 || !train) a->n1.Reset();
    be_->RopeForward(a->q.f32(), B, T_, H_, D_, theta_);
    be_->RopeForward(a->k.f32(), B, T_, Hkv_, D_, theta_);
    r.q = a->q.f32();
    r.k = a->k.f32();
    r.v = a->v.f32();
    return r;
  }
  if (b.fused_qkv) {  // one GEMM: [q | k | v] (N, nq + 2 nk) = n1 · [Wq ; Wk ; Wv]ᵀ
    r.q_ld = r.kv_ld = nq + 2 * nk;
    a->qkv16 = DevBuf(be_, N * r.q_ld * 2, Keep(b, train, "qkv16"));
    b.lq.ForwardFp8(in1, N, C_, r.q_ld, View(b.q), LinearOutput::Bf16(a->qkv16.u16()),
                    train ? &a->sq : nullptr);
    if (train) a->sk = a->sv = a->sq;
    be_->RopeForward(a->qkv16.u16(), B, T_, H_, D_, theta_, r.q_ld);
    be_->RopeForward(a->qkv16.u16() + nq, B, T_, Hkv_, D_, theta_, r.kv_ld);
    r.q = a->qkv16.u16();
    r.k = a->qkv16.u16() + nq;
    r.v = a->qkv16.u16() + nq + nk;
    return r;
  }
  r.q_ld = nq;
  r.kv_ld = nk;
  a->q16 = DevBuf(be_, N * nq * 2, Keep(b, train, "q16"));  // (B, T, H, D) bf16
  a->k16 = DevBuf(be_, N * nk * 2, Keep(b, train, "k16"));  // (B, T, Hkv, D) bf16
  a->v16 = DevBuf(be_, N * nk * 2, Keep(b, train, "v16"));  // (B, T, Hkv, D) bf16
  b.lq.ForwardFp8(in1, N, C_, nq, View(b.q), LinearOutput::Bf16(a->q16.u16()),
                  train ? &a->sq : nullptr);
  b.lk.ForwardFp8(in1, N, C_, nk, View(b.k), LinearOutput::Bf16(a->k16.u16()),
                  train ? &a->sk : nullptr);
  b.lv.ForwardFp8(in1, N, C_, nk, View(b.v), LinearOutput::Bf16(a->v16.u16()),
                  train ? &a->sv : nullptr);
  be_->RopeForward(a->q16.u16(), B, T_, H_, D_, theta_, nq);
  be_->RopeForward(a->k16.u16(), B, T_, Hkv_, D_, theta_, nk);
  r.q = a->q16.u16();
  r.k = a->k16.u16();
  r.v = a->v16.u16();
  return r;
}

// Returns out (N, C) = h + down(silu(gate(n2)) * up(n2)), n2 = RMSNorm(h). With bf16
// activations n2 is cast straight to FP8 (one cast for gate and up), gate and up are bf16 and
// silu(gate) * up is cast to FP8 in one pass; under delayed scaling the backward recasts down's
// input from the kept gate and up (Linear::RecastSwiglu, the same codes) rather than keeping its
// N * F codes.
DevBuf LlamaModel::MlpForward(Block& b, int64_t B, bool train, BlockActs* a) {
  const int64_t N = B * T_;
  if (!b.acts16) a->n2 = DevBuf(be_, N * C_ * 4, Keep(b, train, "n2"));  // (N, C)
  a->rstd2 = DevBuf(be_, N * 4, Keep(b, train, "rstd2"));                  // (N)
  std::shared_ptr<Fp8Input> in2;
  if (b.acts16) {
    in2 = b.lgate.NormCastInput(a->h.f32(), p_->W(b.post_norm), eps_, N, C_, a->rstd2.f32(),
                                {&b.lup}, Keep(b, train, "gate_up.x8"));
  } else {
    be_->RmsNormForward(a->h.f32(), p_->W(b.post_norm), eps_, N, C_, a->n2.f32(), a->rstd2.f32());
  }
  const GateUp gu = GateUpForward(b, N, train, in2, a);
  in2.reset();
  if (b.acts16) {
    std::shared_ptr<Fp8Input> in_act =
        b.ldown.CastSwiglu(gu.gate.h(), gu.up.h(), N, F_, gu.ld, Keep(b, train, "down_proj.x8"));
    if (!train) {
      a->gate16.Reset();
      a->up16.Reset();
      a->gu16.Reset();
    }
    DevBuf out(be_, N * C_ * 4);  // h + down(act), the residual added in the GEMM
    const bool keep = train && (save_down_input_ || b.ldown.XNeedsAmaxFirst());
    b.ldown.ForwardFp8(in_act, N, F_, C_, View(b.down),
                       LinearOutput::F32PlusResidual(out.f32(), a->h.f32()),
                       keep ? &a->sdown : nullptr);
    return out;
  }
  const bool keep_f32_inputs = b.prec != v1::PRECISION_FP8;
  a->act = DevBuf(be_, N * F_ * 4, Keep(b, train, "act"));  // (N, F)
  be_->SwigluForward(gu.gate, gu.up, 1, N * F_, 0, a->act.f32());
  if (train && !keep_f32_inputs) {
    // FP8 linears keep the SwiGLU inputs in bf16 for the backward: 8 significant bits where the
    // GEMM that made them multiplied 4-bit E4M3 operands; half the memory of f32.
    a->gate16 = DevBuf(be_, N * F_ * 2, Keep(b, train, "gate16"));
    a->up16 = DevBuf(be_, N * F_ * 2, Keep(b, train, "up16"));
    be_->PackBf16(a->gate.f32(), a->gate16.u16(), N * F_);
    be_->PackBf16(a->up.f32(), a->up16.u16(), N * F_);
    a->gate.Reset();
    a->up.Reset();
  }
  DevBuf mlp(be_, N * C_ * 4);  // (N, C)
  b.ldown.Forward(a->act.f32(), N, F_, C_, View(b.down), mlp.f32(), train ? &a->sdown : nullptr,
                  Keep(b, train, "down_proj.x8"));
  if (!keep_f32_inputs || !train) a->act.Reset();
  DevBuf out(be_, N * C_ * 4);  // (N, C)
  be_->Add(a->h.f32(), mlp.f32(), out.f32(), N * C_);
  return out;
}

// gate and up (N, F) from n2 (its FP8 codes in2 with bf16 activations, else a->n2 f32): f32 in
// acts' gate, up; or bf16, from one GEMM into acts->gu16 ([gate | up], row stride 2F) when
// MlpFused, else two into gate16, up16.
LlamaModel::GateUp LlamaModel::GateUpForward(Block& b, int64_t N, bool train,
                                             const std::shared_ptr<Fp8Input>& in2, BlockActs* a) {
  GateUp r;
  if (!b.acts16) {
    a->gate = DevBuf(be_, N * F_ * 4, Keep(b, train, "gate"));  // (N, F)
    a->up = DevBuf(be_, N * F_ * 4, Keep(b, train, "up"));      // (N, F)
    b.lgate.Forward(a->n2.f32(), N, C_, F_, View(b.gate), a->gate.f32(),
                    train ? &a->sgate : nullptr, Keep(b, train, "gate_proj.x8"));
    b.lup.Forward(a->n2.f32(), N, C_, F_, View(b.up), a->up.f32(), train ? &a->sup : nullptr,
                  Keep(b, train, "up_proj.x8"));
    if (b.prec == v1::PRECISION_FP8 || !train) a->n2.Reset();
    r.gate = a->gate.f32();
    r.up = a->up.f32();
    r.ld = F_;
    return r;
  }
  if (MlpFused(b)) {  // one GEMM: [gate | up] (N, 2F) = n2 · [Wgate ; Wup]ᵀ (adjacent weights)
    a->gu16 = DevBuf(be_, N * 2 * F_ * 2, Keep(b, train, "gate_up16"));
    b.lgate.ForwardFp8(in2, N, C_, 2 * F_, View(b.gate), LinearOutput::Bf16(a->gu16.u16()),
                       train ? &a->sgate : nullptr);
    if (train) a->sup = a->sgate;
    r.gate = a->gu16.u16();
    r.up = a->gu16.u16() + F_;
    r.ld = 2 * F_;
    return r;
  }
  a->gate16 = DevBuf(be_, N * F_ * 2, Keep(b, train, "gate16"));  // (N, F) bf16
  a->up16 = DevBuf(be_, N * F_ * 2, Keep(b, train, "up16"));      // (N, F) bf16
  b.lgate.ForwardFp8(in2, N, C_, F_, View(b.gate), LinearOutput::Bf16(a->gate16.u16()),
                     train ? &a->sgate : nullptr);
  b.lup.ForwardFp8(in2, N, C_, F_, View(b.up), LinearOutput::Bf16(a->up16.u16()),
                   train ? &a->sup : nullptr);
  r.gate = a->gate16.u16();
  r.up = a->up16.u16();
  r.ld = F_;
  return r;
}

void LlamaModel::BlockBackward(int l, int64_t B, BlockActs* a, DevBuf* dout) {
  Block& b = blocks_[l];
  DevBuf dh = MlpBackward(l, b, B, a, dout);
  AttentionBackward(b, B, a, dh, dout);
}

// The MLP half, out = h + down(silu(gate) * up): returns dh (N, C) f32 from dout (N, C) f32
// (freed here). dn2 = dgate · Wgate + dup · Wup: f32, accumulated by the second linear; with bf16
// activations one GEMM over K = 2F when gate/up are fused (one bf16 part), else two bf16 parts
// summed in f32 by the norm's backward (no GEMM reads and rewrites an f32 accumulator).
DevBuf LlamaModel::MlpBackward(int l, Block& b, int64_t B, BlockActs* a, DevBuf* dout) {
  const int64_t N = B * T_;
  DevBuf dact(be_, N * F_ * (b.acts16 ? 2 : 4));  // (N, F): the gradient of silu(gate) * up
  if (b.acts16 && a->sdown.in == nullptr) {  // not kept by the forward: recast from gate and up
    const bool fused = !a->gu16.empty();
    a->sdown = b.ldown.RecastSwiglu(fused ? a->gu16.u16() : a->gate16.u16(),
                                    fused ? a->gu16.u16() + F_ : a->up16.u16(), N, F_,
                                    fused ? 2 * F_ : F_);
    ++down_input_recasts_;
  }
  b.ldown.Backward(ActivationView::F32(dout->f32()), N, F_, C_, View(b.down), a->sdown,
                   b.acts16 ? InputGrad::Bf16(dact.u16()) : InputGrad::F32(dact.f32()),
                   p_->G(b.down));
  a->sdown = LinearSaved();
  a->act.Reset();
  DevBuf dh;
  if (!b.acts16) {
    DevBuf dgate(be_, N * F_ * 4), dup(be_, N * F_ * 4);  // (N, F) each
    if (!a->gate16.empty()) {
      be_->SwigluBackward(dact.f32(), a->gate16.u16(), a->up16.u16(), 1, N * F_, 0, dgate.f32(),
                          dup.f32());
    } else {
      be_->SwigluBackward(dact.f32(), a->gate.f32(), a->up.f32(), 1, N * F_, 0, dgate.f32(),
                          dup.f32());
    }
    dact.Reset();
    a->gate.Reset();
    a->up.Reset();
    a->gate16.Reset();
    a->up16.Reset();
    DevBuf dn2(be_, N * C_ * 4);  // (N, C) = dgate · Wgate + dup · Wup
    b.lgate.Backward(ActivationView::F32(dgate.f32()), N, C_, F_, View(b.gate), a->sgate,
                     InputGrad::F32(dn2.f32()), p_->G(b.gate));
    b.lup.Backward(ActivationView::F32(dup.f32()), N, C_, F_, View(b.up), a->sup,
                   InputGrad::AddF32(dn2.f32()), p_->G(b.up));
    dgate.Reset();
    dup.Reset();
    a->sgate = LinearSaved();
    a->sup = LinearSaved();
    a->n2.Reset();
    dh = DevBuf(be_, N * C_ * 4);  // (N, C)
    be_->RmsNormBackward(dn2.f32(), a->h.f32(), p_->W(b.post_norm), a->rstd2.f32(), N, C_, dh.f32(),
                         p_->G(b.post_norm));
    be_->Axpy(1.0f, dout->f32(), dh.f32(), N * C_);
    dn2.Reset();
    dout->Reset();
    return dh;
  }
  DevBuf dn2g(be_, N * C_ * 2), dn2u;  // (N, C) bf16 parts
  // The forward (and a recompute) decided with the same scales: [gate | up] is there exactly
  // when the backward fuses.
  const bool fused = MlpFused(b);
  FSDP8_CHECK(fused == !a->gu16.empty()) << "block " << l << ": gate/up fused in one pass only";
  if (fused) {
    BackwardGateUpFused(b, N, a, &dact, &dn2g);
  } else {
    BackwardGateUpPerLinear(b, N, a, &dact, &dn2g, &dn2u);
  }
  a->sgate = LinearSaved();
  a->sup = LinearSaved();
  dh = DevBuf(be_, N * C_ * 4);  // (N, C)
  DevBuf h32;
  be_->RmsNormBackward(dn2g.u16(), NormInput(a->h, a->h16, N * C_, &h32), p_->W(b.post_norm),
                       a->rstd2.f32(), N, C_, dh.f32(), p_->G(b.post_norm), dout->f32(),
                       dn2u.empty() ? nullptr : dn2u.u16(), nullptr);
  h32.Reset();
  dn2g.Reset();
  dn2u.Reset();
  dout->Reset();
  return dh;
}

void LlamaModel::BackwardGateUpFused(Block& b, int64_t N, BlockActs* a, DevBuf* dact16,
                                     DevBuf* dn2) {
  // [dgate | dup] (N, 2F) codes side by side and [dgateᵀ ; dupᵀ] (2F, N) stacked: the A operands
  // of the fused dX (N, C) = [dgate | dup] · [Wgate ; Wup] and dW (2F, C) = [dgateᵀ ; dupᵀ] · n2.
  DevBuf d8(be_, N * 2 * F_), dT8(be_, N * 2 * F_);
  const uint16_t* gu16 = a->gu16.u16();
  be_->SwigluBackward(dact16->u16(), gu16, gu16 + F_, N, F_, 2 * F_, nullptr, nullptr,
                      b.lgate.DyCast(d8.u8(), dT8.u8(), 2 * F_),
                      b.lup.DyCast(d8.u8() + F_, dT8.u8() + N * F_, 2 * F_));
  dact16->Reset();
  a->gate16.Reset();
  a->up16.Reset();
  a->gu16.Reset();
  b.lgate.BackwardFp8(std::move(d8), std::move(dT8), N, C_, 2 * F_, View(b.gate), a->sgate,
                      InputGrad::Bf16(dn2->u16()), p_->G(b.gate));
  ++fused_backward_runs_;
}

void LlamaModel::BackwardGateUpPerLinear(Block& b, int64_t N, BlockActs* a, DevBuf* dact16,
                                         DevBuf* dn2g, DevBuf* dn2u) {
  *dn2u = DevBuf(be_, N * C_ * 2);
  if (!b.lgate.DyNeedsAmaxFirst() && !b.lup.DyNeedsAmaxFirst() &&
      b.lgate.dy_format() == b.lup.dy_format()) {
    // dgate and dup go straight from the SwiGLU gradient to their FP8 codes and transposes: no
    // bf16 copy of either passes through memory.
    DevBuf dg8(be_, N * F_), dgT8(be_, N * F_), du8(be_, N * F_), duT8(be_, N * F_);
    be_->SwigluBackward(dact16->u16(), a->gate16.u16(), a->up16.u16(), N, F_, F_, nullptr, nullptr,
                        b.lgate.DyCast(dg8.u8(), dgT8.u8(), F_),
                        b.lup.DyCast(du8.u8(), duT8.u8(), F_));
    dact16->Reset();
    a->gate16.Reset();
    a->up16.Reset();
    b.lgate.BackwardFp8(std::move(dg8), std::move(dgT8), N, C_, F_, View(b.gate), a->sgate,
                        InputGrad::Bf16(dn2g->u16()), p_->G(b.gate));
    b.lup.BackwardFp8(std::move(du8), std::move(duT8), N, C_, F_, View(b.up), a->sup,
                      InputGrad::Bf16(dn2u->u16()), p_->G(b.up));
    return;
  }
  // A grad-output scale measured first (first step, CURRENT recipe).
  DevBuf dgate16(be_, N * F_ * 2), dup16(be_, N * F_ * 2);  // (N, F) bf16
  be_->SwigluBackward(dact16->u16(), a->gate16.u16(), a->up16.u16(), 1, N * F_, 0, dgate16.u16(),
                      dup16.u16());
  dact16->Reset();
  a->gate16.Reset();
  a->up16.Reset();
  b.lgate.Backward(ActivationView::Bf16(dgate16.u16()), N, C_, F_, View(b.gate), a->sgate,
                   InputGrad::Bf16(dn2g->u16()), p_->G(b.gate));
  b.lup.Backward(ActivationView::Bf16(dup16.u16()), N, C_, F_, View(b.up), a->sup,
                 InputGrad::Bf16(dn2u->u16()), p_->G(b.up));
}

// The attention half, h = x + o_proj(attn): *dout becomes dx (N, C) f32 from dh (N, C) f32;
// *a is cleared. dn1 = dq · Wq + dk · Wk + dv · Wv: f32, accumulated by the linears; with bf16
// activations one fused GEMM, or three bf16 parts (as dn2 in MlpBackward).
void LlamaModel::AttentionBackward(Block& b, int64_t B, BlockActs* a, const DevBuf& dh,
                                   DevBuf* dout) {
  const int64_t N = B * T_;
  DevBuf dx;  // (N, C)
  if (b.acts16) {
    // (B, T, H, D), (B, T, Hkv, D) x2, bf16
    DevBuf dq16(be_, N * H_ * D_ * 2), dk16(be_, N * Hkv_ * D_ * 2), dv16(be_, N * Hkv_ * D_ * 2);
    OutputAttentionBackward(b, B, a, dh, &dq16, &dk16, &dv16);
    a->q16.Reset();
    a->k16.Reset();
    a->v16.Reset();
    a->qkv16.Reset();
    a->att16.Reset();
    DevBuf dn1q(be_, N * C_ * 2), dn1k, dn1v;  // (N, C) bf16 parts
    if (QkvBackwardFused(b)) {
      BackwardQkvFused(b, B, *a, dq16, dk16, dv16, dn1q);
    } else {
      dn1k = DevBuf(be_, N * C_ * 2);
      dn1v = DevBuf(be_, N * C_ * 2);
      BackwardQkvPerLinear(b, B, *a, dq16, dk16, dv16, dn1q, dn1k, dn1v);
    }
    dq16.Reset();
    dk16.Reset();
    dv16.Reset();
    a->sq = a->sk = a->sv = LinearSaved();
    dx = DevBuf(be_, N * C_ * 4);
    DevBuf x32;
    be_->RmsNormBackward(dn1q.u16(), NormInput(a->x_in, a->x_in16, N * C_, &x32), p_->W(b.in_norm),
                         a->rstd1.f32(), N, C_, dx.f32(), p_->G(b.in_norm), dh.f32(),
                         dn1k.empty() ? nullptr : dn1k.u16(), dn1v.empty() ? nullptr : dn1v.u16());
  } else {
    DevBuf datt(be_, N * C_ * 4);  // (N, C)
    b.lo.Backward(ActivationView::F32(dh.f32()), N, C_, C_, View(b.o), a->so,
                  InputGrad::F32(datt.f32()), p_->G(b.o));
    a->so = LinearSaved();
    // (B, T, H, D), (B, T, Hkv, D) x2
    DevBuf dq(be_, N * H_ * D_ * 4), dk(be_, N * Hkv_ * D_ * 4), dv(be_, N * Hkv_ * D_ * 4);
    // BF16 attention saved its operands as bf16 (exactly the values its backward rounds to).
    auto saved = [&](DevBuf& f32, DevBuf& b16) {
      return Act(attention_bf16_ ? b16 : f32, attention_bf16_);
    };
    be_->AttentionBackward(saved(a->q, a->q16), saved(a->k, a->k16), saved(a->v, a->v16),
                           saved(a->att, a->att16), datt.f32(), a->lse.f32(), B, T_, H_, Hkv_, D_,
                           dq.f32(), dk.f32(), dv.f32(), AttentionOptions{attention_bf16_});
    datt.Reset();
    be_->RopeBackward(dq.f32(), B, T_, H_, D_, theta_);
    be_->RopeBackward(dk.f32(), B, T_, Hkv_, D_, theta_);
    DevBuf dn1(be_, N * C_ * 4);  // (N, C) = dq · Wq + dk · Wk + dv · Wv
    b.lq.Backward(ActivationView::F32(dq.f32()), N, C_, H_ * D_, View(b.q), a->sq,
                  InputGrad::F32(dn1.f32()), p_->G(b.q));
    b.lk.Backward(ActivationView::F32(dk.f32()), N, C_, Hkv_ * D_, View(b.k), a->sk,
                  InputGrad::AddF32(dn1.f32()), p_->G(b.k));
    b.lv.Backward(ActivationView::F32(dv.f32()), N, C_, Hkv_ * D_, View(b.v), a->sv,
                  InputGrad::AddF32(dn1.f32()), p_->G(b.v));
    a->sq = a->sk = a->sv = LinearSaved();  // frees their FP8 input and its transpose
    dq.Reset();
    dk.Reset();
    dv.Reset();
    dx = DevBuf(be_, N * C_ * 4);
    be_->RmsNormBackward(dn1.f32(), a->x_in.f32(), p_->W(b.in_norm), a->rstd1.f32(), N, C_,
                         dx.f32(), p_->G(b.in_norm));
    be_->Axpy(1.0f, dh.f32(), dx.f32(), N * C_);
  }
  *a = BlockActs();
  *dout = std::move(dx);
}

void LlamaModel::OutputAttentionBackward(Block& b, int64_t B, BlockActs* a, const DevBuf& dh,
                                         DevBuf* dq16, DevBuf* dk16, DevBuf* dv16) {
  const int64_t N = B * T_;
  DevBuf datt16(be_, N * C_ * 2);  // (N, C) bf16
  b.lo.Backward(ActivationView::F32(dh.f32()), N, C_, C_, View(b.o), a->so,
                InputGrad::Bf16(datt16.u16()), p_->G(b.o));
  a->so = LinearSaved();
  const int64_t nq = H_ * D_, nk = Hkv_ * D_;
  const bool fused = !a->qkv16.empty();  // [q | k | v] from the fused forward GEMM
  const uint16_t* q = fused ? a->qkv16.u16() : a->q16.u16();
  const uint16_t* k = fused ? q + nq : a->k16.u16();
  const uint16_t* v = fused ? q + nq + nk : a->v16.u16();
  const AttentionOptions opts{true, fused ? nq + 2 * nk : nq, fused ? nq + 2 * nk : nk};
  be_->AttentionBackward(q, k, v, a->att16.u16(), datt16.u16(), a->lse.f32(), B, T_, H_, Hkv_, D_,
                         dq16->u16(), dk16->u16(), dv16->u16(), opts);
}

void LlamaModel::BackwardQkvFused(Block& b, int64_t B, BlockActs& a, DevBuf& dq16, DevBuf& dk16,
                                  DevBuf& dv16, DevBuf& dn1) {
  // [dq | dk | dv] (N, nt) codes side by side (RoPE's backward in the q and k casts) and their
  // transposes stacked (nt, N): one dX GEMM over K = nt and one dW GEMM of (nt, C).
  const int64_t N = B * T_;
  const int64_t nq = H_ * D_, nk = Hkv_ * D_, nt = nq + 2 * nk;
  DevBuf d8(be_, N * nt), dT8(be_, N * nt);
  // One format for the group (QkvBackwardFused): k's and v's casts take q's.
  Fp8Cast kc = b.lk.DyCast(d8.u8() + nq, dT8.u8() + N * nq, nt);
  Fp8Cast vc = b.lv.DyCast(d8.u8() + nq + nk, dT8.u8() + N * (nq + nk), nt);
  kc.fmt = vc.fmt = b.lq.dy_format();
  be_->RopeBackward(dq16.u16(), B, T_, H_, D_, theta_, b.lq.DyCast(d8.u8(), dT8.u8(), nt));
  be_->RopeBackward(dk16.u16(), B, T_, Hkv_, D_, theta_, kc);
  be_->CastFp8(dv16.u16(), N, nk, vc.scale, vc.fmt, vc.out, vc.out_t, vc.amax, nt);
  dq16.Reset();  // before the GEMMs: off the backward's peak
  dk16.Reset();
  dv16.Reset();
  b.lq.BackwardFp8(std::move(d8), std::move(dT8), N, C_, nt, View(b.q), a.sq,
                   InputGrad::Bf16(dn1.u16()), p_->G(b.q));
  ++fused_backward_runs_;
}

void LlamaModel::BackwardQkvPerLinear(Block& b, int64_t B, BlockActs& a, DevBuf& dq16,
                                      DevBuf& dk16, DevBuf& dv16, DevBuf& dn1q, DevBuf& dn1k,
                                      DevBuf& dn1v) {
  const int64_t N = B * T_;
  // q and k: RoPE's backward and the grad-output cast in one pass where the scale is known.
  auto rope_backward = [&](Linear& lin, DevBuf& d16, int64_t heads, const LinearSaved& saved,
                           const TensorRef& w, DevBuf& dn) {
    const int64_t n = N * heads * D_;
    if (lin.DyNeedsAmaxFirst()) {
      be_->RopeBackward(d16.u16(), B, T_, heads, D_, theta_);
      lin.Backward(ActivationView::Bf16(d16.u16()), N, C_, heads * D_, View(w), saved,
                   InputGrad::Bf16(dn.u16()), p_->G(w));
      return;
    }
    DevBuf d8(be_, n), dT8(be_, n);
    be_->RopeBackward(d16.u16(), B, T_, heads, D_, theta_,
                      lin.DyCast(d8.u8(), dT8.u8(), heads * D_));
    d16.Reset();
    lin.BackwardFp8(std::move(d8), std::move(dT8), N, C_, heads * D_, View(w), saved,
                    InputGrad::Bf16(dn.u16()), p_->G(w));
  };
  rope_backward(b.lq, dq16, H_, a.sq, b.q, dn1q);
  rope_backward(b.lk, dk16, Hkv_, a.sk, b.k, dn1k);
  b.lv.Backward(ActivationView::Bf16(dv16.u16()), N, C_, Hkv_ * D_, View(b.v), a.sv,
                InputGrad::Bf16(dn1v.u16()), p_->G(b.v));
}

void LlamaModel::HeadBf16Compute(const float* nf, const int32_t* targets, int64_t N,
                                 float grad_scale, float* losses, float* dnf) {
  // Rows per chunk: at most head_chunk_bytes_ of f32 logits (by default 512 MiB: 4096 rows at
  // vocab 32768, 1024 at 128256), a multiple of 128 rows where the chunk holds more (GEMM tiles).
  const int64_t rows = HeadChunkRows(N, V_, head_chunk_bytes_);
  // W (V, C) and nf (N, C) in bf16 once: the GEMMs read the operands the BF16 head rounds to.
  DevBuf w16_packed;
  const uint16_t* w16 = HeadWeightBf16(&w16_packed);
  DevBuf nf16(be_, N * C_ * 2, MemoryLabel::kLogits);
  be_->PackBf16(nf, nf16.u16(), N * C_);
  if (dnf == nullptr) {  // evaluation: the losses only
    for (int64_t r0 = 0; r0 < N; r0 += rows) {
      const int64_t n = std::min(rows, N - r0);
      DevBuf logits(be_, n * V_ * 4, MemoryLabel::kLogits);
      be_->Gemm(false, true, n, V_, C_, nf16.u16() + r0 * C_, w16, logits.f32(), false,
                GemmInputs::kBF16);
      be_->CrossEntropyForwardBackward(logits.f32(), targets + r0, n, V_, 0.0f, losses + r0);
    }
    return;
  }
  // The bf16 cross-entropy gradient g (N, V) of every row is kept, so the weight gradient is one
  // GEMM over all N rows: a GEMM per chunk would read and write the f32 dW (V, C) once per chunk.
  DevBuf g16(be_, N * V_ * 2, MemoryLabel::kLogits);
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t n = std::min(rows, N - r0);
    uint16_t* g = g16.u16() + r0 * V_;
    DevBuf logits(be_, n * V_ * 4, MemoryLabel::kLogits);
    be_->Gemm(false, true, n, V_, C_, nf16.u16() + r0 * C_, w16, logits.f32(), false,
              GemmInputs::kBF16);
    be_->CrossEntropyForwardBackward(logits.f32(), targets + r0, n, V_, grad_scale, losses + r0, g);
    logits.Reset();
    be_->Gemm(false, false, n, C_, V_, g, w16, dnf + r0 * C_, false,
              GemmInputs::kBF16);  // dnf (n, C)
  }
  // dW (V, C) = gᵀ · nf, written whole (BeginHeadGrads left it unzeroed); tied: += into the
  // embedding's gradient, which its own backward adds to later.
  be_->Gemm(true, false, V_, C_, N, g16.u16(), nf16.u16(), p_->G(head_), tied_, GemmInputs::kBF16);
}

const uint16_t* LlamaModel::HeadWeightBf16(DevBuf* packed) {
  // A bf16 wire carries exactly the bf16 rounding of the master weights (PackBf16): the gathered
  // codes are the operand. Another wire (an FP32 embedding tied to a BF16 head) is packed here.
  if (head_.wire == WireDtype::kBf16) return p_->W16(head_);
  *packed = DevBuf(be_, V_ * C_ * 2);
  be_->PackBf16(p_->W(head_), packed->u16(), V_ * C_);
  return packed->u16();
}

absl::Status LlamaModel::GatherHead() {
  if (tied_) {
    if (absl::Status s = p_->Gather(embedding_unit_); !s.ok()) return s;
  }
  return p_->Gather(head_unit_);
}

void LlamaModel::ReleaseHead() {
  p_->Release(head_unit_);
  if (tied_) p_->Release(embedding_unit_);
}

void LlamaModel::BeginHeadGrads() {
  // An untied BF16 head's weight gradient is written whole by one GEMM (HeadBf16Compute).
  const bool whole = !tied_ && lhead_.precision() == v1::PRECISION_BF16;
  p_->BeginGrads(head_unit_, whole ? &head_ : nullptr);
  if (tied_) p_->BeginGrads(embedding_unit_);
}

absl::Status LlamaModel::PrefetchFirstUnits() {
  if (absl::Status s = p_->Prefetch(embedding_unit_); !s.ok()) return s;
  return blocks_.empty() ? p_->Prefetch(head_unit_) : p_->Prefetch(blocks_[0].q.unit);
}

int LlamaModel::BlockUnit(int l) const {
  return l < static_cast<int>(blocks_.size()) ? blocks_[l].q.unit : head_unit_;
}

absl::Status LlamaModel::Run(const int32_t* tokens, const int32_t* targets, int64_t B,
                             float grad_scale, float* losses, bool backward) {
  const int64_t N = B * T_;
  const int L = static_cast<int>(blocks_.size());
  // The step's transients are workspaces; what the plan names otherwise is labelled where it is
  // allocated (saved activations, logits; FsdpParams' buffers).
  const MemoryLabelScope work(&be_->account(), MemoryLabel::kWork);
  DevBuf x;  // (N, C) f32: the residual stream
  std::vector<BlockActs> acts(backward ? L : 0);
  if (absl::Status s = ForwardBlocks(tokens, B, backward, &x, &acts); !s.ok()) return s;
  // Head: final norm, lm_head, fused cross-entropy (+ its backward).
  const AllocationLabel label("the head (final norm, lm_head, loss)");
  if (absl::Status s = GatherHead(); !s.ok()) return s;
  if (backward && L > 0) {
    if (absl::Status s = p_->Prefetch(BlockUnit(L - 1)); !s.ok()) return s;
  }
  DevBuf nf(be_, N * C_ * 4), rstdf(be_, N * 4);  // (N, C), (N)
  be_->RmsNormForward(x.f32(), p_->W(final_norm_), eps_, N, C_, nf.f32(), rstdf.f32());
  DevBuf dnf;  // (N, C) f32
  if (lhead_.precision() == v1::PRECISION_BF16) {
    if (!backward) {
      HeadBf16Compute(nf.f32(), targets, N, 0.0f, losses, nullptr);
      ReleaseHead();
      return absl::OkStatus();
    }
    // Forward and backward of the head interleave (row chunks): the forward phase's peak is
    // taken after both.
    BeginHeadGrads();
    dnf = DevBuf(be_, N * C_ * 4);
    HeadBf16Compute(nf.f32(), targets, N, grad_scale, losses, dnf.f32());
    TakePeak(&forward_peak_, &forward_peak_labels_);
    be_->ResetPeak();
  } else {
    DevBuf logits(be_, N * V_ * 4, MemoryLabel::kLogits);  // (N, V)
    LinearSaved sh;
    lhead_.Forward(nf.f32(), N, C_, V_, View(head_), logits.f32(), backward ? &sh : nullptr);
    be_->CrossEntropyForwardBackward(logits.f32(), targets, N, V_, backward ? grad_scale : 0.0f,
                                     losses);
    if (!backward) {
      ReleaseHead();
      return absl::OkStatus();
    }
    TakePeak(&forward_peak_, &forward_peak_labels_);
    be_->ResetPeak();
    BeginHeadGrads();
    dnf = DevBuf(be_, N * C_ * 4);
    lhead_.Backward(ActivationView::F32(logits.f32()), N, C_, V_, View(head_), sh,
                    InputGrad::F32(dnf.f32()), p_->G(head_));
  }
  DevBuf dx(be_, N * C_ * 4);  // (N, C)
  be_->RmsNormBackward(dnf.f32(), x.f32(), p_->W(final_norm_), rstdf.f32(), N, C_, dx.f32(),
                       p_->G(final_norm_));
  nf.Reset();
  x.Reset();
  ReleaseHead();
  // Tied: the embedding's gradient is reduced after the embedding's own backward adds to it.
  if (absl::Status s = p_->ReduceGrads(head_unit_); !s.ok()) return s;
  return BackwardBlocks(tokens, B, &acts, &dx);
}

absl::Status LlamaModel::Logits(const int32_t* tokens, int64_t B, float* logits) {
  const int64_t N = B * T_;
  const MemoryLabelScope work(&be_->account(), MemoryLabel::kWork);
  DevBuf x;
  std::vector<BlockActs> none;
  if (absl::Status s = ForwardBlocks(tokens, B, false, &x, &none); !s.ok()) return s;
  if (absl::Status s = GatherHead(); !s.ok()) return s;
  DevBuf nf(be_, N * C_ * 4), rstdf(be_, N * 4);
  be_->RmsNormForward(x.f32(), p_->W(final_norm_), eps_, N, C_, nf.f32(), rstdf.f32());
  if (lhead_.precision() == v1::PRECISION_BF16) {
    DevBuf w16_packed, nf16(be_, N * C_ * 2);
    const uint16_t* w16 = HeadWeightBf16(&w16_packed);
    be_->PackBf16(nf.f32(), nf16.u16(), N * C_);
    be_->Gemm(false, true, N, V_, C_, nf16.u16(), w16, logits, false, GemmInputs::kBF16);
  } else {
    lhead_.Forward(nf.f32(), N, C_, V_, View(head_), logits, nullptr);
  }
  ReleaseHead();
  return absl::OkStatus();
}

absl::Status LlamaModel::ForwardBlocks(const int32_t* tokens, int64_t B, bool backward, DevBuf* x,
                                       std::vector<BlockActs>* acts) {
  const int64_t N = B * T_;
  const int L = static_cast<int>(blocks_.size());
  // Embedding.
  if (absl::Status s = p_->Gather(embedding_unit_); !s.ok()) return s;
  // The next unit's all-gather runs while this one computes (prefetch one unit ahead; two ahead
  // measured slower at 1b).
  if (absl::Status s = p_->Prefetch(BlockUnit(0)); !s.ok()) return s;
  *x = DevBuf(be_, N * C_ * 4);
  be_->EmbeddingForward(tokens, N, p_->W(embed_), C_, x->f32());
  p_->Release(embedding_unit_);
  // Blocks.
  const bool recompute = backward && recompute_;
  for (int l = 0; l < L; ++l) {
    const AllocationLabel label("the forward of block", l);
    const int unit = BlockUnit(l);
    if (absl::Status s = p_->Gather(unit); !s.ok()) return s;
    if (absl::Status s = p_->Prefetch(BlockUnit(l + 1)); !s.ok()) return s;
    BlockActs* a = backward ? &(*acts)[l] : nullptr;
    if (recompute) {  // keep only the block input
      a->x_in = DevBuf(be_, N * C_ * 4, MemoryLabel::kSaved);
      be_->Copy(a->x_in.get(), x->get(), N * C_ * 4);
    }
    absl::Status s = BlockForward(l, B, x, recompute ? nullptr : a);
    p_->Release(unit);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status LlamaModel::BackwardBlocks(const int32_t* tokens, int64_t B,
                                        std::vector<BlockActs>* acts, DevBuf* dx) {
  const int64_t N = B * T_;
  // Blocks in reverse: re-gather (prefetched one block ahead), gradients, reduce-scatter (in
  // flight while the next block computes), free.
  for (int l = static_cast<int>(blocks_.size()) - 1; l >= 0; --l) {
    const AllocationLabel label("the backward of block", l);
    BlockActs& a = (*acts)[l];
    const int unit = BlockUnit(l);
    if (absl::Status s = p_->Gather(unit); !s.ok()) return s;
    if (l > 0) {
      if (absl::Status s = p_->Prefetch(BlockUnit(l - 1)); !s.ok()) return s;
    }
    if (recompute_) {
      // The same weights and FP8 scales as the forward: the activations come out bit-identical
      // (re-recording their amax changes no maximum).
      DevBuf xin = std::move(a.x_in);
      xin.Relabel(MemoryLabel::kWork);  // the recomputed block's input
      if (absl::Status s = BlockForward(l, B, &xin, &a); !s.ok()) return s;
    }
    p_->BeginGrads(unit);
    BlockBackward(l, B, &a, dx);
    p_->Release(unit);
    if (absl::Status s = p_->ReduceGrads(unit); !s.ok()) return s;
  }
  // Embedding backward needs only the tokens. Tied: its gradient buffer holds the head's part
  // since the head's backward (BeginHeadGrads), and both are reduced once here.
  if (!tied_) p_->BeginGrads(embedding_unit_);
  be_->EmbeddingBackward(tokens, N, dx->f32(), C_, p_->G(embed_));
  if (absl::Status s = p_->ReduceGrads(embedding_unit_); !s.ok()) return s;
  p_->FlushGrads();
  TakePeak(&backward_peak_, &backward_peak_labels_);
  be_->ResetPeak();
  return absl::OkStatus();
}

}  // namespace fsdp8
