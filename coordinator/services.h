// The coordinator's gRPC services: thin adapters over JobManager, WorkerRegistry, KvServer and
// Scheduler (tests use those classes directly), and CoordinatorServer, which owns them all plus the
// grpc::Server (grpc.health.v1 per service and server reflection on, message size limits, TLS or
// mutual TLS, bearer tokens with roles: see coordinator/auth.h).
//
// Access: every JobService, AdminService and WorkerControl call is authenticated first
// (UNAUTHENTICATED) and then checked (PERMISSION_DENIED): JobService takes submitters and admins,
// a submitter seeing and cancelling only its own jobs (ListJobs lists only those); AdminService
// takes admins; WorkerControl takes workers and admins. Health and reflection need no token.
//
// Thread-safety: CoordinatorServer::Shutdown may be called from any thread, once or more.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/auth.h"
#include "coordinator/job_manager.h"
#include "coordinator/kv_server.h"
#include "coordinator/metrics.h"
#include "coordinator/scheduler.h"
#include "coordinator/worker_registry.h"
#include "fsdp8/v1/admin.grpc.pb.h"
#include "fsdp8/v1/jobs.grpc.pb.h"
#include "fsdp8/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fsdp8 {
class HttpServer;
}

namespace fsdp8::coord {

grpc::Status ToGrpc(const absl::Status& s);

class JobServiceImpl final : public v1::JobService::Service {
 public:
  // page_bytes: the most serialized job bytes one ListJobs page carries.
  JobServiceImpl(JobManager* jobs, const Authorizer* auth, const std::atomic<bool>* draining,
                 int64_t page_bytes = 4 << 20)
      : jobs_(jobs), auth_(auth), draining_(draining), page_bytes_(page_bytes) {}
  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest*, v1::Job*) override;
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest*, v1::Job*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                        v1::ListJobsResponse*) override;
  grpc::Status WatchJob(grpc::ServerContext*, const v1::WatchJobRequest*,
                        grpc::ServerWriter<v1::JobEvent>*) override;
  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest*, v1::Job*) override;
  grpc::Status ResumeJob(grpc::ServerContext*, const v1::ResumeJobRequest*, v1::Job*) override;
  grpc::Status DeleteJob(grpc::ServerContext*, const v1::DeleteJobRequest*, v1::Job*) override;

 private:
  // The job when the caller may see it: NOT_FOUND, or PERMISSION_DENIED for another user's job.
  absl::StatusOr<v1::Job> Visible(const Principal& p, const std::string& job_id) const;
  JobManager* jobs_;
  const Authorizer* auth_;
  const std::atomic<bool>* draining_;
  const int64_t page_bytes_;
};

class AdminServiceImpl final : public v1::AdminService::Service {
 public:
  AdminServiceImpl(JobManager* jobs, WorkerRegistry* workers, const Authorizer* auth)
      : jobs_(jobs), workers_(workers), auth_(auth) {}
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse*) override;
  // See WorkerRegistry::Drain. NOT_FOUND for an unknown worker.
  grpc::Status DrainWorker(grpc::ServerContext*, const v1::DrainWorkerRequest*,
                           v1::WorkerInfo*) override;
  grpc::Status GetShardPlan(grpc::ServerContext*, const v1::GetShardPlanRequest*,
                            v1::ShardPlan*) override;
  grpc::Status GetScalingState(grpc::ServerContext*, const v1::GetScalingStateRequest*,
                               v1::ScalingState*) override;
  // NOT_FOUND for an unknown job; FAILED_PRECONDITION when it is not RUNNING or has no
  // checkpoint.dir. Returns the step after which the checkpoint is saved.
  grpc::Status TriggerCheckpoint(grpc::ServerContext*, const v1::TriggerCheckpointRequest*,
                                 v1::TriggerCheckpointResponse*) override;
  // The job's committed checkpoints (those in its checkpoint.dir whose MANIFEST names it), oldest
  // first; empty when the job has no checkpoint.dir. NOT_FOUND for an unknown job.
  grpc::Status ListCheckpoints(grpc::ServerContext*, const v1::ListCheckpointsRequest*,
                               v1::ListCheckpointsResponse*) override;
  // INVALID_ARGUMENT for an unknown level name (see coordinator/log.h).
  grpc::Status SetLogLevel(grpc::ServerContext*, const v1::SetLogLevelRequest*,
                           v1::SetLogLevelResponse*) override;

 private:
  grpc::Status Admin(grpc::ServerContext* ctx, const char* what) const;
  JobManager* jobs_;
  WorkerRegistry* workers_;
  const Authorizer* auth_;
};

