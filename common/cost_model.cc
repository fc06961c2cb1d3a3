#include "common/cost_model.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/memory_plan.h"
#include "common/model_dims.h"
#include "common/spec.h"

namespace fsdp8 {

const char* CollectiveOpName(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllGather: return "all_gather";
    case CollectiveOp::kReduceScatter: return "reduce_scatter";
    case CollectiveOp::kAllReduce: return "all_reduce";
  }
  return "?";
}

namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

absl::Status Bad(const std::string& origin, const std::string& field, const std::string& rule) {
  return absl::InvalidArgumentError(absl::StrCat(origin, ": ", field, ": ", rule));
}

const Value* Field(const Struct& s, const std::string& name) {
  auto it = s.fields().find(name);
  return it == s.fields().end() ? nullptr : &it->second;
}

// A number field > 0 (required) or >= 0 (optional, default 0).
absl::StatusOr<double> Number(const Struct& s, const std::string& name, const std::string& path,
                              const std::string& origin, bool required) {
  const Value* v = Field(s, name);
  if (v == nullptr) {
    if (required) return Bad(origin, path + name, "missing (a number > 0)");
    return 0.0;
  }
  if (v->kind_case() != Value::kNumberValue || !std::isfinite(v->number_value()) ||
      v->number_value() < 0 || (required && v->number_value() == 0)) {
    return Bad(origin, path + name, required ? "must be a number > 0" : "must be a number >= 0");
  }
  return v->number_value();
}

std::string Text(const Struct& s, const std::string& name) {
  const Value* v = Field(s, name);
  return v != nullptr && v->kind_case() == Value::kStringValue ? v->string_value() : "";
}

absl::StatusOr<CollectiveOp> OpOf(const std::string& name, const std::string& path,
                                  const std::string& origin) {
  for (CollectiveOp op :
       {CollectiveOp::kAllGather, CollectiveOp::kReduceScatter, CollectiveOp::kAllReduce}) {
    if (name == CollectiveOpName(op)) return op;
  }
  return Bad(origin, path, "must be all_gather, reduce_scatter or all_reduce");
}

absl::StatusOr<CollectiveCurve> ParseCurve(const Struct& s, const std::string& path,
                                           const std::string& origin) {
  CollectiveCurve cc;
  cc.link = Text(s, "link");
  if (cc.link.empty()) return Bad(origin, path + "link", "missing (a link name)");
  absl::StatusOr<CollectiveOp> op = OpOf(Text(s, "op"), path + "op", origin);
  if (!op.ok()) return op.status();
  cc.op = *op;
  absl::StatusOr<double> ranks = Number(s, "ranks", path, origin, false);
  if (!ranks.ok()) return ranks.status();
  cc.ranks = static_cast<int>(*ranks);
  absl::StatusOr<double> lat = Number(s, "latency_us", path, origin, false);
  if (!lat.ok()) return lat.status();
  cc.latency_s = *lat * 1e-6;
  const Value* pts = Field(s, "points");
  if (pts == nullptr || pts->kind_case() != Value::kListValue || pts->list_value().values().empty()) {
    return Bad(origin, path + "points", "missing (a list of [bytes, GB/s] pairs)");
  }
  for (const Value& p : pts->list_value().values()) {
    const std::string at = absl::StrCat(path, "points[", cc.busbw.size(), "]");
    if (p.kind_case() != Value::kListValue || p.list_value().values_size() != 2) {
      return Bad(origin, at, "must be a pair [bytes, GB/s]");
    }
    const double bytes = p.list_value().values(0).number_value();
    const double gbps = p.list_value().values(1).number_value();
    if (!(bytes > 0) || !(gbps > 0) || !std::isfinite(bytes) || !std::isfinite(gbps)) {
      return Bad(origin, at, "bytes and GB/s must be > 0");
    }
    if (!cc.busbw.empty() && bytes <= cc.busbw.back().first) {
      return Bad(origin, at, "points must ascend in bytes");
    }
    cc.busbw.emplace_back(bytes, gbps);
  }
  return cc;
}

// The sum of |log(a / b)| over the three dimensions: the distance between shape classes.
double ShapeDistance(const GemmClass& g, int64_t m, int64_t n, int64_t k) {
  auto d = [](double a, double b) { return std::fabs(std::log(std::max(a, 1.0) / std::max(b, 1.0))); };
  return d(static_cast<double>(g.m), static_cast<double>(m)) +
         d(static_cast<double>(g.n), static_cast<double>(n)) +
         d(static_cast<double>(g.k), static_cast<double>(k));
}

// busbw at `bytes` interpolated in log(bytes) between the curve's points, clamped at the ends.
double BusBandwidthGbps(const CollectiveCurve& cc, double bytes) {
  const auto& p = cc.busbw;
  if (bytes <= p.front().first) return p.front().second;
  if (bytes >= p.back().first) return p.back().second;
  for (size_t i = 1; i < p.size(); ++i) {
    if (bytes <= p[i].first) {
      const double f = std::log(bytes / p[i - 1].first) / std::log(p[i].first / p[i - 1].first);
      return p[i - 1].second + f * (p[i].second - p[i - 1].second);
    }
  }
  return p.back().second;
}

double BusFactor(CollectiveOp op, int ranks) {
  const double n = ranks;
  return op == CollectiveOp::kAllReduce ? 2.0 * (n - 1) / n : (n - 1) / n;
}

int64_t WireBytes(WireDtype w) { return w == WireDtype::kFp8 ? 1 : w == WireDtype::kBf16 ? 2 : 4; }

