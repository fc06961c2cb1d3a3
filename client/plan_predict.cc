#include "client/plan_predict.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/cost_model.h"
#include "common/mesh.h"
#include "common/spec.h"

namespace fsdp8 {

std::string DefaultCalibrationPath(const std::string& backend) {
  const std::string name = backend == "cuda" ? "cuda-h100.json" : "cpu.json";
  const std::filesystem::path rel = std::filesystem::path("data") / "calibration" / name;
  std::error_code ec;
  if (std::filesystem::exists(rel, ec)) return rel.string();
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const std::filesystem::path p = exe.parent_path().parent_path().parent_path() / rel;
    if (std::filesystem::exists(p, ec)) return p.string();
  }
  return rel.string();
}

namespace {

void PrintCost(const std::string& spec_path, const std::string& backend, const Mesh& mesh,
               const std::string& calibration, const StepCost& c, bool json) {
  const auto ms = [](double s) { return s * 1e3; };
  if (json) {
    printf("{\"world_size\": %d, \"replicas\": %d, \"shard_size\": %d, \"step_ms\": %.4f, "
           "\"compute_ms\": %.4f, \"exposed_comm_ms\": %.4f, \"optimizer_ms\": %.4f, "
           "\"comm_total_ms\": %.4f, \"gemm_ms\": %.4f, \"attention_ms\": %.4f, "
           "\"memory_ms\": %.4f, \"floor_ms\": %.4f, \"microbatches\": %d, \"tokens_per_rank\": %lld, "
           "\"tokens_per_s\": %.1f, \"optimizer_order\": \"%s\", "
           "\"training_defers_optimizer\": %s, \"optimizer_in_forward_ms\": %.4f, "
           "\"host_ms\": %.4f, \"syncs\": %.1f, \"calls\": %d, \"calibration\": \"%s\"}\n",
           mesh.world_size(), mesh.replicas, mesh.shard_size, ms(c.step_s), ms(c.compute_s),
           ms(c.exposed_comm_s), ms(c.optimizer_s), ms(c.comm_total_s), ms(c.gemm_s),
           ms(c.attention_s), ms(c.memory_s), ms(c.floor_s), c.microbatches,
           static_cast<long long>(c.tokens_per_rank),
           c.tokens_per_rank * mesh.world_size() / c.step_s,
           c.optimizer_deferred ? "deferred" : "serial", c.optimizer_deferred ? "true" : "false",
           ms(c.optimizer_in_forward_s), ms(c.host_s), c.syncs, c.calls, calibration.c_str());
    return;
  }
  printf("predicted step of %s: backend %s, %d rank%s (%d replica%s x %d), per rank\n",
         spec_path.c_str(), backend.c_str(), mesh.world_size(), mesh.world_size() == 1 ? "" : "s",
         mesh.replicas, mesh.replicas == 1 ? "" : "s", mesh.shard_size);
  printf("  %-24s %10.2f ms  (GEMMs %.2f, attention %.2f, memory-bound passes %.2f)\n",
         "compute", ms(c.compute_s), ms(c.gemm_s), ms(c.attention_s), ms(c.memory_s));
  printf("  %-24s %10.2f ms  (of %.2f ms of collectives; links %s / %s)\n",
         "exposed communication", ms(c.exposed_comm_s), ms(c.comm_total_s), c.intra_link.c_str(),
         c.inter_link.c_str());
  if (c.optimizer_deferred) {
    printf("  %-24s %10.2f ms  (deferred: the step's tail; +%.2f ms of compute in the forward)\n",
           "optimizer", ms(c.optimizer_s), ms(c.optimizer_in_forward_s));
  } else {
    printf("  %-24s %10.2f ms  (serial order: after the backward)\n", "optimizer",
           ms(c.optimizer_s));
  }
  if (c.host_s > 0) {
    printf("  %-24s %10.2f ms  (%.1f synchronisations with the device, the step's round trip)\n",
           "host", ms(c.host_s), c.syncs);
  }
  printf("  %-24s %10.2f ms  (%d microbatch%s, %lld tokens per rank, %.0f tokens/s)\n", "step",
         ms(c.step_s), c.microbatches, c.microbatches == 1 ? "" : "es",
         static_cast<long long>(c.tokens_per_rank),
         c.tokens_per_rank * mesh.world_size() / c.step_s);
  if (c.contention > 1) {
    printf("  (CPU ranks sharing the host: compute and optimizer x %.3f)\n", c.contention);
  }
  if (c.floor_s > 0) {
    printf("  (%d backend calls at the calibration's floor: +%.2f ms of compute and optimizer)\n",
           c.calls, ms(c.floor_s));
  }
  printf("  calibration: %s\n", calibration.c_str());
}

}  // namespace

int PrintStepPrediction(const std::string& spec_path, const v1::JobSpec& spec,
                        const std::vector<int>& worlds, const PredictFlags& flags) {
  int replicas = 0;
  if (!flags.replicas.empty() && (!absl::SimpleAtoi(flags.replicas, &replicas) || replicas < 1)) {
    fprintf(stderr, "error: --replicas: must be a positive integer (got \"%s\")\n",
            flags.replicas.c_str());
    return 2;
  }
  const std::string backend = spec.backend().empty() ? "cpu" : spec.backend();
  const std::string path =
      flags.calibration.empty() ? DefaultCalibrationPath(backend) : flags.calibration;
  absl::StatusOr<Calibration> cal = LoadCalibration(path);
  if (!cal.ok()) {
    fprintf(stderr, "error: %s\n", std::string(cal.status().message()).c_str());
    return 2;
  }
  for (int n : worlds) {
    v1::JobSpec s = spec;
    s.mutable_sharding()->set_min_workers(n);
    s.mutable_sharding()->set_max_workers(n);
    if (replicas > 0) s.mutable_sharding()->set_replicas(replicas);
    absl::StatusOr<v1::JobSpec> d = ResolveSpec(s, n, {}, /*check_files=*/false);
    if (!d.ok()) {
      fprintf(stderr, "error: invalid job spec at world size %d: %s\n", n,
              std::string(d.status().message()).c_str());
      return 2;
    }
    absl::StatusOr<Mesh> mesh = MeshOf(*d, n);
    if (!mesh.ok()) {
      fprintf(stderr, "error: %s\n", std::string(mesh.status().message()).c_str());
      return 2;
    }
    absl::StatusOr<StepCost> cost = PredictStep(*d, *mesh, *cal);
    if (!cost.ok()) {
      fprintf(stderr, "error: %s: %s\n", path.c_str(), std::string(cost.status().message()).c_str());
      return 2;
    }
    PrintCost(spec_path, d->backend(), *mesh, path, *cost, flags.json);
  }
  return 0;
}

}  // namespace fsdp8
