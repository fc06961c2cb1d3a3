#include "train/fsdp.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "common/check.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "common/scaling.h"
#include "kernels/fp8.h"

namespace fsdp8 {

std::string ScalingBaseName(const std::string& hf_name) {
  absl::string_view s = hf_name;
  absl::ConsumePrefix(&s, "model.");
  absl::ConsumeSuffix(&s, ".weight");
  return absl::StrReplaceAll(s, {{"self_attn.", "attn."}});
}

namespace {

// out[g - lo] = InitValue(t, g - offset, seed) for g in [lo, hi), on up to 16 host threads (a
// full Llama-3-8B has 8 G elements; one thread takes minutes).
void InitRange(const TensorSpec& t, int64_t offset, int64_t lo, int64_t hi, uint64_t seed,
               float* out) {
  auto fill = [&](int64_t a, int64_t b) {
    for (int64_t g = a; g < b; ++g) out[g - lo] = InitValue(t, g - offset, seed);
  };
  constexpr int64_t kPerThread = int64_t{1} << 22;
  const int64_t threads = std::clamp<int64_t>((hi - lo) / kPerThread, 1,
      std::min<int64_t>(16, std::max(1u, std::thread::hardware_concurrency())));
  if (threads == 1) return fill(lo, hi);
  std::vector<std::thread> pool;
  const int64_t step = (hi - lo + threads - 1) / threads;
  for (int64_t a = lo; a < hi; a += step) pool.emplace_back(fill, a, std::min(hi, a + step));
  for (std::thread& th : pool) th.join();
}

}  // namespace

MomentDtype MomentDtypeOf(v1::Precision state_precision) {
  return state_precision == v1::PRECISION_BF16 ? MomentDtype::kBf16 : MomentDtype::kF32;
}

namespace {

Mesh FlatMesh(int world_size) {
  Mesh m;
  m.shard_size = world_size;
  return m;
}

}  // namespace

FsdpParams::FsdpParams(const ShardPlan& plan, int rank, uint64_t seed, Backend* be,
                       Communicator* comm, CommClock* clock, MomentDtype moments,
                       bool keep_fp8_codes, const FsdpMesh* mesh)
    : plan_(plan), rank_(rank), keep_fp8_codes_(keep_fp8_codes), moments_(moments), be_(be),
      comm_(comm), replica_(mesh != nullptr && mesh->mesh.replicas > 1 ? mesh->replica : nullptr),
      world_(mesh != nullptr && mesh->mesh.replicas > 1 ? mesh->world : comm),
      mesh_(mesh != nullptr ? mesh->mesh : FlatMesh(plan.world_size)),
      global_rank_(mesh != nullptr ? mesh->rank : rank), clock_(clock) {
  FSDP8_CHECK(mesh_.shard_size == plan.world_size && mesh_.replicas == plan.replicas)
      << "mesh " << mesh_.replicas << " x " << mesh_.shard_size << " for a plan of "
      << plan.replicas << " x " << plan.world_size;
  FSDP8_CHECK(mesh_.ShardIndex(global_rank_) == rank) << "rank " << global_rank_ << " is not shard " << rank;
  FSDP8_CHECK(mesh_.replicas == 1 || (replica_ != nullptr && world_ != nullptr))
      << "a mesh of " << mesh_.replicas << " replicas needs its replica and world communicators";
  FSDP8_CHECK(keep_fp8_codes_ || !WorldOptimizer()) << "WORLD optimizer sharding keeps FP8 codes";
  const int pieces = WorldOptimizer() ? mesh_.replicas : 1;
  const int piece = WorldOptimizer() ? mesh_.Replica(global_rank_) : 0;
  units_.resize(plan.units.size());
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const AllocationLabel label("the shards (weights, gradients, AdamW moments) of unit",
                                static_cast<int64_t>(u));
    const int first_fp8 = static_cast<int>(fp8_refs_.size());
    for (size_t b = 0; b < plan.units[u].buffers.size(); ++b) {
      const BufferPlan& bp = plan.units[u].buffers[b];
      Buf& buf = units_[u].emplace_back();
      buf.plan = &bp;
      buf.opt_n = bp.shard_numel / pieces;
      buf.opt_lo = piece * buf.opt_n;
      const int64_t n = buf.opt_n;
      // Master init on the host from the global index: only this rank's piece is materialised.
      std::vector<float> host(n, 0.0f);
      const int64_t begin = bp.ShardBegin(rank) + buf.opt_lo;
      for (size_t t = 0; t < bp.tensors.size(); ++t) {
        const int64_t lo = std::max(bp.offsets[t], begin);
        const int64_t hi = std::min(bp.offsets[t] + bp.tensors[t].numel, begin + n);
        InitRange(bp.tensors[t], bp.offsets[t], lo, hi, seed, host.data() + (lo - begin));
        if (bp.wire == WireDtype::kFp8 && !bp.Banded()) {
          FSDP8_CHECK(bp.tensors[t].is_fp8_linear) << bp.tensors[t].name << " in an fp8 buffer";
          TensorRef r{static_cast<int>(u), static_cast<int>(b), static_cast<int>(t),
                      bp.offsets[t], bp.tensors[t].numel, bp.wire,
                      static_cast<int>(fp8_refs_.size())};
          buf.fp8_ids.push_back(r.fp8_id);
          // Shard-local, within the optimizer piece.
          fp8_slices_.push_back(hi > lo ? Slice{lo - begin + buf.opt_lo, hi - begin + buf.opt_lo}
                                        : Slice{0, 0});
          fp8_refs_.push_back(r);
          WeightScaling ws;
          ws.name = ScalingBaseName(bp.tensors[t].name) + ".w";
          ws.tensor = bp.tensors[t].name;
          wscale_.push_back(ws);
        }
      }
      buf.master = DevBuf(be, n * sizeof(float), MemoryLabel::kParams);
      if (n > 0) be->CopyToDevice(buf.master.get(), host.data(), n * sizeof(float));
      buf.m = DevBuf::Zeros(be, n * ElementBytes(ShardArray::kAdamM), MemoryLabel::kOptimizer);
      buf.v = DevBuf::Zeros(be, n * ElementBytes(ShardArray::kAdamV), MemoryLabel::kOptimizer);
      const int64_t ns = bp.shard_numel;  // the wire shards are the group's whole shard
      if (bp.Banded()) {
        // Codes and block scales of whole bands (CastBands writes them all, padding included);
        // the scaled dW GEMMs accumulate, so the full gradients are zeroed whole (BeginGrads).
        if (keep_fp8_codes_) {
          buf.wire = DevBuf::Zeros(be, ns, MemoryLabel::kParams);
          buf.wire_scales = DevBuf::Zeros(be, bp.ShardScales() * sizeof(float), MemoryLabel::kParams);
        }
      } else if (bp.wire == WireDtype::kFp8) {
        // Padding stays code 0: casts write the tensors only.
        if (keep_fp8_codes_) buf.wire = DevBuf::Zeros(be, ns, MemoryLabel::kParams);
        // Every FP8 weight's gradient is written whole by its dW GEMM (Linear::Backward).
        for (size_t t = 0; t < bp.tensors.size(); ++t) {
          buf.grad_written_whole.push_back({bp.offsets[t], bp.offsets[t] + bp.tensors[t].numel});
        }
      }
      if (bp.wire == WireDtype::kBf16) {
        buf.wire = DevBuf::Zeros(be, ns * sizeof(uint16_t), MemoryLabel::kParams);
      }
      // WORLD: an fp32 buffer's all-gathers send an f32 copy of the shard (RebuildWireShards).
      if (bp.wire == WireDtype::kFp32 && WorldOptimizer()) {
        buf.wire = DevBuf(be, ns * sizeof(float), MemoryLabel::kParams);
      }
    }
    unit_fp8_.emplace_back(first_fp8, static_cast<int>(fp8_refs_.size()));
  }
  pending_.assign(units_.size(), false);
  adamw_pending_.assign(units_.size(), false);
  const size_t nf = std::max<size_t>(fp8_refs_.size(), 1);
  const MemoryLabelScope scaling(&be->account(), MemoryLabel::kScaling);
  w_scale_ = DevBuf(be, nf * kScaleStride * sizeof(float));
  w_scale_inv_ = DevBuf(be, nf * kScaleStride * sizeof(float));
  w_amax_ = DevBuf(be, nf * sizeof(float));
  w_amax_cast_ = DevBuf::Zeros(be, nf * sizeof(float));
  for (size_t i = 0; i < fp8_refs_.size(); ++i) w_group_.push_back(static_cast<int32_t>(i));
  // The device slots hold the current scales (the previous scale is an all-zero weight's
  // fallback in Fp8ScalesFromAmax): 1 until the first cast.
  const std::vector<float> ones(nf, 1.0f);
  UploadScaleSlots(be, w_scale_.f32(), ones);
  UploadScaleSlots(be, w_scale_inv_.f32(), ones);
}

