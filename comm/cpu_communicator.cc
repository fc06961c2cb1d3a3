#include "comm/cpu_communicator.h"

#include "comm/async_communicator.h"
#include "comm/gloo_communicator.h"
#include "comm/shm_communicator.h"
#include "common/env_settings.h"

namespace fsdp8 {

CpuCommOptions CpuCommOptions::FromEnvironment() {
  CpuCommOptions o;
  if (env::GetOrEmpty(env::kCpuTransport) == "gloo") o.transport = Transport::kGloo;
  o.overlap = env::SwitchOrExit(env::kCpuCommOverlap, /*unset=*/true);
  return o;
}

namespace {

std::unique_ptr<Communicator> MaybeOverlapped(std::unique_ptr<Communicator> c,
                                              const CpuCommOptions& options) {
  if (!options.overlap || c->world_size() < 2) return c;
  return std::make_unique<AsyncCommunicator>(std::move(c));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateCpuCommunicator(
    int rank, int world_size, KvStore* store, const std::string& prefix, const std::string& host,
    std::chrono::milliseconds timeout, std::chrono::milliseconds bootstrap_timeout,
    const CpuCommOptions& options, std::string* transport) {
  if (options.transport == CpuCommOptions::Transport::kAuto && world_size > 1) {
    auto shm = SharedMemoryCommunicator::Create(rank, world_size, store, prefix, timeout,
                                                bootstrap_timeout);
    if (shm.ok()) {
      if (transport) *transport = "shared memory";
      return MaybeOverlapped(std::move(*shm), options);
    }
    if (shm.status().code() != absl::StatusCode::kFailedPrecondition) return shm.status();
  }
  if (transport) *transport = "gloo";
  auto gloo = GlooCommunicator::Create(rank, world_size, store, prefix, host, timeout,
                                       bootstrap_timeout);
  if (!gloo.ok()) return gloo.status();
  return MaybeOverlapped(std::move(*gloo), options);
}

}  // namespace fsdp8
