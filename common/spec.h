// Job spec rules shared by the coordinator (validation) and the worker (reading the spec):
// defaults, validation with messages naming the field and the rule, and YAML/JSON parsing for the CLI.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

// Limits on what a spec may hold, so that one submission cannot grow the coordinator's job table
// without bound: the serialized size of the spec, and the bytes of every string field — paths
// (data.train_path, data.val_path, checkpoint.dir, checkpoint.resume_from, init.from_hf,
// init.from_checkpoint) up to kMaxPathBytes, every other string (name, backend) up to
// kMaxNameBytes. Also the limit on a request id. kMaxSpecBytes also bounds a spec file the CLI
// reads (ReadSpecFile): a file larger than a spec may be is refused before it is read.
inline constexpr int64_t kMaxSpecBytes = 64 << 10;
inline constexpr int64_t kMaxPathBytes = 1024;
inline constexpr int64_t kMaxNameBytes = 256;

// INVALID_ARGUMENT naming the field and the limit when `spec` (as given, before defaults) breaks
// one of the limits above: "spec: serialized size 70000 bytes exceeds the limit of 65536 bytes",
// "name: longer than the limit of 256 bytes (got 10485760)". ValidateSpec checks it first.
absl::Status CheckSpecLimits(const v1::JobSpec& spec);

// The largest model.vocab_size accepted (token ids travel as int32; every published Llama-family
// vocabulary, up to 256k, fits).
inline constexpr int kMaxVocabSize = 1 << 20;

// Returns `spec` with every unset field filled with its documented default (see spec.proto).
// world_size is needed for the microbatch default (global_batch / world_size); pass 0 when unknown
// (the microbatch default is then left unset). Fields set in their old place (kMovedFields) are
// moved first, silently (the new place wins when both are set; MigrateSpec reports them).
// Only the coordinator (ResolveSpec) and readers of old records and user input call it: a worker
// receives a resolved spec and checks it (CheckResolved).
v1::JobSpec WithDefaults(const v1::JobSpec& spec, int world_size);

// A spec field that moved: its old path and its new one.
struct MovedField {
  const char* old_path;
  const char* new_path;
};
// training.gemm_autotune -> tuning.gemm_autotune,
// precision.fp8.forward_fast_accumulation -> tuning.forward_fast_accumulation.
extern const MovedField kMovedFields[2];

// Moves every field set in its old place (kMovedFields) to its new place and clears the old one;
// returns one warning per field moved, naming both places:
//   "training.gemm_autotune: moved to tuning.gemm_autotune (read from the old place for now;
//    write it there)".
// INVALID_ARGUMENT naming both places when a field is set in both with different values. For
// specs written before the move: users' YAML and API requests (at submit), the state db's jobs
// and checkpoint MANIFESTs (on load).
absl::StatusOr<std::vector<std::string>> MigrateSpec(v1::JobSpec* spec);

// The coordinator's resolution of a job's spec: moved fields migrated (MigrateSpec; its warnings
// appended to *warnings when given), every default applied at world_size (WithDefaults), then
// checked (ValidateSpec with data_roots and check_files). world_size 0: the job's spec before a
// world size is fixed (training.microbatch stays unset unless given). Errors: MigrateSpec's and
// ValidateSpec's.
absl::StatusOr<v1::JobSpec> ResolveSpec(const v1::JobSpec& spec, int world_size,
                                        const std::vector<std::string>& data_roots,
                                        bool check_files,
                                        std::vector<std::string>* warnings = nullptr);

// A spec read back from a record an earlier release may have written (a state db row, a
// checkpoint MANIFEST): moved fields in their new place and the defaults added since applied
// (WithDefaults(stored, 0)); every set field is kept. The one migration on load.
v1::JobSpec MigrateStoredSpec(const v1::JobSpec& stored);

// The model section alone with its defaults (those WithDefaults gives it), for readers of a model
// section outside a job spec (Hugging Face config.json conversion, common/hf_model.h).
v1::ModelConfig DefaultedModel(const v1::ModelConfig& model);

// Whether every default is applied at world_size and no moved field is in its old place
// (WithDefaults(spec, world_size) would change nothing): INVALID_ARGUMENT naming the first field
// it would fill or move otherwise,
//   "spec: not resolved at world size 2 (the coordinator resolves a job's spec, ResolveSpec):
//    added: training.microbatch: 8".
// What the plans (PlanMemory, MakeShardPlan) require of their spec; CheckResolved adds the rules.
absl::Status CheckDefaulted(const v1::JobSpec& spec, int world_size);

// What a worker checks of the spec its assignment carries, without filling anything in: nothing
// in a moved field's old place, every default applied at world_size (WithDefaults would change
// nothing) and ValidateSpec(spec, world_size, {}, false) passing: CheckDefaulted's error, or
// ValidateSpec's.
absl::Status CheckResolved(const v1::JobSpec& spec, int world_size);

