// KvServer and the Scheduler's step driver, with in-process fake workers that speak the Session
// protocol through SessionSink (no gRPC). WorkerRegistry: worker_registry_test.cc.
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/memory_plan.h"
#include "common/spec.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/job_manager.h"
#include "coordinator/job_run.h"
#include "coordinator/placement.h"
#include "coordinator/resolved_job.h"
#include "coordinator/kv_server.h"
#include "coordinator/memory_fit.h"
#include "coordinator/scheduler.h"
#include "coordinator/worker_registry.h"
#include "gtest/gtest.h"
#include "tests/coordinator/test_util.h"

namespace fsdp8::coord {
namespace {

using fsdp8::testing::CpuWorkerRegistration;
using fsdp8::testing::SmallSpec;
using fsdp8::testing::TempDir;
using fsdp8::testing::WaitFor;
using fsdp8::testing::WriteTokens;
using namespace std::chrono_literals;

// ---------------- KvServer ----------------

TEST(KvServer, GetBlocksUntilSet) {
  KvServer kv;
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    ASSERT_TRUE(kv.Set("job/a/gen/1/rank0", "addr").ok());
  });
  auto t0 = std::chrono::steady_clock::now();
  auto v = kv.Get("job/a/gen/1/rank0", 5000ms);
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "addr");
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 90ms);
}

TEST(KvServer, GetTimesOutNamingTheKey) {
  KvServer kv;
  auto t0 = std::chrono::steady_clock::now();
  auto v = kv.Get("job/a/gen/1/missing", 150ms);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(v.status().message(), "job/a/gen/1/missing")) << v.status();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 140ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
}

TEST(KvServer, DeletePrefixAndShutdown) {
  KvServer kv;
  ASSERT_TRUE(kv.Set("job/a/gen/1/x", "1").ok());
  ASSERT_TRUE(kv.Set("job/a/gen/1/y", "2").ok());
  ASSERT_TRUE(kv.Set("job/a/gen/2/x", "3").ok());
  EXPECT_EQ(kv.DeletePrefix("job/a/gen/1/"), 2);
  EXPECT_EQ(kv.size(), 1u);
  EXPECT_EQ(kv.Get("job/a/gen/1/x", 0ms).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(kv.Set("", "v").code(), absl::StatusCode::kInvalidArgument);
  std::thread stopper([&] {
    std::this_thread::sleep_for(50ms);
    kv.Shutdown();
  });
  EXPECT_EQ(kv.Get("never", 10000ms).status().code(), absl::StatusCode::kUnavailable);
  stopper.join();
}

// ---------------- fake workers + scheduler ----------------

// A worker daemon in miniature: answers Assignment with Ready, StepCommand with StepResult and
// SaveCheckpoint with a file dir/rank-<r>.ckpt of 1000 + r bytes and CheckpointSaved, unless told to
// misbehave at some step (kErrorAtSave: WorkerError instead of CheckpointSaved at that step).
class FakeWorker : public SessionSink, public std::enable_shared_from_this<FakeWorker> {
 public:
  enum class Mode {
    kNormal, kErrorAtStep, kLoseSessionAtStep, kStopHeartbeatAtStep, kHangAtStep, kErrorAtSave,
    kWrongSizeAtSave, kEscapingNameAtSave, kErrorOnceAtStep,
    kErrorFromSave,  // every save from at_step on fails (as kErrorAtSave)
    kOutOfMemoryAtStep,  // WorkerError with code RESOURCE_EXHAUSTED at at_step
    kResultForUnsentStepAt,  // at at_step, also a result for step at_step + 1000 (never sent)
  };

  FakeWorker(WorkerRegistry* reg, Mode mode = Mode::kNormal, int64_t at_step = -1,
             double loss_per_token = 2.0)
      : reg_(reg), mode_(mode), at_step_(at_step), loss_per_token_(loss_per_token) {}
  ~FakeWorker() override { Stop(); }

  // The memory the worker reports at registration (0: unknown); before Start.
  void set_memory_bytes(int64_t bytes) { memory_bytes_ = bytes; }
  // The host it registers from (a simulated host: 127.0.0.2, ...); before Start.
  void set_host(const std::string& host) { host_ = host; }
  // Registers under `name` reporting that it holds `held` (a job of a coordinator that went away;
  // RegisterRequest.held_job); Adopt then makes it that job's rank, as the worker daemon does;
  // before Start.
  void set_held(const std::string& name, const v1::HeldJob& held) {
    name_ = name;
    held_ = held;
  }
  void Start() {
    v1::RegisterRequest req = CpuWorkerRegistration(FSDP8_VERSION);
    req.set_memory_bytes(memory_bytes_);
    if (!host_.empty()) req.set_host(host_);
    req.set_name(name_);
    if (!held_.job_id().empty()) *req.mutable_held_job() = held_;
    auto r = reg_->Register(req);
    ASSERT_TRUE(r.ok()) << r.status();
    id_ = r->worker_id();
    auto t = reg_->AttachSession(id_, shared_from_this());
    ASSERT_TRUE(t.ok());
    token_ = *t;
    loop_ = std::thread([this] { Loop(); });
    beat_ = std::thread([this] {
      while (!stop_) {
        if (heartbeat_) reg_->Heartbeat(id_).IgnoreError();
        std::this_thread::sleep_for(50ms);
      }
    });
  }
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    if (loop_.joinable()) loop_.join();
    if (beat_.joinable()) beat_.join();
  }

  bool Send(const v1::CoordinatorMessage& m) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    if (m.has_step()) results_before_step_.push_back(results_sent_.load());
    q_.push_back(m);
    received_.push_back(m);
    cv_.notify_all();
    return true;
  }
  void Close() override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }

  const std::string& id() const { return id_; }
  // Ends the worker's session as a lost stream does (the registration stays, unhealthy), and
  // attaches a new one (a worker that reconnects).
  void Detach() { reg_->DetachSession(id_, token_, "session stream ended"); }
  void Reattach() {
    auto t = reg_->AttachSession(id_, shared_from_this());
    ASSERT_TRUE(t.ok()) << t.status();
    token_ = *t;
  }
  // Delays before answering: every StepCommand, every SaveCheckpoint.
  void set_delays(std::chrono::milliseconds step, std::chrono::milliseconds save) {
    step_delay_ = step;
    save_delay_ = save;
  }
  // Holds each step's result until a later step's command has arrived, or `at_most` passed (for a
  // step that nothing is sent ahead of): what arrives ahead is then fixed by the protocol, not by
  // how fast the coordinator's thread runs.
  void set_hold_results(std::chrono::milliseconds at_most) { hold_at_most_ = at_most; }
  // SaveCheckpoints answered while a MANIFEST already existed in the step directory.
  int manifest_seen_early() const { return manifest_seen_early_; }
  std::vector<v1::CoordinatorMessage> received() {
    std::lock_guard<std::mutex> lock(mu_);
    return received_;
  }
  // For each StepCommand received, how many step results this worker had sent by then.
  std::vector<int> results_before_step() {
    std::lock_guard<std::mutex> lock(mu_);
    return results_before_step_;
  }
  int Count(v1::CoordinatorMessage::KindCase k) {
    int n = 0;
    for (const auto& m : received()) n += m.kind_case() == k;
    return n;
  }

 private:
  void Reply(const v1::WorkerMessage& m) { reg_->OnMessage(id_, token_, m); }

  void Loop() {
    for (;;) {
      v1::CoordinatorMessage m;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !q_.empty(); });
        if (stop_) return;
        m = q_.front();
        q_.pop_front();
      }
      if (m.has_adopt()) {
        v1::WorkerMessage r;
        if (m.adopt().job_id() != held_.job_id() || m.adopt().rank() != held_.rank()) {
          r.mutable_error()->set_job_id(m.adopt().job_id());
          r.mutable_error()->set_message("adopt: not the job held");
        } else {
          a_.set_job_id(held_.job_id());
          a_.set_generation(held_.generation());
          a_.set_rank(held_.rank());
          a_.set_world_size(held_.world_size());
          r.mutable_ready()->set_job_id(a_.job_id());
          r.mutable_ready()->set_generation(a_.generation());
        }
        Reply(r);
      } else if (m.has_assignment()) {
        a_ = m.assignment();
        v1::WorkerMessage r;
        r.mutable_ready()->set_job_id(a_.job_id());
        r.mutable_ready()->set_generation(a_.generation());
        Reply(r);
      } else if (m.has_save()) {
        const v1::SaveCheckpoint& sc = m.save();
        std::this_thread::sleep_for(save_delay_);
        v1::WorkerMessage r;
        if ((mode_ == Mode::kErrorAtSave && sc.step() == at_step_) ||
            (mode_ == Mode::kErrorFromSave && sc.step() >= at_step_)) {
          // As the worker daemon reports a shard it could not write: its state stays usable.
          std::ofstream(sc.dir() + "/rank-" + std::to_string(a_.rank()) + ".ckpt.tmp") << "partial";
          v1::CheckpointSaved* cs = r.mutable_saved();
          cs->set_job_id(a_.job_id());
          cs->set_step(sc.step());
          cs->set_rank(a_.rank());
          cs->set_error("disk full");
          Reply(r);
          continue;
        }
        // Hybrid sharding, as the design says (written out here, not taken from the code under
        // test): R replicas of S ranks; SHARD_GROUP: replica 0 writes file = shard index, the
        // others nothing; WORLD: every rank writes file = shard index * R + replica.
        const int r_count = a_.spec().sharding().replicas() > 0 ? a_.spec().sharding().replicas() : 1;
        const int s_size = a_.world_size() / r_count;
        const int replica = a_.rank() / s_size, shard = a_.rank() % s_size;
        const bool world =
            a_.spec().sharding().optimizer_sharding() == v1::OPTIMIZER_SHARDING_WORLD;
        const int index = world ? shard * r_count + replica : (replica == 0 ? shard : -1);
        if (index < 0) {
          v1::CheckpointSaved* cs = r.mutable_saved();
          cs->set_job_id(a_.job_id());
          cs->set_step(sc.step());
          cs->set_rank(a_.rank());
          Reply(r);
          continue;
        }
        const std::string file = "rank-" + std::to_string(index) + ".ckpt";
        {
          std::ofstream out(sc.dir() + "/" + file, std::ios::binary);
          out << std::string(1000 + a_.rank(), 'c');
        }
        if (std::filesystem::exists(sc.dir() + "/MANIFEST")) ++manifest_seen_early_;
        v1::CheckpointSaved* cs = r.mutable_saved();
        cs->set_job_id(a_.job_id());
        cs->set_step(sc.step());
        cs->set_rank(a_.rank());
        cs->set_file(file);
        cs->set_bytes(1000 + a_.rank());
        if (sc.step() == at_step_ && mode_ == Mode::kWrongSizeAtSave) cs->set_bytes(4096);
        if (sc.step() == at_step_ && mode_ == Mode::kEscapingNameAtSave) cs->set_file("../../x");
        cs->set_crc32(12345);
        Reply(r);
      } else if (m.has_step()) {
        const int64_t k = m.step().step();
        std::this_thread::sleep_for(step_delay_);
        if (hold_at_most_ > 0ms) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait_for(lock, hold_at_most_, [&] {
            if (stop_) return true;
            for (const auto& q : q_)
              if (q.has_step() && q.step().step() > k) return true;
            return false;
          });
        }
        if (k == at_step_ && mode_ == Mode::kOutOfMemoryAtStep) {
          v1::WorkerMessage r;
          r.mutable_error()->set_job_id(a_.job_id());
          r.mutable_error()->set_message("step 2: RESOURCE_EXHAUSTED: out of memory in step 2");
          r.mutable_error()->set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
          Reply(r);
          continue;
        }
        if (k == at_step_ && mode_ == Mode::kResultForUnsentStepAt) {
          v1::WorkerMessage r;
          r.mutable_result()->set_job_id(a_.job_id());
          r.mutable_result()->set_step(k + 1000);
          Reply(r);
        }
        if (k == at_step_ && mode_ == Mode::kErrorOnceAtStep && !fired_) {
          fired_ = true;
          v1::WorkerMessage r;
          r.mutable_error()->set_job_id(a_.job_id());
          r.mutable_error()->set_message("gloo allreduce failed");
          Reply(r);
          continue;
        }
        if (k == at_step_ && (mode_ == Mode::kErrorAtStep || mode_ == Mode::kLoseSessionAtStep ||
                              mode_ == Mode::kStopHeartbeatAtStep || mode_ == Mode::kHangAtStep)) {
          if (mode_ == Mode::kErrorAtStep) {
            v1::WorkerMessage r;
            r.mutable_error()->set_job_id(a_.job_id());
            r.mutable_error()->set_message("gloo allreduce failed");
            Reply(r);
          } else if (mode_ == Mode::kLoseSessionAtStep) {
            Close();
            reg_->DetachSession(id_, token_, "session stream ended");
          } else if (mode_ == Mode::kStopHeartbeatAtStep) {
            heartbeat_ = false;
          }
          continue;  // kHangAtStep: never answer
        }
        v1::WorkerMessage r;
        v1::StepResult* s = r.mutable_result();
        s->set_job_id(a_.job_id());
        s->set_step(k);
        const int64_t tokens = 100 * (a_.rank() + 1);
        s->set_tokens(tokens);
        s->set_loss_sum(loss_per_token_ * (a_.rank() + 1) * tokens);
        s->set_grad_norm(1.5);
        s->set_lr(0.001 * (k + 1));
        s->set_val_loss(m.step().evaluate() ? 2.75 : NAN);
        if (m.step().evaluate()) {  // a step of 100 ms whose validation took 20 ms (rank 0), 40 (1)
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          s->set_eval_seconds(0.02 + 0.02 * a_.rank());
        }
        if (m.step().report_scaling()) {
          s->mutable_scaling()->set_step(k + 1);
          auto* t = s->mutable_scaling()->add_tensors();
          t->set_name("layers.0.attn.q_proj.x");
          t->set_format("E4M3");
          t->set_scale(448.0f);
          t->set_scale_inv(1 / 448.0f);
        }
        ++results_sent_;
        Reply(r);
      }
    }
  }

  WorkerRegistry* reg_;
  int64_t memory_bytes_ = 0;
  std::string host_;
  std::string name_;
  v1::HeldJob held_;
  Mode mode_;
  int64_t at_step_;
  double loss_per_token_;
  std::string id_;
  uint64_t token_ = 0;
  v1::Assignment a_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::CoordinatorMessage> q_;
  std::vector<v1::CoordinatorMessage> received_;
  std::vector<int> results_before_step_;
  std::atomic<int> results_sent_{0};
  bool closed_ = false;
  bool stop_ = false;
  bool fired_ = false;
  std::atomic<bool> heartbeat_{true};
  std::chrono::milliseconds step_delay_{0}, save_delay_{0}, hold_at_most_{0};
  std::atomic<int> manifest_seen_early_{0};
  std::thread loop_, beat_;
};

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    train_ = WriteTokens(dir_, "train.bin");
    val_ = WriteTokens(dir_, "val.bin", 1000);
    auto jm = JobManager::Open(JobManagerOptions());
    ASSERT_TRUE(jm.ok());
    jobs_ = std::move(*jm);
    WorkerRegistryOptions wo;
    wo.version = FSDP8_VERSION;
    // Well above the fakes' 50 ms beat, so that a thread stalled on a loaded machine is not taken
    // for a dead worker.
    wo.heartbeat_timeout = 2s;
    workers_ = std::make_unique<WorkerRegistry>(wo);
    // abort_grace 0: tests check reassignment right after an Abort; the grace has its own.
    StartScheduler(2s, 0ms);
  }
  // (Re)starts the scheduler with a 3 s start timeout and these step timeout and abort grace.
  void StartScheduler(std::chrono::milliseconds step_timeout, std::chrono::milliseconds abort_grace) {
    if (sched_) sched_->Stop();
    SchedulerOptions so;
    so.start_timeout = 3s;
    so.step_timeout = step_timeout;
    so.tick = 20ms;
    so.abort_grace = abort_grace;
    sched_ = std::make_unique<Scheduler>(jobs_.get(), workers_.get(), &kv_, so);
    sched_->Start();
  }
  void TearDown() override {
    sched_->Stop();
    for (auto& w : fakes_) w->Stop();
  }
  std::shared_ptr<FakeWorker> AddWorker(FakeWorker::Mode mode = FakeWorker::Mode::kNormal,
                                        int64_t at = -1, double loss = 2.0,
                                        int64_t memory_bytes = 0) {
    auto w = std::make_shared<FakeWorker>(workers_.get(), mode, at, loss);
    w->set_memory_bytes(memory_bytes);
    w->Start();
    fakes_.push_back(w);
    return w;
  }
  // A worker registered from `host` (a simulated host of this machine).
  std::shared_ptr<FakeWorker> AddWorkerOn(const std::string& host) {
    auto w = std::make_shared<FakeWorker>(workers_.get());
    w->set_host(host);
    w->Start();
    fakes_.push_back(w);
    return w;
  }
  // n workers registered alternately from 127.0.0.1 and 127.0.0.2 (first-n in registration order
  // would span both hosts).
  void AddInterleavedWorkers(int n) {
    for (int i = 0; i < n; ++i) AddWorkerOn(i % 2 == 0 ? "127.0.0.1" : "127.0.0.2");
  }
  // The host each rank of a started job runs on.
  std::vector<std::string> RankHosts(const v1::Job& job) {
    std::map<std::string, std::string> host;
    for (const v1::WorkerInfo& w : workers_->List()) host[w.worker_id()] = w.host();
    std::vector<std::string> out;
    for (const std::string& id : job.worker_ids()) out.push_back(host[id]);
    return out;
  }
  // The Assignment a worker got for job_id (the last one).
  std::optional<v1::Assignment> AssignmentOf(const std::string& worker_id, const std::string& job_id) {
    std::optional<v1::Assignment> a;
    for (auto& f : fakes_) {
      if (f->id() != worker_id) continue;
      for (const auto& m : f->received())
        if (m.has_assignment() && m.assignment().job_id() == job_id) a = m.assignment();
    }
    return a;
  }
  v1::Job WaitEnd(const std::string& id, double seconds = 10) {
    EXPECT_TRUE(WaitFor([&] { return jobs_->IsTerminal(id); }, seconds)) << "job did not end";
    return *jobs_->Get(id);
  }
  bool AllIdle() {
    for (const auto& w : workers_->List())
      if (!w.job_id().empty()) return false;
    return true;
  }

  TempDir dir_;
  std::string train_, val_;
  KvServer kv_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<WorkerRegistry> workers_;
  std::unique_ptr<Scheduler> sched_;
  std::vector<std::shared_ptr<FakeWorker>> fakes_;
};

