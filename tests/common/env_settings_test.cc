// The one on/off rule (common/env_settings.h ParseOnOff) and its readers: environment switches
// and the daemons' boolean flags (common/flags_help.h ParseOnOffFlags).
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "common/env_settings.h"
#include "common/flags_help.h"
#include "gtest/gtest.h"

ABSL_FLAG(bool, on_off_test_flag, true, "a boolean flag of this test");

namespace fsdp8 {
namespace {

// Sets a variable for the scope of one test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(OnOffRule, EverySpellingOfOnAndOffInAnyCase) {
  for (const char* v : {"1", "true", "on", "TRUE", "On", "oN", "tRuE"}) {
    absl::StatusOr<bool> on = env::ParseOnOff("X", v);
    ASSERT_TRUE(on.ok()) << v << ": " << on.status();
    EXPECT_TRUE(*on) << v;
  }
  for (const char* v : {"0", "false", "off", "FALSE", "Off", "OFF", "fAlSe"}) {
    absl::StatusOr<bool> on = env::ParseOnOff("X", v);
    ASSERT_TRUE(on.ok()) << v << ": " << on.status();
    EXPECT_FALSE(*on) << v;
  }
}

TEST(OnOffRule, AnythingElseIsAnErrorNamingTheVariableAndTheRule) {
  for (const char* v : {"yes", "no", "2", "00", "01", " 1", "1 ", "t", "enabled", "-1", "0.0"}) {
    absl::StatusOr<bool> on = env::ParseOnOff("FSDP8_GEMM_VERBOSE", v);
    ASSERT_FALSE(on.ok()) << v;
    EXPECT_EQ(on.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string m(on.status().message());
    EXPECT_TRUE(absl::StartsWith(m, "FSDP8_GEMM_VERBOSE: \"")) << m;
    EXPECT_TRUE(absl::StrContains(m, absl::StrCat("\"", v, "\""))) << m;
    EXPECT_TRUE(absl::StrContains(m, "on: 1, true, on; off: 0, false, off; any case")) << m;
  }
}

TEST(OnOffRule, SwitchUnsetOrEmptyTakesItsDefault) {
  {
    ScopedEnv e(env::kStepTiming, nullptr);
    EXPECT_FALSE(*env::GetSwitch(env::kStepTiming));
    EXPECT_TRUE(*env::GetSwitch(env::kStepTiming, /*unset=*/true));
  }
  {
    ScopedEnv e(env::kStepTiming, "");
    EXPECT_FALSE(*env::GetSwitch(env::kStepTiming));
    EXPECT_TRUE(*env::GetSwitch(env::kStepTiming, /*unset=*/true));
  }
  {
    ScopedEnv e(env::kStepTiming, "OFF");
    EXPECT_FALSE(*env::GetSwitch(env::kStepTiming, /*unset=*/true));
  }
}

// The bug the rule removes: "0" read as set, and so on.
TEST(OnOffRule, GemmVerboseZeroIsOff) {
  ScopedEnv e(env::kGemmVerbose, "0");
  EXPECT_FALSE(env::SwitchOrExit(env::kGemmVerbose));
  ScopedEnv e2(env::kCpuCommOverlap, "false");  // default on: an off value turns it off
  EXPECT_FALSE(env::SwitchOrExit(env::kCpuCommOverlap, /*unset=*/true));
}

TEST(OnOffRule, ProfileOpsTakesASwitchOrSeconds) {
  struct Case {
    const char* value;
    std::optional<double> period;
  };
  for (const Case& c : std::vector<Case>{{nullptr, std::nullopt},
                                         {"", std::nullopt},
                                         {"0", std::nullopt},
                                         {"off", std::nullopt},
                                         {"1", 10.0},
                                         {"ON", 10.0},
                                         {"0.5", 10.0},
                                         {"2.5", 2.5},
                                         {"30", 30.0}}) {
    ScopedEnv e(env::kProfileOps, c.value);
    absl::StatusOr<std::optional<double>> p = env::ProfileOpsPeriod();
    ASSERT_TRUE(p.ok()) << (c.value ? c.value : "unset") << ": " << p.status();
    EXPECT_EQ(*p, c.period) << (c.value ? c.value : "unset");
  }
  for (const char* bad : {"yes", "-3", "soon"}) {
    ScopedEnv e(env::kProfileOps, bad);
    absl::StatusOr<std::optional<double>> p = env::ProfileOpsPeriod();
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_TRUE(absl::StartsWith(p.status().message(), "FSDP8_PROFILE_OPS: ")) << p.status();
    EXPECT_TRUE(absl::StrContains(p.status().message(), "number of seconds > 0")) << p.status();
  }
}

TEST(OnOffRule, CheckEnvironmentNamesTheFirstBadVariable) {
  ScopedEnv a(env::kCpuFillNan, nullptr), b(env::kGemmVerbose, nullptr),
      c(env::kCpuCommOverlap, nullptr), d(env::kStepTiming, nullptr), e(env::kProfileOps, nullptr),
      f(env::kNcclCheckCollectives, "sync");
  EXPECT_TRUE(env::CheckEnvironment().ok());
  {
    ScopedEnv bad(env::kCpuCommOverlap, "no");
    const absl::Status s = env::CheckEnvironment();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StartsWith(s.message(), "FSDP8_CPU_COMM_OVERLAP: \"no\"")) << s;
  }
  {
    ScopedEnv bad(env::kNcclCheckCollectives, "async");
    const absl::Status s = env::CheckEnvironment();
    EXPECT_TRUE(absl::StartsWith(s.message(), "FSDP8_NCCL_CHECK_COLLECTIVES: \"async\"")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "nor \"sync\"")) << s;
  }
  {
    ScopedEnv ok(env::kNcclCheckCollectives, "Off");
    EXPECT_TRUE(env::CheckEnvironment().ok());
  }
}

