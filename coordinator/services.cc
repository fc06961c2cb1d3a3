#include "coordinator/services.h"

#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/memory_plan.h"
#include "common/mesh.h"
#include "coordinator/memory_fit.h"
#include "common/shard_plan.h"
#include "common/spec.h"
#include "common/http_server.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/log.h"
#include "coordinator/status_page.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"

namespace fsdp8::coord {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

namespace {

// Authenticates and authorizes one call; logs refusals (warning) and calls (debug).
absl::StatusOr<Principal> Authorize(const Authorizer* auth, grpc::ServerContext* ctx,
                                    std::initializer_list<Role> allowed, const char* what) {
  auto p = auth->Check(ctx->client_metadata(), allowed, what);
  if (!p.ok()) {
    Log(LogLevel::kWarning, absl::StrCat("refused ", what, " from ", ctx->peer(), ": ",
                                         p.status().ToString()));
    return p.status();
  }
  if (LogEnabled(LogLevel::kDebug))
    Log(LogLevel::kDebug, absl::StrCat(what, " by ", p->user.empty() ? "(anonymous)" : p->user,
                                       " (", RoleName(p->role), ") from ", ctx->peer()));
  return p;
}

}  // namespace

// ---------------- JobService ----------------

absl::StatusOr<v1::Job> JobServiceImpl::Visible(const Principal& p,
                                                const std::string& job_id) const {
  auto job = jobs_->Get(job_id);
  if (!job.ok()) return job.status();
  if (!MayAccessJob(p, job->owner()))
    return absl::PermissionDeniedError(
        absl::StrCat("job '", job_id, "' belongs to another user (", p.user, " is a submitter)"));
  return job;
}

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                                       v1::Job* resp) {
  auto p = Authorize(auth_, ctx, {Role::kSubmitter, Role::kAdmin}, "JobService/SubmitJob");
  if (!p.ok()) return ToGrpc(p.status());
  if (draining_ && draining_->load()) {
    LogEvent("job_refused", {{"owner", p->user},
                             {"name", req->spec().name().substr(0, kMaxNameBytes)},
                             {"code", "UNAVAILABLE"},
                             {"field", ""},
                             {"rule", "coordinator is draining (shutting down)"}});
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator is draining (shutting down)");
  }
  auto job = jobs_->Submit(req->request_id(), req->spec(), p->user);
  if (!job.ok()) return ToGrpc(job.status());
  *resp = *job;
  return grpc::Status::OK;
}

