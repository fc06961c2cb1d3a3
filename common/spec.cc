#include "common/spec.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/message_differencer.h>
#include <yaml-cpp/yaml.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/hf_model.h"
#include "common/rope.h"
#include "common/token_dataset.h"
#include "common/token_shard.h"

namespace fsdp8 {

// ---------------------------------------------------------------------------------------------
// Moved fields
// ---------------------------------------------------------------------------------------------

const MovedField kMovedFields[2] = {
    {"training.gemm_autotune", "tuning.gemm_autotune"},
    {"precision.fp8.forward_fast_accumulation", "tuning.forward_fast_accumulation"},
};

namespace {

// The old places are deprecated proto fields: this is the one place that reads them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

// One moved bool as a spec holds it: whether it is set in its old place and its value there,
// whether it is set in its new place and its value there.
struct MovedBool {
  const MovedField& field;
  bool has_old, old_value, has_new, new_value;
};

std::vector<MovedBool> MovedBools(const v1::JobSpec& s) {
  return {
      {kMovedFields[0], s.training().has_gemm_autotune(), s.training().gemm_autotune(),
       s.tuning().has_gemm_autotune(), s.tuning().gemm_autotune()},
      {kMovedFields[1], s.precision().fp8().has_forward_fast_accumulation(),
       s.precision().fp8().forward_fast_accumulation(), s.tuning().has_forward_fast_accumulation(),
       s.tuning().forward_fast_accumulation()},
  };
}

// Moves field i of kMovedFields (when set in its old place) unless the new place is set, and
// clears the old place.
void MoveField(v1::JobSpec* s, int i) {
  if (i == 0 && s->training().has_gemm_autotune()) {
    if (!s->tuning().has_gemm_autotune())
      s->mutable_tuning()->set_gemm_autotune(s->training().gemm_autotune());
    s->mutable_training()->clear_gemm_autotune();
  }
  if (i == 1 && s->precision().fp8().has_forward_fast_accumulation()) {
    if (!s->tuning().has_forward_fast_accumulation())
      s->mutable_tuning()->set_forward_fast_accumulation(
          s->precision().fp8().forward_fast_accumulation());
    s->mutable_precision()->mutable_fp8()->clear_forward_fast_accumulation();
  }
}

#pragma GCC diagnostic pop

void MoveFields(v1::JobSpec* s) {
  for (int i = 0; i < 2; ++i) MoveField(s, i);
}

}  // namespace

absl::StatusOr<std::vector<std::string>> MigrateSpec(v1::JobSpec* spec) {
  std::vector<std::string> warnings;
  for (const MovedBool& m : MovedBools(*spec)) {
    if (!m.has_old) continue;
    if (m.has_new && m.new_value != m.old_value) {
      return absl::InvalidArgumentError(absl::StrCat(
          m.field.old_path, ": moved to ", m.field.new_path, ", which says ",
          m.new_value ? "true" : "false", " where the old place says ",
          m.old_value ? "true" : "false", " (give it only in ", m.field.new_path, ")"));
    }
    warnings.push_back(absl::StrCat(m.field.old_path, ": moved to ", m.field.new_path,
                                    " (read from the old place for now; write it there)"));
  }
  MoveFields(spec);
  return warnings;
}

// ---------------------------------------------------------------------------------------------
// Defaults
// ---------------------------------------------------------------------------------------------

v1::JobSpec WithDefaults(const v1::JobSpec& in, int world_size) {
  v1::JobSpec s = in;
  MoveFields(&s);
  v1::ModelConfig* m = s.mutable_model();
  if (!m->has_d_model()) m->set_d_model(128);
  if (!m->has_n_layers()) m->set_n_layers(4);
  if (!m->has_n_heads()) m->set_n_heads(4);
  if (!m->has_n_kv_heads()) m->set_n_kv_heads(m->n_heads());
  if (!m->has_ffn_dim()) m->set_ffn_dim(384);
  if (!m->has_vocab_size()) m->set_vocab_size(256);
  if (!m->has_seq_len()) m->set_seq_len(256);
  if (!m->has_rope_theta()) m->set_rope_theta(10000.0);
  if (!m->has_norm_eps()) m->set_norm_eps(1e-5);
  if (s.data().sampling() == v1::SAMPLING_UNSPECIFIED) {
    s.mutable_data()->set_sampling(v1::SAMPLING_EPOCH);
  }

  v1::TrainingSpec* t = s.mutable_training();
  if (!t->has_steps()) t->set_steps(600);
  if (!t->has_global_batch()) t->set_global_batch(16);
  if (!t->has_microbatch() && world_size > 0) {
    // At least 1, so a world larger than the batch is reported by the divisibility rule.
    t->set_microbatch(std::max(1, t->global_batch() / world_size));
  }
  if (!t->has_seed()) t->set_seed(1234);
  if (!t->has_eval_every()) t->set_eval_every(100);
  if (!t->has_eval_batches()) t->set_eval_batches(4);
  if (!t->has_deterministic()) t->set_deterministic(true);
  if (t->saved_norm_inputs() == v1::PRECISION_UNSPECIFIED) {
    t->set_saved_norm_inputs(v1::PRECISION_FP32);
  }
  if (!t->has_max_nonfinite_steps()) t->set_max_nonfinite_steps(0);
  if (!t->has_overlap_optimizer()) t->set_overlap_optimizer(true);

  v1::OptimizerSpec* o = s.mutable_optimizer();
  if (!o->has_peak_lr()) o->set_peak_lr(3e-3);
  if (!o->has_min_lr_ratio()) o->set_min_lr_ratio(0.1);
  if (!o->has_warmup_steps()) {
    // 5% of the steps, rounded to nearest, at least 1 when there is at least one step.
    int64_t w = 0;
    if (t->steps() >= 1) w = std::max<int64_t>(1, std::llround(0.05 * static_cast<double>(t->steps())));
    o->set_warmup_steps(w);
  }
  if (!o->has_beta1()) o->set_beta1(0.9);
  if (!o->has_beta2()) o->set_beta2(0.95);
  if (!o->has_eps()) o->set_eps(1e-8);
  if (!o->has_weight_decay()) o->set_weight_decay(0.1);
  if (!o->has_grad_clip()) o->set_grad_clip(1.0);
  if (o->state_precision() == v1::PRECISION_UNSPECIFIED) o->set_state_precision(v1::PRECISION_FP32);

  v1::ShardingSpec* sh = s.mutable_sharding();
  if (!sh->has_min_workers()) sh->set_min_workers(1);
  if (!sh->has_max_workers()) sh->set_max_workers(sh->min_workers());
  if (!sh->has_alignment()) sh->set_alignment(16);
  if (!sh->has_replicas()) sh->set_replicas(1);
  if (sh->optimizer_sharding() == v1::OPTIMIZER_SHARDING_UNSPECIFIED) {
    sh->set_optimizer_sharding(v1::OPTIMIZER_SHARDING_SHARD_GROUP);
  }

  v1::PrecisionSpec* p = s.mutable_precision();
  if (p->linears() == v1::PRECISION_UNSPECIFIED) p->set_linears(v1::PRECISION_FP8);
  if (p->embedding() == v1::PRECISION_UNSPECIFIED) p->set_embedding(v1::PRECISION_BF16);
  if (p->lm_head() == v1::PRECISION_UNSPECIFIED) p->set_lm_head(v1::PRECISION_BF16);
  if (p->attention() == v1::PRECISION_UNSPECIFIED) p->set_attention(v1::PRECISION_FP32);
  v1::Fp8Recipe* r = p->mutable_fp8();
  if (r->granularity() == v1::FP8_GRANULARITY_UNSPECIFIED) {
    r->set_granularity(v1::FP8_GRANULARITY_TENSORWISE);
  }
  // Rowwise and blockwise scale every tensor from its own amax (no history): current scaling.
  const bool scaled = r->granularity() != v1::FP8_GRANULARITY_TENSORWISE;
  if (r->recipe() == v1::SCALING_RECIPE_UNSPECIFIED) {
    r->set_recipe(scaled ? v1::SCALING_RECIPE_CURRENT : v1::SCALING_RECIPE_DELAYED);
  }
  // Blockwise: E4M3 grad-outputs too (DeepSeek-V3, TransformerEngine Float8BlockScaling).
  if (r->format() == v1::FP8_FORMAT_UNSPECIFIED) {
    r->set_format(r->granularity() == v1::FP8_GRANULARITY_BLOCKWISE ? v1::FP8_FORMAT_E4M3
                                                                    : v1::FP8_FORMAT_HYBRID);
  }
  if (!r->has_amax_history_len()) r->set_amax_history_len(16);
  if (r->amax_algorithm() == v1::AMAX_ALGORITHM_UNSPECIFIED) r->set_amax_algorithm(v1::AMAX_ALGORITHM_MAX);
  if (!r->has_margin()) r->set_margin(0);
  if (!r->has_fused_projections()) r->set_fused_projections(true);
  if (!r->has_keep_weight_codes()) r->set_keep_weight_codes(true);

  v1::CheckpointSpec* c = s.mutable_checkpoint();
  if (!c->has_every_steps()) c->set_every_steps(0);
  if (!c->has_keep_last()) c->set_keep_last(3);
  if (!c->has_max_failed_saves()) c->set_max_failed_saves(3);
  if (!s.has_max_restarts()) s.set_max_restarts(c->dir().empty() ? 0 : 3);

  if (s.backend().empty()) s.set_backend("cpu");

  v1::TuningSpec* tu = s.mutable_tuning();
  if (!tu->has_gemm_autotune()) tu->set_gemm_autotune(false);
  if (!tu->has_forward_fast_accumulation()) tu->set_forward_fast_accumulation(true);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------
namespace {

absl::Status Bad(const std::string& path, const std::string& rule, const std::string& detail) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", rule, " (", detail, ")"));
}

#define FSDP8_RETURN_IF_ERROR(expr)        \
  do {                                     \
    absl::Status _st = (expr);             \
    if (!_st.ok()) return _st;             \
  } while (0)

absl::Status Positive(const std::string& path, int64_t v) {
  if (v > 0) return absl::OkStatus();
  return Bad(path, "must be > 0", absl::StrCat("got ", v));
}

absl::Status NonNegative(const std::string& path, double v) {
  if (v >= 0 && std::isfinite(v)) return absl::OkStatus();
  return Bad(path, "must be >= 0 and finite", absl::StrCat("got ", v));
}

const char* PrecisionName(v1::Precision p) {
  switch (p) {
    case v1::PRECISION_FP8: return "FP8";
    case v1::PRECISION_BF16: return "BF16";
    case v1::PRECISION_FP32: return "FP32";
    default: return "UNSPECIFIED";
  }
}

// True when normalised absolute `path` lies under (or is) normalised absolute `root`.
bool Under(const std::filesystem::path& path, const std::filesystem::path& root) {
  auto p = path.begin();
  for (auto r = root.begin(); r != root.end(); ++r) {
    if (r->empty()) continue;  // trailing separator of "/a/b/"
    if (p == path.end() || *p != *r) return false;
    ++p;
  }
  return true;
}

absl::Status CheckDataPath(const std::string& field, const std::string& value,
                           const std::vector<std::string>& roots) {
  if (roots.empty()) return absl::OkStatus();
  const std::filesystem::path p = std::filesystem::path(value).lexically_normal();
  if (!p.is_absolute()) {
    return Bad(field, "must be an absolute path when data roots are configured",
               absl::StrCat("got \"", value, "\""));
  }
  // Lexically first (".." cannot climb out), then with every symlink of the existing part of the
  // path resolved, so that a link inside a root pointing outside it does not pass either.
  std::error_code ec;
  const std::filesystem::path real = std::filesystem::weakly_canonical(p, ec);
  if (ec) {
    return Bad(field, "must be resolvable under the data roots",
               absl::StrCat("\"", value, "\": ", ec.message()));
  }
  bool lexical = false;
  for (const std::string& r : roots) {
    if (r.empty()) continue;
    if (!Under(p, std::filesystem::path(r).lexically_normal())) continue;
    lexical = true;
    std::error_code rec;
    const std::filesystem::path root_real = std::filesystem::weakly_canonical(r, rec);
    if (!rec && Under(real, root_real)) return absl::OkStatus();
  }
  if (lexical) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": must lie under one of the data roots (", absl::StrJoin(roots, ", "),
        ") after resolving symlinks (\"", value, "\" resolves to \"", real.string(), "\")"));
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": must lie under one of the data roots (",
                                                 absl::StrJoin(roots, ", "), ")"));
}

