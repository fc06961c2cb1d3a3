#include "common/hf_model.h"

#include <errno.h>
#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checkpoint_format.h"
#include "common/shard_plan.h"
#include "common/spec.h"
#include "common/token_dataset.h"

namespace fsdp8 {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;
namespace fs = std::filesystem;

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    const int err = errno;
    const std::string msg = absl::StrCat("cannot read ", path, ": ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::InternalError(msg);
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

absl::Status WriteTextAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f) return absl::InternalError(absl::StrCat("writing ", tmp, ": ", std::strerror(errno)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("renaming ", tmp, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<Struct> ParseJsonObject(const std::string& text, const std::string& what) {
  Struct s;
  if (auto st = google::protobuf::util::JsonStringToMessage(text, &s); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a JSON object (", std::string(st.message()), ")"));
  }
  return s;
}

// Whole numbers below 1e15 as integers (500000), others as the shortest text that reads back as
// the same double (1e-05, not 1.0000000000000001e-05; 1e+15). -0 prints as 0.
std::string Num(double v) {
  if (std::fabs(v) < 1e15 && v == std::trunc(v)) return absl::StrCat(static_cast<int64_t>(v));
  char buf[32];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

// Checks a rank file's header against what the MANIFEST says of it.
absl::Status CheckRankHeader(const std::string& path, const RankFileHeader& h, int rank,
                             int world, int64_t step, const ShardPlan& plan) {
  if (h.rank != rank || h.world_size != world || h.step != step) {
    return absl::DataLossError(absl::StrCat(path, ": written by rank ", h.rank, " of ",
                                            h.world_size, " at step ", h.step,
                                            ", the MANIFEST says rank ", rank, " of ", world,
                                            " at step ", step));
  }
  size_t expect_nbuf = 0;
  for (const UnitPlan& u : plan.units) expect_nbuf += u.buffers.size();
  if (h.num_buffers != expect_nbuf) {
    return absl::DataLossError(absl::StrCat(path, ": ", h.num_buffers,
                                            " flat buffers, the MANIFEST's spec has ", expect_nbuf));
  }
  return absl::OkStatus();
}

// Reads buffer (u, b)'s FP32 master slice of `rank` into dst (padded_numel elements) and skips
// its AdamW moments.
absl::Status ReadBufferMasters(RankFileReader* r, const ShardPlan& plan, size_t u, size_t b,
                               int rank, std::vector<float>* dst) {
  const BufferPlan& bp = plan.units[u].buffers[b];
  RankFileBufferHeader h;
  if (absl::Status s = r->ReadBufferHeader(&h); !s.ok()) return s;
  if (h.unit != u || h.buffer != b || h.wire != static_cast<uint32_t>(bp.wire) ||
      h.numel != bp.numel || h.shard_numel != bp.shard_numel ||
      h.padded_numel != bp.padded_numel) {
    return absl::DataLossError(absl::StrCat(
        r->path(), ": buffer ", plan.units[u].name, "/", WireDtypeName(bp.wire),
        " does not match the MANIFEST's spec (numel ", h.numel, ", shard ", h.shard_numel,
        "; expected ", bp.numel, ", ", bp.shard_numel, ")"));
  }
  const int64_t shard = h.shard_numel;
  dst->resize(static_cast<size_t>(bp.padded_numel));
  if (absl::Status s = r->ReadShardArray(shard, 0, shard, dst->data() + rank * shard); !s.ok()) {
    return s;
  }
  for (int moment = 0; moment < 2; ++moment) {  // AdamW m and v, in their stored dtype
    if (absl::Status s = r->ReadShardArray(shard, 0, 0, nullptr, h.moments); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Reads the FP32 master slices of one rank file into `full` (per buffer, padded_numel each),
// after checking its size and CRC-32 against the manifest and its own trailer.
absl::Status ReadRankMasters(const std::string& path, const v1::CheckpointFile& entry, int rank,
                             int world, int64_t step, const ShardPlan& plan,
                             std::vector<std::vector<float>>* full) {
  absl::StatusOr<RankFileReader> r = RankFileReader::Open(path);
  if (!r.ok()) return r.status();
  if (absl::Status s = r->Verify(&entry); !s.ok()) return s;
  RankFileHeader h;
  if (absl::Status s = r->ReadHeader(&h); !s.ok()) return s;
  if (absl::Status s = CheckRankHeader(path, h, rank, world, step, plan); !s.ok()) return s;
  size_t flat = 0;
  for (size_t u = 0; u < plan.units.size(); ++u) {
    for (size_t b = 0; b < plan.units[u].buffers.size(); ++b, ++flat) {
      if (absl::Status s = ReadBufferMasters(&*r, plan, u, b, rank, &(*full)[flat]); !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

const Value* Field(const Struct& s, const std::string& k) {
  auto it = s.fields().find(k);
  if (it == s.fields().end() || it->second.kind_case() == Value::kNullValue) return nullptr;
  return &it->second;
}

// config.json's fields and the error prefix ("<field>: config.json ") of CheckHfConfig.
struct HfConfigFields {
  const Struct& s;
  const std::string& field;

  absl::Status Bad(const std::string& what) const {
    // "config.json" as the field (ModelConfigFromHf) is not repeated.
    return absl::InvalidArgumentError(
        field == kHfConfigFile ? absl::StrCat(field, ": ", what)
                               : absl::StrCat(field, ": config.json ", what));
  }
  // The number at key k; `dflt` when absent (INVALID_ARGUMENT without a default).
  absl::Status Number(const char* k, double* out, const std::optional<double>& dflt) const {
    const Value* v = Field(s, k);
    if (!v) {
      if (dflt) {
        *out = *dflt;
        return absl::OkStatus();
      }
      return Bad(absl::StrCat(k, " is missing"));
    }
    if (v->kind_case() != Value::kNumberValue) return Bad(absl::StrCat(k, " is not a number"));
    *out = v->number_value();
    return absl::OkStatus();
  }
};

absl::Status ReadHfRope(const HfConfigFields& c, double* theta, v1::RopeScaling* scaling,
                        bool* scaled);

// The integer sizes and head_dim equal the model section's.
absl::Status CheckHfSizes(const HfConfigFields& c, const v1::ModelConfig& m) {
  struct IntRule { const char* key; const char* model_field; int want; };
  double heads = 0;
  if (absl::Status st = c.Number("num_attention_heads", &heads, std::nullopt); !st.ok()) return st;
  const IntRule rules[] = {
      {"hidden_size", "model.d_model", m.d_model()},
      {"intermediate_size", "model.ffn_dim", m.ffn_dim()},
      {"num_attention_heads", "model.n_heads", m.n_heads()},
      {"num_key_value_heads", "model.n_kv_heads", m.n_kv_heads()},
      {"num_hidden_layers", "model.n_layers", m.n_layers()},
      {"vocab_size", "model.vocab_size", m.vocab_size()},
  };
  for (const IntRule& r : rules) {
    double v = 0;
    const std::optional<double> dflt =
        std::string(r.key) == "num_key_value_heads" ? std::optional<double>(heads) : std::nullopt;
    if (absl::Status st = c.Number(r.key, &v, dflt); !st.ok()) return st;
    if (v != r.want) {
      return c.Bad(absl::StrCat(r.key, " is ", Num(v), ", ", r.model_field, " is ", r.want));
    }
  }
  double head_dim = 0;
  if (absl::Status st = c.Number("head_dim", &head_dim, m.d_model() / m.n_heads()); !st.ok()) {
    return st;
  }
  if (head_dim != m.d_model() / m.n_heads()) {
    return c.Bad(absl::StrCat("head_dim is ", Num(head_dim),
                              ", model.d_model / model.n_heads is ", m.d_model() / m.n_heads()));
  }
  return absl::OkStatus();
}

// rms_norm_eps and rope_theta equal to within 1e-9 relative; max_position_embeddings >= seq_len.
absl::Status CheckHfReals(const HfConfigFields& c, const v1::ModelConfig& m) {
  double eps = 0, theta = 10000.0;
  v1::RopeScaling unused;
  bool scaled = false;
  if (absl::Status st = c.Number("rms_norm_eps", &eps, 1e-6); !st.ok()) return st;
  if (absl::Status st = ReadHfRope(c, &theta, &unused, &scaled); !st.ok()) return st;
  struct RealRule { const char* key; const char* model_field; double got, want; };
  for (const RealRule& r : {RealRule{"rms_norm_eps", "model.norm_eps", eps, m.norm_eps()},
                            RealRule{"rope_theta", "model.rope_theta", theta, m.rope_theta()}}) {
    if (!(std::fabs(r.got - r.want) <= 1e-9 * std::fabs(r.want))) {
      return c.Bad(absl::StrCat(r.key, " is ", Num(r.got), ", ", r.model_field, " is ", Num(r.want)));
    }
  }
  double max_pos = 0;
  if (absl::Status st = c.Number("max_position_embeddings", &max_pos, 2048.0); !st.ok()) return st;
  if (max_pos < m.seq_len()) {
    return c.Bad(absl::StrCat("max_position_embeddings is ", Num(max_pos),
                              ", below model.seq_len ", m.seq_len()));
  }
  return absl::OkStatus();
}

// The RoPE section of config.json: rope_theta and rope_scaling (transformers 4), or
// rope_parameters (transformers 5: rope_type, rope_theta and the scaling keys in one object).
// *theta is left alone when the config gives none; *scaling is cleared for plain RoPE.
absl::Status ReadHfRope(const HfConfigFields& c, double* theta, v1::RopeScaling* scaling,
                        bool* scaled) {
  const char* key = Field(c.s, "rope_parameters") ? "rope_parameters" : "rope_scaling";
  if (absl::Status st = c.Number("rope_theta", theta, *theta); !st.ok()) return st;
  *scaled = false;
  const Value* v = Field(c.s, key);
  if (!v) return absl::OkStatus();
  if (v->kind_case() != Value::kStructValue) return c.Bad(absl::StrCat(key, " is not an object"));
  const HfConfigFields r{v->struct_value(), c.field};
  if (Field(r.s, "rope_theta")) {
    if (absl::Status st = r.Number("rope_theta", theta, std::nullopt); !st.ok()) return st;
  }
  const Value* type = Field(r.s, "rope_type") ? Field(r.s, "rope_type") : Field(r.s, "type");
  const std::string t = type && type->kind_case() == Value::kStringValue ? type->string_value() : "";
  if (t == "default") return absl::OkStatus();
  if (t != "llama3") {
    return c.Bad(absl::StrCat(key, ".rope_type is \"", t,
                              "\" (implemented: \"default\" and \"llama3\")"));
  }
  double factor = 0, low = 0, high = 0, orig = 0;
  for (auto [k, out] : {std::pair<const char*, double*>{"factor", &factor},
                        {"low_freq_factor", &low}, {"high_freq_factor", &high},
                        {"original_max_position_embeddings", &orig}}) {
    if (!Field(r.s, k)) return c.Bad(absl::StrCat(key, ".", k, " is missing"));
    if (absl::Status st = r.Number(k, out, std::nullopt); !st.ok()) return st;
  }
  scaling->Clear();
  scaling->set_rope_type("llama3");
  scaling->set_factor(factor);
  scaling->set_low_freq_factor(low);
  scaling->set_high_freq_factor(high);
  scaling->set_original_max_position_embeddings(static_cast<int32_t>(orig));
  *scaled = true;
  return absl::OkStatus();
}

// SwiGLU, no biases, full-width RoPE, no sliding window: the keys of features fsdp8 does not
// implement are refused by name.
absl::Status CheckHfUnsupported(const HfConfigFields& c) {
  if (const Value* act = Field(c.s, "hidden_act");
      act && (act->kind_case() != Value::kStringValue || act->string_value() != "silu")) {
    return c.Bad("hidden_act must be \"silu\" (fsdp8's MLP is SwiGLU)");
  }
  for (const char* k : {"attention_bias", "mlp_bias", "use_sliding_window"}) {
    const Value* v = Field(c.s, k);
    if (v && (v->kind_case() != Value::kBoolValue || v->bool_value())) {
      return c.Bad(absl::StrCat(k, " must be false (fsdp8 models have no biases and no sliding window)"));
    }
  }
  if (const Value* v = Field(c.s, "sliding_window"); v) {
    return c.Bad("sliding_window must be null (fsdp8's attention is full causal attention)");
  }
  if (const Value* v = Field(c.s, "partial_rotary_factor");
      v && (v->kind_case() != Value::kNumberValue || v->number_value() != 1.0)) {
    return c.Bad("partial_rotary_factor must be 1 (fsdp8 rotates the whole head)");
  }
  if (const Value* v = Field(c.s, "tie_word_embeddings");
      v && v->kind_case() != Value::kBoolValue) {
    return c.Bad("tie_word_embeddings is not a boolean");
  }
  return absl::OkStatus();
}

// tie_word_embeddings (default false) and the RoPE scaling equal to the model section's.
absl::Status CheckHfTieAndRope(const HfConfigFields& c, const v1::ModelConfig& m) {
  const Value* tie = Field(c.s, "tie_word_embeddings");
  const bool tied = tie != nullptr && tie->bool_value();
  if (tied != m.tie_word_embeddings()) {
    return c.Bad(absl::StrCat("tie_word_embeddings is ", tied ? "true" : "false",
                              ", model.tie_word_embeddings is ",
                              m.tie_word_embeddings() ? "true" : "false"));
  }
  double theta = m.rope_theta();
  v1::RopeScaling r;
  bool scaled = false;
  if (absl::Status st = ReadHfRope(c, &theta, &r, &scaled); !st.ok()) return st;
  if (scaled != m.has_rope_scaling()) {
    return c.Bad(absl::StrCat(scaled ? "has rope_scaling llama3" : "has no rope_scaling",
                              ", model.rope_scaling is ", m.has_rope_scaling() ? "set" : "unset"));
  }
  if (!scaled) return absl::OkStatus();
  const v1::RopeScaling& w = m.rope_scaling();
  struct Rule { const char* key; double got, want; };
  for (const Rule& x : {Rule{"factor", r.factor(), w.factor()},
                        Rule{"low_freq_factor", r.low_freq_factor(), w.low_freq_factor()},
                        Rule{"high_freq_factor", r.high_freq_factor(), w.high_freq_factor()},
                        Rule{"original_max_position_embeddings",
                             static_cast<double>(r.original_max_position_embeddings()),
                             static_cast<double>(w.original_max_position_embeddings())}}) {
    if (!(std::fabs(x.got - x.want) <= 1e-9 * std::fabs(x.want))) {
      return c.Bad(absl::StrCat("rope_scaling.", x.key, " is ", Num(x.got), ", model.rope_scaling.",
                                x.key, " is ", Num(x.want)));
    }
  }
  return absl::OkStatus();
}

// The model section's remaining fields from config.json (norm_eps, rope_theta, rope_scaling,
// tie_word_embeddings), after refusing the features fsdp8 does not implement and a head_dim other
// than hidden_size / num_attention_heads.
absl::Status ModelFlagsFromHf(const Struct& s, v1::ModelConfig* m) {
  const std::string field = "config.json";
  const HfConfigFields c{s, field};
  const Value* mt = Field(s, "model_type");
  if (mt && (mt->kind_case() != Value::kStringValue || mt->string_value() != "llama")) {
    return c.Bad("model_type must be \"llama\" (LlamaForCausalLM)");
  }
  if (absl::Status st = CheckHfUnsupported(c); !st.ok()) return st;
  double head_dim = 0;
  const double natural = static_cast<double>(m->d_model() / m->n_heads());
  if (absl::Status st = c.Number("head_dim", &head_dim, natural); !st.ok()) return st;
  if (head_dim != natural || m->d_model() % m->n_heads() != 0) {
    return c.Bad(absl::StrCat("head_dim is ", Num(head_dim), ", fsdp8 needs hidden_size / ",
                              "num_attention_heads (", m->d_model(), " / ", m->n_heads(), ")"));
  }
  double eps = 0, theta = 10000.0;
  if (absl::Status st = c.Number("rms_norm_eps", &eps, 1e-6); !st.ok()) return st;
  v1::RopeScaling r;
  bool scaled = false;
  if (absl::Status st = ReadHfRope(c, &theta, &r, &scaled); !st.ok()) return st;
  m->set_norm_eps(eps);
  m->set_rope_theta(theta);
  if (scaled) *m->mutable_rope_scaling() = r;
  const Value* tie = Field(s, "tie_word_embeddings");
  if (tie != nullptr && tie->bool_value()) m->set_tie_word_embeddings(true);
  return absl::OkStatus();
}

}  // namespace

namespace {

std::string PrettyJson(const Struct& s) {
  std::string out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  (void)google::protobuf::util::MessageToJsonString(s, &out, opts);
  return out;
}

Struct HfConfigStruct(const v1::ModelConfig& m_in, SafetensorsDtype dtype) {
  const v1::ModelConfig m = DefaultedModel(m_in);
  Struct s;
  auto& f = *s.mutable_fields();
  f["architectures"].mutable_list_value()->add_values()->set_string_value("LlamaForCausalLM");
  f["model_type"].set_string_value("llama");
  f["hidden_size"].set_number_value(m.d_model());
  f["intermediate_size"].set_number_value(m.ffn_dim());
  f["num_attention_heads"].set_number_value(m.n_heads());
  f["num_key_value_heads"].set_number_value(m.n_kv_heads());
  f["head_dim"].set_number_value(m.d_model() / m.n_heads());
  f["num_hidden_layers"].set_number_value(m.n_layers());
  f["vocab_size"].set_number_value(m.vocab_size());
  f["rms_norm_eps"].set_number_value(m.norm_eps());
  f["rope_theta"].set_number_value(m.rope_theta());
  f["max_position_embeddings"].set_number_value(m.seq_len());
  f["hidden_act"].set_string_value("silu");
  f["tie_word_embeddings"].set_bool_value(m.tie_word_embeddings());
  f["attention_bias"].set_bool_value(false);
  f["mlp_bias"].set_bool_value(false);
  if (m.has_rope_scaling()) {
    auto& r = *f["rope_scaling"].mutable_struct_value()->mutable_fields();
    r["rope_type"].set_string_value(m.rope_scaling().rope_type());
    r["factor"].set_number_value(m.rope_scaling().factor());
    r["low_freq_factor"].set_number_value(m.rope_scaling().low_freq_factor());
    r["high_freq_factor"].set_number_value(m.rope_scaling().high_freq_factor());
    r["original_max_position_embeddings"].set_number_value(
        m.rope_scaling().original_max_position_embeddings());
  } else {
    f["rope_scaling"].set_null_value(google::protobuf::NULL_VALUE);
  }
  f["torch_dtype"].set_string_value(dtype == SafetensorsDtype::kBF16 ? "bfloat16" : "float32");
  return s;
}

constexpr const char* kTokenIdKeys[] = {"bos_token_id", "eos_token_id", "pad_token_id"};

}  // namespace

std::string HfConfigJson(const v1::ModelConfig& m, SafetensorsDtype dtype) {
  return PrettyJson(HfConfigStruct(m, dtype));
}

absl::StatusOr<std::string> HfConfigJson(const v1::ModelConfig& m, SafetensorsDtype dtype,
                                         const HfConfigExtras& extras) {
  Struct s = HfConfigStruct(m, dtype);
  auto& f = *s.mutable_fields();
  Struct ids;
  if (!extras.token_ids_json.empty()) {
    absl::StatusOr<Struct> p = ParseJsonObject(extras.token_ids_json, "special token ids");
    if (!p.ok()) return p.status();
    ids = std::move(*p);
  }
  for (const char* k : kTokenIdKeys) {
    auto it = ids.fields().find(k);
    if (it != ids.fields().end()) {
      f[k] = it->second;
    } else {
      f[k].set_null_value(google::protobuf::NULL_VALUE);
    }
  }
  if (!extras.source_config_json.empty()) {
    absl::StatusOr<Struct> src =
        ParseJsonObject(extras.source_config_json, "init.from_hf config.json");
    if (!src.ok()) return src.status();
    if (const Value* v = Field(*src, "max_position_embeddings");
        v && v->kind_case() == Value::kNumberValue) {
      f["max_position_embeddings"] = *v;
    }
    if (const Value* v = Field(*src, "rope_parameters")) {
      f["rope_parameters"] = *v;
      f.erase("rope_scaling");
    } else if (const Value* v = Field(*src, "rope_scaling")) {
      f["rope_scaling"] = *v;
    }
  }
  return PrettyJson(s);
}

std::string HfTokenizerSource(const v1::JobSpec& spec, const std::string& tokenizer_dir) {
  if (!tokenizer_dir.empty()) return tokenizer_dir;
  std::error_code ec;
  if (!spec.data().train_path().empty()) {
    absl::StatusOr<std::vector<std::string>> shards = ExpandShardPaths(spec.data().train_path());
    if (shards.ok() && !shards->empty()) {
      const fs::path record = fs::path(shards->front()).parent_path() / kTokenizerRecordDir;
      if (fs::is_regular_file(record / kTokenIdsFile, ec)) return record.string();
    }
  }
  return spec.init().from_hf();
}

absl::StatusOr<v1::ModelConfig> ModelConfigFromHf(const std::string& config_json) {
  absl::StatusOr<Struct> s = ParseJsonObject(config_json, "config.json");
  if (!s.ok()) return s.status();
  v1::ModelConfig m;
  auto get_int = [&](const char* k, int* out) -> absl::Status {
    const Value* v = Field(*s, k);
    if (!v) return absl::InvalidArgumentError(absl::StrCat("config.json: ", k, " missing"));
    if (v->kind_case() != Value::kNumberValue || std::floor(v->number_value()) != v->number_value() ||
        !(v->number_value() >= 1) || v->number_value() > 2147483647.0) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: ", k, " must be a positive integer"));
    }
    *out = static_cast<int>(v->number_value());
    return absl::OkStatus();
  };
  int hidden = 0, inter = 0, heads = 0, layers = 0, vocab = 0, pos = 0, kv = 0;
  for (auto [k, p] : {std::pair<const char*, int*>{"hidden_size", &hidden},
                      {"intermediate_size", &inter}, {"num_attention_heads", &heads},
                      {"num_hidden_layers", &layers}, {"vocab_size", &vocab},
                      {"max_position_embeddings", &pos}}) {
    if (absl::Status st = get_int(k, p); !st.ok()) return st;
  }
  kv = heads;
  if (Field(*s, "num_key_value_heads")) {
    if (absl::Status st = get_int("num_key_value_heads", &kv); !st.ok()) return st;
  }
  m.set_d_model(hidden);
  m.set_ffn_dim(inter);
  m.set_n_heads(heads);
  m.set_n_kv_heads(kv);
  m.set_n_layers(layers);
  m.set_vocab_size(vocab);
  m.set_seq_len(pos);
  if (absl::Status st = ModelFlagsFromHf(*s, &m); !st.ok()) return st;
  return m;
}

absl::StatusOr<std::string> HfModelSectionYaml(const std::string& config_json, int seq_len) {
  absl::StatusOr<v1::ModelConfig> m = ModelConfigFromHf(config_json);
  if (!m.ok()) return m.status();
  std::string y = "model:\n";
  auto line = [&](const char* k, const std::string& v) { absl::StrAppend(&y, "  ", k, ": ", v, "\n"); };
  line("d_model", absl::StrCat(m->d_model()));
  line("n_layers", absl::StrCat(m->n_layers()));
  line("n_heads", absl::StrCat(m->n_heads()));
  line("n_kv_heads", absl::StrCat(m->n_kv_heads()));
  line("ffn_dim", absl::StrCat(m->ffn_dim()));
  line("vocab_size", absl::StrCat(m->vocab_size()));
  line("seq_len", absl::StrCat(std::min(seq_len, m->seq_len())));
  line("rope_theta", Num(m->rope_theta()));
  line("norm_eps", Num(m->norm_eps()));
  line("tie_word_embeddings", m->tie_word_embeddings() ? "true" : "false");
  if (m->has_rope_scaling()) {
    const v1::RopeScaling& r = m->rope_scaling();
    absl::StrAppend(&y, "  rope_scaling:\n    rope_type: ", r.rope_type(), "\n    factor: ",
                    Num(r.factor()), "\n    low_freq_factor: ", Num(r.low_freq_factor()),
                    "\n    high_freq_factor: ", Num(r.high_freq_factor()),
                    "\n    original_max_position_embeddings: ",
                    r.original_max_position_embeddings(), "\n");
  }
  return y;
}

absl::Status CheckHfConfig(const std::string& config_json, const v1::ModelConfig& m_in,
                           const std::string& field) {
  const v1::ModelConfig m = DefaultedModel(m_in);
  absl::StatusOr<Struct> parsed = ParseJsonObject(config_json, absl::StrCat(field, ": config.json"));
  if (!parsed.ok()) return parsed.status();
  const HfConfigFields c{*parsed, field};
  const Value* mt = Field(c.s, "model_type");
  if (!mt || mt->kind_case() != Value::kStringValue || mt->string_value() != "llama") {
    return c.Bad("model_type must be \"llama\" (LlamaForCausalLM)");
  }
  if (absl::Status st = CheckHfSizes(c, m); !st.ok()) return st;
  if (absl::Status st = CheckHfReals(c, m); !st.ok()) return st;
  if (absl::Status st = CheckHfUnsupported(c); !st.ok()) return st;
  return CheckHfTieAndRope(c, m);
}

absl::Status CheckHfDir(const std::string& dir, const v1::ModelConfig& m, const std::string& field) {
  const std::string cfg = absl::StrCat(dir, "/", kHfConfigFile);
  absl::StatusOr<std::string> text = ReadText(cfg);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": must be a Hugging Face model directory (",
                                                   text.status().message(), ")"));
  }
  if (absl::Status s = CheckHfConfig(*text, m, field); !s.ok()) return s;
  struct stat st;
  const std::string weights = absl::StrCat(dir, "/", kHfWeightsFile);
  const std::string index = absl::StrCat(dir, "/", kHfIndexFile);
  if ((::stat(weights.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) &&
      (::stat(index.c_str(), &st) != 0 || !S_ISREG(st.st_mode))) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", weights, " is missing (and there is no ", kHfIndexFile, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointWeights> ReadCheckpointWeights(const std::string& step_dir) {
  absl::StatusOr<v1::CheckpointManifest> manifest = ReadManifestFile(step_dir);
  if (!manifest.ok()) return manifest.status();
  CheckpointWeights out;
  out.manifest = std::move(*manifest);
  const v1::CheckpointManifest& m = out.manifest;
  // A MANIFEST of an earlier release holds moved fields in their old places: migrated first. A
  // hybrid-sharded job's files are padded for its whole mesh (MakeCheckpointShardPlan).
  absl::StatusOr<ShardPlan> plan =
      MakeCheckpointShardPlan(MigrateStoredSpec(m.spec()), m.world_size());
  if (!plan.ok()) {
    return absl::DataLossError(absl::StrCat(step_dir, "/MANIFEST: its spec has no shard plan (",
                                            plan.status().message(), ")"));
  }
  std::vector<std::vector<float>> full;
  for (const UnitPlan& u : plan->units) full.resize(full.size() + u.buffers.size());
  for (int r = 0; r < m.world_size(); ++r) {
    absl::Status s = ReadRankMasters(absl::StrCat(step_dir, "/", m.files(r).file()), m.files(r), r,
                                     m.world_size(), m.step(), *plan, &full);
    if (!s.ok()) return s;
  }
  size_t flat = 0;
  for (const UnitPlan& u : plan->units) {
    for (const BufferPlan& b : u.buffers) {
      for (size_t t = 0; t < b.tensors.size(); ++t) {
        const float* src = full[flat].data() + b.offsets[t];
        out.tensors.push_back({b.tensors[t].name, b.tensors[t].shape,
                               std::vector<float>(src, src + b.tensors[t].numel)});
      }
      std::vector<float>().swap(full[flat]);
      ++flat;
    }
  }
  return out;
}

absl::StatusOr<std::string> ResolveCheckpointStepDir(const std::string& path,
                                                     std::optional<int64_t> step) {
  std::error_code ec;
  if (fs::exists(fs::path(path) / kManifestFileName, ec)) {
    absl::StatusOr<v1::CheckpointManifest> m = ReadManifestFile(path);
    if (!m.ok()) return m.status();
    if (step && m->step() != *step) {
      return absl::InvalidArgumentError(absl::StrCat(path, " is the checkpoint of step ", m->step(),
                                                     ", not --step ", *step));
    }
    return path;
  }
  if (!fs::is_directory(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such checkpoint directory"));
  }
  if (step) {
    const std::string d = absl::StrCat(path, "/", StepDirName(*step));
    absl::StatusOr<v1::CheckpointManifest> m = ReadManifestFile(d);
    if (!m.ok()) return m.status();
    return d;
  }
  int64_t best = -1;
  for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
    const int64_t k = StepOfDirName(e.path().filename().string());
    if (k <= best) continue;
    if (ReadManifestFile(e.path().string()).ok()) best = k;
  }
  if (best < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": no committed checkpoint (no step-<k> with a MANIFEST)"));
  }
  return absl::StrCat(path, "/", StepDirName(best));
}

absl::StatusOr<HfWeights> HfWeights::Open(const std::string& dir) {
  HfWeights out;
  const std::string single = absl::StrCat(dir, "/", kHfWeightsFile);
  std::error_code ec;
  if (fs::exists(single, ec)) {
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(single);
    if (!f.ok()) return f.status();
    for (const auto& [name, t] : f->tensors()) out.tensors_[name] = Entry{t, 0};
    out.files_.push_back(std::move(*f));
    return out;
  }
  const std::string index = absl::StrCat(dir, "/", kHfIndexFile);
  absl::StatusOr<std::string> text = ReadText(index);
  if (!text.ok()) return text.status();
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(index, ": ", what));
  };
  absl::StatusOr<Struct> root = ParseJsonObject(*text, index);
  if (!root.ok()) return bad("not a JSON object");
  const Value* map = Field(*root, "weight_map");
  if (!map || map->kind_case() != Value::kStructValue) return bad("weight_map missing or not an object");
  std::map<std::string, int> file_ids;
  for (const auto& [name, v] : map->struct_value().fields()) {
    if (v.kind_case() != Value::kStringValue) return bad(absl::StrCat("weight_map[\"", name, "\"] is not a string"));
    const std::string& file = v.string_value();
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
      return bad(absl::StrCat("weight_map[\"", name, "\"] = \"", file, "\" is not a file name in the directory"));
    }
    auto [it, added] = file_ids.emplace(file, static_cast<int>(out.files_.size()));
    if (added) {
      absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(absl::StrCat(dir, "/", file));
      if (!f.ok()) return f.status();
      out.files_.push_back(std::move(*f));
    }
    auto t = out.files_[it->second].tensors().find(name);
    if (t == out.files_[it->second].tensors().end()) {
      return bad(absl::StrCat("weight_map puts ", name, " in ", file, ", which does not hold it"));
    }
    out.tensors_[name] = Entry{t->second, it->second};
  }
  for (size_t i = 0; i < out.files_.size(); ++i) {
    for (const auto& [name, unused] : out.files_[i].tensors()) {
      auto it = out.tensors_.find(name);
      if (it == out.tensors_.end() || it->second.file != static_cast<int>(i)) {
        return bad(absl::StrCat(out.files_[i].path(), " holds ", name,
                                ", which weight_map does not put there"));
      }
    }
  }
  return out;
}

absl::Status HfWeights::Read(const std::string& name, int64_t first, int64_t n, float* out) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return absl::NotFoundError(absl::StrCat("no tensor \"", name, "\""));
  return files_[it->second.file].Read(name, first, n, out);
}

namespace {

// Shards of at most max_bytes of tensor data, in order (a larger tensor alone).
std::vector<std::vector<const CheckpointWeights::Tensor*>> PlanShards(
    const CheckpointWeights& w, int64_t esize, int64_t max_bytes) {
  std::vector<std::vector<const CheckpointWeights::Tensor*>> shards(1);
  int64_t bytes = 0;
  for (const CheckpointWeights::Tensor& t : w.tensors) {
    const int64_t b = static_cast<int64_t>(t.values.size()) * esize;
    if (!shards.back().empty() && bytes + b > max_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(&t);
    bytes += b;
  }
  return shards;
}

// The weights as out_dir/model.safetensors (one shard) or model-<i>-of-<n>.safetensors shards and
// their index; the other layout's files are removed.
absl::Status WriteHfWeights(const CheckpointWeights& w, const std::string& out_dir,
                            const HfExportOptions& o) {
  const int64_t esize = o.dtype == SafetensorsDtype::kBF16 ? 2 : 4;
  const auto shards = PlanShards(w, esize, o.max_shard_bytes);
  const std::map<std::string, std::string> meta = {
      {"fsdp8_job", w.manifest.job_id()}, {"fsdp8_step", absl::StrCat(w.manifest.step())}};
  std::error_code ec;
  Struct index;
  auto& map = *(*index.mutable_fields())["weight_map"].mutable_struct_value()->mutable_fields();
  int64_t total = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name = shards.size() == 1 ? std::string(kHfWeightsFile)
                                                : absl::StrFormat("model-%05d-of-%05d.safetensors",
                                                                  i + 1, shards.size());
    std::vector<SafetensorsWriteTensor> tensors;
    for (const CheckpointWeights::Tensor* t : shards[i]) {
      tensors.push_back({t->name, t->shape, t->values.data()});
      map[t->name].set_string_value(name);
      total += static_cast<int64_t>(t->values.size()) * esize;
    }
    if (absl::Status s = WriteSafetensors(absl::StrCat(out_dir, "/", name), tensors, o.dtype, meta);
        !s.ok()) {
      return s;
    }
  }
  if (shards.size() == 1) {
    fs::remove(fs::path(out_dir) / kHfIndexFile, ec);
    return absl::OkStatus();
  }
  fs::remove(fs::path(out_dir) / kHfWeightsFile, ec);
  (*(*index.mutable_fields())["metadata"].mutable_struct_value()->mutable_fields())["total_size"]
      .set_number_value(static_cast<double>(total));
  std::string text;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  (void)google::protobuf::util::MessageToJsonString(index, &text, opts);
  return WriteTextAtomically(absl::StrCat(out_dir, "/", kHfIndexFile), text);
}

// Copies the tokenizer files present in `from` (none when it is empty or unreadable); appends
// their names to *copied when it is not null.
absl::Status CopyTokenizerFiles(const std::string& from, const std::string& out_dir,
                                std::vector<std::string>* copied) {
  if (from.empty()) return absl::OkStatus();
  for (const char* f : kHfTokenizerFiles) {
    std::error_code ec;
    const fs::path src = fs::path(from) / f;
    if (!fs::is_regular_file(src, ec)) continue;
    fs::copy_file(src, fs::path(out_dir) / f, fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::InternalError(absl::StrCat("copying ", src.string(), ": ", ec.message()));
    if (copied != nullptr) copied->push_back(f);
  }
  return absl::OkStatus();
}

// The special token ids of the tokenizer source `dir`: bos_token_id, eos_token_id and
// pad_token_id (those present) of its kTokenIdsFile, else of its generation_config.json, else of
// its config.json; an empty object when none of them has any (or dir is empty).
absl::StatusOr<Struct> SpecialTokenIds(const std::string& dir) {
  Struct ids;
  if (dir.empty()) return ids;
  for (const char* name : {kTokenIdsFile, kHfGenerationConfigFile, kHfConfigFile}) {
    const std::string path = absl::StrCat(dir, "/", name);
    absl::StatusOr<std::string> text = ReadText(path);
    if (!text.ok()) continue;
    absl::StatusOr<Struct> s = ParseJsonObject(*text, path);
    if (!s.ok()) return s.status();
    for (const char* k : kTokenIdKeys) {
      auto it = s->fields().find(k);
      if (it != s->fields().end()) (*ids.mutable_fields())[k] = it->second;
    }
    if (!ids.fields().empty()) return ids;
  }
  return ids;
}

// out_dir/generation_config.json with the special token ids (null ones left out), the other keys
// of the one copied there kept; none when there is neither an id nor a copied file. *written says
// whether it was written.
absl::Status WriteGenerationConfig(const std::string& out_dir, const Struct& ids, bool* written) {
  *written = false;
  const std::string path = absl::StrCat(out_dir, "/", kHfGenerationConfigFile);
  Struct g;
  absl::StatusOr<std::string> text = ReadText(path);
  if (text.ok()) {
    absl::StatusOr<Struct> s = ParseJsonObject(*text, path);
    if (!s.ok()) return s.status();
    g = std::move(*s);
  }
  for (const auto& [k, v] : ids.fields()) {
    if (v.kind_case() == Value::kNullValue) {
      g.mutable_fields()->erase(k);
    } else {
      (*g.mutable_fields())[k] = v;
    }
  }
  if (!text.ok() && g.fields().empty()) return absl::OkStatus();  // nothing to say
  *written = true;
  return WriteTextAtomically(path, PrettyJson(g) + "\n");
}

}  // namespace

absl::Status ExportHf(const std::string& step_dir, const std::string& out_dir,
                      const HfExportOptions& options, std::vector<std::string>* tokenizer_files) {
  if (options.max_shard_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max shard size: must be >= 1 byte (got ", options.max_shard_bytes, ")"));
  }
  absl::StatusOr<CheckpointWeights> w = ReadCheckpointWeights(step_dir);
  if (!w.ok()) return w.status();
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("creating ", out_dir, ": ", ec.message()));
  if (absl::Status s = WriteHfWeights(*w, out_dir, options); !s.ok()) return s;
  const v1::JobSpec& spec = w->manifest.spec();
  const std::string tok = HfTokenizerSource(spec, options.tokenizer_dir);
  if (absl::Status s = CopyTokenizerFiles(tok, out_dir, tokenizer_files); !s.ok()) return s;
  HfConfigExtras extras;
  absl::StatusOr<Struct> ids = SpecialTokenIds(tok);
  if (!ids.ok()) return ids.status();
  if (!ids->fields().empty()) {
    extras.token_ids_json = PrettyJson(*ids);
    bool written = false;
    if (absl::Status s = WriteGenerationConfig(out_dir, *ids, &written); !s.ok()) return s;
    if (written && tokenizer_files != nullptr &&
        std::find(tokenizer_files->begin(), tokenizer_files->end(), kHfGenerationConfigFile) ==
            tokenizer_files->end()) {
      tokenizer_files->push_back(kHfGenerationConfigFile);
    }
  }
  if (!spec.init().from_hf().empty()) {
    absl::StatusOr<std::string> src =
        ReadText(absl::StrCat(spec.init().from_hf(), "/", kHfConfigFile));
    if (src.ok()) extras.source_config_json = std::move(*src);
  }
  absl::StatusOr<std::string> config = HfConfigJson(spec.model(), options.dtype, extras);
  if (!config.ok()) return config.status();
  return WriteTextAtomically(absl::StrCat(out_dir, "/", kHfConfigFile), *config + "\n");
}

}  // namespace fsdp8
