#include "coordinator/job_manager.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <limits>
#include <cstring>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/checkpoint_format.h"
#include "common/mesh.h"
#include "common/spec.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/log.h"
#include "coordinator/memory_fit.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace fsdp8::coord {
namespace {

// How long Resume waits for an ended job's run to be joined before it refuses.
constexpr absl::Duration kResumeJoinWait = absl::Seconds(5);

std::string DeterministicBytes(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::io::StringOutputStream sos(&out);
  google::protobuf::io::CodedOutputStream cos(&sos);
  cos.SetSerializationDeterministic(true);
  m.SerializeToCodedStream(&cos);
  cos.Trim();
  return out;
}

}  // namespace

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string StateName(v1::JobState s) {
  std::string n = v1::JobState_Name(s);
  const std::string prefix = "JOB_STATE_";
  if (n.rfind(prefix, 0) == 0) n = n.substr(prefix.size());
  return n.empty() ? absl::StrCat(static_cast<int>(s)) : n;
}

bool IsTerminalState(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED;
}

absl::StatusOr<std::unique_ptr<JobManager>> JobManager::Open(const JobManagerOptions& options) {
  auto store = JobStore::Open(options.state_db);
  if (!store.ok()) return store.status();
  auto rows = (*store)->LoadAll();
  if (!rows.ok()) return rows.status();
  std::unique_ptr<JobManager> jm(new JobManager(options, std::move(*store)));
  auto coordinator = jm->store_->CoordinatorId();
  if (!coordinator.ok()) return coordinator.status();
  jm->coordinator_id_ = *coordinator;
  absl::ReleasableMutexLock lock(&jm->mu_);
  for (auto& row : *rows) {
    const std::string id = row.job.job_id();
    Record& r = jm->jobs_[id];
    r.job = std::move(row.job);
    r.last_seq = row.last_seq;
    const int64_t keep = static_cast<int64_t>(options.max_events_per_job);
    auto stored = jm->store_->Events(id, r.last_seq - keep, r.last_seq + 1);
    if (!stored.ok()) return stored.status();
    r.events.assign(std::make_move_iterator(stored->begin()),
                    std::make_move_iterator(stored->end()));
    // Migrated on load (fields moved since, defaults added since), so a row stored before still
    // matches a resubmission.
    *r.job.mutable_spec() = MigrateStoredSpec(r.job.spec());
    r.submitted_spec = DeterministicBytes(r.job.spec());
    r.resolved = std::make_shared<ResolvedJob>(r.job.spec(), options.planner);
    jm->order_.insert({r.job.create_time(), id});
    if (!r.job.request_id().empty()) jm->by_request_[r.job.request_id()] = id;
    v1::JobState s = r.job.state();
    const bool readopt =
        options.readopt_window.count() > 0 && r.job.worker_ids_size() > 0 &&
        (s == v1::JOB_STATE_RUNNING ||
         (s == v1::JOB_STATE_RECOVERING && r.job.reason().rfind(kReadoptReasonPrefix, 0) == 0));
    if (readopt) {
      // Its workers may still hold the generation (worker/daemon.h): wait for them a while.
      r.job.set_state(v1::JOB_STATE_RECOVERING);
      r.job.set_reason(absl::StrCat(
          kReadoptReasonPrefix, "the ", r.job.worker_ids_size(), " ranks of generation ",
          r.job.generation(), " (waiting up to ",
          absl::FormatDuration(absl::FromChrono(options.readopt_window)), ")"));
      r.readopt_until = std::chrono::steady_clock::now() + options.readopt_window;
      v1::JobEvent ev;
      ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
      ev.set_step(r.job.step());
      ev.set_tokens(r.job.tokens());
      ev.set_message(r.job.reason());
      jm->PublishLocked(&r, ev);
    } else if (s == v1::JOB_STATE_STARTING || s == v1::JOB_STATE_RUNNING ||
               s == v1::JOB_STATE_RECOVERING) {
      // The generation that was running died with the old coordinator (its workers abort when
      // their session ends). Like any failed generation, a job with checkpoints and restarts left
      // continues from its latest committed checkpoint; a RECOVERING one was already counted.
      const v1::JobSpec& d = r.job.spec();
      const bool counted = s == v1::JOB_STATE_RECOVERING;
      const bool recover = !d.checkpoint().dir().empty() &&
                           (counted || r.job.restarts() < d.max_restarts());
      v1::JobEvent ev;
      ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
      ev.set_step(r.job.step());
      ev.set_tokens(r.job.tokens());
      if (recover) {
        if (!counted) r.job.set_restarts(r.job.restarts() + 1);
        r.job.set_state(v1::JOB_STATE_RECOVERING);
        r.job.set_reason(absl::StrCat("recovering from a coordinator restart (restart ",
                                      r.job.restarts(), " of ", d.max_restarts(), ")"));
        r.job.clear_worker_ids();
      } else {
        r.job.set_state(v1::JOB_STATE_FAILED);
        r.job.set_reason(d.checkpoint().dir().empty()
                             ? "coordinator restarted (no checkpoint.dir to resume from)"
                             : absl::StrCat("coordinator restarted (max_restarts ",
                                            d.max_restarts(), " reached)"));
        r.job.set_end_time(NowSeconds());
      }
      ev.set_message(r.job.reason());
      jm->PublishLocked(&r, ev);
      if (!recover) jm->ended_.insert({r.job.end_time(), id});
    } else if (IsTerminalState(s) && r.last_seq > 0 && r.events.empty()) {
      // A database written before events were stored: the final event, rebuilt from the row so
      // that a late watcher still learns the outcome.
      v1::JobEvent ev;
      ev.set_seq(r.last_seq);
      ev.set_job_id(id);
      ev.set_state(s);
      ev.set_step(r.job.step());
      ev.set_total_steps(r.job.total_steps());
      ev.set_loss(r.job.loss());
      ev.set_val_loss(r.job.val_loss());
      ev.set_tokens(r.job.tokens());
      ev.set_message(r.job.reason());
      ev.set_time(r.job.end_time());
      r.events.push_back(ev);
    }
    if (IsTerminalState(s)) jm->ended_.insert({r.job.end_time(), id});
  }
  jm->RetainLocked();
  jm->ReconcileCheckpointDirsLocked();
  lock.Release();
  if (options.checkpoint_lease.count() > 0)
    jm->lease_thread_ = std::thread([p = jm.get()] { p->RenewLeases(); });
  return jm;
}

