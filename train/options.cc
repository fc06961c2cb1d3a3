#include "train/options.h"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>

#include "common/env_settings.h"

namespace fsdp8 {

ModelOptions ModelOptions::FromEnvironment() {
  ModelOptions o;
  if (const std::optional<std::string> v = env::Get(env::kHeadChunkLogitBytes); v && !v->empty())
    o.head_chunk_logit_bytes = std::max<int64_t>(1, std::atoll(v->c_str()));
  return o;
}

TrainerOptions TrainerOptions::FromEnvironment() {
  TrainerOptions o;
  o.model = ModelOptions::FromEnvironment();
  o.log_step_timing = env::SwitchOrExit(env::kStepTiming);
  if (absl::StatusOr<std::optional<double>> p = env::ProfileOpsPeriod(); p.ok() && p->has_value())
    o.log_step_timing = true;
  return o;
}

}  // namespace fsdp8
