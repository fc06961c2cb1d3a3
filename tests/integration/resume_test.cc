// Resume as a verb and the local mode, through real processes: a coordinator and CPU workers as
// children (tests/support), and the `fsdp8` CLI itself (cancel, resume, run).
//
// - `fsdp8 cancel JOB` saves a checkpoint after the step in progress, then cancels; `fsdp8 resume
//   JOB` continues the same job from that checkpoint: the first step trained after the resume is
//   the checkpoint's step + 1, and the job's events (what `fsdp8 resume --json` prints: the whole
//   history) hold every step 1..steps once, in order. The coordinator is restarted between the
//   cancel and the resume (same state db): the job still resumes under its own lease, and the
//   status page's chart (/api/status) holds every step, those before the restart included.
// - ResumeJob refuses a running job, a job that SUCCEEDED, one with no committed checkpoint of
//   its own (cancelled before any), one without checkpoint.dir (FAILED_PRECONDITION naming the
//   rule), and another user's job (PERMISSION_DENIED).
// - `fsdp8 run job.yaml` interrupted by SIGINT exits 130 after a checkpoint; run again, it resumes
//   the same job from that checkpoint, and its events are continuous as above.
// - `fsdp8 run` warns of a field in its old place, and refuses a spec that breaks a rule before
//   it starts a daemon.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/coordinator/test_util.h"
#include "tests/support/cluster.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::LocalCluster;
using testing::ReadFile;
using testing::TempDir;

// A port that was free a moment ago on 127.0.0.1 (the kernel's pick).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// The body of an HTTP/1.0 GET of 127.0.0.1:port/path ("" on any failure or a status other than 200).
std::string HttpGetBody(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  std::string raw;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (send(fd, req.data(), req.size(), 0) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) raw.append(buf, n);
    }
  }
  close(fd);
  const size_t end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.", 0) != 0 || raw.find(" 200 ") != 8 || end == std::string::npos) return "";
  return raw.substr(end + 4);
}

// The JobEvent lines (proto3 JSON, one per line: `watch --json`) of a CLI's output; other lines
// (notices on stderr share the log) are skipped.
std::vector<v1::JobEvent> JsonEvents(const std::string& output) {
  std::vector<v1::JobEvent> out;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] != '{') continue;
    v1::JobEvent ev;
    if (google::protobuf::util::JsonStringToMessage(line, &ev).ok()) out.push_back(ev);
  }
  return out;
}

bool IsStep(const v1::JobEvent& ev) { return ev.message().empty() && ev.step() > 0; }

// The steps of the step events, in event order.
std::vector<int64_t> Steps(const std::vector<v1::JobEvent>& events) {
  std::vector<int64_t> steps;
  for (const auto& ev : events)
    if (IsStep(ev)) steps.push_back(ev.step());
  return steps;
}

// The committed checkpoints (step-<k> directories with a MANIFEST) under dir, by step.
std::set<int64_t> CommittedSteps(const fs::path& dir) {
  std::set<int64_t> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0 || !fs::exists(e.path() / "MANIFEST")) continue;
    steps.insert(std::stoll(name.substr(5)));
  }
  return steps;
}

// Checks that `events` (a job's whole history, oldest first) hold every step 1..total exactly once
// and in order, and that the first step after the "resumed" event is resumed_at + 1.
void ExpectContinuousAcrossResume(const std::vector<v1::JobEvent>& events, int64_t total,
                                  int64_t resumed_at) {
  std::vector<int64_t> want;
  for (int64_t k = 1; k <= total; ++k) want.push_back(k);
  EXPECT_EQ(Steps(events), want) << "step events are not 1.." << total << " once each";
  for (size_t i = 1; i < events.size(); ++i)
    EXPECT_GT(events[i].seq(), events[i - 1].seq()) << "event seq not increasing at " << i;
  size_t resumed = events.size();
  for (size_t i = 0; i < events.size(); ++i)
    if (events[i].message().rfind("resumed (resume 1) from ", 0) == 0) resumed = i;
  ASSERT_LT(resumed, events.size()) << "no \"resumed\" event";
  EXPECT_EQ(events[resumed].step(), resumed_at);
  int64_t first_after = -1;
  for (size_t i = resumed + 1; i < events.size() && first_after < 0; ++i)
    if (IsStep(events[i])) first_after = events[i].step();
  EXPECT_EQ(first_after, resumed_at + 1);
  int64_t last_before = -1;
  for (size_t i = 0; i < resumed; ++i)
    if (IsStep(events[i])) last_before = events[i].step();
  EXPECT_EQ(last_before, resumed_at) << "steps before the resume end elsewhere than its checkpoint";
}

