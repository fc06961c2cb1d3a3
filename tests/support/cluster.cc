#include "tests/support/cluster.h"

#include <utility>

namespace fsdp8::testing {

LocalCluster::LocalCluster(Binaries binaries, std::filesystem::path log_dir,
                           ProcessOptions options)
    : binaries_(std::move(binaries)), log_dir_(std::move(log_dir)), options_(std::move(options)) {}

LocalCluster::~LocalCluster() {
  coordinator_.reset();
  for (auto& w : workers_) w.reset();
}

std::string LocalCluster::StartCoordinator(const std::vector<std::string>& flags,
                                           const std::string& log_name,
                                           std::chrono::milliseconds timeout) {
  std::vector<std::string> argv{binaries_.coordinator};
  argv.insert(argv.end(), flags.begin(), flags.end());
  coordinator_.reset();
  coordinator_ = std::make_unique<ChildProcess>(argv, LogPath(log_name).string(), options_);
  address_ = coordinator_->ok() ? WaitForLogLine(LogPath(log_name), kListeningPrefix, timeout) : "";
  return address_;
}

ChildProcess* LocalCluster::AddWorker(const std::vector<std::string>& flags,
                                      const std::string& log_name) {
  std::vector<std::string> argv{binaries_.worker};
  argv.insert(argv.end(), flags.begin(), flags.end());
  workers_.push_back(std::make_unique<ChildProcess>(argv, LogPath(log_name).string(), options_));
  return workers_.back().get();
}

}  // namespace fsdp8::testing
