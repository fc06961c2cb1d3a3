#include "client/client.h"

#include <chrono>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fsdp8 {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

void SetDeadline(grpc::ClientContext* ctx, double seconds = 30) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
}

}  // namespace

std::string FormatDuration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  if (s < 60) return absl::StrFormat("%.0fs", s);
  int64_t t = static_cast<int64_t>(s + 0.5);
  if (t < 3600) return absl::StrFormat("%dm%02ds", t / 60, t % 60);
  return absl::StrFormat("%dh%02dm", t / 3600, (t % 3600) / 60);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address,
                                                        const ChannelSecurity& security) {
  auto ch = MakeChannel(address, security);
  if (!ch.ok()) return ch.status();
  std::unique_ptr<Client> c(new Client());
  c->address_ = address;
  c->channel_ = std::move(*ch);
  c->jobs_ = v1::JobService::NewStub(c->channel_);
  c->admin_ = v1::AdminService::NewStub(c->channel_);
  return c;
}

absl::StatusOr<v1::Job> Client::Submit(const v1::JobSpec& spec, const std::string& request_id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::SubmitJobRequest req;
  req.set_request_id(request_id);
  *req.mutable_spec() = spec;
  v1::Job job;
  if (auto s = FromGrpc(jobs_->SubmitJob(&ctx, req, &job)); !s.ok()) return s;
  return job;
}

absl::StatusOr<v1::Job> Client::GetJob(const std::string& job_id, int events) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::GetJobRequest req;
  req.set_job_id(job_id);
  req.set_events(events);
  v1::Job job;
  if (auto s = FromGrpc(jobs_->GetJob(&ctx, req, &job)); !s.ok()) return s;
  return job;
}

absl::StatusOr<v1::ListJobsResponse> Client::ListJobsPage(int page_size,
                                                          const std::string& page_token) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::ListJobsRequest req;
  req.set_page_size(page_size);
  req.set_page_token(page_token);
  v1::ListJobsResponse resp;
  if (auto s = FromGrpc(jobs_->ListJobs(&ctx, req, &resp)); !s.ok()) return s;
  return resp;
}

absl::StatusOr<std::vector<v1::Job>> Client::ListJobs() {
  std::vector<v1::Job> out;
  std::string token;
  do {
    auto page = ListJobsPage(0, token);
    if (!page.ok()) return page.status();
    out.insert(out.end(), page->jobs().begin(), page->jobs().end());
    token = page->next_page_token();
  } while (!token.empty());
  return out;
}

absl::StatusOr<v1::Job> Client::Delete(const std::string& job_id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::DeleteJobRequest req;
  req.set_job_id(job_id);
  v1::Job job;
  if (auto s = FromGrpc(jobs_->DeleteJob(&ctx, req, &job)); !s.ok()) return s;
  return job;
}

absl::StatusOr<v1::Job> Client::Cancel(const std::string& job_id, bool save) {
  grpc::ClientContext ctx;
  // A cancel with a save returns once the step in progress and the save are done.
  SetDeadline(&ctx, save ? kCancelSaveDeadlineS : 30);
  v1::CancelJobRequest req;
  req.set_job_id(job_id);
  req.set_no_save(!save);
  v1::Job job;
  if (auto s = FromGrpc(jobs_->CancelJob(&ctx, req, &job)); !s.ok()) return s;
  return job;
}

absl::StatusOr<v1::Job> Client::Resume(const std::string& job_id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::ResumeJobRequest req;
  req.set_job_id(job_id);
  v1::Job job;
  if (auto s = FromGrpc(jobs_->ResumeJob(&ctx, req, &job)); !s.ok()) return s;
  return job;
}

