#include "common/fault_injection.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
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

FaultInjection::FaultInjection(absl::string_view step_errors, absl::string_view checkpoint_enospc,
                               absl::string_view crash_at, absl::string_view checkpoint_read)
    : step_errors_(Items(step_errors)),
      checkpoint_enospc_(Items(checkpoint_enospc)),
      crash_at_(Items(crash_at)),
      checkpoint_read_(Items(checkpoint_read)) {}

FaultInjection FaultInjection::FromEnvironment() {
  return FaultInjection(env::GetOrEmpty(env::kFaultStepError),
                        env::GetOrEmpty(env::kFaultCheckpointEnospc),
                        env::GetOrEmpty(env::kFaultCrashAt),
                        env::GetOrEmpty(env::kFaultCheckpointRead));
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

absl::Status FaultInjection::CheckpointReadError(const std::string& dir) const {
  for (const std::string& item : checkpoint_read_) {
    if (!absl::StrContains(dir, item)) continue;
    return absl::DataLossError(absl::StrCat("reading checkpoint ", dir, ": failed (injected by ",
                                            env::kFaultCheckpointRead, ")"));
  }
  return absl::OkStatus();
}

const char* const kCrashPoints[10] = {
    "shard.before_write",    "shard.mid_write",      "shard.before_fsync",
    "shard.before_rename",   "shard.after_rename",   "manifest.before_write",
    "manifest.mid_write",    "manifest.before_fsync", "manifest.before_rename",
    "manifest.after_rename"};

const char* const kRetentionCrashPoints[2] = {"retain.after_manifest_removed",
                                               "retain.mid_remove"};

bool FaultInjection::CrashesAt(absl::string_view point, const std::string& path) const {
  for (const std::string& item : crash_at_) {
    const size_t at = item.find('@');
    const absl::string_view name = absl::string_view(item).substr(0, at);
    if (name != point) continue;
    if (at == std::string::npos || absl::StrContains(path, item.substr(at + 1))) return true;
  }
  return false;
}

void FaultInjection::CrashPoint(absl::string_view point, const std::string& path) const {
  if (!CrashesAt(point, path)) return;
  std::fprintf(stderr, "fsdp8: crashing at %s writing %s (injected by %s)\n",
               std::string(point).c_str(), path.c_str(), env::kFaultCrashAt);
  std::fflush(stderr);
  ::kill(::getpid(), SIGKILL);
  for (;;) ::pause();  // SIGKILL is delivered before kill returns to a single-threaded caller;
                       // other threads may run a moment longer: this one never returns
}

}  // namespace fsdp8
