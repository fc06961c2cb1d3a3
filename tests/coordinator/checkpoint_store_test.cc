// CheckpointStore: MANIFEST round trip, committed vs uncommitted directories, retention, damaged
// files, resume compatibility.
#include "coordinator/checkpoint_store.h"

#include <filesystem>
#include <fstream>

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

}  // namespace
}  // namespace fsdp8::coord
