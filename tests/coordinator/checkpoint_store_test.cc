// CheckpointStore: MANIFEST round trip, committed vs uncommitted directories, retention, damaged
// files, resume compatibility.
#include "coordinator/checkpoint_store.h"

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <chrono>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/spec.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "tests/coordinator/test_util.h"

namespace fsdp8::coord {
namespace {

namespace fs = std::filesystem;
using fsdp8::testing::TempDir;

void WriteBytes(const std::string& path, size_t n) {
  std::ofstream out(path, std::ios::binary);
  out << std::string(n, 'x');
}

// Writes rank files of `bytes` each into step_dir and returns their manifest.
v1::CheckpointManifest Save(const CheckpointStore& store, int64_t step, int world, size_t bytes = 64) {
  auto dir = store.Prepare(step);
  EXPECT_TRUE(dir.ok()) << dir.status();
  v1::CheckpointManifest m;
  m.set_job_id("job-1");
  m.set_step(step);
  m.set_world_size(world);
  *m.mutable_spec() = WithDefaults(v1::JobSpec(), world);
  m.set_time(1700000000.5);
  for (int r = 0; r < world; ++r) {
    const std::string f = absl::StrCat("rank-", r, ".ckpt");
    WriteBytes(*dir + "/" + f, bytes + r);
    auto* cf = m.add_files();
    cf->set_rank(r);
    cf->set_file(f);
    cf->set_bytes(static_cast<int64_t>(bytes + r));
    cf->set_crc32(0xdeadbeef + r);
  }
  return m;
}

std::vector<int64_t> Steps(const CheckpointStore& store) {
  std::vector<int64_t> out;
  auto l = store.List();
  EXPECT_TRUE(l.ok()) << l.status();
  for (const auto& c : *l) out.push_back(c.step);
  return out;
}

TEST(CheckpointStore, ManifestRoundTrip) {
  TempDir tmp;
  CheckpointStore store(tmp.File("ckpt"));
  v1::CheckpointManifest m = Save(store, 20, 2);
  EXPECT_FALSE(fs::exists(store.StepDir(20) + "/MANIFEST"));
  ASSERT_TRUE(store.Commit(m).ok());
  EXPECT_TRUE(fs::exists(store.StepDir(20) + "/MANIFEST"));
  EXPECT_FALSE(fs::exists(store.StepDir(20) + "/MANIFEST.tmp"));
  auto c = CheckpointStore::Open(store.StepDir(20));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->step, 20);
  EXPECT_EQ(c->bytes(), 64 + 65);
  m.set_format_version(CheckpointStore::kFormatVersion);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(c->manifest, m))
      << c->manifest.DebugString();
  // JSON with the proto field names.
  std::ifstream in(store.StepDir(20) + "/MANIFEST");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(absl::StrContains(text, "\"format_version\": 1")) << text;
  EXPECT_TRUE(absl::StrContains(text, "\"world_size\": 2")) << text;
  auto latest = store.Latest();
  ASSERT_TRUE(latest.ok() && latest->has_value());
  EXPECT_EQ((*latest)->step, 20);
  // Trailing separator accepted.
  EXPECT_TRUE(CheckpointStore::Open(store.StepDir(20) + "/").ok());
}

// Saving a step that is already committed (a job resumed from an older checkpoint) must leave
// the committed one intact and loadable until the new save commits: through a save that never
// commits (a crash), one that is abandoned (a failed save), and then one that commits.
TEST(CheckpointStore, ResavingACommittedStepKeepsItUntilTheNewCommit) {
  TempDir tmp;
  CheckpointStore store(tmp.File("ckpt"));
  ASSERT_TRUE(store.Commit(Save(store, 10, 2, 64)).ok());
  auto bytes_of_step10 = [&] {
    auto c = CheckpointStore::Open(store.StepDir(10));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? c->bytes() : -1;
  };
  ASSERT_EQ(bytes_of_step10(), 64 + 65);
  // A new save of step 10 goes elsewhere; the committed files are not touched meanwhile.
  v1::CheckpointManifest m = Save(store, 10, 2, 200);
  EXPECT_EQ(bytes_of_step10(), 64 + 65);
  EXPECT_EQ(fs::file_size(store.StepDir(10) + "/rank-0.ckpt"), 64u);
  auto latest = store.Latest();
  ASSERT_TRUE(latest.ok() && latest->has_value());
  EXPECT_EQ((*latest)->step, 10);
  // Abandoned (a failed save): the committed checkpoint survives.
  ASSERT_TRUE(store.Abandon(10).ok());
  EXPECT_EQ(bytes_of_step10(), 64 + 65);
  EXPECT_FALSE(fs::exists(store.StagingDir(10)));
  // Saved again and committed: step 10 now holds the new files, and nothing is left over.
  m = Save(store, 10, 2, 300);
  ASSERT_TRUE(store.Commit(m).ok());
  EXPECT_EQ(bytes_of_step10(), 300 + 301);
  EXPECT_FALSE(fs::exists(store.StagingDir(10)));
  EXPECT_EQ(Steps(store), std::vector<int64_t>{10});
  // A leftover staging directory (a crash before the commit) is cleaned by retention.
  Save(store, 10, 2, 50);
  ASSERT_TRUE(fs::exists(store.StagingDir(10)));
  auto removed = store.Retain(3);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_FALSE(fs::exists(store.StagingDir(10)));
  EXPECT_EQ(bytes_of_step10(), 300 + 301);
}

