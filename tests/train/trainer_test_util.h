// Helpers shared by the training tests (trainer_test, model_test, fsdp_test, hybrid_test,
// memory_labels_test): the token files of this process, precision plans, training a TinySpec job
// on ranks as threads, and the ranks of a hybrid-sharded mesh.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/cpu_communicator.h"
#include "common/spec.h"
#include "fsdp8/v1/spec.pb.h"
#include "gtest/gtest.h"
#include "tests/support/ranks.h"
#include "train/trainer.h"

namespace fsdp8::testing {

// The training and validation token files of this process (written once, on first use).
inline const std::string& TrainFile() {
  static const std::string p = MakeTokenFile("worker_train.bin", 20000, 7);
  return p;
}
inline const std::string& ValFile() {
  static const std::string p = MakeTokenFile("worker_val.bin", 4000, 8);
  return p;
}

// Linears in precision p; the embedding and the head too unless p is FP8 (which keeps them bf16).
// The default job's model (data/default-job.yaml: d 128, 4 layers, 4 heads, ffn 384, vocab 256,
// seq 256) on the cpu backend, FP8 linears (the spec default), two sequences per step.
inline v1::JobSpec DefaultModelSpec(int steps) {
  v1::JobSpec s;
  s.mutable_data()->set_train_path(TrainFile());
  s.mutable_model()->set_d_model(128);
  s.mutable_model()->set_n_layers(4);
  s.mutable_model()->set_n_heads(4);
  s.mutable_model()->set_ffn_dim(384);
  s.mutable_model()->set_vocab_size(256);
  s.mutable_model()->set_seq_len(256);
  s.mutable_training()->set_global_batch(2);
  s.mutable_training()->set_steps(steps);
  s.mutable_optimizer()->set_warmup_steps(2);
  s.set_backend("cpu");
  return s;
}

inline void AllPrecision(v1::JobSpec* s, v1::Precision p) {
  s->mutable_precision()->set_linears(p);
  if (p != v1::PRECISION_FP8) {
    s->mutable_precision()->set_embedding(p);
    s->mutable_precision()->set_lm_head(p);
  }
}

// One rank's view of a training run.
struct RankOut {
  std::vector<StepStats> results;
  std::map<std::string, std::vector<float>> master;
  v1::ScalingState scaling;
};

// `steps` steps of `spec` on `world` ranks as threads (CPU backend, collectives over
// `transport`); gather: also the master weights at the end.
inline std::vector<RankOut> Train(const v1::JobSpec& spec, int world, int steps,
                                  bool gather = false,
                                  Transport transport = Transport::kGloo) {
  std::vector<RankOut> out(world);
  RunRanksOver(transport, world, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto t = Trainer::Create(WithDefaults(spec, world), r, world, be.get(), c);
    ASSERT_TRUE(t.ok()) << t.status();
    for (int k = 0; k < steps; ++k) {
      auto res = (*t)->Step(k, false, true);
      ASSERT_TRUE(res.ok()) << res.status();
      out[r].results.push_back(*res);
    }
    auto scaling = (*t)->ScalingReport();
    ASSERT_TRUE(scaling.ok()) << scaling.status();
    out[r].scaling = *scaling;
    if (gather) {
      auto m = (*t)->params().GatherAll(false);
      ASSERT_TRUE(m.ok()) << m.status();
      out[r].master = *m;
    }
  });
  return out;
}

// Runs fn(rank, world, mesh) on R x S ranks (threads) of a hybrid-sharded job (common/mesh.h):
// each rank's world communicator and, for R > 1, its shard-group and replica-group communicators
// (CPU communicators under their own rendezvous prefixes on one in-process KvStore); R = 1 passes
// empty MeshComms (a flat job).
inline void RunMeshRanks(int R, int S,
                         const std::function<void(int, Communicator*, const MeshComms&)>& fn) {
  static std::atomic<int> generation{0};
  const std::string prefix = absl::StrCat("mesh/", generation++, "/");
  const int W = R * S;
  MemKvStore kv;
  const auto timeout = std::chrono::seconds(30);
  RunOnThreads(W, [&](int r) {
    auto make = [&](int rank, int size, const std::string& name) -> std::unique_ptr<Communicator> {
      auto c = CreateCpuCommunicator(rank, size, &kv, prefix + name + "/", "127.0.0.1", timeout,
                                     timeout, CpuCommOptions());
      EXPECT_TRUE(c.ok()) << c.status();
      return c.ok() ? std::move(*c) : nullptr;
    };
    std::unique_ptr<Communicator> world = make(r, W, "world"), shard, replica;
    MeshComms comms;
    if (R > 1) {
      shard = make(r % S, S, absl::StrCat("shard", r / S));
      replica = make(r / S, R, absl::StrCat("replica", r % S));
      comms = MeshComms{shard.get(), replica.get()};
    }
    ASSERT_TRUE(world && (R == 1 || (shard && replica)));
    fn(r, world.get(), comms);
  });
}

// Global mean training loss of step k (sum over ranks of loss_sum / tokens).
inline double MeanLoss(const std::vector<RankOut>& o, int k) {
  double loss = 0, tokens = 0;
  for (const RankOut& r : o) {
    loss += r.results[k].loss_sum;
    tokens += r.results[k].tokens;
  }
  return loss / tokens;
}

// The bits of an f32.
inline uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

}  // namespace fsdp8::testing
