// A job's life with the coordinator's default flags, through real processes on loopback (a
// coordinator and CPU workers as children, tests/support): a hung rank (SIGSTOP) costs seconds; a
// failed allocation fails the job, not the worker; the JSON log tells a job's whole life.
//
// Each test starts its own cluster, so that the defaults under test are the daemons' own.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "common/token_shard.h"
#include "fsdp8/v1/admin.grpc.pb.h"
#include "fsdp8/v1/jobs.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/support/cluster.h"
#include "tests/support/process.h"
#include "tests/support/rank_failure.h"
#include "tests/support/temp_dir.h"

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using testing::ChildProcess;
using testing::LocalCluster;
using testing::ReadFile;
using testing::TempDir;

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
        LocalCluster::Binaries{FSDP8_COORDINATOR_BIN, FSDP8_WORKER_BIN}, dir_, cluster_options_);
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

  // 2 ranks, FP32, d 64, 2 layers; a checkpoint every 5 steps under dir_/<ck>.
  v1::JobSpec Spec(int steps, const std::string& ck = "ck") const {
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
    s.mutable_checkpoint()->set_dir((dir_ / ck).string());
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
  testing::ProcessOptions cluster_options_;  // every process's (environment)
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
  testing::RankFailureTimer hang(SIGSTOP, 8, [&](const std::string& job_id) {
    const std::string id = GetJob(job_id).worker_ids(0);
    return testing::RankFailureTimer::Rank0{id, WorkerProcess(id)};
  });
  const v1::JobState last =
      Follow(job.job_id(), [&](const v1::JobEvent& ev) { hang.OnEvent(ev); });
  ASSERT_TRUE(hang.failed()) << "the job never reached step 8";
  EXPECT_TRUE(hang.victim_process()->Kill());
  ASSERT_NE(hang.first_step(), Clock::time_point()) << "no step of a new generation";
  std::printf("hung rank recovery: RECOVERING after %.2f s (%s), RUNNING after %.2f s, first step "
              "of the new generation after %.2f s\n",
              hang.SecondsTo(hang.recovering()), hang.cause().c_str(),
              hang.SecondsTo(hang.running()), hang.SecondsTo(hang.first_step()));
  std::fflush(stdout);
  EXPECT_NE(hang.cause().find(hang.victim()), std::string::npos) << hang.cause();
  EXPECT_LE(hang.SecondsTo(hang.first_step()), 10.0);
  EXPECT_EQ(last, v1::JOB_STATE_SUCCEEDED);
  const v1::Job done = GetJob(job.job_id());
  EXPECT_EQ(done.step(), steps);
  EXPECT_EQ(done.generation(), 2);
  for (const auto& w : done.worker_ids())
    EXPECT_NE(w, hang.victim()) << "the hung worker was reused";
}

// Allocation failures are job errors: worker node-0 may hold 48 MiB (--memory_limit_mb), and a
// job whose microbatch needs more (32 sequences of 512 tokens per rank), started on it (the
// coordinator's memory check off: it would choose the other workers) fails in its first step
// with RESOURCE_EXHAUSTED naming what was being allocated, without a restart (a spare worker is
// free, the job has a checkpoint dir and restarts left). Rank 1, blocked in a collective on the
// failed rank, is aborted. Every worker is IDLE afterwards, and all three train the next (small)
// job.
TEST_F(LifecycleTest, OutOfMemoryFailsTheJobAndTheWorkersTrainTheNext) {
  StartCluster(3, {"--check_memory=false"}, {{"--memory_limit_mb=48"}});
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
  // The same workers train the next job: one on all three, node-0 and node-1 included.
  v1::JobSpec next_spec = Spec(6, "ck-next");  // a checkpoint dir belongs to one job
  next_spec.mutable_training()->set_global_batch(6);
  next_spec.mutable_sharding()->set_min_workers(3);
  next_spec.mutable_sharding()->set_max_workers(3);
  const v1::Job next = Submit(next_spec);
  ASSERT_FALSE(next.job_id().empty());
  EXPECT_EQ(Follow(next.job_id(), [](const v1::JobEvent&) {}), v1::JOB_STATE_SUCCEEDED);
  const v1::Job done = GetJob(next.job_id());
  ASSERT_EQ(done.worker_ids_size(), 3);
  EXPECT_EQ(done.worker_ids(0), "node-0");
  EXPECT_EQ(done.worker_ids(1), "node-1");
  EXPECT_EQ(done.step(), 6);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(cluster_->worker(i)->Wait(std::chrono::milliseconds(0)), ChildProcess::kStillRunning)
        << "worker " << i << " exited";
}

