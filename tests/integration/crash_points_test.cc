// Crash-safe checkpoint saves: a real coordinator and two CPU workers on loopback; one process is
// killed with SIGKILL at a named crash point of the second save (FSDP8_FAULT_CRASH_AT,
// common/fault_injection.h): in a rank's shard write (shard.*) or in the coordinator's MANIFEST
// commit (manifest.*). Each case then checks, on disk, that the previous checkpoint (step-2) is
// still committed and whole (MANIFEST valid, every file of the recorded size and CRC-32), and that
// the newest committed checkpoint, the one a resume picks, is step-2, or step-4 once its MANIFEST
// was renamed into place (manifest.after_rename: the commit point, with every file already
// whole). Finally a fresh coordinator and workers on the same job table resume the job from that
// checkpoint and finish it. Deterministic: the process dies at the point, not after a delay.
#include <zlib.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_format.h"
#include "common/env_settings.h"
#include "common/fault_injection.h"
#include "common/token_shard.h"
#include "fsdp8/v1/jobs.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/support/cluster.h"
#include "tests/support/temp_dir.h"

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using testing::LocalCluster;
using testing::ProcessOptions;
using testing::ReadFile;
using testing::TempDir;

uint32_t FileCrc32(const fs::path& p) {
  const std::string bytes = ReadFile(p);
  return static_cast<uint32_t>(
      ::crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

// The step of the newest committed checkpoint under ck (the rule a resume follows: a step-<k>
// directory whose MANIFEST is valid and names step k); -1 for none.
int64_t NewestCommitted(const fs::path& ck) {
  int64_t newest = -1;
  for (const auto& e : fs::directory_iterator(ck)) {
    const int64_t k = StepOfDirName(e.path().filename().string());
    if (k < 0 || !ReadManifestFile(e.path().string()).ok()) continue;
    newest = std::max(newest, k);
  }
  return newest;
}

// Every file the MANIFEST of step_dir lists exists with its size and CRC-32.
void ExpectWhole(const fs::path& step_dir) {
  auto m = ReadManifestFile(step_dir.string());
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->files_size(), 2);
  for (const auto& f : m->files()) {
    const fs::path p = step_dir / f.file();
    ASSERT_TRUE(fs::exists(p)) << p;
    EXPECT_EQ(static_cast<int64_t>(fs::file_size(p)), f.bytes()) << p;
    EXPECT_EQ(FileCrc32(p), f.crc32()) << p;
  }
}

class CrashPointTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    std::vector<uint16_t> tokens(20000);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i * 131) % 251);
    ASSERT_TRUE(WriteTokenShard((root() / "train.bin").string(), tokens).ok());
  }

  v1::JobSpec Spec() const {
    v1::JobSpec s;
    s.set_name("crash");
    s.mutable_model()->set_d_model(32);
    s.mutable_model()->set_n_layers(1);
    s.mutable_model()->set_n_heads(2);
    s.mutable_model()->set_ffn_dim(64);
    s.mutable_model()->set_seq_len(16);
    s.mutable_data()->set_train_path((root() / "train.bin").string());
    s.mutable_training()->set_steps(6);
    s.mutable_training()->set_global_batch(4);
    s.mutable_training()->set_eval_every(0);
    s.mutable_sharding()->set_min_workers(2);
    s.mutable_checkpoint()->set_dir(ck().string());
    s.mutable_checkpoint()->set_every_steps(2);
    s.mutable_checkpoint()->set_keep_last(5);
    return s;
  }
  fs::path root() const { return dir_.path(); }
  fs::path ck() const { return root() / "ck"; }

  // A coordinator on the cluster's job table and two workers, every process with `env`.
  std::unique_ptr<LocalCluster> Start(const std::string& name, std::vector<std::string> env) {
    auto c = std::make_unique<LocalCluster>(
        LocalCluster::Binaries{FSDP8_COORDINATOR_BIN, FSDP8_WORKER_BIN}, dir_.path(),
        ProcessOptions{std::move(env)});
    const std::string addr = c->StartCoordinator(
        {"--listen=127.0.0.1:0", "--state_db=" + (root() / "jobs.db").string(),
         "--data_roots=" + dir_.path(), "--heartbeat_interval_ms=200",
         "--heartbeat_timeout_s=2", "--abort_grace_s=0"},
        name + "-coordinator.log");
    EXPECT_FALSE(addr.empty()) << ReadFile(c->LogPath(name + "-coordinator.log"));
    for (int i = 0; i < 2; ++i)
      c->AddWorker({"--coordinator=" + addr, "--threads=1"}, absl::StrCat(name, "-worker-", i, ".log"));
    stub_ = v1::JobService::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
    return c;
  }

  v1::Job Get(const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 5s);
    v1::GetJobRequest req;
    req.set_job_id(id);
    req.set_events(1000);
    v1::Job job;
    grpc::Status s = stub_->GetJob(&ctx, req, &job);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }

  TempDir dir_{"fsdp8-crash-points", TempDir::Cleanup::kUnlessFailed};
  std::unique_ptr<v1::JobService::Stub> stub_;
};

