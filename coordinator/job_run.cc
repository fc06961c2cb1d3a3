#include "coordinator/job_run.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/spec.h"
#include "coordinator/log.h"
#include "coordinator/metrics.h"

namespace fsdp8::coord {

bool IsDeterministicFailure(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kPermissionDenied:
      return true;
    default:
      return false;
  }
}

namespace {

using Clock = std::chrono::steady_clock;

// Step k's command (free-running: the one command for steps k..steps-1).
v1::CoordinatorMessage StepCommandFor(const v1::JobSpec& spec, int64_t k) {
  const int64_t steps = spec.training().steps();
  const bool has_val = !spec.data().val_path().empty();
  const int eval_every = spec.training().eval_every();
  const bool last = k == steps - 1;
  v1::CoordinatorMessage m;
  v1::StepCommand* c = m.mutable_step();
  c->set_step(k);
  c->set_evaluate(has_val && eval_every > 0 && ((k + 1) % eval_every == 0 || last));
  c->set_report_scaling(k % 10 == 0 || last);
  if (spec.training().free_running()) {
    c->set_evaluate(false);
    c->set_report_scaling(false);
    c->set_count(steps - k);
  }
  return m;
}

// Whether a checkpoint is saved once `completed` steps are done: the final save, a periodic one
// (every_steps), or one `requested` by TriggerCheckpoint. Free-running workers are busy stepping
// until the end: only the final save.
bool SaveDue(const v1::JobSpec& spec, int64_t completed, bool requested) {
  const v1::CheckpointSpec& ckpt = spec.checkpoint();
  if (ckpt.dir().empty()) return false;
  if (completed == spec.training().steps()) return true;
  if (spec.training().free_running()) return false;
  return requested || (ckpt.every_steps() > 0 && completed % ckpt.every_steps() == 0);
}

// The job event of step k from every rank's result: loss over the global batch, throughput over
// `secs` less the validation's time, the slowest rank's time and memory breakdown. Adds the step's
// tokens to *tokens_total.
v1::JobEvent StepEvent(int64_t k, bool evaluated, const std::vector<v1::StepResult>& results,
                       double secs, int64_t* tokens_total) {
  double loss_sum = 0;
  int64_t tokens = 0;
  for (const auto& res : results) {
    loss_sum += res.loss_sum();
    tokens += res.tokens();
  }
  *tokens_total += tokens;
  v1::JobEvent ev;
  ev.set_step(k + 1);
  ev.set_loss(tokens > 0 ? loss_sum / tokens : std::numeric_limits<double>::quiet_NaN());
  ev.set_val_loss(evaluated ? results[0].val_loss() : std::numeric_limits<double>::quiet_NaN());
  ev.set_grad_norm(results[0].grad_norm());
  ev.set_lr(results[0].lr());
  ev.set_epoch(results[0].epoch());
  ev.set_tokens(*tokens_total);
  // The validation's time: the least of the ranks' (a rank that finished training early waited in
  // the validation's first collective for the others; the last one to finish did not).
  double eval_secs = results.empty() ? 0 : results[0].eval_seconds();
  for (const auto& res : results) eval_secs = std::min(eval_secs, res.eval_seconds());
  ev.set_eval_seconds(eval_secs);
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
  // The ranks time their validation themselves; should it exceed the interval measured here (a
  // rank that started the step before its previous result arrived), the wall time is used.
  const double train_secs = ev.eval_seconds() < secs ? secs - ev.eval_seconds() : secs;
  ev.set_tokens_per_second(train_secs > 0 ? tokens / train_secs : 0);
  ev.set_step_seconds(secs);
  return ev;
}

absl::Status WithContext(const std::string& what, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// The spec of a job at `replicas` R' that ran at `from` R > R' replicas (continuing on fewer
// replicas): sharding.replicas R'; without sharding.elastic the global batch shrinks by the lost
// replicas' share (each survivor keeps its local batch).
v1::JobSpec SpecOnFewerReplicas(const v1::JobSpec& spec, int from, int replicas) {
  v1::JobSpec next = spec;
  next.mutable_sharding()->set_replicas(replicas);
  if (!next.sharding().elastic()) {
    next.mutable_training()->set_global_batch(
        static_cast<int32_t>(spec.training().global_batch() / from * replicas));
  }
  return next;
}

}  // namespace

// ---- Inbox ----

// Pop waits on mu_ for ReadyLocked, which absl::Mutex evaluates whenever the lock is released.
void Inbox::Push(const WorkerEvent& ev) {
  absl::MutexLock lock(&mu_);
  q_.push_back(ev);
}

void Inbox::Poke() {
  absl::MutexLock lock(&mu_);
  poked_ = true;
}

bool Inbox::Pop(WorkerEvent* out, Clock::time_point until) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(this, &Inbox::ReadyLocked),
                       absl::FromChrono(until - Clock::now()));
  poked_ = false;
  if (q_.empty()) return false;
  *out = std::move(q_.front());
  q_.pop_front();
  return true;
}

// ---- Life of a run ----

JobRun::JobRun(JobManager* jobs, WorkerRegistry* workers, KvServer* kv,
               const SchedulerOptions& options, v1::Job job, std::shared_ptr<Inbox> inbox,
               std::function<void()> on_done, std::optional<Adoption> adoption)
    : jobs_(jobs), workers_(workers), kv_(kv), options_(options), job_(std::move(job)),
      inbox_(std::move(inbox)), on_done_(std::move(on_done)), adoption_(adoption),
      generation_(job_.generation()) {
  for (int r = 0; r < job_.worker_ids_size(); ++r) ranks_.push_back(job_.worker_ids(r));
}

JobRun::~JobRun() { Join(); }

void JobRun::Start() { thread_ = std::thread([this] { Run(); }); }

void JobRun::Poke() { inbox_->Poke(); }

void JobRun::Shutdown() {
  shutdown_ = true;
  inbox_->Poke();
}

void JobRun::Join() {
  if (thread_.joinable()) thread_.join();
}

