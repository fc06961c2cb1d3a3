// Helpers for the observability tests: child processes, plain HTTP GETs on loopback, and the
// independent exposition reader (parse_prom.py, the Python prometheus_client parser).
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

extern char** environ;

namespace fsdp8::obs_test {

namespace fs = std::filesystem;

inline std::string ReadFile(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

inline void WriteFile(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary);
  f << s;
}

// A child process in its own process group, stdout+stderr to a log. The destructor sends SIGTERM
// to the group, then SIGKILL after 5 s, and reaps it, so no test leaves a process behind.
class Process {
 public:
  Process(const std::vector<std::string>& argv, const std::string& log_path) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    posix_spawnattr_t at;
    posix_spawnattr_init(&at);
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&at, 0);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &fa, &at, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&at);
  }
  ~Process() { Stop(); }
  bool ok() const { return pid_ > 0; }
  // Waits up to `timeout` for the process to exit; returns its exit status (-1 on timeout, after
  // which the group is killed).
  int Wait(std::chrono::seconds timeout) {
    if (pid_ <= 0) return -1;
    const auto until = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      int st = 0;
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        kill(-pid_, SIGKILL);  // helpers it left behind (a browser's renderers)
        pid_ = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      if (std::chrono::steady_clock::now() >= until) {
        Stop();
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  void Stop() {
    if (pid_ <= 0) return;
    kill(-pid_, SIGTERM);
    for (int i = 0; i < 50; ++i) {
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        kill(-pid_, SIGKILL);
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    kill(-pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
};

// A port that was free a moment ago on 127.0.0.1 (the kernel's pick).
inline int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

struct HttpResult {
  int status = 0;  // 0: no connection
  std::string content_type;
  std::string body;
};

// One HTTP/1.0 request to 127.0.0.1:port (5 s timeouts).
inline HttpResult HttpRequest(int port, const std::string& method, const std::string& path) {
  HttpResult r;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return r;
  }
  const std::string req = method + " " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return r;
  }
  std::string raw;
  char buf[65536];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    raw.append(buf, n);
  }
  close(fd);
  const size_t sp = raw.find(' ');
  const size_t hdr_end = raw.find("\r\n\r\n");
  if (sp == std::string::npos || hdr_end == std::string::npos) return r;
  r.status = std::atoi(raw.c_str() + sp + 1);
  const std::string headers = raw.substr(0, hdr_end);
  for (const std::string key : {"Content-Type: ", "content-type: "}) {
    size_t at = headers.find(key);
    if (at != std::string::npos) {
      size_t end = headers.find("\r\n", at);
      r.content_type = headers.substr(at + key.size(), end - at - key.size());
    }
  }
  r.body = raw.substr(hdr_end + 4);
  return r;
}

inline HttpResult HttpGet(int port, const std::string& path) { return HttpRequest(port, "GET", path); }

// One sample as the reference parser read it.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = NAN;
};
struct Family {
  std::string name, type, help;
  std::vector<Sample> samples;
};
using Exposition = std::map<std::string, Family>;  // by family name (counters without _total)

// Parses `text` with parse_prom.py (FSDP8_PARSE_PROM); false with *error on a parser error.
inline bool ParseExposition(const std::string& text, const fs::path& scratch, Exposition* out,
                            std::string* error) {
  const fs::path in = scratch.string() + ".prom", json = scratch.string() + ".json",
                 err = scratch.string() + ".err";
  WriteFile(in, text);
  const std::string cmd = std::string("/usr/bin/python3 ") + FSDP8_PARSE_PROM + " " + in.string() +
                          " > " + json.string() + " 2> " + err.string();
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    *error = "parse_prom.py failed (" + std::to_string(rc) + "): " + ReadFile(err);
    return false;
  }
  google::protobuf::Struct doc;
  if (!google::protobuf::util::JsonStringToMessage(ReadFile(json), &doc).ok()) {
    *error = "parse_prom.py printed no JSON";
    return false;
  }
  out->clear();
  for (const auto& f : doc.fields().at("families").list_value().values()) {
    const auto& ff = f.struct_value().fields();
    Family fam;
    fam.name = ff.at("name").string_value();
    fam.type = ff.at("type").string_value();
    fam.help = ff.at("help").string_value();
    for (const auto& s : ff.at("samples").list_value().values()) {
      const auto& sf = s.struct_value().fields();
      Sample smp;
      smp.name = sf.at("name").string_value();
      for (const auto& [k, v] : sf.at("labels").struct_value().fields())
        smp.labels[k] = v.string_value();
      smp.value = std::strtod(sf.at("value").string_value().c_str(), nullptr);
      fam.samples.push_back(std::move(smp));
    }
    (*out)[fam.name] = std::move(fam);
  }
  return true;
}

// The value of sample `name` whose labels include every pair of `match`; NaN when absent.
inline double Value(const Exposition& e, const std::string& family, const std::string& name,
                    const std::map<std::string, std::string>& match) {
  auto it = e.find(family);
  if (it == e.end()) return NAN;
  for (const Sample& s : it->second.samples) {
    if (s.name != name) continue;
    bool all = true;
    for (const auto& [k, v] : match) {
      auto l = s.labels.find(k);
      all &= l != s.labels.end() && l->second == v;
    }
    if (all) return s.value;
  }
  return NAN;
}

}  // namespace fsdp8::obs_test
