#include "coordinator/services.h"

#include <condition_variable>
#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/shard_plan.h"
#include "common/spec.h"
#include "coordinator/checkpoint_store.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"

namespace fsdp8::coord {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// ---------------- JobService ----------------

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest* req,
                                       v1::Job* resp) {
  auto job = jobs_->Submit(req->request_id(), req->spec());
  if (!job.ok()) return ToGrpc(job.status());
  *resp = *job;
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext*, const v1::GetJobRequest* req,
                                    v1::Job* resp) {
  auto job = jobs_->Get(req->job_id());
  if (!job.ok()) return ToGrpc(job.status());
  *resp = *job;
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                                      v1::ListJobsResponse* resp) {
  for (auto& j : jobs_->List()) *resp->add_jobs() = std::move(j);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                                      grpc::ServerWriter<v1::JobEvent>* writer) {
  bool write_failed = false;
  absl::Status s = jobs_->Watch(
      req->job_id(), req->after_seq(),
      [&](const v1::JobEvent& ev) {
        if (!writer->Write(ev)) {
          write_failed = true;
          return false;
        }
        return true;
      },
      [ctx] { return ctx->IsCancelled(); });
  if (write_failed) return grpc::Status(grpc::StatusCode::CANCELLED, "watcher went away");
  return ToGrpc(s);
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext*, const v1::CancelJobRequest* req,
                                       v1::Job* resp) {
  auto job = jobs_->Cancel(req->job_id());
  if (!job.ok()) return ToGrpc(job.status());
  *resp = *job;
  return grpc::Status::OK;
}

// ---------------- AdminService ----------------

grpc::Status AdminServiceImpl::ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                                           v1::ListWorkersResponse* resp) {
  for (auto& w : workers_->List()) *resp->add_workers() = std::move(w);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::GetShardPlan(grpc::ServerContext*,
                                            const v1::GetShardPlanRequest* req,
                                            v1::ShardPlan* resp) {
  v1::JobSpec spec;
  int world_size = req->world_size();
  if (!req->job_id().empty()) {
    auto job = jobs_->Get(req->job_id());
    if (!job.ok()) return ToGrpc(job.status());
    spec = job->spec();
    if (job->world_size() > 0) world_size = job->world_size();
    else if (world_size <= 0) world_size = Scheduler::MinWorldSize(spec);
  } else {
    if (!req->has_spec())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "job_id or spec: one of them must be given");
    if (world_size < 1)
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("world_size: must be >= 1 (got ", world_size, ")"));
    spec = req->spec();
  }
  v1::JobSpec d = WithDefaults(spec, world_size);
  if (req->job_id().empty()) {
    absl::Status s = ValidateSpec(d, world_size, {}, /*check_files=*/false);
    if (!s.ok()) return ToGrpc(s);
  }
  auto plan = MakeShardPlan(d, world_size);
  if (!plan.ok()) return ToGrpc(plan.status());
  *resp = ToProto(*plan);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::GetScalingState(grpc::ServerContext*,
                                               const v1::GetScalingStateRequest* req,
                                               v1::ScalingState* resp) {
  auto st = jobs_->GetScalingState(req->job_id());
  if (!st.ok()) return ToGrpc(st.status());
  *resp = *st;
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::TriggerCheckpoint(grpc::ServerContext*,
                                                 const v1::TriggerCheckpointRequest* req,
                                                 v1::TriggerCheckpointResponse* resp) {
  auto step = jobs_->RequestCheckpoint(req->job_id());
  if (!step.ok()) return ToGrpc(step.status());
  resp->set_step(*step);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::ListCheckpoints(grpc::ServerContext*,
                                               const v1::ListCheckpointsRequest* req,
                                               v1::ListCheckpointsResponse* resp) {
  auto job = jobs_->Get(req->job_id());
  if (!job.ok()) return ToGrpc(job.status());
  const std::string& dir = job->spec().checkpoint().dir();
  if (dir.empty()) return grpc::Status::OK;
  auto list = CheckpointStore(dir).List();
  if (!list.ok()) return ToGrpc(list.status());
  for (const CommittedCheckpoint& c : *list) {
    v1::CheckpointInfo* info = resp->add_checkpoints();
    info->set_step(c.step);
    info->set_dir(c.dir);
    info->set_world_size(c.manifest.world_size());
    info->set_bytes(c.bytes());
    info->set_time(c.manifest.time());
  }
  return grpc::Status::OK;
}

// ---------------- WorkerControl ----------------

grpc::Status WorkerControlImpl::Register(grpc::ServerContext*, const v1::RegisterRequest* req,
                                         v1::RegisterResponse* resp) {
  auto r = workers_->Register(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = *r;
  return grpc::Status::OK;
}

grpc::Status WorkerControlImpl::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                                          v1::HeartbeatResponse*) {
  return ToGrpc(workers_->Heartbeat(req->worker_id()));
}

grpc::Status WorkerControlImpl::KvSet(grpc::ServerContext*, const v1::KvSetRequest* req,
                                      v1::KvSetResponse*) {
  return ToGrpc(kv_->Set(req->key(), req->value()));
}

grpc::Status WorkerControlImpl::KvGet(grpc::ServerContext* ctx, const v1::KvGetRequest* req,
                                      v1::KvGetResponse* resp) {
  // Never wait past the caller's own deadline, nor over 10 minutes.
  int64_t ms = std::min<int64_t>(req->timeout_ms(), 600000);
  auto dl = ctx->deadline();
  auto now = std::chrono::system_clock::now();
  if (dl > now && dl - now < std::chrono::milliseconds(ms))
    ms = std::chrono::duration_cast<std::chrono::milliseconds>(dl - now).count();
  // A sync handler holds a server thread for the whole wait, so stop as soon as the client gives
  // up (cancel, disconnect) instead of sitting out a timeout of up to minutes.
  auto v = kv_->Get(req->key(), std::chrono::milliseconds(std::max<int64_t>(ms, 0)),
                    [ctx] { return ctx->IsCancelled(); });
  if (!v.ok()) return ToGrpc(v.status());
  resp->set_value(*v);
  return grpc::Status::OK;
}

namespace {

// The outbound half of one Session stream: a queue drained by a writer thread.
class GrpcSessionSink : public SessionSink {
 public:
  explicit GrpcSessionSink(grpc::ServerContext* ctx) : ctx_(ctx) {}
  bool Send(const v1::CoordinatorMessage& msg) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    q_.push_back(msg);
    cv_.notify_all();
    return true;
  }
  void Close() override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
    if (ctx_) ctx_->TryCancel();  // ctx_ is cleared before the handler returns
  }
  // Ends the writer (the handler is returning).
  void Stop() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    stopped_ = true;
    ctx_ = nullptr;
    cv_.notify_all();
  }
  void WriteLoop(grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) {
    for (;;) {
      v1::CoordinatorMessage m;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !q_.empty() || closed_; });
        if (q_.empty() || stopped_) return;
        m = std::move(q_.front());
        q_.pop_front();
      }
      if (!stream->Write(m)) {
        std::lock_guard<std::mutex> lock(mu_);
        closed_ = true;
        return;
      }
    }
  }

 private:
  grpc::ServerContext* ctx_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::CoordinatorMessage> q_;
  bool closed_ = false;
  bool stopped_ = false;
};

}  // namespace

