// WorkerRegistry: the coordinator's view of its worker daemons — registration (with the version
// check), heartbeats, each worker's Session stream, and which job/rank each worker serves.
//
// A worker is *assignable* when it is healthy (a heartbeat within heartbeat_timeout), has an open
// Session, is idle, and is not in the grace period after an Abort (see Release). Messages a worker sends on its Session, and the loss of a worker (its
// Session ended, or its heartbeats stopped), are delivered to the handler of the job the worker is
// assigned to. A worker whose Session ends is marked unhealthy and stays listed (without a session)
// until it has been silent for 60 s; a later heartbeat makes a worker that still has a Session
// healthy again.
//
// Held jobs: a worker that registers with RegisterRequest.held_job still holds a job of a
// coordinator that went away; it is not assignable (WorkerInfo.state BUSY) until the scheduler
// re-adopts it (Adopt) or tells it to drop the job (DropHeld). A registration without one clears
// the report.
//
// Transport: the gRPC layer (or a test) attaches a SessionSink per Session stream; the registry
// only ever calls Send/Close on it.
//
// Thread-safety: every method is safe to call from several threads. Handlers and the change
// listener are called without the registry's lock held.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "fsdp8/v1/admin.pb.h"
#include "fsdp8/v1/worker.pb.h"

namespace fsdp8::coord {

// One worker's Session stream, seen from the coordinator.
class SessionSink {
 public:
  virtual ~SessionSink() = default;
  // Queues a message for the worker; false when the stream is already closed.
  virtual bool Send(const v1::CoordinatorMessage& msg) = 0;
  // Asks the transport to end the stream (used when a newer Session replaces this one).
  virtual void Close() = 0;
};

// Something that happened to an assigned worker.
struct WorkerEvent {
  enum Kind { kMessage, kLost };
  Kind kind = kMessage;
  std::string worker_id;
  v1::WorkerMessage message;  // kMessage
  std::string reason;         // kLost: why, e.g. "session stream ended"
};
using WorkerEventHandler = std::function<void(const WorkerEvent&)>;

struct WorkerRegistryOptions {
  std::string version;  // workers must report exactly this version
  std::chrono::milliseconds heartbeat_timeout{3000};
  int heartbeat_interval_ms = 500;
};

class WorkerRegistry {
 public:
  explicit WorkerRegistry(WorkerRegistryOptions options);

  // FAILED_PRECONDITION "worker version X != coordinator version Y" on a version mismatch;
  // INVALID_ARGUMENT for an empty host or a malformed name. Otherwise the worker id: req.name, or
  // a new w-<n> when it is empty.
  // A name already listed is taken over (same id; its drain and any job it serves stay, and the
  // job learns of the old session's end when the new one attaches) unless that entry is healthy
  // with an open Session of another process (host, pid): ALREADY_EXISTS, naming it; the worker
  // retries, and gets the name once that session ends or its heartbeats stop.
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& req);
  // NOT_FOUND for an unknown worker id (the worker should register again).
  absl::Status Heartbeat(const std::string& worker_id);

  // Attaches a Session stream (after its Hello). A previous Session of the same worker is closed
  // and treated as ended. Returns a token identifying this Session. NOT_FOUND for an unknown id.
  absl::StatusOr<uint64_t> AttachSession(const std::string& worker_id,
                                         std::shared_ptr<SessionSink> sink);
  // A message received on Session `token` (ignored when the token is stale).
  void OnMessage(const std::string& worker_id, uint64_t token, const v1::WorkerMessage& msg);
  // Session `token` ended: the worker becomes unhealthy and its job (if any) is told.
  void DetachSession(const std::string& worker_id, uint64_t token, const std::string& reason);

  // Every worker in registration order, with WorkerInfo.state computed now.
  std::vector<v1::WorkerInfo> List() const;
  // Drains a worker (undo = false): it is never assigned again (FreeWorkers/Assign skip it), while
  // a job it already serves keeps it until that job's run releases it. undo = true makes it
  // assignable again. Returns its WorkerInfo; NOT_FOUND for an unknown id. A drained worker that
  // registers again under a new id (no name) is not drained; one with a name stays drained.
  absl::StatusOr<v1::WorkerInfo> Drain(const std::string& worker_id, bool undo);
  // Whole-coordinator drain: while false, no worker is assignable (running jobs keep theirs).
  void SetAssigning(bool assigning);

