#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/spec.h"
#include "common/token_shard.h"

namespace fsdp8 {
namespace {


const char* FormatName(bool e5m2) { return e5m2 ? "E5M2" : "E4M3"; }

// Empty when `c` is rank `rank` of `size`, else what is wrong with it.
std::string CommMismatch(const Communicator* c, int rank, int size) {
  if (c->rank() == rank && c->world_size() == size) return "";
  return absl::StrCat("is rank ", c->rank(), " of ", c->world_size(), ", expected rank ", rank,
                      " of ", size);
}

// A mesh's group communicators against the mesh (R > 1).
absl::Status CheckMeshComms(const Mesh& mesh, int rank, const MeshComms& comms) {
  std::string missing;
  if (comms.shard == nullptr) missing = "MeshComms.shard (the shard group)";
  if (comms.replica == nullptr) {
    absl::StrAppend(&missing, missing.empty() ? "" : " and ",
                    "MeshComms.replica (the replica group)");
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "trainer: a mesh of ", mesh.replicas, " replicas x ", mesh.shard_size,
        " ranks (sharding.replicas ", mesh.replicas, ") needs its group communicators: ", missing,
        " missing"));
  }
  for (auto [name, c, r, n] :
       {std::tuple{"MeshComms.shard", comms.shard, mesh.ShardIndex(rank), mesh.shard_size},
        std::tuple{"MeshComms.replica", comms.replica, mesh.Replica(rank), mesh.replicas}}) {
    if (std::string m = CommMismatch(c, r, n); !m.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("trainer: ", name, " ", m, " (rank ", rank,
                                                     " of a ", mesh.replicas, " x ",
                                                     mesh.shard_size, " mesh)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const v1::JobSpec& spec, int rank,
                                                         int world_size, Backend* backend,
                                                         Communicator* comm,
                                                         const TrainerOptions& options) {
  return Create(spec, rank, world_size, backend, comm, MeshComms{}, options);
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const v1::JobSpec& spec_in, int rank,
                                                         int world_size, Backend* backend,
                                                         Communicator* comm,
                                                         const MeshComms& mesh_comms,
                                                         const TrainerOptions& options) {
  // The coordinator resolved the spec at this world size; it is checked, never filled in here.
  if (absl::Status s = CheckResolved(spec_in, world_size); !s.ok()) return s;
  absl::StatusOr<Mesh> mesh = MeshOf(spec_in, world_size);
  if (!mesh.ok()) return mesh.status();
  if (!mesh->Flat()) {
    if (absl::Status s = CheckMeshComms(*mesh, rank, mesh_comms); !s.ok()) return s;
  }
  std::unique_ptr<Trainer> t(new Trainer());
  t->timer_ = StepTimer(options.log_step_timing);
  t->spec_ = spec_in;
  const v1::JobSpec& spec = t->spec_;
  t->rank_ = rank;
  t->world_ = world_size;
  t->be_ = backend;
  t->comm_ = comm;
  t->mesh_ = *mesh;
  t->shard_comm_ = mesh->Flat() ? comm : mesh_comms.shard;
  t->replica_comm_ = mesh->Flat() ? nullptr : mesh_comms.replica;
  if (comm->world_size() != world_size || comm->rank() != rank) {
    return absl::InvalidArgumentError(absl::StrCat("communicator is rank ", comm->rank(), " of ",
                                                   comm->world_size(), ", trainer rank ", rank,
                                                   " of ", world_size));
  }
  const v1::TrainingSpec& tr = spec.training();
  if (tr.global_batch() <= 0 || tr.microbatch() <= 0 ||
      tr.global_batch() % (world_size * tr.microbatch()) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "training.global_batch: must be divisible by world_size x training.microbatch (",
        tr.global_batch(), " % (", world_size, " x ", tr.microbatch(), ") != 0)"));
  }
  if (spec.precision().embedding() == v1::PRECISION_FP8) {
    return absl::InvalidArgumentError("precision.embedding: must be BF16 or FP32 (a lookup has no GEMM)");
  }
  t->local_batch_ = LocalBatch(spec, world_size);
  t->micro_ = tr.microbatch();
  t->microbatches_ = Microbatches(spec, world_size);
  absl::StatusOr<ShardPlan> plan = MakeShardPlan(spec, *mesh);
  if (!plan.ok()) return plan.status();
  t->plan_ = std::move(*plan);

  const int T = spec.model().seq_len();
  const int V = spec.model().vocab_size();
  const Sampling sampling =
      spec.data().sampling() == v1::SAMPLING_RANDOM ? Sampling::kRandom : Sampling::kEpoch;
  absl::StatusOr<std::unique_ptr<TokenData>> train =
      TokenData::Load(spec.data().train_path(), T, V, tr.global_batch(), sampling);
  if (!train.ok()) {
    return absl::Status(train.status().code(),
                        absl::StrCat("data.train_path: ", train.status().message()));
  }
  t->train_ = std::move(*train);
  if (!spec.data().val_path().empty()) {
    absl::StatusOr<std::unique_ptr<TokenData>> val =
        TokenData::Load(spec.data().val_path(), T, V, tr.global_batch(), sampling);
    if (!val.ok()) {
      return absl::Status(val.status().code(),
                          absl::StrCat("data.val_path: ", val.status().message()));
    }
    t->val_ = std::move(*val);
  }

  backend->SetGemmAutotune(spec.tuning().gemm_autotune());
  backend->SetDeterministic(tr.deterministic());
  const FsdpMesh fsdp_mesh{*mesh, rank, t->replica_comm_, comm};
  t->params_ = std::make_unique<FsdpParams>(t->plan_, mesh->ShardIndex(rank), tr.seed(), backend,
                                            t->shard_comm_, &t->clock_,
                                            MomentDtypeOf(spec.optimizer().state_precision()),
                                            spec.precision().fp8().keep_weight_codes(),
                                            mesh->Flat() ? nullptr : &fsdp_mesh);
  t->scaling_ = std::make_unique<ActScaling>(backend, spec.precision().fp8(),
                                             spec.tuning().forward_fast_accumulation());
  t->model_ = std::make_unique<LlamaModel>(spec, t->params_.get(), t->scaling_.get(), backend,
                                           options.model);
  t->scaling_->Finalize();
  // The memory plan's rule (common/memory_plan.cc): one function decides for both. The model's
  // weight scale groups (set above) lie within one block, hence one unit, so FsdpParams agrees.
  t->defer_optimizer_ = mesh->DefersOptimizer(tr.overlap_optimizer());
  FSDP8_CHECK(!t->defer_optimizer_ || t->params_->CanDefer())
      << "the step plan deferred the optimizer but a weight scale group spans units";
  if (absl::Status s = t->RecastWeights(); !s.ok()) return s;
  return t;
}

absl::Status Trainer::RecastWeights() {
  if (absl::Status s = params_->CastWeights(); !s.ok()) return s;
  // Every step starts with its first units' all-gathers in flight, issued by whatever came before
  // it: the previous step's end (and counted in that step's bytes), this, the end of an
  // evaluation or of ForwardBackward / ForwardLoss (counted in no step).
  return model_->PrefetchFirstUnits();
}

double Trainer::LearningRate(int64_t k) const {
  const v1::OptimizerSpec& o = spec_.optimizer();
  const double peak = o.peak_lr();
  const int64_t warm = o.warmup_steps();
  const int64_t total = spec_.training().steps();
  if (k < warm) return peak * static_cast<double>(k + 1) / static_cast<double>(warm);
  const double floor = o.min_lr_ratio() * peak;
  const int64_t span = total - warm;
  if (span <= 0) return floor;
  const double progress = std::min(1.0, static_cast<double>(k - warm) / static_cast<double>(span));
  return floor + (peak - floor) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

absl::StatusOr<double> Trainer::RunBatch(
    const TokenData& data, int64_t step, uint64_t stream, bool backward,
    const std::function<absl::Status(const float* losses, int64_t n)>& before_readback) {
  const int T = spec_.model().seq_len();
  const int64_t n = static_cast<int64_t>(micro_) * T;
  const float grad_scale =
      1.0f / static_cast<float>(static_cast<int64_t>(spec_.training().global_batch()) * T);
  std::vector<int32_t> in(n), tg(n);
  std::vector<float> host_losses(static_cast<size_t>(local_batch_) * T);
  const MemoryLabelScope batch(&be_->account(), MemoryLabel::kBatch);
  DevBuf d_in(be_, n * 4), d_tg(be_, n * 4);
  DevBuf losses(be_, host_losses.size() * sizeof(float));
  for (int mb = 0; mb < microbatches_; ++mb) {
    const int64_t first = static_cast<int64_t>(rank_) * local_batch_ + mb * micro_;
    if (absl::Status s = data.Batch(spec_.training().seed(), step, first, micro_, stream,
                                    in.data(), tg.data());
        !s.ok()) {
      return s;
    }
    be_->CopyToDevice(d_in.get(), in.data(), n * 4);
    be_->CopyToDevice(d_tg.get(), tg.data(), n * 4);
    // A mesh sums the gradients over the replicas after the last microbatch's reduce-scatters.
    params_->SetFinalMicrobatch(mb + 1 == microbatches_);
    const double t_run = CommClock::Now();
    absl::Status s = model_->Run(d_in.i32(), d_tg.i32(), micro_, grad_scale,
                                 losses.f32() + mb * n, backward);
    timer_.AddHostEnqueue(CommClock::Now() - t_run);
    if (!s.ok()) return s;
  }
  if (before_readback) {
    if (absl::Status s = before_readback(losses.f32(), static_cast<int64_t>(host_losses.size()));
        !s.ok())
      return s;
  }
  be_->CopyToHost(host_losses.data(), losses.get(), host_losses.size() * sizeof(float));
  double sum = 0;
  for (float l : host_losses) sum += l;
  return sum;
}

absl::StatusOr<double> Trainer::GlobalSum(double local) {
  // Sent as f32 hi + lo parts: hi + lo holds this rank's double to ~48 bits, but the communicator
  // sums each part across ranks in f32, so every cross-rank addition of the hi parts rounds to
  // 24 bits. The result is accurate to about world_size * 2^-24 relative (the lo parts only keep
  // the local f32 conversion from adding its own error), which is ample for a reported loss.
  float parts[2];
  parts[0] = static_cast<float>(local);
  parts[1] = static_cast<float>(local - static_cast<double>(parts[0]));
  DevBuf d(be_, sizeof(parts), MemoryLabel::kWork);
  be_->CopyToDevice(d.get(), parts, sizeof(parts));
  const double t0 = CommClock::Now();
  absl::Status s = comm_->AllReduce(d.f32(), 2, ReduceOp::kSum);
  clock_.seconds += CommClock::Now() - t0;
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("loss all-reduce: ", s.message()));
  be_->CopyToHost(parts, d.get(), sizeof(parts));
  return static_cast<double>(parts[0]) + static_cast<double>(parts[1]);
}

absl::StatusOr<double> Trainer::ForwardBackward(int64_t step) {
  params_->ZeroGrads();
  scaling_->BeginStep();
  scaling_->set_recording(true);
  absl::StatusOr<double> local = RunBatch(*train_, step, kTrainStream, true);
  if (!local.ok()) return local.status();
  if (absl::Status s = model_->PrefetchFirstUnits(); !s.ok()) return s;  // for the next step
  absl::StatusOr<double> total = GlobalSum(*local);
  if (!total.ok()) return total.status();
  return *total / (static_cast<double>(spec_.training().global_batch()) * spec_.model().seq_len());
}

absl::StatusOr<double> Trainer::ForwardLoss(int64_t step) {
  scaling_->set_recording(false);
  absl::StatusOr<double> local = RunBatch(*train_, step, kTrainStream, false);
  scaling_->set_recording(true);
  if (!local.ok()) return local.status();
  if (absl::Status s = model_->PrefetchFirstUnits(); !s.ok()) return s;  // for the next step
  absl::StatusOr<double> total = GlobalSum(*local);
  if (!total.ok()) return total.status();
  return *total / (static_cast<double>(spec_.training().global_batch()) * spec_.model().seq_len());
}

namespace {

// B when `tokens` holds B >= 1 sequences of seq_len tokens, each in [0, vocab).
absl::StatusOr<int64_t> GivenBatch(const std::vector<int32_t>& tokens, const v1::ModelConfig& m) {
  const int64_t T = m.seq_len();
  if (tokens.empty() || static_cast<int64_t>(tokens.size()) % T != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tokens: ", tokens.size(),
                                                   " is not a positive multiple of seq_len ", T));
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= m.vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("tokens: ", t, " outside [0, vocab_size ",
                                                     m.vocab_size(), ")"));
    }
  }
  return static_cast<int64_t>(tokens.size()) / T;
}

}  // namespace