grpc::Status WorkerControlImpl::Session(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) {
  v1::WorkerMessage first;
  if (!stream->Read(&first))
    return grpc::Status(grpc::StatusCode::CANCELLED, "session ended before Hello");
  if (!first.has_hello())
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the first Session message must be Hello{worker_id}");
  const std::string id = first.hello().worker_id();
  auto sink = std::make_shared<GrpcSessionSink>(ctx);
  auto token = workers_->AttachSession(id, sink);
  if (!token.ok()) return ToGrpc(token.status());
  std::thread writer([&] { sink->WriteLoop(stream); });
  v1::WorkerMessage m;
  while (stream->Read(&m)) workers_->OnMessage(id, *token, m);
  workers_->DetachSession(id, *token,
                          ctx->IsCancelled() ? "session stream broken (worker gone or unreachable)"
                                             : "session stream closed by the worker");
  sink->Stop();
  writer.join();
  return grpc::Status::OK;
}

// ---------------- CoordinatorServer ----------------

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    CoordinatorOptions options) {
  if (options.workers.version.empty()) options.workers.version = FSDP8_VERSION;
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer());
  auto jobs = JobManager::Open(options.jobs);
  if (!jobs.ok()) return jobs.status();
  s->jobs_ = std::move(*jobs);
  s->workers_ = std::make_unique<WorkerRegistry>(options.workers);
  s->kv_ = std::make_unique<KvServer>();
  s->scheduler_ = std::make_unique<Scheduler>(s->jobs_.get(), s->workers_.get(), s->kv_.get(),
                                              options.scheduler);
  s->job_service_ = std::make_unique<JobServiceImpl>(s->jobs_.get());
  s->admin_service_ = std::make_unique<AdminServiceImpl>(s->jobs_.get(), s->workers_.get());
  s->worker_service_ = std::make_unique<WorkerControlImpl>(s->workers_.get(), s->kv_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &port);
  b.SetMaxReceiveMessageSize(64 << 20);
  b.SetMaxSendMessageSize(64 << 20);
  b.RegisterService(s->job_service_.get());
  b.RegisterService(s->admin_service_.get());
  b.RegisterService(s->worker_service_.get());
  s->server_ = b.BuildAndStart();
  if (!s->server_ || port == 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  s->port_ = port;
  std::string host = options.listen;
  size_t colon = host.rfind(':');
  if (colon != std::string::npos) host = host.substr(0, colon);
  s->address_ = absl::StrCat(host, ":", port);
  s->scheduler_->Start();
  return s;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

void CoordinatorServer::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (scheduler_) scheduler_->Stop();
  if (jobs_) jobs_->Shutdown();
  if (kv_) kv_->Shutdown();
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
  }
}

}  // namespace fsdp8::coord
