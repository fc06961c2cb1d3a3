#include "common/memory_plan.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_dims.h"
#include "common/spec.h"

namespace fsdp8 {

int64_t OptimizerStateBytesPerElement(const v1::JobSpec& spec) {
  return AdamStateBytesPerElement(spec);  // AdamW m and v in optimizer.state_precision
}

namespace {

enum Term {
  kParams, kGrads, kOptimizer, kScaling, kGathered, kUnitGrads, kSaved, kWork, kLogits, kBatch,
  kNumTerms
};
// The terms are the memory labels (common/memory_label.h) but "unlabelled", in their order.
static_assert(kNumTerms == static_cast<int>(MemoryLabel::kUnlabelled) &&
              kSaved == static_cast<int>(MemoryLabel::kSaved));

// Byte counts in double: exact below 2^53 bytes, and no overflow for absurd sizes (PlanMemory
// saturates them when it reports).
using Bytes = std::array<double, kNumTerms>;

// The table's bytes; after_mlp: less the saved tensors the MLP's backward has dropped.
double Sum(const std::vector<PlannedTensor>& table, bool after_mlp = false) {
  double s = 0;
  for (const PlannedTensor& t : table) {
    if (!after_mlp || t.lifetime != Lifetime::kMlpBackward) s += static_cast<double>(t.bytes);
  }
  return s;
}

// The largest moment of a phase and its terms.
struct PhasePeak {
  double bytes = 0;
  Bytes terms{};
  void Take(const Bytes& at) {  // the first moment at the largest total, as the backend's account
    if (const double total = std::accumulate(at.begin(), at.end(), 0.0); total > bytes) {
      bytes = total;
      terms = at;
    }
  }
};

// Models with more blocks are planned by extrapolation (PlanMemory).
constexpr int kMaxWalkLayers = 1024;

int64_t Saturate(double b) { return b < 9.2e18 ? std::llround(b) : kBytesExceeded; }

// Per unit (the step plan's, in its order): what FsdpParams (train/fsdp.cc) holds of it. O: the
// optimizer piece, S / R under WORLD optimizer sharding with R > 1, else S.
struct UnitBytes {
  double shard = 0;       // master O*4 plus the wire shard (fp8: S with kept codes, bf16: S*2,
                          // fp32 under WORLD: S*4)
  double grad = 0;        // the gradient shard, S*4
  double piece = 0;       // the gradient's piece after its replica sum (WORLD), O*4
  double optimizer = 0;   // O * OptimizerStateBytesPerElement
  double full = 0;        // gathered: P x wire bytes (one rank: a view; cast codes without kept
                          // weight codes)
  double codes = 0;       // a prefetch's cast FP8 slice (no kept codes), until gathered
  double f32 = 0;         // the f32 copies of its bf16 tensors read in f32 (FsdpParams::W)
  double full_grad = 0;   // the full f32 gradient in backward, P*4
};

// Sums over the step plan's tables at each moment of one rank's step where the peak can fall:
// each block's forward, the head, each block's backward (first and later microbatches) and the
// optimizer (with the next step's first units prefetched).
class StepSum {
 public:
  StepSum(const v1::JobSpec& spec, const StepPlan& plan, int64_t opt_bytes);
  void Run(PhasePeak* fwd, PhasePeak* bwd, PhasePeak* opt) const;

 private:
  int BlockUnit(int l) const { return 1 + l; }  // the head is unit 1 + L
  double Gathered(int u) const { return units_[u].full + units_[u].f32; }
  double Prefetched(int u) const { return units_[u].full + units_[u].codes; }
  // The backends' own workspaces, held for the job: the CPU backends' scratch slots
  // (CpuRefBackend::Scratch: the GEMMs' decoded operands, the attention's two T x T f32
  // matrices, the RoPE tables); on CUDA the cuBLASLt workspace, the RoPE table and the f32
  // attention backward's delta slot (B, H, T) grown by a quarter (CudaBackend::Scratch).
  double BackendWorkspace() const;
  // kGrads while unit u computes its backward (the units after it reduced): in the last
  // microbatch under WORLD a unit's shard becomes its piece once its replica sum is waited for;
  // the one d units back has both (its sum in flight: d = 2 behind a reduce-scatter in flight,
  // 1 on one rank).
  double GradsAt(int u, bool later, bool last) const;
  // training.overlap_optimizer: the previous step's grad shards of units `first` on, kept for
  // their deferred updates (FsdpParams::DeferAdamW) until the units are prefetched; else 0.
  double PendingGrads(int first) const;