absl::StatusOr<std::vector<float>> Trainer::ForwardBackwardTokens(
    const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets) {
  absl::StatusOr<int64_t> B = GivenBatch(tokens, spec_.model());
  if (!B.ok()) return B.status();
  if (targets.size() != tokens.size()) return absl::InvalidArgumentError("targets: size differs from tokens");
  if (absl::StatusOr<int64_t> b = GivenBatch(targets, spec_.model()); !b.ok()) return b.status();
  const int64_t n = static_cast<int64_t>(tokens.size());
  params_->ZeroGrads();
  params_->SetFinalMicrobatch(true);
  scaling_->BeginStep();
  scaling_->set_recording(true);
  const MemoryLabelScope batch(&be_->account(), MemoryLabel::kBatch);
  DevBuf d_in(be_, n * 4), d_tg(be_, n * 4), losses(be_, n * 4);
  be_->CopyToDevice(d_in.get(), tokens.data(), n * 4);
  be_->CopyToDevice(d_tg.get(), targets.data(), n * 4);
  const float grad_scale = 1.0f / static_cast<float>(n * world_);
  if (absl::Status s = model_->Run(d_in.i32(), d_tg.i32(), *B, grad_scale, losses.f32(), true);
      !s.ok()) {
    return s;
  }
  std::vector<float> out(static_cast<size_t>(n));
  be_->CopyToHost(out.data(), losses.get(), n * 4);
  if (absl::Status s = model_->PrefetchFirstUnits(); !s.ok()) return s;
  return out;
}

