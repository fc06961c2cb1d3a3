// ModelDims: the dimensions of a Llama model, derived in one place from the spec's model section
// (JobSpec.model, proto/fsdp8/v1/spec.proto) for the trainer's LlamaModel (train/model.h) and the
// memory plan (common/memory_plan.cc).
//
// Thread-safety: a pure function and a plain value.
#pragma once

#include <cstdint>

#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

struct ModelDims {
  int64_t d_model = 0;     // C: hidden size
  int64_t n_heads = 0;     // H: query heads
  int64_t n_kv_heads = 0;  // Hkv: key/value heads
  int64_t head_dim = 0;    // D = d_model / n_heads
  int64_t ffn_dim = 0;     // F: SwiGLU intermediate size
  int64_t vocab_size = 0;  // V
  int64_t seq_len = 0;     // T: tokens per sequence
  int64_t n_layers = 0;    // L: transformer blocks

  // Output widths of q_proj (H * D) and of k_proj / v_proj (Hkv * D).
  int64_t q_width() const { return n_heads * head_dim; }
  int64_t kv_width() const { return n_kv_heads * head_dim; }
};

// The dimensions of model `m`, read as set: pass a spec's model section after WithDefaults (this
// applies none, e.g. an unset n_kv_heads reads 0). Requires n_heads > 0
// (CHECK-fails otherwise); d_model divisible by n_heads as ValidateSpec requires (otherwise
// head_dim is the quotient rounded down).
ModelDims ModelDimsOf(const v1::ModelConfig& m);

}  // namespace fsdp8
