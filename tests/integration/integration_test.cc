// End to end on loopback: a real fsdp8-coordinator and 3 fsdp8-worker processes train on the real
// corpus (Debian fortunes, byte-level) through the gRPC API, at world sizes 1, 2 and 3.
//
// What is asserted, and why the tolerances are what they are:
// - The loss falls: the mean loss of the last 5 steps is at least 1 nat below the first step's
//   (uniform over bytes is 5.55 nats; the reference reaches ~2.8 by step 50).
// - C12: with FP32 linears, the same job at world size 3 matches world size 1 step by step. Every
//   rank sees the same sequences (the data rule) and the same initial bits (init by global index),
//   so the only differences are the order of FP32 sums: the gradient reduce-scatter (a sum of 3
//   partial gradients instead of one running sum) and the loss/norm all-reduces. Each reorder
//   perturbs a sum by a few ulps, relative ~1e-7 (u = 6e-8); AdamW passes such perturbations
//   through to the weights at the same relative size, and over 50 steps they stay of that order
//   in the loss (measured: 1e-8). We allow 1e-5 relative. Rounding the partial sums to BF16 at
//   each hop (relative 2^-9 = 2e-3 per hop) would move the step-1 gradient, and so the losses
//   from step 2 on, by ~1e-3: two orders of magnitude over the bound.
// - FP8: the 2- and 3-rank runs of the default FP8 plan follow the 1-rank run. Here a reorder
//   perturbation can also move a value across an FP8 rounding boundary (one E4M3 code is 2^-3
//   relative), which changes that element by a whole code; these flips are rare (a perturbation of
//   1e-7 relative hits a boundary with probability ~1e-6 per element) but each is large, so the
//   trajectories separate more (measured: 3.5e-4 at worst over 50 steps). We allow 5e-3 relative;
//   a wrong scale or a lost gradient shard changes the loss by more than 5e-2 within a few steps.
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "common/checkpoint_format.h"
#include "common/token_shard.h"
#include "fsdp8/v1/admin.grpc.pb.h"
#include "fsdp8/v1/checkpoint.pb.h"
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

// The default corpus: every file of /usr/share/games/fortunes except *.dat
// and *.u8, in name order, last 5% held out.
void PrepareCorpus(const fs::path& dir) {
  const fs::path src = "/usr/share/games/fortunes";
  ASSERT_TRUE(fs::is_directory(src)) << src << " missing: apt-get install fortunes";
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(src)) {
    std::string n = e.path().filename().string();
    if (n.size() > 4 && (n.substr(n.size() - 4) == ".dat" || n.substr(n.size() - 3) == ".u8")) continue;
    names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  std::string all;
  for (const auto& n : names) all += ReadFile(src / n);
  ASSERT_GT(all.size(), 1000000u);
  size_t n_val = all.size() / 20;
  std::vector<uint16_t> train(all.begin(), all.end() - n_val), val(all.end() - n_val, all.end());
  for (auto& t : train) t = static_cast<uint8_t>(t);
  for (auto& t : val) t = static_cast<uint8_t>(t);
  ASSERT_TRUE(WriteTokenShard((dir / "train.bin").string(), train).ok());
  ASSERT_TRUE(WriteTokenShard((dir / "val.bin").string(), val).ok());
}

