// FaultInjection: failures a process injects on purpose, for tests and drills: the one seam
// through which the worker and the coordinator fail on command, read once from the environment
// at start (the worker's WorkerSettings, worker/settings.h; the coordinator's main).
//   - a step that runs and then fails, as an error found at the step's end (a failed kernel at
//     the final synchronisation) would fail it: FSDP8_FAULT_STEP_ERROR=RANK@STEP,... (STEP
//     0-based), once per entry for the life of the FaultInjection (the process); worker;
//   - a checkpoint shard write that fails as a full disk would, after leaving a partial .tmp file
//     behind: FSDP8_FAULT_CHECKPOINT_ENOSPC=SUBSTRING,... matched against the shard's path
//     (<dir>/rank-<r>.ckpt); worker;
//   - a crash: FSDP8_FAULT_CRASH_AT=POINT@SUBSTRING,... (or POINT alone: any path) makes the
//     process kill itself with SIGKILL when it reaches the named point while writing a file whose
//     path contains SUBSTRING. Points (kCrashPoints): in a rank's shard write (worker,
//     train/checkpoint.cc, path <dir>/rank-<r>.ckpt) shard.before_write (rank-<r>.ckpt.tmp
//     created, empty), shard.mid_write (part of the bytes written), shard.before_fsync (every byte
//     written), shard.before_rename (fsynced and closed), shard.after_rename (renamed to
//     rank-<r>.ckpt, the directory not yet fsynced, not yet reported); in the coordinator's
//     MANIFEST commit (coordinator/checkpoint_store.cc, path <dir>/step-<k>/MANIFEST) the same
//     five as manifest.before_write ... manifest.after_rename; in the coordinator's removal of a
//     step directory by retention (CheckpointStore::Retain, path <dir>/step-<k>, the directory
//     removed; kRetentionCrashPoints) retain.after_manifest_removed (its MANIFEST removed and the
//     directory fsynced, every other file still there) and retain.mid_remove (its first file
//     removed too: rank-0.ckpt; the JOB file goes last);
//   - a checkpoint read that fails: FSDP8_FAULT_CHECKPOINT_READ=SUBSTRING,... makes a worker's
//     load of a checkpoint (Assignment.load_dir, or init_dir of init.from_checkpoint) fail when
//     the step directory's path contains SUBSTRING, before any file is read; "/" matches every
//     checkpoint, so a test can prove that no checkpoint was read; worker.
// Empty items are skipped; unset or empty injects nothing.
//
// Thread-safety: StepError from one thread at a time (the daemon's job thread);
// CheckpointWriteError and CrashPoint from any thread (const).
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace fsdp8 {

// Every crash point's name, in the order a write reaches them (shard.*, then manifest.*).
extern const char* const kCrashPoints[10];
// The crash points of retention's removal of a step directory, in the order it reaches them.
extern const char* const kRetentionCrashPoints[2];

class FaultInjection {
 public:
  FaultInjection() = default;  // injects nothing
  // step_errors: the FSDP8_FAULT_STEP_ERROR syntax; checkpoint_enospc: the
  // FSDP8_FAULT_CHECKPOINT_ENOSPC syntax; crash_at: the FSDP8_FAULT_CRASH_AT syntax (see above).
  FaultInjection(absl::string_view step_errors, absl::string_view checkpoint_enospc,
                 absl::string_view crash_at = "", absl::string_view checkpoint_read = "");
  static FaultInjection FromEnvironment();

  // INTERNAL ("rank R step S failed (injected by FSDP8_FAULT_STEP_ERROR)") the first time it is
  // asked for an entry RANK@STEP equal to (rank, step); OK otherwise.
  absl::Status StepError(int rank, int64_t step);
  // RESOURCE_EXHAUSTED ("writing <path>.tmp: No space left on device (injected by
  // FSDP8_FAULT_CHECKPOINT_ENOSPC)") when `path` contains one of the substrings, after writing
  // 4096 zero bytes to <path>.tmp; OK otherwise (nothing written).
  absl::Status CheckpointWriteError(const std::string& path) const;
  // DATA_LOSS ("reading checkpoint <dir>: failed (injected by FSDP8_FAULT_CHECKPOINT_READ)")
  // when `dir` (a checkpoint's step directory) contains one of the substrings; OK otherwise. A
  // load that fails this way fails the job (a deterministic code: IsDeterministicFailure).
  absl::Status CheckpointReadError(const std::string& dir) const;
  // Whether an entry names `point` for `path` (its substring occurs in path, or it has none).
  bool CrashesAt(absl::string_view point, const std::string& path) const;
  // Kills this process with SIGKILL (after a line on stderr) when CrashesAt(point, path);
  // returns otherwise.
  void CrashPoint(absl::string_view point, const std::string& path) const;

 private:
  std::vector<std::string> step_errors_;        // "RANK@STEP", as given
  std::vector<std::string> checkpoint_enospc_;  // path substrings
  std::vector<std::string> crash_at_;           // "POINT@SUBSTRING" or "POINT"
  std::vector<std::string> checkpoint_read_;    // step directory substrings
  std::set<std::string> fired_;                 // step errors already returned
};

}  // namespace fsdp8