// A dataset (file, directory or glob; common/token_dataset.h): every shard under the data roots
// and a readable token shard; together at least one window of seq_len + 1 tokens.
absl::Status CheckDataset(const std::string& field, const std::string& value, int seq_len,
                          const std::vector<std::string>& roots) {
  absl::StatusOr<std::vector<std::string>> shards = ExpandShardPaths(value);
  if (!shards.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must name token shards (", shards.status().message(), ")"));
  }
  int64_t tokens = 0, windows = 0;
  for (const std::string& shard : *shards) {
    FSDP8_RETURN_IF_ERROR(CheckDataPath(field, shard, roots));
    absl::StatusOr<TokenShardHeader> h = ReadTokenShardHeader(shard);
    if (!h.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": must be a readable token shard (", h.status().message(), ")"));
    }
    tokens += h->num_tokens;
    windows += ShardWindows(h->num_tokens, seq_len);
  }
  // Same rule as DataOrder and the worker's loader: one window needs seq_len + 1 tokens of a shard.
  if (windows == 0) {
    return Bad(field, "too few tokens for one sequence",
               absl::StrCat(tokens, " tokens, need at least seq_len + 1 = ",
                            static_cast<int64_t>(seq_len) + 1, " in one shard (",
                            shards->size(), " shards)"));
  }
  return absl::OkStatus();
}

