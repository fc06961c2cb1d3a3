// --help for the daemons: absl lists only the flags of files named after the program by default,
// and ours are defined in <component>/main.cc.
#pragma once

#include <string>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace fsdp8 {

// Sets the usage line and makes --help / --helpshort list the flags defined in files whose path
// ends with `flags_file` (e.g. "worker/main.cc"). Call once, before absl::ParseCommandLine.
// Not thread-safe (absl's usage configuration is process-wide).
inline void SetDaemonHelp(absl::string_view usage, absl::string_view flags_file) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [file = std::string(flags_file)](absl::string_view path) {
    return absl::EndsWith(path, file);
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
}

}  // namespace fsdp8
