#include "coordinator/memory_fit.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/memory_plan.h"
#include "common/spec.h"

namespace fsdp8::coord {
namespace {

// Whether the global batch splits over n ranks (training.microbatch, when set, per rank).
bool BatchAllows(const v1::JobSpec& spec, int n) {
  const int64_t gb = spec.training().global_batch();
  const int64_t mb = spec.training().has_microbatch() ? spec.training().microbatch() : gb / n;
  return mb >= 1 && gb % (n * mb) == 0;
}

// The job's plan at n ranks; nullopt when the plan cannot be made (the spec checks report that).
std::optional<MemoryPlan> PlanAt(ResolvedJob& job, int n) {
  absl::StatusOr<MemoryPlan> p = job.PlanAt(n);
  if (!p.ok()) return std::nullopt;
  return *p;
}

// The plan of a variant of the job's spec at n ranks (not the job's own: planned each time, with
// the job's planner).
std::optional<MemoryPlan> PlanVariant(const ResolvedJob& job, const v1::JobSpec& variant, int n) {
  ResolvedJob v(variant, job.planner());
  return PlanAt(v, n);
}

int64_t Term(const MemoryPlan& p, const std::string& name) {
  for (const MemoryTerm& t : p.terms) {
    if (t.name == name) return t.bytes;
  }
  return 0;
}

// What would make the job fit on workers of `largest` bytes: more workers, activation recompute,
// BF16 optimizer moments (when not already); `plan` is the plan at the largest allowed world size n.
std::string FitAdvice(const ResolvedJob& job, int n, const MemoryPlan& plan, int64_t largest) {
  const v1::JobSpec& spec = job.spec();
  std::vector<std::string> ways;
  const int64_t gb = spec.training().global_batch();
  for (int m = n + 1; m <= std::min<int64_t>(gb, 4096); ++m) {
    if (!BatchAllows(spec, m)) continue;
    v1::JobSpec s = spec;
    s.mutable_sharding()->set_min_workers(m);
    s.mutable_sharding()->set_max_workers(m);
    auto p = PlanVariant(job, s, m);
    if (p && p->device_bytes <= largest) {
      ways.push_back(absl::StrCat("more workers (sharding.min_workers: ", m, ", ",
                                  MemoryBytes(p->device_bytes), " per rank)"));
      break;
    }
  }
  const bool more_workers = !ways.empty();
  bool recompute_fits = false;
  if (!spec.training().activation_recompute()) {
    v1::JobSpec s = spec;
    s.mutable_training()->set_activation_recompute(true);
    if (auto p = PlanVariant(job, s, n)) {
      recompute_fits = p->device_bytes <= largest;
      ways.push_back(absl::StrCat("training.activation_recompute: true (",
                                  MemoryBytes(p->device_bytes), " per rank at ", n, " ranks)"));
    }
  }
  if (spec.optimizer().state_precision() != v1::PRECISION_BF16) {
    ways.push_back(absl::StrCat("optimizer.state_precision: bf16 (halves the optimizer state's ",
                                MemoryBytes(Term(plan, "optimizer state")), " per rank)"));
  }
  return absl::StrCat(more_workers || recompute_fits ? "it would fit with "
                                                     : "none of these alone makes it fit: ",
                      absl::StrJoin(ways, "; "));
}

}  // namespace

std::vector<int> AllowedWorldSizes(const v1::JobSpec& spec) {
  const int mn = std::max(1, spec.sharding().min_workers());
  const int mx = std::max(mn, spec.sharding().max_workers());
  std::vector<int> out;
  for (int n = mx; n >= mn; --n) {
    if (BatchAllows(spec, n)) out.push_back(n);
  }
  return out;
}

FitChoice ChooseFittingWorkers(ResolvedJob& job, const std::vector<std::string>& free,
                               const std::map<std::string, int64_t>& memory) {
  FitChoice c;
  for (int n : AllowedWorldSizes(job.spec())) {
    if (n > static_cast<int>(free.size())) continue;
    const std::optional<MemoryPlan> p = PlanAt(job, n);
    std::vector<std::string> fit;
    for (const std::string& id : free) {
      auto it = memory.find(id);
      const int64_t mem = it == memory.end() ? 0 : it->second;
      if (!p || mem == 0 || mem >= p->device_bytes) fit.push_back(id);
    }
    if (static_cast<int>(fit.size()) >= n) {
      c.world_size = n;
      c.workers.assign(fit.begin(), fit.begin() + n);
      return c;
    }
    if (c.why.empty() && p) {
      const std::string each = p->device_bytes == kBytesExceeded
                                   ? "more than 8 EiB"  // MemoryBytes reads "exceeds 8 EiB"
                                   : MemoryBytes(p->device_bytes);
      c.why = absl::StrCat("waiting for ", n, " workers with ", each, " each (the memory plan at ",
                           n, " ranks; ", fit.size(), " of ", free.size(),
                           " free workers have it)");
    }
  }
  return c;
}

absl::Status CheckFitsLargestWorkers(const v1::JobSpec& spec,
                                     const std::map<std::string, int64_t>& memory) {
  ResolvedJob job(MigrateStoredSpec(spec));
  return CheckFitsLargestWorkers(job, memory);
}

absl::Status CheckFitsLargestWorkers(ResolvedJob& job,
                                     const std::map<std::string, int64_t>& memory) {
  const v1::JobSpec& spec = job.spec();
  if (memory.empty()) return absl::OkStatus();
  int64_t largest = 0;
  for (const auto& [id, mem] : memory) {
    if (mem == 0) return absl::OkStatus();  // unknown: assumed enough
    largest = std::max(largest, mem);
  }
  const std::vector<int> sizes = AllowedWorldSizes(spec);
  if (sizes.empty()) return absl::OkStatus();  // the spec checks refuse it
  std::optional<MemoryPlan> best;
  for (int n : sizes) {
    const std::optional<MemoryPlan> p = PlanAt(job, n);
    if (!p || p->device_bytes <= largest) return absl::OkStatus();
    if (!best || p->device_bytes < best->device_bytes) best = p;
  }
  const std::string backend = spec.backend().empty() ? "cpu" : spec.backend();
  const std::string needed = best->device_bytes == kBytesExceeded
                                 ? std::string("more than 64-bit byte counts hold (exceeds 8 EiB)")
                                 : MemoryBytesAndCount(best->device_bytes);
  return absl::ResourceExhaustedError(absl::StrCat(
      "the job does not fit: the memory plan predicts ", needed, " per rank at ",
      best->world_size, " ranks (rank 0 and every other rank alike; peak in the ",
      best->peak_phase, ", largest terms: ", LargestTerms(*best),
      "; fsdp8 plan shows every term), the largest registered ", backend, " worker has ",
      MemoryBytesAndCount(largest), "; ", FitAdvice(job, best->world_size, *best, largest)));
}

}  // namespace fsdp8::coord