TEST(OnOffRule, SwitchOrExitExitsOnABadValue) {
  ScopedEnv e(env::kGemmVerbose, "yes");
  EXPECT_EXIT(env::SwitchOrExit(env::kGemmVerbose), ::testing::ExitedWithCode(2),
              "FSDP8_GEMM_VERBOSE: \"yes\" is not an on/off value");
}

// argv as ParseOnOffFlags sees it (writable strings).
struct Argv {
  explicit Argv(std::vector<std::string> a) : args(std::move(a)) {
    for (std::string& s : args) ptrs.push_back(s.data());
  }
  std::vector<std::string> args;
  std::vector<char*> ptrs;
};

TEST(OnOffRule, BooleanFlagsTakeTheSameRule) {
  Argv a({"prog", "--on_off_test_flag=OFF", "-on_off_test_flag=on", "--on_off_test_flag",
          "--noon_off_test_flag", "--other=off", "--", "--on_off_test_flag=maybe"});
  ParseOnOffFlags("tests/common/env_settings_test.cc", static_cast<int>(a.ptrs.size()),
                  a.ptrs.data());
  EXPECT_STREQ(a.ptrs[1], "--on_off_test_flag=false");
  EXPECT_STREQ(a.ptrs[2], "--on_off_test_flag=true");
  EXPECT_STREQ(a.ptrs[3], "--on_off_test_flag");
  EXPECT_STREQ(a.ptrs[4], "--noon_off_test_flag");
  EXPECT_STREQ(a.ptrs[5], "--other=off") << "not a boolean flag of this file";
  EXPECT_STREQ(a.ptrs[7], "--on_off_test_flag=maybe") << "after --: not a flag";
  Argv bad({"prog", "--on_off_test_flag=yes"});
  EXPECT_EXIT(ParseOnOffFlags("tests/common/env_settings_test.cc", 2, bad.ptrs.data()),
              ::testing::ExitedWithCode(2),
              "--on_off_test_flag: \"yes\" is not an on/off value \\(on: 1, true, on; off: 0, "
              "false, off; any case\\)");
}

}  // namespace
}  // namespace fsdp8
