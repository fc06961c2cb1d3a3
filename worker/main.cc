// fsdp8-worker: one rank of fsdp8 training jobs (see worker/daemon.h).
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/flags_help.h"
#include "common/http_server.h"
#include "common/rpc_channel.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "worker/daemon.h"
#include "worker/metrics.h"

extern "C" void openblas_set_num_threads(int);

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051", "coordinator address host:port");
ABSL_FLAG(std::string, host, "127.0.0.1", "address peers use to reach this worker (Gloo TCP)");
ABSL_FLAG(std::string, backend, "cpu", "compute backend this worker offers: cpu or cuda");
ABSL_FLAG(int, device, 0, "GPU ordinal (cuda backend)");
ABSL_FLAG(int, threads, 1, "BLAS threads for the CPU backend");
ABSL_FLAG(int, connect_timeout_s, 60, "give up when the coordinator does not answer this long");
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
ABSL_FLAG(int, health_port, 0,
          "serve grpc.health.v1 on 0.0.0.0:PORT (Kubernetes gRPC probes): service \"\" is SERVING "
          "while the process runs, service \"ready\" while registered with the coordinator; 0: off");

namespace {
// Threads started before main (OpenBLAS's pool, created by its library constructor) do not block
// SIGTERM / SIGINT, so the kernel may deliver them there; this handler hands such a signal on to
// the watcher thread, whose sigwait then takes it (pthread_kill is async-signal-safe).
pthread_t g_watcher;
std::atomic<bool> g_watcher_started{false};
void ForwardToWatcher(int sig) {
  if (g_watcher_started.load()) pthread_kill(g_watcher, sig);
}
}  // namespace

int main(int argc, char** argv) {
  fsdp8::SetDaemonHelp("fsdp8 worker: fsdp8-worker --coordinator host:port [--host ip] ...",
                       "worker/main.cc");
  absl::ParseCommandLine(argc, argv);

  // SIGTERM / SIGINT are taken by a watcher thread (sigwait); they are blocked before any thread of
  // ours starts so every such thread inherits the mask (see ForwardToWatcher for the others).
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
  openblas_set_num_threads(std::max(1, absl::GetFlag(FLAGS_threads)));

  fsdp8::DaemonOptions opts;
  opts.coordinator = absl::GetFlag(FLAGS_coordinator);
  opts.host = absl::GetFlag(FLAGS_host);
  opts.backend = absl::GetFlag(FLAGS_backend);
  opts.device = absl::GetFlag(FLAGS_device);
  opts.connect_timeout_s = absl::GetFlag(FLAGS_connect_timeout_s);
  opts.name = absl::GetFlag(FLAGS_name);
  auto setting = [](std::string v, const char* env) {
    if (v.empty()) {
      const char* e = std::getenv(env);
      if (e) v = e;
    }
    return v;
  };
  fsdp8::ChannelSecurity sec;
  sec.tls_ca = setting(absl::GetFlag(FLAGS_tls_ca), "FSDP8_TLS_CA");
  sec.tls_cert = setting(absl::GetFlag(FLAGS_tls_cert), "FSDP8_TLS_CERT");
  sec.tls_key = setting(absl::GetFlag(FLAGS_tls_key), "FSDP8_TLS_KEY");
  if (const std::string f = setting(absl::GetFlag(FLAGS_token_file), "FSDP8_TOKEN_FILE"); !f.empty()) {
    auto t = fsdp8::ReadTokenFile(f);
    if (!t.ok()) {
      std::cerr << "fsdp8-worker: " << t.status().message() << std::endl;
      return 2;
    }
    sec.token = *t;
  } else {
    sec.token = setting("", "FSDP8_TOKEN");
  }
  auto channel = fsdp8::MakeChannel(opts.coordinator, sec);
  if (!channel.ok()) {
    std::cerr << "fsdp8-worker: " << channel.status().message() << std::endl;
    return 2;
  }
  opts.channel = *channel;
  fsdp8::WorkerMetrics metrics(opts.backend, opts.device);
  std::unique_ptr<fsdp8::HttpServer> http;
  if (absl::GetFlag(FLAGS_metrics_port) != 0) {
    auto s = fsdp8::HttpServer::Start(
        absl::GetFlag(FLAGS_metrics_host), absl::GetFlag(FLAGS_metrics_port),
        [&metrics](const std::string& path, const std::string&) {
          if (path == "/metrics")
            return fsdp8::HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8",
                                       metrics.Render()};
          return fsdp8::HttpResponse{404, "text/plain; charset=utf-8", "not found; try /metrics\n"};
        });
    if (!s.ok()) {
      std::cerr << "fsdp8-worker: --metrics_port: " << s.status().message() << std::endl;
      return 2;
    }
    http = std::move(*s);
    std::cerr << "[worker] metrics on http://" << absl::GetFlag(FLAGS_metrics_host) << ":"
              << http->port() << "/metrics" << std::endl;
    opts.metrics = &metrics;
  }
  auto daemon = std::make_unique<fsdp8::WorkerDaemon>(opts);

  // Health server for probes: plaintext, nothing but grpc.health.v1.
  std::unique_ptr<grpc::Server> health;
  // The builder wants at least one service of its own before it starts (the health service is
  // added at start); this one answers UNIMPLEMENTED to everything.
  grpc::CallbackGenericService unimplemented;
  std::thread health_updater;
  std::atomic<bool> stop_health{false};
  if (const int port = absl::GetFlag(FLAGS_health_port); port > 0) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder b;
    int bound = 0;
    b.AddListeningPort(absl::StrCat("0.0.0.0:", port), grpc::InsecureServerCredentials(), &bound);
    b.RegisterCallbackGenericService(&unimplemented);
    health = b.BuildAndStart();
    if (!health || bound == 0) {
      std::cerr << "[worker] --health_port: cannot listen on 0.0.0.0:" << port << std::endl;
      return 2;
    }
    health->GetHealthCheckService()->SetServingStatus("ready", false);
    health_updater = std::thread([&] {
      bool last = false;
      while (!stop_health.load()) {
        const bool now = daemon->registered();
        if (now != last) health->GetHealthCheckService()->SetServingStatus("ready", now);
        last = now;
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    });
  }
  // The watcher is joined before the daemon is destroyed, so it never touches a freed daemon.
  // Once Run returns, main sets `done` and wakes it with a thread-directed SIGTERM.
  std::atomic<bool> done{false};
  std::thread watcher([d = daemon.get(), set, &done] {
    for (;;) {
      int sig = 0;
      sigwait(&set, &sig);
      if (done.load()) return;
      std::cerr << "[worker] signal " << sig << ": shutting down" << std::endl;
      d->Shutdown();
    }
  });
  g_watcher = watcher.native_handle();
  g_watcher_started = true;
  struct sigaction sa {};
  sa.sa_handler = ForwardToWatcher;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  const int rc = daemon->Run();
  if (health) {
    stop_health = true;
    health_updater.join();
    health->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
  done = true;
  pthread_kill(watcher.native_handle(), SIGTERM);  // blocked everywhere: only sigwait takes it
  watcher.join();
  daemon.reset();  // aborts the current job's communicator and joins the job thread
  http.reset();
  std::cerr.flush();
  std::_Exit(rc);
}
