// A committed checkpoint of a small mixed-precision model, for the Hugging Face interchange tests:
// trained for a few steps on `world` ranks, saved with SaveShard, committed by the coordinator's
// CheckpointStore (the real MANIFEST writer).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/spec.h"
#include "coordinator/checkpoint_store.h"
#include "tests/support/ranks.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace fsdp8::testing {

using Weights = std::map<std::string, std::vector<float>>;

// d 32, 2 layers, 4 query heads sharing 2 key/value heads (grouped-query attention), ffn 64:
// block 0's linears FP8, block 1's BF16, FP32 embedding, BF16 LM head; 2-element alignment so
// buffers are padded on 2 and 3 ranks.
inline v1::JobSpec InterchangeSpec(const std::string& train) {
  v1::JobSpec s = TinySpec(train);
  s.mutable_model()->set_n_heads(4);
  s.mutable_model()->set_n_kv_heads(2);
  s.mutable_sharding()->set_alignment(2);
  auto* p = s.mutable_precision();
  p->set_linears(v1::PRECISION_FP8);
  p->set_embedding(v1::PRECISION_FP32);
  p->set_lm_head(v1::PRECISION_BF16);
  auto* o = p->add_overrides();
  o->set_layer(1);
  o->set_linears(v1::PRECISION_BF16);
  return s;
}

// Trains `steps` steps on `world` ranks, saves root/step-<steps> and commits it. Returns the full
// FP32 master weights (GatherAll on rank 0).
inline absl::StatusOr<Weights> WriteCommittedCheckpoint(const v1::JobSpec& spec, int world,
                                                        int steps, const std::string& root) {
  coord::CheckpointStore store(root);
  absl::StatusOr<std::string> dir = store.Prepare(steps);
  if (!dir.ok()) return dir.status();
  std::vector<v1::CheckpointSaved> saved(world);
  std::vector<absl::Status> status(world);
  Weights master;
  RunRanks(world, [&](int r, Communicator* c) {
    auto be = CpuBackend();
    auto t = Trainer::Create(WithDefaults(spec, world), r, world, be.get(), c);
    if (!t.ok()) {
      status[r] = t.status();
      return;
    }
    for (int k = 0; k < steps && status[r].ok(); ++k) {
      auto res = (*t)->Step(k, false, false);
      if (!res.ok()) status[r] = res.status();
    }
    if (status[r].ok()) status[r] = SaveShard(**t, steps, *dir, &saved[r]);
    auto m = (*t)->params().GatherAll(false);
    if (!m.ok()) status[r] = m.status();
    else if (r == 0) master = *m;
  });
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  v1::CheckpointManifest m;
  m.set_job_id("job-hf");
  m.set_step(steps);
  m.set_world_size(world);
  *m.mutable_spec() = WithDefaults(spec, world);
  for (int r = 0; r < world; ++r) {
    v1::CheckpointFile* f = m.add_files();
    f->set_rank(r);
    f->set_file(saved[r].file());
    f->set_bytes(saved[r].bytes());
    f->set_crc32(saved[r].crc32());
  }
  if (absl::Status s = store.Commit(m); !s.ok()) return s;
  return master;
}

}  // namespace fsdp8::testing
