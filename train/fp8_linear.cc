#include "train/fp8_linear.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "common/check.h"
#include "absl/strings/str_cat.h"

namespace fsdp8 {

ActScaling::ActScaling(Backend* be, const v1::Fp8Recipe& recipe, bool forward_fast_accumulation)
    : be_(be), recipe_(recipe), forward_fast_accumulation_(forward_fast_accumulation) {}

int ActScaling::Add(const std::string& name, bool e5m2) {
  FSDP8_CHECK(scale_.empty()) << "ActScaling::Add after Finalize";
  ScalingState s;
  s.name = name;
  s.e5m2 = e5m2;
  states_.push_back(s);
  return static_cast<int>(states_.size()) - 1;
}

void ActScaling::Finalize() {
  const size_t n = std::max<size_t>(states_.size(), 1);
  const MemoryLabelScope label(&be_->account(), MemoryLabel::kScaling);
  scale_ = DevBuf(be_, n * kScaleStride * sizeof(float));
  scale_inv_ = DevBuf(be_, n * kScaleStride * sizeof(float));
  amax_ = DevBuf::Zeros(be_, n * sizeof(float));  // contiguous: one fused all-reduce
  tmp_amax_ = DevBuf::Zeros(be_, sizeof(float));
  const std::vector<float> ones(n, 1.0f);
  UploadScaleSlots(be_, scale_.f32(), ones);
  UploadScaleSlots(be_, scale_inv_.f32(), ones);
}

absl::Status ActScaling::Restore(const std::vector<ScalingState>& states) {
  FSDP8_CHECK(!scale_.empty()) << "ActScaling::Restore before Finalize";
  if (states.size() != states_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "activation scaling: ", states.size(), " tensors in the checkpoint, ", states_.size(),
        " in this model"));
  }
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i].name != states_[i].name || states[i].e5m2 != states_[i].e5m2) {
      return absl::FailedPreconditionError(absl::StrCat(
          "activation scaling tensor ", i, ": checkpoint has ", states[i].name,
          states[i].e5m2 ? " (E5M2)" : " (E4M3)", ", this model ", states_[i].name,
          states_[i].e5m2 ? " (E5M2)" : " (E4M3)"));
    }
  }
  states_ = states;
  if (states_.empty()) return absl::OkStatus();
  std::vector<float> scale(states_.size()), scale_inv(states_.size());
  for (size_t i = 0; i < states_.size(); ++i) {
    scale[i] = states_[i].scale;
    scale_inv[i] = states_[i].scale_inv;
  }
  UploadScaleSlots(be_, scale_.f32(), scale);
  UploadScaleSlots(be_, scale_inv_.f32(), scale_inv);
  return absl::OkStatus();
}

void ActScaling::BeginStep() {
  be_->Memset(amax_.get(), 0, std::max<size_t>(states_.size(), 1) * sizeof(float));
}

const float* ActScaling::ScaleFor(int i, const float* x, int64_t n) {
  ScalingState& s = states_[i];
  const bool current = recipe_.recipe() == v1::SCALING_RECIPE_CURRENT || !s.initialised;
  if (current) {
    be_->Memset(tmp_amax_.get(), 0, sizeof(float));
    be_->AmaxAccumulate(x, n, tmp_amax_.f32());
    float amax = 0;
    be_->CopyToHost(&amax, tmp_amax_.get(), sizeof(float));
    // Keeps the tensor's delayed scale untouched: only the device slot used by this cast changes.
    const float sc = ComputeScale(amax, Fp8MaxValue(s.e5m2), recipe_.margin(), s.scale);
    const float inv = 1.0f / sc;
    be_->CopyToDevice(scale_.f32() + i * kScaleStride, &sc, sizeof(float));
    be_->CopyToDevice(scale_inv_.f32() + i * kScaleStride, &inv, sizeof(float));
  }
  return scale_.f32() + i * kScaleStride;
}