// checkpoint.*: see ValidateSpec in spec.h.
absl::Status CheckCheckpointSpec(const v1::CheckpointSpec& c,
                                 const std::vector<std::string>& roots) {
  if (c.every_steps() < 0) {
    return Bad("checkpoint.every_steps", "must be >= 0", absl::StrCat("got ", c.every_steps()));
  }
  if (c.max_failed_saves() < 1) {
    return Bad("checkpoint.max_failed_saves", "must be >= 1",
               absl::StrCat("got ", c.max_failed_saves()));
  }
  if (c.keep_last() < 1) {
    return Bad("checkpoint.keep_last", "must be >= 1", absl::StrCat("got ", c.keep_last()));
  }
  if (c.dir().empty()) {
    if (c.every_steps() > 0) {
      return Bad("checkpoint.every_steps", "needs checkpoint.dir",
                 absl::StrCat("every_steps ", c.every_steps(), " but no checkpoint.dir"));
    }
    if (!c.resume_from().empty()) {
      return Bad("checkpoint.resume_from", "needs checkpoint.dir",
                 absl::StrCat("resume_from \"", c.resume_from(), "\" but no checkpoint.dir"));
    }
    if (c.take_over()) {
      return Bad("checkpoint.take_over", "needs checkpoint.dir", "take_over true but no checkpoint.dir");
    }
    return absl::OkStatus();
  }
  FSDP8_RETURN_IF_ERROR(CheckDataPath("checkpoint.dir", c.dir(), roots));
  if (c.resume_from().empty() || c.resume_from() == "latest") return absl::OkStatus();
  // Without a trailing separator, so that "dir/" and "dir" compare equal.
  auto clean = [](const std::string& v) {
    std::filesystem::path p = std::filesystem::path(v).lexically_normal();
    return p.has_filename() ? p : p.parent_path();
  };
  const std::filesystem::path dir = clean(c.dir());
  const std::filesystem::path from = clean(c.resume_from());
  if (from == dir || !Under(from, dir)) {
    return Bad("checkpoint.resume_from",
               "must be empty, \"latest\" or a step directory under checkpoint.dir",
               absl::StrCat("got \"", c.resume_from(), "\", checkpoint.dir \"", c.dir(), "\""));
  }
  return absl::OkStatus();
}

// model.*: sizes, head and vocabulary shape, RoPE and RMSNorm constants.
absl::Status CheckModel(const v1::ModelConfig& m) {
  FSDP8_RETURN_IF_ERROR(Positive("model.d_model", m.d_model()));
  FSDP8_RETURN_IF_ERROR(Positive("model.n_layers", m.n_layers()));
  FSDP8_RETURN_IF_ERROR(Positive("model.n_heads", m.n_heads()));
  FSDP8_RETURN_IF_ERROR(Positive("model.n_kv_heads", m.n_kv_heads()));
  FSDP8_RETURN_IF_ERROR(Positive("model.ffn_dim", m.ffn_dim()));
  FSDP8_RETURN_IF_ERROR(Positive("model.vocab_size", m.vocab_size()));
  FSDP8_RETURN_IF_ERROR(Positive("model.seq_len", m.seq_len()));
  if (m.d_model() % m.n_heads() != 0) {
    return Bad("model.d_model", "must be divisible by model.n_heads",
               absl::StrCat(m.d_model(), " % ", m.n_heads(), " != 0"));
  }
  if ((m.d_model() / m.n_heads()) % 2 != 0) {
    return Bad("model.d_model", "head dimension d_model / n_heads must be even for RoPE",
               absl::StrCat(m.d_model(), " / ", m.n_heads(), " = ", m.d_model() / m.n_heads()));
  }
  if (m.n_heads() % m.n_kv_heads() != 0) {
    return Bad("model.n_heads", "must be divisible by model.n_kv_heads",
               absl::StrCat(m.n_heads(), " % ", m.n_kv_heads(), " != 0"));
  }
  if (m.vocab_size() > kMaxVocabSize) {
    return Bad("model.vocab_size", absl::StrCat("must be <= ", kMaxVocabSize),
               absl::StrCat("got ", m.vocab_size()));
  }
  if (!(m.rope_theta() > 0) || !std::isfinite(m.rope_theta())) {
    return Bad("model.rope_theta", "must be > 0 and finite", absl::StrCat("got ", m.rope_theta()));
  }
  if (!(m.norm_eps() > 0) || !std::isfinite(m.norm_eps())) {
    return Bad("model.norm_eps", "must be > 0 and finite", absl::StrCat("got ", m.norm_eps()));
  }
  return CheckRopeScaling(m);
}

// training.*: step counts, batch sizes (against world_size when > 0), evaluation.
absl::Status CheckTraining(const v1::TrainingSpec& t, int world_size) {
  FSDP8_RETURN_IF_ERROR(Positive("training.steps", t.steps()));
  FSDP8_RETURN_IF_ERROR(Positive("training.global_batch", t.global_batch()));
  if (t.has_microbatch()) FSDP8_RETURN_IF_ERROR(Positive("training.microbatch", t.microbatch()));
  if (t.eval_every() < 0) {
    return Bad("training.eval_every", "must be >= 0", absl::StrCat("got ", t.eval_every()));
  }
  if (t.free_running() && t.eval_every() != 0) {
    return Bad("training.free_running", "needs training.eval_every: 0 (no validation in free-running steps)",
               absl::StrCat("got eval_every ", t.eval_every()));
  }
  FSDP8_RETURN_IF_ERROR(Positive("training.eval_batches", t.eval_batches()));
  if (t.max_nonfinite_steps() < 0 || t.max_nonfinite_steps() > t.steps()) {
    return Bad("training.max_nonfinite_steps",
               "must be in [0, training.steps] (non-finite steps skipped before the job fails)",
               absl::StrCat("got ", t.max_nonfinite_steps(), ", steps ", t.steps()));
  }
  if (t.saved_norm_inputs() != v1::PRECISION_FP32 && t.saved_norm_inputs() != v1::PRECISION_BF16) {
    return Bad("training.saved_norm_inputs", "must be FP32 or BF16",
               absl::StrCat("got ", PrecisionName(t.saved_norm_inputs())));
  }
  if (world_size > 0) {
    const int64_t denom = static_cast<int64_t>(world_size) * t.microbatch();
    if (t.global_batch() % denom != 0) {
      return Bad("training.global_batch",
                 "must be divisible by world_size * training.microbatch",
                 absl::StrCat(t.global_batch(), " % (", world_size, " * ", t.microbatch(),
                              ") != 0"));
    }
  }
  return absl::OkStatus();
}

