#include "coordinator/worker_registry.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "coordinator/job_manager.h"
#include "coordinator/placement.h"

namespace fsdp8::coord {

WorkerRegistry::WorkerRegistry(WorkerRegistryOptions options) : options_(std::move(options)) {}

namespace {

// A worker name: 1 to 63 characters of [A-Za-z0-9._-] (a Kubernetes pod name fits), and not of
// the form w-<digits>, which the registry gives to unnamed workers.
absl::Status CheckName(const std::string& name) {
  if (name.size() > 63)
    return absl::InvalidArgumentError(
        absl::StrCat("name: ", name.size(), " characters; at most 63 are allowed"));
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-')
      return absl::InvalidArgumentError(absl::StrCat(
          "name: '", name, "' has a character other than A-Z, a-z, 0-9, '.', '_' and '-'"));
  }
  if (name.size() > 2 && name.rfind("w-", 0) == 0 &&
      std::all_of(name.begin() + 2, name.end(), [](char c) { return absl::ascii_isdigit(c); }))
    return absl::InvalidArgumentError(absl::StrCat(
        "name: '", name, "' has the form w-<digits>, which is kept for unnamed workers"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::RegisterResponse> WorkerRegistry::Register(const v1::RegisterRequest& req) {
  if (req.version() != options_.version)
    return absl::FailedPreconditionError(absl::StrCat(
        "worker version ", req.version(), " != coordinator version ", options_.version));
  if (req.host().empty()) return absl::InvalidArgumentError("host: must not be empty");
  if (!req.name().empty()) {
    if (absl::Status s = CheckName(req.name()); !s.ok()) return s;
  }
  std::string backend = req.backend().empty() ? "cpu" : req.backend();
  v1::RegisterResponse resp;
  std::shared_ptr<SessionSink> replaced;  // a taken-over entry's old Session, ended below
  WorkerEventHandler handler;
  {
    absl::MutexLock lock(&mu_);
    std::string id;
    Worker* w = nullptr;
    if (!req.name().empty()) {
      id = req.name();
      auto it = workers_.find(id);
      if (it != workers_.end()) {
        Worker& old = it->second;
        if (old.info.healthy() && old.session &&
            (old.info.host() != req.host() || old.pid != req.pid())) {
          return absl::AlreadyExistsError(absl::StrCat(
              "name: '", id, "' is registered by a live worker (host ", old.info.host(), ", pid ",
              old.pid, "); retry once it is gone"));
        }
        w = &old;  // taken over: order, drain, job and rank stay
        if (old.session) {
          // Its own earlier Session, or that of a process that stopped beating: it must not be
          // assignable through the old stream in the moment before the new one attaches.
          replaced = std::move(old.session);
          old.token = 0;
          handler = old.handler;
        }
      }
    }
    if (w == nullptr) {
      const int64_t n = next_id_++;
      if (id.empty()) id = absl::StrCat("w-", n);
      w = &workers_[id];
      w->order = n;
      w->info.set_rank(-1);
    }
    w->pid = req.pid();
    w->last_seen = std::chrono::steady_clock::now();
    v1::WorkerInfo& i = w->info;
    i.set_worker_id(id);
    i.set_host(req.host());
    i.set_backend(backend);
    i.set_device(req.device());
    i.set_placement_domain(req.placement_domain());
    i.set_memory_bytes(req.memory_bytes());
    w->memory_shared = req.memory_shared();
    w->held.reset();
    if (req.has_held_job() && !req.held_job().job_id().empty()) w->held = req.held_job();
    i.set_version(req.version());
    i.set_healthy(true);
    i.set_last_heartbeat(NowSeconds());
    resp.set_worker_id(id);
    resp.set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  }
  if (replaced) {
    replaced->Close();
    if (handler) {
      WorkerEvent ev;
      ev.kind = WorkerEvent::kLost;
      ev.worker_id = resp.worker_id();
      ev.reason = "session replaced: the worker registered again";
      handler(ev);
    }
  }
  return resp;
}

absl::Status WorkerRegistry::Heartbeat(const std::string& worker_id) {
  bool became_healthy = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(worker_id);
    if (it == workers_.end())
      return absl::NotFoundError(absl::StrCat("worker '", worker_id, "' is not registered"));
    Worker& w = it->second;
    w.last_seen = std::chrono::steady_clock::now();
    w.info.set_last_heartbeat(NowSeconds());
    if (!w.info.healthy() && w.session) {
      w.info.set_healthy(true);
      became_healthy = true;
    }
  }
  if (became_healthy) NotifyChange();
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> WorkerRegistry::AttachSession(const std::string& worker_id,
                                                       std::shared_ptr<SessionSink> sink) {
  std::shared_ptr<SessionSink> old;
  WorkerEventHandler handler;
  uint64_t token;
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(worker_id);
    if (it == workers_.end())
      return absl::NotFoundError(absl::StrCat("worker '", worker_id, "' is not registered"));
    Worker& w = it->second;
    old = std::move(w.session);
    if (old) handler = w.handler;
    w.session = std::move(sink);
    w.token = token = next_token_++;
    w.last_seen = std::chrono::steady_clock::now();
    w.info.set_healthy(true);
  }
  if (old) {
    old->Close();
    if (handler) {
      WorkerEvent ev;
      ev.kind = WorkerEvent::kLost;
      ev.worker_id = worker_id;
      ev.reason = "session replaced by a new one";
      handler(ev);
    }
  }
  NotifyChange();
  return token;
}

void WorkerRegistry::OnMessage(const std::string& worker_id, uint64_t token,
                               const v1::WorkerMessage& msg) {
  WorkerEventHandler handler;
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(worker_id);
    if (it == workers_.end() || it->second.token != token) return;
    it->second.last_seen = std::chrono::steady_clock::now();
    handler = it->second.handler;
  }
  if (handler) {
    WorkerEvent ev;
    ev.kind = WorkerEvent::kMessage;
    ev.worker_id = worker_id;
    ev.message = msg;
    handler(ev);
  }
}

void WorkerRegistry::DetachSession(const std::string& worker_id, uint64_t token,
                                   const std::string& reason) {
  WorkerEventHandler handler;
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(worker_id);
    if (it == workers_.end() || it->second.token != token) return;
    Worker& w = it->second;
    w.session.reset();
    w.token = 0;
    w.info.set_healthy(false);
    handler = w.handler;
  }
  if (handler) {
    WorkerEvent ev;
    ev.kind = WorkerEvent::kLost;
    ev.worker_id = worker_id;
    ev.reason = reason;
    handler(ev);
  }
}

std::vector<v1::WorkerInfo> WorkerRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<const Worker*> ws;
  for (const auto& [id, w] : workers_) ws.push_back(&w);
  std::sort(ws.begin(), ws.end(), [](const Worker* a, const Worker* b) { return a->order < b->order; });
  std::vector<v1::WorkerInfo> out;
  for (const Worker* w : ws) out.push_back(InfoOf(*w));
  return out;
}

