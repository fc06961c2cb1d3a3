// Placement: which free workers become which ranks of a hybrid-sharded job (common/mesh.h:
// W = R replicas x S ranks, rank r = shard index r % S of replica r / S, a shard group is S
// consecutive ranks).
//
// A worker's domain is where its fast links end: (RegisterRequest.host,
// RegisterRequest.placement_domain: --placement_domain, or a CUDA worker's NVLink domain detected
// through NVML, worker/nvlink_domain.h), the host alone when placement_domain is empty. CPU workers
// started with different --host addresses (127.0.0.1, 127.0.0.2) are different domains.
//
// Rules (PlaceMesh):
// - R = 1: the first W workers in registration order, as flat jobs have always been placed.
// - R > 1: shard groups are dealt to domains round-robin, in the order the domains first appear
//   among the workers (registration order): replica 0 on the first domain with S workers left,
//   replica 1 on the next such domain, and so on, coming back to the first domain after the
//   last; each group takes the first S workers left in its domain. So no group spans domains when
//   the domains hold R whole groups between them, and the replicas spread over the domains.
// - When they do not (e.g. two hosts of 3 free workers for R = 3, S = 2: two whole groups), the
//   world size stays (placement never shrinks a job) and the remaining groups are made of the
//   workers left over, taken domain by domain in first-appearance order, so that each split group
//   spans as few domains as the leftovers allow. Placement::split_groups counts them; the
//   scheduler publishes a job message naming them.
// - sharding.replicas auto (PlaceAuto): the smallest D dividing W for which D domains each hold
//   W / D of the workers (the first such domains in first-appearance order) gives R = D with one
//   shard group per domain (D = 1: the job fits one domain, a flat job there); when no D does,
//   R = 1 on the first W workers, as a flat job. So auto's R is always the number of domains of
//   the chosen workers when each holds as many of them, else 1. The workers considered may
//   depend on D (the scheduler's: those that hold the memory plan of the D x W / D mesh, which
//   grows with D); each D is tried on its own list.
//
// Thread-safety: pure functions.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace fsdp8::coord {

struct PlacementWorker {
  std::string id;
  std::string domain;  // DomainOf(host, placement_domain)
};

// The domain key of a worker: host, or host + "/" + placement_domain when that is set.
std::string DomainOf(const std::string& host, const std::string& placement_domain);

struct Placement {
  std::vector<std::string> ranks;  // worker ids, index = rank; empty: too few workers
  int replicas = 0;
  int split_groups = 0;            // shard groups whose workers span more than one domain
  std::vector<int> split;          // their replica indices, ascending
};

// Places a mesh of `replicas` x world_size / replicas on `workers` (registration order). ranks is
// empty when fewer than world_size workers are given or replicas does not divide world_size.
Placement PlaceMesh(const std::vector<PlacementWorker>& workers, int world_size, int replicas);

// `replicas` shard groups of world_size / replicas workers, each inside its own domain (the first
// domains, in first-appearance order, that hold that many; the first workers of each); ranks
// empty when fewer than `replicas` domains hold a group, or replicas does not divide world_size.
Placement PlaceOnePerDomain(const std::vector<PlacementWorker>& workers, int world_size,
                            int replicas);

// The free workers (registration order) that may take part in a mesh of `replicas` x
// world_size / replicas; called once per replicas tried, replicas = 1 possibly twice.
using WorkersAt = std::function<std::vector<PlacementWorker>(int replicas)>;

// Resolves sharding.replicas auto at world_size (rules above) on the workers of `at`: each D
// dividing world_size, smallest first, on at(D); then R = 1 on the first world_size of at(1).
// ranks empty when none of these places world_size workers. The scheduler's rule
// (ChooseFittingWorkers, coordinator/memory_fit.h).
Placement PlaceAuto(const WorkersAt& at, int world_size);
// The same on one list of workers whatever D is; ranks empty when fewer than world_size workers
// are given.
Placement PlaceAuto(const std::vector<PlacementWorker>& workers, int world_size);

}  // namespace fsdp8::coord
