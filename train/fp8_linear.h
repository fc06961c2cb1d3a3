// The precision-dependent linear layer y = x · Wᵀ (no bias), and the delayed-scaling state of the
// FP8 activations (X) and grad-outputs (dY) of every FP8 linear.
//
// FP8 (TransformerEngine "hybrid" by default):
//   forward   x → E4M3 codes with the X scale (amax accumulated), Y = GemmFp8(X, W)     (TN)
//   backward  dY → E5M2 (E4M3 for the all-E4M3 format) codes and their transpose in one fused
//             cast (amax accumulated); dX = GemmFp8(dY, Wᵀ) with Wᵀ = TransposeBytes(W) and
//             dW = GemmFp8(dYᵀ, Xᵀ) with Xᵀ = TransposeBytes(saved X codes). Only X's FP8 codes
//             are kept from the forward; Xᵀ is made by the first backward that needs it and freed
//             with the last LinearSaved that holds the input (the caller drops them after use).
//   Linears that read the same activation (q/k/v of n1, gate/up of n2) share one cast and one
//   transpose (Fp8Input): their X tensors see the same values every step, so their delayed
//   scales are equal by construction; the shared cast records one amax, which UpdateScales gives to
//   each (ActScaling::ShareAmax).
//   Fused projections (Fp8Recipe.fused_projections, LlamaModel): q/k/v and gate/up also share
//   one grad-output scale (ActScaling::GroupAmax) and one weight scale
//   (FsdpParams::SetWeightScaleGroup), so that their grad-outputs, cast side by side, and their
//   adjacent gathered weights form one FP8 matrix each: one BackwardFp8 of N = the group's total
//   runs the group's dX and dW GEMMs.
//   Inputs, outputs and grad-outputs may be bfloat16 (bit patterns, Backend's bf16 operands):
//   the views ActivationView, LinearOutput and InputGrad say which.
// BF16 / FP32: Backend::Gemm with inputs rounded to bf16 / kept f32; the f32 input is kept (by
// the caller) for dW.
//
// Scaling (common/scaling.h): delayed — cast with the current scale; amaxes accumulate into a
// device buffer zeroed once per step (max over all microbatches, C03); ReduceAmax does ONE fused
// AllReduce(max) and every rank runs UpdateDelayed identically (C04). A tensor without history
// (first step) and every tensor under the CURRENT recipe is scaled from its own amax, which costs a
// host synchronisation per cast.
//
// Thread-safety: one thread (the trainer's).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/scaling.h"
#include "fsdp8/v1/admin.pb.h"
#include "fsdp8/v1/spec.pb.h"
#include "kernels/backend.h"
#include "comm/communicator.h"
#include "train/device_buffer.h"
#include "train/fsdp.h"

namespace fsdp8 {

class ActScaling {
 public:
  // forward_fast_accumulation: TuningSpec.forward_fast_accumulation of the job.
  ActScaling(Backend* be, const v1::Fp8Recipe& recipe, bool forward_fast_accumulation);
  // Registers a scaled tensor; returns its index. Call before Finalize().
  int Add(const std::string& name, bool e5m2);
  void Finalize();
  size_t size() const { return states_.size(); }

