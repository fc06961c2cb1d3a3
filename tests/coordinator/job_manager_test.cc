// JobManager without workers: validation, idempotency, states, events, persistence.
#include "coordinator/job_manager.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/job_store.h"
#include "coordinator/metrics.h"
#include "coordinator/status_page.h"
#include "coordinator/worker_registry.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "common/spec.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/coordinator/test_util.h"

namespace fsdp8::coord {
namespace {

using fsdp8::testing::SmallSpec;
using fsdp8::testing::TempDir;
using fsdp8::testing::WaitFor;
using fsdp8::testing::WriteTokens;

class JobManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    train_ = WriteTokens(dir_, "train.bin");
    JobManagerOptions o;
    o.data_roots = {dir_.path()};
    auto jm = JobManager::Open(o);
    ASSERT_TRUE(jm.ok()) << jm.status();
    jm_ = std::move(*jm);
  }
  TempDir dir_;
  std::string train_;
  std::unique_ptr<JobManager> jm_;
};

struct BadSpecCase {
  const char* name;
  std::function<void(v1::JobSpec*)> mutate;
  const char* field;  // must appear in the message
};

TEST_F(JobManagerTest, EveryValidationErrorIsInvalidArgumentNamingTheField) {
  const std::vector<BadSpecCase> cases = {
      {"zero d_model", [](v1::JobSpec* s) { s->mutable_model()->set_d_model(0); }, "model.d_model"},
      {"negative steps", [](v1::JobSpec* s) { s->mutable_training()->set_steps(-5); },
       "training.steps"},
      {"d_model % heads", [](v1::JobSpec* s) { s->mutable_model()->set_d_model(34); },
       "model.d_model"},
      {"n_heads % n_kv_heads", [](v1::JobSpec* s) { s->mutable_model()->set_n_kv_heads(3); },
       "model.n_heads"},
      {"global batch vs world x microbatch",
       [](v1::JobSpec* s) {
         s->mutable_sharding()->set_min_workers(3);
         s->mutable_training()->set_microbatch(1);
       },
       "training.global_batch"},
      {"global batch at max_workers",
       [](v1::JobSpec* s) { s->mutable_sharding()->set_max_workers(3); }, "training.global_batch"},
      {"max < min",
       [](v1::JobSpec* s) {
         s->mutable_sharding()->set_min_workers(2);
         s->mutable_sharding()->set_max_workers(1);
       },
       "sharding.max_workers"},
      {"missing train_path", [](v1::JobSpec* s) { s->mutable_data()->clear_train_path(); },
       "data.train_path"},
      {"train_path outside data roots",
       [](v1::JobSpec* s) { s->mutable_data()->set_train_path("/etc/passwd"); },
       "data.train_path"},
      {"train_path does not exist",
       [this](v1::JobSpec* s) { s->mutable_data()->set_train_path(dir_.File("absent.bin")); },
       "data.train_path"},
      {"val_path outside data roots",
       [](v1::JobSpec* s) { s->mutable_data()->set_val_path("/tmp/../etc/val.bin"); },
       "data.val_path"},
      {"FP8 embedding",
       [](v1::JobSpec* s) { s->mutable_precision()->set_embedding(v1::PRECISION_FP8); },
       "precision.embedding"},
      {"FP8 lm_head",
       [](v1::JobSpec* s) { s->mutable_precision()->set_lm_head(v1::PRECISION_FP8); },
       "precision.lm_head"},
      {"zero microbatch", [](v1::JobSpec* s) { s->mutable_training()->set_microbatch(0); },
       "training.microbatch"},
      {"bad backend", [](v1::JobSpec* s) { s->set_backend("tpu"); }, "backend"},
  };
  for (const auto& c : cases) {
    v1::JobSpec spec = SmallSpec(train_);
    c.mutate(&spec);
    auto job = jm_->Submit("", spec);
    ASSERT_FALSE(job.ok()) << c.name;
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << c.name << ": "
                                                                       << job.status();
    EXPECT_TRUE(absl::StrContains(job.status().message(), c.field))
        << c.name << ": message '" << job.status().message() << "' does not name " << c.field;
  }
  EXPECT_TRUE(jm_->List().empty()) << "an invalid spec must not create a job";
}

TEST_F(JobManagerTest, ValidSpecIsPendingWithDefaults) {
  auto job = jm_->Submit("", SmallSpec(train_, 2));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(job->total_steps(), 3);
  EXPECT_EQ(job->spec().sharding().max_workers(), 2);  // default = min_workers
  EXPECT_EQ(job->spec().backend(), "cpu");
  EXPECT_TRUE(std::isnan(job->val_loss()));
  EXPECT_FALSE(job->reason().empty());
}

// A running job that continues on fewer replicas (JobRun::ContinueOnFewerReplicas): a new
// generation on the surviving workers, no restart counted, Job.replicas the live mesh's R and
// Job.configured_replicas the one the job started with; the event carries the message; the status
// page's document (/api/status) gives the live and configured replicas and the live mesh. A job
// that is not RUNNING is refused.
TEST_F(JobManagerTest, MarkReconfiguredContinuesARunningJobOnFewerReplicas) {
  v1::JobSpec spec = SmallSpec(train_, 4);
  spec.mutable_sharding()->set_replicas(2);
  auto job = jm_->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  EXPECT_TRUE(
      absl::IsFailedPrecondition(jm_->MarkReconfigured(id, {"w-1", "w-2"}, 1, "x").status()));
  auto started = jm_->MarkStarting(id, {"w-1", "w-2", "w-3", "w-4"}, 2);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->configured_replicas(), 2);
  ASSERT_TRUE(jm_->MarkRunning(id).ok());
  const std::string msg =
      "replica 1 lost (rank 3 (worker w-4): lost): continuing on 1 replica at step 0";
  auto r = jm_->MarkReconfigured(id, {"w-1", "w-2"}, 1, msg);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const v1::Job& j : {*r, *jm_->Get(id)}) {
    EXPECT_EQ(j.state(), v1::JOB_STATE_RUNNING);
    EXPECT_EQ(j.generation(), started->generation() + 1);
    EXPECT_EQ(j.restarts(), 0);
    EXPECT_EQ(j.world_size(), 2);
    EXPECT_EQ(j.replicas(), 1);
    EXPECT_EQ(j.configured_replicas(), 2);
    ASSERT_EQ(j.worker_ids_size(), 2);
    EXPECT_EQ(j.worker_ids(0), "w-1");
    EXPECT_EQ(j.worker_ids(1), "w-2");
  }
  auto events = jm_->RecentEvents(id, 1);
  ASSERT_TRUE(events.ok() && !events->empty());
  EXPECT_EQ(events->back().message(), msg);
  // The status page's document.
  WorkerRegistry workers(WorkerRegistryOptions{"1.2.3"});
  CoordinatorMetrics metrics;
  const std::string page = StatusJson(*jm_, workers, metrics, "");
  google::protobuf::Struct doc;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(page, &doc).ok()) << page;
  bool found = false;
  for (const auto& v : doc.fields().at("jobs").list_value().values()) {
    const auto& f = v.struct_value().fields();
    if (f.at("job_id").string_value() != id) continue;
    found = true;
    EXPECT_EQ(f.at("mesh").string_value(), "1x2");
    EXPECT_EQ(f.at("replicas").number_value(), 1);
    EXPECT_EQ(f.at("configured_replicas").number_value(), 2);
  }
  EXPECT_TRUE(found) << page;
  // Only a RUNNING job continues so.
  ASSERT_TRUE(jm_->Finish(id, v1::JOB_STATE_SUCCEEDED, "done").ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(jm_->MarkReconfigured(id, {"w-1"}, 1, "x").status()));
}

// The submitted event's message (the job's first event).
std::string SubmittedMessage(JobManager* jm, const std::string& id) {
  auto ev = jm->RecentEvents(id, 100);
  EXPECT_TRUE(ev.ok() && !ev->empty());
  return ev.ok() && !ev->empty() ? ev->front().message() : "";
}

