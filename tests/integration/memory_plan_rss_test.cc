// The memory plan against real processes: a CPU worker's resident memory while it trains a long
// sequence (the attention's T x T scratch dominates), and the coordinator's answers for jobs no
// worker can hold (refused at submit with byte counts) or whose plan overflows 64-bit byte counts
// ("exceeds 8 EiB", never a saturated figure), through the coordinator, GetShardPlan and `fsdp8
// plan`.
#include <sys/wait.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "common/memory_plan.h"
#include "common/spec.h"
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

// A field of /proc/PID/status ("VmRSS", "VmHWM") in bytes; -1 when it cannot be read.
int64_t ProcStatusBytes(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) != 0) continue;
    long long kb = -1;
    if (std::sscanf(line.c_str() + field.size() + 1, "%lld", &kb) == 1) return kb * 1024;
  }
  return -1;
}

class MemoryPlanRssTest : public ::testing::Test {
 protected:
  // A coordinator and one CPU worker (one BLAS thread); a byte-token corpus of `tokens` tokens.
  void StartCluster(size_t tokens) {
    ASSERT_FALSE(tmp_.path().empty());
    dir_ = tmp_.path();
    std::vector<uint16_t> toks(tokens);
    uint64_t x = 11;
    for (uint16_t& t : toks) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      t = static_cast<uint16_t>(32 + (x >> 33) % 90);
    }
    ASSERT_TRUE(WriteTokenShard((dir_ / "train.bin").string(), toks).ok());
    cluster_ = std::make_unique<LocalCluster>(
        LocalCluster::Binaries{FSDP8_COORDINATOR_BIN, FSDP8_WORKER_BIN}, dir_);
    const std::string addr = cluster_->StartCoordinator(
        {"--listen=127.0.0.1:0", "--state_db=" + (dir_ / "jobs.db").string(),
         "--data_roots=" + dir_.string()},
        "coordinator.log");
    ASSERT_FALSE(addr.empty()) << ReadFile(cluster_->LogPath("coordinator.log"));
    auto channel = grpc::CreateChannel(addr, grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel);
    admin_ = v1::AdminService::NewStub(channel);
    cluster_->AddWorker({"--coordinator=" + addr, "--threads=1", "--name=node-0"},
                        "worker-0.log");
    ASSERT_TRUE(WaitForWorker()) << ReadFile(cluster_->LogPath("worker-0.log"));
  }

  bool WaitForWorker() {
    const auto until = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < until) {
      v1::ListWorkersResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      if (admin_->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok() &&
          resp.workers_size() == 1 && resp.workers(0).state() == v1::WORKER_STATE_IDLE) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  // The default job's model (data/default-job.yaml: d 128, 4 heads, ffn 384, vocab 256, FP8 block
  // linears) with one block at `seq_len`, one sequence per step on one rank.
  v1::JobSpec Spec(int seq_len) const {
    v1::JobSpec s;
    s.set_name("rss");
    s.set_backend("cpu");
    auto* m = s.mutable_model();
    m->set_d_model(128);
    m->set_n_layers(1);
    m->set_n_heads(4);
    m->set_ffn_dim(384);
    m->set_vocab_size(256);
    m->set_seq_len(seq_len);
    s.mutable_data()->set_train_path((dir_ / "train.bin").string());
    auto* t = s.mutable_training();
    t->set_steps(3);
    t->set_global_batch(1);
    t->set_seed(5);
    t->set_eval_every(0);
    s.mutable_sharding()->set_min_workers(1);
    s.mutable_sharding()->set_max_workers(1);
    return s;
  }

  grpc::Status Submit(const v1::JobSpec& spec, v1::Job* job) {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return jobs_->SubmitJob(&ctx, req, job);
  }

  // Watches the job until its stream ends; returns the last state seen.
  v1::JobState Follow(const std::string& id) {
    v1::WatchJobRequest req;
    req.set_job_id(id);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
    auto reader = jobs_->WatchJob(&ctx, req);
    v1::JobEvent ev;
    v1::JobState last = v1::JOB_STATE_UNSPECIFIED;
    while (reader->Read(&ev)) {
      if (ev.state() != v1::JOB_STATE_UNSPECIFIED) last = ev.state();
    }
    reader->Finish();
    return last;
  }

  TempDir tmp_{"fsdp8-memory-rss", TempDir::Cleanup::kUnlessFailed};
  fs::path dir_;
  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
};

