// End to end on loopback with security on: a real fsdp8-coordinator with mutual TLS and bearer
// tokens, a real fsdp8-worker authenticated on the worker control channel (client certificate and
// worker token), a job submitted through the SDK with a submitter token; then SIGTERM on the
// coordinator drains it: the running job commits a checkpoint through the checkpoint mechanism and
// the coordinator exits 0. A worker without a token is refused and exits 1.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "client/client.h"
#include "common/token_shard.h"
#include "gtest/gtest.h"
#include "tests/coordinator/certs.h"
#include "tests/coordinator/test_util.h"
#include "tests/support/process.h"

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::ReadFile;

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

  ChildProcess coord({FSDP8_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state_db", ":memory:",
                      "--data_roots", dir.path(), "--tls_cert", certs.server_cert, "--tls_key",
                      certs.server_key, "--tls_client_ca", certs.ca, "--tokens", dir.File("tokens"),
                      "--drain_timeout_s", "60", "--heartbeat_timeout_s", "10"},
                     dir.File("coordinator.log"));
  ASSERT_TRUE(coord.ok());
  const std::string port =
      testing::WaitForLogLine(dir.File("coordinator.log"), "listening on 127.0.0.1:", 30s);
  ASSERT_FALSE(port.empty()) << ReadFile(dir.File("coordinator.log"));
  const std::string address = "localhost:" + port;

  // No token: the worker is refused (UNAUTHENTICATED) and gives up at once with exit status 1.
  ChildProcess rogue({FSDP8_WORKER_BIN, "--coordinator", address, "--tls_ca", certs.ca,
                      "--tls_cert", certs.client_cert, "--tls_key", certs.client_key,
                      "--connect_timeout_s", "20"},
                     dir.File("rogue.log"));
  EXPECT_EQ(rogue.Wait(30s), 1) << ReadFile(dir.File("rogue.log"));
  EXPECT_NE(ReadFile(dir.File("rogue.log")).find("registration refused"), std::string::npos)
      << ReadFile(dir.File("rogue.log"));

  ChildProcess w({FSDP8_WORKER_BIN, "--coordinator", address, "--tls_ca", certs.ca, "--tls_cert",
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