  // ---- scheduler side ----
  // Assignable workers with this backend, in registration order.
  std::vector<std::string> FreeWorkers(const std::string& backend) const;
  // The memory each healthy worker with this backend may use (WorkerInfo.memory_bytes; 0:
  // unknown), by worker id; busy workers included (the memory plan's capacity check).
  std::map<std::string, int64_t> WorkerMemory(const std::string& backend) const;
  // Each registered worker's placement domain with this backend (coordinator/placement.h:
  // DomainOf(host, placement_domain)), by worker id.
  std::map<std::string, std::string> WorkerDomains(const std::string& backend) const;
  // Marks worker_ids[r] as rank r of job_id and routes their events to `handler`.
  // FAILED_PRECONDITION (nothing changes) when any of them is not assignable any more.
  absl::Status Assign(const std::vector<std::string>& worker_ids, const std::string& job_id,
                      WorkerEventHandler handler);
  // The held-job report of every healthy worker with an open Session that holds one, by worker id.
  std::map<std::string, v1::HeldJob> HeldJobs() const;
  // Re-adoption: marks worker_ids[r] as rank r of job_id, as Assign does, when each one is healthy
  // with an open Session and reports holding job_id (its report is cleared). FAILED_PRECONDITION
  // (nothing changes) otherwise.
  absl::Status Adopt(const std::vector<std::string>& worker_ids, const std::string& job_id,
                     WorkerEventHandler handler);
  // As above, checking under the registry's lock that worker_ids[r] still reports the held job
  // expected[r] describes (same job, generation, rank, world size and replicas): a worker that
  // registered again meanwhile with another report is not adopted. FAILED_PRECONDITION (nothing
  // changes) when the sizes differ or a report does not match.
  absl::Status Adopt(const std::vector<std::string>& worker_ids,
                     const std::vector<v1::HeldJob>& expected, WorkerEventHandler handler);
  // Tells a worker that holds a job to drop it (Abort{reason}), clears its report and keeps it
  // unassignable for `grace` (it is tearing the job down). False when it holds none.
  bool DropHeld(const std::string& worker_id, const std::string& reason,
                std::chrono::milliseconds grace);
  // Makes the workers of job_id idle again (their sessions stay). Those in `aborted` were just sent
  // Abort and may still be unwinding the job (a step in flight, its communicator); they stay
  // unassignable (FreeWorkers/Assign skip them) for `grace`, so a next Assignment does not queue
  // up behind that work. The protocol has no "I am idle again" message to wait for instead.
  void Release(const std::string& job_id, const std::vector<std::string>& aborted = {},
               std::chrono::milliseconds grace = std::chrono::milliseconds(0));
  // A job continuing on fewer replicas: its workers not in `ranks` become idle as Release makes
  // them (each kept unassignable for `grace`: it was sent Abort), and ranks[r] becomes rank r.
  void Shrink(const std::string& job_id, const std::vector<std::string>& ranks,
              std::chrono::milliseconds grace);
  // Sends on the worker's current Session; false when it has none or the send failed.
  bool Send(const std::string& worker_id, const v1::CoordinatorMessage& msg);
  // Marks workers silent for longer than the heartbeat timeout unhealthy, tells their jobs, and
  // forgets workers without a Session silent for over 60 s.
  void CheckHeartbeats();
  // Called (without locks) whenever the set of assignable workers may have grown.
  void SetChangeListener(std::function<void()> fn);

  const WorkerRegistryOptions& options() const { return options_; }

 private:
  struct Worker {
    v1::WorkerInfo info;
    std::chrono::steady_clock::time_point last_seen;
    std::shared_ptr<SessionSink> session;
    uint64_t token = 0;
    WorkerEventHandler handler;
    int64_t order = 0;
    bool memory_shared = false;  // RegisterRequest.memory_shared
    int64_t pid = 0;  // the registering process's, to tell its own re-registration from another's
    std::chrono::steady_clock::time_point hold_until{};  // unassignable before this (see Release)
    std::optional<v1::HeldJob> held;  // RegisterRequest.held_job, until adopted or dropped
  };
  bool Assignable(const Worker& w, std::chrono::steady_clock::time_point now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // w's WorkerInfo, its state computed now and memory_bytes its share (MemoryLocked).
  v1::WorkerInfo InfoOf(const Worker& w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes worker_ids[r] rank r of job_id (Adopt, once checked); clears their reports.
  void AdoptLocked(const std::vector<std::string>& worker_ids, const std::string& job_id,
                   WorkerEventHandler handler) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The memory w may use: RegisterRequest.memory_bytes, divided among the live workers (healthy,
  // or with a session still open) registered from the same host address with memory_shared. The
  // share is per address: simulated hosts on one machine (CPU workers with --host 127.0.0.1 and
  // 127.0.0.2) each divide the whole machine's memory among their own workers.
  int64_t MemoryLocked(const Worker& w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifyChange() ABSL_LOCKS_EXCLUDED(mu_);

  const WorkerRegistryOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Worker> workers_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool assigning_ ABSL_GUARDED_BY(mu_) = true;
  uint64_t next_token_ ABSL_GUARDED_BY(mu_) = 1;
  std::function<void()> on_change_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fsdp8::coord