TEST_F(SchedulerTest, ChooseWorldSize) {
  v1::JobSpec s = SmallSpec(train_);
  s.mutable_sharding()->set_min_workers(1);
  s.mutable_sharding()->set_max_workers(4);
  s.mutable_training()->set_global_batch(12);
  EXPECT_EQ(Scheduler::ChooseWorldSize(s, 0), 0);
  EXPECT_EQ(Scheduler::ChooseWorldSize(s, 1), 1);
  EXPECT_EQ(Scheduler::ChooseWorldSize(s, 4), 4);
  s.mutable_training()->set_global_batch(8);
  EXPECT_EQ(Scheduler::ChooseWorldSize(s, 3), 2);  // 8 % 3 != 0
  s.mutable_training()->set_microbatch(4);
  EXPECT_EQ(Scheduler::ChooseWorldSize(s, 4), 2);  // 8 % (4 * 4) != 0
  s.mutable_sharding()->set_min_workers(3);
  EXPECT_EQ(Scheduler::ChooseWorldSize(s, 4), 0);
}

TEST_F(SchedulerTest, PendingReasonNamesWorkersNeededAndFree) {
  auto job = jobs_->Submit("", SmallSpec(train_, 2));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_TRUE(WaitFor([&] { return jobs_->Get(job->job_id())->reason() ==
                                   "waiting for 2 workers (0 free)"; }))
      << jobs_->Get(job->job_id())->reason();
  AddWorker();
  EXPECT_TRUE(WaitFor([&] { return jobs_->Get(job->job_id())->reason() ==
                                   "waiting for 2 workers (1 free)"; }))
      << jobs_->Get(job->job_id())->reason();
  EXPECT_EQ(jobs_->Get(job->job_id())->state(), v1::JOB_STATE_PENDING);
}

// The memory plan's bytes per rank of `spec` at n ranks (what a worker must hold).
int64_t PlanBytes(const v1::JobSpec& spec, int n) {
  auto p = PlanMemory(WithDefaults(spec, n), n);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? p->device_bytes : 0;
}

TEST_F(SchedulerTest, MemoryPlanPicksTheWorkersThatHoldIt) {
  const v1::JobSpec spec = SmallSpec(train_, 2);
  const int64_t need = PlanBytes(spec, 2);
  auto small = AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, need / 2);
  auto big0 = AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, need * 4);
  auto big1 = AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, need);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  ASSERT_EQ(end.worker_ids_size(), 2);
  EXPECT_EQ(end.worker_ids(0), big0->id());
  EXPECT_EQ(end.worker_ids(1), big1->id());
}

TEST_F(SchedulerTest, AJobThatFitsOnlyBusyWorkersWaitsThenStartsOnThem) {
  const v1::JobSpec spec = SmallSpec(train_, 1);
  const int64_t need = PlanBytes(spec, 1);
  auto big = AddWorker(FakeWorker::Mode::kHangAtStep, 1, 2.0, need * 2);
  auto a = jobs_->Submit("", SmallSpec(train_, 1, 5));
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(WaitFor([&] { return jobs_->Get(a->job_id())->state() == v1::JOB_STATE_RUNNING; }));
  auto small = AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, need / 2);
  auto b = jobs_->Submit("", spec);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(WaitFor([&] {
    return absl::StrContains(jobs_->Get(b->job_id())->reason(), "memory plan");
  })) << jobs_->Get(b->job_id())->reason();
  EXPECT_EQ(jobs_->Get(b->job_id())->state(), v1::JOB_STATE_PENDING);
  ASSERT_TRUE(jobs_->Cancel(a->job_id()).ok());
  // Started once the big worker is free again, on it (it hangs this job too: cancelled after).
  ASSERT_TRUE(WaitFor([&] { return jobs_->Get(b->job_id())->worker_ids_size() == 1; }))
      << jobs_->Get(b->job_id())->reason();
  EXPECT_EQ(jobs_->Get(b->job_id())->worker_ids(0), big->id());
  ASSERT_TRUE(jobs_->Cancel(b->job_id()).ok());
}

// The check the coordinator installs (CoordinatorServer::Start): the registered workers' memory.
void InstallAdmission(JobManager* jobs, WorkerRegistry* workers) {
  jobs->SetAdmission([workers](ResolvedJob& job) {
    return CheckFitsLargestWorkers(job, workers->WorkerMemory("cpu"));
  });
}

TEST_F(SchedulerTest, SubmitRefusesAJobThatFitsNoRegisteredWorker) {
  InstallAdmission(jobs_.get(), workers_.get());
  AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, int64_t{1} << 30);
  AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, int64_t{2} << 30);
  for (int which = 0; which < 2; ++which) {
    v1::JobSpec s = SmallSpec(train_, 1);
    if (which == 0) s.mutable_model()->set_n_layers(1000000);
    if (which == 1) s.mutable_model()->set_d_model(1048576);
    auto job = jobs_->Submit("", s);
    EXPECT_EQ(job.status().code(), absl::StatusCode::kResourceExhausted) << job.status();
    const std::string m(job.status().message());
    EXPECT_TRUE(absl::StrContains(m, "the largest registered cpu worker has 2.00 GiB (2147483648 "
                                     "bytes)")) << m;
    EXPECT_TRUE(absl::StrContains(m, "per rank at 1 ranks")) << m;
    EXPECT_TRUE(absl::StrContains(m, "optimizer.state_precision: bf16")) << m;
  }
  EXPECT_TRUE(jobs_->List().empty()) << "a refused job is not in the table";
  // One that fits 2 GiB but not 1 GiB is accepted (and runs on the larger worker).
  auto ok = jobs_->Submit("", SmallSpec(train_, 1));
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST_F(SchedulerTest, AJobAcceptedWithoutWorkersFailsWhenNoneCanHoldIt) {
  InstallAdmission(jobs_.get(), workers_.get());
  v1::JobSpec s = SmallSpec(train_, 1);
  s.mutable_model()->set_n_layers(1000000);
  auto job = jobs_->Submit("", s);
  ASSERT_TRUE(job.ok()) << "no workers registered yet: PENDING as before";
  AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, int64_t{1} << 30);
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "does not fit")) << end.reason();
  EXPECT_TRUE(AllIdle()) << "never started on a worker";
}

// A pending job whose memory plan only the large workers hold waits while those are briefly
// unregistered (a restart, a heartbeat lapse) instead of failing at once; it fails only once the
// verdict has held for start_timeout (3 s here), and starts when they come back before that.
TEST_F(SchedulerTest, APendingJobWaitsForALargeWorkerThatIsBrieflyGone) {
  InstallAdmission(jobs_.get(), workers_.get());
  const v1::JobSpec spec = SmallSpec(train_, 2);
  const int64_t need = PlanBytes(spec, 2);
  auto big0 = AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, need * 2);
  AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, need / 2);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(WaitFor([&] { return !jobs_->Get(job->job_id())->reason().empty(); }));
  big0->Detach();  // now no registered worker holds the plan
  ASSERT_TRUE(WaitFor([&] {
    return absl::StrContains(jobs_->Get(job->job_id())->reason(), "does not fit");
  })) << jobs_->Get(job->job_id())->reason();
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  EXPECT_EQ(jobs_->Get(job->job_id())->state(), v1::JOB_STATE_PENDING)
      << jobs_->Get(job->job_id())->reason();
  big0->Reattach();
  auto big1 = AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, need * 2);
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  ASSERT_EQ(end.worker_ids_size(), 2);
  EXPECT_NE(end.worker_ids(0), end.worker_ids(1));
  for (const std::string& w : end.worker_ids()) {
    EXPECT_TRUE(w == big0->id() || w == big1->id()) << w;
  }
}

