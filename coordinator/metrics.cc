#include "coordinator/metrics.h"

#include <cmath>

#ifndef FSDP8_VERSION
#define FSDP8_VERSION "dev"
#endif

namespace fsdp8::coord {

void CoordinatorMetrics::OnStep(const std::string& job_id, const v1::JobEvent& ev,
                                const std::vector<v1::StepResult>& results) {
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    if (jobs_.size() >= kMaxJobs) {  // drop the least recently updated job
      auto oldest = jobs_.begin();
      for (auto j = jobs_.begin(); j != jobs_.end(); ++j)
        if (j->second.touched < oldest->second.touched) oldest = j;
      jobs_.erase(oldest);
    }
    it = jobs_.emplace(job_id, JobSeries()).first;
  }
  JobSeries& s = it->second;
  s.touched = ++clock_;
  ++s.steps;
  int64_t tokens = 0;
  for (const v1::StepResult& r : results) tokens += r.tokens();
  s.tokens += tokens;
  s.loss = ev.loss();
  if (!std::isnan(ev.val_loss())) {
    s.val_loss = ev.val_loss();
    s.has_val = true;
  }
  s.grad_norm = ev.grad_norm();
  s.lr = ev.lr();
  s.tokens_per_second = ev.tokens_per_second();
  s.step_seconds.Observe(ev.step_seconds());
  if (s.ranks.size() < results.size()) s.ranks.resize(results.size());
  for (size_t r = 0; r < results.size(); ++r) {
    s.ranks[r].all_gather_bytes += static_cast<double>(results[r].all_gather_bytes());
    s.ranks[r].reduce_scatter_bytes += static_cast<double>(results[r].reduce_scatter_bytes());
    s.ranks[r].comm_seconds += results[r].comm_seconds();
    s.ranks[r].compute_seconds += results[r].compute_seconds();
    s.ranks[r].peak_memory_bytes = results[r].peak_memory_bytes();
  }
  Point p;
  p.step = ev.step();
  p.loss = ev.loss();
  p.val_loss = ev.val_loss();
  p.tokens_per_second = ev.tokens_per_second();
  p.step_seconds = ev.step_seconds();
  p.time = NowSeconds();
  s.points.push_back(p);
  if (s.points.size() > kMaxPoints) s.points.pop_front();
}

std::vector<CoordinatorMetrics::Point> CoordinatorMetrics::Recent(const std::string& job_id) const {
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return {};
  return {it->second.points.begin(), it->second.points.end()};
}

