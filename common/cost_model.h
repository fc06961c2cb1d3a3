// The cost model: one training step's time on a rank, predicted before anything runs from rates
// measured by micro-benchmarks (a calibration file, bench/calibrate.sh), never from training runs.
//
// How: PredictStep makes the step plan (common/step_plan.h) at the mesh's shard-group size, as
// the memory plan does, and walks it the same way: per microbatch, the FSDP units in forward order
// (embedding, blocks, head), then in backward order; per block the GEMMs of its linears as the
// plan fuses them (one GEMM per fused group), its attention and its memory-bound passes; per unit
// the all-gather of its wire buffers and the reduce-scatter of its f32 gradients; then the
// optimizer on the rank's shard. Each piece's time comes from the calibration:
//   GEMM            2 M N K / rate; the rate of the GEMM's precision (fp8 / bf16 / fp32) at the
//                   nearest measured shape class (the smallest sum of |log(dim / class dim)| over
//                   M, N, K). Forward Y (N tok, out, in); backward dX (N, in, out) and dW (out,
//                   in, N).
//   attention       causal flash-attention FLOPs as bench/cuda/bench_cuda.cu counts them:
//                   forward 2 B H T^2 D, backward 2.5 x that; at the measured forward and
//                   backward rates (AttentionRates: the attention classes of the nearest head
//                   layout, interpolated in log T; the non-deterministic backward's rate for
//                   training.deterministic false where measured).
//   memory passes   bytes read + written by the passes the backend runs for the block's path
//                   (BlockPassBytes: the generic block's f32 passes, or the bf16-activation
//                   block's fused norm / SwiGLU / RoPE casts; FP8 transposes where the backend's
//                   FP8 GEMMs take one layout), the head's (HeadPassBytes) and the embedding's /
//                   the measured bandwidth of such passes (bench/cpu/ops_bench.cc --json,
//                   fsdp8-bench-cuda --calibration).
//   optimizer       AdamW: 28 bytes per shard element with f32 moments (p, g, m, v read; p, m, v
//                   written), 20 with bf16 moments, + 2 for the bf16 wire shards it packs / the
//                   measured AdamW bytes/s; plus the gradient norm's read (4 bytes per element)
//                   and the FP8 wire cast (4 read + 1 written per FP8 element) at the memory
//                   bandwidth.
//   collectives     NCCL's bus-bandwidth convention (nccl-tests doc/PERFORMANCE.md): for a
//                   message of `size` bytes (the full gathered or reduced buffer) on n ranks,
//                   time = latency + size * f / busbw(size), f = (n-1)/n for all-gather and
//                   reduce-scatter, 2(n-1)/n for all-reduce; busbw interpolated in log(size)
//                   between the measured points (clamped at both ends). The link: shard groups
//                   within one host (ranks_per_host) take the calibration's intra-host link,
//                   groups spanning hosts and replica groups the inter-host link.
// The optimizer is priced in the order training runs it: serial (after the backward) or
// deferred (StepCost::optimizer_deferred: units 2.. updated in the next forward, DeferredWindow).
// The host: backend calls bound each unit's phase from below (op_floor_s + alloc_s per call);
// synchronisations (HostSyncsPerStep x sync_s) and the worker's per-step handling
// (step_overhead_s) are serial with the device; the coordinator's cycle (step_cycle_s) bounds the
// step from below (PredictStep).
// CPU ranks share the host's cores: compute and optimizer times are multiplied by the
// calibration's shared-host slowdown at the ranks on the host (HostSlowdown: measured by N
// synchronised copies of a synthetic step, bench/cpu/ops_bench.cc --copies), or, in a calibration
// without one, by max(1, ranks on the host / cores) (the calibration measured one single-threaded
// op on a core, per CPU second: the model predicts the step on cores the ranks have to
// themselves).
//
// Overlap (Schedule): one compute stream, one collective channel per link (intra: all-gathers and
// reduce-scatters in issue order; inter: the replica reductions). FSDP's prefetch of one unit:
// the all-gather of unit u+1 is issued when the compute of u starts (forward), of u-1 when the
// backward of u starts; the first unit's all-gather is issued at the microbatch's start (exposed);
// the last forward unit (the head) stays gathered for its backward. Unit u's reduce-scatter is
// issued when its backward ends and runs while the backward of u-1 computes. Hybrid meshes: after
// the last microbatch's reduce-scatter of u, its replica all-reduce (or reduce-scatter, with the
// optimizer over the world) on the inter-host link, overlapped likewise. A unit's compute waits
// for its all-gather. Exposed communication = the forward/backward's end (the last collective's
// end or the last compute's end, whichever is later) less the compute; then the step's small
// all-reduces (amaxes, gradient norm) and, with the optimizer over the world, the replica
// all-gather of the updated wire shards, both exposed.
//
// Thread-safety: pure functions and plain values.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mesh.h"
#include "common/step_plan.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

