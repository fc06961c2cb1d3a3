// Starting a job from a Hugging Face LlamaForCausalLM directory (spec.init.from_hf; format in
// common/hf_model.h): model.safetensors or a sharded model (model.safetensors.index.json and its
// shards). Every rank memory-maps and reads only the byte ranges of its own shards' elements, a
// few MiB at a time: no process holds the whole model.
//
// Thread-safety: the trainer's thread.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "train/trainer.h"

namespace fsdp8 {

// Collective (every rank calls it, after Trainer::Create and instead of a checkpoint load): checks
// dir/config.json against the trainer's model section, then that the weights hold exactly the
// model's tensors (names, shapes; F32, BF16 or F16; a "...rotary_emb.inv_freq" buffer, and with tied
// embeddings an lm_head.weight, are ignored),
// sets this rank's FP32 master slices from it (AdamW moments stay zero), refuses non-finite values,
// and re-casts the FP8 / bf16 weight shards with amax recomputed from the loaded weights (C08).
// Errors: INVALID_ARGUMENT (config.json mismatch, naming the key and the model field),
// FAILED_PRECONDITION naming the tensor (missing, unexpected, wrong shape or dtype, non-finite),
// DATA_LOSS (malformed safetensors file), collective errors from the re-cast. On error the
// trainer must be discarded.
absl::Status LoadHfWeights(Trainer* trainer, const std::string& dir);

}  // namespace fsdp8