void JobRun::Run() {
  const std::string& id = job_.job_id();
  prefix_ = absl::StrCat("job/", id, "/gen/", generation_, "/");
  absl::Status s = Drive();
  std::vector<std::string> aborted;
  if (!s.ok()) {
    v1::CoordinatorMessage m;
    m.mutable_abort()->set_reason(EndFailedGeneration(s));
    // Every rank gets Abort, except one whose failure it reported itself or whose session is gone.
    // A rank of a job that may continue on fewer replicas keeps the job after its own failure
    // until told (worker/daemon.h): it gets Abort too.
    const bool skip_failed = !(absl::IsCancelled(s) || absl::IsAborted(s) || abort_failed_rank_ ||
                               failed_keep_job_);
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

std::string JobRun::EndFailedGeneration(const absl::Status& s) {
  const std::string& id = job_.job_id();
  if (absl::IsAborted(s)) return "coordinator shutting down";
  if (absl::IsCancelled(s)) {
    auto j = jobs_->Get(id);
    return j.ok() && !j->reason().empty() ? j->reason() : "job ended";
  }
  std::string reason(s.message());
  if (jobs_->CancelRequested(id)) {
    // A cancel waited for a save that this failure prevented: the job is cancelled, not
    // restarted, and says why nothing was saved.
    const std::string cancelled = absl::StrCat("cancelled by user; no checkpoint saved: ", reason);
    if (jobs_->Finish(id, v1::JOB_STATE_CANCELLED, cancelled).ok()) return cancelled;
  }
  const int max_restarts = job_.spec().max_restarts();  // defaults applied at submit
  LogEvent("generation_failed",
           {{"job", id},
            {"generation", job_.generation()},
            {"rank", failed_rank_},
            {"worker", failed_rank_ >= 0 ? ranks_[failed_rank_] : std::string()},
            {"code", absl::StatusCodeToString(s.code())},
            {"deterministic", IsDeterministicFailure(s.code()) ? "yes" : "no"},
            {"cause", reason}});
  if (assigning_ && recoverable_ && !job_.spec().checkpoint().dir().empty() &&
      job_.restarts() < max_restarts) {
    if (!jobs_->MarkRecovering(id, reason, max_restarts).ok()) {
      auto j = jobs_->Get(id);  // ended meanwhile (cancelled): abort with its reason
      if (j.ok()) reason = j->reason();
    }
  } else if (!jobs_->Finish(id, v1::JOB_STATE_FAILED, reason).ok()) {
    auto j = jobs_->Get(id);  // ended meanwhile (cancelled): abort with its reason
    if (j.ok()) reason = j->reason();
  }
  return reason;
}

absl::Status JobRun::Drive() {
  // The spec resolved at this world size, once per job (JobManager::Resolved): what every
  // rank's Assignment carries and what the workers check without filling anything in.
  const int world_size = static_cast<int>(ranks_.size());
  const std::shared_ptr<ResolvedJob> resolved = jobs_->Resolved(job_.job_id());
  if (resolved == nullptr) return absl::CancelledError("job deleted");
  // The mesh the scheduler placed the ranks as (Job.replicas: auto resolved by the placement).
  absl::StatusOr<v1::JobSpec> at = resolved->SpecAt(world_size, job_.replicas());
  const int configured = job_.configured_replicas(), live = job_.replicas();
  if (at.ok() && configured > live && live >= 1 && world_size % live == 0) {
    // A job re-adopted while it continued on fewer replicas: the configured mesh's spec, reduced
    // as ContinueOnFewerReplicas reduced it.
    at = resolved->SpecAt(world_size / live * configured, configured);
    if (at.ok()) at = SpecOnFewerReplicas(*at, configured, live);
    if (at.ok()) {
      if (absl::Status s = CheckResolved(*at, world_size); !s.ok()) at = s;
    }
  }
  if (!at.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("spec at world size ", world_size, ": ", at.status().message()));
  }
  v1::JobSpec spec = *std::move(at);
  failed_keep_job_ = MayShrink(spec);
  Progress p;
  absl::Status started = adoption_ ? StartAdopted(spec, &p) : StartGeneration(spec, &p);
  if (!started.ok()) return started;
  if (absl::Status s = SaveAtAdoption(spec, &p); !s.ok()) return s;
  const int64_t steps = spec.training().steps();
  for (int64_t k = p.start_step; k < steps; ++k) {
    absl::Status s = RunStep(spec, k, &p);
    if (s.ok()) continue;
    // A lost replica: the survivors go on from the step that was in flight (or the checkpoint).
    absl::StatusOr<int64_t> next = ContinueOnFewerReplicas(&spec, s, &p);
    if (!next.ok()) return next.status();
    failed_keep_job_ = MayShrink(spec);  // the rule at the new mesh
    k = *next - 1;
  }
  v1::CoordinatorMessage fin;
  fin.mutable_finish();
  SendAll(fin);
  jobs_->Finish(job_.job_id(), v1::JOB_STATE_SUCCEEDED, absl::StrCat("completed ", steps, " steps"))
      .IgnoreError();
  return absl::OkStatus();
}

// ---- Talking to the ranks ----

std::string JobRun::RankName(int r) const {
  return absl::StrCat("rank ", r, " (worker ", ranks_[r], ")");
}

int JobRun::RankOf(const std::string& worker_id) const {
  for (size_t r = 0; r < ranks_.size(); ++r)
    if (ranks_[r] == worker_id) return static_cast<int>(r);
  return -1;
}

bool JobRun::SendAll(const v1::CoordinatorMessage& msg, int skip) {
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

absl::Status JobRun::Await(Clock::time_point deadline, const std::string& what,
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
      if (names.size() < ranks_.size()) {
        for (size_t r = 0; r < got.size(); ++r)
          if (!got[r]) missed_[static_cast<int>(r)] = absl::StrCat("no answer to ", what);
      }
      return absl::DeadlineExceededError(absl::StrCat("timed out waiting for ", what, " from ",
                                                      absl::StrJoin(names, ", ")));
    }
    if (!inbox_->Pop(&ev, std::min(deadline, now + std::chrono::seconds(1)))) continue;
    int r = RankOf(ev.worker_id);
    if (r < 0) continue;
    if (ev.kind == WorkerEvent::kLost) {
      lost_[r] = ev.reason;
      failed_rank_ = r;
      // Silent but maybe alive (its Session may still be open): tell it to abort too.
      abort_failed_rank_ = ev.reason.rfind("no heartbeat", 0) == 0;
      return absl::UnavailableError(absl::StrCat(RankName(r), " lost: ", ev.reason));
    }
    const v1::WorkerMessage& m = ev.message;
    // A report of an earlier generation of the job (before it continued on fewer replicas).
    if ((m.has_error() && m.error().generation() != 0 && m.error().generation() != generation_) ||
        (m.has_result() && m.result().generation() != 0 &&
         m.result().generation() != generation_))
      continue;
    if (IsJobError(m)) {
      errors_[r] = {static_cast<absl::StatusCode>(m.error().code()), m.error().message()};
      failed_rank_ = r;
      absl::Status s = RankError(r, m.error());
      if (!IsDeterministicFailure(s.code()))
        s = AwaitRootCause(s, static_cast<absl::StatusCode>(m.error().code()));
      // A restart would fail the same way: the job fails with this cause.
      if (IsDeterministicFailure(s.code())) recoverable_ = false;
      return s;
    }
    if (m.has_result() && m.result().job_id() == job_.job_id() &&
        (m.result().step() < 0 || m.result().step() >= steps_sent_)) {
      // A result for a step this generation never sent: the worker is broken (or not a worker).
      failed_rank_ = r;
      abort_failed_rank_ = true;
      return absl::InternalError(absl::StrCat(RankName(r), " reported a result for step ",
                                              m.result().step(), ", which it was never sent"));
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

bool JobRun::IsJobError(const v1::WorkerMessage& m) const {
  return m.has_error() && (m.error().job_id().empty() || m.error().job_id() == job_.job_id());
}

absl::Status JobRun::RankError(int r, const v1::WorkerError& e) const {
  const auto code = static_cast<absl::StatusCode>(e.code());
  const std::string msg = absl::StrCat(RankName(r), " reported an error: ", e.message());
  return IsDeterministicFailure(code) ? absl::Status(code, msg) : absl::InternalError(msg);
}

absl::Status JobRun::AwaitRootCause(absl::Status first, absl::StatusCode first_code) {
  const auto until = Clock::now() + std::chrono::milliseconds(250);
  WorkerEvent ev;
  while (inbox_->Pop(&ev, until)) {
    const int r = RankOf(ev.worker_id);
    if (r >= 0 && ev.kind == WorkerEvent::kLost) lost_[r] = ev.reason;
    if (r < 0 || ev.kind != WorkerEvent::kMessage || !IsJobError(ev.message)) continue;
    if (ev.message.error().generation() != 0 && ev.message.error().generation() != generation_)
      continue;
    errors_[r] = {static_cast<absl::StatusCode>(ev.message.error().code()),
                  ev.message.error().message()};
    absl::Status s = RankError(r, ev.message.error());
    const bool peers_own = first_code == absl::StatusCode::kUnavailable &&
                           static_cast<absl::StatusCode>(ev.message.error().code()) !=
                               absl::StatusCode::kUnavailable;
    if (IsDeterministicFailure(s.code()) || peers_own) {
      failed_rank_ = r;
      return s;
    }
  }
  return first;
}

// ---- Continue on fewer replicas ----

void JobRun::CollectFailures() {
  const auto start = Clock::now();
  const auto limit = start + std::chrono::seconds(1);
  std::optional<Clock::time_point> settle;  // 100 ms after the first lost rank is known
  if (!lost_.empty()) settle = start + std::chrono::milliseconds(100);
  WorkerEvent ev;
  for (;;) {
    const auto until = settle ? std::min(*settle, limit) : limit;
    if (Clock::now() >= until || !inbox_->Pop(&ev, until)) {
      if (Clock::now() >= until) break;
      continue;
    }
    const int r = RankOf(ev.worker_id);
    if (r < 0) continue;
    if (ev.kind == WorkerEvent::kLost) {
      lost_[r] = ev.reason;
      if (!settle) settle = Clock::now() + std::chrono::milliseconds(100);
      continue;
    }
    const v1::WorkerMessage& m = ev.message;
    if (!IsJobError(m)) continue;  // results of the failed step are of no use now
    if (m.error().generation() != 0 && m.error().generation() != generation_) continue;
    errors_[r] = {static_cast<absl::StatusCode>(m.error().code()), m.error().message()};
  }
}

std::map<int, std::string> JobRun::FailedRanks() const {
  if (!lost_.empty()) {
    std::map<int, std::string> out;
    for (const auto& [r, why] : lost_) out[r] = absl::StrCat("lost: ", why);
    return out;
  }
  if (!missed_.empty()) return missed_;
  std::map<int, std::string> out;
  for (const auto& [r, e] : errors_) {
    const bool peers = e.first == absl::StatusCode::kUnavailable ||
                       e.first == absl::StatusCode::kAborted ||
                       e.first == absl::StatusCode::kCancelled ||
                       e.first == absl::StatusCode::kDeadlineExceeded;
    if (!peers) out[r] = e.second;
  }
  return out;
}

absl::StatusOr<int64_t> JobRun::ContinueOnFewerReplicas(v1::JobSpec* spec,
                                                         const absl::Status& failure,
                                                         Progress* p) {
  const std::string& id = job_.job_id();
  const int64_t k = in_flight_;
  const int n = static_cast<int>(ranks_.size());
  absl::StatusOr<Mesh> mesh = MeshOf(*spec, n);
  if (k < 0 || !mesh.ok() || mesh->replicas < 2 || spec->training().free_running() ||
      !recoverable_ || absl::IsCancelled(failure) || absl::IsAborted(failure) ||
      IsDeterministicFailure(failure.code()))  // bad input: the survivors would fail the same
    return failure;
  const auto t0 = Clock::now();
  CollectFailures();
  const std::map<int, std::string> failed = FailedRanks();
  std::set<int> replicas;
  for (const auto& [r, why] : failed) replicas.insert(mesh->Replica(r));
  if (failed.empty() || replicas.size() != 1) return failure;
  const int lost = *replicas.begin();
  const int first = failed.begin()->first;
  const std::string what = absl::StrCat("replica ", lost, " lost (rank ", first, " (worker ",
                                        ranks_[first], "): ", failed.begin()->second, ")");
  auto fallback = [&](const std::string& why) -> absl::Status {
    LogEvent("replica_lost", {{"job", id}, {"generation", generation_}, {"replica", lost},
                              {"step", k}, {"continued", "no"}, {"cause", why}});
    if (!jobs_->PublishMessage(id, absl::StrCat(what, ": ", why,
                                                "; falling back to the checkpoint path"))
             .ok())
      return absl::CancelledError("job ended");
    return failure;
  };
  if (mesh->optimizer_over_world)
    return fallback("optimizer_sharding WORLD: the surviving replicas hold only their pieces of "
                    "the optimizer state");
  const int replicas_left = mesh->replicas - 1;
  const int world_left = replicas_left * mesh->shard_size;
  const v1::JobSpec next = SpecOnFewerReplicas(*spec, mesh->replicas, replicas_left);
  if (absl::Status s = CheckResolved(next, world_left); !s.ok())
    return fallback(absl::StrCat("the spec at ", replicas_left, " x ", mesh->shard_size,
                                 " ranks: ", s.message()));
  std::vector<std::string> survivors;
  for (int r = 0; r < n; ++r)
    if (mesh->Replica(r) != lost) survivors.push_back(ranks_[r]);
  // Replica `lost`'s live ranks drop the job (they go IDLE once the grace has passed).
  v1::CoordinatorMessage abort;
  abort.mutable_abort()->set_reason(absl::StrCat(what, ": the job continues on ", replicas_left,
                                                 " replica", replicas_left == 1 ? "" : "s",
                                                 " without this one"));
  for (int r = 0; r < n; ++r)
    if (mesh->Replica(r) == lost) workers_->Send(ranks_[r], abort);
  const std::string batch =
      next.sharding().elastic()
          ? absl::StrCat("; global batch ", next.training().global_batch(),
                         " kept by gradient accumulation")
          : absl::StrCat("; global batch ", next.training().global_batch(), " (was ",
                         spec->training().global_batch(), ")");
  auto job = jobs_->MarkReconfigured(
      id, survivors, replicas_left,
      absl::StrCat(what, ": continuing on ", replicas_left, " replica",
                   replicas_left == 1 ? "" : "s", " at step ", k, " (generation ",
                   generation_ + 1, "; no checkpoint read", batch, ")"));
  if (!job.ok()) return absl::CancelledError("job ended");
  workers_->Shrink(id, survivors, options_.abort_grace);
  kv_->DeletePrefix(prefix_);
  LogEvent("replica_lost", {{"job", id}, {"generation", job->generation()}, {"replica", lost},
                            {"step", k}, {"continued", "yes"}, {"replicas", replicas_left},
                            {"cause", what}});
  generation_ = job->generation();
  prefix_ = absl::StrCat("job/", id, "/gen/", generation_, "/");
  ranks_ = survivors;
  failed_rank_ = -1;
  abort_failed_rank_ = false;
  lost_.clear();
  missed_.clear();
  errors_.clear();
  early_results_.clear();
  // The survivors drop the step in flight and the one sent ahead (discarding any partial work
  // on steps >= k), roll back to the end of step k - 1 and re-run k on the new mesh.
  for (int r = 0; r < world_left; ++r) {
    v1::CoordinatorMessage m;
    v1::Reconfigure* rc = m.mutable_reconfigure();
    rc->set_job_id(id);
    rc->set_generation(generation_);
    rc->set_rank(r);
    rc->set_world_size(world_left);
    *rc->mutable_spec() = next;
    rc->set_store_prefix(prefix_);
    rc->set_collective_timeout_ms(options_.collective_timeout_ms);
    rc->set_bootstrap_timeout_ms(static_cast<int32_t>(std::clamp<int64_t>(
        options_.start_timeout.count(), 1, std::numeric_limits<int32_t>::max())));
    rc->set_step(k);
    if (!workers_->Send(ranks_[r], m)) {
      failed_rank_ = r;
      return absl::UnavailableError(
          absl::StrCat("could not send Reconfigure to ", RankName(r), ": session closed"));
    }
  }
  const int64_t gen = generation_;
  absl::Status ready = Await(Clock::now() + options_.start_timeout, "Ready",
                             [&](int, const v1::WorkerMessage& m) {
                               return m.has_ready() && m.ready().job_id() == id &&
                                      m.ready().generation() == gen;
                             });
  if (!ready.ok()) return ready;
  *spec = std::move(next);
  p->next_to_send = k;
  steps_sent_ = k;
  p->last_result = Clock::now();
  LogEvent("replicas_reduced",
           {{"job", id}, {"generation", generation_}, {"replicas", replicas_left},
            {"world_size", world_left}, {"step", k},
            {"seconds", std::chrono::duration<double>(Clock::now() - t0).count()}});
  return k;
}

// ---- Start of a generation ----

absl::Status JobRun::RemoveSaveLeftovers(const v1::JobSpec& spec) {
  if (spec.checkpoint().dir().empty()) return absl::OkStatus();
  // No save of this job is in progress: what an interrupted one left goes (each logged).
  auto removed =
      CheckpointStore(spec.checkpoint().dir(), job_.job_id(), options_.faults, jobs_->SaveLease())
          .RemoveLeftovers();
  // A failure fails the generation: its saves would meet what was not cleaned up.
  if (!removed.ok())
    return absl::Status(removed.status().code(),
                        absl::StrCat("checkpoint.dir ", spec.checkpoint().dir(),
                                     ": removing leftovers: ", removed.status().message()));
  return absl::OkStatus();
}

absl::Status JobRun::SaveAtAdoption(const v1::JobSpec& spec, Progress* p) {
  if (!adoption_ || !SaveDue(spec, p->start_step, false) || p->start_step == 0)
    return absl::OkStatus();
  // The ranks completed step K while no coordinator ran (or before its save committed): the save
  // due at K (periodic or final) is taken now unless K's checkpoint is committed already.
  auto latest = CheckpointStore(spec.checkpoint().dir()).Latest(job_.job_id());
  if (!latest.ok())
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint.dir: ", latest.status().message()));
  if (latest->has_value() && (*latest)->step >= p->start_step) return absl::OkStatus();
  return SaveWithRetry(spec, p->start_step, p);
}

absl::Status JobRun::StartAdopted(const v1::JobSpec& spec, Progress* p) {
  p->start_step = adoption_->step;
  p->tokens_total = adoption_->tokens;
  assigning_ = true;  // the ranks hold the job: a failure must Abort them
  const int n = static_cast<int>(ranks_.size());
  for (int r = 0; r < n; ++r) {
    v1::CoordinatorMessage m;
    m.mutable_adopt()->set_job_id(job_.job_id());
    m.mutable_adopt()->set_generation(job_.generation());
    m.mutable_adopt()->set_rank(r);
    if (!workers_->Send(ranks_[r], m)) {
      failed_rank_ = r;
      return absl::UnavailableError(
          absl::StrCat("could not send Adopt to ", RankName(r), ": session closed"));
    }
    // The steps other ranks received and this one did not: its peers wait for it in them.
    const int64_t from = r < static_cast<int>(adoption_->received.size())
                             ? adoption_->received[r] : p->start_step;
    for (int64_t k = from; k < p->start_step;) {
      const v1::CoordinatorMessage step = StepCommandFor(spec, k);
      if (!workers_->Send(ranks_[r], step)) {
        failed_rank_ = r;
        return absl::UnavailableError(
            absl::StrCat("could not send step ", k, " to ", RankName(r), ": session closed"));
      }
      k += std::max<int64_t>(1, step.step().count());
    }
  }
  // Results of those steps may come: they were sent (and are dropped once a later step is awaited).
  steps_sent_ = spec.training().free_running() ? spec.training().steps() : p->start_step;
  if (absl::Status s = AwaitReady(); !s.ok()) return s;
  // Only now: until every rank's Ready, a rank could still be writing a save's staging directory
  // (a worker with a save in flight does not hold the job, but a stale writer must not race this).
  if (absl::Status s = RemoveSaveLeftovers(spec); !s.ok()) return s;
  const std::string msg =
      absl::StrCat("re-adopted ", n, " ranks at step ", p->start_step, " (generation ",
                   job_.generation(), "; no checkpoint read)");
  LogEvent("generation_readopted", {{"job", job_.job_id()},
                                    {"generation", job_.generation()},
                                    {"world_size", n},
                                    {"steps_done", p->start_step}});
  if (!jobs_->PublishMessage(job_.job_id(), msg).ok()) return absl::CancelledError("job ended");
  p->last_result = Clock::now();
  p->next_to_send = p->start_step;
  return absl::OkStatus();
}

absl::Status JobRun::StartGeneration(const v1::JobSpec& spec, Progress* p) {
  if (absl::Status s = RemoveSaveLeftovers(spec); !s.ok()) return s;
  std::optional<CommittedCheckpoint> resume;
  if (absl::Status s = ResolveResume(spec, &resume); !s.ok()) return s;
  if (resume) {
    p->start_step = resume->step;
    p->tokens_total = resume->manifest.tokens();
  }
  std::optional<CommittedCheckpoint> init;
  if (!resume && !spec.init().from_checkpoint().empty()) {
    // A job without a checkpoint of its own starts from another job's (read only).
    const std::string& dir = spec.init().from_checkpoint();
    auto ck = CheckpointStore::Open(dir);
    if (!ck.ok())
      return absl::FailedPreconditionError(
          absl::StrCat("init.from_checkpoint: ", ck.status().message()));
    if (absl::Status s = CheckpointStore::CheckResumeCompatible(spec, ck->manifest.spec(), dir,
                                                                "init.from_checkpoint");
        !s.ok())
      return s;
    init = std::move(*ck);
  }
  if (absl::Status s = AnnounceStart(resume); !s.ok()) return s;
  assigning_ = true;  // from here on a failure must Abort the ranks
  if (absl::Status s = SendAssignments(spec, resume, init); !s.ok()) return s;
  if (absl::Status s = AwaitReady(); !s.ok()) return s;
  p->last_result = Clock::now();
  p->next_to_send = p->start_step;
  return absl::OkStatus();
}

absl::Status JobRun::ResolveResume(const v1::JobSpec& spec,
                                   std::optional<CommittedCheckpoint>* out) {
  const v1::CheckpointSpec& cs = spec.checkpoint();
  if (cs.dir().empty()) return absl::OkStatus();
  std::string step_dir = cs.resume_from();
  if (job_.restarts() > 0 || job_.resumes() > 0) {
    // A restarted or resumed generation continues from the job's own newest committed
    // checkpoint; before the first one, from where the job itself started.
    auto latest = CheckpointStore(cs.dir()).Latest(job_.job_id());
    if (!latest.ok())
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint.dir: ", latest.status().message()));
    if (latest->has_value()) {
      step_dir = (*latest)->dir;
    } else if (job_.resumes() > 0) {
      // Resume started the job from its own newest checkpoint (Job.step): it continues from
      // there or not at all, never from resume_from (another job's, with "latest") or step 0.
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: checkpoint.dir ", cs.dir(), " no longer holds a committed checkpoint of job ",
          job_.job_id(), "; a resumed job continues only from its own newest committed "
          "checkpoint (submit it again to start over)"));
    }
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

absl::Status JobRun::AnnounceStart(const std::optional<CommittedCheckpoint>& resume) {
  const std::string& id = job_.job_id();
  const int n = static_cast<int>(ranks_.size());
  if (resume) {
    const int saved_by = resume->manifest.world_size();
    if (!jobs_->MarkResumed(id, resume->step, resume->manifest.tokens(),
                            absl::StrCat("resuming from ", resume->dir, " (step ", resume->step,
                                         ", saved by ", saved_by, " ranks)",
                                         saved_by == n
                                             ? ""
                                             : absl::StrCat(", resharded to ", n, " ranks")))
             .ok())
      return absl::CancelledError("job ended");
  } else if (job_.restarts() > 0) {
    if (!jobs_->MarkResumed(id, 0, 0, "restarting from step 0 (no committed checkpoint)").ok())
      return absl::CancelledError("job ended");
  }
  return absl::OkStatus();
}

absl::Status JobRun::SendAssignments(const v1::JobSpec& spec,
                                     const std::optional<CommittedCheckpoint>& resume,
                                     const std::optional<CommittedCheckpoint>& init) {
  const int n = static_cast<int>(ranks_.size());
  for (int r = 0; r < n; ++r) {
    v1::CoordinatorMessage m;
    v1::Assignment* a = m.mutable_assignment();
    a->set_job_id(job_.job_id());
    a->set_generation(job_.generation());
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
      a->set_start_step(resume->step);
    } else if (init) {
      a->set_init_dir(init->dir);
      a->set_init_world_size(init->manifest.world_size());
    }
    if (!workers_->Send(ranks_[r], m)) {
      failed_rank_ = r;
      return absl::UnavailableError(
          absl::StrCat("could not send the assignment to ", RankName(r), ": session closed"));
    }
  }
  return absl::OkStatus();
}

absl::Status JobRun::AwaitReady() {
  const std::string& id = job_.job_id();
  const int64_t gen = generation_;
  absl::Status s = Await(Clock::now() + options_.start_timeout, "Ready",
                         [&](int, const v1::WorkerMessage& m) {
                           return m.has_ready() && m.ready().job_id() == id &&
                                  m.ready().generation() == gen;
                         });
  if (!s.ok()) return s;
  if (!jobs_->MarkRunning(id).ok()) return absl::CancelledError("job ended");
  return absl::OkStatus();
}

// ---- Steps ----

absl::Status JobRun::RunStep(const v1::JobSpec& spec, int64_t k, Progress* p) {
  const v1::CoordinatorMessage command = StepCommandFor(spec, k);
  Clock::time_point t0;
  in_flight_ = k;
  if (absl::Status s = SendStep(spec, command, k, p, &t0); !s.ok()) return s;
  const std::optional<absl::Status> ahead_failed = SendAhead(spec, k, p);
  std::vector<v1::StepResult> results;
  if (absl::Status s = AwaitResults(k, t0, &results); !s.ok()) return s;
  // Step k is complete: a failure from here on is not in a step (save, publish), except a failed
  // send of step k + 1 ahead, which is step k + 1's (it is re-run after step k is published).
  in_flight_ = -1;
  std::optional<absl::Status> ahead_failure = ahead_failed;
  if (ahead_failure && !MayShrink(spec)) return *ahead_failure;
  // Anything left for step k or earlier (a duplicate) will never be awaited.
  for (auto it = early_results_.begin(); it != early_results_.end();) {
    it = it->second.result().step() <= k ? early_results_.erase(it) : std::next(it);
  }
  p->last_result = Clock::now();
  const double secs = std::chrono::duration<double>(p->last_result - t0).count();
  const v1::JobEvent ev =
      StepEvent(k, command.step().evaluate(), results, secs, &p->tokens_total);
  bool requested = false;
  if (absl::Status s = PublishStep(k, ev, results, &requested); !s.ok()) return s;
  if (absl::Status s = CheckFinite(spec, ev, results, p); !s.ok()) return s;
  if (ahead_failure) {
    in_flight_ = k + 1;
    return *ahead_failure;
  }
  const int64_t completed = k + 1;
  // A request that arrived after step k+1 was sent ahead is honoured after step k+1.
  if (requested && p->next_to_send > completed) {
    p->save_pending = true;
    requested = false;
  } else if (p->save_pending && p->next_to_send == completed) {
    p->save_pending = false;
    requested = true;
  }
  if (!SaveDue(spec, completed, requested)) return absl::OkStatus();
  if (absl::Status s = SaveWithRetry(spec, completed, p); !s.ok()) return s;
  return CancelAfterSave(spec, completed, p);
}

bool JobRun::MayShrink(const v1::JobSpec& spec) const {
  absl::StatusOr<Mesh> mesh = MeshOf(spec, static_cast<int>(ranks_.size()));
  return mesh.ok() && mesh->replicas > 1 && !mesh->optimizer_over_world &&
         !spec.training().free_running();
}

absl::Status JobRun::CancelAfterSave(const v1::JobSpec& spec, int64_t completed,
                                     const Progress* p) {
  // The last step's save ends the job SUCCEEDED instead.
  if (completed == spec.training().steps() || !jobs_->CancelRequested(job_.job_id()))
    return absl::OkStatus();
  const std::string reason =
      p->failed_saves == 0
          ? absl::StrCat("cancelled by user after step ", completed, " (", last_save_, ")")
          : absl::StrCat("cancelled by user after step ", completed,
                         "; no checkpoint saved: ", last_save_);
  jobs_->Finish(job_.job_id(), v1::JOB_STATE_CANCELLED, reason).IgnoreError();
  return absl::CancelledError("job ended");
}

absl::Status JobRun::SendStep(const v1::JobSpec& spec, const v1::CoordinatorMessage& command,
                              int64_t k, Progress* p, Clock::time_point* t0) {
  const bool free_running = spec.training().free_running();
  *t0 = free_running && k > p->start_step ? p->last_result : Clock::now();
  if (p->next_to_send != k) {
    *t0 = p->last_result;  // sent ahead: the ranks started it when step k-1 ended
    return absl::OkStatus();
  }
  // Free-running ranks got one command for all their steps.
  if ((!free_running || k == p->start_step) && !SendAll(command))
    return absl::UnavailableError(absl::StrCat("could not send step ", k, " to ",
                                               RankName(failed_rank_), ": session closed"));
  jobs_->SetDispatched(job_.job_id(), k + 1);
  p->next_to_send = k + 1;
  steps_sent_ = free_running ? spec.training().steps() : k + 1;
  return absl::OkStatus();
}

std::optional<absl::Status> JobRun::SendAhead(const v1::JobSpec& spec, int64_t k, Progress* p) {
  const int64_t steps = spec.training().steps();
  if (!options_.dispatch_ahead || spec.training().free_running() || k + 1 >= steps ||
      p->next_to_send != k + 1 || SaveDue(spec, k + 1, false) || p->save_pending ||
      !jobs_->TryDispatchAhead(job_.job_id(), k + 2))
    return std::nullopt;
  std::optional<absl::Status> failed;
  if (!SendAll(StepCommandFor(spec, k + 1)))
    failed = absl::UnavailableError(absl::StrCat("could not send step ", k + 1, " to ",
                                                 RankName(failed_rank_), ": session closed"));
  p->next_to_send = k + 2;
  steps_sent_ = k + 2;
  return failed;
}

absl::Status JobRun::AwaitResults(int64_t k, Clock::time_point t0,
                                  std::vector<v1::StepResult>* results) {
  const std::string& id = job_.job_id();
  results->assign(ranks_.size(), v1::StepResult());
  return Await(t0 + options_.step_timeout, absl::StrCat("the result of step ", k),
               [&](int r, const v1::WorkerMessage& wm) {
                 if (!wm.has_result() || wm.result().job_id() != id || wm.result().step() != k)
                   return false;
                 (*results)[r] = wm.result();
                 return true;
               });
}

absl::Status JobRun::PublishStep(int64_t k, const v1::JobEvent& ev,
                                 const std::vector<v1::StepResult>& results, bool* requested) {
  const std::string& id = job_.job_id();
  for (const auto& res : results) {
    if (res.has_scaling()) {
      v1::ScalingState st = res.scaling();
      if (st.step() == 0) st.set_step(k + 1);
      jobs_->SetScalingState(id, st);
      break;
    }
  }
  // Metrics first: a watcher that has seen step k's event then scrapes at least k steps.
  if (options_.metrics) options_.metrics->OnStep(id, ev, results);
  if (!jobs_->RecordStep(id, ev, requested).ok()) return absl::CancelledError("job ended");
  return absl::OkStatus();
}

absl::Status JobRun::CheckFinite(const v1::JobSpec& spec, const v1::JobEvent& ev,
                                 const std::vector<v1::StepResult>& results, Progress* p) {
  bool skipped = false;
  for (const auto& res : results) skipped = skipped || res.skipped();
  if (!skipped && std::isfinite(ev.loss()) && std::isfinite(ev.grad_norm())) return absl::OkStatus();
  ++p->nonfinite_steps;
  const int64_t allowed = spec.training().max_nonfinite_steps();
  const std::string what = absl::StrCat("step ", ev.step(), ": loss ", ev.loss(),
                                        ", gradient norm ", ev.grad_norm(), ": not finite");
  LogEvent("step_not_finite", {{"job", job_.job_id()},
                               {"step", ev.step()},
                               {"loss", ev.loss()},
                               {"grad_norm", ev.grad_norm()},
                               {"nonfinite_steps", p->nonfinite_steps},
                               {"max_nonfinite_steps", allowed}});
  if (p->nonfinite_steps > allowed) {
    recoverable_ = false;  // the same data and weights would give the same values again
    return absl::OutOfRangeError(absl::StrCat(
        what, "; ", p->nonfinite_steps, " non-finite step", p->nonfinite_steps == 1 ? "" : "s",
        ", more than training.max_nonfinite_steps ", allowed, " (",
        p->nonfinite_steps == 1 ? "its update was" : "each one's update was", " skipped)"));
  }
  if (!jobs_->PublishMessage(job_.job_id(),
                             absl::StrCat(what, "; its update was skipped (", p->nonfinite_steps,
                                          " of at most ", allowed,
                                          " non-finite steps, training.max_nonfinite_steps)"))
           .ok())
    return absl::CancelledError("job ended");
  return absl::OkStatus();
}

// ---- Checkpoints ----

absl::Status JobRun::SaveWithRetry(const v1::JobSpec& spec, int64_t completed, Progress* p) {
  const v1::CheckpointSpec& ckpt = spec.checkpoint();
  for (;;) {
    bool storage_failure = false;
    absl::Status s = SaveCheckpoint(spec, completed, p->tokens_total, &storage_failure);
    if (s.ok()) {
      p->failed_saves = 0;
      return s;
    }
    last_save_ = std::string(s.message());
    if (!storage_failure) {
      // A rank lost during the save is a failed generation; a save that times out or that a rank
      // answers wrongly is not restarted (a restart would repeat it).
      if (!absl::IsUnavailable(s)) recoverable_ = false;
      return s;
    }
    ++p->failed_saves;
    if (p->failed_saves >= ckpt.max_failed_saves()) {
      recoverable_ = false;
      return absl::ResourceExhaustedError(absl::StrCat(
          p->failed_saves, " consecutive checkpoint saves failed (checkpoint.max_failed_saves ",
          ckpt.max_failed_saves(), "); last: ", s.message()));
    }
    if (!jobs_->PublishMessage(job_.job_id(),
                               absl::StrCat(s.message(), " (failed save ", p->failed_saves,
                                            " of at most ", ckpt.max_failed_saves(),
                                            " in a row; training goes on)"))
             .ok())
      return absl::CancelledError("job ended");
    // The last step has no next interval: its save is retried at once.
    if (completed != spec.training().steps()) return absl::OkStatus();
  }
}

absl::Status JobRun::SaveCheckpoint(const v1::JobSpec& spec, int64_t step, int64_t tokens,
                                    bool* storage_failure) {
  *storage_failure = false;
  const std::string what = absl::StrCat("checkpoint step-", step);
  const CheckpointStore store(spec.checkpoint().dir(), job_.job_id(), options_.faults,
                              jobs_->SaveLease());
  auto storage = [&](const absl::Status& s) {
    *storage_failure = true;
    store.Abandon(step).IgnoreError();  // best effort; Retain removes leftovers later
    return WithContext(what, s);
  };
  auto dir = store.Prepare(step);
  if (absl::IsAlreadyExists(dir.status())) {
    // Another job's committed checkpoint of this step (an earlier owner's): never replaced.
    LogEvent("checkpoint_skipped", {{"job", job_.job_id()}, {"step", step},
                                    {"cause", std::string(dir.status().message())}});
    last_save_ = absl::StrCat(what, " skipped: ", dir.status().message());
    if (!jobs_->PublishMessage(job_.job_id(), last_save_).ok())
      return absl::CancelledError("job ended");
    return absl::OkStatus();
  }
  if (!dir.ok()) return storage(dir.status());
  std::vector<v1::CheckpointSaved> saved;
  if (absl::Status s = CollectSaved(step, *dir, what, &saved); !s.ok()) return s;
  std::vector<std::string> errors;
  for (int r = 0; r < static_cast<int>(saved.size()); ++r)
    if (!saved[r].error().empty()) errors.push_back(absl::StrCat(RankName(r), ": ", saved[r].error()));
  if (!errors.empty()) return storage(absl::ResourceExhaustedError(absl::StrJoin(errors, "; ")));
  auto manifest = ManifestOf(spec, step, tokens, saved, what);
  if (!manifest.ok()) return manifest.status();
  // Never commit what a later load would refuse.
  if (absl::Status v = CheckpointStore::VerifyFiles(*dir, *manifest); !v.ok())
    return storage(absl::DataLossError(v.message()));
  if (absl::Status c = store.Commit(*manifest); !c.ok()) return storage(c);
  auto removed = store.Retain(spec.checkpoint().keep_last());
  std::string note;
  if (!removed.ok()) note = absl::StrCat(" (retention failed: ", removed.status().message(), ")");
  LogEvent("checkpoint_committed", {{"job", job_.job_id()},
                                    {"step", step},
                                    {"dir", *dir},
                                    {"world_size", manifest->world_size()},
                                    {"tokens", tokens}});
  last_save_ = absl::StrCat(what, " committed");
  if (!jobs_->PublishMessage(job_.job_id(), absl::StrCat(what, " committed", note)).ok())
    return absl::CancelledError("job ended");
  return absl::OkStatus();
}

absl::Status JobRun::CollectSaved(int64_t step, const std::string& dir, const std::string& what,
                                  std::vector<v1::CheckpointSaved>* saved) {
  const std::string& id = job_.job_id();
  v1::CoordinatorMessage m;
  m.mutable_save()->set_step(step);
  m.mutable_save()->set_dir(dir);
  const auto t0 = Clock::now();
  if (!SendAll(m))
    return absl::UnavailableError(absl::StrCat("could not send ", what, " to ",
                                               RankName(failed_rank_), ": session closed"));
  saved->assign(ranks_.size(), v1::CheckpointSaved());
  absl::Status s = Await(t0 + options_.step_timeout, absl::StrCat("CheckpointSaved of ", what),
                         [&](int r, const v1::WorkerMessage& wm) {
                           if (!wm.has_saved() || wm.saved().job_id() != id ||
                               wm.saved().step() != step)
                             return false;
                           (*saved)[r] = wm.saved();
                           return true;
                         });
  if (!s.ok()) return WithContext(what, s);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::CheckpointFile>> MeshCheckpointFiles(
    const v1::JobSpec& spec, const std::vector<v1::CheckpointSaved>& saved,
    const std::function<std::string(int)>& rank_name, int* bad_rank) {
  *bad_rank = -1;
  const int n = static_cast<int>(saved.size());
  absl::StatusOr<Mesh> mesh = MeshOf(spec, n);
  if (!mesh.ok()) return mesh.status();
  const int files = mesh->OptimizerShards();
  std::vector<int> writer(files, -1);  // file index -> rank
  auto broken = [&](int r, const std::string& why) {
    *bad_rank = r;
    return absl::InternalError(absl::StrCat(rank_name(r), " ", why));
  };
  for (int r = 0; r < n; ++r) {
    if (saved[r].rank() != r) return broken(r, absl::StrCat("reported rank ", saved[r].rank()));
    const int i = mesh->CheckpointFile(r);
    if (i < 0 && !saved[r].file().empty())
      return broken(r, absl::StrCat("reported file ", saved[r].file(), " but writes none (replica ",
                                    mesh->Replica(r), " under optimizer_sharding SHARD_GROUP)"));
    if (i >= 0 && saved[r].file().empty())
      return broken(r, absl::StrCat("reported no file but writes file ", i, " of ", files));
    if (i >= 0) writer[i] = r;
  }
  std::vector<v1::CheckpointFile> out(files);
  for (int i = 0; i < files; ++i) {
    const v1::CheckpointSaved& from = saved[writer[i]];
    out[i].set_rank(i);
    out[i].set_file(from.file());
    out[i].set_bytes(from.bytes());
    out[i].set_crc32(from.crc32());
  }
  return out;
}

absl::StatusOr<v1::CheckpointManifest> JobRun::ManifestOf(
    const v1::JobSpec& spec, int64_t step, int64_t tokens,
    const std::vector<v1::CheckpointSaved>& saved, const std::string& what) {
  int bad = -1;
  auto files = MeshCheckpointFiles(spec, saved, [this](int r) { return RankName(r); }, &bad);
  if (!files.ok() && bad < 0) return WithContext(what, files.status());
  if (!files.ok()) {
    failed_rank_ = bad;
    abort_failed_rank_ = true;
    return absl::InternalError(absl::StrCat(what, ": ", files.status().message()));
  }
  v1::CheckpointManifest manifest;
  manifest.set_format_version(CheckpointStore::kFormatVersion);
  manifest.set_job_id(job_.job_id());
  manifest.set_step(step);
  manifest.set_world_size(static_cast<int>(files->size()));
  *manifest.mutable_spec() = spec;
  manifest.set_time(NowSeconds());
  manifest.set_tokens(tokens);
  for (v1::CheckpointFile& f : *files) *manifest.add_files() = std::move(f);
  return manifest;
}

}  // namespace fsdp8::coord
