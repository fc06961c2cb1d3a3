#include "coordinator/log.h"

#include <atomic>
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace fsdp8::coord {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(const std::string& name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "error") return LogLevel::kError;
  if (n == "warning" || n == "warn") return LogLevel::kWarning;
  if (n == "info") return LogLevel::kInfo;
  if (n == "debug") return LogLevel::kDebug;
  return absl::InvalidArgumentError(
      absl::StrCat("level: must be error, warning, info or debug (got \"", name, "\")"));
}

const char* LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kError: return "error";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kInfo: return "info";
    case LogLevel::kDebug: return "debug";
  }
  return "?";
}

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load()); }
bool LogEnabled(LogLevel level) { return static_cast<int>(level) <= g_level.load(); }

void Log(LogLevel level, const std::string& message) {
  if (!LogEnabled(level)) return;
  // One fprintf per line so that lines from several threads do not interleave.
  fprintf(stderr, "fsdp8-coordinator: [%s] %s\n", LogLevelName(level), message.c_str());
}

}  // namespace fsdp8::coord
