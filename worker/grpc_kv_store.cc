#include "worker/grpc_kv_store.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"

namespace fsdp8 {

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

absl::Status GrpcKvStore::Set(const std::string& key, const std::string& value) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::KvSetRequest req;
  req.set_key(key);
  req.set_value(value);
  v1::KvSetResponse resp;
  return FromGrpc(stub_->KvSet(&ctx, req, &resp), absl::StrCat("rendezvous KvSet ", key));
}

absl::StatusOr<std::string> GrpcKvStore::Get(const std::string& key,
                                             std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout + std::chrono::seconds(5));
  v1::KvGetRequest req;
  req.set_key(key);
  req.set_timeout_ms(static_cast<int32_t>(std::min<int64_t>(timeout.count(), INT32_MAX)));
  v1::KvGetResponse resp;
  grpc::Status s = stub_->KvGet(&ctx, req, &resp);
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::DeadlineExceededError(absl::StrCat("rendezvous key ", key, " did not appear within ",
                                                    timeout.count(), " ms"));
  }
  if (!s.ok()) return FromGrpc(s, absl::StrCat("rendezvous KvGet ", key));
  return resp.value();
}

}  // namespace fsdp8
