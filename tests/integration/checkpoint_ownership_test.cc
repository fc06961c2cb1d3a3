// Checkpoint directories that change hands, through real processes on loopback (coordinators and
// CPU workers as children, tests/support): a take-over never rewrites or deletes an earlier
// owner's committed files (checked with sha256sum, file by file); a second coordinator on the same
// storage refuses to take over the directory of a job the first one runs (the first one's lease),
// also while the first one is down and after it restarted;
// a coordinator killed in the middle of retention leaves a half-removed step directory that the
// next start removes (and logs).
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_format.h"
#include "common/env_settings.h"
#include "common/fault_injection.h"
#include "common/token_shard.h"
#include "fsdp8/v1/jobs.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/support/cluster.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::LocalCluster;
using testing::ProcessOptions;
using testing::ReadFile;
using testing::TempDir;

// sha256 of one file, by coreutils' sha256sum (independent of the code under test).
std::string Sha256(const fs::path& p) {
  const std::string cmd = "sha256sum -- '" + p.string() + "'";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) return "";
  char buf[128] = {0};
  const size_t n = std::fread(buf, 1, 64, f);
  ::pclose(f);
  return std::string(buf, n);
}

// sha256 of every regular file under root, by path; `skip` names files left out (by file name).
std::map<std::string, std::string> HashTree(const fs::path& root,
                                            const std::vector<std::string>& skip = {}) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    const std::string name = e.path().filename().string();
    if (std::find(skip.begin(), skip.end(), name) != skip.end()) continue;
    out[e.path().string()] = Sha256(e.path());
  }
  return out;
}

// Every file of the committed step directories under root (a valid MANIFEST naming its step).
std::map<std::string, std::string> HashCommitted(const fs::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(root)) {
    if (StepOfDirName(e.path().filename().string()) < 0) continue;
    if (!ReadManifestFile(e.path().string()).ok()) continue;
    for (const auto& [path, hash] : HashTree(e.path())) out[path] = hash;
  }
  return out;
}

// step -> job id of every committed checkpoint under root, read from the MANIFESTs.
std::map<int64_t, std::string> CommittedJobs(const fs::path& root) {
  std::map<int64_t, std::string> out;
  for (const auto& e : fs::directory_iterator(root)) {
    const int64_t k = StepOfDirName(e.path().filename().string());
    if (k < 0) continue;
    auto m = ReadManifestFile(e.path().string());
    if (m.ok()) out[k] = m->job_id();
  }
  return out;
}

// Names of step-<k> directories under root that are not committed.
std::vector<std::string> PartialSteps(const fs::path& root) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (StepOfDirName(name) >= 0 && !ReadManifestFile(e.path().string()).ok())
      out.push_back(name);
  }
  return out;
}

class CheckpointOwnershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    std::vector<uint16_t> tokens(20000);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i * 131) % 251);
    ASSERT_TRUE(WriteTokenShard((root() / "train.bin").string(), tokens).ok());
  }

  fs::path root() const { return dir_.path(); }
  fs::path ck() const { return root() / "ck"; }

  v1::JobSpec Spec(int64_t steps, int every, int keep_last, int workers = 1) const {
    v1::JobSpec s;
    s.set_name("own");
    s.mutable_model()->set_d_model(32);
    s.mutable_model()->set_n_layers(1);
    s.mutable_model()->set_n_heads(2);
    s.mutable_model()->set_ffn_dim(64);
    s.mutable_model()->set_seq_len(16);
    s.mutable_data()->set_train_path((root() / "train.bin").string());
    s.mutable_training()->set_steps(steps);
    s.mutable_training()->set_global_batch(4);
    s.mutable_training()->set_eval_every(0);
    s.mutable_sharding()->set_min_workers(workers);
    s.mutable_checkpoint()->set_dir(ck().string());
    s.mutable_checkpoint()->set_every_steps(every);
    s.mutable_checkpoint()->set_keep_last(keep_last);
    return s;
  }

  // A coordinator on state db `db` with `workers` CPU workers; its stub in stubs_[name].
  // `flags`: more coordinator flags.
  std::unique_ptr<LocalCluster> Start(const std::string& name, const std::string& db, int workers,
                                      std::vector<std::string> env = {},
                                      const std::vector<std::string>& flags = {}) {
    auto c = std::make_unique<LocalCluster>(
        LocalCluster::Binaries{FSDP8_COORDINATOR_BIN, FSDP8_WORKER_BIN}, root(),
        ProcessOptions{std::move(env)});
    std::vector<std::string> all = {"--listen=127.0.0.1:0", "--state_db=" + (root() / db).string(),
                                    "--data_roots=" + root().string(),
                                    "--heartbeat_interval_ms=200", "--heartbeat_timeout_s=10",
                                    "--abort_grace_s=0"};
    all.insert(all.end(), flags.begin(), flags.end());
    const std::string addr = c->StartCoordinator(all, name + "-coordinator.log");
    EXPECT_FALSE(addr.empty()) << ReadFile(c->LogPath(name + "-coordinator.log"));
    for (int i = 0; i < workers; ++i)
      c->AddWorker({"--coordinator=" + addr, "--threads=1"}, absl::StrCat(name, "-worker-", i, ".log"));
    stubs_[name] =
        v1::JobService::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
    return c;
  }

  grpc::Status Submit(const std::string& on, const v1::JobSpec& spec, v1::Job* job) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 20s);
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    return stubs_.at(on)->SubmitJob(&ctx, req, job);
  }

  v1::Job Get(const std::string& on, const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 5s);
    v1::GetJobRequest req;
    req.set_job_id(id);
    req.set_events(1000);
    v1::Job job;
    grpc::Status s = stubs_.at(on)->GetJob(&ctx, req, &job);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return job;
  }

  static bool Ended(const v1::Job& j) {
    return j.state() == v1::JOB_STATE_SUCCEEDED || j.state() == v1::JOB_STATE_FAILED ||
           j.state() == v1::JOB_STATE_CANCELLED;
  }

  v1::Job WaitEnd(const std::string& on, const std::string& id) {
    v1::Job j;
    const auto until = std::chrono::steady_clock::now() + 120s;
    do {
      std::this_thread::sleep_for(50ms);
      j = Get(on, id);
    } while (!Ended(j) && std::chrono::steady_clock::now() < until);
    return j;
  }

  TempDir dir_{"fsdp8-ckpt-owner", TempDir::Cleanup::kUnlessFailed};
  std::map<std::string, std::unique_ptr<v1::JobService::Stub>> stubs_;
};

