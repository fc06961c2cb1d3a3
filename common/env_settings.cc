#include "common/env_settings.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fsdp8::env {

std::optional<std::string> Get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

std::string GetOrEmpty(const char* name) { return Get(name).value_or(""); }

absl::StatusOr<bool> ParseOnOff(absl::string_view name, absl::string_view value) {
  const std::string v = absl::AsciiStrToLower(value);
  if (v == "1" || v == "true" || v == "on") return true;
  if (v == "0" || v == "false" || v == "off") return false;
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": \"", value,
                   "\" is not an on/off value (on: 1, true, on; off: 0, false, off; any case)"));
}

absl::StatusOr<bool> GetSwitch(const char* name, bool unset) {
  const std::string v = GetOrEmpty(name);
  if (v.empty()) return unset;
  return ParseOnOff(name, v);
}

bool SwitchOrExit(const char* name, bool unset) {
  absl::StatusOr<bool> on = GetSwitch(name, unset);
  if (!on.ok()) {
    std::fprintf(stderr, "fsdp8: %s\n", std::string(on.status().message()).c_str());
    std::exit(2);
  }
  return *on;
}

absl::StatusOr<std::optional<double>> ProfileOpsPeriod() {
  const std::string v = GetOrEmpty(kProfileOps);
  if (v.empty()) return std::optional<double>();
  double seconds = 0;
  if (absl::SimpleAtod(v, &seconds) && seconds > 0 && v != "1") {
    return std::optional<double>(seconds > 1.0 ? seconds : 10.0);
  }
  absl::StatusOr<bool> on = ParseOnOff(kProfileOps, v);
  if (!on.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(on.status().message(), ", nor a number of seconds > 0"));
  }
  return *on ? std::optional<double>(10.0) : std::optional<double>();
}

absl::Status CheckEnvironment() {
  for (const char* name : {kCpuFillNan, kGemmVerbose, kCpuCommOverlap, kStepTiming}) {
    if (absl::StatusOr<bool> on = GetSwitch(name); !on.ok()) return on.status();
  }
  if (auto p = ProfileOpsPeriod(); !p.ok()) return p.status();
  const std::string check = GetOrEmpty(kNcclCheckCollectives);
  if (!check.empty() && check != "sync") {
    if (absl::StatusOr<bool> on = ParseOnOff(kNcclCheckCollectives, check); !on.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(on.status().message(), ", nor \"sync\""));
    }
  }
  return absl::OkStatus();
}

}  // namespace fsdp8::env
