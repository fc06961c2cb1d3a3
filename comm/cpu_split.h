// CpuCommunicatorBase: what the CPU communicators (SharedMemoryCommunicator, GlooCommunicator)
// share for Communicator::Split. Each keeps its bootstrap (the KvStore, the key prefix and the
// timeouts it was created with) and a factory for sub-communicators. Split exchanges every
// rank's (color, key) over this communicator (Communicator::ExchangeSplit), then the members of
// each sub-group rendezvous through the same KvStore under a prefix of their own,
//   <parent prefix>split<n>/<color>/   (n: this communicator's n-th Split, 1, 2, ...),
// unique per sub-group and per split (nested splits extend it), so concurrent sub-groups never
// meet each other's keys. The factory builds the sub-communicator there: by default one of the
// parent's own kind; CreateCpuCommunicator (comm/cpu_communicator.h) installs one that picks
// shared memory or Gloo per sub-group.
//
// Lifetime: the KvStore must outlive every communicator built over it and every
// sub-communicator split from them (the worker's job owns its store and destroys its
// communicators first). A sub-communicator owns its own transport (its own segment or TCP mesh):
// parent and child may be destroyed in any order, and aborting one leaves the other usable.
//
// Thread-safety: Split as a collective (the collectives' thread); set_subgroup_factory before
// the first Split.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/kv_store.h"

namespace fsdp8 {

// How a CPU communicator rendezvoused (the arguments of its Create).
struct CpuBootstrap {
  KvStore* store = nullptr;  // may be null only for a world of 1 rank
  std::string prefix;
  std::chrono::milliseconds timeout{0};            // each collective
  std::chrono::milliseconds bootstrap_timeout{0};  // each rendezvous wait
};

// Builds rank `rank` of a sub-group of `world_size` ranks that rendezvous under `bootstrap`.
using CpuSubgroupFactory = std::function<absl::StatusOr<std::unique_ptr<Communicator>>(
    int rank, int world_size, const CpuBootstrap& bootstrap)>;

class CpuCommunicatorBase : public Communicator {
 public:
  // See Communicator::Split and this file's comment.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) final;
  // Replaces the factory of the sub-communicators (it must set its own on what it builds to
  // apply to their splits too).
  void set_subgroup_factory(CpuSubgroupFactory factory) { factory_ = std::move(factory); }
  const CpuBootstrap& bootstrap() const { return bootstrap_; }

 protected:
  CpuCommunicatorBase(CpuBootstrap bootstrap, CpuSubgroupFactory factory)
      : bootstrap_(std::move(bootstrap)), factory_(std::move(factory)) {}

 private:
  const CpuBootstrap bootstrap_;
  CpuSubgroupFactory factory_;
};

// "<prefix>split<n>/<color>/": where the sub-group of `plan` rendezvouses.
std::string SubgroupPrefix(const std::string& parent_prefix, const SplitPlan& plan);

}  // namespace fsdp8