const char* PrecisionName(v1::Precision p) {
  return p == v1::PRECISION_FP8 ? "fp8" : p == v1::PRECISION_BF16 ? "bf16" : "fp32";
}

}  // namespace

absl::StatusOr<Calibration> ParseCalibration(const std::string& json, const std::string& origin) {
  Struct root;
  if (auto st = google::protobuf::util::JsonStringToMessage(json, &root); !st.ok()) {
    return Bad(origin, "(file)", absl::StrCat("not a JSON object: ", std::string(st.message())));
  }
  Calibration c;
  c.backend = Text(root, "backend");
  if (c.backend != "cpu" && c.backend != "cuda") return Bad(origin, "backend", "must be cpu or cuda");
  c.device = Text(root, "device");
  c.source = Text(root, "source");
  for (auto [name, out] : {std::pair{"cores", &c.cores}, std::pair{"ranks_per_host", &c.ranks_per_host}}) {
    absl::StatusOr<double> v = Number(root, name, "", origin, false);
    if (!v.ok()) return v.status();
    *out = static_cast<int>(*v);
  }
  c.intra_link = Text(root, "intra_link");
  c.inter_link = Text(root, "inter_link");
  if (c.intra_link.empty()) return Bad(origin, "intra_link", "missing (a link name)");
  if (c.inter_link.empty()) c.inter_link = c.intra_link;
  for (auto [name, out] : {std::pair{"memory_gbps", &c.memory_gbps},
                           std::pair{"optimizer_gbps", &c.optimizer_gbps}}) {
    absl::StatusOr<double> v = Number(root, name, "", origin, true);
    if (!v.ok()) return v.status();
    *out = *v;
  }
  for (auto [name, out] : {std::pair{"op_floor_us", &c.op_floor_s}, std::pair{"alloc_us", &c.alloc_s},
                           std::pair{"sync_us", &c.sync_s}, std::pair{"launch_us", &c.launch_s},
                           std::pair{"step_overhead_us", &c.step_overhead_s},
                           std::pair{"step_cycle_us", &c.step_cycle_s}}) {
    absl::StatusOr<double> v = Number(root, name, "", origin, false);
    if (!v.ok()) return v.status();
    *out = *v * 1e-6;
  }
  const Value* att = Field(root, "attention");
  if (att == nullptr || att->kind_case() != Value::kStructValue) {
    return Bad(origin, "attention", "missing (an object with forward_tflops, backward_tflops)");
  }
  for (auto [name, out] : {std::pair{"forward_tflops", &c.attention_forward_tflops},
                           std::pair{"backward_tflops", &c.attention_backward_tflops}}) {
    absl::StatusOr<double> v = Number(att->struct_value(), name, "attention.", origin, true);
    if (!v.ok()) return v.status();
    *out = *v;
  }
  {
    absl::StatusOr<double> v = Number(att->struct_value(), "backward_nondeterministic_tflops",
                                      "attention.", origin, false);
    if (!v.ok()) return v.status();
    c.attention_backward_nondeterministic_tflops = *v;
  }
  if (const Value* classes = Field(root, "attention_classes"); classes != nullptr) {
    if (classes->kind_case() != Value::kListValue) {
      return Bad(origin, "attention_classes", "must be a list of attention shapes");
    }
    for (const Value& a : classes->list_value().values()) {
      const std::string path = absl::StrCat("attention_classes[", c.attention_classes.size(), "].");
      if (a.kind_case() != Value::kStructValue) return Bad(origin, path, "must be an object");
      AttentionClass ac;
      for (auto [name, out] : {std::pair{"batch", &ac.batch}, std::pair{"seq", &ac.seq},
                               std::pair{"heads", &ac.heads}, std::pair{"kv_heads", &ac.kv_heads},
                               std::pair{"head_dim", &ac.head_dim}}) {
        absl::StatusOr<double> v = Number(a.struct_value(), name, path, origin, true);
        if (!v.ok()) return v.status();
        *out = static_cast<int64_t>(*v);
      }
      for (auto [name, out, required] :
           {std::tuple{"forward_tflops", &ac.forward_tflops, true},
            std::tuple{"backward_tflops", &ac.backward_tflops, true},
            std::tuple{"backward_nondeterministic_tflops", &ac.backward_nondeterministic_tflops,
                       false}}) {
        absl::StatusOr<double> v = Number(a.struct_value(), name, path, origin, required);
        if (!v.ok()) return v.status();
        *out = *v;
      }
      c.attention_classes.push_back(ac);
    }
  }
  const Value* gemm = Field(root, "gemm");
  if (gemm == nullptr || gemm->kind_case() != Value::kListValue || gemm->list_value().values().empty()) {
    return Bad(origin, "gemm", "missing (a list of shape classes)");
  }
  for (const Value& g : gemm->list_value().values()) {
    const std::string path = absl::StrCat("gemm[", c.gemm.size(), "].");
    if (g.kind_case() != Value::kStructValue) return Bad(origin, path, "must be an object");
    GemmClass gc;
    gc.precision = Text(g.struct_value(), "precision");
    if (gc.precision != "fp8" && gc.precision != "bf16" && gc.precision != "fp32") {
      return Bad(origin, path + "precision", "must be fp8, bf16 or fp32");
    }
    for (auto [name, out] : {std::pair{"m", &gc.m}, std::pair{"n", &gc.n}, std::pair{"k", &gc.k}}) {
      absl::StatusOr<double> v = Number(g.struct_value(), name, path, origin, true);
      if (!v.ok()) return v.status();
      *out = static_cast<int64_t>(*v);
    }
    absl::StatusOr<double> r = Number(g.struct_value(), "tflops", path, origin, true);
    if (!r.ok()) return r.status();
    gc.tflops = *r;
    c.gemm.push_back(gc);
  }
  const Value* coll = Field(root, "collectives");
  if (coll != nullptr) {
    if (coll->kind_case() != Value::kListValue) return Bad(origin, "collectives", "must be a list");
    for (const Value& v : coll->list_value().values()) {
      const std::string path = absl::StrCat("collectives[", c.collectives.size(), "].");
      if (v.kind_case() != Value::kStructValue) return Bad(origin, path, "must be an object");
      absl::StatusOr<CollectiveCurve> cc = ParseCurve(v.struct_value(), path, origin);
      if (!cc.ok()) return cc.status();
      c.collectives.push_back(*cc);
    }
  }
  const Value* slow = Field(root, "host_slowdown");
  if (slow != nullptr) {
    if (slow->kind_case() != Value::kListValue) {
      return Bad(origin, "host_slowdown", "must be a list of [processes, factor] pairs");
    }
    for (const Value& p : slow->list_value().values()) {
      const std::string at = absl::StrCat("host_slowdown[", c.host_slowdown.size(), "]");
      if (p.kind_case() != Value::kListValue || p.list_value().values_size() != 2) {
        return Bad(origin, at, "must be a pair [processes, factor]");
      }
      const double n = p.list_value().values(0).number_value();
      const double f = p.list_value().values(1).number_value();
      if (!(n >= 1) || n != std::floor(n) || !(f > 0) || !std::isfinite(f)) {
        return Bad(origin, at, "processes must be an integer >= 1 and the factor > 0");
      }
      if (!c.host_slowdown.empty() && n <= c.host_slowdown.back().first) {
        return Bad(origin, at, "entries must ascend in processes");
      }
      c.host_slowdown.emplace_back(static_cast<int>(n), f);
    }
  }
  return c;
}

