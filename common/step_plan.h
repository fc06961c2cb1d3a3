// The step plan: what one training step of a rank computes and keeps, as data. One pure function
// (MakeStepPlan) from the resolved job spec, the world size, the backend's capabilities and the
// model's options (train/options.h) decides, per block, each linear's precision and scaling
// recipe, the activation dtypes, which projections share scales and run as one GEMM, what the
// forward keeps for the backward (name, dtype, shape, bytes) and what the backward recomputes;
// per FSDP unit, its flat buffers as the shard plan lays them out; and the head's chunking. The
// model (train/model.cc) and the memory plan (common/memory_plan.cc) read these decisions from
// here instead of deciding them each on their own.
//
// Thread-safety: pure functions and plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/shard_plan.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

// The BF16 head's f32 logits per row chunk by default (FSDP8_HEAD_CHUNK_LOGIT_BYTES overrides
// it: train/options.h).
inline constexpr int64_t kDefaultHeadChunkLogitBytes = int64_t{512} << 20;

// The model's options that change the step (ModelOptions, train/options.h).
struct StepPlanOptions {
  // One GEMM per linear where projections share their scales (ModelOptions::unfused_projections).
  bool unfused_projections = false;
  // down_proj's FP8 input codes kept from the forward instead of recast in the backward
  // (ModelOptions::save_down_proj_input).
  bool save_down_proj_input = false;
  // f32 logits per chunk of the BF16 head, >= 1 (FSDP8_HEAD_CHUNK_LOGIT_BYTES).
  int64_t head_chunk_logit_bytes = kDefaultHeadChunkLogitBytes;
  // A "cpu" job runs on the CPU reference backend (Backend::Name() "cpu-ref"; BackendCaps).
  bool cpu_reference = false;
};

// What the plan needs to know of the backend.
struct BackendCaps {
  bool cuda = false;  // the CUDA backend (its own workspaces; no CPU scratch slots)
  // The CPU reference backend ("cpu-ref", also what a "cpu" job runs on where the host lacks the
  // fast backend's instructions): its composed bf16 and fused ops take f32 scratch through Alloc
  // where the fast backend takes other scratch (kernels/backend.cc, kernels/cpu).
  bool cpu_reference = false;
};
// "cuda" -> cuda; "cpu-ref" -> cpu_reference; else the fast CPU backend.
BackendCaps BackendCapsOf(const std::string& backend);

enum class Dtype { kF32 = 0, kBf16 = 1, kE4M3 = 2 };
int64_t DtypeBytes(Dtype d);  // 4, 2, 1

struct PlannedLinear {
  std::string name;                 // "q_proj", ..., "down_proj"
  int64_t in = 0, out = 0;          // features
  v1::Precision precision = v1::PRECISION_FP32;
  // FP8 linears: the activations' and grad-outputs' scaling (weights are scaled per cast).
  v1::ScalingRecipe recipe = v1::SCALING_RECIPE_UNSPECIFIED;
  // FP8 linears: the scaling granularity (LayerGranularity); UNSPECIFIED for other precisions.
  // ROWWISE and BLOCKWISE linears run Linear::Scaled (current scaling: recipe CURRENT).
  v1::Fp8Granularity granularity = v1::FP8_GRANULARITY_UNSPECIFIED;
  // Their f32 scales per GEMM operand, as Backend::QuantizeFp8Blocks lays them out (0 for
  // tensorwise linears, whose scales are single scalars): for tokens rows of activations,
  // forward X and W, dX's dY and Wᵀ, dW's dYᵀ and Xᵀ.
  int64_t forward_scales = 0, dx_scales = 0, dw_scales = 0;
};

// How long a saved tensor lives into its block's backward: to the block's end, or until the
// MLP's backward is done with it (the MLP's inputs, results and codes).
enum class Lifetime { kBlock = 0, kMlpBackward = 1 };

struct PlannedTensor {
  std::string name;             // "x_in", "q16", "gate_up16", "down_proj.x8", ...
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;   // elements per dimension
  int64_t bytes = 0;            // product of shape x DtypeBytes
  Lifetime lifetime = Lifetime::kBlock;  // saved tensors only
};

// One moment of a block's forward: what of the block is alive then, by memory label
// (common/memory_label.h): its saved tensors allocated by then, its transients and the backend's
// scratch in use (workspaces), the f32 copies of its unit's bf16 tensors made by then (gathered
// units).
struct PlannedMoment {
  std::vector<PlannedTensor> saved, work, gathered;
};

