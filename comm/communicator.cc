#include "comm/communicator.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace fsdp8 {

absl::StatusOr<SplitPlan> Communicator::ExchangeSplit(int color, int key) {
  const int64_t seq = ++splits_;
  const int world = world_size();
  const int32_t mine[2] = {color, key};
  std::vector<int32_t> all(2 * static_cast<size_t>(world));
  const CommBytes before = bytes_;
  absl::Status s = AllGather(mine, all.data(), sizeof(mine));
  bytes_ = before;  // the exchange is not FSDP traffic
  if (!s.ok()) return s;
  std::vector<std::pair<int, int>> pairs(world);
  for (int r = 0; r < world; ++r) pairs[r] = {all[2 * r], all[2 * r + 1]};
  return PlanSplit(pairs, rank(), seq);
}

absl::StatusOr<SplitPlan> Communicator::PlanSplit(const std::vector<std::pair<int, int>>& all,
                                                  int rank, int64_t split_seq) {
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].first < 0) {
      return absl::InvalidArgumentError(absl::StrCat("split #", split_seq, ": rank ", r,
                                                     " passed color ", all[r].first,
                                                     " (colors must be >= 0)"));
    }
  }
  SplitPlan plan;
  plan.color = all[rank].first;
  plan.split_seq = split_seq;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].first == plan.color) plan.members.push_back(static_cast<int>(r));
  }
  std::stable_sort(plan.members.begin(), plan.members.end(),  // ties keep the old rank order
                   [&](int a, int b) { return all[a].second < all[b].second; });
  plan.rank = static_cast<int>(std::find(plan.members.begin(), plan.members.end(), rank) -
                               plan.members.begin());
  return plan;
}

}  // namespace fsdp8
