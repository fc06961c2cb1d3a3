#include "common/mesh.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fsdp8 {

int Mesh::CheckpointFile(int rank) const {
  if (optimizer_over_world) return OptimizerIndex(rank);
  return Replica(rank) == 0 ? ShardIndex(rank) : -1;
}

absl::StatusOr<Mesh> MeshOf(const v1::JobSpec& resolved, int world_size) {
  const v1::ShardingSpec& sh = resolved.sharding();
  const int r = sh.has_replicas() ? sh.replicas() : 1;
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world size: must be >= 1 (got ", world_size, ")"));
  }
  if (r < 1 || world_size % r != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sharding.replicas: must be >= 1 and divide the world size (got ", r,
                     " at world size ", world_size, "; auto is resolved by the coordinator)"));
  }
  Mesh m;
  m.replicas = r;
  m.shard_size = world_size / r;
  m.optimizer_over_world = sh.optimizer_sharding() == v1::OPTIMIZER_SHARDING_WORLD;
  return m;
}

bool MeshAllows(const v1::JobSpec& spec, int n) {
  const int r = spec.sharding().has_replicas() ? spec.sharding().replicas() : 1;
  return r <= 0 || n % r == 0;
}

absl::StatusOr<std::pair<int, int>> MeshWorldSizeRange(const v1::JobSpec& spec) {
  const int mn = std::max(1, spec.sharding().min_workers());
  const int mx = std::max(mn, spec.sharding().max_workers());
  int lo = 0, hi = 0;
  for (int n = mn; n <= mx; ++n) {
    if (!MeshAllows(spec, n)) continue;
    if (lo == 0) lo = n;
    hi = n;
  }
  if (lo == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sharding.replicas: must divide a world size in [sharding.min_workers, "
        "sharding.max_workers] (", spec.sharding().replicas(), " divides none of ", mn, "..", mx,
        ")"));
  }
  return std::make_pair(lo, hi);
}

v1::MeshShape MeshShapeOf(const Mesh& m) {
  v1::MeshShape out;
  out.set_replicas(m.replicas);
  out.set_shard_group_size(m.shard_size);
  out.set_optimizer_sharding(m.optimizer_over_world ? v1::OPTIMIZER_SHARDING_WORLD
                                                    : v1::OPTIMIZER_SHARDING_SHARD_GROUP);
  out.set_optimizer_shards(m.OptimizerShards());
  return out;
}

}  // namespace fsdp8
