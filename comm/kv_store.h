// KvStore: the rendezvous key-value store a generation's communicators bootstrap through (Gloo
// addresses, the NCCL unique id). The worker's implementation talks to the coordinator's
// WorkerControl.KvSet/KvGet; tests may use an in-memory one.
//
// Thread-safety: implementations are safe to call from several threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
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

// A KvStore whose waits end early once `cancelled` is set: Get polls the inner store in slices of
// at most `slice` and returns CANCELLED between slices. The daemon wraps a job's store in one so
// an Abort (or a newer Assignment) that arrives while the job is still in its rendezvous ends the
// bootstrap within about one slice instead of at the rendezvous timeout.
class CancellableKvStore : public KvStore {
 public:
  CancellableKvStore(KvStore* inner, std::shared_ptr<const std::atomic<bool>> cancelled,
                     std::chrono::milliseconds slice = std::chrono::milliseconds(250))
      : inner_(inner), cancelled_(std::move(cancelled)), slice_(slice) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    if (cancelled_->load()) return Cancelled(key);
    return inner_->Set(key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (cancelled_->load()) return Cancelled(key);
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      const auto wait = std::max(std::chrono::milliseconds(0), std::min(left, slice_));
      absl::StatusOr<std::string> v = inner_->Get(key, wait);
      if (v.ok() || v.status().code() != absl::StatusCode::kDeadlineExceeded) return v;
      if (left <= slice_) {
        return absl::DeadlineExceededError("rendezvous key " + key + " did not appear within " +
                                           std::to_string(timeout.count()) + " ms");
      }
    }
  }

 private:
  static absl::Status Cancelled(const std::string& key) {
    return absl::CancelledError("rendezvous for " + key + " cancelled: the job was aborted");
  }
  KvStore* inner_;
  std::shared_ptr<const std::atomic<bool>> cancelled_;
  std::chrono::milliseconds slice_;
};

}  // namespace fsdp8
