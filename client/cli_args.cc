#include "client/cli_args.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace fsdp8 {

const std::map<std::string, bool>& CliFlags() {
  static const auto* flags = new std::map<std::string, bool>{
      {"coordinator", true}, {"request-id", true}, {"out", true},      {"val-fraction", true},
      {"no-watch", false},   {"json", false},      {"help", false},    {"step", true},
      {"dtype", true},       {"undo", false},      {"token", true},    {"token-file", true},
      {"tls-ca", true},      {"tls-cert", true},   {"tls-key", true},  {"plot", true},
      {"log", true},
      {"tensorboard", true},
      {"page-size", true},   {"page-token", true},  {"max-shard-size", true}, {"tokenizer", true},
      {"seq-len", true},     {"world-size", true},
      {"replicas", true},
      {"no-save", false},    {"state-dir", true},  {"threads", true},
      {"predict", false},    {"calibration", true}};
  return *flags;
}

std::string DashedFlagName(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

std::optional<std::vector<std::string>> TokenizerPrepareArgs(int argc, const char* const* argv) {
  int i = 1;
  for (; i < argc; ++i) {  // to the command word
    const std::string s = argv[i];
    if (s == "--" || s.size() <= 2 || s.rfind("--", 0) != 0) break;
    const std::string name = DashedFlagName(s.substr(2));
    auto it = CliFlags().find(name);
    if (it != CliFlags().end() && it->second) ++i;  // its value is the next word
  }
  if (i >= argc || std::string(argv[i]) != "prepare") return std::nullopt;
  std::vector<std::string> args(argv + i + 1, argv + argc);
  for (const std::string& s : args) {
    if (s == "--") break;
    if (s == "--tokenizer" || s.rfind("--tokenizer=", 0) == 0) return args;
  }
  return std::nullopt;
}

absl::StatusOr<CliArgs> ParseCliArgs(int argc, const char* const* argv) {
  CliArgs a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--") {
      for (++i; i < argc; ++i) a.positional.push_back(argv[i]);
      break;
    }
    if (s.size() <= 2 || s.rfind("--", 0) != 0) {
      if (a.command.empty()) a.command = s;
      else a.positional.push_back(s);
      continue;
    }
    std::string written = s.substr(2), value;
    const size_t eq = written.find('=');
    const bool has_value = eq != std::string::npos;
    if (has_value) {
      value = written.substr(eq + 1);
      written = written.substr(0, eq);
    }
    const std::string name = DashedFlagName(written);
    auto it = CliFlags().find(name);
    if (it == CliFlags().end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", written));
    }
    if (it->second && !has_value) {
      if (i + 1 >= argc) {
        return absl::InvalidArgumentError(absl::StrCat("--", written, " needs a value"));
      }
      value = argv[++i];
    }
    if (name != written) a.deprecated.push_back(written);
    a.flags[name] = value;
  }
  return a;
}

}  // namespace fsdp8