// A coordinator and 2 CPU workers on loopback, the CLI pointed at it, a corpus in the temp dir.
class ResumeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(tmp_.path().empty());
    dir_ = tmp_.path();
    train_ = testing::WriteTokens(tmp_, "train.bin", 200000);
  }

  void StartCluster(const std::vector<std::string>& extra = {}, int workers = 2) {
    cluster_ = std::make_unique<LocalCluster>(
        LocalCluster::Binaries{FSDP8_COORDINATOR_BIN, FSDP8_WORKER_BIN}, dir_);
    coordinator_flags_ = {"--listen=127.0.0.1:" + std::to_string(FreePort()),
                          "--state_db=" + (dir_ / "jobs.db").string(),
                          "--data_roots=" + dir_.string(), "--metrics_host=127.0.0.1",
                          "--metrics_port=" + std::to_string(metrics_port_)};
    coordinator_flags_.insert(coordinator_flags_.end(), extra.begin(), extra.end());
    address_ = cluster_->StartCoordinator(coordinator_flags_, "coordinator.log");
    ASSERT_FALSE(address_.empty()) << ReadFile(dir_ / "coordinator.log");
    for (int i = 0; i < workers; ++i)
      cluster_->AddWorker({"--coordinator=" + address_, "--threads=1", "--name=node-" + std::to_string(i)},
                          "worker-" + std::to_string(i) + ".log");
  }

  std::unique_ptr<Client> Connect(const std::string& token = "") {
    ChannelSecurity sec;
    sec.token = token;
    auto c = Client::Connect(address_, sec);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // 2 ranks, `steps` steps, checkpoints only on demand (and after the last step) under dir_/ck.
  v1::JobSpec Spec(int64_t steps, int min_workers = 2) const {
    v1::JobSpec s = testing::SmallSpec(train_, min_workers, steps);
    s.mutable_training()->set_eval_every(0);
    s.mutable_sharding()->set_max_workers(min_workers);
    s.mutable_checkpoint()->set_dir((dir_ / "ck").string());
    return s;
  }

  // Runs the CLI against the cluster; returns its exit code (its output in *output).
  int Cli(const std::vector<std::string>& args, std::string* output, const std::string& name,
          std::chrono::seconds timeout = 120s) {
    std::vector<std::string> argv{FSDP8_CLI_BIN, "--coordinator", address_};
    argv.insert(argv.end(), args.begin(), args.end());
    const fs::path log = dir_ / (name + ".log");
    ChildProcess p(argv, log.string());
    const int rc = p.Wait(timeout);
    *output = ReadFile(log);
    return rc;
  }

  bool WaitForStep(Client& c, const std::string& id, int64_t step) {
    return testing::WaitFor(
        [&] {
          auto j = c.GetJob(id);
          return j.ok() && j->state() == v1::JOB_STATE_RUNNING && j->step() >= step;
        },
        120);
  }

  // Stops the coordinator and starts it again with the same flags (address, state db); the
  // workers re-register on their own.
  void RestartCoordinator() {
    address_ = cluster_->StartCoordinator(coordinator_flags_, "coordinator-2.log");
    ASSERT_FALSE(address_.empty()) << ReadFile(dir_ / "coordinator-2.log");
  }

  TempDir tmp_{"resume-test"};
  const int metrics_port_ = FreePort();
  std::vector<std::string> coordinator_flags_;
  fs::path dir_;
  std::string train_;
  std::unique_ptr<LocalCluster> cluster_;
  std::string address_;
};

