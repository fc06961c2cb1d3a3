// FsdpParams: one rank's fully sharded parameters (ZeRO-3) laid out by the ShardPlan.
//
// Per FSDP unit and flat buffer this rank holds, each of shard_numel elements:
//   master (f32)  — the FP32 master weights of its slice, initialised from InitValue of the global
//                   element index (padding 0), so the model is the same bits at any world size;
//   m, v          — AdamW moments, f32 or bf16 (MomentDtype: optimizer.state_precision);
//   grad (f32)    — the reduced gradient of its slice, accumulated over microbatches. It exists
//                   from the step's first reduce-scatter into it (or its first read) until the
//                   next ZeroGrads frees it, so the forward of a step holds no gradient shards
//                   (as `zero_grad(set_to_none=True)` in PyTorch) — except under a deferred
//                   update (DeferAdamW), which keeps a unit's until its update ran; a slice no
//                   gradient reached is allocated and zeroed only when first read;
//   wire shard    — what travels on an all-gather: FP8 codes (u8) for FP8 GEMM weights, bf16 bit
//                   patterns for bf16 buffers (fp32 buffers send the master slice itself);
//                   a blockwise FP8 buffer (BufferPlan::block_cols) also its block scales: f32
//                   scale_inv, one per 128 x 128 block of its whole bands (ShardScales()).
// A blockwise buffer's wire is cast where the tensorwise FP8 casts run (CastWeights, a deferred
// unit's update, or each Prefetch without kept codes): QuantizeFp8Blocks(kBlock128) of the rank's
// bands of its FP32 master shard, each block's amax local (a shard holds whole blocks: no
// all-reduce). Its gather is two all-gathers (codes, then scales); the gathered codes and scales
// of a tensor are those of QuantizeFp8Blocks(kBlock128) of the full (rows, cols) master weight,
// bit for bit (its padding rows are zero: they raise no block's amax).
// The wire shards are refreshed by CastWeights() once per optimizer step (docs/architecture.md,
// The step, item 6), or unit by unit by a deferred update (DeferAdamW, below):
// for FP8 tensors, the amax of this rank's master slice (empty slice: 0), one fused
// AllReduce(max) over all FP8 tensors, scale = ComputeScale(amax, 448, 0, previous) — identical on
// every rank — then this rank's slice is cast with its tensor's scale.
//
// The FP8 tensors' amaxes and the bf16 wire shards come from the AdamW pass that updated them
// (Backend::AdamW's amax_out and p16_out) when CastWeights() follows AdamW(); otherwise
// (initialisation, a checkpoint load) from a pass over the master slices.
//
// Unit lifecycle in a microbatch: Gather(u) all-gathers every buffer of u into full (padded)
// buffers (f32 for bf16/fp32 wire, u8 codes for fp8); Release(u) frees them. On one rank
// (shard = the whole buffer) the gathered buffers are views of the shards: no copy, no memory. BeginGrads(u)
// allocates full f32 gradient buffers, zeroed except for FP8 buffers, whose tensors' gradients
// must each be written whole (not accumulated) once per microbatch: the FP8 dW GEMM overwrites
// (Linear::Backward), and only the elements outside every tensor are zeroed. ReduceGrads(u)
// reduce-scatters them (f32 sums, C12) into the grad shards (the step's first gradient
// directly, later microbatches' added), then frees them; on one rank (shard = the whole buffer)
// the step's first full gradient becomes the grad shard and later ones are added to it. ZeroGrads() frees the grad shards.
//
// Hybrid sharding (common/mesh.h, FsdpMesh below): `comm` is the shard group's communicator and
// the plan is made at its S ranks (rank = shard index). After a unit's reduce-scatter in the
// step's last microbatch (SetFinalMicrobatch) completes, its grad shard is summed over the
// replica group, started as the reduce-scatters are (one unit's buffers in flight at a time,
// finished by the next ReduceGrads or before the shards are read): an in-place all-reduce
// (SHARD_GROUP), or a reduce-scatter into the rank's 1/R piece of the shard (WORLD: the grad shard then holds that
// piece). Under WORLD master, m and v hold only that piece (the rank's optimizer index
// Mesh::OptimizerIndex in a flat world-W layout), AdamW updates it, and CastWeights rebuilds the
// group's wire shard (FP8 codes, bf16, or an f32 copy for fp32 buffers, whose all-gathers then
// send it instead of the master) by an all-gather over the replica group. FP8 weight amaxes and
// the grad norm reduce over the world communicator; under SHARD_GROUP only replica 0 adds its
// squares to the norm (every replica holds the same reduced shards).
//
// Thread-safety: one thread (the trainer's).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mesh.h"
#include "common/shard_plan.h"
#include "kernels/backend.h"
#include "comm/communicator.h"
#include "train/device_buffer.h"

