#include "worker/daemon.h"

#include <unistd.h>

#include <iostream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "common/checkpoint_format.h"
#include "common/log.h"
#include "common/mesh.h"
#include "train/checkpoint.h"
#include "train/device_buffer.h"
#include "comm/cpu_communicator.h"
#include "comm/shm_communicator.h"
#include "worker/grpc_kv_store.h"
#include "train/hf_import.h"
#include "train/trainer.h"
#ifdef FSDP8_WITH_CUDA
#include "comm/nccl_communicator.h"
#endif

#ifndef FSDP8_VERSION
#define FSDP8_VERSION "dev"
#endif

namespace fsdp8 {

struct WorkerDaemon::Job {
  std::string job_id;
  int64_t generation = 0;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<KvStore> grpc_kv;
  std::unique_ptr<KvStore> kv;  // grpc_kv, cancellable by the job's abort flag
  std::shared_ptr<Communicator> comm;
  // Hybrid sharding (R > 1): the shard group's and the replica group's communicators, split from
  // comm (Communicator::Split); null for a flat job.
  std::shared_ptr<Communicator> shard_comm, replica_comm;
  CommBytes reported;  // the trainer's byte counters (every communicator) already in the metrics
  int rank = 0;
  Mesh mesh;  // of the Assignment's resolved spec: which checkpoint file this rank writes
  int world_size = 1;
  int64_t steps_completed = 0;  // optimizer steps done (the next step to run)
  std::deque<v1::StepResult> recent;  // the last results (at most kRecentResults), oldest first
  std::unique_ptr<Trainer> trainer;
  // A step failed: the job waits for the coordinator's Reconfigure (continue on fewer replicas)
  // or Abort; steps queued meanwhile are dropped unrun.
  bool failed = false;
  // Set by Abort, by the end of the session and by a newer Assignment: the coordinator has moved
  // on, so nothing more is reported for this job (a late error or result could otherwise be taken
  // for one of the job's next generation).
  std::shared_ptr<std::atomic<bool>> cancelled;
  ~Job() {
    trainer.reset();  // uses backend and the communicators
    shard_comm.reset();
    replica_comm.reset();
    comm.reset();
    backend.reset();
  }
};

namespace {

// Results a held job reports (HeldJob.recent_results): with one step sent ahead, the old
// coordinator may have recorded neither of the last two.
constexpr size_t kRecentResults = 4;

// The wire form of a step's figures (job_id is left to the caller).
v1::StepResult ToStepResult(const StepStats& s) {
  v1::StepResult r;
  r.set_step(s.step);
  r.set_loss_sum(s.loss_sum);
  r.set_tokens(s.tokens);
  r.set_grad_norm(s.grad_norm);
  r.set_lr(s.lr);
  r.set_epoch(s.epoch);
  r.set_val_loss(s.val_loss);
  r.set_eval_seconds(s.eval_seconds);
  r.set_compute_seconds(s.compute_seconds);
  r.set_comm_seconds(s.comm_seconds);
  r.set_optimizer_seconds(s.optimizer_seconds);
  r.set_all_gather_bytes(s.all_gather_bytes);
  r.set_reduce_scatter_bytes(s.reduce_scatter_bytes);
  r.set_forward_peak_bytes(s.forward_peak_bytes);
  r.set_backward_peak_bytes(s.backward_peak_bytes);
  r.set_optimizer_peak_bytes(s.optimizer_peak_bytes);
  r.set_peak_memory_bytes(s.peak_memory_bytes);
  r.set_skipped(s.skipped);
  if (s.scaling.has_value()) *r.mutable_scaling() = *s.scaling;
  return r;
}

}  // namespace

WorkerDaemon::WorkerDaemon(DaemonOptions opts)
    : opts_(std::move(opts)) {
  channel_ = opts_.channel;
  if (!channel_) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    channel_ = grpc::CreateCustomChannel(opts_.coordinator, grpc::InsecureChannelCredentials(), args);
  }
  stub_ = v1::WorkerControl::NewStub(channel_);
  job_thread_ = std::thread([this] { JobThread(); });
}

WorkerDaemon::~WorkerDaemon() {
  CancelJob("worker shutting down");
  {
    absl::MutexLock l(&q_mu_);
    q_stop_ = true;  // the job thread's wait sees it when q_mu_ is released
  }
  job_thread_.join();
}

void WorkerDaemon::Log(const std::string& msg) const {
  ::fsdp8::Log(LogLevel::kInfo,
               absl::StrCat("[worker ", worker_id_.empty() ? "?" : worker_id_, "] ", msg));
}

void WorkerDaemon::Shutdown() {
  shutdown_ = true;
  absl::MutexLock l(&ctx_mu_);
  if (session_ctx_) session_ctx_->TryCancel();
}

