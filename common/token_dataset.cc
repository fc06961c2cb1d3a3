#include "common/token_dataset.h"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/token_shard.h"

namespace fsdp8 {
namespace {

bool HasGlobChars(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

absl::StatusOr<std::vector<std::string>> Glob(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  if (rc == GLOB_NOMATCH || (rc == 0 && out.empty())) {
    return absl::NotFoundError(absl::StrCat("pattern \"", pattern, "\" matches no file"));
  }
  if (rc != 0) {
    return absl::NotFoundError(absl::StrCat("pattern \"", pattern, "\": cannot read a directory"));
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<std::vector<std::string>> DirectoryShards(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".bin" && !e.is_directory()) out.push_back(e.path().string());
  }
  if (ec) {
    return absl::NotFoundError(absl::StrCat("directory \"", dir, "\": ", ec.message()));
  }
  if (out.empty()) {
    return absl::NotFoundError(absl::StrCat("directory \"", dir, "\" holds no .bin shard"));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// h mapped uniformly onto [0, n) (Lemire's multiply-shift, as WindowStart).
int64_t Scale(uint64_t h, int64_t n) {
  return static_cast<int64_t>((static_cast<unsigned __int128>(h) * static_cast<uint64_t>(n)) >> 64);
}

// The shard holding global offset x of a prefix-sum table (offsets[s] <= x < offsets[s + 1]).
int ShardOf(const std::vector<int64_t>& offsets, int64_t x) {
  return static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), x) - offsets.begin()) -
         1;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandShardPaths(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return DirectoryShards(path);
  if (HasGlobChars(path) && !std::filesystem::exists(path, ec)) return Glob(path);
  return std::vector<std::string>{path};  // a shard file; its reader reports a missing one
}

uint64_t PermuteIndex(uint64_t q, uint64_t n, uint64_t key) {
  int bits = 2;
  while (bits < 64 && (uint64_t{1} << bits) < n) bits += 2;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t round_key[4];
  for (int r = 0; r < 4; ++r) round_key[r] = SplitMix64(key + static_cast<uint64_t>(r));
  uint64_t x = q;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (int r = 0; r < 4; ++r) {
      const uint64_t f = SplitMix64(round_key[r] ^ right) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= n);
  return x;
}

int64_t ShardWindows(int64_t num_tokens, int seq_len) {
  if (seq_len < 1 || num_tokens < static_cast<int64_t>(seq_len) + 1) return 0;
  return (num_tokens - 1) / seq_len;
}

DataOrder::DataOrder(std::vector<int64_t> shard_tokens, int seq_len, int64_t global_batch,
                     Sampling sampling)
    : seq_len_(seq_len), global_batch_(global_batch), sampling_(sampling) {
  window_offset_.assign(1, 0);
  start_offset_.assign(1, 0);
  for (int64_t n : shard_tokens) {
    window_offset_.push_back(window_offset_.back() + ShardWindows(n, seq_len));
    start_offset_.push_back(start_offset_.back() + std::max<int64_t>(0, n - seq_len));
  }
}

WindowRef DataOrder::Window(uint64_t seed, uint64_t stream, int64_t step,
                            int64_t global_index) const {
  WindowRef w;
  if (sampling_ == Sampling::kRandom) {
    const int64_t g = Scale(WindowHash(seed, step, global_index, stream), total_starts());
    w.shard = ShardOf(start_offset_, g);
    w.start = g - start_offset_[w.shard];
    return w;
  }
  const int64_t W = total_windows();
  const int64_t p = step * global_batch_ + global_index;
  const uint64_t epoch = static_cast<uint64_t>(p / W);
  const uint64_t key = SplitMix64(SplitMix64(SplitMix64(seed) ^ stream) ^ epoch);
  const int64_t window = static_cast<int64_t>(
      PermuteIndex(static_cast<uint64_t>(p % W), static_cast<uint64_t>(W), key));
  w.shard = ShardOf(window_offset_, window);
  w.start = (window - window_offset_[w.shard]) * seq_len_;
  return w;
}

double DataOrder::EpochAfterStep(int64_t step) const {
  const int64_t W = total_windows();
  if (W <= 0) return 0;
  return static_cast<double>(step + 1) * static_cast<double>(global_batch_) /
         static_cast<double>(W);
}

}  // namespace fsdp8