void JobManager::ReconcileCheckpointDirsLocked() {
  const double lease_s = std::chrono::duration<double>(options_.checkpoint_lease).count();
  for (auto& [id, r] : jobs_) {
    const std::string& dir = r.job.spec().checkpoint().dir();
    if (dir.empty()) continue;
    const CheckpointStore store(dir, id);
    if (IsTerminalState(r.job.state())) {
      // Ended: its lease goes (false: not this coordinator's, or not this job's directory).
      if (lease_s <= 0) continue;
      if (auto done = store.ReleaseLease(id, coordinator_id_); !done.ok())
        Log(LogLevel::kWarning, absl::StrCat("job ", id, ": checkpoint.dir ", dir, ": lease: ",
                                             done.status().message()));
      continue;
    }
    // Renewed by the lease thread from now on whatever happens below (storage not mounted yet:
    // retried), until the job ends or OWNER names another job.
    if (lease_s > 0) leases_[id] = dir;
    // The lease first, then the leftovers, under one lock.
    if (auto removed = store.ResumeAndRemoveLeftovers(coordinator_id_, lease_s); !removed.ok())
      Log(LogLevel::kWarning, absl::StrCat("job ", id, ": checkpoint.dir ", dir,
                                           ": renewing the lease and removing leftovers: ",
                                           removed.status().message()));
  }
}

void JobManager::RenewLeases() {
  const auto every = std::max<std::chrono::milliseconds>(options_.checkpoint_lease / 4,
                                                         std::chrono::milliseconds(50));
  const double lease_s = std::chrono::duration<double>(options_.checkpoint_lease).count();
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&shutdown_), absl::FromChrono(every))) return;
    }
    absl::MutexLock io(&lease_io_mu_);
    std::vector<std::pair<std::string, std::string>> held;
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) return;
      held.assign(leases_.begin(), leases_.end());
    }
    for (const auto& [id, dir] : held) {
      // Finish and Cancel take lease_io_mu_ too: a job still in leases_ has not ended.
      const CheckpointStore store(dir);
      auto renewed = store.RenewLease(id, coordinator_id_, lease_s);
      if (!renewed.ok()) {
        // An I/O error or storage not mounted: retried at the next round.
        Log(LogLevel::kWarning, absl::StrCat("job ", id, ": renewing the lease of checkpoint.dir ",
                                             dir, ": ", renewed.status().message()));
        continue;
      }
      if (*renewed) continue;
      // Dropped only when OWNER names another job; anything else is retried.
      auto owner = store.Owner();
      if (!owner.ok() || !owner->has_value() || (*owner)->owner().job_id() == id) {
        Log(LogLevel::kWarning, absl::StrCat("job ", id, ": checkpoint.dir ", dir,
                                             ": lease not renewed (",
                                             owner.ok() ? (owner->has_value() ? "another coordinator's lease" : "no OWNER record")
                                                        : std::string(owner.status().message()),
                                             "); retried"));
        continue;
      }
      Log(LogLevel::kWarning, absl::StrCat("job ", id, ": checkpoint.dir ", dir, " belongs to job ",
                                           (*owner)->owner().job_id(),
                                           "; its lease is no longer renewed"));
      absl::MutexLock lock(&mu_);
      leases_.erase(id);
    }
  }
}

bool JobManager::HasRun(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  return runs_.count(job_id) > 0;
}

void JobManager::RunJoined(const std::string& job_id) {
  absl::MutexLock io(&lease_io_mu_);
  bool ended = true;
  {
    absl::MutexLock lock(&mu_);
    runs_.erase(job_id);
    cv_.SignalAll();  // a Resume may wait for it
    const Record* r = FindLocked(job_id);
    ended = r == nullptr || IsTerminalState(r->job.state());
  }
  if (ended) ReleaseLeaseIoLocked(job_id);
}

void JobManager::ReleaseLeaseIoLocked(const std::string& job_id) {
  std::string dir;
  {
    absl::MutexLock lock(&mu_);
    auto it = leases_.find(job_id);
    if (it == leases_.end()) return;
    dir = it->second;
    leases_.erase(it);
  }
  auto released = CheckpointStore(dir).ReleaseLease(job_id, coordinator_id_);
  if (!released.ok())
    Log(LogLevel::kWarning, absl::StrCat("job ", job_id, ": releasing the lease of checkpoint.dir ",
                                         dir, ": ", released.status().message()));
}

JobManager::JobManager(JobManagerOptions options, std::unique_ptr<JobStore> store)
    : options_(std::move(options)), store_(std::move(store)) {}

JobManager::~JobManager() {
  Shutdown();
  if (lease_thread_.joinable()) lease_thread_.join();
}