absl::Status ActScaling::ReduceAmax(Communicator* comm, CommClock* clock) {
  const size_t n = states_.size();
  if (n == 0) return absl::OkStatus();
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = comm->AllReduce(amax_.f32(), n, ReduceOp::kMax);
  clock->seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("activation amax all-reduce: ", s.message()));
  }
  return absl::OkStatus();
}

void ActScaling::UpdateScales() {
  const size_t n = states_.size();
  if (n == 0) return;
  std::vector<float> amax(n), scale(n), scale_inv(n);
  be_->CopyToHost(amax.data(), amax_.get(), n * sizeof(float));
  for (const auto& [to, from] : amax_from_) amax[to] = amax[from];
  for (const std::vector<int>& g : groups_) {
    float m = amax[g.front()];
    for (int i : g) {
      if (std::isnan(amax[i]) || amax[i] > m) m = amax[i];
      if (std::isnan(m)) break;
    }
    for (int i : g) amax[i] = m;
  }
  for (size_t i = 0; i < n; ++i) {
    UpdateDelayed(&states_[i], amax[i], recipe_.amax_history_len(), recipe_.amax_algorithm(),
                  recipe_.margin());
    scale[i] = states_[i].scale;
    scale_inv[i] = states_[i].scale_inv;
  }
  UploadScaleSlots(be_, scale_.f32(), scale);
  UploadScaleSlots(be_, scale_inv_.f32(), scale_inv);
}

void ActScaling::ShareAmax(int from, int to) {
  if (from != to) amax_from_[to] = from;
}

void ActScaling::GroupAmax(const std::vector<int>& members) {
  FSDP8_CHECK(scale_.empty()) << "ActScaling::GroupAmax after Finalize";
  FSDP8_CHECK(members.size() >= 2) << "a scaling group needs two or more tensors";
  for (int i : members) {
    FSDP8_CHECK(i >= 0 && static_cast<size_t>(i) < states_.size()) << "scaling group index " << i;
    for (const auto& g : groups_) {
      FSDP8_CHECK(std::find(g.begin(), g.end(), i) == g.end())
          << states_[i].name << " is already in a scaling group";
    }
  }
  groups_.push_back(members);
}

Linear Linear::Scaled(Backend* be, v1::Fp8Granularity granularity, Fp8Format dy_format) {
  FSDP8_CHECK(granularity == v1::FP8_GRANULARITY_ROWWISE ||
              granularity == v1::FP8_GRANULARITY_BLOCKWISE);
  Linear l(be, nullptr, v1::PRECISION_FP8, -1, -1);
  l.gran_ = granularity;
  l.dy_fmt_ = dy_format;
  return l;
}

namespace {

// A block-scaled FP8 matrix of `rows` x `cols` codes and its scales, as work memory.
struct ScaledCodes {
  DevBuf codes, scale_inv;
  Fp8Blocks blocks;
  ScaledCodes(Backend* be, int64_t rows, int64_t cols, Fp8Blocks b)
      : codes(be, static_cast<size_t>(rows * cols)),
        scale_inv(be, static_cast<size_t>(Fp8ScaleCount(b, rows, cols)) * sizeof(float)),
        blocks(b) {}
  Fp8BlockOperand Operand(Fp8Format fmt) const {
    return {codes.u8(), fmt, scale_inv.f32(), blocks};
  }
};

}  // namespace

namespace {

// Whether a scaled linear's weight comes as blockwise FP8 wire codes (else f32 values).
bool BlockCodes(const WeightView& w) { return w.fp8 != nullptr && w.block_scale_inv != nullptr; }

}  // namespace