TEST(CheckpointStore, InvalidManifestRefusedOnCommit) {
  TempDir tmp;
  CheckpointStore store(tmp.path());
  v1::CheckpointManifest m = Save(store, 1, 2);
  m.mutable_files(1)->set_rank(0);
  EXPECT_EQ(store.Commit(m).code(), absl::StatusCode::kInvalidArgument);
  m = Save(store, 1, 2);
  m.mutable_files(0)->set_file("../escape");
  EXPECT_EQ(store.Commit(m).code(), absl::StatusCode::kInvalidArgument);
  m = Save(store, 1, 2);
  m.set_world_size(3);
  EXPECT_EQ(store.Commit(m).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Steps(store).empty());
}

TEST(CheckpointStore, UncommittedDirectoriesAreIgnored) {
  TempDir tmp;
  CheckpointStore store(tmp.path());
  EXPECT_TRUE(Steps(store).empty());
  EXPECT_TRUE(CheckpointStore(tmp.File("missing")).List()->empty());
  ASSERT_TRUE(store.Commit(Save(store, 5, 1)).ok());
  Save(store, 10, 1);  // files written, never committed
  fs::create_directories(tmp.File("step-12"));
  WriteBytes(tmp.File("step-12/MANIFEST"), 10);  // torn manifest
  fs::create_directories(tmp.File("notes"));
  fs::create_directories(tmp.File("step-x"));
  EXPECT_EQ(Steps(store), (std::vector<int64_t>{5}));
  EXPECT_EQ((*store.Latest())->step, 5);
  auto s10 = CheckpointStore::Open(tmp.File("step-10"));
  EXPECT_EQ(s10.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(s10.status().message(), "no MANIFEST")) << s10.status();
  auto s12 = CheckpointStore::Open(tmp.File("step-12"));
  EXPECT_EQ(s12.status().code(), absl::StatusCode::kDataLoss) << s12.status();
  EXPECT_EQ(CheckpointStore::Open(tmp.File("step-99")).status().code(),
            absl::StatusCode::kNotFound);
  // A manifest copied under the wrong step name is not a checkpoint of that step.
  fs::create_directories(tmp.File("step-7"));
  fs::copy_file(tmp.File("step-5/MANIFEST"), tmp.File("step-7/MANIFEST"));
  EXPECT_EQ(Steps(store), (std::vector<int64_t>{5}));
  // Re-preparing a committed step stages the new save elsewhere: step 5 stays committed.
  auto staged = store.Prepare(5);
  ASSERT_TRUE(staged.ok());
  EXPECT_EQ(*staged, store.StagingDir(5));
  EXPECT_EQ(Steps(store), (std::vector<int64_t>{5}));
}

TEST(CheckpointStore, RetentionKeepsNewestAndDropsStaleSaves) {
  TempDir tmp;
  CheckpointStore store(tmp.path());
  for (int64_t k : {10, 20, 30, 40}) ASSERT_TRUE(store.Commit(Save(store, k, 2)).ok());
  Save(store, 25, 2);  // abandoned save older than the newest committed one
  Save(store, 50, 2);  // a save in progress (newer): must stay
  fs::create_directories(tmp.File("keepme"));
  auto removed = store.Retain(2);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, (std::vector<std::string>{tmp.File("step-10"), tmp.File("step-20"),
                                                tmp.File("step-25")}));
  EXPECT_EQ(Steps(store), (std::vector<int64_t>{30, 40}));
  EXPECT_TRUE(fs::exists(tmp.File("step-50/rank-0.ckpt")));
  EXPECT_TRUE(fs::exists(tmp.File("keepme")));
  EXPECT_FALSE(fs::exists(tmp.File("step-10")));
  EXPECT_EQ(store.Retain(0).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(store.Retain(1).ok());
  EXPECT_EQ(Steps(store), (std::vector<int64_t>{40}));
}

TEST(CheckpointStore, DamagedFileDetectedOnOpen) {
  TempDir tmp;
  CheckpointStore store(tmp.path());
  ASSERT_TRUE(store.Commit(Save(store, 3, 2)).ok());
  ASSERT_TRUE(CheckpointStore::Open(store.StepDir(3)).ok());
  WriteBytes(store.StepDir(3) + "/rank-1.ckpt", 10);  // truncated
  auto c = CheckpointStore::Open(store.StepDir(3));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(c.status().message(), "is damaged: rank 1 file rank-1.ckpt has 10 "
                                                      "bytes, the MANIFEST records 65"))
      << c.status();
  fs::remove(store.StepDir(3) + "/rank-0.ckpt");
  c = CheckpointStore::Open(store.StepDir(3));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(c.status().message(), "rank 0 file rank-0.ckpt")) << c.status();
  // Listing reads manifests only: still listed, refused only when opened for loading.
  EXPECT_EQ(Steps(store), (std::vector<int64_t>{3}));
}

TEST(CheckpointStore, ResumeCompatibility) {
  v1::JobSpec a = WithDefaults(v1::JobSpec(), 1);
  v1::JobSpec b = a;
  b.mutable_training()->set_global_batch(64);
  b.mutable_sharding()->set_max_workers(8);
  EXPECT_TRUE(CheckpointStore::CheckResumeCompatible(a, b, "/c/step-1").ok());
  b.mutable_model()->set_d_model(256);
  auto s = CheckpointStore::CheckResumeCompatible(a, b, "/c/step-1");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "/c/step-1 was written with a different model")) << s;
  b = a;
  b.mutable_precision()->set_linears(v1::PRECISION_BF16);
  s = CheckpointStore::CheckResumeCompatible(a, b, "/c/step-1");
  EXPECT_TRUE(absl::StrContains(s.message(), "different precision")) << s;
}