class Cluster : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { StartCluster(false); }

  // A coordinator and 3 workers. one_at_a_time: each worker is started only after the previous one
  // registered, so that worker_ids_[i] is the id of cluster_->worker(i).
  // worker_hosts: one --host per worker (loopback addresses; distinct ones are distinct hosts for
  // placement); empty: 3 workers on 127.0.0.1.
  static void StartCluster(bool one_at_a_time, const std::vector<std::string>& coordinator_flags = {},
                           std::vector<std::string> worker_hosts = {}) {
    if (worker_hosts.empty()) worker_hosts.assign(3, "127.0.0.1");
    tmp_ = new TempDir(one_at_a_time ? "fsdp8-integration-recovery" : "fsdp8-integration",
                       TempDir::Cleanup::kUnlessFailed);
    dir_ = new fs::path(tmp_->path());
    PrepareCorpus(*dir_);
    // Port 0: the kernel picks a free port (a fixed or pid-derived one can collide with another
    // run); the coordinator prints the bound address, which the workers then dial.
    cluster_ = new LocalCluster({FSDP8_COORDINATOR_BIN, FSDP8_WORKER_BIN}, *dir_);
    coordinator_flags_ = new std::vector<std::string>(coordinator_flags);
    addr_ = new std::string(StartCoordinator("127.0.0.1:0", "coordinator.log"));
    ASSERT_FALSE(addr_->empty());
    auto channel = grpc::CreateChannel(*addr_, grpc::InsecureChannelCredentials());
    admin_ = v1::AdminService::NewStub(channel).release();
    worker_ids_ = new std::vector<std::string>();
    for (int i = 0; i < static_cast<int>(worker_hosts.size()); ++i) {
      // Named as Kubernetes names a StatefulSet's pods: the ids survive a coordinator restart.
      cluster_->AddWorker({"--coordinator=" + *addr_, "--threads=1", "--host=" + worker_hosts[i],
                           "--name=node-" + std::to_string(i)},
                          "worker-" + std::to_string(i) + ".log");
      if (!one_at_a_time) continue;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      for (;;) {
        const auto workers = ListWorkers();
        if (workers && workers->size() == static_cast<size_t>(i + 1)) {
          for (const auto& w : *workers)
            if (std::find(worker_ids_->begin(), worker_ids_->end(), w.worker_id()) ==
                worker_ids_->end())
              worker_ids_->push_back(w.worker_id());
          break;
        }
        ASSERT_LT(std::chrono::steady_clock::now(), until) << "worker " << i << " did not register";
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      ASSERT_EQ(worker_ids_->size(), static_cast<size_t>(i + 1));
    }
    stub_ = v1::JobService::NewStub(channel).release();
  }
  // (Re)starts the coordinator on `listen` with the cluster's state database; returns the address
  // it listens on ("" after a test failure).
  static std::string StartCoordinator(const std::string& listen, const std::string& log_name) {
    std::vector<std::string> flags{"--listen=" + listen,
                                   "--state_db=" + (*dir_ / "jobs.db").string(),
                                   "--data_roots=" + dir_->string()};
    flags.insert(flags.end(), coordinator_flags_->begin(), coordinator_flags_->end());
    std::string addr = cluster_->StartCoordinator(flags, log_name);
    EXPECT_TRUE(cluster_->coordinator()->ok()) << "could not start " << FSDP8_COORDINATOR_BIN;
    const fs::path log = cluster_->LogPath(log_name);
    EXPECT_FALSE(addr.empty()) << "no \"listening on\" line in " << log << ":\n" << ReadFile(log);
    return addr;
  }

  static void TearDownTestSuite() {
    delete stub_;
    stub_ = nullptr;
    delete admin_;
    admin_ = nullptr;
    delete worker_ids_;
    worker_ids_ = nullptr;
    delete cluster_;  // stops the processes
    cluster_ = nullptr;
    delete coordinator_flags_;
    coordinator_flags_ = nullptr;
    delete tmp_;  // removes the directory unless the suite failed
    tmp_ = nullptr;
    delete dir_;
    delete addr_;
  }

  static v1::JobSpec SmallSpec(int world, v1::Precision linears, int steps) {
    v1::JobSpec s;
    s.set_name("integration");
    s.set_backend("cpu");
    auto* m = s.mutable_model();
    m->set_d_model(64);
    m->set_n_layers(2);
    m->set_n_heads(4);
    m->set_ffn_dim(192);
    m->set_vocab_size(256);
    m->set_seq_len(128);
    s.mutable_data()->set_train_path((*dir_ / "train.bin").string());
    s.mutable_data()->set_val_path((*dir_ / "val.bin").string());
    auto* t = s.mutable_training();
    t->set_steps(steps);
    t->set_global_batch(12);  // divisible by 1, 2 and 3 ranks
    t->set_seed(7);
    t->set_eval_every(0);
    s.mutable_optimizer()->set_peak_lr(3e-3);
    s.mutable_sharding()->set_min_workers(world);
    s.mutable_sharding()->set_max_workers(world);
    auto* p = s.mutable_precision();
    p->set_linears(linears);
    if (linears == v1::PRECISION_FP32) {
      p->set_embedding(v1::PRECISION_FP32);
      p->set_lm_head(v1::PRECISION_FP32);
    }
    return s;
  }

  // Submits (retrying while the coordinator starts, e.g. after a restart); the job, or an empty
  // job_id after a reported failure.
  static v1::Job Submit(const v1::JobSpec& spec, const std::string& request_id = "") {
    v1::Job job;
    if (stub_ == nullptr) {  // SetUpTestSuite failed (its message says why)
      ADD_FAILURE() << "the cluster did not start";
      return job;
    }
    v1::SubmitJobRequest req;
    req.set_request_id(request_id);
    *req.mutable_spec() = spec;
    grpc::Status st;
    for (int i = 0; i < 100; ++i) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      st = stub_->SubmitJob(&ctx, req, &job);
      if (st.error_code() != grpc::StatusCode::UNAVAILABLE) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    EXPECT_TRUE(st.ok()) << st.error_message();
    if (!st.ok()) job.clear_job_id();
    return job;
  }

  // Watches job_id from after_seq until the stream ends (the job ended, or the coordinator went
  // away). Fills losses[step - 1] from step events; returns the last state seen, and in *message
  // the last message and in *last_seq the last seq.
  static v1::JobState Follow(const std::string& job_id, int64_t after_seq,
                             std::vector<double>* losses,
                             const std::function<void(const v1::JobEvent&)>& on_event = {},
                             std::string* message = nullptr, int64_t* last_seq = nullptr) {
    v1::WatchJobRequest wr;
    wr.set_job_id(job_id);
    wr.set_after_seq(after_seq);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
    auto reader = stub_->WatchJob(&ctx, wr);
    v1::JobEvent ev;
    v1::JobState last = v1::JOB_STATE_UNSPECIFIED;
    while (reader->Read(&ev)) {
      if (on_event) on_event(ev);
      if (ev.state() != v1::JOB_STATE_UNSPECIFIED) last = ev.state();
      if (message != nullptr && !ev.message().empty()) *message = ev.message();
      if (last_seq != nullptr) *last_seq = ev.seq();
      // A step event carries step = completed steps (1-based) and that step's loss.
      if (ev.step() >= 1 && ev.step() <= static_cast<int64_t>(losses->size()) && ev.loss() > 0) {
        (*losses)[ev.step() - 1] = ev.loss();
      }
    }
    reader->Finish();
    return last;
  }

  // Submits, waits for the job to end, returns the loss of every step (index = step).
  // on_event, when given, sees every event (e.g. to inject a fault mid-job); `reason` receives
  // the last message.
  static std::vector<double> Run(const v1::JobSpec& spec,
                                 const std::function<void(const v1::JobEvent&)>& on_event = {},
                                 v1::JobState expect = v1::JOB_STATE_SUCCEEDED,
                                 std::string* reason = nullptr) {
    const v1::Job job = Submit(spec);
    if (job.job_id().empty()) return {};
    std::vector<double> losses(spec.training().steps(), NAN);
    std::string message;
    const v1::JobState last = Follow(job.job_id(), 0, &losses, on_event, &message);
    EXPECT_EQ(last, expect) << message;
    if (reason != nullptr) *reason = message;
    return losses;
  }

  // The coordinator's workers (AdminService.ListWorkers); nullopt when the call fails.
  static std::optional<std::vector<v1::WorkerInfo>> ListWorkers() {
    v1::ListWorkersResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!admin_->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp).ok()) return std::nullopt;
    return std::vector<v1::WorkerInfo>(resp.workers().begin(), resp.workers().end());
  }

  static v1::Job GetJob(const std::string& job_id) {
    v1::GetJobRequest req;
    req.set_job_id(job_id);
    v1::Job job;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status st = stub_->GetJob(&ctx, req, &job);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return job;
  }

  // The process of a worker id (worker_ids_ order, one_at_a_time clusters only).
  static ChildProcess* WorkerProcess(const std::string& worker_id) {
    auto it = std::find(worker_ids_->begin(), worker_ids_->end(), worker_id);
    if (it == worker_ids_->end()) return nullptr;
    return cluster_->worker(it - worker_ids_->begin());
  }

  static TempDir* tmp_;
  static fs::path* dir_;  // tmp_'s path
  static std::string* addr_;
  static std::vector<std::string>* coordinator_flags_;
  static LocalCluster* cluster_;
  static v1::JobService::Stub* stub_;
  static v1::AdminService::Stub* admin_;
  static std::vector<std::string>* worker_ids_;
};
TempDir* Cluster::tmp_ = nullptr;
fs::path* Cluster::dir_ = nullptr;
std::string* Cluster::addr_ = nullptr;
std::vector<std::string>* Cluster::coordinator_flags_ = nullptr;
LocalCluster* Cluster::cluster_ = nullptr;
v1::JobService::Stub* Cluster::stub_ = nullptr;
v1::AdminService::Stub* Cluster::admin_ = nullptr;
std::vector<std::string>* Cluster::worker_ids_ = nullptr;

