// Trainer: one rank's part of a training job: the optimizer step over fully sharded parameters,
// FP8 scaling, the data rule and evaluation.
//
// Step k: rank r trains on global indices [r * LocalBatch, (r + 1) * LocalBatch) of step k's
// global batch, split into Microbatches() microbatches; gradients are those of the mean loss over
// the whole global batch (so 1, 2 or 3 ranks do the same math up to the order of f32 sums); then
// one fused amax all-reduce and the delayed-scaling update, the global grad norm and clipping,
// AdamW on the master shards with the warmup + cosine LR, and the FP8 cast of the next step's
// weight shards. With training.overlap_optimizer (the default) the AdamW update and the cast of
// each unit run just before the unit's next all-gather instead (FsdpParams::DeferAdamW): the
// first units' at the step's end, the others' in the next step's forward (on CUDA on a side
// stream, beside the previous unit's compute); the bits are the same.
//
// The trainer touches tensors only through Backend (device pointers); per step it copies to the
// host the amaxes, the per-token losses and the grad norm.
//
// Hybrid sharding (common/mesh.h: sharding.replicas R > 1, MeshOf(spec, world_size)): the
// parameters are sharded over the rank's shard group (MeshComms::shard) and summed across its
// replica group (MeshComms::replica) as FsdpParams says (train/fsdp.h); the loss, the FP8 amaxes
// and the grad norm reduce over `comm` (the world), and rank r trains on the same tokens as rank
// r of a flat world-W job. R = 1 is flat FSDP over `comm`, as before.
//
// Errors: collective failures and data errors are returned as Status (the trainer is unusable
// after a failed step); broken invariants abort.
// Thread-safety: one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mesh.h"
#include "common/shard_plan.h"
#include "fsdp8/v1/admin.pb.h"
#include "fsdp8/v1/spec.pb.h"
#include "kernels/backend.h"
#include "comm/communicator.h"
#include "train/data.h"
#include "train/fp8_linear.h"
#include "train/fsdp.h"
#include "train/model.h"
#include "train/options.h"
#include "train/step_timer.h"

