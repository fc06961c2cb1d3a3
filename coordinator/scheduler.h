// Scheduler: assigns ranks to free workers and drives each running job's steps.
//
// One scheduler thread (woken by submissions, cancellations and worker changes, and every 200 ms)
// checks heartbeats and starts PENDING jobs, oldest first, on disjoint idle workers: a job takes the
// largest n in [min_workers, max_workers] of free workers of its backend for which global_batch is
// divisible by n * microbatch (microbatch unset: global_batch / n) and n is a multiple of
// sharding.replicas; the workers become ranks by placement (coordinator/placement.h: each shard
// group inside one placement domain, a host or an NVLink island of one (--placement_domain), when
// the free workers allow it, replicas spread over the domains; auto replicas resolved there). The memory plans it weighs are
// the job's own (JobManager::Resolved: made once per job and world size, at submit or at the first
// pass that needs one), never remade per pass. Jobs that cannot start get the
// reason "waiting for N workers (F free)".
//
// Each started job gets its own driver thread (JobRun, coordinator/job_run.h) that speaks the
// Session protocol with the job's ranks for one generation: Assignment, Ready, StepCommand and
// StepResult, checkpoint saves, Finish or Abort. A job has at most one run: a PENDING or
// RECOVERING job whose last run has not been reaped (joined) yet waits for it.
// Recovery: a failed generation of a job with checkpoint.dir and restarts < max_restarts makes the
// job RECOVERING ("recovering from <cause> (restart n of max)", Job.restarts counted) instead of
// FAILED; the scheduler then starts generation + 1 on free workers (same world-size rule as a fresh
// start) resuming from the latest committed checkpoint under checkpoint.dir (none yet: from where
// the job started). Waiting longer than start_timeout for enough workers fails the job; so does a
// memory plan that no registered worker holds for start_timeout (a large worker that re-registers
// meanwhile, after a restart or a heartbeat lapse, is waited for); Cancel
// while RECOVERING cancels it. Workers are released (idle) when a run ends; ranks that were sent
// Abort become assignable again only after abort_grace (the protocol has no message by which a
// worker reports that it has finished unwinding), and are picked up by the next pass after that.
//
// Re-adoption after a coordinator restart (JobManager "Re-adoption"): every pass looks at the jobs
// waiting for re-adoption and the held-job reports of the registered workers
// (WorkerRegistry::HeldJobs). A job is re-adopted once every rank r of its generation has a
// worker reporting it holds it: the same job, generation, rank r, world size and replicas, its
// state intact, no rank's completed steps behind the state db's step (reports are matched by
// what they say, not by worker id: an unnamed worker comes back under a new id, which becomes
// Job.worker_ids[r]). The job goes on from step K, the most steps any rank received
// (HeldJob.steps_received): a rank that received fewer (the old coordinator died between two
// ranks' sends) is sent the commands it missed, so every rank completes the same steps. Then the
// workers become its ranks again (WorkerRegistry::Adopt, which checks under its lock that each
// still reports the same job, generation, rank and world size), the job STARTING ("re-adopting N
// ranks at step K (the state db had step J ...)", Job.step and tokens the ranks': the results
// the ranks report for steps the db lacks give the tokens; their step events are not published)
// and a JobRun with that Adoption drives it on. A report that disagrees (another generation or
// rank, two workers for one rank, a named worker of the generation back
// without the job: it restarted) gives up at once, and so does the end of the wait
// (JobManagerOptions::readopt_window) with a rank missing: JobManager::ReadoptFailed (the
// checkpoint path, the reason saying why) and every worker holding the job is told to drop it
// (WorkerRegistry::DropHeld), as is any worker holding a job that waits for no re-adoption.
//
// Thread-safety: Start/Stop/Wake may be called from any thread; Stop joins every thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#include "common/fault_injection.h"
#include "coordinator/job_manager.h"
#include "coordinator/kv_server.h"
#include "coordinator/resolved_job.h"
#include "coordinator/worker_registry.h"