// optimizer.*: AdamW hyperparameters and the schedule (warmup within training.steps).
absl::Status CheckOptimizer(const v1::OptimizerSpec& o, int64_t steps) {
  if (!(o.peak_lr() > 0) || !std::isfinite(o.peak_lr())) {
    return Bad("optimizer.peak_lr", "must be > 0 and finite", absl::StrCat("got ", o.peak_lr()));
  }
  if (!(o.min_lr_ratio() >= 0 && o.min_lr_ratio() <= 1)) {
    return Bad("optimizer.min_lr_ratio", "must be in [0, 1]", absl::StrCat("got ", o.min_lr_ratio()));
  }
  if (o.warmup_steps() < 0 || o.warmup_steps() > steps) {
    return Bad("optimizer.warmup_steps", "must be in [0, training.steps]",
               absl::StrCat("got ", o.warmup_steps(), ", steps ", steps));
  }
  if (!(o.beta1() >= 0 && o.beta1() < 1)) {
    return Bad("optimizer.beta1", "must be in [0, 1)", absl::StrCat("got ", o.beta1()));
  }
  if (!(o.beta2() >= 0 && o.beta2() < 1)) {
    return Bad("optimizer.beta2", "must be in [0, 1)", absl::StrCat("got ", o.beta2()));
  }
  if (!(o.eps() > 0) || !std::isfinite(o.eps())) {
    return Bad("optimizer.eps", "must be > 0 and finite", absl::StrCat("got ", o.eps()));
  }
  FSDP8_RETURN_IF_ERROR(NonNegative("optimizer.weight_decay", o.weight_decay()));
  FSDP8_RETURN_IF_ERROR(NonNegative("optimizer.grad_clip", o.grad_clip()));
  if (o.state_precision() != v1::PRECISION_FP32 && o.state_precision() != v1::PRECISION_BF16) {
    return Bad("optimizer.state_precision", "must be FP32 or BF16",
               absl::StrCat("got ", PrecisionName(o.state_precision())));
  }
  // A BF16 second moment keeps 8 significant bits: above beta2 0.99 its decay (1 - beta2) v falls
  // below half its rounding step (2^-9 to 2^-8 of v) and rounds away, so v could only grow.
  if (o.state_precision() == v1::PRECISION_BF16 && o.beta2() > 0.99) {
    return Bad("optimizer.beta2", "must be <= 0.99 with optimizer.state_precision BF16",
               absl::StrCat("got ", o.beta2()));
  }
  return absl::OkStatus();
}

// sharding.*: the world-size range, the shard alignment and the mesh (replicas dividing the
// world size when both are known; 0 = auto is resolved by the coordinator's placement).
absl::Status CheckSharding(const v1::ShardingSpec& sh, int world_size) {
  if (sh.min_workers() < 1) {
    return Bad("sharding.min_workers", "must be >= 1", absl::StrCat("got ", sh.min_workers()));
  }
  if (sh.max_workers() < sh.min_workers()) {
    return Bad("sharding.max_workers", "must be >= sharding.min_workers",
               absl::StrCat(sh.max_workers(), " < ", sh.min_workers()));
  }
  if (sh.alignment() < 1) {
    return Bad("sharding.alignment", "must be >= 1", absl::StrCat("got ", sh.alignment()));
  }
  if (sh.replicas() < 0) {
    return Bad("sharding.replicas", "must be >= 1, or 0 (auto)", absl::StrCat("got ", sh.replicas()));
  }
  if (sh.replicas() > 0 && sh.replicas() > sh.max_workers()) {
    return Bad("sharding.replicas", "must be <= sharding.max_workers",
               absl::StrCat(sh.replicas(), " > ", sh.max_workers()));
  }
  if (world_size > 0 && sh.replicas() > 0 && world_size % sh.replicas() != 0) {
    return Bad("sharding.replicas", "must divide the world size",
               absl::StrCat(world_size, " % ", sh.replicas(), " != 0"));
  }
  return absl::OkStatus();
}

// sharding.elastic at a world size (R > 1 known, microbatch defaulted): the survivors of every
// smaller mesh R' x S (R' in 1..R-1) split the global batch into whole microbatches, so that
// continuing on fewer replicas keeps the tokens per step exactly.
absl::Status CheckElastic(const v1::JobSpec& spec, int world_size) {
  const v1::ShardingSpec& sh = spec.sharding();
  const v1::TrainingSpec& t = spec.training();
  if (!sh.elastic() || world_size <= 0 || sh.replicas() <= 1 || t.microbatch() <= 0 ||
      world_size % sh.replicas() != 0)
    return absl::OkStatus();
  const int64_t s = world_size / sh.replicas();
  for (int r = 1; r < sh.replicas(); ++r) {
    const int64_t denom = s * r * t.microbatch();
    if (t.global_batch() % denom != 0) {
      return Bad("sharding.elastic",
                 "needs training.global_batch divisible by S x R' x training.microbatch for "
                 "every R' in 1..sharding.replicas-1 (the surviving replicas take a lost "
                 "replica's microbatches)",
                 absl::StrCat("S = ", s, ", R' = ", r, ": ", t.global_batch(), " % (", s, " * ",
                              r, " * ", t.microbatch(), ") != 0"));
    }
  }
  return absl::OkStatus();
}

// precision.overrides[*]: one per layer, each in [0, n_layers) with its linears' precision set.
absl::Status CheckPrecisionOverrides(const v1::PrecisionSpec& p, int n_layers) {
  std::map<int, int> seen;  // layer -> override index
  for (int i = 0; i < p.overrides_size(); ++i) {
    const v1::LayerPrecision& lp = p.overrides(i);
    const std::string at = absl::StrCat("precision.overrides[", i, "]");
    if (lp.layer() < 0 || lp.layer() >= n_layers) {
      return Bad(at + ".layer", "must be in [0, model.n_layers)",
                 absl::StrCat(lp.layer(), " not in [0, ", n_layers, ")"));
    }
    auto [it, inserted] = seen.emplace(lp.layer(), i);
    if (!inserted) {
      return Bad(at + ".layer", "duplicate override",
                 absl::StrCat("layer ", lp.layer(), " also in precision.overrides[", it->second, "]"));
    }
    if (lp.linears() == v1::PRECISION_UNSPECIFIED) {
      return Bad(at + ".linears", "must be set", "FP8, BF16 or FP32");
    }
    if (!v1::Fp8Granularity_IsValid(lp.granularity())) {
      return Bad(at + ".granularity", "must be TENSORWISE, ROWWISE or BLOCKWISE",
                 absl::StrCat("undefined value ", static_cast<int>(lp.granularity())));
    }
    if (lp.granularity() != v1::FP8_GRANULARITY_UNSPECIFIED &&
        lp.linears() != v1::PRECISION_FP8) {
      return Bad(at + ".granularity", "applies to FP8 linears only",
                 absl::StrCat("linears ", PrecisionName(lp.linears()), ", granularity ",
                              GranularityName(lp.granularity())));
    }
  }
  return absl::OkStatus();
}

