// Whether a job fits the workers' memory, from the memory plan (common/memory_plan.h): the check
// at submit (JobManager) and the choice of workers at scheduling (Scheduler::SchedulePass).
//
// A worker's memory is WorkerInfo.memory_bytes (WorkerRegistry::WorkerMemory); 0 means unknown
// and is taken as enough. A rank needs the plan's device_bytes at the world size it runs at.
// The plans are the job's own (ResolvedJob::PlanAt: made once per job and world size); the
// advice of a refusal plans variants of the spec (more workers, recompute) with the job's planner.
//
// Thread-safety: functions of their arguments; ResolvedJob is internally locked.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/resolved_job.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8::coord {

// The world sizes a spec (defaults applied) may run at: sharding.min_workers .. max_workers, those
// the global batch allows (Scheduler::ChooseWorldSize's rule), largest first.
std::vector<int> AllowedWorldSizes(const v1::JobSpec& spec);

struct FitChoice {
  int world_size = 0;                // 0: none fits now
  std::vector<std::string> workers;  // rank order
  std::string why;                   // world_size 0: what is missing, for the pending reason
};

// Among the free workers `free` (ids in registration order; memory by id), the largest allowed
// world size n for which n of them hold the plan at n each, and the first n such workers.
FitChoice ChooseFittingWorkers(ResolvedJob& job, const std::vector<std::string>& free,
                               const std::map<std::string, int64_t>& memory);

// OK when `memory` (every registered worker of the spec's backend, busy or not) is empty, holds a
// worker of unknown memory, or its largest worker holds the plan at some allowed world size;
// otherwise RESOURCE_EXHAUSTED naming the predicted bytes per rank, the largest worker's bytes and
// what would make it fit (more workers, activation recompute, BF16 optimizer moments).
absl::Status CheckFitsLargestWorkers(ResolvedJob& job,
                                     const std::map<std::string, int64_t>& memory);
// The same for a spec alone (defaults applied at world size 0), planned afresh (PlanMemory): for
// tools and tests.
absl::Status CheckFitsLargestWorkers(const v1::JobSpec& spec,
                                     const std::map<std::string, int64_t>& memory);

}  // namespace fsdp8::coord