JobManager::Record* JobManager::FindLocked(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}
const JobManager::Record* JobManager::FindLocked(const std::string& job_id) const {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

void JobManager::PersistLocked(const Record& r, const v1::JobEvent& event) {
  absl::Status s =
      store_->Put(r.job, r.last_seq, event, static_cast<int64_t>(options_.max_events_per_job));
  if (!s.ok()) fprintf(stderr, "fsdp8-coordinator: persisting job %s: %s\n",
                       r.job.job_id().c_str(), s.ToString().c_str());
}

void JobManager::PublishLocked(Record* r, v1::JobEvent ev) {
  ev.set_seq(++r->last_seq);
  ev.set_job_id(r->job.job_id());
  ev.set_state(r->job.state());
  ev.set_total_steps(r->job.total_steps());
  if (ev.time() == 0) ev.set_time(NowSeconds());
  r->events.push_back(std::move(ev));
  while (r->events.size() > options_.max_events_per_job) r->events.pop_front();
  PersistLocked(*r, r->events.back());
  cv_.SignalAll();
}

std::string JobManager::NewJobIdLocked() {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  for (;;) {
    char buf[16];
    snprintf(buf, sizeof(buf), "%08llx", static_cast<unsigned long long>(rng() & 0xffffffffULL));
    std::string id = absl::StrCat("job-", buf);
    if (!jobs_.count(id)) return id;
  }
}

std::optional<absl::StatusOr<v1::Job>> JobManager::ReplayLocked(
    const std::string& request_id, const std::string& owner, const std::string& spec_bytes) const {
  if (request_id.empty()) return std::nullopt;
  auto it = by_request_.find(request_id);
  if (it == by_request_.end()) return std::nullopt;
  const Record& r = jobs_.at(it->second);
  if (r.job.owner() != owner)
    return absl::AlreadyExistsError(
        absl::StrCat("request_id '", request_id, "' was already used by another user"));
  if (r.submitted_spec == spec_bytes) return r.job;
  return absl::AlreadyExistsError(absl::StrCat("request_id '", request_id,
                                               "' was already used for job ", r.job.job_id(),
                                               " with a different spec"));
}

absl::StatusOr<v1::Job> JobManager::Submit(const std::string& request_id,
                                           const v1::JobSpec& spec, const std::string& owner) {
  if (static_cast<int64_t>(request_id.size()) > kMaxNameBytes)
    return Refused(absl::InvalidArgumentError(absl::StrCat("request_id: longer than the limit of ",
                                                           kMaxNameBytes, " bytes (got ",
                                                           request_id.size(), ")")),
                   owner, spec);
  // Before copying it around.
  if (absl::Status s = CheckSpecLimits(spec); !s.ok()) return Refused(s, owner, spec);
  v1::JobSpec moved = spec;
  absl::StatusOr<std::vector<std::string>> warnings = MigrateSpec(&moved);
  if (!warnings.ok()) return Refused(warnings.status(), owner, spec);
  // The job's spec before a world size is fixed: the defaults that need none (ResolvedJob fills
  // in the rest per world size).
  v1::JobSpec d = WithDefaults(moved, 0);
  std::string bytes = DeterministicBytes(d);
  {
    absl::MutexLock lock(&mu_);
    if (auto replay = ReplayLocked(request_id, owner, bytes))
      return replay->ok() ? *replay : Refused(replay->status(), owner, d);
  }
  if (absl::Status s = ValidateSpec(d, 0, options_.data_roots, options_.check_files); !s.ok())
    return Refused(s, owner, d);
  auto resolved = std::make_shared<ResolvedJob>(d, options_.planner);
  // The world sizes the job may get are the multiples of its sharding.replicas in [min, max].
  auto range = MeshWorldSizeRange(d);
  if (!range.ok()) return Refused(range.status(), owner, d);
  const auto [mn, mx] = *range;
  for (int n : {mn, mx}) {
    if (n < 1) continue;  // ValidateSpec reported it above
    if (absl::Status s = resolved->SpecAt(n).status(); !s.ok()) {
      if (mn == mx) return Refused(s, owner, d);
      // The job may run (and, after a failure, shrink) to any world size in [min, max].
      return Refused(absl::Status(s.code(),
                                  absl::StrCat(s.message(), " at world size ", n, " (sharding.",
                                               n == mn ? "min_workers" : "max_workers",
                                               "; the global batch is the same at every world "
                                               "size)")),
                     owner, d);
    }
  }
  std::function<absl::Status(ResolvedJob&)> admission;
  {
    absl::MutexLock lock(&mu_);
    admission = admission_;
  }
  if (admission) {
    if (absl::Status s = admission(*resolved); !s.ok()) return Refused(s, owner, d);
  }
  const std::string& resume = d.checkpoint().resume_from();
  if (options_.check_files && !resume.empty() && resume != "latest") {
    auto ck = CheckpointStore::Open(resume);
    if (!ck.ok())
      return Refused(absl::FailedPreconditionError(
                         absl::StrCat("checkpoint.resume_from: ", ck.status().message())),
                     owner, d);
    if (absl::Status s = CheckpointStore::CheckResumeCompatible(d, ck->manifest.spec(), resume);
        !s.ok())
      return Refused(s, owner, d);
  }
  const std::string& init = d.init().from_checkpoint();
  if (options_.check_files && !init.empty()) {
    auto ck = CheckpointStore::Open(init);
    if (!ck.ok())
      return Refused(absl::FailedPreconditionError(
                         absl::StrCat("init.from_checkpoint: ", ck.status().message())),
                     owner, d);
    if (absl::Status s = CheckpointStore::CheckResumeCompatible(d, ck->manifest.spec(), init,
                                                                "init.from_checkpoint");
        !s.ok())
      return Refused(s, owner, d);
  }
  v1::Job out;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_)
      return Refused(absl::UnavailableError("coordinator is shutting down"), owner, d);
    // Re-checked: another submit may have raced us.
    if (auto replay = ReplayLocked(request_id, owner, bytes))
      return replay->ok() ? *replay : Refused(replay->status(), owner, d);
    std::string id = NewJobIdLocked();
    std::vector<std::string> skipped;
    if (absl::Status s = ClaimCheckpointDirLocked(d, id, owner, &skipped); !s.ok())
      return Refused(s, owner, d);
    Record& r = jobs_[id];
    r.submitted_spec = bytes;
    r.resolved = resolved;
    v1::Job& job = r.job;
    job.set_job_id(id);
    job.set_request_id(request_id);
    job.set_owner(owner);
    *job.mutable_spec() = d;
    job.set_state(v1::JOB_STATE_PENDING);
    job.set_reason(absl::StrCat("waiting for ", mn, " workers"));
    job.set_total_steps(d.training().steps());
    job.set_val_loss(std::numeric_limits<double>::quiet_NaN());
    job.set_create_time(NowSeconds());
    order_.insert({job.create_time(), id});
    if (!request_id.empty()) by_request_[request_id] = id;
    v1::JobEvent ev;
    ev.set_message(absl::StrCat("submitted; ", job.reason()));
    for (const std::string& w : *warnings) absl::StrAppend(ev.mutable_message(), "; warning: ", w);
    if (!skipped.empty()) {
      const size_t shown = std::min<size_t>(skipped.size(), 4);
      absl::StrAppend(ev.mutable_message(), "; checkpoint.take_over: ", d.checkpoint().dir(),
                      " holds ", absl::StrJoin(skipped.begin(), skipped.begin() + shown, ", "),
                      skipped.size() > shown ? absl::StrCat(" and ", skipped.size() - shown, " more")
                                             : "",
                      " of earlier owners, which stay as they are: this job's saves of those "
                      "steps will be skipped (checkpoint.resume_from: latest continues after the "
                      "newest)");
    }
    ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
    PublishLocked(&r, ev);
    out = job;
  }
  for (const std::string& w : *warnings)
    Log(LogLevel::kWarning, absl::StrCat("job ", out.job_id(), ": ", w));
  LogEvent("job_submitted", {{"job", out.job_id()},
                             {"owner", out.owner()},
                             {"name", d.name()},
                             {"min_workers", mn},
                             {"max_workers", mx},
                             {"steps", d.training().steps()},
                             {"request_id", request_id}});
  std::function<void()> cb;
  {
    absl::MutexLock lock(&mu_);
    cb = on_submit_;
  }
  if (cb) cb();
  return out;
}

// ---- Pages, deletion, retention ----
namespace {

std::string PageToken(double create_time, const std::string& id) {
  uint64_t bits = 0;
  static_assert(sizeof(bits) == sizeof(create_time));
  std::memcpy(&bits, &create_time, sizeof(bits));
  return absl::StrCat(absl::Hex(bits, absl::kZeroPad16), "/", id);
}

absl::StatusOr<std::pair<double, std::string>> ParsePageToken(const std::string& token) {
  const size_t slash = token.find('/');
  uint64_t bits = 0;
  if (slash != 16 || !absl::SimpleHexAtoi(token.substr(0, slash), &bits) ||
      slash + 1 >= token.size()) {
    return absl::InvalidArgumentError(
        "page_token: not a token from a previous ListJobs page (pass next_page_token as it came)");
  }
  double t = 0;
  std::memcpy(&t, &bits, sizeof(t));
  return std::make_pair(t, token.substr(slash + 1));
}

}  // namespace