// max_k |a[k] - b[k]| / b[k], printed so the margin to each tolerance shows in the test log.
double MaxRelDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t k = 0; k < a.size() && k < b.size(); ++k) m = std::max(m, std::fabs(a[k] - b[k]) / b[k]);
  return m;
}

double MeanLast(const std::vector<double>& v, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += v[v.size() - 1 - i];
  return s / n;
}

TEST_F(Cluster, C12_Fp32SameJobOnOneAndThreeRanksMatches) {
  const int steps = 50;
  auto one = Run(SmallSpec(1, v1::PRECISION_FP32, steps));
  auto three = Run(SmallSpec(3, v1::PRECISION_FP32, steps));
  ASSERT_EQ(one.size(), static_cast<size_t>(steps));
  ASSERT_EQ(three.size(), static_cast<size_t>(steps));
  for (int k = 0; k < steps; ++k) {
    ASSERT_TRUE(std::isfinite(one[k]) && std::isfinite(three[k])) << "step " << k;
    EXPECT_NEAR(three[k], one[k], 1e-5 * one[k]) << "step " << k;
  }
  std::printf("fp32 plan: max relative loss difference, 3 vs 1 ranks: %.3g (tolerance 1e-5)\n",
              MaxRelDiff(three, one));
  EXPECT_LT(MeanLast(one, 5), one[0] - 1.0) << "the loss does not fall";
}

TEST_F(Cluster, C12_Fp8DefaultPlanOnOneTwoThreeRanks) {
  const int steps = 50;
  auto one = Run(SmallSpec(1, v1::PRECISION_FP8, steps));
  auto two = Run(SmallSpec(2, v1::PRECISION_FP8, steps));
  auto three = Run(SmallSpec(3, v1::PRECISION_FP8, steps));
  ASSERT_EQ(one.size(), static_cast<size_t>(steps));
  for (int k = 0; k < steps; ++k) {
    ASSERT_TRUE(std::isfinite(one[k]) && std::isfinite(two[k]) && std::isfinite(three[k]))
        << "step " << k;
    EXPECT_NEAR(two[k], one[k], 5e-3 * one[k]) << "step " << k;
    EXPECT_NEAR(three[k], one[k], 5e-3 * one[k]) << "step " << k;
  }
  std::printf("fp8 plan: max relative loss difference, 2 vs 1 ranks: %.3g, 3 vs 1 ranks: %.3g "
              "(tolerance 5e-3); loss %.3f -> %.3f\n",
              MaxRelDiff(two, one), MaxRelDiff(three, one), one[0], MeanLast(one, 5));
  EXPECT_LT(MeanLast(one, 5), one[0] - 1.0) << "the loss does not fall";
  EXPECT_LT(MeanLast(three, 5), three[0] - 1.0) << "the loss does not fall";
}

// C10 (recovery): its own coordinator and 3 workers, started one at a time so that a rank's worker
// id names its process. A worker holding a rank of a 2-rank job with checkpoints every 5 steps is
// killed after step 8; the job goes RECOVERING, restarts on the 2 healthy workers from the latest
// committed checkpoint and succeeds after one restart, with the losses of an uninterrupted run
// bit for bit (same world size; the steps after the checkpoint are recomputed identically).
class RecoveryCluster : public Cluster {
 protected:
  static void SetUpTestSuite() { StartCluster(true); }
};

TEST_F(RecoveryCluster, C10_KilledRankRecoversFromTheLatestCheckpoint) {
  const int steps = 30;
  auto spec = [&](const std::string& ck) {
    v1::JobSpec s = SmallSpec(2, v1::PRECISION_FP32, steps);
    s.mutable_checkpoint()->set_dir((*dir_ / ck).string());
    s.mutable_checkpoint()->set_every_steps(5);
    return s;
  };
  auto reference = Run(spec("ck-reference"));
  ASSERT_EQ(reference.size(), static_cast<size_t>(steps));
  std::vector<std::string> messages;
  testing::RankFailureTimer kill(SIGKILL, 8, [&](const std::string& job_id) {
    const v1::Job job = GetJob(job_id);
    EXPECT_EQ(job.worker_ids_size(), 2);
    if (job.worker_ids_size() != 2) return testing::RankFailureTimer::Rank0{};
    return testing::RankFailureTimer::Rank0{job.worker_ids(0), WorkerProcess(job.worker_ids(0))};
  });
  auto recovered = Run(spec("ck"), [&](const v1::JobEvent& ev) {
    if (!ev.message().empty()) messages.push_back(ev.message());
    kill.OnEvent(ev);
  });
  ASSERT_TRUE(kill.failed()) << "the job never reached step 8";
  ASSERT_NE(kill.recovering(), Clock::time_point()) << "no RECOVERING event";
  ASSERT_NE(kill.running(), Clock::time_point()) << "never RUNNING again";
  std::printf("killed rank 0 (%s) after step 8: RECOVERING after %.3f s, RUNNING again after "
              "%.3f s, first recomputed step after %.3f s\n",
              kill.victim().c_str(), kill.SecondsTo(kill.recovering()),
              kill.SecondsTo(kill.running()), kill.SecondsTo(kill.first_step()));
  for (const auto& m : messages)
    if (m.find("recovering") != std::string::npos || m.find("resuming") != std::string::npos ||
        m.find("generation") != std::string::npos)
      std::printf("  event: %s\n", m.c_str());
  v1::GetJobRequest req;
  req.set_job_id(kill.job_id());
  v1::Job job;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->GetJob(&ctx, req, &job).ok());
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.step(), steps);
  ASSERT_EQ(recovered.size(), reference.size());
  for (int k = 9; k < steps; ++k)  // step 10 on (index = step - 1)
    EXPECT_EQ(recovered[k], reference[k]) << "step " << k + 1;
  EXPECT_LT(kill.SecondsTo(kill.recovering()), 10.0);
}

