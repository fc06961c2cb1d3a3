#include "client/local_run.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/client.h"

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr char kListening[] = "fsdp8-coordinator listening on ";

// Starts argv[0] with its output appended to `log`, in a process group of its own, ending with
// this process (PR_SET_PDEATHSIG); `inherit_fd` (>= 0) stays open across the exec (the run.lock
// descriptor; every other child of the CLI, gnuplot say, does not get it). Returns the pid, or -1
// with errno.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& log, int inherit_fd) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) return pid;
  // Child: only async-signal-safe calls until exec.
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) _exit(127);  // the CLI already went
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd >= 0) {
    dup2(fd, 1);
    dup2(fd, 2);
  }
  if (inherit_fd >= 0) fcntl(inherit_fd, F_SETFD, 0);
  execv(args[0], args.data());
  _exit(127);
}

bool Exited(pid_t pid) {
  int status = 0;
  return waitpid(pid, &status, WNOHANG) == pid;
}

// SIGTERM, up to `grace` to exit, then SIGKILL; reaps.
void Terminate(pid_t pid, std::chrono::milliseconds grace) {
  if (pid <= 0) return;
  kill(pid, SIGTERM);
  const auto until = Clock::now() + grace;
  while (Clock::now() < until) {
    if (Exited(pid)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
}

uintmax_t FileSize(const std::string& path) {
  std::error_code ec;
  const uintmax_t n = fs::file_size(path, ec);
  return ec ? 0 : n;
}

// The address after kListening in `log` past byte `from`, once a whole line holds it; "" if none.
std::string ListeningAddress(const std::string& log, uintmax_t from) {
  std::ifstream in(log);
  in.seekg(static_cast<std::streamoff>(from));
  std::string line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // no newline yet: the line may be incomplete
    const size_t at = line.find(kListening);
    if (at != std::string::npos) return line.substr(at + std::strlen(kListening));
  }
  return "";
}

}  // namespace

std::string LocalStateDir(const std::string& spec_path) {
  const fs::path p = fs::absolute(fs::path(spec_path)).lexically_normal();
  return (p.parent_path() / (p.stem().string() + ".fsdp8")).string();
}

std::string ExecutableDir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "" : exe.parent_path().string();
}

int CountGpus() {
  static const std::regex kDevice("nvidia[0-9]+");
  int n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev", ec))
    if (std::regex_match(e.path().filename().string(), kDevice)) ++n;
  return n;
}

absl::StatusOr<std::unique_ptr<LocalServices>> LocalServices::Start(const LocalRunOptions& o) {
  for (const char* b : {"fsdp8-coordinator", "fsdp8-worker"}) {
    const std::string path = (fs::path(o.bin_dir) / b).string();
    if (access(path.c_str(), X_OK) != 0)
      return absl::FailedPreconditionError(absl::StrCat(
          "run: ", path, " is not there (fsdp8 run starts the daemons installed beside fsdp8; "
          "build them: scripts/build.sh fsdp8-coordinator fsdp8-worker fsdp8)"));
  }
  if (o.workers < 1)
    return absl::InvalidArgumentError(absl::StrCat("run: workers must be >= 1 (got ", o.workers, ")"));
  std::error_code ec;
  fs::create_directories(o.state_dir, ec);
  if (ec)
    return absl::FailedPreconditionError(
        absl::StrCat("run: cannot create the state directory ", o.state_dir, ": ", ec.message()));
  std::unique_ptr<LocalServices> s(new LocalServices());
  // One run per state directory: a second would open the same state db. The daemons inherit the
  // locked descriptor (Spawn), so the lock holds until the last of them has exited, also when
  // this process is killed and they are still shutting down.
  const std::string lock = (fs::path(o.state_dir) / "run.lock").string();
  s->lock_fd_ = open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (s->lock_fd_ < 0)
    return absl::FailedPreconditionError(absl::StrCat("run: cannot open ", lock, ": ", std::strerror(errno)));
  if (flock(s->lock_fd_, LOCK_EX | LOCK_NB) != 0)
    return absl::FailedPreconditionError(absl::StrCat(
        "run: another fsdp8 run is using ", o.state_dir, " (", lock,
        " is locked, by it or by its daemons while they stop); wait for it to end, or use "
        "another --state-dir"));
  if (absl::Status st = s->StartCoordinator(o); !st.ok()) return st;
  if (absl::Status st = s->StartWorkers(o); !st.ok()) return st;
  return s;
}