struct BlockPlan {
  v1::Precision linears = v1::PRECISION_FP32;  // LayerLinearPrecision
  // FP8 blocks: LayerGranularity (TENSORWISE otherwise). A ROWWISE or BLOCKWISE block runs the
  // generic path with f32 activations, keeping its linears' f32 inputs as a BF16 block does
  // (rowwise weights travel in BF16, blockwise ones as FP8 codes with 128 x 128 block scales: the
  // shard plan), each linear quantizing its activations at each use and rowwise weights too
  // (Linear::Scaled); no groups, no fused GEMMs, no recast.
  v1::Fp8Granularity granularity = v1::FP8_GRANULARITY_TENSORWISE;
  // FP8 linears with BF16 attention: bf16 activations between the GEMMs, FP8 inputs cast from
  // them, fused groups possible (LlamaModel::BlockForward with Block::acts16). Otherwise the generic block: f32
  // activations, each linear casting its own input.
  bool fp8_bf16 = false;
  Dtype attention = Dtype::kF32;  // the attention's compute dtype (precision.attention)
  // Projections sharing one weight scale and one grad-output scale (delayed scaling, adjacent
  // weights, widths the CUDA kernels' vector accesses need: head_dim % 8, ffn_dim % 4).
  bool group_qkv = false, group_mlp = false;
  // Those groups run as one GEMM (unless StepPlanOptions::unfused_projections).
  bool fused_qkv = false, fused_mlp = false;
  // FP8 blocks under delayed scaling: down_proj's input codes are recast in the backward from the
  // kept bf16 gate/up instead of kept from the forward.
  bool recast_down = false;
  std::vector<PlannedLinear> proj;     // q, k, v, o, gate, up, down
  // What the forward keeps for the backward (training.activation_recompute: only x_in; the rest
  // is recomputed in the backward, see recomputed).
  std::vector<PlannedTensor> saved;
  std::vector<PlannedTensor> recomputed;
  // The block's transients beyond what it keeps (saved, recomputed) at the largest moment of its
  // forward, of its MLP's backward and of its attention's backward (the MLP's saved tensors are
  // gone by then): its output, gradients, FP8 codes of grad-outputs, and the scratch the
  // backend's composed ops take ("scratch:..." bytes, E4M3 as a byte). The memory plan sums
  // these tables.
  std::vector<PlannedTensor> forward_work, backward_mlp, backward_attention;
  // The largest moment of the block's forward in training (forward_work is its work), walked
  // allocation by allocation as train/model.cc allocates: with training.activation_recompute the
  // forward keeps nothing (every tensor is work; the kept input copy is `saved`).
  PlannedMoment forward_peak;
  // The largest moment of its backward (from the incoming gradient `dout` to the block's end:
  // its saved or recomputed tensors as they are dropped, the gradients, FP8 grad-output codes and
  // transposes, the backend's scratch), and under recompute the largest moment of the recompute
  // before it (the unit's gradients are not allocated yet then).
  PlannedMoment backward_peak, recompute_peak;
};

struct PlannedBuffer {
  WireDtype wire = WireDtype::kFp32;
  int64_t padded = 0, shard = 0;  // BufferPlan::padded_numel, shard_numel (at the mesh's S)
  // A blockwise FP8 wire buffer's block scales (f32): BufferPlan::PaddedScales, ShardScales.
  int64_t padded_scales = 0, shard_scales = 0;
};
struct PlannedUnit {
  std::string name;                   // "embedding", "layers.0", ..., "head"
  std::vector<PlannedBuffer> buffers;
};

struct StepPlan {
  int world_size = 1;  // W
  Mesh mesh;           // the spec's at W (flat: S = W); the units are laid out at mesh.shard_size
  int64_t tokens = 0;     // N: microbatch * seq_len, the rows of every activation
  int microbatches = 1;   // per rank and step
  bool recompute = false;
  // Planned for the CPU reference backend (BackendCaps::cpu_reference), whose rowwise / blockwise
  // GEMMs take no scratch slots (the host composition).
  bool cpu_reference = false;
  std::vector<BlockPlan> blocks;
  std::vector<PlannedUnit> units;  // embedding, blocks, head (MakeShardPlan's order)
  bool head_bf16 = true;           // precision.lm_head BF16 (chunked) or FP32 (whole logits)
  int64_t head_chunk_rows = 0;     // HeadChunkRows(tokens, V, head_chunk_logit_bytes)
  // The head's tensors at its largest moment: the logits (a BF16 head's first chunk, its bf16
  // logit gradient and nf in bf16; an f32 head's whole logits) and the rest (the final norm's
  // output, rstd and gradient, the last block's output, the backend's scratch).
  std::vector<PlannedTensor> head_logits, head_work;
  // What the head leaves held through the blocks' backward (the final norm's gradient and rstd),
  // and the gradient reaching the embedding's backward.
  std::vector<PlannedTensor> backward_held, embedding_backward;
};

// Rows per chunk of the BF16 head: at most chunk_bytes of f32 logits (V per row), at least 1, a
// multiple of 128 where the chunk holds fewer than N rows and more than 128 (GEMM tiles).
int64_t HeadChunkRows(int64_t N, int64_t V, int64_t chunk_bytes);

// The plan of `spec` (WithDefaults applied by the caller: the resolved spec) on world_size ranks
// (W: a hybrid-sharded spec's units are those of its mesh, MakeShardPlan(spec, MeshOf(spec, W));
// sharding.replicas 0, auto, plans as 1).
// INVALID_ARGUMENT where the shard plan refuses the spec.
absl::StatusOr<StepPlan> MakeStepPlan(const v1::JobSpec& spec, int world_size,
                                      const BackendCaps& caps, const StepPlanOptions& options);

}  // namespace fsdp8
