// The coordinator's HTTP endpoints (served on --metrics_port by common/http_server.h):
//   /metrics      Prometheus text format (coordinator/metrics.h)
//   /             the status page: jobs, workers, live loss and throughput charts (Chart.js)
//   /api/status   what the page shows, as JSON: {time, jobs[], workers[], chart_job, points[]};
//                 ?job=ID picks the charted job (default: the newest job with steps, running first);
//                 points: its newest steps, from its kept events (across coordinator restarts and
//                 resumes) and this process's recent steps
//   /chart.js     Chart.js from Debian's libjs-chart.js (found at run time, see ChartJsPath)
// Read-only; no authentication (bind --metrics_host to a private address).
//
// Thread-safety: ServeStatusHttp may run on several threads at once.
#pragma once

#include <string>

#include "common/http_server.h"
#include "coordinator/job_manager.h"
#include "coordinator/metrics.h"
#include "coordinator/worker_registry.h"

namespace fsdp8::coord {

HttpResponse ServeStatusHttp(const std::string& path, const std::string& query,
                             const JobManager& jobs, const WorkerRegistry& workers,
                             const CoordinatorMetrics& metrics);

// The installed Chart.js UMD bundle (libjs-chart.js, /usr/share/javascript/chart.js/), or
// NOT_FOUND naming the paths tried and the package to install.
absl::StatusOr<std::string> ChartJsPath();

// The /api/status document. chart_job: "" picks the default job.
std::string StatusJson(const JobManager& jobs, const WorkerRegistry& workers,
                       const CoordinatorMetrics& metrics, const std::string& chart_job);

}  // namespace fsdp8::coord
