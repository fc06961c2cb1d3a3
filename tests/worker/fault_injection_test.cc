// FaultInjection (common/fault_injection.h): the two injection points' parsing and their errors,
// which the integration tests' drills (StepFaultCluster, SaveFaultCluster) rely on through the
// environment of the worker processes.
#include "common/fault_injection.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "worker/settings.h"

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;

TEST(FaultInjection, NothingByDefault) {
  FaultInjection none;
  EXPECT_TRUE(none.StepError(0, 0).ok());
  EXPECT_TRUE(none.CheckpointWriteError("/nonexistent/ck/step-1/rank-0.ckpt").ok());
  FaultInjection empty("", ",,");
  EXPECT_TRUE(empty.StepError(0, 0).ok());
  EXPECT_TRUE(empty.CheckpointWriteError("/nonexistent/ck/step-1/rank-0.ckpt").ok());
}

TEST(FaultInjection, StepErrorFiresOncePerEntry) {
  FaultInjection f("1@3,,0@5", "");
  EXPECT_TRUE(f.StepError(0, 3).ok());
  EXPECT_TRUE(f.StepError(1, 2).ok());
  const absl::Status s = f.StepError(1, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(), "rank 1 step 3 failed (injected by FSDP8_FAULT_STEP_ERROR)");
  EXPECT_TRUE(f.StepError(1, 3).ok()) << "fired twice";
  EXPECT_FALSE(f.StepError(0, 5).ok());
  EXPECT_TRUE(f.StepError(0, 5).ok());
}

TEST(FaultInjection, CheckpointWriteFailsOnMatchingPathsLeavingATmpFile) {
  const fs::path dir =
      fs::temp_directory_path() / ("fault_injection_test_" + std::to_string(getpid()));
  fs::create_directories(dir / "ck" / "step-10");
  FaultInjection f("", "ck/step-10/rank-1,other");
  const std::string hit = (dir / "ck" / "step-10" / "rank-1.ckpt").string();
  const std::string miss = (dir / "ck" / "step-10" / "rank-0.ckpt").string();
  EXPECT_TRUE(f.CheckpointWriteError(miss).ok());
  EXPECT_FALSE(fs::exists(miss + ".tmp"));
  for (int i = 0; i < 2; ++i) {  // every time, not once
    const absl::Status s = f.CheckpointWriteError(hit);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(s.message(), "writing " + hit +
                               ".tmp: No space left on device (injected by "
                               "FSDP8_FAULT_CHECKPOINT_ENOSPC)");
    EXPECT_EQ(fs::file_size(hit + ".tmp"), 4096u);
  }
  fs::remove_all(dir);
}

TEST(FaultInjection, FromEnvironmentReadsBothVariables) {
  setenv("FSDP8_FAULT_STEP_ERROR", "2@7", 1);
  setenv("FSDP8_FAULT_CHECKPOINT_ENOSPC", "never-a-path-here", 1);
  FaultInjection f = FaultInjection::FromEnvironment();
  unsetenv("FSDP8_FAULT_STEP_ERROR");
  unsetenv("FSDP8_FAULT_CHECKPOINT_ENOSPC");
  EXPECT_FALSE(f.StepError(2, 7).ok());
  EXPECT_FALSE(f.CheckpointWriteError("/nonexistent/never-a-path-here").ok());
  EXPECT_TRUE(FaultInjection::FromEnvironment().StepError(2, 7).ok());
}

// FSDP8_FAULT_CRASH_AT: an entry names a point and, after '@', a path substring; reaching a
// matching point kills the process with SIGKILL, any other point returns.
TEST(FaultInjection, CrashPointsMatchThePointAndThePath) {
  FaultInjection f("", "", "shard.mid_write@step-4/rank-1,,manifest.after_rename");
  EXPECT_TRUE(f.CrashesAt("shard.mid_write", "/ck/step-4/rank-1.ckpt"));
  EXPECT_FALSE(f.CrashesAt("shard.mid_write", "/ck/step-4/rank-0.ckpt"));
  EXPECT_FALSE(f.CrashesAt("shard.before_fsync", "/ck/step-4/rank-1.ckpt"));
  EXPECT_TRUE(f.CrashesAt("manifest.after_rename", "/any/step-9/MANIFEST"));
  EXPECT_FALSE(FaultInjection().CrashesAt("manifest.after_rename", "/any/step-9/MANIFEST"));
  f.CrashPoint("shard.before_write", "/ck/step-4/rank-1.ckpt");  // not named: returns
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  EXPECT_EXIT(f.CrashPoint("shard.mid_write", "/ck/step-4/rank-1.ckpt"),
              ::testing::KilledBySignal(SIGKILL), "crashing at shard.mid_write");
  std::set<std::string> names(std::begin(kCrashPoints), std::end(kCrashPoints));
  EXPECT_EQ(names.size(), 10u);
  EXPECT_TRUE(names.count("shard.before_write") && names.count("manifest.before_rename"));
}

// FSDP8_FAULT_CHECKPOINT_READ: a load of a step directory whose path holds an entry fails with
// DATA_LOSS naming the directory and the variable, every time; other directories load.
TEST(FaultInjection, CheckpointReadFailsOnMatchingStepDirectories) {
  setenv("FSDP8_FAULT_CHECKPOINT_READ", ",ck/step-10,", 1);
  const FaultInjection f = FaultInjection::FromEnvironment();
  unsetenv("FSDP8_FAULT_CHECKPOINT_READ");
  EXPECT_TRUE(f.CheckpointReadError("/data/ck/step-5").ok());
  EXPECT_TRUE(f.CheckpointReadError("/data/other/step-10").ok());
  for (int i = 0; i < 2; ++i) {
    const absl::Status s = f.CheckpointReadError("/data/ck/step-10");
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(s.message(),
              "reading checkpoint /data/ck/step-10: failed (injected by "
              "FSDP8_FAULT_CHECKPOINT_READ)");
  }
  EXPECT_FALSE(FaultInjection("", "", "", "/").CheckpointReadError("/any/step-1").ok());
  EXPECT_TRUE(FaultInjection().CheckpointReadError("/any/step-1").ok());
}

}  // namespace
}  // namespace fsdp8

namespace fsdp8 {
namespace {

// FSDP8_FAULT_SLOW_SAVE=STEP@MS,...: each entry's step and wait, empty items skipped; an item that
// is not two non-negative integers around '@' is refused naming the variable.
TEST(WorkerSettingsTest, SlowSaveIsParsedAndMalformedItemsAreRefused) {
  setenv("FSDP8_FAULT_SLOW_SAVE", "10@3000,,5@0", 1);
  absl::StatusOr<WorkerSettings> s = WorkerSettings::FromEnvironment();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->slow_save_ms, (std::map<int64_t, int64_t>{{5, 0}, {10, 3000}}));
  for (const char* bad : {"10", "10@", "@5", "a@5", "10@-1", "-1@5", "1@2@3"}) {
    setenv("FSDP8_FAULT_SLOW_SAVE", bad, 1);
    absl::StatusOr<WorkerSettings> r = WorkerSettings::FromEnvironment();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("FSDP8_FAULT_SLOW_SAVE"), std::string::npos) << bad;
  }
  unsetenv("FSDP8_FAULT_SLOW_SAVE");
  s = WorkerSettings::FromEnvironment();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->slow_save_ms.empty());
}

}  // namespace
}  // namespace fsdp8
