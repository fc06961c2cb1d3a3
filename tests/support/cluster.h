// A coordinator and worker daemons as child processes on loopback (ChildProcess), their logs in
// one directory. The cluster only starts and stops processes; tests talk to it over gRPC
// themselves.
//
// Not thread-safe: use from the test's main thread (see process.h on PR_SET_PDEATHSIG).
#pragma once

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/process.h"

namespace fsdp8::testing {

class LocalCluster {
 public:
  struct Binaries {
    std::string coordinator;  // fsdp8-coordinator
    std::string worker;       // fsdp8-worker
  };
  // The line the coordinator prints once it listens, followed by its host:port.
  static constexpr char kListeningPrefix[] = "fsdp8-coordinator listening on ";

  // Logs are written to log_dir/<log name>; every process is started with `options`.
  LocalCluster(Binaries binaries, std::filesystem::path log_dir, ProcessOptions options = {});
  // Stops the coordinator, then the workers in the order they were started.
  ~LocalCluster();
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  // Starts the coordinator with `flags` (after the binary's path), replacing the previous one,
  // which is stopped first unless it already exited or was killed. Waits up to `timeout` for its
  // listening line and returns the address it printed ("" when it did not start or printed none
  // in time: the log says why). address() returns it afterwards.
  std::string StartCoordinator(const std::vector<std::string>& flags, const std::string& log_name,
                               std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // Starts one more worker with `flags` (they name the coordinator: --coordinator=...) and
  // returns it; worker(num_workers() - 1) is the same process.
  ChildProcess* AddWorker(const std::vector<std::string>& flags, const std::string& log_name);

  ChildProcess* coordinator() const { return coordinator_.get(); }
  // The i-th worker started, 0-based.
  ChildProcess* worker(size_t i) const { return workers_.at(i).get(); }
  size_t num_workers() const { return workers_.size(); }
  const std::string& address() const { return address_; }
  std::filesystem::path LogPath(const std::string& log_name) const { return log_dir_ / log_name; }

 private:
  Binaries binaries_;
  std::filesystem::path log_dir_;
  ProcessOptions options_;
  std::unique_ptr<ChildProcess> coordinator_;
  std::vector<std::unique_ptr<ChildProcess>> workers_;
  std::string address_;
};

}  // namespace fsdp8::testing
