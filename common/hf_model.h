// Hugging Face interchange of the full model (docs/architecture.md, Model, Checkpoints): a directory
// holding config.json (a LlamaConfig) and model.safetensors with LlamaForCausalLM tensor names and
// shapes (the shard plan's names: model.embed_tokens.weight (V, C), model.layers.{i}.input_layernorm
// .weight (C), self_attn.{q,k,v,o}_proj.weight (out_features, in_features), post_attention_layernorm
// .weight, mlp.{gate,up,down}_proj.weight, model.norm.weight (C), lm_head.weight (V, C); no
// lm_head.weight with tied embeddings, whose config.json says tie_word_embeddings: true).
//
// fsdp8's RoPE is HF's rotate_half convention on the same head layout (head h = rows
// [h * head_dim, (h + 1) * head_dim) of q_proj / k_proj; pairs (i, i + head_dim / 2)), so q_proj
// and k_proj are exported as they are, with no permutation.
//
// Export reads a committed checkpoint on local storage (its MANIFEST and every rank file, each
// checked against the MANIFEST's size and CRC-32 and the rank file's own trailer; both formats in
// common/checkpoint_format.h) and writes the FP32 master weights, unsharded, as F32 (default) or
// BF16.
//
// Thread-safety: functions touch only their arguments and the named files.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "fsdp8/v1/checkpoint.pb.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

inline constexpr char kHfConfigFile[] = "config.json";
inline constexpr char kHfWeightsFile[] = "model.safetensors";
// A sharded model: {"metadata": {"total_size": bytes}, "weight_map": {tensor: shard file}} and the
// shards model-<i>-of-<n>.safetensors (i from 00001, 5 digits), in the same directory.
inline constexpr char kHfIndexFile[] = "model.safetensors.index.json";
// The tokenizer files an export copies from the job's init.from_hf directory (those present).
inline constexpr const char* kHfTokenizerFiles[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "generation_config.json"};
inline constexpr char kHfGenerationConfigFile[] = "generation_config.json";

// The record of the tokenizer a corpus was prepared with: `fsdp8 prepare` and `fsdp8-prepare`
// write the directory kTokenizerRecordDir beside the shards of their --out folder, holding
// kTokenIdsFile, a JSON object
//   {"kind": "bytes" | "hf" | "sentencepiece", "vocab_size": N,
//    "bos_token_id": id | null, "eos_token_id": id | null, "pad_token_id": id | null, ...}
// (the separators the shards hold: each document is [BOS] tokens [EOS]; byte-level shards have
// none), and, for a real tokenizer, the files transformers loads it from (tokenizer.json or
// tokenizer.model, and a tokenizer_config.json naming the same bos/eos/pad tokens).
inline constexpr char kTokenizerRecordDir[] = "tokenizer";
inline constexpr char kTokenIdsFile[] = "token_ids.json";

// The weights of a Hugging Face model directory: model.safetensors, or (when there is none)
// model.safetensors.index.json and the shards its weight_map names. Every shard is opened and
// validated (SafetensorsFile::Open); the index must name plain file names in the directory, and
// its weight_map must list exactly the tensors the shards hold, each in the shard holding it.
// Thread-safety: immutable after Open; Read from any thread.
class HfWeights {
 public:
  // NOT_FOUND when the directory has neither file; DATA_LOSS naming the file for a malformed
  // index or shard, or a weight_map that disagrees with the shards.
  static absl::StatusOr<HfWeights> Open(const std::string& dir);

  struct Entry {
    SafetensorsTensor tensor;
    int file = 0;  // index into files()
  };
  const std::map<std::string, Entry>& tensors() const { return tensors_; }
  const std::vector<SafetensorsFile>& files() const { return files_; }
  // SafetensorsFile::Read of the shard holding `name` (memory-maps only the range).
  absl::Status Read(const std::string& name, int64_t first, int64_t n, float* out) const;

 private:
  std::vector<SafetensorsFile> files_;
  std::map<std::string, Entry> tensors_;
};

// config.json text for `m` (defaults applied): LlamaForCausalLM, model_type "llama", hidden_size,
// intermediate_size, num_attention_heads, num_key_value_heads, head_dim, num_hidden_layers,
// vocab_size, rms_norm_eps, rope_theta, rope_scaling (null, or {rope_type "llama3", factor,
// low_freq_factor, high_freq_factor, original_max_position_embeddings}), max_position_embeddings =
// seq_len, hidden_act "silu", tie_word_embeddings, attention_bias / mlp_bias false, torch_dtype
// ("float32" or "bfloat16").
std::string HfConfigJson(const v1::ModelConfig& m, SafetensorsDtype dtype);

// What an export knows beyond the model section.
struct HfConfigExtras {
  // A JSON object whose bos_token_id, eos_token_id and pad_token_id (an id, a list of ids or
  // null; kTokenIdsFile, generation_config.json or config.json) go into config.json. Each key it
  // lacks is written as null, so that transformers does not assume LlamaConfig's defaults (1, 2).
  std::string token_ids_json;
  // The config.json of the job's init.from_hf directory, when set: its max_position_embeddings
  // and rope_scaling (or transformers 5's rope_parameters) are kept as they came instead of
  // seq_len and the model section's scaling.
  std::string source_config_json;
};
// HfConfigJson with the extras. INVALID_ARGUMENT when either extra is not a JSON object.
absl::StatusOr<std::string> HfConfigJson(const v1::ModelConfig& m, SafetensorsDtype dtype,
                                         const HfConfigExtras& extras);

