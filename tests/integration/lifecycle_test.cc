// A job's life with the coordinator's default flags, through real processes on loopback (a
// coordinator and CPU workers as children, tests/support): a hung rank (SIGSTOP) costs seconds; a
// failed allocation fails the job, not the worker.
//
// Each test starts its own cluster, so that the defaults under test are the daemons' own.
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

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
using testing::ChildProcess;
using testing::LocalCluster;
using testing::ReadFile;
using testing::TempDir;

double Since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

// A coordinator with `coordinator_flags` (besides listen, state db and data root) and `workers`
// CPU workers named node-0, node-1, ... (their worker ids), each registered before the next starts.
class LifecycleTest : public ::testing::Test {
 protected:
  void StartCluster(int workers, const std::vector<std::string>& coordinator_flags = {},
                    const std::vector<std::vector<std::string>>& worker_flags = {}) {
    ASSERT_FALSE(tmp_.path().empty());
    dir_ = tmp_.path();
    WriteCorpus();
    cluster_ = std::make_unique<LocalCluster>(
        LocalCluster::Binaries{FSDP8_COORDINATOR_BIN, FSDP8_WORKER_BIN}, dir_);
    std::vector<std::string> flags{"--listen=127.0.0.1:0",
                                   "--state_db=" + (dir_ / "jobs.db").string(),
                                   "--data_roots=" + dir_.string()};
    flags.insert(flags.end(), coordinator_flags.begin(), coordinator_flags.end());
    const std::string addr = cluster_->StartCoordinator(flags, "coordinator.log");
    ASSERT_FALSE(addr.empty()) << ReadFile(cluster_->LogPath("coordinator.log"));
    auto channel = grpc::CreateChannel(addr, grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel);
    admin_ = v1::AdminService::NewStub(channel);
    for (int i = 0; i < workers; ++i) {
      std::vector<std::string> wf{"--coordinator=" + addr, "--threads=1",
                                  "--name=node-" + std::to_string(i)};
      if (i < static_cast<int>(worker_flags.size()))
        wf.insert(wf.end(), worker_flags[i].begin(), worker_flags[i].end());
      cluster_->AddWorker(wf, "worker-" + std::to_string(i) + ".log");
      ASSERT_TRUE(WaitForWorkers(i + 1)) << "worker " << i << " did not register";
    }
  }

