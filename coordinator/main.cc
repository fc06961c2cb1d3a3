// fsdp8-coordinator: the cluster's coordinator daemon (see coordinator/services.h).
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <algorithm>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/flags_help.h"
#include "coordinator/log.h"
#include "coordinator/services.h"
#include "coordinator/status_page.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "address to serve gRPC on; port 0 picks a free port (printed on stdout)");
ABSL_FLAG(std::string, state_db, "./fsdp8-coordinator.db",
          "SQLite job table; \":memory:\" keeps it in memory");
ABSL_FLAG(std::string, data_roots, "",
          "comma-separated directories that job data paths must lie under; empty: no restriction");
ABSL_FLAG(double, heartbeat_timeout_s, 3,
          "a worker is dead after this long without a heartbeat (a hung worker is detected then)");
ABSL_FLAG(int32_t, heartbeat_interval_ms, 500, "how often workers are told to heartbeat");
ABSL_FLAG(double, step_timeout_s, 300, "deadline for every rank's result of one step");
ABSL_FLAG(double, start_timeout_s, 120, "deadline for every rank's Ready after an assignment");
ABSL_FLAG(int32_t, collective_timeout_ms, 30000, "collective timeout told to the workers");
ABSL_FLAG(double, abort_grace_s, 1,
          "after an Abort, its workers stay unassignable this long while they unwind the job");
ABSL_FLAG(bool, check_memory, true,
          "refuse at submit a job that the largest registered worker cannot hold, and start jobs "
          "only on workers that hold it, by the memory plan (docs/memory.md); false: any free "
          "workers, as an allocation failure then fails the job");
ABSL_FLAG(bool, dispatch_ahead, true,
          "send step k+1 to the workers while step k runs when no checkpoint save comes between "
          "them (hides the coordinator's per-step round trip)");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of the server; with --tls_key: TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require client certificates signed by it (mutual TLS)");
ABSL_FLAG(std::string, tokens, "",
          "bearer tokens file (\"TOKEN ROLE USER\" lines) or mounted Kubernetes secret directory; "
          "empty: no authentication");
ABSL_FLAG(int32_t, max_message_mb, 64, "largest gRPC message received or sent, MiB");
ABSL_FLAG(double, drain_timeout_s, 60,
          "on SIGTERM/SIGINT, wait this long for running jobs' checkpoints before exiting");
ABSL_FLAG(std::string, retain_ended_jobs, "1000,30d",
          "COUNT[,AGE]: keep at most COUNT ended jobs in the job table (the most recently ended) "
          "and none that ended more than AGE ago (a number with s, m, h or d; 0: no age limit); "
          "older ones are removed, never their checkpoints");
ABSL_FLAG(double, checkpoint_lease_s, 120,
          "lease on each running job's checkpoint.dir, renewed every quarter of it: another "
          "coordinator on the same storage refuses a take-over while it is live; longer than a "
          "restart of this coordinator (which renews it again), and than the hosts' clock skew; at "
          "least 10");
ABSL_FLAG(double, readopt_window_s, 30,
          "after a restart, wait this long at most for the workers of each job that was running "
          "to come back holding its generation, and re-adopt it without a checkpoint read; else "
          "(a rank missing or inconsistent) resume it from its checkpoint; 0: always from the "
          "checkpoint");
ABSL_FLAG(std::string, log_level, "info", "error, warning, info or debug (AdminService.SetLogLevel)");
ABSL_FLAG(std::string, log_format, "text",
          "text, or json: one JSON object per line on stderr (docs/logging.md)");
ABSL_FLAG(int, metrics_port, 0,
          "HTTP port for /metrics (Prometheus) and the status page at /; 0: off");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0", "address the metrics port binds (an IP literal)");

