// Trainer: one rank's part of a training job: the optimizer step over fully sharded parameters,
// FP8 scaling, the data rule and evaluation.
//
// Step k: rank r trains on global indices [r * LocalBatch, (r + 1) * LocalBatch) of step k's
// global batch, split into Microbatches() microbatches; gradients are those of the mean loss over
// the whole global batch (so 1, 2 or 3 ranks do the same math up to the order of f32 sums); then
// one fused amax all-reduce and the delayed-scaling update, the global grad norm and clipping,
// AdamW on the master shards with the warmup + cosine LR, and the FP8 cast of the next step's
// weight shards.
//
// The trainer touches tensors only through Backend (device pointers); per step it copies to the
// host the amaxes, the per-token losses and the grad norm.
//
// Errors: collective failures and data errors are returned as Status (the trainer is unusable
// after a failed step); broken invariants abort.
// Thread-safety: one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/shard_plan.h"
#include "fsdp8/v1/admin.pb.h"
#include "fsdp8/v1/spec.pb.h"
#include "fsdp8/v1/worker.pb.h"
#include "kernels/backend.h"
#include "comm/communicator.h"
#include "train/data.h"
#include "train/fp8_linear.h"
#include "train/fsdp.h"
#include "train/model.h"
#include "train/options.h"

namespace fsdp8 {

class Trainer {
 public:
  // spec: the job spec (defaults are applied here). backend and comm must outlive the trainer.
  // options: the settings the spec does not hold (train/options.h; the worker passes its
  // WorkerSettings'). INVALID_ARGUMENT for specs the worker cannot run, NOT_FOUND for missing data
  // files; may run collectives (the initial FP8 weight cast), so every rank must call it.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const v1::JobSpec& spec, int rank, int world_size, Backend* backend, Communicator* comm,
      const TrainerOptions& options = TrainerOptions::FromEnvironment());

  // Runs optimizer step `step` (0-based); evaluates afterwards when `evaluate`.
  absl::StatusOr<v1::StepResult> Step(int64_t step, bool evaluate, bool report_scaling);
  // Mean validation loss over eval_batches x global_batch sequences (identical on every rank);
  // NaN without a validation file.
  absl::StatusOr<double> Evaluate();

  // The learning rate of step k: linear warmup, then cosine to min_lr_ratio * peak.
  double LearningRate(int64_t step) const;
  v1::ScalingState ScalingReport() const;

  // ---- for tests and tools ----
  // Zeroes the grad shards and accumulates the gradients of step k's global mean loss; returns
  // that loss (global). No optimizer update, no scaling update.
  absl::StatusOr<double> ForwardBackward(int64_t step);
  // Global mean training loss of step k's batch under the current weights (forward only).
  absl::StatusOr<double> ForwardLoss(int64_t step);
  FsdpParams& params() { return *params_; }
  const FsdpParams& params() const { return *params_; }
  const LlamaModel& model() const { return *model_; }
  ActScaling& scaling() { return *scaling_; }
  const ActScaling& scaling() const { return *scaling_; }
  const v1::JobSpec& spec() const { return spec_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  // Records that the state now is the one after `start_step` completed steps (checkpoint load);
  // the next Step() should be start_step. Only the reported scaling step depends on it: AdamW's
  // step counter (k + 1) and the LR schedule are functions of the step index passed to Step().
  void MarkResumed(int64_t start_step) { last_step_ = start_step - 1; }
  // After the master weights changed outside a step (checkpoint load, weight import): recasts
  // the wire shards (FsdpParams::CastWeights) and prefetches the first units of the next step.
  absl::Status RecastWeights();
  // Optimizer steps the current state has completed (the last step run + 1, or the loaded step).
  int64_t CompletedSteps() const { return last_step_ + 1; }

 private:
  Trainer() = default;
  // Runs every microbatch of this rank's slice of batch `step` of `stream`; returns this rank's
  // loss sum (host, double). before_readback (optional) enqueues more device work after the last
  // microbatch, ahead of the losses' copy to the host (which waits for it too).
  absl::StatusOr<double> RunBatch(const TokenData& data, int64_t step, uint64_t stream,
                                  bool backward,
                                  const std::function<absl::Status()>& before_readback = nullptr);
  absl::StatusOr<double> GlobalSum(double local);

  v1::JobSpec spec_;
  int rank_ = 0;
  int world_ = 1;
  Backend* be_ = nullptr;
  Communicator* comm_ = nullptr;
  ShardPlan plan_;
  CommClock clock_;
  std::unique_ptr<FsdpParams> params_;
  std::unique_ptr<ActScaling> scaling_;
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<TokenData> train_, val_;
  int local_batch_ = 0, micro_ = 0, microbatches_ = 0;
  int64_t last_step_ = -1;
  bool log_step_timing_ = false;  // TrainerOptions::log_step_timing
  double last_step_end_ = 0;  // CommClock time at the end of the last Step (log_step_timing_)
  double host_enqueue_seconds_ = 0;  // host time inside LlamaModel::Run this step
};

}  // namespace fsdp8