absl::StatusOr<JobPage> JobManager::ListPage(const std::optional<std::string>& owner,
                                             int page_size, const std::string& page_token,
                                             int events, int64_t max_bytes) const {
  if (page_size < 0)
    return absl::InvalidArgumentError(absl::StrCat("page_size: must be >= 0 (got ", page_size, ")"));
  if (events < 0)
    return absl::InvalidArgumentError(absl::StrCat("events: must be >= 0 (got ", events, ")"));
  const size_t want = page_size == 0 ? kDefaultPageSize : std::min(page_size, kMaxPageSize);
  const size_t n_events = static_cast<size_t>(std::min(events, kMaxListEvents));
  absl::MutexLock lock(&mu_);
  auto it = order_.begin();
  if (!page_token.empty()) {
    auto key = ParsePageToken(page_token);
    if (!key.ok()) return key.status();
    it = order_.upper_bound(*key);
  }
  JobPage page;
  int64_t bytes = 0;
  for (; it != order_.end(); ++it) {
    const Record& r = jobs_.at(it->second);
    if (owner && r.job.owner() != *owner) continue;
    if (page.jobs.size() == want) break;  // a further job exists: not the last page
    v1::Job j = r.job;
    const size_t n = std::min(n_events, r.events.size());
    for (auto e = r.events.end() - n; e != r.events.end(); ++e) *j.add_events() = *e;
    // The job's bytes in the page: its own, its field tag (1 byte) and length (at most 5).
    const int64_t size = static_cast<int64_t>(j.ByteSizeLong()) + 6;
    if (!page.jobs.empty() && bytes + size > max_bytes) break;
    bytes += size;
    page.jobs.push_back(std::move(j));
  }
  if (it != order_.end() && !page.jobs.empty()) {
    const v1::Job& last = page.jobs.back();
    page.next_page_token = PageToken(last.create_time(), last.job_id());
  }
  return page;
}

absl::Status JobManager::Delete(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  const Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (!IsTerminalState(r->job.state()))
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " is ", StateName(r->job.state()),
        "; only an ended job can be deleted (cancel it first)"));
  EraseLocked(job_id);
  cv_.SignalAll();
  return absl::OkStatus();
}

size_t JobManager::ApplyRetention() {
  absl::MutexLock lock(&mu_);
  return RetainLocked();
}

size_t JobManager::size() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

void JobManager::NoteEndedLocked(const v1::Job& job) {
  ended_.insert({job.end_time(), job.job_id()});
  RetainLocked();
}

size_t JobManager::RetainLocked() {
  const double age = static_cast<double>(options_.retain_ended_age.count());
  const double cutoff = NowSeconds() - age;
  size_t removed = 0;
  while (!ended_.empty() && (ended_.size() > options_.retain_ended_jobs ||
                             (age > 0 && ended_.begin()->first < cutoff))) {
    EraseLocked(ended_.begin()->second);
    ++removed;
  }
  if (removed > 0) cv_.SignalAll();
  return removed;
}

void JobManager::EraseLocked(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  const v1::Job& j = it->second.job;
  order_.erase({j.create_time(), job_id});
  ended_.erase({j.end_time(), job_id});
  auto req = by_request_.find(j.request_id());
  if (req != by_request_.end() && req->second == job_id) by_request_.erase(req);
  jobs_.erase(it);
  if (absl::Status s = store_->Delete(job_id); !s.ok())
    fprintf(stderr, "fsdp8-coordinator: deleting job %s: %s\n", job_id.c_str(), s.ToString().c_str());
}

absl::Status JobManager::ClaimCheckpointDirLocked(const v1::JobSpec& spec, const std::string& id,
                                                  const std::string& owner,
                                                  std::vector<std::string>* skipped) {
  const v1::CheckpointSpec& c = spec.checkpoint();
  if (c.dir().empty()) return absl::OkStatus();
  v1::CheckpointOwnerEntry claimant;
  claimant.set_job_id(id);
  claimant.set_user(owner);
  claimant.set_since(NowSeconds());
  CheckpointStore::ClaimOptions o;
  o.take_over = c.take_over();
  // Under mu_: the owner's state cannot change between this check and the claim.
  o.may_take_over = [&](const v1::CheckpointOwnerEntry& old)
                         ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    const Record* r = FindLocked(old.job_id());
    if (r == nullptr || IsTerminalState(r->job.state())) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint.take_over: checkpoint.dir ", c.dir(), " belongs to job ", old.job_id(),
        ", which is ", StateName(r->job.state()),
        "; a directory is taken over only once its owner has ended or was deleted"));
  };
  if (options_.checkpoint_lease.count() > 0) {
    o.coordinator = coordinator_id_;
    o.lease_s = std::chrono::duration<double>(options_.checkpoint_lease).count();
    o.clock_skew_s = o.lease_s / 4;  // an expired lease is taken over only this much later
  }
  // The steps this job may save: after the one it starts from, up to its last.
  if (c.resume_from() == "latest") {
    o.saves_after_latest = true;
  } else if (!c.resume_from().empty()) {
    std::string path = c.resume_from();
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    o.saves_after = std::max<int64_t>(0, StepOfDirName(path.substr(path.find_last_of('/') + 1)));
  }
  o.last_save = spec.training().steps();
  o.skipped = skipped;
  absl::Status s = CheckpointStore(c.dir()).Claim(claimant, o);
  if (s.ok() && !o.coordinator.empty()) leases_[id] = c.dir();
  return s;
}

absl::StatusOr<v1::Job> JobManager::Get(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  const Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  return r->job;
}

std::vector<v1::Job> JobManager::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Job> out;
  out.reserve(order_.size());
  for (const auto& [unused, id] : order_) out.push_back(jobs_.at(id).job);
  return out;
}

std::vector<v1::Job> JobManager::PendingJobs() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Job> out;
  for (const auto& [unused, id] : order_) {
    const auto& j = jobs_.at(id).job;
    if ((j.state() == v1::JOB_STATE_PENDING || j.state() == v1::JOB_STATE_RECOVERING) &&
        !jobs_.at(id).readopt_until)
      out.push_back(j);
  }
  return out;
}

std::vector<ReadoptCandidate> JobManager::ReadoptCandidates() const {
  absl::MutexLock lock(&mu_);
  std::vector<ReadoptCandidate> out;
  for (const auto& [unused, id] : order_) {
    const Record& r = jobs_.at(id);
    if (r.readopt_until && r.job.state() == v1::JOB_STATE_RECOVERING)
      out.push_back({r.job, *r.readopt_until});
  }
  return out;
}

