// Token shards and the global-batch data rule.
//
// File format (llm.c, karpathy/llm.c dev/data/data_common.py `write_datafile`): a header of 256
// little-endian int32 (header[0] = magic 20240520, header[1] = version 1, header[2] = token count N,
// the rest 0), then N little-endian uint16 tokens. The file size is exactly 1024 + 2 * N bytes.
//
// Data rule (the design's "one training step"): the sequence at global index i of step k is a
// window of seq_len + 1 consecutive tokens starting at WindowStart(seed, k, i, N, seq_len, stream);
// tokens [start, start + seq_len) are the input and [start + 1, start + seq_len + 1) the target.
// The start depends on (seed, step, index, stream, N, seq_len) only: no sampler state and nothing
// about the world size, so a job on 1, 2 or 3 ranks (rank r takes a contiguous slice of the global
// indices) and a resumed job read exactly the same sequences.
//
// Thread-safety: pure functions; the file functions touch only the named file (and its temp file).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp8 {

inline constexpr int32_t kTokenShardMagic = 20240520;
inline constexpr int32_t kTokenShardVersion = 1;
inline constexpr int kTokenShardHeaderInts = 256;
inline constexpr int64_t kTokenShardHeaderBytes = kTokenShardHeaderInts * 4;

struct TokenShard {
  std::vector<uint16_t> tokens;
};

// Writes `tokens` as a token shard at `path`: to "<path>.tmp.<pid>" first, then renamed over `path`
// (readers never see a partial file). INTERNAL with the path and errno text on I/O failure;
// INVALID_ARGUMENT when there are more than INT32_MAX tokens (the header holds an int32 count).
absl::Status WriteTokenShard(const std::string& path, const std::vector<uint16_t>& tokens);

// Reads a whole token shard. NOT_FOUND when the file cannot be opened; INVALID_ARGUMENT, with the
// path in the message, for a short header, a wrong magic or version, a negative count, or a file
// size that is not 1024 + 2 * count bytes.
absl::StatusOr<TokenShard> ReadTokenShard(const std::string& path);

// Reads and checks only the header (and the file size against it); returns the token count.
// Errors as ReadTokenShard.
absl::StatusOr<int64_t> ReadTokenShardHeader(const std::string& path);

// SplitMix64 (Steele, Lea, Flood 2014; the finaliser of java.util.SplittableRandom): one step of the
// generator from state x, i.e. mix(x + 0x9e3779b97f4a7c15). A bijection on uint64 with good
// avalanche; the counter-based hash behind data order and parameter initialisation.
uint64_t SplitMix64(uint64_t x);

// Stream ids for WindowStart.
inline constexpr uint64_t kTrainStream = 0;
inline constexpr uint64_t kValidationStream = 1;

// Start offset of the window of sequence `global_index` in step `step` (for the validation stream,
// `step` is the validation batch number b in [0, eval_batches), so every evaluation reads the same
// windows). Returns a value in [0, num_tokens - seq_len - 1]:
//   h = SplitMix64(SplitMix64(SplitMix64(SplitMix64(seed) ^ stream) ^ step) ^ global_index)
//   start = floor(h * W / 2^64),  W = num_tokens - seq_len  (number of legal starts)
// Returns -1 when num_tokens < seq_len + 1 (no full window) or seq_len < 1.
int64_t WindowStart(uint64_t seed, int64_t step, int64_t global_index, int64_t num_tokens,
                    int seq_len, uint64_t stream);

}  // namespace fsdp8
