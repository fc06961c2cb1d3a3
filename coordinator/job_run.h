// JobRun: drives one generation of one job on the workers the scheduler assigned to it.
//
// The Session protocol, per generation:
//   1. Start: resolve the checkpoint to resume from (ResolveResume), Assignment to every rank,
//      wait for every Ready (start_timeout), job -> RUNNING.
//   2. For k in start_step..steps-1: StepCommand{k} to every rank, wait for every StepResult{k}
//      (step_timeout), aggregate into one JobEvent and publish it (CoordinatorMetrics::OnStep,
//      then JobManager::RecordStep), then save a checkpoint if one is due.
//   3. Finish to every rank, job -> SUCCEEDED.
// Dispatch ahead (SchedulerOptions::dispatch_ahead): StepCommand{k+1} is sent right after
// StepCommand{k} when no save is due after step k and no TriggerCheckpoint is pending; workers
// queue it and start it right after step k. Results of a step sent ahead that arrive while the
// previous one is awaited are kept and counted when their step is awaited; a result for a step
// never sent fails the generation (a protocol violation). Free-running jobs get
// one StepCommand{start_step, count = steps - start_step} and report every step on their own.
// Checkpoints (spec.checkpoint.dir set): a save is due after k completed steps when every_steps > 0
// and k % every_steps == 0, when a TriggerCheckpoint is pending, or when k == steps (free-running
// jobs: only k == steps). A save is SaveCheckpoint{k, dir/step-<k>} to every rank, every rank's
// CheckpointSaved (step_timeout), then the MANIFEST (coordinator/checkpoint_store.h), retention
// (keep_last) and the event "checkpoint step-<k> committed". A save that fails for lack of storage
// (a rank's CheckpointSaved carries an error, or the MANIFEST cannot be committed) is dropped (its
// step directory removed; committed checkpoints untouched), published as an event, and training
// goes on; the next interval tries again (the last step's save is retried at once). After
// checkpoint.max_failed_saves consecutive failed saves the job is FAILED, not restarted.
// Resume (checkpoint.resume_from, or any restarted or resumed generation): the coordinator picks
// the checkpoint ("latest" committed one, or the named step directory, or for a restarted
// generation or a job continued by JobManager::Resume the job's own newest; verified, model and precision must match) and sends the same load_dir /
// load_world_size / start_step in every rank's Assignment; steps start_step..steps-1 run and
// Job.step / tokens continue from the checkpoint. Without one, init.from_checkpoint (another
// job's checkpoint, read only) goes out as init_dir / init_world_size and the job starts at 0.
// Saves go through CheckpointStore(dir, job id): only while the job owns the directory. A save
// of a step whose directory holds another job's committed checkpoint (an earlier owner's, in a
// directory taken over) is skipped: event "checkpoint step-<k> skipped: ..." (log event
// checkpoint_skipped), not a failed save; that checkpoint stays as it is. Before each generation
// the leftovers of interrupted saves are removed (CheckpointStore::RemoveLeftovers; a failure fails the generation).
// Cancel with a save (JobManager::Cancel save=true): the requested save runs as a
// TriggerCheckpoint's, then the job ends CANCELLED (CancelAfterSave); a generation that fails
// meanwhile ends the job CANCELLED too, not RECOVERING, its reason saying why nothing was saved.
// Failure: a WorkerError, a lost Session, a heartbeat timeout or a deadline fails the generation
// (the reason names the worker and rank) and sends Abort to the other ranks (and to a failed rank
// that may still be alive: timed out, silent); Cancel and Shutdown send Abort to every rank. A
// failed generation of a job with checkpoint.dir and restarts < max_restarts makes the job
// RECOVERING (the scheduler starts the next generation); otherwise the job becomes FAILED, as it
// does at once for a deterministic failure (a WorkerError whose code is RESOURCE_EXHAUSTED, a bad
// input file or checkpoint: IsDeterministicFailure), which would repeat on other workers. A save
// that times out or that a rank answers wrongly is not restarted (only a rank lost during a save
// is). At the end the generation's rendezvous keys (job/<id>/gen/<g>/) are deleted and the workers
// released, those sent Abort after SchedulerOptions::abort_grace.
//
// Continue on fewer replicas (ContinueOnFewerReplicas): a failed step of a job of R > 1 replicas
// under optimizer_sharding SHARD_GROUP whose failed ranks all belong to one replica does not end
// the run: that replica's ranks get Abort and are released, the survivors become a new generation
// of R-1 replicas (Reconfigure, every Ready; no checkpoint read, no restart counted) and the step
// that was in flight is re-run; results and errors of an earlier generation are ignored.
// Re-adoption (JobRun with an Adoption; coordinator/scheduler.h): after a coordinator restart the
// ranks of the generation that was running still hold it. The run removes the leftovers of
// interrupted saves, sends every rank Adopt{job, generation, rank} instead of an Assignment, and
// to a rank that did not receive every step's command another rank received (the coordinator
// died between two ranks' commands) those commands, so that every rank completes step K; waits
// for every Ready (start_timeout; a rank sends it once the steps it had received are done),
// marks the job RUNNING, publishes "re-adopted N ranks at step K (generation G; no checkpoint
// read)" and steps on from K as any generation does. A failure
// before that (a rank that no longer holds the job answers WorkerError, or is lost) fails the
// generation as above: RECOVERING from the checkpoint.
// Owns: its driver thread and the inbox its workers' events arrive in. Borrows (must outlive it):
// the JobManager, WorkerRegistry, KvServer and SchedulerOptions::metrics.
// Threads and locking: everything from Start to the end of the run happens on the driver thread,
// which alone touches the run's state (no lock). Poke, Shutdown, done and Join may be called from
// any other thread; the Inbox is internally locked. on_done is called on the driver thread as its
// last act, after done() turned true.
// States of a run: constructed -> Start() -> running (driver thread) -> done() -> Join() returns.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/checkpoint_store.h"
#include "common/mesh.h"
#include "coordinator/job_manager.h"
#include "coordinator/kv_server.h"
#include "coordinator/scheduler.h"
#include "coordinator/worker_registry.h"