absl::StatusOr<std::vector<float>> Trainer::Logits(const std::vector<int32_t>& tokens) {
  absl::StatusOr<int64_t> B = GivenBatch(tokens, spec_.model());
  if (!B.ok()) return B.status();
  const int64_t n = static_cast<int64_t>(tokens.size()), V = spec_.model().vocab_size();
  scaling_->set_recording(false);
  DevBuf d_in(be_, n * 4, MemoryLabel::kBatch), logits(be_, n * V * 4, MemoryLabel::kLogits);
  be_->CopyToDevice(d_in.get(), tokens.data(), n * 4);
  absl::Status s = model_->Logits(d_in.i32(), *B, logits.f32());
  scaling_->set_recording(true);
  if (!s.ok()) return s;
  std::vector<float> out(static_cast<size_t>(n * V));
  be_->CopyToHost(out.data(), logits.get(), out.size() * 4);
  if (absl::Status st = model_->PrefetchFirstUnits(); !st.ok()) return st;
  return out;
}

absl::StatusOr<double> Trainer::Evaluate() {
  if (!val_) return std::numeric_limits<double>::quiet_NaN();
  scaling_->set_recording(false);
  double local = 0;
  const int nb = spec_.training().eval_batches();
  for (int j = 0; j < nb; ++j) {
    absl::StatusOr<double> l = RunBatch(*val_, j, kValidationStream, false);
    if (!l.ok()) {
      scaling_->set_recording(true);
      return l.status();
    }
    local += *l;
  }
  scaling_->set_recording(true);
  absl::StatusOr<double> total = GlobalSum(local);
  if (!total.ok()) return total.status();
  return *total / (static_cast<double>(nb) * spec_.training().global_batch() *
                   spec_.model().seq_len());
}