void Linear::ForwardScaled(const float* x, int64_t M, int64_t K, int64_t N, const WeightView& w,
                           float* y) {
  const bool row = gran_ == v1::FP8_GRANULARITY_ROWWISE;
  ScaledCodes x8(be_, M, K, row ? Fp8Blocks::kRow : Fp8Blocks::kTile128);
  be_->QuantizeFp8Blocks(x, M, K, x8.blocks, Fp8Format::kE4M3, x8.codes.u8(), x8.scale_inv.f32());
  if (BlockCodes(w)) {  // the gathered codes and block scales are the operand
    be_->GemmFp8Blocks(M, N, K, x8.Operand(Fp8Format::kE4M3),
                       {w.fp8, Fp8Format::kE4M3, w.block_scale_inv, Fp8Blocks::kBlock128}, y,
                       false);
    return;
  }
  ScaledCodes w8(be_, N, K, row ? Fp8Blocks::kRow : Fp8Blocks::kBlock128);
  be_->QuantizeFp8Blocks(w.f32, N, K, w8.blocks, Fp8Format::kE4M3, w8.codes.u8(),
                         w8.scale_inv.f32());
  be_->GemmFp8Blocks(M, N, K, x8.Operand(Fp8Format::kE4M3), w8.Operand(Fp8Format::kE4M3), y,
                     false);
}

void Linear::BackwardScaled(const float* dy, int64_t M, int64_t K, int64_t N, const WeightView& w,
                            const float* x, InputGrad dx, float* dw) {
  const bool row = gran_ == v1::FP8_GRANULARITY_ROWWISE;
  const Fp8Blocks act = row ? Fp8Blocks::kRow : Fp8Blocks::kTile128;
  // dY (M, N) for dX (contracting N) and dYᵀ (N, M) for dW (contracting the tokens), one call.
  ScaledCodes dy8(be_, M, N, act), dyT8(be_, N, M, act);
  be_->QuantizeFp8Blocks(dy, M, N, act, dy_fmt_, dy8.codes.u8(), dy8.scale_inv.f32(),
                         dyT8.codes.u8(), dyT8.scale_inv.f32());
  if (dx.f32 != nullptr) {
    // Wᵀ (K, N): rowwise W requantized per column; blockwise W's codes, block scales transposed.
    ScaledCodes wT8(be_, K, N, row ? Fp8Blocks::kRow : Fp8Blocks::kBlock128);
    if (BlockCodes(w)) {  // the gathered codes transposed, their block scales too: exact
      be_->TransposeFp8Block128(w.fp8, w.block_scale_inv, N, K, wT8.codes.u8(),
                                wT8.scale_inv.f32());
    } else {
      be_->QuantizeFp8Blocks(w.f32, N, K, wT8.blocks, Fp8Format::kE4M3, nullptr, nullptr,
                             wT8.codes.u8(), wT8.scale_inv.f32());
    }
    be_->GemmFp8Blocks(M, K, N, dy8.Operand(dy_fmt_), wT8.Operand(Fp8Format::kE4M3), dx.f32,
                       dx.accumulate);
  }
  dy8.codes.Reset();  // freed before dW's operands are made
  dy8.scale_inv.Reset();
  ScaledCodes xT8(be_, K, M, act);
  be_->QuantizeFp8Blocks(x, M, K, act, Fp8Format::kE4M3, nullptr, nullptr, xT8.codes.u8(),
                         xT8.scale_inv.f32());
  be_->GemmFp8Blocks(N, K, M, dyT8.Operand(dy_fmt_), xT8.Operand(Fp8Format::kE4M3), dw, true);
}

void Linear::Forward(const float* x, int64_t M, int64_t K, int64_t N, const WeightView& w,
                     float* y, LinearSaved* saved, MemoryLabel codes) {
  if (scaled()) {
    FSDP8_CHECK(w.f32 != nullptr || (BlockCodes(w) && gran_ == v1::FP8_GRANULARITY_BLOCKWISE))
        << "a rowwise / blockwise linear reads f32 weights or, blockwise, block-scaled codes";
    ForwardScaled(x, M, K, N, w, y);
    if (saved) saved->x = x;
    return;
  }
  if (prec_ != v1::PRECISION_FP8) {
    be_->Gemm(false, true, M, N, K, x, w.f32, y, false,
              prec_ == v1::PRECISION_BF16 ? GemmInputs::kBF16 : GemmInputs::kF32);
    if (saved) saved->x = x;
    return;
  }
  ForwardFp8(CastInput(ActivationView::F32(x), M, K, {}, codes), M, K, N, w, LinearOutput::F32(y),
             saved);
}

