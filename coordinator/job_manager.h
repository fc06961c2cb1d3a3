// JobManager: the coordinator's job table — submission (validation, idempotency), job states, the
// per-job event log that WatchJob streams, and persistence through JobStore (SQLite).
//
// States: PENDING -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED, and
// STARTING/RUNNING -> RECOVERING -> STARTING (a failed generation restarted), and
// CANCELLED | FAILED -> PENDING by Resume only. An ended job changes no other way; the transition
// methods refuse it with FAILED_PRECONDITION, which is how a step driver notices that its job was
// cancelled underneath it.
//
// Events: every job has events with seq 1, 2, 3, ... (the seq counter is persisted, so it continues
// after a restart). The last `max_events_per_job` events are kept in memory and in the state db,
// which Open() reads them back from; Watch streams those after a given seq and then blocks for new
// ones until the job ends. The final event of a job carries its terminal state.
//
// Checkpoint directories: Submit claims checkpoint.dir (CheckpointStore::Claim) with this
// coordinator's lease (its identity is kept in the state db, JobStore::CoordinatorId); a thread
// renews the leases of jobs that have not ended, and Finish and Cancel release a job's lease
// before the job is seen to end, unless a run of the job may still be writing (Cancel, a failure):
// then once the run is joined (RunJoined). A renewal that fails (an I/O error, the directory not there:
// storage not mounted, never created by a lease call) is retried every round; a job stops being
// renewed only when it ends or OWNER names another job. Open puts every job that has not ended
// and has a checkpoint.dir under renewal, and for each renews its lease and then removes the
// leftovers of interrupted saves and retention under one lock
// (CheckpointStore::ResumeAndRemoveLeftovers, each removal logged; nothing when the directory is
// no longer the job's); an ended job's lease is released and its directory left alone.
//
// Re-adoption (readopt_window > 0): a job that was RUNNING (or was waiting for re-adoption when the
// previous coordinator stopped) and has its generation's worker_ids becomes RECOVERING with the
// reason "coordinator restarted: re-adopting the N ranks of generation G (waiting up to W s)",
// keeping its generation and worker_ids and counting no restart; it is left out of PendingJobs
// while the scheduler waits for those workers to report it (RegisterRequest.held_job). The
// scheduler then either re-adopts it (MarkReadopting: STARTING on the same generation and
// workers, no checkpoint read) or gives up (ReadoptFailed: the path below, its reason saying
// why). Otherwise:
// Restart: Open() loads every job. Those that were STARTING, RUNNING or RECOVERING become
// RECOVERING ("recovering from a coordinator restart (restart n of max)", counted in Job.restarts
// unless already RECOVERING) when they have a checkpoint.dir and restarts left, so the scheduler
// resumes them from their latest committed checkpoint; otherwise FAILED ("coordinator restarted
// (...)"). PENDING jobs stay pending; request ids are remembered.
//
// Bounds: ListPage hands the table out a page at a time (page size and bytes bounded); Delete and
// the retention of ended jobs (JobManagerOptions::retain_ended_*) remove ended jobs from the table
// and the state db, never their checkpoints.
//
// Thread-safety: every method is safe to call from several threads. Listeners are called without
// the internal lock held. The locks' use is checked by clang's -Wthread-safety (ABSL_GUARDED_BY,
// ABSL_EXCLUSIVE_LOCKS_REQUIRED on the ...Locked helpers).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/job_store.h"
#include "coordinator/resolved_job.h"
#include "fsdp8/v1/admin.pb.h"
#include "fsdp8/v1/jobs.pb.h"

