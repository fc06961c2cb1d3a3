#include "worker/fault_injection.h"

#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/env_settings.h"

namespace fsdp8 {
namespace {

std::vector<std::string> Items(absl::string_view list) {
  return absl::StrSplit(list, ',', absl::SkipEmpty());
}

}  // namespace

FaultInjection::FaultInjection(absl::string_view step_errors, absl::string_view checkpoint_enospc)
    : step_errors_(Items(step_errors)), checkpoint_enospc_(Items(checkpoint_enospc)) {}

FaultInjection FaultInjection::FromEnvironment() {
  return FaultInjection(env::GetOrEmpty(env::kFaultStepError),
                        env::GetOrEmpty(env::kFaultCheckpointEnospc));
}

absl::Status FaultInjection::StepError(int rank, int64_t step) {
  const std::string me = absl::StrCat(rank, "@", step);
  for (const std::string& item : step_errors_) {
    if (item != me || !fired_.insert(me).second) continue;
    return absl::InternalError(absl::StrCat("rank ", rank, " step ", step,
                                            " failed (injected by ", env::kFaultStepError, ")"));
  }
  return absl::OkStatus();
}

absl::Status FaultInjection::CheckpointWriteError(const std::string& path) const {
  for (const std::string& item : checkpoint_enospc_) {
    if (!absl::StrContains(path, item)) continue;
    std::ofstream(path + ".tmp", std::ios::binary) << std::string(4096, '\0');
    return absl::ResourceExhaustedError(
        absl::StrCat("writing ", path, ".tmp: No space left on device (injected by ",
                     env::kFaultCheckpointEnospc, ")"));
  }
  return absl::OkStatus();
}

}  // namespace fsdp8
