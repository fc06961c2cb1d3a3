#include "coordinator/memory_fit.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/memory_plan.h"
#include "common/mesh.h"
#include "common/spec.h"
#include "coordinator/placement.h"

namespace fsdp8::coord {
namespace {

// Whether the global batch splits over n ranks (training.microbatch, when set, per rank).
bool BatchAllows(const v1::JobSpec& spec, int n) {
  const int64_t gb = spec.training().global_batch();
  const int64_t mb = spec.training().has_microbatch() ? spec.training().microbatch() : gb / n;
  return mb >= 1 && gb % (n * mb) == 0;
}

// The job's plan at n ranks as `replicas` x n / replicas (0: the spec's own, auto as 1); nullopt
// when the plan cannot be made (the spec checks report that).
std::optional<MemoryPlan> PlanAt(ResolvedJob& job, int n, int replicas = 0) {
  absl::StatusOr<MemoryPlan> p = job.PlanAt(n, replicas);
  if (!p.ok()) return std::nullopt;
  return *p;
}

// The workers of `free` (in order) that hold plan `p` (none known: all of them), each with its
// placement domain (a worker without one is its own).
std::vector<PlacementWorker> Holding(const std::optional<MemoryPlan>& p,
                                     const std::vector<std::string>& free,
                                     const std::map<std::string, int64_t>& memory,
                                     const std::map<std::string, std::string>& domains) {
  std::vector<PlacementWorker> fit;
  for (const std::string& id : free) {
    auto it = memory.find(id);
    const int64_t mem = it == memory.end() ? 0 : it->second;
    if (p && mem != 0 && mem < p->device_bytes) continue;
    auto d = domains.find(id);
    fit.push_back({id, d == domains.end() ? id : d->second});
  }
  return fit;
}

std::string WaitingWhy(int n, const MemoryPlan& p, size_t holding, size_t free) {
  const std::string each = p.device_bytes == kBytesExceeded
                               ? "more than 8 EiB"  // MemoryBytes reads "exceeds 8 EiB"
                               : MemoryBytes(p.device_bytes);
  return absl::StrCat("waiting for ", n, " workers with ", each, " each (the memory plan at ", n,
                      " ranks; ", holding, " of ", free, " free workers have it)");
}

FitChoice Chosen(int n, const Placement& p) {
  FitChoice c;
  c.world_size = n;
  c.workers = p.ranks;
  c.replicas = p.replicas;
  c.split_groups = p.split;
  return c;
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
    if (!AllowsWorldSize(spec, m)) continue;
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

bool AllowsWorldSize(const v1::JobSpec& spec, int n) {
  return BatchAllows(spec, n) && MeshAllows(spec, n);
}

std::vector<int> AllowedWorldSizes(const v1::JobSpec& spec) {
  const int mn = std::max(1, spec.sharding().min_workers());
  const int mx = std::max(mn, spec.sharding().max_workers());
  std::vector<int> out;
  for (int n = mx; n >= mn; --n) {
    if (AllowsWorldSize(spec, n)) out.push_back(n);
  }
  return out;
}

FitChoice ChooseFittingWorkers(ResolvedJob& job, const std::vector<std::string>& free,
                               const std::map<std::string, int64_t>& memory,
                               const std::map<std::string, std::string>& domains) {
  FitChoice c;
  const bool automatic = job.SpecReplicas() == 0;
  for (int n : AllowedWorldSizes(job.spec())) {
    if (n > static_cast<int>(free.size())) continue;
    // The workers that hold the plan of the mesh R x n / R.
    auto holding = [&](int r) { return Holding(PlanAt(job, n, r), free, memory, domains); };
    const int r = job.ReplicasFor(1);  // auto: 1
    const Placement placed = automatic ? PlaceAuto(holding, n) : PlaceMesh(holding(r), n, r);
    if (!placed.ranks.empty()) return Chosen(n, placed);
    if (!c.why.empty()) continue;
    // Waiting: for workers that hold the plan at (n, R), auto's flat R = 1 (its smallest plan).
    if (const std::optional<MemoryPlan> p = PlanAt(job, n, r))
      c.why = WaitingWhy(n, *p, holding(r).size(), free.size());
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