TensorRef FsdpParams::Ref(const std::string& hf_name) const {
  int u, b, t;
  FSDP8_CHECK(plan_.Find(hf_name, &u, &b, &t)) << "shard plan has no tensor " << hf_name;
  const BufferPlan& bp = plan_.units[u].buffers[b];
  TensorRef r{u, b, t, bp.offsets[t], bp.tensors[t].numel, bp.wire, -1, bp.block_cols};
  for (const TensorRef& f : fp8_refs_) {
    if (f.unit == u && f.buffer == b && f.index == t) r.fp8_id = f.fp8_id;
  }
  return r;
}

absl::Status FsdpParams::Timed(absl::Status s, double t0) {
  clock_->seconds += CommClock::Now() - t0;
  return s;
}

FsdpParams::~FsdpParams() {
  // Collectives still in flight (a step abandoned by an exception) finish before their buffers
  // go: the reduce-scatters here, the all-gathers in DropPrefetches (a buffer holds an all-gather
  // ticket only while its unit is in flight: Prefetch marks the unit before it issues any, Gather
  // and DropUnit clear the tickets before the mark).
  for (PendingReduce& p : reducing_) comm_->Wait(p.ticket);
  reducing_.clear();
  for (PendingReplica& p : replica_sums_) replica_->Wait(p.ticket);
  replica_sums_.clear();
  DropPrefetches();
}

void FsdpParams::Rebind(Communicator* comm, const FsdpMesh& mesh) {
  FSDP8_CHECK(!WorldOptimizer()) << "Rebind under a WORLD optimizer with R > 1";
  FSDP8_CHECK(mesh.mesh.shard_size == mesh_.shard_size &&
              mesh.mesh.ShardIndex(mesh.rank) == rank_ && !mesh.mesh.optimizer_over_world)
      << "Rebind to mesh " << mesh.mesh.replicas << " x " << mesh.mesh.shard_size
      << " as shard " << mesh.mesh.ShardIndex(mesh.rank) << ", was shard " << rank_ << " of "
      << mesh_.shard_size;
  be_->JoinSideStream();
  // The old communicators were aborted: these waits return at once (their errors are the failed
  // step's, already reported).
  for (PendingReduce& p : reducing_) comm_->Wait(p.ticket);
  reducing_.clear();
  for (PendingReplica& p : replica_sums_) replica_->Wait(p.ticket);
  replica_sums_.clear();
  DropPrefetches();
  for (size_t u = 0; u < units_.size(); ++u) {
    for (Buf& b : units_[u]) {
      b.full.Reset();
      b.full_u16.Reset();
      b.f32_of.clear();
      b.full_grad.Reset();
      b.codes.Reset();
      b.full_scales.Reset();
      b.scale_codes.Reset();
    }
    // The failed step's partial gradient sums go; a pending update keeps its (complete) shards.
    if (!pending_[u]) FreeUnitGrads(static_cast<int>(u));
  }
  replica_error_ = absl::OkStatus();
  final_microbatch_ = true;
  adamw_outputs_ready_ = false;  // the next CastWeights takes the amaxes from the master weights
  const bool hybrid = mesh.mesh.replicas > 1;
  comm_ = comm;
  replica_ = hybrid ? mesh.replica : nullptr;
  world_ = hybrid ? mesh.world : comm;
  mesh_ = mesh.mesh;
  global_rank_ = mesh.rank;
}

void FsdpParams::DropPrefetches() {
  for (size_t u = 0; u < in_flight_.size(); ++u) {
    if (in_flight_[u]) DropUnit(static_cast<int>(u));
  }
}

void FsdpParams::DropUnit(int unit) {
  be_->JoinSideStream();  // the buffers freed below may be the side stream's (codes cast there)
  for (Buf& b : units_[unit]) {
    if (b.ticket != 0) comm_->Wait(b.ticket);  // the compute stream's frees below come after it
    if (b.scale_ticket != 0) comm_->Wait(b.scale_ticket);
    b.ticket = 0;
    b.scale_ticket = 0;
    b.codes.Reset();
    b.scale_codes.Reset();
    b.full_scales.Reset();
    b.full.Reset();
    b.full_u16.Reset();
    b.f32_of.clear();
  }
  if (static_cast<size_t>(unit) < in_flight_.size()) in_flight_[unit] = false;
}

absl::Status FsdpParams::Prefetch(int unit) {
  if (in_flight_.size() != units_.size()) in_flight_.assign(units_.size(), false);
  if (in_flight_[unit]) return absl::OkStatus();
  if (!pending_[unit]) return IssuePrefetch(unit);
  // The unit's deferred update writes the wire shards its all-gathers send: both go to the side
  // stream, after everything enqueued so far, beside the compute enqueued next (the previous
  // unit's); Gather joins it.
  be_->BeginSideStream();
  absl::Status s = ApplyPendingUpdate(unit);
  be_->EndSideStream();
  if (!s.ok()) return s;
  AllocateGathered(unit);  // on the compute stream, after the update's own buffers went
  be_->BeginSideStream();  // in order after the update: the same side stream
  s = IssuePrefetch(unit);
  be_->EndSideStream();
  return s;
}