  // Zeroes this step's amax accumulators.
  void BeginStep();
  // Device scale to cast `x` (n f32) of tensor i with. Uninitialised tensors and the CURRENT
  // recipe compute x's amax first (synchronises) and upload the scale.
  const float* ScaleFor(int i, const float* x, int64_t n);
  const float* ScaleInv(int i) const { return scale_inv_.f32() + i * kScaleStride; }
  // Where a cast accumulates tensor i's amax: this step's accumulator, or nullptr when not
  // recording (evaluation).
  float* AmaxOut(int i) const { return recording_ ? amax_.f32() + i : nullptr; }
  void set_recording(bool on) { recording_ = on; }
  // The fused all-reduce(max) of this step's amaxes and the identical update on every rank:
  // ReduceAmax enqueues the all-reduce, UpdateScales reads the result (a device synchronisation)
  // and updates and uploads the scales.
  absl::Status ReduceAmax(Communicator* comm, CommClock* clock);
  void UpdateScales();
  const std::vector<ScalingState>& states() const { return states_; }
  // Whether tensor i's next cast must first measure its own amax (CURRENT recipe, or no history).
  bool NeedsAmaxFirst(int i) const {
    return recipe_.recipe() == v1::SCALING_RECIPE_CURRENT || !states_[i].initialised;
  }
  // The device scale slot of tensor i as it stands (delayed scaling: no measurement).
  const float* Scale(int i) const { return scale_.f32() + i * kScaleStride; }
  // Whether forward FP8 GEMMs use fast accumulation (TuningSpec.forward_fast_accumulation).
  bool forward_fast_accumulation() const { return forward_fast_accumulation_; }
  // Fp8Recipe.fused_projections.
  bool fused_projections() const { return recipe_.fused_projections(); }
  // Tensor `to` takes the amax that tensor `from` records (the same input values, one cast):
  // UpdateScales copies it over before the update. Idempotent; `from` must record its own amax (no
  // chains: each `to` is resolved once).
  void ShareAmax(int from, int to);
  // The tensors `members` (two or more, in no other group) scale as one: before each update every
  // member's recorded amax becomes the group's maximum (NaN when any is NaN), so their histories
  // and scales stay equal from then on (a fused projection's grad-outputs, whose codes one GEMM
  // reads with one scale). Each cast still records its own amax. Call before Finalize().
  void GroupAmax(const std::vector<int>& members);
  // Whether tensors i and j have equal current scales (host state; no synchronisation). Grouped
  // tensors may differ only after a Restore of states saved without the group.
  bool SameScale(int i, int j) const {
    return states_[i].scale == states_[j].scale && states_[i].scale_inv == states_[j].scale_inv;
  }
  // Replaces every tensor's delayed-scaling state (a checkpoint load) and uploads the scales.
  // FAILED_PRECONDITION naming the first tensor whose name or format differs (nothing changed).
  absl::Status Restore(const std::vector<ScalingState>& states);
  Fp8Format format(int i) const { return states_[i].e5m2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3; }

 private:
  Backend* be_;
  v1::Fp8Recipe recipe_;
  bool forward_fast_accumulation_ = true;
  std::vector<ScalingState> states_;
  DevBuf scale_, scale_inv_, amax_, tmp_amax_;  // scales in kScaleStride slots; amax (n) contiguous
  std::map<int, int> amax_from_;                // ShareAmax: to -> from
  std::vector<std::vector<int>> groups_;        // GroupAmax
  bool recording_ = true;
};

// Gathered weight of one linear: W (N, K) as f32 values or as E4M3 codes with its scale_inv.
struct WeightView {
  const float* f32 = nullptr;
  const uint8_t* fp8 = nullptr;
  const float* scale_inv = nullptr;  // device scalar (fp8)
  // A blockwise FP8 wire weight (FsdpParams::WBlockScaleInv): fp8 holds its E4M3 codes (N, K)
  // and this their kBlock128 scale_inv (ceil(N / 128), ceil(K / 128)); scale_inv is unused.
  const float* block_scale_inv = nullptr;
};

// A device activation a linear reads (its input x, or its grad-output dy): f32 values or bf16
// bit patterns (Backend's bf16 operands), exactly one. Make it through F32 / Bf16 (the fields stay
// public for the linear's checks; valid() says whether exactly one is set).
struct ActivationView {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;

  static ActivationView F32(const float* p) { return ActivationView(p, nullptr); }
  static ActivationView Bf16(const uint16_t* p) { return ActivationView(nullptr, p); }
  bool is_bf16() const { return bf16 != nullptr; }
  // Exactly one pointer is set.
  bool valid() const { return (f32 == nullptr) != (bf16 == nullptr); }

