// Rank shard files of a sharded checkpoint: <step dir>/rank-<r>.ckpt (docs/architecture.md,
// Checkpoints).
// The coordinator chooses the step directory and writes its MANIFEST after every rank reported
// CheckpointSaved; this module only writes and reads the rank files.
//
// File format, version 1. All integers and floats little-endian; f32 as IEEE-754 bits.
//   header   char[8]  magic "FSDP8CKP"
//            u32      format version (1)
//            i32      rank, i32 world_size        (of the job that wrote the file)
//            i64      step                        (completed optimizer steps = next step to run)
//            u64      layout fingerprint          (LayoutFingerprint of the shard plan)
//            str      description                 (model dims + precision plan, for errors)
//            u32      number of flat buffers
//   buffers  per FSDP unit and flat buffer, in plan order:
//            u32 unit, u32 buffer, u32 wire dtype (WireDtype), u32 0
//            i64 numel, i64 padded_numel, i64 shard_numel
//            f32[shard_numel] FP32 master, f32[shard_numel] AdamW m, f32[shard_numel] AdamW v
//            (rank r's slice [r * shard_numel, (r + 1) * shard_numel) of the flat buffer; padding 0)
//   scaling  u32 n; n x {str name, f32 scale, f32 scale_inv, f32 amax}      FP8 weight scales
//            u32 n; n x {str name, u8 e5m2, u8 initialised, u16 0, f32 scale, f32 scale_inv,
//                        u32 h, f32[h] amax history (newest first)}          activation / grad-output
//            i64      AdamW step counter (= step: step k runs AdamW with counter k + 1)
//   trailer  char[8]  "FSDP8END", u32 CRC-32 of every byte before the trailer
// str = u32 length + bytes. CRC-32 is zlib's crc32 (IEEE 802.3 polynomial, the same as
// Python's zlib.crc32); CheckpointSaved.crc32 carries the CRC-32 of the whole file,
// trailer included.
// The layout fingerprint depends on the units, buffers, wire dtypes and tensors (names, shapes) of
// the plan but not on the world size or alignment, so a file loads into any world size of the
// same model and precision plan (reshard); the scaling state is replicated (identical on every
// rank). There is no RNG state or data position: both are functions of (seed, step).
//
// Errors name the file. Save: the file is written to rank-<r>.ckpt.tmp, fsynced, renamed and the
// directory fsynced, so a failure (e.g. RESOURCE_EXHAUSTED for a full disk) leaves no
// rank-<r>.ckpt behind and never touches another step directory. Load: NOT_FOUND for a missing
// rank file, DATA_LOSS for a checksum mismatch, truncation or a malformed file,
// FAILED_PRECONDITION for a file of another model / precision plan / world size / step or ranks
// that disagree on the replicated state.
//
// Thread-safety: the functions touch only their arguments; the trainer's thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/scaling.h"
#include "common/shard_plan.h"
#include "fsdp8/v1/spec.pb.h"
#include "fsdp8/v1/worker.pb.h"
#include "train/fsdp.h"
#include "train/fp8_linear.h"
#include "train/trainer.h"

namespace fsdp8 {

inline constexpr uint32_t kCheckpointFormatVersion = 1;

// "rank-<r>.ckpt".
std::string CheckpointFileName(int rank);
// FNV-1a 64 of the plan's units, buffers, wire dtypes and tensors (name, shape, numel).
uint64_t LayoutFingerprint(const ShardPlan& plan);
// Human-readable model dims and precision plan of a spec (defaults applied by the caller).
std::string SpecDescription(const v1::JobSpec& spec);

// The replicated (non-sharded) part of a rank file.
struct ReplicatedState {
  int64_t step = 0;
  int64_t adamw_step = 0;
  std::vector<WeightScaling> weight_scaling;
  std::vector<ScalingState> act_scaling;
};

// Writes dir/rank-<rank>.ckpt (dir is created when missing) from `params` (this rank's shards
// under params.plan() with `world_size` ranks) and `state`. On success fills out->{step, rank,
// file, bytes, crc32} (job_id is the caller's).
absl::Status WriteShardFile(const FsdpParams& params, int rank, int world_size,
                            const std::string& description, const ReplicatedState& state,
                            const std::string& dir, v1::CheckpointSaved* out);
// Reads dir/rank-0..saved_world_size-1.ckpt, verifies them and sets this rank's master, m and v
// shards of `params` (plan: params.plan(), any world size) from the concatenated saved buffers;
// returns rank 0's replicated state in *state after checking that every file agrees with it.
// Touches params only when every file verified. No collectives; the caller re-casts weights.
absl::Status ReadShardFiles(const std::string& dir, int saved_world_size,
                            const std::string& description, FsdpParams* params,
                            ReplicatedState* state);

// Trainer level. SaveShard: the state after `step` completed optimizer steps (call between steps);
// FAILED_PRECONDITION when the trainer's state is not that (trainer.CompletedSteps() != step).
absl::Status SaveShard(const Trainer& trainer, int64_t step, const std::string& dir,
                       v1::CheckpointSaved* out);
// Collective (every rank calls it): loads the checkpoint written by saved_world_size ranks,
// requires its step to equal start_step, restores the scaling state, then re-casts the FP8 / bf16
// weight shards from the loaded master weights with amax recomputed from them (C08). On error
// the trainer must be discarded.
absl::Status LoadShards(Trainer* trainer, const std::string& dir, int saved_world_size,
                        int64_t start_step);

}  // namespace fsdp8
