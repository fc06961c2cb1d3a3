// Child processes for tests that run the real binaries (coordinator, workers, CLI, a browser):
// spawned with their output in a log file, signalled, waited for, and never left behind.
//
// Every child is started through util-linux's setpriv with PR_SET_PDEATHSIG(SIGKILL), so it dies
// with the test process even when the test crashes before its destructors run. The signal fires
// when the spawning *thread* exits: spawn from the test's main thread (SetUpTestSuite, a test
// body). Without setpriv on the PATH the child is spawned directly.
//
// Not thread-safe: one thread owns a ChildProcess.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

namespace fsdp8::testing {

struct ProcessOptions {
  // "NAME=value" entries added to (or replacing in) the test process's environment.
  std::vector<std::string> env;
  // The child leads a process group of its own: Signal, Stop and Kill reach the whole group (a
  // browser and its helper processes), and once the leader exited, Wait kills what the group
  // left behind.
  bool own_process_group = false;
};

class ChildProcess {
 public:
  // Wait's result while the child still runs at the deadline.
  static constexpr int kStillRunning = -1000;

  // Starts argv[0] (a path; not searched on the PATH) with argv, stdout and stderr both to
  // log_path (truncated). ok() is false when the spawn failed.
  ChildProcess(const std::vector<std::string>& argv, const std::string& log_path,
               const ProcessOptions& options = {});
  // Stop().
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // True while the child was spawned and not yet reaped.
  bool ok() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  // Sends `sig` (SIGSTOP, SIGKILL, SIGTERM ...) without waiting; nothing once reaped.
  void Signal(int sig) const;
  // SIGKILL (which also ends a stopped child) and reap; true once the child is gone.
  bool Kill();
  // Polls every 20 ms up to `timeout` for the child to exit and reaps it. Returns its exit code,
  // 128 + the signal that ended it, or kStillRunning (the child keeps running).
  int Wait(std::chrono::milliseconds timeout);
  // SIGTERM, up to 5 s (polled every 100 ms) to exit, then SIGKILL; reaps. Nothing once reaped.
  void Stop();

 private:
  // Sends `sig` to the child, or to its group with own_process_group.
  void SendSignal(int sig) const;
  // After the leader was reaped: SIGKILL to what its group left behind.
  void KillGroupLeftovers() const;

  pid_t pid_ = -1;
  bool group_ = false;
};

// The whole file ("" when it cannot be read).
std::string ReadFile(const std::filesystem::path& path);
// Writes `contents` to `path`, replacing it.
void WriteFile(const std::filesystem::path& path, const std::string& contents);

// Polls `log` every 50 ms up to `timeout` for a complete line (one ending in '\n': the writer
// may be mid-line) that contains `prefix`; returns the rest of that line after `prefix`, or ""
// when none appeared in time.
std::string WaitForLogLine(const std::filesystem::path& log, const std::string& prefix,
                           std::chrono::milliseconds timeout);

}  // namespace fsdp8::testing