std::shared_ptr<Fp8Input> Linear::Cast(std::shared_ptr<Fp8Input> in, MemoryLabel codes,
                                       std::initializer_list<const Linear*> same_input) {
  // Under delayed scaling the tensor's scale_inv slot holds still until UpdateScales, after every
  // backward of the step; a cast that measured its own amax first (NeedsAmaxFirst) rewrites the
  // slot at each cast, so its value is kept.
  if (sc_->NeedsAmaxFirst(x_idx_)) {
    in->scale_inv_copy = DevBuf(be_, sizeof(float), codes);
    be_->Copy(in->scale_inv_copy.get(), sc_->ScaleInv(x_idx_), sizeof(float));
    in->scale_inv = in->scale_inv_copy.f32();
  } else {
    in->scale_inv = sc_->ScaleInv(x_idx_);
  }
  for (const Linear* o : same_input) {
    FSDP8_CHECK(o->prec_ == v1::PRECISION_FP8 && o->sc_ == sc_);
    sc_->ShareAmax(x_idx_, o->x_idx_);
  }
  return in;
}

std::shared_ptr<Fp8Input> Linear::CastInput(ActivationView x, int64_t M, int64_t K,
                                            std::initializer_list<const Linear*> same_input,
                                            MemoryLabel codes) {
  FSDP8_CHECK(prec_ == v1::PRECISION_FP8) << "CastInput of a non-FP8 linear";
  FSDP8_CHECK(x.valid()) << "CastInput takes exactly one input";
  auto in = std::make_shared<Fp8Input>();
  in->x8 = DevBuf(be_, M * K, codes);
  if (x.is_bf16() && sc_->NeedsAmaxFirst(x_idx_)) {
    // Measuring the amax first (first step, CURRENT recipe) goes through f32.
    DevBuf x32(be_, M * K * sizeof(float));
    be_->UnpackBf16(x.bf16, x32.f32(), M * K);
    const float* scale = sc_->ScaleFor(x_idx_, x32.f32(), M * K);
    be_->CastFp8(x32.f32(), 1, M * K, scale, Fp8Format::kE4M3, in->x8.u8(), nullptr,
                 sc_->AmaxOut(x_idx_));
  } else if (x.is_bf16()) {
    be_->CastFp8(x.bf16, 1, M * K, sc_->Scale(x_idx_), Fp8Format::kE4M3, in->x8.u8(), nullptr,
                 sc_->AmaxOut(x_idx_));
  } else {
    const float* scale = sc_->ScaleFor(x_idx_, x.f32, M * K);
    be_->CastFp8(x.f32, 1, M * K, scale, Fp8Format::kE4M3, in->x8.u8(), nullptr,
                 sc_->AmaxOut(x_idx_));
  }
  return Cast(std::move(in), codes, same_input);
}

std::shared_ptr<Fp8Input> Linear::NormCastInput(const float* x, const float* w_norm, float eps,
                                                int64_t M, int64_t K, float* rstd,
                                                std::initializer_list<const Linear*> same_input,
                                                MemoryLabel codes) {
  FSDP8_CHECK(prec_ == v1::PRECISION_FP8) << "NormCastInput of a non-FP8 linear";
  if (sc_->NeedsAmaxFirst(x_idx_)) {
    DevBuf n(be_, M * K * sizeof(float));
    be_->RmsNormForward(x, w_norm, eps, M, K, n.f32(), rstd);
    return CastInput(ActivationView::F32(n.f32()), M, K, same_input, codes);
  }
  auto in = std::make_shared<Fp8Input>();
  in->x8 = DevBuf(be_, M * K, codes);
  be_->RmsNormForward(
      x, w_norm, eps, M, K, nullptr, rstd,
      Fp8Cast{sc_->Scale(x_idx_), Fp8Format::kE4M3, in->x8.u8(), nullptr, sc_->AmaxOut(x_idx_)});
  return Cast(std::move(in), codes, same_input);
}