// The rowwise / blockwise recipes: current scaling only, and only the combinations built so far.
absl::Status CheckGranularity(const v1::JobSpec& spec) {
  const v1::Fp8Recipe& r = spec.precision().fp8();
  if (!v1::Fp8Granularity_IsValid(r.granularity())) {
    return Bad("precision.fp8.granularity", "must be TENSORWISE, ROWWISE or BLOCKWISE",
               absl::StrCat("undefined value ", static_cast<int>(r.granularity())));
  }
  if (r.granularity() != v1::FP8_GRANULARITY_TENSORWISE &&
      r.recipe() == v1::SCALING_RECIPE_DELAYED) {
    return Bad("precision.fp8.recipe",
               absl::StrCat("must be CURRENT with precision.fp8.granularity ",
                            GranularityName(r.granularity()),
                            " (rowwise and blockwise scale each tensor from its own amax: no "
                            "amax history)"),
               "got DELAYED");
  }
  return absl::OkStatus();
}

// precision.*: the non-linear layers' precisions, the FP8 recipe, the per-layer overrides.
absl::Status CheckPrecision(const v1::PrecisionSpec& p, int n_layers) {
  if (p.embedding() != v1::PRECISION_BF16 && p.embedding() != v1::PRECISION_FP32) {
    return Bad("precision.embedding", "must be BF16 or FP32",
               absl::StrCat("got ", PrecisionName(p.embedding())));
  }
  if (p.lm_head() != v1::PRECISION_BF16 && p.lm_head() != v1::PRECISION_FP32) {
    return Bad("precision.lm_head", "must be BF16 or FP32",
               absl::StrCat("got ", PrecisionName(p.lm_head())));
  }
  if (p.attention() != v1::PRECISION_BF16 && p.attention() != v1::PRECISION_FP32) {
    return Bad("precision.attention", "must be BF16 or FP32",
               absl::StrCat("got ", PrecisionName(p.attention())));
  }
  if (p.fp8().amax_history_len() < 1) {
    return Bad("precision.fp8.amax_history_len", "must be >= 1",
               absl::StrCat("got ", p.fp8().amax_history_len()));
  }
  if (p.fp8().margin() < 0) {
    return Bad("precision.fp8.margin", "must be >= 0", absl::StrCat("got ", p.fp8().margin()));
  }
  return CheckPrecisionOverrides(p, n_layers);
}

// init.from_checkpoint and its flags: see ValidateSpec in spec.h.
absl::Status CheckInitFromCheckpoint(const v1::InitSpec& init,
                                     const std::vector<std::string>& roots) {
  if (init.from_checkpoint().empty()) {
    if (init.load_optimizer_state() || init.load_fp8_state()) {
      return Bad(init.load_optimizer_state() ? "init.load_optimizer_state" : "init.load_fp8_state",
                 "needs init.from_checkpoint", "true but no init.from_checkpoint");
    }
    return absl::OkStatus();
  }
  if (!init.from_hf().empty()) {
    return Bad("init.from_checkpoint", "cannot be combined with init.from_hf",
               "both are set: pick one source of the initial weights");
  }
  return CheckDataPath("init.from_checkpoint", init.from_checkpoint(), roots);
}

// data.*, checkpoint.*, init.*: the paths, under the data roots when there are any.
absl::Status CheckPaths(const v1::JobSpec& spec, const std::vector<std::string>& data_roots) {
  const v1::DataSpec& d = spec.data();
  if (d.train_path().empty()) return absl::InvalidArgumentError("data.train_path: required");
  if (d.sampling() != v1::SAMPLING_EPOCH && d.sampling() != v1::SAMPLING_RANDOM) {
    return Bad("data.sampling", "must be EPOCH or RANDOM",
               absl::StrCat("got ", static_cast<int>(d.sampling())));
  }
  FSDP8_RETURN_IF_ERROR(CheckDataPath("data.train_path", d.train_path(), data_roots));
  if (!d.val_path().empty()) {
    FSDP8_RETURN_IF_ERROR(CheckDataPath("data.val_path", d.val_path(), data_roots));
  }
  FSDP8_RETURN_IF_ERROR(CheckCheckpointSpec(spec.checkpoint(), data_roots));
  if (!spec.init().from_hf().empty()) {
    FSDP8_RETURN_IF_ERROR(CheckDataPath("init.from_hf", spec.init().from_hf(), data_roots));
  }
  return CheckInitFromCheckpoint(spec.init(), data_roots);
}

// The files the paths name: token shards long enough for one sequence, a compatible HF model.
absl::Status CheckFiles(const v1::JobSpec& spec, const std::vector<std::string>& roots) {
  const v1::DataSpec& d = spec.data();
  const int seq_len = spec.model().seq_len();
  FSDP8_RETURN_IF_ERROR(CheckDataset("data.train_path", d.train_path(), seq_len, roots));
  if (!d.val_path().empty()) {
    FSDP8_RETURN_IF_ERROR(CheckDataset("data.val_path", d.val_path(), seq_len, roots));
  }
  if (!spec.init().from_hf().empty()) {
    FSDP8_RETURN_IF_ERROR(CheckHfDir(spec.init().from_hf(), spec.model(), "init.from_hf"));
  }
  return absl::OkStatus();
}

bool IsPathField(const google::protobuf::FieldDescriptor* f) {
  static const std::set<std::string>* paths = new std::set<std::string>{
      "fsdp8.v1.DataSpec.train_path",       "fsdp8.v1.DataSpec.val_path",
      "fsdp8.v1.CheckpointSpec.dir",        "fsdp8.v1.CheckpointSpec.resume_from",
      "fsdp8.v1.InitSpec.from_hf",          "fsdp8.v1.InitSpec.from_checkpoint"};
  return paths->count(f->full_name()) > 0;
}