void FsdpParams::AllocateGathered(int unit) {
  for (Buf& b : units_[unit]) {
    const BufferPlan& bp = *b.plan;
    const bool cast_now = bp.wire == WireDtype::kFp8 && !keep_fp8_codes_;
    if (cast_now && b.codes.empty()) b.codes = DevBuf(be_, bp.shard_numel, MemoryLabel::kGathered);
    if (cast_now && bp.Banded() && b.scale_codes.empty()) {
      b.scale_codes = DevBuf(be_, bp.ShardScales() * sizeof(float), MemoryLabel::kGathered);
    }
    if (bp.OneRank()) continue;  // a view of the shard, or of the codes above
    if (bp.Banded()) {  // its codes, then its block scales (IssueBandGather's order)
      if (b.full.empty()) b.full = DevBuf(be_, bp.padded_numel, MemoryLabel::kGathered);
      if (b.full_scales.empty()) {
        b.full_scales = DevBuf(be_, bp.PaddedScales() * sizeof(float), MemoryLabel::kGathered);
      }
      continue;
    }
    if (bp.wire == WireDtype::kBf16) {
      if (b.full_u16.empty()) {
        b.full_u16 = DevBuf(be_, bp.padded_numel * sizeof(uint16_t), MemoryLabel::kGathered);
      }
    } else if (b.full.empty()) {
      const size_t elt = bp.wire == WireDtype::kFp8 ? 1 : sizeof(float);
      b.full = DevBuf(be_, bp.padded_numel * elt, MemoryLabel::kGathered);
    }
  }
}

absl::Status FsdpParams::IssuePrefetch(int unit) {
  // Marked before the allocations: should one throw (out of memory), DropUnit (the destructor's)
  // waits for the all-gathers already issued.
  in_flight_[unit] = true;
  for (Buf& b : units_[unit]) {
    const BufferPlan& bp = *b.plan;
    const int64_t n = bp.shard_numel;
    if (bp.Banded()) {
      if (absl::Status s = IssueBandGather(unit, b); !s.ok()) return s;
      continue;
    }
    if (bp.wire == WireDtype::kFp8 && !keep_fp8_codes_) {
      // No kept codes: cast now (on one rank straight into the gathered buffer).
      if (b.codes.empty()) b.codes = DevBuf(be_, n, MemoryLabel::kGathered);
      CastShardCodes(b, b.codes.u8());
      if (bp.OneRank()) {
        b.full = std::move(b.codes);
        continue;
      }
    }
    if (bp.OneRank()) {  // the gathered unit is the shard itself (no copy)
      if (bp.wire == WireDtype::kBf16) {
        b.full_u16 = DevBuf::View(b.wire.get(), n * sizeof(uint16_t));
      } else {
        b.full = bp.wire == WireDtype::kFp8 ? DevBuf::View(b.wire.get(), n)
                                            : DevBuf::View(F32Wire(b).get(), n * sizeof(float));
      }
      continue;
    }
    const double t0 = CommClock::Now();
    absl::StatusOr<int64_t> t;
    switch (bp.wire) {
      case WireDtype::kFp8:
        if (b.full.empty()) b.full = DevBuf(be_, bp.padded_numel, MemoryLabel::kGathered);
        t = comm_->AllGatherAsync(keep_fp8_codes_ ? b.wire.get() : b.codes.get(), b.full.get(), n);
        break;
      case WireDtype::kBf16:
        if (b.full_u16.empty()) {
          b.full_u16 = DevBuf(be_, bp.padded_numel * sizeof(uint16_t), MemoryLabel::kGathered);
        }
        t = comm_->AllGatherAsync(b.wire.get(), b.full_u16.get(), n * sizeof(uint16_t));
        break;
      case WireDtype::kFp32:
        if (b.full.empty()) b.full = DevBuf(be_, bp.padded_numel * sizeof(float), MemoryLabel::kGathered);
        t = comm_->AllGatherAsync(F32Wire(b).get(), b.full.get(), n * sizeof(float));
        break;
    }
    if (absl::Status r = Timed(t.status(), t0); !r.ok()) {
      DropUnit(unit);  // the all-gathers issued so far finish before their buffers go
      return absl::Status(r.code(), absl::StrCat("all-gather of ", plan_.units[unit].name, "/",
                                                 WireDtypeName(bp.wire), ": ", r.message()));
    }
    b.ticket = *t;
  }
  return absl::OkStatus();
}

absl::Status FsdpParams::IssueBandGather(int unit, Buf& b) {
  const BufferPlan& bp = *b.plan;
  const int64_t n = bp.shard_numel, ns = bp.ShardScales();
  const uint8_t* codes = b.wire.u8();
  const float* scales = b.wire_scales.f32();
  if (!keep_fp8_codes_) {  // no kept codes: cast now (on one rank straight into the gathered)
    if (b.codes.empty()) b.codes = DevBuf(be_, n, MemoryLabel::kGathered);
    if (b.scale_codes.empty()) {
      b.scale_codes = DevBuf(be_, ns * sizeof(float), MemoryLabel::kGathered);
    }
    CastBands(b, b.codes.u8(), b.scale_codes.f32());
    codes = b.codes.u8();
    scales = b.scale_codes.f32();
  }
  if (bp.OneRank()) {
    if (keep_fp8_codes_) {
      b.full = DevBuf::View(b.wire.get(), n);
      b.full_scales = DevBuf::View(b.wire_scales.get(), ns * sizeof(float));
    } else {
      b.full = std::move(b.codes);
      b.full_scales = std::move(b.scale_codes);
    }
    return absl::OkStatus();
  }
  // Two all-gathers: the codes, then the block scales (their buffers made here unless
  // AllocateGathered made them).
  if (b.full.empty()) b.full = DevBuf(be_, bp.padded_numel, MemoryLabel::kGathered);
  if (b.full_scales.empty()) {
    b.full_scales = DevBuf(be_, bp.PaddedScales() * sizeof(float), MemoryLabel::kGathered);
  }
  const double t0 = CommClock::Now();
  absl::StatusOr<int64_t> t = comm_->AllGatherAsync(codes, b.full.get(), n);
  if (t.ok()) b.ticket = *t;
  absl::StatusOr<int64_t> ts = t.ok() ? comm_->AllGatherAsync(scales, b.full_scales.get(),
                                                              ns * sizeof(float))
                                      : t.status();
  if (ts.ok()) b.scale_ticket = *ts;
  if (absl::Status r = Timed(ts.status(), t0); !r.ok()) {
    DropUnit(unit);
    return absl::Status(r.code(), absl::StrCat("all-gather of ", plan_.units[unit].name,
                                               "/fp8 blockwise: ", r.message()));
  }
  return absl::OkStatus();
}

