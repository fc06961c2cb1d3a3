// WorkerDaemon: the fsdp8-worker process logic. Registers with the coordinator (retrying),
// heartbeats, and serves the Session stream: Assignment → build backend, communicator and
// Trainer, then load Assignment.load_dir when set (train/checkpoint.h; every rank, collective)
// (reply Ready or WorkerError); StepCommand → run the step on the job thread and reply StepResult
// (or WorkerError, then drop the job; a job of R > 1 replicas under optimizer_sharding
// SHARD_GROUP, not free-running, is kept instead, its communicators aborted and later steps
// dropped unrun, until the coordinator's Reconfigure or Abort, or max(hold_job_s, 30) s);
// Reconfigure → drop the steps received before it and the step in flight, new communicators for
// the new mesh, Trainer::Rebind (continue on fewer replicas from memory; reply Ready or
// WorkerError, then drop the job); SaveCheckpoint → write this rank's rank-<r>.ckpt on the job
// thread between steps and reply CheckpointSaved (carrying the error when the shard could not be
// written; the job stays usable; under hybrid sharding a rank whose file the mesh's checkpoint
// does not take, a replica other than 0 with optimizer_sharding SHARD_GROUP, writes nothing and
// replies with an empty file; FSDP8_FAULT_CHECKPOINT_ENOSPC injects such failures,
// common/fault_injection.h);
// Finish → drop the job; Abort → cancel the job's rendezvous if it is still bootstrapping, abort
// the communicator (a collective blocked on a hung peer returns at once: comm/communicator.h) and
// drop the job. A newer
// Assignment cancels an older job's bootstrap too.
// The daemon survives job failures and coordinator restarts (it registers again, with exponential
// backoff from 0.2 s to 5 s).
// Holding a job through a coordinator restart (hold_job_s > 0): when the session ends while a job
// is ready (its Ready sent), the job is kept: its trainer, communicators and training state. The
// steps already received still run (their results kept, not sent), and the daemon
// registers again at once reporting the job (RegisterRequest.held_job: job, generation, rank,
// world size, replicas, steps completed, steps whose commands it received, the last results).
// Adopt{job, generation, rank} on the new session, handled after those steps, takes it up again
// (reply Ready; the StepCommands that follow continue from there: first those of the steps other
// ranks received and this one did not); Abort or an Assignment drops it; so does the end of
// hold_job_s from when the job thread went idle (the job is then dropped as after Abort and the
// worker is idle). A job still bootstrapping when the session ends is cancelled as before, and so
// is a job with a SaveCheckpoint received and not finished (SaveShard is collective: a rank the
// old coordinator did not reach would never join it) and a free-running job (it would run all its
// remaining steps before answering Adopt): the coordinator resumes those from their checkpoint. Nothing is reported for a job after its Abort (a late error or step
// result could be taken for the job's next generation).
//
// Thread-safety: Run() on one thread; Shutdown() from any thread (e.g. a signal watcher).
#pragma once

#include <atomic>
#include <vector>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "fsdp8/v1/worker.grpc.pb.h"
#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "comm/communicator.h"
#include "common/fault_injection.h"
#include "worker/metrics.h"
#include "worker/settings.h"

namespace fsdp8 {

struct DaemonOptions {
  std::string coordinator;     // host:port
  std::string host = "127.0.0.1";  // address peers use for collectives
  // RegisterRequest.placement_domain: the device's NVLink island within the host; empty: the host
  // is one domain. The daemon sends it as given; fsdp8-worker fills it from --placement_domain,
  // else on the cuda backend from NVML (worker/nvlink_domain.h).
  std::string placement_domain;
  std::string backend = "cpu";
  int device = 0;
  int connect_timeout_s = 60;  // give up when the coordinator does not answer this long; 0: never
  // Stable worker id to register under (RegisterRequest.name, e.g. the pod name); empty: the
  // coordinator assigns one, new at each registration.
  std::string name;
  // The memory reported at registration (RegisterRequest.memory_bytes): the device's (a GPU's
  // total, or --memory_limit_mb when smaller), or, for a CPU worker without --memory_limit_mb,
  // the host's physical memory with memory_shared (the coordinator divides it among the host's
  // workers). 0: unknown.
  int64_t memory_bytes = 0;
  bool memory_shared = false;
  // The channel to the coordinator (TLS, token: common/rpc_channel.h); null = plaintext.
  std::shared_ptr<grpc::Channel> channel;
  WorkerMetrics* metrics = nullptr;  // optional; must outlive the daemon
  // How long a job is held for re-adoption after its coordinator's session ended (see above),
  // seconds; 0: the job is dropped at once (as before held jobs existed).
  int hold_job_s = 60;
  // The process's environment settings (WorkerSettings::FromEnvironment in main): the options of
  // each job's backend, NCCL communicator and trainer, and the faults to inject.
  WorkerSettings settings;
};

class WorkerDaemon {
 public:
  explicit WorkerDaemon(DaemonOptions opts);
  ~WorkerDaemon();
  // Serves until Shutdown() or until the coordinator stays unreachable for connect_timeout_s.
  // Returns 0 on a clean shutdown, 1 when the coordinator could not be reached.
  int Run();
  void Shutdown();
  // True while registered with the coordinator and its session is being served (any thread).
  bool registered() const { return registered_.load(); }