namespace fsdp8 {

// Accumulates the wall time spent in collectives.
struct CommClock {
  double seconds = 0;
  // Monotonic wall time in seconds, for timing collectives into `seconds`.
  static double Now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

// Where a tensor lives.
struct TensorRef {
  int unit = -1;
  int buffer = -1;
  int index = -1;        // tensor index within the buffer
  int64_t offset = 0;    // element offset in the flat buffer
  int64_t numel = 0;
  WireDtype wire = WireDtype::kFp32;
  int fp8_id = -1;       // index among FP8 weight tensors, -1 otherwise
  int64_t block_cols = 0; // > 0: a blockwise FP8 wire tensor (BufferPlan::block_cols): E4M3
                          // codes with 128 x 128 block scales (W8, WBlockScaleInv), no fp8_id
};

// AdamW's arguments for one optimizer step (Backend::AdamW); grad_scale multiplies every
// gradient (the clipping factor).
struct AdamWStep {
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  int64_t step = 0;  // AdamW's step counter (bias correction), from 1
  float grad_scale = 1;
};

// FP8 weight scaling summary for reports.
struct WeightScaling {
  std::string name;   // e.g. "layers.0.attn.q_proj.w"
  std::string tensor; // Hugging Face name
  float scale = 1.0f;
  float scale_inv = 1.0f;
  float amax = 0.0f;  // global amax of the master weight at the last cast (its own, also in a
                      // scale group, whose scale comes from the group's maximum)
};

// Short scaling-state name of a weight: "model.layers.0.self_attn.q_proj.weight" ->
// "layers.0.attn.q_proj" (suffixes ".x", ".dy", ".w" name the three scaled tensors of a linear).
std::string ScalingBaseName(const std::string& hf_name);

// The per-element arrays of a rank's shard that a checkpoint carries.
enum class ShardArray { kMaster = 0, kAdamM = 1, kAdamV = 2 };

// Storage of the AdamW moments m and v: f32, or bfloat16 (Backend::AdamW with bf16 moments: updated
// in f32, rounded to nearest even when stored).
enum class MomentDtype { kF32 = 0, kBf16 = 1 };
// The moments' storage for optimizer.state_precision (FP32 or BF16; defaults applied).
MomentDtype MomentDtypeOf(v1::Precision state_precision);

// A hybrid-sharded rank's mesh and its two other communicators (non-owning; they outlive the
// FsdpParams). A flat job passes none.
struct FsdpMesh {
  Mesh mesh;                        // R x S: S == plan.world_size, R == plan.replicas
  int rank = 0;                     // global rank (its shard index is FsdpParams' rank)
  Communicator* replica = nullptr;  // the replica group of this shard index (R ranks, by replica)
  Communicator* world = nullptr;    // every rank (W)
};

class FsdpParams {
 public:
  // keep_fp8_codes (Fp8Recipe.keep_weight_codes): false keeps no FP8 wire shards; Prefetch casts
  // the rank's FP8 slices from the master weights with the current scales instead (not under an
  // optimizer sharded over the world with R > 1: aborts). rank: the shard index in `comm`.
  // mesh (optional; R > 1 requires it, its communicators non-null and matching): see above.
  FsdpParams(const ShardPlan& plan, int rank, uint64_t seed, Backend* be, Communicator* comm,
             CommClock* clock, MomentDtype moments = MomentDtype::kF32, bool keep_fp8_codes = true,
             const FsdpMesh* mesh = nullptr);

