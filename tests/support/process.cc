#include "tests/support/process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

extern char** environ;

namespace fsdp8::testing {
namespace {

namespace fs = std::filesystem;

// setpriv's path, found once on the PATH; "" when it is not installed.
const std::string& SetprivPath() {
  static const std::string path = [] {
    const char* env = std::getenv("PATH");
    std::string dirs = env != nullptr ? env : "/usr/bin:/bin";
    for (size_t begin = 0; begin <= dirs.size();) {
      size_t end = dirs.find(':', begin);
      if (end == std::string::npos) end = dirs.size();
      const std::string candidate = dirs.substr(begin, end - begin) + "/setpriv";
      if (end > begin && access(candidate.c_str(), X_OK) == 0) return candidate;
      begin = end + 1;
    }
    return std::string();
  }();
  return path;
}

// The test's environment with `overrides` ("NAME=value") added or replacing same-named entries.
std::vector<std::string> ChildEnvironment(const std::vector<std::string>& overrides) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('=') + 1);
    bool replaced = false;
    for (const std::string& o : overrides) replaced |= o.rfind(name, 0) == 0;
    if (!replaced) env.push_back(entry);
  }
  env.insert(env.end(), overrides.begin(), overrides.end());
  return env;
}

std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

}  // namespace

ChildProcess::ChildProcess(const std::vector<std::string>& argv, const std::string& log_path,
                           const ProcessOptions& options)
    : group_(options.own_process_group) {
  std::vector<std::string> args;
  if (!SetprivPath().empty()) args = {SetprivPath(), "--pdeathsig", "KILL", "--"};
  args.insert(args.end(), argv.begin(), argv.end());
  std::vector<std::string> env = ChildEnvironment(options.env);
  std::vector<char*> c_args = CStrings(args), c_env = CStrings(env);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  if (group_) {
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
  }
  if (posix_spawn(&pid_, c_args[0], &fa, &attr, c_args.data(), c_env.data()) != 0) pid_ = -1;
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
}

ChildProcess::~ChildProcess() { Stop(); }

void ChildProcess::SendSignal(int sig) const { kill(group_ ? -pid_ : pid_, sig); }

void ChildProcess::KillGroupLeftovers() const {
  if (group_) kill(-pid_, SIGKILL);
}

void ChildProcess::Signal(int sig) const {
  if (pid_ > 0) SendSignal(sig);
}

bool ChildProcess::Kill() {
  if (pid_ <= 0) return true;
  SendSignal(SIGKILL);
  const bool reaped = waitpid(pid_, nullptr, 0) == pid_;
  pid_ = -1;
  return reaped;
}

int ChildProcess::Wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return kStillRunning;
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      KillGroupLeftovers();
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (std::chrono::steady_clock::now() >= until) return kStillRunning;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void ChildProcess::Stop() {
  if (pid_ <= 0) return;
  SendSignal(SIGTERM);
  for (int i = 0; i < 50; ++i) {
    if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
      KillGroupLeftovers();
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  SendSignal(SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void WriteFile(const fs::path& path, const std::string& contents) {
  std::ofstream f(path, std::ios::binary);
  f << contents;
}

std::string WaitForLogLine(const fs::path& log, const std::string& prefix,
                           std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const std::string text = ReadFile(log);
    const size_t at = text.find(prefix);
    if (at != std::string::npos) {
      const size_t begin = at + prefix.size();
      const size_t end = text.find('\n', begin);
      if (end != std::string::npos) return text.substr(begin, end - begin);
    }
    if (std::chrono::steady_clock::now() >= until) return "";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace fsdp8::testing