// The directory an export takes the tokenizer files and special token ids from: `tokenizer_dir`
// when set; else the tokenizer record (kTokenizerRecordDir) beside the first shard of
// spec.data.train_path, when it exists here; else spec.init.from_hf; else "" (none known).
std::string HfTokenizerSource(const v1::JobSpec& spec, const std::string& tokenizer_dir);

// Checks config.json text against the model section `m` (defaults applied). INVALID_ARGUMENT
// naming `field` ("init.from_hf"), the config.json key and the model field, e.g.
//   "init.from_hf: config.json hidden_size is 64, model.d_model is 32".
// Requires model_type "llama"; equal sizes; num_key_value_heads (default num_attention_heads);
// head_dim (when present) = d_model / n_heads; rms_norm_eps and rope_theta (default 10000) equal to
// within 1e-9 relative; max_position_embeddings >= seq_len; hidden_act "silu"; tie_word_embeddings
// (default false) equal; the RoPE scaling equal (rope_scaling, or transformers 5's
// rope_parameters, with rope_type "default" or "llama3"). Keys of features fsdp8 does not
// implement are refused by name: attention_bias, mlp_bias, use_sliding_window true, sliding_window
// set, partial_rotary_factor != 1, another rope_type.
absl::Status CheckHfConfig(const std::string& config_json, const v1::ModelConfig& m,
                           const std::string& field);
// The model section that config.json describes (seq_len = max_position_embeddings), with the
// refusals of CheckHfConfig (unimplemented features, head_dim != hidden_size / heads) naming the
// key, e.g. "config.json: attention_bias must be false (...)".
absl::StatusOr<v1::ModelConfig> ModelConfigFromHf(const std::string& config_json);
// The spec's model section, as YAML text ("model:\n  d_model: 2048\n  ..."), that config.json
// describes (ModelConfigFromHf, its refusals included), with seq_len = min(seq_len,
// max_position_embeddings): training sequences are usually far shorter than the positions the
// model supports. Every field is written, so the section does not depend on spec defaults.
absl::StatusOr<std::string> HfModelSectionYaml(const std::string& config_json, int seq_len);

// Reads DIR/config.json and checks it (CheckHfConfig); also requires DIR/model.safetensors or
// DIR/model.safetensors.index.json to exist. INVALID_ARGUMENT naming `field` when either is
// missing or unreadable.
absl::Status CheckHfDir(const std::string& dir, const v1::ModelConfig& m, const std::string& field);

// The FP32 master weights of a committed checkpoint, unsharded.
struct CheckpointWeights {
  v1::CheckpointManifest manifest;
  // In shard-plan order: name, shape, values.
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> values;
  };
  std::vector<Tensor> tensors;
};

// Reads step_dir (a committed checkpoint: step-<k> with a MANIFEST). NOT_FOUND without a MANIFEST,
// DATA_LOSS for a damaged MANIFEST or rank file (size, CRC-32, layout), FAILED_PRECONDITION for
// a format version this build does not read.
absl::StatusOr<CheckpointWeights> ReadCheckpointWeights(const std::string& step_dir);

// The committed step directory to export: `path` itself when it holds a MANIFEST (its step must
// equal `step` when given), else the checkpoint root `path`'s step-<step> or, without `step`, its
// newest step-<k> holding a parseable MANIFEST. NOT_FOUND when there is none.
absl::StatusOr<std::string> ResolveCheckpointStepDir(const std::string& path,
                                                     std::optional<int64_t> step);

struct HfExportOptions {
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  // Largest shard in bytes of tensor data (as transformers' max_shard_size): tensors go into
  // shards in shard-plan order, a new shard starting when the next tensor would not fit (a tensor
  // larger than this gets a shard of its own). When everything fits in one: model.safetensors.
  int64_t max_shard_bytes = int64_t{5} << 30;
  // Where the tokenizer files (kHfTokenizerFiles) and special token ids are taken from; empty:
  // as HfTokenizerSource (the corpus' tokenizer record, else init.from_hf).
  std::string tokenizer_dir;
};

// Writes out_dir/config.json and the weights (out_dir is created; files of the names written are
// replaced; a model.safetensors or index left from an earlier export of the other layout is
// removed, so that transformers reads the new one) from the committed checkpoint step_dir, and
// copies the tokenizer files found (their names, and generation_config.json when it is written,
// appended to *tokenizer_files when it is not null).
// Each safetensors file's metadata records the job id and step.
// Special token ids, from the source's kTokenIdsFile, else its generation_config.json, else its
// config.json: written into config.json (null when unknown) and, when known, into
// generation_config.json (the copied one's other keys kept). The job's init.from_hf config.json,
// when readable, gives max_position_embeddings and the RoPE scaling (HfConfigExtras).
// Errors as ReadCheckpointWeights, INVALID_ARGUMENT for max_shard_bytes < 1 or a source JSON
// file that is not an object (naming it), plus I/O errors naming the file.
absl::Status ExportHf(const std::string& step_dir, const std::string& out_dir,
                      const HfExportOptions& options,
                      std::vector<std::string>* tokenizer_files = nullptr);
inline absl::Status ExportHf(const std::string& step_dir, const std::string& out_dir,
                             SafetensorsDtype dtype) {
  HfExportOptions o;
  o.dtype = dtype;
  return ExportHf(step_dir, out_dir, o);
}

}  // namespace fsdp8