// A job with rowwise / blockwise blocks resumes a checkpoint of tensorwise blocks (the worker maps
// the tensors across layouts); not the other way round, and every other precision difference
// still refuses.
TEST(CheckpointStore, ResumeCompatibilityAcrossGranularity) {
  const v1::JobSpec tensorwise = WithDefaults(v1::JobSpec(), 1);  // delayed, hybrid
  v1::JobSpec blockwise_in;
  blockwise_in.mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  const v1::JobSpec blockwise = WithDefaults(blockwise_in, 1);  // current, e4m3
  EXPECT_TRUE(CheckpointStore::CheckResumeCompatible(blockwise, tensorwise, "/c/step-1").ok());
  auto s = CheckpointStore::CheckResumeCompatible(tensorwise, blockwise, "/c/step-1");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "different precision")) << s;
  // Rowwise and blockwise lay the same blocks out alike: either resumes the other.
  v1::JobSpec rowwise_in;
  rowwise_in.mutable_precision()->mutable_fp8()->set_granularity(v1::FP8_GRANULARITY_ROWWISE);
  const v1::JobSpec rowwise = WithDefaults(rowwise_in, 1);
  EXPECT_TRUE(CheckpointStore::CheckResumeCompatible(rowwise, blockwise, "/c/step-1").ok());
  EXPECT_TRUE(CheckpointStore::CheckResumeCompatible(blockwise, rowwise, "/c/step-1").ok());
  // Other precision fields still have to match.
  v1::JobSpec bf16_head = blockwise;
  bf16_head.mutable_precision()->set_lm_head(v1::PRECISION_FP32);
  s = CheckpointStore::CheckResumeCompatible(bf16_head, tensorwise, "/c/step-1");
  EXPECT_TRUE(absl::StrContains(s.message(), "different precision")) << s;
  // One blockwise block among tensorwise ones: the tensorwise blocks' scaling state is loaded, so
  // their recipe and format must match.
  v1::JobSpec one = tensorwise;
  auto* o = one.mutable_precision()->add_overrides();
  o->set_layer(1);
  o->set_linears(v1::PRECISION_FP8);
  o->set_granularity(v1::FP8_GRANULARITY_BLOCKWISE);
  v1::JobSpec saved_one = tensorwise;
  auto* so = saved_one.mutable_precision()->add_overrides();
  so->set_layer(1);
  so->set_linears(v1::PRECISION_FP8);
  EXPECT_TRUE(CheckpointStore::CheckResumeCompatible(one, saved_one, "/c/step-1").ok());
  one.mutable_precision()->mutable_fp8()->set_format(v1::FP8_FORMAT_E4M3);
  s = CheckpointStore::CheckResumeCompatible(one, saved_one, "/c/step-1");
  EXPECT_TRUE(absl::StrContains(s.message(), "different precision")) << s;
}

// ---- Ownership ----

v1::CheckpointOwnerEntry Claimant(const std::string& job, const std::string& user = "") {
  v1::CheckpointOwnerEntry e;
  e.set_job_id(job);
  e.set_user(user);
  e.set_since(1700000000);
  return e;
}

// Save() of job `job` through a store that writes for it, committed.
void CommitAs(const std::string& root, const std::string& job, int64_t step) {
  CheckpointStore store(root, job);
  v1::CheckpointManifest m = Save(store, step, 1);
  m.set_job_id(job);
  ASSERT_TRUE(store.Commit(m).ok()) << job << " step " << step;
}

// Every file under root and its bytes.
std::map<std::string, std::string> Snapshot(const std::string& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    out[e.path().string()] = std::string((std::istreambuf_iterator<char>(in)), {});
  }
  return out;
}

TEST(CheckpointStore, ClaimRecordsTheOwnerAndRefusesAnotherJob) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  CheckpointStore store(root);
  ASSERT_TRUE(store.Claim(Claimant("job-a", "alice"), false, nullptr).ok());
  auto owner = store.Owner();
  ASSERT_TRUE(owner.ok() && owner->has_value()) << owner.status();
  EXPECT_EQ((*owner)->owner().job_id(), "job-a");
  EXPECT_EQ((*owner)->owner().user(), "alice");
  EXPECT_TRUE(fs::exists(root + "/OWNER.lock"));
  // The same job again (a restart): fine, nothing changes.
  EXPECT_TRUE(store.Claim(Claimant("job-a", "alice"), false, nullptr).ok());
  // Another job: refused, naming the owner and the way out.
  absl::Status s = store.Claim(Claimant("job-b", "bob"), false, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "belongs to job job-a (user alice)")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "checkpoint.take_over")) << s;
  // Take-over: the check decides.
  s = store.Claim(Claimant("job-b", "bob"), true, [](const v1::CheckpointOwnerEntry& o) {
    return absl::FailedPreconditionError("still running: " + o.job_id());
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "still running: job-a");
  EXPECT_EQ((*store.Owner())->owner().job_id(), "job-a");
  v1::CheckpointOwnerEntry b = Claimant("job-b", "bob");
  b.set_since(1700000100);
  ASSERT_TRUE(store.Claim(b, true, [](const v1::CheckpointOwnerEntry&) {
                     return absl::OkStatus();
                   }).ok());
  owner = store.Owner();
  ASSERT_TRUE(owner.ok() && owner->has_value());
  EXPECT_EQ((*owner)->owner().job_id(), "job-b");
  ASSERT_EQ((*owner)->previous_size(), 1);
  EXPECT_EQ((*owner)->previous(0).job_id(), "job-a");
  EXPECT_EQ((*owner)->previous(0).until(), 1700000100);
}

