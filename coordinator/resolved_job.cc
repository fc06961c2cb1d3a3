#include "coordinator/resolved_job.h"

#include <utility>

#include "common/spec.h"

namespace fsdp8::coord {

absl::StatusOr<MemoryPlan> PlanMemoryOf(const v1::JobSpec& resolved, int world_size) {
  return PlanMemory(resolved, world_size);
}

ResolvedJob::ResolvedJob(v1::JobSpec spec, MemoryPlanner planner)
    : spec_(std::move(spec)), planner_(planner ? std::move(planner) : MemoryPlanner(PlanMemoryOf)) {}

int ResolvedJob::SpecReplicas() const {
  return spec_.sharding().has_replicas() ? spec_.sharding().replicas() : 1;
}

int ResolvedJob::ReplicasFor(int replicas) const {
  const int own = SpecReplicas();
  if (own != 0) return own;
  return replicas < 1 ? 1 : replicas;
}

ResolvedJob::AtSize& ResolvedJob::AtLocked(int world_size, int replicas) {
  const int r = ReplicasFor(replicas);
  auto it = at_.find({world_size, r});
  if (it != at_.end()) return it->second;
  // The one place the coordinator fills in a job's spec at a mesh (the microbatch default, and
  // sharding.replicas auto made the placement's concrete R).
  AtSize a{WithDefaults(spec_, world_size), absl::OkStatus(), nullptr};
  a.spec.mutable_sharding()->set_replicas(r);
  a.rules = ValidateSpec(a.spec, world_size, {}, /*check_files=*/false);
  return at_.emplace(std::make_pair(world_size, r), std::move(a)).first->second;
}

absl::StatusOr<v1::JobSpec> ResolvedJob::SpecAt(int world_size, int replicas) {
  absl::MutexLock lock(&mu_);
  const AtSize& a = AtLocked(world_size, replicas);
  if (!a.rules.ok()) return a.rules;
  return a.spec;
}

v1::JobSpec ResolvedJob::DefaultedAt(int world_size, int replicas) {
  absl::MutexLock lock(&mu_);
  return AtLocked(world_size, replicas).spec;
}

absl::StatusOr<MemoryPlan> ResolvedJob::PlanAt(int world_size, int replicas) {
  absl::MutexLock lock(&mu_);
  AtSize& a = AtLocked(world_size, replicas);
  if (a.plan == nullptr) {
    a.plan = std::make_unique<absl::StatusOr<MemoryPlan>>(planner_(a.spec, world_size));
  }
  return *a.plan;
}

}  // namespace fsdp8::coord