 private:
  struct Job;
  bool Register();
  void Serve();  // one Session stream
  void HeartbeatLoop(std::string worker_id, int interval_ms, std::atomic<bool>* stop);
  void Send(const v1::WorkerMessage& m) ABSL_LOCKS_EXCLUDED(write_mu_);
  void Post(std::function<void()> task) ABSL_LOCKS_EXCLUDED(q_mu_);
  void JobThread() ABSL_LOCKS_EXCLUDED(q_mu_);
  // What the job thread waits for.
  bool TaskOrStopLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(q_mu_) {
    return q_stop_ || !queue_.empty();
  }
  void HandleAssignment(const v1::Assignment& a, std::shared_ptr<std::atomic<bool>> cancelled);
  // Adds comm to live_comms_ unless the job was cancelled (then aborts it, returns false).
  bool PublishComm(const std::shared_ptr<Communicator>& comm, const std::atomic<bool>& cancelled)
      ABSL_LOCKS_EXCLUDED(comm_mu_);
  // A hybrid job's group communicators (job->shard_comm, job->replica_comm), published as made.
  absl::Status SplitMesh(Job* job) ABSL_LOCKS_EXCLUDED(comm_mu_);
  // Marks the newest job's bootstrap cancelled and aborts its communicator (reader thread).
  void CancelJob(const std::string& reason) ABSL_LOCKS_EXCLUDED(comm_mu_);
  void HandleStep(const v1::StepCommand& c);
  // The world communicator of rank `rank` of `world_size`, bootstrapped through the job's store
  // under `prefix` (job thread); *transport names what the CPU transports chose.
  absl::StatusOr<std::shared_ptr<Communicator>> BootstrapWorld(
      Job* job, const std::string& backend, int rank, int world_size, const std::string& prefix,
      int collective_timeout_ms, int bootstrap_timeout_ms, std::string* transport);
  // Continue on fewer replicas: new communicators for the new mesh, the trainer rebound to them
  // (Trainer::Rebind); replies Ready, or WorkerError (then drops the job).
  void HandleReconfigure(const v1::Reconfigure& rc);
  // Aborts the job's communicators without cancelling the job (reader thread: a Reconfigure).
  void AbortComms(const std::string& reason) ABSL_LOCKS_EXCLUDED(comm_mu_);
  // The session ended while the job was ready: keep it for hold_job_s and publish what it holds
  // for the next registration (job thread).
  void HoldJob();
  // Updates held_ from job_ (job thread).
  void PublishHeld() ABSL_LOCKS_EXCLUDED(held_mu_);
  // Drops a held job whose hold_job_s has passed (job thread, between tasks).
  void ExpireHold();
  // Adopt: goes on with the held job when it is the one named; replies Ready or WorkerError.
  void HandleAdopt(const v1::Adopt& a);
  // One step; false when it failed (the job was dropped and the error sent).
  bool RunStep(const v1::StepCommand& c);
  // Writes this rank's checkpoint shard (between steps) and replies CheckpointSaved or WorkerError.
  void HandleSave(const v1::SaveCheckpoint& c);
  // Sends HandleSave's reply unless the job was cancelled or is held meanwhile (job thread).
  void SendSaveReply(const v1::WorkerMessage& m);
  // Destroys the current job. Unless `finished` (the coordinator's Finish), its communicator is
  // aborted first: collectives still queued on it (a prefetch behind a failed step) then end at
  // once instead of waiting for a peer up to the collective timeout; the peers learn that this
  // rank left, as from its communicator's destruction.
  void DropJob(bool finished = false) ABSL_LOCKS_EXCLUDED(comm_mu_);
  void Log(const std::string& msg) const;

