// Helpers for worker tests: an in-memory KvStore, ranks as threads over Gloo on 127.0.0.1 or over
// shared memory (either behind an AsyncCommunicator or not), a small generated token file and a
// tiny job spec.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/shard_plan.h"
#include "common/token_shard.h"
#include "fsdp8/v1/spec.pb.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "comm/async_communicator.h"
#include "comm/gloo_communicator.h"
#include "comm/kv_store.h"
#include "comm/shm_communicator.h"

namespace fsdp8::testing {

class MemKvStore : public KvStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> l(mu_);
    kv_[key] = value;
    cv_.notify_all();
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> l(mu_);
    if (!cv_.wait_for(l, timeout, [&] { return kv_.count(key) > 0; })) {
      return absl::DeadlineExceededError("key " + key);
    }
    return kv_[key];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

// Runs fn(rank) on `world` threads and joins them.
inline void RunOnThreads(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

// k*Overlapped: behind an AsyncCommunicator (the CPU workers' default).
enum class Transport { kGloo, kSharedMemory, kGlooOverlapped, kSharedMemoryOverlapped };

// Runs fn(rank, comm) on `world` threads, each with its own communicator over `transport`.
inline void RunRanksOver(Transport transport, int world,
                         const std::function<void(int, Communicator*)>& fn,
                         std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  static std::atomic<int> generation{0};
  const std::string prefix = absl::StrCat("test/", generation++, "/");
  MemKvStore kv;
  RunOnThreads(world, [&](int r) {
    std::unique_ptr<Communicator> comm;
    if (transport == Transport::kGloo || transport == Transport::kGlooOverlapped) {
      auto c = GlooCommunicator::Create(r, world, &kv, prefix, "127.0.0.1", timeout);
      ASSERT_TRUE(c.ok()) << c.status();
      comm = std::move(*c);
    } else {
      auto c = SharedMemoryCommunicator::Create(r, world, &kv, prefix, timeout);
      ASSERT_TRUE(c.ok()) << c.status();
      comm = std::move(*c);
    }
    if (transport == Transport::kGlooOverlapped ||
        transport == Transport::kSharedMemoryOverlapped) {
      comm = std::make_unique<AsyncCommunicator>(std::move(comm));
    }
    fn(r, comm.get());
  });
}

// Runs fn(rank, comm) on `world` threads, each with its own Gloo communicator.
inline void RunRanks(int world, const std::function<void(int, Communicator*)>& fn,
                     std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  RunRanksOver(Transport::kGloo, world, fn, timeout);
}

// A token file of byte-level pseudo-English (words from a small list): learnable structure, so
// the loss falls quickly.
inline std::string MakeTokenFile(const std::string& name, int64_t n_tokens, uint64_t seed = 7) {
  static const char* kWords[] = {"the ", "cat ", "sat ", "on ", "a ", "mat. ", "dogs ", "run ",
                                 "fast ", "and ", "birds ", "sing ", "in ", "trees. ", "we ",
                                 "read ", "books ", "every ", "day. ", "time "};
  std::vector<uint16_t> toks;
  uint64_t x = seed;
  while (static_cast<int64_t>(toks.size()) < n_tokens) {
    x = SplitMix64(x);
    const char* w = kWords[x % 20];
    for (const char* c = w; *c && static_cast<int64_t>(toks.size()) < n_tokens; ++c) {
      toks.push_back(static_cast<uint8_t>(*c));
    }
  }
  // Per process: ctest runs the cases of one binary as parallel processes that would otherwise
  // rewrite the same file while another reads it.
  const std::string path =
      ::testing::TempDir() + "/" + std::to_string(static_cast<long>(::getpid())) + "_" + name;
  absl::Status s = WriteTokenShard(path, toks);
  EXPECT_TRUE(s.ok()) << s;
  return path;
}

// d 32, 2 layers, 2 heads, ffn 64, vocab 256, seq 32, global batch 6, microbatch 1.
inline v1::JobSpec TinySpec(const std::string& train, const std::string& val = "") {
  v1::JobSpec s;
  s.set_name("tiny");
  auto* m = s.mutable_model();
  m->set_d_model(32);
  m->set_n_layers(2);
  m->set_n_heads(2);
  m->set_ffn_dim(64);
  m->set_vocab_size(256);
  m->set_seq_len(32);
  s.mutable_data()->set_train_path(train);
  s.mutable_data()->set_val_path(val);
  auto* t = s.mutable_training();
  t->set_steps(20);
  t->set_global_batch(6);
  t->set_microbatch(1);
  t->set_seed(1234);
  t->set_eval_batches(1);
  auto* o = s.mutable_optimizer();
  o->set_warmup_steps(2);
  o->set_peak_lr(3e-3);
  s.mutable_sharding()->set_alignment(4);
  s.set_backend("cpu");
  return s;
}

// A parameter for explicit shard plans (odd sizes such as 57 or 1x17): Kaiming-uniform init with
// fan_in = the last dimension.
inline TensorSpec PlanTensor(const std::string& name, std::vector<int64_t> shape) {
  TensorSpec t;
  t.name = name;
  t.shape = std::move(shape);
  t.init = Init::kKaimingUniform;
  t.fan_in = t.shape.back();
  return t;
}

inline std::unique_ptr<Backend> CpuBackend() {
  std::string err;
  auto be = CreateBackend("cpu", 0, &err);
  EXPECT_NE(be, nullptr) << err;
  return be;
}

}  // namespace fsdp8::testing
