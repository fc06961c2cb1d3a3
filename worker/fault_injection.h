// FaultInjection: failures a worker injects on purpose, for tests and drills, at two points of
// the daemon (worker/daemon.cc):
//   - a step that runs and then fails, as an error found at the step's end (a failed kernel at
//     the final synchronisation) would fail it: FSDP8_FAULT_STEP_ERROR=RANK@STEP,... (STEP
//     0-based), once per entry for the life of the FaultInjection (the process);
//   - a checkpoint shard write that fails as a full disk would, after leaving a partial .tmp file
//     behind: FSDP8_FAULT_CHECKPOINT_ENOSPC=SUBSTRING,... matched against the shard's path
//     (<dir>/rank-<r>.ckpt).
// Empty items are skipped; unset or empty injects nothing. The daemon holds one, parsed once from
// the environment at start (WorkerSettings, worker/settings.h).
//
// Thread-safety: StepError and CheckpointWriteError from one thread at a time (the daemon's job
// thread).
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace fsdp8 {

class FaultInjection {
 public:
  FaultInjection() = default;  // injects nothing
  // step_errors: the FSDP8_FAULT_STEP_ERROR syntax; checkpoint_enospc: the
  // FSDP8_FAULT_CHECKPOINT_ENOSPC syntax (see above).
  FaultInjection(absl::string_view step_errors, absl::string_view checkpoint_enospc);
  static FaultInjection FromEnvironment();

  // INTERNAL ("rank R step S failed (injected by FSDP8_FAULT_STEP_ERROR)") the first time it is
  // asked for an entry RANK@STEP equal to (rank, step); OK otherwise.
  absl::Status StepError(int rank, int64_t step);
  // RESOURCE_EXHAUSTED ("writing <path>.tmp: No space left on device (injected by
  // FSDP8_FAULT_CHECKPOINT_ENOSPC)") when `path` contains one of the substrings, after writing
  // 4096 zero bytes to <path>.tmp; OK otherwise (nothing written).
  absl::Status CheckpointWriteError(const std::string& path) const;

 private:
  std::vector<std::string> step_errors_;        // "RANK@STEP", as given
  std::vector<std::string> checkpoint_enospc_;  // path substrings
  std::set<std::string> fired_;                 // step errors already returned
};

}  // namespace fsdp8