 private:
  ActivationView(const float* f, const uint16_t* b) : f32(f), bf16(b) {}
};

// Where an FP8 linear's forward writes y (M, N) = x · Wᵀ: f32 values, f32 values with a residual
// (M, N) f32 added in the GEMM (y = residual + x · Wᵀ), or bf16 bit patterns.
struct LinearOutput {
  float* f32 = nullptr;
  uint16_t* bf16 = nullptr;
  const float* residual = nullptr;

  static LinearOutput F32(float* y) { return LinearOutput(y, nullptr, nullptr); }
  static LinearOutput F32PlusResidual(float* y, const float* residual) {
    return LinearOutput(y, nullptr, residual);
  }
  static LinearOutput Bf16(uint16_t* y) { return LinearOutput(nullptr, y, nullptr); }

 private:
  LinearOutput(float* f, uint16_t* b, const float* r) : f32(f), bf16(b), residual(r) {}
};

// Where a linear's backward writes the input gradient dx (M, K) = dy · W: nowhere, f32 values
// (overwritten, or added to the values there), or bf16 bit patterns (FP8 linears; overwritten).
struct InputGrad {
  float* f32 = nullptr;
  uint16_t* bf16 = nullptr;
  bool accumulate = false;  // f32 only: dx += dy · W

  static InputGrad None() { return InputGrad(nullptr, nullptr, false); }
  static InputGrad F32(float* dx) { return InputGrad(dx, nullptr, false); }
  static InputGrad AddF32(float* dx) { return InputGrad(dx, nullptr, true); }
  static InputGrad Bf16(uint16_t* dx) { return InputGrad(nullptr, dx, false); }
  bool none() const { return f32 == nullptr && bf16 == nullptr; }

 private:
  InputGrad(float* f, uint16_t* b, bool acc) : f32(f), bf16(b), accumulate(acc) {}
};

// The E4M3 codes of one FP8 linear input, shared by the linears that read it.
struct Fp8Input {
  DevBuf x8;                        // (M, K) E4M3 codes
  const float* scale_inv = nullptr; // (1) f32 device scalar: the scale_inv x8 was cast with
  DevBuf scale_inv_copy;            // owns *scale_inv when the tensor's slot may change first
  DevBuf xT;  // (K, M) transpose for dW, made by the first backward that needs it
};

// What the forward keeps for the backward.
struct LinearSaved {
  std::shared_ptr<Fp8Input> in;  // FP8
  const float* x = nullptr;      // (M, K) f32 input (BF16/FP32), owned by the caller
};

class Linear {
 public:
  Linear() = default;
  // x_idx / dy_idx: ActScaling indices (FP8 only).
  Linear(Backend* be, ActScaling* scaling, v1::Precision precision, int x_idx, int dy_idx)
      : be_(be), sc_(scaling), prec_(precision), x_idx_(x_idx), dy_idx_(dy_idx) {}
  // An FP8 linear of the rowwise or blockwise recipe (precision.fp8.granularity): current
  // scaling per row / 1x128 tile / 128x128 block at every cast (Backend::QuantizeFp8Blocks,
  // GemmFp8Blocks), no ActScaling state. It reads f32 inputs and grad-outputs, and the weight
  // as f32 values (rowwise: the gathered BF16 weight) or, blockwise, as the gathered FP8 codes
  // with their 128x128 block scales (WeightView::block_scale_inv: the FP8 wire, no cast at use;
  // an f32 weight is still accepted and quantized at each use). It keeps the f32 input for the
  // backward, as a BF16 linear does:
  //   forward  Y  = X · Wᵀ: X per row (rowwise) or 1x128 tile, W per row or 128x128 block;
  //   dX = dY · W:  dY per row or 1x128 tile along N; Wᵀ per row of Wᵀ (rowwise: W requantized
  //                 per column) or W's codes with the transposed 128x128 block scales;
  //   dW = dYᵀ · X: dYᵀ and Xᵀ per row or 1x128 tile along the tokens (their transposed casts).
  // dw accumulates (dw += dYᵀ · X) as for BF16 / FP32 linears. dy_format: the grad-outputs'
  // format (precision.fp8.format: E5M2 under HYBRID, else E4M3); inputs and weights are E4M3.
  static Linear Scaled(Backend* be, v1::Fp8Granularity granularity, Fp8Format dy_format);
  v1::Precision precision() const { return prec_; }
  // TENSORWISE for every linear but Scaled ones.
  v1::Fp8Granularity granularity() const { return gran_; }