absl::StatusOr<Calibration> LoadCalibration(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read the calibration file"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseCalibration(ss.str(), path);
}

std::pair<double, double> AttentionRates(const Calibration& c, int64_t heads, int64_t kv_heads,
                                         int64_t head_dim, int64_t seq, bool deterministic) {
  auto backward = [&](double det, double nondet) { return !deterministic && nondet > 0 ? nondet : det; };
  if (c.attention_classes.empty()) {
    return {c.attention_forward_tflops,
            backward(c.attention_backward_tflops, c.attention_backward_nondeterministic_tflops)};
  }
  auto lg = [](double a, double b) { return std::fabs(std::log(std::max(a, 1.0) / std::max(b, 1.0))); };
  auto layout = [&](const AttentionClass& a) {
    return lg(static_cast<double>(a.heads), static_cast<double>(heads)) +
           lg(static_cast<double>(a.kv_heads), static_cast<double>(kv_heads)) +
           lg(static_cast<double>(a.head_dim), static_cast<double>(head_dim));
  };
  double best = std::numeric_limits<double>::infinity();
  for (const AttentionClass& a : c.attention_classes) best = std::min(best, layout(a));
  std::vector<const AttentionClass*> near;  // the nearest layout's classes, by seq
  for (const AttentionClass& a : c.attention_classes) {
    if (layout(a) <= best + 1e-12) near.push_back(&a);
  }
  std::sort(near.begin(), near.end(),
            [](const AttentionClass* a, const AttentionClass* b) { return a->seq < b->seq; });
  auto rates = [&](const AttentionClass& a) {
    return std::pair{a.forward_tflops, backward(a.backward_tflops, a.backward_nondeterministic_tflops)};
  };
  if (seq <= near.front()->seq) return rates(*near.front());
  if (seq >= near.back()->seq) return rates(*near.back());
  for (size_t i = 1; i < near.size(); ++i) {
    if (seq <= near[i]->seq) {
      const double f = std::log(static_cast<double>(seq) / near[i - 1]->seq) /
                       std::log(static_cast<double>(near[i]->seq) / near[i - 1]->seq);
      const auto [f0, b0] = rates(*near[i - 1]);
      const auto [f1, b1] = rates(*near[i]);
      return {f0 + f * (f1 - f0), b0 + f * (b1 - b0)};
    }
  }
  return rates(*near.back());
}

double GemmSeconds(const Calibration& c, const std::string& precision, int64_t m, int64_t n,
                   int64_t k) {
  const GemmClass* best = nullptr;
  double best_d = std::numeric_limits<double>::infinity();
  for (const char* want : {precision.c_str(), "bf16", ""}) {
    for (const GemmClass& g : c.gemm) {
      if (*want != '\0' && g.precision != want) continue;
      const double d = ShapeDistance(g, m, n, k);
      if (d < best_d) {
        best_d = d;
        best = &g;
      }
    }
    if (best != nullptr) break;
  }
  if (best == nullptr) return 0;
  return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) /
         (best->tflops * 1e12);
}

double CollectiveSeconds(const Calibration& c, const std::string& link, CollectiveOp op, int ranks,
                         double bytes) {
  if (ranks <= 1 || bytes <= 0) return 0;
  const CollectiveCurve* best = nullptr;
  int best_d = std::numeric_limits<int>::max();
  for (const CollectiveCurve& cc : c.collectives) {
    if (cc.link != link || cc.op != op) continue;
    const int d = cc.ranks == 0 ? 1 << 20 : std::abs(cc.ranks - ranks);
    if (d < best_d) {
      best_d = d;
      best = &cc;
    }
  }
  if (best == nullptr) return 0;
  return best->latency_s + bytes * BusFactor(op, ranks) / (BusBandwidthGbps(*best, bytes) * 1e9);
}