namespace fsdp8::coord {

struct JobManagerOptions {
  std::string state_db = ":memory:";      // SQLite path; ":memory:" for tests
  std::vector<std::string> data_roots;     // dataset paths must lie under one; empty = anywhere
  bool check_files = true;                 // validate that data files exist and are token shards
  size_t max_events_per_job = 10000;
  // Ended jobs (SUCCEEDED, FAILED, CANCELLED) kept in the table: the retain_ended_jobs most
  // recently ended, none that ended more than retain_ended_age ago (0: no age limit). Older ones
  // are removed from the table and the state db (never their checkpoints) whenever a job ends, at
  // Open and on ApplyRetention.
  size_t retain_ended_jobs = 1000;
  std::chrono::seconds retain_ended_age{30 * 24 * 3600};
  // The lease on each job's checkpoint.dir (CheckpointLease, coordinator/checkpoint_store.h):
  // written at submit, renewed every checkpoint_lease / 4 while the job has not ended (and at
  // Open for the jobs it resumes), released when the job ends. Another coordinator refuses a
  // take-over of the directory while the lease is live. It must outlast a restart of this
  // coordinator, which renews it again at Open. 0: no leases are written.
  std::chrono::milliseconds checkpoint_lease{std::chrono::seconds(120)};
  // How long a restarted coordinator waits at most for the ranks of a job's running generation to
  // come back holding it (RegisterRequest.held_job) before it resumes the job from its checkpoint
  // instead; counted from Open. 0 (the default here; fsdp8-coordinator's --readopt_window_s is
  // 30 s): no re-adoption (every running job resumes from its checkpoint).
  std::chrono::milliseconds readopt_window{0};
  // Makes each job's memory plans (ResolvedJob, once per job and world size); empty: PlanMemory.
  // Tests inject one that counts its calls.
  MemoryPlanner planner;
};

// A job waiting for re-adoption after a coordinator restart (JobManager::ReadoptCandidates).
struct ReadoptCandidate {
  v1::Job job;  // RECOVERING, its generation and worker_ids those of the generation that ran
  std::chrono::steady_clock::time_point until;  // when the wait for its ranks ends
};
// The start of the reason of a job waiting for re-adoption (kept in the state db: a coordinator
// that restarts again meanwhile waits for the ranks again).
inline constexpr char kReadoptReasonPrefix[] = "coordinator restarted: re-adopting ";

// One page of JobManager::ListPage.
struct JobPage {
  std::vector<v1::Job> jobs;
  std::string next_page_token;  // empty on the last page
};
inline constexpr int kDefaultPageSize = 100;
inline constexpr int kMaxPageSize = 1000;
inline constexpr int kMaxListEvents = 100;  // events per job in a page

class JobManager {
 public:
  // Opens the state database and loads the job table and each job's stored events (see "Restart"
  // above). JobStore's errors: INTERNAL from SQLite, DATA_LOSS for a row that does not parse.
  static absl::StatusOr<std::unique_ptr<JobManager>> Open(const JobManagerOptions& options);
  ~JobManager();

  // ---- client side ----

