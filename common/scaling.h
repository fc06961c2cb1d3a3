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

// scale = fp8_max / amax / 2^margin (computed in double, rounded once to FP32), clamped to
// [2^-126, FLT_MAX]; `previous` when amax is 0 (or -0), negative, inf or NaN (C01). A denormal amax
// (e.g. 1e-40) is used and clamps to FLT_MAX. A negative margin counts as 0. When `previous` itself
// is not finite and > 0, 1.0 is returned in its place. The result is always finite and > 0.
float ComputeScale(float amax, float fp8_max, int margin, float previous);

// One scaled tensor's delayed-scaling state.
struct ScalingState {
  std::string name;          // e.g. "layers.0.attn.q_proj.x"
  bool e5m2 = false;
  float scale = 1.0f;
  float scale_inv = 1.0f;
  std::deque<float> history;  // newest first, at most history_len entries
  bool initialised = false;   // false until a scale was computed from a positive finite amax
};

// Pushes this step's global amax (the max over all microbatches and ranks) to the front of the
// history (trimmed to history_len >= 1 entries; history_len < 1 counts as 1) and recomputes the
// scale for the next step from the max over the history (AMAX_ALGORITHM_MAX, also used for
// UNSPECIFIED) or the newest entry (MOST_RECENT), then scale_inv = 1 / scale and initialised = true.
// An inf/NaN/negative amax is not recorded (the state is unchanged); when the chosen amax is 0 the
// scale, scale_inv and initialised stay as they were (C01). A tensor whose state is not yet initialised is cast
// with current scaling by the trainer (its own amax), so the very first step is not scaled by 1.
void UpdateDelayed(ScalingState* s, float amax, int history_len, v1::AmaxAlgorithm algo, int margin);

}  // namespace fsdp8
