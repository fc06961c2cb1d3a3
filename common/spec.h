// Job spec rules shared by the coordinator (validation) and the worker (reading the spec):
// defaults, validation with messages naming the field and the rule, and YAML/JSON parsing for the CLI.
//
// Thread-safety: pure functions.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp8/v1/spec.pb.h"

namespace fsdp8 {

// Returns `spec` with every unset field filled with its documented default (see spec.proto).
// world_size is needed for the microbatch default (global_batch / world_size); pass 0 when unknown
// (the microbatch default is then left unset).
v1::JobSpec WithDefaults(const v1::JobSpec& spec, int world_size);

// Checks the rules of a job spec (after WithDefaults). Returns INVALID_ARGUMENT whose message names
// the field path and the rule, e.g.
//   "model.d_model: must be divisible by model.n_heads (130 % 4 != 0)".
// world_size: the number of ranks the job would run on (checks global_batch divisible by
// world_size * microbatch); 0 skips the world-size rules.
// data_roots: colon-free list of directories paths must lie under; empty means no restriction.
// Checks that data.train_path exists and is a readable token shard when check_files is true.
absl::Status ValidateSpec(const v1::JobSpec& spec, int world_size,
                          const std::vector<std::string>& data_roots, bool check_files);

// Parses a job spec from YAML or JSON text (protobuf JSON mapping field names; YAML uses the same
// names). Unknown fields are an error: INVALID_ARGUMENT "unknown field 'model.dmodel'".
absl::StatusOr<v1::JobSpec> ParseSpec(const std::string& text);

// Number of sequences each rank processes per optimizer step: global_batch / world_size.
int LocalBatch(const v1::JobSpec& spec, int world_size);
// Gradient-accumulation microbatches per step: LocalBatch / microbatch.
int Microbatches(const v1::JobSpec& spec, int world_size);

// The effective precision of block `layer`'s linears (overrides applied).
v1::Precision LayerLinearPrecision(const v1::JobSpec& spec, int layer);

}  // namespace fsdp8
