#include "train/hf_import.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/hf_model.h"
#include "common/safetensors.h"

namespace fsdp8 {
namespace {

// Elements per read: a rank holds at most this many f32 values (and their mapped bytes) beyond its
// shards while it loads.
constexpr int64_t kReadChunk = int64_t{1} << 22;

// Every tensor of the plan is in `w` with its shape and a loadable dtype, and `w` holds nothing
// else (a rotary_emb.inv_freq buffer, and lm_head.weight of a tied model, are ignored).
absl::Status CheckTensors(const HfWeights& w, const ShardPlan& plan, bool tied,
                          const std::function<absl::Status(const std::string&)>& bad) {
  std::set<std::string> wanted;
  for (const UnitPlan& u : plan.units) {
    for (const BufferPlan& b : u.buffers) {
      for (const TensorSpec& t : b.tensors) {
        wanted.insert(t.name);
        auto it = w.tensors().find(t.name);
        if (it == w.tensors().end()) return bad(absl::StrCat("tensor ", t.name, " is missing"));
        const SafetensorsTensor& st = it->second.tensor;
        if (st.shape != t.shape) {
          return bad(absl::StrCat("tensor ", t.name, " has shape [", absl::StrJoin(st.shape, ", "),
                                  "], this model needs [", absl::StrJoin(t.shape, ", "), "]"));
        }
        if (st.dtype != "F32" && st.dtype != "BF16" && st.dtype != "F16") {
          return bad(absl::StrCat("tensor ", t.name, " has dtype ", st.dtype,
                                  " (loadable: F32, BF16, F16)"));
        }
      }
    }
  }
  for (const auto& [name, unused] : w.tensors()) {
    if (!wanted.count(name) && !absl::EndsWith(name, ".rotary_emb.inv_freq") &&
        !(tied && name == "lm_head.weight")) {
      return bad(absl::StrCat("unexpected tensor ", name, " (this model has no such parameter)"));
    }
  }
  return absl::OkStatus();
}

// Sets this rank's master elements [lo, hi) of buffer (u, b) (flat-buffer indices, inside tensor
// t and its optimizer piece) from the file, in chunks of kReadChunk.
absl::Status LoadRange(const HfWeights& w, FsdpParams* params, size_t u, size_t b, size_t t,
                       int64_t lo, int64_t hi,
                       const std::function<absl::Status(const std::string&)>& bad) {
  const BufferPlan& bp = params->plan().units[u].buffers[b];
  const std::string& name = bp.tensors[t].name;
  const int64_t shard0 = params->OptimizerBegin(static_cast<int>(u), static_cast<int>(b));
  std::vector<float> chunk(static_cast<size_t>(std::min(kReadChunk, hi - lo)));
  for (int64_t c = lo; c < hi; c += kReadChunk) {
    const int64_t n = std::min(kReadChunk, hi - c);
    if (absl::Status s = w.Read(name, c - bp.offsets[t], n, chunk.data()); !s.ok()) return s;
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(chunk[i])) {
        return bad(absl::StrCat("tensor ", name, " element ", c - bp.offsets[t] + i, " is not finite"));
      }
    }
    params->UploadShardRange(static_cast<int>(u), static_cast<int>(b), ShardArray::kMaster,
                             c - shard0, chunk.data(), n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadHfWeights(Trainer* trainer, const std::string& dir) {
  const std::string field = "init.from_hf";
  if (absl::Status s = CheckHfDir(dir, trainer->spec().model(), field); !s.ok()) return s;
  absl::StatusOr<HfWeights> w = HfWeights::Open(dir);
  if (!w.ok()) return w.status();
  FsdpParams& params = trainer->params();
  const ShardPlan& plan = params.plan();
  auto bad = [&](const std::string& what) {
    return absl::FailedPreconditionError(absl::StrCat(field, ": ", dir, ": ", what));
  };
  // Everything is checked before any shard changes.
  if (absl::Status s = CheckTensors(*w, plan, trainer->spec().model().tie_word_embeddings(), bad);
      !s.ok()) {
    return s;
  }
  for (size_t u = 0; u < plan.units.size(); ++u) {
    for (size_t b = 0; b < plan.units[u].buffers.size(); ++b) {
      const BufferPlan& bp = plan.units[u].buffers[b];
      // This rank's master elements: its optimizer piece (its shard, or 1/R of it under WORLD).
      const int64_t begin = params.OptimizerBegin(static_cast<int>(u), static_cast<int>(b));
      const int64_t end = begin + params.OptimizerNumel(static_cast<int>(u), static_cast<int>(b));
      for (size_t t = 0; t < bp.tensors.size(); ++t) {
        const int64_t lo = std::max(begin, bp.offsets[t]);
        const int64_t hi = std::min(end, bp.offsets[t] + bp.tensors[t].numel);
        if (hi <= lo) continue;
        if (absl::Status s = LoadRange(*w, &params, u, b, t, lo, hi, bad); !s.ok()) return s;
      }
    }
  }
  // C08: the FP8 weight scales of the first step come from the loaded weights.
  return trainer->RecastWeights();
}

}  // namespace fsdp8
