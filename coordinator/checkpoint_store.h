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
// Ownership (common/checkpoint_format.h, OWNER): a directory belongs to one job. Claim records the
// owner at submit (under an exclusive flock of <root>/OWNER.lock, waited for at most 10 s, then
// UNAVAILABLE); only Claim creates root, every other call that takes the lock is UNAVAILABLE
// when root is not there (storage not mounted). A store made with a job id (the job's step driver) writes only while OWNER names
// that job (a directory without OWNER and without another job's committed checkpoint is claimed
// by the first Prepare): Prepare, Commit, Abandon, Retain and RemoveLeftovers refuse with
// FAILED_PRECONDITION naming the owner otherwise. Nothing ever writes into or deletes another
// job's committed step directory: Prepare of a step whose step-<k> holds another job's committed
// checkpoint is refused (ALREADY_EXISTS), and Abandon and Retain delete only that job's step
// directories (the MANIFEST's job_id, or the JOB file Prepare writes into every step directory it
// creates). A store made without a job id (tools, tests) ignores ownership.
//
// Lease (CheckpointLease in OWNER): the coordinator that runs the owner job renews it
// (RenewLease) while the job has not ended and releases it (ReleaseLease) when it ends. Claim
// with take_over refuses a directory whose lease is another coordinator's and live
// (FAILED_PRECONDITION naming the directory, the job and that coordinator's host), whatever that
// coordinator's job table says; the claiming coordinator's own TakeOverCheck decides for its own
// jobs. A renewal by the same coordinator identity succeeds whatever the expiry (a restarted
// coordinator re-claims its running jobs' directories), unless another job owns the directory by
// then.
//
// Committed: Inspect(step_dir) is the one rule: committed (a valid MANIFEST naming the
// directory's step), MANIFEST missing (ENOENT), or unreadable (any other failure to read or
// accept it). Only a directory whose MANIFEST is missing is ever removed as a leftover.
// Leftovers (RemoveLeftovers): step-<k> directories without MANIFEST (an interrupted save, or
// retention interrupted after it removed the MANIFEST), unfinished staging directories, a staging
// directory or old copy (step-<k>.old) beside a committed step-<k> of the same job are removed,
// each logged (event checkpoint_leftover_removed); an old copy that is the only committed one of
// its step is renamed back to step-<k>. Committed and unreadable step directories, and another
// job's committed old copy, are never removed (each kept one is logged, event
// checkpoint_leftover_kept). Prepare refuses (ALREADY_EXISTS, the save is skipped) a step whose
// step-<k> is unreadable or another job's, or whose step-<k>.old is another job's or unreadable.
// Call RemoveLeftovers only while no save of the directory is in progress: the coordinator does
// at start (for its jobs' directories) and before every generation of the owner job (a failure
// fails that generation). Without a job id it refuses (FAILED_PRECONDITION) while OWNER's lease
// is live.
//
// Thread-safety: the object is immutable; concurrent calls on the same root are safe as far as the
// filesystem is (OWNER and the MANIFEST commit under the flock), but Prepare/Commit/Retain for one
// root are expected from one thread (the job's step driver).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checkpoint_format.h"
#include "common/fault_injection.h"
#include "fsdp8/v1/checkpoint.pb.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8::coord {

struct CommittedCheckpoint {
  int64_t step = 0;
  std::string dir;  // <root>/step-<k>
  v1::CheckpointManifest manifest;
  int64_t bytes() const;  // sum of the files' sizes
};

// The lease the job's saves run under (the coordinator's step driver). coordinator empty: no
// lease checks (tools, tests). Otherwise Prepare and Commit refuse (FAILED_PRECONDITION naming
// the directory, the lease's holder and its expiry) unless OWNER's lease is `coordinator`'s and
// expires more than margin_s from now (a lapsed lease may already have let another job in), and
// a directory without OWNER is claimed with a lease of lease_s, never without one.
struct SaveLeaseCheck {
  std::string coordinator;
  double lease_s = 0;
  double margin_s = 0;
};

class CheckpointStore {
 public:
  static constexpr int kFormatVersion = kManifestFormatVersion;
  static constexpr const char* kManifestName = kManifestFileName;

  using LeaseCheck = SaveLeaseCheck;

  // job_id: the job this store writes for (see Ownership above); empty: no ownership checks.
  // faults (optional, must outlive the store): Commit reaches its manifest.* crash points.
  explicit CheckpointStore(std::string root, std::string job_id = "",
                           const FaultInjection* faults = nullptr, LeaseCheck lease = {})
      : root_(std::move(root)), job_id_(std::move(job_id)), faults_(faults),
        lease_(std::move(lease)) {}
  const std::string& root() const { return root_; }

  // Decides whether the current owner may be replaced: OK allows, an error is returned by Claim
  // as is. Called under the lock.
  using TakeOverCheck = std::function<absl::Status(const v1::CheckpointOwnerEntry& owner)>;