// Job A ends with committed step-4, step-6, step-8. Job B takes the directory over and starts
// afresh (saves every 2 steps up to 14, keep_last 2): its submission names the steps it will
// skip, its saves of steps 4, 6 and 8 are skipped (events), the others are written, and its
// retention deletes its own step-2 and step-10 only. Every file of A's committed checkpoints has
// the same sha256 afterwards, and the MANIFESTs of 4, 6 and 8 still name A.
TEST_F(CheckpointOwnershipTest, TakeOverWithCollidingStepsKeepsEveryEarlierFile) {
  auto cluster = Start("one", "jobs.db", 1);
  v1::Job a;
  ASSERT_TRUE(Submit("one", Spec(8, 2, 3), &a).ok());
  ASSERT_EQ(WaitEnd("one", a.job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  const std::map<int64_t, std::string> of_a = CommittedJobs(ck());
  ASSERT_EQ(of_a, (std::map<int64_t, std::string>{
                      {4, a.job_id()}, {6, a.job_id()}, {8, a.job_id()}}));
  const auto before = HashCommitted(ck());
  ASSERT_EQ(before.size(), 9u);  // 3 x (rank file, MANIFEST, JOB)
  for (const auto& [path, hash] : before) ASSERT_EQ(hash.size(), 64u) << path;

  v1::JobSpec spec = Spec(14, 2, 2);
  spec.mutable_checkpoint()->set_take_over(true);
  v1::Job b;
  const grpc::Status st = Submit("one", spec, &b);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const v1::Job end = WaitEnd("one", b.job_id());
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.step(), 14);
  std::vector<std::string> messages;
  for (const auto& e : end.events())
    if (!e.message().empty()) messages.push_back(e.message());
  ASSERT_FALSE(messages.empty());
  EXPECT_TRUE(absl::StrContains(messages[0], absl::StrCat("step-4 (job ", a.job_id(), "), step-6 (job ",
                                                          a.job_id(), "), step-8 (job ", a.job_id(),
                                                          ")")))
      << messages[0];
  for (int k : {4, 6, 8}) {
    const std::string skipped = absl::StrCat("checkpoint step-", k, " skipped: ",
                                             (ck() / absl::StrCat("step-", k)).string(),
                                             " holds the committed checkpoint of job ", a.job_id());
    bool seen = false;
    for (const auto& m : messages) seen |= absl::StartsWith(m, skipped);
    EXPECT_TRUE(seen) << "no event \"" << skipped << "\"";
  }
  EXPECT_EQ(CommittedJobs(ck()), (std::map<int64_t, std::string>{{4, a.job_id()},
                                                                 {6, a.job_id()},
                                                                 {8, a.job_id()},
                                                                 {12, b.job_id()},
                                                                 {14, b.job_id()}}));
  EXPECT_FALSE(fs::exists(ck() / "step-2"));
  EXPECT_FALSE(fs::exists(ck() / "step-10"));
  const auto after = HashTree(ck());
  for (const auto& [path, hash] : before) {
    ASSERT_TRUE(after.count(path)) << path << " was deleted";
    EXPECT_EQ(after.at(path), hash) << path << " changed";
  }
  EXPECT_TRUE(PartialSteps(ck()).empty());
}

// Two coordinators (their own state dbs) on one directory tree: job A runs under the first; the
// second refuses a take-over of A's directory with FAILED_PRECONDITION naming the directory and A
// (the first one's lease; the second has never heard of A). While A's worker is stopped, the
// refused submission changes no file; A then finishes SUCCEEDED with its own checkpoints, and
// its lease is released, after which the second coordinator accepts the take-over.
TEST_F(CheckpointOwnershipTest, SecondCoordinatorRefusesTakeOverOfARunningJob) {
  auto first = Start("first", "first.db", 1);
  auto second = Start("second", "second.db", 0);
  v1::Job a;
  ASSERT_TRUE(Submit("first", Spec(60, 5, 2), &a).ok());
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (!fs::exists(ck() / "step-5" / kManifestFileName) &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(5ms);
  first->worker(0)->Signal(SIGSTOP);  // A stays RUNNING and writes nothing meanwhile
  const v1::Job running = Get("first", a.job_id());
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING) << "A ended before the take-over was tried";
  std::this_thread::sleep_for(300ms);  // a save already under way settles
  const auto before = HashTree(ck(), {"OWNER", "OWNER.lock"});

  v1::JobSpec take = Spec(80, 5, 2);
  take.mutable_checkpoint()->set_take_over(true);
  take.mutable_checkpoint()->set_resume_from("latest");
  v1::Job b;
  grpc::Status st = Submit("second", take, &b);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), ck().string())) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "belongs to job " + a.job_id()))
      << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "another coordinator")) << st.error_message();
  EXPECT_EQ(HashTree(ck(), {"OWNER", "OWNER.lock"}), before);
  auto owner = ReadOwnerFile(ck().string());
  ASSERT_TRUE(owner.ok() && owner->has_value()) << owner.status();
  EXPECT_EQ((*owner)->owner().job_id(), a.job_id());
  first->worker(0)->Signal(SIGCONT);

  const v1::Job end = WaitEnd("first", a.job_id());
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.step(), 60);
  EXPECT_EQ(CommittedJobs(ck()),
            (std::map<int64_t, std::string>{{55, a.job_id()}, {60, a.job_id()}}));
  EXPECT_TRUE(PartialSteps(ck()).empty());
  owner = ReadOwnerFile(ck().string());
  ASSERT_TRUE(owner.ok() && owner->has_value()) << owner.status();
  EXPECT_EQ((*owner)->owner().job_id(), a.job_id());
  EXPECT_EQ((*owner)->lease().expires(), 0) << "the lease is released when the job ends";

  // Ended: now the second coordinator lets the take-over through (it continues after step-60).
  st = Submit("second", take, &b);
  ASSERT_TRUE(st.ok()) << st.error_message();
  owner = ReadOwnerFile(ck().string());
  ASSERT_TRUE(owner.ok() && owner->has_value());
  EXPECT_EQ((*owner)->owner().job_id(), b.job_id());
}

double WallNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The owner's coordinator (a 10 s lease, the shortest allowed) is SIGKILLed while its job runs:
// its lease outlives it, so a second coordinator refuses the take-over while it is down; started
// again on its state db a few seconds later, it renews the lease (same identity, renewed after
// the kill) and keeps renewing it: more than a lease length later, while the job still waits for
// a worker, the take-over is still refused. With a worker it resumes the job from its checkpoint
// and finishes it; the directory stays the job's throughout.
TEST_F(CheckpointOwnershipTest, LeaseOutlivesARestartOfTheOwningCoordinator) {
  const std::vector<std::string> lease = {"--checkpoint_lease_s=10"};
  auto second = Start("second", "second.db", 0);
  std::string id, holder;
  double killed = 0;
  {
    auto first = Start("first", "first.db", 1, {}, lease);
    v1::Job a;
    ASSERT_TRUE(Submit("first", Spec(40, 5, 2), &a).ok());
    id = a.job_id();
    const auto until = std::chrono::steady_clock::now() + 60s;
    while (!fs::exists(ck() / "step-5" / kManifestFileName) &&
           std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(5ms);
    ASSERT_TRUE(first->coordinator()->Kill());
    killed = WallNow();
    auto owner = ReadOwnerFile(ck().string());
    ASSERT_TRUE(owner.ok() && owner->has_value()) << owner.status();
    holder = (*owner)->lease().coordinator();
    EXPECT_FALSE(holder.empty());
  }  // its worker stopped too

  v1::JobSpec take = Spec(60, 5, 2);
  take.mutable_checkpoint()->set_take_over(true);
  take.mutable_checkpoint()->set_resume_from("latest");
  v1::Job b;
  grpc::Status st = Submit("second", take, &b);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "belongs to job " + id)) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "another coordinator")) << st.error_message();

  std::this_thread::sleep_for(3s);  // a restart that takes a few seconds
  // No worker yet: the job waits RECOVERING, with its lease renewed by the restarted coordinator.
  auto again = Start("first-again", "first.db", 0, {}, lease);
  const double restarted = WallNow();
  auto owner = ReadOwnerFile(ck().string());
  ASSERT_TRUE(owner.ok() && owner->has_value()) << owner.status();
  EXPECT_EQ((*owner)->owner().job_id(), id);
  EXPECT_EQ((*owner)->lease().coordinator(), holder) << "the restarted coordinator re-claims";
  EXPECT_GT((*owner)->lease().renewed(), killed + 2) << "not renewed by the restart";
  st = Submit("second", take, &b);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  // Past one lease length after the restart's renewal: still refused (renewed meanwhile).
  std::this_thread::sleep_for(std::chrono::duration<double>(restarted + 11.5 - WallNow()));
  owner = ReadOwnerFile(ck().string());
  ASSERT_TRUE(owner.ok() && owner->has_value()) << owner.status();
  EXPECT_GT((*owner)->lease().renewed(), restarted + 5) << "not renewed after the restart";
  st = Submit("second", take, &b);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "another coordinator")) << st.error_message();
  again->AddWorker({"--coordinator=" + again->address(), "--threads=1"},
                   "first-again-worker-0.log");
  const v1::Job end = WaitEnd("first-again", id);
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.step(), 40);
  EXPECT_EQ(end.restarts(), 1);
  EXPECT_EQ(CommittedJobs(ck()), (std::map<int64_t, std::string>{{35, id}, {40, id}}));
}

