// What fsdp8-worker serves on --metrics_port (Prometheus text format, common/prometheus_text.h):
// per (job, rank) the steps, tokens, step duration histogram, compute and communication seconds,
// bytes per collective (the communicator's own counters, comm/communicator.h: all_gather the
// gathered output, reduce_scatter its f32 input, all_reduce its buffer), the rank's loss, grad
// norm, learning rate, peak device memory and the FP8 scale and newest amax of every scaled
// tensor; per process the resident memory and the assignments, failures and aborts it has seen.
//
// Thread-safety: internally locked (the daemon's job thread writes, the HTTP threads render).
#pragma once

#include <cstdint>
#include <deque>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#include "common/prometheus_text.h"
#include "fsdp8/v1/admin.pb.h"
#include "fsdp8/v1/worker.pb.h"
#include "comm/communicator.h"

namespace fsdp8 {

class WorkerMetrics {
 public:
  // backend ("cpu"/"cuda") and device label fsdp8_worker_info.
  WorkerMetrics(std::string backend, int device);
  void SetWorkerId(const std::string& id);
  void OnAssignment();
  void OnFailure();
  void OnAbort();
  // One completed step of (job, rank): `result` as sent to the coordinator, `step_seconds` the
  // step's wall time on this worker, `comm` what the communicator moved since the last report,
  // `scaling` the rank's FP8 scaling state after the step (replaces the previous one).
  void OnStep(const std::string& job_id, int rank, const v1::StepResult& result,
              double step_seconds, const CommBytes& comm, const v1::ScalingState& scaling);
  // The exposition text.
  std::string Render() const;

 private:
  struct Series {
    std::string job_id;
    int rank = 0;
    int64_t steps = 0, tokens = 0, last_step = -1;
    double compute_seconds = 0, comm_seconds = 0;
    double loss = 0, grad_norm = 0, lr = 0;
    int64_t peak_memory_bytes = 0;
    CommBytes comm;
    prom::Histogram step_seconds{prom::StepDurationBuckets()};
  };
  static constexpr size_t kMaxSeries = 8;  // (job, rank) pairs kept, newest last

  const std::string backend_;
  const int device_;
  mutable absl::Mutex mu_;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  int64_t assignments_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t failures_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t aborts_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Series> series_ ABSL_GUARDED_BY(mu_);
  std::string scaling_job_ ABSL_GUARDED_BY(mu_);
  int scaling_rank_ ABSL_GUARDED_BY(mu_) = 0;
  v1::ScalingState scaling_ ABSL_GUARDED_BY(mu_);
};

// This process's resident set size in bytes (/proc/self/statm), 0 when unreadable.
int64_t ResidentMemoryBytes();

}  // namespace fsdp8