bool WorkerDaemon::Register() {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(opts_.connect_timeout_s);
  int attempt = 0;
  // Exponential backoff (0.2 s doubling to 5 s, with jitter) so that a fleet of workers does not
  // hammer a coordinator that is restarting; cut short once the channel connects (it reconnects on
  // its own backoff, common/rpc_channel.cc), so a coordinator that comes up is reached at once.
  std::chrono::milliseconds backoff(200);
  std::minstd_rand jitter(static_cast<uint32_t>(getpid()));
  auto last_log = std::chrono::steady_clock::now();
  while (!shutdown_) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::RegisterRequest req;
    req.set_version(FSDP8_VERSION);
    req.set_host(opts_.host);
    req.set_placement_domain(opts_.placement_domain);
    req.set_backend(opts_.backend);
    req.set_device(opts_.device);
    req.set_memory_bytes(opts_.memory_bytes);
    req.set_memory_shared(opts_.memory_shared);
    req.set_pid(getpid());
    req.set_name(opts_.name);
    {
      absl::MutexLock l(&held_mu_);
      if (holding_.load() && held_) {
        *req.mutable_held_job() = *held_;
        req.mutable_held_job()->set_steps_received(
            std::max(held_->steps_completed(), job_received_.load()));
      }
    }
    v1::RegisterResponse resp;
    grpc::Status s = stub_->Register(&ctx, req, &resp);
    if (s.ok()) {
      worker_id_ = resp.worker_id();
      if (opts_.metrics) opts_.metrics->SetWorkerId(worker_id_);
      heartbeat_ms_ = resp.heartbeat_interval_ms() > 0 ? resp.heartbeat_interval_ms() : 1000;
      Log(absl::StrCat("registered with ", opts_.coordinator, " (version ", FSDP8_VERSION,
                       ", heartbeat ", heartbeat_ms_, " ms)"));
      return true;
    }
    const grpc::StatusCode c = s.error_code();
    if (c == grpc::StatusCode::FAILED_PRECONDITION || c == grpc::StatusCode::INVALID_ARGUMENT ||
        c == grpc::StatusCode::PERMISSION_DENIED || c == grpc::StatusCode::UNAUTHENTICATED) {
      Log(absl::StrCat("registration refused: ", s.error_message()));
      return false;
    }
    if (opts_.connect_timeout_s > 0 && std::chrono::steady_clock::now() > deadline) {
      Log(absl::StrCat("coordinator ", opts_.coordinator, " did not answer within ",
                       opts_.connect_timeout_s, " s (--connect_timeout_s): ", s.error_message()));
      return false;
    }
    const auto wait = backoff + std::chrono::milliseconds(jitter() % (backoff.count() / 4 + 1));
    // Said at the first failure (within the first call's deadline, 5 s at most) and then every
    // 5 s or so, with what happens next.
    if (attempt++ == 0 || std::chrono::steady_clock::now() - last_log >= std::chrono::seconds(5)) {
      last_log = std::chrono::steady_clock::now();
      const std::string next = absl::StrCat(
          "; retrying in ", absl::StrFormat("%.1f", wait.count() / 1000.0), " s (doubling up to about 5 s",
          opts_.connect_timeout_s > 0
              ? absl::StrCat(", giving up after ", opts_.connect_timeout_s, " s)")
              : std::string(", until it answers)"));
      Log(c == grpc::StatusCode::ALREADY_EXISTS
              ? absl::StrCat("registration refused for now: ", s.error_message(), next)
              : absl::StrCat("cannot reach coordinator ", opts_.coordinator, ": ",
                             s.error_message(), next));
    }
    // Not connected: until the channel is. A refusal for now (ALREADY_EXISTS), or UNAVAILABLE from
    // a coordinator that is connected (shutting down), waits the backoff out.
    const bool until_connected = c == grpc::StatusCode::UNAVAILABLE &&
                                 channel_->GetState(false) != GRPC_CHANNEL_READY;
    for (auto until = std::chrono::steady_clock::now() + wait;
         !shutdown_ && std::chrono::steady_clock::now() < until;) {
      if (!until_connected) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      const grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/true);
      if (state == GRPC_CHANNEL_READY) break;
      channel_->WaitForStateChange(state, std::chrono::system_clock::now() +
                                              std::chrono::milliseconds(50));
    }
    backoff = std::min<std::chrono::milliseconds>(2 * backoff, std::chrono::seconds(5));
  }
  return false;
}

int WorkerDaemon::Run() {
  while (!shutdown_) {
    if (!Register()) return shutdown_ ? 0 : 1;
    std::atomic<bool> stop_hb{false};
    std::thread hb([this, id = worker_id_, ms = heartbeat_ms_, &stop_hb] {
      HeartbeatLoop(id, ms, &stop_hb);
    });
    registered_ = true;
    Serve();
    registered_ = false;
    stop_hb = true;
    hb.join();
    if (!shutdown_) {
      Log("session with the coordinator ended; registering again");
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  Log("shutting down");
  return 0;
}

void WorkerDaemon::HeartbeatLoop(std::string worker_id, int interval_ms, std::atomic<bool>* stop) {
  while (!stop->load() && !shutdown_) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(
                                                            std::max(interval_ms * 3, 2000)));
    v1::HeartbeatRequest req;
    req.set_worker_id(worker_id);
    v1::HeartbeatResponse resp;
    grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      // The coordinator no longer knows us (it restarted): end the session and register again.
      Log("coordinator forgot this worker; re-registering");
      absl::MutexLock l(&ctx_mu_);
      if (session_ctx_) session_ctx_->TryCancel();
      return;
    }
    for (int waited = 0; waited < interval_ms && !stop->load() && !shutdown_; waited += 50) {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, interval_ms)));
    }
  }
}

void WorkerDaemon::Send(const v1::WorkerMessage& m) {
  absl::MutexLock l(&write_mu_);
  if (stream_ == nullptr || !stream_->Write(m)) Log("could not send a message: no session");
}