absl::StatusOr<v1::Job> JobManager::MarkReadopting(const std::string& job_id,
                                                   const std::vector<std::string>& worker_ids,
                                                   int64_t step, int64_t tokens,
                                                   const std::string& message) {
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (!r->readopt_until || r->job.state() != v1::JOB_STATE_RECOVERING)
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " is not waiting for re-adoption"));
  if (static_cast<int>(worker_ids.size()) != r->job.worker_ids_size())
    return absl::InvalidArgumentError(absl::StrCat("job ", job_id, ": ", worker_ids.size(),
                                                   " workers for ", r->job.worker_ids_size(),
                                                   " ranks"));
  r->readopt_until.reset();
  runs_.insert(job_id);  // until RunJoined
  v1::Job& j = r->job;
  j.clear_worker_ids();
  for (const std::string& w : worker_ids) j.add_worker_ids(w);
  j.set_state(v1::JOB_STATE_STARTING);
  j.set_reason("");
  j.set_step(step);
  j.set_tokens(tokens);
  v1::JobEvent ev;
  ev.set_step(step);
  ev.set_tokens(tokens);
  ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
  ev.set_message(message);
  PublishLocked(r, ev);
  return j;
}

absl::Status JobManager::ReadoptFailed(const std::string& job_id, const std::string& why) {
  std::string failed;  // the reason when the job cannot recover
  {
    absl::MutexLock lock(&mu_);
    Record* r = FindLocked(job_id);
    if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    if (!r->readopt_until || r->job.state() != v1::JOB_STATE_RECOVERING)
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id, " is not waiting for re-adoption"));
    r->readopt_until.reset();
    v1::Job& j = r->job;
    const v1::JobSpec& d = j.spec();
    LogEvent("readopt_failed", {{"job", job_id}, {"generation", j.generation()}, {"cause", why}});
    if (!d.checkpoint().dir().empty() && j.restarts() < d.max_restarts()) {
      j.set_restarts(j.restarts() + 1);
      j.set_reason(absl::StrCat("recovering from a coordinator restart (restart ", j.restarts(),
                                " of ", d.max_restarts(), "): falling back to the checkpoint because ",
                                why));
      j.clear_worker_ids();
      v1::JobEvent ev;
      ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
      ev.set_step(j.step());
      ev.set_tokens(j.tokens());
      ev.set_message(j.reason());
      PublishLocked(r, ev);
      return absl::OkStatus();
    }
    failed = absl::StrCat("coordinator restarted and ", why, " (",
                          d.checkpoint().dir().empty()
                              ? std::string("no checkpoint.dir to resume from")
                              : absl::StrCat("max_restarts ", d.max_restarts(), " reached"),
                          ")");
  }
  return Finish(job_id, v1::JOB_STATE_FAILED, failed);
}

absl::StatusOr<bool> JobManager::RequestCancelAfterSave(const std::string& job_id,
                                                         std::string* why) {
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  v1::Job& j = r->job;
  if (IsTerminalState(j.state()))
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " already ended (", StateName(j.state()), ")"));
  if (r->cancel_after_save) return true;  // an earlier cancel's save is pending
  if (j.spec().checkpoint().dir().empty()) {
    *why = "the job has no checkpoint.dir";
    return false;
  }
  if (j.spec().training().free_running()) {
    *why = "a free-running job saves only after its last step";
    return false;
  }
  if (j.state() != v1::JOB_STATE_RUNNING) {
    *why = absl::StrCat("the job was ", StateName(j.state()),
                        ": nothing was trained since the checkpoint it starts from");
    return false;
  }
  r->cancel_after_save = true;
  r->checkpoint_requested = true;
  const int64_t at = std::min(std::max(j.step() + 1, r->dispatched), j.total_steps());
  v1::JobEvent ev;
  ev.set_step(j.step());
  ev.set_tokens(j.tokens());
  ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
  ev.set_message(absl::StrCat("cancelling: saving checkpoint step-", at, " after step ", at,
                              ", then stopping"));
  PublishLocked(r, ev);
  LogEvent("job_cancelling", {{"job", job_id}, {"owner", j.owner()}, {"save_step", at}});
  return true;
}

absl::StatusOr<v1::Job> JobManager::AwaitEnded(const std::string& job_id,
                                               const std::function<bool()>& stop) {
  absl::MutexLock lock(&mu_);
  for (;;) {
    if (shutdown_) return absl::UnavailableError("coordinator is shutting down");
    const Record* r = FindLocked(job_id);
    if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    if (IsTerminalState(r->job.state()) || (stop && stop())) return r->job;
    cv_.WaitWithTimeout(&mu_, absl::Milliseconds(200));
  }
}

bool JobManager::CancelRequested(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  const Record* r = FindLocked(job_id);
  return r != nullptr && r->cancel_after_save;
}

absl::StatusOr<v1::Job> JobManager::Cancel(const std::string& job_id, bool save,
                                           const std::function<bool()>& stop) {
  std::string reason = "cancelled by user";
  if (save) {
    std::string why;
    auto saving = RequestCancelAfterSave(job_id, &why);
    if (!saving.ok()) return saving.status();
    if (*saving) return AwaitEnded(job_id, stop);
    reason = absl::StrCat("cancelled by user; no checkpoint saved: ", why);
  }
  v1::Job out;
  bool was_active = false;
  std::function<void(const std::string&)> cb;
  {
    // A job without a run: the lease goes before the job is seen to end (another coordinator may
    // then take over). With a run, its ranks may still be writing: RunJoined releases it.
    absl::MutexLock io(&lease_io_mu_);
    if (!HasRun(job_id)) ReleaseLeaseIoLocked(job_id);
    absl::MutexLock lock(&mu_);
    Record* r = FindLocked(job_id);
    if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    if (IsTerminalState(r->job.state()))
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " already ended (", StateName(r->job.state()), ")"));
    was_active = r->job.state() != v1::JOB_STATE_PENDING;
    r->job.set_state(v1::JOB_STATE_CANCELLED);
    r->job.set_reason(reason);
    r->job.set_end_time(NowSeconds());
    v1::JobEvent ev;
    ev.set_step(r->job.step());
    ev.set_loss(r->job.loss());
    ev.set_val_loss(r->job.val_loss());
    ev.set_tokens(r->job.tokens());
    ev.set_message(reason);
    PublishLocked(r, ev);
    out = r->job;
    cb = on_cancel_;
    NoteEndedLocked(out);
  }
  LogEvent("job_cancelled", {{"job", job_id}, {"owner", out.owner()}, {"step", out.step()}});
  LogEnded(out);
  if (was_active && cb) cb(job_id);
  return out;
}

