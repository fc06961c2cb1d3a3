// The communicator of a CPU job's rank: shared memory when every rank of the generation runs on
// this machine (comm/shm_communicator.h), Gloo over TCP otherwise (comm/gloo_communicator.h). Both
// give the same results bit for bit; shared memory needs no threads of its own and no sockets.
// With 2 or more ranks either runs its collectives on one helper thread per rank
// (comm/async_communicator.h) unless CpuCommOptions::overlap is off.
//
// Split (Communicator::Split, comm/cpu_split.h) makes the same choice per sub-group: shared
// memory when every rank of the sub-group shares this machine (e.g. a shard group inside one
// host), Gloo otherwise (a replica group across hosts), whatever the parent's transport; with
// the transport set to Gloo, Gloo. A wrapped communicator's sub-communicators are wrapped too.
//
// Thread-safety: CreateCpuCommunicator may run on several threads at once (one per rank).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/kv_store.h"

namespace fsdp8 {

struct CpuCommOptions {
  // FSDP8_CPU_TRANSPORT: "gloo" always uses Gloo; unset or "auto" uses shared memory where every
  // rank shares this machine. Every rank of a job must use the same value.
  enum class Transport { kAuto, kGloo };
  Transport transport = Transport::kAuto;
  // FSDP8_CPU_COMM_OVERLAP: "0" runs the collectives on the caller's thread; unset or any other
  // value runs those of a job of 2 or more ranks on a helper thread (comm/async_communicator.h),
  // so that FSDP's all-gathers and reduce-scatters overlap compute. Ranks may differ here.
  bool overlap = true;
  // This rank's machine as the shared-memory choice compares it across ranks; "" (the default):
  // SharedMemoryCommunicator::MachineIdentity(). Tests set it to place ranks on "machines".
  std::string machine;

  static CpuCommOptions FromEnvironment();
};

// Builds rank `rank` of `world_size`'s communicator, rendezvousing through `store` under `prefix`
// (see SharedMemoryCommunicator::Create and GlooCommunicator::Create for the arguments; `host` is
// the address Gloo's peers reach this rank at). *transport (when given) is set to "shared memory"
// or "gloo". With options.overlap and world_size > 1 the communicator is wrapped in an
// AsyncCommunicator. Errors: those of the rendezvous and of GlooCommunicator::Create.
// `store` must outlive the communicator and every sub-communicator split from it: Split
// rendezvouses each sub-group through it (comm/cpu_split.h).
absl::StatusOr<std::unique_ptr<Communicator>> CreateCpuCommunicator(
    int rank, int world_size, KvStore* store, const std::string& prefix, const std::string& host,
    std::chrono::milliseconds timeout, std::chrono::milliseconds bootstrap_timeout,
    const CpuCommOptions& options, std::string* transport = nullptr);

}  // namespace fsdp8
