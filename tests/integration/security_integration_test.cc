// End to end on loopback with security on: a real fsdp8-coordinator with mutual TLS and bearer
// tokens, a real fsdp8-worker authenticated on the worker control channel (client certificate and
// worker token), a job submitted through the SDK with a submitter token; then SIGTERM on the
// coordinator drains it: the running job commits a checkpoint through the checkpoint mechanism and
// the coordinator exits 0. A worker without a token is refused and exits 1.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "common/token_shard.h"
#include "gtest/gtest.h"
#include "tests/coordinator/certs.h"
#include "tests/coordinator/test_util.h"

extern char** environ;

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

class Process {
 public:
  Process(const std::vector<std::string>& argv, const std::string& log_path) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  ~Process() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    if (Wait(5s) == kStillRunning) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  static constexpr int kStillRunning = -1000;
  // The exit status (128 + signal when killed), or kStillRunning after `timeout`.
  int Wait(std::chrono::milliseconds timeout) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      int st = 0;
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      if (std::chrono::steady_clock::now() >= until) return kStillRunning;
      std::this_thread::sleep_for(20ms);
    }
  }
  void Signal(int sig) const {
    if (pid_ > 0) kill(pid_, sig);
  }
  bool ok() const { return pid_ > 0; }

 private:
  pid_t pid_ = -1;
};

std::string ReadFile(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(SecureCluster, MutualTlsTokensAndSigtermDrainWithACheckpoint) {
  testing::TempDir dir;
  testing::TestCerts certs;
  ASSERT_TRUE(testing::MakeTestCerts(dir.path(), &certs));
  const std::string submitter = "alice-submitter-token-0001", worker = "worker-pool-token-00000004";
  std::ofstream(dir.File("tokens")) << submitter << " submitter alice\n"
                                    << "root-admin-token-000000003 admin root\n"
                                    << worker << " worker pool\n";
  std::ofstream(dir.File("worker-token")) << worker << "\n";
  const std::string train = testing::WriteTokens(dir, "train.bin", 20000);

  Process coord({FSDP8_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state_db", ":memory:",
                 "--data_roots", dir.path(), "--tls_cert", certs.server_cert, "--tls_key",
                 certs.server_key, "--tls_client_ca", certs.ca, "--tokens", dir.File("tokens"),
                 "--drain_timeout_s", "60", "--heartbeat_timeout_s", "10"},
                dir.File("coordinator.log"));
  ASSERT_TRUE(coord.ok());
  std::string port;
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        const std::string log = ReadFile(dir.File("coordinator.log"));
        const std::string key = "listening on 127.0.0.1:";
        const size_t at = log.find(key);
        if (at == std::string::npos) return false;
        const size_t end = log.find('\n', at);
        if (end == std::string::npos) return false;
        port = log.substr(at + key.size(), end - at - key.size());
        return true;
      },
      30))
      << ReadFile(dir.File("coordinator.log"));
  const std::string address = "localhost:" + port;

  // No token: the worker is refused (UNAUTHENTICATED) and gives up at once with exit status 1.
  Process rogue({FSDP8_WORKER_BIN, "--coordinator", address, "--tls_ca", certs.ca, "--tls_cert",
                 certs.client_cert, "--tls_key", certs.client_key, "--connect_timeout_s", "20"},
                dir.File("rogue.log"));
  EXPECT_EQ(rogue.Wait(30s), 1) << ReadFile(dir.File("rogue.log"));
  EXPECT_NE(ReadFile(dir.File("rogue.log")).find("registration refused"), std::string::npos)
      << ReadFile(dir.File("rogue.log"));

  Process w({FSDP8_WORKER_BIN, "--coordinator", address, "--tls_ca", certs.ca, "--tls_cert",
             certs.client_cert, "--tls_key", certs.client_key, "--token_file",
             dir.File("worker-token"), "--connect_timeout_s", "30"},
            dir.File("worker.log"));
  ASSERT_TRUE(w.ok());

  ChannelSecurity sec;
  sec.tls_ca = certs.ca;
  sec.tls_cert = certs.client_cert;
  sec.tls_key = certs.client_key;
  sec.token = submitter;
  auto client = Client::Connect(address, sec);
  ASSERT_TRUE(client.ok()) << client.status();
  v1::JobSpec spec = testing::SmallSpec(train, 1, 1000000);
  spec.mutable_checkpoint()->set_dir(dir.File("ck"));
  auto job = (*client)->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->owner(), "alice");
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        auto j = (*client)->GetJob(job->job_id());
        return j.ok() && j->state() == v1::JOB_STATE_RUNNING && j->step() >= 3;
      },
      60))
      << ReadFile(dir.File("coordinator.log")) << ReadFile(dir.File("worker.log"));

  coord.Signal(SIGTERM);
  const int rc = coord.Wait(90s);
  const std::string log = ReadFile(dir.File("coordinator.log"));
  EXPECT_EQ(rc, 0) << log;
  const std::string committed = job->job_id() + ": checkpoint step-";
  const size_t at = log.find("drain: " + committed);
  ASSERT_NE(at, std::string::npos) << log;
  EXPECT_NE(log.find(" committed", at), std::string::npos) << log;
  // The checkpoint the drain names is on disk with its MANIFEST (committed).
  const size_t num = at + std::string("drain: ").size() + committed.size();
  const std::string step = log.substr(num, log.find(' ', num) - num);
  EXPECT_TRUE(fs::exists(dir.File("ck/step-" + step + "/MANIFEST"))) << step << "\n" << log;
  EXPECT_TRUE(fs::exists(dir.File("ck/step-" + step + "/rank-0.ckpt")));
}

}  // namespace
}  // namespace fsdp8