namespace fsdp8::coord {

// Whether a rank's failure with this code would happen again on other workers (WorkerError.code:
// out of memory, a bad input file or checkpoint), so that the job fails instead of restarting.
bool IsDeterministicFailure(absl::StatusCode code);

// The files of a mesh's checkpoint from every rank's CheckpointSaved (saved[r] is rank r's;
// saved.size() is the world size W): Mesh::OptimizerShards() files in index order, file i as
// reported by the rank Mesh::CheckpointFile names for it (CheckpointFile.rank = i, its file, bytes
// and crc32): a flat checkpoint. The mesh is the spec's at W (MeshOf's error when it has none,
// *bad_rank = -1). INTERNAL "<rank_name(r)> <why>", *bad_rank = r, when rank r reported another
// rank than its own, reported no file but writes one ("reported no file but writes file i of N"),
// or reported a file but writes none ("reported file F but writes none (replica p under
// optimizer_sharding SHARD_GROUP)"). Pure.
absl::StatusOr<std::vector<v1::CheckpointFile>> MeshCheckpointFiles(
    const v1::JobSpec& spec, const std::vector<v1::CheckpointSaved>& saved,
    const std::function<std::string(int)>& rank_name, int* bad_rank);

// A job run's mailbox: worker events plus "look again" pokes (cancel, shutdown).
// Thread-safety: every method may be called from any thread.
class Inbox {
 public:
  void Push(const WorkerEvent& ev) ABSL_LOCKS_EXCLUDED(mu_);
  void Poke() ABSL_LOCKS_EXCLUDED(mu_);
  // True with the oldest event; false on timeout (`until`) or poke (the poke is consumed).
  bool Pop(WorkerEvent* out, std::chrono::steady_clock::time_point until) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // What Pop waits for.
  bool ReadyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !q_.empty() || poked_; }

  absl::Mutex mu_;
  std::deque<WorkerEvent> q_ ABSL_GUARDED_BY(mu_);
  bool poked_ ABSL_GUARDED_BY(mu_) = false;
};

// Where a re-adopted generation stands: the steps its ranks completed and the job's tokens by then.
struct Adoption {
  int64_t step = 0;    // the step every rank will have completed: the run goes on from there
  int64_t tokens = 0;
  // By rank, the first step whose command that rank did not receive before the coordinator went
  // away (HeldJob.steps_received): it is sent those up to `step` after Adopt.
  std::vector<int64_t> received;
};

