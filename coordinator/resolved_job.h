// ResolvedJob: one job's spec as the coordinator resolves it at each mesh it considers the job at
// (world size and replicas, common/mesh.h), and the job's memory plan there, each made once per
// (job, world size, replicas) and kept with
// the job (JobManager holds one per job) for the admission check at submit, every scheduling pass
// (coordinator/memory_fit.h), the Assignment's spec (JobRun) and AdminService.GetShardPlan.
//
// The spec it starts from is the job's spec as stored (Job.spec): moved fields migrated and the
// defaults that need no world size applied (ResolveSpec at world size 0, or MigrateStoredSpec for
// a job read back from the state db).
//
// Thread-safety: every method may be called from several threads; each (world size) entry is
// made once, under the object's lock (a second caller waits for the first's result).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/memory_plan.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8::coord {

// Makes the memory plan of a spec resolved at world_size: PlanMemory (common/memory_plan.h) unless
// a test injects another (JobManagerOptions::planner).
using MemoryPlanner =
    std::function<absl::StatusOr<MemoryPlan>(const v1::JobSpec& resolved, int world_size)>;

// PlanMemory with default options.
absl::StatusOr<MemoryPlan> PlanMemoryOf(const v1::JobSpec& resolved, int world_size);

class ResolvedJob {
 public:
  // spec: the job's stored spec (see above). planner: empty means PlanMemoryOf.
  explicit ResolvedJob(v1::JobSpec spec, MemoryPlanner planner = nullptr);
  ResolvedJob(const ResolvedJob&) = delete;
  ResolvedJob& operator=(const ResolvedJob&) = delete;

  // The job's stored spec (world-size free).
  const v1::JobSpec& spec() const { return spec_; }
  // sharding.replicas of the stored spec: R >= 1, or 0 for auto (unset: 1).
  int SpecReplicas() const;
  // The concrete R a call with `replicas` resolves to: the spec's own R when it names one
  // (`replicas` ignored), else (auto) `replicas`, or 1 when that is < 1.
  int ReplicasFor(int replicas) const;

  // Every call below takes the mesh as (world_size, replicas), replicas per ReplicasFor: the
  // resolved spec's sharding.replicas is that concrete R, never auto.
  // The spec resolved at the mesh (every default, training.microbatch included, and the rules
  // of ValidateSpec at that world size; the paths were checked at submit): what the Assignment
  // carries. ValidateSpec's error when it breaks a rule there (sharding.replicas not dividing
  // world_size among them).
  absl::StatusOr<v1::JobSpec> SpecAt(int world_size, int replicas = 0) ABSL_LOCKS_EXCLUDED(mu_);
  // The spec with its defaults at the mesh, whatever the rules say of it (what PlanAt plans).
  v1::JobSpec DefaultedAt(int world_size, int replicas = 0) ABSL_LOCKS_EXCLUDED(mu_);
  // The memory plan of the spec with its defaults at the mesh (the planner's result, from the
  // resolved spec, which carries the mesh; the spec rules are SpecAt's to report), made on the
  // first call for that (world size, replicas) and returned from then on.
  absl::StatusOr<MemoryPlan> PlanAt(int world_size, int replicas = 0) ABSL_LOCKS_EXCLUDED(mu_);
  // The planner (for plans of other specs derived from this one, e.g. memory_fit's advice).
  const MemoryPlanner& planner() const { return planner_; }

 private:
  struct AtSize {
    v1::JobSpec spec;    // defaults applied at the world size
    absl::Status rules;  // ValidateSpec's verdict on it
    std::unique_ptr<absl::StatusOr<MemoryPlan>> plan;  // null until asked for
  };
  AtSize& AtLocked(int world_size, int replicas) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const v1::JobSpec spec_;
  const MemoryPlanner planner_;
  absl::Mutex mu_;
  std::map<std::pair<int, int>, AtSize> at_ ABSL_GUARDED_BY(mu_);  // by (world size, R)
};

}  // namespace fsdp8::coord