  DaemonOptions opts_;  // opts_.settings.faults keeps its state: touched only on the job thread
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<v1::WorkerControl::Stub> stub_;
  std::string worker_id_;
  int heartbeat_ms_ = 1000;
  std::atomic<bool> shutdown_{false};
  std::atomic<bool> registered_{false};

  absl::Mutex ctx_mu_;
  grpc::ClientContext* session_ctx_ ABSL_GUARDED_BY(ctx_mu_) = nullptr;
  absl::Mutex write_mu_;  // held across a write: one message on the stream at a time
  grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>* stream_
      ABSL_GUARDED_BY(write_mu_) = nullptr;

  // Job thread: assignments and steps run there in order.
  absl::Mutex q_mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(q_mu_);
  bool q_stop_ ABSL_GUARDED_BY(q_mu_) = false;
  std::thread job_thread_;
  std::unique_ptr<Job> job_;  // touched only on the job thread
  absl::Mutex comm_mu_;
  // The current job's communicators (the world's, then a hybrid job's group ones), for Abort
  // from the reader: aborting one does not abort the others (Communicator::Split).
  std::vector<std::shared_ptr<Communicator>> live_comms_ ABSL_GUARDED_BY(comm_mu_);
  // The newest assigned job's abort flag. Set by Abort, by session end and by a newer
  // Assignment; the job's rendezvous waits poll it, so a job aborted while still bootstrapping
  // stops within a fraction of a second instead of at the rendezvous timeout.
  std::shared_ptr<std::atomic<bool>> job_cancelled_ ABSL_GUARDED_BY(comm_mu_);
  // Set when a job is aborted, fails a step, or the session ends, until the next assignment: step
  // commands the coordinator had already sent ahead are then dropped without an error.
  std::atomic<bool> stale_steps_{false};
  // Whether the job thread's job_ is ready (its Ready sent): set and cleared on the job thread,
  // read by the reader at session end to choose between holding and cancelling it.
  std::atomic<bool> job_ready_{false};
  // Set at a session's end when the job is held, until it is adopted or dropped: the steps already
  // received still run, their results kept instead of sent.
  std::atomic<bool> holding_{false};
  // SaveCheckpoint commands received (reader) whose HandleSave has not ended (job thread).
  std::atomic<int> saves_unfinished_{0};
  // Whether the newest assigned job is free-running (training.free_running); set on the job
  // thread before Ready, read by the reader at session end.
  std::atomic<bool> job_free_running_{false};
  // The steps of the current job whose commands this worker received (the next step no command
  // covers; HeldJob.steps_received), set by the reader.
  std::atomic<int64_t> job_received_{0};
  // When the held job is dropped (job thread only); unset when no job is held.
  std::optional<std::chrono::steady_clock::time_point> hold_until_;
  absl::Mutex held_mu_;
  // The ready job's state as a held job would report it (kept current by the job thread); sent
  // with a registration while holding_.
  std::optional<v1::HeldJob> held_ ABSL_GUARDED_BY(held_mu_);
  // Bumped by a Reconfigure (reader): step commands received before it are dropped unrun (the
  // step that was in flight is sent again for the new mesh).
  std::atomic<int64_t> step_epoch_{0};
  // A Reconfigure was received and not yet handled: a step that fails meanwhile (its
  // communicators aborted for the reconfiguration) reports nothing.
  std::atomic<bool> reconfiguring_{false};
  // A job whose step failed and that waits for the coordinator's Reconfigure or Abort (a hybrid
  // SHARD_GROUP job, which may continue on fewer replicas) is dropped at this time (job thread).
  std::optional<std::chrono::steady_clock::time_point> failed_until_;
  // The highest step whose StepCommand the session has received (for FSDP8_FAULT_STEP_ERROR).
  std::atomic<int64_t> last_step_received_{-1};
};

}  // namespace fsdp8
