// The per-step scalars of AdamW, computed once on the host for every backend's AdamW and
// AdamWBf16Moments (Backend::AdamW states the update).
//
// Source: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019, algorithm 2
// (decoupled decay, bias-corrected moments), in the form of the torch.optim.AdamW documentation
// and its single-tensor path: the scalars are computed in double and rounded once to f32, then the
// per-element f32 operations are
//   p *= decay;  m.lerp_(g, w1);  v = v * beta2 + w2 * g^2;
//   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps).
//
// Thread-safety: a pure function.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/check.h"

namespace fsdp8 {

struct AdamWHostScalars {
  float decay;      // 1 - lr * weight_decay (the decoupled weight decay's factor)
  float w1;         // 1 - beta1 (m's lerp weight toward the gradient)
  float w2;         // 1 - beta2 (the squared gradient's weight in v)
  float step_size;  // lr / (1 - beta1^step) (lr over m's bias correction)
  float bc2_sqrt;   // sqrt(1 - beta2^step) (the square root of v's bias correction)
};

// The scalars for optimizer step `step` (1-based: the first update is step 1; CHECK-fails
// otherwise). lr, weight_decay, beta1, beta2 as in the optimizer's spec.
inline AdamWHostScalars AdamWHostScalarsFor(float lr, float beta1, float beta2,
                                            float weight_decay, int64_t step) {
  FSDP8_CHECK(step >= 1) << "AdamW step must be >= 1";
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  AdamWHostScalars s;
  s.decay = static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay);
  s.w1 = static_cast<float>(1.0 - beta1);
  s.w2 = static_cast<float>(1.0 - beta2);
  s.step_size = static_cast<float>(lr / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  return s;
}

}  // namespace fsdp8
