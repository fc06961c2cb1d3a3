// Memory labels: what each byte a backend allocates for a training step is for, named as the
// memory plan names its terms (common/memory_plan.h). The one naming rule: an allocation carries
// the label of the plan entry it is, the backend keeps live bytes per label
// (kernels/allocation_account.h) and the plan sums its tables per label, so the two can be held
// against each other label by label.
//
// Thread-safety: constants only.
#pragma once

#include <array>
#include <cstdint>

namespace fsdp8 {

enum class MemoryLabel : uint8_t {
  kParams = 0,      // "parameter shards": f32 master shards and the wire shards
  kGrads,           // "gradient shards": f32 gradient shards
  kOptimizer,       // "optimizer state": AdamW m and v
  kScaling,         // "FP8 scaling state": weight, activation and grad-output scales and amaxes
  kGathered,        // "gathered units": gathered and prefetched units, their f32 copies and codes
  kUnitGrads,       // "unit gradients": full gradients of units in backward or in flight
  kSaved,           // "saved activations": what the forward keeps for the backward
  kWork,            // "workspaces": the step's transients and the backends' scratch
  kLogits,          // "logits chunks": the head's logits, their gradient, its bf16 input
  kBatch,           // "batch": token ids, targets and the step's per-token losses
  kUnlabelled,      // "unlabelled": an allocation no label scope covers (none in a step)
};
inline constexpr int kNumMemoryLabels = 11;

// Bytes per label, indexed by static_cast<int>(MemoryLabel).
using LabelBytes = std::array<int64_t, kNumMemoryLabels>;

inline constexpr std::array<const char*, kNumMemoryLabels> kMemoryLabelNames = {
    "parameter shards", "gradient shards",   "optimizer state", "FP8 scaling state",
    "gathered units",   "unit gradients",    "saved activations", "workspaces",
    "logits chunks",    "batch",             "unlabelled"};

inline const char* MemoryLabelName(MemoryLabel l) {
  return kMemoryLabelNames[static_cast<int>(l)];
}

}  // namespace fsdp8
