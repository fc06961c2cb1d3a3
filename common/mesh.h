// The device mesh of a job: W ranks = R replicas x S ranks per shard group (hybrid sharding, as
// torchtitan's dp_replicate x dp_shard and Megatron-FSDP's outer/inner data-parallel groups).
//
// Rank r is shard index r % S of replica r / S: a shard group is S consecutive ranks (the
// coordinator places a group inside one placement domain: a host, or an NVLink island of one), a
// replica group is the R ranks of one shard index.
// Parameters and gradients are sharded over the shard group (the shard plan is made at S ranks)
// and replicated across replicas; the gradients are reduce-scattered within the group, then summed
// across the replica group. The optimizer state (FP32 master weights and AdamW moments) is either
// sharded like the parameters (kShardGroup: replicated across replicas) or over every rank
// (kWorld, Megatron's HFSDP): shard s of the group is split into R pieces, piece p held by the
// rank of replica p, so the state's layout is a flat world-W layout with optimizer index s * R + p.
// R = 1 is flat FSDP (S = W); S = 1 is pure data parallelism.
//
// Data: rank r always trains on the global-batch slice of rank r of a flat world-W job, so a
// hybrid job sees the same tokens per step as the flat one.
//
// Thread-safety: pure functions and immutable values.
#pragma once

#include <utility>

#include "absl/status/statusor.h"
#include "fsdp8/v1/admin.pb.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

struct Mesh {
  int replicas = 1;    // R
  int shard_size = 1;  // S, ranks per shard group
  bool optimizer_over_world = false;  // OPTIMIZER_SHARDING_WORLD

  int world_size() const { return replicas * shard_size; }
  int Replica(int rank) const { return rank / shard_size; }
  int ShardIndex(int rank) const { return rank % shard_size; }
  // Global rank of shard index `shard` in replica `replica`.
  int RankOf(int replica, int shard) const { return replica * shard_size + shard; }
  // Ranks the optimizer state is split over (S, or W with optimizer_over_world), and this rank's
  // piece's index in that flat layout (shard index, or shard index * R + replica).
  int OptimizerShards() const { return optimizer_over_world ? world_size() : shard_size; }
  int OptimizerIndex(int rank) const {
    return optimizer_over_world ? ShardIndex(rank) * replicas + Replica(rank) : ShardIndex(rank);
  }
  bool Flat() const { return replicas == 1; }
  // The checkpoint file rank `rank` writes (a mesh's checkpoint is a flat one of OptimizerShards()
  // files), or -1 when it writes none: optimizer_over_world (WORLD), every rank writes file
  // OptimizerIndex(rank); otherwise (SHARD_GROUP) the ranks of replica 0 write file = shard index
  // and the other replicas' ranks, which hold copies of those shards, write none.
  int CheckpointFile(int rank) const;
  // Whether the optimizer can run deferred into the next step's forward, per unit
  // (training.overlap_optimizer): not when the optimizer is sharded over the world with R > 1,
  // whose wire shards are rebuilt by all-gathers over the replica group. The one rule: the
  // trainer (Trainer::defers_optimizer) and the memory plan (PlanMemory) both decide by it.
  bool DefersOptimizer(bool overlap_optimizer) const {
    return overlap_optimizer && !(optimizer_over_world && replicas > 1);
  }
};

// The mesh of a spec resolved at world_size (sharding.replicas > 0: auto is resolved by the
// coordinator before). INVALID_ARGUMENT naming sharding.replicas when it is not >= 1 or does not
// divide world_size (>= 1).
absl::StatusOr<Mesh> MeshOf(const v1::JobSpec& resolved, int world_size);

// Whether n ranks can form the spec's mesh: sharding.replicas (R; unset: 1) divides n, or the
// spec says auto (0), which any n can form. The coordinator gives a job only such world sizes.
bool MeshAllows(const v1::JobSpec& spec, int n);

// The smallest and largest world sizes in [sharding.min_workers, sharding.max_workers] (min < 1
// taken as 1, max below min as min) that MeshAllows; equal when only one does. INVALID_ARGUMENT
// naming sharding.replicas when none does.
absl::StatusOr<std::pair<int, int>> MeshWorldSizeRange(const v1::JobSpec& spec);

// The mesh as the API reports it (GetShardPlan, fsdp8 plan): R, S, the optimizer sharding and its
// shard count.
v1::MeshShape MeshShapeOf(const Mesh& m);

}  // namespace fsdp8
