#include "coordinator/scheduler.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/spec.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/metrics.h"

namespace fsdp8::coord {
namespace {

using Clock = std::chrono::steady_clock;

// A job run's mailbox: worker events plus "look again" pokes (cancel, shutdown).
class Inbox {
 public:
  void Push(const WorkerEvent& ev) {
    std::lock_guard<std::mutex> lock(mu_);
    q_.push_back(ev);
    cv_.notify_all();
  }
  void Poke() {
    std::lock_guard<std::mutex> lock(mu_);
    poked_ = true;
    cv_.notify_all();
  }
  // True with an event; false on timeout or poke.
  bool Pop(WorkerEvent* out, Clock::time_point until) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, until, [&] { return !q_.empty() || poked_; });
    poked_ = false;
    if (q_.empty()) return false;
    *out = std::move(q_.front());
    q_.pop_front();
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<WorkerEvent> q_;
  bool poked_ = false;
};

}  // namespace

// Drives one generation of one job on its own thread (see scheduler.h for the protocol).
class JobRun {
 public:
  JobRun(JobManager* jobs, WorkerRegistry* workers, KvServer* kv, const SchedulerOptions& options,
         v1::Job job, std::shared_ptr<Inbox> inbox, std::function<void()> on_done)
      : jobs_(jobs), workers_(workers), kv_(kv), options_(options), job_(std::move(job)),
        inbox_(std::move(inbox)), on_done_(std::move(on_done)) {
    for (int r = 0; r < job_.worker_ids_size(); ++r) ranks_.push_back(job_.worker_ids(r));
  }
  ~JobRun() { Join(); }

  void Start() { thread_ = std::thread([this] { Run(); }); }
  void Poke() { inbox_->Poke(); }
  void Shutdown() {
    shutdown_ = true;
    inbox_->Poke();
  }
  bool done() const { return done_; }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::string RankName(int r) const { return absl::StrCat("rank ", r, " (worker ", ranks_[r], ")"); }
  int RankOf(const std::string& worker_id) const {
    for (size_t r = 0; r < ranks_.size(); ++r)
      if (ranks_[r] == worker_id) return static_cast<int>(r);
    return -1;
  }