// One measured GEMM shape class: precision "fp8" | "bf16" | "fp32", dimensions, TFLOP/s.
struct GemmClass {
  std::string precision;
  int64_t m = 0, n = 0, k = 0;
  double tflops = 0;
};

// One measured attention shape: causal, bf16 through the backend's fused attention.
struct AttentionClass {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  double forward_tflops = 0, backward_tflops = 0;  // backward: deterministic
  double backward_nondeterministic_tflops = 0;     // 0: not measured
};

enum class CollectiveOp { kAllGather = 0, kReduceScatter = 1, kAllReduce = 2 };
const char* CollectiveOpName(CollectiveOp op);  // "all_gather", "reduce_scatter", "all_reduce"

// A collective's measured (or published) bus bandwidth by message size on one link.
struct CollectiveCurve {
  std::string link;   // "shm", "gloo", "nvlink4", "ib400", ...
  CollectiveOp op = CollectiveOp::kAllGather;
  int ranks = 0;      // the ranks it was measured on; 0: any
  double latency_s = 0;
  std::vector<std::pair<double, double>> busbw;  // (message bytes, GB/s), ascending bytes
};

struct Calibration {
  std::string backend;      // "cpu" | "cuda"
  std::string device;       // free text: the CPU model or GPU name
  std::string source;       // how it was made (the command, the date, citations)
  int cores = 0;            // CPU: the host's cores the ranks share (0: one device per rank)
  int ranks_per_host = 0;   // ranks one host holds (0: every rank on one host)
  std::string intra_link, inter_link;  // link names of CollectiveCurve
  std::vector<GemmClass> gemm;
  double attention_forward_tflops = 0, attention_backward_tflops = 0;
  double attention_backward_nondeterministic_tflops = 0;  // 0: not measured (the backward's)
  std::vector<AttentionClass> attention_classes;           // optional, finer than the above
  double memory_gbps = 0;     // memory-bound passes, bytes read + written per second / 1e9
  double optimizer_gbps = 0;  // AdamW, bytes read + written per second / 1e9
  // The floor of one backend call (seconds; "op_floor_us" in the file, optional, 0: none): a
  // tiny call's time when calls are issued back to back (the host's issue time). A unit's
  // forward or backward takes at least its calls (BlockOpCount) times this, as does the
  // optimizer.
  double op_floor_s = 0;
  // The host's per-step costs that do not scale with the model (optional, 0: none):
  // "alloc_us": one workspace allocation and free through the backend (each backend call of the
  // model writes a fresh workspace: counted once per call beside op_floor_us); "sync_us": one
  // host synchronisation with the device (the backend's 4-byte CopyToHost readback or
  // CopyToDevice upload, both of which wait for the stream: the mean of the two round trips);
  // "launch_us": an empty kernel's launch issued back to back (informative: op_floor_us is the
  // backend call's); "step_overhead_us": the worker's own per-step handling outside the
  // trainer's step (a free-running trivial job's step less its timed step), serial with every
  // step; "step_cycle_us": the shortest step the coordinator's driving loop allows (a driven
  // trivial job's step: the coordinator handles step k's result while the worker runs k+1, so a
  // longer step hides it). Both from bench/step-overhead.sh.
  double alloc_s = 0, sync_s = 0, launch_s = 0, step_overhead_s = 0, step_cycle_s = 0;
  std::vector<CollectiveCurve> collectives;
  // CPU: (processes, slowdown) ascending in processes: the wall time per step of that many
  // synchronised single-threaded copies of a synthetic step on the host, over one copy's CPU
  // time alone (1 at one process). Empty: max(1, processes / cores).
  std::vector<std::pair<int, double>> host_slowdown;
};

