// Client channels to the coordinator, shared by the CLI/SDK and the worker daemon: plaintext, TLS
// (server verified against a CA bundle) or mutual TLS (plus a client certificate), an optional
// bearer token sent as "authorization: Bearer TOKEN" on every call, message size limits and
// keepalive pings (so a dead coordinator is noticed on long-lived streams).
//
// Thread-safety: pure functions; the returned channel is thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace fsdp8 {

struct ChannelSecurity {
  std::string tls_ca;    // PEM CA bundle that the coordinator's certificate must chain to; empty:
                         // plaintext (unless tls_cert is set: then the system roots)
  std::string tls_cert;  // PEM client certificate chain (mutual TLS), with tls_key
  std::string tls_key;
  std::string token;     // bearer token; empty: none
  int max_message_bytes = 64 << 20;
};

// Creates the channel (no round trip). INVALID_ARGUMENT for tls_cert without tls_key (or the
// reverse) or a token with a space or control character; NOT_FOUND for an unreadable file.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           const ChannelSecurity& security);

// A token from a file: its first line, surrounding whitespace removed. NOT_FOUND when unreadable,
// INVALID_ARGUMENT when empty.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

}  // namespace fsdp8