absl::StatusOr<StepStats> Trainer::Step(int64_t step, bool evaluate, bool report_scaling) {
  timer_.Begin();
  clock_.seconds = 0;
  ConsumeExposedSeconds();  // drop waits recorded outside steps
  const CommBytes bytes0 = Bytes();
  be_->ResetPeak();
  StepStats r;
  r.step = step;
  r.tokens = static_cast<int64_t>(local_batch_) * spec_.model().seq_len();
  r.epoch = train_->order().EpochAfterStep(step);
  if (absl::Status s = StepForwardBackward(step, &r); !s.ok()) return s;
  if (absl::Status s = StepOptimizer(step, &r); !s.ok()) return s;
  // The next step's first all-gathers overlap this step's end and the host's turn-around; they
  // count in this step's bytes, as this step's own first all-gathers counted in the previous one.
  if (absl::Status s = model_->PrefetchFirstUnits(); !s.ok()) return s;
  // The job's last step, and a step whose scaling state is reported, leave nothing pending.
  if (step + 1 >= spec_.training().steps() || report_scaling) {
    if (absl::Status s = ApplyPendingUpdates(); !s.ok()) return s;
  }
  const CommBytes bytes1 = Bytes();
  be_->Synchronize();
  timer_.Mark(StepTimer::kOptimizer);
  r.optimizer_peak_bytes = be_->PeakAllocatedBytes();
  r.optimizer_peak_labels = be_->account().AtPeak();
  timer_.MaybePrint(step);
  ConsumeExposedSeconds();
  last_step_ = step;
  step_committed_ = false;
  if (evaluate) {
    const auto e0 = std::chrono::steady_clock::now();
    absl::StatusOr<double> v = Evaluate();
    if (!v.ok()) return v.status();
    if (absl::Status s = VerifyComms(); !s.ok()) return s;  // the evaluation's collectives (C09)
    if (absl::Status s = model_->PrefetchFirstUnits(); !s.ok()) return s;  // taken by the evaluation
    r.val_loss = *v;
    r.eval_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
  }
  r.comm_seconds = timer_.comm_seconds();
  r.compute_seconds = timer_.compute_seconds();
  r.optimizer_seconds = timer_.optimizer_seconds();
  r.all_gather_bytes = bytes1.all_gather - bytes0.all_gather;
  r.reduce_scatter_bytes = bytes1.reduce_scatter - bytes0.reduce_scatter;
  r.peak_memory_bytes =
      std::max({r.forward_peak_bytes, r.backward_peak_bytes, r.optimizer_peak_bytes});
  if (report_scaling) {
    absl::StatusOr<v1::ScalingState> scaling = ScalingReport();
    if (!scaling.ok()) return scaling.status();
    r.scaling = *std::move(scaling);
  }
  timer_.End();
  return r;
}