// A spec written for the release before tuning: moved out of the user's sections still submits.
// Today's data/default-job.yaml (its data paths filled in, as scripts/demo.sh does) is accepted as
// it is, with no warning (it sets no moved field); a spec that sets every moved field in its old
// place is accepted with one warning per field naming its new place, and the job records them
// there (tuning), so that the same request in the new place is the same job.
TEST_F(JobManagerTest, SpecsOfTheLastReleaseSubmitWithAWarningNamingTheNewPlace) {
  const std::string val = WriteTokens(dir_, "val.bin", 1000);
  std::ifstream in(std::string(FSDP8_SOURCE_DIR) + "/data/default-job.yaml");
  ASSERT_TRUE(in) << "data/default-job.yaml";
  std::stringstream text;
  text << in.rdbuf();
  std::string yaml = text.str();
  for (auto [from, to] : {std::pair<std::string, std::string>{"DATA_DIR/train.bin", train_},
                          std::pair<std::string, std::string>{"DATA_DIR/val.bin", val}}) {
    const size_t at = yaml.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    yaml.replace(at, from.size(), to);
  }
  auto def = ParseSpec(yaml);
  ASSERT_TRUE(def.ok()) << def.status();
  auto d = jm_->Submit("", *def);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(absl::StrContains(SubmittedMessage(jm_.get(), d->job_id()), "warning"))
      << SubmittedMessage(jm_.get(), d->job_id());
  EXPECT_FALSE(d->spec().tuning().gemm_autotune());
  EXPECT_TRUE(d->spec().tuning().forward_fast_accumulation());

  const std::string old_place = absl::StrCat(
      "name: old-place\n"
      "model: {d_model: 32, n_layers: 1, n_heads: 2, ffn_dim: 64, seq_len: 16}\n"
      "data: {train_path: ", train_, "}\n"
      "training: {steps: 3, global_batch: 4, gemm_autotune: true}\n"
      "precision:\n"
      "  fp8: {recipe: delayed, forward_fast_accumulation: false}\n");
  auto old_spec = ParseSpec(old_place);
  ASSERT_TRUE(old_spec.ok()) << old_spec.status();
  auto o = jm_->Submit("same-request", *old_spec);
  ASSERT_TRUE(o.ok()) << o.status();
  const std::string m = SubmittedMessage(jm_.get(), o->job_id());
  EXPECT_TRUE(absl::StrContains(
      m, "warning: training.gemm_autotune: moved to tuning.gemm_autotune")) << m;
  EXPECT_TRUE(absl::StrContains(m, "warning: precision.fp8.forward_fast_accumulation: moved to "
                                   "tuning.forward_fast_accumulation")) << m;
  EXPECT_TRUE(o->spec().tuning().gemm_autotune());
  EXPECT_FALSE(o->spec().tuning().forward_fast_accumulation());
  // Nothing left in the old places (WithDefaults would move it).
  EXPECT_TRUE(CheckDefaulted(o->spec(), 0).ok()) << CheckDefaulted(o->spec(), 0);

  const std::string new_place = absl::StrCat(
      "name: old-place\n"
      "model: {d_model: 32, n_layers: 1, n_heads: 2, ffn_dim: 64, seq_len: 16}\n"
      "data: {train_path: ", train_, "}\n"
      "training: {steps: 3, global_batch: 4}\n"
      "precision:\n"
      "  fp8: {recipe: delayed}\n"
      "tuning: {gemm_autotune: true, forward_fast_accumulation: false}\n");
  auto new_spec = ParseSpec(new_place);
  ASSERT_TRUE(new_spec.ok()) << new_spec.status();
  auto n = jm_->Submit("same-request", *new_spec);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->job_id(), o->job_id());

  // Both places, disagreeing: refused naming both.
  v1::JobSpec both = *old_spec;
  both.mutable_tuning()->set_gemm_autotune(false);
  auto b = jm_->Submit("", both);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(b.status().message(),
                                "training.gemm_autotune: moved to tuning.gemm_autotune"))
      << b.status();
}

TEST_F(JobManagerTest, IdempotentSubmit) {
  auto a = jm_->Submit("req-1", SmallSpec(train_));
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = jm_->Submit("req-1", SmallSpec(train_));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->job_id(), b->job_id());
  // Spelling out a default is the same spec.
  v1::JobSpec same = SmallSpec(train_);
  same.set_backend("cpu");
  auto c = jm_->Submit("req-1", same);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->job_id(), a->job_id());
  v1::JobSpec other = SmallSpec(train_, 1, 7);
  auto d = jm_->Submit("req-1", other);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kAlreadyExists) << d.status();
  // Empty request ids always create new jobs.
  auto e = jm_->Submit("", SmallSpec(train_));
  auto f = jm_->Submit("", SmallSpec(train_));
  ASSERT_TRUE(e.ok() && f.ok());
  EXPECT_NE(e->job_id(), f->job_id());
  EXPECT_EQ(jm_->List().size(), 3u);
}

