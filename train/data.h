// TokenData: a worker's view of a token dataset — its shards open for reading
// (TokenShardReader, common/token_shard.h), never read whole — and the data rule (common/token_dataset.h): sequence `global_index` of step
// `step` is the window DataOrder::Window(seed, stream, step, global_index); inputs are its first
// seq_len tokens, targets the next seq_len.
//
// Thread-safety: immutable after Load; Batch may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/token_dataset.h"
#include "common/token_shard.h"

namespace fsdp8 {

class TokenData {
 public:
  // Opens every shard `path` names (ExpandShardPaths). NOT_FOUND / INVALID_ARGUMENT as
  // ExpandShardPaths and TokenShardReader::Open (naming the shard); INVALID_ARGUMENT when no shard
  // holds a window of seq_len + 1 tokens. Token values are checked against vocab_size as batches
  // are read (Batch), not here: a large corpus is not paged in at load.
  static absl::StatusOr<std::unique_ptr<TokenData>> Load(const std::string& path, int seq_len,
                                                         int vocab_size, int64_t global_batch,
                                                         Sampling sampling);

  // inputs, targets (count * seq_len) int32 for global indices [first, first + count) of `step`.
  // Every shard the batch read is checked after its windows were read
  // (TokenShardReader::CheckUnchanged): DATA_LOSS naming the shard when it shrank, was rewritten,
  // replaced or deleted since Load (a read past its new end is DATA_LOSS as well), so a batch is
  // never built from a file other than the one the job opened. INVALID_ARGUMENT naming the shard
  // and the offset when a token is >= vocab_size.
  absl::Status Batch(uint64_t seed, int64_t step, int64_t first, int64_t count, uint64_t stream,
                     int32_t* inputs, int32_t* targets) const;

  const DataOrder& order() const { return *order_; }
  int64_t num_tokens() const { return num_tokens_; }  // over all shards
  int num_shards() const { return static_cast<int>(shards_.size()); }

 private:
  std::vector<std::unique_ptr<TokenShardReader>> shards_;
  std::unique_ptr<DataOrder> order_;
  int seq_len_ = 0;
  int vocab_size_ = 0;
  int64_t num_tokens_ = 0;
};

}  // namespace fsdp8
