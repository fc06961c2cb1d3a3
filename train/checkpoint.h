// Rank shard files of a sharded checkpoint: <step dir>/rank-<r>.ckpt (docs/architecture.md,
// Checkpoints).
// The coordinator chooses the step directory and writes its MANIFEST after every rank reported
// CheckpointSaved; this module only writes and reads the rank files.
//
// The file format (header, per-buffer shards of master weights and AdamW moments (f32, or bf16
// with optimizer.state_precision BF16: kept in their precision), replicated
// scaling state, trailer with CRC-32) is defined and documented in common/checkpoint_format.h;
// this module maps a rank's FsdpParams and trainer state onto it. A file loads into any world size
// of the same model and precision plan (reshard); the scaling state is replicated (identical on
// every rank).
//
// Errors name the file. Save: the file is written to rank-<r>.ckpt.tmp, fsynced, renamed and the
// directory fsynced, so a failure (e.g. RESOURCE_EXHAUSTED for a full disk) leaves no
// rank-<r>.ckpt behind and never touches another step directory. Load: NOT_FOUND for a missing
// rank file, DATA_LOSS for a checksum mismatch, truncation or a malformed file,
// FAILED_PRECONDITION for a file of another model / precision plan / world size / step or ranks
// that disagree on the replicated state.
//
// Checkpoints of a hybrid-sharded job (common/mesh.h) are mesh-independent: they hold the
// optimizer state's flat layout, Mesh::OptimizerShards() rank files. SHARD_GROUP: the ranks of
// replica 0 write, file index = shard index (a world-S checkpoint); WORLD: every rank writes its
// piece as file Mesh::OptimizerIndex(rank) (a world-W checkpoint). A file's buffers carry their
// own padding (a multiple of W x alignment for a mesh), so any mesh, flat included, loads any
// checkpoint of the same model and precision plan by global element offset.
//
// Thread-safety: the functions touch only their arguments; the trainer's thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/checkpoint_format.h"
#include "common/fault_injection.h"
#include "common/mesh.h"
#include "common/scaling.h"
#include "common/shard_plan.h"
#include "fsdp8/v1/spec.pb.h"
#include "fsdp8/v1/worker.pb.h"
#include "train/fsdp.h"
#include "train/fp8_linear.h"
#include "train/trainer.h"

namespace fsdp8 {

// CheckpointFileName and LayoutFingerprint: common/checkpoint_format.h.

// What rank `rank` of a job of mesh `mesh` contributes to a checkpoint.
struct CheckpointRole {
  bool writes = true;  // false: SaveShard writes nothing (a SHARD_GROUP replica other than 0)
  int file_index = 0;  // its file: CheckpointFileName(file_index) (Mesh::OptimizerIndex(rank))
  int files = 1;       // rank files in the whole checkpoint (Mesh::OptimizerShards()): the
                       // saved world size that LoadShards and the MANIFEST take
};
CheckpointRole CheckpointRoleOf(const Mesh& mesh, int rank);

// Human-readable model dims and precision plan of a spec (defaults applied by the caller).
std::string SpecDescription(const v1::JobSpec& spec);

// The replicated (non-sharded) part of a rank file.
struct ReplicatedState {
  int64_t step = 0;
  int64_t adamw_step = 0;
  std::vector<WeightScaling> weight_scaling;
  std::vector<ScalingState> act_scaling;
};

// Writes dir/rank-<rank>.ckpt (dir is created when missing) from `params` (this rank's optimizer
// piece: rank = params.OptimizerIndex(), world_size = params.OptimizerShards(), else
// INVALID_ARGUMENT) and `state`. On success fills out->{step, rank (= `rank`), file, bytes,
// crc32} (job_id is the caller's). faults (optional): its shard.* crash points
// (common/fault_injection.h) are reached on the way.
absl::Status WriteShardFile(FsdpParams& params, int rank, int world_size,
                            const std::string& description, const ReplicatedState& state,
                            const std::string& dir, v1::CheckpointSaved* out,
                            const FaultInjection* faults = nullptr);
// Reads dir/rank-0..saved_world_size-1.ckpt, verifies them and sets this rank's master, m and v
// shards of `params` (its optimizer piece, any mesh) from the concatenated saved buffers
// (moments saved in another precision than params.moment_dtype() are converted: bf16 to f32
// exactly, f32 to bf16 rounded to nearest even);
// returns rank 0's replicated state in *state after checking that every file agrees with it.
// Touches params only when every file verified. No collectives; the caller re-casts weights.
// job_spec (optional): the loading job's resolved spec. When it has rowwise / blockwise blocks
// and the files were written under the same model with every block tensorwise, every block
// rowwise, every block blockwise, or the job's plan with rowwise and blockwise swapped (the layout
// fingerprint says which), the files load across the layouts, tensor by tensor by name (rowwise
// linears sit in BF16 buffers, blockwise ones in blockwise FP8 wire buffers, tensorwise ones in
// FP8 buffers; padding is never read); the caller then keeps only the scaling state its model has
// (LoadShards does).
absl::Status ReadShardFiles(const std::string& dir, int saved_world_size,
                            const std::string& description, FsdpParams* params,
                            ReplicatedState* state, const v1::JobSpec* job_spec = nullptr);

// Trainer level. SaveShard: the state after `step` completed optimizer steps (call between steps);
// FAILED_PRECONDITION when the trainer's state is not that (trainer.CompletedSteps() != step).
// Under a mesh it writes file CheckpointRoleOf(mesh, rank).file_index, or nothing when the role
// does not write: then it fills only out->{step, rank} (file empty). out->rank is the trainer's
// (global) rank either way. Collective: it applies the updates the last step deferred
// (Trainer::ApplyPendingUpdates) on every rank, a writer or not.
absl::Status SaveShard(Trainer& trainer, int64_t step, const std::string& dir,
                       v1::CheckpointSaved* out, const FaultInjection* faults = nullptr);
// Collective (every rank calls it): loads the checkpoint of saved_world_size rank files (the
// files count of the writing job's CheckpointRole; any mesh loads it),
// requires its step to equal start_step, restores the scaling state, then re-casts the FP8 / bf16
// weight shards from the loaded master weights with amax recomputed from them (C08). On error
// the trainer must be discarded.
absl::Status LoadShards(Trainer* trainer, const std::string& dir, int saved_world_size,
                        int64_t start_step);
// Collective: a fresh job's initial state from another job's committed checkpoint
// (spec.init.from_checkpoint, read only): its master weights; with optimizer_state its AdamW
// moments and step counter (Trainer::SetAdamWOffset), else zero moments; with fp8_state its
// scaling state, else the fresh one. The job then starts at step 0; the FP8 / bf16 wire shards
// are re-cast from the loaded masters. Errors as LoadShards.
absl::Status LoadInitialShards(Trainer* trainer, const std::string& dir, int saved_world_size,
                               bool optimizer_state, bool fp8_state);

}  // namespace fsdp8