std::shared_ptr<Fp8Input> Linear::CastSwiglu(const uint16_t* gate16, const uint16_t* up16,
                                             int64_t M, int64_t K, int64_t ld,
                                             MemoryLabel codes) {
  FSDP8_CHECK(prec_ == v1::PRECISION_FP8) << "CastSwiglu of a non-FP8 linear";
  const int64_t n = M * K;
  if (sc_->NeedsAmaxFirst(x_idx_)) {
    FSDP8_CHECK(ld == K) << "CastSwiglu: a strided gate/up needs the scale known (delayed)";
    DevBuf g(be_, n * sizeof(float)), u(be_, n * sizeof(float)), h(be_, n * sizeof(float));
    be_->UnpackBf16(gate16, g.f32(), n);
    be_->UnpackBf16(up16, u.f32(), n);
    be_->SwigluForward(g.f32(), u.f32(), 1, n, 0, h.f32());
    return CastInput(ActivationView::F32(h.f32()), M, K, {}, codes);
  }
  auto in = std::make_shared<Fp8Input>();
  in->x8 = DevBuf(be_, n, codes);
  be_->SwigluForward(
      gate16, up16, M, K, ld, nullptr,
      Fp8Cast{sc_->Scale(x_idx_), Fp8Format::kE4M3, in->x8.u8(), nullptr, sc_->AmaxOut(x_idx_)});
  return Cast(std::move(in), codes, {});
}

LinearSaved Linear::RecastSwiglu(const uint16_t* gate16, const uint16_t* up16, int64_t M,
                                 int64_t K, int64_t ld) const {
  FSDP8_CHECK(prec_ == v1::PRECISION_FP8 && !sc_->NeedsAmaxFirst(x_idx_))
      << "RecastSwiglu needs an FP8 linear whose input scale is known (delayed scaling)";
  auto in = std::make_shared<Fp8Input>();
  in->xT = DevBuf(be_, M * K);
  be_->SwigluForward(gate16, up16, M, K, ld, nullptr,
                     Fp8Cast{sc_->Scale(x_idx_), Fp8Format::kE4M3, nullptr, in->xT.u8(), nullptr});
  in->scale_inv = sc_->ScaleInv(x_idx_);
  LinearSaved s;
  s.in = std::move(in);
  return s;
}

void Linear::ForwardFp8(const std::shared_ptr<Fp8Input>& in, int64_t M, int64_t K, int64_t N,
                        const WeightView& w, LinearOutput y, LinearSaved* saved) {
  FSDP8_CHECK(prec_ == v1::PRECISION_FP8 && in != nullptr) << "ForwardFp8 of a non-FP8 linear";
  FSDP8_CHECK(w.fp8 != nullptr && w.scale_inv != nullptr) << "FP8 linear without FP8 weight";
  FSDP8_CHECK((y.f32 == nullptr) != (y.bf16 == nullptr)) << "ForwardFp8 takes exactly one output";
  FSDP8_CHECK(y.residual == nullptr || y.f32 != nullptr) << "a residual needs the f32 output";
  const bool fast = sc_->forward_fast_accumulation();
  if (fast) be_->SetFp8FastAccumulation(true);
  if (y.bf16 != nullptr) {
    be_->GemmFp8(false, true, M, N, K, {in->x8.u8(), Fp8Format::kE4M3, in->scale_inv},
                 {w.fp8, Fp8Format::kE4M3, w.scale_inv}, y.bf16, false);
  } else if (y.residual != nullptr) {
    be_->GemmFp8(false, true, M, N, K, {in->x8.u8(), Fp8Format::kE4M3, in->scale_inv},
                 {w.fp8, Fp8Format::kE4M3, w.scale_inv}, y.f32, false, y.residual);
  } else {
    be_->GemmFp8(false, true, M, N, K, {in->x8.u8(), Fp8Format::kE4M3, in->scale_inv},
                 {w.fp8, Fp8Format::kE4M3, w.scale_inv}, y.f32, false);
  }
  if (fast) be_->SetFp8FastAccumulation(false);
  if (saved) saved->in = in;
}