absl::StatusOr<CommittedCheckpoint> JobManager::ResumePoint(const std::string& job_id,
                                                             const std::string& dir) {
  const CheckpointStore store(dir, job_id);
  auto owner = store.Owner();
  if (!owner.ok())
    return absl::UnavailableError(absl::StrCat("checkpoint.dir ", dir, ": ", owner.status().message()));
  if (owner->has_value() && (*owner)->owner().job_id() != job_id)
    return absl::FailedPreconditionError(absl::StrCat(
        "resume: checkpoint.dir ", dir, " now belongs to job ", (*owner)->owner().job_id(),
        " (it took the directory over); job ", job_id,
        " may not save there again: submit a new job (init.from_checkpoint starts it from one of "
        "these checkpoints)"));
  auto latest = store.Latest(job_id);
  if (!latest.ok())
    return absl::UnavailableError(absl::StrCat("checkpoint.dir ", dir, ": ", latest.status().message()));
  if (!latest->has_value())
    return absl::FailedPreconditionError(absl::StrCat(
        "resume: checkpoint.dir ", dir, " holds no committed checkpoint of job ", job_id,
        "; a job resumes only from its own newest committed checkpoint (submit it again to "
        "start over)"));
  const double lease_s = std::chrono::duration<double>(options_.checkpoint_lease).count();
  if (lease_s > 0) {
    auto renewed = store.RenewLease(job_id, coordinator_id_, lease_s);
    if (!renewed.ok())
      return absl::UnavailableError(absl::StrCat("checkpoint.dir ", dir, ": renewing the lease: ",
                                                 renewed.status().message()));
    if (!*renewed)
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: checkpoint.dir ", dir, " is leased by another coordinator (or has no OWNER "
          "record naming job ", job_id, "); a job resumes only under the coordinator that "
          "holds its directory"));
  }
  return std::move(**latest);
}

absl::StatusOr<v1::Job> JobManager::Resume(const std::string& job_id) {
  {
    // An ended job's run is joined moments after it ends (a cancel returns at the end): wait for
    // that, up to kResumeJoinWait, before the refusal below (RunJoined signals cv_).
    absl::MutexLock lock(&mu_);
    const absl::Time until = absl::Now() + kResumeJoinWait;
    for (;;) {
      const Record* r = FindLocked(job_id);
      if (r == nullptr || !IsTerminalState(r->job.state()) || runs_.count(job_id) == 0 ||
          shutdown_ || cv_.WaitWithDeadline(&mu_, until))
        break;
    }
  }
  absl::MutexLock io(&lease_io_mu_);  // no lease call of this job meanwhile
  std::string dir;
  double ended_at = 0;
  {
    absl::MutexLock lock(&mu_);
    const Record* r = FindLocked(job_id);
    if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    const v1::Job& j = r->job;
    if (!IsTerminalState(j.state()))
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: job ", job_id, " is ", StateName(j.state()),
          "; only an ended job (CANCELLED or FAILED) can be resumed"));
    if (j.state() == v1::JOB_STATE_SUCCEEDED)
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: job ", job_id, " SUCCEEDED (all ", j.total_steps(),
          " training.steps done); only a CANCELLED or FAILED job can be resumed (to train "
          "further, submit a new job with init.from_checkpoint)"));
    dir = j.spec().checkpoint().dir();
    if (dir.empty())
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: job ", job_id, " has no checkpoint.dir, so nothing to resume from"));
    // A run that has not been joined (a cancel --no-save while it commits a checkpoint) may
    // still write checkpoint.dir and release its workers: a new run must not start beside it.
    if (runs_.count(job_id) > 0)
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: job ", job_id,
          " is still stopping (its last run has not ended); try again in a moment"));
    ended_at = j.end_time();
  }
  auto point = ResumePoint(job_id, dir);
  if (!point.ok()) return point.status();
  v1::Job out;
  {
    absl::MutexLock lock(&mu_);
    Record* r = FindLocked(job_id);
    // Deleted, or resumed by another call, meanwhile (the lease renewal stays harmless: it
    // expires, or the resumed job renews it).
    if (!r || !IsTerminalState(r->job.state()) || r->job.end_time() != ended_at)
      return absl::FailedPreconditionError(absl::StrCat(
          "resume: job ", job_id, " changed while it was being resumed; look at it again"));
    v1::Job& j = r->job;
    ended_.erase({j.end_time(), job_id});
    // The job's spec has its defaults (applied at submit, or migrated when the db was read).
    const int mn = std::max(1, j.spec().sharding().min_workers());
    j.set_state(v1::JOB_STATE_PENDING);
    j.set_reason(absl::StrCat("resumed from ", point->dir, "; waiting for ", mn, " workers"));
    j.set_end_time(0);
    j.set_restarts(0);
    j.set_resumes(j.resumes() + 1);
    j.set_step(point->step);
    j.set_tokens(point->manifest.tokens());
    j.clear_worker_ids();
    r->checkpoint_requested = false;
    r->cancel_after_save = false;
    if (options_.checkpoint_lease.count() > 0) leases_[job_id] = dir;
    v1::JobEvent ev;
    ev.set_step(point->step);
    ev.set_tokens(point->manifest.tokens());
    ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
    ev.set_message(absl::StrCat("resumed (resume ", j.resumes(), ") from ", point->dir, " (step ",
                                point->step, "); waiting for ", mn, " workers"));
    PublishLocked(r, ev);
    out = j;
  }
  LogEvent("job_resumed", {{"job", job_id},
                           {"owner", out.owner()},
                           {"step", out.step()},
                           {"dir", point->dir},
                           {"resumes", out.resumes()}});
  std::function<void()> cb;
  {
    absl::MutexLock lock(&mu_);
    cb = on_submit_;
  }
  if (cb) cb();
  return out;
}

absl::Status JobManager::Watch(const std::string& job_id, int64_t after_seq,
                               const std::function<bool(const v1::JobEvent&)>& on_event,
                               const std::function<bool()>& stop) {
  int64_t cursor = after_seq;
  for (;;) {
    std::vector<v1::JobEvent> batch;  // the events after cursor, handed out without mu_ held
    {
      absl::MutexLock lock(&mu_);
      for (;;) {
        if (shutdown_) return absl::UnavailableError("coordinator is shutting down");
        Record* r = FindLocked(job_id);
        if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
        if (!r->events.empty()) {
          int64_t first = r->events.front().seq();
          size_t i = cursor + 1 <= first ? 0 : static_cast<size_t>(cursor + 1 - first);
          for (; i < r->events.size(); ++i) batch.push_back(r->events[i]);
        }
        if (!batch.empty()) break;
        if (IsTerminalState(r->job.state())) return absl::OkStatus();
        if (stop && stop()) return absl::CancelledError("watch cancelled");
        cv_.WaitWithTimeout(&mu_, absl::Milliseconds(200));
      }
    }
    for (const auto& e : batch) {
      cursor = e.seq();
      if (!on_event(e)) return absl::OkStatus();
    }
  }
}

absl::StatusOr<std::vector<v1::JobEvent>> JobManager::RecentEvents(const std::string& job_id,
                                                                   size_t max) const {
  absl::MutexLock lock(&mu_);
  const Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  const size_t n = std::min(max, r->events.size());
  return std::vector<v1::JobEvent>(r->events.end() - n, r->events.end());
}

void JobManager::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  cv_.SignalAll();
}

