// LlamaModel: the forward and backward of one microbatch of Hugging Face LlamaForCausalLM over
// fully sharded parameters (FsdpParams), unit by unit:
//   embedding → L × [x + o_proj(attn(rope(q(n1)), rope(k(n1)), v(n1))), n1 = RMSNorm(x);
//                    h + down(silu(gate(n2)) * up(n2)), n2 = RMSNorm(h)]
//   → final RMSNorm → lm_head → softmax cross-entropy against the next tokens.
// Forward gathers each unit's weights, computes, frees them; backward re-gathers each block,
// computes its gradients into full f32 buffers and reduce-scatters them (FsdpParams). The head's
// forward and backward run back to back (fused cross-entropy), with one gather.
//
// Activations are f32 (B, T, C) row-major, N = B * T tokens. FP8 blocks keep their linear inputs
// as FP8 codes only; with BF16 attention, the activations between their GEMMs that feed only an
// FP8 cast or the attention (q, k, v, att, gate, up and their gradients) are bf16.
//
// Thread-safety: one thread (the trainer's).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "fsdp8/v1/spec.pb.h"
#include "kernels/backend.h"
#include "train/fp8_linear.h"
#include "train/fsdp.h"
#include "train/options.h"

namespace fsdp8 {

class LlamaModel {
 public:
  // spec: defaults applied. Registers the FP8 tensors of every FP8 linear in `scaling` (which the
  // caller finalises).
  LlamaModel(const v1::JobSpec& spec, FsdpParams* params, ActScaling* scaling, Backend* be,
             const ModelOptions& options);

  // One microbatch of B sequences. tokens, targets (B * T) int32 device buffers.
  // losses (B * T) f32 device buffer receives the per-token losses (nats).
  // backward: also compute gradients of sum(losses) * grad_scale, reduce-scattered into the
  // parameters' grad shards (accumulating).
  absl::Status Run(const int32_t* tokens, const int32_t* targets, int64_t B, float grad_scale,
                   float* losses, bool backward);
  // Starts the all-gathers of the first units a Run gathers (the embedding and block 0), so that
  // they run while the host finishes the step and starts the next one. Call after the weights'
  // last CastWeights of the step; the next Run takes them over (FsdpParams::Prefetch).
  absl::Status PrefetchFirstUnits();

  // How many projection groups (q/k/v or gate/up of a block, Fp8Recipe.fused_projections) run
  // fused; and how many fused backward passes (one dX and one dW GEMM for a group) ran so far.
  int fused_projections() const {
    int n = 0;
    for (const Block& b : blocks_) n += b.fused_qkv + b.fused_mlp;
    return n;
  }
  int64_t fused_backward_runs() const { return fused_backward_runs_; }

  // Peak device bytes of the forward (embedding through the loss) and of the backward, the
  // maximum over the Run calls since the last call (which resets them). Run resets the backend's
  // peak counter at the phase boundary.
  std::pair<int64_t, int64_t> TakePhasePeaks() {
    auto r = std::make_pair(forward_peak_, backward_peak_);
    forward_peak_ = backward_peak_ = 0;
    return r;
  }

 private:
  struct Block {
    v1::Precision prec;
    TensorRef in_norm, post_norm, q, k, v, o, gate, up, down;
    Linear lq, lk, lv, lo, lgate, lup, ldown;
    // Fp8Recipe.fused_projections with the group's weights adjacent in one flat buffer (their
    // gathered codes and full gradients are then one (sum of N, K) matrix): q/k/v run one forward
    // GEMM (always: their weight scale is shared) and, once their grad-output scales are known,
    // one dX and one dW GEMM; gate/up the same when MlpFused.
    bool fused_qkv = false, fused_mlp = false;
  };
  struct BlockActs;
  WeightView View(const TensorRef& t) const;
  // Whether block b's gate/up run fused this step (b.fused_mlp, and every scale involved known
  // without measuring: delayed scaling with history, gate's and up's grad-output scales equal):
  // one forward GEMM into [gate | up] and one dX and one dW GEMM in the backward. Constant within
  // a step (the scales change only in UpdateScales), so forward, recompute and backward agree.
  bool MlpFused(const Block& b) const;
  // Whether block b's q/k/v backward runs one dX and one dW GEMM this step (b.fused_qkv, the
  // grad-output scales known and equal). Its forward GEMM is fused whenever b.fused_qkv.
  bool QkvBackwardFused(const Block& b) const;
  // The per-linear q/k/v backward of BlockBackwardFp8: dn1q, dn1k, dn1v (N, C) bf16 parts from
  // dq16, dk16, dv16 (RoPE's backward applied to q and k here).
  void BackwardQkvPerLinear(Block& b, int64_t B, BlockActs& a, DevBuf& dq16, DevBuf& dk16,
                            DevBuf& dv16, DevBuf& dn1q, DevBuf& dn1k, DevBuf& dn1v);
  absl::Status BlockForward(int l, int64_t B, DevBuf* x, BlockActs* acts);
  void BlockBackward(int l, int64_t B, BlockActs* acts, DevBuf* dx);
  // The same for an FP8 block with BF16 attention (bf16 activations between its GEMMs).
  absl::Status BlockForwardFp8(int l, int64_t B, DevBuf* x, BlockActs* acts);
  // The BF16 head's forward and backward with its loss, in row chunks: logits (rows, V) f32 per
  // chunk, the cross-entropy gradient straight to bf16 (Backend::CrossEntropyForwardBackwardBf16Grad),
  // dnf (N, C) f32 written, the head's weight gradient accumulated (BeginGrads first). dnf null:
  // evaluation, the losses only. nf (N, C) f32, targets (N), losses (N) nats.
  void HeadBf16(const float* nf, const int32_t* targets, int64_t N, float grad_scale,
                float* losses, float* dnf);
  void BlockBackwardFp8(int l, int64_t B, BlockActs* acts, DevBuf* dx);

  Backend* be_;
  FsdpParams* p_;
  ActScaling* scaling_;
  int64_t C_, H_, Hkv_, D_, F_, V_, T_;
  int64_t fused_backward_runs_ = 0;
  float eps_, theta_;
  bool attention_bf16_ = false;  // precision.attention == BF16
  bool recompute_ = false;       // training.activation_recompute
  // f32 logits per chunk of the BF16 head (HeadBf16): ModelOptions::head_chunk_logit_bytes.
  int64_t head_chunk_bytes_ = int64_t{1} << 30;
  int64_t forward_peak_ = 0, backward_peak_ = 0;
  TensorRef embed_, final_norm_, head_;
  Linear lhead_;
  std::vector<Block> blocks_;
  int embedding_unit_ = 0, head_unit_ = 0;
};

}  // namespace fsdp8
