// LlamaModel: the forward and backward of one microbatch of Hugging Face LlamaForCausalLM over
// fully sharded parameters (FsdpParams), unit by unit:
//   embedding → L × [x + o_proj(attn(rope(q(n1)), rope(k(n1)), v(n1))), n1 = RMSNorm(x);
//                    h + down(silu(gate(n2)) * up(n2)), n2 = RMSNorm(h)]
//   → final RMSNorm → lm_head → softmax cross-entropy against the next tokens.
// With tied embeddings (model.tie_word_embeddings) lm_head is embed_tokens' weight: the head
// gathers the embedding unit again and its weight gradient is added to the embedding's, which is
// reduce-scattered once after the embedding's backward.
// Forward gathers each unit's weights, computes, frees them; backward re-gathers each block,
// computes its gradients into full f32 buffers and reduce-scatters them (FsdpParams). The head's
// forward and backward run back to back (fused cross-entropy), with one gather.
//
// Activations are f32 (B, T, C) row-major, N = B * T tokens. FP8 blocks keep their linear inputs
// as FP8 codes only; with BF16 attention, the activations between their GEMMs that feed only an
// FP8 cast or the attention (q, k, v, att, gate, up and their gradients) are bf16. One routine
// runs every block (BlockForward / BlockBackward); each linear computes in its own precision.
//
// Thread-safety: one thread (the trainer's).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
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
  // Forward only, for comparisons with other implementations: logits (B * T, V) f32 device buffer
  // of the head's GEMM (in precision.lm_head; BF16 rounds its operands as the training head does).
  absl::Status Logits(const int32_t* tokens, int64_t B, float* logits);
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
  // How many FP8 block backwards so far recast down_proj's input from the saved gate/up instead
  // of reading codes kept from the forward (ModelOptions::save_down_proj_input).
  int64_t down_input_recasts() const { return down_input_recasts_; }

  // Peak device bytes of the forward (embedding through the loss) and of the backward, the
  // maximum over the Run calls since the last call (which resets them). Run resets the backend's
  // peak counter at the phase boundary.
  std::pair<int64_t, int64_t> TakePhasePeaks() {
    auto r = std::make_pair(forward_peak_, backward_peak_);
    forward_peak_ = backward_peak_ = 0;
    return r;
  }
  // The backend's bytes per memory label at those peaks (AllocationAccount::AtPeak), reset with
  // them; call before TakePhasePeaks.
  std::pair<LabelBytes, LabelBytes> PhasePeakLabels() const {
    return {forward_peak_labels_, backward_peak_labels_};
  }

 private:
  struct Block {
    // The block's path: its linears' precision, BF16 for rowwise / blockwise FP8 linears (the
    // generic path; their Linear is Scaled).
    v1::Precision prec;
    TensorRef in_norm, post_norm, q, k, v, o, gate, up, down;
    Linear lq, lk, lv, lo, lgate, lup, ldown;
    // Fp8Recipe.fused_projections with the group's weights adjacent in one flat buffer (their
    // gathered codes and full gradients are then one (sum of N, K) matrix): q/k/v run one forward
    // GEMM (always: their weight scale is shared) and, once their grad-output scales are known,
    // one dX and one dW GEMM; gate/up the same when MlpFused.
    bool fused_qkv = false, fused_mlp = false;
    // FP8 linears with BF16 attention: the activations between the GEMMs that feed only an FP8
    // cast or the attention (q, k, v, att, gate, up and their gradients) are bf16.
    bool acts16 = false;
    // The names of what the step plan keeps from this block's forward for its backward
    // (BlockPlan::saved without recompute): their allocations are labelled saved activations.
    std::vector<std::string> saved;
  };
  struct BlockActs;
  // The memory label of block b's tensor `name` (a PlannedTensor name): saved activations when a
  // training forward without recompute keeps it (Block::saved), else workspaces.
  MemoryLabel Keep(const Block& b, bool train, const char* name) const;
  WeightView View(const TensorRef& t) const;
  // Whether block b's gate/up run fused this step (b.fused_mlp, and every scale involved known
  // without measuring: delayed scaling with history, gate's and up's grad-output scales equal):
  // one forward GEMM into [gate | up] and one dX and one dW GEMM in the backward. Constant within
  // a step (the scales change only in UpdateScales), so forward, recompute and backward agree.
  bool MlpFused(const Block& b) const;
  // Whether block b's q/k/v backward runs one dX and one dW GEMM this step (b.fused_qkv, the
  // grad-output scales known and equal). Its forward GEMM is fused whenever b.fused_qkv.
  bool QkvBackwardFused(const Block& b) const;
  // The FSDP unit of block l; the head's unit for l == the number of blocks.
  int BlockUnit(int l) const;
  // The head's units: its own (final norm, lm_head) and, with tied embeddings, the embedding's
  // (the head GEMM's weight). BeginHeadGrads starts both gradient buffers; the embedding's stays
  // open until the embedding's backward has added its part (one reduce-scatter of the sum).
  absl::Status GatherHead();
  void ReleaseHead();
  void BeginHeadGrads();
  // The embedding and the blocks' forward: x (N, C) f32 receives the last block's output. With
  // backward, acts (one per block) receives what each block's backward needs (only the block
  // input with activation recompute).
  absl::Status ForwardBlocks(const int32_t* tokens, int64_t B, bool backward, DevBuf* x,
                             std::vector<BlockActs>* acts);
  // The blocks' backward in reverse, then the embedding's, from dx (N, C) f32, the gradient of
  // the last block's output; flushes the reduce-scatters and records the backward's peak.
  absl::Status BackwardBlocks(const int32_t* tokens, int64_t B, std::vector<BlockActs>* acts,
                              DevBuf* dx);

  // One block, forward: *x (N, C) f32 is the block input and becomes its output; acts null:
  // evaluation (nothing kept). Backward: *dx (N, C) f32, the gradient of the block output,
  // becomes the gradient of its input; the block's weight gradients are written, acts cleared.
  // Every block runs these, whatever its linears' precision (Block::acts16: model.cc).
  absl::Status BlockForward(int l, int64_t B, DevBuf* x, BlockActs* acts);
  void BlockBackward(int l, int64_t B, BlockActs* acts, DevBuf* dx);
  // The two halves of a block: the attention half makes acts->h (N, C) f32 from acts->x_in; the
  // MLP half returns the block output (N, C) f32 from acts->h. Their backwards in reverse order:
  // the MLP half returns dh (N, C) from *dout (freed), the attention half turns *dout into dx
  // (N, C) from dh and clears acts.
  void AttentionForward(Block& b, int64_t B, bool train, BlockActs* a);
  DevBuf MlpForward(Block& b, int64_t B, bool train, BlockActs* a);
  DevBuf MlpBackward(int l, Block& b, int64_t B, BlockActs* a, DevBuf* dout);
  void AttentionBackward(Block& b, int64_t B, BlockActs* a, const DevBuf& dh, DevBuf* dout);
  // training.saved_norm_inputs BF16 in a block with bf16 activations: *x16 (n) bf16 = *x (n f32),
  // which is freed. Else nothing.
  void KeepNormInput(const Block& b, DevBuf* x, DevBuf* x16, int64_t n, const char* name);
  // The f32 values a norm's backward reads of a kept norm input: x itself, or x16 unpacked into
  // *tmp (n f32).
  const float* NormInput(const DevBuf& x, const DevBuf& x16, int64_t n, DevBuf* tmp);

  // q, k, v (B, T, H, D), (B, T, Hkv, D) x2 after RoPE, in acts' buffers, f32 or bf16;
  // consecutive tokens' rows q_ld (q) and kv_ld (k, v) elements apart (0: dense).
  struct Qkv {
    TypedCPtr q, k, v;
    int64_t q_ld = 0, kv_ld = 0;
  };
  // The q/k/v projections of the attention half from n1: acts->n1 f32, or with bf16 activations
  // its FP8 codes in1, through one GEMM into acts->qkv16 when b.fused_qkv, else three.
  Qkv QkvForward(Block& b, int64_t B, bool train, const std::shared_ptr<Fp8Input>& in1,
                 BlockActs* a);
  // gate and up (N, F), f32 or bf16, rows ld elements apart.
  struct GateUp {
    TypedCPtr gate, up;
    int64_t ld = 0;
  };
  // The gate/up projections of the MLP half from n2 (as QkvForward; fused when MlpFused).
  GateUp GateUpForward(Block& b, int64_t N, bool train, const std::shared_ptr<Fp8Input>& in2,
                       BlockActs* a);
  // The gate/up backward of the MLP half with bf16 activations from dact16 (N, F) bf16, the
  // gradient of silu(gate) * up (freed here): fused (MlpFused), dn2 (N, C) bf16 from one dX GEMM;
  // or per linear, dn2g and dn2u (N, C) bf16 (allocated here) parts.
  void BackwardGateUpFused(Block& b, int64_t N, BlockActs* a, DevBuf* dact16, DevBuf* dn2);
  void BackwardGateUpPerLinear(Block& b, int64_t N, BlockActs* a, DevBuf* dact16, DevBuf* dn2g,
                               DevBuf* dn2u);
  // The o_proj and attention backward of the attention half with bf16 activations: dq16, dk16,
  // dv16 (B, T, H|Hkv, D) bf16 from dh (N, C) f32.
  void OutputAttentionBackward(Block& b, int64_t B, BlockActs* a, const DevBuf& dh, DevBuf* dq16,
                               DevBuf* dk16, DevBuf* dv16);
  // The q/k/v backward of the attention half with bf16 activations from dq16, dk16, dv16
  // (RoPE's backward applied to q and k here): fused (QkvBackwardFused), dn1 (N, C) bf16 from one
  // dX GEMM; or per linear, dn1q, dn1k, dn1v (N, C) bf16 parts.
  void BackwardQkvFused(Block& b, int64_t B, BlockActs& a, DevBuf& dq16, DevBuf& dk16,
                        DevBuf& dv16, DevBuf& dn1);
  void BackwardQkvPerLinear(Block& b, int64_t B, BlockActs& a, DevBuf& dq16, DevBuf& dk16,
                            DevBuf& dv16, DevBuf& dn1q, DevBuf& dn1k, DevBuf& dn1v);
  // The BF16 head's forward and backward with its loss, in row chunks: logits (rows, V) f32 per
  // chunk, the cross-entropy gradient straight to bf16 (Backend::CrossEntropyForwardBackward into
  // bf16 dlogits), dnf (N, C) f32 written, the head's weight gradient accumulated (BeginGrads
  // first). dnf null: evaluation, the losses only. nf (N, C) f32, targets (N), losses (N) nats.
  void HeadBf16Compute(const float* nf, const int32_t* targets, int64_t N, float grad_scale,
                       float* losses, float* dnf);
  // The head weight (V, C) as bf16 codes: the gathered bf16 wire itself, or packed into *packed.
  const uint16_t* HeadWeightBf16(DevBuf* packed);

  Backend* be_;
  FsdpParams* p_;
  ActScaling* scaling_;
  int64_t C_, H_, Hkv_, D_, F_, V_, T_;  // ModelDims (common/model_dims.h): d_model .. seq_len
  int64_t fused_backward_runs_ = 0;
  int64_t down_input_recasts_ = 0;
  float eps_, theta_;
  bool attention_bf16_ = false;  // precision.attention == BF16
  bool recompute_ = false;       // training.activation_recompute
  bool save_down_input_ = false;  // ModelOptions::save_down_proj_input
  bool norm_inputs_bf16_ = false;  // training.saved_norm_inputs == BF16 (FP8 blocks, BF16 attention)
  bool tied_ = false;           // model.tie_word_embeddings: head_ is embed_
  // f32 logits per chunk of the BF16 head (HeadBf16Compute):
  // ModelOptions::head_chunk_logit_bytes.
  int64_t head_chunk_bytes_ = kDefaultHeadChunkLogitBytes;
  int64_t forward_peak_ = 0, backward_peak_ = 0;
  LabelBytes forward_peak_labels_{}, backward_peak_labels_{};
  // Takes the backend's peak since its last reset into *peak (and its labels) when larger.
  void TakePeak(int64_t* peak, LabelBytes* labels);
  TensorRef embed_, final_norm_, head_;
  Linear lhead_;
  std::vector<Block> blocks_;
  int embedding_unit_ = 0, head_unit_ = 0;
};

}  // namespace fsdp8