void Linear::Backward(ActivationView dy, int64_t M, int64_t K, int64_t N, const WeightView& w,
                      const LinearSaved& saved, InputGrad dx, float* dw) {
  if (scaled()) {
    FSDP8_CHECK(dy.f32 != nullptr && dy.bf16 == nullptr && dx.bf16 == nullptr &&
                (w.f32 != nullptr || (BlockCodes(w) && gran_ == v1::FP8_GRANULARITY_BLOCKWISE)) &&
                saved.x != nullptr)
        << "a rowwise / blockwise linear reads f32 operands (blockwise: or block-scaled codes)";
    BackwardScaled(dy.f32, M, K, N, w, saved.x, dx, dw);
    return;
  }
  if (prec_ != v1::PRECISION_FP8) {
    FSDP8_CHECK(dy.f32 != nullptr && dy.bf16 == nullptr && dx.bf16 == nullptr)
        << "bf16 grad-output or input-gradient of a non-FP8 linear";
    const GemmInputs in = prec_ == v1::PRECISION_BF16 ? GemmInputs::kBF16 : GemmInputs::kF32;
    FSDP8_CHECK(saved.x != nullptr);
    // dx (M, K) = dy (M, N) · W (N, K)
    if (dx.f32) be_->Gemm(false, false, M, K, N, dy.f32, w.f32, dx.f32, dx.accumulate, in);
    // dw (N, K) += dyᵀ (N, M) · x (M, K)
    be_->Gemm(true, false, N, K, M, dy.f32, saved.x, dw, true, in);
    return;
  }
  FSDP8_CHECK(dy.valid()) << "Backward takes exactly one grad-output";
  FSDP8_CHECK(saved.in != nullptr) << "FP8 backward without its saved input";
  DevBuf dy8(be_, M * N), dyT8;
  if (be_->Fp8GemmAnyLayout() && dx.bf16 == nullptr && !saved.in->x8.empty()) {
    CastDy(dy, M, N, &dy8, nullptr);
    BackwardFp8AnyLayout(std::move(dy8), M, K, N, w, saved, dx, dw);
    return;
  }
  dyT8 = DevBuf(be_, M * N);
  CastDy(dy, M, N, &dy8, &dyT8);
  BackwardFp8(std::move(dy8), std::move(dyT8), M, K, N, w, saved, dx, dw);
}

void Linear::CastDy(ActivationView dy, int64_t M, int64_t N, DevBuf* dy8, DevBuf* dyT8) {
  const Fp8Format dfmt = sc_->format(dy_idx_);
  if (dy.is_bf16() && !sc_->NeedsAmaxFirst(dy_idx_)) {
    if (dyT8 == nullptr) {
      be_->CastFp8(dy.bf16, 1, M * N, sc_->Scale(dy_idx_), dfmt, dy8->u8(), nullptr,
                   sc_->AmaxOut(dy_idx_));
    } else {
      be_->CastFp8(dy.bf16, M, N, sc_->Scale(dy_idx_), dfmt, dy8->u8(), dyT8->u8(),
                   sc_->AmaxOut(dy_idx_), N);
    }
    return;
  }
  const float* dy32 = dy.f32;
  DevBuf unpacked;
  if (dy.is_bf16()) {  // measuring the amax first goes through f32
    unpacked = DevBuf(be_, M * N * sizeof(float));
    be_->UnpackBf16(dy.bf16, unpacked.f32(), M * N);
    dy32 = unpacked.f32();
  }
  const float* scale = sc_->ScaleFor(dy_idx_, dy32, M * N);
  if (dyT8 == nullptr) {
    be_->CastFp8(dy32, 1, M * N, scale, dfmt, dy8->u8(), nullptr, sc_->AmaxOut(dy_idx_));
  } else {
    be_->CastFp8(dy32, M, N, scale, dfmt, dy8->u8(), dyT8->u8(), sc_->AmaxOut(dy_idx_));
  }
}

