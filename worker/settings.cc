#include "worker/settings.h"

#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/env_settings.h"

namespace fsdp8 {
namespace {

constexpr char kFaultSlowSave[] = "FSDP8_FAULT_SLOW_SAVE";

// STEP@MS,... (see WorkerSettings::slow_save_ms).
absl::StatusOr<std::map<int64_t, int64_t>> ParseSlowSave(const std::string& value) {
  std::map<int64_t, int64_t> out;
  for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> parts = absl::StrSplit(item, '@');
    int64_t step = 0, ms = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &step) ||
        !absl::SimpleAtoi(parts[1], &ms) || step < 0 || ms < 0)
      return absl::InvalidArgumentError(absl::StrCat(
          kFaultSlowSave, ": \"", item, "\" is not STEP@MS (non-negative integers)"));
    out[step] = ms;
  }
  return out;
}

}  // namespace

absl::StatusOr<WorkerSettings> WorkerSettings::FromEnvironment() {
  if (absl::Status st = env::CheckEnvironment(); !st.ok()) return st;
  WorkerSettings s;
  s.backend = BackendOptions::FromEnvironment();
  s.nccl = NcclOptions::FromEnvironment();
  s.cpu_comm = CpuCommOptions::FromEnvironment();
  s.trainer = TrainerOptions::FromEnvironment();
  s.faults = FaultInjection::FromEnvironment();
  absl::StatusOr<std::map<int64_t, int64_t>> slow = ParseSlowSave(env::GetOrEmpty(kFaultSlowSave));
  if (!slow.ok()) return slow.status();
  s.slow_save_ms = *std::move(slow);
  s.tls_ca = env::GetOrEmpty(env::kTlsCa);
  s.tls_cert = env::GetOrEmpty(env::kTlsCert);
  s.tls_key = env::GetOrEmpty(env::kTlsKey);
  s.token_file = env::GetOrEmpty(env::kTokenFile);
  s.token = env::GetOrEmpty(env::kToken);
  return s;
}

}  // namespace fsdp8
