// Settings of the model and the trainer that are not the job spec's: some come from the
// environment (common/env_settings.h; docs/environment.md), the rest are test options set in code.
// They change no result beyond the order of f32 sums (the head's chunks) or the GEMM grouping
// that the tests compare (unfused projections, down_proj's kept input), and what is logged.
#pragma once

#include <cstdint>

#include "common/step_plan.h"

namespace fsdp8 {

struct ModelOptions {
  // f32 logits per row chunk of the BF16 head (LlamaModel::HeadBf16Compute), >= 1; smaller saves
  // memory at the head at some speed (FSDP8_HEAD_CHUNK_LOGIT_BYTES; the tests use it to run
  // several chunks).
  int64_t head_chunk_logit_bytes = kDefaultHeadChunkLogitBytes;
  // Test option (set in code, never from the environment): one GEMM per linear where a group of
  // projections shares its scales (q/k/v, gate/up), instead of the fused GEMM: the per-linear
  // reference the tests hold the fused GEMMs to.
  bool unfused_projections = false;
  // Test option (set in code, never from the environment): down_proj's FP8 input codes kept from
  // the forward for dW, instead of recast in the backward from the saved gate/up with the same
  // scale (the same codes, bit for bit): the reference the tests hold the recast to.
  bool save_down_proj_input = false;

  // FSDP8_HEAD_CHUNK_LOGIT_BYTES; the test options keep their defaults.
  static ModelOptions FromEnvironment();
};

struct TrainerOptions {
  ModelOptions model;
  // Each step's timing split (forward+backward, its host and collective parts, the optimizer's
  // phases, the host time between steps) logged to stderr (FSDP8_STEP_TIMING or
  // FSDP8_PROFILE_OPS on).
  bool log_step_timing = false;

  static TrainerOptions FromEnvironment();
};

}  // namespace fsdp8
