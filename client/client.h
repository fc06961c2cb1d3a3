// fsdp8::Client: the C++ SDK for an fsdp8 coordinator (JobService and AdminService over gRPC).
//
// Every call returns the coordinator's status as an absl::Status (same code and message), or
// UNAVAILABLE when the coordinator cannot be reached. Calls have a 30 s deadline, except Watch.
//
// Thread-safety: a connected Client may be used from several threads at once.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/rpc_channel.h"
#include "fsdp8/v1/admin.grpc.pb.h"
#include "fsdp8/v1/jobs.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace fsdp8 {

class Client {
 public:
  // Creates a channel to "host:port" (no round trip: an unreachable coordinator shows up as
  // UNAVAILABLE on the first call). `security`: TLS / mutual TLS files and the bearer token (see
  // common/rpc_channel.h); errors as MakeChannel. With authentication on, calls without a valid
  // token fail UNAUTHENTICATED and calls the token's role may not make PERMISSION_DENIED.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& address,
                                                         const ChannelSecurity& security = {});

  // Submits a job. The same non-empty request_id with the same spec returns the existing job;
  // with another spec ALREADY_EXISTS. INVALID_ARGUMENT names the spec field and the rule.
  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec, const std::string& request_id = "");
  // events > 0: Job.events holds up to that many of the job's newest events.
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id, int events = 0);
  // Every job the caller may see (a submitter: its own), oldest first, fetched page by page.
  absl::StatusOr<std::vector<v1::Job>> ListJobs();
  // One page of ListJobs: page_size 0 is the coordinator's default (100); page_token is the
  // previous page's next_page_token ("" for the first page).
  absl::StatusOr<v1::ListJobsResponse> ListJobsPage(int page_size, const std::string& page_token);
  // Cancels a job. save (the default): a RUNNING job with a checkpoint.dir first saves a
  // checkpoint after the step in progress, and the call returns the job once it has ended
  // (CANCELLED, its reason naming the committed checkpoint or why none was saved; SUCCEEDED when
  // that step was its last), waiting up to kCancelSaveDeadlineS; save false: stops it at once.
  // FAILED_PRECONDITION for an ended job.
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id, bool save = true);
  // Continues an ended (CANCELLED or FAILED) job as the same job id from its own newest committed
  // checkpoint: returns it PENDING. FAILED_PRECONDITION naming the rule for a job that has not
  // ended, SUCCEEDED, or has no committed checkpoint of its own; PERMISSION_DENIED for another
  // user's job.
  absl::StatusOr<v1::Job> Resume(const std::string& job_id);
  static constexpr double kCancelSaveDeadlineS = 600;
  // Removes an ended job from the job table (its checkpoints stay); FAILED_PRECONDITION for a job
  // that has not ended. Returns the job as it was.
  absl::StatusOr<v1::Job> Delete(const std::string& job_id);

  // Streams the job's events with seq > after_seq to on_event until the job ends, then returns the
  // job as GetJob reports it. When the stream breaks with UNAVAILABLE (coordinator restarting,
  // network), reconnects and resumes after the last seq seen, for up to `reconnect_for_s` seconds
  // of continuous failure. on_event returning false stops watching (the current job is returned).
  absl::StatusOr<v1::Job> Watch(const std::string& job_id, int64_t after_seq,
                                const std::function<bool(const v1::JobEvent&)>& on_event,
                                double reconnect_for_s = 60);

  absl::StatusOr<std::vector<v1::WorkerInfo>> ListWorkers();
  // The plan of a job (at its world size), or of `spec` at `world_size` when job_id is empty.
  // replicas: GetShardPlanRequest.replicas (the R to plan a sharding.replicas auto spec at).
  absl::StatusOr<v1::ShardPlan> GetShardPlan(const std::string& job_id, const v1::JobSpec& spec = {},
                                             int world_size = 0, int replicas = 0);
  absl::StatusOr<v1::ScalingState> GetScalingState(const std::string& job_id);
  // Asks a RUNNING job with a checkpoint.dir for a checkpoint after its next step; returns that
  // step. FAILED_PRECONDITION when the job is not running or has no checkpoint.dir.
  absl::StatusOr<int64_t> TriggerCheckpoint(const std::string& job_id);
  // The committed checkpoints in the job's checkpoint.dir, oldest first.
  absl::StatusOr<std::vector<v1::CheckpointInfo>> ListCheckpoints(const std::string& job_id);
  // Drains a worker (no new work; undo = accept work again). NOT_FOUND for an unknown worker.
  absl::StatusOr<v1::WorkerInfo> DrainWorker(const std::string& worker_id, bool undo = false);
  // Sets the coordinator's log level; returns the previous one. INVALID_ARGUMENT for a bad name.
  absl::StatusOr<std::string> SetLogLevel(const std::string& level);

  const std::string& address() const { return address_; }

 private:
  Client() = default;
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
};

// "1.2s", "3m12s", "1h05m".
std::string FormatDuration(double seconds);

// "512B", "1.5KiB", "12.0MiB", "3.25GiB".
std::string FormatBytes(int64_t bytes);

// The table `fsdp8 checkpoints JOB` prints: a header line, then one line per checkpoint
// (STEP, WORLD, BYTES, DIR), in the given order; "no committed checkpoints\n" when empty.
std::string FormatCheckpointTable(const std::vector<v1::CheckpointInfo>& checkpoints);

}  // namespace fsdp8
