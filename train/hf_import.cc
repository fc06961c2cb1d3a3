#include "train/hf_import.h"

#include <cmath>
#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/hf_model.h"
#include "common/safetensors.h"

namespace fsdp8 {

absl::Status LoadHfWeights(Trainer* trainer, const std::string& dir) {
  const std::string field = "init.from_hf";
  if (absl::Status s = CheckHfDir(dir, trainer->spec().model(), field); !s.ok()) return s;
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(absl::StrCat(dir, "/", kHfWeightsFile));
  if (!file.ok()) return file.status();
  const ShardPlan& plan = trainer->params().plan();
  const std::string& path = file->path();
  auto bad = [&](const std::string& what) {
    return absl::FailedPreconditionError(absl::StrCat(field, ": ", path, ": ", what));
  };
  // Everything is checked before any shard changes.
  std::set<std::string> wanted;
  for (const UnitPlan& u : plan.units) {
    for (const BufferPlan& b : u.buffers) {
      for (const TensorSpec& t : b.tensors) {
        wanted.insert(t.name);
        auto it = file->tensors().find(t.name);
        if (it == file->tensors().end()) return bad(absl::StrCat("tensor ", t.name, " is missing"));
        const SafetensorsTensor& st = it->second;
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
  for (const auto& [name, unused] : file->tensors()) {
    if (!wanted.count(name) && !absl::EndsWith(name, ".rotary_emb.inv_freq")) {
      return bad(absl::StrCat("unexpected tensor ", name, " (this model has no such parameter)"));
    }
  }
  FsdpParams& params = trainer->params();
  const int rank = params.rank();
  std::vector<float> chunk;
  for (size_t u = 0; u < plan.units.size(); ++u) {
    for (size_t b = 0; b < plan.units[u].buffers.size(); ++b) {
      const BufferPlan& bp = plan.units[u].buffers[b];
      const int64_t lo_shard = bp.ShardBegin(rank), hi_shard = bp.ShardEnd(rank);
      for (size_t t = 0; t < bp.tensors.size(); ++t) {
        const int64_t lo = std::max(lo_shard, bp.offsets[t]);
        const int64_t hi = std::min(hi_shard, bp.offsets[t] + bp.tensors[t].numel);
        if (hi <= lo) continue;
        chunk.resize(static_cast<size_t>(hi - lo));
        if (absl::Status s = file->Read(bp.tensors[t].name, lo - bp.offsets[t], hi - lo, chunk.data());
            !s.ok()) {
          return s;
        }
        for (int64_t i = 0; i < hi - lo; ++i) {
          if (!std::isfinite(chunk[i])) {
            return bad(absl::StrCat("tensor ", bp.tensors[t].name, " element ",
                                    lo - bp.offsets[t] + i, " is not finite"));
          }
        }
        params.UploadShardRange(static_cast<int>(u), static_cast<int>(b), ShardArray::kMaster,
                                lo - lo_shard, chunk.data(), hi - lo);
      }
    }
  }
  // C08: the FP8 weight scales of the first step come from the loaded weights.
  return trainer->RecastWeights();
}

}  // namespace fsdp8
