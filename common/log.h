// The daemons' log (coordinator and worker): one line per message or event on stderr, leveled.
//
// Two formats (--log_format):
//   text (default): "<process>: [<level>] <message>" and, for an event,
//       "<process>: [<level>] <event> key=value key=value ..." (values with spaces or quotes are
//       quoted, C-escaped);
//   json: one JSON object per line, for log shippers:
//       {"time":"2026-12-01T17:02:03.123Z","level":"info","process":"fsdp8-coordinator",
//        "event":"job_submitted","job":"job-...","owner":"alice",...}
//     a plain message has "message" instead of "event" and fields. Numbers are JSON numbers (a NaN
//     is null). The lines are written with the protobuf JSON printer (google.protobuf.Struct).
// Events name a job's lifecycle (docs/logging.md lists them and their fields); they are logged
// at info level.
//
// The level, format and process name are process-wide and may change at run time (the level by
// AdminService.SetLogLevel). Thread-safety: every function may be called from any thread; a line
// is written with one call, so lines from several threads do not interleave.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <variant>

#include "absl/status/statusor.h"

namespace fsdp8 {

enum class LogLevel { kError = 0, kWarning = 1, kInfo = 2, kDebug = 3 };
enum class LogFormat { kText, kJson };

// "error", "warning", "info", "debug" (case-insensitive; "warn" too). INVALID_ARGUMENT otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(const std::string& name);
const char* LogLevelName(LogLevel level);  // "error", "warning", "info", "debug"
// "text" or "json". INVALID_ARGUMENT otherwise.
absl::StatusOr<LogFormat> ParseLogFormat(const std::string& name);

void SetLogLevel(LogLevel level);  // default: info
LogLevel GetLogLevel();
bool LogEnabled(LogLevel level);
void SetLogFormat(LogFormat format);  // default: text
LogFormat GetLogFormat();
void SetLogProcess(const std::string& process);  // default: "fsdp8"

// Writes one line when `level` is enabled.
void Log(LogLevel level, const std::string& message);

// One field of an event: a string, an integer or a floating-point value.
struct LogField {
  LogField(const char* k, std::string v) : key(k), value(std::move(v)) {}
  LogField(const char* k, const char* v) : key(k), value(std::string(v)) {}
  LogField(const char* k, int64_t v) : key(k), value(v) {}
  LogField(const char* k, int v) : key(k), value(static_cast<int64_t>(v)) {}
  LogField(const char* k, double v) : key(k), value(v) {}
  const char* key;
  std::variant<std::string, int64_t, double> value;
};

// Writes one event line (info level): `event` (snake_case, e.g. "job_submitted") and its fields
// in order.
void LogEvent(const char* event, std::initializer_list<LogField> fields);

// The line LogEvent/Log would write (without the newline); exposed for tests.
std::string FormatLogLine(LogLevel level, const char* event, const std::string& message,
                          std::initializer_list<LogField> fields);

}  // namespace fsdp8