int64_t WorkerRegistry::MemoryLocked(const Worker& w) const {
  if (!w.memory_shared) return w.info.memory_bytes();
  int64_t sharing = 0;
  // Live registrations only: a worker whose session ended no longer takes a share. One whose
  // heartbeats stopped while its session stays open (a hung process) still holds its memory.
  for (const auto& [id, o] : workers_) {
    const bool live = o.info.healthy() || o.session != nullptr;
    sharing += o.memory_shared && live && o.info.host() == w.info.host();
  }
  return w.info.memory_bytes() / std::max<int64_t>(1, sharing);
}

std::map<std::string, int64_t> WorkerRegistry::WorkerMemory(const std::string& backend) const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int64_t> out;
  for (const auto& [id, w] : workers_) {
    if (w.info.healthy() && w.info.backend() == backend) out[id] = MemoryLocked(w);
  }
  return out;
}

std::map<std::string, std::string> WorkerRegistry::WorkerDomains(const std::string& backend) const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, std::string> out;
  for (const auto& [id, w] : workers_) {
    if (w.info.backend() == backend)
      out[id] = DomainOf(w.info.host(), w.info.placement_domain());
  }
  return out;
}

v1::WorkerInfo WorkerRegistry::InfoOf(const Worker& w) const {
  v1::WorkerInfo info = w.info;
  info.set_memory_bytes(MemoryLocked(w));
  const bool busy = !info.job_id().empty() || w.held.has_value();
  if (!info.healthy() || !w.session) info.set_state(v1::WORKER_STATE_UNHEALTHY);
  else if (info.draining()) info.set_state(busy ? v1::WORKER_STATE_DRAINING : v1::WORKER_STATE_DRAINED);
  else info.set_state(busy ? v1::WORKER_STATE_BUSY : v1::WORKER_STATE_IDLE);
  return info;
}