class JobRun {
 public:
  // `job` is the STARTING job (JobManager::MarkStarting) whose worker_ids are its ranks, in rank
  // order; `inbox` receives those workers' events (WorkerRegistry::Assign).
  JobRun(JobManager* jobs, WorkerRegistry* workers, KvServer* kv, const SchedulerOptions& options,
         v1::Job job, std::shared_ptr<Inbox> inbox, std::function<void()> on_done,
         std::optional<Adoption> adoption = std::nullopt);
  ~JobRun();  // joins

  // Starts the driver thread. Called once.
  void Start();
  // Look again now (the job may have been cancelled).
  void Poke();
  // Ends the run soon: every rank gets Abort{"coordinator shutting down"}; the job keeps its state.
  void Shutdown();
  // True once the run has ended (workers released); Join then returns promptly.
  bool done() const { return done_; }
  void Join();

 private:
  using Clock = std::chrono::steady_clock;

  // Where the step loop stands (driver thread only).
  struct Progress {
    int64_t start_step = 0;     // first step of this generation (resumed checkpoint's step)
    int64_t tokens_total = 0;   // tokens trained on, all ranks, since step 0
    Clock::time_point last_result;  // when the previous step's last result arrived
    int failed_saves = 0;       // consecutive saves that failed for lack of storage
    int64_t next_to_send = 0;   // the first step whose command has not been sent
    bool save_pending = false;  // a requested save waits for the step already sent ahead
    int64_t nonfinite_steps = 0;  // steps of this generation whose loss or grad norm was not finite
  };

  void Run();
  absl::Status Drive();
  // Works out why the run failed and marks the job RECOVERING or FAILED accordingly; returns the
  // reason the ranks' Abort carries.
  std::string EndFailedGeneration(const absl::Status& s);

  std::string RankName(int r) const;
  int RankOf(const std::string& worker_id) const;
  // Sends `msg` to every rank but `skip`; false (failed_rank_ set) when a send failed.
  bool SendAll(const v1::CoordinatorMessage& msg, int skip = -1);
  // Waits until accept() has returned true for every rank. Errors: CANCELLED when the job ended
  // under us, ABORTED on shutdown, UNAVAILABLE/INTERNAL when a rank is lost or reports an error,
  // DEADLINE_EXCEEDED naming the missing ranks.
  absl::Status Await(Clock::time_point deadline, const std::string& what,
                     const std::function<bool(int, const v1::WorkerMessage&)>& accept);
  // A WorkerError of this job (or of no job in particular).
  bool IsJobError(const v1::WorkerMessage& m) const;
  // Rank r's error as a Status: its own code when deterministic (IsDeterministicFailure), else
  // INTERNAL.
  absl::Status RankError(int r, const v1::WorkerError& e) const;
  // A rank's failure often surfaces on its peers too (their collectives see it go): `first` came
  // first but is not deterministic, so errors arriving within 250 ms are looked at for the cause
  // (a deterministic one wins and sets failed_rank_). The generation is over: other events are
  // dropped. A rank whose peer left the collective reports UNAVAILABLE (`first_code`, the
  // worker's code): then another rank's error of any other code is its cause and wins too.
  absl::Status AwaitRootCause(absl::Status first, absl::StatusCode first_code);