void WorkerDaemon::Serve() {
  grpc::ClientContext ctx;
  {
    absl::MutexLock l(&ctx_mu_);
    session_ctx_ = &ctx;
    if (shutdown_) ctx.TryCancel();
  }
  auto stream = stub_->Session(&ctx);
  {
    absl::MutexLock l(&write_mu_);
    stream_ = stream.get();
  }
  v1::WorkerMessage hello;
  hello.mutable_hello()->set_worker_id(worker_id_);
  Send(hello);
  v1::CoordinatorMessage msg;
  std::string session_job;  // the job of the newest Assignment on this session
  while (stream->Read(&msg)) {
    switch (msg.kind_case()) {
      case v1::CoordinatorMessage::kAssignment: {
        const v1::Assignment a = msg.assignment();
        Log(absl::StrCat("assigned job ", a.job_id(), " generation ", a.generation(), " rank ",
                         a.rank(), "/", a.world_size()));
        LogEvent("job_assigned", {{"worker", worker_id_},
                                  {"job", a.job_id()},
                                  {"generation", a.generation()},
                                  {"rank", a.rank()},
                                  {"world_size", a.world_size()},
                                  {"load_dir", a.load_dir()}});
        session_job = a.job_id();
        job_received_.store(a.start_step());
        auto cancelled = std::make_shared<std::atomic<bool>>(false);
        {
          // A still-bootstrapping older job would otherwise hold the job thread until its
          // rendezvous timeout and make this one miss its own rendezvous.
          absl::MutexLock l(&comm_mu_);
          if (job_cancelled_) job_cancelled_->store(true);
          job_cancelled_ = cancelled;
        }
        Post([this, a, cancelled] { HandleAssignment(a, cancelled); });
        break;
      }
      case v1::CoordinatorMessage::kStep: {
        const v1::StepCommand c = msg.step();
        last_step_received_.store(std::max(last_step_received_.load(), c.step()));
        job_received_.store(std::max(job_received_.load(), c.step() + std::max<int64_t>(1, c.count())));
        Post([this, c, epoch = step_epoch_.load()] {
          if (epoch != step_epoch_.load()) {
            Log(absl::StrCat("step ", c.step(), " dropped: the job's mesh changed"));
            return;
          }
          HandleStep(c);
        });
        break;
      }
      case v1::CoordinatorMessage::kSave: {
        const v1::SaveCheckpoint c = msg.save();
        // Counted until HandleSave ends: a session that ends with a save in flight does not hold
        // the job (see the session's end below).
        saves_unfinished_.fetch_add(1);
        Post([this, c] { HandleSave(c); });
        break;
      }
      case v1::CoordinatorMessage::kFinish:
        Log("job finished");
        LogEvent("job_finished", {{"worker", worker_id_}, {"job", session_job}});
        Post([this] { DropJob(/*finished=*/true); });
        break;
      case v1::CoordinatorMessage::kAdopt: {
        const v1::Adopt a = msg.adopt();
        session_job = a.job_id();
        Post([this, a] { HandleAdopt(a); });
        break;
      }
      case v1::CoordinatorMessage::kReconfigure: {
        const v1::Reconfigure rc = msg.reconfigure();
        Log(absl::StrCat("reconfigure: job ", rc.job_id(), " continues as generation ",
                         rc.generation(), " rank ", rc.rank(), "/", rc.world_size(),
                         " from step ", rc.step()));
        reconfiguring_.store(true);
        step_epoch_.fetch_add(1);
        // A step blocked on the lost replica returns at once.
        AbortComms(absl::StrCat("the job continues on fewer replicas (generation ",
                                rc.generation(), ")"));
        Post([this, rc] { HandleReconfigure(rc); });
        break;
      }
      case v1::CoordinatorMessage::kAbort: {
        Log(absl::StrCat("abort: ", msg.abort().reason()));
        LogEvent("job_aborted",
                 {{"worker", worker_id_}, {"job", session_job}, {"reason", msg.abort().reason()}});
        if (opts_.metrics) opts_.metrics->OnAbort();
        CancelJob(msg.abort().reason());
        Post([this] { DropJob(); });
        break;
      }
      default:
        break;
    }
  }
  {
    absl::MutexLock l(&write_mu_);
    stream_ = nullptr;
  }
  // A ready job is held for the next coordinator (hold_job_s); one still bootstrapping is
  // cancelled: its rendezvous went with the coordinator.
  // A held job is reported at once (registration does not wait for the steps already received:
  // a peer may need a step's command that only this rank got); those steps run on, their results
  // kept for the report instead of sent.
  // Not held: a job with a save received and not finished (SaveShard is collective, and a rank
  // whose save command never came would not join it; a held job keeps no save to re-send), and a
  // free-running job (its ranks run every remaining step before they could answer Adopt). Both
  // are dropped; the restarted coordinator resumes them from their last committed checkpoint.
  const bool hold = opts_.hold_job_s > 0 && !shutdown_ && job_ready_.load() &&
                    saves_unfinished_.load() == 0 && !job_free_running_.load();
  if (opts_.hold_job_s > 0 && !shutdown_ && job_ready_.load() && !hold) {
    Log(saves_unfinished_.load() > 0
            ? "session ended during a checkpoint save: the job is dropped, not held"
            : "session ended: a free-running job is dropped, not held");
  }
  if (hold) {
    holding_.store(true);
  } else {
    CancelJob("coordinator session ended");
  }
  Post([this, hold] {
    if (hold && job_ && !job_->cancelled->load()) {
      HoldJob();
    } else {
      DropJob();
    }
  });
  grpc::Status s = stream->Finish();
  if (!s.ok() && !shutdown_) Log(absl::StrCat("session ended: ", s.error_message()));
  absl::MutexLock l(&ctx_mu_);
  session_ctx_ = nullptr;
}

void WorkerDaemon::CancelJob(const std::string& reason) {
  stale_steps_.store(true);
  absl::MutexLock l(&comm_mu_);
  if (job_cancelled_) job_cancelled_->store(true);
  for (const auto& c : live_comms_) c->Abort(reason);
}

