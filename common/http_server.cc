#include "common/http_server.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace fsdp8 {
namespace {

struct QueryCollector {
  std::string query;
};

MHD_Result AddArg(void* cls, MHD_ValueKind, const char* key, const char* value) {
  auto* q = static_cast<QueryCollector*>(cls);
  if (!q->query.empty()) q->query += '&';
  q->query += key;
  if (value) {
    q->query += '=';
    q->query += value;
  }
  return MHD_YES;
}

MHD_Result Queue(MHD_Connection* c, const HttpResponse& r, bool head) {
  MHD_Response* resp = MHD_create_response_from_buffer(
      head ? 0 : r.body.size(), const_cast<char*>(r.body.data()), MHD_RESPMEM_MUST_COPY);
  if (resp == nullptr) return MHD_NO;
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, r.content_type.c_str());
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
  const MHD_Result ret = MHD_queue_response(c, static_cast<unsigned>(r.status), resp);
  MHD_destroy_response(resp);
  return ret;
}

MHD_Result Access(void* cls, MHD_Connection* c, const char* url, const char* method,
                  const char* /*version*/, const char* /*upload*/, size_t* upload_size,
                  void** con_cls) {
  // The first call per request only announces the headers; answer on the second.
  static int marker;
  if (*con_cls != &marker) {
    *con_cls = &marker;
    return MHD_YES;
  }
  const bool head = strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
  if (!head && strcmp(method, MHD_HTTP_METHOD_GET) != 0) {
    HttpResponse r{405, "text/plain; charset=utf-8", "only GET and HEAD are served\n"};
    return Queue(c, r, false);
  }
  if (*upload_size != 0) {
    *upload_size = 0;  // a GET body is ignored
    return MHD_YES;
  }
  QueryCollector q;
  MHD_get_connection_values(c, MHD_GET_ARGUMENT_KIND, &AddArg, &q);
  const HttpHandler& h = *static_cast<HttpHandler*>(cls);
  HttpResponse r;
  try {
    r = h(url ? url : "/", q.query);
  } catch (...) {  // never let an exception unwind into C
    r = HttpResponse{500, "text/plain; charset=utf-8", "internal error\n"};
  }
  return Queue(c, r, head);
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& host, int port,
                                                               HttpHandler handler) {
  if (port < 0 || port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("metrics port: must be in [0, 65535] (got ", port, ")"));
  sockaddr_storage ss{};
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                   MHD_USE_ERROR_LOG;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
  } else if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    flags |= MHD_USE_IPv6;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics host: \"", host, "\" is not an IPv4 or IPv6 address"));
  }
  std::unique_ptr<HttpServer> s(new HttpServer());
  s->handler_ = std::move(handler);
  s->daemon_ = MHD_start_daemon(
      flags, static_cast<uint16_t>(port), nullptr, nullptr,
      &Access, &s->handler_,
      MHD_OPTION_SOCK_ADDR, reinterpret_cast<sockaddr*>(&ss),
      MHD_OPTION_CONNECTION_TIMEOUT, 10u,   // seconds: an idle client never holds a thread long
      MHD_OPTION_CONNECTION_LIMIT, 64u,
      MHD_OPTION_END);
  if (s->daemon_ == nullptr)
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", host, ":", port, ": ",
                                               strerror(errno)));
  const MHD_DaemonInfo* info = MHD_get_daemon_info(s->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  s->port_ = info ? info->port : port;
  return s;
}

HttpServer::~HttpServer() {
  if (daemon_) MHD_stop_daemon(daemon_);
}

}  // namespace fsdp8
