#include "coordinator/kv_server.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace fsdp8::coord {

absl::Status KvServer::Set(const std::string& key, const std::string& value) {
  if (key.empty()) return absl::InvalidArgumentError("key: must not be empty");
  if (value.size() > (16u << 20))
    return absl::InvalidArgumentError(absl::StrCat("value of key '", key, "': over 16 MiB"));
  absl::MutexLock lock(&mu_);
  kv_[key] = value;
  cv_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<std::string> KvServer::Get(const std::string& key,
                                          std::chrono::milliseconds timeout,
                                          const std::function<bool()>& cancelled) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  absl::MutexLock lock(&mu_);
  ++waiting_;
  struct Leave {
    int* n;
    ~Leave() { --*n; }
  } leave{&waiting_};
  for (;;) {
    if (shutdown_) return absl::UnavailableError("coordinator is shutting down");
    auto it = kv_.find(key);
    if (it != kv_.end()) return it->second;
    if (cancelled && cancelled()) {
      return absl::CancelledError(absl::StrCat("wait for key '", key, "' cancelled by the caller"));
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) break;
    const auto until = cancelled ? std::min(deadline, now + kCancelPoll) : deadline;
    cv_.WaitWithTimeout(&mu_, absl::FromChrono(until - now));
  }
  return absl::DeadlineExceededError(absl::StrCat("key '", key, "' did not appear within ",
                                                  timeout.count(), " ms"));
}

int KvServer::DeletePrefix(const std::string& prefix) {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.rfind(prefix, 0) == 0;) {
    it = kv_.erase(it);
    ++n;
  }
  return n;
}

size_t KvServer::size() const {
  absl::MutexLock lock(&mu_);
  return kv_.size();
}

int KvServer::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

void KvServer::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  cv_.SignalAll();
}

}  // namespace fsdp8::coord