  bool SendAll(const v1::CoordinatorMessage& msg, int skip = -1) {
    bool ok = true;
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      if (r == skip) continue;
      if (!workers_->Send(ranks_[r], msg)) {
        if (failed_rank_ < 0) failed_rank_ = r;
        ok = false;
      }
    }
    return ok;
  }

  // Waits until accept() has returned true for every rank. Errors: CANCELLED when the job ended
  // under us, ABORTED on shutdown, UNAVAILABLE/INTERNAL when a rank is lost or reports an error,
  // DEADLINE_EXCEEDED naming the missing ranks.
  absl::Status Await(Clock::time_point deadline, const std::string& what,
                     const std::function<bool(int, const v1::WorkerMessage&)>& accept) {
    std::vector<bool> got(ranks_.size(), false);
    size_t missing = ranks_.size();
    // Step results that arrived while an earlier step was awaited (dispatch ahead) come first.
    for (auto it = early_results_.begin(); it != early_results_.end() && missing > 0;) {
      if (!got[it->first] && accept(it->first, it->second)) {
        got[it->first] = true;
        --missing;
        it = early_results_.erase(it);
      } else {
        ++it;
      }
    }
    while (missing > 0) {
      if (shutdown_) return absl::AbortedError("coordinator shutting down");
      if (jobs_->IsTerminal(job_.job_id())) return absl::CancelledError("job ended");
      WorkerEvent ev;
      auto now = Clock::now();
      if (now >= deadline) {
        std::vector<std::string> names;
        for (size_t r = 0; r < got.size(); ++r) {
          if (!got[r]) {
            names.push_back(RankName(static_cast<int>(r)));
            if (failed_rank_ < 0) failed_rank_ = static_cast<int>(r);
          }
        }
        abort_failed_rank_ = true;  // a slow rank is alive: it must stop as well
        return absl::DeadlineExceededError(absl::StrCat("timed out waiting for ", what, " from ",
                                                        absl::StrJoin(names, ", ")));
      }
      if (!inbox_->Pop(&ev, std::min(deadline, now + std::chrono::seconds(1)))) continue;
      int r = RankOf(ev.worker_id);
      if (r < 0) continue;
      if (ev.kind == WorkerEvent::kLost) {
        failed_rank_ = r;
        // Silent but maybe alive (its Session may still be open): tell it to abort too.
        abort_failed_rank_ = ev.reason.rfind("no heartbeat", 0) == 0;
        return absl::UnavailableError(absl::StrCat(RankName(r), " lost: ", ev.reason));
      }
      const v1::WorkerMessage& m = ev.message;
      if (m.has_error() && (m.error().job_id().empty() || m.error().job_id() == job_.job_id())) {
        failed_rank_ = r;
        return absl::InternalError(
            absl::StrCat(RankName(r), " reported an error: ", m.error().message()));
      }
      if (!got[r] && accept(r, m)) {
        got[r] = true;
        --missing;
      } else if (m.has_result() && m.result().job_id() == job_.job_id()) {
        early_results_.emplace_back(r, m);  // a later step's result (it was sent ahead)
      }
    }
    return absl::OkStatus();
  }

  // Resolves spec.checkpoint.resume_from into the committed checkpoint every rank loads (C11: the
  // coordinator decides, no rank looks on its own). Leaves *out empty for a fresh start ("latest"
  // with nothing committed yet). FAILED_PRECONDITION for a missing, damaged or incompatible one.
  absl::Status ResolveResume(const v1::JobSpec& spec, std::optional<CommittedCheckpoint>* out) {
    const v1::CheckpointSpec& cs = spec.checkpoint();
    if (cs.dir().empty()) return absl::OkStatus();
    std::string step_dir = cs.resume_from();
    if (job_.restarts() > 0) {
      // A restarted generation continues from the newest committed checkpoint under dir; before
      // the first one, from where the job itself started.
      auto latest = CheckpointStore(cs.dir()).Latest();
      if (!latest.ok())
        return absl::FailedPreconditionError(
            absl::StrCat("checkpoint.dir: ", latest.status().message()));
      if (latest->has_value()) step_dir = (*latest)->dir;
    }
    if (step_dir.empty()) return absl::OkStatus();
    if (step_dir == "latest") {
      auto latest = CheckpointStore(cs.dir()).Latest();
      if (!latest.ok())
        return absl::FailedPreconditionError(
            absl::StrCat("checkpoint.resume_from: ", latest.status().message()));
      if (!latest->has_value()) return absl::OkStatus();
      step_dir = (*latest)->dir;
    }
    auto ck = CheckpointStore::Open(step_dir);
    if (!ck.ok())
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint.resume_from: ", ck.status().message()));
    if (absl::Status s = CheckpointStore::CheckResumeCompatible(spec, ck->manifest.spec(), step_dir);
        !s.ok())
      return s;
    *out = std::move(*ck);
    return absl::OkStatus();
  }

  // Saves a checkpoint after `step` completed steps: SaveCheckpoint{step, dir} to every rank, every
  // rank's CheckpointSaved (deadline: step_timeout), then the MANIFEST (only now is it committed),
  // retention, and the event "checkpoint step-<k> committed".
  // *storage_failure is set when the save failed for lack of storage: a rank reported that it
  // could not write its shard, or the files or the MANIFEST could not be committed. Every rank has
  // answered by then and its training state is intact, the partial step directory is removed, and
  // nothing committed was touched, so the job can go on. Other errors (a rank lost, a timeout, a
  // protocol violation) end the generation.
  absl::Status SaveCheckpoint(const v1::JobSpec& spec, int64_t step, int64_t tokens,
                              bool* storage_failure) {
    *storage_failure = false;
    const std::string& id = job_.job_id();
    const std::string what = absl::StrCat("checkpoint step-", step);
    auto with_context = [&](const absl::Status& s) {
      return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
    };
    const CheckpointStore store(spec.checkpoint().dir());
    auto storage = [&](const absl::Status& s) {
      *storage_failure = true;
      store.Abandon(step).IgnoreError();  // best effort; Retain removes leftovers later
      return with_context(s);
    };
    auto dir = store.Prepare(step);
    if (!dir.ok()) return storage(dir.status());
    v1::CoordinatorMessage m;
    m.mutable_save()->set_step(step);
    m.mutable_save()->set_dir(*dir);
    const auto t0 = Clock::now();
    if (!SendAll(m))
      return absl::UnavailableError(absl::StrCat("could not send ", what, " to ",
                                                 RankName(failed_rank_), ": session closed"));
    const int n = static_cast<int>(ranks_.size());
    std::vector<v1::CheckpointSaved> saved(n);
    absl::Status s = Await(t0 + options_.step_timeout, absl::StrCat("CheckpointSaved of ", what),
                           [&](int r, const v1::WorkerMessage& wm) {
                             if (!wm.has_saved() || wm.saved().job_id() != id ||
                                 wm.saved().step() != step)
                               return false;
                             saved[r] = wm.saved();
                             return true;
                           });
    if (!s.ok()) return with_context(s);
    std::vector<std::string> errors;
    for (int r = 0; r < n; ++r)
      if (!saved[r].error().empty()) errors.push_back(absl::StrCat(RankName(r), ": ", saved[r].error()));
    if (!errors.empty()) return storage(absl::ResourceExhaustedError(absl::StrJoin(errors, "; ")));
    v1::CheckpointManifest manifest;
    manifest.set_format_version(CheckpointStore::kFormatVersion);
    manifest.set_job_id(id);
    manifest.set_step(step);
    manifest.set_world_size(n);
    *manifest.mutable_spec() = spec;
    manifest.set_time(NowSeconds());
    manifest.set_tokens(tokens);
    for (int r = 0; r < n; ++r) {
      if (saved[r].rank() != r) {
        failed_rank_ = r;
        abort_failed_rank_ = true;
        return absl::InternalError(absl::StrCat(what, ": ", RankName(r), " reported rank ",
                                                saved[r].rank()));
      }
      v1::CheckpointFile* f = manifest.add_files();
      f->set_rank(r);
      f->set_file(saved[r].file());
      f->set_bytes(saved[r].bytes());
      f->set_crc32(saved[r].crc32());
    }
    // Never commit what a later load would refuse.
    if (absl::Status v = CheckpointStore::VerifyFiles(*dir, manifest); !v.ok())
      return storage(absl::DataLossError(v.message()));
    if (absl::Status c = store.Commit(manifest); !c.ok()) return storage(c);
    auto removed = store.Retain(spec.checkpoint().keep_last());
    std::string note;
    if (!removed.ok()) note = absl::StrCat(" (retention failed: ", removed.status().message(), ")");
    if (!jobs_->PublishMessage(id, absl::StrCat(what, " committed", note)).ok())
      return absl::CancelledError("job ended");
    return absl::OkStatus();
  }

  absl::Status Drive() {
    const std::string& id = job_.job_id();
    const int n = static_cast<int>(ranks_.size());
    const v1::JobSpec spec = WithDefaults(job_.spec(), n);
    const int64_t gen = job_.generation();
    std::optional<CommittedCheckpoint> resume;
    if (absl::Status rs = ResolveResume(spec, &resume); !rs.ok()) return rs;
    int64_t start_step = 0;
    int64_t tokens_total = 0;
    if (resume) {
      start_step = resume->step;
      tokens_total = resume->manifest.tokens();
      const int saved_by = resume->manifest.world_size();
      if (!jobs_->MarkResumed(id, start_step, tokens_total,
                              absl::StrCat("resuming from ", resume->dir, " (step ", start_step,
                                           ", saved by ", saved_by, " ranks)",
                                           saved_by == n ? ""
                                                         : absl::StrCat(", resharded to ", n,
                                                                        " ranks")))
               .ok())
        return absl::CancelledError("job ended");
    } else if (job_.restarts() > 0) {
      if (!jobs_->MarkResumed(id, 0, 0, "restarting from step 0 (no committed checkpoint)").ok())
        return absl::CancelledError("job ended");
    }
    assigning_ = true;  // from here on a failure must Abort the ranks
    for (int r = 0; r < n; ++r) {
      v1::CoordinatorMessage m;
      v1::Assignment* a = m.mutable_assignment();
      a->set_job_id(id);
      a->set_generation(gen);
      a->set_rank(r);
      a->set_world_size(n);
      *a->mutable_spec() = spec;
      a->set_store_prefix(prefix_);
      a->set_collective_timeout_ms(options_.collective_timeout_ms);
      a->set_bootstrap_timeout_ms(static_cast<int32_t>(std::clamp<int64_t>(
          options_.start_timeout.count(), 1, std::numeric_limits<int32_t>::max())));
      if (resume) {  // the same checkpoint for every rank
        a->set_load_dir(resume->dir);
        a->set_load_world_size(resume->manifest.world_size());
        a->set_start_step(start_step);
      }
      if (!workers_->Send(ranks_[r], m)) {
        failed_rank_ = r;
        return absl::UnavailableError(
            absl::StrCat("could not send the assignment to ", RankName(r), ": session closed"));
      }
    }
    absl::Status s = Await(Clock::now() + options_.start_timeout, "Ready",
                           [&](int, const v1::WorkerMessage& m) {
                             return m.has_ready() && m.ready().job_id() == id &&
                                    m.ready().generation() == gen;
                           });
    if (!s.ok()) return s;
    if (!jobs_->MarkRunning(id).ok()) return absl::CancelledError("job ended");

    const int64_t steps = spec.training().steps();
    const bool has_val = !spec.data().val_path().empty();
    const int eval_every = spec.training().eval_every();
    const v1::CheckpointSpec& ckpt = spec.checkpoint();
    Clock::time_point last_result = Clock::now();
    int failed_saves = 0;  // consecutive
    const bool free_running = spec.training().free_running();
    auto command = [&](int64_t k) {
      const bool last = k == steps - 1;
      v1::CoordinatorMessage m;
      v1::StepCommand* c = m.mutable_step();
      c->set_step(k);
      c->set_evaluate(has_val && eval_every > 0 && ((k + 1) % eval_every == 0 || last));
      c->set_report_scaling(k % 10 == 0 || last);
      if (free_running) {
        c->set_evaluate(false);
        c->set_report_scaling(false);
        c->set_count(steps - k);
      }
      return m;
    };
    // A save is due once `completed` steps are done (periodic or final).
    auto save_due = [&](int64_t completed) {
      return !ckpt.dir().empty() &&
             (completed == steps || (ckpt.every_steps() > 0 && completed % ckpt.every_steps() == 0));
    };
    int64_t next_to_send = start_step;  // the first step whose command has not been sent
    bool save_pending = false;  // a requested save waits for the step already sent ahead
    for (int64_t k = start_step; k < steps; ++k) {
      const v1::CoordinatorMessage m = command(k);
      const v1::StepCommand* c = &m.step();
      auto t0 = free_running && k > start_step ? last_result : Clock::now();
      if (next_to_send == k) {
        if ((!free_running || k == start_step) && !SendAll(m))
          return absl::UnavailableError(absl::StrCat(
              "could not send step ", k, " to ", RankName(failed_rank_), ": session closed"));
        jobs_->SetDispatched(id, k + 1);
        next_to_send = k + 1;
      } else {
        t0 = last_result;  // sent ahead: the ranks started it when step k-1 ended
      }
      // A failed send ahead is reported after step k's wait, which names a lost rank's cause.
      std::optional<absl::Status> ahead_failed;
      if (options_.dispatch_ahead && !free_running && k + 1 < steps && next_to_send == k + 1 &&
          !save_due(k + 1) && !save_pending && jobs_->TryDispatchAhead(id, k + 2)) {
        if (!SendAll(command(k + 1))) {
          ahead_failed = absl::UnavailableError(absl::StrCat(
              "could not send step ", k + 1, " to ", RankName(failed_rank_), ": session closed"));
        }
        next_to_send = k + 2;
      }
      std::vector<v1::StepResult> results(n);
      s = Await(t0 + options_.step_timeout, absl::StrCat("the result of step ", k),
                [&](int r, const v1::WorkerMessage& wm) {
                  if (!wm.has_result() || wm.result().job_id() != id || wm.result().step() != k)
                    return false;
                  results[r] = wm.result();
                  return true;
                });
      if (!s.ok()) return s;
      if (ahead_failed) return *ahead_failed;
      // Anything left for step k or earlier (a duplicate) will never be awaited.
      for (auto it = early_results_.begin(); it != early_results_.end();) {
        it = it->second.result().step() <= k ? early_results_.erase(it) : std::next(it);
      }
      last_result = Clock::now();
      double secs = std::chrono::duration<double>(last_result - t0).count();
      double loss_sum = 0;
      int64_t tokens = 0;
      for (const auto& res : results) {
        loss_sum += res.loss_sum();
        tokens += res.tokens();
      }
      tokens_total += tokens;
      v1::JobEvent ev;
      ev.set_step(k + 1);
      ev.set_loss(tokens > 0 ? loss_sum / tokens : std::numeric_limits<double>::quiet_NaN());
      ev.set_val_loss(c->evaluate() ? results[0].val_loss()
                                    : std::numeric_limits<double>::quiet_NaN());
      ev.set_grad_norm(results[0].grad_norm());
      ev.set_lr(results[0].lr());
      ev.set_tokens(tokens_total);
      ev.set_tokens_per_second(secs > 0 ? tokens / secs : 0);
      ev.set_step_seconds(secs);
      for (const auto& res : results) {  // the slowest rank's breakdown
        ev.set_compute_seconds(std::max(ev.compute_seconds(), res.compute_seconds()));
        ev.set_comm_seconds(std::max(ev.comm_seconds(), res.comm_seconds()));
        ev.set_optimizer_seconds(std::max(ev.optimizer_seconds(), res.optimizer_seconds()));
        ev.set_peak_memory_bytes(std::max(ev.peak_memory_bytes(), res.peak_memory_bytes()));
        ev.set_all_gather_bytes(std::max(ev.all_gather_bytes(), res.all_gather_bytes()));
        ev.set_reduce_scatter_bytes(std::max(ev.reduce_scatter_bytes(), res.reduce_scatter_bytes()));
        ev.set_forward_peak_bytes(std::max(ev.forward_peak_bytes(), res.forward_peak_bytes()));
        ev.set_backward_peak_bytes(std::max(ev.backward_peak_bytes(), res.backward_peak_bytes()));
        ev.set_optimizer_peak_bytes(std::max(ev.optimizer_peak_bytes(), res.optimizer_peak_bytes()));
      }
      for (const auto& res : results) {
        if (res.has_scaling()) {
          v1::ScalingState st = res.scaling();
          if (st.step() == 0) st.set_step(k + 1);
          jobs_->SetScalingState(id, st);
          break;
        }
      }
      bool requested = false;
      if (!jobs_->RecordStep(id, ev, &requested).ok()) return absl::CancelledError("job ended");
      if (options_.metrics) options_.metrics->OnStep(id, ev, results);
      const int64_t completed = k + 1;
      // A request that arrived after step k+1 was sent ahead is honoured after step k+1.
      if (requested && next_to_send > completed) {
        save_pending = true;
        requested = false;
      } else if (save_pending && next_to_send == completed) {
        save_pending = false;
        requested = true;
      }
      // Free-running workers are busy stepping until the end: only the final save.
      if (!ckpt.dir().empty() && (!spec.training().free_running() || completed == steps) &&
          (requested || completed == steps ||
           (ckpt.every_steps() > 0 && completed % ckpt.every_steps() == 0))) {
        // The last step has no next interval: its save is retried at once.
        for (;;) {
          bool storage_failure = false;
          s = SaveCheckpoint(spec, completed, tokens_total, &storage_failure);
          if (s.ok()) {
            failed_saves = 0;
            break;
          }
          if (!storage_failure) {
            // A rank lost during the save is a failed generation; a save that times out or that
            // a rank answers wrongly is not restarted (a restart would repeat it).
            if (!absl::IsUnavailable(s)) recoverable_ = false;
            return s;
          }
          ++failed_saves;
          if (failed_saves >= ckpt.max_failed_saves()) {
            recoverable_ = false;
            return absl::ResourceExhaustedError(absl::StrCat(
                failed_saves, " consecutive checkpoint saves failed (checkpoint.max_failed_saves ",
                ckpt.max_failed_saves(), "); last: ", s.message()));
          }
          if (!jobs_->PublishMessage(id, absl::StrCat(s.message(), " (failed save ", failed_saves,
                                                      " of at most ", ckpt.max_failed_saves(),
                                                      " in a row; training goes on)"))
                   .ok())
            return absl::CancelledError("job ended");
          if (completed != steps) break;
        }
      }
    }
    v1::CoordinatorMessage fin;
    fin.mutable_finish();
    SendAll(fin);
    jobs_->Finish(id, v1::JOB_STATE_SUCCEEDED, absl::StrCat("completed ", steps, " steps"))
        .IgnoreError();
    return absl::OkStatus();
  }

  void Run() {
    const std::string& id = job_.job_id();
    prefix_ = absl::StrCat("job/", id, "/gen/", job_.generation(), "/");
    absl::Status s = Drive();
    std::vector<std::string> aborted;
    if (!s.ok()) {
      std::string reason;
      if (absl::IsAborted(s)) {
        reason = "coordinator shutting down";
      } else if (absl::IsCancelled(s)) {
        auto j = jobs_->Get(id);
        reason = j.ok() && !j->reason().empty() ? j->reason() : "job ended";
      } else {
        reason = std::string(s.message());
        const int max_restarts = WithDefaults(job_.spec(), 0).max_restarts();
        bool recovering = false;
        if (assigning_ && recoverable_ && !job_.spec().checkpoint().dir().empty() &&
            job_.restarts() < max_restarts) {
          recovering = jobs_->MarkRecovering(id, reason, max_restarts).ok();
          if (!recovering) {
            auto j = jobs_->Get(id);  // ended meanwhile (cancelled): abort with its reason
            if (j.ok()) reason = j->reason();
          }
        } else if (!jobs_->Finish(id, v1::JOB_STATE_FAILED, reason).ok()) {
          auto j = jobs_->Get(id);  // ended meanwhile (cancelled): abort with its reason
          if (j.ok()) reason = j->reason();
        }
      }
      v1::CoordinatorMessage m;
      m.mutable_abort()->set_reason(reason);
      // Every rank gets Abort, except one whose failure it reported itself or whose session is gone.
      const bool skip_failed = !(absl::IsCancelled(s) || absl::IsAborted(s) || abort_failed_rank_);
      const int skip = skip_failed ? failed_rank_ : -1;
      // Ranks never sent an Assignment (e.g. the checkpoint to resume from was refused) have
      // nothing to abort and are free at once.
      if (assigning_) {
        SendAll(m, skip);
        for (int r = 0; r < static_cast<int>(ranks_.size()); ++r)
          if (r != skip) aborted.push_back(ranks_[r]);
      }
    }
    kv_->DeletePrefix(prefix_);
    workers_->Release(id, aborted, options_.abort_grace);
    done_ = true;
    if (on_done_) on_done_();
  }

  JobManager* jobs_;
  WorkerRegistry* workers_;
  KvServer* kv_;
  const SchedulerOptions options_;
  const v1::Job job_;
  std::shared_ptr<Inbox> inbox_;
  std::function<void()> on_done_;
  std::vector<std::string> ranks_;
  std::string prefix_;
  int failed_rank_ = -1;
  // Step results received ahead of the step being awaited (rank, message), oldest first.
  std::deque<std::pair<int, v1::WorkerMessage>> early_results_;
  bool abort_failed_rank_ = false;
  bool assigning_ = false;
  bool recoverable_ = true;
  std::atomic<bool> shutdown_{false};
  std::atomic<bool> done_{false};
  std::thread thread_;
};