// The memory plan is made once per (job, world size): at submit (the admission check) or at the
// first scheduling pass that weighs that world size, then reused by every later pass. A job that
// waits with enough free workers, none of which holds its plan (a larger worker is busy), is
// weighed at both its world sizes (2 and 1) on every pass; over 100 passes the planner still runs
// once for each, and once for the job already running.
TEST_F(SchedulerTest, MemoryPlanIsMadeOncePerJobAndWorldSize) {
  struct Counts {
    std::mutex mu;
    std::map<std::pair<std::string, int>, int> calls;  // (job name, world size) -> plans made
  };
  auto counts = std::make_shared<Counts>();
  sched_->Stop();
  JobManagerOptions jo;
  jo.planner = [counts](const v1::JobSpec& spec, int n) {
    {
      std::lock_guard<std::mutex> lock(counts->mu);
      ++counts->calls[{spec.name(), n}];
    }
    return PlanMemory(spec, n);
  };
  auto jm = JobManager::Open(jo);
  ASSERT_TRUE(jm.ok()) << jm.status();
  jobs_ = std::move(*jm);
  StartScheduler(60s, 0ms);  // the running job hangs at step 1 until cancelled
  InstallAdmission(jobs_.get(), workers_.get());

  v1::JobSpec b = SmallSpec(train_, 1, 5);
  b.set_name("waits");
  b.mutable_sharding()->set_max_workers(2);  // global batch 4: world sizes 2 and 1
  const int64_t need1 = PlanBytes(b, 1), need2 = PlanBytes(b, 2);
  ASSERT_GT(need1, need2);
  auto big = AddWorker(FakeWorker::Mode::kHangAtStep, 1, 2.0, need1 * 2);
  v1::JobSpec a = SmallSpec(train_, 1, 5);
  a.set_name("runs");
  auto ja = jobs_->Submit("", a);
  ASSERT_TRUE(ja.ok()) << ja.status();
  ASSERT_TRUE(WaitFor([&] { return jobs_->Get(ja->job_id())->state() == v1::JOB_STATE_RUNNING; }));
  AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, need2 / 2);
  AddWorker(FakeWorker::Mode::kNormal, -1, 2.0, need2 / 2);
  auto jb = jobs_->Submit("", b);
  ASSERT_TRUE(jb.ok()) << jb.status();
  ASSERT_TRUE(WaitFor([&] {
    return absl::StrContains(jobs_->Get(jb->job_id())->reason(), "memory plan");
  })) << jobs_->Get(jb->job_id())->reason();
  const int64_t p0 = sched_->passes();
  ASSERT_TRUE(WaitFor([&] { return sched_->passes() >= p0 + 100; }, 30))
      << sched_->passes() - p0 << " passes";
  EXPECT_EQ(jobs_->Get(jb->job_id())->state(), v1::JOB_STATE_PENDING);
  {
    std::lock_guard<std::mutex> lock(counts->mu);
    std::map<std::pair<std::string, int>, int> expected = {
        {{"runs", 1}, 1}, {{"waits", 1}, 1}, {{"waits", 2}, 1}};
    EXPECT_EQ(counts->calls, expected);
  }
  ASSERT_TRUE(jobs_->Cancel(jb->job_id()).ok());
  ASSERT_TRUE(jobs_->Cancel(ja->job_id()).ok());
}

TEST(MemoryFit, RefusalNamesPredictedAvailableAndWaysToFit) {
  v1::JobSpec s;
  s.mutable_model()->set_d_model(64);
  s.mutable_model()->set_seq_len(512);
  s.mutable_training()->set_global_batch(8);
  s.mutable_sharding()->set_min_workers(1);
  s = WithDefaults(s, 0);
  const int64_t need = PlanBytes(s, 1);
  v1::JobSpec r = s;
  r.mutable_training()->set_activation_recompute(true);
  const int64_t with_recompute = PlanBytes(r, 1);
  ASSERT_LT(with_recompute, need);
  const int64_t have = (need + with_recompute) / 2;
  EXPECT_TRUE(CheckFitsLargestWorkers(s, {}).ok()) << "no workers yet: it waits";
  EXPECT_TRUE(CheckFitsLargestWorkers(s, {{"a", have}, {"b", 0}}).ok()) << "b: unknown memory";
  EXPECT_TRUE(CheckFitsLargestWorkers(s, {{"a", have / 2}, {"b", need}}).ok());
  const absl::Status st = CheckFitsLargestWorkers(s, {{"a", have / 2}, {"b", have}});
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  const std::string m(st.message());
  EXPECT_TRUE(absl::StrContains(m, absl::StrCat("(", need, " bytes) per rank at 1 ranks"))) << m;
  EXPECT_TRUE(absl::StrContains(m, absl::StrCat("(", have, " bytes)"))) << m;
  EXPECT_TRUE(absl::StrContains(m, "training.activation_recompute: true")) << m;
  EXPECT_TRUE(absl::StrContains(m, "more workers (sharding.min_workers: ")) << m;
}

TEST_F(SchedulerTest, TwoRanksRunToSuccess) {
  auto w0 = AddWorker(FakeWorker::Mode::kNormal, -1, 2.0);
  auto w1 = AddWorker(FakeWorker::Mode::kNormal, -1, 2.0);
  auto job = jobs_->Submit("", SmallSpec(train_, 2, 12, val_));
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  v1::Job end = WaitEnd(id);
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.step(), 12);
  EXPECT_EQ(end.world_size(), 2);
  EXPECT_EQ(end.worker_ids(0), w0->id());
  EXPECT_EQ(end.worker_ids(1), w1->id());
  // rank 0: 100 tokens at loss 2, rank 1: 200 tokens at loss 4 -> (200 + 800) / 300.
  EXPECT_NEAR(end.loss(), 1000.0 / 300.0, 1e-12);
  EXPECT_DOUBLE_EQ(end.val_loss(), 2.75);
  EXPECT_EQ(end.tokens(), 12 * 300);
  // Assignment: ranks, world size, microbatch default, store prefix, collective timeout.
  auto msgs = w1->received();
  ASSERT_FALSE(msgs.empty());
  ASSERT_TRUE(msgs[0].has_assignment());
  const auto& a = msgs[0].assignment();
  EXPECT_EQ(a.job_id(), id);
  EXPECT_EQ(a.rank(), 1);
  EXPECT_EQ(a.world_size(), 2);
  EXPECT_EQ(a.generation(), 1);
  EXPECT_EQ(a.spec().training().microbatch(), 2);  // global_batch 4 / 2 ranks
  EXPECT_EQ(a.store_prefix(), "job/" + id + "/gen/1/");
  EXPECT_EQ(a.collective_timeout_ms(), 30000);
  EXPECT_EQ(a.bootstrap_timeout_ms(), 3000);  // the start timeout (3 s here)
  // Steps 0..11 in order; evaluate at steps 2,4,...,12 (eval_every 2) and the last.
  std::vector<int64_t> steps, evals, scaling;
  for (const auto& m : msgs) {
    if (!m.has_step()) continue;
    steps.push_back(m.step().step());
    if (m.step().evaluate()) evals.push_back(m.step().step());
    if (m.step().report_scaling()) scaling.push_back(m.step().step());
  }
  EXPECT_EQ(steps.size(), 12u);
  for (size_t k = 0; k < steps.size(); ++k) EXPECT_EQ(steps[k], static_cast<int64_t>(k));
  EXPECT_EQ(evals, (std::vector<int64_t>{1, 3, 5, 7, 9, 11}));
  EXPECT_EQ(scaling, (std::vector<int64_t>{0, 10, 11}));
  EXPECT_TRUE(msgs.back().has_finish());
  EXPECT_EQ(w0->Count(v1::CoordinatorMessage::kAbort), 0);
  // Events: one per step with aggregated numbers, val_loss NaN when not evaluated.
  std::vector<v1::JobEvent> evs;
  ASSERT_TRUE(jobs_->Watch(id, 0, [&](const v1::JobEvent& e) {
                      evs.push_back(e);
                      return true;
                    }).ok());
  int step_events = 0;
  for (const auto& e : evs) {
    if (e.state() != v1::JOB_STATE_RUNNING || !e.message().empty()) continue;
    ++step_events;
    EXPECT_EQ(e.total_steps(), 12);
    EXPECT_NEAR(e.loss(), 1000.0 / 300.0, 1e-12);
    EXPECT_EQ(std::isnan(e.val_loss()), e.step() % 2 != 0) << "step " << e.step();
    EXPECT_DOUBLE_EQ(e.grad_norm(), 1.5);
    EXPECT_DOUBLE_EQ(e.lr(), 0.001 * e.step());
    EXPECT_EQ(e.tokens(), 300 * e.step());
    // Throughput over the step's time less its validation's, the least of the ranks' (jobs.proto).
    const bool evaluated = e.step() % 2 == 0;
    EXPECT_DOUBLE_EQ(e.eval_seconds(), evaluated ? 0.02 : 0.0) << "step " << e.step();
    ASSERT_GT(e.step_seconds(), e.eval_seconds()) << "step " << e.step();
    EXPECT_NEAR(e.tokens_per_second() * (e.step_seconds() - e.eval_seconds()), 300.0, 1e-6)
        << "step " << e.step();
  }
  EXPECT_EQ(step_events, 12);
  EXPECT_EQ(evs.back().state(), v1::JOB_STATE_SUCCEEDED);
  auto sc = jobs_->GetScalingState(id);
  ASSERT_TRUE(sc.ok()) << sc.status();
  EXPECT_EQ(sc->job_id(), id);
  EXPECT_EQ(sc->step(), 12);
  ASSERT_EQ(sc->tensors_size(), 1);
  EXPECT_TRUE(WaitFor([&] { return AllIdle(); }));
}

TEST_F(SchedulerTest, WorkerErrorFailsJobAndAbortsOthers) {
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kErrorAtStep, 1);
  auto job = jobs_->Submit("", SmallSpec(train_, 2, 5));
  ASSERT_TRUE(job.ok());
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "rank 1")) << end.reason();
  EXPECT_TRUE(absl::StrContains(end.reason(), w1->id())) << end.reason();
  EXPECT_TRUE(absl::StrContains(end.reason(), "gloo allreduce failed")) << end.reason();
  EXPECT_TRUE(WaitFor([&] { return w0->Count(v1::CoordinatorMessage::kAbort) == 1; }));
  EXPECT_TRUE(WaitFor([&] { return AllIdle(); }));
  EXPECT_EQ(workers_->FreeWorkers("cpu").size(), 2u) << "both sessions stay and are idle again";
  EXPECT_EQ(w1->Count(v1::CoordinatorMessage::kAbort), 0) << "the failing rank already stopped";
}

TEST_F(SchedulerTest, AbortedRanksWaitOutTheGraceBeforeTheNextJob) {
  // A grace long enough that a loaded machine still checks the held worker inside it.
  StartScheduler(2s, 3s);
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kErrorAtStep, 1);
  auto a = jobs_->Submit("", SmallSpec(train_, 2, 5));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(WaitEnd(a->job_id()).state(), v1::JOB_STATE_FAILED);
  ASSERT_TRUE(WaitFor([&] { return AllIdle(); }));
  const auto idle = std::chrono::steady_clock::now();
  // w0 was sent Abort and is held; w1 reported the failure itself, so it is free at once.
  EXPECT_EQ(workers_->FreeWorkers("cpu"), std::vector<std::string>{w1->id()});
  auto b = jobs_->Submit("", SmallSpec(train_, 2, 2));
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(WaitFor([&] { return jobs_->Get(b->job_id())->state() != v1::JOB_STATE_PENDING; }));
  // The hold began (at Release) no later than `idle`; allow for the polling around it.
  EXPECT_GE(std::chrono::steady_clock::now() - idle, 2500ms);
  // STARTING is set before the job's driver thread sends the assignments.
  EXPECT_TRUE(WaitFor([&] { return w0->Count(v1::CoordinatorMessage::kAssignment) == 2; }));
}

TEST_F(SchedulerTest, LostSessionFailsJobWithinSeconds) {
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kLoseSessionAtStep, 2);
  auto job = jobs_->Submit("", SmallSpec(train_, 2, 5));
  ASSERT_TRUE(job.ok());
  v1::Job end = WaitEnd(job->job_id(), 5);
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "rank 1 (worker " + w1->id() + ")")) << end.reason();
  EXPECT_TRUE(absl::StrContains(end.reason(), "session stream ended")) << end.reason();
  EXPECT_TRUE(WaitFor([&] { return w0->Count(v1::CoordinatorMessage::kAbort) == 1; }));
  // The Abort is sent before the job's workers are released.
  ASSERT_TRUE(WaitFor([&] { return AllIdle(); }));
  EXPECT_EQ(workers_->FreeWorkers("cpu"), std::vector<std::string>{w0->id()});
}

TEST_F(SchedulerTest, HeartbeatTimeoutFailsJob) {
  StartScheduler(10s, 0ms);  // the heartbeat timeout (2 s) must end the step's wait first
  auto w0 = AddWorker(FakeWorker::Mode::kStopHeartbeatAtStep, 1);
  auto w1 = AddWorker();
  auto job = jobs_->Submit("", SmallSpec(train_, 2, 5));
  ASSERT_TRUE(job.ok());
  auto t0 = std::chrono::steady_clock::now();
  v1::Job end = WaitEnd(job->job_id(), 15);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 9s) << "before the 10 s step timeout";
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "rank 0 (worker " + w0->id() + ")")) << end.reason();
  EXPECT_TRUE(absl::StrContains(end.reason(), "heartbeat")) << end.reason();
  EXPECT_TRUE(WaitFor([&] { return w1->Count(v1::CoordinatorMessage::kAbort) == 1; }));
  // The silent worker's session is still open: it is told to abort as well.
  EXPECT_TRUE(WaitFor([&] { return w0->Count(v1::CoordinatorMessage::kAbort) == 1; }));
}

TEST_F(SchedulerTest, StepTimeoutFailsJob) {
  AddWorker(FakeWorker::Mode::kHangAtStep, 0);
  auto job = jobs_->Submit("", SmallSpec(train_, 1, 5));
  ASSERT_TRUE(job.ok());
  v1::Job end = WaitEnd(job->job_id(), 6);
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "step 0")) << end.reason();
  EXPECT_TRUE(absl::StrContains(end.reason(), "rank 0")) << end.reason();
}