TEST_F(JobManagerTest, CancelPendingThenAgainAndNotFound) {
  auto job = jm_->Submit("", SmallSpec(train_));
  ASSERT_TRUE(job.ok());
  auto c = jm_->Cancel(job->job_id());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(jm_->Get(job->job_id())->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(jm_->Cancel(job->job_id()).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(jm_->Get("job-nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(jm_->Cancel("job-nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(jm_->Watch("job-nope", 0, [](const v1::JobEvent&) { return true; }).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(jm_->GetScalingState("job-nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(jm_->GetScalingState(job->job_id()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(JobManagerTest, WatchResumesAfterSeqAndEndsWithTerminalState) {
  auto job = jm_->Submit("", SmallSpec(train_));
  ASSERT_TRUE(job.ok());
  const std::string id = job->job_id();
  ASSERT_TRUE(jm_->SetPendingReason(id, "waiting for 1 workers (0 free)").ok());
  ASSERT_TRUE(jm_->SetPendingReason(id, "waiting for 1 workers (0 free)").ok());  // no change
  ASSERT_TRUE(jm_->SetPendingReason(id, "something else").ok());
  ASSERT_TRUE(jm_->Cancel(id).ok());
  std::vector<v1::JobEvent> all;
  ASSERT_TRUE(jm_->Watch(id, 0, [&](const v1::JobEvent& e) {
                   all.push_back(e);
                   return true;
                 }).ok());
  ASSERT_EQ(all.size(), 4u);
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i].seq(), static_cast<int64_t>(i + 1));
  EXPECT_EQ(all.back().state(), v1::JOB_STATE_CANCELLED);
  std::vector<int64_t> after2;
  ASSERT_TRUE(jm_->Watch(id, 2, [&](const v1::JobEvent& e) {
                   after2.push_back(e.seq());
                   return true;
                 }).ok());
  EXPECT_EQ(after2, (std::vector<int64_t>{3, 4}));
  std::vector<int64_t> after_end;
  ASSERT_TRUE(jm_->Watch(id, 4, [&](const v1::JobEvent& e) {
                   after_end.push_back(e.seq());
                   return true;
                 }).ok());
  EXPECT_TRUE(after_end.empty());
}

TEST_F(JobManagerTest, WatchBlocksForNewEventsUntilTheJobEnds) {
  auto job = jm_->Submit("", SmallSpec(train_));
  ASSERT_TRUE(job.ok());
  const std::string id = job->job_id();
  std::vector<v1::JobEvent> seen;
  std::atomic<bool> returned{false};
  absl::Status result;
  std::thread watcher([&] {
    result = jm_->Watch(id, 1, [&](const v1::JobEvent& e) {
      seen.push_back(e);
      return true;
    });
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(returned) << "Watch must block while the job is live";
  ASSERT_TRUE(jm_->MarkStarting(id, {"w-1"}).ok());
  ASSERT_TRUE(jm_->MarkRunning(id).ok());
  v1::JobEvent step;
  step.set_step(1);
  step.set_loss(3.5);
  step.set_val_loss(NAN);
  step.set_tokens(64);
  ASSERT_TRUE(jm_->RecordStep(id, step).ok());
  ASSERT_TRUE(jm_->Finish(id, v1::JOB_STATE_SUCCEEDED, "done").ok());
  ASSERT_TRUE(WaitFor([&] { return returned.load(); }, 5));
  watcher.join();
  EXPECT_TRUE(result.ok()) << result;
  ASSERT_EQ(seen.size(), 4u);  // starting, running, step, succeeded
  EXPECT_EQ(seen[0].seq(), 2);
  EXPECT_EQ(seen[0].state(), v1::JOB_STATE_STARTING);
  EXPECT_EQ(seen[2].step(), 1);
  EXPECT_DOUBLE_EQ(seen[2].loss(), 3.5);
  EXPECT_EQ(seen.back().state(), v1::JOB_STATE_SUCCEEDED);
  auto j = jm_->Get(id);
  EXPECT_EQ(j->step(), 1);
  EXPECT_EQ(j->tokens(), 64);
  EXPECT_EQ(j->generation(), 1);
  EXPECT_EQ(jm_->Finish(id, v1::JOB_STATE_FAILED, "late").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(jm_->Get(id)->state(), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(JobManagerTest, WatchStopsWhenAsked) {
  auto job = jm_->Submit("", SmallSpec(train_));
  ASSERT_TRUE(job.ok());
  auto s = jm_->Watch(job->job_id(), 0, [](const v1::JobEvent&) { return true; },
                      [] { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
}

TEST(JobManagerPersistence, SurvivesRestart) {
  TempDir dir;
  std::string train = WriteTokens(dir, "train.bin");
  JobManagerOptions o;
  o.state_db = dir.File("state.db");
  std::string pending_id, running_id, done_id;
  int64_t running_last_seq = 0;
  {
    auto jm = JobManager::Open(o);
    ASSERT_TRUE(jm.ok()) << jm.status();
    auto p = (*jm)->Submit("keep-me", SmallSpec(train));
    auto r = (*jm)->Submit("", SmallSpec(train, 1, 9));
    auto d = (*jm)->Submit("", SmallSpec(train));
    ASSERT_TRUE(p.ok() && r.ok() && d.ok());
    pending_id = p->job_id();
    running_id = r->job_id();
    done_id = d->job_id();
    ASSERT_TRUE((*jm)->MarkStarting(running_id, {"w-1"}).ok());
    ASSERT_TRUE((*jm)->MarkRunning(running_id).ok());
    v1::JobEvent step;
    step.set_step(4);
    step.set_loss(2.25);
    step.set_val_loss(2.5);
    step.set_tokens(400);
    ASSERT_TRUE((*jm)->RecordStep(running_id, step).ok());
    ASSERT_TRUE((*jm)->Cancel(done_id).ok());
    (*jm)->Watch(running_id, 0, [&](const v1::JobEvent& e) {
      running_last_seq = e.seq();
      return true;
    }, [] { return true; }).IgnoreError();
  }
  auto jm = JobManager::Open(o);
  ASSERT_TRUE(jm.ok()) << jm.status();
  auto jobs = (*jm)->List();
  ASSERT_EQ(jobs.size(), 3u);
  EXPECT_EQ(jobs[0].job_id(), pending_id);
  EXPECT_EQ((*jm)->Get(pending_id)->state(), v1::JOB_STATE_PENDING);
  auto r = (*jm)->Get(running_id);
  EXPECT_EQ(r->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(r->reason(), "coordinator restarted (no checkpoint.dir to resume from)");
  EXPECT_EQ(r->step(), 4);
  EXPECT_DOUBLE_EQ(r->loss(), 2.25);
  EXPECT_DOUBLE_EQ(r->val_loss(), 2.5);
  EXPECT_EQ(r->total_steps(), 9);
  EXPECT_EQ((*jm)->Get(done_id)->state(), v1::JOB_STATE_CANCELLED);
  // Event numbering continues; a watch from the start gets every event of before the restart (the
  // step's figures included), in order and without gaps; the final event carries the terminal state.
  std::vector<v1::JobEvent> evs;
  ASSERT_TRUE((*jm)->Watch(running_id, 0, [&](const v1::JobEvent& e) {
                       evs.push_back(e);
                       return true;
                     }).ok());
  ASSERT_EQ(evs.size(), static_cast<size_t>(running_last_seq + 1));
  for (size_t i = 0; i < evs.size(); ++i) EXPECT_EQ(evs[i].seq(), static_cast<int64_t>(i + 1));
  EXPECT_EQ(evs.back().state(), v1::JOB_STATE_FAILED);
  const v1::JobEvent& step4 = evs[running_last_seq - 1];
  EXPECT_EQ(step4.step(), 4);
  EXPECT_DOUBLE_EQ(step4.loss(), 2.25);
  EXPECT_DOUBLE_EQ(step4.val_loss(), 2.5);
  EXPECT_EQ(step4.state(), v1::JOB_STATE_RUNNING);
  // From a later seq: only what follows it.
  std::vector<int64_t> later;
  ASSERT_TRUE((*jm)->Watch(running_id, running_last_seq - 1, [&](const v1::JobEvent& e) {
                       later.push_back(e.seq());
                       return true;
                     }).ok());
  EXPECT_EQ(later, (std::vector<int64_t>{running_last_seq, running_last_seq + 1}));
  std::vector<v1::JobEvent> done_evs;
  ASSERT_TRUE((*jm)->Watch(done_id, 0, [&](const v1::JobEvent& e) {
                       done_evs.push_back(e);
                       return true;
                     }).ok());
  ASSERT_EQ(done_evs.size(), 2u);  // submitted, cancelled
  EXPECT_EQ(done_evs[0].seq(), 1);
  EXPECT_EQ(done_evs[0].state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(done_evs[1].seq(), 2);
  EXPECT_EQ(done_evs[1].state(), v1::JOB_STATE_CANCELLED);
  // A job still pending: its events from before the restart, then the watch waits for more.
  std::vector<int64_t> pending_seqs;
  EXPECT_EQ((*jm)->Watch(pending_id, 0, [&](const v1::JobEvent& e) {
                     pending_seqs.push_back(e.seq());
                     EXPECT_EQ(e.state(), v1::JOB_STATE_PENDING);
                     return true;
                   }, [] { return true; }).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(pending_seqs, (std::vector<int64_t>{1}));
  // The request id is remembered.
  auto again = (*jm)->Submit("keep-me", SmallSpec(train));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->job_id(), pending_id);
  EXPECT_EQ((*jm)->Submit("keep-me", SmallSpec(train, 1, 5)).status().code(),
            absl::StatusCode::kAlreadyExists);
}

// Every event the state db holds for `job_id`, read through a second JobStore.
std::vector<v1::JobEvent> StoredEvents(const std::string& db, const std::string& job_id) {
  auto store = JobStore::Open(db);
  EXPECT_TRUE(store.ok()) << store.status();
  if (!store.ok()) return {};
  auto events = (*store)->Events(job_id, 0, std::numeric_limits<int64_t>::max());
  EXPECT_TRUE(events.ok()) << events.status();
  return events.ok() ? *events : std::vector<v1::JobEvent>{};
}

// The state db keeps a job's newest max_events_per_job events, as memory does: after a restart a
// watch from the start gets those, in seq order, and no older ones.
TEST(JobManagerPersistence, StoredEventsAreTheNewestMaxEventsPerJob) {
  TempDir dir;
  std::string train = WriteTokens(dir, "train.bin");
  JobManagerOptions o;
  o.state_db = dir.File("state.db");
  o.max_events_per_job = 3;
  std::string id;
  int64_t last = 0;
  {
    auto jm = JobManager::Open(o);
    ASSERT_TRUE(jm.ok()) << jm.status();
    auto j = (*jm)->Submit("", SmallSpec(train, 1, 9));
    ASSERT_TRUE(j.ok());
    id = j->job_id();
    ASSERT_TRUE((*jm)->MarkStarting(id, {"w-1"}).ok());
    ASSERT_TRUE((*jm)->MarkRunning(id).ok());
    for (int k = 1; k <= 70; ++k) {
      v1::JobEvent step;
      step.set_step(k);
      step.set_loss(3.0 - 0.25 * k);
      step.set_val_loss(NAN);
      step.set_tokens(100 * k);
      ASSERT_TRUE((*jm)->RecordStep(id, step).ok());
    }
    ASSERT_TRUE((*jm)->Watch(id, 0, [&](const v1::JobEvent& e) {
                         last = e.seq();
                         return true;
                       }, [] { return true; }).code() == absl::StatusCode::kCancelled);
  }
  // Trimmed in the state db every JobStore::kTrimEvery events, not kept whole.
  const std::vector<v1::JobEvent> stored = StoredEvents(o.state_db, id);
  EXPECT_GE(stored.size(), 3u);
  EXPECT_LE(stored.size(), static_cast<size_t>(3 + JobStore::kTrimEvery - 1));
  EXPECT_LT(stored.size(), static_cast<size_t>(last));
  ASSERT_FALSE(stored.empty());
  EXPECT_EQ(stored.back().seq(), last);
  auto jm = JobManager::Open(o);
  ASSERT_TRUE(jm.ok()) << jm.status();
  std::vector<int64_t> seqs, steps;
  ASSERT_TRUE((*jm)->Watch(id, 0, [&](const v1::JobEvent& e) {
                       seqs.push_back(e.seq());
                       steps.push_back(e.step());
                       return true;
                     }).ok());
  // The restart's own event (seq last + 1, the job's step) is one of the 3 kept.
  EXPECT_EQ(seqs, (std::vector<int64_t>{last - 1, last, last + 1}));
  EXPECT_EQ(steps, (std::vector<int64_t>{69, 70, 70}));
}

// A coordinator restart is a failed generation: a job with a checkpoint.dir and restarts left comes
// back RECOVERING (counted once), ready to resume from its latest checkpoint; one without restarts
// left fails, naming max_restarts.
TEST(JobManagerPersistence, RunningJobWithCheckpointsRecoversAfterRestart) {
  TempDir dir;
  std::string train = WriteTokens(dir, "train.bin");
  JobManagerOptions o;
  o.state_db = dir.File("state.db");
  // Each job its own directory (a directory belongs to one job).
  auto with_ckpt = [&](int max_restarts, const std::string& ck) {
    v1::JobSpec s = SmallSpec(train, 1, 9);
    s.mutable_checkpoint()->set_dir(dir.File(ck));
    s.set_max_restarts(max_restarts);
    return s;
  };
  std::string again_id, spent_id, waiting_id;
  {
    auto jm = JobManager::Open(o);
    ASSERT_TRUE(jm.ok()) << jm.status();
    auto a = (*jm)->Submit("req-a", with_ckpt(2, "ck-a"));
    auto b = (*jm)->Submit("", with_ckpt(0, "ck-b"));
    auto c = (*jm)->Submit("", with_ckpt(2, "ck-c"));
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    again_id = a->job_id();
    spent_id = b->job_id();
    waiting_id = c->job_id();
    for (const auto& id : {again_id, spent_id, waiting_id}) {
      ASSERT_TRUE((*jm)->MarkStarting(id, {"w-1"}).ok());
      ASSERT_TRUE((*jm)->MarkRunning(id).ok());
    }
    ASSERT_TRUE((*jm)->MarkRecovering(waiting_id, "rank 0 lost", 2).ok());  // restarts 1
  }
  auto jm = JobManager::Open(o);
  ASSERT_TRUE(jm.ok()) << jm.status();
  auto a = (*jm)->Get(again_id);
  EXPECT_EQ(a->state(), v1::JOB_STATE_RECOVERING);
  EXPECT_EQ(a->restarts(), 1);
  EXPECT_EQ(a->reason(), "recovering from a coordinator restart (restart 1 of 2)");
  EXPECT_EQ(a->worker_ids_size(), 0);
  auto b = (*jm)->Get(spent_id);
  EXPECT_EQ(b->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(b->reason(), "coordinator restarted (max_restarts 0 reached)");
  auto c = (*jm)->Get(waiting_id);
  EXPECT_EQ(c->state(), v1::JOB_STATE_RECOVERING);
  EXPECT_EQ(c->restarts(), 1);  // not counted twice
  std::vector<std::string> pending;
  for (const auto& j : (*jm)->PendingJobs()) pending.push_back(j.job_id());
  EXPECT_EQ(pending, (std::vector<std::string>{again_id, waiting_id}));
  auto same = (*jm)->Submit("req-a", with_ckpt(2, "ck-a"));
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->job_id(), again_id);
}

// With re-adoption on (readopt_window), a job RUNNING at the restart waits for its ranks instead:
// RECOVERING, its generation and worker_ids kept, no restart counted, out of PendingJobs and in
// ReadoptCandidates (also after a second restart meanwhile). MarkReadopting makes it STARTING on
// the same generation at the ranks' step; ReadoptFailed takes the checkpoint path (the restart
// counted, the reason saying why) or fails a job without a checkpoint.dir. A job STARTING at the
// restart has no ranks to re-adopt: the checkpoint path at once.
TEST(JobManagerPersistence, RunningJobWaitsForReadoptionAfterRestart) {
  TempDir dir;
  std::string train = WriteTokens(dir, "train.bin");
  JobManagerOptions o;
  o.state_db = dir.File("state.db");
  o.readopt_window = std::chrono::milliseconds(60000);
  auto spec = [&](const std::string& ck) {
    v1::JobSpec s = SmallSpec(train, 2, 9);
    if (!ck.empty()) s.mutable_checkpoint()->set_dir(dir.File(ck));
    s.set_max_restarts(2);
    return s;
  };
  std::string adopt_id, fall_id, bare_id, starting_id;
  {
    auto jm = JobManager::Open(o);
    ASSERT_TRUE(jm.ok()) << jm.status();
    adopt_id = (*jm)->Submit("", spec("ck-a"))->job_id();
    fall_id = (*jm)->Submit("", spec("ck-b"))->job_id();
    bare_id = (*jm)->Submit("", spec(""))->job_id();
    starting_id = (*jm)->Submit("", spec("ck-d"))->job_id();
    for (const auto& id : {adopt_id, fall_id, bare_id, starting_id}) {
      ASSERT_TRUE((*jm)->MarkStarting(id, {"w-1", "w-2"}).ok());
      if (id != starting_id) {
        ASSERT_TRUE((*jm)->MarkRunning(id).ok());
      }
    }
    v1::JobEvent ev;
    ev.set_step(4);
    ev.set_loss(2.5);
    ev.set_tokens(400);
    ASSERT_TRUE((*jm)->RecordStep(adopt_id, ev).ok());
  }
  for (int restart = 0; restart < 2; ++restart) {  // a second restart while waiting: still waits
    auto jm = JobManager::Open(o);
    ASSERT_TRUE(jm.ok()) << jm.status();
    for (const auto& id : {adopt_id, fall_id, bare_id}) {
      auto j = (*jm)->Get(id);
      EXPECT_EQ(j->state(), v1::JOB_STATE_RECOVERING);
      EXPECT_EQ(j->restarts(), 0);
      EXPECT_EQ(j->generation(), 1);
      EXPECT_EQ(j->worker_ids_size(), 2);
      EXPECT_EQ(j->reason(),
                "coordinator restarted: re-adopting the 2 ranks of generation 1 (waiting up to 1m)");
    }
  }
  auto jm = JobManager::Open(o);
  ASSERT_TRUE(jm.ok()) << jm.status();
  std::vector<std::string> pending, candidates;
  for (const auto& j : (*jm)->PendingJobs()) pending.push_back(j.job_id());
  for (const auto& c : (*jm)->ReadoptCandidates()) {
    candidates.push_back(c.job.job_id());
    EXPECT_GT(c.until, std::chrono::steady_clock::now() + std::chrono::seconds(50));
  }
  EXPECT_EQ(pending, std::vector<std::string>{starting_id});
  EXPECT_EQ((*jm)->Get(starting_id)->reason(),
            "recovering from a coordinator restart (restart 1 of 2)");
  EXPECT_EQ(candidates, (std::vector<std::string>{adopt_id, fall_id, bare_id}));

  EXPECT_EQ((*jm)->MarkReadopting(adopt_id, {"w-1"}, 6, 600, "one worker").status().code(),
            absl::StatusCode::kInvalidArgument);
  // Rank 1's unnamed worker came back under a new id.
  auto adopted = (*jm)->MarkReadopting(adopt_id, {"w-1", "w-5"}, 6, 600,
                                       "re-adopting 2 ranks at step 6");
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ(adopted->worker_ids(1), "w-5");
  EXPECT_EQ(adopted->state(), v1::JOB_STATE_STARTING);
  EXPECT_EQ(adopted->generation(), 1);
  EXPECT_EQ(adopted->step(), 6);
  EXPECT_EQ(adopted->tokens(), 600);
  EXPECT_EQ(adopted->worker_ids_size(), 2);
  ASSERT_TRUE((*jm)->MarkRunning(adopt_id).ok());
  EXPECT_EQ((*jm)->MarkReadopting(adopt_id, {"w-1", "w-5"}, 6, 600, "again").status().code(),
            absl::StatusCode::kFailedPrecondition);

  ASSERT_TRUE((*jm)->ReadoptFailed(fall_id, "rank 1 (worker w-2) did not come back").ok());
  auto fall = (*jm)->Get(fall_id);
  EXPECT_EQ(fall->state(), v1::JOB_STATE_RECOVERING);
  EXPECT_EQ(fall->restarts(), 1);
  EXPECT_EQ(fall->worker_ids_size(), 0);
  EXPECT_EQ(fall->reason(),
            "recovering from a coordinator restart (restart 1 of 2): falling back to the "
            "checkpoint because rank 1 (worker w-2) did not come back");
  EXPECT_EQ((*jm)->ReadoptFailed(fall_id, "twice").code(), absl::StatusCode::kFailedPrecondition);

  ASSERT_TRUE((*jm)->ReadoptFailed(bare_id, "rank 0 (worker w-1) did not come back").ok());
  auto bare = (*jm)->Get(bare_id);
  EXPECT_EQ(bare->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(bare->reason(),
            "coordinator restarted and rank 0 (worker w-1) did not come back (no checkpoint.dir "
            "to resume from)");
  pending.clear();
  for (const auto& j : (*jm)->PendingJobs()) pending.push_back(j.job_id());
  EXPECT_EQ(pending, (std::vector<std::string>{fall_id, starting_id}));
  EXPECT_TRUE((*jm)->ReadoptCandidates().empty());
}

// ---- bounded table: pages, deletion, retention -------------------------------------------------

// Pages come oldest first, only the owner's when asked, within the page size and the byte budget,
// and their tokens resume exactly after the previous page, also across a deletion.
TEST_F(JobManagerTest, ListPagesByOwnerSizeAndBytes) {
  std::vector<std::string> ids[2];
  for (int i = 0; i < 25; ++i) {
    const std::string user = i % 2 ? "bob" : "alice";
    auto j = jm_->Submit("", SmallSpec(train_), user);
    ASSERT_TRUE(j.ok()) << j.status();
    ids[i % 2].push_back(j->job_id());
  }
  auto collect = [&](const std::optional<std::string>& owner, int size, int64_t bytes) {
    std::vector<std::string> out;
    std::string token;
    int pages = 0;
    do {
      auto page = jm_->ListPage(owner, size, token, 0, bytes);
      EXPECT_TRUE(page.ok()) << page.status();
      if (!page.ok()) break;
      EXPECT_LE(page->jobs.size(), static_cast<size_t>(size));
      if (!token.empty()) {
        EXPECT_FALSE(page->jobs.empty()) << "a page after a token is never empty";
      }
      for (const auto& j : page->jobs) {
        if (owner) {
          EXPECT_EQ(j.owner(), *owner);
        }
        out.push_back(j.job_id());
      }
      token = page->next_page_token;
      ++pages;
    } while (!token.empty() && pages < 100);
    return std::make_pair(out, pages);
  };
  EXPECT_EQ(collect("alice", 5, 1 << 20), std::make_pair(ids[0], 3));  // 13 jobs: 5 + 5 + 3
  EXPECT_EQ(collect("bob", 4, 1 << 20), std::make_pair(ids[1], 3));    // 12 jobs: 4 + 4 + 4
  EXPECT_EQ(collect("carol", 5, 1 << 20).first.size(), 0u);
  // A byte budget of one job's size: one job per page, never more.
  const int64_t one = static_cast<int64_t>(jm_->Get(ids[0][0])->ByteSizeLong());
  EXPECT_EQ(collect("alice", 100, one), std::make_pair(ids[0], 13));
  // Every job for an admin (no owner filter).
  EXPECT_EQ(collect(std::nullopt, 1000, 1 << 20).first.size(), 25u);
  // A token stays valid when the job it names is deleted.
  auto first = jm_->ListPage("alice", 2, "", 0, 1 << 20);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(jm_->Cancel(ids[0][1]).ok());
  ASSERT_TRUE(jm_->Delete(ids[0][1]).ok());
  auto second = jm_->ListPage("alice", 2, first->next_page_token, 0, 1 << 20);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(second->jobs.size(), 2u);
  EXPECT_EQ(second->jobs[0].job_id(), ids[0][2]);
  // Malformed tokens and sizes.
  for (const std::string& bad : {std::string("xyz"), std::string("0000000000000000/"),
                                 std::string("zz00000000000000/job-1")}) {
    EXPECT_EQ(jm_->ListPage("alice", 2, bad, 0, 1 << 20).status().code(),
              absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(jm_->ListPage("alice", -1, "", 0, 1 << 20).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Only an ended job is deleted; it leaves the table and the state db, never its checkpoints.
TEST(JobManagerRetention, DeleteOnlyEndedJobsAndKeepTheirCheckpoints) {
  TempDir dir;
  const std::string train = WriteTokens(dir, "train.bin");
  JobManagerOptions o;
  o.state_db = dir.File("state.db");
  v1::JobSpec spec = SmallSpec(train);
  spec.mutable_checkpoint()->set_dir(dir.File("ck"));
  std::string id;
  {
    auto jm = JobManager::Open(o);
    ASSERT_TRUE(jm.ok());
    auto a = (*jm)->Submit("req-a", spec, "alice");
    ASSERT_TRUE(a.ok()) << a.status();
    id = a->job_id();
    absl::Status s = (*jm)->Delete(id);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(s.message(), "only an ended job can be deleted")) << s;
    EXPECT_EQ((*jm)->Delete("job-none").code(), absl::StatusCode::kNotFound);
    // The directory is owned: without take-over a second job is refused, also after the end.
    v1::JobSpec other = spec;
    other.set_name("other");
    ASSERT_TRUE((*jm)->Cancel(id).ok());
    s = (*jm)->Submit("", other, "bob").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(s.message(), "belongs to job " + id)) << s;
    ASSERT_TRUE((*jm)->Delete(id).ok());
    EXPECT_EQ((*jm)->Get(id).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ((*jm)->size(), 0u);
    EXPECT_TRUE(std::filesystem::exists(dir.File("ck") + "/OWNER"));
    // Deleted: the directory may be taken over, explicitly.
    s = (*jm)->Submit("", other, "bob").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    other.mutable_checkpoint()->set_take_over(true);
    auto b = (*jm)->Submit("", other, "bob");
    ASSERT_TRUE(b.ok()) << b.status();
    // The request id is free again.
    auto again = (*jm)->Submit("req-a", SmallSpec(train), "alice");
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_NE(again->job_id(), id);
  }
  {
    // Its events left the state db with it; the other jobs' are there.
    EXPECT_TRUE(StoredEvents(o.state_db, id).empty());
    auto store = JobStore::Open(o.state_db);
    ASSERT_TRUE(store.ok()) << store.status();
    auto rows = (*store)->LoadAll();
    ASSERT_TRUE(rows.ok());
    ASSERT_EQ(rows->size(), 2u);
    for (const auto& row : *rows) {
      EXPECT_EQ(StoredEvents(o.state_db, row.job.job_id()).size(),
                static_cast<size_t>(row.last_seq)) << row.job.job_id();
    }
  }
  auto jm = JobManager::Open(o);  // deleted from the state db too
  ASSERT_TRUE(jm.ok());
  EXPECT_EQ((*jm)->Get(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*jm)->size(), 2u);
}

// Two coordinators' job managers (their own state dbs) on one checkpoint directory: the first's
// job holds a lease from its submission; the second, which has never heard of it, refuses to take
// the directory over until the job ends (Cancel releases the lease first). A restart on the same
// state db keeps the coordinator's identity and renews the lease of a job that has not ended.
TEST(JobManagerLease, AnotherCoordinatorWaitsForTheLeaseOfAJobThatHasNotEnded) {
  TempDir dir;
  const std::string train = WriteTokens(dir, "train.bin");
  JobManagerOptions o1;
  o1.state_db = dir.File("first.db");
  JobManagerOptions o2;
  o2.state_db = dir.File("second.db");
  const std::string ck = dir.File("ck");
  v1::JobSpec spec = SmallSpec(train);
  spec.mutable_checkpoint()->set_dir(ck);
  v1::JobSpec take = spec;
  take.mutable_checkpoint()->set_take_over(true);
  std::string id, first_id;
  double renewed = 0;
  {
    auto first = JobManager::Open(o1);
    ASSERT_TRUE(first.ok()) << first.status();
    first_id = (*first)->coordinator_id();
    EXPECT_TRUE(absl::StartsWith(first_id, "coord-")) << first_id;
    auto a = (*first)->Submit("", spec, "alice");
    ASSERT_TRUE(a.ok()) << a.status();
    id = a->job_id();
    auto owner = CheckpointStore(ck).Owner();
    ASSERT_TRUE(owner.ok() && owner->has_value()) << owner.status();
    EXPECT_EQ((*owner)->lease().coordinator(), first_id);
    EXPECT_GT((*owner)->lease().expires(), NowSeconds() + 100);  // 120 s by default
    renewed = (*owner)->lease().renewed();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  auto first = JobManager::Open(o1);  // a restart: same identity, the PENDING job's lease renewed
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ((*first)->coordinator_id(), first_id);
  auto owner = CheckpointStore(ck).Owner();
  ASSERT_TRUE(owner.ok() && owner->has_value());
  EXPECT_EQ((*owner)->lease().coordinator(), first_id);
  EXPECT_GT((*owner)->lease().renewed(), renewed);

  auto second = JobManager::Open(o2);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE((*second)->coordinator_id(), first_id);
  absl::Status s = (*second)->Submit("", take, "bob").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "checkpoint.dir " + ck + " belongs to job " + id))
      << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "runs under another coordinator")) << s;
  EXPECT_EQ((*CheckpointStore(ck).Owner())->owner().job_id(), id);

  ASSERT_TRUE((*first)->Cancel(id).ok());
  EXPECT_EQ((*CheckpointStore(ck).Owner())->lease().expires(), 0);
  auto b = (*second)->Submit("", take, "bob");
  ASSERT_TRUE(b.ok()) << b.status();
  owner = CheckpointStore(ck).Owner();
  EXPECT_EQ((*owner)->owner().job_id(), b->job_id());
  EXPECT_EQ((*owner)->lease().coordinator(), (*second)->coordinator_id());
}

// The lease thread renews the lease of a job that has not ended (every quarter of the lease),
// so it never lapses while the job waits or runs; Finish releases it.
TEST(JobManagerLease, RenewedUntilTheJobEnds) {
  TempDir dir;
  const std::string train = WriteTokens(dir, "train.bin");
  JobManagerOptions o;
  o.checkpoint_lease = std::chrono::milliseconds(400);
  auto jm = JobManager::Open(o);
  ASSERT_TRUE(jm.ok()) << jm.status();
  const std::string ck = dir.File("ck");
  v1::JobSpec spec = SmallSpec(train);
  spec.mutable_checkpoint()->set_dir(ck);
  auto a = (*jm)->Submit("", spec);
  ASSERT_TRUE(a.ok()) << a.status();
  const double first = (*CheckpointStore(ck).Owner())->lease().renewed();
  // Three lease lengths later the lease is still live: renewed meanwhile.
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  auto owner = CheckpointStore(ck).Owner();
  ASSERT_TRUE(owner.ok() && owner->has_value());
  EXPECT_GT((*owner)->lease().renewed(), first + 0.5);
  EXPECT_GT((*owner)->lease().expires(), NowSeconds());
  ASSERT_TRUE((*jm)->Finish(a->job_id(), v1::JOB_STATE_FAILED, "test").ok());
  EXPECT_EQ((*CheckpointStore(ck).Owner())->lease().expires(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ((*CheckpointStore(ck).Owner())->lease().expires(), 0) << "renewed after the end";
}

// Cancel of a job whose run has not been joined (its ranks may still write) keeps the lease live
// and renewed; it goes once the run is joined. A job without a run loses it at once.
TEST(JobManagerLease, CancelKeepsTheLeaseUntilTheRunIsJoined) {
  TempDir dir;
  const std::string train = WriteTokens(dir, "train.bin");
  JobManagerOptions o;
  o.checkpoint_lease = std::chrono::milliseconds(400);
  auto jm = JobManager::Open(o);
  ASSERT_TRUE(jm.ok()) << jm.status();
  v1::JobSpec spec = SmallSpec(train);
  spec.mutable_checkpoint()->set_dir(dir.File("ck"));
  auto a = (*jm)->Submit("", spec);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE((*jm)->MarkStarting(a->job_id(), {"w-1"}).ok());
  ASSERT_TRUE((*jm)->Cancel(a->job_id()).ok());
  const double cancelled = NowSeconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // beyond one lease length
  auto owner = CheckpointStore(dir.File("ck")).Owner();
  ASSERT_TRUE(owner.ok() && owner->has_value()) << owner.status();
  EXPECT_GT((*owner)->lease().expires(), NowSeconds()) << "released while the run may write";
  EXPECT_GT((*owner)->lease().renewed(), cancelled) << "not renewed while the run may write";
  (*jm)->RunJoined(a->job_id());
  EXPECT_EQ((*CheckpointStore(dir.File("ck")).Owner())->lease().expires(), 0);

  spec.mutable_checkpoint()->set_dir(dir.File("ck2"));
  auto b = (*jm)->Submit("", spec);  // PENDING: no run
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE((*jm)->Cancel(b->job_id()).ok());
  EXPECT_EQ((*CheckpointStore(dir.File("ck2")).Owner())->lease().expires(), 0);
}

// A restart while the checkpoint storage is not mounted yet: the job's lease is still renewed
// once the directory is back (retried, never dropped), and no lease call creates the directory on
// the empty mount point meanwhile.
TEST(JobManagerLease, RenewedOnceTheStorageIsBackAfterARestart) {
  TempDir dir;
  const std::string train = WriteTokens(dir, "train.bin");
  JobManagerOptions o;
  o.state_db = dir.File("state.db");
  o.checkpoint_lease = std::chrono::milliseconds(400);
  const std::string mnt = dir.File("mnt");
  const std::string ck = mnt + "/ck";
  v1::JobSpec spec = SmallSpec(train);
  spec.mutable_checkpoint()->set_dir(ck);
  std::string id;
  {
    auto jm = JobManager::Open(o);
    ASSERT_TRUE(jm.ok()) << jm.status();
    auto a = (*jm)->Submit("", spec);
    ASSERT_TRUE(a.ok()) << a.status();
    id = a->job_id();
  }
  std::filesystem::rename(mnt, dir.File("unmounted"));
  ASSERT_TRUE(std::filesystem::create_directories(mnt));  // the empty mount point
  auto jm = JobManager::Open(o);
  ASSERT_TRUE(jm.ok()) << jm.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // four renewal rounds
  EXPECT_FALSE(std::filesystem::exists(ck)) << "created on the empty mount point";
  std::filesystem::remove(mnt);
  std::filesystem::rename(dir.File("unmounted"), mnt);  // mounted
  const double back = NowSeconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  auto owner = CheckpointStore(ck).Owner();
  ASSERT_TRUE(owner.ok() && owner->has_value()) << owner.status();
  EXPECT_EQ((*owner)->owner().job_id(), id);
  EXPECT_EQ((*owner)->lease().coordinator(), (*jm)->coordinator_id());
  EXPECT_GT((*owner)->lease().renewed(), back) << "never renewed after the storage came back";
  EXPECT_GT((*owner)->lease().expires(), NowSeconds());
}

// Retention keeps the most recently ended jobs up to the count, drops those older than the age,
// and never touches a job that has not ended.
TEST(JobManagerRetention, CountAndAge) {
  TempDir dir;
  const std::string train = WriteTokens(dir, "train.bin");
  JobManagerOptions o;
  o.state_db = dir.File("state.db");
  o.retain_ended_jobs = 3;
  o.retain_ended_age = std::chrono::seconds(3600);
  std::vector<std::string> ids;
  {
    auto jm = JobManager::Open(o);
    ASSERT_TRUE(jm.ok());
    for (int i = 0; i < 8; ++i) ids.push_back((*jm)->Submit("", SmallSpec(train))->job_id());
    for (int i = 0; i < 6; ++i) ASSERT_TRUE((*jm)->Cancel(ids[i]).ok());
    EXPECT_EQ((*jm)->size(), 5u);  // 3 ended + 2 pending
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ((*jm)->Get(ids[i]).status().code(), absl::StatusCode::kNotFound) << i;
    for (int i = 3; i < 8; ++i) EXPECT_TRUE((*jm)->Get(ids[i]).ok()) << i;
  }
  o.retain_ended_jobs = 1;  // applied at Open
  {
    auto jm = JobManager::Open(o);
    ASSERT_TRUE(jm.ok());
    EXPECT_EQ((*jm)->size(), 3u);
    EXPECT_TRUE((*jm)->Get(ids[5]).ok());
  }
  o.retain_ended_age = std::chrono::seconds(1);
  o.retain_ended_jobs = 100;
  auto jm = JobManager::Open(o);
  ASSERT_TRUE(jm.ok());
  ASSERT_TRUE((*jm)->Cancel(ids[6]).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  (*jm)->ApplyRetention();  // ids[5] and ids[6] ended more than 1 s ago (ids[5] maybe gone at Open)
  EXPECT_EQ((*jm)->Get(ids[5]).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*jm)->Get(ids[6]).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*jm)->size(), 1u);
  EXPECT_TRUE((*jm)->Get(ids[7]).ok());  // pending: never removed
}

// ---- cancel with a save, resume ----------------------------------------------------------------

// A RUNNING job's step event after `step` steps of 4 x 16 tokens.
v1::JobEvent StepDone(int64_t step) {
  v1::JobEvent ev;
  ev.set_step(step);
  ev.set_loss(2.0);
  ev.set_val_loss(std::numeric_limits<double>::quiet_NaN());
  ev.set_tokens(step * 64);
  return ev;
}

// Commits a one-rank checkpoint of `job` after `step` steps under root (as the step driver does).
void CommitStep(const std::string& root, const v1::Job& job, int64_t step) {
  CheckpointStore store(root, job.job_id());
  auto dir = store.Prepare(step);
  ASSERT_TRUE(dir.ok()) << dir.status();
  std::ofstream(*dir + "/rank-0.ckpt") << "0123456789";
  v1::CheckpointManifest m;
  m.set_format_version(CheckpointStore::kFormatVersion);
  m.set_job_id(job.job_id());
  m.set_step(step);
  m.set_world_size(1);
  m.set_tokens(step * 64);
  *m.mutable_spec() = job.spec();
  auto* f = m.add_files();
  f->set_rank(0);
  f->set_file("rank-0.ckpt");
  f->set_bytes(10);
  ASSERT_TRUE(store.Commit(m).ok());
}

// Cancel with a save waits while the job runs: the next step asks for the checkpoint, and the job
// ends when the step driver finishes it after the save.
TEST(JobManagerResume, CancelWithASaveWaitsForTheStepDriver) {
  TempDir dir;
  const std::string train = WriteTokens(dir, "train.bin");
  auto jm = JobManager::Open(JobManagerOptions());
  ASSERT_TRUE(jm.ok()) << jm.status();
  v1::JobSpec spec = SmallSpec(train, 1, 100);
  spec.mutable_checkpoint()->set_dir(dir.File("ck"));
  auto job = (*jm)->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  ASSERT_TRUE((*jm)->MarkStarting(id, {"w-1"}).ok());
  ASSERT_TRUE((*jm)->MarkRunning(id).ok());
  ASSERT_TRUE((*jm)->RecordStep(id, StepDone(1)).ok());
  absl::StatusOr<v1::Job> cancelled;
  std::thread canceller([&] { cancelled = (*jm)->Cancel(id, /*save=*/true); });
  ASSERT_TRUE(WaitFor([&] { return (*jm)->CancelRequested(id); }));
  EXPECT_FALSE((*jm)->IsTerminal(id)) << "cancelled before its save";
  bool requested = false;
  ASSERT_TRUE((*jm)->RecordStep(id, StepDone(2), &requested).ok());
  EXPECT_TRUE(requested) << "the cancel did not ask for a checkpoint after the step in progress";
  ASSERT_TRUE((*jm)->Finish(id, v1::JOB_STATE_CANCELLED, "cancelled by user after step 2").ok());
  canceller.join();
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(cancelled->step(), 2);
  EXPECT_FALSE((*jm)->CancelRequested(id));

  // Without a checkpoint.dir there is nothing to save: cancelled at once, saying why.
  v1::JobSpec bare = SmallSpec(train, 1, 100);
  auto other = (*jm)->Submit("", bare);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE((*jm)->MarkStarting(other->job_id(), {"w-2"}).ok());
  ASSERT_TRUE((*jm)->MarkRunning(other->job_id()).ok());
  auto now = (*jm)->Cancel(other->job_id(), /*save=*/true);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(now->reason(), "cancelled by user; no checkpoint saved: the job has no checkpoint.dir");
}

// Resume: the same job, PENDING again from its own newest checkpoint, its events continuing, its
// lease renewed, a fresh restart budget; kept across a coordinator restart.
TEST(JobManagerResume, ContinuesTheSameJobFromItsNewestCheckpoint) {
  TempDir dir;
  const std::string train = WriteTokens(dir, "train.bin");
  JobManagerOptions o;
  o.state_db = dir.File("state.db");
  std::string id;
  int64_t last_seq = 0;
  {
    auto jm = JobManager::Open(o);
    ASSERT_TRUE(jm.ok()) << jm.status();
    v1::JobSpec spec = SmallSpec(train, 1, 100);
    spec.mutable_checkpoint()->set_dir(dir.File("ck"));
    spec.set_max_restarts(2);
    auto job = (*jm)->Submit("", spec, "alice");
    ASSERT_TRUE(job.ok()) << job.status();
    id = job->job_id();
    ASSERT_TRUE((*jm)->MarkStarting(id, {"w-1"}).ok());
    ASSERT_TRUE((*jm)->MarkRunning(id).ok());
    for (int64_t k = 1; k <= 3; ++k) ASSERT_TRUE((*jm)->RecordStep(id, StepDone(k)).ok());
    ASSERT_TRUE((*jm)->MarkRecovering(id, "rank 0 lost", 2).ok());
    ASSERT_TRUE((*jm)->MarkStarting(id, {"w-1"}).ok());
    ASSERT_TRUE((*jm)->MarkRunning(id).ok());
    // Step 7 is trained but not saved: the resume goes back to step 6.
    for (int64_t k = 1; k <= 7; ++k) ASSERT_TRUE((*jm)->RecordStep(id, StepDone(k)).ok());
    auto running = (*jm)->Get(id);
    EXPECT_EQ((*jm)->Resume(id).status().code(), absl::StatusCode::kFailedPrecondition);
    CommitStep(dir.File("ck"), *running, 4);
    CommitStep(dir.File("ck"), *running, 6);
    ASSERT_TRUE((*jm)->Cancel(id).ok());
    (*jm)->RunJoined(id);
    EXPECT_EQ((*CheckpointStore(dir.File("ck")).Owner())->lease().expires(), 0) << "not released";
    auto ended = (*jm)->RecentEvents(id, 1);
    ASSERT_TRUE(ended.ok());
    last_seq = ended->back().seq();

    auto resumed = (*jm)->Resume(id);
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    EXPECT_EQ(resumed->job_id(), id);
    EXPECT_EQ(resumed->owner(), "alice");
    EXPECT_EQ(resumed->state(), v1::JOB_STATE_PENDING);
    EXPECT_EQ(resumed->step(), 6);
    EXPECT_EQ(resumed->tokens(), 6 * 64);
    EXPECT_EQ(resumed->restarts(), 0);
    EXPECT_EQ(resumed->resumes(), 1);
    EXPECT_EQ(resumed->end_time(), 0);
    auto ev = (*jm)->RecentEvents(id, 1);
    ASSERT_TRUE(ev.ok());
    EXPECT_EQ(ev->back().seq(), last_seq + 1);
    EXPECT_EQ(ev->back().step(), 6);
    EXPECT_EQ(ev->back().message().rfind("resumed (resume 1) from " + dir.File("ck") + "/step-6 (step 6)", 0), 0u)
        << ev->back().message();
    // The job's own lease again (no take-over: OWNER still names it).
    auto owner = CheckpointStore(dir.File("ck")).Owner();
    ASSERT_TRUE(owner.ok() && owner->has_value());
    EXPECT_EQ((*owner)->owner().job_id(), id);
    EXPECT_GT((*owner)->lease().expires(), NowSeconds());
    EXPECT_EQ((*owner)->previous_size(), 0) << "a take-over was recorded";
    // Pending for the scheduler, and not resumable twice.
    ASSERT_EQ((*jm)->PendingJobs().size(), 1u);
    EXPECT_EQ((*jm)->Resume(id).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  auto jm = JobManager::Open(o);
  ASSERT_TRUE(jm.ok()) << jm.status();
  auto again = (*jm)->Get(id);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(again->resumes(), 1);
  EXPECT_EQ(again->step(), 6);
}

// A job cancelled without a save while its run still unwinds (e.g. in a checkpoint commit) is not
// resumed until that run is joined: a second run beside it would share its workers and directory.
TEST(JobManagerResume, RefusedWhileTheLastRunIsStillStopping) {
  TempDir dir;
  const std::string train = WriteTokens(dir, "train.bin");
  auto jm = JobManager::Open(JobManagerOptions());
  ASSERT_TRUE(jm.ok()) << jm.status();
  v1::JobSpec spec = SmallSpec(train, 1, 100);
  spec.mutable_checkpoint()->set_dir(dir.File("ck"));
  auto job = (*jm)->Submit("", spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  ASSERT_TRUE((*jm)->MarkStarting(id, {"w-1"}).ok());
  ASSERT_TRUE((*jm)->MarkRunning(id).ok());
  for (int64_t k = 1; k <= 2; ++k) ASSERT_TRUE((*jm)->RecordStep(id, StepDone(k)).ok());
  CommitStep(dir.File("ck"), *(*jm)->Get(id), 2);
  auto cancelled = (*jm)->Cancel(id);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  ASSERT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);

  auto early = (*jm)->Resume(id);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(early.status().message(),
            "resume: job " + id +
                " is still stopping (its last run has not ended); try again in a moment");
  auto unchanged = (*jm)->Get(id);
  ASSERT_TRUE(unchanged.ok());
  EXPECT_EQ(unchanged->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(unchanged->resumes(), 0);
  EXPECT_TRUE((*jm)->PendingJobs().empty());

  (*jm)->RunJoined(id);  // the run has ended
  auto resumed = (*jm)->Resume(id);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(resumed->step(), 2);
  EXPECT_EQ(resumed->resumes(), 1);
}

// A generation that fails after a Cancel with save asked for a checkpoint (and before the save):
// the job is cancelled, saying why nothing was saved, and the waiting Cancel returns; it is not
// restarted (MarkRecovering) nor left FAILED (Finish).
TEST(JobManagerResume, AFailureBeforeTheCancelsSaveCancelsTheJob) {
  TempDir dir;
  const std::string train = WriteTokens(dir, "train.bin");
  auto jm = JobManager::Open(JobManagerOptions());
  ASSERT_TRUE(jm.ok()) << jm.status();
  for (const bool recoverable : {true, false}) {
    SCOPED_TRACE(recoverable ? "MarkRecovering" : "Finish FAILED");
    v1::JobSpec spec = SmallSpec(train, 1, 100);
    spec.mutable_checkpoint()->set_dir(dir.File(recoverable ? "ck-1" : "ck-2"));
    spec.set_max_restarts(3);
    auto job = (*jm)->Submit("", spec);
    ASSERT_TRUE(job.ok()) << job.status();
    const std::string id = job->job_id();
    ASSERT_TRUE((*jm)->MarkStarting(id, {"w-1"}).ok());
    ASSERT_TRUE((*jm)->MarkRunning(id).ok());
    ASSERT_TRUE((*jm)->RecordStep(id, StepDone(1)).ok());
    // Bounded: a cancel that is lost would otherwise wait for the job to end.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    absl::StatusOr<v1::Job> cancelled;
    std::thread canceller([&] {
      cancelled = (*jm)->Cancel(id, /*save=*/true,
                                [&] { return std::chrono::steady_clock::now() > until; });
    });
    ASSERT_TRUE(WaitFor([&] { return (*jm)->CancelRequested(id); }));
    if (recoverable) {
      auto restarted = (*jm)->MarkRecovering(id, "rank 0 lost", 3);
      EXPECT_EQ(restarted.status().code(), absl::StatusCode::kFailedPrecondition);
    } else {
      EXPECT_TRUE((*jm)->Finish(id, v1::JOB_STATE_FAILED, "rank 0 lost").ok());
    }
    canceller.join();
    ASSERT_TRUE(cancelled.ok()) << cancelled.status();
    EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
    EXPECT_EQ(cancelled->reason(), "cancelled by user; no checkpoint saved: rank 0 lost");
    auto now = (*jm)->Get(id);
    ASSERT_TRUE(now.ok());
    EXPECT_EQ(now->state(), v1::JOB_STATE_CANCELLED);
    EXPECT_EQ(now->restarts(), 0);
    EXPECT_FALSE((*jm)->CancelRequested(id));
    EXPECT_TRUE((*jm)->PendingJobs().empty()) << "the job waits to be restarted";
    (*jm)->RunJoined(id);
  }
}

}  // namespace
}  // namespace fsdp8::coord