void WorkerDaemon::AbortComms(const std::string& reason) {
  absl::MutexLock l(&comm_mu_);
  for (const auto& c : live_comms_) c->Abort(reason);
}

void WorkerDaemon::Post(std::function<void()> task) {
  {
    absl::MutexLock l(&q_mu_);
    queue_.push_back(std::move(task));  // the job thread's wait sees it when q_mu_ is released
  }
}

void WorkerDaemon::JobThread() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock l(&q_mu_);
      // Woken at least every 200 ms so that a held job's hold runs out on time.
      q_mu_.AwaitWithTimeout(absl::Condition(this, &WorkerDaemon::TaskOrStopLocked),
                             absl::Milliseconds(200));
      if (q_stop_ && queue_.empty()) break;
      if (!queue_.empty()) {
        task = std::move(queue_.front());
        queue_.pop_front();
      }
    }
    if (task) {
      task();
    } else {
      ExpireHold();
    }
  }
  DropJob();
}

void WorkerDaemon::PublishHeld() {
  v1::HeldJob h;
  h.set_job_id(job_->job_id);
  h.set_generation(job_->generation);
  h.set_rank(job_->rank);
  h.set_world_size(job_->world_size);
  h.set_replicas(job_->mesh.replicas);
  h.set_steps_completed(job_->steps_completed);
  h.set_intact(true);  // a failed step drops the job: a job still here is whole
  for (const v1::StepResult& r : job_->recent) *h.add_recent_results() = r;
  absl::MutexLock l(&held_mu_);
  held_ = std::move(h);
}

void WorkerDaemon::HoldJob() {
  hold_until_ = std::chrono::steady_clock::now() + std::chrono::seconds(opts_.hold_job_s);
  v1::HeldJob h;
  {
    absl::MutexLock l(&held_mu_);
    if (held_) h = *held_;
  }
  Log(absl::StrCat("holding job ", h.job_id(), " generation ", h.generation(), " rank ", h.rank(),
                   "/", h.world_size(), " after ", h.steps_completed(),
                   " steps for the next coordinator (up to ", opts_.hold_job_s,
                   " s, --hold_job_s)"));
  LogEvent("job_held", {{"worker", worker_id_},
                        {"job", h.job_id()},
                        {"generation", h.generation()},
                        {"rank", h.rank()},
                        {"steps_completed", h.steps_completed()},
                        {"hold_s", opts_.hold_job_s}});
}

void WorkerDaemon::ExpireHold() {
  if (failed_until_ && std::chrono::steady_clock::now() >= *failed_until_) {
    Log("no Reconfigure or Abort came for the failed job: dropping it");
    DropJob();
    return;
  }
  if (!hold_until_ || std::chrono::steady_clock::now() < *hold_until_) return;
  if (job_) {
    Log(absl::StrCat("job ", job_->job_id, " generation ", job_->generation,
                     " was not re-adopted within ", opts_.hold_job_s,
                     " s (--hold_job_s): dropping it"));
    LogEvent("job_hold_expired", {{"worker", worker_id_},
                                  {"job", job_->job_id},
                                  {"generation", job_->generation}});
  }
  DropJob();
}

void WorkerDaemon::HandleAdopt(const v1::Adopt& a) {
  const bool match = job_ && hold_until_ && job_->job_id == a.job_id() &&
                     job_->generation == a.generation() && job_->rank == a.rank() &&
                     !job_->cancelled->load();
  v1::WorkerMessage m;
  if (!match) {
    const std::string what =
        absl::StrCat("adopt: this worker does not hold job ", a.job_id(), " generation ",
                     a.generation(), " rank ", a.rank(),
                     job_ ? absl::StrCat(" (it holds job ", job_->job_id, " generation ",
                                         job_->generation, " rank ", job_->rank, ")")
                          : std::string(" (it holds no job)"));
    Log(what);
    m.mutable_error()->set_job_id(a.job_id());
    m.mutable_error()->set_message(what);
    Send(m);
    return;
  }
  hold_until_.reset();
  holding_.store(false);
  stale_steps_.store(false);
  m.mutable_ready()->set_job_id(a.job_id());
  m.mutable_ready()->set_generation(a.generation());
  Send(m);
  Log(absl::StrCat("re-adopted: job ", a.job_id(), " generation ", a.generation(), " rank ",
                   a.rank(), ", continuing after ", job_->steps_completed, " steps"));
  LogEvent("job_readopted", {{"worker", worker_id_},
                             {"job", a.job_id()},
                             {"generation", a.generation()},
                             {"steps_completed", job_->steps_completed}});
}

void WorkerDaemon::DropJob(bool finished) {
  job_ready_.store(false);
  failed_until_.reset();
  holding_.store(false);
  hold_until_.reset();
  {
    absl::MutexLock l(&held_mu_);
    held_.reset();
  }
  {
    absl::MutexLock l(&comm_mu_);
    if (!finished) {
      for (const auto& c : live_comms_) c->Abort("this rank dropped the job");
    }
    live_comms_.clear();
  }
  job_.reset();
}

bool WorkerDaemon::PublishComm(const std::shared_ptr<Communicator>& comm,
                               const std::atomic<bool>& cancelled) {
  // Checked under comm_mu_ so an Abort either sees it in live_comms_ or is seen here.
  absl::MutexLock l(&comm_mu_);
  if (cancelled.load()) {
    comm->Abort("job aborted during bootstrap");
    return false;
  }
  live_comms_.push_back(comm);
  return true;
}