  // Validates `spec` (defaults applied; checked at both min_workers and max_workers) and creates a
  // PENDING job. A field given in its old place (kMovedFields, common/spec.h) is moved to its new
  // one: the job's spec holds it there, and the "submitted" event and the coordinator's log carry
  // MigrateSpec's warning naming the new place (INVALID_ARGUMENT when both places disagree). With check_files and a checkpoint.resume_from naming a step directory, that
  // checkpoint must be committed and intact and have the job's model and precision
  // (FAILED_PRECONDITION otherwise; "latest" is resolved when the job starts). INVALID_ARGUMENT names the field and the rule. A non-empty request_id that was
  // seen before returns that job when the spec (defaults applied) is the same, and ALREADY_EXISTS
  // otherwise; an empty request_id always creates a new job. owner: the submitting user's name
  // (Job.owner); a request_id already used by another owner is ALREADY_EXISTS.
  // checkpoint.dir is claimed for the new job (CheckpointStore::Claim): FAILED_PRECONDITION naming
  // the owner when another job owns it, unless checkpoint.take_over and that job has ended or is
  // no longer in the table (deleted).
  absl::StatusOr<v1::Job> Submit(const std::string& request_id, const v1::JobSpec& spec,
                                 const std::string& owner = "");
  // NOT_FOUND for an unknown id.
  absl::StatusOr<v1::Job> Get(const std::string& job_id) const;
  // Every job, oldest first.
  std::vector<v1::Job> List() const;
  // One page of the table, oldest first (by create time, then id): up to page_size jobs (0:
  // kDefaultPageSize; at most kMaxPageSize) after the one page_token names ("": from the first),
  // only `owner`'s when set, each with up to `events` of its newest events (at most
  // kMaxListEvents), and at most max_bytes of serialized jobs (but at least one job). Tokens stay
  // valid across deletions and coordinator restarts. INVALID_ARGUMENT for a negative page_size or
  // events, or a page_token that ListPage did not make.
  absl::StatusOr<JobPage> ListPage(const std::optional<std::string>& owner, int page_size,
                                   const std::string& page_token, int events,
                                   int64_t max_bytes) const;
  // Removes an ended job from the table and the state db; its checkpoints stay. NOT_FOUND for an
  // unknown id, FAILED_PRECONDITION for a job that has not ended (cancel it first).
  absl::Status Delete(const std::string& job_id);
  // Applies the retention rule of ended jobs now (the age part matters between job ends); returns
  // how many were removed.
  size_t ApplyRetention();
  // Jobs in the table.
  size_t size() const;
  // A PENDING job becomes CANCELLED at once; a STARTING/RUNNING job becomes CANCELLED and the
  // cancel listener is told (the step driver then aborts its ranks). FAILED_PRECONDITION for a
  // finished job, NOT_FOUND for an unknown id.
  // save: a RUNNING job with a checkpoint.dir that is not free-running first saves a checkpoint
  // after the step in progress (as RequestCheckpoint; event "cancelling: ..."), and the step driver
  // then ends it CANCELLED (CancelRequested, reason naming the committed checkpoint or why the
  // save failed); Cancel waits for the job to end and returns it as it ended (SUCCEEDED when that
  // step was its last), or as it stands when `stop` returns true (polled about every 200 ms);
  // UNAVAILABLE after Shutdown(). Any other job is cancelled at once, its reason saying why no
  // checkpoint was saved (no checkpoint.dir, free-running, or nothing trained since the
  // checkpoint it starts from). A second Cancel while the save is pending waits as well.
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id, bool save = false,
                                 const std::function<bool()>& stop = nullptr);
  // Continues an ended job (CANCELLED or FAILED) as the same job: it becomes PENDING (reason
  // "resumed from <dir>/step-<k>; waiting for N workers"), keeps its id, owner, spec, events
  // (the event "resumed from ..." carries step k) and creation and start times; end_time is
  // cleared, restarts reset to 0 (a fresh max_restarts budget), Job.resumes counted, and every
  // generation from then on starts from the job's own newest committed checkpoint (step k + 1
  // is the first step trained). The job's lease on checkpoint.dir is renewed (retention and
  // ownership unchanged: no take-over happens). Refusals, nothing changed: NOT_FOUND for an
  // unknown id; FAILED_PRECONDITION naming the rule for a job that has not ended, one that
  // SUCCEEDED, one without a checkpoint.dir, one whose checkpoint.dir holds no committed
  // checkpoint of its own, one whose last run has not been joined yet (RunJoined: "is still
  // stopping"; it may still write checkpoint.dir and hold workers), and one whose checkpoint.dir
  // now belongs to another job or is leased by another coordinator; UNAVAILABLE when
  // checkpoint.dir cannot be read. Owner checks are the caller's (the RPC layer's, as for Cancel).
  absl::StatusOr<v1::Job> Resume(const std::string& job_id) ABSL_LOCKS_EXCLUDED(lease_io_mu_, mu_);
  // Calls on_event for every kept event with seq > after_seq, then for new ones as they come, and
  // returns OK after the job's final event. Returns early with OK when on_event returns false,
  // CANCELLED when `stop` returns true (polled about every 200 ms), UNAVAILABLE after Shutdown().
  // NOT_FOUND for an unknown id. If the job has ended and nothing is newer than after_seq, returns
  // OK at once.
  absl::Status Watch(const std::string& job_id, int64_t after_seq,
                     const std::function<bool(const v1::JobEvent&)>& on_event,
                     const std::function<bool()>& stop = nullptr);
  // Up to `max` of the job's newest kept events, oldest first. NOT_FOUND for an unknown id.
  absl::StatusOr<std::vector<v1::JobEvent>> RecentEvents(const std::string& job_id,
                                                         size_t max) const;
  // Wakes every watcher; Watch returns UNAVAILABLE from then on.
  void Shutdown();

  // ---- scheduler / step driver side ----

