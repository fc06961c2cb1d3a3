// fsdp8-worker: one rank of fsdp8 training jobs (see worker/daemon.h).
#include <pthread.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/flags_help.h"
#include "common/http_server.h"
#include "common/log.h"
#include "common/rpc_channel.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/backend.h"
#include "kernels/device_memory.h"
#include "worker/daemon.h"
#include "worker/metrics.h"
#include "worker/nvlink_domain.h"
#include "worker/settings.h"

extern "C" void openblas_set_num_threads(int);

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051", "coordinator address host:port");
ABSL_FLAG(std::string, host, "127.0.0.1", "address peers use to reach this worker (Gloo TCP)");
ABSL_FLAG(std::string, placement_domain, "",
          "the NVLink island of this worker's device within its host, for the placement of "
          "hybrid-sharded jobs' shard groups (any name; devices naming the same one are one domain); "
          "empty: on the cuda backend, detected from the device's NVLinks through NVML "
          "(worker/nvlink_domain.h; \"\" when there are none or NVML is missing: the whole host), "
          "on the cpu backends the whole host");
ABSL_FLAG(bool, print_placement_domain, false,
          "print the placement domain this worker would register (--placement_domain, else the "
          "one detected for --device on the cuda backend) and how it was found, then exit");
ABSL_FLAG(std::string, backend, "cpu", "compute backend this worker offers: cpu or cuda");
ABSL_FLAG(int, device, 0, "GPU ordinal (cuda backend)");
ABSL_FLAG(int, threads, 1, "BLAS threads for the CPU backend");
ABSL_FLAG(int, connect_timeout_s, 60,
          "give up when the coordinator does not answer this long (seconds; 0: keep retrying)");
ABSL_FLAG(int, hold_job_s, 60,
          "when the coordinator's session ends while a job runs, keep the job (trainer, "
          "communicators, training state) this long for a restarted coordinator to re-adopt "
          "(seconds; 0: drop it at once)");
ABSL_FLAG(std::string, name, "",
          "stable worker id (e.g. the pod name): kept across session losses and restarts of this "
          "worker or the coordinator; 1-63 of [A-Za-z0-9._-]; empty: the coordinator assigns w-<n>");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle to verify the coordinator with (TLS); "
          "default $FSDP8_TLS_CA");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mutual TLS); default $FSDP8_TLS_CERT");
ABSL_FLAG(std::string, tls_key, "", "PEM key of --tls_cert; default $FSDP8_TLS_KEY");
ABSL_FLAG(std::string, token_file, "",
          "file holding this worker's bearer token (role worker); default $FSDP8_TOKEN_FILE, "
          "or the token itself in $FSDP8_TOKEN");
ABSL_FLAG(int, metrics_port, 0, "serve Prometheus metrics on http://metrics_host:PORT/metrics; 0: off");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0", "address the metrics port binds (an IP literal)");
ABSL_FLAG(std::string, log_format, "text",
          "text, or json: one JSON object per line on stderr (docs/logging.md)");
ABSL_FLAG(int64_t, memory_limit_mb, 0,
          "most memory a job's buffers may take on this worker's device (host memory for the cpu "
          "backend), MiB; an allocation beyond it fails the job with RESOURCE_EXHAUSTED as an "
          "exhausted device does; 0: no limit but the device's. Reported at registration as the "
          "memory the coordinator plans jobs with (default: a GPU's total memory; for cpu "
          "workers, the host's RAM or its cgroup's memory limit, divided by the cpu workers registered "
          "from this host)");
ABSL_FLAG(int, health_port, 0,
          "serve grpc.health.v1 on 0.0.0.0:PORT (Kubernetes gRPC probes): service \"\" is SERVING "
          "while the process runs, service \"ready\" while registered with the coordinator; 0: off");

