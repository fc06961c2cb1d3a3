// `fsdp8 prepare`: text files -> byte-level llm.c-compatible token shards.
//
// The files are concatenated as bytes in the given order; every byte is one token (0..255). The
// last floor(val_fraction * total) bytes become <out_dir>/val.bin, the rest <out_dir>/train.bin
// (common/token_shard.h format). out_dir is created when missing. The tokenizer record
// <out_dir>/tokenizer/token_ids.json (common/hf_model.h) says the tokens are bytes, with no BOS,
// EOS or padding token, so that an export of a job trained on them writes no special token ids.
//
// Thread-safety: a pure function of its inputs and the files it reads and writes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fsdp8 {

struct PrepareResult {
  std::string train_path;
  std::string val_path;
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
};

// INVALID_ARGUMENT for no files or val_fraction outside [0, 1); NOT_FOUND/INTERNAL (with the
// path) when a file cannot be read or a shard cannot be written.
absl::StatusOr<PrepareResult> PrepareTokenShards(const std::vector<std::string>& files,
                                                 const std::string& out_dir,
                                                 double val_fraction = 0.05);

}  // namespace fsdp8
