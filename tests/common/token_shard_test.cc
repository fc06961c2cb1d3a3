// Token shards (llm.c format) and the global-batch data rule.
#include "common/token_shard.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <set>

#include <gtest/gtest.h>

namespace fsdp8 {
namespace {

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/fsdp8_ts_" + std::to_string(getpid()) + "_" + name;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
}

TEST(TokenShard, RoundTripAndLayout) {
  std::vector<uint16_t> tokens(1000);
  std::mt19937 rng(1);
  for (auto& t : tokens) t = static_cast<uint16_t>(rng());
  tokens[0] = 0;
  tokens[1] = 65535;
  const std::string p = TempPath("rt.bin");
  ASSERT_TRUE(WriteTokenShard(p, tokens).ok());
  const std::string bytes = ReadAll(p);
  ASSERT_EQ(bytes.size(), 1024u + 2000u);
  int32_t h[3];
  std::memcpy(h, bytes.data(), 12);
  EXPECT_EQ(h[0], 20240520);
  EXPECT_EQ(h[1], 1);
  EXPECT_EQ(h[2], 1000);
  // Token 1 (65535) at byte 1024 + 2, little-endian.
  EXPECT_EQ(static_cast<unsigned char>(bytes[1026]), 0xff);
  EXPECT_EQ(static_cast<unsigned char>(bytes[1027]), 0xff);
  auto shard = ReadTokenShard(p);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ(shard->tokens, std::vector<uint32_t>(tokens.begin(), tokens.end()));
  EXPECT_EQ(shard->token_bytes, 2);
  auto n = ReadTokenShardHeader(p);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->num_tokens, 1000);
  EXPECT_EQ(n->token_bytes, 2);
  std::remove(p.c_str());
}

TEST(TokenShard, EmptyShard) {
  const std::string p = TempPath("empty.bin");
  ASSERT_TRUE(WriteTokenShard(p, {}).ok());
  auto shard = ReadTokenShard(p);
  ASSERT_TRUE(shard.ok());
  EXPECT_TRUE(shard->tokens.empty());
  std::remove(p.c_str());
}

TEST(TokenShard, BadMagicNamesFile) {
  const std::string p = TempPath("magic.bin");
  ASSERT_TRUE(WriteTokenShard(p, std::vector<uint16_t>(10, 7)).ok());
  std::string bytes = ReadAll(p);
  const int32_t wrong = 20240521;
  std::memcpy(&bytes[0], &wrong, 4);
  WriteAll(p, bytes);
  auto s = ReadTokenShard(p);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find(p), std::string::npos) << s.status();
  EXPECT_NE(s.status().message().find("magic"), std::string::npos) << s.status();
  EXPECT_FALSE(ReadTokenShardHeader(p).ok());
  std::remove(p.c_str());
}

TEST(TokenShard, BadVersionTruncatedAndMissing) {
  const std::string p = TempPath("bad.bin");
  ASSERT_TRUE(WriteTokenShard(p, std::vector<uint16_t>(10, 7)).ok());
  std::string bytes = ReadAll(p);
  std::string v2 = bytes;
  const int32_t seven = 7;
  std::memcpy(&v2[4], &seven, 4);
  WriteAll(p, v2);
  auto s = ReadTokenShard(p);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("version"), std::string::npos) << s.status();
  WriteAll(p, bytes.substr(0, bytes.size() - 1));  // one byte short
  s = ReadTokenShard(p);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find(p), std::string::npos);
  WriteAll(p, bytes.substr(0, 100));  // shorter than the header
  EXPECT_FALSE(ReadTokenShardHeader(p).ok());
  std::remove(p.c_str());
  s = ReadTokenShard(p);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find(p), std::string::npos);
}

TEST(TokenShard, SplitMix64KnownValues) {
  // Reference outputs of Vigna's splitmix64.c: seed 0 -> first output 0xe220a8397b1dcdaf;
  // seed 1234567 -> 6457827717110365317, 3203168211198807973.
  EXPECT_EQ(SplitMix64(0), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(SplitMix64(1234567), 6457827717110365317ULL);
  EXPECT_EQ(SplitMix64(1234567 + 0x9e3779b97f4a7c15ULL), 3203168211198807973ULL);
}

TEST(WindowStart, RangeAndEdges) {
  const int seq = 256;
  for (int64_t n : {257, 258, 300, 100000}) {
    std::set<int64_t> seen;
    for (int64_t step = 0; step < 50; ++step) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t s = WindowStart(1234, step, i, n, seq, kTrainStream);
        ASSERT_GE(s, 0);
        ASSERT_LE(s, n - seq - 1);  // tokens[s .. s + seq] all exist
        seen.insert(s);
      }
    }
    if (n == 257) {
      EXPECT_EQ(seen, std::set<int64_t>{0});
    }
    if (n == 258) {
      EXPECT_EQ(seen, (std::set<int64_t>{0, 1}));
    }
    if (n == 300) {
      EXPECT_EQ(seen.size(), 44u);  // 800 draws over 44 starts hit all of them
    }
  }
  EXPECT_EQ(WindowStart(1, 0, 0, 256, 256, 0), -1);  // no full window (needs seq_len + 1)
  EXPECT_EQ(WindowStart(1, 0, 0, 10, 0, 0), -1);
}

TEST(WindowStart, PureFunctionOfSeedStepIndexStream) {
  const int64_t n = 1 << 20;
  int diff_seed = 0, diff_stream = 0, diff_step = 0;
  for (int64_t i = 0; i < 200; ++i) {
    const int64_t a = WindowStart(1234, 7, i, n, 256, kTrainStream);
    EXPECT_EQ(a, WindowStart(1234, 7, i, n, 256, kTrainStream));
    diff_seed += a != WindowStart(1235, 7, i, n, 256, kTrainStream);
    diff_stream += a != WindowStart(1234, 7, i, n, 256, kValidationStream);
    diff_step += a != WindowStart(1234, 8, i, n, 256, kTrainStream);
  }
  EXPECT_GT(diff_seed, 190);
  EXPECT_GT(diff_stream, 190);
  EXPECT_GT(diff_step, 190);
}

TEST(WindowStart, SameSequencesOnOneTwoThreeRanks) {
  // Global batch 12; rank r of w takes the contiguous slice [r * 12 / w, (r + 1) * 12 / w).
  const int64_t n = 50000;
  const int gb = 12;
  std::vector<int64_t> ref;
  for (int i = 0; i < gb; ++i) ref.push_back(WindowStart(9, 3, i, n, 64, kTrainStream));
  for (int w : {1, 2, 3}) {
    std::vector<int64_t> got;
    for (int r = 0; r < w; ++r) {
      for (int i = r * gb / w; i < (r + 1) * gb / w; ++i) {
        got.push_back(WindowStart(9, 3, i, n, 64, kTrainStream));
      }
    }
    EXPECT_EQ(got, ref) << w;
  }
}

}  // namespace
}  // namespace fsdp8