  // PENDING and RECOVERING jobs (both wait for workers), oldest first; not those waiting for
  // re-adoption (ReadoptCandidates).
  std::vector<v1::Job> PendingJobs() const;
  // The jobs waiting for re-adoption after a coordinator restart, oldest first.
  std::vector<ReadoptCandidate> ReadoptCandidates() const;
  // A job waiting for re-adoption -> STARTING on the same generation, its ranks now worker_ids
  // (the same processes; an unnamed worker's id changes when it registers again); Job.step and
  // tokens become the ranks' (`step`, `tokens`) and `message` is published. FAILED_PRECONDITION
  // when the job is not waiting for re-adoption (cancelled meanwhile); INVALID_ARGUMENT when
  // worker_ids is not one per rank of the generation.
  absl::StatusOr<v1::Job> MarkReadopting(const std::string& job_id,
                                         const std::vector<std::string>& worker_ids, int64_t step,
                                         int64_t tokens, const std::string& message);
  // A job waiting for re-adoption that will not be: as Open would have done without re-adoption,
  // RECOVERING ("recovering from a coordinator restart (restart n of max): falling back to the
  // checkpoint because <why>", the restart counted, worker_ids cleared) when it has a
  // checkpoint.dir and restarts left, FAILED otherwise. FAILED_PRECONDITION when it is not
  // waiting for re-adoption.
  absl::Status ReadoptFailed(const std::string& job_id, const std::string& why)
      ABSL_LOCKS_EXCLUDED(lease_io_mu_, mu_);
  // Sets a PENDING or RECOVERING job's reason (publishes an event when it changed).
  absl::Status SetPendingReason(const std::string& job_id, const std::string& reason);
  // PENDING or RECOVERING -> STARTING with a new generation on worker_ids (index = rank) as a mesh
  // of `replicas` (Job.replicas: sharding.replicas with auto resolved; 1 for a flat job); returns
  // the job (its generation field is the new one). The generation's event names the mesh when
  // replicas > 1, and `placement_note` (e.g. shard groups split across placement domains) when not empty.
  absl::StatusOr<v1::Job> MarkStarting(const std::string& job_id,
                                       const std::vector<std::string>& worker_ids,
                                       int replicas = 1, const std::string& placement_note = "");
  // STARTING -> RUNNING.
  absl::Status MarkRunning(const std::string& job_id);
  // A RUNNING job continues on fewer replicas (docs/architecture.md "Continue on fewer
  // replicas"): its ranks become worker_ids (index = rank) as a mesh of `replicas`, under a new
  // generation (returned in the job), counting no restart; Job.configured_replicas keeps the
  // number the generation started with. Publishes `message`. FAILED_PRECONDITION when the job is
  // not RUNNING (it ended meanwhile).
  absl::StatusOr<v1::Job> MarkReconfigured(const std::string& job_id,
                                           const std::vector<std::string>& worker_ids,
                                           int replicas, const std::string& message);
  // STARTING/RUNNING -> RECOVERING after a failed generation: counts the restart (Job.restarts),
  // sets the reason and publishes "recovering from <cause> (restart n of max)". Returns the new
  // restart count. FAILED_PRECONDITION when the job already ended. A job that a Cancel with save
  // waits for (CancelRequested) is not restarted: decided under the same lock as that Cancel's
  // request, it ends CANCELLED ("cancelled by user; no checkpoint saved: <cause>"), the waiting
  // Cancel returns it, and MarkRecovering returns FAILED_PRECONDITION with that reason.
  absl::StatusOr<int> MarkRecovering(const std::string& job_id, const std::string& cause,
                                     int max_restarts) ABSL_LOCKS_EXCLUDED(lease_io_mu_, mu_);
  // Records a finished step: `ev` carries step (steps completed so far, 1-based), loss, val_loss
  // (NaN when not evaluated), grad_norm, lr, tokens (cumulative), tokens_per_second, step_seconds,
  // eval_seconds and the step's breakdown (jobs.proto JobEvent), stored as given.
  // FAILED_PRECONDITION when the job is not RUNNING.
  // checkpoint_requested (optional): set to whether a RequestCheckpoint was pending, which is
  // consumed in the same step (so a request is honoured after exactly one step).
  absl::Status RecordStep(const std::string& job_id, const v1::JobEvent& ev,
                          bool* checkpoint_requested = nullptr);
  // Publishes an informational event ("checkpoint step-20 committed") at the job's current step.
  // FAILED_PRECONDITION when the job already ended.
  absl::Status PublishMessage(const std::string& job_id, const std::string& message);
  // A STARTING job resumes from a checkpoint taken after `step` steps and `tokens` tokens: sets
  // Job.step/tokens (step events continue from there) and publishes `message`.
  absl::Status MarkResumed(const std::string& job_id, int64_t step, int64_t tokens,
                           const std::string& message);
  // Asks for a checkpoint after the job's next completed step that has not been dispatched yet
  // (the step after the job's current one, or after the one already sent ahead, see
  // TryDispatchAhead); returns that step (1-based count of completed steps). NOT_FOUND for an
  // unknown id; FAILED_PRECONDITION when the job is not RUNNING or has no checkpoint.dir.
  // Repeated requests before that step coalesce.
  absl::StatusOr<int64_t> RequestCheckpoint(const std::string& job_id);
  // The scheduler sent the command of the step that completes `completed` steps (no-op for an
  // unknown job).
  void SetDispatched(const std::string& job_id, int64_t completed);
  // The scheduler may send that step's command ahead, while the current step runs, unless a
  // checkpoint request is pending (then the save comes first): true records it as dispatched.
  bool TryDispatchAhead(const std::string& job_id, int64_t completed);
  // Whether a Cancel with save waits for this job's save (the step driver ends the job after it).
  bool CancelRequested(const std::string& job_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Any non-terminal state -> `state` (SUCCEEDED, FAILED or CANCELLED) with `reason`.
  // FAILED_PRECONDITION when the job already ended. FAILED for a job that a Cancel with save
  // waits for (CancelRequested) ends it CANCELLED instead, with the reason "cancelled by user; no
  // checkpoint saved: <reason>" (the failure prevented the save).
  absl::Status Finish(const std::string& job_id, v1::JobState state, const std::string& reason)
      ABSL_LOCKS_EXCLUDED(lease_io_mu_, mu_);
  bool IsTerminal(const std::string& job_id) const;

  void SetScalingState(const std::string& job_id, const v1::ScalingState& state);
  // NOT_FOUND for an unknown job; FAILED_PRECONDITION when no rank has reported one yet.
  absl::StatusOr<v1::ScalingState> GetScalingState(const std::string& job_id) const;

  // The job's resolved spec and memory plans per world size (made once, kept with the job until it
  // leaves the table); nullptr for an unknown id.
  std::shared_ptr<ResolvedJob> Resolved(const std::string& job_id) const;

  // Called after a successful Submit (new job) and after Cancel of a STARTING/RUNNING job.
  void SetSubmitListener(std::function<void()> fn);
  // Consulted by Submit after the spec checks (defaults applied): a non-OK status refuses the
  // job with it (the memory check of coordinator/memory_fit.h against the registered workers). The
  // ResolvedJob it gets becomes the job's: plans it makes are the scheduler's too.
  void SetAdmission(std::function<absl::Status(ResolvedJob&)> fn);
  void SetCancelListener(std::function<void(const std::string& job_id)> fn);

  const JobManagerOptions& options() const { return options_; }
  // This coordinator's identity in checkpoint directory leases (JobStore::CoordinatorId).
  // The scheduler's run of a job is from MarkStarting until RunJoined (its driver thread joined,
  // every rank sent Abort or done): meanwhile its ranks may write checkpoint.dir, so Cancel, and
  // Finish with a state other than SUCCEEDED, leave the lease (still renewed) to RunJoined, which
  // releases it when the job has ended.
  void RunJoined(const std::string& job_id);
  const std::string& coordinator_id() const { return coordinator_id_; }
  // The lease a job's saves run under (CheckpointStore::LeaseCheck): this coordinator's, with
  // half the lease length as the margin; no check when leases are off (checkpoint_lease 0).
  CheckpointStore::LeaseCheck SaveLease() const {
    CheckpointStore::LeaseCheck l;
    if (options_.checkpoint_lease.count() <= 0) return l;
    l.coordinator = coordinator_id_;
    l.lease_s = std::chrono::duration<double>(options_.checkpoint_lease).count();
    l.margin_s = l.lease_s / 2;
    return l;
  }

 private:
  // Logs the refused submission (event job_refused: the field and the rule) and returns s.
  static absl::Status Refused(absl::Status s, const std::string& owner, const v1::JobSpec& spec);
  // Logs a job that reached a final state (event job_ended).
  static void LogEnded(const v1::Job& j);

  struct Record {
    v1::Job job;
    std::string submitted_spec;  // deterministic serialization of the defaulted spec
    std::shared_ptr<ResolvedJob> resolved;  // the spec per world size and its memory plans
    int64_t last_seq = 0;
    std::deque<v1::JobEvent> events;
    std::optional<v1::ScalingState> scaling;
    bool checkpoint_requested = false;
    int64_t dispatched = 0;  // completed-step count after the last step command sent
    bool cancel_after_save = false;  // a Cancel with save waits for the next save
    // Waiting for re-adoption after a coordinator restart until then (see "Re-adoption").
    std::optional<std::chrono::steady_clock::time_point> readopt_until;
  };

  using OrderKey = std::pair<double, std::string>;  // (create_time, job_id)

  JobManager(JobManagerOptions options, std::unique_ptr<JobStore> store);
  // Records that the job ended (for retention) and applies the retention rule; may remove jobs,
  // so no Record pointer survives it.
  void NoteEndedLocked(const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t RetainLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Record* FindLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job's record when it is RUNNING; NOT_FOUND or FAILED_PRECONDITION (naming its state).
  absl::StatusOr<Record*> FindRunningLocked(const std::string& job_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Record* FindLocked(const std::string& job_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends an event (fills seq, job_id, state, total_steps, time), persists, notifies watchers.
  void PublishLocked(Record* r, v1::JobEvent ev) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the job's row and its new event (kept with the newest max_events_per_job).
  void PersistLocked(const Record& r, const v1::JobEvent& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NewJobIdLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A submit whose request_id was used before: the earlier job (same owner and spec bytes) or
  // ALREADY_EXISTS naming the conflict; nullopt for an empty or new request_id. mu_ held.
  std::optional<absl::StatusOr<v1::Job>> ReplayLocked(const std::string& request_id,
                                                      const std::string& owner,
                                                      const std::string& spec_bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Claims spec.checkpoint.dir for job `id` (CheckpointStore::Claim; take-over only from a job
  // that ended or is not in the table, and whose lease no other coordinator holds). *skipped:
  // the earlier owners' committed steps this job's saves will skip.
  absl::Status ClaimCheckpointDirLocked(const v1::JobSpec& spec, const std::string& id,
                                        const std::string& owner,
                                        std::vector<std::string>* skipped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Cancel with save, first part: true when the job now saves before it is cancelled (the flag
  // set, the checkpoint requested, the event published); false with *why when it cannot save.
  absl::StatusOr<bool> RequestCancelAfterSave(const std::string& job_id, std::string* why)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until the job has ended (or `stop`, or Shutdown) and returns it.
  absl::StatusOr<v1::Job> AwaitEnded(const std::string& job_id, const std::function<bool()>& stop)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Resume's checks of checkpoint.dir (no lock held): the job's newest committed checkpoint, its
  // lease renewed. FAILED_PRECONDITION naming the rule.
  absl::StatusOr<CommittedCheckpoint> ResumePoint(const std::string& job_id,
                                                  const std::string& dir)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lease_io_mu_) ABSL_LOCKS_EXCLUDED(mu_);

  // Ends the job (not ended yet) in `state` with `reason`: publishes the final event, clears a
  // pending cancel-with-save, applies retention (r may be gone afterwards). The lease is the
  // caller's (Finish).
  void FinishLocked(Record* r, v1::JobState state, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // MarkRecovering of a job that has not ended and that no cancel waits for.
  absl::StatusOr<int> MarkRecoveringLocked(Record* r, const std::string& cause, int max_restarts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // At Open: tidies the checkpoint directories this coordinator's jobs own (see above).
  void ReconcileCheckpointDirsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a run of the job has not been joined yet.
  bool HasRun(const std::string& job_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Releases the job's checkpoint.dir lease (before it ends).
  void ReleaseLeaseIoLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lease_io_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The lease thread: renews every leases_ entry every checkpoint_lease / 4 until Shutdown.
  void RenewLeases() ABSL_LOCKS_EXCLUDED(lease_io_mu_, mu_);

  const JobManagerOptions options_;
  std::unique_ptr<JobStore> store_;
  std::string coordinator_id_;
  // Held across a lease's file I/O and the job state it depends on (taken before mu_).
  absl::Mutex lease_io_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::map<std::string, std::string> leases_ ABSL_GUARDED_BY(mu_);  // job id -> checkpoint.dir leased
  std::set<std::string> runs_ ABSL_GUARDED_BY(mu_);  // jobs with a run not joined yet
  std::thread lease_thread_;
  mutable absl::Mutex mu_;
  absl::CondVar cv_;  // signalled on every new event, removal and at Shutdown
  std::map<std::string, Record> jobs_ ABSL_GUARDED_BY(mu_);
  std::set<OrderKey> order_ ABSL_GUARDED_BY(mu_);  // every job, oldest first
  // (end_time, job_id) of ended jobs
  std::set<std::pair<double, std::string>> ended_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> by_request_ ABSL_GUARDED_BY(mu_);  // request_id -> job_id
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> on_submit_ ABSL_GUARDED_BY(mu_);
  std::function<void(const std::string&)> on_cancel_ ABSL_GUARDED_BY(mu_);
  std::function<absl::Status(ResolvedJob&)> admission_ ABSL_GUARDED_BY(mu_);
};

// Text of a state without the prefix: "PENDING", "RUNNING", ...
std::string StateName(v1::JobState s);
bool IsTerminalState(v1::JobState s);
double NowSeconds();

}  // namespace fsdp8::coord