namespace fsdp8 {

// What one optimizer step reports: this rank's figures unless marked global.
struct StepStats {
  int64_t step = 0;
  double loss_sum = 0;   // sum of the per-token training losses over this rank's tokens (nats)
  int64_t tokens = 0;    // tokens this rank trained on
  double grad_norm = 0;  // global L2 norm of the gradients before clipping (equal on every rank)
  double lr = 0;         // learning rate of the step
  // Epochs of the training data completed after this step: (step + 1) * global_batch / windows
  // (DataOrder::EpochAfterStep; equal on every rank).
  double epoch = 0;
  // Global mean validation loss (nats, equal on every rank) when the step evaluated, else NaN.
  double val_loss = std::numeric_limits<double>::quiet_NaN();
  // Host wall seconds (StepTimer): the forward/backward split into compute and exposed
  // communication, and the optimizer phase (amax and grad-norm reductions, AdamW, FP8 weight
  // casts); evaluation is in none of them. With training.overlap_optimizer the optimizer phase
  // holds the reductions, the scale update and the first two units' AdamW and casts (the
  // prefetch that ends the step); the other units' run inside the next step's forward (in its
  // compute seconds, overlapped on CUDA).
  double compute_seconds = 0;
  double comm_seconds = 0;
  double optimizer_seconds = 0;
  double eval_seconds = 0;  // host wall seconds of the validation (Evaluate) when the step ran one
  // Bytes this rank's all-gathers and reduce-scatters moved in the step (as CommBytes counts).
  int64_t all_gather_bytes = 0;
  int64_t reduce_scatter_bytes = 0;
  // Peak device bytes allocated per phase (each includes what stays allocated, e.g. the shards):
  // forward (through the loss), backward, optimizer (and FP8 weight casts); and their maximum.
  int64_t forward_peak_bytes = 0;
  int64_t backward_peak_bytes = 0;
  int64_t optimizer_peak_bytes = 0;
  int64_t peak_memory_bytes = 0;
  // The backend's bytes per memory label at each phase's peak (Backend::account(), AtPeak): each
  // sums to that phase's peak bytes above (the CPU backends; CUDA's own workspaces are in neither).
  LabelBytes forward_peak_labels{}, backward_peak_labels{}, optimizer_peak_labels{};
  // Trainer::ScalingReport() after the step, when the step was asked for it.
  std::optional<v1::ScalingState> scaling;
  // The step's loss on some rank or its global grad norm was not finite: the step changed no
  // master weight, AdamW moment, FP8 scale or amax history (equal on every rank; loss_sum and
  // grad_norm then carry the non-finite values).
  bool skipped = false;
};

// A hybrid-sharded rank's two group communicators (non-owning; they outlive the trainer): the
// shard group (S ranks, rank = shard index) and the replica group of its shard index (R ranks,
// rank = replica), as Communicator::Split(color, key) makes them from the world. A flat job
// (R = 1) needs neither (they are ignored then).
struct MeshComms {
  Communicator* shard = nullptr;
  Communicator* replica = nullptr;
};

class Trainer {
 public:
  // spec: the job spec resolved at world_size (ResolveSpec in common/spec.h: defaults applied,
  // moved fields in their new place); checked with CheckResolved, never defaulted here
  // (INVALID_ARGUMENT naming the first unresolved field). backend and comm must outlive the trainer.
  // options: the settings the spec does not hold (train/options.h; the worker passes its
  // WorkerSettings'). INVALID_ARGUMENT for specs the worker cannot run, NOT_FOUND for missing data
  // files; may run collectives (the initial FP8 weight cast), so every rank must call it.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const v1::JobSpec& spec, int rank, int world_size, Backend* backend, Communicator* comm,
      const TrainerOptions& options = TrainerOptions::FromEnvironment());
  // The same for a job of any mesh: comm is the world's communicator, mesh the group ones.
  // INVALID_ARGUMENT naming sharding.replicas when R does not divide world_size, naming
  // MeshComms.shard / MeshComms.replica when R > 1 and one is missing or of the wrong size or
  // rank, and naming precision.fp8.keep_weight_codes when it is false under
  // optimizer_sharding WORLD with R > 1 (the casts need the whole shard's codes kept).
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const v1::JobSpec& spec, int rank, int world_size, Backend* backend, Communicator* comm,
      const MeshComms& mesh, const TrainerOptions& options = TrainerOptions::FromEnvironment());

  // Runs optimizer step `step` (0-based); evaluates afterwards when `evaluate`; reports the
  // scaling state when `report_scaling`. A step whose loss (on any rank: its per-token losses ride
  // in the grad-norm all-reduce, FsdpParams::StartGradSquaredNorm) or global grad norm is not
  // finite is skipped by every rank: no scale update, clipping, AdamW or weight cast
  // (StepStats::skipped). Whether that fails the job is for the caller (the coordinator) to say.
  absl::StatusOr<StepStats> Step(int64_t step, bool evaluate, bool report_scaling);
  // Mean validation loss over eval_batches x global_batch sequences (identical on every rank);
  // NaN without a validation file.
  absl::StatusOr<double> Evaluate();

  // The learning rate of step k: linear warmup, then cosine to min_lr_ratio * peak.
  double LearningRate(int64_t step) const;
  // The FP8 scaling state after the last step. Applies the pending updates first
  // (ApplyPendingUpdates: collective, every rank calls it at the same point), so that the weight
  // scales are the last step's casts'. The error of those updates (a failed collective) when
  // they fail: the trainer is then broken, as after a failed step.
  absl::StatusOr<v1::ScalingState> ScalingReport();
  // The same without applying anything (no collective): with training.overlap_optimizer a unit
  // whose deferred update has not run yet reports the weight scales its wire shards hold now
  // (the previous step's cast); the rest as ScalingReport.
  v1::ScalingState CurrentScalingReport() const;

  // ---- for tests and tools ----
  // Zeroes the grad shards and accumulates the gradients of step k's global mean loss; returns
  // that loss (global). No optimizer update, no scaling update.
  absl::StatusOr<double> ForwardBackward(int64_t step);
  // Global mean training loss of step k's batch under the current weights (forward only).
  absl::StatusOr<double> ForwardLoss(int64_t step);
  // A given batch (comparisons with other implementations): tokens, targets (B * seq_len) host
  // int32, B >= 1, each token < vocab_size. ForwardBackwardTokens zeroes the grad shards and
  // accumulates the gradients of sum(losses) / (B * seq_len * world_size) (with the same B on
  // every rank: of the mean over all ranks' tokens), returning this rank's per-token losses
  // (nats); Logits returns (B * seq_len, V) f32 (forward only, no collective beyond the
  // all-gathers). INVALID_ARGUMENT for a wrong size or a token out of range.
  absl::StatusOr<std::vector<float>> ForwardBackwardTokens(const std::vector<int32_t>& tokens,
                                                           const std::vector<int32_t>& targets);
  absl::StatusOr<std::vector<float>> Logits(const std::vector<int32_t>& tokens);
  FsdpParams& params() { return *params_; }
  const FsdpParams& params() const { return *params_; }
  const LlamaModel& model() const { return *model_; }
  ActScaling& scaling() { return *scaling_; }
  const ActScaling& scaling() const { return *scaling_; }
  const v1::JobSpec& spec() const { return spec_; }
  // Bytes of this rank's collectives since the trainer was built (CommBytes), summed over its
  // communicators: the world's and, under a mesh, the shard and replica groups'.
  CommBytes Bytes() const;
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  const Mesh& mesh() const { return mesh_; }
  // Records that the state now is the one after `start_step` completed steps (checkpoint load);
  // the next Step() should be start_step. Only the reported scaling step depends on it: AdamW's
  // step counter (k + 1) and the LR schedule are functions of the step index passed to Step().
  void MarkResumed(int64_t start_step) { last_step_ = start_step - 1; }
  // AdamW's step counter is step + 1 + adamw_offset(): nonzero for a job that took another job's
  // optimizer state (init.load_optimizer_state), so that the bias correction continues from it.
  void SetAdamWOffset(int64_t offset) { adamw_offset_ = offset; }
  int64_t adamw_offset() const { return adamw_offset_; }
  // After the master weights changed outside a step (checkpoint load, weight import): recasts
  // the wire shards (FsdpParams::CastWeights) and prefetches the first units of the next step.
  absl::Status RecastWeights();
  // training.overlap_optimizer in effect (Mesh::DefersOptimizer, the memory plan's rule too): each
  // step's AdamW updates and wire-shard casts run per unit before the unit's next all-gather.
  bool defers_optimizer() const { return defer_optimizer_; }
  // Runs the updates a step deferred (FsdpParams::DeferAdamW) that have not run yet, so that the
  // master weights, moments and FP8 weight scales are the completed steps' (no-op when none is
  // pending). Collective: every rank calls it at the same point. Checkpoint saves and loads and
  // weight imports call it; evaluation and every forward apply each unit's update as they gather
  // it; Step applies them all at the job's last step and when it reports the scaling state.
  absl::Status ApplyPendingUpdates();
  // Continue on fewer replicas (docs/architecture.md "Continue on fewer replicas"): after a step
  // failed because a rank of another replica went away, and after every communicator of the job
  // was aborted (Communicator::Abort), takes the new mesh's communicators (`comm` the new world,
  // `mesh` its shard and replica groups; this rank keeps its shard index, the shard group its S
  // ranks) and `spec` (the job's spec resolved at world_size: sharding.replicas the new R, maybe
  // another global batch), and rolls the state back to the end of step next_step - 1 from memory:
  // the failed step's in-flight collectives, partial gradients and recorded amaxes are dropped,
  // the pending deferred update of step next_step - 1 is applied exactly once (units that the
  // failed step had already updated are not updated again), and the wire shards are recast on
  // the new communicators (collective: every rank of the new mesh calls it at the same point).
  // The shard plan, master weights, moments and FP8 scaling state are kept. ABORTED (the state
  // is not that of next_step - 1 completed steps; the trainer is unusable then) when this rank
  // completed another number of steps, or when the failed step had passed the point where it
  // changes the state (its scale update; with the serial optimizer its AdamW): the caller then
  // falls back to a checkpoint. INVALID_ARGUMENT when the new mesh is not R' x S with the same S
  // under optimizer_sharding SHARD_GROUP, or the spec is not resolved at world_size.
  absl::Status Rebind(const v1::JobSpec& spec, int rank, int world_size, Communicator* comm,
                      const MeshComms& mesh, int64_t next_step);
  // Optimizer steps the current state has completed (the last step run + 1, or the loaded step).
  int64_t CompletedSteps() const { return last_step_ + 1; }

 private:
  Trainer() = default;
  // Runs every microbatch of this rank's slice of batch `step` of `stream`; returns this rank's
  // loss sum (host, double). before_readback (optional) enqueues more device work after the last
  // microbatch, ahead of the losses' copy to the host (which waits for it too).
  // before_readback gets the device losses of this rank's tokens (local batch x seq_len f32).
  absl::StatusOr<double> RunBatch(
      const TokenData& data, int64_t step, uint64_t stream, bool backward,
      const std::function<absl::Status(const float* losses, int64_t n)>& before_readback =
          nullptr);
  absl::StatusOr<double> GlobalSum(double local);
  // The distinct communicators of this rank (world, and a mesh's shard and replica groups).
  std::vector<Communicator*> Comms() const;
  double ConsumeExposedSeconds();   // summed over Comms()
  absl::Status VerifyComms();       // Verify() of each of Comms()
  // The two phases of Step: every microbatch's forward and backward with the amax and grad-norm
  // reductions enqueued behind them (fills loss_sum and the forward/backward peaks); then the
  // scaling update, clipping, AdamW and the next step's FP8 weight casts (fills grad_norm, lr).
  absl::Status StepForwardBackward(int64_t step, StepStats* stats);
  absl::Status StepOptimizer(int64_t step, StepStats* stats);

  v1::JobSpec spec_;
  int rank_ = 0;
  int world_ = 1;
  Backend* be_ = nullptr;
  Communicator* comm_ = nullptr;  // the world
  Communicator* shard_comm_ = nullptr;
  Communicator* replica_comm_ = nullptr;  // R > 1
  Mesh mesh_;
  ShardPlan plan_;
  CommClock clock_;
  std::unique_ptr<FsdpParams> params_;
  std::unique_ptr<ActScaling> scaling_;
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<TokenData> train_, val_;
  int local_batch_ = 0, micro_ = 0, microbatches_ = 0;
  int64_t last_step_ = -1;
  // The step being run has changed the training state (its scale update ran): it cannot be
  // rolled back (Rebind) should it fail from here on.
  bool step_committed_ = false;
  int64_t adamw_offset_ = 0;
  bool defer_optimizer_ = false;
  StepTimer timer_;
};

}  // namespace fsdp8