TEST_F(SchedulerTest, CancelRunningJobAbortsEveryRank) {
  auto w0 = AddWorker(FakeWorker::Mode::kHangAtStep, 1);  // keeps the job in step 1
  auto w1 = AddWorker();
  auto job = jobs_->Submit("", SmallSpec(train_, 2, 5));
  ASSERT_TRUE(job.ok());
  ASSERT_TRUE(WaitFor([&] { return jobs_->Get(job->job_id())->step() == 1; }));
  auto c = jobs_->Cancel(job->job_id());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_TRUE(WaitFor([&] {
    return w0->Count(v1::CoordinatorMessage::kAbort) == 1 &&
           w1->Count(v1::CoordinatorMessage::kAbort) == 1;
  }, 3));
  EXPECT_TRUE(WaitFor([&] { return AllIdle(); }));
  EXPECT_EQ(jobs_->Get(job->job_id())->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(jobs_->Cancel(job->job_id()).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(SchedulerTest, JobsRunConcurrentlyOnDisjointWorkers) {
  auto w0 = AddWorker(FakeWorker::Mode::kHangAtStep, 2);
  auto w1 = AddWorker();
  auto w2 = AddWorker();
  auto a = jobs_->Submit("", SmallSpec(train_, 1, 5));
  ASSERT_TRUE(WaitFor([&] { return jobs_->Get(a->job_id())->state() == v1::JOB_STATE_RUNNING; }));
  auto b = jobs_->Submit("", SmallSpec(train_, 2, 3));
  ASSERT_TRUE(a.ok() && b.ok());
  v1::Job bend = WaitEnd(b->job_id());
  EXPECT_EQ(bend.state(), v1::JOB_STATE_SUCCEEDED) << bend.reason();
  EXPECT_EQ(jobs_->Get(a->job_id())->state(), v1::JOB_STATE_RUNNING);
  for (const auto& w : bend.worker_ids()) EXPECT_NE(w, w0->id());
  ASSERT_TRUE(jobs_->Cancel(a->job_id()).ok());
}

TEST_F(SchedulerTest, FlexibleWorldSizePicksLargestDivisor) {
  for (int i = 0; i < 3; ++i) AddWorker();
  v1::JobSpec s = SmallSpec(train_, 1, 2);
  s.mutable_sharding()->set_max_workers(4);  // global_batch 4: 3 does not divide, 4 not free
  auto job = jobs_->Submit("", s);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.world_size(), 2);
}

// ---------------- checkpoints ----------------

// Steps of the SaveCheckpoints a worker received, and the position of each in its message stream
// relative to the step commands.
std::vector<int64_t> SaveSteps(FakeWorker& w) {
  std::vector<int64_t> out;
  for (const auto& m : w.received())
    if (m.has_save()) out.push_back(m.save().step());
  return out;
}

std::vector<std::string> Messages(JobManager* jobs, const std::string& id) {
  std::vector<std::string> out;
  EXPECT_TRUE(jobs->Watch(id, 0, [&](const v1::JobEvent& e) {
                    if (!e.message().empty()) out.push_back(e.message());
                    return true;
                  }).ok());
  return out;
}

std::vector<int64_t> Committed(const std::string& dir) {
  std::vector<int64_t> out;
  auto l = CheckpointStore(dir).List();
  EXPECT_TRUE(l.ok()) << l.status();
  for (const auto& c : *l) out.push_back(c.step);
  return out;
}

TEST_F(SchedulerTest, CheckpointsAtIntervalAndEndOnEveryRankManifestLast) {
  auto w0 = AddWorker();
  auto w1 = AddWorker();
  w1->set_delays(0ms, 150ms);  // rank 1 acks late: the MANIFEST must wait for it
  const std::string ck = dir_.File("ck");
  v1::JobSpec spec = SmallSpec(train_, 2, 10);
  spec.mutable_checkpoint()->set_dir(ck);
  spec.mutable_checkpoint()->set_every_steps(4);
  spec.mutable_checkpoint()->set_keep_last(2);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::Job end = WaitEnd(job->job_id());
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  for (auto* w : {w0.get(), w1.get()}) {
    EXPECT_EQ(SaveSteps(*w), (std::vector<int64_t>{4, 8, 10}));
    // Each save comes right after its step's result, before the next step command.
    std::vector<std::string> order;
    for (const auto& m : w->received()) {
      if (m.has_step()) order.push_back("s" + std::to_string(m.step().step()));
      if (m.has_save()) {
        order.push_back("c" + std::to_string(m.save().step()));
        EXPECT_EQ(m.save().dir(), ck + "/step-" + std::to_string(m.save().step()));
      }
    }
    EXPECT_EQ(order, (std::vector<std::string>{"s0", "s1", "s2", "s3", "c4", "s4", "s5", "s6",
                                               "s7", "c8", "s8", "s9", "c10"}));
    EXPECT_EQ(w->manifest_seen_early(), 0) << "MANIFEST written before every rank acked";
    EXPECT_TRUE(w->received().back().has_finish());
  }
  EXPECT_EQ(Committed(ck), (std::vector<int64_t>{8, 10}));  // keep_last 2
  auto c = CheckpointStore::Open(ck + "/step-10");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->manifest.job_id(), job->job_id());
  EXPECT_EQ(c->manifest.world_size(), 2);
  EXPECT_EQ(c->manifest.tokens(), 10 * 300);
  ASSERT_EQ(c->manifest.files_size(), 2);
  EXPECT_EQ(c->manifest.files(1).file(), "rank-1.ckpt");
  EXPECT_EQ(c->manifest.files(1).bytes(), 1001);
  EXPECT_EQ(c->manifest.files(1).crc32(), 12345u);
  EXPECT_EQ(c->manifest.spec().model().d_model(), 32);
  const auto msgs = Messages(jobs_.get(), job->job_id());
  for (int k : {4, 8, 10}) {
    EXPECT_NE(std::find(msgs.begin(), msgs.end(),
                        "checkpoint step-" + std::to_string(k) + " committed"),
              msgs.end())
        << k;
  }
}

TEST_F(SchedulerTest, NoCheckpointDirNoSaves) {
  auto w0 = AddWorker();
  auto job = jobs_->Submit("", SmallSpec(train_, 1, 3));
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(WaitEnd(job->job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(w0->Count(v1::CoordinatorMessage::kSave), 0);
}

// Dispatch ahead: step k+1's command reaches the workers while step k runs (before its result),
// except where a save comes between the two steps; the saves land where they would otherwise.
TEST_F(SchedulerTest, NextStepIsSentAheadUnlessASaveComesBetween) {
  StartScheduler(10s, 0ms);  // a step timeout above the results' hold below
  auto w0 = AddWorker();
  auto w1 = AddWorker();
  // A step sent ahead arrives while the result of the one before is held; 3 s covers a loaded
  // machine, and only the two steps with nothing sent ahead (3: a save follows; 7: the last) wait it.
  for (auto* w : {w0.get(), w1.get()}) w->set_hold_results(3000ms);
  const std::string ck = dir_.File("ck");
  v1::JobSpec spec = SmallSpec(train_, 2, 8);
  spec.mutable_checkpoint()->set_dir(ck);
  spec.mutable_checkpoint()->set_every_steps(4);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::Job end = WaitEnd(job->job_id(), 30);
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  for (auto* w : {w0.get(), w1.get()}) {
    // Step k+1 arrives after k results (while step k runs); step 4 only after the save of step-4,
    // i.e. after 4 results.
    EXPECT_EQ(w->results_before_step(), (std::vector<int>{0, 0, 1, 2, 4, 4, 5, 6}));
    EXPECT_EQ(SaveSteps(*w), (std::vector<int64_t>{4, 8}));
  }
}

TEST_F(SchedulerTest, TriggerCheckpointSavesAfterTheNextStep) {
  auto w0 = AddWorker();
  w0->set_delays(30ms, 0ms);
  const std::string ck = dir_.File("ck");
  v1::JobSpec spec = SmallSpec(train_, 1, 30);
  spec.mutable_checkpoint()->set_dir(ck);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  EXPECT_EQ(jobs_->RequestCheckpoint("job-nope").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(WaitFor([&] { return jobs_->Get(id)->step() >= 3; }));
  auto at = jobs_->RequestCheckpoint(id);
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_GE(*at, 4);
  EXPECT_LT(*at, 30);
  auto again = jobs_->RequestCheckpoint(id);  // coalesces with the first
  v1::Job end = WaitEnd(id);
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  std::vector<int64_t> want = {*at};
  if (again.ok() && *again != *at) want.push_back(*again);
  want.push_back(30);
  EXPECT_EQ(SaveSteps(*w0), want);
  EXPECT_EQ(jobs_->RequestCheckpoint(id).status().code(), absl::StatusCode::kFailedPrecondition);
  // Without a checkpoint.dir.
  auto plain = jobs_->Submit("", SmallSpec(train_, 1, 3));
  auto st = jobs_->RequestCheckpoint(plain->job_id()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(), "no checkpoint.dir")) << st;
}

// A save one rank cannot write is dropped (nothing committed, its directory removed) and training
// goes on; the next interval saves normally.
TEST_F(SchedulerTest, FailedSaveIsDroppedAndTheNextIntervalSaves) {
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kErrorAtSave, 2);
  const std::string ck = dir_.File("ck");
  v1::JobSpec spec = SmallSpec(train_, 2, 6);
  spec.mutable_checkpoint()->set_dir(ck);
  spec.mutable_checkpoint()->set_every_steps(2);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok());
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(Committed(ck), (std::vector<int64_t>{4, 6}));
  EXPECT_FALSE(std::filesystem::exists(ck + "/step-2"));
  bool reported = false;
  for (const auto& m : Messages(jobs_.get(), job->job_id()))
    reported |= absl::StrContains(m, "checkpoint step-2: rank 1") &&
                absl::StrContains(m, "disk full") && absl::StrContains(m, "failed save 1 of at most 3");
  EXPECT_TRUE(reported);
  EXPECT_EQ(w0->Count(v1::CoordinatorMessage::kAbort), 0);
}

// checkpoint.max_failed_saves consecutive failed saves fail the job, naming the rule and the last
// cause; the checkpoint committed before them is untouched.
TEST_F(SchedulerTest, ConsecutiveFailedSavesFailTheJob) {
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kErrorFromSave, 4);
  const std::string ck = dir_.File("ck");
  v1::JobSpec spec = SmallSpec(train_, 2, 20);
  spec.mutable_checkpoint()->set_dir(ck);
  spec.mutable_checkpoint()->set_every_steps(2);
  spec.mutable_checkpoint()->set_max_failed_saves(3);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok());
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(end.step(), 8);  // saves at 4, 6 and 8 failed
  EXPECT_TRUE(absl::StrContains(end.reason(), "3 consecutive checkpoint saves failed "
                                              "(checkpoint.max_failed_saves 3); last: checkpoint "
                                              "step-8: rank 1"))
      << end.reason();
  EXPECT_EQ(end.restarts(), 0);  // a storage problem is not restarted
  EXPECT_EQ(Committed(ck), (std::vector<int64_t>{2}));
  EXPECT_TRUE(CheckpointStore::Open(ck + "/step-2").ok());
  EXPECT_FALSE(std::filesystem::exists(ck + "/step-4"));
}

TEST_F(SchedulerTest, ReportedFileThatDoesNotMatchIsNeverCommitted) {
  for (auto mode : {FakeWorker::Mode::kWrongSizeAtSave, FakeWorker::Mode::kEscapingNameAtSave}) {
    auto w = AddWorker(mode, 2);
    const std::string ck = dir_.File(mode == FakeWorker::Mode::kWrongSizeAtSave ? "ck1" : "ck2");
    v1::JobSpec spec = SmallSpec(train_, 1, 4);
    spec.mutable_checkpoint()->set_dir(ck);
    spec.mutable_checkpoint()->set_every_steps(2);
    spec.mutable_checkpoint()->set_max_failed_saves(1);
    auto job = jobs_->Submit("", spec);
    ASSERT_TRUE(job.ok());
    v1::Job end = WaitEnd(job->job_id());
    EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
    EXPECT_TRUE(absl::StrContains(end.reason(), "checkpoint step-2: checkpoint " + ck + "/step-2"))
        << end.reason();
    EXPECT_TRUE(Committed(ck).empty());
    EXPECT_TRUE(WaitFor([&] { return w->Count(v1::CoordinatorMessage::kAbort) == 1; }));
    // Released first: a busy worker is not free either, and would be free again after the stop.
    ASSERT_TRUE(WaitFor([&] { return AllIdle(); }));
    w->Stop();  // no more heartbeats: unassignable once the registry notices
    ASSERT_TRUE(WaitFor([&] { return workers_->FreeWorkers("cpu").empty(); }));
  }
}

TEST_F(SchedulerTest, SaveDeadlineFailsTheJob) {
  // The fixture's 2 s step timeout is also the save's deadline: room for the steps on a loaded
  // machine, well below the 5 s the save takes.
  auto w0 = AddWorker();
  w0->set_delays(0ms, 5000ms);
  v1::JobSpec spec = SmallSpec(train_, 1, 2);
  spec.mutable_checkpoint()->set_dir(dir_.File("ck"));
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok());
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "checkpoint step-2: timed out waiting for "
                                              "CheckpointSaved"))
      << end.reason();
}