TEST(CheckpointStore, TheOldOwnerNeverWritesAgain) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-a"), false, nullptr).ok());
  CommitAs(root, "job-a", 2);
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-b"), true, nullptr).ok());
  CheckpointStore old(root, "job-a");
  for (absl::Status s : {old.Prepare(4).status(), old.Retain(1).status(), old.Abandon(2)}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "belongs to job job-b")) << s;
  }
  EXPECT_FALSE(fs::exists(root + "/step-4"));
  EXPECT_TRUE(fs::exists(root + "/step-2/MANIFEST"));
}

// Retention and abandoned saves of the new owner never delete the old owner's steps or leftovers.
TEST(CheckpointStore, RetentionNeverDeletesAnotherJobsSteps) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-a"), false, nullptr).ok());
  for (int64_t k : {1, 2, 3}) CommitAs(root, "job-a", k);
  // job-a's abandoned save of step 4 (prepared, never committed).
  ASSERT_TRUE(CheckpointStore(root, "job-a").Prepare(4).ok());
  WriteBytes(root + "/step-4/rank-0.ckpt", 10);
  const auto before = Snapshot(root);
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-b"), true, nullptr).ok());
  CheckpointStore b(root, "job-b");
  for (int64_t k : {5, 6, 7}) {
    CommitAs(root, "job-b", k);
    auto removed = b.Retain(1);
    ASSERT_TRUE(removed.ok()) << removed.status();
  }
  // job-b's own save of step 8 abandoned, then 9 committed: its leftover goes, job-a's stay.
  ASSERT_TRUE(b.Prepare(8).ok());
  ASSERT_TRUE(b.Prepare(10).ok());
  ASSERT_TRUE(b.Abandon(10).ok());
  EXPECT_FALSE(fs::exists(root + "/step-10"));
  ASSERT_TRUE(b.Abandon(4).ok());  // job-a's unfinished save: not b's to remove
  CommitAs(root, "job-b", 9);
  ASSERT_TRUE(b.Retain(1).ok());
  EXPECT_EQ(Steps(CheckpointStore(root)), (std::vector<int64_t>{1, 2, 3, 9}));
  EXPECT_FALSE(fs::exists(root + "/step-8"));
  EXPECT_FALSE(fs::exists(root + "/step-5"));
  const auto now = Snapshot(root);
  for (const auto& [path, bytes] : before) {
    if (absl::EndsWith(path, "/OWNER")) continue;  // the take-over rewrote the record
    ASSERT_TRUE(now.count(path)) << path << " was deleted";
    EXPECT_EQ(now.at(path), bytes) << path << " changed";
  }
  // The store without a job id lists every job's; with one, that job's only.
  auto of_a = CheckpointStore(root).List("job-a");
  ASSERT_TRUE(of_a.ok());
  EXPECT_EQ(of_a->size(), 3u);
  auto latest_b = CheckpointStore(root).Latest("job-b");
  ASSERT_TRUE(latest_b.ok() && latest_b->has_value());
  EXPECT_EQ((*latest_b)->step, 9);
}

// A directory from before OWNER records: its checkpoints' job owns it.
TEST(CheckpointStore, ADirectoryWithoutOwnerBelongsToItsCheckpointsJob) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  CheckpointStore legacy(root);
  v1::CheckpointManifest m = Save(legacy, 3, 1);  // job-1's
  ASSERT_TRUE(legacy.Commit(m).ok());
  absl::Status s = CheckpointStore(root).Claim(Claimant("job-2"), false, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "belongs to job job-1")) << s;
  s = CheckpointStore(root, "job-2").Prepare(4).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  // Its own job claims it at its first save (a job submitted before OWNER records).
  EXPECT_TRUE(CheckpointStore(root, "job-1").Prepare(4).ok());
  EXPECT_EQ((*CheckpointStore(root).Owner())->owner().job_id(), "job-1");
}

// A new owner never writes into a step directory holding another job's committed checkpoint:
// Prepare refuses, naming it, and an abandoned save of that step leaves it as it was.
TEST(CheckpointStore, PrepareNeverWritesIntoAnotherJobsCommittedStep) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-a"), false, nullptr).ok());
  for (int64_t k : {2, 4}) CommitAs(root, "job-a", k);
  const auto before = Snapshot(root);
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-b"), true, nullptr).ok());
  CheckpointStore b(root, "job-b");
  auto dir = b.Prepare(4);
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kAlreadyExists) << dir.status();
  EXPECT_TRUE(absl::StrContains(dir.status().message(),
                                root + "/step-4 holds the committed checkpoint of job job-a"))
      << dir.status();
  EXPECT_TRUE(b.Abandon(4).ok());
  EXPECT_FALSE(fs::exists(b.StagingDir(4)));
  // job-a's unfinished save of step 6 is a leftover: job-b's save of step 6 replaces it.
  ASSERT_TRUE(fs::create_directories(root + "/step-6"));
  {
    std::ofstream(root + "/step-6/JOB") << "job-a\n";
  }
  WriteBytes(root + "/step-6/rank-0.ckpt", 5);
  CommitAs(root, "job-b", 6);
  EXPECT_EQ(Steps(CheckpointStore(root)), (std::vector<int64_t>{2, 4, 6}));
  EXPECT_EQ(CheckpointStore(root).List("job-b")->size(), 1u);
  const auto now = Snapshot(root);
  for (const auto& [path, bytes] : before) {
    if (absl::EndsWith(path, "/OWNER")) continue;
    ASSERT_TRUE(now.count(path)) << path << " was deleted";
    EXPECT_EQ(now.at(path), bytes) << path << " changed";
  }
}