absl::StatusOr<v1::WorkerInfo> WorkerRegistry::Drain(const std::string& worker_id, bool undo) {
  v1::WorkerInfo out;
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(worker_id);
    if (it == workers_.end())
      return absl::NotFoundError(absl::StrCat("worker '", worker_id, "' not found"));
    it->second.info.set_draining(!undo);
    out = InfoOf(it->second);
  }
  if (undo) NotifyChange();
  return out;
}

void WorkerRegistry::SetAssigning(bool assigning) {
  {
    absl::MutexLock lock(&mu_);
    assigning_ = assigning;
  }
  if (assigning) NotifyChange();
}

bool WorkerRegistry::Assignable(const Worker& w, std::chrono::steady_clock::time_point now) const {
  return assigning_ && w.info.healthy() && w.session && w.info.job_id().empty() &&
         !w.held && !w.info.draining() && now >= w.hold_until;
}

std::vector<std::string> WorkerRegistry::FreeWorkers(const std::string& backend) const {
  absl::MutexLock lock(&mu_);
  const auto now = std::chrono::steady_clock::now();
  std::vector<const Worker*> ws;
  for (const auto& [id, w] : workers_) {
    if (Assignable(w, now) && w.info.backend() == backend) ws.push_back(&w);
  }
  std::sort(ws.begin(), ws.end(), [](const Worker* a, const Worker* b) { return a->order < b->order; });
  std::vector<std::string> out;
  for (const Worker* w : ws) out.push_back(w->info.worker_id());
  return out;
}

absl::Status WorkerRegistry::Assign(const std::vector<std::string>& worker_ids,
                                    const std::string& job_id, WorkerEventHandler handler) {
  absl::MutexLock lock(&mu_);
  const auto now = std::chrono::steady_clock::now();
  for (const auto& id : worker_ids) {
    auto it = workers_.find(id);
    if (it == workers_.end() || !Assignable(it->second, now))
      return absl::FailedPreconditionError(absl::StrCat("worker ", id, " is not assignable"));
  }
  for (size_t r = 0; r < worker_ids.size(); ++r) {
    Worker& w = workers_.at(worker_ids[r]);
    w.info.set_job_id(job_id);
    w.info.set_rank(static_cast<int>(r));
    w.handler = handler;
  }
  return absl::OkStatus();
}

std::map<std::string, v1::HeldJob> WorkerRegistry::HeldJobs() const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, v1::HeldJob> out;
  for (const auto& [id, w] : workers_) {
    if (w.held && w.session && w.info.healthy()) out[id] = *w.held;
  }
  return out;
}

namespace {

// Whether a held-job report names the same rank of the same generation and mesh.
bool SameHeldRank(const v1::HeldJob& a, const v1::HeldJob& b) {
  return a.job_id() == b.job_id() && a.generation() == b.generation() && a.rank() == b.rank() &&
         a.world_size() == b.world_size() && a.replicas() == b.replicas();
}

}  // namespace

absl::Status WorkerRegistry::Adopt(const std::vector<std::string>& worker_ids,
                                   const std::vector<v1::HeldJob>& expected,
                                   WorkerEventHandler handler) {
  if (expected.size() != worker_ids.size() || expected.empty())
    return absl::FailedPreconditionError(
        absl::StrCat("adopt: ", worker_ids.size(), " workers for ", expected.size(), " reports"));
  {
    absl::MutexLock lock(&mu_);
    for (size_t r = 0; r < worker_ids.size(); ++r) {
      auto it = workers_.find(worker_ids[r]);
      if (it == workers_.end() || !it->second.session || !it->second.info.healthy() ||
          !it->second.held || !SameHeldRank(*it->second.held, expected[r]))
        return absl::FailedPreconditionError(absl::StrCat(
            "worker ", worker_ids[r], " no longer reports holding job ", expected[r].job_id(),
            " generation ", expected[r].generation(), " rank ", expected[r].rank(), "/",
            expected[r].world_size(), " (or has no session)"));
    }
    AdoptLocked(worker_ids, expected[0].job_id(), std::move(handler));
  }
  return absl::OkStatus();
}

absl::Status WorkerRegistry::Adopt(const std::vector<std::string>& worker_ids,
                                   const std::string& job_id, WorkerEventHandler handler) {
  absl::MutexLock lock(&mu_);
  for (const auto& id : worker_ids) {
    auto it = workers_.find(id);
    if (it == workers_.end() || !it->second.session || !it->second.info.healthy() ||
        !it->second.held || it->second.held->job_id() != job_id)
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", id, " does not hold job ", job_id, " (or has no session)"));
  }
  AdoptLocked(worker_ids, job_id, std::move(handler));
  return absl::OkStatus();
}