class WorkerControlImpl final : public v1::WorkerControl::Service {
 public:
  WorkerControlImpl(WorkerRegistry* workers, KvServer* kv, const Authorizer* auth)
      : workers_(workers), kv_(kv), auth_(auth) {}
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest*,
                        v1::RegisterResponse*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse*) override;
  grpc::Status KvSet(grpc::ServerContext*, const v1::KvSetRequest*, v1::KvSetResponse*) override;
  grpc::Status KvGet(grpc::ServerContext*, const v1::KvGetRequest*, v1::KvGetResponse*) override;
  grpc::Status Session(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) override;

 private:
  grpc::Status Worker(grpc::ServerContext* ctx, const char* what) const;
  WorkerRegistry* workers_;
  KvServer* kv_;
  const Authorizer* auth_;
};

struct CoordinatorOptions {
  std::string listen = "0.0.0.0:50051";  // port 0 picks a free port
  // TLS: PEM files of the server's certificate chain and private key; both empty = plaintext.
  std::string tls_cert;
  std::string tls_key;
  // Mutual TLS: PEM CA bundle that client certificates must chain to (needs tls_cert); clients
  // without a valid certificate are refused during the handshake.
  std::string tls_client_ca;
  // Tokens file or secret directory (coordinator/auth.h); empty = no authentication.
  std::string tokens;
  int max_message_bytes = 64 << 20;       // largest message received or sent, either direction
  JobManagerOptions jobs;
  FaultInjection faults;                  // crash points for tests and drills (main: environment)
  WorkerRegistryOptions workers;          // version defaults to FSDP8_VERSION when empty
  SchedulerOptions scheduler;
  // HTTP: /metrics (Prometheus) and the status page; port 0: no HTTP server.
  std::string metrics_host = "0.0.0.0";
  int metrics_port = 0;
};

// The whole coordinator in one object (used by main.cc and in-process tests).
class CoordinatorServer {
 public:
  // Opens the state database, starts the scheduler and listens. INTERNAL/UNAVAILABLE when the
  // database cannot be opened or the address cannot be bound; INVALID_ARGUMENT / NOT_FOUND for
  // unreadable or malformed TLS files or tokens.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(CoordinatorOptions options);
  ~CoordinatorServer();

  // "host:port" with the port actually bound.
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  // Graceful drain (SIGTERM): every service's health becomes NOT_SERVING, SubmitJob is refused
  // with UNAVAILABLE, no job is started any more (running ones continue), and every RUNNING job
  // with a checkpoint.dir is asked for a checkpoint (TriggerCheckpoint). Waits until each of those
  // has committed it (or ended), at most `timeout`. Returns a line per job ("job-x: checkpoint
  // step-12 committed" or why not). Call Shutdown afterwards.
  std::vector<std::string> Drain(std::chrono::milliseconds timeout);
  // The bound HTTP port (metrics, status page); 0 when off.
  int metrics_port() const;
  // Stops the scheduler (running jobs' ranks get Abort), wakes watchers and blocked KvGets, and
  // shuts the server down (in-flight calls are cancelled after 2 s).
  void Shutdown();

  JobManager* jobs() { return jobs_.get(); }
  WorkerRegistry* workers() { return workers_.get(); }
  KvServer* kv() { return kv_.get(); }
  CoordinatorMetrics* metrics() { return metrics_.get(); }

 private:
  CoordinatorServer() = default;
  FaultInjection faults_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<WorkerRegistry> workers_;
  std::unique_ptr<KvServer> kv_;
  std::unique_ptr<CoordinatorMetrics> metrics_;
  std::unique_ptr<HttpServer> http_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<Authorizer> auth_;
  std::atomic<bool> draining_{false};
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<AdminServiceImpl> admin_service_;
  std::unique_ptr<WorkerControlImpl> worker_service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  int port_ = 0;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace fsdp8::coord