// C11: the coordinator picks the checkpoint and sends the same one to every rank.
TEST_F(SchedulerTest, ResumeSendsTheSameCheckpointToEveryRank) {
  auto w0 = AddWorker();
  auto w1 = AddWorker();
  const std::string ck = dir_.File("ck");
  v1::JobSpec first = SmallSpec(train_, 2, 4);
  first.mutable_checkpoint()->set_dir(ck);
  auto a = jobs_->Submit("", first);
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(WaitEnd(a->job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  ASSERT_EQ(Committed(ck), (std::vector<int64_t>{4}));
  ASSERT_TRUE(WaitFor([&] { return AllIdle(); }));
  // Each pass takes over its own copy of the directory: a second take-over of the same one would
  // meet the first pass's step-8 at its final step (refused at submit).
  const std::string copies[2] = {dir_.File("ck-latest"), dir_.File("ck-step4")};
  for (const std::string& copy : copies)
    std::filesystem::copy(ck, copy, std::filesystem::copy_options::recursive);

  for (int pass = 0; pass < 2; ++pass) {
    const std::string ck = copies[pass];
    const std::string from = pass == 0 ? std::string("latest") : ck + "/step-4";
    v1::JobSpec second = SmallSpec(train_, 2, 8);
    second.mutable_checkpoint()->set_dir(ck);
    second.mutable_checkpoint()->set_resume_from(from);
    second.mutable_checkpoint()->set_keep_last(5);
    second.mutable_checkpoint()->set_take_over(true);  // the directory of an ended job
    const int before0 = static_cast<int>(w0->received().size());
    const int before1 = static_cast<int>(w1->received().size());
    auto b = jobs_->Submit("", second);
    ASSERT_TRUE(b.ok()) << b.status();
    v1::Job end = WaitEnd(b->job_id());
    ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
    EXPECT_EQ(end.step(), 8);
    EXPECT_EQ(end.tokens(), 8 * 300) << "tokens continue from the checkpoint";
    for (auto [w, before] : {std::pair{w0.get(), before0}, std::pair{w1.get(), before1}}) {
      auto msgs = w->received();
      msgs.erase(msgs.begin(), msgs.begin() + before);
      ASSERT_FALSE(msgs.empty());
      ASSERT_TRUE(msgs[0].has_assignment());
      EXPECT_EQ(msgs[0].assignment().load_dir(), ck + "/step-4") << from;
      EXPECT_EQ(msgs[0].assignment().load_world_size(), 2);
      EXPECT_EQ(msgs[0].assignment().start_step(), 4);
      std::vector<int64_t> steps;
      for (const auto& m : msgs)
        if (m.has_step()) steps.push_back(m.step().step());
      EXPECT_EQ(steps, (std::vector<int64_t>{4, 5, 6, 7}));
    }
    std::vector<int64_t> step_events;
    ASSERT_TRUE(jobs_->Watch(b->job_id(), 0, [&](const v1::JobEvent& e) {
                        if (e.state() == v1::JOB_STATE_RUNNING && e.message().empty())
                          step_events.push_back(e.step());
                        return true;
                      }).ok());
    EXPECT_EQ(step_events, (std::vector<int64_t>{5, 6, 7, 8}));
    const auto msgs = Messages(jobs_.get(), b->job_id());
    EXPECT_NE(std::find(msgs.begin(), msgs.end(),
                        "resuming from " + ck + "/step-4 (step 4, saved by 2 ranks)"),
              msgs.end());
    ASSERT_TRUE(WaitFor([&] { return AllIdle(); }));
    EXPECT_EQ(Committed(ck), (std::vector<int64_t>{4, 8}));
    // step-4 stays the first job's, step-8 is this pass's.
    EXPECT_EQ(CheckpointStore::ReadManifest(ck + "/step-4")->job_id(), a->job_id());
    EXPECT_EQ(CheckpointStore::ReadManifest(ck + "/step-8")->job_id(), b->job_id());
  }
}

std::map<std::string, std::string> FilesUnder(const std::string& root);

// A take-over whose final step (training.steps) is another job's committed checkpoint is refused
// at submit, naming the directory, the step, that job and the ways out; nothing is written.
TEST_F(SchedulerTest, TakeOverWhoseFinalStepIsTakenIsRefused) {
  auto w0 = AddWorker();
  const std::string ck = dir_.File("ck");
  v1::JobSpec first = SmallSpec(train_, 1, 4);
  first.mutable_checkpoint()->set_dir(ck);
  first.mutable_checkpoint()->set_every_steps(2);
  auto a = jobs_->Submit("", first);
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(WaitEnd(a->job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  ASSERT_EQ(Committed(ck), (std::vector<int64_t>{2, 4}));
  const auto before = FilesUnder(ck);
  v1::JobSpec second = SmallSpec(train_, 1, 4);
  second.mutable_checkpoint()->set_dir(ck);
  second.mutable_checkpoint()->set_take_over(true);
  absl::Status s = jobs_->Submit("", second).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  for (const std::string& part :
       {"checkpoint.dir " + ck, std::string("final step 4"), "step-4 (job " + a->job_id() + ")",
        std::string("checkpoint.resume_from: latest"), std::string("training.steps"),
        std::string("another checkpoint.dir")})
    EXPECT_TRUE(absl::StrContains(s.message(), part)) << part << " not in " << s;
  EXPECT_EQ(FilesUnder(ck), before);
  EXPECT_EQ((*CheckpointStore(ck).Owner())->owner().job_id(), a->job_id());
  // The ways out: continuing after the newest checkpoint, or more steps (step 2 is skipped).
  second.mutable_checkpoint()->set_resume_from("latest");
  EXPECT_TRUE(jobs_->Submit("", second).ok());
}

// Every file under root and its bytes.
std::map<std::string, std::string> FilesUnder(const std::string& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    out[e.path().string()] = std::string((std::istreambuf_iterator<char>(in)), {});
  }
  return out;
}

// A checkpoint directory belongs to the job that used it first: a second job naming it is refused
// at submit while the first runs and after it ended; with checkpoint.take_over once the first has
// ended, and then the first's checkpoints stay byte for byte (the second's retention keeps them).
TEST_F(SchedulerTest, TwoJobsOnOneDirectoryTheFirstsCheckpointsStay) {
  auto w0 = AddWorker();
  w0->set_delays(30ms, 0ms);
  const std::string ck = dir_.File("ck");
  v1::JobSpec first = SmallSpec(train_, 1, 20);
  first.mutable_checkpoint()->set_dir(ck);
  first.mutable_checkpoint()->set_every_steps(2);
  first.mutable_checkpoint()->set_keep_last(2);
  auto a = jobs_->Submit("", first, "alice");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(WaitFor([&] { return jobs_->Get(a->job_id())->step() >= 4; }));

  v1::JobSpec second = SmallSpec(train_, 1, 4);
  second.mutable_checkpoint()->set_dir(ck);
  second.mutable_checkpoint()->set_every_steps(2);
  second.mutable_checkpoint()->set_keep_last(1);
  auto refused = [&](const v1::JobSpec& spec, const std::string& why) {
    absl::Status st = jobs_->Submit("", spec, "bob").status();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), why)) << st;
  };
  const std::string owner = "belongs to job " + a->job_id() + " (user alice)";
  refused(second, owner);
  second.mutable_checkpoint()->set_resume_from("latest");
  refused(second, owner);
  second.mutable_checkpoint()->set_take_over(true);
  refused(second, a->job_id() + ", which is RUNNING");

  ASSERT_EQ(WaitEnd(a->job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  ASSERT_EQ(Committed(ck), (std::vector<int64_t>{18, 20}));
  const auto before = FilesUnder(ck);
  second.mutable_checkpoint()->set_take_over(false);
  refused(second, owner);  // ended, but no take-over asked for
  second.mutable_checkpoint()->clear_resume_from();
  refused(second, owner);
  EXPECT_EQ(FilesUnder(ck), before);

  // Take-over: a fresh start whose saves (steps 2 and 4, keep_last 1) never touch the first's.
  second.mutable_checkpoint()->set_take_over(true);
  auto b = jobs_->Submit("", second, "bob");
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(WaitEnd(b->job_id()).state(), v1::JOB_STATE_SUCCEEDED) << jobs_->Get(b->job_id())->reason();
  EXPECT_EQ(Committed(ck), (std::vector<int64_t>{4, 18, 20}));
  const auto after = FilesUnder(ck);
  for (const auto& [path, bytes] : before) {
    if (absl::EndsWith(path, "/OWNER")) continue;  // rewritten by the take-over
    ASSERT_TRUE(after.count(path)) << path << " deleted";
    EXPECT_EQ(after.at(path), bytes) << path << " changed";
  }
  auto of_a = CheckpointStore(ck).List(a->job_id());
  ASSERT_TRUE(of_a.ok());
  ASSERT_EQ(of_a->size(), 2u);
  auto owner_now = CheckpointStore(ck).Owner();
  ASSERT_TRUE(owner_now.ok() && owner_now->has_value());
  EXPECT_EQ((*owner_now)->owner().job_id(), b->job_id());
  ASSERT_EQ((*owner_now)->previous_size(), 1);
  EXPECT_EQ((*owner_now)->previous(0).job_id(), a->job_id());
}

// A generation starts only once the leftovers of its directory are removed: when that fails (the
// directory now belongs to another job) the job fails naming it and never runs a step.
TEST_F(SchedulerTest, AGenerationWhoseLeftoversCannotBeRemovedNeverRuns) {
  const std::string ck = dir_.File("ck");
  v1::JobSpec spec = SmallSpec(train_, 1, 3);
  spec.mutable_checkpoint()->set_dir(ck);
  auto job = jobs_->Submit("", spec);  // no worker yet: PENDING
  ASSERT_TRUE(job.ok()) << job.status();
  {
    v1::CheckpointDirOwner o;
    o.mutable_owner()->set_job_id("job-elsewhere");
    auto text = EncodeOwner(o);
    ASSERT_TRUE(text.ok()) << text.status();
    std::ofstream(ck + "/OWNER", std::ios::trunc) << *text;
  }
  auto w0 = AddWorker();
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "checkpoint.dir " + ck + ": removing leftovers"))
      << end.reason();
  EXPECT_TRUE(absl::StrContains(end.reason(), "belongs to job job-elsewhere")) << end.reason();
  EXPECT_EQ(w0->Count(v1::CoordinatorMessage::kStep), 0);
}

// init.from_checkpoint: a job starts at step 0 from another job's committed checkpoint, which
// every rank gets in its Assignment and which is never written (its directory stays byte for
// byte); a checkpoint of another model is refused at submit, naming the field.
TEST_F(SchedulerTest, StartsFromAnotherJobsCheckpointReadOnly) {
  auto w0 = AddWorker();
  const std::string ck_a = dir_.File("ck-a");
  v1::JobSpec first = SmallSpec(train_, 1, 4);
  first.mutable_checkpoint()->set_dir(ck_a);
  auto a = jobs_->Submit("", first);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(WaitEnd(a->job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  ASSERT_TRUE(WaitFor([&] { return AllIdle(); }));
  const auto before = FilesUnder(ck_a);

  v1::JobSpec second = SmallSpec(train_, 1, 3);
  second.mutable_checkpoint()->set_dir(dir_.File("ck-b"));
  second.mutable_init()->set_from_checkpoint(ck_a + "/step-4");
  second.mutable_init()->set_load_optimizer_state(true);
  v1::JobSpec other_model = second;
  other_model.mutable_model()->set_d_model(64);
  absl::Status st = jobs_->Submit("", other_model).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(), "init.from_checkpoint: checkpoint " + ck_a +
                                                  "/step-4 was written with a different model"))
      << st;
  const size_t seen = w0->received().size();
  auto b = jobs_->Submit("", second);
  ASSERT_TRUE(b.ok()) << b.status();
  v1::Job end = WaitEnd(b->job_id());
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.step(), 3);
  auto msgs = w0->received();
  msgs.erase(msgs.begin(), msgs.begin() + seen);
  ASSERT_TRUE(!msgs.empty() && msgs[0].has_assignment());
  EXPECT_EQ(msgs[0].assignment().init_dir(), ck_a + "/step-4");
  EXPECT_EQ(msgs[0].assignment().init_world_size(), 1);
  EXPECT_EQ(msgs[0].assignment().load_dir(), "");
  EXPECT_EQ(msgs[0].assignment().start_step(), 0);
  std::vector<int64_t> steps;
  for (const auto& m : msgs)
    if (m.has_step()) steps.push_back(m.step().step());
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(FilesUnder(ck_a), before) << "init.from_checkpoint is read only";
  EXPECT_EQ(Committed(dir_.File("ck-b")), (std::vector<int64_t>{3}));
}

// A generation restarted after a failure (same job id) keeps writing its own directory.
TEST_F(SchedulerTest, ARestartedJobKeepsItsDirectory) {
  auto w0 = AddWorker(FakeWorker::Mode::kErrorOnceAtStep, 5);
  const std::string ck = dir_.File("ck");
  v1::JobSpec spec = SmallSpec(train_, 1, 8);
  spec.mutable_checkpoint()->set_dir(ck);
  spec.mutable_checkpoint()->set_every_steps(2);
  spec.mutable_checkpoint()->set_keep_last(10);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::Job end = WaitEnd(job->job_id());
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.restarts(), 1);
  EXPECT_EQ(Committed(ck), (std::vector<int64_t>{2, 4, 6, 8}));
  auto mine = CheckpointStore(ck).List(job->job_id());
  ASSERT_TRUE(mine.ok());
  EXPECT_EQ(mine->size(), 4u);
}

