#include "common/rpc_channel.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/support/client_interceptor.h"

namespace fsdp8 {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& what, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(absl::StrCat(what, ": cannot read ", path, ": ", std::strerror(errno)));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Adds the bearer token to every call's initial metadata. An interceptor rather than call
// credentials, because gRPC sends call credentials only over TLS and tokens also work in plaintext
// (behind a mesh that terminates TLS, or on loopback).
class TokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({"authorization", *header_});
    }
    methods->Proceed();
  }

 private:
  const std::string* header_;
};

class TokenInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::string token) : header_("Bearer " + token) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(&header_);
  }

 private:
  const std::string header_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           const ChannelSecurity& sec) {
  if (address.empty()) return absl::InvalidArgumentError("coordinator address: empty");
  if (sec.tls_cert.empty() != sec.tls_key.empty())
    return absl::InvalidArgumentError("tls-cert and tls-key: give both or neither");
  for (unsigned char c : sec.token)
    if (c <= 0x20 || c >= 0x7f)
      return absl::InvalidArgumentError("token: must be printable ASCII without spaces");
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (sec.tls_ca.empty() && sec.tls_cert.empty()) {
    creds = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    if (!sec.tls_ca.empty()) {
      auto ca = ReadFile("tls-ca", sec.tls_ca);
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
    }
    if (!sec.tls_cert.empty()) {
      auto cert = ReadFile("tls-cert", sec.tls_cert);
      if (!cert.ok()) return cert.status();
      auto key = ReadFile("tls-key", sec.tls_key);
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(sec.max_message_bytes);
  args.SetMaxSendMessageSize(sec.max_message_bytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  // Reconnect within a few seconds of the peer coming (back) up: gRPC's default backoff grows to
  // 120 s, too slow for workers waiting on a restarted coordinator.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  if (!sec.token.empty()) factories.push_back(std::make_unique<TokenInterceptorFactory>(sec.token));
  auto ch = grpc::experimental::CreateCustomChannelWithInterceptors(address, creds, args,
                                                                    std::move(factories));
  if (!ch) return absl::UnavailableError(absl::StrCat("cannot create a channel to ", address));
  return ch;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  auto text = ReadFile("token-file", path);
  if (!text.ok()) return text.status();
  std::string first = text->substr(0, text->find('\n'));
  std::string token(absl::StripAsciiWhitespace(first));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("token-file: ", path, " is empty"));
  return token;
}

}  // namespace fsdp8