  struct ClaimOptions {
    bool take_over = false;
    // Consulted for an owner whose lease is not another coordinator's (see Lease above).
    TakeOverCheck may_take_over;
    // The claiming coordinator's identity and its lease length: the new owner's lease. Empty: no
    // lease is written (tools, tests), and another coordinator's live lease still refuses.
    std::string coordinator;
    double lease_s = 0;
    // Another coordinator's lease refuses a take-over until clock_skew_s after its expiry (a
    // released lease, expires 0, at once): the hosts' clocks may differ by that much.
    double clock_skew_s = 0;
    // With take_over: the steps the claimant may save, (saves_after, last_save] (saves_after
    // raised to the newest committed step when saves_after_latest: checkpoint.resume_from
    // latest). On a successful take-over, *skipped (when set and last_save >= 0) lists the
    // committed step directories of other jobs in that range, "step-<k> (job X)" by step: the
    // saves the claimant will skip (Prepare).
    int64_t saves_after = 0;
    bool saves_after_latest = false;
    int64_t last_save = -1;
    std::vector<std::string>* skipped = nullptr;
  };
  // Makes `claimant` (job_id set) the owner of root (created when missing). Without OWNER, the
  // owner is the job of the newest committed checkpoint written by another job, if any (a
  // directory from before OWNER records). OK at once when claimant already owns it, or nobody
  // does (OWNER written). Another job's directory: FAILED_PRECONDITION naming that job unless
  // take_over; with take_over, refused while another coordinator's lease on it is live, else
  // may_take_over(owner) decides (and ClaimOptions::skipped is filled). A take-over whose final
  // save (last_save, when in its save range) would hit another job's committed or unreadable
  // step-<last_save> or step-<last_save>.old is refused (FAILED_PRECONDITION naming the
  // directory, the step, the other job and the ways out: resume_from latest, a larger
  // training.steps, another checkpoint.dir); earlier collisions are skipped saves.
  // On OK the claimant becomes the owner, the old one moving to OWNER's `previous` with `until`
  // set, and the lease is options.coordinator's. INTERNAL for I/O errors.
  absl::Status Claim(const v1::CheckpointOwnerEntry& claimant, const ClaimOptions& options) const;
  // Claim without a lease or a save range.
  absl::Status Claim(const v1::CheckpointOwnerEntry& claimant, bool take_over,
                     const TakeOverCheck& may_take_over) const;
  // Renews the lease of job_id's directory for `coordinator` until now + lease_s: true when
  // OWNER names job_id and its lease is coordinator's, absent or released; false (nothing
  // written) when another job owns the directory, or another coordinator holds a lease on it.
  absl::StatusOr<bool> RenewLease(const std::string& job_id, const std::string& coordinator,
                                  double lease_s) const;
  // At a coordinator's start, for a job it resumes (a store made with that job id), under one
  // lock: renews the job's lease for `coordinator` (as RenewLease; lease_s <= 0: no lease), then
  // removes the leftovers (RemoveLeftovers). FAILED_PRECONDITION, nothing removed, when the
  // renewal is refused (OWNER missing or naming another job, another coordinator's lease);
  // UNAVAILABLE when root is not there (never created here).
  absl::StatusOr<std::vector<std::string>> ResumeAndRemoveLeftovers(const std::string& coordinator,
                                                                    double lease_s) const;
  // Releases (expires = 0) coordinator's lease of job_id's directory; false when OWNER names
  // another job or the lease is another coordinator's (nothing written).
  absl::StatusOr<bool> ReleaseLease(const std::string& job_id, const std::string& coordinator) const;

  // The owner record; nullopt when root has none.
  absl::StatusOr<std::optional<v1::CheckpointDirOwner>> Owner() const;

  // "<root>/step-<k>".
  std::string StepDir(int64_t step) const;

  // Whether step_dir is a committed checkpoint: its MANIFEST is valid (ReadManifestFile) and,
  // for a directory named step-<k>, records step k.
  static bool IsCommitted(const std::string& step_dir);

  // What a step directory's MANIFEST says, the one rule every save and removal uses:
  // kCommitted: a valid MANIFEST (IsCommitted); kMissing: lstat of <step_dir>/MANIFEST reports
  // ENOENT or ENOTDIR (an unfinished save, or retention interrupted after removing it; also a
  // step_dir that does not exist); kUnreadable: anything else (an open or read error such as
  // EIO, ESTALE, EMFILE or EACCES, a torn MANIFEST, a newer format_version, a MANIFEST of another
  // step). Only a kMissing directory is ever deleted as a leftover; a kUnreadable one is kept
  // (logged) and counts as another job's checkpoint for Prepare.
  enum class ManifestState { kCommitted, kMissing, kUnreadable };
  struct Inspection {
    ManifestState state = ManifestState::kMissing;
    v1::CheckpointManifest manifest;  // kCommitted only
    absl::Status error;               // kUnreadable: why
  };
  static Inspection Inspect(const std::string& step_dir);