// Parses a calibration file's JSON text (bench/calibrate.sh writes them): the fields above by
// name, "attention": {"forward_tflops", "backward_tflops"}, "gemm": [{"precision", "m", "n",
// "k", "tflops"}], "collectives": [{"link", "op", "ranks", "latency_us", "points": [[bytes,
// GB/s], ...]}], "host_slowdown": [[processes, factor], ...], "attention_classes": [{"batch",
// "seq", "heads", "kv_heads", "head_dim", "forward_tflops", "backward_tflops",
// "backward_nondeterministic_tflops"}]; "cores", "ranks_per_host", "collectives", "inter_link",
// "host_slowdown", "attention_classes", "op_floor_us", "alloc_us", "sync_us", "launch_us",
// "step_overhead_us", "step_cycle_us" and
// attention.backward_nondeterministic_tflops optional.
// INVALID_ARGUMENT naming `origin` and the field for malformed JSON, a missing or non-positive
// rate, an unknown precision or op, points not ascending, a host_slowdown entry that is not a
// [processes >= 1, factor > 0] pair ascending in processes.
absl::StatusOr<Calibration> ParseCalibration(const std::string& json, const std::string& origin);
// Reads and parses `path`: NOT_FOUND when it cannot be read.
absl::StatusOr<Calibration> LoadCalibration(const std::string& path);

// Attention TFLOP/s (forward, backward) for `heads` query heads, `kv_heads`, `head_dim` and
// sequence length `seq`: among the attention classes, those of the nearest head layout (the
// smallest sum of |log(x / class x)| over heads, kv_heads and head_dim), their rates
// interpolated linearly in log(seq) between the two classes around `seq` (clamped at the ends);
// without classes, the "attention" rates. The backward takes the non-deterministic rate when
// `deterministic` is false and that rate was measured.
std::pair<double, double> AttentionRates(const Calibration& c, int64_t heads, int64_t kv_heads,
                                         int64_t head_dim, int64_t seq, bool deterministic);

// Seconds of one GEMM (2 m n k FLOPs) at `precision` ("fp8", "bf16", "fp32"); the nearest
// class of that precision, else of "bf16", else any (a precision not measured).
double GemmSeconds(const Calibration& c, const std::string& precision, int64_t m, int64_t n,
                   int64_t k);
// Seconds of a collective of `bytes` (the full buffer) on `ranks` ranks over `link`: 0 for one
// rank; the curve of that link and op measured on the nearest rank count.
double CollectiveSeconds(const Calibration& c, const std::string& link, CollectiveOp op,
                         int ranks, double bytes);

// One FSDP unit's times for one microbatch (seconds).
struct UnitTimes {
  double forward = 0, backward = 0;  // compute
  double gather = 0;                 // all-gather of its wire buffers (shard group)
  double reduce = 0;                 // reduce-scatter of its f32 gradients (shard group)
  double replica = 0;                // hybrid: its replica reduction, after the last microbatch
  // The deferred optimizer (first microbatch only): `update`, the seconds from this unit's
  // prefetch to the end of its deferred AdamW and wire cast, which its all-gather follows;
  // `deferred`, what the next unit's update adds to this unit's forward (run beside it, or
  // inline before it).
  double update = 0, deferred = 0;
};

struct ScheduleResult {
  double compute_s = 0;        // sum of the units' compute over the microbatches
  double end_s = 0;            // when the forward/backward's last compute or collective ends
  double exposed_s = 0;        // end_s - compute_s
  double comm_s = 0;           // every collective's time, hidden or not
};
// The overlap of `units` (forward order) over `microbatches` as described above; in the first
// microbatch unit u's forward takes forward + deferred and the all-gather of u+1 is issued
// `update` (of u+1) after u's compute starts.
ScheduleResult Schedule(const std::vector<UnitTimes>& units, int microbatches);

// Optimizer seconds: AdamW on `shard_elements` f32 master elements with `state_bytes` of
// moments per element (8 or 4), the gradient norm's read and a separate cast of every element to
// `wire_bytes` per element (4 read + wire_bytes written, at the memory bandwidth).
double OptimizerSeconds(const Calibration& c, double shard_elements, int state_bytes,
                        double wire_bytes);

// A rank's optimizer piece by the wire dtype of its buffers (elements).
struct ShardElements {
  double fp32 = 0, bf16 = 0, fp8 = 0;
  double total() const { return fp32 + bf16 + fp8; }
};
// Optimizer seconds as FsdpParams runs the step's end (train/fsdp.cc): the gradient norm's read
// (4 bytes per element, memory bandwidth); AdamW over every element (12 + 2 state_bytes bytes),
// writing the bf16 wire shards itself (+2 bytes per bf16 element), at the AdamW rate; the FP8
// wire cast of the FP8 elements (CastWeights: 4 read + 1 written, memory bandwidth). FP32 wire
// shards are the master values (no cast).
double OptimizerSeconds(const Calibration& c, const ShardElements& e, int state_bytes);
// The update part of OptimizerSeconds (without the gradient norm's read): AdamW with the bf16
// pack at the AdamW rate and the FP8 wire cast at the memory bandwidth. The deferred optimizer
// runs it per unit; OptimizerSeconds = 4 e.total() / memory bandwidth + UpdateSeconds.
double UpdateSeconds(const Calibration& c, const ShardElements& e, int state_bytes);