TEST_F(ResumeTest, CancelSavesAndResumeContinuesFromThatCheckpoint) {
  StartCluster();
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const int64_t kSteps = 300;
  auto job = c->Submit(Spec(kSteps));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(WaitForStep(*c, job->job_id(), 3)) << ReadFile(dir_ / "coordinator.log");

  std::string out;
  ASSERT_EQ(Cli({"cancel", job->job_id()}, &out, "cancel"), 0) << out;
  auto cancelled = c->GetJob(job->job_id());
  ASSERT_TRUE(cancelled.ok());
  ASSERT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED) << cancelled->reason();
  const int64_t k = cancelled->step();
  ASSERT_GE(k, 3);
  ASSERT_LT(k, kSteps) << "the job ended before the cancel";
  // The save is the cancel's (checkpoints are only on demand here): exactly step-k, committed.
  EXPECT_EQ(CommittedSteps(dir_ / "ck"), std::set<int64_t>{k});
  const std::string committed = "checkpoint step-" + std::to_string(k) + " committed";
  EXPECT_NE(cancelled->reason().find(committed), std::string::npos) << cancelled->reason();
  EXPECT_NE(out.find("CANCELLED"), std::string::npos) << out;
  EXPECT_NE(out.find(committed), std::string::npos) << out;

  // A coordinator restart in between: the job is kept, ended, in the state db.
  c.reset();
  RestartCoordinator();
  c = Connect();
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(c->GetJob(job->job_id())->state(), v1::JOB_STATE_CANCELLED);

  // Resume as the same job and follow it to the end; --json prints the whole history.
  ASSERT_EQ(Cli({"resume", job->job_id(), "--json"}, &out, "resume", 300s), 0) << out;
  auto done = c->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
  EXPECT_EQ(done->step(), kSteps);
  EXPECT_EQ(done->resumes(), 1);
  EXPECT_EQ(done->owner(), job->owner());
  const std::vector<v1::JobEvent> events = JsonEvents(out);
  ASSERT_FALSE(events.empty()) << out;
  for (const auto& ev : events) EXPECT_EQ(ev.job_id(), job->job_id());
  EXPECT_EQ(events.front().seq(), 1) << "the history starts at the submission";
  ExpectContinuousAcrossResume(events, kSteps, k);
  // The new generation loaded step-k: the coordinator announced it.
  bool resumed_from_k = false;
  for (const auto& ev : events)
    resumed_from_k |= ev.message().rfind("resuming from " + (dir_ / "ck").string() + "/step-" +
                                         std::to_string(k), 0) == 0;
  EXPECT_TRUE(resumed_from_k) << out;
  // Retention is the job's own as before: keep_last 3 of its steps, the final one among them.
  EXPECT_EQ(CommittedSteps(dir_ / "ck"), (std::set<int64_t>{k, kSteps}));

  // The status page's chart: every step once, those of the coordinator before the restart too.
  const std::string page = HttpGetBody(metrics_port_, "/api/status?job=" + job->job_id());
  google::protobuf::Struct doc;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(page, &doc).ok()) << page;
  std::vector<int64_t> charted;
  for (const auto& p : doc.fields().at("points").list_value().values())
    charted.push_back(static_cast<int64_t>(p.struct_value().fields().at("step").number_value()));
  std::vector<int64_t> all;
  for (int64_t s = 1; s <= kSteps; ++s) all.push_back(s);
  EXPECT_EQ(charted, all);
}

