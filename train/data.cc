#include "train/data.h"

#include "common/check.h"
#include "absl/strings/str_cat.h"
#include "common/token_shard.h"

namespace fsdp8 {

absl::StatusOr<TokenData> TokenData::Load(const std::string& path, int seq_len, int vocab_size) {
  absl::StatusOr<TokenShard> shard = ReadTokenShard(path);
  if (!shard.ok()) return shard.status();
  TokenData d;
  d.tokens_ = std::move(shard->tokens);
  d.seq_len_ = seq_len;
  const int64_t needed = static_cast<int64_t>(seq_len) + 1;  // 64 bits: seq_len may be INT32_MAX
  if (static_cast<int64_t>(d.tokens_.size()) < needed) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", d.tokens_.size(),
                                                   " tokens, fewer than seq_len + 1 = ", needed));
  }
  for (size_t i = 0; i < d.tokens_.size(); ++i) {
    if (d.tokens_[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": token ", d.tokens_[i], " at ", i,
                                                     " is >= model.vocab_size ", vocab_size));
    }
  }
  return d;
}

void TokenData::Batch(uint64_t seed, int64_t step, int64_t first, int64_t count, uint64_t stream,
                      int32_t* inputs, int32_t* targets) const {
  const int64_t n = num_tokens();
  for (int64_t s = 0; s < count; ++s) {
    const int64_t start = WindowStart(seed, step, first + s, n, seq_len_, stream);
    FSDP8_CHECK(start >= 0 && start + seq_len_ + 1 <= n) << "window start " << start;
    for (int t = 0; t < seq_len_; ++t) {
      inputs[s * seq_len_ + t] = tokens_[start + t];
      targets[s * seq_len_ + t] = tokens_[start + t + 1];
    }
  }
}

}  // namespace fsdp8
