#include "coordinator/scheduler.h"

#include <algorithm>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "coordinator/job_run.h"
#include "coordinator/log.h"
#include "coordinator/memory_fit.h"

namespace fsdp8::coord {
namespace {

using Clock = std::chrono::steady_clock;

// The generation's note on shard groups that placement had to split across domains (placement.h).
std::string SplitNote(const FitChoice& fit) {
  if (fit.split_groups.empty()) return "";
  const int s = fit.world_size / fit.replicas;
  std::vector<std::string> groups;
  for (int g : fit.split_groups) {
    std::vector<std::string> ids(fit.workers.begin() + g * s, fit.workers.begin() + (g + 1) * s);
    groups.push_back(absl::StrCat("replica ", g, " (", absl::StrJoin(ids, ", "), ")"));
  }
  return absl::StrCat("shard groups split across placement domains (hosts, or a host's NVLink "
                      "islands where workers give --placement_domain; no domain had ", s,
                      " free workers left for them): ", absl::StrJoin(groups, "; "));
}

// The steps a held rank will have run once it takes up Adopt: those whose commands it received.
int64_t ReceivedSteps(const v1::HeldJob& h) {
  return std::max(h.steps_completed(), h.steps_received());
}

// Whether a worker id is one the registry gives to unnamed workers (w-<n>, new at each
// registration): such an id says nothing about which process holds it.
bool UnnamedId(const std::string& id) {
  return id.size() > 2 && id.rfind("w-", 0) == 0 &&
         std::all_of(id.begin() + 2, id.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The held reports of job's generation by rank, from every worker's report (`held`, by worker
// id): reports[r] and ids[r] are rank r's, matched by what the report says (job, rank), not by
// worker id (an unnamed worker comes back under a new one). Returns why they do not allow the
// job's re-adoption ("" when they do, or when some rank has not reported yet: *missing names
// those). A named worker of the generation that is back without holding the job (`idle`: healthy
// workers that hold no job) is reason enough at once.
std::string ReadoptRefusal(const v1::Job& job, const std::map<std::string, v1::HeldJob>& held,
                           const std::set<std::string>& idle,
                           std::vector<const v1::HeldJob*>* reports, std::vector<std::string>* ids,
                           std::vector<std::string>* missing) {
  const int n = job.worker_ids_size();
  const int replicas = std::max(1, job.replicas());
  reports->assign(n, nullptr);
  ids->assign(job.worker_ids().begin(), job.worker_ids().end());
  for (const auto& [worker, h] : held) {
    if (h.job_id() != job.job_id()) continue;
    if (h.generation() != job.generation() || h.rank() < 0 || h.rank() >= n ||
        h.world_size() != n || std::max(1, h.replicas()) != replicas)
      return absl::StrCat("worker ", worker, " holds generation ", h.generation(), " as rank ",
                          h.rank(), " of ", h.world_size(), " (", std::max(1, h.replicas()),
                          " replicas), not one of the ", n, " ranks of generation ",
                          job.generation(), " (", replicas, " replicas)");
    if ((*reports)[h.rank()] != nullptr)
      return absl::StrCat("workers ", (*ids)[h.rank()], " and ", worker, " both hold rank ",
                          h.rank());
    (*reports)[h.rank()] = &h;
    (*ids)[h.rank()] = worker;
  }
  int64_t target = 0;  // every rank runs the steps any rank received
  for (int r = 0; r < n; ++r) {
    const v1::HeldJob* h = (*reports)[r];
    const std::string who = absl::StrCat("rank ", r, " (worker ", (*ids)[r], ")");
    if (h == nullptr) {
      if (!UnnamedId(job.worker_ids(r)) && idle.count(job.worker_ids(r)))
        return absl::StrCat(who, " came back without holding the job");
      missing->push_back(who);
      continue;
    }
    if (!h->intact()) return absl::StrCat(who, " reports its state is not intact");
    if (h->steps_completed() < job.step())
      return absl::StrCat(who, " holds step ", h->steps_completed(), ", behind the state db's step ",
                          job.step());
    target = std::max(target, ReceivedSteps(*h));
  }
  if (!missing->empty()) return "";
  if (target > job.spec().training().steps())
    return absl::StrCat("the ranks hold step ", target, ", past the job's ",
                        job.spec().training().steps(), " steps");
  return "";
}

}  // namespace

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
    absl::MutexLock lock(&mu_);
    if (stop_ && !thread_.joinable() && runs_.empty()) return;
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  jobs_->SetSubmitListener(nullptr);
  jobs_->SetCancelListener(nullptr);
  workers_->SetChangeListener(nullptr);
  std::map<std::string, std::unique_ptr<JobRun>> runs;
  {
    absl::MutexLock lock(&mu_);
    runs.swap(runs_);
  }
  for (auto& [id, run] : runs) run->Shutdown();
  for (auto& [id, run] : runs) {
    run->Join();
    jobs_->RunJoined(id);
  }
}

void Scheduler::Wake() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

void Scheduler::OnCancel(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(job_id);
  if (it != runs_.end()) it->second->Poke();
  wake_ = true;
}

void Scheduler::Loop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      // Woken by Wake, OnCancel and Stop: the condition is evaluated whenever mu_ is released.
      mu_.AwaitWithTimeout(absl::Condition(this, &Scheduler::WakeOrStopLocked),
                           absl::FromChrono(options_.tick));
      if (stop_) return;
      wake_ = false;
    }
    workers_->CheckHeartbeats();
    jobs_->ApplyRetention();  // the age part of the ended jobs' retention
    ReapFinished();
    ReadoptPass();
    SchedulePass();
    passes_.fetch_add(1);
  }
}