ScheduleResult Schedule(const std::vector<UnitTimes>& units, int microbatches) {
  ScheduleResult r;
  if (units.empty()) return r;
  const size_t U = units.size();
  double t = 0, chan = 0, replica = 0;
  // A collective issued at `issue` for `dur` seconds on `*ch` (in issue order): its end.
  auto collective = [&](double issue, double dur, double* ch) {
    const double start = std::max(issue, *ch);
    *ch = start + dur;
    r.comm_s += dur;
    return *ch;
  };
  std::vector<double> ready(U);
  for (int mb = 0; mb < std::max(1, microbatches); ++mb) {
    const bool last = mb == std::max(1, microbatches) - 1;
    ready[0] = collective(t, units[0].gather, &chan);
    for (size_t u = 0; u < U; ++u) {  // forward: prefetch u+1 while u computes
      const double start = std::max(t, ready[u]);
      if (u + 1 < U) {
        const double update = mb == 0 ? units[u + 1].update : 0;  // the deferred update first
        ready[u + 1] = collective(start + update, units[u + 1].gather, &chan);
      }
      const double forward = units[u].forward + (mb == 0 ? units[u].deferred : 0);
      t = start + forward;
      r.compute_s += forward;
    }
    ready[U - 1] = t;  // the last forward unit stays gathered for its backward
    for (size_t u = U; u-- > 0;) {  // backward: prefetch u-1, then reduce-scatter u
      const double start = std::max(t, ready[u]);
      if (u > 0) ready[u - 1] = collective(start, units[u - 1].gather, &chan);
      t = start + units[u].backward;
      r.compute_s += units[u].backward;
      const double reduced = collective(t, units[u].reduce, &chan);
      if (last && units[u].replica > 0) collective(reduced, units[u].replica, &replica);
    }
  }
  r.end_s = std::max({t, chan, replica});
  r.exposed_s = r.end_s - r.compute_s;
  return r;
}

double OptimizerSeconds(const Calibration& c, double shard_elements, int state_bytes,
                        double wire_bytes) {
  const double adamw = shard_elements * (12.0 + 2.0 * state_bytes) / (c.optimizer_gbps * 1e9);
  const double norm_and_cast = shard_elements * (4.0 + 4.0 + wire_bytes) / (c.memory_gbps * 1e9);
  return adamw + norm_and_cast;
}

double OptimizerSeconds(const Calibration& c, const ShardElements& e, int state_bytes) {
  const double adamw = (e.total() * (12.0 + 2.0 * state_bytes) + 2.0 * e.bf16) /
                       (c.optimizer_gbps * 1e9);
  const double norm_and_cast = (4.0 * e.total() + 5.0 * e.fp8) / (c.memory_gbps * 1e9);
  return adamw + norm_and_cast;
}

double UpdateSeconds(const Calibration& c, const ShardElements& e, int state_bytes) {
  const double adamw = (e.total() * (12.0 + 2.0 * state_bytes) + 2.0 * e.bf16) /
                       (c.optimizer_gbps * 1e9);
  return adamw + 5.0 * e.fp8 / (c.memory_gbps * 1e9);
}

double DeferredWindow(double forward_device, int forward_calls, double update_device,
                      int update_calls, double call_s, bool side_stream) {
  if (side_stream) {
    return std::max(forward_device + update_device, (forward_calls + update_calls) * call_s);
  }
  return std::max(forward_device, forward_calls * call_s) +
         std::max(update_device, update_calls * call_s);
}

double HostSyncsPerStep(int microbatches, int fp8_linears, bool current_recipe) {
  double syncs = 2.0 * microbatches + 1 + 1 + 1;  // uploads; losses; grad norm; the step's end
  if (fp8_linears > 0) {
    syncs += 3 + 0.3;  // the delayed scales' update; the scaling report every 10th step
    if (current_recipe) syncs += 3.0 * 2 * fp8_linears * microbatches;
  }
  return syncs;
}

double HostSlowdown(const Calibration& c, int processes) {
  if (c.cores <= 0) return 1.0;
  const auto& h = c.host_slowdown;
  if (processes <= 1) return !h.empty() && h.front().first == 1 ? h.front().second : 1.0;
  if (h.empty()) return std::max(1.0, static_cast<double>(processes) / c.cores);
  if (processes <= h.front().first) {
    // Below the first measured count: linear from (1 process, 1.0) to that point.
    if (h.front().first <= 1) return h.front().second;
    const double f = static_cast<double>(processes - 1) / (h.front().first - 1);
    return 1.0 + f * (h.front().second - 1.0);
  }
  if (processes >= h.back().first) {
    return h.back().second * processes / static_cast<double>(h.back().first);
  }
  for (size_t i = 1; i < h.size(); ++i) {
    if (processes <= h[i].first) {
      const double f = static_cast<double>(processes - h[i - 1].first) / (h[i].first - h[i - 1].first);
      return h[i - 1].second + f * (h[i].second - h[i - 1].second);
    }
  }
  return h.back().second;
}

PassRules PassRulesOf(const v1::JobSpec& spec) {
  const BackendCaps caps = BackendCapsOf(spec.backend());
  PassRules r;
  r.fp8_one_layout = caps.cuda || caps.cpu_reference;
  r.norm_inputs_bf16 = spec.training().saved_norm_inputs() == v1::PRECISION_BF16;
  return r;
}