// The deferred update of one unit beside (CUDA: a side stream) or before (CPU: inline) the
// forward of the unit before it (seconds; DeferredWindow). Side stream, the device work-
// conserving: the two streams share the device's SMs and memory bandwidth, both bound by them,
// so the device finishes both in the sum of their device times, and nothing shorter than the
// host's issue of both units' calls: window = max(forward_device + update_device,
// (forward_calls + update_calls) x call_s). Inline (no side stream): window = max(forward_device,
// forward_calls x call_s) + max(update_device, update_calls x call_s).
double DeferredWindow(double forward_device, int forward_calls, double update_device,
                      int update_calls, double call_s, bool side_stream);

// Host synchronisations one training step makes (the trainer's waits for the device: each
// CopyToHost and CopyToDevice of the backend waits for the stream), per train/trainer.cc,
// train/fsdp.cc and train/fp8_linear.cc: per microbatch the tokens' and targets' uploads (2); the
// losses' readback (1); the gradient norm's readback (1); with FP8 linears the delayed scales'
// update (the amax readback, the scale and inverse-scale uploads: 3) and, under the CURRENT
// recipe, per microbatch each scaled cast's amax readback and two scale uploads (3 per cast: an
// input cast per FP8 linear forward and a grad-output cast backward); the step's final
// synchronisation (1); with FP8 linears the scaling report of every 10th step (3 readbacks: 0.3 a
// step).
double HostSyncsPerStep(int microbatches, int fp8_linears, bool current_recipe);

// The factor on a CPU rank's compute and optimizer time with `processes` ranks on the host: the
// calibration's host_slowdown interpolated linearly between measured process counts (beyond the
// last, that factor x processes / its processes; below the first, linearly from 1 process at
// 1.0 to the first; at 1 process, the table's factor at 1 where it has one: a host slower than
// when the rates were measured slows a lone rank too); without one,
// max(1, processes / cores); 1 for a calibration without cores (GPUs).
double HostSlowdown(const Calibration& c, int processes);

struct StepCost {
  double step_s = 0;           // compute + exposed communication + optimizer + host_s
  double compute_s = 0;        // forward + backward compute of every microbatch
  double exposed_comm_s = 0;   // what the compute does not hide, the small all-reduces included
  double optimizer_s = 0;
  double comm_total_s = 0;     // every collective, hidden or not
  double gemm_s = 0, attention_s = 0, memory_s = 0;  // compute_s's parts
  double contention = 1;       // the CPU ranks' shared-host factor applied (HostSlowdown)
  double floor_s = 0;          // of compute_s and optimizer_s: what the backend-call floor added
  // Of compute_s: what the deferred optimizer's updates add to the forward (0 in the serial
  // order).
  double optimizer_in_forward_s = 0;
  // Host time serial with the device: syncs x sync_s + step_overhead_s, and what the
  // coordinator's cycle adds where it is longer than the step (in step_s).
  double host_s = 0;
  double syncs = 0;            // host synchronisations per step (HostSyncsPerStep)
  int calls = 0;               // backend calls per step (the call floor's count)
  int microbatches = 1;
  int64_t tokens_per_rank = 0;  // per step
  std::string intra_link, inter_link;
  // Whether training runs the optimizer deferred into the next step's forward
  // (training.overlap_optimizer, Mesh::DefersOptimizer), and the model prices it so: optimizer_s
  // is the step's tail (the gradient norm's read and the updates of units 0 and 1, in the
  // prefetch that ends the step); every later unit's update runs in the next forward
  // (DeferredWindow), its cost in compute_s (optimizer_in_forward_s). Serial: optimizer_s is the
  // whole optimizer after the backward.
  bool optimizer_deferred = false;
};