void Scheduler::ReapFinished() {
  std::vector<std::pair<std::string, std::unique_ptr<JobRun>>> done;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = runs_.begin(); it != runs_.end();) {
      if (it->second->done()) {
        done.emplace_back(it->first, std::move(it->second));
        it = runs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [id, r] : done) {
    r->Join();
    jobs_->RunJoined(id);  // the job's lease goes now if it has ended (Cancel)
  }
}

int Scheduler::ChooseWorldSize(const v1::JobSpec& spec, int free) {
  const int mn = std::max(1, spec.sharding().min_workers());
  const int mx = std::max(mn, spec.sharding().max_workers());
  for (int n = std::min(mx, free); n >= mn; --n) {
    if (AllowsWorldSize(spec, n)) return n;  // the batch splits; a multiple of sharding.replicas
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

void Scheduler::NoteWaiting(const v1::Job& job, size_t free, const std::string& memory_why) {
  const int need = MinWorldSize(job.spec());
  std::string why = static_cast<int>(free) >= need && !memory_why.empty()
                        ? memory_why
                        : absl::StrCat("waiting for ", need, " workers (", free, " free)");
  if (job.state() == v1::JOB_STATE_RECOVERING) {
    const auto now = Clock::now();
    const auto since = recovering_since_.emplace(job.job_id(), now).first->second;
    if (now - since >= options_.start_timeout) {
      recovering_since_.erase(job.job_id());
      jobs_->Finish(job.job_id(), v1::JOB_STATE_FAILED,
                    absl::StrCat("could not recover: ", why, " for ",
                                 options_.start_timeout.count(), " ms"))
          .IgnoreError();
      return;
    }
    why = absl::StrCat("recovering: ", why);
  }
  jobs_->SetPendingReason(job.job_id(), why).IgnoreError();
}

void Scheduler::NoteUnfit(const v1::Job& job, size_t free, const std::string& why) {
  const auto now = Clock::now();
  const auto since = unfit_since_.emplace(job.job_id(), now).first->second;
  if (now - since < options_.start_timeout) {
    if (job.state() == v1::JOB_STATE_RECOVERING) {
      NoteWaiting(job, free, why);  // with its own deadline
    } else {
      jobs_->SetPendingReason(job.job_id(), why).IgnoreError();
    }
    return;
  }
  unfit_since_.erase(job.job_id());
  recovering_since_.erase(job.job_id());
  jobs_->Finish(job.job_id(), v1::JOB_STATE_FAILED, why).IgnoreError();
}

absl::Status Scheduler::FitVerdict(const std::string& job_id, ResolvedJob& job,
                                   const std::map<std::string, int64_t>& memory) {
  auto it = fit_verdicts_.find(job_id);
  if (it != fit_verdicts_.end() && it->second.memory == memory) return it->second.status;
  absl::Status s = CheckFitsLargestWorkers(job, memory);
  fit_verdicts_[job_id] = FitVerdictEntry{memory, s};
  return s;
}

void Scheduler::SchedulePass() {
  std::map<std::string, std::vector<std::string>> free;
  std::map<std::string, std::map<std::string, int64_t>> memory;  // per backend, per worker
  std::map<std::string, std::map<std::string, std::string>> domains;  // per backend, per worker
  const std::vector<v1::Job> pending = jobs_->PendingJobs();
  for (auto it = recovering_since_.begin(); it != recovering_since_.end();) {
    bool waiting = false;
    for (const v1::Job& j : pending) waiting |= j.job_id() == it->first;
    it = waiting ? std::next(it) : recovering_since_.erase(it);
  }
  for (auto it = unfit_since_.begin(); it != unfit_since_.end();) {
    bool waiting = false;
    for (const v1::Job& j : pending) waiting |= j.job_id() == it->first;
    it = waiting ? std::next(it) : unfit_since_.erase(it);
  }
  for (auto it = fit_verdicts_.begin(); it != fit_verdicts_.end();) {
    bool waiting = false;
    for (const v1::Job& j : pending) waiting |= j.job_id() == it->first;
    it = waiting ? std::next(it) : fit_verdicts_.erase(it);
  }
  for (const v1::Job& job : pending) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    {
      // The job's last run (a failed generation, or one cancelled and then resumed) is still
      // unwinding: the next starts once it is reaped, never beside it.
      absl::MutexLock lock(&mu_);
      if (runs_.count(job.job_id())) continue;
    }
    std::string backend = job.spec().backend().empty() ? "cpu" : job.spec().backend();
    auto it = free.find(backend);
    if (it == free.end()) it = free.emplace(backend, workers_->FreeWorkers(backend)).first;
    std::vector<std::string>& f = it->second;
    auto mit = memory.find(backend);
    if (mit == memory.end()) {
      // Without the check every worker counts as large enough (no memory known).
      mit = memory.emplace(backend, options_.check_memory ? workers_->WorkerMemory(backend)
                                                          : std::map<std::string, int64_t>())
                .first;
    }
    auto dit = domains.find(backend);
    if (dit == domains.end()) dit = domains.emplace(backend, workers_->WorkerDomains(backend)).first;
    // The job's spec and memory plans per mesh, made once (JobManager keeps them).
    const std::shared_ptr<ResolvedJob> resolved = jobs_->Resolved(job.job_id());
    if (resolved == nullptr) continue;  // deleted meanwhile
    // Workers whose memory holds the job's memory plan (coordinator/memory_fit.h).
    const FitChoice fit = ChooseFittingWorkers(*resolved, f, mit->second, dit->second);
    const int n = fit.world_size;
    if (n == 0) {
      if (absl::Status s = FitVerdict(job.job_id(), *resolved, mit->second); !s.ok()) {
        NoteUnfit(job, f.size(), std::string(s.message()));
        continue;
      }
      unfit_since_.erase(job.job_id());
      NoteWaiting(job, f.size(), fit.why);
      continue;
    }
    recovering_since_.erase(job.job_id());
    unfit_since_.erase(job.job_id());
    const std::vector<std::string>& chosen = fit.workers;
    auto inbox = std::make_shared<Inbox>();
    if (!workers_->Assign(chosen, job.job_id(), [inbox](const WorkerEvent& ev) { inbox->Push(ev); })
             .ok()) {
      f = workers_->FreeWorkers(backend);  // the picture changed; look again next pass
      Wake();
      continue;
    }
    for (const std::string& id : chosen) f.erase(std::find(f.begin(), f.end(), id));
    auto started = jobs_->MarkStarting(job.job_id(), chosen, fit.replicas, SplitNote(fit));
    if (!started.ok()) {  // cancelled meanwhile
      workers_->Release(job.job_id());
      continue;
    }
    auto run = std::make_unique<JobRun>(jobs_, workers_, kv_, options_, *started, inbox,
                                        [this] { Wake(); });
    JobRun* raw = run.get();
    bool added = false;
    {
      // The job has no entry (checked above, and only this thread adds them): an entry is never
      // replaced, which would destroy a live run (joining its thread) under mu_.
      absl::MutexLock lock(&mu_);
      added = runs_.try_emplace(job.job_id(), std::move(run)).second;
    }
    if (added) raw->Start();
  }
}

}  // namespace fsdp8::coord