void FsdpParams::CastBands(const Buf& b, uint8_t* codes, float* scales) {
  const BufferPlan& bp = *b.plan;
  if (b.opt_n == 0) return;
  be_->QuantizeFp8Blocks(b.master.f32(), b.opt_n / bp.block_cols, bp.block_cols,
                         Fp8Blocks::kBlock128, Fp8Format::kE4M3, codes + b.opt_lo,
                         scales + bp.ScaleOffset(b.opt_lo));
}

void FsdpParams::CastBandWires(int unit) {
  if (!keep_fp8_codes_) return;  // each Prefetch casts them
  for (size_t u = 0; u < units_.size(); ++u) {
    if (unit >= 0 && static_cast<int>(u) != unit) continue;
    for (Buf& b : units_[u]) {
      if (b.plan->Banded()) CastBands(b, b.wire.u8(), b.wire_scales.f32());
    }
  }
}

absl::Status FsdpParams::Gather(int unit) {
  if (absl::Status s = Prefetch(unit); !s.ok()) return s;
  be_->JoinSideStream();  // a one-rank unit's update has no all-gather to wait for
  for (Buf& b : units_[unit]) {
    comm_->Wait(b.ticket);
    comm_->Wait(b.scale_ticket);
    b.ticket = 0;
    b.scale_ticket = 0;
    b.codes.Reset();  // the all-gather has read it (stream-ordered free)
    b.scale_codes.Reset();
    if (b.plan->wire == WireDtype::kBf16) {
      b.f32_of.clear();
      b.f32_of.resize(b.plan->tensors.size());
    }
  }
  in_flight_[unit] = false;
  return absl::OkStatus();
}

void FsdpParams::CastShardCodes(const Buf& b, uint8_t* codes) {
  int64_t at = 0;  // zeroes the gaps between tensors and the padding
  for (int i : b.fp8_ids) {
    const Slice& sl = fp8_slices_[i];
    if (sl.hi <= sl.lo) continue;
    if (sl.lo > at) be_->Memset(codes + at, 0, sl.lo - at);
    be_->CastFp8(b.master.f32() + (sl.lo - b.opt_lo), 1, sl.hi - sl.lo,
                 w_scale_.f32() + i * kScaleStride, Fp8Format::kE4M3, codes + sl.lo, nullptr,
                 nullptr);
    at = sl.hi;
  }
  if (b.plan->shard_numel > at) be_->Memset(codes + at, 0, b.plan->shard_numel - at);
}

void FsdpParams::Release(int unit) {
  for (Buf& b : units_[unit]) {
    b.full.Reset();
    b.full_scales.Reset();
    b.full_u16.Reset();
    b.f32_of.clear();
  }
}

void FsdpParams::BeginGrads(int unit, const TensorRef* written_whole) {
  for (int bi = 0; bi < static_cast<int>(units_[unit].size()); ++bi) {
    Buf& b = units_[unit][bi];
    std::vector<Slice> whole = b.grad_written_whole;
    if (written_whole != nullptr && written_whole->unit == unit && written_whole->buffer == bi) {
      whole.push_back({written_whole->offset, written_whole->offset + written_whole->numel});
    }
    std::sort(whole.begin(), whole.end(),
              [](const Slice& x, const Slice& y) { return x.lo < y.lo; });
    // Zeros everywhere else: accumulated into, or reduce-scattered as they are (gaps, padding).
    const int64_t n = b.plan->padded_numel;
    b.full_grad = DevBuf(be_, n * sizeof(float), MemoryLabel::kUnitGrads);
    int64_t at = 0;
    for (const Slice& w : whole) {
      if (w.lo > at) be_->Memset(b.full_grad.f32() + at, 0, (w.lo - at) * sizeof(float));
      at = std::max(at, w.hi);
    }
    if (n > at) be_->Memset(b.full_grad.f32() + at, 0, (n - at) * sizeof(float));
  }
}

void FsdpParams::FlushGrads() {
  FinishReplicaSums();
  std::vector<Buf*> complete;
  for (PendingReduce& p : reducing_) {
    comm_->Wait(p.ticket);
    const int64_t n = p.buf->plan->shard_numel;
    if (n > 0 && !p.part.empty()) be_->Axpy(1.0f, p.part.f32(), p.buf->grad.f32(), n);
    complete.push_back(p.buf);
  }
  reducing_.clear();  // frees the full gradients and the parts (stream-ordered)
  if (replica_ == nullptr || !final_microbatch_) return;
  for (Buf* b : complete) {
    // A failed start is returned by the next ReduceGrads or StartGradSquaredNorm (the step
    // fails; the trainer is unusable then, as after any collective error).
    if (absl::Status s = StartReplicaSum(*b); !s.ok() && replica_error_.ok()) replica_error_ = s;
  }
}

// The replica-group sum of a complete grad shard, started asynchronously (deferred wait) as the
// reduce-scatters are: an all-reduce in place (SHARD_GROUP) or a reduce-scatter into the rank's
// 1/R piece (WORLD).
absl::Status FsdpParams::StartReplicaSum(Buf& b) {
  FSDP8_CHECK(!b.replica_summed) << "grad shard summed over the replicas twice in a step";
  b.replica_summed = true;
  const int64_t n = b.plan->shard_numel;
  const double t0 = CommClock::Now();
  absl::StatusOr<int64_t> t;
  DevBuf shard;
  if (WorldOptimizer()) {
    shard = std::move(b.grad);
    b.grad = DevBuf(be_, b.opt_n * sizeof(float), MemoryLabel::kGrads);  // written below
    t = replica_->ReduceScatterSumAsync(shard.f32(), b.grad.f32(), b.opt_n);
  } else {
    t = replica_->AllReduceAsync(b.grad.f32(), n, ReduceOp::kSum);
  }
  if (absl::Status s = Timed(t.status(), t0); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("replica-group sum of a grad shard: ", s.message()));
  }
  replica_sums_.push_back(PendingReplica{&b, std::move(shard), *t});
  return absl::OkStatus();
}

void FsdpParams::FinishReplicaSums() {
  for (PendingReplica& p : replica_sums_) replica_->Wait(p.ticket);
  replica_sums_.clear();  // frees WORLD's group shards (stream-ordered)
}

