// The memory plan: each rank's peak device memory for a job spec on a world size, predicted
// before anything runs (the coordinator at submit and at scheduling, GetShardPlan, `fsdp8 plan`).
//
// How: PlanMemory makes the step plan (common/step_plan.h) and sums its tables at each moment of
// one rank's step where the peak can fall: each block's forward (the blocks before it keep their
// saved tensors, BlockPlan::saved; the block holds its forward_work), the head (head_logits,
// head_work), each block's backward at its MLP's and at its attention's largest moment
// (backward_mlp, backward_attention, with the block's saved or recomputed tensors still alive by
// their Lifetime, and what the head leaves held), the embedding's backward, in the first
// microbatch and in later ones (which hold every gradient shard), and the optimizer. Around them: the units' buffers as the shard plan lays them out
// (the unit computing and the one prefetched, gradients in flight), the FP8 scaling state, the
// batch, and the backends' own workspaces (the CPU backends' kept scratch slots; the CUDA
// backend's cuBLASLt workspace and tables, kernels/cuda/cuda_backend.cu). The peak is the figure
// the worker reports as StepResult.peak_memory_bytes (Backend::PeakAllocatedBytes, the max over
// the forward, backward and optimizer phases), measured at a steady step (delayed scaling with
// history; the first step casts through a few extra f32 copies, as the CURRENT recipe does at
// every step, where the plan counts them). A model of
// more than 1,024 blocks is summed with 512 and with 1,024 blocks and extrapolated linearly
// (every figure but one block's transients grows with the blocks); precision overrides of blocks
// past 1,024 are not seen then.
//
// Terms (bytes of one rank; S = a buffer's shard_numel, P = its padded_numel, both from the shard
// plan's rule: P = ceil(numel / (W * alignment)) * W * alignment, S = P / ranks per shard group;
// a flat job's group is the world. Under a mesh of R replicas x S-rank groups (sharding.replicas,
// common/mesh.h) O = S / R is a rank's optimizer piece with optimizer_sharding WORLD and R > 1,
// else O = S):
//   parameter shards   per flat buffer: the f32 master slice O*4 and the wire shard (fp8: S, bf16:
//                      S*2, fp32: none, the master is sent; O < S: an f32 copy S*4, rebuilt from
//                      the replicas' pieces)                                 FsdpParams::FsdpParams
//   gradient shards    per flat buffer S*4 (f32, accumulated over microbatches); O < S: in the
//                      last microbatch each becomes its piece O*4 once its reduce-scatter over
//                      the replica group is waited for (both while it is in flight), and the
//                      optimizer holds the pieces
//   optimizer state    per flat buffer O * OptimizerStateBytesPerElement (AdamW m and v)
//   FP8 scaling state  weight and activation scales: 16-byte slots per FP8 tensor (kScaleStride)
//                      plus amaxes                                      FsdpParams, ActScaling
//   gathered units     full buffers of the units gathered or in flight: the unit computing, the
//                      next one prefetched (prefetch depth 1; LlamaModel::ForwardBlocks), the
//                      head's and the tied embedding's; fp8 P bytes, bf16 P*2 plus f32 copies of
//                      the tensors read in f32 (norms, the embedding table, BF16 linears), fp32
//                      P*4                                 FsdpParams::Prefetch, Gather, W
//   unit gradients     full f32 gradients of the unit in backward (P*4) and of the one whose
//                      reduce-scatter is in flight; later microbatches' S*4 parts
//                                                              FsdpParams::BeginGrads, ReduceGrads
//   saved activations  what each block keeps from its forward for its backward (BlockActs in
//                      train/model.cc; only the block input, N*C*4, with
//                      training.activation_recompute); N = microbatch * seq_len tokens
//   workspaces         the temporaries of the block or head computing now (its activations before
//                      they are kept, gradients, FP8 codes and transposes of grad-outputs and
//                      weights) and the backends' scratch (kernels/backend.cc compositions and the
//                      CPU backends' kept scratch slots: two T x T f32 attention matrices, the
//                      GEMMs' f32 operands, RoPE tables; cuBLASLt workspace 32 MiB, RoPE tables
//                      and cuDNN attention workspace on CUDA); O < S: the optimizer's copy of
//                      one fp8 / bf16 wire piece, the send buffer of its replicas' all-gather
//   logits chunks      the BF16 head's per-chunk f32 logits (rows chosen so that a chunk stays
//                      within head_chunk_logit_bytes, default 512 MiB,
//                      FSDP8_HEAD_CHUNK_LOGIT_BYTES), every row's bf16 logit gradient, nf in bf16; the f32
//                      head's whole (N, V) logits     LlamaModel::HeadBf16Compute, LlamaModel::Run
//   batch              token ids and targets (N*4 each) and the step's per-token losses
//                      (local_batch * seq_len * 4)                                Trainer::RunBatch
// Outside the backend's count (CUDA only; NVML sees them, StepResult.peak_memory_bytes does not),
// device_extra:
//   CUDA context       kCudaContextBytes: the context, module images and cuBLAS/cuBLASLt/cuDNN
//                      handles of one process, and what a one-rank NCCL communicator holds:
//                      1.14 GiB, NVML's used memory of one CUDA worker less the stream-ordered
//                      pool's reserved peak (the backend's `memory pool peaks` line), the same
//                      for 1b and l3proxy on an H100 (CUDA 13; bench/RESULTS.md)
//   NCCL buffers       world_size > 1: kNcclBufferBytes per communicator (NCCL_BUFFSIZE 4 MiB x
//                      channels and peers, plus its proxy state; about 0.25 GiB at 8 ranks)
//   allocator rounding cudaMallocAsync's pool rounds blocks up (2 MiB granularity for large
//                      blocks) and keeps freed blocks it cannot reuse for a larger request:
//                      kPoolOverheadFraction of the peak, the pool's reserved peak over the
//                      backend's count peak measured on the same runs (1.083 and 1.084)
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/memory_label.h"
#include "common/step_plan.h"
#include "fsdp8/v1/admin.pb.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