// Failure handling with the short timeouts a test can afford: heartbeats every 250 ms, a worker is
// dead after 2 s of silence, a collective gives up after 5 s (so a rank blocked on a hung peer
// stops within 5 s of its last progress), aborted workers are reassignable after 1 s.
class ChaosCluster : public Cluster {
 protected:
  static constexpr double kHeartbeatTimeoutS = 2;
  static constexpr double kCollectiveTimeoutS = 5;
  static void SetUpTestSuite() {
    StartCluster(true, {"--heartbeat_interval_ms=250", "--heartbeat_timeout_s=2",
                        "--collective_timeout_ms=5000", "--abort_grace_s=1"});
  }
  // 2 ranks, FP32, a checkpoint every 5 steps under dir_/ck.
  static v1::JobSpec CkptSpec(const std::string& ck, int steps) {
    v1::JobSpec s = SmallSpec(2, v1::PRECISION_FP32, steps);
    s.mutable_checkpoint()->set_dir((*dir_ / ck).string());
    s.mutable_checkpoint()->set_every_steps(5);
    return s;
  }
};

// The newest committed checkpoint's step under ck (a step-<k> directory with a MANIFEST), of those
// saved by `world_size` ranks when it is above 0; -1: none.
int64_t NewestCommitted(const fs::path& ck, int world_size = 0) {
  int64_t newest = -1;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(ck, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0 || !fs::exists(e.path() / "MANIFEST")) continue;
    if (world_size > 0) {
      v1::CheckpointManifest m;
      if (!google::protobuf::util::JsonStringToMessage(ReadFile(e.path() / "MANIFEST"), &m).ok()) {
        ADD_FAILURE() << "unreadable " << (e.path() / "MANIFEST");
        continue;
      }
      if (m.world_size() != world_size) continue;
    }
    newest = std::max<int64_t>(newest, std::stoll(name.substr(5)));
  }
  return newest;
}

double Since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

// C10 (hang): a rank's process is stopped (SIGSTOP) after step 8 of a 2-rank job; its heartbeats
// stop, the coordinator declares it dead after the heartbeat timeout, aborts the other rank (which
// gives up its blocked collective within the collective timeout), and restarts the job on the
// surviving worker plus the idle one from step-5. Every loss equals the uninterrupted run's bit
// for bit. The stopped process is then killed and reaped.
TEST_F(ChaosCluster, C10_HungRankIsDetectedAndTheJobRecoversBitIdentically) {
  const int steps = 30;
  auto reference = Run(CkptSpec("hang-reference", steps));
  ASSERT_EQ(reference.size(), static_cast<size_t>(steps));
  testing::RankFailureTimer hang(SIGSTOP, 8, [&](const std::string& job_id) {
    const v1::Job job = GetJob(job_id);
    EXPECT_EQ(job.worker_ids_size(), 2);
    if (job.worker_ids_size() != 2) return testing::RankFailureTimer::Rank0{};
    return testing::RankFailureTimer::Rank0{job.worker_ids(0), WorkerProcess(job.worker_ids(0))};
  });
  auto recovered = Run(CkptSpec("hang", steps), [&](const v1::JobEvent& ev) { hang.OnEvent(ev); });
  ASSERT_TRUE(hang.failed()) << "the job never reached step 8";
  // The test cleans up the stopped process: SIGKILL and reap, nothing left behind.
  EXPECT_TRUE(hang.victim_process()->Kill());
  ASSERT_NE(hang.recovering(), Clock::time_point()) << "no RECOVERING event";
  ASSERT_NE(hang.running(), Clock::time_point()) << "never RUNNING again";
  std::printf("stopped rank 0 (%s) after step 8: RECOVERING after %.3f s (%s), RUNNING again "
              "after %.3f s, first recomputed step after %.3f s\n",
              hang.victim().c_str(), hang.SecondsTo(hang.recovering()), hang.cause().c_str(),
              hang.SecondsTo(hang.running()), hang.SecondsTo(hang.first_step()));
  EXPECT_NE(hang.cause().find("no heartbeat"), std::string::npos) << hang.cause();
  EXPECT_NE(hang.cause().find(hang.victim()), std::string::npos) << hang.cause();
  // Detected once the heartbeat timeout passed (plus the 200 ms scheduler tick and load), and not
  // before: the rank was stopped, not dead.
  EXPECT_GE(hang.SecondsTo(hang.recovering()), kHeartbeatTimeoutS - 0.5);
  EXPECT_LT(hang.SecondsTo(hang.recovering()), kHeartbeatTimeoutS + 3);
  // The survivor unwinds within the collective timeout; the new generation then starts.
  EXPECT_LT(hang.SecondsTo(hang.running()), kHeartbeatTimeoutS + kCollectiveTimeoutS + 10);
  const v1::Job job = GetJob(hang.job_id());
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.step(), steps);
  for (const auto& w : job.worker_ids())
    EXPECT_NE(w, hang.victim()) << "the hung worker was reused";
  ASSERT_EQ(recovered.size(), reference.size());
  for (int k = 0; k < steps; ++k) EXPECT_EQ(recovered[k], reference[k]) << "step " << k + 1;
}

