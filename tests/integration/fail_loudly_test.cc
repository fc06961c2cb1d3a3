// Failing loudly, through real processes on loopback (a coordinator and CPU workers as children,
// tests/support): a token shard truncated under a running job fails that job naming the file
// while the workers stay up and run the next job; a job whose loss turns non-finite fails at that
// step, naming it, its loss and its gradient norm (or skips up to training.max_nonfinite_steps
// such steps first), and `fsdp8 status` shows why; every refused submission is in the
// coordinator's log.
//
// Each test starts its own cluster.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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

class FailLoudlyTest : public ::testing::Test {
 protected:
  // A coordinator (data root: the test's directory) and `workers` CPU workers node-0, node-1, ...
  void StartCluster(int workers) {
    ASSERT_FALSE(tmp_.path().empty());
    dir_ = tmp_.path();
    WriteCorpus();
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
    for (int i = 0; i < workers; ++i) {
      cluster_->AddWorker({"--coordinator=" + addr, "--threads=1", "--name=node-" + std::to_string(i)},
                          "worker-" + std::to_string(i) + ".log");
      ASSERT_TRUE(WaitForIdleWorkers(i + 1, std::chrono::seconds(30)))
          << "worker " << i << " did not register";
    }
  }

  fs::path TrainPath() const { return dir_ / "train.bin"; }

