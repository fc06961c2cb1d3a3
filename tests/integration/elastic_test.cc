// Continue on fewer replicas (docs/architecture.md): a job of 2 replicas x 2-rank shard groups
// (CPU ranks, the default job's model shapes, optimizer_sharding SHARD_GROUP) on 2 simulated hosts
// (127.0.0.1 and 127.0.0.2: each host holds one shard group) loses a rank of replica 1 to SIGKILL
// or SIGSTOP after a few steps; the coordinator drops replica 1 and the job steps on on replica 0
// from the survivors' in-memory state, through real processes on loopback (tests/support).
//
// What is asserted, and why:
// - No checkpoint is read: the workers run with FSDP8_FAULT_CHECKPOINT_READ=/ (common/
//   fault_injection.h), so any checkpoint load fails the job (DATA_LOSS, not restarted); the job
//   succeeds with Job.restarts 0, and no worker log says "loaded checkpoint".
// - The first step after the fault is the one that was in flight: the published step events are
//   exactly 1, 2, ..., steps in order (a skipped step leaves a gap, a repeated one a duplicate;
//   the checkpoint path would repeat the steps since step 5's checkpoint).
// - The job steps again within 15 s of the fault (the time is printed; target 2 s).
// - sharding.elastic true: every step still trains on the global batch (the step events' token
//   counts), and the losses after the fault stay within C12's FP8 tolerance (5e-3 relative) of the
//   same job run without a fault (2 replicas, the same tokens per step): 1 replica of 2 ranks
//   trains on the same sequences, so only the order of f32 sums differs (CPU ranks are
//   deterministic, but the grad norm's partial sums are taken over other shard boundaries).
//   A step applied twice, skipped, or run on half the batch moves them far more.
// - sharding.elastic false: the global batch halves after the fault (tokens per step).
// - Job.replicas 1 and Job.configured_replicas 2 afterwards; fsdp8 status says "1 of 2 replicas
//   live".
// - optimizer_sharding WORLD (HFSDP): the survivors cannot rebuild the optimizer state: the event
//   says "falling back to the checkpoint path" and the job finishes from its checkpoint.
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
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

constexpr int kSteps = 14;
constexpr int kFaultAfter = 6;  // the fault comes once the job reported this step (3 steps
                                // before the next checkpoint save, at 10)
constexpr int kGlobalBatch = 16;
constexpr int kSeqLen = 256;

