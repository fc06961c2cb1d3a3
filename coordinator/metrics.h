// CoordinatorMetrics: what the coordinator serves on --metrics_port at /metrics (Prometheus text
// format, common/prometheus_text.h), and the recent steps the status page charts.
//
// Fed by the step driver (OnStep, once per completed step with every rank's StepResult); Render
// adds what JobManager and WorkerRegistry hold at scrape time (job states and restarts, workers,
// the FP8 scaling state the ranks last reported). Counters count what this coordinator process
// observed (they restart at 0 with it, as Prometheus expects of counters). Units: seconds, bytes,
// tokens; losses in nats per token.
//
// Kept in memory: the last kMaxJobs jobs that ran a step, kMaxPoints recent steps each.
//
// Thread-safety: every method may be called from any thread (internally locked).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#include "common/prometheus_text.h"
#include "coordinator/job_manager.h"
#include "coordinator/worker_registry.h"
#include "fsdp8/v1/jobs.pb.h"
#include "fsdp8/v1/worker.pb.h"

namespace fsdp8::coord {

class CoordinatorMetrics {
 public:
  static constexpr size_t kMaxJobs = 50;
  static constexpr size_t kMaxPoints = 1000;

  // One recent step of a job (status page charts).
  struct Point {
    int64_t step = 0;            // steps completed (1-based)
    double loss = 0;             // nats per token
    double val_loss = 0;         // NaN unless evaluated at this step
    double tokens_per_second = 0;
    double step_seconds = 0;
    double time = 0;             // seconds since the Unix epoch
  };

  // A step the ranks completed: `ev` as JobRun hands it to JobManager::RecordStep right after
  // (called first, so a watcher that saw the step's event scrapes it counted; a step completed just
  // as its job was cancelled is counted here though the job table drops it), `results` by rank.
  void OnStep(const std::string& job_id, const v1::JobEvent& ev,
              const std::vector<v1::StepResult>& results);
  // The job's recent steps, oldest first (empty for a job this process saw no step of).
  std::vector<Point> Recent(const std::string& job_id) const;
  // The exposition text.
  std::string Render(const JobManager& jobs, const WorkerRegistry& workers) const;

 private:
  struct RankSeries {
    double all_gather_bytes = 0, reduce_scatter_bytes = 0, comm_seconds = 0, compute_seconds = 0;
    int64_t peak_memory_bytes = 0;
  };
  struct JobSeries {
    int64_t steps = 0, tokens = 0;
    double loss = 0, val_loss = 0, grad_norm = 0, lr = 0, tokens_per_second = 0;
    bool has_val = false;
    prom::Histogram step_seconds{prom::StepDurationBuckets()};
    std::vector<RankSeries> ranks;  // index = rank
    std::deque<Point> points;
    uint64_t touched = 0;           // order of the last update, for eviction
  };

  // Per-job step series and per-rank series of the jobs in jobs_.
  void RenderSteps(prom::ExpositionWriter* w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RenderRanks(prom::ExpositionWriter* w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, JobSeries> jobs_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace fsdp8::coord