  // Byte tokens of pseudo-random words: enough for every step of these jobs.
  void WriteCorpus() {
    static const char* kWords[] = {"the ", "cat ", "sat ", "on ", "a ", "mat. ", "dogs ", "run "};
    std::vector<uint16_t> toks;
    uint64_t x = 7;
    while (toks.size() < 200000) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      for (const char* c = kWords[(x >> 33) % 8]; *c; ++c) toks.push_back(static_cast<uint8_t>(*c));
    }
    ASSERT_TRUE(WriteTokenShard((dir_ / "train.bin").string(), toks).ok());
  }

  bool WaitForWorkers(size_t n) {
    const auto until = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < until) {
      v1::ListWorkersResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      if (admin_->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok() &&
          static_cast<size_t>(resp.workers_size()) >= n)
        return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  // 2 ranks, FP32, d 64, 2 layers; a checkpoint every 5 steps under dir_/ck.
  v1::JobSpec Spec(int steps) const {
    v1::JobSpec s;
    s.set_name("lifecycle");
    s.set_backend("cpu");
    auto* m = s.mutable_model();
    m->set_d_model(64);
    m->set_n_layers(2);
    m->set_n_heads(4);
    m->set_ffn_dim(192);
    m->set_vocab_size(256);
    m->set_seq_len(64);
    s.mutable_data()->set_train_path((dir_ / "train.bin").string());
    auto* t = s.mutable_training();
    t->set_steps(steps);
    t->set_global_batch(4);
    t->set_seed(7);
    t->set_eval_every(0);
    s.mutable_sharding()->set_min_workers(2);
    s.mutable_sharding()->set_max_workers(2);
    auto* p = s.mutable_precision();
    p->set_linears(v1::PRECISION_FP32);
    p->set_embedding(v1::PRECISION_FP32);
    p->set_lm_head(v1::PRECISION_FP32);
    s.mutable_checkpoint()->set_dir((dir_ / "ck").string());
    s.mutable_checkpoint()->set_every_steps(5);
    return s;
  }

  v1::Job Submit(const v1::JobSpec& spec) {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    v1::Job job;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status st = jobs_->SubmitJob(&ctx, req, &job);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return job;
  }

  v1::Job GetJob(const std::string& id) {
    v1::GetJobRequest req;
    req.set_job_id(id);
    v1::Job job;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    EXPECT_TRUE(jobs_->GetJob(&ctx, req, &job).ok());
    return job;
  }

  // Watches the job until its stream ends; returns the last state seen.
  v1::JobState Follow(const std::string& id, const std::function<void(const v1::JobEvent&)>& fn) {
    v1::WatchJobRequest req;
    req.set_job_id(id);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
    auto reader = jobs_->WatchJob(&ctx, req);
    v1::JobEvent ev;
    v1::JobState last = v1::JOB_STATE_UNSPECIFIED;
    while (reader->Read(&ev)) {
      fn(ev);
      if (ev.state() != v1::JOB_STATE_UNSPECIFIED) last = ev.state();
    }
    reader->Finish();
    return last;
  }

  ChildProcess* WorkerProcess(const std::string& worker_id) {
    for (size_t i = 0; i < cluster_->num_workers(); ++i)
      if (worker_id == "node-" + std::to_string(i)) return cluster_->worker(i);
    return nullptr;
  }

  TempDir tmp_{"fsdp8-lifecycle", TempDir::Cleanup::kUnlessFailed};
  fs::path dir_;
  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
};

// With the default flags, 2 ranks plus a spare worker and a checkpoint every 5 steps: rank 0 is
// stopped (SIGSTOP) after step 8; the job runs its first step of the new generation (on the
// survivor and the spare, from step-5) within 10 s of the stop, and ends with every step done.
TEST_F(LifecycleTest, HungRankCostsSecondsWithDefaultFlags) {
  StartCluster(3);
  const int steps = 40;
  const v1::Job job = Submit(Spec(steps));
  ASSERT_FALSE(job.job_id().empty());
  ChildProcess* victim_proc = nullptr;
  std::string victim, cause;
  Clock::time_point stopped, recovering, running, first_step;
  const v1::JobState last = Follow(job.job_id(), [&](const v1::JobEvent& ev) {
    const auto now = Clock::now();
    if (victim_proc == nullptr && ev.step() >= 8 && ev.state() == v1::JOB_STATE_RUNNING) {
      victim = GetJob(job.job_id()).worker_ids(0);
      victim_proc = WorkerProcess(victim);
      ASSERT_NE(victim_proc, nullptr) << victim;
      victim_proc->Signal(SIGSTOP);
      stopped = Clock::now();
      return;
    }
    if (victim_proc == nullptr) return;
    if (ev.state() == v1::JOB_STATE_RECOVERING && recovering == Clock::time_point()) {
      recovering = now;
      cause = ev.message();
    }
    if (recovering != Clock::time_point() && ev.state() == v1::JOB_STATE_RUNNING &&
        running == Clock::time_point())
      running = now;
    if (running != Clock::time_point() && ev.loss() > 0 && first_step == Clock::time_point())
      first_step = now;
  });
  ASSERT_NE(victim_proc, nullptr) << "the job never reached step 8";
  EXPECT_TRUE(victim_proc->Kill());
  ASSERT_NE(first_step, Clock::time_point()) << "no step of a new generation";
  std::printf("hung rank recovery: RECOVERING after %.2f s (%s), RUNNING after %.2f s, first step "
              "of the new generation after %.2f s\n",
              Since(stopped, recovering), cause.c_str(), Since(stopped, running),
              Since(stopped, first_step));
  std::fflush(stdout);
  EXPECT_NE(cause.find(victim), std::string::npos) << cause;
  EXPECT_LE(Since(stopped, first_step), 10.0);
  EXPECT_EQ(last, v1::JOB_STATE_SUCCEEDED);
  const v1::Job done = GetJob(job.job_id());
  EXPECT_EQ(done.step(), steps);
  EXPECT_EQ(done.generation(), 2);
  for (const auto& w : done.worker_ids()) EXPECT_NE(w, victim) << "the hung worker was reused";
}