// Hybrid sharding: the shard group (color = replica, key = shard index) and the replica group
// (color = shard index, key = replica) from the world communicator, every rank in the same order.
absl::Status WorkerDaemon::SplitMesh(Job* job) {
  if (job->mesh.Flat()) return absl::OkStatus();
  const int r = job->comm->rank();
  absl::StatusOr<std::unique_ptr<Communicator>> shard =
      job->comm->Split(job->mesh.Replica(r), job->mesh.ShardIndex(r));
  if (!shard.ok()) return shard.status();
  job->shard_comm = std::move(*shard);
  if (!PublishComm(job->shard_comm, *job->cancelled)) return absl::AbortedError("aborted during bootstrap");
  absl::StatusOr<std::unique_ptr<Communicator>> replica =
      job->comm->Split(job->mesh.ShardIndex(r), job->mesh.Replica(r));
  if (!replica.ok()) return replica.status();
  job->replica_comm = std::move(*replica);
  if (!PublishComm(job->replica_comm, *job->cancelled)) return absl::AbortedError("aborted during bootstrap");
  return absl::OkStatus();
}

void WorkerDaemon::HandleAssignment(const v1::Assignment& a,
                                    std::shared_ptr<std::atomic<bool>> cancelled) {
  DropJob();
  stale_steps_.store(false);
  if (cancelled->load()) {
    Log(absl::StrCat("job ", a.job_id(), " generation ", a.generation(),
                     ": aborted before it started"));
    return;
  }
  if (opts_.metrics) opts_.metrics->OnAssignment();
  // code: the failure's status code when it says whether a restart could cure it (WorkerError).
  auto fail = [&](const std::string& what, absl::StatusCode code = absl::StatusCode::kOk) {
    Log(absl::StrCat("job ", a.job_id(), ": ", what));
    LogEvent("job_start_failed", {{"worker", worker_id_},
                                  {"job", a.job_id()},
                                  {"generation", a.generation()},
                                  {"code", absl::StatusCodeToString(code)},
                                  {"cause", what}});
    // The coordinator has already moved on from an aborted job; an error for it could be taken
    // as a failure of the job's next generation.
    if (cancelled->load()) return DropJob();
    if (opts_.metrics) opts_.metrics->OnFailure();
    v1::WorkerMessage m;
    m.mutable_error()->set_job_id(a.job_id());
    m.mutable_error()->set_message(what);
    m.mutable_error()->set_code(static_cast<int32_t>(code));
    Send(m);
    DropJob();
  };
  auto job = std::make_unique<Job>();
  job->job_id = a.job_id();
  job->generation = a.generation();
  job->mesh = MeshOf(a.spec(), a.world_size()).value_or(Mesh{1, std::max(1, a.world_size())});
  job->world_size = a.world_size();
  job->steps_completed = a.load_dir().empty() ? 0 : a.start_step();
  job->cancelled = cancelled;
  const std::string backend = a.spec().backend().empty() ? "cpu" : a.spec().backend();
  std::string err;
  job->backend = CreateBackend(backend, opts_.device, &err, opts_.settings.backend);
  if (!job->backend) return fail(absl::StrCat("backend ", backend, ": ", err));
  job->grpc_kv = std::make_unique<GrpcKvStore>(stub_);
  job->kv = std::make_unique<CancellableKvStore>(job->grpc_kv.get(), cancelled);
  std::string transport;
  auto c = BootstrapWorld(job.get(), backend, a.rank(), a.world_size(), a.store_prefix(),
                          a.collective_timeout_ms(), a.bootstrap_timeout_ms(), &transport);
  if (!c.ok()) return fail(std::string(c.status().message()));
  job->comm = std::move(*c);
  if (!transport.empty())
    Log(absl::StrCat("job ", a.job_id(), " generation ", a.generation(),
                     ": collectives over ", transport));
  if (!PublishComm(job->comm, *cancelled)) return fail("aborted during bootstrap");
  if (absl::Status s = SplitMesh(job.get()); !s.ok()) return fail(std::string(s.message()));
  job->rank = a.rank();
  const MeshComms mesh_comms{job->shard_comm.get(), job->replica_comm.get()};
  auto t = CatchAllocationFailure("building the model", [&] {
    return Trainer::Create(a.spec(), a.rank(), a.world_size(), job->backend.get(),
                           job->comm.get(), mesh_comms, opts_.settings.trainer);
  });
  if (!t.ok()) return fail(t.status().ToString(), t.status().code());
  job->trainer = std::move(*t);
  job_free_running_.store(a.spec().training().free_running());
  if (!a.load_dir().empty()) {
    // Collective (the FP8 re-cast): every rank of the generation loads the same checkpoint.
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = opts_.settings.faults.CheckpointReadError(a.load_dir());
    if (s.ok()) {
      s = CatchAllocationFailure("loading the checkpoint", [&] {
        return LoadShards(job->trainer.get(), a.load_dir(), a.load_world_size(), a.start_step());
      });
    }
    if (!s.ok()) return fail(absl::StrCat("loading checkpoint: ", s.ToString()), s.code());
    Log(absl::StrCat("loaded checkpoint ", a.load_dir(), " (", a.load_world_size(),
                     " ranks) in ",
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                     " s, starting at step ", a.start_step()));
  } else if (!a.init_dir().empty()) {
    // Another job's checkpoint, read only; collective like the load above.
    const v1::InitSpec& init = a.spec().init();
    absl::Status s = opts_.settings.faults.CheckpointReadError(a.init_dir());
    if (s.ok())
      s = LoadInitialShards(job->trainer.get(), a.init_dir(), a.init_world_size(),
                            init.load_optimizer_state(), init.load_fp8_state());
    if (!s.ok()) return fail(absl::StrCat("loading init.from_checkpoint: ", s.ToString()));
    Log(absl::StrCat("initialised from checkpoint ", a.init_dir(), " (", a.init_world_size(),
                     " ranks)"));
  } else if (!a.spec().init().from_hf().empty()) {
    // Collective too; a job resumed from a checkpoint never re-reads its initial weights.
    absl::Status s = CatchAllocationFailure("loading the initial weights", [&] {
      return LoadHfWeights(job->trainer.get(), a.spec().init().from_hf());
    });
    if (!s.ok()) return fail(absl::StrCat("loading initial weights: ", s.ToString()), s.code());
    Log(absl::StrCat("loaded initial weights from ", a.spec().init().from_hf()));
  }
  job_ = std::move(job);
  PublishHeld();
  job_ready_.store(true);
  v1::WorkerMessage m;
  m.mutable_ready()->set_job_id(a.job_id());
  m.mutable_ready()->set_generation(a.generation());
  Send(m);
  Log(absl::StrCat("ready for job ", a.job_id()));
  LogEvent("job_ready", {{"worker", worker_id_}, {"job", a.job_id()}, {"generation", a.generation()}});
}

