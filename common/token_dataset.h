// Token datasets (one or more shards) and the data rule: which tokens sequence i of step k reads.
//
// A dataset is named by one string (data.train_path / data.val_path): a shard file, a directory
// (every "*.bin" file in it, sorted by name), or a glob pattern ("/data/corpus/train_*.bin", glob(7),
// matches sorted). Its shards are taken in that order (ExpandShardPaths).
//
// Windows (docs/data.md): a window is seq_len + 1 consecutive tokens of one shard — the first
// seq_len are a sequence's inputs, the last seq_len its targets — and never straddles two shards.
// Shard s of n_s tokens holds floor((n_s - 1) / seq_len) windows at stride seq_len: window j starts
// at token j * seq_len. Windows are numbered across the dataset in shard order; W is their total.
//
// Sampling (data.sampling). Sequence i of step k has the dataset position p = k * global_batch + i
// (for the validation stream, k is the validation batch number, so every evaluation reads the same
// sequences).
//   * EPOCH (default): epoch e = floor(p / W) reads window π_e(p mod W), where π_e is a seeded
//     pseudo-random permutation of [0, W) (PermuteIndex, key from seed, stream and e): within an
//     epoch every window is read exactly once, in an order that changes every epoch.
//   * RANDOM: the window of p is drawn with replacement from every legal start of every shard (any
//     offset, not only multiples of seq_len): shard s has n_s - seq_len legal starts, and the start
//     is the WindowStart hash of (seed, stream, k, i) mapped uniformly onto their total. On one
//     shard this is exactly WindowStart (common/token_shard.h).
// Either way the window depends on (dataset, seed, k, i) only — not on the world size, the rank or
// any sampler state — so a job on any number of ranks, and a resumed job, read the same sequences.
//
// Thread-safety: DataOrder is immutable after construction; the functions are pure (except
// ExpandShardPaths, which reads the file system).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fsdp8 {

enum class Sampling { kEpoch, kRandom };

// The shard paths that `path` names (file, directory or glob; see above), sorted. NOT_FOUND naming
// `path` when a glob matches nothing or a directory holds no ".bin" file. Any other path is
// returned as the one shard (whether it exists is for the shard reader to say).
absl::StatusOr<std::vector<std::string>> ExpandShardPaths(const std::string& path);

// A pseudo-random permutation of [0, n) evaluated at q (0 <= q < n): a 4-round Feistel network on
// the smallest even number of bits b with 2^b >= n (round function: SplitMix64 of the round key and
// the right half), cycle-walked until the result falls below n (Black and Rogaway, "Ciphers with
// arbitrary finite domains", 2002). A bijection for every key; O(1) memory, expected < 4 rounds of
// walking.
uint64_t PermuteIndex(uint64_t q, uint64_t n, uint64_t key);

// Windows of a shard of num_tokens tokens: floor((num_tokens - 1) / seq_len), 0 when num_tokens <
// seq_len + 1.
int64_t ShardWindows(int64_t num_tokens, int seq_len);

// Where one sequence's window lies: tokens [start, start + seq_len + 1) of shard `shard`.
struct WindowRef {
  int shard = 0;
  int64_t start = 0;
};

// The data rule over a dataset of shards with the given token counts.
class DataOrder {
 public:
  // shard_tokens[s] = n_s. Requires seq_len >= 1 and global_batch >= 1; total_windows() may be 0
  // (then nothing may be asked of it).
  DataOrder(std::vector<int64_t> shard_tokens, int seq_len, int64_t global_batch,
            Sampling sampling);

  int64_t total_windows() const { return window_offset_.back(); }  // W
  int64_t total_starts() const { return start_offset_.back(); }    // sum of n_s - seq_len

  // The window of sequence `global_index` (0 <= index < global_batch) of step `step`.
  WindowRef Window(uint64_t seed, uint64_t stream, int64_t step, int64_t global_index) const;

  // Epochs completed after step `step` of the train stream: (step + 1) * global_batch / W.
  double EpochAfterStep(int64_t step) const;

 private:
  int seq_len_;
  int64_t global_batch_;
  Sampling sampling_;
  std::vector<int64_t> window_offset_;  // S + 1 prefix sums of the shards' windows
  std::vector<int64_t> start_offset_;   // S + 1 prefix sums of the shards' legal starts
};

}  // namespace fsdp8
