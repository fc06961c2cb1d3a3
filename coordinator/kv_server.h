// KvServer: the coordinator's side of the rendezvous key-value store (WorkerControl.KvSet/KvGet)
// that a generation's communicators bootstrap through. Keys of a generation share the prefix
// "job/<id>/gen/<g>/" and are deleted with DeletePrefix when the generation ends.
//
// Thread-safety: every method is safe to call from several threads; Get blocks on a condition
// variable until the key is set, the timeout passes, the caller's cancellation check fires, or
// Shutdown() is called. The lock's use is checked by clang's -Wthread-safety (ABSL_GUARDED_BY).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace fsdp8::coord {

class KvServer {
 public:
  // Sets (overwrites) key. INVALID_ARGUMENT for an empty key or a value over 16 MiB.
  absl::Status Set(const std::string& key, const std::string& value) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits up to `timeout` (<= 0: no wait) for key. DEADLINE_EXCEEDED naming the key when it does
  // not appear in time; UNAVAILABLE after Shutdown(). When `cancelled` is set it is polled every
  // kCancelPoll (nothing signals the condition variable when an RPC's client goes away) and a true
  // result ends the wait with CANCELLED.
  absl::StatusOr<std::string> Get(const std::string& key, std::chrono::milliseconds timeout,
                                  const std::function<bool()>& cancelled = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr std::chrono::milliseconds kCancelPoll{50};
  // Deletes every key starting with `prefix`; returns how many.
  int DeletePrefix(const std::string& prefix) ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);
  // Gets now blocked waiting for a key (for tests).
  int waiting() const ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes every waiting Get (they return UNAVAILABLE).
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  absl::CondVar cv_;  // signalled when a key is set and at Shutdown
  std::map<std::string, std::string> kv_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace fsdp8::coord