// Checks the rules of a job spec (after WithDefaults). Returns INVALID_ARGUMENT whose message names
// the field path and the rule, e.g.
//   "model.d_model: must be divisible by model.n_heads (130 % 4 != 0)".
// world_size: the number of ranks the job would run on (checks global_batch divisible by
// world_size * microbatch); 0 skips the world-size rules.
// data_roots: directories that data.train_path / data.val_path must lie under, both lexically
// (after std::filesystem::lexically_normal, so ".." cannot escape; the paths must then be absolute)
// and after resolving symlinks (std::filesystem::weakly_canonical of path and root, so a link inside
// a root that points outside is refused); empty means no restriction. The check is made when the
// job is submitted.
// checkpoint: every_steps >= 0, keep_last >= 1; checkpoint.dir follows the data-root rule of
// data.train_path; every_steps > 0 and a non-empty resume_from need checkpoint.dir; resume_from is
// empty, "latest" or a path strictly under checkpoint.dir (lexically normalised; whether it holds
// a committed checkpoint is checked by the coordinator, not here).
// max_restarts >= 0 (default 3 with a checkpoint.dir, else 0).
// init.from_hf and init.from_checkpoint follow the data-root rule of data.train_path; at most one
// of them is set; init.load_optimizer_state and init.load_fp8_state need init.from_checkpoint
// (whether it holds a committed checkpoint of the job's model is checked by the coordinator).
// data.sampling is EPOCH or RANDOM.
// check_files: data.train_path (and data.val_path when set) must name token shards
// (ExpandShardPaths in token_dataset.h: a file, a directory or a glob; a pattern matching nothing is
// refused naming it), each under the data roots and readable (header and size checked, see
// token_shard.h; the error names the shard), one of them holding at least seq_len + 1 tokens;
// init.from_hf must hold
// a config.json matching the model section (CheckHfDir in hf_model.h) and a model.safetensors.
// Unset fields are first given their defaults (WithDefaults(spec, world_size)); rules stop at the
// first violation.
absl::Status ValidateSpec(const v1::JobSpec& spec, int world_size,
                          const std::vector<std::string>& data_roots, bool check_files);

// The text of a job spec file, for the CLI: the file's size is checked (fstat of the open file)
// before anything is read, and at most kMaxSpecBytes + 1 bytes are ever read (a file that grows
// meanwhile, a pipe), so memory stays bounded whatever the file holds. NOT_FOUND naming the path
// and the errno text when it cannot be opened or read; INVALID_ARGUMENT naming the path, its size
// and the limit when it is larger than kMaxSpecBytes ("big.yaml: 53477376 bytes exceeds the
// limit of 65536 bytes on a job spec").
absl::StatusOr<std::string> ReadSpecFile(const std::string& path);

// Parses a job spec from YAML or JSON text (protobuf JSON mapping: original or lowerCamel field
// names, enum value names; YAML uses the same names). Enums also accept case-insensitive value names
// and the short spellings fp8/bf16/fp32, delayed/current, hybrid/e4m3, max/most_recent,
// tensorwise/rowwise/blockwise. A null value
// leaves the field unset. Nothing is defaulted or validated here (see WithDefaults, ValidateSpec).
// Errors are INVALID_ARGUMENT naming the field path and the source position, e.g.
//   "model.dmodel: unknown field \"dmodel\" (line 2, column 3)",
//   "model.d_model: expected an integer (got \"abc\") (line 2, column 12)",
//   "spec: parse error at line 3, column 5: ..." (malformed YAML/JSON).
absl::StatusOr<v1::JobSpec> ParseSpec(const std::string& text);

// Number of sequences each rank processes per optimizer step: global_batch / world_size.
int LocalBatch(const v1::JobSpec& spec, int world_size);
// Gradient-accumulation microbatches per step: LocalBatch / microbatch.
int Microbatches(const v1::JobSpec& spec, int world_size);

// The effective precision of block `layer`'s linears (overrides applied).
v1::Precision LayerLinearPrecision(const v1::JobSpec& spec, int layer);

// The effective FP8 scaling granularity of block `layer`'s linears: the override's when set, else
// precision.fp8.granularity; TENSORWISE when neither is set, and TENSORWISE for a block whose
// linears are not FP8 (the field means nothing there).
v1::Fp8Granularity LayerGranularity(const v1::JobSpec& spec, int layer);

// Whether any block's FP8 linears scale rowwise or blockwise (LayerGranularity).
bool AnyScaledGranularity(const v1::JobSpec& spec);
// The field that makes some block rowwise or blockwise: "precision.fp8.granularity" when that
// is not TENSORWISE (nor unset), else "precision.overrides[i].granularity" of the first override
// whose layer is; "" when every block is tensorwise (AnyScaledGranularity false).
std::string ScaledGranularityField(const v1::JobSpec& spec);

// "TENSORWISE", "ROWWISE", "BLOCKWISE" or "UNSPECIFIED".
const char* GranularityName(v1::Fp8Granularity g);

// Bytes per parameter element of the AdamW state, both moments m and v together, for
// optimizer.state_precision (defaults applied): 8 for FP32, 4 for BF16. The master weights (4)
// and the gradient shard (4) are not included. For memory plans.
int64_t AdamStateBytesPerElement(const v1::JobSpec& spec);

}  // namespace fsdp8