absl::Status FsdpParams::ReduceGrads(int unit) {
  be_->JoinSideStream();
  // A unit never gathered since the deferral still holds the previous step's grad shards.
  if (absl::Status s = ApplyPendingUpdate(unit); !s.ok()) return s;
  FlushGrads();
  if (!replica_error_.ok()) return std::exchange(replica_error_, absl::OkStatus());
  for (Buf& b : units_[unit]) {
    const int64_t n = b.plan->shard_numel;
    if (b.plan->OneRank()) {  // the full gradient is the shard (no copy)
      if (b.grad_unset) {
        b.grad = std::move(b.full_grad);
        b.grad.Relabel(MemoryLabel::kGrads);
      } else {
        if (n > 0) be_->Axpy(1.0f, b.full_grad.f32(), b.grad.f32(), n);
        b.full_grad.Reset();
      }
      b.grad_unset = false;
      if (replica_ != nullptr && final_microbatch_) {
        if (absl::Status s = StartReplicaSum(b); !s.ok()) return s;
      }
      continue;
    }
    // The first gradient of a step lands in the grad shard itself; later ones (microbatches)
    // in a part that FlushGrads adds.
    DevBuf part;
    if (b.grad_unset) b.grad = DevBuf(be_, n * sizeof(float), MemoryLabel::kGrads);  // written below
    if (!b.grad_unset) part = DevBuf(be_, n * sizeof(float), MemoryLabel::kUnitGrads);
    float* out = b.grad_unset ? b.grad.f32() : part.f32();
    const double t0 = CommClock::Now();
    absl::StatusOr<int64_t> t = comm_->ReduceScatterSumAsync(b.full_grad.f32(), out, n);
    if (absl::Status s = Timed(t.status(), t0); !s.ok()) {
      b.full_grad.Reset();
      return absl::Status(s.code(), absl::StrCat("reduce-scatter of ", plan_.units[unit].name, "/",
                                                 WireDtypeName(b.plan->wire), " grads: ",
                                                 s.message()));
    }
    b.grad_unset = false;
    reducing_.push_back(PendingReduce{&b, std::move(b.full_grad), std::move(part), *t});
  }
  return absl::OkStatus();
}

const float* FsdpParams::W(const TensorRef& t) const {
  const Buf& b = units_[t.unit][t.buffer];
  FSDP8_CHECK(b.plan->wire != WireDtype::kFp8) << "f32 view of an fp8 buffer";
  if (b.plan->wire == WireDtype::kFp32) {
    FSDP8_CHECK(!b.full.empty() || t.numel == 0) << "unit " << t.unit << " not gathered";
    return b.full.f32() + t.offset;
  }
  FSDP8_CHECK(!b.full_u16.empty() || t.numel == 0) << "unit " << t.unit << " not gathered";
  FSDP8_CHECK(static_cast<size_t>(t.index) < b.f32_of.size()) << "unit " << t.unit << " not gathered";
  DevBuf& f = b.f32_of[t.index];
  if (f.empty() && t.numel > 0) {
    f = DevBuf(be_, t.numel * sizeof(float), MemoryLabel::kGathered);
    be_->UnpackBf16(b.full_u16.u16() + t.offset, f.f32(), t.numel);
  }
  return f.f32();
}

const uint16_t* FsdpParams::W16(const TensorRef& t) const {
  const Buf& b = units_[t.unit][t.buffer];
  FSDP8_CHECK(b.plan->wire == WireDtype::kBf16) << "bf16 view of a non-bf16 buffer";
  FSDP8_CHECK(!b.full_u16.empty() || t.numel == 0) << "unit " << t.unit << " not gathered";
  return b.full_u16.u16() + t.offset;
}

const uint8_t* FsdpParams::W8(const TensorRef& t) const {
  const Buf& b = units_[t.unit][t.buffer];
  FSDP8_CHECK(!b.full.empty() || t.numel == 0) << "unit " << t.unit << " not gathered";
  FSDP8_CHECK(b.plan->wire == WireDtype::kFp8) << "fp8 view of a non-fp8 buffer";
  return b.full.u8() + t.offset;
}

const float* FsdpParams::WScaleInv(const TensorRef& t) const {
  FSDP8_CHECK(t.fp8_id >= 0);
  return w_scale_inv_.f32() + t.fp8_id * kScaleStride;
}

const float* FsdpParams::WBlockScaleInv(const TensorRef& t) const {
  const Buf& b = units_[t.unit][t.buffer];
  FSDP8_CHECK(b.plan->Banded()) << "block scales of a buffer that is not blockwise FP8";
  FSDP8_CHECK(!b.full_scales.empty()) << "unit " << t.unit << " not gathered";
  return b.full_scales.f32() + b.plan->ScaleOffset(t.offset);
}

float* FsdpParams::G(const TensorRef& t) const {
  const Buf& b = units_[t.unit][t.buffer];
  FSDP8_CHECK(!b.full_grad.empty() || t.numel == 0) << "unit " << t.unit << " has no grad buffer";
  return b.full_grad.f32() + t.offset;
}

void FsdpParams::ZeroGrads() {
  FlushGrads();
  // The step's first reduce-scatter allocates each grad shard and writes it whole (ReduceGrads);
  // shards no gradient reached are made zero before anything reads them (MaterializeGrads).
  FinishReplicaSums();
  for (size_t u = 0; u < units_.size(); ++u) {
    // A pending update reads its unit's grad shards: they go when it has run (FreeUnitGrads).
    if (!pending_[u]) FreeUnitGrads(static_cast<int>(u));
  }
}

void FsdpParams::FreeUnitGrads(int unit) {
  for (Buf& b : units_[unit]) {
    b.grad.Reset();
    b.grad_unset = true;
    b.replica_summed = false;
  }
}

void FsdpParams::MaterializeGrads() {
  FSDP8_CHECK(!UpdatePending()) << "grad shards read while a deferred update still holds them";
  FlushGrads();
  FinishReplicaSums();
  for (auto& u : units_) {
    for (Buf& b : u) {
      if (b.grad_unset) {  // no gradient reached it on any rank: zero, summed or not
        b.grad = DevBuf::Zeros(be_, b.opt_n * sizeof(float), MemoryLabel::kGrads);
        b.replica_summed = true;
      }
      b.grad_unset = false;
      FSDP8_CHECK(replica_ == nullptr || b.replica_summed)
          << "a grad shard read before its replica-group sum (SetFinalMicrobatch unset in the "
             "step's last microbatch)";
    }
  }
}

absl::Status FsdpParams::StartGradSquaredNorm(const float* values, int64_t n) {
  be_->JoinSideStream();
  if (absl::Status s = ApplyPendingUpdates(); !s.ok()) return s;
  MaterializeGrads();
  if (!replica_error_.ok()) return std::exchange(replica_error_, absl::OkStatus());
  grad_sq_ = DevBuf::Zeros(be_, 2 * sizeof(float), MemoryLabel::kWork);
  // Each distinct gradient element counted once: SHARD_GROUP's replicas hold the same shards.
  const bool adds = WorldOptimizer() || mesh_.Replica(global_rank_) == 0;
  for (auto& u : units_) {
    for (Buf& b : u) {
      if (adds) be_->SumSquares(b.grad.f32(), b.opt_n, grad_sq_.f32());
    }
  }
  if (values != nullptr && n > 0) be_->SumSquares(values, n, grad_sq_.f32() + 1);
  const double t0 = CommClock::Now();
  absl::Status s = Timed(world_->AllReduce(grad_sq_.f32(), 2, ReduceOp::kSum), t0);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("grad-norm all-reduce: ", s.message()));
  return absl::OkStatus();
}