  // Waits (stream-ordered) for prefetched all-gathers still in flight before their buffers go.
  ~FsdpParams();
  FsdpParams(const FsdpParams&) = delete;
  FsdpParams& operator=(const FsdpParams&) = delete;

  const ShardPlan& plan() const { return plan_; }
  int rank() const { return rank_; }  // shard index
  const Mesh& mesh() const { return mesh_; }
  // The optimizer state's flat layout (checkpoints): OptimizerShards() pieces of each buffer,
  // this rank's at index OptimizerIndex() (a flat job: world size and rank), each
  // OptimizerNumel(u, b) elements; master, m and v (ShardArray) hold this piece.
  int OptimizerShards() const { return mesh_.OptimizerShards(); }
  int OptimizerIndex() const { return mesh_.OptimizerIndex(global_rank_); }
  int64_t OptimizerNumel(int unit, int buffer) const { return units_[unit][buffer].opt_n; }
  // The piece's first element in the flat buffer (OptimizerIndex() * OptimizerNumel).
  int64_t OptimizerBegin(int unit, int buffer) const {
    return OptimizerIndex() * units_[unit][buffer].opt_n;
  }
  // Whether the reduce-scatters from now on are the step's last microbatch's: each unit's grad
  // shard is then summed over the replica group once complete (R > 1). Default true; the trainer
  // sets it per microbatch. No effect on a flat job.
  void SetFinalMicrobatch(bool final) { final_microbatch_ = final; }
  MomentDtype moment_dtype() const { return moments_; }
  // The tensor named `hf_name`; aborts when the plan has no such tensor (a broken invariant).
  TensorRef Ref(const std::string& hf_name) const;

  // Prefetch(u) starts u's all-gathers without making compute wait (overlap with the current
  // unit's compute); Gather(u) starts them unless prefetched, then makes compute wait for them
  // (and unpacks bf16). At most a few units should be in flight: each holds its full buffers.
  absl::Status Prefetch(int unit);
  absl::Status Gather(int unit);
  void Release(int unit);
  // Starts u's full gradient buffers, zeroed (FP8 buffers: only the elements outside every tensor,
  // as their dW GEMMs write each tensor whole). `written_whole`, when given, names one more tensor
  // of u whose gradient the caller writes whole (not accumulated): it is left unzeroed.
  void BeginGrads(int unit, const TensorRef* written_whole = nullptr);
  // Starts the reduce-scatter of u's full gradients. The previous unit's reduce-scatter is
  // finished first (its shard accumulated, its buffers freed), so at most one is in flight;
  // FlushGrads() finishes the last one. The grad shards are read through StartGradSquaredNorm,
  // AdamW and GatherAll, which also zero the shards no gradient reached since ZeroGrads.
  absl::Status ReduceGrads(int unit);
  void FlushGrads();

  // Views into the gathered unit (valid between Gather and Release).
  // f32 values (bf16/fp32 buffers). A bf16 tensor is unpacked to f32 on its first W() after the
  // Gather (the tensor's numel x 4 bytes, held until Release): tensors read only as bf16 (W16)
  // never cost f32 memory. Not thread-safe (neither is the rest of the class).
  const float* W(const TensorRef& t) const;
  const uint16_t* W16(const TensorRef& t) const;    // bf16 codes as gathered (bf16 buffers)
  const uint8_t* W8(const TensorRef& t) const;      // E4M3 codes (fp8 buffers)
  const float* WScaleInv(const TensorRef& t) const; // device scalar of an FP8 tensor
  // A blockwise FP8 wire tensor's gathered scale_inv, (ceil(rows / 128), ceil(cols / 128)) f32
  // in Backend's kBlock128 layout for the codes W8(t) (rows, cols).
  const float* WBlockScaleInv(const TensorRef& t) const;
  // Full gradient view (valid between BeginGrads and ReduceGrads).
  float* G(const TensorRef& t) const;

