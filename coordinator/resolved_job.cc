#include "coordinator/resolved_job.h"

#include <utility>

#include "common/spec.h"

namespace fsdp8::coord {

absl::StatusOr<MemoryPlan> PlanMemoryOf(const v1::JobSpec& resolved, int world_size) {
  return PlanMemory(resolved, world_size);
}

ResolvedJob::ResolvedJob(v1::JobSpec spec, MemoryPlanner planner)
    : spec_(std::move(spec)), planner_(planner ? std::move(planner) : MemoryPlanner(PlanMemoryOf)) {}

ResolvedJob::AtSize& ResolvedJob::AtLocked(int world_size) {
  auto it = at_.find(world_size);
  if (it != at_.end()) return it->second;
  // The one place the coordinator fills in a job's spec at a world size (the microbatch default).
  AtSize a{WithDefaults(spec_, world_size), absl::OkStatus(), nullptr};
  a.rules = ValidateSpec(a.spec, world_size, {}, /*check_files=*/false);
  return at_.emplace(world_size, std::move(a)).first->second;
}

absl::StatusOr<v1::JobSpec> ResolvedJob::SpecAt(int world_size) {
  absl::MutexLock lock(&mu_);
  const AtSize& a = AtLocked(world_size);
  if (!a.rules.ok()) return a.rules;
  return a.spec;
}

v1::JobSpec ResolvedJob::DefaultedAt(int world_size) {
  absl::MutexLock lock(&mu_);
  return AtLocked(world_size).spec;
}

absl::StatusOr<MemoryPlan> ResolvedJob::PlanAt(int world_size) {
  absl::MutexLock lock(&mu_);
  AtSize& a = AtLocked(world_size);
  if (a.plan == nullptr) {
    a.plan = std::make_unique<absl::StatusOr<MemoryPlan>>(planner_(a.spec, world_size));
  }
  return *a.plan;
}

}  // namespace fsdp8::coord