  // y (M, N) = x (M, K) · W (N, K)ᵀ. saved may be null (no backward follows). An FP8 linear's
  // input codes are allocated under memory label `codes` (common/memory_label.h: kSaved where the
  // step plan keeps them for the backward).
  void Forward(const float* x, int64_t M, int64_t K, int64_t N, const WeightView& w, float* y,
               LinearSaved* saved, MemoryLabel codes = MemoryLabel::kWork);
  // dx (M, K) = dy (M, N) · W (see InputGrad); dw (N, K) += dyᵀ · x for BF16/FP32 linears; FP8
  // linears overwrite dw = dyᵀ · x (each FP8 weight's gradient is written once per microbatch
  // into an unzeroed buffer, FsdpParams). A bf16 dy, or a bf16 dx, only for FP8 linears.
  void Backward(ActivationView dy, int64_t M, int64_t K, int64_t N, const WeightView& w,
                const LinearSaved& saved, InputGrad dx, float* dw);

  // FP8 only. Casts x (M, K), f32 or bf16, with this linear's X scale; each linear of
  // `same_input` (which read the same x) takes the amax it records (ActScaling::ShareAmax). The
  // codes here and in NormCastInput and CastSwiglu are allocated under memory label `codes`.
  std::shared_ptr<Fp8Input> CastInput(ActivationView x, int64_t M, int64_t K,
                                      std::initializer_list<const Linear*> same_input = {},
                                      MemoryLabel codes = MemoryLabel::kWork);
  // FP8 only. The input RMSNorm(x) * w_norm (M, K) of this linear (and of `same_input`), cast
  // straight from the norm (Backend::RmsNormForward with an Fp8Cast); rstd (M) receives the norm's
  // 1/rms.
  std::shared_ptr<Fp8Input> NormCastInput(const float* x, const float* w_norm, float eps,
                                          int64_t M, int64_t K, float* rstd,
                                          std::initializer_list<const Linear*> same_input = {},
                                          MemoryLabel codes = MemoryLabel::kWork);
  // FP8 only. The input silu(gate) * up (M, K) of this linear from bf16 gate16, up16 (M, K) of
  // row stride ld (K when dense; ld != K only when !NeedsAmaxFirst of this linear's input), cast
  // in one pass (Backend::SwigluForward with an Fp8Cast).
  std::shared_ptr<Fp8Input> CastSwiglu(const uint16_t* gate16, const uint16_t* up16, int64_t M,
                                       int64_t K, int64_t ld,
                                       MemoryLabel codes = MemoryLabel::kWork);
  // FP8 only, !XNeedsAmaxFirst(): the saved input of a forward that read CastSwiglu(gate16, up16,
  // M, K, ld) in this step, recast for the backward from the same bf16 gate16, up16 with the same
  // X scale (its slot holds still until UpdateScales): only the transpose xT (K, M) that dW reads,
  // bit for bit the transpose of the forward's codes (Backend::SwigluForward with an Fp8Cast to
  // out_t; x8 stays empty, dX does not read the input). Records no amax (the forward's cast did).
  LinearSaved RecastSwiglu(const uint16_t* gate16, const uint16_t* up16, int64_t M, int64_t K,
                           int64_t ld) const;
  // Whether this FP8 linear's input cast must first measure its own amax (ActScaling).
  bool XNeedsAmaxFirst() const { return sc_->NeedsAmaxFirst(x_idx_); }
  // FP8 only. y (M, N) = in · Wᵀ, written where `y` says (LinearOutput).
  void ForwardFp8(const std::shared_ptr<Fp8Input>& in, int64_t M, int64_t K, int64_t N,
                  const WeightView& w, LinearOutput y, LinearSaved* saved);