  void ZeroGrads();
  // Squared L2 norm of the global gradient: sum of every shard's SumSquares, AllReduce(sum) over
  // the world (a mesh: each distinct piece once, see above).
  // StartGradSquaredNorm enqueues it, FinishGradSquaredNorm reads it (a device
  // synchronisation). `values` (optional, n device floats: the trainer passes this rank's
  // per-token losses) ride in the same all-reduce as a second sum, of their squares over every
  // rank: *values_squared, finite when every rank's values are all finite (and of magnitude below
  // about 1e19, whose squares a float holds), so that every rank reaches the same verdict on them
  // without another collective. Without values (or values_squared null) it is 0 / not written.
  absl::Status StartGradSquaredNorm(const float* values = nullptr, int64_t n = 0);
  double FinishGradSquaredNorm(double* values_squared = nullptr);
  // Updates every master element of this rank's shards (Backend::AdamW; grads read as
  // ReduceGrads says). Also writes the bf16 wire shards (PackBf16 of the update) and the FP8
  // tensors' amaxes, which the next CastWeights() takes unless a master weight changed in between
  // (SetMasterElement, ZeroShard, UploadShardRange). Prefetches still in flight read the wire
  // shards: they are dropped first.
  // Aborts while a deferred update is pending (DeferAdamW).
  void AdamW(float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step,
             float grad_scale);
  void AdamW(const AdamWStep& s) {
    AdamW(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step, s.grad_scale);
  }

  // ---- the deferred update (training.overlap_optimizer) ----
  // DeferAdamW records `s` as every unit's pending update instead of running it (the grad shards
  // are complete: call it where AdamW would be called). A unit's pending update runs when the
  // unit is next prefetched or gathered (Prefetch, before its all-gathers are issued), when its
  // gradients are next reduced (ReduceGrads), or by ApplyPendingUpdate(s): that unit's AdamW,
  // then the refresh of its wire shards as CastWeights() does it for the unit's tensors (the
  // amax all-reduce(max) over the unit's FP8 weights, their scales, the casts), then its grad
  // shards are freed. ZeroGrads keeps the grad shards of units whose update is pending. The
  // results are bit-identical to AdamW() then CastWeights(): the same per-element update, and a
  // maximum is exact in any grouping of the ranks' amaxes. Prefetches in flight are dropped
  // first. Aborts when !CanDefer().
  // The per-unit update is collective over the world when the unit has FP8 weights (its amax
  // all-reduce): every rank must apply the same units in the same order, as every rank
  // prefetches the same units in the same order. Readers of the master weights and moments
  // apply the pending updates first: GatherAll and StartGradSquaredNorm (collective, as they
  // are) do; SetMasterElement, ZeroShard, UploadShardRange and CastWeights run the pending AdamW
  // updates locally (no collective: their callers recast the wire shards with CastWeights);
  // DownloadShard runs the pending AdamW updates (no collective; the units' casts stay pending).
  // weight_scaling() reports the scales as cast so far: a unit's pending update has not cast yet.
  void DeferAdamW(const AdamWStep& s);
  // Whether updates can be deferred per unit: not under an optimizer sharded over the world with
  // R > 1 (its wire shards are rebuilt by all-gathers over the replica group) nor with a weight
  // scale group spanning units.
  bool CanDefer() const { return !WorldOptimizer() && !cross_unit_groups_; }
  // Whether some unit's deferred update has not run yet.
  bool UpdatePending() const;
  // Runs `unit`'s pending update (no-op without one); errors are the amax all-reduce's.
  absl::Status ApplyPendingUpdate(int unit);
  // Every pending update, in unit order (collective, see above).
  absl::Status ApplyPendingUpdates();
  // Refreshes the wire shards from the master weights (FP8 casts with a fused amax all-reduce).
  // Prefetches still in flight read the old shards: they are dropped first.
  absl::Status CastWeights();
  // From the next CastWeights on, the FP8 weights `members` (at least two, FP8 wire, in no other
  // group) share one scale, computed from the maximum of their global amaxes (Backend::GroupMax):
  // the weights of one fused projection (LlamaModel's q/k/v, gate/up) then form one FP8 matrix
  // that a single GEMM can read. INVALID_ARGUMENT naming the tensor for a non-FP8 member or one
  // already grouped (nothing changes then).
  absl::Status SetWeightScaleGroup(const std::vector<TensorRef>& members);
  // Per FP8 weight: scale, scale_inv and amax of the last CastWeights (copied from the device
  // when they changed since the last call: a device synchronisation; not during a step).
  const std::vector<WeightScaling>& weight_scaling() const;

