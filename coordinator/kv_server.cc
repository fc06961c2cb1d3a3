#include "coordinator/kv_server.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fsdp8::coord {

absl::Status KvServer::Set(const std::string& key, const std::string& value) {
  if (key.empty()) return absl::InvalidArgumentError("key: must not be empty");
  if (value.size() > (16u << 20))
    return absl::InvalidArgumentError(absl::StrCat("value of key '", key, "': over 16 MiB"));
  std::lock_guard<std::mutex> lock(mu_);
  kv_[key] = value;
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::string> KvServer::Get(const std::string& key,
                                          std::chrono::milliseconds timeout,
                                          const std::function<bool()>& cancelled) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mu_);
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
    cv_.wait_until(lock, cancelled ? std::min(deadline, now + kCancelPoll) : deadline);
  }
  return absl::DeadlineExceededError(absl::StrCat("key '", key, "' did not appear within ",
                                                  timeout.count(), " ms"));
}

int KvServer::DeletePrefix(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.rfind(prefix, 0) == 0;) {
    it = kv_.erase(it);
    ++n;
  }
  return n;
}

size_t KvServer::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kv_.size();
}

int KvServer::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiting_;
}

void KvServer::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  shutdown_ = true;
  cv_.notify_all();
}

}  // namespace fsdp8::coord