TEST_F(SchedulerTest, ResumeLatestWithNothingCommittedStartsFresh) {
  auto w0 = AddWorker();
  v1::JobSpec spec = SmallSpec(train_, 1, 2);
  spec.mutable_checkpoint()->set_dir(dir_.File("empty"));
  spec.mutable_checkpoint()->set_resume_from("latest");
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_EQ(WaitEnd(job->job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  auto msgs = w0->received();
  ASSERT_TRUE(msgs[0].has_assignment());
  EXPECT_EQ(msgs[0].assignment().load_dir(), "");
  EXPECT_EQ(msgs[0].assignment().start_step(), 0);
}

TEST_F(SchedulerTest, ResumeRefusesIncompatibleOrDamagedCheckpoints) {
  auto w0 = AddWorker();
  const std::string ck = dir_.File("ck");
  v1::JobSpec first = SmallSpec(train_, 1, 2);
  first.mutable_checkpoint()->set_dir(ck);
  auto a = jobs_->Submit("", first);
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(WaitEnd(a->job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  ASSERT_TRUE(WaitFor([&] { return AllIdle(); }));

  // A named step directory is checked at submit.
  v1::JobSpec other = SmallSpec(train_, 1, 4);
  other.mutable_model()->set_d_model(64);
  other.mutable_checkpoint()->set_dir(ck);
  other.mutable_checkpoint()->set_resume_from(ck + "/step-2");
  auto s = jobs_->Submit("", other).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "different model")) << s;
  other.mutable_model()->set_d_model(32);
  other.mutable_checkpoint()->set_resume_from(ck + "/step-3");
  s = jobs_->Submit("", other).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "checkpoint.resume_from: checkpoint " + ck +
                                                 "/step-3: no such directory")) << s;

  // "latest" is resolved at start: the job fails with the reason.
  other.mutable_model()->set_d_model(64);
  other.mutable_checkpoint()->set_resume_from("latest");
  other.mutable_checkpoint()->set_take_over(true);  // the directory of an ended job
  auto b = jobs_->Submit("", other);
  ASSERT_TRUE(b.ok()) << b.status();
  v1::Job end = WaitEnd(b->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "different model")) << end.reason();
  ASSERT_TRUE(WaitFor([&] { return AllIdle(); }));

  // A damaged checkpoint is refused, never loaded.
  { std::ofstream(ck + "/step-2/rank-0.ckpt") << "short"; }
  other.mutable_model()->set_d_model(32);
  auto c = jobs_->Submit("", other);
  ASSERT_TRUE(c.ok()) << c.status();
  end = WaitEnd(c->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "is damaged: rank 0 file rank-0.ckpt")) << end.reason();
  for (const auto& m : w0->received()) {
    if (m.has_assignment()) {
      EXPECT_EQ(m.assignment().load_dir(), "");
    }
  }
  EXPECT_EQ(w0->Count(v1::CoordinatorMessage::kAbort), 0) << "never assigned, nothing to abort";
  EXPECT_EQ(w0->Count(v1::CoordinatorMessage::kAssignment), 1);
}

}  // namespace
}  // namespace fsdp8::coord

namespace fsdp8::coord {
namespace {

// Recovery: a failed generation restarts from the latest committed checkpoint.
TEST_F(SchedulerTest, FailedGenerationRecoversFromLatestCheckpoint) {
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kErrorOnceAtStep, 3);
  const std::string ck = dir_.File("ck");
  v1::JobSpec spec = SmallSpec(train_, 2, 6);
  spec.mutable_checkpoint()->set_dir(ck);
  spec.mutable_checkpoint()->set_every_steps(2);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->spec().max_restarts(), 3);
  v1::Job end = WaitEnd(job->job_id());
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.restarts(), 1);
  EXPECT_EQ(end.generation(), 2);
  EXPECT_EQ(end.step(), 6);
  EXPECT_EQ(end.tokens(), 6 * 300);
  for (auto* w : {w0.get(), w1.get()}) {
    std::vector<v1::Assignment> as;
    for (const auto& m : w->received())
      if (m.has_assignment()) as.push_back(m.assignment());
    ASSERT_EQ(as.size(), 2u);
    EXPECT_EQ(as[0].generation(), 1);
    EXPECT_TRUE(as[0].load_dir().empty());
    EXPECT_EQ(as[1].generation(), 2);
    EXPECT_EQ(as[1].load_dir(), ck + "/step-2");
    EXPECT_EQ(as[1].load_world_size(), 2);
    EXPECT_EQ(as[1].start_step(), 2);
    EXPECT_NE(as[1].store_prefix(), as[0].store_prefix());
    // Steps 2.. are run again by generation 2.
    std::vector<int64_t> steps;
    for (const auto& m : w->received())
      if (m.has_step()) steps.push_back(m.step().step());
    EXPECT_EQ(steps, (std::vector<int64_t>{0, 1, 2, 3, 2, 3, 4, 5}));
  }
  EXPECT_EQ(w0->Count(v1::CoordinatorMessage::kAbort), 1);
  EXPECT_EQ(w1->Count(v1::CoordinatorMessage::kAbort), 0) << "the failing rank already stopped";
  bool saw_recovering = false;
  std::vector<std::string> msgs;
  jobs_->Watch(job->job_id(), 0, [&](const v1::JobEvent& e) {
    saw_recovering |= e.state() == v1::JOB_STATE_RECOVERING;
    msgs.push_back(e.message());
    return true;
  }).IgnoreError();
  EXPECT_TRUE(saw_recovering);
  bool recovering_msg = false, resumed_msg = false;
  for (const auto& m : msgs) {
    recovering_msg |= absl::StrContains(m, "recovering from rank 1") &&
                      absl::StrContains(m, "gloo allreduce failed") &&
                      absl::StrContains(m, "(restart 1 of 3)");
    resumed_msg |= absl::StrContains(m, "resuming from " + ck + "/step-2");
  }
  EXPECT_TRUE(recovering_msg) << absl::StrJoin(msgs, "\n");
  EXPECT_TRUE(resumed_msg) << absl::StrJoin(msgs, "\n");
}

TEST_F(SchedulerTest, ExhaustedRestartsFailTheJob) {
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kErrorAtStep, 3);
  v1::JobSpec spec = SmallSpec(train_, 2, 6);
  spec.mutable_checkpoint()->set_dir(dir_.File("ck"));
  spec.mutable_checkpoint()->set_every_steps(2);
  spec.set_max_restarts(2);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(end.restarts(), 2);
  EXPECT_EQ(end.generation(), 3);
  EXPECT_TRUE(absl::StrContains(end.reason(), "gloo allreduce failed")) << end.reason();
  EXPECT_EQ(w1->Count(v1::CoordinatorMessage::kAssignment), 3);
}

// A deterministic failure (out of memory: WorkerError code RESOURCE_EXHAUSTED) fails the job
// with that cause at once, although it has a checkpoint dir, restarts left and a spare worker.
TEST_F(SchedulerTest, OutOfMemoryFailsTheJobWithoutRestart) {
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kOutOfMemoryAtStep, 2);
  auto spare = AddWorker();
  v1::JobSpec spec = SmallSpec(train_, 2, 6);
  spec.mutable_checkpoint()->set_dir(dir_.File("ck"));
  spec.mutable_checkpoint()->set_every_steps(2);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(end.restarts(), 0);
  EXPECT_EQ(end.generation(), 1);
  EXPECT_TRUE(absl::StrContains(end.reason(), "RESOURCE_EXHAUSTED")) << end.reason();
  EXPECT_EQ(spare->Count(v1::CoordinatorMessage::kAssignment), 0);
  EXPECT_TRUE(WaitFor([&] { return AllIdle(); }, 5));
}

// A worker that reports a result for a step it was never sent fails the generation with that
// protocol violation (named), instead of the coordinator keeping the result around.
TEST_F(SchedulerTest, ResultForAStepNeverSentFailsTheGeneration) {
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kResultForUnsentStepAt, 1);
  v1::JobSpec spec = SmallSpec(train_, 2, 4);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "result for step 1001, which it was never sent"))
      << end.reason();
  EXPECT_TRUE(absl::StrContains(end.reason(), w1->id())) << end.reason();
  EXPECT_TRUE(WaitFor([&] { return AllIdle(); }, 5));
}

TEST_F(SchedulerTest, NoCheckpointDirMeansNoRestart) {
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kErrorOnceAtStep, 1);
  auto job = jobs_->Submit("", SmallSpec(train_, 2, 4));
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->spec().max_restarts(), 0);
  v1::Job end = WaitEnd(job->job_id());
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(end.restarts(), 0);
}

TEST_F(SchedulerTest, RecoveringWithTooFewWorkersFailsAfterStartTimeout) {
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kLoseSessionAtStep, 1);
  v1::JobSpec spec = SmallSpec(train_, 2, 4);
  spec.mutable_checkpoint()->set_dir(dir_.File("ck"));
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok());
  const std::string id = job->job_id();
  // The job shows why it waits.
  ASSERT_TRUE(WaitFor([&] {
    return absl::StrContains(jobs_->Get(id)->reason(), "recovering: waiting for 2 workers (1 free)");
  })) << jobs_->Get(id)->reason();
  EXPECT_EQ(jobs_->Get(id)->state(), v1::JOB_STATE_RECOVERING);
  EXPECT_EQ(jobs_->Get(id)->restarts(), 1);
  v1::Job end = WaitEnd(id, 8);  // start_timeout 3 s
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "could not recover")) << end.reason();
}

TEST_F(SchedulerTest, CancelWhileRecoveringCancels) {
  auto w0 = AddWorker();
  auto w1 = AddWorker(FakeWorker::Mode::kLoseSessionAtStep, 1);
  v1::JobSpec spec = SmallSpec(train_, 2, 4);
  spec.mutable_checkpoint()->set_dir(dir_.File("ck"));
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok());
  const std::string id = job->job_id();
  ASSERT_TRUE(WaitFor([&] { return jobs_->Get(id)->state() == v1::JOB_STATE_RECOVERING; }));
  ASSERT_TRUE(jobs_->Cancel(id).ok());
  EXPECT_EQ(WaitEnd(id).state(), v1::JOB_STATE_CANCELLED);
  AddWorker();  // enough workers now: the cancelled job must not start again
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(jobs_->Get(id)->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(jobs_->Get(id)->generation(), 1);
}