  // Collective: every tensor's full values, gathered from all ranks (master weights or grads).
  // Applies the pending deferred updates first (DeferAdamW). FAILED_PRECONDITION for grads while
  // an update is pending (UpdatePending(): a step ran with training.overlap_optimizer and no
  // forward, evaluation or GatherAll has applied it since): that update consumes and frees the
  // grad shards, so the gradients of that step are no longer available. Gradients are available
  // after ForwardBackward, or after a step with the serial optimizer order.
  absl::StatusOr<std::map<std::string, std::vector<float>>> GatherAll(bool grads);
  // Sets one element of a tensor's master weight if this rank owns it (testing, import); call
  // CastWeights() afterwards. Returns whether this rank owns it. Like ZeroShard and
  // UploadShardRange, it drops the prefetches in flight first (an fp32 buffer's all-gather reads
  // the master shard).
  bool SetMasterElement(const std::string& hf_name, int64_t index, float value);

  // ---- checkpoints (train/checkpoint.h) ----
  // The arrays travel as f32 whatever moment_dtype(): bf16 moments are widened (exact) on
  // download and rounded to the nearest bfloat16 (ties to even) on upload. A "shard array" is the
  // optimizer piece: OptimizerNumel(unit, buffer) elements (shard_numel but under WORLD).
  // Copies this rank's whole shard array of (unit, buffer) (OptimizerNumel f32) to the host.
  // Runs the pending AdamW updates first (RunPendingAdamW), hence not const.
  void DownloadShard(int unit, int buffer, ShardArray which, float* host);
  // Zeroes this rank's shard array of (unit, buffer) (padding included).
  void ZeroShard(int unit, int buffer, ShardArray which);
  // Writes n f32 values to elements [offset, offset + n) of this rank's shard array.
  void UploadShardRange(int unit, int buffer, ShardArray which, int64_t offset,
                        const float* host, int64_t n);
  // ---- continuing on fewer replicas (Trainer::Rebind) ----
  // After a failed step whose communicators were aborted: waits out (they fail at once after the
  // abort) and forgets every collective still in flight on the old communicators (prefetched
  // all-gathers, reduce-scatters, replica-group sums) and the gathered buffers, frees the grad
  // shards of units without a pending update (the failed step's partial sums), keeps the pending
  // deferred update of the last completed step as it stands (units that already applied theirs
  // are not applied again), then takes `comm` (the new shard group: the same S ranks, this rank
  // the same shard index) and `mesh` (the new mesh, R' replicas of S; its communicators). The
  // shard plan stays the one this object was built with: its padding (a multiple of the old
  // world size x alignment) is one of the new world's too under SHARD_GROUP, whose optimizer
  // piece is the whole shard at any R. Call RecastWeights-style CastWeights next (collective on
  // the new communicators). Aborts under a WORLD optimizer with R > 1 (its pieces are 1/R of a
  // shard: not rebuildable by the survivors) or when the shard index or group size changes.
  void Rebind(Communicator* comm, const FsdpMesh& mesh);
  // Replaces the FP8 weight scaling state (same tensors, same order; aborts otherwise). Only the
  // scales matter to the next CastWeights(): they are the fallback for an all-zero weight.
  void RestoreWeightScaling(const std::vector<WeightScaling>& ws);

