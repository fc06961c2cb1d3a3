// The memory plan as the AdminService and people read it (common/memory_plan.h): ToProto and the
// byte counts in words.
#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/memory_plan.h"

namespace fsdp8 {

v1::MemoryPlan ToProto(const MemoryPlan& plan) {
  v1::MemoryPlan out;
  out.set_backend(plan.backend);
  out.set_world_size(plan.world_size);
  out.set_forward_peak_bytes(plan.forward_peak_bytes);
  out.set_backward_peak_bytes(plan.backward_peak_bytes);
  out.set_optimizer_peak_bytes(plan.optimizer_peak_bytes);
  out.set_peak_bytes(plan.peak_bytes);
  out.set_peak_phase(plan.peak_phase);
  for (auto [terms, field] : {std::pair{&plan.terms, out.mutable_terms()},
                              std::pair{&plan.device_extra, out.mutable_device_extra()},
                              std::pair{&plan.forward_terms, out.mutable_forward_terms()},
                              std::pair{&plan.backward_terms, out.mutable_backward_terms()},
                              std::pair{&plan.optimizer_terms, out.mutable_optimizer_terms()}}) {
    for (const MemoryTerm& t : *terms) {
      field->Add()->set_name(t.name);
      field->rbegin()->set_bytes(t.bytes);
    }
  }
  out.set_device_bytes(plan.device_bytes);
  out.set_exceeds_int64(plan.exceeds_int64);
  return out;
}

std::string MemoryBytes(int64_t bytes) {
  if (bytes == kBytesExceeded) return "exceeds 8 EiB";
  const double b = static_cast<double>(bytes);
  for (auto [shift, unit, digits] : {std::tuple{40, "TiB", 2}, {30, "GiB", 2}, {20, "MiB", 1},
                                     {10, "KiB", 1}}) {
    const double u = static_cast<double>(int64_t{1} << shift);
    if (b >= u) return absl::StrFormat("%.*f %s", digits, b / u, unit);
  }
  return absl::StrCat(bytes, " B");
}

std::string MemoryBytesAndCount(int64_t bytes) {
  if (bytes == kBytesExceeded) return MemoryBytes(bytes);
  return absl::StrCat(MemoryBytes(bytes), " (", bytes, " bytes)");
}

std::string LargestTerms(const MemoryPlan& plan, int n) {
  std::vector<MemoryTerm> all = plan.terms;
  all.insert(all.end(), plan.device_extra.begin(), plan.device_extra.end());
  std::stable_sort(all.begin(), all.end(),
                   [](const MemoryTerm& a, const MemoryTerm& b) { return a.bytes > b.bytes; });
  std::string out;
  for (int i = 0; i < n && i < static_cast<int>(all.size()) && all[i].bytes > 0; ++i) {
    absl::StrAppend(&out, i > 0 ? ", " : "", all[i].name, " ", MemoryBytes(all[i].bytes));
  }
  return out;
}

}  // namespace fsdp8