// A resumed job whose own checkpoints are gone before its next generation starts fails, naming
// the directory: it neither starts over at step 0 (while Job.step says the resume point) nor
// from checkpoint.resume_from.
TEST_F(SchedulerTest, AResumedJobWhoseCheckpointsVanishedFailsInsteadOfStartingOver) {
  auto w0 = AddWorker(FakeWorker::Mode::kErrorAtStep, 5);
  const std::string ck = dir_.File("ck");
  v1::JobSpec spec = SmallSpec(train_, 1, 8);
  spec.mutable_checkpoint()->set_dir(ck);
  spec.mutable_checkpoint()->set_every_steps(2);
  spec.mutable_checkpoint()->set_resume_from("latest");
  spec.set_max_restarts(0);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  ASSERT_EQ(WaitEnd(id).state(), v1::JOB_STATE_FAILED);
  ASSERT_EQ(Committed(ck), (std::vector<int64_t>{2, 4}));
  sched_->Stop();  // nothing starts while the checkpoints go
  auto resumed = jobs_->Resume(id);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  ASSERT_EQ(resumed->step(), 4);
  for (const char* step : {"/step-2", "/step-4"}) std::filesystem::remove_all(ck + step);
  ASSERT_TRUE(Committed(ck).empty());
  StartScheduler(2s, 0ms);
  const v1::Job end = WaitEnd(id);
  EXPECT_EQ(end.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(end.reason().rfind("resume: checkpoint.dir " + ck +
                                   " no longer holds a committed checkpoint of job " + id,
                               0),
            0u)
      << end.reason();
  EXPECT_EQ(w0->Count(v1::CoordinatorMessage::kAssignment), 1) << "a second generation started";
}

// ---------------- hybrid sharding: placement, auto replicas, checkpoints of a mesh ----------------

// A job of `replicas` x world / replicas on min..max workers, global batch 8 (microbatch 1 at 8).
v1::JobSpec HybridSpec(const std::string& train, int min_workers, int max_workers, int replicas,
                       int64_t steps = 3) {
  v1::JobSpec s = SmallSpec(train, min_workers, steps);
  s.mutable_sharding()->set_max_workers(max_workers);
  s.mutable_training()->set_global_batch(8);
  s.mutable_sharding()->set_replicas(replicas);
  return s;
}

// The host of each shard group (S consecutive ranks); "split" for a group on several hosts.
std::vector<std::string> GroupHosts(const std::vector<std::string>& rank_hosts, int s) {
  std::vector<std::string> out;
  for (size_t g = 0; g * s < rank_hosts.size(); ++g) {
    std::string h = rank_hosts[g * s];
    for (int k = 1; k < s; ++k)
      if (rank_hosts[g * s + k] != h) h = "split";
    out.push_back(h);
  }
  return out;
}

// 8 workers registered alternately from two simulated hosts: R = 2 x S = 4 and R = 4 x S = 2
// jobs get every shard group on one host, replicas alternating between the hosts, and every
// rank's Assignment carries the concrete R (registration order alone would split every group).
TEST_F(SchedulerTest, HybridShardGroupsStayOnOneHostAndReplicasSpreadOverHosts) {
  AddInterleavedWorkers(8);
  for (int r : {2, 4}) {
    SCOPED_TRACE(absl::StrCat("replicas ", r));
    auto job = jobs_->Submit("", HybridSpec(train_, 8, 8, r));
    ASSERT_TRUE(job.ok()) << job.status();
    const v1::Job end = WaitEnd(job->job_id());
    ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
    EXPECT_EQ(end.world_size(), 8);
    EXPECT_EQ(end.replicas(), r);
    std::vector<std::string> expected;
    for (int g = 0; g < r; ++g) expected.push_back(g % 2 == 0 ? "127.0.0.1" : "127.0.0.2");
    EXPECT_EQ(GroupHosts(RankHosts(end), 8 / r), expected);
    for (int rank = 0; rank < 8; ++rank) {
      auto a = AssignmentOf(end.worker_ids(rank), end.job_id());
      ASSERT_TRUE(a.has_value()) << rank;
      EXPECT_EQ(a->rank(), rank);
      EXPECT_EQ(a->world_size(), 8);
      EXPECT_EQ(a->spec().sharding().replicas(), r);
    }
  }
}

// Two R = 2 x S = 2 jobs side by side on two hosts of 4: disjoint workers, no group split.
TEST_F(SchedulerTest, TwoHybridJobsSideBySideKeepTheirGroupsWhole) {
  AddInterleavedWorkers(8);
  for (auto& f : fakes_) f->set_delays(100ms, 0ms);  // both jobs run at the same time
  auto a = jobs_->Submit("", HybridSpec(train_, 4, 4, 2));
  auto b = jobs_->Submit("", HybridSpec(train_, 4, 4, 2));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(WaitFor([&] {
    return jobs_->Get(a->job_id())->world_size() == 4 && jobs_->Get(b->job_id())->world_size() == 4;
  }));
  const v1::Job ja = *jobs_->Get(a->job_id()), jb = *jobs_->Get(b->job_id());
  EXPECT_FALSE(jobs_->IsTerminal(ja.job_id()) && jobs_->IsTerminal(jb.job_id()));
  std::set<std::string> ids(ja.worker_ids().begin(), ja.worker_ids().end());
  ids.insert(jb.worker_ids().begin(), jb.worker_ids().end());
  EXPECT_EQ(ids.size(), 8u) << "the jobs share a worker";
  for (const v1::Job* j : {&ja, &jb}) {
    EXPECT_EQ(GroupHosts(RankHosts(*j), 2), (std::vector<std::string>{"127.0.0.1", "127.0.0.2"}))
        << j->job_id();
  }
  EXPECT_EQ(WaitEnd(a->job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(WaitEnd(b->job_id()).state(), v1::JOB_STATE_SUCCEEDED);
}

// Two hosts of 3 free workers and R = 3 x S = 2: the job still runs on 6 (placement never
// shrinks it), two groups whole, the third split, and the generation's event says so.
TEST_F(SchedulerTest, AnUnavoidableSplitRunsAndIsAnnounced) {
  AddInterleavedWorkers(6);
  v1::JobSpec spec = HybridSpec(train_, 6, 6, 3);
  spec.mutable_training()->set_global_batch(24);
  auto job = jobs_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const v1::Job end = WaitEnd(job->job_id());
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.world_size(), 6);
  EXPECT_EQ(GroupHosts(RankHosts(end), 2),
            (std::vector<std::string>{"127.0.0.1", "127.0.0.2", "split"}));
  bool announced = false;
  for (const std::string& m : Messages(jobs_.get(), job->job_id()))
    announced |= absl::StrContains(m, "as 3 replicas x 2 ranks") &&
                 absl::StrContains(m, "shard groups split across placement domains") &&
                 absl::StrContains(m, "no domain had 2 free workers") &&
                 absl::StrContains(m, "replica 2 (");
  EXPECT_TRUE(announced) << absl::StrJoin(Messages(jobs_.get(), job->job_id()), "\n");
}

// replicas auto: on two hosts of 4, an 8-rank job is 2 x 4, a group per host; its memory plans
// were made from specs carrying a concrete R (2 where it ran), never auto.
TEST_F(SchedulerTest, AutoReplicasAreTheHostsOfTheJobsWorkers) {
  struct Seen {
    std::mutex mu;
    std::set<std::pair<int, int>> plans;  // (world size, sharding.replicas of the planned spec)
  };
  auto seen = std::make_shared<Seen>();
  sched_->Stop();
  JobManagerOptions jo;
  jo.planner = [seen](const v1::JobSpec& spec, int n) {
    {
      std::lock_guard<std::mutex> lock(seen->mu);
      seen->plans.insert({n, spec.sharding().replicas()});
    }
    return PlanMemory(spec, n);
  };
  auto jm = JobManager::Open(jo);
  ASSERT_TRUE(jm.ok()) << jm.status();
  jobs_ = std::move(*jm);
  StartScheduler(2s, 0ms);
  AddInterleavedWorkers(8);
  InstallAdmission(jobs_.get(), workers_.get());
  auto job = jobs_->Submit("", HybridSpec(train_, 8, 8, 0));
  ASSERT_TRUE(job.ok()) << job.status();
  const v1::Job end = WaitEnd(job->job_id());
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.replicas(), 2);
  EXPECT_EQ(GroupHosts(RankHosts(end), 4), (std::vector<std::string>{"127.0.0.1", "127.0.0.2"}));
  auto a = AssignmentOf(end.worker_ids(0), end.job_id());
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->spec().sharding().replicas(), 2);
  std::lock_guard<std::mutex> lock(seen->mu);
  EXPECT_TRUE(seen->plans.count({8, 2})) << "no plan of the mesh it runs on";
  for (const auto& [n, r] : seen->plans) EXPECT_GE(r, 1) << "planned auto at " << n;
}

// The scheduler's auto rule is PlaceAuto on, for each R, the free workers that hold the plan of
// the R x n / R mesh. The planner here needs 1000 bytes per replica (R = 1: 1000, 2: 2000, 4:
// 4000): on hosts A (a0, a1, a2) and B (b0, b1, b2) no host holds 4 ranks (R = 1 per host fails),
// and a0, b0 (1000 bytes) cannot join a 2 x 2 mesh, so its groups are (a1, a2) and (b1, b2), not
// the hosts' first workers; with a fourth worker on A, A holds the whole flat job (R = 1 is tried
// first). With every worker at 1000 bytes only the flat R = 1 fits: the first 4 in registration
// order. With one such worker nothing fits and the reason counts the workers that
// hold the flat plan.
TEST_F(SchedulerTest, AutoReplicasPlaceEachMeshOnTheWorkersThatHoldItsPlan) {
  ResolvedJob job(HybridSpec(train_, 4, 4, 0), [](const v1::JobSpec& resolved, int n) {
    MemoryPlan p;
    p.backend = "cpu";
    p.world_size = n;
    p.device_bytes = 1000 * int64_t{resolved.sharding().replicas()};
    return absl::StatusOr<MemoryPlan>(p);
  });
  const std::vector<std::string> free = {"a0", "b0", "a1", "b1", "a2", "b2"};
  std::map<std::string, std::string> domains;
  for (const std::string& id : free) domains[id] = id.substr(0, 1);  // hosts "a" and "b"
  std::map<std::string, int64_t> memory = {{"a0", 1000}, {"b0", 1000}, {"a1", 2000},
                                           {"b1", 2000}, {"a2", 2000}, {"b2", 2000}};
  const FitChoice two = ChooseFittingWorkers(job, free, memory, domains);
  EXPECT_EQ(two.world_size, 4);
  EXPECT_EQ(two.replicas, 2);
  EXPECT_EQ(two.workers, (std::vector<std::string>{"a1", "a2", "b1", "b2"}));
  EXPECT_TRUE(two.split_groups.empty());

  // A fourth worker on A, a3: host A holds the flat mesh, and the fewest domains win (R = 1).
  std::vector<std::string> with_a3 = free;
  with_a3.push_back("a3");
  domains["a3"] = "a";
  memory["a3"] = 2000;
  const FitChoice one = ChooseFittingWorkers(job, with_a3, memory, domains);
  EXPECT_EQ(one.replicas, 1);
  EXPECT_EQ(one.workers, (std::vector<std::string>{"a0", "a1", "a2", "a3"}));
  memory.erase("a3");

  for (auto& [id, bytes] : memory) bytes = 1000;
  const FitChoice flat = ChooseFittingWorkers(job, free, memory, domains);
  EXPECT_EQ(flat.world_size, 4);
  EXPECT_EQ(flat.replicas, 1);
  EXPECT_EQ(flat.workers, (std::vector<std::string>{"a0", "b0", "a1", "b1"}));

  for (auto& [id, bytes] : memory) bytes = id == "b2" ? 1000 : 500;
  const FitChoice none = ChooseFittingWorkers(job, free, memory, domains);
  EXPECT_EQ(none.world_size, 0);
  EXPECT_TRUE(none.workers.empty());
  EXPECT_TRUE(absl::StrContains(none.why, "waiting for 4 workers with")) << none.why;
  EXPECT_TRUE(absl::StrContains(none.why, "1 of 6 free workers have it")) << none.why;
}

// A world size that R does not divide is never chosen: 6 free workers, a batch that allows 6,
// R = 4: the job runs on 4. Specs whose range holds no multiple of R are refused naming
// sharding.replicas; a range holding one is accepted.
TEST_F(SchedulerTest, WorldSizesAreMultiplesOfTheReplicas) {
  v1::JobSpec s = HybridSpec(train_, 1, 6, 4);
  s.mutable_training()->set_global_batch(24);  // 6, 4, 3, 2, 1 ranks split it
  EXPECT_EQ(Scheduler::ChooseWorldSize(s, 6), 4);
  EXPECT_EQ(Scheduler::ChooseWorldSize(s, 3), 0);
  EXPECT_EQ(AllowedWorldSizes(s), (std::vector<int>{4}));
  s.mutable_sharding()->set_replicas(2);
  EXPECT_EQ(AllowedWorldSizes(s), (std::vector<int>{6, 4, 2}));
  s.mutable_sharding()->set_replicas(4);
  for (int i = 0; i < 6; ++i) AddWorker();
  auto job = jobs_->Submit("", s);
  ASSERT_TRUE(job.ok()) << job.status();
  const v1::Job end = WaitEnd(job->job_id());
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.world_size(), 4);
  EXPECT_EQ(end.replicas(), 4);

  v1::JobSpec none = HybridSpec(train_, 5, 7, 4);
  auto refused = jobs_->Submit("", none);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "sharding.replicas"))
      << refused.status();
  v1::JobSpec exact = HybridSpec(train_, 6, 6, 4);
  exact.mutable_training()->set_global_batch(24);
  auto refused6 = jobs_->Submit("", exact);
  EXPECT_TRUE(absl::StrContains(refused6.status().message(), "sharding.replicas"))
      << refused6.status();
  auto accepted = jobs_->Submit("", HybridSpec(train_, 3, 5, 2));  // runs at 4
  EXPECT_TRUE(accepted.ok()) << accepted.status();
  if (accepted.ok()) {
    const v1::Job four = WaitEnd(accepted->job_id());
    EXPECT_EQ(four.state(), v1::JOB_STATE_SUCCEEDED) << four.reason();
    EXPECT_EQ(four.world_size(), 4);
  }
}

// The MANIFEST's files of an R = 2 x S = 2 mesh from hand-written CheckpointSaved lists (file
// names carry the file index each rank must write, bytes 1000 + rank): SHARD_GROUP, ranks 0 and 1
// write files 0 and 1 and replica 1 none; WORLD, ranks 0, 1, 2, 3 write files 0, 2, 1, 3, listed
// in index order. A rank that writes a file and reports none, or one that writes none and
// reports one, is refused by name.
std::vector<v1::CheckpointSaved> SavedList(const std::vector<std::string>& files) {
  std::vector<v1::CheckpointSaved> out;
  for (int r = 0; r < static_cast<int>(files.size()); ++r) {
    v1::CheckpointSaved s;
    s.set_rank(r);
    s.set_file(files[r]);
    if (!files[r].empty()) {
      s.set_bytes(1000 + r);
      s.set_crc32(7000 + r);
    }
    out.push_back(s);
  }
  return out;
}

TEST(MeshCheckpointFiles, ListsEachFileOnceInIndexOrderAndRefusesWrongLists) {
  auto name = [](int r) { return absl::StrCat("rank ", r, " (worker w", r, ")"); };
  v1::JobSpec spec;
  spec.mutable_sharding()->set_replicas(2);
  int bad = -2;

  auto group = MeshCheckpointFiles(spec, SavedList({"f0", "f1", "", ""}), name, &bad);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(bad, -1);
  ASSERT_EQ(group->size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ((*group)[i].rank(), i);
    EXPECT_EQ((*group)[i].file(), absl::StrCat("f", i));
    EXPECT_EQ((*group)[i].bytes(), 1000 + i);
    EXPECT_EQ((*group)[i].crc32(), 7000u + i);
  }
  auto missing = MeshCheckpointFiles(spec, SavedList({"f0", "", "", ""}), name, &bad);
  ASSERT_EQ(missing.status().code(), absl::StatusCode::kInternal) << missing.status();
  EXPECT_EQ(missing.status().message(), "rank 1 (worker w1) reported no file but writes file 1 of 2");
  EXPECT_EQ(bad, 1);
  auto extra = MeshCheckpointFiles(spec, SavedList({"f0", "f1", "", "x"}), name, &bad);
  ASSERT_EQ(extra.status().code(), absl::StatusCode::kInternal) << extra.status();
  EXPECT_EQ(extra.status().message(),
            "rank 3 (worker w3) reported file x but writes none (replica 1 under "
            "optimizer_sharding SHARD_GROUP)");
  EXPECT_EQ(bad, 3);

  spec.mutable_sharding()->set_optimizer_sharding(v1::OPTIMIZER_SHARDING_WORLD);
  auto world = MeshCheckpointFiles(spec, SavedList({"f0", "f2", "f1", "f3"}), name, &bad);
  ASSERT_TRUE(world.ok()) << world.status();
  EXPECT_EQ(bad, -1);
  ASSERT_EQ(world->size(), 4u);
  const int writer[4] = {0, 2, 1, 3};  // file index -> rank
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ((*world)[i].rank(), i);
    EXPECT_EQ((*world)[i].file(), absl::StrCat("f", i));
    EXPECT_EQ((*world)[i].bytes(), 1000 + writer[i]);
    EXPECT_EQ((*world)[i].crc32(), 7000u + writer[i]);
  }
  auto world_missing = MeshCheckpointFiles(spec, SavedList({"f0", "f2", "", "f3"}), name, &bad);
  ASSERT_EQ(world_missing.status().code(), absl::StatusCode::kInternal) << world_missing.status();
  EXPECT_EQ(world_missing.status().message(),
            "rank 2 (worker w2) reported no file but writes file 1 of 4");
  EXPECT_EQ(bad, 2);
  // Under WORLD every rank writes one, so an extra file is a rank reporting another's.
  std::vector<v1::CheckpointSaved> swapped = SavedList({"f0", "f2", "f1", "f3"});
  swapped[3].set_rank(1);
  auto world_extra = MeshCheckpointFiles(spec, swapped, name, &bad);
  ASSERT_EQ(world_extra.status().code(), absl::StatusCode::kInternal) << world_extra.status();
  EXPECT_EQ(world_extra.status().message(), "rank 3 (worker w3) reported rank 1");
  EXPECT_EQ(bad, 3);

  // A list whose length the spec's replicas do not divide: no mesh, no rank at fault.
  auto odd = MeshCheckpointFiles(spec, SavedList({"f0", "f1", "f2"}), name, &bad);
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument) << odd.status();
  EXPECT_EQ(bad, -1);
}