double FsdpParams::FinishGradSquaredNorm(double* values_squared) {
  FSDP8_CHECK(!grad_sq_.empty()) << "FinishGradSquaredNorm without StartGradSquaredNorm";
  float host[2] = {0, 0};
  be_->CopyToHost(host, grad_sq_.get(), sizeof(host));
  grad_sq_.Reset();
  if (values_squared != nullptr) *values_squared = static_cast<double>(host[1]);
  return static_cast<double>(host[0]);
}

void FsdpParams::AdamW(float lr, float beta1, float beta2, float eps, float weight_decay,
                       int64_t step, float grad_scale) {
  FSDP8_CHECK(!UpdatePending()) << "AdamW while a deferred update is pending";
  be_->JoinSideStream();
  DropPrefetches();  // their all-gathers read the bf16 wire shards written below
  MaterializeGrads();
  if (!fp8_refs_.empty()) be_->Memset(w_amax_.get(), 0, fp8_refs_.size() * sizeof(float));
  const AdamWStep s{lr, beta1, beta2, eps, weight_decay, step, grad_scale};
  for (size_t u = 0; u < units_.size(); ++u) UpdateUnit(static_cast<int>(u), s);
  adamw_outputs_ready_ = true;
}

void FsdpParams::UpdateUnit(int unit, const AdamWStep& s) const {
  // bf16 wire shards are packed by the update itself (CastWeights then skips them).
  // [lo, hi): shard elements within the optimizer piece; the piece's arrays start at opt_lo.
  auto update = [&](const Buf& b, int64_t lo, int64_t hi, float* amax) {
    if (hi <= lo) return;
    uint16_t* p16 = b.plan->wire == WireDtype::kBf16 ? b.wire.u16() + lo : nullptr;
    const int64_t i = lo - b.opt_lo;
    if (moments_ == MomentDtype::kBf16) {
      be_->AdamW(b.master.f32() + i, b.grad.f32() + i, b.m.u16() + i, b.v.u16() + i, hi - lo,
                 s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step, s.grad_scale, amax, p16);
      return;
    }
    be_->AdamW(b.master.f32() + i, b.grad.f32() + i, b.m.f32() + i, b.v.f32() + i, hi - lo,
               s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step, s.grad_scale, amax, p16);
  };
  for (const Buf& b : units_[unit]) {
    // FP8 tensors' slices record the amax of their updated weights for the casts.
    int64_t at = b.opt_lo;
    for (int i : b.fp8_ids) {
      const Slice& sl = fp8_slices_[i];
      if (sl.hi <= sl.lo) continue;
      update(b, at, sl.lo, nullptr);
      update(b, sl.lo, sl.hi, w_amax_.f32() + i);
      at = sl.hi;
    }
    update(b, at, b.opt_lo + b.opt_n, nullptr);
  }
}

void FsdpParams::DeferAdamW(const AdamWStep& s) {
  FSDP8_CHECK(CanDefer()) << "deferred AdamW under a WORLD optimizer with R > 1 or scale groups "
                             "across units";
  FSDP8_CHECK(!UpdatePending()) << "DeferAdamW while an update is pending";
  be_->JoinSideStream();
  DropPrefetches();  // issued before the update of their units
  MaterializeGrads();
  adamw_outputs_ready_ = false;
  pending_step_ = s;
  pending_.assign(units_.size(), true);
  adamw_pending_.assign(units_.size(), true);
}

bool FsdpParams::UpdatePending() const {
  return std::find(pending_.begin(), pending_.end(), true) != pending_.end();
}

void FsdpParams::RunPendingAdamW(int unit) {
  if (!adamw_pending_[unit]) return;
  adamw_pending_[unit] = false;
  const auto [lo, hi] = unit_fp8_[unit];
  if (hi > lo) be_->Memset(w_amax_.f32() + lo, 0, (hi - lo) * sizeof(float));
  UpdateUnit(unit, pending_step_);  // the amaxes stay in w_amax_ until the unit's cast
}

absl::Status FsdpParams::ApplyPendingUpdate(int unit) {
  if (!pending_[unit]) return absl::OkStatus();
  pending_[unit] = false;
  RunPendingAdamW(unit);
  absl::Status s = CastUnit(unit);
  FreeUnitGrads(unit);  // stream-ordered after the update's reads
  return s;
}

absl::Status FsdpParams::ApplyPendingUpdates() {
  be_->JoinSideStream();  // from here on the compute stream: after the side stream's updates
  for (size_t u = 0; u < units_.size(); ++u) {
    if (absl::Status s = ApplyPendingUpdate(static_cast<int>(u)); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void FsdpParams::ApplyPendingLocally() {
  be_->JoinSideStream();
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!pending_[u]) continue;
    pending_[u] = false;
    RunPendingAdamW(static_cast<int>(u));  // its amaxes unused: CastWeights retakes them
    FreeUnitGrads(static_cast<int>(u));
  }
  adamw_outputs_ready_ = false;
}

absl::Status FsdpParams::CastUnit(int unit) {
  // bf16 wire shards were packed by the update; fp32 buffers send the master itself; blockwise
  // buffers are cast from their own bands (no all-reduce).
  CastBandWires(unit);
  const auto [lo, hi] = unit_fp8_[unit];
  if (hi <= lo) return absl::OkStatus();
  const int64_t n = hi - lo;
  const double t0 = CommClock::Now();
  absl::Status s = Timed(world_->AllReduce(w_amax_.f32() + lo, n, ReduceOp::kMax), t0);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("fp8 weight amax all-reduce of ",
                                               plan_.units[unit].name, ": ", s.message()));
  }
  // As CastWeights, over the unit's tensors (a scale group lies within one unit: CanDefer).
  be_->Copy(w_amax_cast_.f32() + lo, w_amax_.f32() + lo, n * sizeof(float));
  if (w_grouped_) {
    be_->GroupMax(w_amax_cast_.f32() + lo, w_group_dev_.i32() + lo, n, w_amax_.f32() + lo);
  }
  be_->Fp8ScalesFromAmax(w_amax_.f32() + lo, n, Fp8MaxValue(/*e5m2=*/false), /*margin=*/0,
                         w_scale_.f32() + lo * kScaleStride, w_scale_inv_.f32() + lo * kScaleStride,
                         kScaleStride);
  wscale_on_host_ = false;
  if (!keep_fp8_codes_) return absl::OkStatus();  // each Prefetch casts with these scales
  for (int i = lo; i < hi; ++i) {
    Buf& b = units_[fp8_refs_[i].unit][fp8_refs_[i].buffer];
    const Slice& sl = fp8_slices_[i];
    if (sl.hi <= sl.lo) continue;
    be_->CastFp8(b.master.f32() + (sl.lo - b.opt_lo), 1, sl.hi - sl.lo,
                 w_scale_.f32() + i * kScaleStride, Fp8Format::kE4M3, b.wire.u8() + sl.lo,
                 nullptr, nullptr);
  }
  return absl::OkStatus();
}