 private:
  struct Slice {
    int64_t lo = 0, hi = 0;  // [lo, hi) elements
  };
  struct Buf {
    const BufferPlan* plan = nullptr;
    DevBuf master, m, v, grad, wire;  // shards (master, m, v and a reduced grad: the piece)
    int64_t opt_lo = 0, opt_n = 0;   // the optimizer piece: shard elements [opt_lo, + opt_n)
    DevBuf full;       // gathered f32 (fp32) or u8 (fp8), padded_numel elements
    DevBuf wire_scales, full_scales, scale_codes;  // blockwise: the shard's block scales (kept
                       // codes), the gathered ones, the ones cast for an all-gather in flight
    int64_t scale_ticket = 0;  // blockwise: the scales' all-gather in flight
    DevBuf full_u16;   // gathered bf16 codes (bf16), padded_numel elements
    mutable std::vector<DevBuf> f32_of;  // bf16: each tensor's f32 values, unpacked by W()
    DevBuf full_grad;  // padded_numel f32
    DevBuf codes;      // without kept FP8 codes: the slice cast for an all-gather in flight
    int64_t ticket = 0;  // in-flight all-gather (Communicator::Wait)
    std::vector<int> fp8_ids;        // FP8 tensors of this buffer, in offset order
    std::vector<Slice> grad_written_whole;  // full-gradient ranges written whole, by offset (FP8
                                            // buffers: every tensor); BeginGrads zeroes the rest
    bool grad_unset = true;          // grad holds nothing of this step yet (is not allocated)
    bool replica_summed = false;     // grad's replica-group sum has started (R > 1)
  };
  struct PendingReplica {
    Buf* buf;
    DevBuf shard;  // WORLD: the group's grad shard, read until the reduce-scatter is waited for
    int64_t ticket;
  };
  struct PendingReduce {
    Buf* buf;
    DevBuf full_grad, part;  // kept alive until the reduce-scatter is waited for
    int64_t ticket;
  };
  absl::Status Timed(absl::Status s, double t0);
  // The gathered buffers of `unit` (and the shard codes cast at prefetch), allocated before
  // Prefetch moves to the side stream: buffers that CUDA's pool hands out on the side stream and
  // that are freed on the compute stream (Release) are not reused by the compute stream's next
  // allocations, and the pool grew by them (measured: 5.6 GiB more in NVML on l3proxy).
  void AllocateGathered(int unit);
  // Prefetch's allocations (those AllocateGathered has not made) and all-gathers (the unit marked
  // in flight).
  absl::Status IssuePrefetch(int unit);
  // A blockwise buffer's part of it: its codes and scales (cast first without kept codes).
  absl::Status IssueBandGather(int unit, Buf& b);
  // Drops every prefetched, not yet gathered unit (its all-gather waited for, buffers freed).
  void DropPrefetches();
  // Drops one unit's issued all-gathers (waited for on the compute stream) and full buffers.
  void DropUnit(int unit);
  // Casts b's FP8 tensors from its master slice with the current weight scales into `codes`
  // (shard_numel bytes; the rest zeroed, as a kept wire shard's padding).
  void CastShardCodes(const Buf& b, uint8_t* codes);
  // Casts a blockwise buffer's optimizer piece of whole bands from its master (kBlock128) into
  // codes and scales (the shard's arrays: the piece lands at its place in them).
  void CastBands(const Buf& b, uint8_t* codes, float* scales);
  // CastBands into the kept wire of every blockwise buffer of `unit` (all units: -1).
  void CastBandWires(int unit);
  // Finishes pending reduce-scatters; allocates and zeroes the grad shards no gradient reached.
  // Aborts while a deferred update is pending (its grad shards are the previous step's).
  void MaterializeGrads();
  // AdamW over unit's buffers; FP8 tensors' slices take their amax into w_amax_ (zeroed by the
  // caller).
  void UpdateUnit(int unit, const AdamWStep& s) const;
  // Runs unit's pending AdamW (no-op without one), not its cast (no collective): DownloadShard
  // reads the updated arrays so; the cast follows with the unit's update (w_amax_ keeps the
  // amaxes until then).
  void RunPendingAdamW(int unit);
  // The wire-shard refresh of CastWeights for one unit whose AdamW just ran (w_amax_ holds its
  // FP8 tensors' amaxes, its bf16 wire shards are packed): amax all-reduce, scales, casts.
  absl::Status CastUnit(int unit);
  // Runs every pending AdamW update without the casts (no collective); the wire shards are then
  // stale until the next CastWeights.
  void ApplyPendingLocally();
  // Frees unit's grad shards (its update ran): the next step's first reduce-scatter makes them.
  void FreeUnitGrads(int unit);
  // R > 1: starts b's replica-group sum (its grad shard complete); finishes those in flight.
  absl::Status StartReplicaSum(Buf& b);
  void FinishReplicaSums();
  // WORLD with R > 1: the group's wire shards from every replica's piece (all-gathers over the
  // replica group).
  absl::Status RebuildWireShards();
  // What an fp32 buffer's all-gather sends: its f32 wire shard under WORLD, else the master.
  const DevBuf& F32Wire(const Buf& b) const { return b.wire.empty() ? b.master : b.wire; }
  bool WorldOptimizer() const { return mesh_.optimizer_over_world && mesh_.replicas > 1; }
  const DevBuf& Array(int unit, int buffer, ShardArray which) const;
  // Bytes per element of `which` (4, or 2 for bf16 moments).
  size_t ElementBytes(ShardArray which) const;