// Every string field of `m` (set ones, recursively) within its limit.
absl::Status CheckStringLimits(const google::protobuf::Message& m, const std::string& prefix) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const FieldDescriptor* f : fields) {
    const std::string path = prefix.empty() ? f->name() : absl::StrCat(prefix, ".", f->name());
    const int n = f->is_repeated() ? r->FieldSize(m, f) : 1;
    for (int i = 0; i < n; ++i) {
      const std::string at = f->is_repeated() ? absl::StrCat(path, "[", i, "]") : path;
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        const auto& sub = f->is_repeated() ? r->GetRepeatedMessage(m, f, i) : r->GetMessage(m, f);
        FSDP8_RETURN_IF_ERROR(CheckStringLimits(sub, at));
      } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
        const std::string v = f->is_repeated() ? r->GetRepeatedString(m, f, i) : r->GetString(m, f);
        const int64_t limit = IsPathField(f) ? kMaxPathBytes : kMaxNameBytes;
        if (static_cast<int64_t>(v.size()) > limit) {
          return Bad(at, absl::StrCat("longer than the limit of ", limit, " bytes"),
                     absl::StrCat("got ", v.size()));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> ReadSpecFile(const std::string& path) {
  auto io_error = [&](const char* what) {
    return absl::NotFoundError(absl::StrCat(path, ": ", what, ": ", std::strerror(errno)));
  };
  auto too_big = [&](const std::string& size) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", size, " exceeds the limit of ",
                                                   kMaxSpecBytes, " bytes on a job spec"));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot read");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    absl::Status e = io_error("cannot stat");
    ::close(fd);
    return e;
  }
  if (S_ISREG(st.st_mode) && st.st_size > kMaxSpecBytes) {
    ::close(fd);
    return too_big(absl::StrCat(st.st_size, " bytes"));
  }
  // Read at most one byte beyond the limit: that byte tells a file that grew (or a pipe) too big.
  std::string text(static_cast<size_t>(kMaxSpecBytes) + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status e = io_error("cannot read");
      ::close(fd);
      return e;
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (static_cast<int64_t>(got) > kMaxSpecBytes) {
    return too_big(absl::StrCat("more than ", kMaxSpecBytes, " bytes"));
  }
  text.resize(got);
  return text;
}

absl::Status CheckSpecLimits(const v1::JobSpec& spec) {
  const int64_t bytes = static_cast<int64_t>(spec.ByteSizeLong());
  if (bytes > kMaxSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat("spec: serialized size ", bytes,
                                                   " bytes exceeds the limit of ", kMaxSpecBytes,
                                                   " bytes"));
  }
  return CheckStringLimits(spec, "");
}

absl::Status ValidateSpec(const v1::JobSpec& spec_in, int world_size,
                          const std::vector<std::string>& data_roots, bool check_files) {
  FSDP8_RETURN_IF_ERROR(CheckSpecLimits(spec_in));
  const v1::JobSpec spec = WithDefaults(spec_in, world_size);
  FSDP8_RETURN_IF_ERROR(CheckModel(spec.model()));
  FSDP8_RETURN_IF_ERROR(CheckTraining(spec.training(), world_size));
  FSDP8_RETURN_IF_ERROR(CheckOptimizer(spec.optimizer(), spec.training().steps()));
  FSDP8_RETURN_IF_ERROR(CheckSharding(spec.sharding(), world_size));
  FSDP8_RETURN_IF_ERROR(CheckElastic(spec, world_size));
  FSDP8_RETURN_IF_ERROR(CheckPrecision(spec.precision(), spec.model().n_layers()));
  FSDP8_RETURN_IF_ERROR(CheckGranularity(spec));
  // Under WORLD a rank holds only its 1/R piece of the master weights: its shard group's FP8
  // codes cannot be cast per gather from them, so they must be kept.
  if (spec.sharding().optimizer_sharding() == v1::OPTIMIZER_SHARDING_WORLD &&
      spec.sharding().replicas() != 1 && !spec.precision().fp8().keep_weight_codes()) {
    return Bad("precision.fp8.keep_weight_codes",
               "must be true with sharding.optimizer_sharding WORLD and sharding.replicas other "
               "than 1",
               "got false");
  }
  if (spec.backend() != "cpu" && spec.backend() != "cuda") {
    return Bad("backend", "must be \"cpu\" or \"cuda\"", absl::StrCat("got \"", spec.backend(), "\""));
  }
  FSDP8_RETURN_IF_ERROR(CheckPaths(spec, data_roots));
  if (spec.max_restarts() < 0) {
    return Bad("max_restarts", "must be >= 0", absl::StrCat("got ", spec.max_restarts()));
  }
  if (check_files) FSDP8_RETURN_IF_ERROR(CheckFiles(spec, data_roots));
  return absl::OkStatus();
}

absl::StatusOr<v1::JobSpec> ResolveSpec(const v1::JobSpec& spec, int world_size,
                                        const std::vector<std::string>& data_roots,
                                        bool check_files, std::vector<std::string>* warnings) {
  FSDP8_RETURN_IF_ERROR(CheckSpecLimits(spec));
  v1::JobSpec moved = spec;
  absl::StatusOr<std::vector<std::string>> w = MigrateSpec(&moved);
  if (!w.ok()) return w.status();
  if (warnings != nullptr) warnings->insert(warnings->end(), w->begin(), w->end());
  v1::JobSpec resolved = WithDefaults(moved, world_size);
  FSDP8_RETURN_IF_ERROR(ValidateSpec(resolved, world_size, data_roots, check_files));
  return resolved;
}

v1::JobSpec MigrateStoredSpec(const v1::JobSpec& stored) { return WithDefaults(stored, 0); }

v1::ModelConfig DefaultedModel(const v1::ModelConfig& model) {
  v1::JobSpec s;
  *s.mutable_model() = model;
  return WithDefaults(s, 0).model();
}

absl::Status CheckDefaulted(const v1::JobSpec& spec, int world_size) {
  const v1::JobSpec resolved = WithDefaults(spec, world_size);
  google::protobuf::util::MessageDifferencer diff;
  std::string what;
  diff.ReportDifferencesToString(&what);
  if (!diff.Compare(spec, resolved)) {
    const size_t nl = what.find('\n');
    if (nl != std::string::npos) what.resize(nl);
    return absl::InvalidArgumentError(
        absl::StrCat("spec: not resolved at world size ", world_size,
                     " (the coordinator resolves a job's spec, ResolveSpec): ", what));
  }
  return absl::OkStatus();
}

absl::Status CheckResolved(const v1::JobSpec& spec, int world_size) {
  FSDP8_RETURN_IF_ERROR(CheckDefaulted(spec, world_size));
  return ValidateSpec(spec, world_size, {}, /*check_files=*/false);
}