  // FP8 only: where this linear's grad-output dY is cast, for an op that computes dY and casts it
  // in the same pass (Backend::SwigluBackward with two Fp8Casts). Such an op may be used only when
  // !DyNeedsAmaxFirst() (delayed scaling with history: no measurement before the cast).
  bool DyNeedsAmaxFirst() const { return sc_->NeedsAmaxFirst(dy_idx_); }
  const float* DyScale() const { return sc_->Scale(dy_idx_); }
  float* DyAmaxOut() const { return sc_->AmaxOut(dy_idx_); }
  Fp8Format dy_format() const { return sc_->format(dy_idx_); }
  // FP8 only: where an op that computes dY casts it (Fp8Cast: this linear's grad-output scale,
  // format and amax), codes into out (row stride ld) and their transpose into out_t.
  Fp8Cast DyCast(uint8_t* out, uint8_t* out_t, int64_t ld) const {
    return Fp8Cast{DyScale(), dy_format(), out, out_t, DyAmaxOut(), ld};
  }
  // ActScaling indices of this FP8 linear's input and grad-output (-1 for other precisions).
  int x_index() const { return x_idx_; }
  int dy_index() const { return dy_idx_; }
  // FP8 only. Backward with dY already cast with DyScale(): dy8 (M, N) and its transpose dyT8
  // (N, M), E5M2 / E4M3 codes of dy_format(); both are freed here as soon as they are used.
  void BackwardFp8(DevBuf dy8, DevBuf dyT8, int64_t M, int64_t K, int64_t N, const WeightView& w,
                   const LinearSaved& saved, InputGrad dx, float* dw);

 private:
  // Finishes an input whose x8 was just cast with this linear's X scale: points at that
  // scale_inv (or keeps a copy when the slot may change before the backward) and shares the
  // cast's amax with the linears of `same_input`. The copy takes the codes' memory label.
  std::shared_ptr<Fp8Input> Cast(std::shared_ptr<Fp8Input> in, MemoryLabel codes,
                                 std::initializer_list<const Linear*> same_input);
  // dY (M, N), f32 or bf16, cast to this linear's grad-output format: dy8 (M, N); with dyT8 (its
  // transpose, N x M) when dyT8 is not null.
  void CastDy(ActivationView dy, int64_t M, int64_t N, DevBuf* dy8, DevBuf* dyT8);
  // The FP8 backward for a backend whose GemmFp8 takes every layout (Fp8GemmAnyLayout):
  // dx = dy8 · W and dw = dy8ᵀ · x8 straight from the untransposed codes. dx not bf16; the saved
  // input has its codes x8 (not only a recast transpose).
  void BackwardFp8AnyLayout(DevBuf dy8, int64_t M, int64_t K, int64_t N, const WeightView& w,
                            const LinearSaved& saved, InputGrad dx, float* dw);

  // The rowwise / blockwise forward and backward (Scaled): f32 operands, see Scaled.
  bool scaled() const { return gran_ != v1::FP8_GRANULARITY_TENSORWISE; }
  void ForwardScaled(const float* x, int64_t M, int64_t K, int64_t N, const WeightView& w,
                     float* y);
  void BackwardScaled(const float* dy, int64_t M, int64_t K, int64_t N, const WeightView& w,
                      const float* x, InputGrad dx, float* dw);

  Backend* be_ = nullptr;
  ActScaling* sc_ = nullptr;
  v1::Precision prec_ = v1::PRECISION_FP32;
  v1::Fp8Granularity gran_ = v1::FP8_GRANULARITY_TENSORWISE;
  Fp8Format dy_fmt_ = Fp8Format::kE4M3;  // Scaled only
  int x_idx_ = -1;
  int dy_idx_ = -1;
};

}  // namespace fsdp8
