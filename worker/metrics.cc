#include "worker/metrics.h"

#include <unistd.h>

#include <cstdio>

#ifndef FSDP8_VERSION
#define FSDP8_VERSION "dev"
#endif

namespace fsdp8 {

WorkerMetrics::WorkerMetrics(std::string backend, int device)
    : backend_(std::move(backend)), device_(device) {}

void WorkerMetrics::SetWorkerId(const std::string& id) {
  absl::MutexLock l(&mu_);
  worker_id_ = id;
}

void WorkerMetrics::OnAssignment() {
  absl::MutexLock l(&mu_);
  ++assignments_;
}

void WorkerMetrics::OnFailure() {
  absl::MutexLock l(&mu_);
  ++failures_;
}

void WorkerMetrics::OnAbort() {
  absl::MutexLock l(&mu_);
  ++aborts_;
}

void WorkerMetrics::OnStep(const std::string& job_id, int rank, const v1::StepResult& result,
                           double step_seconds, const CommBytes& comm,
                           const v1::ScalingState& scaling) {
  absl::MutexLock l(&mu_);
  Series* s = nullptr;
  for (Series& x : series_)
    if (x.job_id == job_id && x.rank == rank) s = &x;
  if (s == nullptr) {
    if (series_.size() >= kMaxSeries) series_.pop_front();
    series_.emplace_back();
    s = &series_.back();
    s->job_id = job_id;
    s->rank = rank;
  }
  ++s->steps;
  s->tokens += result.tokens();
  s->last_step = result.step();
  s->compute_seconds += result.compute_seconds();
  s->comm_seconds += result.comm_seconds();
  s->loss = result.tokens() > 0 ? result.loss_sum() / static_cast<double>(result.tokens()) : 0;
  s->grad_norm = result.grad_norm();
  s->lr = result.lr();
  s->peak_memory_bytes = result.peak_memory_bytes();
  s->comm.all_gather += comm.all_gather;
  s->comm.reduce_scatter += comm.reduce_scatter;
  s->comm.all_reduce += comm.all_reduce;
  s->step_seconds.Observe(step_seconds);
  scaling_job_ = job_id;
  scaling_rank_ = rank;
  scaling_ = scaling;
}

std::string WorkerMetrics::Render() const {
  const int64_t rss = ResidentMemoryBytes();
  absl::MutexLock l(&mu_);
  prom::ExpositionWriter w;
  w.Family("fsdp8_worker_info", "gauge", "Constant 1, labelled with the worker's identity.");
  w.Sample({{"worker", worker_id_}, {"version", FSDP8_VERSION}, {"backend", backend_},
            {"device", std::to_string(device_)}},
           1);
  w.Family("process_resident_memory_bytes", "gauge", "Resident memory of the worker process.");
  w.Sample({}, static_cast<double>(rss));
  w.Family("fsdp8_worker_assignments_total", "counter",
           "Job generations assigned to this worker (a restarted job counts again).");
  w.Sample({}, static_cast<double>(assignments_));
  w.Family("fsdp8_worker_failures_total", "counter",
           "Assignments or steps that failed on this worker (reported to the coordinator).");
  w.Sample({}, static_cast<double>(failures_));
  w.Family("fsdp8_worker_aborts_total", "counter", "Abort messages received from the coordinator.");
  w.Sample({}, static_cast<double>(aborts_));

  auto labels = [](const Series& s) {
    return prom::Labels{{"job", s.job_id}, {"rank", std::to_string(s.rank)}};
  };
  auto per_series = [&](const char* name, const char* type, const char* help, auto value)
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    w.Family(name, type, help);
    for (const Series& s : series_) w.Sample(labels(s), static_cast<double>(value(s)));
  };
  per_series("fsdp8_steps_total", "counter", "Optimizer steps this rank completed.",
             [](const Series& s) { return s.steps; });
  per_series("fsdp8_step", "gauge", "Optimizer steps completed by the job (last step index + 1).",
             [](const Series& s) { return s.last_step + 1; });
  per_series("fsdp8_tokens_total", "counter", "Tokens this rank trained on.",
             [](const Series& s) { return s.tokens; });
  w.Family("fsdp8_step_duration_seconds", "histogram",
           "Wall time of one optimizer step on this rank (with evaluation when it ran).");
  for (const Series& s : series_) w.HistogramSeries(labels(s), s.step_seconds);
  per_series("fsdp8_compute_seconds_total", "counter",
             "Step time not spent in collectives (forward, backward, optimizer).",
             [](const Series& s) { return s.compute_seconds; });
  per_series("fsdp8_comm_seconds_total", "counter", "Step time spent in collectives.",
             [](const Series& s) { return s.comm_seconds; });
  per_series("fsdp8_loss", "gauge",
             "This rank's mean training loss of the last step over its own tokens (nats per token).",
             [](const Series& s) { return s.loss; });
  per_series("fsdp8_grad_norm", "gauge", "Global gradient norm of the last step, before clipping.",
             [](const Series& s) { return s.grad_norm; });
  per_series("fsdp8_learning_rate", "gauge", "Learning rate of the last step.",
             [](const Series& s) { return s.lr; });
  per_series("fsdp8_peak_memory_bytes", "gauge",
             "Peak device memory allocated by the backend during the last step.",
             [](const Series& s) { return s.peak_memory_bytes; });
  w.Family("fsdp8_comm_bytes_total", "counter",
           "Bytes through each collective (all_gather: gathered output, reduce_scatter: f32 "
           "input, all_reduce: buffer).");
  for (const Series& s : series_) {
    const std::pair<const char*, int64_t> kinds[] = {{"all_gather", s.comm.all_gather},
                                                     {"reduce_scatter", s.comm.reduce_scatter},
                                                     {"all_reduce", s.comm.all_reduce}};
    for (const auto& [name, bytes] : kinds) {
      prom::Labels lb = labels(s);
      lb.emplace_back("collective", name);
      w.Sample(lb, static_cast<double>(bytes));
    }
  }
  auto scaled = [&](const char* name, const char* help, auto value)
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    w.Family(name, "gauge", help);
    if (scaling_job_.empty()) return;
    for (const v1::TensorScaling& t : scaling_.tensors())
      w.Sample({{"job", scaling_job_}, {"rank", std::to_string(scaling_rank_)},
                {"tensor", t.name()}, {"format", t.format()}},
               value(t));
  };
  scaled("fsdp8_fp8_scale", "FP8 scale of each scaled tensor after the last step (x_fp8 = x * scale).",
         [](const v1::TensorScaling& t) { return static_cast<double>(t.scale()); });
  scaled("fsdp8_fp8_amax", "Newest amax of each FP8-scaled tensor (absolute maximum, its own unit).",
         [](const v1::TensorScaling& t) {
           return t.amax_history_size() > 0 ? static_cast<double>(t.amax_history(0)) : 0.0;
         });
  return w.text();
}

int64_t ResidentMemoryBytes() {
  FILE* f = fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long long size = 0, resident = 0;
  const int n = fscanf(f, "%lld %lld", &size, &resident);
  fclose(f);
  if (n != 2) return 0;
  return static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE);
}

}  // namespace fsdp8
