#include "client/plot.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

extern char** environ;

namespace fsdp8 {
namespace {

namespace fs = std::filesystem;

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The gnuplot terminal for a file name ("" when none fits).
std::string Terminal(const std::string& path) {
  if (EndsWith(path, ".png")) return "pngcairo size 1000,600 font 'DejaVu Sans,11'";
  if (EndsWith(path, ".svg")) return "svg size 1000,600 dynamic font 'DejaVu Sans,11'";
  if (EndsWith(path, ".pdf")) return "pdfcairo size 10in,6in font 'DejaVu Sans,11'";
  return "";
}

// A gnuplot single-quoted string: '' stands for one quote; no other escapes are interpreted.
std::string Quote(const std::string& s) {
  return "'" + absl::StrReplaceAll(s, {{"'", "''"}, {"\n", " "}}) + "'";
}

// Whether `name` is an executable on PATH.
bool OnPath(const std::string& name) {
  const char* path = getenv("PATH");
  if (path == nullptr) return false;
  std::stringstream ss(path);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (dir.empty()) continue;
    if (access((fs::path(dir) / name).c_str(), X_OK) == 0) return true;
  }
  return false;
}

}  // namespace

absl::Status CheckPlotPath(const std::string& path) {
  if (Terminal(path).empty())
    return absl::InvalidArgumentError(
        absl::StrCat("--plot: \"", path, "\" must end in .png, .svg or .pdf (the image format)"));
  return absl::OkStatus();
}

absl::Status WriteLossPlot(const std::string& path, const std::string& title,
                           const std::vector<LossPoint>& points) {
  if (absl::Status s = CheckPlotPath(path); !s.ok()) return s;
  if (points.empty()) return absl::FailedPreconditionError("--plot: the job has no steps to plot yet");
  if (!OnPath("gnuplot"))
    return absl::FailedPreconditionError(
        "--plot: gnuplot is not installed (apt-get install gnuplot-nox)");
  const std::string tmp = absl::StrCat(path, ".tmp-", getpid());
  const std::string data = tmp + ".dat", script = tmp + ".gp", log = tmp + ".log";
  auto cleanup = [&] {
    std::error_code ec;
    for (const std::string& f : {data, script, log, tmp}) fs::remove(f, ec);
  };
  {
    std::ofstream d(data);
    for (const LossPoint& p : points)
      d << p.step << ' ' << absl::StrFormat("%.9g", p.loss) << ' '
        << (std::isnan(p.val_loss) ? std::string("NaN") : absl::StrFormat("%.9g", p.val_loss))
        << '\n';
    if (!d) {
      cleanup();
      return absl::InternalError(absl::StrCat("--plot: cannot write ", data));
    }
  }
  bool any_val = false;
  for (const LossPoint& p : points) any_val |= !std::isnan(p.val_loss);
  {
    std::ofstream g(script);
    g << "set terminal " << Terminal(path) << "\n"
      << "set output " << Quote(tmp) << "\n"
      << "set title " << Quote(title) << " noenhanced\n"
      << "set xlabel 'step'\nset ylabel 'loss (nats per token)'\n"
      << "set grid\nset key top right\nset datafile missing 'NaN'\n"
      << "plot " << Quote(data) << " using 1:2 with lines lw 2 lc rgb '#1f77b4' title 'train loss'";
    if (any_val)
      g << ", " << Quote(data)
        << " using 1:3 with linespoints pt 7 ps 0.8 lw 2 lc rgb '#d62728' title 'val loss'";
    g << "\nset output\n";
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::string prog = "gnuplot";
  char* argv[] = {prog.data(), const_cast<char*>(script.c_str()), nullptr};
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, "gnuplot", &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    cleanup();
    return absl::FailedPreconditionError(absl::StrCat("--plot: cannot run gnuplot: ", strerror(rc)));
  }
  int status = 0;
  bool exited = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!exited) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    if (std::chrono::steady_clock::now() > until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!exited) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    cleanup();
    return absl::InternalError("--plot: gnuplot ran over 60 s");
  }
  std::ifstream l(log);
  const std::string output((std::istreambuf_iterator<char>(l)), {});
  std::error_code ec;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !fs::exists(tmp, ec) ||
      fs::file_size(tmp, ec) == 0) {
    cleanup();
    return absl::InternalError(absl::StrCat("--plot: gnuplot failed: ", output));
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    cleanup();
    return absl::InternalError(absl::StrCat("--plot: cannot write ", path, ": ", ec.message()));
  }
  cleanup();
  return absl::OkStatus();
}

}  // namespace fsdp8