namespace {
using fsdp8::coord::Log;
using fsdp8::coord::LogLevel;

std::chrono::milliseconds Ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// "COUNT[,AGE]" of --retain_ended_jobs into the job manager's options; false when malformed.
bool ParseRetention(const std::string& v, fsdp8::coord::JobManagerOptions* o) {
  std::vector<std::string> parts = absl::StrSplit(v, ',');
  int64_t count = 0;
  if (parts.empty() || parts.size() > 2 || !absl::SimpleAtoi(parts[0], &count) || count < 0)
    return false;
  o->retain_ended_jobs = static_cast<size_t>(count);
  if (parts.size() == 1) return true;
  const std::string& age = parts[1];
  int64_t n = 0;
  if (age == "0") {
    o->retain_ended_age = std::chrono::seconds(0);
    return true;
  }
  if (age.size() < 2 || !absl::SimpleAtoi(age.substr(0, age.size() - 1), &n) || n < 0) return false;
  const char unit = age.back();
  const int64_t scale = unit == 's' ? 1 : unit == 'm' ? 60 : unit == 'h' ? 3600 : unit == 'd' ? 86400 : 0;
  if (scale == 0) return false;
  o->retain_ended_age = std::chrono::seconds(n * scale);
  return true;
}
}  // namespace

int main(int argc, char** argv) {
  fsdp8::SetDaemonHelp("fsdp8-coordinator [--listen host:port] [--data_roots DIRS] [--state_db FILE] ...",
                       "coordinator/main.cc", argc, argv);
  fsdp8::ParseOnOffFlags("coordinator/main.cc", argc, argv);
  absl::ParseCommandLine(argc, argv);

  // Handle SIGINT/SIGTERM on this thread only (every thread started later inherits the mask).
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  fsdp8::coord::CoordinatorOptions o;
  auto level = fsdp8::coord::ParseLogLevel(absl::GetFlag(FLAGS_log_level));
  if (!level.ok()) {
    fprintf(stderr, "fsdp8-coordinator: --log_%s\n", std::string(level.status().message()).c_str());
    return 2;
  }
  fsdp8::coord::SetLogLevel(*level);
  auto format = fsdp8::ParseLogFormat(absl::GetFlag(FLAGS_log_format));
  if (!format.ok()) {
    fprintf(stderr, "fsdp8-coordinator: --log_%s\n", std::string(format.status().message()).c_str());
    return 2;
  }
  fsdp8::SetLogFormat(*format);
  fsdp8::SetLogProcess("fsdp8-coordinator");
  o.listen = absl::GetFlag(FLAGS_listen);
  o.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key = absl::GetFlag(FLAGS_tls_key);
  o.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  o.tokens = absl::GetFlag(FLAGS_tokens);
  o.max_message_bytes = std::max(1, absl::GetFlag(FLAGS_max_message_mb)) << 20;
  o.jobs.state_db = absl::GetFlag(FLAGS_state_db);
  // A shorter lease lapses on a stalled renewal or a short restart; saves stop with half of it
  // left (SaveLeaseCheck), so a few seconds would stop them at every hiccup.
  if (!(absl::GetFlag(FLAGS_checkpoint_lease_s) >= 10)) {
    fprintf(stderr,
            "fsdp8-coordinator: --checkpoint_lease_s must be >= 10 (seconds; renewed every "
            "quarter of it, and a job saves only with more than half of it left), got %g\n",
            absl::GetFlag(FLAGS_checkpoint_lease_s));
    return 2;
  }
  o.jobs.checkpoint_lease = Ms(absl::GetFlag(FLAGS_checkpoint_lease_s));
  o.jobs.readopt_window = Ms(std::max(0.0, absl::GetFlag(FLAGS_readopt_window_s)));
  o.faults = fsdp8::FaultInjection::FromEnvironment();
  if (!ParseRetention(absl::GetFlag(FLAGS_retain_ended_jobs), &o.jobs)) {
    fprintf(stderr, "fsdp8-coordinator: --retain_ended_jobs must be COUNT[,AGE] (e.g. 1000,30d), "
                    "got \"%s\"\n", absl::GetFlag(FLAGS_retain_ended_jobs).c_str());
    return 2;
  }
  for (absl::string_view r :
       absl::StrSplit(absl::GetFlag(FLAGS_data_roots), ',', absl::SkipWhitespace()))
    o.jobs.data_roots.emplace_back(r);
  o.workers.version = FSDP8_VERSION;
  o.workers.heartbeat_timeout = Ms(absl::GetFlag(FLAGS_heartbeat_timeout_s));
  o.workers.heartbeat_interval_ms = absl::GetFlag(FLAGS_heartbeat_interval_ms);
  o.scheduler.step_timeout = Ms(absl::GetFlag(FLAGS_step_timeout_s));
  o.scheduler.start_timeout = Ms(absl::GetFlag(FLAGS_start_timeout_s));
  o.scheduler.collective_timeout_ms = absl::GetFlag(FLAGS_collective_timeout_ms);
  o.scheduler.abort_grace = Ms(absl::GetFlag(FLAGS_abort_grace_s));
  o.scheduler.dispatch_ahead = absl::GetFlag(FLAGS_dispatch_ahead);
  o.scheduler.check_memory = absl::GetFlag(FLAGS_check_memory);
  o.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  o.metrics_port = absl::GetFlag(FLAGS_metrics_port);

  if (o.workers.heartbeat_interval_ms < 1 ||
      std::chrono::milliseconds(o.workers.heartbeat_interval_ms) >= o.workers.heartbeat_timeout) {
    fprintf(stderr, "fsdp8-coordinator: --heartbeat_interval_ms must be >= 1 and below "
                    "--heartbeat_timeout_s\n");
    return 2;  // a bad flag value, as for the other flags
  }
  if (o.scheduler.start_timeout <= std::chrono::milliseconds(o.scheduler.collective_timeout_ms)) {
    fprintf(stderr, "fsdp8-coordinator: warning: --start_timeout_s is not above "
                    "--collective_timeout_ms; a rank still blocked in a collective of a failed "
                    "generation may make the next generation's rendezvous time out\n");
  }
  auto server = fsdp8::coord::CoordinatorServer::Start(o);
  if (!server.ok()) {
    Log(LogLevel::kError, server.status().ToString());
    return 1;
  }
  printf("fsdp8-coordinator listening on %s\n", (*server)->address().c_str());
  if ((*server)->metrics_port() != 0) {
    printf("fsdp8-coordinator status page on http://%s:%d/ (metrics at /metrics)\n",
           o.metrics_host.c_str(), (*server)->metrics_port());
    auto chart = fsdp8::coord::ChartJsPath();
    if (!chart.ok())
      Log(LogLevel::kWarning,
          absl::StrCat("status page charts off: ", chart.status().message()));
  }
  fflush(stdout);
  Log(LogLevel::kInfo,
      absl::StrCat("version ", FSDP8_VERSION, ": state db ", o.jobs.state_db, ", data roots ",
                   o.jobs.data_roots.empty() ? "(any)" : absl::GetFlag(FLAGS_data_roots), ", ",
                   o.tls_cert.empty() ? "plaintext" : o.tls_client_ca.empty() ? "TLS" : "mutual TLS",
                   ", ", o.tokens.empty() ? "no authentication" : "bearer tokens"));
  if (!o.tokens.empty() && o.tls_cert.empty())
    Log(LogLevel::kWarning, "bearer tokens travel in clear text without --tls_cert/--tls_key");

  int sig = 0;
  sigwait(&sigs, &sig);
  Log(LogLevel::kInfo,
      absl::StrCat("signal ", sig, ", draining (health NOT_SERVING, checkpoints)"));
  for (const std::string& line :
       (*server)->Drain(Ms(absl::GetFlag(FLAGS_drain_timeout_s))))
    Log(LogLevel::kInfo, absl::StrCat("drain: ", line));
  Log(LogLevel::kInfo, "shutting down");
  (*server)->Shutdown();
  server->reset();
  Log(LogLevel::kInfo, "stopped");
  return 0;
}