TEST_F(ResumeTest, RefusesRunningSucceededUncheckpointedAndUnsavedJobs) {
  StartCluster();
  auto c = Connect();
  ASSERT_NE(c, nullptr);

  // Running: FAILED_PRECONDITION naming the rule; the CLI exits 1 saying so.
  auto running = c->Submit(Spec(100000));
  ASSERT_TRUE(running.ok()) << running.status();
  ASSERT_TRUE(WaitForStep(*c, running->job_id(), 1));
  auto r = c->Resume(running->job_id());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("only an ended job (CANCELLED or FAILED)"), std::string::npos)
      << r.status();
  std::string out;
  EXPECT_EQ(Cli({"resume", running->job_id()}, &out, "resume-running"), 1) << out;
  EXPECT_NE(out.find("FAILED_PRECONDITION"), std::string::npos) << out;
  // Cancelled without a save: no checkpoint of its own, so nothing to resume from.
  auto stopped = c->Cancel(running->job_id(), /*save=*/false);
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_EQ(stopped->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_TRUE(CommittedSteps(dir_ / "ck").empty());
  r = c->Resume(running->job_id());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("holds no committed checkpoint of job " + running->job_id()),
            std::string::npos)
      << r.status();

  // A job cancelled while it waits for workers saves nothing, and says why.
  v1::JobSpec waiting = Spec(10, 4);  // 4 ranks, 2 workers: it stays PENDING
  waiting.mutable_checkpoint()->set_dir((dir_ / "ck-waiting").string());
  auto pending = c->Submit(waiting);
  ASSERT_TRUE(pending.ok()) << pending.status();
  auto cancelled = c->Cancel(pending->job_id());
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_NE(cancelled->reason().find("no checkpoint saved: the job was PENDING"), std::string::npos)
      << cancelled->reason();

  // SUCCEEDED: refused, naming the rule.
  v1::JobSpec short_spec = Spec(4);
  short_spec.mutable_checkpoint()->set_dir((dir_ / "ck-short").string());
  auto finished = c->Submit(short_spec);
  ASSERT_TRUE(finished.ok()) << finished.status();
  auto f = c->Watch(finished->job_id(), 0, [](const v1::JobEvent&) { return true; });
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->state(), v1::JOB_STATE_SUCCEEDED) << f->reason();
  r = c->Resume(finished->job_id());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("SUCCEEDED"), std::string::npos) << r.status();

  // No checkpoint.dir at all.
  v1::JobSpec bare = Spec(10, 4);
  bare.clear_checkpoint();
  auto nodir = c->Submit(bare);
  ASSERT_TRUE(nodir.ok()) << nodir.status();
  ASSERT_TRUE(c->Cancel(nodir->job_id()).ok());
  r = c->Resume(nodir->job_id());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("has no checkpoint.dir"), std::string::npos) << r.status();

  // Unknown id.
  EXPECT_EQ(c->Resume("job-nosuchjob").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ResumeTest, AnotherUsersJobIsRefused) {
  const std::string alice = "alice-submitter-token-0001", bob = "bob-submitter-token-00002";
  std::ofstream(dir_ / "tokens") << alice << " submitter alice\n" << bob << " submitter bob\n";
  StartCluster({"--tokens=" + (dir_ / "tokens").string()}, /*workers=*/0);
  auto as_alice = Connect(alice);
  auto as_bob = Connect(bob);
  ASSERT_NE(as_alice, nullptr);
  ASSERT_NE(as_bob, nullptr);
  auto job = as_alice->Submit(Spec(10));  // no workers: PENDING
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(as_alice->Cancel(job->job_id()).ok());
  auto r = as_bob->Resume(job->job_id());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  EXPECT_NE(r.status().message().find("belongs to another user"), std::string::npos) << r.status();
  // Alice's own refusal is about the checkpoint, not the owner.
  EXPECT_EQ(as_alice->Resume(job->job_id()).status().code(), absl::StatusCode::kFailedPrecondition);
  auto j = as_alice->GetJob(job->job_id());
  ASSERT_TRUE(j.ok());
  EXPECT_EQ(j->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(j->resumes(), 0);
}

// Pids other than `except` that hold `path` open (their /proc/<pid>/fd links).
std::set<pid_t> HoldersOf(const fs::path& path, pid_t except) {
  std::set<pid_t> out;
  std::error_code ec;
  const fs::path target = fs::canonical(path, ec);
  for (const auto& proc : fs::directory_iterator("/proc", ec)) {
    const std::string name = proc.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    if (pid == except) continue;
    std::error_code fd_ec;
    for (const auto& fd : fs::directory_iterator(proc.path() / "fd", fd_ec)) {
      std::error_code link_ec;
      if (fs::read_symlink(fd.path(), link_ec) == target) out.insert(pid);
    }
  }
  return out;
}

// `fsdp8 run`: SIGINT saves and stops; the rerun resumes the same job from that checkpoint.
TEST(LocalRunTest, SigintSavesAndRunAgainResumes) {
  TempDir tmp("local-run-test");
  ASSERT_FALSE(tmp.path().empty());
  const fs::path dir = tmp.path();
  const std::string train = testing::WriteTokens(tmp, "train.bin", 200000);
  const int64_t kSteps = 300;
  std::ofstream(dir / "job.yaml") << "name: local-run\n"
                                  << "model: {d_model: 32, n_layers: 1, n_heads: 2, ffn_dim: 64, "
                                     "vocab_size: 256, seq_len: 16}\n"
                                  << "data: {train_path: " << train << "}\n"
                                  << "training: {steps: " << kSteps
                                  << ", global_batch: 4, eval_every: 0}\n"
                                  << "sharding: {min_workers: 2, max_workers: 2}\n";
  const std::vector<std::string> argv{FSDP8_CLI_BIN, "run", (dir / "job.yaml").string(), "--json"};
  const fs::path state = dir / "job.fsdp8";  // the documented state directory of job.yaml

  ChildProcess first(argv, (dir / "run-1.log").string());
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        const auto steps = Steps(JsonEvents(ReadFile(dir / "run-1.log")));
        return !steps.empty() && steps.back() >= 3;
      },
      120))
      << ReadFile(dir / "run-1.log");
  // The daemons hold the state directory's run.lock too (inherited), so a rerun is refused until
  // the last of them has exited, even when `fsdp8 run` itself is killed.
  EXPECT_GE(HoldersOf(state / "run.lock", first.pid()).size(), 3u) << "coordinator + 2 workers";
  first.Signal(SIGINT);
  ASSERT_EQ(first.Wait(120s), 130) << ReadFile(dir / "run-1.log");
  EXPECT_TRUE(HoldersOf(state / "run.lock", -1).empty()) << "a daemon outlived fsdp8 run";
  const std::vector<v1::JobEvent> before = JsonEvents(ReadFile(dir / "run-1.log"));
  ASSERT_FALSE(before.empty());
  EXPECT_EQ(before.back().state(), v1::JOB_STATE_CANCELLED) << before.back().message();
  const std::vector<int64_t> steps_before = Steps(before);
  ASSERT_FALSE(steps_before.empty());
  const int64_t k = steps_before.back();
  ASSERT_LT(k, kSteps) << "the job ended before the interrupt";
  EXPECT_NE(before.back().message().find("checkpoint step-" + std::to_string(k) + " committed"),
            std::string::npos)
      << before.back().message();
  // The spec has no checkpoint.dir: checkpoints go under the state directory; only the
  // interrupt's save is there.
  EXPECT_TRUE(fs::exists(state / "jobs.db"));
  EXPECT_EQ(CommittedSteps(state / "checkpoints"), std::set<int64_t>{k});

  ChildProcess second(argv, (dir / "run-2.log").string());
  ASSERT_EQ(second.Wait(300s), 0) << ReadFile(dir / "run-2.log");
  const std::string out = ReadFile(dir / "run-2.log");
  const std::vector<v1::JobEvent> events = JsonEvents(out);
  ASSERT_FALSE(events.empty()) << out;
  for (const auto& ev : events) EXPECT_EQ(ev.job_id(), before.front().job_id()) << "another job";
  EXPECT_EQ(events.front().seq(), 1);
  EXPECT_EQ(events.back().state(), v1::JOB_STATE_SUCCEEDED) << events.back().message();
  ExpectContinuousAcrossResume(events, kSteps, k);
  // Both runs' daemons are gone: nothing listens on the state db any more (a third run would
  // start its own); the db and logs stay.
  EXPECT_TRUE(fs::exists(state / "coordinator.log"));
  EXPECT_TRUE(fs::exists(state / "worker-0.log"));
  EXPECT_TRUE(fs::exists(state / "worker-1.log"));
}

