// Local mode (`fsdp8 run SPEC`): a coordinator and its workers as child processes of the CLI, on
// loopback, with their state in a directory derived from the spec file.
//
// State directory: LocalStateDir(spec) = "<the spec's directory>/<the spec's file name without
// its last extension>.fsdp8" (job.yaml -> ./job.fsdp8/). It holds the coordinator's state db
// (jobs.db: the job, its events, the coordinator's identity, so a rerun is the same job and
// holds the same checkpoint lease), its log (coordinator.log), one log per worker
// (worker-<i>.log), checkpoints/ for a spec without checkpoint.dir, and run.lock (one run of a
// state directory at a time). Logs are appended to.
//
// Processes: fsdp8-coordinator and fsdp8-worker from `bin_dir` (the directory of the running
// fsdp8), each in a process group of its own (a terminal's Ctrl-C reaches only the CLI, which
// stops them itself) and with PR_SET_PDEATHSIG(SIGTERM): they end with the CLI even when it is
// killed. The coordinator listens on 127.0.0.1 (a free port); CPU workers get --threads,
// CUDA workers --backend cuda --device K, one per GPU.
//
// Thread-safety: one thread owns a LocalServices (start and stop it from the main thread: the
// death signal fires when the spawning thread exits).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp8 {

struct LocalRunOptions {
  std::string bin_dir;    // holds fsdp8-coordinator and fsdp8-worker
  std::string state_dir;  // created when missing
  int workers = 1;        // worker processes to start (>= 1)
  std::string backend = "cpu";  // "cpu" or "cuda"
  int threads = 1;        // BLAS threads of each CPU worker
};

// "<dir>/<stem>.fsdp8", absolute (see above).
std::string LocalStateDir(const std::string& spec_path);
// The directory of the running executable (/proc/self/exe); "" when unknown.
std::string ExecutableDir();
// GPUs present (/dev/nvidia<N> device files).
int CountGpus();

class LocalServices {
 public:
  // Starts the coordinator, waits up to 30 s for its listening line, then starts the workers and
  // waits up to 60 s until all have registered (polled over gRPC). FAILED_PRECONDITION naming
  // the missing binary, or when another run holds the state directory (an flock on run.lock);
  // UNAVAILABLE naming the log of a process that exited or did not get ready (what was started
  // is stopped again).
  static absl::StatusOr<std::unique_ptr<LocalServices>> Start(const LocalRunOptions& options);
  // Stop().
  ~LocalServices();
  LocalServices(const LocalServices&) = delete;
  LocalServices& operator=(const LocalServices&) = delete;

  // The coordinator's "127.0.0.1:PORT".
  const std::string& address() const { return address_; }
  // SIGTERM to the workers, then to the coordinator; each gets up to 10 s, then SIGKILL. Idempotent.
  void Stop();

 private:
  LocalServices() = default;
  absl::Status StartCoordinator(const LocalRunOptions& o);
  absl::Status StartWorkers(const LocalRunOptions& o);

  int lock_fd_ = -1;  // state_dir/run.lock, flock'ed while this run lives
  pid_t coordinator_ = -1;
  std::vector<pid_t> workers_;
  std::string address_;
};

}  // namespace fsdp8
