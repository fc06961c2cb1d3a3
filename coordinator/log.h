// The coordinator's log: leveled lines on stderr ("fsdp8-coordinator: [LEVEL] message"). The level
// is process-wide and can be changed at run time (AdminService.SetLogLevel); debug also logs every
// authorized RPC with its caller.
//
// Thread-safety: every function is safe to call from several threads.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace fsdp8::coord {

enum class LogLevel { kError = 0, kWarning = 1, kInfo = 2, kDebug = 3 };

// "error", "warning", "info", "debug" (case-insensitive; "warn" too). INVALID_ARGUMENT otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(const std::string& name);
const char* LogLevelName(LogLevel level);  // "error", "warning", "info", "debug"

void SetLogLevel(LogLevel level);  // default: info
LogLevel GetLogLevel();
bool LogEnabled(LogLevel level);
// Writes one line when `level` is enabled.
void Log(LogLevel level, const std::string& message);

}  // namespace fsdp8::coord