  const StepPlan& plan_;
  const ModelDims d_;
  const double C_, H_, D_, T_, B_, N_, nq_, nk_, F_, local_tokens_;
  const int L_;
  const bool cuda_, tied_, attn16_;
  Bytes fixed_{};  // shards, optimizer state, scaling state, backend workspaces, batch
  std::vector<UnitBytes> units_;
  double all_grads_ = 0, all_pieces_ = 0;
  bool pieces_ = false;  // WORLD optimizer sharding, R > 1
  bool defer_ = false;   // the optimizer deferred into the next forward (Mesh::DefersOptimizer)
  double rebuild_ = 0;   // WORLD: the largest fp8/bf16 wire piece copied out for its all-gather
};

StepSum::StepSum(const v1::JobSpec& spec, const StepPlan& plan, int64_t opt_bytes)
    : plan_(plan), d_(ModelDimsOf(spec.model())), C_(d_.d_model), H_(d_.n_heads),
      D_(d_.head_dim), T_(d_.seq_len), B_(spec.training().microbatch()),
      N_(static_cast<double>(plan.tokens)), nq_(d_.q_width()), nk_(d_.kv_width()), F_(d_.ffn_dim),
      local_tokens_(static_cast<double>(spec.training().global_batch()) / plan.world_size * T_),
      L_(static_cast<int>(plan.blocks.size())), cuda_(spec.backend() == "cuda"),
      tied_(spec.model().tie_word_embeddings()),
      attn16_(spec.precision().attention() == v1::PRECISION_BF16) {
  const bool keep_codes = spec.precision().fp8().keep_weight_codes();
  pieces_ = plan.mesh.optimizer_over_world && plan.mesh.replicas > 1;
  defer_ = plan.mesh.DefersOptimizer(spec.training().overlap_optimizer());
  int fp8_tensors = 0;
  bool grouped = false;
  for (const BlockPlan& b : plan.blocks) {
    // Tensorwise FP8 linears only: rowwise / blockwise ones keep no scaling state.
    fp8_tensors += b.linears == v1::PRECISION_FP8 &&
                           b.granularity == v1::FP8_GRANULARITY_TENSORWISE
                       ? 7
                       : 0;
    grouped = grouped || b.group_qkv || b.group_mlp;
  }
  for (size_t u = 0; u < plan.units.size(); ++u) {
    // Elements read in f32 per bf16 buffer: the embedding table; a block's norms (and its
    // linears in a BF16 block); the final norm (and the weight of an f32 head).
    const double VC = static_cast<double>(d_.vocab_size) * C_;
    double f32_numel = VC;
    if (u + 1 == plan.units.size()) {
      f32_numel = plan.head_bf16 ? C_ : C_ + VC;
    } else if (u > 0) {
      f32_numel = 2 * C_;
      // f32 copies of the linears of a BF16 or rowwise block (a blockwise block's travel as FP8).
      if (plan.blocks[u - 1].linears == v1::PRECISION_BF16 ||
          plan.blocks[u - 1].granularity == v1::FP8_GRANULARITY_ROWWISE) {
        f32_numel += 2 * C_ * C_ + 2 * nk_ * C_ + 3 * F_ * C_;
      }
    }
    UnitBytes& ub = units_.emplace_back();
    for (const PlannedBuffer& b : plan.units[u].buffers) {
      const double S = static_cast<double>(b.shard), P = static_cast<double>(b.padded);
      const bool fp8 = b.wire == WireDtype::kFp8, bf16 = b.wire == WireDtype::kBf16;
      const double wire = fp8 ? 1 : bf16 ? 2 : 4, O = pieces_ ? S / plan.mesh.replicas : S;
      ub.shard += O * 4 + (fp8 ? (keep_codes ? S : 0) : bf16 ? S * 2 : pieces_ ? S * 4 : 0);
      ub.grad += S * 4;
      ub.piece += O * 4;
      ub.optimizer += O * static_cast<double>(opt_bytes);
      if (pieces_ && (fp8 || bf16)) rebuild_ = std::max(rebuild_, O * wire);
      ub.full += S == P ? (fp8 && !keep_codes ? S : 0) : P * wire;
      ub.codes += fp8 && !keep_codes && S != P ? S : 0;
      ub.f32 += bf16 ? f32_numel * 4 : 0;
      ub.full_grad += P * 4;
      // A blockwise FP8 wire buffer's block scales go as its codes do (FsdpParams::
      // IssueBandGather): kept with the shard, gathered beside the codes.
      const double Ss = static_cast<double>(b.shard_scales) * 4,
                   Ps = static_cast<double>(b.padded_scales) * 4;
      if (Ss > 0) {
        ub.shard += keep_codes ? Ss : 0;
        if (pieces_) rebuild_ = std::max(rebuild_, Ss / plan.mesh.replicas);
        ub.full += S == P ? (!keep_codes ? Ss : 0) : Ps;
        ub.codes += !keep_codes && S != P ? Ss : 0;
      }
    }
    fixed_[kParams] += ub.shard;
    fixed_[kOptimizer] += ub.optimizer;
    all_grads_ += ub.grad;
    all_pieces_ += ub.piece;
  }
  // Weight scales (40 bytes per FP8 weight: scale and scale_inv slots of 16, two amaxes), the
  // shared groups' table, activation and grad-output scales (36 each), a temporary amax.
  const double nw = std::max(fp8_tensors, 1), na = std::max(2 * fp8_tensors, 1);
  fixed_[kScaling] = nw * 40 + (grouped ? nw * 4 : 0) + na * 36 + 4;
  fixed_[kWork] = BackendWorkspace();
  // Trainer::RunBatch: token ids and targets of a microbatch, the step's per-token losses.
  fixed_[kBatch] = N_ * 4 * 2 + local_tokens_ * 4;
}

double StepSum::BackendWorkspace() const {
  if (cuda_) {
    return static_cast<double>(kCudaGemmWorkspaceBytes) + T_ * D_ * 4 +
           (attn16_ ? 0 : B_ * H_ * T_ * 4 * 1.25);
  }
  // A linear of `in` inputs and `out` outputs over N tokens takes N * max(in, out) f32 in slot
  // 0 and max(in * out, N * in) in slot 1 (FP8 and BF16 linears; f32 GEMMs read in place).
  double s0 = 0, s1 = 0;
  for (const BlockPlan& b : plan_.blocks) {
    if (b.linears == v1::PRECISION_FP32) continue;
    // Rowwise / blockwise linears: the fast backend's GEMM takes the same slots (the scaled
    // decoded operands); the reference's host composition none.
    if (b.granularity != v1::FP8_GRANULARITY_TENSORWISE && plan_.cpu_reference) continue;
    std::vector<std::pair<double, double>> shapes = {{nq_, C_}, {C_, b.fused_mlp ? 2 * F_ : F_},
                                                     {F_, C_}, {C_, nq_ + 2 * nk_}};
    if (!b.fused_qkv) {  // separate q, k and v GEMMs
      shapes.back() = {C_, nq_};
      shapes.push_back({C_, nk_});
    }
    for (auto [in, out] : shapes) {
      s0 = std::max(s0, N_ * std::max(in, out));
      s1 = std::max(s1, std::max(in * out, N_ * in));
    }
  }
  return (s0 + s1 + 2 * T_ * T_ + T_ * D_) * 4;
}

double StepSum::GradsAt(int u, bool later, bool last) const {
  const int d = plan_.mesh.shard_size > 1 ? 2 : 1;
  double g = 0;
  for (int x = 0; x < static_cast<int>(units_.size()); ++x) {
    const UnitBytes& b = units_[x];
    if (x <= u) g += later ? b.grad : 0;
    if (x > u) g += !(last && pieces_) || x < u + d ? b.grad : b.piece + (x == u + d ? b.grad : 0);
  }
  return g;
}

double StepSum::PendingGrads(int first) const {
  double g = 0;
  for (int x = std::max(first, 0); defer_ && x < static_cast<int>(units_.size()); ++x) {
    g += units_[x].grad;
  }
  return g;
}

void StepSum::Run(PhasePeak* fwd, PhasePeak* bwd, PhasePeak* opt) const {
  const int head = 1 + L_;
  std::vector<double> saved_before(L_ + 1, 0);  // saved activations of blocks < l
  for (int l = 0; l < L_; ++l) saved_before[l + 1] = saved_before[l] + Sum(plan_.blocks[l].saved);
  // Microbatch 0 starts with no gradient shard; later ones hold them all (repeating the second);
  // the last one sums the shards over the replicas (WORLD: a third walk when it is not the second).
  const int M = plan_.microbatches;
  std::vector<std::pair<bool, bool>> walks = {{false, M == 1}};  // later, last
  if (M >= 2) walks.push_back({true, true});
  if (M >= 3 && pieces_) walks.push_back({true, false});
  const double residual = N_ * C_ * 4;  // the forward's residual stream x (LlamaModel::Run)
  {
    // The step's start, before ZeroGrads and the batch: the previous step's grad shards (all of
    // them in the serial order, the pending ones under a deferred optimizer) and its end's
    // prefetches. The peak of a model whose shards outweigh its activations.
    Bytes at = fixed_;
    at[kBatch] = 0;
    at[kGrads] = defer_ ? PendingGrads(2) : pieces_ ? all_pieces_ : all_grads_;
    at[kGathered] = Prefetched(0) + (L_ > 0 ? Prefetched(1) : 0);
    fwd->Take(at);
  }
  for (auto [later, last] : walks) {
    // Microbatch 0 under a deferred optimizer: the units from 2 on still hold the previous
    // step's grad shards (units 0 and 1 were updated by the prefetch that ended it); each goes
    // when its unit is prefetched, one block ahead, after its update.
    if (!later && defer_) {
      // The embedding's forward: its table read in f32 (bf16 wire), the residual.
      Bytes at = fixed_;
      at[kGrads] = PendingGrads(2);
      at[kGathered] = Gathered(0) + Prefetched(1);
      at[kWork] += residual;
      fwd->Take(at);
    }
    for (int l = 0; l < L_; ++l) {  // block l's forward
      const BlockPlan& b = plan_.blocks[l];
      if (!later && defer_) {
        // The update of the unit after it (prefetched as block l starts), before its grad
        // shards go: block l's unit gathered, the activations saved so far, the residual.
        Bytes at = fixed_;
        at[kGrads] = PendingGrads(BlockUnit(l) + 1);
        at[kGathered] = units_[BlockUnit(l)].full;
        at[kSaved] = saved_before[l];
        at[kWork] += residual;
        fwd->Take(at);
      }
      Bytes at = fixed_;  // at its largest moment (BlockPlan::forward_peak)
      at[kGrads] = later ? all_grads_ : PendingGrads(BlockUnit(l) + 2);
      at[kGathered] = units_[BlockUnit(l)].full + Sum(b.forward_peak.gathered) +
                      Prefetched(BlockUnit(l) + 1);
      // Under recompute the block's kept input copy; else what it has kept by then.
      at[kSaved] = saved_before[l] + Sum(plan_.recompute ? b.saved : b.forward_peak.saved);
      at[kWork] += Sum(b.forward_work);
      fwd->Take(at);
    }
    {  // the head's forward (a BF16 head's backward too: it computes both per chunk)
      Bytes at = fixed_;
      at[kGrads] = later ? all_grads_ : 0;
      // A tied BF16 head reads the embedding's bf16 codes (no f32 copy).
      at[kGathered] = Gathered(head) +
                      (tied_ ? units_[0].full + (plan_.head_bf16 ? 0 : units_[0].f32) : 0) +
                      (L_ > 0 ? Prefetched(BlockUnit(L_ - 1)) : 0);
      const double unit_grads = units_[head].full_grad + (tied_ ? units_[0].full_grad : 0);
      const double nc = N_ * C_ * 4;  // dnf, dx
      at[kUnitGrads] = plan_.head_bf16 ? unit_grads : 0;
      at[kSaved] = saved_before[L_];
      at[kWork] += Sum(plan_.head_work) - (plan_.head_bf16 ? 0 : nc);
      at[kLogits] = Sum(plan_.head_logits);
      fwd->Take(at);
      // The backward opens at the head: an f32 head's backward (with its logits), then dx
      // (LlamaModel::Run) with the head's x, nf, rstdf and dnf.
      at[kUnitGrads] = unit_grads;
      if (!plan_.head_bf16) {
        at[kWork] += nc;
        bwd->Take(at);
      }
      at[kLogits] = 0;
      at[kWork] = fixed_[kWork] + 3 * nc + N_ * 4 + nc;
      bwd->Take(at);
    }
    for (int l = L_ - 1; l >= 0; --l) {  // block l's backward: its MLP's, then its attention's
      const BlockPlan& b = plan_.blocks[l];
      const int u = BlockUnit(l);
      Bytes at = fixed_;
      at[kGrads] = GradsAt(u, later, last);
      at[kGathered] = units_[u].full + (l > 0 ? Prefetched(u - 1) : 0);
      // The previous unit's full gradient while its reduce-scatter is in flight, and a tied
      // embedding's (from the head until the embedding's backward); its own from BeginGrads,
      // after a recompute.
      at[kUnitGrads] = tied_ ? units_[0].full_grad : 0;
      if (plan_.mesh.shard_size > 1) {
        at[kUnitGrads] += units_[u + 1].full_grad + (later ? units_[u + 1].grad : 0);
      }
      at[kSaved] = saved_before[l];
      at[kWork] += Sum(plan_.backward_held);
      auto take = [&](const PlannedMoment& m, double own_grads) {
        Bytes x = at;
        x[kUnitGrads] += own_grads;
        x[kSaved] += Sum(m.saved);
        x[kWork] += Sum(m.work);
        x[kGathered] += Sum(m.gathered);
        bwd->Take(x);
      };
      if (plan_.recompute) take(b.recompute_peak, 0);
      take(b.backward_peak, units_[u].full_grad);
    }
    Bytes at = fixed_;  // the embedding's backward: its full gradient
    at[kGrads] = GradsAt(0, later, last);
    at[kUnitGrads] = units_[0].full_grad;
    if (plan_.mesh.shard_size > 1 && L_ > 0) {
      at[kUnitGrads] += units_[1].full_grad + (later ? units_[1].grad : 0);
    }
    at[kWork] += Sum(plan_.backward_held) + Sum(plan_.embedding_backward);
    bwd->Take(at);
    if (last && pieces_ && plan_.mesh.shard_size > 1) {  // the embedding's replica sum (WORLD)
      Bytes tail = fixed_;
      tail[kGrads] = all_pieces_ + units_[0].grad;
      bwd->Take(tail);
    }
  }
  // The optimizer (the batch is gone): first with the grad norm's two f32 sums
  // (FsdpParams::StartGradSquaredNorm), then with the next step's first units prefetched.
  // WORLD: the gradients are pieces; the wire shards' rebuild copies one piece out at a time.
  Bytes at = fixed_;
  at[kBatch] = 0;
  at[kGrads] = pieces_ ? all_pieces_ : all_grads_;
  for (double work : {8.0, rebuild_}) {
    at[kWork] += work;
    if (work > 0) opt->Take(at);
    at[kWork] -= work;
  }
  if (defer_) {
    // The prefetch of the next step's first units runs their deferred updates first, each
    // freeing its grad shards before its all-gather's buffers come.
    at[kGrads] = PendingGrads(1);
    at[kGathered] = Prefetched(0);
    opt->Take(at);
    at[kGrads] = PendingGrads(2);
  }
  at[kGathered] = Prefetched(0) + (L_ > 0 ? Prefetched(1) : 0);
  opt->Take(at);
}

}  // namespace

absl::StatusOr<MemoryPlan> PlanMemory(const v1::JobSpec& spec_in, int world_size,
                                      const MemoryPlanOptions& options) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: must be >= 1 (got ", world_size, ")"));
  }
  if (absl::Status s = CheckDefaulted(spec_in, world_size); !s.ok()) return s;
  const v1::JobSpec& spec = spec_in;
  const v1::ModelConfig& m = spec.model();
  if (m.d_model() <= 0 || m.n_layers() <= 0 || m.n_heads() <= 0 || m.n_kv_heads() <= 0 ||
      m.ffn_dim() <= 0 || m.vocab_size() <= 0 || m.seq_len() <= 0 ||
      m.d_model() % m.n_heads() != 0 || spec.training().microbatch() <= 0 ||
      spec.sharding().alignment() < 1) {
    return absl::InvalidArgumentError(
        "memory plan: model sizes, microbatch and alignment must be > 0 and d_model divisible by "
        "n_heads (validate the spec first)");
  }
  // The step plan of `s` (at most kMaxWalkLayers blocks), summed.
  auto sum = [&](const v1::JobSpec& s, PhasePeak* f, PhasePeak* b, PhasePeak* o) {
    absl::StatusOr<StepPlan> plan =
        MakeStepPlan(s, world_size, BackendCapsOf(s.backend()), options);  // cpu_reference: options
    if (!plan.ok()) return plan.status();
    StepSum(s, *plan, OptimizerStateBytesPerElement(s)).Run(f, b, o);
    return absl::OkStatus();
  };
  PhasePeak fwd, bwd, opt;
  if (m.n_layers() <= kMaxWalkLayers) {
    if (absl::Status st = sum(spec, &fwd, &bwd, &opt); !st.ok()) return st;
  } else {
    // Beyond kMaxWalkLayers blocks every figure grows linearly with the blocks (shards, saved
    // activations; the transients are one block's): sums of K / 2 and K blocks, extrapolated.
    std::array<PhasePeak, 3> a, b;
    for (auto [n, out] : {std::pair{kMaxWalkLayers / 2, &a}, std::pair{kMaxWalkLayers, &b}}) {
      v1::JobSpec s = spec;
      s.mutable_model()->set_n_layers(n);
      if (absl::Status st = sum(s, &(*out)[0], &(*out)[1], &(*out)[2]); !st.ok()) return st;
    }
    const double f = (static_cast<double>(m.n_layers()) - kMaxWalkLayers) / (kMaxWalkLayers / 2);
    for (auto [x, y, out] : {std::tuple{&a[0], &b[0], &fwd}, std::tuple{&a[1], &b[1], &bwd},
                             std::tuple{&a[2], &b[2], &opt}}) {
      out->bytes = y->bytes + (y->bytes - x->bytes) * f;
      for (int t = 0; t < kNumTerms; ++t) {
        out->terms[t] = y->terms[t] + (y->terms[t] - x->terms[t]) * f;
      }
    }
  }
  MemoryPlan p;
  p.backend = spec.backend();
  p.world_size = world_size;
  p.forward_peak_bytes = Saturate(fwd.bytes);
  p.backward_peak_bytes = Saturate(bwd.bytes);
  p.optimizer_peak_bytes = Saturate(opt.bytes);
  const PhasePeak* top = nullptr;  // the first phase at the largest peak
  for (auto [name, ph] : {std::pair{"forward", &fwd}, {"backward", &bwd}, {"optimizer", &opt}}) {
    if (top == nullptr || ph->bytes > top->bytes) {
      top = ph;
      p.peak_phase = name;
    }
  }
  p.peak_bytes = Saturate(top->bytes);
  for (int t = 0; t < kNumTerms; ++t) {
    p.terms.push_back({kMemoryLabelNames[t], Saturate(top->terms[t])});
    p.forward_terms.push_back({kMemoryLabelNames[t], Saturate(fwd.terms[t])});
    p.backward_terms.push_back({kMemoryLabelNames[t], Saturate(bwd.terms[t])});
    p.optimizer_terms.push_back({kMemoryLabelNames[t], Saturate(opt.terms[t])});
  }
  double device = top->bytes;
  if (p.backend == "cuda") {
    p.device_extra.push_back({"CUDA context", kCudaContextBytes});
    if (world_size > 1) p.device_extra.push_back({"NCCL buffers", kNcclBufferBytes});
    p.device_extra.push_back({"allocator rounding", Saturate(top->bytes * kPoolOverheadFraction)});
    for (const MemoryTerm& t : p.device_extra) device += static_cast<double>(t.bytes);
  }
  p.device_bytes = Saturate(device);
  std::vector<int64_t> all = {p.device_bytes, p.peak_bytes, p.forward_peak_bytes,
                              p.backward_peak_bytes, p.optimizer_peak_bytes};
  for (const MemoryTerm& t : p.terms) all.push_back(t.bytes);
  p.exceeds_int64 = std::find(all.begin(), all.end(), kBytesExceeded) != all.end();
  return p;
}

}  // namespace fsdp8