absl::Status JobManager::SetPendingReason(const std::string& job_id, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (r->job.state() != v1::JOB_STATE_PENDING && r->job.state() != v1::JOB_STATE_RECOVERING)
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is not waiting"));
  if (r->job.reason() == reason) return absl::OkStatus();
  r->job.set_reason(reason);
  v1::JobEvent ev;
  ev.set_message(reason);
  ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
  PublishLocked(r, ev);
  return absl::OkStatus();
}

absl::StatusOr<v1::Job> JobManager::MarkStarting(const std::string& job_id,
                                                 const std::vector<std::string>& worker_ids,
                                                 int replicas, const std::string& placement_note) {
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  const bool recovering = r->job.state() == v1::JOB_STATE_RECOVERING;
  if (r->job.state() != v1::JOB_STATE_PENDING && !recovering)
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " is ", StateName(r->job.state()), ", not PENDING"));
  runs_.insert(job_id);  // until RunJoined
  v1::Job& j = r->job;
  j.set_state(v1::JOB_STATE_STARTING);
  j.set_reason("");
  j.set_world_size(static_cast<int>(worker_ids.size()));
  j.set_replicas(std::max(1, replicas));
  j.set_configured_replicas(j.replicas());
  j.clear_worker_ids();
  for (const auto& w : worker_ids) j.add_worker_ids(w);
  j.set_generation(j.generation() + 1);
  // A resumed job keeps the time it first started (its history continues).
  if (!recovering && j.start_time() == 0) j.set_start_time(NowSeconds());
  std::vector<std::string> ranks;
  for (size_t i = 0; i < worker_ids.size(); ++i)
    ranks.push_back(absl::StrCat(i, "=", worker_ids[i]));
  v1::JobEvent ev;
  const std::string mesh =
      j.replicas() > 1 ? absl::StrCat(" as ", j.replicas(), " replicas x ",
                                      worker_ids.size() / j.replicas(), " ranks")
                       : "";
  ev.set_message(absl::StrCat("starting generation ", j.generation(), " on ", worker_ids.size(),
                              " workers", mesh, " (rank=worker: ", absl::StrJoin(ranks, ", "), ")",
                              placement_note.empty() ? "" : "; ", placement_note));
  ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
  PublishLocked(r, ev);
  LogEvent("generation_started", {{"job", job_id},
                                  {"generation", j.generation()},
                                  {"world_size", j.world_size()},
                                  {"replicas", j.replicas()},
                                  {"ranks", absl::StrJoin(ranks, ",")},
                                  {"steps_done", j.step()}});
  return j;
}

absl::Status JobManager::MarkRunning(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (r->job.state() != v1::JOB_STATE_STARTING)
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " is ", StateName(r->job.state()), ", not STARTING"));
  r->job.set_state(v1::JOB_STATE_RUNNING);
  r->dispatched = r->job.step();  // a new generation: nothing sent beyond its first step yet
  v1::JobEvent ev;
  ev.set_step(r->job.step());
  ev.set_message(absl::StrCat("running on ", r->job.world_size(), " ranks"));
  ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
  PublishLocked(r, ev);
  return absl::OkStatus();
}

absl::StatusOr<JobManager::Record*> JobManager::FindRunningLocked(const std::string& job_id) {
  Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (r->job.state() != v1::JOB_STATE_RUNNING)
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " is ", StateName(r->job.state()), ", not RUNNING"));
  return r;
}

absl::StatusOr<v1::Job> JobManager::MarkReconfigured(const std::string& job_id,
                                                     const std::vector<std::string>& worker_ids,
                                                     int replicas, const std::string& message) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Record*> found = FindRunningLocked(job_id);
  if (!found.ok()) return found.status();
  Record* r = *found;
  v1::Job& j = r->job;
  if (j.configured_replicas() == 0) j.set_configured_replicas(j.replicas());
  j.set_world_size(static_cast<int>(worker_ids.size()));
  j.set_replicas(std::max(1, replicas));
  j.clear_worker_ids();
  for (const auto& w : worker_ids) j.add_worker_ids(w);
  j.set_generation(j.generation() + 1);
  r->dispatched = j.step();  // the new mesh has been sent nothing yet
  v1::JobEvent ev;
  ev.set_step(j.step());
  ev.set_tokens(j.tokens());
  ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
  ev.set_message(message);
  PublishLocked(r, ev);
  return j;
}

absl::StatusOr<int> JobManager::MarkRecovering(const std::string& job_id,
                                              const std::string& cause, int max_restarts) {
  // Held throughout: cancel_after_save is cleared, and a job ended, only under lease_io_mu_
  // (Finish, Cancel, Resume), so the decision below stands until the job is cancelled.
  absl::MutexLock io(&lease_io_mu_);
  {
    absl::MutexLock lock(&mu_);
    Record* r = FindLocked(job_id);
    if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    if (IsTerminalState(r->job.state()))
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id, " already ended (", StateName(r->job.state()), ")"));
    if (!r->cancel_after_save) return MarkRecoveringLocked(r, cause, max_restarts);
  }
  // A cancel waits for a save that this failure prevented: the job is cancelled, not restarted.
  const std::string reason = absl::StrCat("cancelled by user; no checkpoint saved: ", cause);
  if (!HasRun(job_id)) ReleaseLeaseIoLocked(job_id);  // else RunJoined releases it
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (IsTerminalState(r->job.state()))
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " already ended (", StateName(r->job.state()), ")"));
  FinishLocked(r, v1::JOB_STATE_CANCELLED, reason);
  return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " ", reason));
}

absl::StatusOr<int> JobManager::MarkRecoveringLocked(Record* r, const std::string& cause,
                                                    int max_restarts) {
  const std::string& job_id = r->job.job_id();
  v1::Job& j = r->job;
  j.set_restarts(j.restarts() + 1);
  j.set_state(v1::JOB_STATE_RECOVERING);
  const std::string msg =
      absl::StrCat("recovering from ", cause, " (restart ", j.restarts(), " of ", max_restarts, ")");
  j.set_reason(msg);
  r->checkpoint_requested = false;
  v1::JobEvent ev;
  ev.set_step(j.step());
  ev.set_tokens(j.tokens());
  ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
  ev.set_message(msg);
  PublishLocked(r, ev);
  LogEvent("job_restarting", {{"job", job_id},
                              {"generation", j.generation()},
                              {"restart", j.restarts()},
                              {"max_restarts", max_restarts},
                              {"step", j.step()},
                              {"cause", cause}});
  return j.restarts();
}

absl::Status JobManager::RecordStep(const std::string& job_id, const v1::JobEvent& ev,
                                    bool* checkpoint_requested) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Record*> found = FindRunningLocked(job_id);
  if (!found.ok()) return found.status();
  Record* r = *found;
  v1::Job& j = r->job;
  j.set_step(ev.step());
  j.set_loss(ev.loss());
  if (!std::isnan(ev.val_loss())) j.set_val_loss(ev.val_loss());
  j.set_tokens(ev.tokens());
  PublishLocked(r, ev);
  if (checkpoint_requested) *checkpoint_requested = r->checkpoint_requested;
  r->checkpoint_requested = false;
  return absl::OkStatus();
}