// A checkpoint of an R = 2 x S = 2 job is a flat one: SHARD_GROUP: 2 files from replica 0's
// ranks (replica 1 answers with no file); WORLD: 4 files, file s * R + p from the rank of shard s
// of replica p (ranks 0, 2, 1, 3 write files 0, 1, 2, 3; the fakes' files hold 1000 + rank bytes).
TEST_F(SchedulerTest, AMeshsCheckpointListsItsOptimizerShards) {
  AddInterleavedWorkers(4);
  for (bool world : {false, true}) {
    SCOPED_TRACE(world ? "WORLD" : "SHARD_GROUP");
    const std::string ck = dir_.File(world ? "ck-world" : "ck-group");
    v1::JobSpec spec = HybridSpec(train_, 4, 4, 2);
    spec.mutable_sharding()->set_optimizer_sharding(world ? v1::OPTIMIZER_SHARDING_WORLD
                                                          : v1::OPTIMIZER_SHARDING_SHARD_GROUP);
    spec.mutable_checkpoint()->set_dir(ck);
    auto job = jobs_->Submit("", spec);
    ASSERT_TRUE(job.ok()) << job.status();
    const v1::Job end = WaitEnd(job->job_id());
    ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
    auto c = CheckpointStore::Open(ck + "/step-3");
    ASSERT_TRUE(c.ok()) << c.status();
    const std::vector<int64_t> bytes =
        world ? std::vector<int64_t>{1000, 1002, 1001, 1003} : std::vector<int64_t>{1000, 1001};
    EXPECT_EQ(c->manifest.world_size(), static_cast<int>(bytes.size()));
    ASSERT_EQ(c->manifest.files_size(), static_cast<int>(bytes.size()));
    for (int i = 0; i < c->manifest.files_size(); ++i) {
      EXPECT_EQ(c->manifest.files(i).rank(), i);
      EXPECT_EQ(c->manifest.files(i).file(), "rank-" + std::to_string(i) + ".ckpt");
      EXPECT_EQ(c->manifest.files(i).bytes(), bytes[i]) << "file " << i;
    }
    EXPECT_FALSE(std::filesystem::exists(ck + "/step-3/rank-" + std::to_string(bytes.size()) +
                                         ".ckpt"));
  }
}

}  // namespace
}  // namespace fsdp8::coord

namespace fsdp8::coord {
namespace {

// Coordinator restart with re-adoption: a job RUNNING on workers "node-a", "node-b" after 3 steps
// (in the state db) comes back waiting for re-adoption (readopt_window 60 s).
class ReadoptSchedulerTest : public SchedulerTest {
 protected:
  // Submits the job (2 ranks, 8 steps, a checkpoint dir with nothing committed), runs it 3 steps
  // on node-a and node-b in a first JobManager on a state db, then opens the db again as a
  // restarted coordinator does, with re-adoption on, and restarts the scheduler on it.
  // every_steps: checkpoint.every_steps of the spec (0: only the final save).
  std::string RestartWithARunningJob(int every_steps = 0) {
    sched_->Stop();
    JobManagerOptions o;
    o.state_db = dir_.File("state.db");
    std::string id;
    {
      auto first = JobManager::Open(o);
      EXPECT_TRUE(first.ok()) << first.status();
      v1::JobSpec spec = SmallSpec(train_, 2, 8);
      spec.mutable_checkpoint()->set_dir(dir_.File("ck"));
      spec.mutable_checkpoint()->set_every_steps(every_steps);
      auto job = (*first)->Submit("", spec);
      EXPECT_TRUE(job.ok()) << job.status();
      id = job->job_id();
      EXPECT_TRUE((*first)->MarkStarting(id, {"node-a", "node-b"}).ok());
      EXPECT_TRUE((*first)->MarkRunning(id).ok());
      v1::JobEvent ev;
      ev.set_step(3);
      ev.set_loss(2.0);
      ev.set_tokens(900);
      EXPECT_TRUE((*first)->RecordStep(id, ev).ok());
    }
    o.readopt_window = 60s;
    auto jm = JobManager::Open(o);
    EXPECT_TRUE(jm.ok()) << jm.status();
    jobs_ = std::move(*jm);
    StartScheduler(2s, 0ms);
    return id;
  }
  // A worker named `name` holding rank `rank` of the job's `generation` after `steps` steps (the
  // commands it received), with the results (tokens 100 * (rank + 1)) of the steps from 3 on.
  std::shared_ptr<FakeWorker> AddHeld(const std::string& name, const std::string& job, int rank,
                                      int64_t steps, int64_t generation = 1) {
    v1::HeldJob h;
    h.set_job_id(job);
    h.set_generation(generation);
    h.set_rank(rank);
    h.set_world_size(2);
    h.set_replicas(1);
    h.set_steps_completed(steps);
    h.set_steps_received(steps);
    h.set_intact(true);
    for (int64_t k = 3; k < steps; ++k) {
      v1::StepResult* r = h.add_recent_results();
      r->set_job_id(job);
      r->set_step(k);
      r->set_tokens(100 * (rank + 1));
    }
    auto w = std::make_shared<FakeWorker>(workers_.get());
    w->set_held(name, h);
    w->Start();
    fakes_.push_back(w);
    return w;
  }
  std::vector<std::string> Messages(const std::string& id) {
    std::vector<std::string> msgs;
    jobs_->Watch(id, 0, [&](const v1::JobEvent& e) {
      if (!e.message().empty()) msgs.push_back(e.message());
      return true;
    }).IgnoreError();
    return msgs;
  }
};

// Both ranks come back holding generation 1 after 5 steps (2 more than the state db's 3): the job
// is re-adopted (Adopt, no Assignment, no restart), steps on from step 5 and succeeds; its tokens
// count the 2 steps the db lacked from the ranks' reported results.
TEST_F(ReadoptSchedulerTest, IntactRanksAreReadoptedAtTheirStep) {
  const std::string id = RestartWithARunningJob();
  EXPECT_EQ(jobs_->Get(id)->state(), v1::JOB_STATE_RECOVERING);
  auto a = AddHeld("node-a", id, 0, 5);
  // One rank back: the job waits (the window is 60 s).
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(jobs_->Get(id)->state(), v1::JOB_STATE_RECOVERING);
  EXPECT_EQ(a->Count(v1::CoordinatorMessage::kAdopt), 0);
  auto b = AddHeld("node-b", id, 1, 5);
  const v1::Job end = WaitEnd(id);
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.generation(), 1);
  EXPECT_EQ(end.restarts(), 0);
  EXPECT_EQ(end.step(), 8);
  EXPECT_EQ(end.tokens(), 8 * 300);
  for (auto* w : {a.get(), b.get()}) {
    EXPECT_EQ(w->Count(v1::CoordinatorMessage::kAdopt), 1);
    EXPECT_EQ(w->Count(v1::CoordinatorMessage::kAssignment), 0);
    EXPECT_EQ(w->Count(v1::CoordinatorMessage::kAbort), 0);
    std::vector<int64_t> steps;
    for (const auto& m : w->received())
      if (m.has_step()) steps.push_back(m.step().step());
    EXPECT_EQ(steps, (std::vector<int64_t>{5, 6, 7}));
  }
  const std::vector<std::string> msgs = Messages(id);
  auto has = [&](const std::string& text) {
    for (const auto& m : msgs)
      if (m == text) return true;
    return false;
  };
  EXPECT_TRUE(has("re-adopting 2 ranks of generation 1 at step 5 (the state db had step 3; the "
                  "ranks completed 2 more while no coordinator ran)"))
      << absl::StrJoin(msgs, "\n");
  EXPECT_TRUE(has("re-adopted 2 ranks at step 5 (generation 1; no checkpoint read)"))
      << absl::StrJoin(msgs, "\n");
}

// A checkpoint every 5 steps, the ranks held at step 5 (the old coordinator died before step 5's
// save was sent; nothing committed): the re-adopting coordinator takes step 5's save before it
// sends step 5, then the final one; both commit.
TEST_F(ReadoptSchedulerTest, APeriodicSaveDueAtTheAdoptionStepIsTaken) {
  const std::string id = RestartWithARunningJob(/*every_steps=*/5);
  auto a = AddHeld("node-a", id, 0, 5);
  auto b = AddHeld("node-b", id, 1, 5);
  const v1::Job end = WaitEnd(id);
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.restarts(), 0);
  for (auto* w : {a.get(), b.get()}) {
    EXPECT_EQ(SaveSteps(*w), (std::vector<int64_t>{5, 8}));
    const std::vector<v1::CoordinatorMessage> got = w->received();
    for (const auto& m : got) {
      if (m.has_step()) {
        ADD_FAILURE() << "step " << m.step().step() << " was sent before step 5's save";
        break;
      }
      if (m.has_save()) break;
    }
  }
  EXPECT_TRUE(CheckpointStore::Open(dir_.File("ck") + "/step-5").ok());
  EXPECT_TRUE(CheckpointStore::Open(dir_.File("ck") + "/step-8").ok());
}

// Rank 1 did not receive step 4's command, which rank 0 ran (the coordinator died between the two
// sends): re-adopted at step 5, rank 1 is sent step 4 after its Adopt, then both go on from 5.
TEST_F(ReadoptSchedulerTest, ARankThatMissedAStepIsSentItAndTheJobGoesOnFromTheLast) {
  const std::string id = RestartWithARunningJob();
  auto a = AddHeld("node-a", id, 0, 5);
  auto b = AddHeld("node-b", id, 1, 4);
  const v1::Job end = WaitEnd(id);
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.generation(), 1);
  EXPECT_EQ(end.restarts(), 0);
  EXPECT_EQ(end.step(), 8);
  auto steps_of = [](FakeWorker* w) {
    std::vector<int64_t> steps;
    for (const auto& m : w->received())
      if (m.has_step()) steps.push_back(m.step().step());
    return steps;
  };
  EXPECT_EQ(steps_of(a.get()), (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(steps_of(b.get()), (std::vector<int64_t>{4, 5, 6, 7}));
  const std::vector<v1::CoordinatorMessage> got = b->received();
  ASSERT_FALSE(got.empty());
  EXPECT_TRUE(got[0].has_adopt()) << "Adopt comes before the missing step";
  bool readopted = false;
  for (const auto& m : Messages(id))
    readopted |= m == "re-adopted 2 ranks at step 5 (generation 1; no checkpoint read)";
  EXPECT_TRUE(readopted) << absl::StrJoin(Messages(id), "\n");
}

// A rank reports another generation of the job: no re-adoption, at once (not at the window's
// end): the job falls back to the checkpoint path saying why, the held workers are told to drop
// the job, and the job then runs again from step 0 (nothing committed) as generation 2 on the same
// workers.
TEST_F(ReadoptSchedulerTest, AReportOfAnotherGenerationFallsBackToTheCheckpoint) {
  const std::string id = RestartWithARunningJob();
  auto a = AddHeld("node-a", id, 0, 5);
  auto b = AddHeld("node-b", id, 1, 5, /*generation=*/7);
  const v1::Job end = WaitEnd(id);
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.generation(), 2);
  EXPECT_EQ(end.restarts(), 1);
  for (auto* w : {a.get(), b.get()}) {
    EXPECT_EQ(w->Count(v1::CoordinatorMessage::kAdopt), 0);
    bool dropped = false;
    for (const auto& m : w->received())
      dropped |= m.has_abort() && absl::StrContains(m.abort().reason(), "is not re-adopted");
    EXPECT_TRUE(dropped);
    EXPECT_EQ(w->Count(v1::CoordinatorMessage::kAssignment), 1);
  }
  bool fell_back = false;
  for (const auto& m : Messages(id))
    fell_back |= m == "recovering from a coordinator restart (restart 1 of 3): falling back to "
                      "the checkpoint because worker node-b holds generation 7 as rank 1 of 2 (1 "
                      "replicas), not one of the 2 ranks of generation 1 (1 replicas)";
  EXPECT_TRUE(fell_back) << absl::StrJoin(Messages(id), "\n");
}

}  // namespace
}  // namespace fsdp8::coord