// ---------------------------------------------------------------------------------------------
// Parsing: YAML (or JSON, which yaml-cpp reads as YAML flow style) -> JSON guided by the message
// descriptors -> protobuf's JSON parser.
// ---------------------------------------------------------------------------------------------
namespace {

using google::protobuf::Descriptor;
using google::protobuf::EnumDescriptor;
using google::protobuf::FieldDescriptor;

std::string Where(const YAML::Node& n) {
  const YAML::Mark mk = n.Mark();
  if (mk.is_null()) return "";
  return absl::StrCat(" (line ", int64_t{mk.line} + 1, ", column ", int64_t{mk.column} + 1, ")");
}

std::string JsonQuote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

bool IsQuoted(const YAML::Node& n) { return n.Tag() == "!"; }

bool IsNullScalar(const YAML::Node& n) {
  if (n.IsNull()) return true;
  if (!n.IsScalar() || IsQuoted(n)) return false;
  const std::string& v = n.Scalar();
  return v == "~" || v == "null" || v == "Null" || v == "NULL";
}

// Parses a plain YAML scalar as a number; writes its JSON spelling.
bool NumberToJson(const std::string& v, bool want_integer, std::string* json) {
  if (v.empty()) return false;
  errno = 0;
  char* end = nullptr;
  if (v[0] != '-') {
    unsigned long long u = std::strtoull(v.c_str(), &end, 10);
    if (errno == 0 && end == v.c_str() + v.size() && v[0] != '+' && v[0] != ' ') {
      *json = std::to_string(u);
      return true;
    }
  } else {
    errno = 0;
    long long i = std::strtoll(v.c_str(), &end, 10);
    if (errno == 0 && end == v.c_str() + v.size()) {
      *json = std::to_string(i);
      return true;
    }
  }
  if (want_integer) return false;
  std::string low = absl::AsciiStrToLower(v);
  if (low == ".inf" || low == "+.inf") { *json = "\"Infinity\""; return true; }
  if (low == "-.inf") { *json = "\"-Infinity\""; return true; }
  if (low == ".nan") { *json = "\"NaN\""; return true; }
  errno = 0;
  double d = std::strtod(v.c_str(), &end);
  if (errno != 0 || end != v.c_str() + v.size() || !std::isfinite(d) || std::isspace(
      static_cast<unsigned char>(v[0]))) {
    return false;
  }
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", d);
  *json = buf;
  return true;
}

// Short enum spellings accepted besides the full value names (case-insensitive).
const std::map<std::string, std::map<std::string, std::string>>& ShortEnumNames() {
  static const auto* m = new std::map<std::string, std::map<std::string, std::string>>{
      {"fsdp8.v1.Precision",
       {{"fp8", "PRECISION_FP8"}, {"bf16", "PRECISION_BF16"}, {"fp32", "PRECISION_FP32"}}},
      {"fsdp8.v1.ScalingRecipe",
       {{"delayed", "SCALING_RECIPE_DELAYED"}, {"current", "SCALING_RECIPE_CURRENT"}}},
      {"fsdp8.v1.Sampling", {{"epoch", "SAMPLING_EPOCH"}, {"random", "SAMPLING_RANDOM"}}},
      {"fsdp8.v1.Fp8Format", {{"hybrid", "FP8_FORMAT_HYBRID"}, {"e4m3", "FP8_FORMAT_E4M3"}}},
      {"fsdp8.v1.Fp8Granularity",
       {{"tensorwise", "FP8_GRANULARITY_TENSORWISE"},
        {"rowwise", "FP8_GRANULARITY_ROWWISE"},
        {"blockwise", "FP8_GRANULARITY_BLOCKWISE"}}},
      {"fsdp8.v1.AmaxAlgorithm",
       {{"max", "AMAX_ALGORITHM_MAX"}, {"most_recent", "AMAX_ALGORITHM_MOST_RECENT"}}},
      {"fsdp8.v1.OptimizerSharding",
       {{"shard_group", "OPTIMIZER_SHARDING_SHARD_GROUP"}, {"world", "OPTIMIZER_SHARDING_WORLD"}}},
  };
  return *m;
}

absl::Status ValueToJson(const YAML::Node& n, const FieldDescriptor* f, const std::string& path,
                         std::string* out);

absl::Status MessageToJson(const YAML::Node& n, const Descriptor* d, const std::string& path,
                           std::string* out) {
  if (!n.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.empty() ? "spec" : path, ": expected a mapping", Where(n)));
  }
  std::set<const FieldDescriptor*> seen;
  *out += "{";
  bool first = true;
  for (auto it = n.begin(); it != n.end(); ++it) {
    // A copy: it-> returns a proxy that dies with the expression (a reference would dangle).
    const YAML::Node key = it->first;
    if (!key.IsScalar()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path.empty() ? "spec" : path, ": keys must be plain names", Where(key)));
    }
    const std::string& k = key.Scalar();
    const FieldDescriptor* f = d->FindFieldByName(k);
    if (f == nullptr) {
      for (int i = 0; i < d->field_count(); ++i) {
        if (d->field(i)->json_name() == k) f = d->field(i);
      }
    }
    const std::string fpath = path.empty() ? k : absl::StrCat(path, ".", k);
    if (f == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(fpath, ": unknown field \"", k, "\"", Where(key)));
    }
    if (!seen.insert(f).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(fpath, ": field given twice", Where(key)));
    }
    if (IsNullScalar(it->second)) continue;  // null = unset
    if (!first) *out += ",";
    first = false;
    *out += JsonQuote(f->name());
    *out += ":";
    if (f->is_repeated()) {
      if (!it->second.IsSequence()) {
        return absl::InvalidArgumentError(
            absl::StrCat(fpath, ": expected a list", Where(it->second)));
      }
      *out += "[";
      for (size_t i = 0; i < it->second.size(); ++i) {
        if (i > 0) *out += ",";
        FSDP8_RETURN_IF_ERROR(
            ValueToJson(it->second[i], f, absl::StrCat(fpath, "[", i, "]"), out));
      }
      *out += "]";
    } else {
      FSDP8_RETURN_IF_ERROR(ValueToJson(it->second, f, fpath, out));
    }
  }
  *out += "}";
  return absl::OkStatus();
}