namespace {

// The coordinator's version, and the job table's jobs by state (every state, zeros included, so
// absent series never hide a drop to 0).
void RenderCoordinator(const std::vector<v1::Job>& all, prom::ExpositionWriter* w) {
  w->Family("fsdp8_coordinator_info", "gauge", "Constant 1, labelled with the coordinator version.");
  w->Sample({{"version", FSDP8_VERSION}}, 1);
  w->Family("fsdp8_jobs", "gauge", "Jobs in the job table, by state.");
  for (int st = v1::JOB_STATE_PENDING; st <= v1::JOB_STATE_CANCELLED; ++st) {
    int n = 0;
    for (const v1::Job& j : all) n += j.state() == st;
    w->Sample({{"state", StateName(static_cast<v1::JobState>(st))}}, n);
  }
}

// What the job table says of each shown job: name and state, steps, world size, restarts.
void RenderJobTable(const std::vector<const v1::Job*>& shown, prom::ExpositionWriter* w) {
  auto job_family = [&](const char* name, const char* type, const char* help, auto value) {
    w->Family(name, type, help);
    for (const v1::Job* j : shown) w->Sample({{"job", j->job_id()}}, static_cast<double>(value(*j)));
  };
  w->Family("fsdp8_job_info", "gauge", "Constant 1, labelled with the job's name and state.");
  for (const v1::Job* j : shown)
    w->Sample({{"job", j->job_id()}, {"name", j->spec().name()}, {"state", StateName(j->state())}},
              1);
  job_family("fsdp8_job_step", "gauge", "Optimizer steps the job has completed.",
             [](const v1::Job& j) { return j.step(); });
  job_family("fsdp8_job_total_steps", "gauge", "Optimizer steps the job runs in all.",
             [](const v1::Job& j) { return j.total_steps(); });
  job_family("fsdp8_job_world_size", "gauge", "Ranks of the job's current generation.",
             [](const v1::Job& j) { return j.world_size(); });
  job_family("fsdp8_job_restarts_total", "counter",
             "Generations of the job restarted after a failure (RECOVERING).",
             [](const v1::Job& j) { return j.restarts(); });
}

// FP8 scaling state (identical on every rank, C04) of each shown job, as last reported (every 10
// steps): scale and newest amax per tensor.
void RenderScaling(const JobManager& jobs, const std::vector<const v1::Job*>& shown,
                   prom::ExpositionWriter* w) {
  std::vector<v1::ScalingState> scaling;
  for (const v1::Job* j : shown) {
    auto st = jobs.GetScalingState(j->job_id());
    if (st.ok()) scaling.push_back(*st);
  }
  w->Family("fsdp8_fp8_scale", "gauge", "FP8 scale of each scaled tensor (x_fp8 = x * scale).");
  for (const v1::ScalingState& st : scaling)
    for (const v1::TensorScaling& t : st.tensors())
      w->Sample({{"job", st.job_id()}, {"tensor", t.name()}, {"format", t.format()}}, t.scale());
  w->Family("fsdp8_fp8_amax", "gauge", "Newest amax of each FP8-scaled tensor.");
  for (const v1::ScalingState& st : scaling)
    for (const v1::TensorScaling& t : st.tensors())
      w->Sample({{"job", st.job_id()}, {"tensor", t.name()}, {"format", t.format()}},
                t.amax_history_size() > 0 ? t.amax_history(0) : 0.0);
}

// Registered workers: counts by backend and state, health, memory, last heartbeat.
void RenderWorkers(const std::vector<v1::WorkerInfo>& ws, prom::ExpositionWriter* w) {
  w->Family("fsdp8_workers", "gauge", "Registered workers by backend and state (idle, busy, unhealthy).");
  std::map<std::pair<std::string, std::string>, int> counts;
  for (const v1::WorkerInfo& x : ws) {
    for (const char* st : {"idle", "busy", "unhealthy"}) counts[{x.backend(), st}] += 0;
    counts[{x.backend(), !x.healthy() ? "unhealthy" : x.job_id().empty() ? "idle" : "busy"}]++;
  }
  for (const auto& [k, n] : counts) w->Sample({{"backend", k.first}, {"state", k.second}}, n);
  w->Family("fsdp8_worker_healthy", "gauge", "1 while the worker heartbeats, else 0.");
  for (const v1::WorkerInfo& x : ws)
    w->Sample({{"worker", x.worker_id()}, {"host", x.host()}, {"backend", x.backend()},
               {"device", std::to_string(x.device())}},
              x.healthy() ? 1 : 0);
  w->Family("fsdp8_worker_memory_bytes", "gauge", "Memory the worker reported at registration.");
  for (const v1::WorkerInfo& x : ws)
    w->Sample({{"worker", x.worker_id()}}, static_cast<double>(x.memory_bytes()));
  w->Family("fsdp8_worker_last_heartbeat_timestamp_seconds", "gauge",
            "Time of the worker's last heartbeat (seconds since the Unix epoch).");
  for (const v1::WorkerInfo& x : ws) w->Sample({{"worker", x.worker_id()}}, x.last_heartbeat());
}

}  // namespace

