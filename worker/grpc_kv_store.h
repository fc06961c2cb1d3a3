// GrpcKvStore: the KvStore a worker uses, backed by the coordinator's WorkerControl.KvSet/KvGet.
//
// Get waits on the coordinator side (KvGetRequest.timeout_ms); the RPC deadline is that timeout
// plus a few seconds of slack. Errors: DEADLINE_EXCEEDED naming the key when it does not appear,
// UNAVAILABLE when the coordinator cannot be reached, other RPC errors as returned.
//
// Thread-safety: safe from several threads (gRPC stubs are).
#pragma once

#include <memory>
#include <string>

#include "fsdp8/v1/worker.grpc.pb.h"
#include "comm/kv_store.h"

namespace fsdp8 {

class GrpcKvStore : public KvStore {
 public:
  explicit GrpcKvStore(std::shared_ptr<v1::WorkerControl::StubInterface> stub)
      : stub_(std::move(stub)) {}
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override;

 private:
  std::shared_ptr<v1::WorkerControl::StubInterface> stub_;
};

// grpc::Status -> absl::Status with the same code and message, prefixed by `what`.
absl::Status FromGrpc(const grpc::Status& s, const std::string& what);

}  // namespace fsdp8