// A take-over lists the committed steps of other jobs its saves would hit (and will skip): those
// after the step it starts from, up to its last; none when it starts after the newest one
// (resume_from latest). Uncommitted directories are not listed (a save replaces them).
TEST(CheckpointStore, TakeOverListsTheEarlierOwnersStepsItsSavesWillSkip) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-a"), false, nullptr).ok());
  for (int64_t k : {4, 6, 8}) CommitAs(root, "job-a", k);
  ASSERT_TRUE(fs::create_directories(root + "/step-10"));  // uncommitted
  std::vector<std::string> skipped;
  CheckpointStore::ClaimOptions o;
  o.take_over = true;
  o.saves_after = 5;
  o.last_save = 12;
  o.skipped = &skipped;
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-b"), o).ok());
  EXPECT_EQ(skipped, (std::vector<std::string>{"step-6 (job job-a)", "step-8 (job job-a)"}));
  EXPECT_EQ((*CheckpointStore(root).Owner())->owner().job_id(), "job-b");
  CommitAs(root, "job-b", 12);
  o.saves_after = 0;
  o.last_save = 20;
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-c"), o).ok());
  EXPECT_EQ(skipped, (std::vector<std::string>{"step-4 (job job-a)", "step-6 (job job-a)",
                                                "step-8 (job job-a)", "step-12 (job job-b)"}));
  o.saves_after_latest = true;  // after step 12
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-d"), o).ok());
  EXPECT_TRUE(skipped.empty());
  EXPECT_EQ((*CheckpointStore(root).Owner())->owner().job_id(), "job-d");
}

// The owner's coordinator holds a lease: another coordinator's take-over is refused while it is
// live (whatever its own check says), allowed once released or expired; the holder renews it
// whatever the expiry (a restart), another coordinator cannot.
TEST(CheckpointStore, ALiveLeaseOfAnotherCoordinatorRefusesATakeOver) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  CheckpointStore store(root);
  CheckpointStore::ClaimOptions first;
  first.coordinator = "coord-1";
  first.lease_s = 60;
  ASSERT_TRUE(store.Claim(Claimant("job-a"), first).ok());
  auto owner = store.Owner();
  ASSERT_TRUE(owner.ok() && owner->has_value());
  EXPECT_EQ((*owner)->lease().coordinator(), "coord-1");
  EXPECT_GT((*owner)->lease().expires(), (*owner)->lease().renewed() + 59);
  EXPECT_FALSE((*owner)->lease().host().empty());

  CheckpointStore::ClaimOptions second;
  second.take_over = true;
  second.coordinator = "coord-2";
  second.lease_s = 60;
  second.may_take_over = [](const v1::CheckpointOwnerEntry&) { return absl::OkStatus(); };
  absl::Status s = store.Claim(Claimant("job-b"), second);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "checkpoint.dir " + root + " belongs to job job-a"))
      << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "runs under another coordinator")) << s;
  // Only the holder renews; another coordinator's renewal or release changes nothing.
  EXPECT_FALSE(*store.RenewLease("job-a", "coord-2", 60));
  EXPECT_FALSE(*store.ReleaseLease("job-a", "coord-2"));
  EXPECT_FALSE(*store.RenewLease("job-x", "coord-1", 60));
  EXPECT_TRUE(*store.RenewLease("job-a", "coord-1", 0.5));  // a restarted holder re-claims
  EXPECT_EQ(store.Claim(Claimant("job-b"), second).code(), absl::StatusCode::kFailedPrecondition);
  std::this_thread::sleep_for(std::chrono::milliseconds(800));  // expired
  EXPECT_TRUE(store.Claim(Claimant("job-b"), second).ok());
  EXPECT_EQ((*store.Owner())->owner().job_id(), "job-b");
  EXPECT_EQ((*store.Owner())->lease().coordinator(), "coord-2");
  // The old holder's renewal no longer applies: the directory is job-b's.
  EXPECT_FALSE(*store.RenewLease("job-a", "coord-1", 60));
  // Released: coord-1 may take it over at once.
  ASSERT_TRUE(*store.ReleaseLease("job-b", "coord-2"));
  EXPECT_EQ((*store.Owner())->lease().expires(), 0);
  first.take_over = true;
  EXPECT_TRUE(store.Claim(Claimant("job-c"), first).ok());
  // The holder's own take-over is decided by its own check.
  ASSERT_TRUE(*store.RenewLease("job-c", "coord-1", 60));
  first.may_take_over = [](const v1::CheckpointOwnerEntry& o) {
    return absl::FailedPreconditionError("running: " + o.job_id());
  };
  EXPECT_EQ(store.Claim(Claimant("job-d"), first).message(), "running: job-c");
}

