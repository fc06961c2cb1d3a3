#include "common/rope.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace fsdp8 {
namespace {

absl::Status Bad(const char* field, const std::string& rule) {
  return absl::InvalidArgumentError(absl::StrCat("model.rope_scaling.", field, ": ", rule));
}

// Scales the default frequencies in place, f32 step by step (transformers' llama3 rule).
void ScaleLlama3(const v1::RopeScaling& r, std::vector<float>* inv_freq) {
  const float factor = static_cast<float>(r.factor());
  const float low = static_cast<float>(r.low_freq_factor());
  const float old_len = static_cast<float>(r.original_max_position_embeddings());
  const float low_wavelen = static_cast<float>(r.original_max_position_embeddings() / r.low_freq_factor());
  const float high_wavelen =
      static_cast<float>(r.original_max_position_embeddings() / r.high_freq_factor());
  const float span = static_cast<float>(r.high_freq_factor() - r.low_freq_factor());
  const float two_pi = static_cast<float>(2.0 * M_PI);
  for (float& f : *inv_freq) {
    const float wavelen = (1.0f / f) * two_pi;
    if (wavelen > low_wavelen) {
      f = f / factor;
    } else if (!(wavelen < high_wavelen)) {
      const float s = ((1.0f / wavelen) * old_len - low) / span;
      f = (1.0f - s) * f / factor + s * f;
    }
  }
}

}  // namespace

bool HasRopeScaling(const v1::ModelConfig& m) { return m.has_rope_scaling(); }

absl::Status CheckRopeScaling(const v1::ModelConfig& m) {
  if (!m.has_rope_scaling()) return absl::OkStatus();
  const v1::RopeScaling& r = m.rope_scaling();
  if (r.rope_type() != "llama3") {
    return Bad("rope_type", absl::StrCat("must be \"llama3\" (the only RoPE scaling implemented; got \"",
                                         r.rope_type(), "\")"));
  }
  auto positive = [](bool has, double v) { return has && v > 0 && std::isfinite(v); };
  if (!positive(r.has_factor(), r.factor())) {
    return Bad("factor", absl::StrCat("must be set, > 0 and finite (got ", r.factor(), ")"));
  }
  if (!positive(r.has_low_freq_factor(), r.low_freq_factor())) {
    return Bad("low_freq_factor",
               absl::StrCat("must be set, > 0 and finite (got ", r.low_freq_factor(), ")"));
  }
  if (!r.has_high_freq_factor() || !std::isfinite(r.high_freq_factor()) ||
      !(r.high_freq_factor() > r.low_freq_factor())) {
    return Bad("high_freq_factor", absl::StrCat("must be set and > low_freq_factor (got ",
                                                r.high_freq_factor(), ", low_freq_factor ",
                                                r.low_freq_factor(), ")"));
  }
  if (!r.has_original_max_position_embeddings() || r.original_max_position_embeddings() <= 0) {
    return Bad("original_max_position_embeddings",
               absl::StrCat("must be set and > 0 (got ", r.original_max_position_embeddings(), ")"));
  }
  return absl::OkStatus();
}

std::vector<float> RopeInvFreq(const v1::ModelConfig& m) {
  const int64_t D = m.d_model() / m.n_heads();
  std::vector<float> inv_freq(static_cast<size_t>(D / 2));
  for (int64_t i = 0; i < D / 2; ++i) {
    inv_freq[i] = static_cast<float>(
        1.0 / std::pow(static_cast<double>(static_cast<float>(m.rope_theta())),
                           static_cast<double>(2 * i) / static_cast<double>(D)));
  }
  if (m.has_rope_scaling()) ScaleLlama3(m.rope_scaling(), &inv_freq);
  return inv_freq;
}

}  // namespace fsdp8