// `fsdp8 run` checks the spec as the coordinator would at submit before it starts anything: a
// field in its old place is named with its new one on stderr (and the job runs), a spec that
// breaks a rule exits 2 naming the field, with no coordinator or worker started.
TEST(LocalRunTest, MovedFieldWarnsAndInvalidSpecStartsNoDaemon) {
  TempDir tmp("local-run-spec-test");
  ASSERT_FALSE(tmp.path().empty());
  const fs::path dir = tmp.path();
  const std::string train = testing::WriteTokens(tmp, "train.bin", 20000);
  const std::string common = "model: {d_model: 32, n_layers: 1, n_heads: 2, ffn_dim: 64, "
                             "vocab_size: 256, seq_len: 16}\n"
                             "data: {train_path: " + train + "}\n";
  std::ofstream(dir / "old.yaml") << common
                                  << "training: {steps: 2, global_batch: 4, eval_every: 0, "
                                     "gemm_autotune: true}\n";
  ChildProcess old({FSDP8_CLI_BIN, "run", (dir / "old.yaml").string()},
                   (dir / "old.log").string());
  ASSERT_EQ(old.Wait(120s), 0) << ReadFile(dir / "old.log");
  EXPECT_NE(ReadFile(dir / "old.log")
                .find("warning: " + (dir / "old.yaml").string() +
                      ": training.gemm_autotune: moved to tuning.gemm_autotune"),
            std::string::npos)
      << ReadFile(dir / "old.log");

  std::ofstream(dir / "bad.yaml") << common << "training: {steps: 2, global_batch: 4, eval_every: -1}\n";
  ChildProcess bad({FSDP8_CLI_BIN, "run", (dir / "bad.yaml").string()},
                   (dir / "bad.log").string());
  ASSERT_EQ(bad.Wait(60s), 2) << ReadFile(dir / "bad.log");
  EXPECT_NE(ReadFile(dir / "bad.log")
                .find("error: invalid job spec: training.eval_every: must be >= 0 (got -1)"),
            std::string::npos)
      << ReadFile(dir / "bad.log");
  // The documented state directory of bad.yaml: no coordinator (nor its db) was started there.
  EXPECT_FALSE(fs::exists(dir / "bad.fsdp8" / "coordinator.log"));
  EXPECT_FALSE(fs::exists(dir / "bad.fsdp8" / "jobs.db"));
}

}  // namespace
}  // namespace fsdp8
