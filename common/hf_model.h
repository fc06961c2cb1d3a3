// Hugging Face interchange of the full model (docs/architecture.md, Model, Checkpoints): a directory
// holding config.json (a LlamaConfig) and model.safetensors with LlamaForCausalLM tensor names and
// shapes (the shard plan's names: model.embed_tokens.weight (V, C), model.layers.{i}.input_layernorm
// .weight (C), self_attn.{q,k,v,o}_proj.weight (out_features, in_features), post_attention_layernorm
// .weight, mlp.{gate,up,down}_proj.weight, model.norm.weight (C), lm_head.weight (V, C)).
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

// config.json text for `m` (defaults applied): LlamaForCausalLM, model_type "llama", hidden_size,
// intermediate_size, num_attention_heads, num_key_value_heads, head_dim, num_hidden_layers,
// vocab_size, rms_norm_eps, rope_theta, max_position_embeddings = seq_len, hidden_act "silu",
// tie_word_embeddings false, attention_bias / mlp_bias false, torch_dtype ("float32" or "bfloat16").
std::string HfConfigJson(const v1::ModelConfig& m, SafetensorsDtype dtype);

// Checks config.json text against the model section `m` (defaults applied). INVALID_ARGUMENT
// naming `field` ("init.from_hf"), the config.json key and the model field, e.g.
//   "init.from_hf: config.json hidden_size is 64, model.d_model is 32".
// Requires model_type "llama"; equal sizes; num_key_value_heads (default num_attention_heads);
// head_dim (when present) = d_model / n_heads; rms_norm_eps and rope_theta (default 10000) equal to
// within 1e-9 relative; max_position_embeddings >= seq_len; hidden_act "silu"; no
// tie_word_embeddings, attention_bias, mlp_bias or rope_scaling.
absl::Status CheckHfConfig(const std::string& config_json, const v1::ModelConfig& m,
                           const std::string& field);
// The model section that config.json describes (seq_len = max_position_embeddings).
absl::StatusOr<v1::ModelConfig> ModelConfigFromHf(const std::string& config_json);
// Reads DIR/config.json and checks it (CheckHfConfig); also requires DIR/model.safetensors to
// exist. INVALID_ARGUMENT naming `field` when either is missing or unreadable.
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

// Writes out_dir/config.json and out_dir/model.safetensors (out_dir is created; existing files of
// those names are replaced) from the committed checkpoint step_dir. The safetensors metadata
// records the job id and step. Errors as ReadCheckpointWeights, plus I/O errors naming the file.
absl::Status ExportHf(const std::string& step_dir, const std::string& out_dir,
                      SafetensorsDtype dtype);

}  // namespace fsdp8