absl::StatusOr<v1::Job> Client::Watch(const std::string& job_id, int64_t after_seq,
                                      const std::function<bool(const v1::JobEvent&)>& on_event,
                                      double reconnect_for_s) {
  int64_t last = after_seq;
  auto failing_since = std::chrono::steady_clock::time_point::max();
  int backoff_ms = 100;
  for (;;) {
    grpc::ClientContext ctx;
    v1::WatchJobRequest req;
    req.set_job_id(job_id);
    req.set_after_seq(last);
    auto reader = jobs_->WatchJob(&ctx, req);
    v1::JobEvent ev;
    bool stopped = false;
    while (reader->Read(&ev)) {
      failing_since = std::chrono::steady_clock::time_point::max();
      backoff_ms = 100;
      last = ev.seq();
      if (!on_event(ev)) {
        stopped = true;
        ctx.TryCancel();
        break;
      }
    }
    grpc::Status st = reader->Finish();
    if (stopped || st.ok()) return GetJob(job_id);
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE) return FromGrpc(st);
    auto now = std::chrono::steady_clock::now();
    if (failing_since == std::chrono::steady_clock::time_point::max()) failing_since = now;
    if (now - failing_since > std::chrono::milliseconds(static_cast<int64_t>(reconnect_for_s * 1000)))
      return FromGrpc(st);
    std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
    backoff_ms = std::min(backoff_ms * 2, 2000);
  }
}

absl::StatusOr<std::vector<v1::WorkerInfo>> Client::ListWorkers() {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::ListWorkersResponse resp;
  if (auto s = FromGrpc(admin_->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp)); !s.ok())
    return s;
  return std::vector<v1::WorkerInfo>(resp.workers().begin(), resp.workers().end());
}

absl::StatusOr<v1::ShardPlan> Client::GetShardPlan(const std::string& job_id,
                                                   const v1::JobSpec& spec, int world_size,
                                                   int replicas) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::GetShardPlanRequest req;
  req.set_job_id(job_id);
  if (job_id.empty()) *req.mutable_spec() = spec;
  req.set_world_size(world_size);
  req.set_replicas(replicas);
  v1::ShardPlan plan;
  if (auto s = FromGrpc(admin_->GetShardPlan(&ctx, req, &plan)); !s.ok()) return s;
  return plan;
}

absl::StatusOr<v1::ScalingState> Client::GetScalingState(const std::string& job_id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::GetScalingStateRequest req;
  req.set_job_id(job_id);
  v1::ScalingState st;
  if (auto s = FromGrpc(admin_->GetScalingState(&ctx, req, &st)); !s.ok()) return s;
  return st;
}

absl::StatusOr<int64_t> Client::TriggerCheckpoint(const std::string& job_id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::TriggerCheckpointRequest req;
  req.set_job_id(job_id);
  v1::TriggerCheckpointResponse resp;
  if (auto s = FromGrpc(admin_->TriggerCheckpoint(&ctx, req, &resp)); !s.ok()) return s;
  return resp.step();
}

absl::StatusOr<std::vector<v1::CheckpointInfo>> Client::ListCheckpoints(const std::string& job_id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::ListCheckpointsRequest req;
  req.set_job_id(job_id);
  v1::ListCheckpointsResponse resp;
  if (auto s = FromGrpc(admin_->ListCheckpoints(&ctx, req, &resp)); !s.ok()) return s;
  return std::vector<v1::CheckpointInfo>(resp.checkpoints().begin(), resp.checkpoints().end());
}

absl::StatusOr<v1::WorkerInfo> Client::DrainWorker(const std::string& worker_id, bool undo) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::DrainWorkerRequest req;
  req.set_worker_id(worker_id);
  req.set_undo(undo);
  v1::WorkerInfo w;
  if (auto s = FromGrpc(admin_->DrainWorker(&ctx, req, &w)); !s.ok()) return s;
  return w;
}

absl::StatusOr<std::string> Client::SetLogLevel(const std::string& level) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::SetLogLevelRequest req;
  req.set_level(level);
  v1::SetLogLevelResponse resp;
  if (auto s = FromGrpc(admin_->SetLogLevel(&ctx, req, &resp)); !s.ok()) return s;
  return resp.previous();
}

std::string FormatBytes(int64_t b) {
  if (b < 1024) return absl::StrFormat("%dB", b);
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = -1;
  while (v >= 1024 && u < 3) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat(v < 10 ? "%.2f%s" : "%.1f%s", v, units[u]);
}

std::string FormatCheckpointTable(const std::vector<v1::CheckpointInfo>& cks) {
  if (cks.empty()) return "no committed checkpoints\n";
  std::string out = absl::StrFormat("%-10s %-6s %-10s %s\n", "STEP", "WORLD", "BYTES", "DIR");
  for (const auto& c : cks) {
    absl::StrAppend(&out, absl::StrFormat("%-10d %-6d %-10s %s\n", c.step(), c.world_size(),
                                          FormatBytes(c.bytes()), c.dir()));
  }
  return out;
}

}  // namespace fsdp8