namespace {

// The generic block: f32 activations, each FP8 linear casting its own input (LlamaModel's
// non-acts16 path).
std::pair<double, double> GenericBlockPassBytes(const BlockPlan& b, const PassShape& s,
                                                const PassRules& r) {
  const double N = static_cast<double>(s.tokens);
  const double C = s.d_model, F = s.ffn, Q = s.q_width, K = s.kv_width;
  const bool fp8 = b.linears == v1::PRECISION_FP8;
  // Norms (f32 read and written), RoPE on q and k (in place), SwiGLU (2 reads, 1 write), the
  // two residual adds (2 reads, 1 write).
  double fwd = N * (2 * 8 * C + 8 * (Q + K) + 12 * F + 2 * 12 * C);
  // Norms' backward (gradient and input read, gradient written), RoPE, SwiGLU (gradient, gate
  // and up read; two gradients written), the residual Axpys.
  double bwd = N * (2 * 12 * C + 8 * (Q + K) + 2 * 12 * C);
  if (b.attention == Dtype::kBf16) fwd += N * 6 * (Q + 2 * K + Q);  // q, k, v, att packed
  if (!fp8) return {fwd, bwd + N * 20 * F};
  fwd += N * 12 * F;   // gate and up packed to bf16 for the backward
  bwd += N * 16 * F;   // SwiGLU's backward reading them
  // Input casts (f32 read, E4M3 written), one per linear: q, k, v, o, gate, up, down.
  fwd += N * 5 * (3 * C + Q + 2 * C + F);
  // Per linear (in, out): its grad-output's cast and, one-layout backends, the transposes.
  const std::pair<double, double> lin[] = {{C, Q}, {C, K}, {C, K}, {Q, C},
                                           {C, F}, {C, F}, {F, C}};
  for (auto [in, out] : lin) {
    bwd += N * (r.fp8_one_layout ? 6 : 5) * out;
    if (r.fp8_one_layout) bwd += 2 * in * out + N * 2 * in;
  }
  return {fwd, bwd};
}

// The bf16-activation block (BlockPlan::fp8_bf16, LlamaModel's acts16 path): FP8 inputs cast
// by fused passes from bf16 activations; the backward always through BackwardFp8 (bf16 input
// gradients), hence with the transposes on every backend.
std::pair<double, double> Bf16BlockPassBytes(const BlockPlan& b, const PassShape& s,
                                             const PassRules& r) {
  const double N = static_cast<double>(s.tokens);
  const double C = s.d_model, F = s.ffn, Q = s.q_width, K = s.kv_width, T = Q + 2 * K;
  // RMSNorm + cast (x f32 read, codes written) twice, RoPE on bf16 q and k in place, o_proj's
  // input cast from bf16 att, SwiGLU + down_proj's cast (bf16 gate and up read, codes written).
  double fwd = N * (2 * 5 * C + 4 * (Q + K) + 3 * Q + 5 * F);
  // down_proj's input codes for dW: recast from gate and up (transposed codes written), or the
  // kept codes transposed.
  double bwd = N * (b.recast_down ? 5 : 2) * F;
  bwd += N * 6 * C + 2 * C * F;              // down: f32 grad-output cast + transpose; weight
  bwd += N * 10 * F;                         // SwiGLU backward: casts and transposes of dgate, dup
  const double mlp_parts = b.fused_mlp ? 1 : 2, qkv_parts = b.fused_qkv ? 1 : 3;
  bwd += 2 * (2 * F) * C + N * 2 * C;        // gate/up weights; the shared input's codes
  bwd += N * (12 + 2 * mlp_parts) * C;       // post-norm backward (+ dout), bf16 parts read
  bwd += N * 6 * C + 2 * C * Q + N * 2 * Q;  // o: f32 grad-output cast; weight; input codes
  bwd += N * 4 * T;                          // RoPE backward + q, k casts; v's cast
  bwd += 2 * T * C + N * 2 * C;              // q/k/v weights; the shared input's codes
  bwd += N * (12 + 2 * qkv_parts) * C;       // input norm's backward (+ dh), bf16 parts read
  if (r.norm_inputs_bf16) {                  // x_in and h packed to bf16, unpacked for the norms
    fwd += N * 2 * 6 * C;
    bwd += N * 2 * 6 * C;
  }
  return {fwd, bwd};
}

}  // namespace

std::pair<double, double> BlockPassBytes(const BlockPlan& b, const PassShape& s,
                                         const PassRules& r) {
  return b.fp8_bf16 ? Bf16BlockPassBytes(b, s, r) : GenericBlockPassBytes(b, s, r);
}

std::pair<int, int> BlockOpCount(const BlockPlan& b, const PassRules& r) {
  const bool fp8 = b.linears == v1::PRECISION_FP8;
  if (!b.fp8_bf16) {
    // Forward: norm, each linear (its input's cast and GEMM), RoPE q and k, attention (and BF16
    // attention's four packs), add, norm, SwiGLU, FP8's gate/up packs, add.
    const int fwd = 1 + 7 * (fp8 ? 2 : 1) + 2 + 1 + (b.attention == Dtype::kBf16 ? 4 : 0) + 1 + 1 +
                    1 + (fp8 ? 2 : 0) + 1;
    // Backward: each linear (grad-output cast, the two transposes on one-layout backends, dX and
    // dW GEMMs), SwiGLU, two norms, two Axpys, attention, RoPE q and k.
    const int per_linear = fp8 ? 3 + (r.fp8_one_layout ? 2 : 0) : 2;
    return {fwd, 7 * per_linear + 1 + 2 + 2 + 1 + 2};
  }
  const int qkv = b.fused_qkv ? 1 : 3, mlp = b.fused_mlp ? 1 : 2, norm16 = r.norm_inputs_bf16 ? 2 : 0;
  // Forward: two norm casts, q/k/v GEMM(s), RoPE q and k, attention, o's cast and GEMM, gate/up
  // GEMM(s), SwiGLU cast, down GEMM.
  const int fwd = 2 + qkv + 2 + 1 + 2 + mlp + 1 + 1 + norm16;
  // Backward: down's input recast (or transpose), its cast, weight transpose, dX, dW; SwiGLU;
  // gate/up weight transposes, input transpose, dX and dW per GEMM; norm; o's cast, transposes,
  // dX, dW; attention; RoPE q, k and v's cast; q/k/v transposes, dX and dW per GEMM; norm.
  const int bwd = 1 + 4 + 1 + (mlp + 1 + 2 * mlp) + 1 + 5 + 1 + 3 + (qkv + 1 + 2 * qkv) + 1 + norm16;
  return {fwd, bwd};
}