  // Continue on fewer replicas (docs/architecture.md "Continue on fewer replicas"): after the
  // step in flight (in_flight_) failed in a job of R > 1 replicas under optimizer_sharding
  // SHARD_GROUP, works out which ranks failed (CollectFailures). When they all belong to one
  // replica k: Abort to replica k's ranks (they drop the job and go IDLE), a new generation of
  // the R-1 surviving replicas (JobManager::MarkReconfigured; the survivors renumbered in order),
  // Reconfigure to each survivor (new communicators through the rendezvous under the new
  // generation's prefix, no checkpoint read: the in-memory state rolled back to the end of the
  // last completed step) and every Ready; *spec becomes the spec at the new mesh (sharding.elastic
  // false: the global batch shrinks by the lost replica's share). Returns the step to run next:
  // the one that was in flight. A step the coordinator had sent ahead (in_flight_ + 1) is dropped
  // unrun by the survivors (their partial work on steps >= in_flight_ is discarded) and is sent
  // again in order. Returns `failure` (the checkpoint path: RECOVERING) when the job cannot
  // continue so: R == 1, optimizer_sharding WORLD (event "... falling back to the checkpoint
  // path"), failed ranks in more than one replica or in none known, a failure outside a step, a
  // survivor whose state cannot be rolled back (its WorkerError), or a spec that the new mesh
  // cannot run.
  absl::StatusOr<int64_t> ContinueOnFewerReplicas(v1::JobSpec* spec, const absl::Status& failure,
                                                  Progress* p);
  // Whether the job can continue on fewer replicas at all: R > 1 under SHARD_GROUP, driven.
  bool MayShrink(const v1::JobSpec& spec) const;
  // Reads the job's events for a short while after a failure (until a lost rank is known and
  // 100 ms more, at most 1 s) and notes who failed: lost_, errors_.
  void CollectFailures();
  // The ranks that failed on their own: the lost ones (session closed, heartbeats stopped), else
  // those that missed the step deadline while others answered, else those whose error is not a
  // peer's going away (UNAVAILABLE, ABORTED, CANCELLED, DEADLINE_EXCEEDED).
  std::map<int, std::string> FailedRanks() const;
  // Start of a generation: resume choice, Assignments, every Ready, RUNNING. Fills *p.
  absl::Status StartGeneration(const v1::JobSpec& spec, Progress* p);
  // Start of a re-adopted generation (adoption_): Adopt to every rank, every Ready, RUNNING.
  // An adopted run at step K: the save due at K (SaveDue) when no committed checkpoint of the
  // job has step K yet.
  absl::Status SaveAtAdoption(const v1::JobSpec& spec, Progress* p);
  absl::Status StartAdopted(const v1::JobSpec& spec, Progress* p);
  // Removes what interrupted saves left in checkpoint.dir (a failure fails the generation).
  absl::Status RemoveSaveLeftovers(const v1::JobSpec& spec);
  // Resolves spec.checkpoint.resume_from into the committed checkpoint every rank loads (C11: the
  // coordinator decides, no rank looks on its own). Leaves *out empty for a fresh start ("latest"
  // with nothing committed yet). FAILED_PRECONDITION for a missing, damaged or incompatible one.
  absl::Status ResolveResume(const v1::JobSpec& spec, std::optional<CommittedCheckpoint>* out);
  // Publishes where this generation starts from (nothing for a first generation from step 0).
  absl::Status AnnounceStart(const std::optional<CommittedCheckpoint>& resume);
  // init: spec.init.from_checkpoint, opened and checked, when the job starts without `resume`.
  absl::Status SendAssignments(const v1::JobSpec& spec,
                               const std::optional<CommittedCheckpoint>& resume,
                               const std::optional<CommittedCheckpoint>& init);
  absl::Status AwaitReady();

  // One step k: its command (unless sent ahead), step k+1's ahead when allowed, every rank's
  // result, the published event, then the save if one is due.
  absl::Status RunStep(const v1::JobSpec& spec, int64_t k, Progress* p);
  // Sends step k's command unless it was sent ahead; *t0 = when step k started.
  absl::Status SendStep(const v1::JobSpec& spec, const v1::CoordinatorMessage& command, int64_t k,
                        Progress* p, Clock::time_point* t0);
  // Sends step k+1's command while step k runs when allowed; a failed send is returned, to be
  // reported after step k's wait (which names a lost rank's cause).
  std::optional<absl::Status> SendAhead(const v1::JobSpec& spec, int64_t k, Progress* p);
  absl::Status AwaitResults(int64_t k, Clock::time_point t0, std::vector<v1::StepResult>* results);
  // After step event `ev` was published: a step whose loss or gradient norm is not finite (or that
  // a rank reports skipped) is counted; beyond spec.training.max_nonfinite_steps the job fails
  // (OUT_OF_RANGE, not restarted: it would repeat), the reason naming the step, the loss and the
  // gradient norm; before that the skip is published as an event and logged.
  absl::Status CheckFinite(const v1::JobSpec& spec, const v1::JobEvent& ev,
                           const std::vector<v1::StepResult>& results, Progress* p);
  // Records the step (scaling state, JobManager, metrics); *requested: a TriggerCheckpoint is due.
  absl::Status PublishStep(int64_t k, const v1::JobEvent& ev,
                           const std::vector<v1::StepResult>& results, bool* requested);