absl::Status ValueToJson(const YAML::Node& n, const FieldDescriptor* f, const std::string& path,
                         std::string* out) {
  if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    return MessageToJson(n, f->message_type(), path, out);
  }
  if (!n.IsScalar()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": expected a scalar", Where(n)));
  }
  const std::string& v = n.Scalar();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_STRING:
      *out += JsonQuote(v);
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_BOOL: {
      const std::string low = absl::AsciiStrToLower(v);
      if (low == "true" || low == "false") {
        *out += low;
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": expected true or false (got \"", v, "\")", Where(n)));
    }
    case FieldDescriptor::CPPTYPE_ENUM: {
      const EnumDescriptor* e = f->enum_type();
      const std::string upper = absl::AsciiStrToUpper(v);
      if (e->FindValueByName(upper) != nullptr) {
        *out += JsonQuote(upper);
        return absl::OkStatus();
      }
      auto shorts = ShortEnumNames().find(e->full_name());
      if (shorts != ShortEnumNames().end()) {
        auto s = shorts->second.find(absl::AsciiStrToLower(v));
        if (s != shorts->second.end()) {
          *out += JsonQuote(s->second);
          return absl::OkStatus();
        }
      }
      std::string json;
      if (!IsQuoted(n) && NumberToJson(v, true, &json) && e->FindValueByNumber(std::atoi(v.c_str()))) {
        *out += json;
        return absl::OkStatus();
      }
      std::vector<std::string> names;
      for (int i = 0; i < e->value_count(); ++i) names.push_back(e->value(i)->name());
      if (shorts != ShortEnumNames().end()) {
        for (const auto& [k, unused] : shorts->second) names.push_back(k);
      }
      return absl::InvalidArgumentError(absl::StrCat(path, ": unknown value \"", v, "\" (one of ",
                                                     absl::StrJoin(names, ", "), ")", Where(n)));
    }
    default: {  // numbers
      // sharding.replicas: "auto" is 0 (ShardingSpec.replicas).
      if (f->full_name() == "fsdp8.v1.ShardingSpec.replicas" && !IsQuoted(n) &&
          absl::AsciiStrToLower(v) == "auto") {
        *out += "0";
        return absl::OkStatus();
      }
      const bool integer = f->cpp_type() != FieldDescriptor::CPPTYPE_DOUBLE &&
                           f->cpp_type() != FieldDescriptor::CPPTYPE_FLOAT;
      std::string json;
      if (NumberToJson(v, integer, &json)) {
        if (integer) {
          // json is a plain decimal integer here; check it fits the field's type.
          const bool neg = json[0] == '-';
          errno = 0;
          const long long sv = neg ? std::strtoll(json.c_str(), nullptr, 10) : 0;
          const unsigned long long uv = neg ? 0 : std::strtoull(json.c_str(), nullptr, 10);
          bool fits = errno == 0;
          switch (f->cpp_type()) {
            case FieldDescriptor::CPPTYPE_INT32:
              fits = fits && (neg ? sv >= INT32_MIN : uv <= static_cast<unsigned long long>(INT32_MAX));
              break;
            case FieldDescriptor::CPPTYPE_INT64:
              fits = fits && (neg || uv <= static_cast<unsigned long long>(INT64_MAX));
              break;
            case FieldDescriptor::CPPTYPE_UINT32:
              fits = fits && !neg && uv <= UINT32_MAX;
              break;
            default:  // UINT64
              fits = fits && !neg;
          }
          if (!fits) {
            return absl::InvalidArgumentError(absl::StrCat(
                path, ": out of range for ", f->cpp_type_name(), " (got ", v, ")", Where(n)));
          }
        }
        *out += json;
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(absl::StrCat(path, ": expected ",
                                                     integer ? "an integer" : "a number",
                                                     " (got \"", v, "\")", Where(n)));
    }
  }
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseSpec(const std::string& text) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    return absl::InvalidArgumentError(absl::StrCat("spec: parse error at line ",
                                                   int64_t{e.mark.line} + 1, ", column ",
                                                   int64_t{e.mark.column} + 1, ": ", e.msg));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("spec: parse error: ", e.what()));
  }
  if (!root.IsDefined() || root.IsNull()) {
    return absl::InvalidArgumentError("spec: empty document");
  }
  std::string json;
  try {
    FSDP8_RETURN_IF_ERROR(MessageToJson(root, v1::JobSpec::descriptor(), "", &json));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("spec: ", e.what()));
  }
  v1::JobSpec spec;
  google::protobuf::util::JsonParseOptions opts;
  opts.ignore_unknown_fields = false;
  auto st = google::protobuf::util::JsonStringToMessage(json, &spec, opts);
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("spec: ", std::string(st.message())));
  }
  return spec;
}

// ---------------------------------------------------------------------------------------------
// Derived quantities
// ---------------------------------------------------------------------------------------------

int LocalBatch(const v1::JobSpec& spec, int world_size) {
  if (world_size <= 0) return 0;
  const int gb = spec.training().has_global_batch() ? spec.training().global_batch() : 16;
  return gb / world_size;
}

int Microbatches(const v1::JobSpec& spec, int world_size) {
  if (world_size <= 0) return 0;
  const v1::JobSpec s = WithDefaults(spec, world_size);
  if (s.training().microbatch() <= 0) return 0;
  return LocalBatch(s, world_size) / s.training().microbatch();
}

v1::Precision LayerLinearPrecision(const v1::JobSpec& spec, int layer) {
  for (const v1::LayerPrecision& lp : spec.precision().overrides()) {
    if (lp.layer() == layer && lp.linears() != v1::PRECISION_UNSPECIFIED) return lp.linears();
  }
  const v1::Precision p = spec.precision().linears();
  return p == v1::PRECISION_UNSPECIFIED ? v1::PRECISION_FP8 : p;
}

v1::Fp8Granularity LayerGranularity(const v1::JobSpec& spec, int layer) {
  if (LayerLinearPrecision(spec, layer) != v1::PRECISION_FP8) return v1::FP8_GRANULARITY_TENSORWISE;
  for (const v1::LayerPrecision& lp : spec.precision().overrides()) {
    if (lp.layer() == layer && lp.granularity() != v1::FP8_GRANULARITY_UNSPECIFIED) {
      return lp.granularity();
    }
  }
  const v1::Fp8Granularity g = spec.precision().fp8().granularity();
  return g == v1::FP8_GRANULARITY_UNSPECIFIED ? v1::FP8_GRANULARITY_TENSORWISE : g;
}

bool AnyScaledGranularity(const v1::JobSpec& spec) {
  for (int l = 0; l < spec.model().n_layers(); ++l) {
    if (LayerGranularity(spec, l) != v1::FP8_GRANULARITY_TENSORWISE) return true;
  }
  return false;
}

std::string ScaledGranularityField(const v1::JobSpec& spec) {
  if (!AnyScaledGranularity(spec)) return "";
  const v1::Fp8Granularity g = spec.precision().fp8().granularity();
  if (g != v1::FP8_GRANULARITY_TENSORWISE && g != v1::FP8_GRANULARITY_UNSPECIFIED) {
    return "precision.fp8.granularity";
  }
  const auto& overrides = spec.precision().overrides();
  for (int i = 0; i < overrides.size(); ++i) {
    if (LayerGranularity(spec, overrides[i].layer()) != v1::FP8_GRANULARITY_TENSORWISE) {
      return absl::StrCat("precision.overrides[", i, "].granularity");
    }
  }
  return "precision.overrides[].granularity";  // unreachable: a scaled layer has a cause
}

const char* GranularityName(v1::Fp8Granularity g) {
  switch (g) {
    case v1::FP8_GRANULARITY_TENSORWISE: return "TENSORWISE";
    case v1::FP8_GRANULARITY_ROWWISE: return "ROWWISE";
    case v1::FP8_GRANULARITY_BLOCKWISE: return "BLOCKWISE";
    default: return "UNSPECIFIED";
  }
}

int64_t AdamStateBytesPerElement(const v1::JobSpec& spec) {
  return spec.optimizer().state_precision() == v1::PRECISION_BF16 ? 2 * 2 : 2 * 4;
}

}  // namespace fsdp8
