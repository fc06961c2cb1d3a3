// Token shards: the one reader and writer of fsdp8's tokenized-data files.
//
// File format (llm.c, karpathy/llm.c dev/data/data_common.py `write_datafile`): a header of 256
// little-endian int32 — header[0] magic, header[1] version, header[2] token count N (0 <= N <
// 2^31), the rest 0 — then N little-endian tokens. Two formats:
//
//   | format  | magic    | version | token type | file size    | llm.c name |
//   |---------|----------|---------|------------|--------------|------------|
//   | uint16  | 20240520 | 1       | uint16     | 1024 + 2 * N | "gpt-2"    |
//   | uint32  | 20240801 | 7       | uint32     | 1024 + 4 * N | "llama-3"  |
//
// Writers pick the narrowest format that holds the vocabulary (TokenBytesForVocab). Readers keep
// the file open (TokenShardReader) and read the tokens they need with pread(2) into their own
// buffer: a shard is never read whole into anonymous memory, so a worker's resident anonymous
// memory does not grow with the dataset, and a file that shrinks, is replaced or is deleted while
// it is read gives an error naming it (DATA_LOSS), never a signal (a memory map of a truncated
// file raises SIGBUS on the next touch of a page past its end).
//
// The data rule (which windows a step reads) is in common/token_dataset.h.
//
// Thread-safety: the free functions touch only the named file (and its temp file);
// TokenShardReader is immutable after Open and may be used from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp8 {

inline constexpr int32_t kTokenShardMagic = 20240520;       // uint16 tokens
inline constexpr int32_t kTokenShardVersion = 1;
inline constexpr int32_t kTokenShardMagicU32 = 20240801;    // uint32 tokens
inline constexpr int32_t kTokenShardVersionU32 = 7;
inline constexpr int kTokenShardHeaderInts = 256;
inline constexpr int64_t kTokenShardHeaderBytes = kTokenShardHeaderInts * 4;

// What a shard's header says, checked against the file size.
struct TokenShardHeader {
  int token_bytes = 2;     // 2 (uint16 format) or 4 (uint32 format)
  int64_t num_tokens = 0;  // N
};

// Bytes per token of the narrowest format holding token ids [0, vocab_size): 2 when
// vocab_size <= 65536, else 4.
int TokenBytesForVocab(int64_t vocab_size);

// Writes tokens[0, n) as a shard of `token_bytes` (2 or 4) per token at `path`: to
// "<path>.tmp.<pid>" first, fsynced, then renamed over `path` (readers never see a partial file).
// INVALID_ARGUMENT when token_bytes is not 2 or 4, n >= 2^31 (the header holds an int32 count), or
// a token does not fit (>= 65536 in the uint16 format; the message names its index); INTERNAL with
// the path and errno text on I/O failure.
absl::Status WriteTokenShard(const std::string& path, const uint32_t* tokens, int64_t n,
                             int token_bytes);
// The uint16 format from 16-bit tokens.
absl::Status WriteTokenShard(const std::string& path, const std::vector<uint16_t>& tokens);

// Reads and checks the header: NOT_FOUND when the file cannot be opened; INVALID_ARGUMENT, with the
// path in the message, for a short header, an unknown (magic, version) pair, a negative count, or a
// file size that does not match the header.
absl::StatusOr<TokenShardHeader> ReadTokenShardHeader(const std::string& path);

// One shard, open read-only (header checked as ReadTokenShardHeader). Tokens are read with
// pread(2) (no memory map): the page cache holds what was read, file-backed, and the kernel may
// drop it under memory pressure.
//
// The file may change under a long-running reader (truncated, rewritten, replaced by a rename,
// deleted). Read never reads past the end the file has now (a short read is DATA_LOSS), and
// CheckUnchanged tells whether the path still names the file as it was opened: a caller that
// checks after its reads knows that what it read came from that file.
class TokenShardReader {
 public:
  // Errors as ReadTokenShardHeader; INTERNAL when the file cannot be stat'ed.
  static absl::StatusOr<std::unique_ptr<TokenShardReader>> Open(const std::string& path);
  ~TokenShardReader();  // closes the file
  TokenShardReader(const TokenShardReader&) = delete;
  TokenShardReader& operator=(const TokenShardReader&) = delete;

  const std::string& path() const { return path_; }
  int64_t num_tokens() const { return header_.num_tokens; }
  int token_bytes() const { return header_.token_bytes; }
  // out[0, count) = tokens [first, first + count) widened to uint32; requires
  // 0 <= first <= first + count <= num_tokens(). DATA_LOSS naming the path when the file ends
  // before the last byte asked for (it shrank since Open); INTERNAL with the errno text when the
  // read fails.
  absl::Status Read(int64_t first, int64_t count, uint32_t* out) const;
  // OK while the open file has the size and modification time it had at Open and `path` still
  // names it (same device and inode). Otherwise DATA_LOSS naming the path and what changed:
  // its size (truncated or extended), its modification time (rewritten in place), or the file
  // the path names (replaced, e.g. renamed over) or none (deleted). Two stat calls; never reads.
  absl::Status CheckUnchanged() const;

 private:
  TokenShardReader() = default;
  std::string path_;
  TokenShardHeader header_;
  int fd_ = -1;
  int64_t file_bytes_ = 0;  // at Open
  uint64_t dev_ = 0, ino_ = 0;
  int64_t mtime_ns_ = 0;  // at Open
};

// A whole shard in memory, for tests and small tools (training reads windows instead).
struct TokenShard {
  std::vector<uint32_t> tokens;
  int token_bytes = 2;
};
// Errors as TokenShardReader::Open and Read.
absl::StatusOr<TokenShard> ReadTokenShard(const std::string& path);

// SplitMix64 (Steele, Lea, Flood 2014; the finaliser of java.util.SplittableRandom): one step of the
// generator from state x, i.e. mix(x + 0x9e3779b97f4a7c15). A bijection on uint64 with good
// avalanche; the counter-based hash behind data order and parameter initialisation.
uint64_t SplitMix64(uint64_t x);

// Stream ids of the data rule.
inline constexpr uint64_t kTrainStream = 0;
inline constexpr uint64_t kValidationStream = 1;

// The hash behind the random-window rule:
//   SplitMix64(SplitMix64(SplitMix64(SplitMix64(seed) ^ stream) ^ step) ^ global_index).
uint64_t WindowHash(uint64_t seed, int64_t step, int64_t global_index, uint64_t stream);

// The random-window rule on one shard of num_tokens tokens: start offset of the window of sequence
// `global_index` in step `step` (for the validation stream, `step` is the validation batch number).
// Returns a value in [0, num_tokens - seq_len - 1]:
//   h = SplitMix64(SplitMix64(SplitMix64(SplitMix64(seed) ^ stream) ^ step) ^ global_index)
//   start = floor(h * S / 2^64),  S = num_tokens - seq_len  (number of legal starts)
// Returns -1 when num_tokens < seq_len + 1 (no full window) or seq_len < 1.
int64_t WindowStart(uint64_t seed, int64_t step, int64_t global_index, int64_t num_tokens,
                    int seq_len, uint64_t stream);

}  // namespace fsdp8