namespace {
void AddEvents(JobManager* jobs, int32_t n, v1::Job* job) {
  if (n <= 0) return;
  auto evs = jobs->RecentEvents(job->job_id(), static_cast<size_t>(n));
  if (!evs.ok()) return;
  for (auto& e : *evs) *job->add_events() = std::move(e);
}
}  // namespace

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext* ctx, const v1::GetJobRequest* req,
                                    v1::Job* resp) {
  auto p = Authorize(auth_, ctx, {Role::kSubmitter, Role::kAdmin}, "JobService/GetJob");
  if (!p.ok()) return ToGrpc(p.status());
  auto job = Visible(*p, req->job_id());
  if (!job.ok()) return ToGrpc(job.status());
  *resp = *job;
  AddEvents(jobs_, req->events(), resp);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req,
                                      v1::ListJobsResponse* resp) {
  auto p = Authorize(auth_, ctx, {Role::kSubmitter, Role::kAdmin}, "JobService/ListJobs");
  if (!p.ok()) return ToGrpc(p.status());
  std::optional<std::string> owner;
  if (p->role != Role::kAdmin) owner = p->user;
  auto page = jobs_->ListPage(owner, req->page_size(), req->page_token(), req->events(),
                              page_bytes_);
  if (!page.ok()) return ToGrpc(page.status());
  for (v1::Job& j : page->jobs) *resp->add_jobs() = std::move(j);
  resp->set_next_page_token(page->next_page_token);
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* req,
                                       v1::Job* resp) {
  auto p = Authorize(auth_, ctx, {Role::kSubmitter, Role::kAdmin}, "JobService/DeleteJob");
  if (!p.ok()) return ToGrpc(p.status());
  auto seen = Visible(*p, req->job_id());
  if (!seen.ok()) return ToGrpc(seen.status());
  if (absl::Status s = jobs_->Delete(req->job_id()); !s.ok()) return ToGrpc(s);
  *resp = *seen;
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::WatchJob(grpc::ServerContext* ctx, const v1::WatchJobRequest* req,
                                      grpc::ServerWriter<v1::JobEvent>* writer) {
  auto p = Authorize(auth_, ctx, {Role::kSubmitter, Role::kAdmin}, "JobService/WatchJob");
  if (!p.ok()) return ToGrpc(p.status());
  if (auto job = Visible(*p, req->job_id()); !job.ok()) return ToGrpc(job.status());
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

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* ctx, const v1::CancelJobRequest* req,
                                       v1::Job* resp) {
  auto p = Authorize(auth_, ctx, {Role::kSubmitter, Role::kAdmin}, "JobService/CancelJob");
  if (!p.ok()) return ToGrpc(p.status());
  if (auto seen = Visible(*p, req->job_id()); !seen.ok()) return ToGrpc(seen.status());
  auto job = jobs_->Cancel(req->job_id(), /*save=*/!req->no_save(),
                          [ctx] { return ctx->IsCancelled(); });
  if (!job.ok()) return ToGrpc(job.status());
  *resp = *job;
  return grpc::Status::OK;
}

grpc::Status JobServiceImpl::ResumeJob(grpc::ServerContext* ctx, const v1::ResumeJobRequest* req,
                                       v1::Job* resp) {
  auto p = Authorize(auth_, ctx, {Role::kSubmitter, Role::kAdmin}, "JobService/ResumeJob");
  if (!p.ok()) return ToGrpc(p.status());
  if (auto seen = Visible(*p, req->job_id()); !seen.ok()) return ToGrpc(seen.status());
  if (draining_ && draining_->load())
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator is draining (shutting down)");
  auto job = jobs_->Resume(req->job_id());
  if (!job.ok()) return ToGrpc(job.status());
  *resp = *job;
  return grpc::Status::OK;
}

// ---------------- AdminService ----------------

grpc::Status AdminServiceImpl::Admin(grpc::ServerContext* ctx, const char* what) const {
  return ToGrpc(Authorize(auth_, ctx, {Role::kAdmin}, what).status());
}

grpc::Status AdminServiceImpl::ListWorkers(grpc::ServerContext* ctx, const v1::ListWorkersRequest*,
                                           v1::ListWorkersResponse* resp) {
  if (grpc::Status a = Admin(ctx, "AdminService/ListWorkers"); !a.ok()) return a;
  for (auto& w : workers_->List()) *resp->add_workers() = std::move(w);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::DrainWorker(grpc::ServerContext* ctx,
                                           const v1::DrainWorkerRequest* req,
                                           v1::WorkerInfo* resp) {
  if (grpc::Status a = Admin(ctx, "AdminService/DrainWorker"); !a.ok()) return a;
  auto w = workers_->Drain(req->worker_id(), req->undo());
  if (!w.ok()) return ToGrpc(w.status());
  Log(LogLevel::kInfo, absl::StrCat("worker ", req->worker_id(), req->undo() ? " undrained" : " drained"));
  *resp = *w;
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::SetLogLevel(grpc::ServerContext* ctx,
                                           const v1::SetLogLevelRequest* req,
                                           v1::SetLogLevelResponse* resp) {
  if (grpc::Status a = Admin(ctx, "AdminService/SetLogLevel"); !a.ok()) return a;
  auto level = ParseLogLevel(req->level());
  if (!level.ok()) return ToGrpc(level.status());
  resp->set_previous(LogLevelName(GetLogLevel()));
  coord::SetLogLevel(*level);
  resp->set_level(LogLevelName(*level));
  Log(LogLevel::kInfo, absl::StrCat("log level ", resp->previous(), " -> ", resp->level()));
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::GetShardPlan(grpc::ServerContext* ctx,
                                            const v1::GetShardPlanRequest* req,
                                            v1::ShardPlan* resp) {
  if (grpc::Status a = Admin(ctx, "AdminService/GetShardPlan"); !a.ok()) return a;
  int world_size = req->world_size();
  int replicas = req->replicas();  // for a spec whose sharding.replicas is auto
  std::shared_ptr<ResolvedJob> resolved;
  if (!req->job_id().empty()) {
    auto job = jobs_->Get(req->job_id());
    if (!job.ok()) return ToGrpc(job.status());
    resolved = jobs_->Resolved(req->job_id());
    if (resolved == nullptr) return ToGrpc(absl::NotFoundError(req->job_id()));  // deleted meanwhile
    if (job->world_size() > 0) {
      world_size = job->world_size();
      replicas = job->replicas();  // the mesh it runs on
    } else if (world_size <= 0) {
      world_size = Scheduler::MinWorldSize(job->spec());
    }
  } else {
    if (!req->has_spec())
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "job_id or spec: one of them must be given");
    if (world_size < 1)
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("world_size: must be >= 1 (got ", world_size, ")"));
    // A spec not submitted: resolved for this answer only (its fields checked at world_size).
    absl::StatusOr<v1::JobSpec> d = ResolveSpec(req->spec(), world_size, {}, /*check_files=*/false);
    if (!d.ok()) return ToGrpc(d.status());
    resolved = std::make_shared<ResolvedJob>(*d);
  }
  // The mesh: refused (naming sharding.replicas or replicas) when R does not divide world_size.
  if (replicas < 0)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("replicas: must be >= 0 (got ", replicas, ")"));
  const v1::JobSpec d = resolved->DefaultedAt(world_size, replicas);
  absl::StatusOr<Mesh> mesh = MeshOf(d, world_size);
  if (!mesh.ok()) return ToGrpc(mesh.status());
  // A job's plan is the one its admission and scheduling made (ResolvedJob, once per mesh).
  auto memory = resolved->PlanAt(world_size, replicas);
  if (!memory.ok()) return ToGrpc(memory.status());
  if (req->memory_only()) {
    resp->set_world_size(world_size);
    resp->set_alignment(d.sharding().alignment());
  } else {
    auto plan = MakeShardPlan(d, *mesh);
    if (!plan.ok()) return ToGrpc(plan.status());
    *resp = ToProto(*plan);
  }
  *resp->mutable_memory() = ToProto(*memory);
  *resp->mutable_mesh() = MeshShapeOf(*mesh);
  *resp->mutable_memory()->mutable_mesh() = resp->mesh();
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::GetScalingState(grpc::ServerContext* ctx,
                                               const v1::GetScalingStateRequest* req,
                                               v1::ScalingState* resp) {
  if (grpc::Status a = Admin(ctx, "AdminService/GetScalingState"); !a.ok()) return a;
  auto st = jobs_->GetScalingState(req->job_id());
  if (!st.ok()) return ToGrpc(st.status());
  *resp = *st;
  for (v1::TensorScaling& t : *resp->mutable_tensors()) {
    t.set_amax_history_len(t.amax_history_size());
    t.set_amax_latest(t.amax_history_size() > 0 ? t.amax_history(0) : 0.0f);
    float mx = 0;
    for (float a : t.amax_history()) mx = std::max(mx, a);  // NaN never wins std::max
    t.set_amax_max(mx);
    if (req->summary_only()) t.clear_amax_history();
  }
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::TriggerCheckpoint(grpc::ServerContext* ctx,
                                                 const v1::TriggerCheckpointRequest* req,
                                                 v1::TriggerCheckpointResponse* resp) {
  if (grpc::Status a = Admin(ctx, "AdminService/TriggerCheckpoint"); !a.ok()) return a;
  auto step = jobs_->RequestCheckpoint(req->job_id());
  if (!step.ok()) return ToGrpc(step.status());
  resp->set_step(*step);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::ListCheckpoints(grpc::ServerContext* ctx,
                                               const v1::ListCheckpointsRequest* req,
                                               v1::ListCheckpointsResponse* resp) {
  if (grpc::Status a = Admin(ctx, "AdminService/ListCheckpoints"); !a.ok()) return a;
  auto job = jobs_->Get(req->job_id());
  if (!job.ok()) return ToGrpc(job.status());
  const std::string& dir = job->spec().checkpoint().dir();
  if (dir.empty()) return grpc::Status::OK;
  auto list = CheckpointStore(dir).List(job->job_id());
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

grpc::Status WorkerControlImpl::Worker(grpc::ServerContext* ctx, const char* what) const {
  return ToGrpc(Authorize(auth_, ctx, {Role::kWorker, Role::kAdmin}, what).status());
}

grpc::Status WorkerControlImpl::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                                         v1::RegisterResponse* resp) {
  if (grpc::Status a = Worker(ctx, "WorkerControl/Register"); !a.ok()) return a;
  auto r = workers_->Register(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = *r;
  return grpc::Status::OK;
}

grpc::Status WorkerControlImpl::Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                                          v1::HeartbeatResponse*) {
  if (grpc::Status a = Worker(ctx, "WorkerControl/Heartbeat"); !a.ok()) return a;
  return ToGrpc(workers_->Heartbeat(req->worker_id()));
}

grpc::Status WorkerControlImpl::KvSet(grpc::ServerContext* ctx, const v1::KvSetRequest* req,
                                      v1::KvSetResponse*) {
  if (grpc::Status a = Worker(ctx, "WorkerControl/KvSet"); !a.ok()) return a;
  return ToGrpc(kv_->Set(req->key(), req->value()));
}

grpc::Status WorkerControlImpl::KvGet(grpc::ServerContext* ctx, const v1::KvGetRequest* req,
                                      v1::KvGetResponse* resp) {
  if (grpc::Status a = Worker(ctx, "WorkerControl/KvGet"); !a.ok()) return a;
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
  // WriteLoop waits on mu_ for WritableLocked, which absl::Mutex evaluates whenever the lock is
  // released.
  bool Send(const v1::CoordinatorMessage& msg) override {
    absl::MutexLock lock(&mu_);
    if (closed_) return false;
    q_.push_back(msg);
    return true;
  }
  void Close() override {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    if (ctx_) ctx_->TryCancel();  // ctx_ is cleared before the handler returns
  }
  // Ends the writer (the handler is returning).
  void Stop() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    stopped_ = true;
    ctx_ = nullptr;
  }
  void WriteLoop(grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    for (;;) {
      v1::CoordinatorMessage m;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &GrpcSessionSink::WritableLocked));
        if (q_.empty() || stopped_) return;
        m = std::move(q_.front());
        q_.pop_front();
      }
      if (!stream->Write(m)) {
        absl::MutexLock lock(&mu_);
        closed_ = true;
        return;
      }
    }
  }

 private:
  bool WritableLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !q_.empty() || closed_; }

  absl::Mutex mu_;
  grpc::ServerContext* ctx_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::CoordinatorMessage> q_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::Status WorkerControlImpl::Session(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) {
  if (grpc::Status a = Worker(ctx, "WorkerControl/Session"); !a.ok()) return a;
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

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(errno)));
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().find("-----BEGIN ") == std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is not a PEM file"));
  return ss.str();
}