absl::Status LocalServices::StartCoordinator(const LocalRunOptions& o) {
  const std::string log = (fs::path(o.state_dir) / "coordinator.log").string();
  const uintmax_t from = FileSize(log);
  coordinator_ = Spawn({(fs::path(o.bin_dir) / "fsdp8-coordinator").string(),
                        "--listen=127.0.0.1:0",
                        "--state_db=" + (fs::path(o.state_dir) / "jobs.db").string()},
                       log, lock_fd_);
  if (coordinator_ < 0)
    return absl::UnavailableError(absl::StrCat("run: cannot start fsdp8-coordinator: ",
                                               std::strerror(errno)));
  const auto until = Clock::now() + std::chrono::seconds(30);
  while (Clock::now() < until) {
    address_ = ListeningAddress(log, from);
    if (!address_.empty()) return absl::OkStatus();
    if (Exited(coordinator_)) {
      coordinator_ = -1;
      return absl::UnavailableError(
          absl::StrCat("run: fsdp8-coordinator exited before it listened; see ", log));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::UnavailableError(
      absl::StrCat("run: fsdp8-coordinator did not listen within 30 s; see ", log));
}

absl::Status LocalServices::StartWorkers(const LocalRunOptions& o) {
  const std::string worker = (fs::path(o.bin_dir) / "fsdp8-worker").string();
  for (int i = 0; i < o.workers; ++i) {
    std::vector<std::string> argv{worker, "--coordinator=" + address_, "--host=127.0.0.1"};
    if (o.backend == "cuda") {
      argv.push_back("--backend=cuda");
      argv.push_back(absl::StrCat("--device=", i));
      argv.push_back(absl::StrCat("--name=local-gpu-", i));
    } else {
      argv.push_back(absl::StrCat("--threads=", std::max(1, o.threads)));
      argv.push_back(absl::StrCat("--name=local-", i));
    }
    const pid_t pid =
        Spawn(argv, (fs::path(o.state_dir) / absl::StrCat("worker-", i, ".log")).string(), lock_fd_);
    if (pid < 0)
      return absl::UnavailableError(absl::StrCat("run: cannot start fsdp8-worker: ", std::strerror(errno)));
    workers_.push_back(pid);
  }
  auto client = Client::Connect(address_);
  if (!client.ok()) return client.status();
  const auto until = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < until) {
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (Exited(workers_[i])) {
        workers_[i] = -1;
        return absl::UnavailableError(absl::StrCat("run: worker ", i, " exited; see ",
                                                   (fs::path(o.state_dir) / absl::StrCat("worker-", i, ".log")).string()));
      }
    }
    auto ws = (*client)->ListWorkers();
    if (ws.ok() && static_cast<int>(ws->size()) >= o.workers) return absl::OkStatus();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return absl::UnavailableError(absl::StrCat("run: the workers did not register within 60 s; see ",
                                             o.state_dir, "/worker-<i>.log"));
}

void LocalServices::Stop() {
  for (pid_t& w : workers_) {
    if (w > 0) kill(w, SIGTERM);
  }
  for (pid_t& w : workers_) {
    Terminate(w, std::chrono::seconds(10));
    w = -1;
  }
  Terminate(coordinator_, std::chrono::seconds(10));
  coordinator_ = -1;
}

LocalServices::~LocalServices() {
  Stop();
  if (lock_fd_ >= 0) close(lock_fd_);  // releases the lock
}

}  // namespace fsdp8