std::pair<double, double> HeadPassBytes(bool head_bf16, int64_t tokens, int64_t d_model,
                                        int64_t vocab) {
  const double N = static_cast<double>(tokens), C = d_model, V = vocab;
  const double fwd = N * (8 * C + (head_bf16 ? 6 * C + 10 * V : 12 * V));
  return {fwd, N * 12 * C};
}

absl::StatusOr<StepCost> PredictStep(const v1::JobSpec& spec, const Mesh& mesh,
                                     const Calibration& c, const StepPlanOptions& options) {
  const std::string backend = spec.backend() == "cuda" ? "cuda" : "cpu";
  if (const std::string field = ScaledGranularityField(spec); !field.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": the cost model prices tensorwise FP8 linears only (ROWWISE and BLOCKWISE "
        "blocks' per-row / per-tile scaling passes are not modelled)"));
  }
  if (c.backend != backend) {
    return absl::InvalidArgumentError(absl::StrCat("calibration: backend ", c.backend,
                                                   " does not match the spec's backend ",
                                                   spec.backend()));
  }
  if (c.gemm.empty() || c.memory_gbps <= 0 || c.optimizer_gbps <= 0 ||
      c.attention_forward_tflops <= 0 || c.attention_backward_tflops <= 0) {
    return absl::InvalidArgumentError(
        "calibration: gemm, memory_gbps, optimizer_gbps and attention rates must be set");
  }
  const int W = mesh.world_size(), S = mesh.shard_size, R = mesh.replicas;
  // The plan of the spec on `mesh` (its units laid out at the shard group's size): the spec's
  // replicas set to the mesh's.
  v1::JobSpec on_mesh = spec;
  on_mesh.mutable_sharding()->set_replicas(R);
  absl::StatusOr<StepPlan> plan =
      MakeStepPlan(on_mesh, W, BackendCapsOf(spec.backend()), options);
  if (!plan.ok()) return plan.status();
  const ModelDims d = ModelDimsOf(spec.model());
  const v1::TrainingSpec& tr = spec.training();
  const int64_t B = std::max(1, tr.microbatch()), N = plan->tokens;
  StepCost cost;
  cost.microbatches =
      static_cast<int>(std::max<int64_t>(1, tr.global_batch() / std::max(1, W) / B));
  cost.tokens_per_rank = N * cost.microbatches;
  // Links: a group within one host takes the intra-host link.
  const int per_host = c.ranks_per_host > 0 ? c.ranks_per_host : W;
  cost.intra_link = S <= per_host ? c.intra_link : c.inter_link;
  cost.inter_link = W <= per_host ? c.intra_link : c.inter_link;
  for (const std::string& link : {cost.intra_link, cost.inter_link}) {
    bool found = false;
    for (const CollectiveCurve& cc : c.collectives) found = found || cc.link == link;
    if (W > 1 && !found) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration: no collectives measured on link \"", link, "\""));
    }
  }
  cost.contention = HostSlowdown(c, std::min(W, per_host));
  const double k = cost.contention, bw = c.memory_gbps * 1e9;
  auto gemm = [&](const char* p, int64_t m, int64_t n, int64_t kk) {
    const double s = GemmSeconds(c, p, m, n, kk) * k;
    cost.gemm_s += s;
    return s;
  };
  auto pass = [&](double bytes) {
    const double s = bytes / bw * k;
    cost.memory_s += s;
    return s;
  };
  const int64_t C = d.d_model, F = d.ffn_dim, V = d.vocab_size, nq = d.q_width(),
                nk = d.kv_width();
  const PassRules rules = PassRulesOf(spec);
  const std::pair<double, double> att_rates =
      AttentionRates(c, d.n_heads, d.n_kv_heads, d.head_dim, d.seq_len, tr.deterministic());
  std::vector<UnitTimes> units(plan->units.size());
  // Compute: embedding (unit 0), blocks (1..L), head (last).
  units.front().forward = pass(8.0 * N * C);
  units.front().backward = pass(8.0 * N * C);
  // A unit's compute takes at least its backend calls' host issue: each call at the
  // calibration's floor plus its workspace's allocation and free.
  const double floor_s = (c.op_floor_s + c.alloc_s) * k;
  int calls_per_mb = 0;
  auto at_least = [&](double s, int ops) {
    const double f = ops * floor_s;
    calls_per_mb += ops;
    if (f > s) cost.floor_s += f - s;
    return std::max(s, f);
  };
  // Each unit's forward on the device alone and its calls (the deferred optimizer's window).
  std::vector<double> forward_device(units.size());
  std::vector<int> forward_calls(units.size());
  forward_device.front() = units.front().forward;
  forward_calls.front() = 1;
  units.front().forward = at_least(units.front().forward, 1);
  units.front().backward = at_least(units.front().backward, 1);
  for (size_t l = 0; l < plan->blocks.size(); ++l) {
    const BlockPlan& b = plan->blocks[l];
    UnitTimes& u = units[1 + l];
    const char* p = PrecisionName(b.linears);
    std::vector<std::pair<int64_t, int64_t>> gemms;  // (in, out) per GEMM
    if (b.fused_qkv) {
      gemms.push_back({C, nq + 2 * nk});
    } else {
      gemms.insert(gemms.end(), {{C, nq}, {C, nk}, {C, nk}});
    }
    gemms.push_back({nq, C});
    if (b.fused_mlp) {
      gemms.push_back({C, 2 * F});
    } else {
      gemms.insert(gemms.end(), {{C, F}, {C, F}});
    }
    gemms.push_back({F, C});
    double fwd = 0, bwd = 0;
    for (auto [in, out] : gemms) {
      fwd += gemm(p, N, out, in);
      bwd += gemm(p, N, in, out) + gemm(p, out, in, N);
    }
    const double att = 2.0 * B * d.n_heads * d.seq_len * d.seq_len * d.head_dim;
    const double af = att / (att_rates.first * 1e12) * k;
    const double ab = 2.5 * att / (att_rates.second * 1e12) * k;
    cost.attention_s += af + ab;
    const auto [pf, pb] = BlockPassBytes(b, PassShape{N, C, F, nq, nk}, rules);
    fwd += af + pass(pf);
    bwd += ab + pass(pb);
    if (plan->recompute) {  // the backward reruns the forward
      for (auto [in, out] : gemms) bwd += gemm(p, N, out, in);
      cost.attention_s += af;
      bwd += af + pass(pf);
    }
    const auto [of, ob] = BlockOpCount(b, rules);
    forward_device[1 + l] = fwd;
    forward_calls[1 + l] = of;
    u.forward = at_least(fwd, of);
    u.backward = at_least(bwd, ob + (plan->recompute ? of : 0));
  }
  {
    UnitTimes& h = units.back();
    const char* p = plan->head_bf16 ? "bf16" : "fp32";
    // Final norm, logits GEMM, fused cross-entropy forward + backward; backward: dX and dW
    // GEMMs, the norm's backward.
    const auto [hf, hb] = HeadPassBytes(plan->head_bf16, N, C, V);
    h.forward = gemm(p, N, V, C) + pass(hf);
    h.backward = gemm(p, N, C, V) + gemm(p, V, C, N) + pass(hb);
    // Calls: a BF16 head's norm, bf16 copy, per row chunk its logits GEMM, cross-entropy and dX
    // GEMM, one dW GEMM, the norm's backward; an f32 head's norm, GEMM, cross-entropy, dX, dW and
    // norm backward.
    const int chunks = plan->head_bf16 && plan->head_chunk_rows > 0
                           ? static_cast<int>((N + plan->head_chunk_rows - 1) / plan->head_chunk_rows)
                           : 1;
    forward_device.back() = h.forward;
    forward_calls.back() = plan->head_bf16 ? 2 + 2 * chunks : 3;
    h.forward = at_least(h.forward, forward_calls.back());
    h.backward = at_least(h.backward, plan->head_bf16 ? chunks + 2 : 3);
  }
  // Communication per unit.
  double shard_wire = 0;
  ShardElements piece;
  std::vector<ShardElements> unit_piece(plan->units.size());
  for (size_t i = 0; i < plan->units.size(); ++i) {
    double gathered = 0, grads = 0, shard_grads = 0;
    for (const PlannedBuffer& pb : plan->units[i].buffers) {
      gathered += static_cast<double>(pb.padded) * WireBytes(pb.wire);
      grads += static_cast<double>(pb.padded) * 4;
      shard_grads += static_cast<double>(pb.shard) * 4;
      (pb.wire == WireDtype::kFp8 ? piece.fp8 : pb.wire == WireDtype::kBf16 ? piece.bf16 : piece.fp32) +=
          static_cast<double>(pb.shard);
      ShardElements& up = unit_piece[i];
      (pb.wire == WireDtype::kFp8 ? up.fp8 : pb.wire == WireDtype::kBf16 ? up.bf16 : up.fp32) +=
          static_cast<double>(pb.shard);
      shard_wire += pb.wire == WireDtype::kFp32 ? 0.0
                                                : static_cast<double>(pb.shard) * WireBytes(pb.wire);
    }
    units[i].gather = CollectiveSeconds(c, cost.intra_link, CollectiveOp::kAllGather, S, gathered);
    units[i].reduce =
        CollectiveSeconds(c, cost.intra_link, CollectiveOp::kReduceScatter, S, grads);
    if (R > 1) {
      units[i].replica = CollectiveSeconds(
          c, cost.inter_link,
          mesh.optimizer_over_world ? CollectiveOp::kReduceScatter : CollectiveOp::kAllReduce, R,
          shard_grads);
    }
  }
  // The small all-reduces, the optimizer's pieces and calls (per unit: its FP8 tensors).
  int fp8_linears = 0;
  std::vector<int> unit_fp8(plan->units.size(), 0);
  for (size_t l = 0; l < plan->blocks.size(); ++l) {
    const BlockPlan& b = plan->blocks[l];
    if (b.linears != v1::PRECISION_FP8) continue;
    fp8_linears += static_cast<int>(b.proj.size());
    if (1 + l < unit_fp8.size()) unit_fp8[1 + l] = static_cast<int>(b.proj.size());
  }
  const double pieces = mesh.optimizer_over_world ? R : 1;
  const int state_bytes = static_cast<int>(OptimizerStateBytesPerElement(spec));
  auto mine_of = [&](const ShardElements& e) {
    return ShardElements{e.fp32 / pieces, e.bf16 / pieces, e.fp8 / pieces};
  };
  const ShardElements mine = mine_of(piece);
  int buffers = 0;
  for (const PlannedUnit& u : plan->units) buffers += static_cast<int>(u.buffers.size());
  cost.optimizer_deferred = mesh.DefersOptimizer(spec.training().overlap_optimizer());
  int optimizer_calls = 0;
  double optimizer_floor = 0;  // what the call floor added to the optimizer
  if (!cost.optimizer_deferred) {
    // Serial: the whole optimizer after the backward. Its calls: per buffer the gradient norm's
    // and AdamW's (AdamW again per FP8 tensor's slice), per FP8 tensor its cast, and the scales'
    // four (amax reset, group maximum, scales, reduce).
    cost.optimizer_s = OptimizerSeconds(c, mine, state_bytes) * k;
    optimizer_calls = 2 * buffers + 2 * fp8_linears + (fp8_linears > 0 ? 4 : 0);
    if (optimizer_calls * floor_s > cost.optimizer_s) {
      optimizer_floor = optimizer_calls * floor_s - cost.optimizer_s;
      cost.optimizer_s = optimizer_calls * floor_s;
    }
  } else {
    // Deferred (FsdpParams::DeferAdamW): the step's tail is the gradient norm's read (one call
    // per buffer) and the updates of units 0 and 1 (PrefetchFirstUnits); unit u >= 2 is updated
    // when its prefetch is issued, as unit u-1's forward starts (first microbatch). A unit's
    // update calls: per buffer AdamW, per FP8 tensor AdamW's slice and the cast, and, with FP8
    // tensors, the unit's amax reset, amax maximum and scales (3).
    const bool side_stream = BackendCapsOf(spec.backend()).cuda;
    auto update_calls = [&](size_t u) {
      return static_cast<int>(plan->units[u].buffers.size()) + 2 * unit_fp8[u] +
             (unit_fp8[u] > 0 ? 3 : 0);
    };
    double tail_device = 4.0 * mine.total() / (c.memory_gbps * 1e9) * k;
    int tail_calls = buffers;
    const size_t U = units.size();
    for (size_t u = 0; u < U; ++u) {
      const double device = UpdateSeconds(c, mine_of(unit_piece[u]), state_bytes) * k;
      const int calls = update_calls(u);
      optimizer_calls += calls;
      if (u < 2) {
        tail_device += device;
        tail_calls += calls;
        continue;
      }
      const double window = DeferredWindow(forward_device[u - 1], forward_calls[u - 1], device,
                                           calls, floor_s, side_stream);
      units[u - 1].deferred = std::max(0.0, window - units[u - 1].forward);
      units[u].update = std::max(device, calls * floor_s);
      cost.optimizer_in_forward_s += units[u - 1].deferred;
    }
    optimizer_calls += buffers;
    cost.optimizer_s = std::max(tail_device, tail_calls * floor_s);
    optimizer_floor = std::max(0.0, tail_calls * floor_s - tail_device);
  }
  const ScheduleResult sr = Schedule(units, cost.microbatches);
  cost.compute_s = sr.compute_s;
  for (double* part : {&cost.gemm_s, &cost.attention_s, &cost.memory_s}) *part *= cost.microbatches;
  cost.comm_total_s = sr.comm_s;
  cost.floor_s = cost.floor_s * cost.microbatches + optimizer_floor;
  // The step's small all-reduces over every rank: activation and grad-output amaxes (two per
  // FP8 linear), the gradient norm and loss sums (2 floats), the weights' amaxes (one per FP8
  // linear).
  double small = 0;
  const std::string world_link = W <= per_host ? c.intra_link : c.inter_link;
  if (fp8_linears > 0) {
    small += CollectiveSeconds(c, world_link, CollectiveOp::kAllReduce, W, 8.0 * fp8_linears);
    small += CollectiveSeconds(c, world_link, CollectiveOp::kAllReduce, W, 4.0 * fp8_linears);
  }
  small += CollectiveSeconds(c, world_link, CollectiveOp::kAllReduce, W, 8.0);
  if (mesh.optimizer_over_world && R > 1) {  // the updated wire pieces gathered across replicas
    small += CollectiveSeconds(c, cost.inter_link, CollectiveOp::kAllGather, R, shard_wire);
  }
  cost.comm_total_s += small;
  cost.exposed_comm_s = sr.exposed_s + small;
  // The host's serial part: each synchronisation's round trip (the device drained, waiting for
  // the host's next call) and the worker's per-step handling; the coordinator's cycle bounds the
  // step from below.
  cost.calls = calls_per_mb * cost.microbatches + optimizer_calls;
  cost.syncs = HostSyncsPerStep(cost.microbatches, fp8_linears,
                                spec.precision().fp8().recipe() == v1::SCALING_RECIPE_CURRENT);
  cost.host_s = cost.syncs * c.sync_s + c.step_overhead_s;
  const double inner = cost.compute_s + cost.exposed_comm_s + cost.optimizer_s;
  // The coordinator's loop: no step shorter than its cycle.
  cost.host_s = std::max(inner + cost.host_s, c.step_cycle_s) - inner;
  cost.step_s = inner + cost.host_s;
  return cost;
}

}  // namespace fsdp8