// A coordinator SIGKILLed while retention removes step-2 (keep_last 1, after step-4's commit)
// leaves step-2 half-removed (no MANIFEST; at retain.mid_remove one file fewer). The next start
// removes it before it listens, logs checkpoint_leftover_removed naming it, and the job resumes
// and finishes with only whole checkpoints on disk.
class RetentionCrashTest : public CheckpointOwnershipTest,
                           public ::testing::WithParamInterface<const char*> {};

TEST_P(RetentionCrashTest, RestartLeavesNoPartialStepDirectory) {
  const std::string point = GetParam();
  std::string id;
  {
    auto cluster = Start("crash", "jobs.db", 2,
                         {std::string(env::kFaultCrashAt) + "=" + point + "@/ck/step-2"});
    v1::Job job;
    ASSERT_TRUE(Submit("crash", Spec(6, 2, 1, 2), &job).ok());
    id = job.job_id();
    const int rc = cluster->coordinator()->Wait(120s);
    ASSERT_EQ(rc, 128 + 9) << "the coordinator did not die at " << point;
  }
  ASSERT_TRUE(fs::exists(ck() / "step-2"));
  EXPECT_FALSE(fs::exists(ck() / "step-2" / kManifestFileName));
  ASSERT_EQ(PartialSteps(ck()), std::vector<std::string>{"step-2"});
  const bool mid = point == std::string("retain.mid_remove");
  // Two rank files and JOB before; at mid_remove rank-0.ckpt is gone (JOB goes last).
  EXPECT_TRUE(fs::exists(ck() / "step-2" / kStepJobFileName));
  EXPECT_EQ(fs::exists(ck() / "step-2" / "rank-0.ckpt"), !mid);
  EXPECT_TRUE(fs::exists(ck() / "step-2" / "rank-1.ckpt"));
  const auto committed = HashCommitted(ck());
  ASSERT_FALSE(committed.empty());

  auto cluster = Start("restart", "jobs.db", 0);  // listening: its start is done
  EXPECT_TRUE(PartialSteps(ck()).empty());
  EXPECT_FALSE(fs::exists(ck() / "step-2"));
  const std::string log = ReadFile(cluster->LogPath("restart-coordinator.log"));
  EXPECT_TRUE(absl::StrContains(log, "checkpoint_leftover_removed")) << log;
  EXPECT_TRUE(absl::StrContains(log, (ck() / "step-2").string())) << log;
  // The committed checkpoints are untouched by the clean-up.
  const auto now = HashTree(ck());
  for (const auto& [path, hash] : committed) EXPECT_EQ(now.count(path) ? now.at(path) : "", hash) << path;

  for (int i = 0; i < 2; ++i)
    cluster->AddWorker({"--coordinator=" + cluster->address(), "--threads=1"},
                       absl::StrCat("restart-worker-", i, ".log"));
  const v1::Job end = WaitEnd("restart", id);
  ASSERT_EQ(end.state(), v1::JOB_STATE_SUCCEEDED) << end.reason();
  EXPECT_EQ(end.step(), 6);
  EXPECT_TRUE(PartialSteps(ck()).empty());
  EXPECT_EQ(CommittedJobs(ck()), (std::map<int64_t, std::string>{{6, id}}));
}

INSTANTIATE_TEST_SUITE_P(EveryPoint, RetentionCrashTest, ::testing::ValuesIn(kRetentionCrashPoints),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           std::string n = i.param;
                           for (char& c : n)
                             if (c == '.') c = '_';
                           return n;
                         });

}  // namespace
}  // namespace fsdp8