absl::Status JobManager::PublishMessage(const std::string& job_id, const std::string& message) {
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (IsTerminalState(r->job.state()))
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " already ended (", StateName(r->job.state()), ")"));
  v1::JobEvent ev;
  ev.set_step(r->job.step());
  ev.set_tokens(r->job.tokens());
  ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
  ev.set_message(message);
  PublishLocked(r, ev);
  return absl::OkStatus();
}

absl::Status JobManager::MarkResumed(const std::string& job_id, int64_t step, int64_t tokens,
                                     const std::string& message) {
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (r->job.state() != v1::JOB_STATE_STARTING)
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " is ", StateName(r->job.state()), ", not STARTING"));
  r->job.set_step(step);
  r->job.set_tokens(tokens);
  v1::JobEvent ev;
  ev.set_step(step);
  ev.set_tokens(tokens);
  ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
  ev.set_message(message);
  PublishLocked(r, ev);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> JobManager::RequestCheckpoint(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (r->job.spec().checkpoint().dir().empty())
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " has no checkpoint.dir; set one in the spec to checkpoint"));
  if (r->job.state() != v1::JOB_STATE_RUNNING)
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " is ", StateName(r->job.state()), "; only a RUNNING job can checkpoint"));
  r->checkpoint_requested = true;
  return std::min(std::max(r->job.step() + 1, r->dispatched), r->job.total_steps());
}

void JobManager::SetDispatched(const std::string& job_id, int64_t completed) {
  absl::MutexLock lock(&mu_);
  if (Record* r = FindLocked(job_id)) r->dispatched = completed;
}

bool JobManager::TryDispatchAhead(const std::string& job_id, int64_t completed) {
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (r == nullptr || r->checkpoint_requested) return false;
  r->dispatched = completed;
  return true;
}

absl::Status JobManager::Finish(const std::string& job_id, v1::JobState state,
                                const std::string& reason) {
  if (!IsTerminalState(state))
    return absl::InvalidArgumentError(absl::StrCat("not a final state: ", StateName(state)));
  // The lease goes before the job is seen to end (another coordinator may then take over), unless
  // a run of the job may still be writing (a failure, followed by Abort): RunJoined releases it.
  // SUCCEEDED comes after every rank acknowledged the final save.
  absl::MutexLock io(&lease_io_mu_);
  if (state == v1::JOB_STATE_SUCCEEDED || !HasRun(job_id)) ReleaseLeaseIoLocked(job_id);
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (IsTerminalState(r->job.state()))
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " already ended (", StateName(r->job.state()), ")"));
  if (state == v1::JOB_STATE_FAILED && r->cancel_after_save) {
    // A cancel waits for a save that this failure prevented: the job is cancelled, saying why.
    FinishLocked(r, v1::JOB_STATE_CANCELLED,
                 absl::StrCat("cancelled by user; no checkpoint saved: ", reason));
  } else {
    FinishLocked(r, state, reason);
  }
  return absl::OkStatus();
}

void JobManager::FinishLocked(Record* r, v1::JobState state, const std::string& reason) {
  const std::string job_id = r->job.job_id();
  v1::Job& j = r->job;
  // A cancel that waited for its save ends here (the step driver finishes the job).
  const bool cancelled_after_save = state == v1::JOB_STATE_CANCELLED && r->cancel_after_save;
  r->cancel_after_save = false;
  j.set_state(state);
  j.set_reason(reason);
  j.set_end_time(NowSeconds());
  v1::JobEvent ev;
  ev.set_step(j.step());
  ev.set_loss(j.loss());
  ev.set_val_loss(j.val_loss());
  ev.set_tokens(j.tokens());
  ev.set_message(reason.empty() ? StateName(state) : reason);
  PublishLocked(r, ev);
  const v1::Job ended = j;
  NoteEndedLocked(ended);  // may remove the record
  if (cancelled_after_save)
    LogEvent("job_cancelled", {{"job", job_id}, {"owner", ended.owner()}, {"step", ended.step()}});
  LogEnded(ended);
}

absl::Status JobManager::Refused(absl::Status s, const std::string& owner,
                                 const v1::JobSpec& spec) {
  // Validation messages read "field: rule".
  const std::string message(s.message());
  const size_t colon = message.find(": ");
  // A refused spec may break the limits: its name is logged up to the limit on names.
  std::string name = spec.name();
  if (static_cast<int64_t>(name.size()) > kMaxNameBytes)
    name = absl::StrCat(name.substr(0, static_cast<size_t>(kMaxNameBytes)), "... (",
                        spec.name().size(), " bytes)");
  LogEvent("job_refused", {{"owner", owner},
                           {"name", name},
                           {"code", absl::StatusCodeToString(s.code())},
                           {"field", colon == std::string::npos ? "" : message.substr(0, colon)},
                           {"rule", colon == std::string::npos ? message : message.substr(colon + 2)}});
  return s;
}

void JobManager::LogEnded(const v1::Job& j) {
  const double since = j.start_time() > 0 ? j.start_time() : j.create_time();
  LogEvent("job_ended", {{"job", j.job_id()},
                         {"state", StateName(j.state())},
                         {"steps", j.step()},
                         {"total_steps", j.total_steps()},
                         {"loss", j.step() > 0 ? j.loss() : std::numeric_limits<double>::quiet_NaN()},
                         {"val_loss", j.val_loss()},
                         {"restarts", j.restarts()},
                         {"wall_s", j.end_time() - since},
                         {"reason", j.reason()}});
}

bool JobManager::IsTerminal(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  const Record* r = FindLocked(job_id);
  return !r || IsTerminalState(r->job.state());
}

void JobManager::SetScalingState(const std::string& job_id, const v1::ScalingState& state) {
  absl::MutexLock lock(&mu_);
  Record* r = FindLocked(job_id);
  if (!r) return;
  r->scaling = state;
  r->scaling->set_job_id(job_id);
}

absl::StatusOr<v1::ScalingState> JobManager::GetScalingState(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  const Record* r = FindLocked(job_id);
  if (!r) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (!r->scaling)
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " has not reported a scaling state yet"));
  return *r->scaling;
}

void JobManager::SetSubmitListener(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  on_submit_ = std::move(fn);
}

std::shared_ptr<ResolvedJob> JobManager::Resolved(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  const Record* r = FindLocked(job_id);
  return r == nullptr ? nullptr : r->resolved;
}

void JobManager::SetAdmission(std::function<absl::Status(ResolvedJob&)> fn) {
  absl::MutexLock lock(&mu_);
  admission_ = std::move(fn);
}
void JobManager::SetCancelListener(std::function<void(const std::string&)> fn) {
  absl::MutexLock lock(&mu_);
  on_cancel_ = std::move(fn);
}

}  // namespace fsdp8::coord
