// The coordinator's gRPC services: thin adapters over JobManager, WorkerRegistry, KvServer and
// Scheduler (tests use those classes directly), and CoordinatorServer, which owns them all plus the
// grpc::Server (health checking and server reflection on, 64 MiB message limits).
//
// Thread-safety: CoordinatorServer::Shutdown may be called from any thread, once or more.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/job_manager.h"
#include "coordinator/kv_server.h"
#include "coordinator/scheduler.h"
#include "coordinator/worker_registry.h"
#include "fsdp8/v1/admin.grpc.pb.h"
#include "fsdp8/v1/jobs.grpc.pb.h"
#include "fsdp8/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fsdp8::coord {

grpc::Status ToGrpc(const absl::Status& s);

class JobServiceImpl final : public v1::JobService::Service {
 public:
  explicit JobServiceImpl(JobManager* jobs) : jobs_(jobs) {}
  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest*, v1::Job*) override;
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest*, v1::Job*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                        v1::ListJobsResponse*) override;
  grpc::Status WatchJob(grpc::ServerContext*, const v1::WatchJobRequest*,
                        grpc::ServerWriter<v1::JobEvent>*) override;
  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest*, v1::Job*) override;

 private:
  JobManager* jobs_;
};

class AdminServiceImpl final : public v1::AdminService::Service {
 public:
  AdminServiceImpl(JobManager* jobs, WorkerRegistry* workers) : jobs_(jobs), workers_(workers) {}
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse*) override;
  grpc::Status GetShardPlan(grpc::ServerContext*, const v1::GetShardPlanRequest*,
                            v1::ShardPlan*) override;
  grpc::Status GetScalingState(grpc::ServerContext*, const v1::GetScalingStateRequest*,
                               v1::ScalingState*) override;
  // NOT_FOUND for an unknown job; FAILED_PRECONDITION when it is not RUNNING or has no
  // checkpoint.dir. Returns the step after which the checkpoint is saved.
  grpc::Status TriggerCheckpoint(grpc::ServerContext*, const v1::TriggerCheckpointRequest*,
                                 v1::TriggerCheckpointResponse*) override;
  // The committed checkpoints in the job's checkpoint.dir, oldest first (also those written by
  // earlier jobs sharing the directory); empty when the job has no checkpoint.dir. NOT_FOUND for an
  // unknown job.
  grpc::Status ListCheckpoints(grpc::ServerContext*, const v1::ListCheckpointsRequest*,
                               v1::ListCheckpointsResponse*) override;

 private:
  JobManager* jobs_;
  WorkerRegistry* workers_;
};

class WorkerControlImpl final : public v1::WorkerControl::Service {
 public:
  WorkerControlImpl(WorkerRegistry* workers, KvServer* kv) : workers_(workers), kv_(kv) {}
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
  WorkerRegistry* workers_;
  KvServer* kv_;
};

struct CoordinatorOptions {
  std::string listen = "0.0.0.0:50051";  // port 0 picks a free port
  JobManagerOptions jobs;
  WorkerRegistryOptions workers;          // version defaults to FSDP8_VERSION when empty
  SchedulerOptions scheduler;
};

// The whole coordinator in one object (used by main.cc and in-process tests).
class CoordinatorServer {
 public:
  // Opens the state database, starts the scheduler and listens. INTERNAL/UNAVAILABLE when the
  // database cannot be opened or the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(CoordinatorOptions options);
  ~CoordinatorServer();

  // "host:port" with the port actually bound.
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  // Stops the scheduler (running jobs' ranks get Abort), wakes watchers and blocked KvGets, and
  // shuts the server down (in-flight calls are cancelled after 2 s).
  void Shutdown();

  JobManager* jobs() { return jobs_.get(); }
  WorkerRegistry* workers() { return workers_.get(); }
  KvServer* kv() { return kv_.get(); }

 private:
  CoordinatorServer() = default;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<WorkerRegistry> workers_;
  std::unique_ptr<KvServer> kv_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<AdminServiceImpl> admin_service_;
  std::unique_ptr<WorkerControlImpl> worker_service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  int port_ = 0;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;
};

}  // namespace fsdp8::coord
