#include "comm/cpu_split.h"

#include "absl/strings/str_cat.h"

namespace fsdp8 {

std::string SubgroupPrefix(const std::string& parent_prefix, const SplitPlan& plan) {
  return absl::StrCat(parent_prefix, "split", plan.split_seq, "/", plan.color, "/");
}

absl::StatusOr<std::unique_ptr<Communicator>> CpuCommunicatorBase::Split(int color, int key) {
  absl::StatusOr<SplitPlan> plan = ExchangeSplit(color, key);
  if (!plan.ok()) return plan.status();
  CpuBootstrap child = bootstrap_;
  child.prefix = SubgroupPrefix(bootstrap_.prefix, *plan);
  absl::StatusOr<std::unique_ptr<Communicator>> c =
      factory_(plan->rank, plan->world_size(), child);
  if (!c.ok()) {
    return absl::Status(c.status().code(),
                        absl::StrCat("split #", plan->split_seq, " (color ", plan->color,
                                     ", rank ", plan->rank, " of ", plan->world_size(),
                                     "): ", c.status().message()));
  }
  return c;
}

}  // namespace fsdp8