namespace fsdp8::coord {

void Scheduler::ReadoptPass() {
  const std::vector<ReadoptCandidate> candidates = jobs_->ReadoptCandidates();
  const std::map<std::string, v1::HeldJob> held = workers_->HeldJobs();
  if (candidates.empty() && held.empty()) return;
  std::set<std::string> idle;  // healthy workers with a session that hold no job
  for (const v1::WorkerInfo& w : workers_->List())
    if (w.state() == v1::WORKER_STATE_IDLE || w.state() == v1::WORKER_STATE_DRAINED)
      idle.insert(w.worker_id());
  std::set<std::string> waiting;  // jobs still waited for
  for (const ReadoptCandidate& c : candidates) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      if (runs_.count(c.job.job_id())) continue;  // never beside a run of the job
    }
    const v1::Job& job = c.job;
    std::vector<const v1::HeldJob*> reports;
    std::vector<std::string> ids, missing;
    std::string why = ReadoptRefusal(job, held, idle, &reports, &ids, &missing);
    if (why.empty() && missing.empty()) {
      std::vector<v1::HeldJob> ranks;
      for (const v1::HeldJob* h : reports) ranks.push_back(*h);
      waiting.insert(job.job_id());  // its ranks' reports are not dropped below
      Readopt(job, ids, ranks);
      continue;
    }
    if (why.empty() && Clock::now() < c.until) {
      waiting.insert(job.job_id());
      continue;
    }
    if (why.empty()) {
      why = absl::StrCat(absl::StrJoin(missing, ", "),
                         " did not come back holding it within the re-adoption window");
    }
    Log(LogLevel::kInfo, absl::StrCat("job ", job.job_id(), ": not re-adopted: ", why));
    jobs_->ReadoptFailed(job.job_id(), why).IgnoreError();
  }
  // Held jobs that nothing waits for (given up above, ended, unknown): dropped.
  for (const auto& [worker, h] : held) {
    if (waiting.count(h.job_id())) continue;
    bool adopting = false;
    {
      absl::MutexLock lock(&mu_);
      adopting = runs_.count(h.job_id()) > 0;
    }
    if (adopting) continue;  // Adopt cleared the ranks' reports; another worker's goes below
    const std::string reason =
        absl::StrCat("job ", h.job_id(), " generation ", h.generation(),
                     " is not re-adopted: the coordinator resumes it from its checkpoint, or it "
                     "no longer runs");
    if (workers_->DropHeld(worker, reason, options_.abort_grace))
      Log(LogLevel::kInfo, absl::StrCat("worker ", worker, ": ", reason));
  }
}