// RemoveLeftovers: uncommitted step directories (an interrupted save; a retention that removed
// the MANIFEST and some files), staging beside a committed step and an old copy of a step
// committed again go; an old copy that is the only committed one is renamed back; every committed
// file stays as it was.
TEST(CheckpointStore, RemoveLeftoversNeverTouchesACommittedStep) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  CheckpointStore store(root);
  for (int64_t k : {2, 4}) ASSERT_TRUE(store.Commit(Save(store, k, 2)).ok());
  // step-6: an interrupted save (one rank file); step-8: half-removed by retention.
  ASSERT_TRUE(fs::create_directories(root + "/step-6"));
  WriteBytes(root + "/step-6/rank-0.ckpt", 7);
  ASSERT_TRUE(store.Commit(Save(store, 8, 2)).ok());
  fs::remove(root + "/step-8/MANIFEST");
  fs::remove(root + "/step-8/rank-0.ckpt");
  // A staging directory beside committed step-2; an old copy beside committed step-4.
  ASSERT_TRUE(fs::create_directories(store.StagingDir(2)));
  WriteBytes(store.StagingDir(2) + "/rank-0.ckpt", 3);
  fs::copy(root + "/step-4", root + "/step-4.old");
  // step-10 moved aside (committed, as step-10.old) and an unfinished step-10 in its place.
  ASSERT_TRUE(store.Commit(Save(store, 10, 2)).ok());
  fs::rename(root + "/step-10", root + "/step-10.old");
  ASSERT_TRUE(fs::create_directories(root + "/step-10"));
  WriteBytes(root + "/step-10/rank-1.ckpt", 9);
  // Not step directories: never touched.
  ASSERT_TRUE(fs::create_directories(root + "/notes"));
  WriteBytes(root + "/notes/x", 1);
  std::map<std::string, std::string> committed;
  for (const auto& [path, bytes] : Snapshot(root))
    if (absl::StrContains(path, "/step-2/") || absl::StrContains(path, "/step-4/"))
      committed[path] = bytes;
  std::map<std::string, std::string> old10;
  for (const auto& [path, bytes] : Snapshot(root + "/step-10.old"))
    old10[path.substr((root + "/step-10.old").size())] = bytes;

  auto removed = store.RemoveLeftovers();
  ASSERT_TRUE(removed.ok()) << removed.status();
  std::sort(removed->begin(), removed->end());
  EXPECT_EQ(*removed, (std::vector<std::string>{
                          root + "/.replace-step-2", root + "/step-10", root + "/step-10.old",
                          root + "/step-4.old", root + "/step-6", root + "/step-8"}));
  EXPECT_EQ(Steps(store), (std::vector<int64_t>{2, 4, 10}));
  for (const char* gone : {"/step-6", "/step-8", "/.replace-step-2", "/step-4.old", "/step-10.old"})
    EXPECT_FALSE(fs::exists(root + gone)) << gone;
  EXPECT_TRUE(fs::exists(root + "/notes/x"));
  const auto now = Snapshot(root);
  for (const auto& [path, bytes] : committed) {
    ASSERT_TRUE(now.count(path)) << path << " was deleted";
    EXPECT_EQ(now.at(path), bytes) << path << " changed";
  }
  for (const auto& [rel, bytes] : old10) EXPECT_EQ(now.at(root + "/step-10" + rel), bytes) << rel;
  EXPECT_TRUE(CheckpointStore::Open(root + "/step-10").ok());
  // Nothing left to do the second time.
  EXPECT_TRUE(store.RemoveLeftovers()->empty());
}

// Retention's removal of a step directory goes MANIFEST first: a half-removed one is never
// committed, and RemoveLeftovers takes it away.
TEST(CheckpointStore, HalfRemovedStepIsUncommittedAndALeftover) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  CheckpointStore store(root);
  for (int64_t k : {1, 2}) ASSERT_TRUE(store.Commit(Save(store, k, 2)).ok());
  EXPECT_TRUE(CheckpointStore::IsCommitted(root + "/step-1"));
  fs::remove(root + "/step-1/MANIFEST");  // where retain.after_manifest_removed stops
  EXPECT_FALSE(CheckpointStore::IsCommitted(root + "/step-1"));
  EXPECT_EQ(Steps(store), (std::vector<int64_t>{2}));
  EXPECT_EQ(*store.RemoveLeftovers(), (std::vector<std::string>{root + "/step-1"}));
  EXPECT_TRUE(CheckpointStore::IsCommitted(root + "/step-2"));
  // A MANIFEST of another step (a directory renamed by hand) does not commit step-3.
  fs::copy(root + "/step-2", root + "/step-3");
  EXPECT_FALSE(CheckpointStore::IsCommitted(root + "/step-3"));
}