namespace {

using fsdp8::WorkerDaemon;

// Threads started before main (OpenBLAS's pool, created by its library constructor) do not block
// SIGTERM / SIGINT, so the kernel may deliver them there; this handler hands such a signal on to
// the watcher thread, whose sigwait then takes it (pthread_kill is async-signal-safe).
pthread_t g_watcher;
std::atomic<bool> g_watcher_started{false};
void ForwardToWatcher(int sig) {
  if (g_watcher_started.load()) pthread_kill(g_watcher, sig);
}

// Blocks SIGTERM and SIGINT in the calling thread, before any thread of ours starts, so that every
// such thread inherits the mask (see ForwardToWatcher for the others); returns the set.
sigset_t BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

// Takes the blocked stop signals on its own thread (sigwait) and shuts the daemon down. Stop()
// joins the thread; call it before the daemon is destroyed, so that it never touches a freed one.
class SignalWatcher {
 public:
  SignalWatcher(sigset_t set, WorkerDaemon* daemon) {
    thread_ = std::thread([set, daemon, this] {
      for (;;) {
        int sig = 0;
        sigwait(&set, &sig);
        if (done_.load()) return;
        fsdp8::Log(fsdp8::LogLevel::kInfo, absl::StrCat("signal ", sig, ": shutting down"));
        daemon->Shutdown();
      }
    });
    g_watcher = thread_.native_handle();
    g_watcher_started = true;
    struct sigaction sa {};
    sa.sa_handler = ForwardToWatcher;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);
  }
  ~SignalWatcher() {
    if (thread_.joinable()) Stop();
  }
  void Stop() {
    done_ = true;
    pthread_kill(thread_.native_handle(), SIGTERM);  // blocked everywhere: only sigwait takes it
    thread_.join();
  }

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// grpc.health.v1 on 0.0.0.0:port for probes, plaintext and nothing else: service "" is SERVING
// while the process runs, service "ready" while the daemon is registered (polled every 200 ms).
class HealthServer {
 public:
  ~HealthServer() { Stop(); }
  // False when the port cannot be bound.
  bool Start(int port, const WorkerDaemon* daemon) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder b;
    int bound = 0;
    b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a taken port fails, not shared
    b.AddListeningPort(absl::StrCat("0.0.0.0:", port), grpc::InsecureServerCredentials(), &bound);
    b.RegisterCallbackGenericService(&unimplemented_);
    server_ = b.BuildAndStart();
    if (!server_ || bound == 0) return false;
    server_->GetHealthCheckService()->SetServingStatus("ready", false);
    updater_ = std::thread([this, daemon] {
      bool last = false;
      while (!stop_.load()) {
        const bool now = daemon->registered();
        if (now != last) server_->GetHealthCheckService()->SetServingStatus("ready", now);
        last = now;
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    });
    return true;
  }
  // Stops the updater and the server (within 1 s); a no-op when not started.
  void Stop() {
    if (!updater_.joinable()) return;
    stop_ = true;
    updater_.join();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

 private:
  // The builder wants at least one service of its own before it starts (the health service is
  // added at start); this one answers UNIMPLEMENTED to everything.
  grpc::CallbackGenericService unimplemented_;
  std::unique_ptr<grpc::Server> server_;
  std::thread updater_;
  std::atomic<bool> stop_{false};
};

// The flag's value, else its default from the environment.
std::string FlagOr(const std::string& flag, const std::string& from_environment) {
  return flag.empty() ? from_environment : flag;
}

// The channel to the coordinator: TLS from --tls_ca, --tls_cert, --tls_key and the bearer token
// from --token_file, each defaulting to its environment variable, else the token in FSDP8_TOKEN.
absl::StatusOr<std::shared_ptr<grpc::Channel>> CoordinatorChannel(
    const std::string& address, const fsdp8::WorkerSettings& settings) {
  fsdp8::ChannelSecurity sec;
  sec.tls_ca = FlagOr(absl::GetFlag(FLAGS_tls_ca), settings.tls_ca);
  sec.tls_cert = FlagOr(absl::GetFlag(FLAGS_tls_cert), settings.tls_cert);
  sec.tls_key = FlagOr(absl::GetFlag(FLAGS_tls_key), settings.tls_key);
  if (const std::string f = FlagOr(absl::GetFlag(FLAGS_token_file), settings.token_file);
      !f.empty()) {
    absl::StatusOr<std::string> t = fsdp8::ReadTokenFile(f);
    if (!t.ok()) return t.status();
    sec.token = *t;
  } else {
    sec.token = settings.token;
  }
  return fsdp8::MakeChannel(address, sec);
}

// Serves `metrics` on http://--metrics_host:--metrics_port/metrics; null when the port is 0.
absl::StatusOr<std::unique_ptr<fsdp8::HttpServer>> StartMetricsServer(
    fsdp8::WorkerMetrics* metrics) {
  if (absl::GetFlag(FLAGS_metrics_port) == 0) return nullptr;
  auto s = fsdp8::HttpServer::Start(
      absl::GetFlag(FLAGS_metrics_host), absl::GetFlag(FLAGS_metrics_port),
      [metrics](const std::string& path, const std::string&) {
        if (path == "/metrics")
          return fsdp8::HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8",
                                     metrics->Render()};
        return fsdp8::HttpResponse{404, "text/plain; charset=utf-8", "not found; try /metrics\n"};
      });
  if (!s.ok()) return s.status();
  fsdp8::Log(fsdp8::LogLevel::kInfo, absl::StrCat("metrics on http://",
                                                  absl::GetFlag(FLAGS_metrics_host), ":",
                                                  (*s)->port(), "/metrics"));
  return std::move(*s);
}

// The placement domain to register: --placement_domain when given, else on the cuda backend the
// device's NVLink domain (NVML), else "" (the whole host); *how says where it came from.
std::string PlacementDomain(const std::string& backend, int device, std::string* how) {
  std::string flag = absl::GetFlag(FLAGS_placement_domain);
  if (!flag.empty()) {
    *how = "given by --placement_domain";
    return flag;
  }
  if (backend != "cuda") {
    *how = "not detected on the " + backend + " backend";
    return "";
  }
  fsdp8::NvLinkDomain d = fsdp8::DetectCudaNvLinkDomain(device);
  *how = "detected: " + d.how;
  return d.name;
}

// The daemon's options from the flags and the environment's settings (no channel yet); *domain_how
// says where opts.placement_domain came from.
fsdp8::DaemonOptions OptionsFromFlags(fsdp8::WorkerSettings settings, std::string* domain_how) {
  fsdp8::DaemonOptions opts;
  opts.coordinator = absl::GetFlag(FLAGS_coordinator);
  opts.host = absl::GetFlag(FLAGS_host);
  opts.backend = absl::GetFlag(FLAGS_backend);
  opts.device = absl::GetFlag(FLAGS_device);
  opts.placement_domain = PlacementDomain(opts.backend, opts.device, domain_how);
  opts.connect_timeout_s = absl::GetFlag(FLAGS_connect_timeout_s);
  opts.name = absl::GetFlag(FLAGS_name);
  opts.hold_job_s = std::max(0, absl::GetFlag(FLAGS_hold_job_s));
  opts.settings = std::move(settings);
  const int64_t limit = std::max<int64_t>(0, absl::GetFlag(FLAGS_memory_limit_mb)) << 20;
  opts.settings.backend.memory_limit_bytes = limit;
  // What the coordinator plans with (common/memory_plan.h): the device's memory, or the limit.
  std::string err;
  const int64_t device = fsdp8::DeviceMemoryBytes(opts.backend == "cuda" ? "cuda" : "cpu",
                                                  opts.device, &err);
  if (device == 0) fsdp8::Log(fsdp8::LogLevel::kWarning, absl::StrCat("device memory unknown: ", err));
  opts.memory_bytes = limit > 0 && (device == 0 || limit < device) ? limit : device;
  opts.memory_shared = opts.backend != "cuda" && limit == 0;  // the host's RAM, shared
  return opts;
}

// The start line: version, coordinator address, this worker's address, backend and device.
void PrintStartLine(const fsdp8::DaemonOptions& o) {
  std::string device;
  if (o.backend == "cpu") {
    std::string err;
    auto be = fsdp8::CreateBackend("cpu", 0, &err);  // which CPU kernels this CPU runs
    const std::string kernels = !be ? "?" : be->Name() == "cpu" ? "AVX2+FMA+F16C" : "reference";
    device = absl::StrCat("host CPU (", kernels, " kernels, ",
                          std::max(1, absl::GetFlag(FLAGS_threads)), " BLAS thread(s))");
  } else {
    device = absl::StrCat("GPU ", o.device);
  }
  fsdp8::Log(fsdp8::LogLevel::kInfo,
             absl::StrCat("version ", FSDP8_VERSION, ": coordinator ", o.coordinator, ", host ",
                          o.host, ", name ", o.name.empty() ? "(assigned)" : o.name,
                          ", backend ", o.backend, ", device ", device));
}

// A job keeps each of its token shards open while it runs (common/token_shard.h, TokenShardReader):
// the soft limit on open files is raised to the hard one, so that a corpus of thousands of shards
// does not run into the usual soft limit of 1,024.
void RaiseOpenFileLimit() {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max) return;
  rl.rlim_cur = rl.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
    fsdp8::Log(fsdp8::LogLevel::kWarning, "cannot raise the open-file limit to its hard limit");
  }
}