void Linear::BackwardFp8AnyLayout(DevBuf dy8, int64_t M, int64_t K, int64_t N,
                                  const WeightView& w, const LinearSaved& saved, InputGrad dx,
                                  float* dw) {
  const Fp8Format dfmt = sc_->format(dy_idx_);
  // dx (M, K) = dy8 (M, N) · W (N, K)
  if (dx.f32 != nullptr) {
    be_->GemmFp8(false, false, M, K, N, {dy8.u8(), dfmt, sc_->ScaleInv(dy_idx_)},
                 {w.fp8, Fp8Format::kE4M3, w.scale_inv}, dx.f32, dx.accumulate);
  }
  // dW (N, K) = dy8ᵀ · x8 (M, K), overwritten as in BackwardFp8.
  const Fp8Input& in = *saved.in;
  be_->GemmFp8(true, false, N, K, M, {dy8.u8(), dfmt, sc_->ScaleInv(dy_idx_)},
               {in.x8.u8(), Fp8Format::kE4M3, in.scale_inv}, dw, false);
}

void Linear::BackwardFp8(DevBuf dy8, DevBuf dyT8, int64_t M, int64_t K, int64_t N,
                         const WeightView& w, const LinearSaved& saved, InputGrad dx, float* dw) {
  FSDP8_CHECK(prec_ == v1::PRECISION_FP8 && saved.in != nullptr)
      << "FP8 backward without its saved input";
  const Fp8Format dfmt = sc_->format(dy_idx_);
  FSDP8_CHECK(dx.bf16 == nullptr || (dx.f32 == nullptr && !dx.accumulate))
      << "bf16 dx with f32 dx or accumulate";
  if (!dx.none()) {
    DevBuf wT(be_, N * K);
    be_->TransposeBytes(w.fp8, N, K, wT.u8());  // (K, N)
    if (dx.bf16) {
      be_->GemmFp8(false, true, M, K, N, {dy8.u8(), dfmt, sc_->ScaleInv(dy_idx_)},
                   {wT.u8(), Fp8Format::kE4M3, w.scale_inv}, dx.bf16, false);
    } else {
      be_->GemmFp8(false, true, M, K, N, {dy8.u8(), dfmt, sc_->ScaleInv(dy_idx_)},
                   {wT.u8(), Fp8Format::kE4M3, w.scale_inv}, dx.f32, dx.accumulate);
    }
  }
  dy8.Reset();
  Fp8Input& in = *saved.in;
  if (in.xT.empty()) {  // the first of the linears sharing this input
    in.xT = DevBuf(be_, M * K);
    be_->TransposeBytes(in.x8.u8(), M, K, in.xT.u8());  // (K, M)
  }
  // dW is overwritten: FsdpParams leaves FP8 weights' gradient buffers unzeroed (BeginGrads).
  be_->GemmFp8(false, true, N, K, M, {dyT8.u8(), dfmt, sc_->ScaleInv(dy_idx_)},
               {in.xT.u8(), Fp8Format::kE4M3, in.scale_inv}, dw, false);
  dyT8.Reset();
}

}  // namespace fsdp8
