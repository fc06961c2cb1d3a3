#include "common/scaling.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

namespace fsdp8 {
namespace {

// Smallest normal FP32, the lower clamp of a scale.
constexpr double kMinScale = FLT_MIN;  // 2^-126

bool UsableAmax(float amax) { return std::isfinite(amax) && amax > 0.0f; }

bool UsableScale(float s) { return std::isfinite(s) && s > 0.0f; }

}  // namespace

float Fp8MaxValue(bool e5m2) { return e5m2 ? 57344.0f : 448.0f; }

float ComputeScale(float amax, float fp8_max, int margin, float previous) {
  const float fallback = UsableScale(previous) ? previous : 1.0f;
  if (!UsableAmax(amax) || !UsableScale(fp8_max)) return fallback;
  // In double: fp8_max / amax cannot overflow there (amax >= 2^-149), so the clamp sees the true
  // value; the result is then rounded once to FP32.
  double s = static_cast<double>(fp8_max) / static_cast<double>(amax);
  s = std::ldexp(s, -std::max(margin, 0));
  s = std::min(std::max(s, kMinScale), static_cast<double>(FLT_MAX));
  return static_cast<float>(s);
}

void UpdateDelayed(ScalingState* s, float amax, int history_len, v1::AmaxAlgorithm algo,
                   int margin) {
  const size_t len = static_cast<size_t>(std::max(history_len, 1));
  if (amax == 0.0f) amax = 0.0f;  // -0 -> +0
  // A non-finite or negative amax is not recorded: it would poison the window for `len` steps.
  if (std::isfinite(amax) && amax >= 0.0f) {
    s->history.push_front(amax);
  }
  while (s->history.size() > len) s->history.pop_back();
  if (s->history.empty()) return;  // nothing usable yet: scale unchanged

  float chosen;
  if (algo == v1::AMAX_ALGORITHM_MOST_RECENT) {
    chosen = s->history.front();
  } else {
    chosen = *std::max_element(s->history.begin(), s->history.end());
  }
  if (!UsableAmax(chosen)) return;  // all zeros: keep the previous scale (and initialised as it was)
  s->scale = ComputeScale(chosen, Fp8MaxValue(s->e5m2), margin, s->scale);
  s->scale_inv = 1.0f / s->scale;
  s->initialised = true;
}

}  // namespace fsdp8