// The operator's log (--log_format=json): every line of the coordinator's and the workers' logs
// is a JSON object (parsed here line by line), and a whole job's life reads from the coordinator's
// events: a refused submission (field and rule), a submission, its generation start (rank=worker),
// an injected step failure on rank 1 at step 6 (FSDP8_FAULT_STEP_ERROR), the restart with that
// cause, checkpoints, and the end with its steps, loss and wall time; a second job is cancelled.
// The workers log the same job's assignment and failure with its id.
TEST_F(LifecycleTest, JsonLogReadsAWholeJob) {
  cluster_options_.env = {"FSDP8_FAULT_STEP_ERROR=1@6"};
  StartCluster(3, {"--log_format=json"},
               {{"--log_format=json"}, {"--log_format=json"}, {"--log_format=json"}});
  v1::JobSpec bad = Spec(10);
  bad.mutable_model()->set_n_heads(5);  // 64 % 5 != 0
  {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = bad;
    v1::Job out;
    grpc::ClientContext ctx;
    EXPECT_EQ(jobs_->SubmitJob(&ctx, req, &out).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  const v1::Job job = Submit(Spec(10));
  ASSERT_FALSE(job.job_id().empty());
  EXPECT_EQ(Follow(job.job_id(), [](const v1::JobEvent&) {}), v1::JOB_STATE_SUCCEEDED);
  const v1::Job other = Submit(Spec(100000, "ck-other"));
  ASSERT_FALSE(other.job_id().empty());
  bool cancel_sent = false;
  Follow(other.job_id(), [&](const v1::JobEvent& ev) {
    if (ev.step() >= 2 && !cancel_sent) {
      cancel_sent = true;
      v1::CancelJobRequest req;
      req.set_job_id(other.job_id());
      v1::Job out;
      grpc::ClientContext ctx;
      EXPECT_TRUE(jobs_->CancelJob(&ctx, req, &out).ok());
    }
  });
  cluster_->coordinator()->Stop();  // the log is complete

  // Every line parses; the coordinator's events of `job` in order.
  auto parse = [](const fs::path& log, bool skip_listening) {
    std::vector<google::protobuf::Struct> lines;
    std::istringstream in(ReadFile(log));
    std::string line;
    while (std::getline(in, line)) {
      // stdout's address line (the LocalCluster handshake) shares the file; it is not the log.
      if (skip_listening && line.rfind(LocalCluster::kListeningPrefix, 0) == 0) continue;
      google::protobuf::Struct st;
      EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(line, &st).ok())
          << log << ": not a JSON object: " << line;
      lines.push_back(st);
    }
    return lines;
  };
  auto str = [](const google::protobuf::Struct& st, const std::string& k) {
    auto it = st.fields().find(k);
    return it == st.fields().end() ? std::string() : it->second.string_value();
  };
  auto num = [](const google::protobuf::Struct& st, const std::string& k) {
    auto it = st.fields().find(k);
    return it == st.fields().end() ? -1.0 : it->second.number_value();
  };
  const auto coord = parse(cluster_->LogPath("coordinator.log"), true);
  std::vector<std::string> life;  // the events of `job`, in order
  bool refused = false, cancelled = false, other_ended = false;
  for (const auto& st : coord) {
    EXPECT_EQ(str(st, "process"), "fsdp8-coordinator");
    EXPECT_FALSE(str(st, "time").empty());
    const std::string ev = str(st, "event");
    if (ev == "job_refused") {
      refused = true;
      EXPECT_EQ(str(st, "field"), "model.d_model");
      EXPECT_NE(str(st, "rule").find("divisible by model.n_heads"), std::string::npos);
    }
    if (str(st, "job") == other.job_id()) {
      cancelled |= ev == "job_cancelled";
      if (ev == "job_ended") {
        other_ended = true;
        EXPECT_EQ(str(st, "state"), "CANCELLED");
      }
    }
    if (str(st, "job") != job.job_id()) continue;
    life.push_back(ev);
    if (ev == "job_submitted") {
      EXPECT_EQ(num(st, "min_workers"), 2);
      EXPECT_EQ(str(st, "name"), "lifecycle");
    }
    if (ev == "generation_started" && num(st, "generation") == 1) {
      EXPECT_EQ(str(st, "ranks"), "0=node-0,1=node-1");
    }
    if (ev == "job_restarting") {
      EXPECT_NE(str(st, "cause").find("rank 1"), std::string::npos) << str(st, "cause");
    }
    if (ev == "job_ended") {
      EXPECT_EQ(str(st, "state"), "SUCCEEDED");
      EXPECT_EQ(num(st, "steps"), 10);
      EXPECT_GT(num(st, "loss"), 0);
      EXPECT_GT(num(st, "wall_s"), 0);
    }
  }
  EXPECT_TRUE(refused);
  EXPECT_TRUE(cancelled);
  EXPECT_TRUE(other_ended);
  ASSERT_GE(life.size(), 7u);
  EXPECT_EQ(life.front(), "job_submitted");
  EXPECT_EQ(life[1], "generation_started");
  EXPECT_EQ(life.back(), "job_ended");
  auto index = [&](const std::string& e) {
    return std::find(life.begin(), life.end(), e) - life.begin();
  };
  // Step 5's checkpoint, then the failure at step 6, the restart, the new generation.
  EXPECT_LT(index("checkpoint_committed"), index("generation_failed"));
  EXPECT_LT(index("generation_failed"), index("job_restarting"));
  EXPECT_LT(index("job_restarting"),
            std::find(life.begin() + index("job_restarting"), life.end(), "generation_started") -
                life.begin());
  // The workers: JSON too, and the job's assignment and failure with its id.
  bool assigned = false, step_failed = false;
  for (int i = 0; i < 3; ++i) {
    for (const auto& st : parse(cluster_->LogPath("worker-" + std::to_string(i) + ".log"), false)) {
      EXPECT_EQ(str(st, "process"), "fsdp8-worker");
      if (str(st, "job") != job.job_id()) continue;
      assigned |= str(st, "event") == "job_assigned";
      step_failed |= str(st, "event") == "step_failed" && num(st, "step") == 6;
    }
  }
  EXPECT_TRUE(assigned);
  EXPECT_TRUE(step_failed);
}

}  // namespace
}  // namespace fsdp8
