// Helpers for the observability tests: plain HTTP GETs on loopback and the independent exposition
// reader (parse_prom.py, the Python prometheus_client parser). Child processes come from
// tests/support/process.h.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "tests/support/process.h"

namespace fsdp8::obs_test {

namespace fs = std::filesystem;

using testing::ChildProcess;
using testing::ProcessOptions;
using testing::ReadFile;
using testing::WriteFile;

// Children of these tests lead process groups of their own: stopping one (a browser) stops its
// helpers too.
inline ProcessOptions GroupOptions() {
  ProcessOptions o;
  o.own_process_group = true;
  return o;
}

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
