#include "client/tensorboard.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "google/protobuf/util/json_util.h"

extern char** environ;

namespace fsdp8 {
namespace {

constexpr std::chrono::seconds kTimeout(120);

void CloseFd(int* fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

// Reads `fd` to its end or until `until`; false on timeout.
bool ReadAll(int fd, std::chrono::steady_clock::time_point until, std::string* out) {
  char buf[4096];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return true;  // end of file (or an error: nothing more to read)
    out->append(buf, static_cast<size_t>(n));
  }
}

// Reads from `fd` until a newline, its end or `until`; returns what came, without the newline.
std::string ReadLine(int fd, std::chrono::steady_clock::time_point until, bool* timed_out) {
  std::string line;
  *timed_out = false;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      *timed_out = true;
      return line;
    }
    pollfd p{fd, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) continue;  // the deadline is checked above
    char c;
    const ssize_t n = read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || c == '\n') return line;
    line += c;
  }
}

// Waits for `pid` until `until`; kills it past that. Returns the wait status, or -1 when killed.
int WaitUntil(pid_t pid, std::chrono::steady_clock::time_point until) {
  int status = 0;
  while (true) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid || (r < 0 && errno != EINTR)) return status;
    if (std::chrono::steady_clock::now() > until) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string ExitText(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("signal ", WTERMSIG(status));
  return absl::StrCat("wait status ", status);
}

absl::Status NotInstalled() {
  return absl::FailedPreconditionError(absl::StrCat(
      "--tensorboard: ", kTensorBoardProgram,
      " (fsdp8's Python SDK) is not on PATH; install the SDK with the tensorboard package (from "
      "the fsdp8 source tree; a virtual environment on Debian 12): python3 -m pip install "
      "'./client/python[tensorboard]'"));
}

}  // namespace

absl::Status CheckTensorBoardProgram() {
  const char* path = getenv("PATH");
  std::string dirs = path == nullptr ? "" : path;
  for (size_t at = 0; at <= dirs.size();) {
    size_t colon = dirs.find(':', at);
    if (colon == std::string::npos) colon = dirs.size();
    const std::string dir = dirs.substr(at, colon - at);
    at = colon + 1;
    if (dir.empty()) continue;
    if (access((dir + "/" + kTensorBoardProgram).c_str(), X_OK) == 0) return absl::OkStatus();
  }
  return NotInstalled();
}

absl::StatusOr<std::unique_ptr<TensorBoardSink>> TensorBoardSink::Start(const std::string& dir,
                                                                        const std::string& job_id) {
  signal(SIGPIPE, SIG_IGN);
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(in[0]);
    close(in[1]);
    return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  std::string prog = kTensorBoardProgram, a1 = "--logdir", a2 = "--job";
  std::string d = dir, j = job_id;
  char* argv[] = {prog.data(), a1.data(), d.data(), a2.data(), j.data(), nullptr};
  std::unique_ptr<TensorBoardSink> sink(new TensorBoardSink());
  const int rc = posix_spawnp(&sink->pid_, kTensorBoardProgram, &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(in[0]);
  close(out[1]);
  sink->to_child_ = in[1];
  sink->from_child_ = out[0];
  if (rc != 0) {
    sink->pid_ = -1;
    if (rc == ENOENT) return NotInstalled();
    return absl::FailedPreconditionError(
        absl::StrCat("--tensorboard: cannot run ", kTensorBoardProgram, ": ", strerror(rc)));
  }
  bool timed_out = false;
  const auto until = std::chrono::steady_clock::now() + kTimeout;
  const std::string ready = ReadLine(sink->from_child_, until, &timed_out);
  if (timed_out) {
    return absl::DeadlineExceededError(absl::StrCat("--tensorboard: ", kTensorBoardProgram,
                                                    " did not start within ", kTimeout.count(),
                                                    " s"));
  }
  if (ready.empty()) {  // it exited (its own message went to our standard error)
    CloseFd(&sink->to_child_);
    const int status = WaitUntil(sink->pid_, until);
    sink->pid_ = -1;
    return absl::FailedPreconditionError(absl::StrCat(
        "--tensorboard: ", kTensorBoardProgram, " stopped before writing anything (",
        ExitText(status), ")"));
  }
  return sink;
}

TensorBoardSink::~TensorBoardSink() {
  CloseFd(&to_child_);
  CloseFd(&from_child_);
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

absl::Status TensorBoardSink::Write(const v1::JobEvent& ev) {
  if (write_failed_ || to_child_ < 0)
    return absl::InternalError(absl::StrCat("--tensorboard: ", kTensorBoardProgram, " stopped"));
  std::string line;
  google::protobuf::util::JsonPrintOptions o;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(ev, &line, o);
  line += '\n';
  for (size_t done = 0; done < line.size();) {
    const ssize_t n = write(to_child_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      write_failed_ = true;
      return absl::InternalError(absl::StrCat("--tensorboard: writing to ", kTensorBoardProgram,
                                              ": ", strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> TensorBoardSink::Finish() {
  CloseFd(&to_child_);
  const auto until = std::chrono::steady_clock::now() + kTimeout;
  std::string rest;
  const bool ended = ReadAll(from_child_, until, &rest);
  CloseFd(&from_child_);
  const int status = WaitUntil(pid_, ended ? until : std::chrono::steady_clock::now());
  pid_ = -1;
  if (status == -1) {
    return absl::DeadlineExceededError(absl::StrCat(
        "--tensorboard: ", kTensorBoardProgram, " did not finish within ", kTimeout.count(), " s"));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || write_failed_) {
    return absl::InternalError(
        absl::StrCat("--tensorboard: ", kTensorBoardProgram, " failed (", ExitText(status), ")"));
  }
  std::string last(absl::StripTrailingAsciiWhitespace(rest));
  if (const size_t nl = last.rfind('\n'); nl != std::string::npos) last = last.substr(nl + 1);
  return last;
}

}  // namespace fsdp8
