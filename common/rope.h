// RoPE inverse frequencies as Hugging Face transformers computes them (modeling_rope_utils), for
// the model section's head dimension D = d_model / n_heads:
//   default:  inv_freq_i = f32(1 / theta^(2i/D)), i in [0, D/2) (evaluated in double, as the
//             backends' RoPE tables);
//   "llama3": Llama 3.1's scaling of those, in f32 arithmetic in transformers' order:
//             wavelen = f32(1 / inv_freq) * f32(2 pi); wavelen > original / low_freq_factor:
//             inv_freq / factor; wavelen < original / high_freq_factor: unchanged; in between
//             (1 - s) * inv_freq / factor + s * inv_freq with
//             s = (f32(1 / wavelen) * original - low_freq_factor) / (high_freq_factor - low_freq_factor).
//
// Thread-safety: pure functions.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

// Checks model.rope_scaling when set (rope_type "llama3" with factor > 0, 0 < low_freq_factor <
// high_freq_factor, original_max_position_embeddings > 0). INVALID_ARGUMENT naming the field,
// e.g. "model.rope_scaling.rope_type: must be \"llama3\" (got \"yarn\")".
absl::Status CheckRopeScaling(const v1::ModelConfig& m);

// The D/2 inverse frequencies of model `m` (defaults applied, rope_scaling valid).
std::vector<float> RopeInvFreq(const v1::ModelConfig& m);

// Whether `m` scales RoPE (model.rope_scaling set).
bool HasRopeScaling(const v1::ModelConfig& m);

}  // namespace fsdp8