void Scheduler::Readopt(const v1::Job& job, const std::vector<std::string>& ids,
                        const std::vector<v1::HeldJob>& held) {
  const std::string& id = job.job_id();
  int64_t step = 0;  // every rank runs the steps any rank received (ReadoptRefusal)
  for (const v1::HeldJob& h : held) step = std::max(step, ReceivedSteps(h));
  std::vector<int64_t> from;  // the first step whose command each rank lacks
  for (const v1::HeldJob& h : held) from.push_back(ReceivedSteps(h));
  // Tokens: the state db's, plus those of the steps it lacks: a step's tokens are the same every
  // step (the global batch), each rank's as its last reported result says, else the db's mean.
  int64_t per_step = 0;
  bool every_rank = true;
  for (const v1::HeldJob& h : held) {
    if (h.recent_results_size() == 0) every_rank = false;
    else per_step += h.recent_results(h.recent_results_size() - 1).tokens();
  }
  if (!every_rank) per_step = job.step() > 0 ? job.tokens() / job.step() : 0;
  const int64_t tokens = job.tokens() + (step - job.step()) * per_step;
  auto inbox = std::make_shared<Inbox>();
  if (!workers_->Adopt(ids, held, [inbox](const WorkerEvent& ev) { inbox->Push(ev); }).ok()) {
    Wake();  // a report changed meanwhile: look again next pass
    return;
  }
  const std::string msg = absl::StrCat(
      "re-adopting ", ids.size(), " ranks of generation ", job.generation(), " at step ", step,
      step == job.step()
          ? std::string(" (the state db's step)")
          : absl::StrCat(" (the state db had step ", job.step(), "; the ranks completed ",
                         step - job.step(), " more while no coordinator ran)"));
  auto started = jobs_->MarkReadopting(id, ids, step, tokens, msg);
  if (!started.ok()) {  // cancelled meanwhile
    workers_->Release(id, ids, options_.abort_grace);
    for (const std::string& w : ids) {
      v1::CoordinatorMessage m;
      m.mutable_abort()->set_reason(absl::StrCat("job ", id, " ended: ", started.status().message()));
      workers_->Send(w, m);
    }
    return;
  }
  auto run = std::make_unique<JobRun>(jobs_, workers_, kv_, options_, *started, inbox,
                                      [this] { Wake(); }, Adoption{step, tokens, from});
  JobRun* raw = run.get();
  bool added = false;
  {
    absl::MutexLock lock(&mu_);
    added = runs_.try_emplace(id, std::move(run)).second;
  }
  if (added) raw->Start();
}

}  // namespace fsdp8::coord