absl::StatusOr<std::shared_ptr<Communicator>> WorkerDaemon::BootstrapWorld(
    Job* job, const std::string& backend, int rank, int world_size, const std::string& prefix,
    int collective_timeout_ms, int bootstrap_timeout_ms, std::string* transport) {
  const std::chrono::milliseconds timeout(collective_timeout_ms > 0 ? collective_timeout_ms
                                                                    : 60000);
  if (backend == "cuda") {
#ifdef FSDP8_WITH_CUDA
    auto c = CreateNcclCommunicator(rank, world_size, job->kv.get(), prefix, job->backend.get(),
                                    timeout, std::chrono::milliseconds(bootstrap_timeout_ms),
                                    opts_.settings.nccl);
    if (!c.ok()) return c.status();
    return std::shared_ptr<Communicator>(std::move(*c));
#else
    return absl::FailedPreconditionError("backend cuda: this worker was built without CUDA");
#endif
  }
  // Workers advertising different --host addresses are different hosts, also on one machine
  // (simulated hosts): shared memory only between ranks of the same machine and address.
  CpuCommOptions cpu = opts_.settings.cpu_comm;
  if (cpu.machine.empty()) {
    cpu.machine = absl::StrCat(SharedMemoryCommunicator::MachineIdentity(), "@", opts_.host);
  }
  auto c = CreateCpuCommunicator(rank, world_size, job->kv.get(), prefix, opts_.host, timeout,
                                 std::chrono::milliseconds(bootstrap_timeout_ms), cpu, transport);
  if (!c.ok()) return c.status();
  return std::shared_ptr<Communicator>(std::move(*c));
}

void WorkerDaemon::HandleReconfigure(const v1::Reconfigure& rc) {
  const auto t0 = std::chrono::steady_clock::now();
  struct Done {
    std::atomic<bool>* flag;
    ~Done() { flag->store(false); }
  } done{&reconfiguring_};
  auto fail = [&](const absl::Status& s) {
    const std::string what = absl::StrCat("reconfigure to generation ", rc.generation(), ": ",
                                          s.message());
    Log(what);
    LogEvent("reconfigure_failed", {{"worker", worker_id_},
                                    {"job", rc.job_id()},
                                    {"generation", rc.generation()},
                                    {"code", absl::StatusCodeToString(s.code())},
                                    {"cause", what}});
    v1::WorkerMessage m;
    m.mutable_error()->set_job_id(rc.job_id());
    m.mutable_error()->set_message(what);
    m.mutable_error()->set_code(static_cast<int32_t>(s.code()));
    m.mutable_error()->set_generation(rc.generation());
    Send(m);
    DropJob();
  };
  if (!job_ || job_->job_id != rc.job_id() || job_->cancelled->load())
    return fail(absl::AbortedError("this worker does not hold the job"));
  Job* job = job_.get();
  // The old communicators (aborted by the reader) stay alive until the trainer has let go of them.
  std::vector<std::shared_ptr<Communicator>> old = {job->comm, job->shard_comm, job->replica_comm};
  {
    absl::MutexLock l(&comm_mu_);
    live_comms_.clear();
  }
  job->shard_comm.reset();
  job->replica_comm.reset();
  const std::string backend = rc.spec().backend().empty() ? "cpu" : rc.spec().backend();
  std::string transport;
  auto c = BootstrapWorld(job, backend, rc.rank(), rc.world_size(), rc.store_prefix(),
                          rc.collective_timeout_ms(), rc.bootstrap_timeout_ms(), &transport);
  if (!c.ok()) return fail(c.status());
  job->comm = std::move(*c);
  if (!PublishComm(job->comm, *job->cancelled)) return fail(absl::AbortedError("job aborted"));
  absl::StatusOr<Mesh> mesh = MeshOf(rc.spec(), rc.world_size());
  if (!mesh.ok()) return fail(mesh.status());
  job->mesh = *mesh;
  if (absl::Status s = SplitMesh(job); !s.ok()) return fail(s);
  const MeshComms mesh_comms{job->shard_comm.get(), job->replica_comm.get()};
  absl::Status s = job->trainer->Rebind(rc.spec(), rc.rank(), rc.world_size(), job->comm.get(),
                                        mesh_comms, rc.step());
  // A refused Rebind left the trainer on the old communicators: they outlive DropJob (in fail).
  if (!s.ok()) return fail(s);
  old.clear();
  job->generation = rc.generation();
  job->rank = rc.rank();
  job->world_size = rc.world_size();
  job->failed = false;
  job->reported = job->trainer->Bytes();
  failed_until_.reset();
  stale_steps_.store(false);
  PublishHeld();
  job_ready_.store(true);
  v1::WorkerMessage m;
  m.mutable_ready()->set_job_id(rc.job_id());
  m.mutable_ready()->set_generation(rc.generation());
  Send(m);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Log(absl::StrCat("continuing job ", rc.job_id(), " as rank ", rc.rank(), "/", rc.world_size(),
                   " (", job->mesh.replicas, " replica", job->mesh.replicas == 1 ? "" : "s",
                   ", generation ", rc.generation(), ") from step ", rc.step(),
                   " without a checkpoint read, in ", secs, " s",
                   transport.empty() ? "" : absl::StrCat("; collectives over ", transport)));
  LogEvent("job_reconfigured", {{"worker", worker_id_},
                                {"job", rc.job_id()},
                                {"generation", rc.generation()},
                                {"rank", rc.rank()},
                                {"world_size", rc.world_size()},
                                {"step", rc.step()},
                                {"seconds", secs}});
}

