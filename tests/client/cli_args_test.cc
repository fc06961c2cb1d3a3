// The CLI's command line: dashed flags anywhere, "--name=value", "--", and the deprecated
// underscore spellings (parsed directly, then through the fsdp8 binary).
#include "client/cli_args.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

absl::StatusOr<CliArgs> Parse(std::vector<const char*> words) {
  words.insert(words.begin(), "fsdp8");
  return ParseCliArgs(static_cast<int>(words.size()), words.data());
}

TEST(CliArgs, FlagsAnywhereInBothForms) {
  auto a = Parse({"--coordinator", "h:1", "submit", "job.yaml", "--request-id=r1", "--no-watch"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->command, "submit");
  EXPECT_EQ(a->positional, std::vector<std::string>{"job.yaml"});
  EXPECT_EQ(a->flags.at("coordinator"), "h:1");
  EXPECT_EQ(a->flags.at("request-id"), "r1");
  EXPECT_EQ(a->flags.at("no-watch"), "");
  EXPECT_TRUE(a->deprecated.empty());
}

TEST(CliArgs, DoubleDashEndsTheFlags) {
  auto a = Parse({"prepare", "--out", "d", "--", "--json", "x.txt"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->positional, (std::vector<std::string>{"--json", "x.txt"}));
  EXPECT_EQ(a->flags.count("json"), 0u);
}

TEST(CliArgs, UnderscoreSpellingIsADeprecatedAlias) {
  auto a = Parse({"submit", "j.yaml", "--request_id", "r2", "--no_watch", "--val_fraction=0.1",
                  "--tls_ca", "ca.crt"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->flags.at("request-id"), "r2");
  EXPECT_EQ(a->flags.at("no-watch"), "");
  EXPECT_EQ(a->flags.at("val-fraction"), "0.1");
  EXPECT_EQ(a->flags.at("tls-ca"), "ca.crt");
  EXPECT_EQ(a->flags.count("request_id"), 0u);
  EXPECT_EQ(a->deprecated,
            (std::vector<std::string>{"request_id", "no_watch", "val_fraction", "tls_ca"}));
}

TEST(CliArgs, PrepareWithATokenizerIsHandedOverVerbatim) {
  auto words = [](std::vector<const char*> w) {
    w.insert(w.begin(), "fsdp8");
    return TokenizerPrepareArgs(static_cast<int>(w.size()), w.data());
  };
  auto a = words({"--coordinator", "h:1", "--token=t", "prepare", "--tokenizer", "t.json", "--out",
                  "d", "--workers", "3", "--val_fraction", "0.1", "a.jsonl"});
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(*a, (std::vector<std::string>{"--tokenizer", "t.json", "--out", "d", "--workers", "3",
                                          "--val_fraction", "0.1", "a.jsonl"}));
  auto b = words({"prepare", "--out", "d", "--tokenizer=t.model", "x.txt"});
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(*b, (std::vector<std::string>{"--out", "d", "--tokenizer=t.model", "x.txt"}));
  // Byte-level prepare, --tokenizer after "--" (a file name) and other commands stay here.
  EXPECT_FALSE(words({"prepare", "--out", "d", "x.txt"}).has_value());
  EXPECT_FALSE(words({"prepare", "--out", "d", "--", "--tokenizer"}).has_value());
  EXPECT_FALSE(words({"--coordinator", "prepare", "list", "--tokenizer", "t"}).has_value());
  EXPECT_FALSE(words({"submit", "--tokenizer", "t.json"}).has_value());
  EXPECT_FALSE(words({}).has_value());
}

TEST(CliArgs, ErrorsNameTheFlagAsWritten) {
  auto unknown = Parse({"list", "--bogus_flag"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().message(), "unknown flag --bogus_flag");
  auto missing = Parse({"submit", "j.yaml", "--request_id"});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(), "--request_id needs a value");
}

TEST(CliArgs, EveryFlagIsDashed) {
  for (const auto& [name, takes_value] : CliFlags()) {
    EXPECT_EQ(name.find('_'), std::string::npos) << name;
    EXPECT_EQ(DashedFlagName(name), name);
  }
}

// Runs `fsdp8 ARGS` through the shell; returns the exit code, stderr in *err.
int RunCli(const std::string& args, const std::string& dir, std::string* err) {
  const std::string err_file = dir + "/stderr";
  const std::string cmd =
      std::string(FSDP8_CLI_BIN) + " " + args + " > /dev/null 2> " + err_file;
  const int status = std::system(cmd.c_str());
  std::ifstream in(err_file);
  std::stringstream ss;
  ss << in.rdbuf();
  *err = ss.str();
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(CliBinary, OldUnderscoreFlagStillWorksWithAWarning) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "fsdp8-cli-XXXXXX").string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const std::string dir = mkdtemp(buf.data());
  std::ofstream(dir + "/in.txt") << std::string(1000, 'x');
  std::string err;
  ASSERT_EQ(RunCli("prepare --out " + dir + "/new --val-fraction 0.25 " + dir + "/in.txt", dir,
                   &err),
            0)
      << err;
  EXPECT_EQ(err, "");
  ASSERT_EQ(RunCli("prepare --out " + dir + "/old --val_fraction 0.25 " + dir + "/in.txt", dir,
                   &err),
            0)
      << err;
  EXPECT_EQ(err, "warning: --val_fraction is deprecated, use --val-fraction\n");
  EXPECT_EQ(ReadAll(dir + "/old/val.bin"), ReadAll(dir + "/new/val.bin"));
  EXPECT_EQ(ReadAll(dir + "/old/train.bin"), ReadAll(dir + "/new/train.bin"));
  EXPECT_EQ(RunCli("prepare --out " + dir + "/bad --val_fraction x " + dir + "/in.txt", dir, &err),
            2);
  EXPECT_NE(err.find("error: --val-fraction: not a number"), std::string::npos) << err;
  std::filesystem::remove_all(dir);
}

// A --tokenizer folder that does not exist is refused before anything is read or written (a typo
// would otherwise export without the tokenizer files, silently).
TEST(CliBinary, ExportRefusesAMissingTokenizerFolder) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "fsdp8-cli-XXXXXX").string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const std::string dir = mkdtemp(buf.data());
  std::filesystem::create_directories(dir + "/ckpt");
  std::string err;
  EXPECT_EQ(RunCli("export " + dir + "/ckpt --out " + dir + "/hf --tokenizer " + dir + "/no-such",
                   dir, &err),
            2);
  EXPECT_NE(err.find("--tokenizer: \"" + dir + "/no-such\" is not a directory"), std::string::npos)
      << err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/hf"));
  std::filesystem::remove_all(dir);
}

// A job id given with no coordinator to ask (after `fsdp8 run` ended, say) is refused saying what
// to give instead, and nothing is written.
TEST(CliBinary, ExportOfAJobIdWithNoCoordinatorNamesTheCheckpointFolder) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "fsdp8-cli-XXXXXX").string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const std::string dir = mkdtemp(buf.data());
  std::string err;
  // Port 1 on the loopback: nothing listens there.
  EXPECT_EQ(RunCli("--coordinator 127.0.0.1:1 export job-12345678 --out " + dir + "/hf", dir, &err),
            1);
  EXPECT_NE(err.find("error: UNAVAILABLE"), std::string::npos) << err;
  EXPECT_NE(err.find("\"job-12345678\" is not a folder"), std::string::npos) << err;
  EXPECT_NE(err.find("give the job's checkpoint folder instead"), std::string::npos) << err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/hf"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fsdp8