absl::Status Trainer::StepForwardBackward(int64_t step, StepStats* r) {
  params_->ZeroGrads();
  scaling_->BeginStep();
  scaling_->set_recording(true);
  // Steps 5 and 6's reductions are enqueued behind the backward, so that the device runs them
  // while the host waits for the losses: one synchronisation instead of three host round trips.
  double fb_host_comm = 0;
  absl::StatusOr<double> loss_sum =
      RunBatch(*train_, step, kTrainStream, true,
               [&](const float* losses, int64_t n) -> absl::Status {
                 fb_host_comm = clock_.seconds;  // the forward/backward's own collective calls
                 if (absl::Status s = scaling_->ReduceAmax(comm_, &clock_); !s.ok()) return s;
                 // The losses ride along: every rank learns whether any rank's loss is finite.
                 return params_->StartGradSquaredNorm(losses, n);
               });
  if (!loss_sum.ok()) return loss_sum.status();
  // RunBatch ended with a device synchronisation (the losses' copy to the host).
  timer_.Mark(StepTimer::kForwardBackward);
  const auto [fwd_labels, bwd_labels] = model_->PhasePeakLabels();
  const auto [fwd_peak, bwd_peak] = model_->TakePhasePeaks();
  const int64_t fb_tail_peak = be_->PeakAllocatedBytes();  // after the last phase boundary
  r->forward_peak_labels = fwd_labels;
  r->backward_peak_labels = fb_tail_peak > bwd_peak ? be_->account().AtPeak() : bwd_labels;
  be_->ResetPeak();
  timer_.SetForwardBackwardComm(fb_host_comm, ConsumeExposedSeconds());
  r->loss_sum = *loss_sum;
  r->forward_peak_bytes = fwd_peak;
  r->backward_peak_bytes = std::max(bwd_peak, fb_tail_peak);
  return absl::OkStatus();
}

