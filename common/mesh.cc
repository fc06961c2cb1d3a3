#include "common/mesh.h"

#include "absl/strings/str_cat.h"

namespace fsdp8 {

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

}  // namespace fsdp8
