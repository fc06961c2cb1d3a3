// FP8 scaling math (pure, host-side): delayed scaling with an amax history, current scaling, and
// the update rules that keep every scale finite and positive (C01).
//
// Formula (NVIDIA TransformerEngine DelayedScaling; Micikevicius et al. 2022, "FP8 Formats for Deep
// Learning"): scale = fp8_max / amax / 2^margin, scale_inv = 1 / scale.
// Update rule: an amax that is 0, inf or NaN keeps the previous scale; the scale is clamped to
// [2^-126 .. FLT_MAX] so fp8_max / amax never overflows FP32.
//
// Thread-safety: values; no shared state.
#pragma once

#include <cstdint>
#include <deque>
#include <string>

#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

// Largest finite value of each format (OCP FP8 v1.0): E4M3 448, E5M2 57344.
float Fp8MaxValue(bool e5m2);

// scale = fp8_max / amax / 2^margin, or `previous` when amax is 0, denormal-zero, inf or NaN
// (C01). The result is finite and > 0.
float ComputeScale(float amax, float fp8_max, int margin, float previous);

// One scaled tensor's delayed-scaling state.
struct ScalingState {
  std::string name;          // e.g. "layers.0.attn.q_proj.x"
  bool e5m2 = false;
  float scale = 1.0f;
  float scale_inv = 1.0f;
  std::deque<float> history;  // newest first, at most history_len entries
  bool initialised = false;   // false until the first amax arrives
};

// Pushes this step's global amax (the max over all microbatches and ranks) and recomputes the
// scale for the next step; sets initialised. A tensor whose state is not yet initialised is cast
// with current scaling by the trainer (its own amax), so the very first step is not scaled by 1.
void UpdateDelayed(ScalingState* s, float amax, int history_len, v1::AmaxAlgorithm algo, int margin);

}  // namespace fsdp8