absl::Status Trainer::StepOptimizer(int64_t step, StepStats* r) {
  // Step 6's reductions were enqueued behind the backward: the global grad norm and the sum of
  // every rank's squared losses, read back first: a non-finite step changes nothing below.
  double losses_squared = 0;
  const double sq = params_->FinishGradSquaredNorm(&losses_squared);
  timer_.Mark(StepTimer::kGradNorm);
  const double norm = std::sqrt(sq);
  const double lr = LearningRate(step);
  r->grad_norm = norm;
  r->lr = lr;
  if (!std::isfinite(norm) || !std::isfinite(losses_squared)) {
    // Every rank got the same sums, so every rank skips: no scale update, AdamW or weight cast.
    r->skipped = true;
    timer_.Mark(StepTimer::kScaleUpdate);
    timer_.Mark(StepTimer::kAdamW);
    timer_.Mark(StepTimer::kWeightCasts);
    if (absl::Status s = VerifyComms(); !s.ok()) return s;
    timer_.Mark(StepTimer::kVerify);
    return absl::OkStatus();
  }
  // Step 5: the fused amax all-reduce (enqueued behind the backward); identical delayed-scaling
  // updates on every rank. From here on the step changes the state (Rebind cannot undo it).
  step_committed_ = true;
  scaling_->UpdateScales();
  timer_.Mark(StepTimer::kScaleUpdate);
  // Step 6: clipping, AdamW, next step's FP8 weight shards.
  const v1::OptimizerSpec& o = spec_.optimizer();
  double clip = 1.0;
  if (o.grad_clip() > 0) clip = std::min(1.0, o.grad_clip() / (norm + 1e-6));
  const AdamWStep update{static_cast<float>(lr),
                         static_cast<float>(o.beta1()),
                         static_cast<float>(o.beta2()),
                         static_cast<float>(o.eps()),
                         static_cast<float>(o.weight_decay()),
                         step + 1 + adamw_offset_,
                         static_cast<float>(clip)};
  if (defer_optimizer_) {
    // Each unit's AdamW and wire-shard cast run before its next all-gather (FsdpParams::
    // DeferAdamW): the first units' in the prefetch that ends this step, the others' in the
    // next step's forward.
    params_->DeferAdamW(update);
    timer_.Mark(StepTimer::kAdamW);
    timer_.Mark(StepTimer::kWeightCasts);
    if (absl::Status s = VerifyComms(); !s.ok()) return s;
    timer_.Mark(StepTimer::kVerify);
    return absl::OkStatus();
  }
  params_->AdamW(update);
  timer_.Mark(StepTimer::kAdamW);
  if (absl::Status s = params_->CastWeights(); !s.ok()) return s;
  // C09 for this step's collectives, before the next step's prefetch: its headers queue behind
  // the embedding's all-gather, and waiting for them held the next step back (~0.7 ms at 1b);
  // the watchdog or the next step's Verify compares them.
  timer_.Mark(StepTimer::kWeightCasts);
  if (absl::Status s = VerifyComms(); !s.ok()) return s;
  timer_.Mark(StepTimer::kVerify);
  return absl::OkStatus();
}

absl::Status Trainer::ApplyPendingUpdates() { return params_->ApplyPendingUpdates(); }

