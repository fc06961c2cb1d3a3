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

absl::StatusOr<std::unique_ptr<Communicator>> CreateTransport(
    int rank, int world_size, const CpuBootstrap& b, const std::string& host,
    const CpuCommOptions& options, std::string* transport);

// Sub-groups choose their transport as the world did (CreateTransport), each for itself.
CpuSubgroupFactory SubgroupFactory(const std::string& host, const CpuCommOptions& options) {
  return [host, options](int rank, int world_size, const CpuBootstrap& b) {
    return CreateTransport(rank, world_size, b, host, options, nullptr);
  };
}

// The shared-memory or Gloo communicator (not wrapped), with SubgroupFactory for its splits.
absl::StatusOr<std::unique_ptr<Communicator>> CreateTransport(
    int rank, int world_size, const CpuBootstrap& b, const std::string& host,
    const CpuCommOptions& options, std::string* transport) {
  std::unique_ptr<CpuCommunicatorBase> c;
  if (options.transport == CpuCommOptions::Transport::kAuto && world_size > 1) {
    const std::string machine =
        options.machine.empty() ? SharedMemoryCommunicator::MachineIdentity() : options.machine;
    auto shm = SharedMemoryCommunicator::Create(rank, world_size, b.store, b.prefix, b.timeout,
                                                b.bootstrap_timeout, machine);
    if (shm.ok()) {
      if (transport) *transport = "shared memory";
      c = std::move(*shm);
    } else if (shm.status().code() != absl::StatusCode::kFailedPrecondition) {
      return shm.status();
    }
  }
  if (c == nullptr) {
    if (transport) *transport = "gloo";
    auto gloo = GlooCommunicator::Create(rank, world_size, b.store, b.prefix, host, b.timeout,
                                         b.bootstrap_timeout);
    if (!gloo.ok()) return gloo.status();
    c = std::move(*gloo);
  }
  c->set_subgroup_factory(SubgroupFactory(host, options));
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateCpuCommunicator(
    int rank, int world_size, KvStore* store, const std::string& prefix, const std::string& host,
    std::chrono::milliseconds timeout, std::chrono::milliseconds bootstrap_timeout,
    const CpuCommOptions& options, std::string* transport) {
  if (bootstrap_timeout.count() <= 0) bootstrap_timeout = timeout;
  const CpuBootstrap b{store, prefix, timeout, bootstrap_timeout};
  auto c = CreateTransport(rank, world_size, b, host, options, transport);
  if (!c.ok()) return c.status();
  return MaybeOverlapped(std::move(*c), options);
}

}  // namespace fsdp8