TEST_P(CrashPointTest, PreviousCheckpointStaysCommittedAndResumeSkipsTheHalfOne) {
  const std::string point = GetParam();
  const bool manifest = absl::StartsWith(point, "manifest.");
  // Rank 1's shard of step 4, or step 4's MANIFEST: the second save.
  const std::string at = point + (manifest ? "@/step-4/MANIFEST" : "@/step-4/rank-1.ckpt");
  std::string id;
  {
    auto cluster = Start("crash", {std::string(env::kFaultCrashAt) + "=" + at});
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    v1::SubmitJobRequest req;
    *req.mutable_spec() = Spec();
    v1::Job job;
    ASSERT_TRUE(stub_->SubmitJob(&ctx, req, &job).ok());
    id = job.job_id();
    // The process that reaches the point dies of SIGKILL (128 + 9) at it.
    testing::ChildProcess* victim = manifest ? cluster->coordinator() : nullptr;
    const auto until = std::chrono::steady_clock::now() + 120s;
    int rc = testing::ChildProcess::kStillRunning;
    while (rc == testing::ChildProcess::kStillRunning && std::chrono::steady_clock::now() < until) {
      if (manifest) {
        rc = victim->Wait(100ms);
      } else {
        for (int i = 0; i < 2 && rc == testing::ChildProcess::kStillRunning; ++i)
          rc = cluster->worker(i)->Wait(50ms);
      }
    }
    ASSERT_EQ(rc, 128 + 9) << point << ": no process was killed at the point";
  }  // every other process stopped

  ASSERT_TRUE(fs::exists(ck() / "step-2" / kManifestFileName));
  ExpectWhole(ck() / "step-2");
  const int64_t expected = point == std::string("manifest.after_rename") ? 4 : 2;
  EXPECT_EQ(NewestCommitted(ck()), expected) << point;
  if (expected == 4) ExpectWhole(ck() / "step-4");

  // A fresh coordinator and fresh workers on the same job table: the job resumes from that
  // checkpoint and ends.
  auto cluster = Start("resume", {});
  v1::Job end;
  const auto until = std::chrono::steady_clock::now() + 120s;
  do {
    std::this_thread::sleep_for(100ms);
    end = Get(id);
  } while (end.state() != v1::JOB_STATE_SUCCEEDED && end.state() != v1::JOB_STATE_FAILED &&
           std::chrono::steady_clock::now() < until);
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.step(), 6);
  bool resumed = false;
  for (const auto& e : end.events())
    resumed |= absl::StartsWith(e.message(), absl::StrCat("resuming from ", (ck() / "step-").string(),
                                                          expected, " "));
  EXPECT_TRUE(resumed) << "no \"resuming from .../step-" << expected << "\" event";
  ExpectWhole(ck() / "step-6");
}

INSTANTIATE_TEST_SUITE_P(EveryPoint, CrashPointTest, ::testing::ValuesIn(kCrashPoints),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           std::string n = i.param;
                           for (char& c : n)
                             if (c == '.') c = '_';
                           return n;
                         });

}  // namespace
}  // namespace fsdp8
