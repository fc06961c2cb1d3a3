#include "common/log.h"

#include <atomic>
#include <cmath>
#include <cstdio>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace fsdp8 {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_format{static_cast<int>(LogFormat::kText)};
// Constant-initialized: usable from any static initializer or destructor that logs.
ABSL_CONST_INIT absl::Mutex g_process_mu(absl::kConstInit);
std::string& Process() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_process_mu) {
  static std::string* p = new std::string("fsdp8");
  return *p;
}
std::string ProcessName() {
  absl::MutexLock l(&g_process_mu);
  return Process();
}

// A text value: bare when it has no space, quote, '=' or control character; else quoted.
std::string TextValue(const std::string& v) {
  bool bare = !v.empty();
  for (char c : v)
    if (c == ' ' || c == '"' || c == '=' || c == '\\' || static_cast<unsigned char>(c) < 0x20)
      bare = false;
  return bare ? v : absl::StrCat("\"", absl::CEscape(v), "\"");
}

std::string TextLine(LogLevel level, const char* event, const std::string& message,
                     std::initializer_list<LogField> fields) {
  std::string out = absl::StrCat(ProcessName(), ": [", LogLevelName(level), "] ");
  if (event == nullptr) return absl::StrCat(out, message);
  absl::StrAppend(&out, event);
  for (const LogField& f : fields) {
    absl::StrAppend(&out, " ", f.key, "=");
    if (const auto* s = std::get_if<std::string>(&f.value)) absl::StrAppend(&out, TextValue(*s));
    if (const auto* i = std::get_if<int64_t>(&f.value)) absl::StrAppend(&out, *i);
    if (const auto* d = std::get_if<double>(&f.value)) absl::StrAppend(&out, *d);
  }
  return out;
}

std::string JsonLine(LogLevel level, const char* event, const std::string& message,
                     std::initializer_list<LogField> fields) {
  google::protobuf::Struct doc;
  auto& m = *doc.mutable_fields();
  m["time"].set_string_value(
      absl::FormatTime("%Y-%m-%d%ET%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()));
  m["level"].set_string_value(LogLevelName(level));
  m["process"].set_string_value(ProcessName());
  if (event == nullptr) {
    m["message"].set_string_value(message);
  } else {
    m["event"].set_string_value(event);
    for (const LogField& f : fields) {
      google::protobuf::Value& v = m[f.key];
      if (const auto* s = std::get_if<std::string>(&f.value)) v.set_string_value(*s);
      if (const auto* i = std::get_if<int64_t>(&f.value)) v.set_number_value(static_cast<double>(*i));
      if (const auto* d = std::get_if<double>(&f.value)) {
        if (std::isfinite(*d)) v.set_number_value(*d);
        else v.set_null_value(google::protobuf::NULL_VALUE);
      }
    }
  }
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(doc, &out).ok()) {
    return absl::StrCat("{\"level\":\"error\",\"message\":\"unprintable log line\"}");
  }
  return out;
}

void Write(const std::string& line) {
  // One fwrite per line so that lines from several threads do not interleave.
  const std::string with_newline = line + "\n";
  fwrite(with_newline.data(), 1, with_newline.size(), stderr);
  fflush(stderr);
}

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

absl::StatusOr<LogFormat> ParseLogFormat(const std::string& name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "text") return LogFormat::kText;
  if (n == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("format: must be text or json (got \"", name, "\")"));
}

void SetLogLevel(LogLevel level) { g_level = static_cast<int>(level); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load()); }
bool LogEnabled(LogLevel level) { return static_cast<int>(level) <= g_level.load(); }
void SetLogFormat(LogFormat format) { g_format = static_cast<int>(format); }
LogFormat GetLogFormat() { return static_cast<LogFormat>(g_format.load()); }
void SetLogProcess(const std::string& process) {
  absl::MutexLock l(&g_process_mu);
  Process() = process;
}

std::string FormatLogLine(LogLevel level, const char* event, const std::string& message,
                          std::initializer_list<LogField> fields) {
  return GetLogFormat() == LogFormat::kJson ? JsonLine(level, event, message, fields)
                                            : TextLine(level, event, message, fields);
}

void Log(LogLevel level, const std::string& message) {
  if (LogEnabled(level)) Write(FormatLogLine(level, nullptr, message, {}));
}

void LogEvent(const char* event, std::initializer_list<LogField> fields) {
  if (LogEnabled(LogLevel::kInfo)) Write(FormatLogLine(LogLevel::kInfo, event, "", fields));
}

}  // namespace fsdp8