  // Byte tokens of pseudo-random words (200,000: far more than these jobs read before they end).
  void WriteCorpus() {
    static const char* kWords[] = {"the ", "cat ", "sat ", "on ", "a ", "mat. ", "dogs ", "run "};
    std::vector<uint16_t> toks;
    uint64_t x = 7;
    while (toks.size() < 200000) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      for (const char* c = kWords[(x >> 33) % 8]; *c; ++c) toks.push_back(static_cast<uint8_t>(*c));
    }
    ASSERT_TRUE(WriteTokenShard(TrainPath().string(), toks).ok());
  }

  std::vector<v1::WorkerInfo> Workers() {
    v1::ListWorkersResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!admin_->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok()) return {};
    return {resp.workers().begin(), resp.workers().end()};
  }

  // True once n workers are registered, healthy and IDLE.
  bool WaitForIdleWorkers(size_t n, std::chrono::seconds timeout) {
    const auto until = Clock::now() + timeout;
    while (Clock::now() < until) {
      size_t idle = 0;
      for (const v1::WorkerInfo& w : Workers())
        if (w.healthy() && w.state() == v1::WORKER_STATE_IDLE) ++idle;
      if (idle >= n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  // 2 ranks, FP32, d 64, 2 layers, seq 64: milliseconds a step.
  v1::JobSpec SmallSpec(int64_t steps) const {
    v1::JobSpec s;
    s.set_name("small");
    auto* m = s.mutable_model();
    m->set_d_model(64);
    m->set_n_layers(2);
    m->set_n_heads(4);
    m->set_ffn_dim(192);
    m->set_seq_len(64);
    s.mutable_data()->set_train_path(TrainPath().string());
    s.mutable_training()->set_steps(steps);
    s.mutable_training()->set_global_batch(4);
    s.mutable_training()->set_eval_every(0);
    s.mutable_sharding()->set_min_workers(2);
    s.mutable_sharding()->set_max_workers(2);
    auto* p = s.mutable_precision();
    p->set_linears(v1::PRECISION_FP32);
    p->set_embedding(v1::PRECISION_FP32);
    p->set_lm_head(v1::PRECISION_FP32);
    return s;
  }

  // The default model (d 128, 4 layers, seq 256, FP8 linears, global batch 16) on 2 ranks, with
  // peak_lr 1e308: finite in double, infinite as the f32 learning rate AdamW applies.
  v1::JobSpec DivergingSpec(int64_t steps) const {
    v1::JobSpec s;
    s.set_name("diverging");
    s.mutable_data()->set_train_path(TrainPath().string());
    s.mutable_training()->set_steps(steps);
    s.mutable_training()->set_eval_every(0);
    s.mutable_optimizer()->set_peak_lr(1e308);
    s.mutable_sharding()->set_min_workers(2);
    s.mutable_sharding()->set_max_workers(2);
    return s;
  }

  grpc::Status TrySubmit(const v1::JobSpec& spec, v1::Job* job, const std::string& request_id = "") {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    req.set_request_id(request_id);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return jobs_->SubmitJob(&ctx, req, job);
  }

  v1::Job Submit(const v1::JobSpec& spec) {
    v1::Job job;
    const grpc::Status st = TrySubmit(spec, &job);
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

  // Watches the job until its stream ends (at most 2 minutes); returns the last state seen.
  v1::JobState Follow(const std::string& id, const std::function<void(const v1::JobEvent&)>& fn) {
    v1::WatchJobRequest req;
    req.set_job_id(id);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(2));
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

  // `fsdp8 --coordinator ADDR status JOB`: its exit code and standard output.
  int CliStatus(const std::string& job_id, std::string* out) {
    const fs::path out_file = dir_ / "status.out";
    const std::string cmd = std::string(FSDP8_CLI_BIN) + " --coordinator " + cluster_->address() +
                            " status " + job_id + " > " + out_file.string() + " 2>&1";
    const int status = std::system(cmd.c_str());
    *out = ReadFile(out_file);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  TempDir tmp_{"fsdp8-loud", TempDir::Cleanup::kUnlessFailed};
  fs::path dir_;
  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
};

// The job's shard is truncated to 100 tokens after step 3 (a memory-mapped shard killed every
// worker with SIGBUS here): the job is FAILED with a reason naming the file; both workers are
// still running, registered, healthy and IDLE; with the shard rewritten they run the next job to
// SUCCEEDED.
TEST_F(FailLoudlyTest, ShardTruncatedMidJobFailsThatJobAndTheWorkersRunTheNext) {
  StartCluster(2);
  const v1::Job job = Submit(SmallSpec(100000));
  ASSERT_FALSE(job.job_id().empty());
  bool truncated = false;
  const v1::JobState last = Follow(job.job_id(), [&](const v1::JobEvent& ev) {
    if (!truncated && ev.step() >= 3) {
      ASSERT_EQ(::truncate(TrainPath().c_str(), 1024 + 2 * 100), 0);
      truncated = true;
    }
  });
  ASSERT_TRUE(truncated) << "the job never reached step 3";
  EXPECT_EQ(last, v1::JOB_STATE_FAILED);
  const v1::Job failed = GetJob(job.job_id());
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(failed.reason().find(TrainPath().string()), std::string::npos) << failed.reason();
  EXPECT_NE(failed.reason().find("truncated"), std::string::npos) << failed.reason();
  std::printf("truncated shard: %s\n", failed.reason().c_str());
  EXPECT_LT(failed.step(), 100000);
  for (size_t i = 0; i < cluster_->num_workers(); ++i)
    EXPECT_EQ(cluster_->worker(i)->Wait(std::chrono::milliseconds(0)), ChildProcess::kStillRunning)
        << "worker " << i << " exited";
  EXPECT_TRUE(WaitForIdleWorkers(2, std::chrono::seconds(15)))
      << ReadFile(cluster_->LogPath("worker-0.log"));
  for (const v1::WorkerInfo& w : Workers())
    EXPECT_TRUE(w.worker_id() == "node-0" || w.worker_id() == "node-1") << w.worker_id();

  WriteCorpus();
  const v1::Job next = Submit(SmallSpec(5));
  EXPECT_EQ(Follow(next.job_id(), [](const v1::JobEvent&) {}), v1::JOB_STATE_SUCCEEDED)
      << GetJob(next.job_id()).reason();
  EXPECT_EQ(GetJob(next.job_id()).step(), 5);
}

// Step events of a job: (step, loss, grad norm) of each published step.
struct StepSeen {
  int64_t step;
  double loss, grad_norm;
};

std::vector<StepSeen> StepsOf(const std::vector<v1::JobEvent>& events) {
  std::vector<StepSeen> out;
  for (const v1::JobEvent& ev : events)
    if (ev.step() > 0 && ev.message().empty())  // state and message events carry a message
      out.push_back({ev.step(), ev.loss(), ev.grad_norm()});
  return out;
}

// The first step whose published loss or gradient norm is not finite; 0 when none.
int64_t FirstNonFinite(const std::vector<StepSeen>& steps) {
  for (const StepSeen& s : steps)
    if (!std::isfinite(s.loss) || !std::isfinite(s.grad_norm)) return s.step;
  return 0;
}

// peak_lr 1e308 on the default model: step 1 runs on the initial weights (finite loss and grad
// norm) and its AdamW update, at an f32 learning rate of +inf, leaves the weights non-finite, so
// step 2 is the first non-finite one (as the published step events show too). The job is FAILED
// there, not SUCCEEDED: no step after 2 is published, the reason names step 2, its loss and its
// gradient norm and the spec field, and `fsdp8 status` prints it.
TEST_F(FailLoudlyTest, PeakLr1e308FailsAtTheFirstNonFiniteStep) {
  StartCluster(2);
  const v1::Job job = Submit(DivergingSpec(50));
  ASSERT_FALSE(job.job_id().empty());
  std::vector<v1::JobEvent> events;
  const v1::JobState last = Follow(job.job_id(), [&](const v1::JobEvent& ev) { events.push_back(ev); });
  EXPECT_EQ(last, v1::JOB_STATE_FAILED);
  const std::vector<StepSeen> steps = StepsOf(events);
  ASSERT_FALSE(steps.empty());
  const int64_t first_bad = FirstNonFinite(steps);
  EXPECT_EQ(first_bad, 2);
  EXPECT_EQ(steps.back().step, first_bad) << "steps went on after the first non-finite one";
  EXPECT_TRUE(std::isfinite(steps.front().loss) && std::isfinite(steps.front().grad_norm));
  const v1::Job failed = GetJob(job.job_id());
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  const std::string& reason = failed.reason();
  std::printf("peak_lr 1e308: %s\n", reason.c_str());
  EXPECT_EQ(reason.rfind("step " + std::to_string(first_bad) + ": loss ", 0), 0u) << reason;
  EXPECT_NE(reason.find("gradient norm"), std::string::npos) << reason;
  EXPECT_NE(reason.find("not finite"), std::string::npos) << reason;
  EXPECT_NE(reason.find("training.max_nonfinite_steps 0"), std::string::npos) << reason;
  std::string out;
  EXPECT_EQ(CliStatus(job.job_id(), &out), 0) << out;
  EXPECT_NE(out.find("FAILED"), std::string::npos) << out;
  EXPECT_NE(out.find(reason), std::string::npos) << out;
  EXPECT_TRUE(WaitForIdleWorkers(2, std::chrono::seconds(15)));
}

// With training.max_nonfinite_steps 2 the same job skips steps 2 and 3 (each published as an
// event) and fails at step 4, the third non-finite step, naming the count and the limit.
TEST_F(FailLoudlyTest, NonFiniteStepsAreSkippedUpToTheLimit) {
  StartCluster(2);
  v1::JobSpec spec = DivergingSpec(50);
  spec.mutable_training()->set_max_nonfinite_steps(2);
  const v1::Job job = Submit(spec);
  ASSERT_FALSE(job.job_id().empty());
  std::vector<v1::JobEvent> events;
  const v1::JobState last = Follow(job.job_id(), [&](const v1::JobEvent& ev) { events.push_back(ev); });
  EXPECT_EQ(last, v1::JOB_STATE_FAILED);
  const std::vector<StepSeen> steps = StepsOf(events);
  ASSERT_EQ(steps.size(), 4u);
  EXPECT_EQ(FirstNonFinite(steps), 2);
  std::vector<std::string> skips;
  for (const v1::JobEvent& ev : events)
    if (ev.message().find("its update was skipped") != std::string::npos) skips.push_back(ev.message());
  ASSERT_EQ(skips.size(), 2u);
  EXPECT_EQ(skips[0].rfind("step 2: loss ", 0), 0u) << skips[0];
  EXPECT_NE(skips[0].find("(1 of at most 2 non-finite steps"), std::string::npos) << skips[0];
  EXPECT_EQ(skips[1].rfind("step 3: loss ", 0), 0u) << skips[1];
  const std::string reason = GetJob(job.job_id()).reason();
  EXPECT_EQ(reason.rfind("step 4: loss ", 0), 0u) << reason;
  EXPECT_NE(reason.find("3 non-finite steps, more than training.max_nonfinite_steps 2"),
            std::string::npos)
      << reason;
}

// Refusals at submit, each with a line in the coordinator's log (event job_refused): a spec over
// the 64 KiB limit, a spec breaking a rule, a request id over its limit.
TEST_F(FailLoudlyTest, EveryRefusedSubmissionIsInTheCoordinatorLog) {
  StartCluster(0);
  v1::JobSpec big = SmallSpec(5);
  for (int i = 0; i < 20000; ++i) {
    auto* o = big.mutable_precision()->add_overrides();
    o->set_layer(1);
    o->set_linears(v1::PRECISION_BF16);
  }
  ASSERT_GT(big.ByteSizeLong(), 65536u);
  v1::Job job;
  grpc::Status st = TrySubmit(big, &job);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("exceeds the limit of 65536 bytes"), std::string::npos);
  v1::JobSpec bad = SmallSpec(5);
  bad.mutable_model()->set_d_model(130);
  st = TrySubmit(bad, &job);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  st = TrySubmit(SmallSpec(5), &job, std::string(300, 'r'));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  // A request id reused with another spec: accepted once, refused the second time.
  ASSERT_TRUE(TrySubmit(SmallSpec(5), &job, "rid-1").ok());
  st = TrySubmit(SmallSpec(6), &job, "rid-1");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS) << st.error_message();

  const fs::path log = cluster_->LogPath("coordinator.log");
  const std::vector<std::string> rules{
      "field=spec rule=\"serialized size " + std::to_string(big.ByteSizeLong()) +
          " bytes exceeds the limit of 65536 bytes\"",
      "field=model.d_model rule=\"must be divisible by model.n_heads",
      "field=request_id rule=\"longer than the limit of 256 bytes (got 300)\"",
      "code=ALREADY_EXISTS", "was already used for job"};
  // Each refusal was answered after its line was written.
  const std::string text = ReadFile(log);
  int refused = 0;
  for (size_t at = text.find("job_refused"); at != std::string::npos;
       at = text.find("job_refused", at + 1))
    ++refused;
  EXPECT_EQ(refused, 4) << text;
  for (const std::string& rule : rules)
    EXPECT_NE(text.find(rule), std::string::npos) << rule << "\n" << text;
}

}  // namespace
}  // namespace fsdp8