namespace fsdp8::coord {

class CoordinatorMetrics;

struct SchedulerOptions {
  std::chrono::milliseconds start_timeout{120000};
  std::chrono::milliseconds step_timeout{300000};
  int collective_timeout_ms = 30000;
  std::chrono::milliseconds tick{200};
  // After a run ends with Abort, the ranks that were sent it stay unassignable this long so that a
  // worker still unwinding the aborted job (finishing a step, tearing down its communicator) is not
  // handed the next Assignment meanwhile. 0 releases them at once.
  std::chrono::milliseconds abort_grace{1000};
  // Told every completed step (optional; must outlive the scheduler).
  CoordinatorMetrics* metrics = nullptr;
  // The manifest.* crash points of checkpoint commits (optional; must outlive the scheduler).
  const FaultInjection* faults = nullptr;
  // Send step k+1's command while step k runs when no checkpoint save comes between them, so
  // that the workers start it without waiting for the coordinator's round trip (result ->
  // aggregation -> next command). A TriggerCheckpoint then lands after the step already sent.
  bool dispatch_ahead = true;
  // Start a job only on workers that hold its memory plan (coordinator/memory_fit.h); false:
  // on any free workers (an allocation failure then fails the job on the worker).
  bool check_memory = true;
};

class JobRun;

class Scheduler {
 public:
  Scheduler(JobManager* jobs, WorkerRegistry* workers, KvServer* kv, SchedulerOptions options);
  ~Scheduler();

  // Installs the listeners on jobs/workers and starts the scheduler thread.
  void Start();
  // Stops scheduling; running jobs' ranks get Abort{"coordinator shutting down"} and their
  // threads are joined. The jobs keep their persisted state (a restarted coordinator resumes
  // them from their latest committed checkpoint, see JobManager).
  void Stop();
  // Asks for a scheduling pass soon.
  void Wake();

  // Chooses a world size for `spec` given `free` workers; 0 when none fits. Exposed for tests.
  static int ChooseWorldSize(const v1::JobSpec& spec, int free);
  // The smallest world size the spec can run on (>= min_workers).
  static int MinWorldSize(const v1::JobSpec& spec);
  // Scheduling passes completed since Start (any thread).
  int64_t passes() const { return passes_.load(); }

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  void SchedulePass() ABSL_LOCKS_EXCLUDED(mu_);
  // Re-adopts or gives up on the jobs waiting for re-adoption; drops held jobs nobody waits for.
  void ReadoptPass() ABSL_LOCKS_EXCLUDED(mu_);
  // Starts the run of a re-adopted job on its held workers (`ids[r]` holds rank r, `held[r]` is
  // its report).
  void Readopt(const v1::Job& job, const std::vector<std::string>& ids,
               const std::vector<v1::HeldJob>& held) ABSL_LOCKS_EXCLUDED(mu_);
  void ReapFinished() ABSL_LOCKS_EXCLUDED(mu_);
  void OnCancel(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);
  // What the scheduler thread waits for between passes (besides the tick).
  bool WakeOrStopLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return wake_ || stop_; }
  // No world size fits `free` workers: records why the job waits (memory_why: the memory plan's
  // reason when enough workers are free but too few hold the plan), or fails a RECOVERING job
  // that has waited start_timeout.
  void NoteWaiting(const v1::Job& job, size_t free, const std::string& memory_why = "");
  // No registered worker holds the job's memory plan (`why`: CheckFitsLargestWorkers' refusal):
  // the job waits, and fails once the verdict has held for start_timeout.
  void NoteUnfit(const v1::Job& job, size_t free, const std::string& why);
  // CheckFitsLargestWorkers of the job against `memory` (the registered workers of its backend),
  // made again only when `memory` changed since the job's last verdict (its refusal's advice plans
  // variants of the spec: not every pass).
  absl::Status FitVerdict(const std::string& job_id, ResolvedJob& job,
                          const std::map<std::string, int64_t>& memory);

  JobManager* jobs_;
  WorkerRegistry* workers_;
  KvServer* kv_;
  const SchedulerOptions options_;

  absl::Mutex mu_;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
  std::map<std::string, std::unique_ptr<JobRun>> runs_ ABSL_GUARDED_BY(mu_);
  // RECOVERING jobs waiting for workers, since when (scheduler thread only).
  std::map<std::string, std::chrono::steady_clock::time_point> recovering_since_;
  // Jobs whose memory plan no registered worker holds, since when (scheduler thread only).
  std::map<std::string, std::chrono::steady_clock::time_point> unfit_since_;
  // Each waiting job's last FitVerdict and the worker memory it was made against (scheduler
  // thread only).
  struct FitVerdictEntry {
    std::map<std::string, int64_t> memory;
    absl::Status status;
  };
  std::map<std::string, FitVerdictEntry> fit_verdicts_;
  std::atomic<int64_t> passes_{0};
};

}  // namespace fsdp8::coord