// The step of `spec` resolved at mesh.world_size() (ResolveSpec) on `mesh` with calibration `c`.
// INVALID_ARGUMENT where the step plan refuses the spec, where the calibration lacks a rate the
// spec needs (naming it), for a calibration of another backend than the spec's, or naming
// precision.fp8.granularity / precision.overrides[i].granularity for a spec with a rowwise or
// blockwise block (ScaledGranularityField: only tensorwise FP8 is priced). The optimizer is
// priced in the order training runs it (StepCost::optimizer_deferred). The step:
//   step = max(compute + exposed communication + optimizer + syncs x sync_s + step_overhead_s,
//              step_cycle_s)
// where compute and optimizer take, per unit and phase, the larger of the device's time and the
// host's issue of its calls (calls x (op_floor_s + alloc_s)): between two synchronisations host
// and device overlap (the host runs ahead, the longer bounds), while at a synchronisation the
// device drains and waits for the host's next call (serial: the sync's round trip), the worker's
// per-step handling runs while the device is idle, and the coordinator's loop (dispatching ahead)
// bounds the step from below.
absl::StatusOr<StepCost> PredictStep(const v1::JobSpec& spec, const Mesh& mesh,
                                     const Calibration& c, const StepPlanOptions& options = {});

// How a backend runs a block's memory-bound passes (PassRulesOf).
struct PassRules {
  // The backend's FP8 GEMMs take one layout (A and B row-major, "TN": CUDA's cuBLASLt, the CPU
  // reference): the backward of an FP8 linear transposes its weight's codes (dX) and its input's
  // codes (dW; once per shared input), and casts its grad-output with a transposed copy. False:
  // the fast CPU backend (Backend::Fp8GemmAnyLayout), whose generic block (f32 grad-outputs)
  // casts without the copy and transposes nothing; its bf16-activation block still transposes
  // (bf16 input gradients take BackwardFp8, train/fp8_linear.cc).
  bool fp8_one_layout = true;
  bool norm_inputs_bf16 = false;  // training.saved_norm_inputs BF16 (bf16-activation blocks)
};
PassRules PassRulesOf(const v1::JobSpec& spec);

// One block's dimensions for BlockPassBytes.
struct PassShape {
  int64_t tokens = 0;  // N, rows of every activation (one microbatch)
  int64_t d_model = 0, ffn = 0, q_width = 0, kv_width = 0;  // C, F, H D, Hkv D
};

// Bytes read + written by one block's memory-bound passes for one microbatch (forward,
// backward), as train/model.cc and train/fp8_linear.cc issue them for the block's path
// (docs/cost-model.md lists each pass):
// - generic block (f32 activations): f32 norms (8 B per element forward, 12 backward), RoPE on
//   q and k (8), SwiGLU (12 forward; 20 backward, 16 with the bf16 gate/up FP8 linears keep,
//   which the forward packs: 12 per F element), residual adds (12), BF16 attention's operand
//   packs (6); FP8 linears: each linear casts its own input (5) and its grad-output (6 with the
//   transposed copy, else 5) and, one-layout backends, transposes its weight's and its input's
//   codes (2 each).
// - bf16-activation block (BlockPlan::fp8_bf16): RMSNorm fused with the FP8 cast (5), RoPE on
//   bf16 q and k (4), o_proj's cast of bf16 att (3), SwiGLU fused with down_proj's cast (5);
//   backward: down_proj's input recast from gate/up (5, recast_down) or transposed (2), the f32
//   grad-outputs of down_proj and o_proj cast with their transposes (6), SwiGLU's backward
//   writing both grad-output casts and transposes (10), RoPE's backward fused with the q/k casts
//   and v's cast (4), the norms' backward (12 + 2 per bf16 part), and the transposes of every
//   weight (2 per weight element) and of each shared input's codes (2); bf16 saved norm inputs
//   add a pack (6) and an unpack (6) per norm.
std::pair<double, double> BlockPassBytes(const BlockPlan& b, const PassShape& s,
                                         const PassRules& r);

// Backend calls one block issues per microbatch (forward, backward), as train/model.cc and
// train/fp8_linear.cc issue them for the block's path: each GEMM, memory-bound pass, transpose
// and attention call counts one (generic FP8 block on a one-layout backend: 24 and 43; the fused
// bf16-activation block: 11 and 25).
std::pair<int, int> BlockOpCount(const BlockPlan& b, const PassRules& r);

// The head's memory-bound bytes for one microbatch of `tokens` rows (forward, backward): the
// final norm (8 forward, 12 backward), a BF16 head's bf16 copy of its input (6) and the fused
// cross-entropy, which reads the f32 logits twice and writes the gradient (bf16: 10 B per logit;
// an f32 head's, in place: 12).
std::pair<double, double> HeadPassBytes(bool head_bf16, int64_t tokens, int64_t d_model,
                                        int64_t vocab);

}  // namespace fsdp8
