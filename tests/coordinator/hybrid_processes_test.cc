// Hybrid sharding's placement through real processes on loopback (tests/support): a coordinator
// and four CPU workers, two registered with --host 127.0.0.1 and two with --host 127.0.0.2
// (alternately, so that registration order alone would split every shard group). A job with
// sharding.replicas auto gets R = 2 with one shard group per simulated host; fsdp8 status shows
// the mesh; with optimizer_sharding SHARD_GROUP the final checkpoint's MANIFEST lists the 2 files
// of replica 0 and the workers of replica 1 write none.
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/checkpoint_format.h"
#include "common/token_shard.h"
#include "fsdp8/v1/admin.grpc.pb.h"
#include "fsdp8/v1/jobs.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/support/cluster.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using testing::LocalCluster;
using testing::ReadFile;
using testing::TempDir;

std::string RunCli(const std::string& args) {
  std::string out;
  FILE* p = popen((std::string(FSDP8_CLI_BIN) + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return out;
  std::array<char, 4096> buf;
  size_t n = 0;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  pclose(p);
  return out;
}

class HybridProcessesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = tmp_.path();
    std::vector<uint16_t> toks;
    uint64_t x = 11;
    while (toks.size() < 100000) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      toks.push_back(static_cast<uint16_t>((x >> 33) % 256));
    }
    ASSERT_TRUE(WriteTokenShard((dir_ / "train.bin").string(), toks).ok());
    cluster_ = std::make_unique<LocalCluster>(
        LocalCluster::Binaries{FSDP8_COORDINATOR_BIN, FSDP8_WORKER_BIN}, dir_);
    addr_ = cluster_->StartCoordinator({"--listen=127.0.0.1:0", "--data_roots=" + dir_.string(),
                                        "--state_db=" + (dir_ / "jobs.db").string()},
                                       "coordinator.log");
    ASSERT_FALSE(addr_.empty()) << ReadFile(cluster_->LogPath("coordinator.log"));
    auto channel = grpc::CreateChannel(addr_, grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel);
    admin_ = v1::AdminService::NewStub(channel);
    for (int i = 0; i < 4; ++i) {
      const std::string host = i % 2 == 0 ? "127.0.0.1" : "127.0.0.2";
      cluster_->AddWorker({"--coordinator=" + addr_, "--threads=1", "--host=" + host,
                           "--name=node-" + std::to_string(i)},
                          "worker-" + std::to_string(i) + ".log");
      ASSERT_TRUE(WaitForWorkers(i + 1)) << "worker " << i << " did not register";
    }
  }

  bool WaitForWorkers(int n) {
    const auto until = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < until) {
      v1::ListWorkersResponse resp;
      grpc::ClientContext ctx;
      if (admin_->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok() &&
          resp.workers_size() >= n) {
        hosts_.clear();
        for (const v1::WorkerInfo& w : resp.workers()) hosts_[w.worker_id()] = w.host();
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  v1::Job GetJob(const std::string& id) {
    v1::GetJobRequest req;
    req.set_job_id(id);
    v1::Job job;
    grpc::ClientContext ctx;
    EXPECT_TRUE(jobs_->GetJob(&ctx, req, &job).ok());
    return job;
  }

  TempDir tmp_{"fsdp8-hybrid", TempDir::Cleanup::kUnlessFailed};
  fs::path dir_;
  std::unique_ptr<LocalCluster> cluster_;
  std::string addr_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
  std::map<std::string, std::string> hosts_;  // worker id -> host
};

TEST_F(HybridProcessesTest, AutoReplicasPlaceOneShardGroupPerSimulatedHost) {
  v1::JobSpec s;
  s.set_name("hybrid");
  s.set_backend("cpu");
  auto* m = s.mutable_model();
  m->set_d_model(32);
  m->set_n_layers(1);
  m->set_n_heads(2);
  m->set_ffn_dim(64);
  m->set_vocab_size(256);
  m->set_seq_len(16);
  s.mutable_data()->set_train_path((dir_ / "train.bin").string());
  s.mutable_training()->set_steps(2);
  s.mutable_training()->set_global_batch(4);
  s.mutable_training()->set_eval_every(0);
  s.mutable_sharding()->set_min_workers(4);
  s.mutable_sharding()->set_replicas(0);  // auto
  s.mutable_checkpoint()->set_dir((dir_ / "ck").string());
  v1::SubmitJobRequest req;
  *req.mutable_spec() = s;
  v1::Job job;
  {
    grpc::ClientContext ctx;
    const grpc::Status st = jobs_->SubmitJob(&ctx, req, &job);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  const auto until = Clock::now() + std::chrono::minutes(3);
  v1::Job end = GetJob(job.job_id());
  while (Clock::now() < until && end.state() != v1::JOB_STATE_SUCCEEDED &&
         end.state() != v1::JOB_STATE_FAILED && end.state() != v1::JOB_STATE_CANCELLED) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    end = GetJob(job.job_id());
  }
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.world_size(), 4);
  EXPECT_EQ(end.replicas(), 2);
  ASSERT_EQ(end.worker_ids_size(), 4);
  // Ranks 0-1 (replica 0) on one host, ranks 2-3 (replica 1) on the other.
  EXPECT_EQ(hosts_[end.worker_ids(0)], hosts_[end.worker_ids(1)]);
  EXPECT_EQ(hosts_[end.worker_ids(2)], hosts_[end.worker_ids(3)]);
  EXPECT_NE(hosts_[end.worker_ids(0)], hosts_[end.worker_ids(2)]);

  const std::string status = RunCli("--coordinator " + addr_ + " status " + job.job_id());
  EXPECT_NE(status.find("world size: 4 = 2x2 replicas x shard group"), std::string::npos) << status;

  // SHARD_GROUP: the final checkpoint is 2 files, written by replica 0's ranks only.
  const fs::path step = dir_ / "ck" / "step-2";
  auto manifest = ReadManifestFile(step.string());
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->world_size(), 2);
  ASSERT_EQ(manifest->files_size(), 2);
  EXPECT_EQ(manifest->files(0).file(), "rank-0.ckpt");
  EXPECT_EQ(manifest->files(1).file(), "rank-1.ckpt");
  EXPECT_FALSE(fs::exists(step / "rank-2.ckpt"));
  EXPECT_FALSE(fs::exists(step / "rank-3.ckpt"));
}

}  // namespace
}  // namespace fsdp8