// The coordinator is SIGKILLed after step 12 of a 2-rank job and started again on the same address
// and state database with re-adoption off (--readopt_window_s=0: the checkpoint path, which a
// job takes when its ranks cannot be re-adopted; readopt_test covers re-adoption). The workers
// re-register on their own; the job, RUNNING when the coordinator
// died, comes back RECOVERING, resumes from the newest checkpoint committed before the kill
// (step-10, or a later one when the event stream lagged behind the job) and succeeds with every
// loss equal to the uninterrupted run's; resubmitting its request id returns the same job.
TEST_F(ChaosCluster, CoordinatorRestartResumesTheRunningJobFromItsCheckpoint) {
  const int steps = 30;
  auto reference = Run(CkptSpec("restart-reference", steps));
  ASSERT_EQ(reference.size(), static_cast<size_t>(steps));
  const v1::Job job = Submit(CkptSpec("restart", steps), "restart-request");
  ASSERT_FALSE(job.job_id().empty());
  std::vector<double> losses(steps, NAN);
  Clock::time_point killed;
  int64_t seq = 0;
  Follow(job.job_id(), 0, &losses, [&](const v1::JobEvent& ev) {
    if (killed == Clock::time_point() && ev.step() >= 12 && ev.state() == v1::JOB_STATE_RUNNING) {
      EXPECT_TRUE(cluster_->coordinator()->Kill());
      killed = Clock::now();
    }
  }, nullptr, &seq);
  ASSERT_NE(killed, Clock::time_point()) << "the job never reached step 12";
  // Only the coordinator commits checkpoints, and it is dead: what is on disk now is final.
  const int64_t committed = NewestCommitted(*dir_ / "restart");
  EXPECT_GE(committed, 10);
  const std::string resume_from = "step-" + std::to_string(committed);
  coordinator_flags_->push_back("--readopt_window_s=0");
  ASSERT_EQ(StartCoordinator(*addr_, "coordinator-2.log"), *addr_);
  coordinator_flags_->pop_back();
  const Clock::time_point restarted = Clock::now();
  // The workers come back under their names (--name), the ids the first coordinator listed.
  std::vector<std::string> ids;
  for (int i = 0; i < 400 && ids.size() < worker_ids_->size(); ++i) {
    if (const auto workers = ListWorkers()) {
      ids.clear();
      for (const auto& w : *workers) ids.push_back(w.worker_id());
    }
    if (ids.size() < worker_ids_->size()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::vector<std::string> before = *worker_ids_;
  std::sort(before.begin(), before.end());
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(ids, before);
  EXPECT_EQ(before, (std::vector<std::string>{"node-0", "node-1", "node-2"}));
  // Idempotent across the restart: the same request id and spec give the same job.
  const v1::Job again = Submit(CkptSpec("restart", steps), "restart-request");
  EXPECT_EQ(again.job_id(), job.job_id());
  EXPECT_NE(again.state(), v1::JOB_STATE_FAILED) << again.reason();
  std::vector<std::string> messages;
  Clock::time_point running, first_step;
  std::string last_message;
  const v1::JobState end = Follow(job.job_id(), seq, &losses, [&](const v1::JobEvent& ev) {
    if (!ev.message().empty()) messages.push_back(ev.message());
    if (ev.state() == v1::JOB_STATE_RUNNING && running == Clock::time_point())
      running = Clock::now();
    if (running != Clock::time_point() && ev.loss() > 0 && first_step == Clock::time_point())
      first_step = Clock::now();
  }, &last_message);
  EXPECT_EQ(end, v1::JOB_STATE_SUCCEEDED) << last_message;
  std::printf("coordinator killed after step 12, restarted %.3f s later; job RUNNING again %.3f s "
              "after the restart, first step after %.3f s\n",
              Since(killed, restarted), Since(restarted, running), Since(restarted, first_step));
  bool saw_recovering = false, saw_resume = false;
  for (const auto& m : messages) {
    std::printf("  event: %s\n", m.c_str());
    saw_recovering |= m.find("recovering from a coordinator restart") != std::string::npos;
    saw_resume |= m.find("resuming from") != std::string::npos &&
                  m.find(resume_from + " ") != std::string::npos;
  }
  EXPECT_TRUE(saw_recovering);
  EXPECT_TRUE(saw_resume) << "no event says \"resuming from\" " << resume_from;
  const v1::Job done = GetJob(job.job_id());
  EXPECT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(done.restarts(), 1);
  EXPECT_EQ(done.step(), steps);
  for (int k = 0; k < steps; ++k) EXPECT_EQ(losses[k], reference[k]) << "step " << k + 1;
}

// World shrink: a job with sharding.min_workers 2 and max_workers 3 runs on the 3 workers; one is
// killed after step 8, so only 2 are left and the job goes on with 2 ranks from the newest
// checkpoint committed by then (step-5; step-10 when the event stream lagged behind the job),
// saved by 3 ranks and resharded. The global batch stays 12 sequences: 3 ranks x 2 microbatches of
// 2 before, 2 ranks x 3 microbatches of 2 after. Losses up to that step are the uninterrupted
// 3-rank run's bit for bit; after it they differ only by the order of FP32 sums, so they stay within the C12
// tolerance of 1e-5 relative (see the top of this file; a lost or doubled microbatch moves the
// loss by ~1e-2).
TEST_F(ChaosCluster, WorldShrinksToTheHealthyWorkersWithTheSameGlobalBatch) {
  const int steps = 30;
  {
    // Each test gets a fresh cluster when run on its own (as ctest does); an earlier test of this
    // process may have killed a worker. Registered is not yet assignable (the session stream opens
    // after): wait until every healthy worker is IDLE, or the reference run could start on 2.
    int healthy = 0, idle = 0;
    for (int i = 0; i < 200; ++i) {
      const auto workers = ListWorkers();
      ASSERT_TRUE(workers.has_value());
      healthy = idle = 0;
      for (const auto& w : *workers) {
        healthy += w.healthy();
        idle += w.state() == v1::WORKER_STATE_IDLE;
      }
      if (healthy < 3 || idle == 3) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (healthy < 3) GTEST_SKIP() << "needs 3 healthy workers, " << healthy << " left";
    ASSERT_EQ(idle, 3) << "3 healthy workers, but not all of them assignable";
  }
  auto spec = [&](const std::string& ck) {
    v1::JobSpec s = CkptSpec(ck, steps);
    s.mutable_sharding()->set_min_workers(2);
    s.mutable_sharding()->set_max_workers(3);
    s.mutable_training()->set_microbatch(2);
    return s;
  };
  std::string reference_id;
  auto reference = Run(spec("shrink-reference"), [&](const v1::JobEvent& ev) {
    reference_id = ev.job_id();
  });
  ASSERT_EQ(reference.size(), static_cast<size_t>(steps));
  EXPECT_EQ(GetJob(reference_id).world_size(), 3);
  std::string job_id;
  std::vector<std::string> messages;
  int64_t committed = -1;  // newest checkpoint on disk once generation 1 failed
  auto shrunk = Run(spec("shrink"), [&](const v1::JobEvent& ev) {
    if (!ev.message().empty()) messages.push_back(ev.message());
    // RECOVERING: generation 1 has ended and commits nothing more. Its checkpoints are those
    // saved by 3 ranks (generation 2 may have committed one already if this event came late).
    if (!job_id.empty() && committed < 0 && ev.state() == v1::JOB_STATE_RECOVERING)
      committed = NewestCommitted(*dir_ / "shrink", 3);
    if (job_id.empty() && ev.step() >= 8 && ev.state() == v1::JOB_STATE_RUNNING) {
      const v1::Job job = GetJob(ev.job_id());
      ASSERT_EQ(job.worker_ids_size(), 3);
      ChildProcess* p = WorkerProcess(job.worker_ids(2));
      ASSERT_NE(p, nullptr);
      EXPECT_TRUE(p->Kill());
      job_id = ev.job_id();
    }
  });
  ASSERT_FALSE(job_id.empty()) << "the job never reached step 8";
  const v1::Job job = GetJob(job_id);
  EXPECT_EQ(job.world_size(), 2);
  EXPECT_EQ(job.restarts(), 1);
  // Killed once the event of step 8 (or a later one, if the stream lagged) was read; checkpoints
  // every 5 steps.
  ASSERT_GE(committed, 5) << "no checkpoint saved by 3 ranks";
  const std::string want = "step-" + std::to_string(committed) + " (step " +
                           std::to_string(committed) + ", saved by 3 ranks), resharded to 2 ranks";
  bool resharded = false;
  for (const auto& m : messages) {
    if (m.find("resuming") != std::string::npos) std::printf("  event: %s\n", m.c_str());
    resharded |= m.find(want) != std::string::npos;
  }
  EXPECT_TRUE(resharded) << "no event says " << want;
  ASSERT_EQ(shrunk.size(), reference.size());
  for (int k = 0; k < committed; ++k) EXPECT_EQ(shrunk[k], reference[k]) << "step " << k + 1;
  for (int k = static_cast<int>(committed); k < steps; ++k) {
    ASSERT_TRUE(std::isfinite(shrunk[k])) << "step " << k + 1;
    EXPECT_NEAR(shrunk[k], reference[k], 1e-5 * reference[k]) << "step " << k + 1;
  }
  std::printf("after shrinking from 3 to 2 ranks: max relative loss difference %.3g (tolerance "
              "1e-5)\n", MaxRelDiff(shrunk, reference));
}

// Failed checkpoint saves, injected in the workers (FSDP8_FAULT_CHECKPOINT_ENOSPC: a shard write
// whose path contains one of the listed strings fails with "No space left on device" after
// leaving a partial file).
class SaveFaultCluster : public ChaosCluster {
 protected:
  static void SetUpTestSuite() {
    setenv("FSDP8_FAULT_CHECKPOINT_ENOSPC",
           "ck-flaky/step-10/rank-1,ck-flaky/step-15/rank-0,ck-full/step-1", 1);
    ChaosCluster::SetUpTestSuite();
  }
};

// Two saves in a row fail (step-10 on rank 1, step-15 on rank 0): each is dropped (its directory
// removed, nothing committed), shows as an event, and training goes on untouched (every loss
// equals a run without faults); step-20 commits again.
TEST_F(SaveFaultCluster, FailedSavesAreDroppedAndTrainingGoesOn) {
  const int steps = 20;
  auto reference = Run(CkptSpec("faults-reference", steps));
  std::vector<std::string> messages;
  std::string job_id;
  auto losses = Run(CkptSpec("ck-flaky", steps), [&](const v1::JobEvent& ev) {
    job_id = ev.job_id();
    if (!ev.message().empty()) messages.push_back(ev.message());
  });
  int failed = 0;
  for (const auto& m : messages) {
    if (m.find("No space left on device") == std::string::npos) continue;
    std::printf("  event: %s\n", m.c_str());
    if (m.find("checkpoint step-10: rank 1") != std::string::npos &&
        m.find("failed save 1 of at most 3") != std::string::npos)
      ++failed;
    if (m.find("checkpoint step-15: rank 0") != std::string::npos &&
        m.find("failed save 2 of at most 3") != std::string::npos)
      ++failed;
  }
  EXPECT_EQ(failed, 2);
  const fs::path ck = *dir_ / "ck-flaky";
  EXPECT_TRUE(fs::exists(ck / "step-5" / "MANIFEST"));
  EXPECT_TRUE(fs::exists(ck / "step-20" / "MANIFEST"));
  EXPECT_FALSE(fs::exists(ck / "step-10"));
  EXPECT_FALSE(fs::exists(ck / "step-15"));
  EXPECT_EQ(GetJob(job_id).restarts(), 0);
  ASSERT_EQ(losses.size(), reference.size());
  for (int k = 0; k < steps; ++k) EXPECT_EQ(losses[k], reference[k]) << "step " << k + 1;
}

// checkpoint.max_failed_saves 2: the saves of step-10 and step-15 fail, so the job fails after step
// 15 with a reason naming the rule and the disk error, without a restart. step-5, committed
// before, still loads: the same job resumed from it repeats the failed job's steps 6 to 15 bit for
// bit (and fails the same way).
TEST_F(SaveFaultCluster, ConsecutiveFailedSavesFailTheJobAndKeepTheLastCheckpoint) {
  v1::JobSpec spec = CkptSpec("ck-full", 30);
  spec.mutable_checkpoint()->set_max_failed_saves(2);
  std::string reason, job_id;
  auto failed = Run(spec, [&](const v1::JobEvent& ev) { job_id = ev.job_id(); },
                    v1::JOB_STATE_FAILED, &reason);
  std::printf("job FAILED: %s\n", reason.c_str());
  EXPECT_NE(reason.find("2 consecutive checkpoint saves failed (checkpoint.max_failed_saves 2); "
                        "last: checkpoint step-15: rank"),
            std::string::npos) << reason;
  EXPECT_NE(reason.find("No space left on device"), std::string::npos) << reason;
  const v1::Job job = GetJob(job_id);
  EXPECT_EQ(job.step(), 15);
  EXPECT_EQ(job.restarts(), 0);
  const fs::path ck = *dir_ / "ck-full";
  EXPECT_TRUE(fs::exists(ck / "step-5" / "MANIFEST"));
  EXPECT_FALSE(fs::exists(ck / "step-10"));
  // A new job in the failed job's directory: it takes the directory over (its owner has ended).
  spec.mutable_checkpoint()->set_resume_from((ck / "step-5").string());
  spec.mutable_checkpoint()->set_take_over(true);
  auto resumed = Run(spec, {}, v1::JOB_STATE_FAILED);
  ASSERT_EQ(resumed.size(), failed.size());
  for (int k = 5; k < 15; ++k) EXPECT_EQ(resumed[k], failed[k]) << "step " << k + 1;
}

// A really full filesystem: the checkpoint directory is a 4 MiB tmpfs, room for two checkpoints of
// the test model (2 x 0.84 MB per step), mounted in a private mount namespace of this test process,
// which the cluster it starts shares (so nothing outside sees it and it goes away with them).
// Needs root; skipped otherwise.
class FullDiskCluster : public ChaosCluster {
 protected:
  static void SetUpTestSuite() {
    why_not_ = new std::string();
    if (unshare(CLONE_NEWNS) != 0) {
      *why_not_ = std::string("unshare(CLONE_NEWNS): ") + std::strerror(errno);
    } else if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      *why_not_ = std::string("making / private: ") + std::strerror(errno);
    }
    ChaosCluster::SetUpTestSuite();
    if (!why_not_->empty() || dir_ == nullptr) return;
    const fs::path small = *dir_ / "full" / "small";
    fs::create_directories(small);
    if (mount("tmpfs", small.c_str(), "tmpfs", 0, "size=4m") != 0)
      *why_not_ = std::string("mount -t tmpfs: ") + std::strerror(errno);
  }
  static void TearDownTestSuite() {
    if (dir_ != nullptr) umount2((*dir_ / "full" / "small").c_str(), MNT_DETACH);
    ChaosCluster::TearDownTestSuite();
    delete why_not_;
  }
  static std::string* why_not_;
};
std::string* FullDiskCluster::why_not_ = nullptr;

// Saves at steps 5 and 10 fit; step-15 and step-20 run out of space part-way through a shard file
// (a real ENOSPC). Each failed save is removed again, so the two committed checkpoints stay intact;
// with max_failed_saves 2 the job fails after step 20. step-10 still loads: the job resumed from
// it (saving elsewhere) repeats steps 11 to 20 bit for bit and succeeds.
TEST_F(FullDiskCluster, RealFullDiskKeepsCommittedCheckpoints) {
  if (!why_not_->empty()) GTEST_SKIP() << "no private tmpfs: " << *why_not_;
  v1::JobSpec spec = CkptSpec("full/small", 30);
  spec.mutable_checkpoint()->set_max_failed_saves(2);
  std::string reason;
  std::vector<std::string> messages;
  auto failed = Run(spec, [&](const v1::JobEvent& ev) {
    if (!ev.message().empty()) messages.push_back(ev.message());
  }, v1::JOB_STATE_FAILED, &reason);
  for (const auto& m : messages)
    if (m.find("checkpoint") != std::string::npos) std::printf("  event: %s\n", m.c_str());
  EXPECT_NE(reason.find("2 consecutive checkpoint saves failed (checkpoint.max_failed_saves 2); "
                        "last: checkpoint step-20: rank"),
            std::string::npos) << reason;
  EXPECT_NE(reason.find("No space left on device"), std::string::npos) << reason;
  const fs::path ck = *dir_ / "full" / "small";
  EXPECT_TRUE(fs::exists(ck / "step-5" / "MANIFEST"));
  EXPECT_TRUE(fs::exists(ck / "step-10" / "MANIFEST"));
  EXPECT_FALSE(fs::exists(ck / "step-15"));
  EXPECT_FALSE(fs::exists(ck / "step-20"));
  v1::JobSpec resume = spec;
  resume.mutable_checkpoint()->set_resume_from((ck / "step-10").string());
  // resume_from must lie under dir: the directory that holds the tmpfs (on the normal disk).
  resume.mutable_checkpoint()->set_dir((*dir_ / "full").string());
  auto resumed = Run(resume);
  ASSERT_EQ(resumed.size(), failed.size());
  for (int k = 10; k < 20; ++k) EXPECT_EQ(resumed[k], failed[k]) << "step " << k + 1;
}

// C10 (detection part): a rank killed mid-step makes the job FAILED within seconds with the rank
// named, and the surviving workers are not left blocked in a collective: they train the next job.
// (The job has no checkpoint.dir, so it is not restarted.) Runs last: it kills a worker.
// A step that fails on one rank (FSDP8_FAULT_STEP_ERROR=1@3, injected in the workers, which
// inherit it; the test process unsets it once they started).
class StepFaultCluster : public Cluster {
 protected:
  static void SetUpTestSuite() {
    setenv("FSDP8_FAULT_STEP_ERROR", "1@3", 1);
    StartCluster(false);
    unsetenv("FSDP8_FAULT_STEP_ERROR");
  }
};

// Rank 1's step 3 fails at its end: the job fails with that rank's error (no checkpoint, so no
// restart). The coordinator had already sent that worker step 4 (it sends a step ahead, and the
// injected fault is reported once that command arrived): the worker drops it instead of answering
// it, which would reach the next
// job as a "no job assigned" error. The same workers then train the next job to the end, all 3 of
// them, so the failed one too. That job stops before step 3: its rank 1 may be another worker
// process, in which the injected fault has not fired yet.
TEST_F(StepFaultCluster, FailedStepFailsTheJobAndTheStepQueuedBehindItIsDropped) {
  std::string reason;
  Run(SmallSpec(2, v1::PRECISION_FP32, 10), {}, v1::JOB_STATE_FAILED, &reason);
  std::printf("job FAILED: %s\n", reason.c_str());
  EXPECT_NE(reason.find("injected by FSDP8_FAULT_STEP_ERROR"), std::string::npos) << reason;
  // The drop is logged when the worker's job thread reaches the queued step: wait for it.
  bool dropped = false;
  for (int i = 0; i < 100 && !dropped; ++i) {
    for (int w = 0; w < 3; ++w) {
      const std::string log = ReadFile(*dir_ / ("worker-" + std::to_string(w) + ".log"));
      if (log.find("step 4 of an aborted job dropped") != std::string::npos) dropped = true;
    }
    if (!dropped) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(dropped) << "no worker log says \"step 4 of an aborted job dropped\"";
  auto after = Run(SmallSpec(3, v1::PRECISION_FP32, 3));
  ASSERT_EQ(after.size(), 3u);
  for (double l : after) EXPECT_TRUE(std::isfinite(l));
}

TEST_F(Cluster, C10_KilledRankFailsTheJobFastAndSurvivorsServeTheNextJob) {
  std::chrono::steady_clock::time_point killed;
  bool done = false;
  std::string reason;
  Run(SmallSpec(3, v1::PRECISION_FP8, 100000), [&](const v1::JobEvent& ev) {
        if (!done && ev.step() >= 3) {
          cluster_->worker(2)->Signal(SIGKILL);  // one of the 3 workers: every one holds a rank
          killed = std::chrono::steady_clock::now();
          done = true;
        }
      },
      v1::JOB_STATE_FAILED, &reason);
  ASSERT_TRUE(done) << "the job never reached step 3";
  const double detect_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  std::printf("killed rank detected, job FAILED after %.3f s: %s\n", detect_s, reason.c_str());
  EXPECT_LT(detect_s, 10.0) << "heartbeat timeout is 5 s";
  EXPECT_TRUE(reason.find("rank") != std::string::npos) << reason;
  const auto t0 = std::chrono::steady_clock::now();
  auto after = Run(SmallSpec(2, v1::PRECISION_FP8, 5));
  ASSERT_EQ(after.size(), 5u);
  EXPECT_TRUE(std::isfinite(after[4]));
  std::printf("the 2 surviving workers trained the next job in %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// Hybrid sharding across real processes: 4 CPU workers on 2 simulated hosts (127.0.0.1 and
// 127.0.0.2). A job of 2 replicas x 2-rank shard groups trains the same losses as the flat
// world-4 job (C12's tolerances: 1e-5 relative with FP32 linears, 5e-3 with FP8), with either
// optimizer sharding; every shard group lies on one host; a checkpoint of the mesh holds
// Mesh::OptimizerShards() rank files.
class HybridCluster : public Cluster {
 protected:
  static void SetUpTestSuite() {
    StartCluster(false, {}, {"127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"});
  }
  static v1::JobSpec MeshSpec(int replicas, v1::Precision linears, int steps,
                              v1::OptimizerSharding optimizer = v1::OPTIMIZER_SHARDING_SHARD_GROUP) {
    v1::JobSpec s = SmallSpec(4, linears, steps);
    s.mutable_sharding()->set_replicas(replicas);
    s.mutable_sharding()->set_optimizer_sharding(optimizer);
    return s;
  }
  // Every shard group (ranks g*S .. g*S+S-1 of job_id) on one host.
  static void ExpectShardGroupsOnOneHost(const std::string& job_id, int shard_size) {
    const v1::Job job = GetJob(job_id);
    const auto workers = ListWorkers();
    ASSERT_TRUE(workers.has_value());
    std::map<std::string, std::string> host_of;
    for (const auto& w : *workers) host_of[w.worker_id()] = w.host();
    ASSERT_EQ(job.worker_ids_size(), 4);
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(host_of[job.worker_ids(r)], host_of[job.worker_ids(r - r % shard_size)])
          << "rank " << r << " is not on its shard group's host";
    }
  }
};

TEST_F(HybridCluster, TwoReplicasOfTwoRanksMatchTheFlatWorldOfFour) {
  const int steps = 20;
  for (v1::Precision linears : {v1::PRECISION_FP32, v1::PRECISION_FP8}) {
    const double tol = linears == v1::PRECISION_FP32 ? 1e-5 : 5e-3;
    const auto flat = Run(MeshSpec(1, linears, steps));
    for (v1::OptimizerSharding o :
         {v1::OPTIMIZER_SHARDING_SHARD_GROUP, v1::OPTIMIZER_SHARDING_WORLD}) {
      const v1::Job job = Submit(MeshSpec(2, linears, steps, o));
      ASSERT_FALSE(job.job_id().empty());
      std::vector<double> hybrid(steps, NAN);
      std::string message;
      ASSERT_EQ(Follow(job.job_id(), 0, &hybrid, {}, &message), v1::JOB_STATE_SUCCEEDED) << message;
      ExpectShardGroupsOnOneHost(job.job_id(), 2);
      for (int k = 0; k < steps; ++k) {
        ASSERT_TRUE(std::isfinite(hybrid[k]) && std::isfinite(flat[k])) << "step " << k;
        EXPECT_NEAR(hybrid[k], flat[k], tol * flat[k]) << "step " << k << " optimizer " << o;
      }
      std::printf("%s linears, optimizer sharding %d: (2 x 2) vs flat 4: max relative loss "
                  "difference %.3g (tolerance %g)\n",
                  linears == v1::PRECISION_FP32 ? "fp32" : "fp8", static_cast<int>(o),
                  MaxRelDiff(hybrid, flat), tol);
    }
  }
}

// Workers of different --host addresses are different hosts also on one machine: the world's
// collectives go over Gloo, as between real hosts.
TEST_F(HybridCluster, SimulatedHostsTalkOverGloo) {
  Run(MeshSpec(2, v1::PRECISION_FP32, 2));
  for (int i = 0; i < 4; ++i) {
    const std::string log = ReadFile(cluster_->LogPath("worker-" + std::to_string(i) + ".log"));
    EXPECT_NE(log.find("collectives over gloo"), std::string::npos) << "worker " << i << ":\n" << log;
    EXPECT_EQ(log.find("collectives over shared memory"), std::string::npos) << "worker " << i;
  }
}

TEST_F(HybridCluster, ACheckpointOfTheMeshHasOneFilePerOptimizerShard) {
  for (auto [o, files] : {std::pair{v1::OPTIMIZER_SHARDING_SHARD_GROUP, 2},
                          std::pair{v1::OPTIMIZER_SHARDING_WORLD, 4}}) {
    const std::string ck = "hybrid-ck-" + std::to_string(files);
    v1::JobSpec s = MeshSpec(2, v1::PRECISION_FP8, 10, o);
    s.mutable_checkpoint()->set_dir((*dir_ / ck).string());
    s.mutable_checkpoint()->set_every_steps(5);
    Run(s);
    const absl::StatusOr<v1::CheckpointManifest> m =
        ReadManifestFile((*dir_ / ck / "step-10").string());
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->world_size(), files);
    EXPECT_EQ(m->files_size(), files);
  }
}

}  // namespace
}  // namespace fsdp8