  const ShardPlan& plan_;
  const int rank_;
  const bool keep_fp8_codes_;
  const MomentDtype moments_;
  Backend* be_;
  Communicator* comm_;     // the shard group (a flat job: every rank)
  Communicator* replica_;  // R > 1: the replica group, else null
  Communicator* world_;    // every rank (comm_ for a flat job)
  Mesh mesh_;
  int global_rank_;
  bool final_microbatch_ = true;
  std::vector<PendingReplica> replica_sums_;  // in flight
  absl::Status replica_error_;  // a replica-group sum FlushGrads could not start
  CommClock* clock_;
  std::vector<std::vector<Buf>> units_;
  std::vector<bool> in_flight_;          // per unit: prefetched, not yet waited for
  std::vector<PendingReduce> reducing_;  // the reduce-scatters of one unit
  std::vector<TensorRef> fp8_refs_;
  std::vector<Slice> fp8_slices_;  // per FP8 tensor: its shard-local [lo, hi) ({0, 0} if none)
  // AdamW just ran and nothing changed the master weights since: w_amax_ holds their amax and
  // the bf16 wire shards their packed values (CastWeights skips both passes).
  bool adamw_outputs_ready_ = false;
  mutable std::vector<WeightScaling> wscale_;  // host copy of the device state below
  mutable bool wscale_on_host_ = true;         // wscale_ matches the device
  DevBuf w_scale_, w_scale_inv_, w_amax_;  // scales (n_fp8 * kScaleStride), amax (n_fp8) f32
  DevBuf w_amax_cast_;                     // global amaxes of the last CastWeights (n_fp8) f32
  DevBuf grad_sq_;                         // StartGradSquaredNorm's sums (2) f32
  std::vector<int32_t> w_group_;           // per FP8 tensor: its scale group (its own index alone)
  bool w_grouped_ = false;                 // some group has two or more members
  bool cross_unit_groups_ = false;         // some group has members in two units
  // Per unit: its FP8 tensors' ids [first, second) (contiguous: ids go in unit order).
  std::vector<std::pair<int, int>> unit_fp8_;
  std::vector<bool> pending_;  // per unit: its deferred update has not run (DeferAdamW)
  std::vector<bool> adamw_pending_;        // per unit: not even its AdamW (RunPendingAdamW)
  AdamWStep pending_step_;
  DevBuf w_group_dev_;                     // w_group_ on the device (n_fp8) int32, when grouped
};

}  // namespace fsdp8
