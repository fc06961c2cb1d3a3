// KvStore: the rendezvous key-value store a generation's communicators bootstrap through (Gloo
// addresses, the NCCL unique id). The worker's implementation talks to the coordinator's
// WorkerControl.KvSet/KvGet; tests may use an in-memory one.
//
// Thread-safety: implementations are safe to call from several threads.
#pragma once

#include <chrono>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp8 {

class KvStore {
 public:
  virtual ~KvStore() = default;
  // Sets key to value (overwrites).
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Waits up to `timeout` for key to exist and returns its value; DEADLINE_EXCEEDED naming the key
  // when it does not appear in time, UNAVAILABLE when the store cannot be reached.
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          std::chrono::milliseconds timeout) = 0;
};

}  // namespace fsdp8