  // Saves after `completed` steps; a save that failed for lack of storage is counted and
  // published and training goes on (the last step's save is retried at once) until
  // checkpoint.max_failed_saves in a row (RESOURCE_EXHAUSTED, not restarted).
  absl::Status SaveWithRetry(const v1::JobSpec& spec, int64_t completed, Progress* p);
  // After a save following `completed` steps (not the last): a Cancel waiting for a save
  // (JobManager::CancelRequested) ends the job CANCELLED now, its reason naming the committed
  // checkpoint or why the save failed; returns CANCELLED then (the ranks get Abort).
  absl::Status CancelAfterSave(const v1::JobSpec& spec, int64_t completed, const Progress* p);
  // Saves a checkpoint after `step` completed steps: SaveCheckpoint{step, dir} to every rank, every
  // rank's CheckpointSaved (deadline: step_timeout), then the MANIFEST (only now is it committed),
  // retention, and the event "checkpoint step-<k> committed".
  // *storage_failure is set when the save failed for lack of storage: a rank reported that it
  // could not write its shard, or the files or the MANIFEST could not be committed. Every rank has
  // answered by then and its training state is intact, the partial step directory is removed, and
  // nothing committed was touched, so the job can go on. Other errors (a rank lost, a timeout, a
  // protocol violation) end the generation.
  absl::Status SaveCheckpoint(const v1::JobSpec& spec, int64_t step, int64_t tokens,
                              bool* storage_failure);
  // SaveCheckpoint{step, dir} to every rank and every rank's CheckpointSaved, by rank.
  absl::Status CollectSaved(int64_t step, const std::string& dir, const std::string& what,
                            std::vector<v1::CheckpointSaved>* saved);
  // The MANIFEST of the ranks' files: a flat checkpoint of Mesh::OptimizerShards() files (its
  // world_size), the files of MeshCheckpointFiles. Its INTERNAL refusals, prefixed with `what`,
  // mark the rank at fault as the failed one (aborted).
  absl::StatusOr<v1::CheckpointManifest> ManifestOf(const v1::JobSpec& spec, int64_t step,
                                                    int64_t tokens,
                                                    const std::vector<v1::CheckpointSaved>& saved,
                                                    const std::string& what);

  JobManager* jobs_;
  WorkerRegistry* workers_;
  KvServer* kv_;
  const SchedulerOptions options_;
  const v1::Job job_;
  std::shared_ptr<Inbox> inbox_;
  std::function<void()> on_done_;
  const std::optional<Adoption> adoption_;
  std::vector<std::string> ranks_;  // worker id by rank
  int64_t generation_ = 0;          // the current generation (a reconfiguration makes a new one)
  int64_t in_flight_ = -1;          // the step whose results are awaited, -1 between steps
  // A step's failure reports, by rank (driver thread; cleared by a reconfiguration).
  std::map<int, std::string> lost_;                               // session lost, no heartbeat
  std::map<int, std::string> missed_;                             // missed the step deadline
  std::map<int, std::pair<absl::StatusCode, std::string>> errors_;  // WorkerError
  std::string prefix_;              // the generation's rendezvous keys
  int failed_rank_ = -1;
  std::string last_save_;  // the outcome of the latest save: "checkpoint step-<k> committed", ...
  int64_t steps_sent_ = 0;  // steps [0, steps_sent_) have had their StepCommand sent
  // Step results received ahead of the step being awaited (rank, message), oldest first.
  std::deque<std::pair<int, v1::WorkerMessage>> early_results_;
  bool abort_failed_rank_ = false;  // the failed rank may be alive: send it Abort too
  // The ranks keep the job after a failed step (a mesh that may continue on fewer replicas,
  // MayShrink): a failed rank gets Abort too.
  bool failed_keep_job_ = false;
  bool assigning_ = false;          // Assignments went out: a failure must Abort the ranks
  bool recoverable_ = true;         // a failure may restart the job (RECOVERING)
  std::atomic<bool> shutdown_{false};
  std::atomic<bool> done_{false};
  std::thread thread_;
};

}  // namespace fsdp8::coord