  // Removes the leftovers of interrupted saves and retention (see Leftovers above) and returns
  // what it removed or restored. With a job id: only while that job owns root.
  absl::StatusOr<std::vector<std::string>> RemoveLeftovers() const;

  // "<root>/.replace-step-<k>": where a save of a step that already has a committed checkpoint
  // is written (that checkpoint stays untouched until the new one is complete).
  std::string StagingDir(int64_t step) const;

  // Returns the directory the ranks write step k's files into: <root>/step-<k> (created, with
  // root), or StagingDir(k) when step-<k> is already committed by this job (a job resumed from an
  // older checkpoint saves the same step again). Either way the previously committed checkpoint of
  // step k stays intact and loadable until Commit replaces it. With a job id: ALREADY_EXISTS
  // when step-<k> holds another job's committed checkpoint (never replaced: the caller skips
  // that save); another job's uncommitted step-<k> (a leftover: this job owns the directory) is
  // removed first.
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

  // Committed checkpoints, ascending by step. A missing root is an empty list. job_id non-empty:
  // only those whose MANIFEST names that job.
  absl::StatusOr<std::vector<CommittedCheckpoint>> List(const std::string& job_id = "") const;
  // The newest committed checkpoint (of job_id when non-empty); nullopt when there is none.
  absl::StatusOr<std::optional<CommittedCheckpoint>> Latest(const std::string& job_id = "") const;

  // Deletes every committed step directory except the newest keep_last, and every uncommitted
  // step-<k> directory with k below the newest committed step (abandoned saves). Directories not
  // named step-<digits> are never touched. With a job id, only that job's committed and
  // uncommitted step directories count and are deleted. Returns the removed directories. Each
  // directory loses its MANIFEST first (durably), then its files one by one: crash points
  // retain.after_manifest_removed and retain.mid_remove (after the first file), path
  // <root>/step-<k>; a directory left half-removed is uncommitted and RemoveLeftovers' to remove.
  absl::StatusOr<std::vector<std::string>> Retain(int keep_last) const;

  // Reads and checks <step_dir>/MANIFEST and the files it lists (existence and size). For loading.
  static absl::StatusOr<CommittedCheckpoint> Open(const std::string& step_dir);
  // Reads <step_dir>/MANIFEST and checks it (not the shard files): ReadManifestFile.
  static absl::StatusOr<v1::CheckpointManifest> ReadManifest(const std::string& step_dir);
  // Checks the manifest's structure (DATA_LOSS), then that every file of `m` exists in step_dir
  // with the recorded size.
  static absl::Status VerifyFiles(const std::string& step_dir, const v1::CheckpointManifest& m);

  // OK when a job with spec `job` may load a checkpoint written with spec `saved`: the model
  // config and the precision plan must be equal. `job` resolved by the coordinator (defaults
  // applied); `saved`, a MANIFEST's, is migrated here (MigrateStoredSpec: moved fields, defaults
  // added since). The tuning section is not compared. FAILED_PRECONDITION naming the
  // differing section otherwise. Sharding, batch sizes and the optimizer may differ.
  // `field` names the spec field in the message.
  static absl::Status CheckResumeCompatible(const v1::JobSpec& job, const v1::JobSpec& saved,
                                            const std::string& step_dir,
                                            const std::string& field = "checkpoint.resume_from");

 private:
  // OK when job_id_ is empty or owns root; claims root for job_id_ when it has no owner. Call with
  // the lock held.
  absl::Status CheckOwnedLocked() const;
  // The owner a directory without OWNER has: the job of its newest committed checkpoint written
  // by a job other than `except`; nullopt when none.
  absl::StatusOr<std::optional<v1::CheckpointOwnerEntry>> LegacyOwner(const std::string& except) const;
  absl::Status WriteOwnerLocked(const v1::CheckpointDirOwner& o) const;
  absl::StatusOr<bool> RenewLeaseLocked(const std::string& job_id, const std::string& coordinator,
                                        double lease_s) const;
  absl::StatusOr<std::vector<std::string>> RemoveLeftoversLocked() const;
  // The step directories of other jobs than `job` with after < k <= last, named "step-<k> (job X)".
  std::vector<std::string> CollisionsLocked(const std::string& job, int64_t after, int64_t last) const;
  // Removes step_dir: MANIFEST first (durably), then its entries one by one (crash points).
  absl::Status RemoveStepDir(const std::string& step_dir) const;
  // Whether the step directory (committed or not) was written by job_id_ (always true without a
  // job id).
  bool Mine(const std::string& step_dir) const;

  // With a LeaseCheck: OK while OWNER's lease is lease_.coordinator's with more than margin_s
  // left. Call with the lock held, after CheckOwnedLocked.
  absl::Status CheckLeaseLocked() const;

  std::string root_;
  std::string job_id_;
  const FaultInjection* faults_;
  LeaseCheck lease_;
};

}  // namespace fsdp8::coord
