// TokenData: a token shard in host memory and the global-batch data rule (common/token_shard.h):
// sequence `global_index` of step `step` is the window starting at
// WindowStart(seed, step, global_index, num_tokens, seq_len, stream); inputs are its first
// seq_len tokens, targets the next seq_len.
//
// Thread-safety: immutable after Load; Batch may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fsdp8 {

class TokenData {
 public:
  // Reads the shard; INVALID_ARGUMENT when it has no full window of seq_len + 1 tokens or holds a
  // token >= vocab_size; read errors as ReadTokenShard.
  static absl::StatusOr<TokenData> Load(const std::string& path, int seq_len, int vocab_size);

  // inputs, targets (count * seq_len) int32 for global indices [first, first + count).
  void Batch(uint64_t seed, int64_t step, int64_t first, int64_t count, uint64_t stream,
             int32_t* inputs, int32_t* targets) const;
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  std::vector<uint16_t> tokens_;
  int seq_len_ = 0;
};

}  // namespace fsdp8