// Allocation failures are job errors: worker node-0 may hold 48 MiB (--memory_limit_mb), and a
// job whose microbatch needs more (32 sequences of 512 tokens per rank) fails in its first step
// with RESOURCE_EXHAUSTED naming what was being allocated, without a restart (a spare worker is
// free, the job has a checkpoint dir and restarts left). Rank 1, blocked in a collective on the
// failed rank, is aborted. Both workers are IDLE afterwards, and train the next (small) job.
TEST_F(LifecycleTest, OutOfMemoryFailsTheJobAndTheWorkersTrainTheNext) {
  StartCluster(3, {}, {{"--memory_limit_mb=48"}});
  v1::JobSpec big = Spec(10);
  big.mutable_model()->set_seq_len(512);
  big.mutable_training()->set_global_batch(64);
  big.mutable_training()->set_microbatch(32);
  const v1::Job job = Submit(big);
  ASSERT_FALSE(job.job_id().empty());
  std::string reason;
  const v1::JobState last = Follow(job.job_id(), [&](const v1::JobEvent& ev) {
    if (!ev.message().empty()) reason = ev.message();
  });
  EXPECT_EQ(last, v1::JOB_STATE_FAILED) << reason;
  const v1::Job failed = GetJob(job.job_id());
  EXPECT_EQ(failed.restarts(), 0) << failed.reason();
  EXPECT_EQ(failed.generation(), 1);
  EXPECT_NE(failed.reason().find("RESOURCE_EXHAUSTED"), std::string::npos) << failed.reason();
  EXPECT_NE(failed.reason().find("out of memory in step 0"), std::string::npos) << failed.reason();
  EXPECT_NE(failed.reason().find("bytes of device memory"), std::string::npos) << failed.reason();
  EXPECT_NE(failed.reason().find("block"), std::string::npos) << failed.reason();
  EXPECT_NE(failed.reason().find("node-0"), std::string::npos) << failed.reason();
  // Every worker is registered and IDLE again (after the abort grace).
  bool idle = false;
  for (int i = 0; i < 100 && !idle; ++i) {
    v1::ListWorkersResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ASSERT_TRUE(admin_->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok());
    int n_idle = 0;
    for (const auto& w : resp.workers()) n_idle += w.state() == v1::WORKER_STATE_IDLE;
    idle = resp.workers_size() == 3 && n_idle == 3;
    if (!idle) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(idle) << "the workers did not all come back IDLE";
  // The same workers (the scheduler takes free workers in registration order) train the next job.
  const v1::Job next = Submit(Spec(6));
  ASSERT_FALSE(next.job_id().empty());
  EXPECT_EQ(Follow(next.job_id(), [](const v1::JobEvent&) {}), v1::JOB_STATE_SUCCEEDED);
  const v1::Job done = GetJob(next.job_id());
  ASSERT_EQ(done.worker_ids_size(), 2);
  EXPECT_EQ(done.worker_ids(0), "node-0");
  EXPECT_EQ(done.worker_ids(1), "node-1");
  EXPECT_EQ(done.step(), 6);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(cluster_->worker(i)->Wait(std::chrono::milliseconds(0)), ChildProcess::kStillRunning)
        << "worker " << i << " exited";
}

}  // namespace
}  // namespace fsdp8
