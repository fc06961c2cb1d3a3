// The CLI's spec files are bounded: the fsdp8 binary refuses a file larger than the limit on a
// job spec (kMaxSpecBytes, the coordinator's) before reading it, in bounded memory, naming the
// limit. The child's peak resident memory comes from the kernel (wait4's rusage), not from the
// code under test.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

struct CliRun {
  int exit_code = -1;
  long max_rss_kb = -1;  // the child's peak resident set (ru_maxrss, KiB)
  std::string err;       // its standard error
};

// Runs the fsdp8 binary with `args` (stdout to /dev/null, stderr to dir/stderr) and waits for it
// with wait4, which reports the child's own peak resident memory.
CliRun RunCliMeasured(const std::vector<std::string>& args, const std::string& dir) {
  const std::string err_file = dir + "/stderr";
  std::vector<std::string> argv{FSDP8_CLI_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (std::string& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  CliRun out;
  const pid_t pid = fork();
  if (pid == 0) {
    const int null_fd = open("/dev/null", O_WRONLY);
    const int err_fd = open(err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (null_fd < 0 || err_fd < 0) _exit(127);
    dup2(null_fd, 1);
    dup2(err_fd, 2);
    execv(cargv[0], cargv.data());
    _exit(127);
  }
  if (pid < 0) return out;
  int status = 0;
  struct rusage ru {};
  if (wait4(pid, &status, 0, &ru) != pid) return out;
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  out.max_rss_kb = ru.ru_maxrss;
  std::ifstream in(err_file);
  std::stringstream ss;
  ss << in.rdbuf();
  out.err = ss.str();
  return out;
}

std::string MakeDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "fsdp8-specfile-XXXXXX").string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  return mkdtemp(buf.data());
}

// A YAML spec of exactly `bytes` bytes: a valid spec padded with a comment line.
void WriteSpecOfSize(const std::string& path, size_t bytes) {
  const std::string head = "data: {train_path: /data/train.bin}\n";
  std::string text = head + "#";
  text += std::string(bytes - text.size() - 1, 'x');
  text += "\n";
  ASSERT_EQ(text.size(), bytes);
  std::ofstream(path, std::ios::binary) << text;
}

// 51 MB (53,477,376 bytes) of one YAML string: the CLI used to read it whole and expand it to
// gigabytes before refusing it. Now `submit` and `plan` refuse it before reading it (exit 2),
// naming the file, its size and the limit, with a peak resident set under 100 MB.
TEST(CliBinary, OversizedSpecFileRefusedUnreadInBoundedMemory) {
  const std::string dir = MakeDir();
  const std::string big = dir + "/big.yaml";
  const size_t size = 51u << 20;
  {
    std::ofstream f(big, std::ios::binary);
    f << "name: \"";
    const std::string chunk(1 << 20, 'x');
    for (size_t written = 7; written < size - 2; written += chunk.size()) {
      f.write(chunk.data(), static_cast<std::streamsize>(std::min(chunk.size(), size - 2 - written)));
    }
    f << "\"\n";
  }
  ASSERT_EQ(std::filesystem::file_size(big), size);
  // No coordinator listens on port 1: the file must be refused before any call is made.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--coordinator", "127.0.0.1:1", "submit", big, "--no-watch"},
        std::vector<std::string>{"plan", big}}) {
    const CliRun r = RunCliMeasured(args, dir);
    EXPECT_EQ(r.exit_code, 2) << args[args.size() > 2 ? 2 : 0] << ": " << r.err;
    EXPECT_NE(r.err.find(big), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("53477376 bytes exceeds the limit of 65536 bytes"), std::string::npos)
        << r.err;
    ASSERT_GT(r.max_rss_kb, 0);
    EXPECT_LT(r.max_rss_kb, 100 * 1024) << "peak RSS " << r.max_rss_kb << " KiB";
  }
  std::filesystem::remove_all(dir);
}

// The limit is the spec's, inclusive: a 65,536-byte spec file is read and planned, a 65,537-byte
// one refused.
TEST(CliBinary, SpecFileAtTheLimitIsReadOneByteMoreIsRefused) {
  const std::string dir = MakeDir();
  WriteSpecOfSize(dir + "/at.yaml", 65536);
  WriteSpecOfSize(dir + "/over.yaml", 65537);
  const CliRun at = RunCliMeasured({"plan", dir + "/at.yaml"}, dir);
  EXPECT_EQ(at.exit_code, 0) << at.err;
  const CliRun over = RunCliMeasured({"plan", dir + "/over.yaml"}, dir);
  EXPECT_EQ(over.exit_code, 2) << over.err;
  EXPECT_NE(over.err.find("65537 bytes exceeds the limit of 65536 bytes"), std::string::npos)
      << over.err;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fsdp8
