// The command line of the `fsdp8` CLI: `fsdp8 [FLAGS] COMMAND [ARGS...] [FLAGS]`.
//
// Flags are spelled with dashes (--request-id, --tls-ca, --val-fraction) and may stand anywhere:
// "--name value", "--name=value", or "--name" alone for a boolean flag; "--" ends the flags (every
// later word is positional). The underscore spelling of a flag (--request_id) is a deprecated
// alias, accepted for one more release: it is stored under the dashed name and listed in
// CliArgs::deprecated so that the CLI can say so. (The daemons keep abseil's underscores.)
//
// Thread-safety: plain functions and values.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fsdp8 {

struct CliArgs {
  std::string command;                        // the first word that is not a flag; "" if none
  std::vector<std::string> positional;        // the other words that are not flags, in order
  std::map<std::string, std::string> flags;   // dashed name -> value ("" for a boolean flag)
  std::vector<std::string> deprecated;        // underscore spellings given, e.g. "request_id"
};

// Every flag the CLI knows, dashed: name -> whether it takes a value.
const std::map<std::string, bool>& CliFlags();

// Parses argv[1..argc). INVALID_ARGUMENT "unknown flag --NAME" or "--NAME needs a value" (NAME as
// written).
absl::StatusOr<CliArgs> ParseCliArgs(int argc, const char* const* argv);

// `fsdp8 [FLAGS] prepare ARGS...` where ARGS holds --tokenizer (before any "--") is handed over to
// the Python command fsdp8-prepare: returns ARGS as written, in order (the flags before the command
// word are dropped); nullopt for any other command line. Flags before the command are skipped as
// CliFlags() says (a flag that takes a value consumes the next word unless written --name=value).
std::optional<std::vector<std::string>> TokenizerPrepareArgs(int argc, const char* const* argv);

// The flag's dashed name: "request_id" -> "request-id".
std::string DashedFlagName(std::string name);

}  // namespace fsdp8
