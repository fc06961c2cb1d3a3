#include "train/data.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace fsdp8 {

absl::StatusOr<std::unique_ptr<TokenData>> TokenData::Load(const std::string& path, int seq_len,
                                                           int vocab_size, int64_t global_batch,
                                                           Sampling sampling) {
  absl::StatusOr<std::vector<std::string>> paths = ExpandShardPaths(path);
  if (!paths.ok()) return paths.status();
  std::unique_ptr<TokenData> d(new TokenData());
  d->seq_len_ = seq_len;
  d->vocab_size_ = vocab_size;
  std::vector<int64_t> counts;
  for (const std::string& p : *paths) {
    absl::StatusOr<std::unique_ptr<TokenShardReader>> shard = TokenShardReader::Open(p);
    if (!shard.ok()) return shard.status();
    counts.push_back((*shard)->num_tokens());
    d->num_tokens_ += (*shard)->num_tokens();
    d->shards_.push_back(std::move(*shard));
  }
  d->order_ = std::make_unique<DataOrder>(std::move(counts), seq_len, global_batch, sampling);
  if (d->order_->total_windows() == 0) {
    // 64 bits: seq_len may be INT32_MAX.
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ", d->num_tokens_, " tokens, fewer than seq_len + 1 = ",
        static_cast<int64_t>(seq_len) + 1, " in every shard (", d->shards_.size(), " shards)"));
  }
  return d;
}

absl::Status TokenData::Batch(uint64_t seed, int64_t step, int64_t first, int64_t count,
                              uint64_t stream, int32_t* inputs, int32_t* targets) const {
  const int64_t W = static_cast<int64_t>(seq_len_) + 1;
  std::vector<uint32_t> windows(static_cast<size_t>(count * W));
  std::vector<WindowRef> refs(static_cast<size_t>(count));
  std::vector<int> read;  // the shards read, each once
  for (int64_t s = 0; s < count; ++s) {
    const WindowRef w = order_->Window(seed, stream, step, first + s);
    const TokenShardReader& shard = *shards_[w.shard];
    FSDP8_CHECK(w.start >= 0 && w.start + W <= shard.num_tokens())
        << "window start " << w.start << " in " << shard.path();
    if (absl::Status st = shard.Read(w.start, W, windows.data() + s * W); !st.ok()) return st;
    refs[s] = w;
    if (std::find(read.begin(), read.end(), w.shard) == read.end()) read.push_back(w.shard);
  }
  // After the reads: what was read came from the files as they were opened.
  for (int i : read) {
    if (absl::Status st = shards_[i]->CheckUnchanged(); !st.ok()) return st;
  }
  for (int64_t s = 0; s < count; ++s) {
    const uint32_t* window = windows.data() + s * W;
    for (int t = 0; t <= seq_len_; ++t) {
      if (window[t] >= static_cast<uint32_t>(vocab_size_)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "token shard ", shards_[refs[s].shard]->path(), ": token ", window[t], " at offset ",
            refs[s].start + t, " is >= model.vocab_size ", vocab_size_));
      }
    }
    for (int t = 0; t < seq_len_; ++t) {
      inputs[s * seq_len_ + t] = static_cast<int32_t>(window[t]);
      targets[s * seq_len_ + t] = static_cast<int32_t>(window[t + 1]);
    }
  }
  return absl::OkStatus();
}

}  // namespace fsdp8
