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
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/string_view.h"
#include "common/env_settings.h"

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

// The boolean flags defined in a file whose path ends with `flags_file` take their values under
// the one on/off rule (env::ParseOnOff: 1, true, on / 0, false, off, any case): each
// "--NAME=VALUE" or "-NAME=VALUE" of such a flag is rewritten in argv as "--NAME=true" or
// "--NAME=false" for absl::ParseCommandLine; bare "--NAME" and "--noNAME" stay as they are. A
// value outside the rule prints "<program>: --NAME: "VALUE" is not an on/off value (...)" to
// stderr and exits 2. Call once, before absl::ParseCommandLine (the rewritten strings live for
// the process). Not thread-safe.
inline void ParseOnOffFlags(absl::string_view flags_file, int argc, char** argv) {
  std::vector<std::string> names;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), flags_file) && flag->IsOfType<bool>())
      names.emplace_back(name);
  }
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (a == "--") break;
    if (!absl::ConsumePrefix(&a, "--")) absl::ConsumePrefix(&a, "-");
    const size_t eq = a.find('=');
    if (eq == absl::string_view::npos) continue;
    const absl::string_view name = a.substr(0, eq);
    if (std::find(names.begin(), names.end(), name) == names.end()) continue;
    absl::StatusOr<bool> on = env::ParseOnOff(absl::StrCat("--", name), a.substr(eq + 1));
    if (!on.ok()) {
      std::fprintf(stderr, "%s: %s\n", argv[0], std::string(on.status().message()).c_str());
      std::exit(2);
    }
    auto* kept = new std::string(absl::StrCat("--", name, *on ? "=true" : "=false"));
    argv[i] = kept->data();
  }
}

}  // namespace fsdp8
