// HttpServer: a small read-only HTTP/1.1 server (GNU libmicrohttpd, Debian libmicrohttpd-dev) for
// /metrics and the coordinator's status page. GET and HEAD only (anything else: 405); the handler
// runs on libmicrohttpd's thread pool, so it must be thread-safe.
//
// Thread-safety: Start/Stop/port from any thread; the destructor stops the server and waits for
// running handlers.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

struct MHD_Daemon;

namespace fsdp8 {

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// path: the URL path ("/metrics"); query: the raw query string after '?', or "".
using HttpHandler = std::function<HttpResponse(const std::string& path, const std::string& query)>;

class HttpServer {
 public:
  // Listens on host:port (an IPv4 or IPv6 literal; "0.0.0.0" for every IPv4 address; port 0 picks
  // a free port). INVALID_ARGUMENT for a bad host or port, UNAVAILABLE when it cannot bind
  // (the message names the address).
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const std::string& host, int port,
                                                           HttpHandler handler);
  ~HttpServer();
  int port() const { return port_; }

 private:
  HttpServer() = default;
  MHD_Daemon* daemon_ = nullptr;
  HttpHandler handler_;
  int port_ = 0;
};

}  // namespace fsdp8