absl::Status FsdpParams::CastWeights() {
  ApplyPendingLocally();  // recast below from the updated master weights
  DropPrefetches();
  const bool from_adamw = adamw_outputs_ready_;
  adamw_outputs_ready_ = false;
  // bf16 wire shards: a plain pack of the master slice (AdamW packed them when it just ran).
  for (auto& u : units_) {
    for (Buf& b : u) {
      if (b.plan->wire == WireDtype::kBf16 && b.opt_n > 0 && !from_adamw) {
        be_->PackBf16(b.master.f32(), b.wire.u16() + b.opt_lo, b.opt_n);
      }
    }
  }
  CastBandWires(-1);
  if (fp8_refs_.empty()) return RebuildWireShards();
  // FP8: per-tensor amax of this rank's slice (taken by AdamW when it just ran), one fused
  // all-reduce(max), identical scales.
  const size_t nf = fp8_refs_.size();
  if (!from_adamw) {
    be_->Memset(w_amax_.get(), 0, nf * sizeof(float));
    for (size_t i = 0; i < nf; ++i) {
      const Buf& b = units_[fp8_refs_[i].unit][fp8_refs_[i].buffer];
      const Slice& sl = fp8_slices_[i];
      if (sl.hi <= sl.lo) continue;  // none of the tensor in this rank's piece: amax stays 0
      be_->AmaxAccumulate(b.master.f32() + (sl.lo - b.opt_lo), sl.hi - sl.lo, w_amax_.f32() + i);
    }
  }
  const double t0 = CommClock::Now();
  absl::Status s = Timed(world_->AllReduce(w_amax_.f32(), nf, ReduceOp::kMax), t0);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("fp8 weight amax all-reduce: ", s.message()));
  }
  // The scales on the device (ComputeScale's rule, margin 0): no host round trip between AdamW
  // and the casts. wscale_ follows when read (weight_scaling()), with each tensor's own amax.
  be_->Copy(w_amax_cast_.get(), w_amax_.get(), nf * sizeof(float));
  // A scale group's members take its maximum amax, hence one scale. Should that maximum be
  // unusable, each member keeps its previous scale, which may then differ (scales restored from a
  // run without the group): harmless, as amax 0 means all-zero codes and a non-finite weight has
  // broken training already.
  if (w_grouped_) {
    be_->GroupMax(w_amax_cast_.f32(), w_group_dev_.i32(), static_cast<int64_t>(nf),
                  w_amax_.f32());
  }
  be_->Fp8ScalesFromAmax(w_amax_.f32(), static_cast<int64_t>(nf), Fp8MaxValue(/*e5m2=*/false),
                         /*margin=*/0, w_scale_.f32(), w_scale_inv_.f32(), kScaleStride);
  wscale_on_host_ = false;
  if (!keep_fp8_codes_) return RebuildWireShards();  // each Prefetch casts with these scales
  for (size_t i = 0; i < nf; ++i) {
    Buf& b = units_[fp8_refs_[i].unit][fp8_refs_[i].buffer];
    const Slice& sl = fp8_slices_[i];
    if (sl.hi <= sl.lo) continue;
    be_->CastFp8(b.master.f32() + (sl.lo - b.opt_lo), 1, sl.hi - sl.lo,
                 w_scale_.f32() + i * kScaleStride, Fp8Format::kE4M3, b.wire.u8() + sl.lo,
                 nullptr, nullptr);
  }
  return RebuildWireShards();
}