// Bytes of optimizer state per parameter element of a rank's shard: AdamW's m and v, 8 (f32) or
// 4 (optimizer.state_precision BF16).
// (The one place the plan reads the optimizer state's precision from.)
int64_t OptimizerStateBytesPerElement(const v1::JobSpec& spec);

// CUDA-only constants of device_extra (see above).
inline constexpr int64_t kCudaContextBytes = int64_t{1167} << 20;
inline constexpr int64_t kNcclBufferBytes = int64_t{256} << 20;
inline constexpr double kPoolOverheadFraction = 0.084;
// The CUDA backend's own workspaces, always held (kGemmWorkspaceBytes in cuda_backend.cu).
inline constexpr int64_t kCudaGemmWorkspaceBytes = int64_t{32} << 20;

struct MemoryTerm {
  std::string name;    // "parameter shards", ... (the list above)
  int64_t bytes = 0;
};

// The model's options that change the step (the head's chunk, unfused projections, a kept
// down_proj input): the step plan's (common/step_plan.h).
using MemoryPlanOptions = StepPlanOptions;

struct MemoryPlan {
  std::string backend;  // the spec's: "cpu" or "cuda"
  int world_size = 1;
  // Peaks of the backend's own count per phase (StepResult's forward/backward/optimizer peaks).
  int64_t forward_peak_bytes = 0, backward_peak_bytes = 0, optimizer_peak_bytes = 0;
  int64_t peak_bytes = 0;          // their maximum: StepResult.peak_memory_bytes
  std::string peak_phase;          // "forward", "backward" or "optimizer"
  std::vector<MemoryTerm> terms;   // at the peak, in the order above; they sum to peak_bytes
  // Each phase's terms at its own peak, one per memory label (common/memory_label.h, the names
  // of `terms`, "unlabelled" left out): what the backend's AllocationAccount holds per label at
  // that phase's peak (StepStats::*_peak_labels). Each sums to its phase's peak bytes.
  std::vector<MemoryTerm> forward_terms, backward_terms, optimizer_terms;
  std::vector<MemoryTerm> device_extra;  // outside the count (CUDA only)
  int64_t device_bytes = 0;        // peak_bytes + device_extra: what the device must hold
  // Some figure exceeds 64-bit byte counts: it holds kBytesExceeded (no size; fits nowhere).
  bool exceeds_int64 = false;
};

// What a plan's figure holds when the true figure does not fit 64-bit byte counts (8 EiB).
inline constexpr int64_t kBytesExceeded = INT64_MAX;

// The plan of `spec`, resolved at world_size (ResolveSpec in common/spec.h: defaults applied,
// checked here with CheckDefaulted, never filled in), on world_size ranks in the spec's mesh
// (sharding.replicas; auto, 0, plans as 1 until resolved); the worst rank (all ranks hold the
// same shard sizes). The SHARD_GROUP replica-group all-reduce runs in place: no bytes. INVALID_ARGUMENT for world_size < 1, a spec not resolved at
// world_size, or a model whose sizes the spec rules refuse (validate first for the exact message). Sizes too large for
// 64-bit byte counts hold kBytesExceeded and set exceeds_int64 (such a job fits nowhere).
absl::StatusOr<MemoryPlan> PlanMemory(const v1::JobSpec& spec, int world_size,
                                      const MemoryPlanOptions& options = {});

v1::MemoryPlan ToProto(const MemoryPlan& plan);

// "1.23 GiB" / "512 MiB" / "100 B": bytes for people; kBytesExceeded reads "exceeds 8 EiB".
std::string MemoryBytes(int64_t bytes);
// "1.23 GiB (1320702443 bytes)", or "exceeds 8 EiB" for kBytesExceeded (no saturated count).
std::string MemoryBytesAndCount(int64_t bytes);
// The plan's `n` largest terms at its peak (device_extra included), largest first:
// "saved activations 1.20 GiB, workspaces 512.0 MiB".
std::string LargestTerms(const MemoryPlan& plan, int n = 3);

}  // namespace fsdp8