Scheduler::Scheduler(JobManager* jobs, WorkerRegistry* workers, KvServer* kv,
                     SchedulerOptions options)
    : jobs_(jobs), workers_(workers), kv_(kv), options_(options) {}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Start() {
  jobs_->SetSubmitListener([this] { Wake(); });
  jobs_->SetCancelListener([this](const std::string& id) { OnCancel(id); });
  workers_->SetChangeListener([this] { Wake(); });
  thread_ = std::thread([this] { Loop(); });
}

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && !thread_.joinable() && runs_.empty()) return;
    stop_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  jobs_->SetSubmitListener(nullptr);
  jobs_->SetCancelListener(nullptr);
  workers_->SetChangeListener(nullptr);
  std::map<std::string, std::unique_ptr<JobRun>> runs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    runs.swap(runs_);
  }
  for (auto& [id, run] : runs) run->Shutdown();
  for (auto& [id, run] : runs) run->Join();
}

void Scheduler::Wake() {
  std::lock_guard<std::mutex> lock(mu_);
  wake_ = true;
  cv_.notify_all();
}

void Scheduler::OnCancel(const std::string& job_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(job_id);
  if (it != runs_.end()) it->second->Poke();
  wake_ = true;
  cv_.notify_all();
}

void Scheduler::Loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, options_.tick, [&] { return wake_ || stop_; });
      if (stop_) return;
      wake_ = false;
    }
    workers_->CheckHeartbeats();
    ReapFinished();
    SchedulePass();
  }
}

