// Helpers shared by the coordinator tests: a real token shard on disk, a small valid spec, a
// worker's registration, waiting.
// TempDir comes from tests/support/temp_dir.h.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/token_shard.h"
#include "fsdp8/v1/spec.pb.h"
#include "fsdp8/v1/worker.pb.h"
#include "gtest/gtest.h"
#include "tests/support/temp_dir.h"

namespace fsdp8::testing {

// Writes a token shard of n byte-level tokens and returns its path.
inline std::string WriteTokens(const TempDir& dir, const std::string& name, int n = 5000) {
  std::vector<uint16_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = static_cast<uint16_t>((i * 7) % 256);
  std::string path = dir.File(name);
  EXPECT_TRUE(WriteTokenShard(path, t).ok());
  return path;
}

// A small valid spec: `steps` steps on `workers` ranks.
inline v1::JobSpec SmallSpec(const std::string& train, int workers = 1, int64_t steps = 3,
                             const std::string& val = "") {
  v1::JobSpec s;
  s.set_name("test");
  s.mutable_model()->set_d_model(32);
  s.mutable_model()->set_n_layers(1);
  s.mutable_model()->set_n_heads(2);
  s.mutable_model()->set_ffn_dim(64);
  s.mutable_model()->set_seq_len(16);
  s.mutable_data()->set_train_path(train);
  if (!val.empty()) s.mutable_data()->set_val_path(val);
  s.mutable_training()->set_steps(steps);
  s.mutable_training()->set_global_batch(4);
  s.mutable_training()->set_eval_every(2);
  s.mutable_sharding()->set_min_workers(workers);
  return s;
}

// A worker's registration from 127.0.0.1 with the cpu backend, at `version`.
inline v1::RegisterRequest CpuWorkerRegistration(const std::string& version = "1.2.3") {
  v1::RegisterRequest r;
  r.set_version(version);
  r.set_host("127.0.0.1");
  r.set_backend("cpu");
  return r;
}

inline bool WaitFor(const std::function<bool()>& pred, double seconds = 10) {
  auto until = std::chrono::steady_clock::now() +
               std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

}  // namespace fsdp8::testing