// Replaces `from` by `to` in <step_dir>/MANIFEST (a MANIFEST this build cannot read, or one
// naming another job).
void EditManifest(const std::string& step_dir, const std::string& from, const std::string& to) {
  const std::string path = step_dir + "/MANIFEST";
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  in.close();
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from << " not in " << path;
  text.replace(at, from.size(), to);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// A committed step directory whose MANIFEST cannot be read (a newer format_version, a torn file)
// is neither committed nor a leftover: RemoveLeftovers, Retain and Abandon keep it, Prepare skips
// its step, a take-over lists it. Only a directory with no MANIFEST at all is removed.
TEST(CheckpointStore, AnUnreadableManifestIsNeverDeleted) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-a"), false, nullptr).ok());
  for (int64_t k : {2, 4, 6}) CommitAs(root, "job-a", k);
  EditManifest(root + "/step-2", "\"format_version\": 1", "\"format_version\": 99");
  {
    const std::string path = root + "/step-4/MANIFEST";
    fs::resize_file(path, fs::file_size(path) / 2);  // torn
  }
  EXPECT_EQ(CheckpointStore::Inspect(root + "/step-2").state,
            CheckpointStore::ManifestState::kUnreadable);
  EXPECT_EQ(CheckpointStore::Inspect(root + "/step-4").state,
            CheckpointStore::ManifestState::kUnreadable);
  EXPECT_EQ(CheckpointStore::Inspect(root + "/step-6").state,
            CheckpointStore::ManifestState::kCommitted);
  EXPECT_EQ(CheckpointStore::Inspect(root + "/step-9").state,
            CheckpointStore::ManifestState::kMissing);
  // An interrupted save of job-a: no MANIFEST at all, the one leftover.
  ASSERT_TRUE(fs::create_directories(root + "/step-7"));
  WriteBytes(root + "/step-7/rank-0.ckpt", 3);
  EXPECT_EQ(CheckpointStore::Inspect(root + "/step-7").state,
            CheckpointStore::ManifestState::kMissing);
  auto before = Snapshot(root);
  for (auto it = before.begin(); it != before.end();)
    it = absl::StrContains(it->first, "/step-7/") ? before.erase(it) : std::next(it);

  CheckpointStore a(root, "job-a");
  auto removed = a.RemoveLeftovers();
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, (std::vector<std::string>{root + "/step-7"}));
  // The owner's own retention: step-2 and step-4 are not stale saves.
  CommitAs(root, "job-a", 8);
  ASSERT_TRUE(a.Retain(1).ok());
  EXPECT_TRUE(fs::exists(root + "/step-2/MANIFEST"));
  EXPECT_TRUE(fs::exists(root + "/step-4/MANIFEST"));
  EXPECT_TRUE(a.Abandon(2).ok());
  EXPECT_TRUE(a.Abandon(4).ok());
  // A later owner: the same, and its saves of those steps are skipped.
  std::vector<std::string> skipped;
  CheckpointStore::ClaimOptions o;
  o.take_over = true;
  o.last_save = 4;  // its final save would hit step-4: refused
  o.skipped = &skipped;
  absl::Status refused = CheckpointStore(root).Claim(Claimant("job-b"), o);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "step-4 (unreadable MANIFEST)")) << refused;
  o.last_save = 5;
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-b"), o).ok());
  EXPECT_EQ(skipped, (std::vector<std::string>{"step-2 (unreadable MANIFEST)",
                                                "step-4 (unreadable MANIFEST)"}));
  CheckpointStore b(root, "job-b");
  removed = b.RemoveLeftovers();
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_TRUE(removed->empty());
  for (int64_t k : {2, 4}) {
    auto dir = b.Prepare(k);
    EXPECT_EQ(dir.status().code(), absl::StatusCode::kAlreadyExists) << k << dir.status();
    EXPECT_TRUE(absl::StrContains(dir.status().message(), "cannot be read")) << dir.status();
    EXPECT_TRUE(b.Abandon(k).ok());
  }
  const auto now = Snapshot(root);
  for (const auto& [path, bytes] : before) {
    if (absl::EndsWith(path, "/OWNER") || absl::StrContains(path, "/step-6/")) continue;
    ASSERT_TRUE(now.count(path)) << path << " was deleted";
    EXPECT_EQ(now.at(path), bytes) << path << " changed";
  }
}

// step-<k>.old of another job (its only copy of step k, left by an interrupted replacement) is
// never removed because step-<k> is committed by the new owner; Prepare skips step k, a take-over
// lists it, and Commit never swaps a staged save with a step-<k> that is not the job's own.
TEST(CheckpointStore, AnotherJobsOldCopyOfAStepIsNeverDeleted) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-a"), false, nullptr).ok());
  CommitAs(root, "job-a", 3);
  fs::rename(root + "/step-3", root + "/step-3.old");
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-b"), true, nullptr).ok());
  {
    CheckpointStore untracked(root);  // job-b's step-3 beside it (no ownership checks)
    v1::CheckpointManifest m = Save(untracked, 3, 1);
    m.set_job_id("job-b");
    ASSERT_TRUE(untracked.Commit(m).ok());
  }
  const auto old = Snapshot(root + "/step-3.old");
  ASSERT_FALSE(old.empty());
  CheckpointStore b(root, "job-b");
  auto removed = b.RemoveLeftovers();
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_TRUE(removed->empty());
  EXPECT_EQ(Snapshot(root + "/step-3.old"), old);
  auto dir = b.Prepare(3);
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kAlreadyExists) << dir.status();
  EXPECT_TRUE(absl::StrContains(dir.status().message(),
                                root + "/step-3.old holds the committed checkpoint of job job-a"))
      << dir.status();
  ASSERT_TRUE(b.Retain(1).ok());
  EXPECT_EQ(Snapshot(root + "/step-3.old"), old);
  std::vector<std::string> skipped;
  CheckpointStore::ClaimOptions o;
  o.take_over = true;
  o.last_save = 5;
  o.skipped = &skipped;
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-c"), o).ok());
  EXPECT_EQ(skipped, (std::vector<std::string>{"step-3 (job job-b)", "step-3.old (job job-a)"}));
  // job-c's staged re-save of its step 5, and meanwhile step-5 names job-a: not swapped in.
  CommitAs(root, "job-c", 5);
  CheckpointStore c(root, "job-c");
  v1::CheckpointManifest m = Save(c, 5, 1);
  m.set_job_id("job-c");
  ASSERT_TRUE(fs::is_directory(c.StagingDir(5)));
  EditManifest(root + "/step-5", "\"job-c\"", "\"job-a\"");
  const auto five = Snapshot(root + "/step-5");
  absl::Status s = c.Commit(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(Snapshot(root + "/step-5"), five);
  EXPECT_EQ(CheckpointStore::ReadManifest(root + "/step-5")->job_id(), "job-a");
}

