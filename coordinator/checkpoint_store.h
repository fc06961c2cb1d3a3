// CheckpointStore: the coordinator's view of one checkpoint directory (spec.checkpoint.dir).
//
// Layout: <root>/step-<k>/rank-<r>.ckpt (written by the ranks) and <root>/step-<k>/MANIFEST (written
// by the coordinator, last). Both formats, and the rules a valid MANIFEST follows, are defined in
// common/checkpoint_format.h. The MANIFEST is written to MANIFEST.tmp, fsynced, renamed to
// MANIFEST, and the step directory is fsynced, so a crash leaves either no MANIFEST or a complete
// one.
//
// Committed: a step-<k> directory whose MANIFEST is valid (ReadManifestFile). Anything else
// (no MANIFEST, a torn or foreign one) is uncommitted: List/Latest skip it and Open refuses it.
// List does not touch the shard files; Open additionally checks that every listed file exists
// with the recorded size (a damaged checkpoint is refused with DATA_LOSS naming the file).
//
// Errors: NOT_FOUND (no such step directory / no MANIFEST), DATA_LOSS (invalid MANIFEST, missing or
// truncated shard file), FAILED_PRECONDITION (a MANIFEST format_version this build does not read;
// CheckResumeCompatible), INTERNAL (I/O failures, with the path and errno text).
//
// Thread-safety: the object is immutable; concurrent calls on the same root are safe as far as the
// filesystem is, but Prepare/Commit/Retain for one root are expected from one thread (the job's
// step driver).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checkpoint_format.h"
#include "fsdp8/v1/checkpoint.pb.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8::coord {

struct CommittedCheckpoint {
  int64_t step = 0;
  std::string dir;  // <root>/step-<k>
  v1::CheckpointManifest manifest;
  int64_t bytes() const;  // sum of the files' sizes
};

class CheckpointStore {
 public:
  static constexpr int kFormatVersion = kManifestFormatVersion;
  static constexpr const char* kManifestName = kManifestFileName;

  explicit CheckpointStore(std::string root) : root_(std::move(root)) {}
  const std::string& root() const { return root_; }

  // "<root>/step-<k>".
  std::string StepDir(int64_t step) const;

  // "<root>/.replace-step-<k>": where a save of a step that already has a committed checkpoint
  // is written (that checkpoint stays untouched until the new one is complete).
  std::string StagingDir(int64_t step) const;

  // Returns the directory the ranks write step k's files into: <root>/step-<k> (created, with
  // root), or StagingDir(k) when step-<k> is already committed (a job resumed from an older
  // checkpoint saves the same step again). Either way the previously committed checkpoint of step
  // k stays intact and loadable until Commit replaces it.
  absl::StatusOr<std::string> Prepare(int64_t step) const;

  // Writes manifest.step()'s MANIFEST (see the header comment). The manifest must be valid
  // (INVALID_ARGUMENT otherwise); format_version is set to kFormatVersion when 0. For a staged
  // save the MANIFEST is written into the staging directory, which then atomically trades places
  // with step-<k> (renameat2 RENAME_EXCHANGE; where the filesystem lacks it, two renames with the
  // old MANIFEST removed durably first), and the old files are removed.
  absl::Status Commit(v1::CheckpointManifest manifest) const;

  // Removes a failed save's directory: StagingDir(k) if present, else <root>/step-<k> unless it is
  // committed (a committed checkpoint is never deleted by a failed save). OK when absent.
  absl::Status Abandon(int64_t step) const;

  // Committed checkpoints, ascending by step. A missing root is an empty list.
  absl::StatusOr<std::vector<CommittedCheckpoint>> List() const;
  // The newest committed checkpoint; nullopt when there is none.
  absl::StatusOr<std::optional<CommittedCheckpoint>> Latest() const;

  // Deletes every committed step directory except the newest keep_last, and every uncommitted
  // step-<k> directory with k below the newest committed step (abandoned saves). Directories not
  // named step-<digits> are never touched. Returns the removed directories.
  absl::StatusOr<std::vector<std::string>> Retain(int keep_last) const;

  // Reads and checks <step_dir>/MANIFEST and the files it lists (existence and size). For loading.
  static absl::StatusOr<CommittedCheckpoint> Open(const std::string& step_dir);
  // Reads <step_dir>/MANIFEST and checks it (not the shard files): ReadManifestFile.
  static absl::StatusOr<v1::CheckpointManifest> ReadManifest(const std::string& step_dir);
  // Checks the manifest's structure (DATA_LOSS), then that every file of `m` exists in step_dir
  // with the recorded size.
  static absl::Status VerifyFiles(const std::string& step_dir, const v1::CheckpointManifest& m);

  // OK when a job with spec `job` may load a checkpoint written with spec `saved`: the model
  // config and the precision plan (defaults applied) must be equal. FAILED_PRECONDITION naming the
  // differing section otherwise. Sharding, batch sizes and the optimizer may differ.
  static absl::Status CheckResumeCompatible(const v1::JobSpec& job, const v1::JobSpec& saved,
                                            const std::string& step_dir);

 private:
  std::string root_;
};

}  // namespace fsdp8::coord