absl::Status FsdpParams::RebuildWireShards() {
  if (!WorldOptimizer()) return absl::OkStatus();
  for (auto& u : units_) {
    for (Buf& b : u) {
      if (b.opt_n == 0) continue;
      const size_t eb = b.plan->wire == WireDtype::kFp8 ? 1 : b.plan->wire == WireDtype::kBf16 ? 2 : 4;
      const double t0 = CommClock::Now();
      absl::Status s;
      if (b.plan->wire == WireDtype::kFp32) {
        s = replica_->AllGather(b.master.get(), b.wire.get(), b.opt_n * eb);
      } else {
        // The own piece is copied out first: an all-gather's send may not alias its receive.
        DevBuf piece(be_, b.opt_n * eb, MemoryLabel::kWork);
        be_->Copy(piece.get(), static_cast<uint8_t*>(b.wire.get()) + b.opt_lo * eb, b.opt_n * eb);
        s = replica_->AllGather(piece.get(), b.wire.get(), b.opt_n * eb);
      }
      if (s.ok() && b.plan->Banded()) {  // and the block scales of the bands
        const int64_t so = b.plan->ScaleOffset(b.opt_lo), sn = b.plan->ScaleOffset(b.opt_n);
        DevBuf piece(be_, sn * sizeof(float), MemoryLabel::kWork);
        be_->Copy(piece.get(), b.wire_scales.f32() + so, sn * sizeof(float));
        s = replica_->AllGather(piece.get(), b.wire_scales.get(), sn * sizeof(float));
      }
      if (absl::Status r = Timed(s, t0); !r.ok()) {
        return absl::Status(r.code(), absl::StrCat("wire shard all-gather over the replicas: ",
                                                   r.message()));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status FsdpParams::SetWeightScaleGroup(const std::vector<TensorRef>& members) {
  if (members.size() < 2) return absl::InvalidArgumentError("a weight scale group needs two or more tensors");
  for (const TensorRef& r : members) {
    if (r.fp8_id < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weight scale group: tensor at unit ", r.unit, " offset ", r.offset, " is not FP8"));
    }
    if (w_group_[r.fp8_id] != r.fp8_id) {
      return absl::InvalidArgumentError(absl::StrCat("weight scale group: ",
                                                     wscale_[r.fp8_id].tensor, " is already grouped"));
    }
  }
  const int32_t g = members.front().fp8_id;
  for (const TensorRef& r : members) {
    w_group_[r.fp8_id] = g;
    cross_unit_groups_ = cross_unit_groups_ || r.unit != members.front().unit;
  }
  w_grouped_ = true;
  w_group_dev_ = DevBuf(be_, w_group_.size() * sizeof(int32_t), MemoryLabel::kScaling);
  be_->CopyToDevice(w_group_dev_.get(), w_group_.data(), w_group_.size() * sizeof(int32_t));
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, std::vector<float>>> FsdpParams::GatherAll(bool grads) {
  if (grads && UpdatePending()) {
    // Applying the updates frees the grad shards they read: the gradients are gone.
    return absl::FailedPreconditionError(
        "GatherAll(grads): a deferred optimizer update is pending (training.overlap_optimizer); "
        "its AdamW consumes the gradients, which are no longer available");
  }
  if (absl::Status s = ApplyPendingUpdates(); !s.ok()) return s;  // joins the side stream
  if (grads) {
    MaterializeGrads();
  } else {
    FlushGrads();
  }
  std::map<std::string, std::vector<float>> out;
  // Under WORLD every rank holds a piece: gathered over the world in rank order, each placed at
  // its optimizer index.
  Communicator* over = WorldOptimizer() ? world_ : comm_;
  for (auto& u : units_) {
    for (Buf& b : u) {
      const BufferPlan& bp = *b.plan;
      DevBuf full(be_, bp.padded_numel * sizeof(float), MemoryLabel::kWork);
      const DevBuf& src = grads ? b.grad : b.master;
      const double t0 = CommClock::Now();
      absl::Status s = Timed(over->AllGather(src.get(), full.get(), b.opt_n * sizeof(float)), t0);
      if (!s.ok()) return s;
      std::vector<float> host(bp.padded_numel);
      if (bp.padded_numel > 0) be_->CopyToHost(host.data(), full.get(), host.size() * sizeof(float));
      if (WorldOptimizer()) {
        std::vector<float> ordered(host.size());
        for (int r = 0; r < mesh_.world_size(); ++r) {
          std::copy_n(host.begin() + r * b.opt_n, b.opt_n,
                      ordered.begin() + mesh_.OptimizerIndex(r) * b.opt_n);
        }
        host.swap(ordered);
      }
      for (size_t t = 0; t < bp.tensors.size(); ++t) {
        out[bp.tensors[t].name] = std::vector<float>(
            host.begin() + bp.offsets[t], host.begin() + bp.offsets[t] + bp.tensors[t].numel);
      }
    }
  }
  return out;
}

bool FsdpParams::SetMasterElement(const std::string& hf_name, int64_t index, float value) {
  const TensorRef r = Ref(hf_name);
  FSDP8_CHECK(index >= 0 && index < r.numel);
  Buf& b = units_[r.unit][r.buffer];
  const int64_t g = r.offset + index;
  const int64_t begin = b.plan->ShardBegin(rank_) + b.opt_lo;
  if (g < begin || g >= begin + b.opt_n) return false;
  ApplyPendingLocally();
  DropPrefetches();  // an fp32 buffer's all-gather reads the master shard
  adamw_outputs_ready_ = false;
  be_->CopyToDevice(b.master.f32() + (g - begin), &value, sizeof(float));
  return true;
}

const DevBuf& FsdpParams::Array(int unit, int buffer, ShardArray which) const {
  FSDP8_CHECK(unit >= 0 && unit < static_cast<int>(units_.size()));
  FSDP8_CHECK(buffer >= 0 && buffer < static_cast<int>(units_[unit].size()));
  const Buf& b = units_[unit][buffer];
  switch (which) {
    case ShardArray::kMaster: return b.master;
    case ShardArray::kAdamM: return b.m;
    case ShardArray::kAdamV: return b.v;
  }
  FSDP8_CHECK(false) << "bad ShardArray";
  return b.master;
}

size_t FsdpParams::ElementBytes(ShardArray which) const {
  const bool moment = which == ShardArray::kAdamM || which == ShardArray::kAdamV;
  return moment && moments_ == MomentDtype::kBf16 ? sizeof(uint16_t) : sizeof(float);
}

void FsdpParams::DownloadShard(int unit, int buffer, ShardArray which, float* host) {
  be_->JoinSideStream();
  for (size_t u = 0; u < units_.size(); ++u) RunPendingAdamW(static_cast<int>(u));
  const int64_t n = units_[unit][buffer].opt_n;
  if (n <= 0) return;
  if (ElementBytes(which) == sizeof(float)) {
    be_->CopyToHost(host, Array(unit, buffer, which).get(), n * sizeof(float));
    return;
  }
  std::vector<uint16_t> bits(n);
  be_->CopyToHost(bits.data(), Array(unit, buffer, which).get(), n * sizeof(uint16_t));
  for (int64_t i = 0; i < n; ++i) host[i] = Bf16Value(bits[i]);
}

void FsdpParams::ZeroShard(int unit, int buffer, ShardArray which) {
  const int64_t n = units_[unit][buffer].opt_n;
  ApplyPendingLocally();
  DropPrefetches();  // an fp32 buffer's all-gather reads the master shard
  adamw_outputs_ready_ = false;
  if (n > 0) be_->Memset(Array(unit, buffer, which).get(), 0, n * ElementBytes(which));
}

void FsdpParams::UploadShardRange(int unit, int buffer, ShardArray which, int64_t offset,
                                  const float* host, int64_t n) {
  const int64_t shard = units_[unit][buffer].opt_n;
  FSDP8_CHECK(offset >= 0 && n >= 0 && offset + n <= shard)
      << "shard range [" << offset << ", " << offset + n << ") of " << shard;
  ApplyPendingLocally();
  DropPrefetches();  // an fp32 buffer's all-gather reads the master shard
  adamw_outputs_ready_ = false;
  if (n <= 0) return;
  const DevBuf& a = Array(unit, buffer, which);
  if (ElementBytes(which) == sizeof(float)) {
    be_->CopyToDevice(a.f32() + offset, host, n * sizeof(float));
    return;
  }
  std::vector<uint16_t> bits(n);
  for (int64_t i = 0; i < n; ++i) bits[i] = Bf16Bits(host[i]);
  be_->CopyToDevice(a.u16() + offset, bits.data(), n * sizeof(uint16_t));
}

const std::vector<WeightScaling>& FsdpParams::weight_scaling() const {
  be_->JoinSideStream();  // the side stream's casts write the scales
  if (!wscale_on_host_ && !wscale_.empty()) {
    const size_t nf = wscale_.size();
    std::vector<float> amax(nf), scale(nf * kScaleStride), scale_inv(nf * kScaleStride);
    be_->CopyToHost(amax.data(), w_amax_cast_.get(), nf * sizeof(float));
    be_->CopyToHost(scale.data(), w_scale_.get(), scale.size() * sizeof(float));
    be_->CopyToHost(scale_inv.data(), w_scale_inv_.get(), scale_inv.size() * sizeof(float));
    for (size_t i = 0; i < nf; ++i) {
      wscale_[i].amax = amax[i];
      wscale_[i].scale = scale[i * kScaleStride];
      wscale_[i].scale_inv = scale_inv[i * kScaleStride];
    }
  }
  wscale_on_host_ = true;
  return wscale_;
}

void FsdpParams::RestoreWeightScaling(const std::vector<WeightScaling>& ws) {
  (void)weight_scaling();  // host copy current: the values restored below are the state from now on
  FSDP8_CHECK(ws.size() == wscale_.size()) << ws.size() << " weight scales for " << wscale_.size();
  std::vector<float> scale(ws.size()), scale_inv(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    FSDP8_CHECK(ws[i].name == wscale_[i].name) << ws[i].name << " vs " << wscale_[i].name;
    wscale_[i].scale = ws[i].scale;
    wscale_[i].scale_inv = ws[i].scale_inv;
    wscale_[i].amax = ws[i].amax;
    scale[i] = ws[i].scale;
    scale_inv[i] = ws[i].scale_inv;
  }
  if (!ws.empty()) {
    UploadScaleSlots(be_, w_scale_.f32(), scale);
    UploadScaleSlots(be_, w_scale_inv_.f32(), scale_inv);
  }
}

}  // namespace fsdp8
