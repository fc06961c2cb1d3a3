// --help for the daemons: the usage line and the daemon's own flags (those defined in
// <component>/main.cc), one per flag with its default, without absl's "Flags from FILE" headings
// and library flags.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace fsdp8 {

// Prints `usage` and every flag defined in a file whose path ends with `flags_file` (e.g.
// "worker/main.cc"), sorted by name, as "  --name=DEFAULT" followed by its help text, to stdout.
inline void PrintDaemonHelp(absl::string_view usage, absl::string_view flags_file) {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), flags_file)) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::printf("usage: %.*s\n\nflags:\n", static_cast<int>(usage.size()), usage.data());
  for (const absl::CommandLineFlag* f : flags) {
    const std::string def = f->DefaultValue();
    std::printf("  --%s=%s\n      %s\n", std::string(f->Name()).c_str(),
                def.empty() ? "\"\"" : def.c_str(), f->Help().c_str());
  }
}

// Sets the usage line; when argv asks for help (--help, -help, -h, --helpshort, --helpfull),
// prints PrintDaemonHelp and exits 0. Call once, before absl::ParseCommandLine.
// Not thread-safe (absl's usage configuration is process-wide).
inline void SetDaemonHelp(absl::string_view usage, absl::string_view flags_file, int argc,
                          char** argv) {
  absl::SetProgramUsageMessage(usage);
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strcmp(a, "--") == 0) break;
    for (const char* h : {"--help", "-help", "-h", "--helpshort", "--helpfull"}) {
      if (std::strcmp(a, h) == 0) {
        PrintDaemonHelp(usage, flags_file);
        std::exit(0);
      }
    }
  }
}

}  // namespace fsdp8