void CoordinatorMetrics::RenderSteps(prom::ExpositionWriter* w) const {
  auto series_family = [&](const char* name, const char* type, const char* help, auto value,
                           bool (*has)(const JobSeries&) = nullptr)
                           ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    w->Family(name, type, help);
    for (const auto& [id, s] : jobs_)
      if (has == nullptr || has(s)) w->Sample({{"job", id}}, static_cast<double>(value(s)));
  };
  series_family("fsdp8_steps_total", "counter", "Optimizer steps completed (seen by this process).",
                [](const JobSeries& s) { return s.steps; });
  series_family("fsdp8_tokens_total", "counter", "Tokens trained on, all ranks.",
                [](const JobSeries& s) { return s.tokens; });
  w->Family("fsdp8_step_duration_seconds", "histogram",
            "Wall time of one optimizer step, from the step command to the last rank's result.");
  for (const auto& [id, s] : jobs_) w->HistogramSeries({{"job", id}}, s.step_seconds);
  series_family("fsdp8_loss", "gauge",
                "Training loss of the last step, mean over the global batch (nats per token).",
                [](const JobSeries& s) { return s.loss; });
  series_family("fsdp8_val_loss", "gauge", "Last validation loss (nats per token).",
                [](const JobSeries& s) { return s.val_loss; },
                [](const JobSeries& s) { return s.has_val; });
  series_family("fsdp8_grad_norm", "gauge", "Global gradient norm of the last step, before clipping.",
                [](const JobSeries& s) { return s.grad_norm; });
  series_family("fsdp8_learning_rate", "gauge", "Learning rate of the last step.",
                [](const JobSeries& s) { return s.lr; });
  series_family("fsdp8_tokens_per_second", "gauge",
                "Throughput of the last step (training tokens per second, its validation time "
                "excluded).",
                [](const JobSeries& s) { return s.tokens_per_second; });
}

void CoordinatorMetrics::RenderRanks(prom::ExpositionWriter* w) const {
  auto rank_family = [&](const char* name, const char* type, const char* help, auto value)
                         ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    w->Family(name, type, help);
    for (const auto& [id, s] : jobs_)
      for (size_t r = 0; r < s.ranks.size(); ++r)
        w->Sample({{"job", id}, {"rank", std::to_string(r)}}, static_cast<double>(value(s.ranks[r])));
  };
  w->Family("fsdp8_comm_bytes_total", "counter",
            "Bytes through the rank's step collectives (all_gather: gathered output, "
            "reduce_scatter: f32 input).");
  for (const auto& [id, s] : jobs_)
    for (size_t r = 0; r < s.ranks.size(); ++r) {
      w->Sample({{"job", id}, {"rank", std::to_string(r)}, {"collective", "all_gather"}},
                s.ranks[r].all_gather_bytes);
      w->Sample({{"job", id}, {"rank", std::to_string(r)}, {"collective", "reduce_scatter"}},
                s.ranks[r].reduce_scatter_bytes);
    }
  rank_family("fsdp8_comm_seconds_total", "counter", "Step time the rank spent in collectives.",
              [](const RankSeries& r) { return r.comm_seconds; });
  rank_family("fsdp8_compute_seconds_total", "counter", "Step time the rank spent computing.",
              [](const RankSeries& r) { return r.compute_seconds; });
  rank_family("fsdp8_peak_memory_bytes", "gauge", "Peak device memory of the rank's last step.",
              [](const RankSeries& r) { return r.peak_memory_bytes; });
}

std::string CoordinatorMetrics::Render(const JobManager& jobs,
                                       const WorkerRegistry& workers) const {
  const std::vector<v1::Job> all = jobs.List();
  const std::vector<v1::WorkerInfo> ws = workers.List();
  prom::ExpositionWriter w;
  RenderCoordinator(all, &w);
  absl::MutexLock l(&mu_);
  // Per-job series for jobs still in play and for those this process ran steps of.
  std::vector<const v1::Job*> shown;
  for (const v1::Job& j : all)
    if (!IsTerminalState(j.state()) || jobs_.count(j.job_id())) shown.push_back(&j);
  RenderJobTable(shown, &w);
  RenderSteps(&w);
  RenderRanks(&w);
  RenderScaling(jobs, shown, &w);
  RenderWorkers(ws, &w);
  return w.text();
}

}  // namespace fsdp8::coord