// seq 8192 on the default model's width: the attention's two 8192 x 8192 f32 matrices (512 MiB)
// are most of the step. The worker's peak resident memory (VmHWM) less its resident memory
// before the job is within 10% of the plan's device_bytes (what the coordinator admits by).
TEST_F(MemoryPlanRssTest, CpuAttentionAtSeq8192WithinTenPercentOfWorkerPeakRss) {
  StartCluster(100000);
  const v1::JobSpec spec = Spec(8192);
  auto plan = PlanMemory(WithDefaults(spec, 1), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const pid_t pid = cluster_->worker(0)->pid();
  const int64_t before = ProcStatusBytes(pid, "VmRSS");
  ASSERT_GT(before, 0);
  v1::Job job;
  const grpc::Status st = Submit(spec, &job);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(Follow(job.job_id()), v1::JOB_STATE_SUCCEEDED)
      << ReadFile(cluster_->LogPath("worker-0.log"));
  const int64_t hwm = ProcStatusBytes(pid, "VmHWM");
  ASSERT_GT(hwm, before);
  const double growth = static_cast<double>(hwm - before);
  const double ratio = static_cast<double>(plan->device_bytes) / growth;
  std::printf("seq 8192: plan %lld bytes (%s), worker RSS %lld before, VmHWM %lld, growth %.0f, "
              "ratio %.3f\n",
              static_cast<long long>(plan->device_bytes), LargestTerms(*plan).c_str(),
              static_cast<long long>(before), static_cast<long long>(hwm), growth, ratio);
  EXPECT_GT(ratio, 0.9);
  EXPECT_LT(ratio, 1.1);
}

// seq 2,000,000: the attention alone needs 2 x (2e6)^2 x 4 bytes = 32 TB; refused at submit with
// RESOURCE_EXHAUSTED naming the predicted bytes per rank, the worker's bytes and the largest terms;
// the job is not in the table and the worker stays IDLE.
TEST_F(MemoryPlanRssTest, Seq2MillionRefusedAtSubmitWithByteCounts) {
  StartCluster(2000100);
  v1::Job job;
  const grpc::Status st = Submit(Spec(2000000), &job);
  ASSERT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  const std::string m = st.error_message();
  EXPECT_NE(m.find("the memory plan predicts "), std::string::npos) << m;
  EXPECT_NE(m.find(" bytes) per rank at 1 ranks"), std::string::npos) << m;
  EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
  EXPECT_NE(m.find("largest terms: workspaces"), std::string::npos) << m;
  EXPECT_NE(m.find("the largest registered cpu worker has "), std::string::npos) << m;
  // The predicted figure is at least the two T x T matrices: 32,000,000,000,000 bytes.
  const size_t at = m.find("TiB (");
  ASSERT_NE(at, std::string::npos) << m;
  const int64_t predicted = std::stoll(m.substr(at + 5));
  EXPECT_GE(predicted, int64_t{32000000000000}) << m;
  EXPECT_EQ(m.find("9223372036854775807"), std::string::npos) << m;
  EXPECT_TRUE(WaitForWorker()) << "the worker is IDLE";
  v1::ListJobsResponse list;
  grpc::ClientContext ctx;
  ASSERT_TRUE(jobs_->ListJobs(&ctx, v1::ListJobsRequest(), &list).ok());
  EXPECT_EQ(list.jobs_size(), 0);
}

// 2e9 blocks of width 2^20 (ffn 2^22): the shards alone are beyond 64-bit byte counts. The
// refusal at submit, GetShardPlan and `fsdp8 plan` say "exceeds 8 EiB" and print no saturated
// figure.
TEST_F(MemoryPlanRssTest, OverflowingPlanSaysExceeds) {
  StartCluster(100000);
  v1::JobSpec spec = Spec(64);
  spec.mutable_model()->set_n_layers(2000000000);
  spec.mutable_model()->set_d_model(1048576);
  spec.mutable_model()->set_n_heads(8192);
  spec.mutable_model()->set_ffn_dim(4194304);
  v1::Job job;
  const grpc::Status st = Submit(spec, &job);
  ASSERT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  const std::string m = st.error_message();
  EXPECT_NE(m.find("the memory plan predicts more than 64-bit byte counts hold (exceeds 8 EiB) "
                   "per rank at 1 ranks"),
            std::string::npos)
      << m;
  EXPECT_EQ(m.find("9223372036854775807"), std::string::npos) << m;
  EXPECT_EQ(m.find("8388608.00 TiB"), std::string::npos) << m;

  v1::GetShardPlanRequest req;
  *req.mutable_spec() = spec;
  req.set_world_size(1);
  req.set_memory_only(true);
  v1::ShardPlan resp;
  grpc::ClientContext ctx;
  const grpc::Status gs = admin_->GetShardPlan(&ctx, req, &resp);
  ASSERT_TRUE(gs.ok()) << gs.error_message();
  EXPECT_TRUE(resp.memory().exceeds_int64());
  EXPECT_EQ(resp.memory().device_bytes(), kBytesExceeded);

  // `fsdp8 plan` on the same spec as YAML.
  const fs::path yaml = dir_ / "huge.yaml";
  testing::WriteFile(yaml, absl::StrCat("backend: cpu\nmodel:\n  d_model: 1048576\n"
                                        "  n_layers: 2000000000\n  n_heads: 8192\n"
                                        "  ffn_dim: 4194304\n  vocab_size: 256\n  seq_len: 64\n"
                                        "data:\n  train_path: ",
                                        (dir_ / "train.bin").string(),
                                        "\ntraining:\n  global_batch: 1\n"));
  const fs::path out = dir_ / "plan.out";
  const std::string cmd = absl::StrCat(FSDP8_CLI_BIN, " plan ", yaml.string(),
                                       " --world-size 1 > ", out.string(), " 2>&1");
  const int rc = std::system(cmd.c_str());
  const std::string text = ReadFile(out);
  EXPECT_EQ(WEXITSTATUS(rc), 0) << text;
  const size_t total = text.find("device total");
  ASSERT_NE(total, std::string::npos) << text;
  EXPECT_EQ(text.substr(total, text.find('\n', total) - total).find("exceeds 8 EiB"),
            text.substr(total, text.find('\n', total) - total).size() - 13)
      << "the device total line ends with \"exceeds 8 EiB\": " << text;
  EXPECT_EQ(text.find("8388608.00 TiB"), std::string::npos) << text;
  EXPECT_EQ(text.find("9223372036854775807"), std::string::npos) << text;
}

}  // namespace
}  // namespace fsdp8