// The fsdp8 CLI's output (stdout and stderr) for `args`.
std::string RunCli(const std::string& args) {
  std::string out;
  FILE* p = popen((std::string(FSDP8_CLI_BIN) + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// What a watcher saw of one job.
struct Seen {
  std::vector<int64_t> steps;          // step numbers of the step events, in order
  std::map<int64_t, double> loss;      // by step
  std::map<int64_t, int64_t> tokens;   // cumulative tokens, by step
  std::vector<std::string> messages;
  v1::JobState end = v1::JOB_STATE_UNSPECIFIED;
  double fault_time = 0;     // seconds since the Unix epoch (JobEvent.time's clock)
  double recovery_s = -1;    // fault -> the first step done after it (its event's time)
  int64_t last_before = 0;   // the last step done before the fault
  int64_t first_after_step = 0;
};

class ElasticTest : public ::testing::Test {
 protected:
  // A coordinator and 4 CPU workers: node-0 and node-1 on host 127.0.0.1, node-2 and node-3 on
  // 127.0.0.2 (each host one shard group of a 2 x 2 mesh).
  void StartCluster(const std::vector<std::string>& env) {
    ASSERT_FALSE(tmp_.path().empty());
    dir_ = tmp_.path();
    WriteCorpus();
    testing::ProcessOptions options;
    options.env = env;
    cluster_ = std::make_unique<LocalCluster>(
        LocalCluster::Binaries{FSDP8_COORDINATOR_BIN, FSDP8_WORKER_BIN}, dir_, options);
    addr_ = cluster_->StartCoordinator({"--state_db=" + (dir_ / "jobs.db").string(),
                                        "--data_roots=" + dir_.string(), "--listen=127.0.0.1:0"},
                                       "coordinator.log");
    ASSERT_FALSE(addr_.empty()) << ReadFile(cluster_->LogPath("coordinator.log"));
    auto channel = grpc::CreateChannel(addr_, grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel);
    admin_ = v1::AdminService::NewStub(channel);
    for (int i = 0; i < 4; ++i) {
      cluster_->AddWorker({"--coordinator=" + addr_, "--threads=1",
                           std::string("--host=127.0.0.") + (i < 2 ? "1" : "2"),
                           "--name=node-" + std::to_string(i)},
                          "worker-" + std::to_string(i) + ".log");
      ASSERT_TRUE(WaitForIdleWorkers(i + 1)) << "worker " << i << " did not register";
    }
  }

  void WriteCorpus() {
    static const char* kWords[] = {"the ", "cat ", "sat ", "on ", "a ", "mat. ", "dogs ", "run "};
    std::vector<uint16_t> toks;
    uint64_t x = 7;
    while (toks.size() < 400000) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      for (const char* c = kWords[(x >> 33) % 8]; *c; ++c) toks.push_back(static_cast<uint8_t>(*c));
    }
    ASSERT_TRUE(WriteTokenShard((dir_ / "train.bin").string(), toks).ok());
  }

  bool WaitForIdleWorkers(int n) {
    const auto until = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < until) {
      v1::ListWorkersResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      int idle = 0;
      if (admin_->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok())
        for (const auto& w : resp.workers()) idle += w.state() == v1::WORKER_STATE_IDLE;
      if (idle >= n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  // The default job's shapes and recipe (data/default-job.yaml) as 2 replicas x 2 ranks, a
  // checkpoint every 5 steps under dir_/<ck>.
  v1::JobSpec Spec(const std::string& ck, bool elastic,
                   v1::OptimizerSharding sharding = v1::OPTIMIZER_SHARDING_SHARD_GROUP) const {
    v1::JobSpec s;
    s.set_name("elastic");
    s.set_backend("cpu");
    auto* m = s.mutable_model();
    m->set_d_model(128);
    m->set_n_layers(4);
    m->set_n_heads(4);
    m->set_ffn_dim(384);
    m->set_vocab_size(256);
    m->set_seq_len(kSeqLen);
    s.mutable_data()->set_train_path((dir_ / "train.bin").string());
    auto* t = s.mutable_training();
    t->set_steps(kSteps);
    t->set_global_batch(kGlobalBatch);
    t->set_seed(1234);
    t->set_eval_every(0);
    auto* o = s.mutable_optimizer();
    o->set_peak_lr(0.005);
    o->set_beta1(0.85);
    o->set_beta2(0.99);
    o->set_min_lr_ratio(0.1);
    o->set_weight_decay(0.1);
    o->set_grad_clip(1.0);
    auto* sh = s.mutable_sharding();
    sh->set_min_workers(4);
    sh->set_max_workers(4);
    sh->set_replicas(2);
    sh->set_optimizer_sharding(sharding);
    sh->set_elastic(elastic);
    auto* p = s.mutable_precision();
    p->set_linears(v1::PRECISION_FP8);
    p->set_embedding(v1::PRECISION_BF16);
    p->set_lm_head(v1::PRECISION_BF16);
    s.mutable_checkpoint()->set_dir((dir_ / ck).string());
    s.mutable_checkpoint()->set_every_steps(5);
    return s;
  }

  std::string Submit(const v1::JobSpec& spec) {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    v1::Job job;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status st = jobs_->SubmitJob(&ctx, req, &job);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return job.job_id();
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

  ChildProcess* WorkerOf(const std::string& worker_id) {
    for (size_t i = 0; i < cluster_->num_workers(); ++i)
      if (worker_id == "node-" + std::to_string(i)) return cluster_->worker(i);
    return nullptr;
  }

  // Runs the job to its end; `fault` (when set) gets the process of rank `fault_rank` once the
  // step event of step `fault_after` came. *id: the job's id.
  Seen Run(const v1::JobSpec& spec, const std::function<void(ChildProcess*)>& fault,
           std::string* id_out = nullptr, int fault_rank = 3, int fault_after = kFaultAfter) {
    Seen seen;
    const std::string id = Submit(spec);
    if (id_out != nullptr) *id_out = id;
    if (id.empty()) return seen;
    v1::WatchJobRequest req;
    req.set_job_id(id);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
    auto reader = jobs_->WatchJob(&ctx, req);
    v1::JobEvent ev;
    bool faulted = false;
    while (reader->Read(&ev)) {
      if (!ev.message().empty()) seen.messages.push_back(ev.message());
      if (ev.state() != v1::JOB_STATE_UNSPECIFIED) seen.end = ev.state();
      if (ev.loss() > 0 && ev.message().empty()) {  // a step event (not a state change's)
        seen.steps.push_back(ev.step());
        seen.loss[ev.step()] = ev.loss();
        seen.tokens[ev.step()] = ev.tokens();
        // Events published before the fault may still be read after it: their time says.
        if (!faulted || ev.time() < seen.fault_time) {
          seen.last_before = ev.step();
        } else if (seen.recovery_s < 0) {
          seen.recovery_s = ev.time() - seen.fault_time;
          seen.first_after_step = ev.step();
        }
      }
      if (fault && !faulted && ev.loss() > 0 && ev.message().empty() && ev.step() >= fault_after) {
        const v1::Job job = GetJob(id);
        ChildProcess* proc = job.worker_ids_size() > fault_rank
                                 ? WorkerOf(job.worker_ids(fault_rank)) : nullptr;
        EXPECT_NE(proc, nullptr) << "no worker for rank " << fault_rank;
        if (proc == nullptr) break;
        seen.fault_time = NowSeconds();
        fault(proc);
        faulted = true;
      }
    }
    reader->Finish();
    if (fault) {
      EXPECT_TRUE(faulted) << "the job never reached step " << fault_after;
    }
    return seen;
  }

  // The published step events are 1..kSteps, each once, in order; the job stepped again within
  // 15 s of the fault, first the step that was in flight.
  void ExpectNoStepSkippedOrRepeated(const Seen& seen, const char* what) {
    std::vector<int64_t> expected;
    for (int k = 1; k <= kSteps; ++k) expected.push_back(k);
    EXPECT_EQ(seen.steps, expected) << "the published steps are not 1.." << kSteps;
    ASSERT_GE(seen.recovery_s, 0) << "no step after the fault";
    EXPECT_EQ(seen.first_after_step, seen.last_before + 1);
    const double secs = seen.recovery_s;
    std::printf("%s of rank 3 after step %ld: step %ld done %.3f s after the fault\n", what,
                static_cast<long>(seen.last_before), static_cast<long>(seen.first_after_step),
                secs);
    EXPECT_LT(secs, 15.0);
  }

  // The job continued on 1 replica without a checkpoint read (see the file's comment).
  void ExpectContinuedOnOneReplica(const std::string& id, const Seen& seen) {
    const v1::Job job = GetJob(id);
    ASSERT_EQ(seen.end, v1::JOB_STATE_SUCCEEDED) << job.reason();
    bool continued = false;
    for (const std::string& m : seen.messages) {
      std::printf("  event: %s\n", m.c_str());
      continued |= m.find("replica 1 lost (rank ") != std::string::npos &&
                    m.find("continuing on 1 replica at step ") != std::string::npos;
      EXPECT_EQ(m.find("resuming from"), std::string::npos) << m;
      EXPECT_EQ(m.find("falling back"), std::string::npos) << m;
    }
    EXPECT_TRUE(continued) << "no \"replica 1 lost ...: continuing on 1 replica\" event";
    EXPECT_EQ(job.restarts(), 0);
    EXPECT_EQ(job.replicas(), 1);
    EXPECT_EQ(job.configured_replicas(), 2);
    EXPECT_EQ(job.world_size(), 2);
    EXPECT_EQ(job.step(), kSteps);
    // fsdp8 status shows the live mesh and the configured replicas.
    const std::string status = RunCli("--coordinator " + addr_ + " status " + id);
    EXPECT_NE(status.find("world size: 2 = 1x2 replicas x shard group (1 of 2 replicas live)"),
              std::string::npos)
        << status;
    for (int i = 0; i < 4; ++i) {
      const std::string log = ReadFile(cluster_->LogPath("worker-" + std::to_string(i) + ".log"));
      EXPECT_EQ(log.find("loaded checkpoint"), std::string::npos) << "worker " << i;
    }
    // Replica 0's ranks (node-0 and node-1, the first host's shard group) went on.
    for (int i = 0; i < 2; ++i) {
      const std::string log = ReadFile(cluster_->LogPath("worker-" + std::to_string(i) + ".log"));
      EXPECT_NE(log.find("without a checkpoint read"), std::string::npos) << "worker " << i;
    }
  }

  TempDir tmp_{"fsdp8-elastic", TempDir::Cleanup::kUnlessFailed};
  fs::path dir_;
  std::string addr_;
  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
};

// SIGKILL of a rank of replica 1, sharding.elastic true: the job steps on on replica 0 from the
// step that was in flight, keeps its tokens per step, and its losses stay within C12's FP8
// tolerance of the fault-free run.
TEST_F(ElasticTest, SigkillOfAReplicaRankContinuesOnOneReplicaWithoutACheckpointRead) {
  StartCluster({"FSDP8_FAULT_CHECKPOINT_READ=/"});
  const Seen reference = Run(Spec("reference", true), nullptr);
  ASSERT_EQ(reference.end, v1::JOB_STATE_SUCCEEDED);
  std::string id;
  const Seen seen = Run(Spec("ck", true), [](ChildProcess* p) { p->Signal(SIGKILL); }, &id);
  ExpectNoStepSkippedOrRepeated(seen, "SIGKILL");
  ExpectContinuedOnOneReplica(id, seen);
  // The same tokens per step before and after the fault (gradient accumulation).
  for (int k = 2; k <= kSteps; ++k) {
    ASSERT_TRUE(seen.tokens.count(k) && seen.tokens.count(k - 1)) << "step " << k;
    EXPECT_EQ(seen.tokens.at(k) - seen.tokens.at(k - 1), int64_t{kGlobalBatch} * kSeqLen)
        << "step " << k;
  }
  double worst = 0;
  for (int k = 1; k <= kSteps; ++k) {
    ASSERT_TRUE(seen.loss.count(k) && reference.loss.count(k)) << "step " << k;
    const double rel = std::fabs(seen.loss.at(k) - reference.loss.at(k)) / reference.loss.at(k);
    if (k <= seen.last_before) {
      EXPECT_EQ(seen.loss.at(k), reference.loss.at(k)) << "step " << k;
    }
    EXPECT_LT(rel, 5e-3) << "step " << k;
    worst = std::max(worst, rel);
  }
  std::printf("losses after the fault vs the fault-free run (2 replicas, same tokens per step): "
              "at most %.3g relative\n", worst);
}

// SIGSTOP of a rank of replica 1: its heartbeats stop (or the step deadline passes), then the
// same path as a SIGKILL.
TEST_F(ElasticTest, SigstopOfAReplicaRankIsDetectedAndTheJobContinuesOnOneReplica) {
  StartCluster({"FSDP8_FAULT_CHECKPOINT_READ=/"});
  std::string id;
  ChildProcess* stopped = nullptr;
  const Seen seen = Run(Spec("ck", true), [&](ChildProcess* p) {
    p->Signal(SIGSTOP);
    stopped = p;
  }, &id);
  if (stopped != nullptr) stopped->Signal(SIGCONT);
  ExpectNoStepSkippedOrRepeated(seen, "SIGSTOP");
  ExpectContinuedOnOneReplica(id, seen);
}

// sharding.elastic false: the global batch shrinks by the lost replica's share (the step events'
// tokens), the job goes on and finishes.
TEST_F(ElasticTest, WithoutElasticTheGlobalBatchShrinksByTheLostReplicasShare) {
  StartCluster({"FSDP8_FAULT_CHECKPOINT_READ=/"});
  std::string id;
  const Seen seen = Run(Spec("ck", false), [](ChildProcess* p) { p->Signal(SIGKILL); }, &id);
  ExpectNoStepSkippedOrRepeated(seen, "SIGKILL");
  ExpectContinuedOnOneReplica(id, seen);
  for (int k = 2; k <= kSteps; ++k) {
    ASSERT_TRUE(seen.tokens.count(k) && seen.tokens.count(k - 1)) << "step " << k;
    const int64_t batch = k <= seen.last_before ? kGlobalBatch : kGlobalBatch / 2;
    EXPECT_EQ(seen.tokens.at(k) - seen.tokens.at(k - 1), int64_t{batch} * kSeqLen)
        << "step " << k;
    EXPECT_TRUE(std::isfinite(seen.loss.at(k)));
  }
  bool said = false;
  for (const std::string& m : seen.messages)
    said |= m.find("global batch 8 (was 16)") != std::string::npos;
  EXPECT_TRUE(said) << "no event names the shrunk global batch";
}

// optimizer_sharding WORLD (HFSDP): each survivor holds only its piece of the optimizer state:
// the job falls back to the checkpoint path (reads allowed here), says so, and finishes on the
// workers left (sharding.min_workers 2) from its checkpoint of step 5 (the fault comes after
// step 6).
TEST_F(ElasticTest, HfsdpFallsBackToTheCheckpointPathAndFinishes) {
  StartCluster({});
  v1::JobSpec spec = Spec("ck", true, v1::OPTIMIZER_SHARDING_WORLD);
  spec.mutable_sharding()->set_min_workers(2);
  std::string id;
  const Seen seen =
      Run(spec, [](ChildProcess* p) { p->Signal(SIGKILL); }, &id, /*fault_rank=*/3, kFaultAfter);
  const v1::Job job = GetJob(id);
  ASSERT_EQ(seen.end, v1::JOB_STATE_SUCCEEDED) << job.reason();
  bool fell_back = false, resumed = false;
  for (const std::string& m : seen.messages) {
    std::printf("  event: %s\n", m.c_str());
    fell_back |= m.find("replica 1 lost (rank ") != std::string::npos &&
                 m.find("optimizer_sharding WORLD") != std::string::npos &&
                 m.find("falling back to the checkpoint path") != std::string::npos;
    resumed |= m.find("resuming from") != std::string::npos && m.find("step-5") != std::string::npos;
    EXPECT_EQ(m.find("continuing on"), std::string::npos) << m;
  }
  EXPECT_TRUE(fell_back) << "no event says the job falls back to the checkpoint path";
  EXPECT_TRUE(resumed) << "the job did not resume from its checkpoint";
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.step(), kSteps);
}

}  // namespace
}  // namespace fsdp8