absl::Status Trainer::Rebind(const v1::JobSpec& spec, int rank, int world_size,
                             Communicator* comm, const MeshComms& mesh_comms, int64_t next_step) {
  if (CompletedSteps() != next_step)
    return absl::AbortedError(absl::StrCat("this rank's state is after ", CompletedSteps(),
                                           " steps, not ", next_step,
                                           ": it cannot re-run step ", next_step));
  if (step_committed_)
    return absl::AbortedError(absl::StrCat(
        "step ", next_step, " had already updated this rank's scaling state or weights when it "
        "failed: it cannot be rolled back"));
  if (absl::Status s = CheckResolved(spec, world_size); !s.ok()) return s;
  absl::StatusOr<Mesh> mesh = MeshOf(spec, world_size);
  if (!mesh.ok()) return mesh.status();
  if (mesh->shard_size != mesh_.shard_size || mesh_.optimizer_over_world ||
      mesh->ShardIndex(rank) != mesh_.ShardIndex(rank_))
    return absl::InvalidArgumentError(absl::StrCat(
        "sharding: a rank continues on fewer replicas only as the same shard of a group of ",
        mesh_.shard_size, " under optimizer_sharding SHARD_GROUP (new mesh ", mesh->replicas,
        " x ", mesh->shard_size, ", rank ", rank, ")"));
  if (!mesh->Flat()) {
    if (absl::Status s = CheckMeshComms(*mesh, rank, mesh_comms); !s.ok()) return s;
  }
  if (comm->world_size() != world_size || comm->rank() != rank)
    return absl::InvalidArgumentError(absl::StrCat("communicator is rank ", comm->rank(), " of ",
                                                   comm->world_size(), ", trainer rank ", rank,
                                                   " of ", world_size));
  const v1::TrainingSpec& tr = spec.training();
  if (tr.global_batch() <= 0 || tr.microbatch() <= 0 ||
      tr.global_batch() % (world_size * tr.microbatch()) != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "training.global_batch: must be divisible by world_size x training.microbatch (",
        tr.global_batch(), " % (", world_size, " x ", tr.microbatch(), ") != 0)"));
  spec_ = spec;
  rank_ = rank;
  world_ = world_size;
  comm_ = comm;
  mesh_ = *mesh;
  shard_comm_ = mesh->Flat() ? comm : mesh_comms.shard;
  replica_comm_ = mesh->Flat() ? nullptr : mesh_comms.replica;
  local_batch_ = LocalBatch(spec, world_size);
  micro_ = tr.microbatch();
  microbatches_ = Microbatches(spec, world_size);
  const FsdpMesh fsdp_mesh{*mesh, rank, replica_comm_, comm};
  params_->Rebind(shard_comm_, fsdp_mesh);
  // The pending update of step next_step - 1 (its units not yet updated) runs here, locally,
  // then every wire shard is cast again on the new communicators, and the next step's first
  // units are prefetched.
  return RecastWeights();
}

std::vector<Communicator*> Trainer::Comms() const {
  std::vector<Communicator*> out = {comm_};
  for (Communicator* c : {shard_comm_, replica_comm_}) {
    if (c != nullptr && c != comm_) out.push_back(c);
  }
  return out;
}

CommBytes Trainer::Bytes() const {
  CommBytes sum;
  for (const Communicator* c : Comms()) {
    sum.all_gather += c->bytes().all_gather;
    sum.reduce_scatter += c->bytes().reduce_scatter;
    sum.all_reduce += c->bytes().all_reduce;
  }
  return sum;
}

double Trainer::ConsumeExposedSeconds() {
  double s = 0;
  for (Communicator* c : Comms()) s += c->ConsumeExposedSeconds();
  return s;
}

absl::Status Trainer::VerifyComms() {
  for (Communicator* c : Comms()) {
    if (absl::Status s = c->Verify(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ScalingState> Trainer::ScalingReport() {
  if (absl::Status s = ApplyPendingUpdates(); !s.ok()) return s;
  return CurrentScalingReport();
}

v1::ScalingState Trainer::CurrentScalingReport() const {
  v1::ScalingState out;
  out.set_step(last_step_);
  for (const WeightScaling& w : params_->weight_scaling()) {
    v1::TensorScaling* t = out.add_tensors();
    t->set_name(w.name);
    t->set_format("E4M3");
    t->set_scale(w.scale);
    t->set_scale_inv(w.scale_inv);
    t->add_amax_history(w.amax);
  }
  for (const ScalingState& s : scaling_->states()) {
    v1::TensorScaling* t = out.add_tensors();
    t->set_name(s.name);
    t->set_format(FormatName(s.e5m2));
    t->set_scale(s.scale);
    t->set_scale_inv(s.scale_inv);
    for (float a : s.history) t->add_amax_history(a);
  }
  return out;
}

}  // namespace fsdp8