int Fail(absl::string_view what) {
  std::cerr << "fsdp8-worker: " << what << std::endl;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp8::SetDaemonHelp("fsdp8-worker --coordinator host:port [--host ip] [--name NAME] [--threads N] ...",
                       "worker/main.cc", argc, argv);
  fsdp8::ParseOnOffFlags("worker/main.cc", argc, argv);
  absl::ParseCommandLine(argc, argv);
  const sigset_t stop_signals = BlockStopSignals();
  signal(SIGPIPE, SIG_IGN);
  openblas_set_num_threads(std::max(1, absl::GetFlag(FLAGS_threads)));
  auto log_format = fsdp8::ParseLogFormat(absl::GetFlag(FLAGS_log_format));
  if (!log_format.ok()) return Fail(absl::StrCat("--log_", log_format.status().message()));
  fsdp8::SetLogFormat(*log_format);
  fsdp8::SetLogProcess("fsdp8-worker");
  RaiseOpenFileLimit();
  if (absl::GetFlag(FLAGS_print_placement_domain)) {
    std::string how;
    const std::string domain =
        PlacementDomain(absl::GetFlag(FLAGS_backend), absl::GetFlag(FLAGS_device), &how);
    std::cout << "placement_domain: \"" << domain << "\"\n" << "how: " << how << std::endl;
    return 0;
  }

  absl::StatusOr<fsdp8::WorkerSettings> settings = fsdp8::WorkerSettings::FromEnvironment();
  if (!settings.ok()) return Fail(settings.status().message());
  std::string domain_how;
  fsdp8::DaemonOptions opts = OptionsFromFlags(*std::move(settings), &domain_how);
  PrintStartLine(opts);
  fsdp8::Log(fsdp8::LogLevel::kInfo,
             absl::StrCat("placement domain \"", opts.placement_domain, "\"",
                          opts.placement_domain.empty() ? " (the whole host)" : "", ": ", domain_how));
  auto channel = CoordinatorChannel(opts.coordinator, opts.settings);
  if (!channel.ok()) return Fail(channel.status().message());
  opts.channel = *channel;
  fsdp8::WorkerMetrics metrics(opts.backend, opts.device);
  auto http = StartMetricsServer(&metrics);
  if (!http.ok()) return Fail(absl::StrCat("--metrics_port: ", http.status().message()));
  if (*http) opts.metrics = &metrics;
  auto daemon = std::make_unique<WorkerDaemon>(opts);

  HealthServer health;
  const int health_port = absl::GetFlag(FLAGS_health_port);
  if (health_port > 0 && !health.Start(health_port, daemon.get())) {
    std::cerr << "[worker] --health_port: cannot listen on 0.0.0.0:" << health_port << std::endl;
    return 2;
  }
  SignalWatcher watcher(stop_signals, daemon.get());
  const int rc = daemon->Run();
  health.Stop();
  watcher.Stop();
  daemon.reset();  // aborts the current job's communicator and joins the job thread
  http->reset();
  std::cerr.flush();
  std::_Exit(rc);
}