constexpr const char* kServiceNames[] = {"fsdp8.v1.JobService", "fsdp8.v1.AdminService",
                                         "fsdp8.v1.WorkerControl"};

}  // namespace

static absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const CoordinatorOptions& o) {
  if (o.tls_cert.empty() != o.tls_key.empty())
    return absl::InvalidArgumentError("tls_cert and tls_key: give both or neither");
  if (o.tls_cert.empty()) {
    if (!o.tls_client_ca.empty())
      return absl::InvalidArgumentError("tls_client_ca: mutual TLS needs tls_cert and tls_key");
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions ssl;
  auto cert = ReadPem("tls_cert", o.tls_cert);
  if (!cert.ok()) return cert.status();
  auto key = ReadPem("tls_key", o.tls_key);
  if (!key.ok()) return key.status();
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!o.tls_client_ca.empty()) {
    auto ca = ReadPem("tls_client_ca", o.tls_client_ca);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    CoordinatorOptions options) {
  if (options.workers.version.empty()) options.workers.version = FSDP8_VERSION;
  if (options.max_message_bytes < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes: must be >= 1 (got ", options.max_message_bytes, ")"));
  auto creds = ServerCredentialsFor(options);
  if (!creds.ok()) return creds.status();
  std::optional<TokenTable> tokens;
  if (!options.tokens.empty()) {
    auto t = TokenTable::Load(options.tokens);
    if (!t.ok()) return t.status();
    tokens = std::move(*t);
  }
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer());
  s->auth_ = std::make_unique<Authorizer>(std::move(tokens));
  auto jobs = JobManager::Open(options.jobs);
  if (!jobs.ok()) return jobs.status();
  s->jobs_ = std::move(*jobs);
  s->workers_ = std::make_unique<WorkerRegistry>(options.workers);
  // A job that cannot fit even on the largest registered workers is refused at submit.
  if (options.scheduler.check_memory) {
    s->jobs_->SetAdmission([workers = s->workers_.get()](ResolvedJob& job) {
      const std::string backend = job.spec().backend().empty() ? "cpu" : job.spec().backend();
      return CheckFitsLargestWorkers(job, workers->WorkerMemory(backend));
    });
  }
  s->kv_ = std::make_unique<KvServer>();
  s->metrics_ = std::make_unique<CoordinatorMetrics>();
  options.scheduler.metrics = s->metrics_.get();
  s->faults_ = options.faults;
  options.scheduler.faults = &s->faults_;
  if (options.metrics_port != 0) {
    auto http = HttpServer::Start(options.metrics_host, options.metrics_port,
                                  [srv = s.get()](const std::string& path, const std::string& query) {
                                    return ServeStatusHttp(path, query, *srv->jobs_, *srv->workers_,
                                                           *srv->metrics_);
                                  });
    if (!http.ok()) return http.status();
    s->http_ = std::move(*http);
  }
  s->scheduler_ = std::make_unique<Scheduler>(s->jobs_.get(), s->workers_.get(), s->kv_.get(),
                                              options.scheduler);
  s->job_service_ =
      std::make_unique<JobServiceImpl>(s->jobs_.get(), s->auth_.get(), &s->draining_,
                                       std::min<int64_t>(4 << 20, options.max_message_bytes / 2));
  s->admin_service_ =
      std::make_unique<AdminServiceImpl>(s->jobs_.get(), s->workers_.get(), s->auth_.get());
  s->worker_service_ =
      std::make_unique<WorkerControlImpl>(s->workers_.get(), s->kv_.get(), s->auth_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder b;
  int port = 0;
  // No SO_REUSEPORT: a second coordinator on a taken port fails to start instead of sharing it.
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  b.AddListeningPort(options.listen, *creds, &port);
  b.SetMaxReceiveMessageSize(options.max_message_bytes);
  b.SetMaxSendMessageSize(options.max_message_bytes);
  // Dead peers on long-lived streams (Session, WatchJob) are found by keepalive pings; clients
  // may ping every 10 s even without calls in flight.
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  b.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  b.RegisterService(s->job_service_.get());
  b.RegisterService(s->admin_service_.get());
  b.RegisterService(s->worker_service_.get());
  s->server_ = b.BuildAndStart();
  if (!s->server_ || port == 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  if (grpc::HealthCheckServiceInterface* h = s->server_->GetHealthCheckService()) {
    for (const char* name : kServiceNames) h->SetServingStatus(name, true);
  }
  s->port_ = port;
  std::string host = options.listen;
  size_t colon = host.rfind(':');
  if (colon != std::string::npos) host = host.substr(0, colon);
  s->address_ = absl::StrCat(host, ":", port);
  s->scheduler_->Start();
  return s;
}

std::vector<std::string> CoordinatorServer::Drain(std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  draining_ = true;
  if (server_) {
    if (grpc::HealthCheckServiceInterface* h = server_->GetHealthCheckService())
      h->SetServingStatus(false);  // "" and every named service
  }
  workers_->SetAssigning(false);
  struct Pending {
    std::string job_id, dir;
    int64_t step;
  };
  std::vector<Pending> waiting;
  std::vector<std::string> report;
  for (const v1::Job& j : jobs_->List()) {
    if (j.state() != v1::JOB_STATE_RUNNING) continue;
    if (j.spec().checkpoint().dir().empty()) {
      report.push_back(absl::StrCat(j.job_id(), ": no checkpoint.dir, nothing saved"));
      continue;
    }
    auto step = jobs_->RequestCheckpoint(j.job_id());
    if (!step.ok()) {
      report.push_back(absl::StrCat(j.job_id(), ": ", step.status().message()));
      continue;
    }
    waiting.push_back({j.job_id(), j.spec().checkpoint().dir(), *step});
  }
  for (const Pending& p : waiting) {
    std::string line = absl::StrCat(p.job_id, ": checkpoint step-", p.step, " not committed within the drain timeout");
    for (;;) {
      auto latest = CheckpointStore(p.dir).Latest(p.job_id);
      if (latest.ok() && latest->has_value() && (*latest)->step >= p.step) {
        line = absl::StrCat(p.job_id, ": checkpoint step-", (*latest)->step, " committed");
        break;
      }
      if (jobs_->IsTerminal(p.job_id)) {
        auto j = jobs_->Get(p.job_id);
        line = absl::StrCat(p.job_id, ": ended before its checkpoint (",
                            j.ok() ? StateName(j->state()) : "?", ")");
        break;
      }
      if (std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    report.push_back(line);
  }
  return report;
}

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

int CoordinatorServer::metrics_port() const { return http_ ? http_->port() : 0; }

void CoordinatorServer::Shutdown() {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  http_.reset();  // its handlers read the job table and the registry
  if (scheduler_) scheduler_->Stop();
  if (jobs_) jobs_->Shutdown();
  if (kv_) kv_->Shutdown();
  if (server_) {
    if (grpc::HealthCheckServiceInterface* h = server_->GetHealthCheckService()) h->Shutdown();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
  }
}

}  // namespace fsdp8::coord