void WorkerRegistry::AdoptLocked(const std::vector<std::string>& worker_ids,
                                 const std::string& job_id, WorkerEventHandler handler) {
  for (size_t r = 0; r < worker_ids.size(); ++r) {
    Worker& w = workers_.at(worker_ids[r]);
    w.held.reset();
    w.info.set_job_id(job_id);
    w.info.set_rank(static_cast<int>(r));
    w.handler = handler;
  }
}

bool WorkerRegistry::DropHeld(const std::string& worker_id, const std::string& reason,
                              std::chrono::milliseconds grace) {
  std::shared_ptr<SessionSink> sink;
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(worker_id);
    if (it == workers_.end() || !it->second.held) return false;
    it->second.held.reset();
    it->second.hold_until = std::chrono::steady_clock::now() + grace;
    sink = it->second.session;
  }
  v1::CoordinatorMessage m;
  m.mutable_abort()->set_reason(reason);
  if (sink) sink->Send(m);
  NotifyChange();
  return true;
}

void WorkerRegistry::Release(const std::string& job_id, const std::vector<std::string>& aborted,
                             std::chrono::milliseconds grace) {
  {
    absl::MutexLock lock(&mu_);
    const auto hold_until = std::chrono::steady_clock::now() + grace;
    for (auto& [id, w] : workers_) {
      if (w.info.job_id() == job_id) {
        w.info.clear_job_id();
        w.info.set_rank(-1);
        w.handler = nullptr;
        if (grace.count() > 0 && std::find(aborted.begin(), aborted.end(), id) != aborted.end())
          w.hold_until = hold_until;
      }
    }
  }
  NotifyChange();
}

void WorkerRegistry::Shrink(const std::string& job_id, const std::vector<std::string>& ranks,
                            std::chrono::milliseconds grace) {
  {
    absl::MutexLock lock(&mu_);
    const auto hold_until = std::chrono::steady_clock::now() + grace;
    for (auto& [id, w] : workers_) {
      if (w.info.job_id() != job_id) continue;
      auto it = std::find(ranks.begin(), ranks.end(), id);
      if (it != ranks.end()) {
        w.info.set_rank(static_cast<int>(it - ranks.begin()));
        continue;
      }
      w.info.clear_job_id();
      w.info.set_rank(-1);
      w.handler = nullptr;
      if (grace.count() > 0) w.hold_until = hold_until;
    }
  }
  NotifyChange();
}

bool WorkerRegistry::Send(const std::string& worker_id, const v1::CoordinatorMessage& msg) {
  std::shared_ptr<SessionSink> sink;
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(worker_id);
    if (it == workers_.end()) return false;
    sink = it->second.session;
  }
  return sink && sink->Send(msg);
}

void WorkerRegistry::CheckHeartbeats() {
  std::vector<std::pair<WorkerEventHandler, WorkerEvent>> lost;
  {
    absl::MutexLock lock(&mu_);
    auto now = std::chrono::steady_clock::now();
    for (auto it = workers_.begin(); it != workers_.end();) {
      Worker& w = it->second;
      auto silent = now - w.last_seen;
      if (!w.session && w.info.job_id().empty() && silent > std::chrono::seconds(60)) {
        it = workers_.erase(it);
        continue;
      }
      if (w.info.healthy() && silent > options_.heartbeat_timeout) {
        w.info.set_healthy(false);
        if (w.handler) {
          WorkerEvent ev;
          ev.kind = WorkerEvent::kLost;
          ev.worker_id = w.info.worker_id();
          ev.reason = absl::StrCat(
              "no heartbeat for ",
              std::chrono::duration_cast<std::chrono::milliseconds>(silent).count() / 1000.0, " s");
          lost.emplace_back(w.handler, ev);
        }
      }
      ++it;
    }
  }
  for (auto& [h, ev] : lost) h(ev);
}

void WorkerRegistry::SetChangeListener(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  on_change_ = std::move(fn);
}

void WorkerRegistry::NotifyChange() {
  std::function<void()> fn;
  {
    absl::MutexLock lock(&mu_);
    fn = on_change_;
  }
  if (fn) fn();
}

}  // namespace fsdp8::coord