void WorkerDaemon::HandleStep(const v1::StepCommand& cmd) {
  // count > 1 (free-running benchmark mode): the following steps run back to back.
  const int64_t count = std::max<int64_t>(1, cmd.count());
  for (int64_t i = 0; i < count; ++i) {
    v1::StepCommand c = cmd;
    c.set_step(cmd.step() + i);
    if (!RunStep(c)) return;
  }
}

bool WorkerDaemon::RunStep(const v1::StepCommand& c) {
  if (!job_ && stale_steps_.load()) {
    Log(absl::StrCat("step ", c.step(), " of an aborted job dropped"));
    return false;
  }
  if (!job_) {
    v1::WorkerMessage m;
    m.mutable_error()->set_message(absl::StrCat("step ", c.step(), ": no job assigned"));
    Send(m);
    return false;
  }
  if (job_->failed) {
    Log(absl::StrCat("step ", c.step(), " of job ", job_->job_id,
                     " not run: an earlier step failed (waiting for the coordinator)"));
    return false;
  }
  if (job_->cancelled->load()) {
    // A step queued behind the one that was aborted (the coordinator sends a step ahead).
    Log(absl::StrCat("step ", c.step(), " of aborted job ", job_->job_id, " not run"));
    DropJob();
    return false;
  }
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<StepStats> r = CatchAllocationFailure(absl::StrCat("in step ", c.step()), [&] {
    return job_->trainer->Step(c.step(), c.evaluate(), c.report_scaling());
  });
  if (r.ok()) {
    if (absl::Status fault = opts_.settings.faults.StepError(job_->rank, c.step()); !fault.ok()) {
      // An injected step error (common/fault_injection.h) is reported once the next step's
      // command has arrived (the coordinator sends one step ahead; at most 5 s), so that the drop
      // of a queued step is what a drill sees every time.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (last_step_received_.load() <= c.step() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      r = fault;
    }
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (job_->cancelled->load()) {
    Log(absl::StrCat("step ", c.step(), " of aborted job ", job_->job_id, " not reported",
                     r.ok() ? "" : absl::StrCat(": ", r.status().message())));
    DropJob();
    return false;
  }
  v1::WorkerMessage m;
  if (!r.ok()) {
    if (opts_.metrics) opts_.metrics->OnFailure();
    m.mutable_error()->set_job_id(job_->job_id);
    m.mutable_error()->set_message(absl::StrCat("step ", c.step(), ": ", r.status().ToString()));
    m.mutable_error()->set_code(static_cast<int32_t>(r.status().code()));
    m.mutable_error()->set_generation(job_->generation);
    Log(m.error().message());
    LogEvent("step_failed", {{"worker", worker_id_},
                             {"job", job_->job_id},
                             {"step", c.step()},
                             {"code", absl::StatusCodeToString(r.status().code())},
                             {"cause", std::string(r.status().message())}});
    if (job_->mesh.replicas > 1 && !job_->mesh.optimizer_over_world &&
        !job_free_running_.load()) {
      // A hybrid SHARD_GROUP job (driven step by step) may continue on fewer replicas: its state
      // is kept until the coordinator says (Reconfigure, or Abort: the coordinator sends it to a
      // failed rank of such a job too); collectives still queued end at once.
      job_->failed = true;
      job_ready_.store(false);  // not held through a coordinator restart: it is not intact
      failed_until_ = std::chrono::steady_clock::now() +
                      std::chrono::seconds(std::max(opts_.hold_job_s, 30));
      AbortComms("a step of this rank failed");
      if (!reconfiguring_.load()) Send(m);
      return false;
    }
    // The coordinator fails this generation and sends this rank no Abort: a step it had already
    // sent ahead must not answer "no job assigned" into the next job's run.
    stale_steps_.store(true);
    Send(m);
    DropJob();
    return false;
  }
  v1::StepResult result = ToStepResult(*r);
  result.set_job_id(job_->job_id);
  result.set_generation(job_->generation);
  job_->steps_completed = c.step() + 1;
  job_->recent.push_back(result);
  job_->recent.back().clear_scaling();  // the report stays small
  while (job_->recent.size() > kRecentResults) job_->recent.pop_front();
  PublishHeld();
  if (holding_.load()) {
    // Run while the job is held (sent before the coordinator went away): its result is in the
    // held job's report; the coordinator that re-adopts the job goes on after it.
    Log(absl::StrCat("step ", c.step(), " of held job ", job_->job_id, " done; result kept"));
    return true;
  }
  if (result.skipped()) {
    Log(absl::StrCat("step ", c.step(), ": loss ",
                     result.loss_sum() / std::max<int64_t>(1, result.tokens()), " (this rank's), ",
                     "gradient norm ", result.grad_norm(), ": not finite, update skipped"));
  } else if (c.step() % 50 == 0 || c.evaluate()) {
    Log(absl::StrCat("step ", c.step(), ": loss ",
                     result.loss_sum() / std::max<int64_t>(1, result.tokens()), " compute ",
                     result.compute_seconds(), " s, comm ", result.comm_seconds(),
                     " s, optimizer ", result.optimizer_seconds(), " s",
                     c.evaluate() ? absl::StrCat(", val ", result.val_loss()) : ""));
  }
  if (result.has_scaling()) result.mutable_scaling()->set_job_id(job_->job_id);
  if (opts_.metrics) {
    const CommBytes now = job_->trainer->Bytes();  // every communicator of the job
    CommBytes delta;
    delta.all_gather = now.all_gather - job_->reported.all_gather;
    delta.reduce_scatter = now.reduce_scatter - job_->reported.reduce_scatter;
    delta.all_reduce = now.all_reduce - job_->reported.all_reduce;
    opts_.metrics->OnStep(job_->job_id, job_->rank, result, wall, delta,
                          result.has_scaling() ? result.scaling()
                                               : job_->trainer->CurrentScalingReport());
    job_->reported = now;
  }
  *m.mutable_result() = std::move(result);
  Send(m);
  return true;
}

void WorkerDaemon::SendSaveReply(const v1::WorkerMessage& m) {
  // The session may have ended during SaveShard (the job was then cancelled, and the next session
  // may already be up): the reply belongs to the old one.
  if (job_->cancelled->load() || holding_.load()) {
    Log(absl::StrCat("checkpoint reply of job ", job_->job_id,
                     " not sent: the job was aborted or its session ended"));
    return;
  }
  Send(m);
}

void WorkerDaemon::HandleSave(const v1::SaveCheckpoint& c) {
  struct Finished {
    std::atomic<int>* n;
    ~Finished() { n->fetch_sub(1); }
  } finished{&saves_unfinished_};
  if (auto slow = opts_.settings.slow_save_ms.find(c.step());
      slow != opts_.settings.slow_save_ms.end()) {
    Log(absl::StrCat("save at step ", c.step(), ": waiting ", slow->second,
                     " ms first (FSDP8_FAULT_SLOW_SAVE)"));
    std::this_thread::sleep_for(std::chrono::milliseconds(slow->second));
  }
  v1::WorkerMessage m;
  if (job_ && (job_->cancelled->load() || holding_.load())) {
    // The session that sent it ended (a job with a save in flight is not held: it is dropped
    // next) or the job was aborted: nothing is written or reported for it.
    Log(absl::StrCat("save at step ", c.step(), " of job ", job_->job_id,
                     " not run: the job was aborted or its session ended"));
    return;
  }
  if (!job_ && stale_steps_.load()) {
    Log(absl::StrCat("save at step ", c.step(), " of an aborted job dropped"));
    return;
  }
  if (!job_) {
    m.mutable_error()->set_message(absl::StrCat("save at step ", c.step(), ": no job assigned"));
    Send(m);
    return;
  }
  // Hybrid sharding: a rank whose role writes no file (a replica other than 0 under
  // SHARD_GROUP) still goes through SaveShard, which checks the step and answers with no file.
  const CheckpointRole role = CheckpointRoleOf(job_->mesh, job_->trainer->rank());
  v1::CheckpointSaved saved;
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = role.writes ? opts_.settings.faults.CheckpointWriteError(absl::StrCat(
                                     c.dir(), "/", CheckpointFileName(role.file_index)))
                               : absl::OkStatus();
  if (s.ok()) {
    s = CatchAllocationFailure("saving the checkpoint", [&] {
      return SaveShard(*job_->trainer, c.step(), c.dir(), &saved, &opts_.settings.faults);
    });
  }
  if (!s.ok()) {
    // The job stays usable: a failed save leaves the training state untouched. The coordinator
    // drops this save and tries again at the next interval.
    saved.Clear();
    saved.set_job_id(job_->job_id);
    saved.set_step(c.step());
    saved.set_rank(job_->trainer->rank());
    saved.set_error(std::string(s.message()));
    Log(absl::StrCat("checkpoint at step ", c.step(), " failed: ", s.ToString()));
    *m.mutable_saved() = std::move(saved);
    SendSaveReply(m);
    return;
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  saved.set_job_id(job_->job_id);
  if (!role.writes) {  // nothing written: replica 0 holds the same state
    *m.mutable_saved() = std::move(saved);
    SendSaveReply(m);
    return;
  }
  LogEvent("checkpoint_saved", {{"worker", worker_id_},
                                {"job", job_->job_id},
                                {"step", c.step()},
                                {"file", absl::StrCat(c.dir(), "/", saved.file())},
                                {"bytes", saved.bytes()},
                                {"seconds", secs}});
  Log(absl::StrCat("saved ", c.dir(), "/", saved.file(), " (", saved.bytes(), " bytes in ", secs,
                   " s)"));
  *m.mutable_saved() = std::move(saved);
  SendSaveReply(m);
}

}  // namespace fsdp8