// Lease calls on a directory that is not there (storage not mounted) fail UNAVAILABLE and create
// nothing; only a claim creates the directory.
TEST(CheckpointStore, LeaseCallsNeverCreateTheDirectory) {
  TempDir tmp;
  const std::string root = tmp.File("mnt/ck");
  CheckpointStore store(root);
  auto renewed = store.RenewLease("job-a", "coord-1", 60);
  EXPECT_EQ(renewed.status().code(), absl::StatusCode::kUnavailable) << renewed.status();
  EXPECT_TRUE(absl::StrContains(renewed.status().message(), "checkpoint.dir " + root))
      << renewed.status();
  EXPECT_EQ(store.ReleaseLease("job-a", "coord-1").status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(CheckpointStore(root, "job-a").ResumeAndRemoveLeftovers("coord-1", 60).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_FALSE(fs::exists(tmp.File("mnt")));
  ASSERT_TRUE(store.Claim(Claimant("job-a"), false, nullptr).ok());
  EXPECT_TRUE(fs::exists(root + "/OWNER"));
}

// The coordinator's step driver saves only under its own lease with more than the margin left:
// a lease about to lapse, released, or another coordinator's refuses Prepare and Commit; a
// directory without OWNER is claimed with the lease, never without one.
TEST(CheckpointStore, SavesOnlyUnderALiveLeaseWithTheMarginLeft) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  CheckpointStore::ClaimOptions claim;
  claim.coordinator = "coord-1";
  claim.lease_s = 60;
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-a"), claim).ok());
  CheckpointStore::LeaseCheck lease{"coord-1", 60, 30};
  CheckpointStore a(root, "job-a", nullptr, lease);
  v1::CheckpointManifest m = Save(a, 2, 1);  // 60 s left: saves
  m.set_job_id("job-a");
  ASSERT_TRUE(a.Commit(m).ok());
  ASSERT_TRUE(a.Prepare(4).ok());
  auto refused = [&](const std::string& why) {
    absl::Status s = a.Prepare(4).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << why << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "checkpoint.dir " + root + ": the lease of job job-a"))
        << s;
    m.set_step(2);
    s = a.Commit(m);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << why << ": " << s;
  };
  ASSERT_TRUE(*CheckpointStore(root).RenewLease("job-a", "coord-1", 10));  // 10 s < 30 s margin
  refused("about to lapse");
  ASSERT_TRUE(*CheckpointStore(root).ReleaseLease("job-a", "coord-1"));
  refused("released");
  CheckpointStore::LeaseCheck other{"coord-2", 60, 30};
  EXPECT_EQ(CheckpointStore(root, "job-a", nullptr, other).Prepare(6).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(*CheckpointStore(root).RenewLease("job-a", "coord-1", 60));
  EXPECT_TRUE(a.Prepare(6).ok());
  // A directory without OWNER: the first save claims it with the lease.
  const std::string fresh = tmp.File("fresh");
  ASSERT_TRUE(fs::create_directories(fresh));
  ASSERT_TRUE(CheckpointStore(fresh, "job-b", nullptr, lease).Prepare(1).ok());
  auto owner = CheckpointStore(fresh).Owner();
  ASSERT_TRUE(owner.ok() && owner->has_value()) << owner.status();
  EXPECT_EQ((*owner)->owner().job_id(), "job-b");
  EXPECT_EQ((*owner)->lease().coordinator(), "coord-1");
  EXPECT_GT((*owner)->lease().expires(), (*owner)->lease().renewed() + 59);
}

// OWNER is written through a temporary file of the writer's own: another writer's (or a stale)
// OWNER.tmp is neither used nor in the way, and no temporary file stays behind.
TEST(CheckpointStore, OwnerIsWrittenThroughAWritersOwnTemporaryFile) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  ASSERT_TRUE(fs::create_directories(root + "/OWNER.tmp"));  // in the way of a fixed name
  WriteBytes(root + "/OWNER.tmp/x", 1);
  CheckpointStore::ClaimOptions o;
  o.coordinator = "coord-1";
  o.lease_s = 60;
  ASSERT_TRUE(CheckpointStore(root).Claim(Claimant("job-a"), o).ok());
  ASSERT_TRUE(*CheckpointStore(root).RenewLease("job-a", "coord-1", 60));
  EXPECT_EQ((*CheckpointStore(root).Owner())->owner().job_id(), "job-a");
  EXPECT_TRUE(fs::exists(root + "/OWNER.tmp/x"));
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "OWNER" || name == "OWNER.lock" || name == "OWNER.tmp") << name;
  }
}

// An expired lease of another coordinator still refuses a take-over within the clock-skew grace
// after its expiry; a released one does not.
TEST(CheckpointStore, AnExpiredLeaseRefusesATakeOverWithinTheClockSkewGrace) {
  TempDir tmp;
  const std::string root = tmp.File("ck");
  CheckpointStore store(root);
  CheckpointStore::ClaimOptions first;
  first.coordinator = "coord-1";
  first.lease_s = 60;
  ASSERT_TRUE(store.Claim(Claimant("job-a"), first).ok());
  ASSERT_TRUE(*store.RenewLease("job-a", "coord-1", -2));  // expired 2 s ago
  CheckpointStore::ClaimOptions second;
  second.take_over = true;
  second.coordinator = "coord-2";
  second.lease_s = 60;
  second.clock_skew_s = 5;
  absl::Status s = store.Claim(Claimant("job-b"), second);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "runs under another coordinator")) << s;
  second.clock_skew_s = 1;
  EXPECT_TRUE(store.Claim(Claimant("job-b"), second).ok());
  ASSERT_TRUE(*store.ReleaseLease("job-b", "coord-2"));
  first.take_over = true;
  first.clock_skew_s = 3600;
  EXPECT_TRUE(store.Claim(Claimant("job-c"), first).ok()) << "a released lease is no lease";
}

}  // namespace
}  // namespace fsdp8::coord