void Scheduler::ReapFinished() {
  std::vector<std::unique_ptr<JobRun>> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = runs_.begin(); it != runs_.end();) {
      if (it->second->done()) {
        done.push_back(std::move(it->second));
        it = runs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& r : done) r->Join();
}

int Scheduler::ChooseWorldSize(const v1::JobSpec& spec, int free) {
  const int mn = std::max(1, spec.sharding().min_workers());
  const int mx = std::max(mn, spec.sharding().max_workers());
  const int64_t gb = spec.training().global_batch();
  for (int n = std::min(mx, free); n >= mn; --n) {
    int64_t mb = spec.training().has_microbatch() ? spec.training().microbatch() : gb / n;
    if (mb >= 1 && gb % (n * mb) == 0) return n;
  }
  return 0;
}

int Scheduler::MinWorldSize(const v1::JobSpec& spec) {
  const int mn = std::max(1, spec.sharding().min_workers());
  const int mx = std::max(mn, spec.sharding().max_workers());
  for (int n = mn; n <= mx; ++n)
    if (ChooseWorldSize(spec, n) == n) return n;
  return mn;
}

void Scheduler::SchedulePass() {
  std::map<std::string, std::vector<std::string>> free;
  const std::vector<v1::Job> pending = jobs_->PendingJobs();
  for (auto it = recovering_since_.begin(); it != recovering_since_.end();) {
    bool waiting = false;
    for (const v1::Job& j : pending) waiting |= j.job_id() == it->first;
    it = waiting ? std::next(it) : recovering_since_.erase(it);
  }
  for (const v1::Job& job : pending) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    const bool recovering = job.state() == v1::JOB_STATE_RECOVERING;
    if (recovering) {
      std::lock_guard<std::mutex> lock(mu_);
      if (runs_.count(job.job_id())) continue;  // the failed generation is still unwinding
    }
    std::string backend = job.spec().backend().empty() ? "cpu" : job.spec().backend();
    auto it = free.find(backend);
    if (it == free.end()) it = free.emplace(backend, workers_->FreeWorkers(backend)).first;
    std::vector<std::string>& f = it->second;
    int n = ChooseWorldSize(job.spec(), static_cast<int>(f.size()));
    if (n == 0) {
      int need = MinWorldSize(job.spec());
      std::string why = absl::StrCat("waiting for ", need, " workers (", f.size(), " free)");
      if (recovering) {
        const auto now = Clock::now();
        const auto since = recovering_since_.emplace(job.job_id(), now).first->second;
        if (now - since >= options_.start_timeout) {
          recovering_since_.erase(job.job_id());
          jobs_->Finish(job.job_id(), v1::JOB_STATE_FAILED,
                        absl::StrCat("could not recover: ", why, " for ",
                                     options_.start_timeout.count(), " ms"))
              .IgnoreError();
          continue;
        }
        why = absl::StrCat("recovering: ", why);
      }
      jobs_->SetPendingReason(job.job_id(), why).IgnoreError();
      continue;
    }
    recovering_since_.erase(job.job_id());
    std::vector<std::string> chosen(f.begin(), f.begin() + n);
    auto inbox = std::make_shared<Inbox>();
    if (!workers_->Assign(chosen, job.job_id(), [inbox](const WorkerEvent& ev) { inbox->Push(ev); })
             .ok()) {
      f = workers_->FreeWorkers(backend);  // the picture changed; look again next pass
      Wake();
      continue;
    }
    f.erase(f.begin(), f.begin() + n);
    auto started = jobs_->MarkStarting(job.job_id(), chosen);
    if (!started.ok()) {  // cancelled meanwhile
      workers_->Release(job.job_id());
      continue;
    }
    auto run = std::make_unique<JobRun>(jobs_, workers_, kv_, options_, *started, inbox,
                                        [this] { Wake(); });
    JobRun* raw = run.get();
    {
      std::lock_guard<std::mutex> lock(mu_);
      runs_[job.job_id()] = std::move(run);
    }
    raw->Start();
  }
}

}  // namespace fsdp8::coord
