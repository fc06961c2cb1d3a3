// Whether a job fits the workers' memory, from the memory plan (common/memory_plan.h): the check
// at submit (JobManager) and the choice of workers at scheduling (Scheduler::SchedulePass).
//
// A worker's memory is WorkerInfo.memory_bytes (WorkerRegistry::WorkerMemory); 0 means unknown
// and is taken as enough. A rank needs the plan's device_bytes at the mesh it runs at (world size
// and replicas: ResolvedJob plans the resolved spec, which carries the concrete R). The admission
// check (CheckFitsLargestWorkers) plans a sharding.replicas auto job at R = 1, its smallest
// plan per rank: it refuses only what fits no placement. Workers registered with memory_shared
// each get their host address's memory divided by the live memory_shared workers of that address
// (WorkerRegistry), so simulated hosts on one machine (CPU workers on 127.0.0.1 and 127.0.0.2
// without --memory_limit_mb) each count the whole machine's memory.
// The plans are the job's own (ResolvedJob::PlanAt: made once per job and world size); the
// advice of a refusal plans variants of the spec (more workers, recompute) with the job's planner.
//
// Thread-safety: functions of their arguments; ResolvedJob is internally locked.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/resolved_job.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8::coord {

// Whether a spec (defaults applied) may run at n ranks, n in its worker range aside: the global
// batch splits over n (training.microbatch, when set, per rank) and n can form its mesh
// (common/mesh.h MeshAllows: a multiple of sharding.replicas). The one rule of
// AllowedWorldSizes and Scheduler::ChooseWorldSize.
bool AllowsWorldSize(const v1::JobSpec& spec, int n);

// The world sizes a spec (defaults applied) may run at: sharding.min_workers .. max_workers that
// AllowsWorldSize, largest first. (The range's multiples of sharding.replicas alone:
// MeshWorldSizeRange, common/mesh.h.)
std::vector<int> AllowedWorldSizes(const v1::JobSpec& spec);

struct FitChoice {
  int world_size = 0;                // 0: none fits now
  std::vector<std::string> workers;  // rank order (coordinator/placement.h)
  int replicas = 0;                  // R of the mesh (auto resolved), world_size > 0
  std::vector<int> split_groups;     // replicas whose shard group spans domains (placement.h)
  std::string why;                   // world_size 0: what is missing, for the pending reason
};

// Among the free workers `free` (ids in registration order; memory by id; placement domain by id,
// coordinator/placement.h, a worker without one its own domain), the largest allowed world size n
// for which n of them hold the plan at n each (the plan of the mesh they would form), and those
// workers in rank order: PlaceMesh for a fixed sharding.replicas; for auto, the smallest R for
// which R domains each hold n / R workers that hold the plan at (n, R), one shard group per
// domain, else R = 1 on the first n that hold the plan at (n, 1): PlaceAuto (placement.h) given,
// for each R, the free workers that hold the plan at (n, R).
FitChoice ChooseFittingWorkers(ResolvedJob& job, const std::vector<std::string>& free,
                               const std::map<std::string, int64_t>& memory,
                               const std::map<std::string, std::string>& domains = {});

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
