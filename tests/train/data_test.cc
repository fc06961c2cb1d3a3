// Datasets of token shards and the data rule (common/token_dataset.h, train/data.h), and the
// uint32 shard format.
// Expected values come from the rule as docs/data.md states it (window counts, shard boundaries),
// from hand-built file bytes, and from counting: nothing here is read back from the code under test
// except what it is asked to produce.
#include "common/token_dataset.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "common/token_shard.h"
#include "train/data.h"

namespace fsdp8 {
namespace {

std::string TempDir(const std::string& name) {
  const std::string d =
      ::testing::TempDir() + "/fsdp8_td_" + std::to_string(getpid()) + "_" + name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// A uint32 shard whose token at offset o is base + o: every token names its shard and offset.
void WriteCountingShard(const std::string& path, uint32_t base, int64_t n) {
  std::vector<uint32_t> t(static_cast<size_t>(n));
  for (int64_t o = 0; o < n; ++o) t[o] = base + static_cast<uint32_t>(o);
  ASSERT_TRUE(WriteTokenShard(path, t.data(), n, 4).ok());
}

TEST(TokenShardU32, HandBuiltBytesAreRead) {
  const std::string d = TempDir("u32");
  const std::string p = d + "/a.bin";
  std::string bytes(1024 + 3 * 4, '\0');
  const int32_t h[3] = {20240801, 7, 3};
  std::memcpy(&bytes[0], h, sizeof(h));
  const uint32_t toks[3] = {0, 70000, 128255};
  std::memcpy(&bytes[1024], toks, sizeof(toks));
  std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  auto header = ReadTokenShardHeader(p);
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->token_bytes, 4);
  EXPECT_EQ(header->num_tokens, 3);
  auto shard = ReadTokenShard(p);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ(shard->tokens, (std::vector<uint32_t>{0, 70000, 128255}));
  // The writer produces the same bytes.
  const std::string q = d + "/b.bin";
  ASSERT_TRUE(WriteTokenShard(q, toks, 3, 4).ok());
  std::ifstream in(q, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), bytes);
}

TEST(TokenShardU32, FormatRulesAndErrors) {
  EXPECT_EQ(TokenBytesForVocab(256), 2);
  EXPECT_EQ(TokenBytesForVocab(65536), 2);
  EXPECT_EQ(TokenBytesForVocab(65537), 4);
  EXPECT_EQ(TokenBytesForVocab(128256), 4);
  const std::string d = TempDir("u32err");
  const uint32_t big[2] = {1, 65536};
  absl::Status s = WriteTokenShard(d + "/x.bin", big, 2, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("index 1"), std::string::npos) << s;
  EXPECT_FALSE(std::filesystem::exists(d + "/x.bin"));
  // Magic 20240801 with version 1 (the pair of the other format) is refused naming the version.
  std::string bytes(1024 + 4, '\0');
  const int32_t h[3] = {20240801, 1, 1};
  std::memcpy(&bytes[0], h, sizeof(h));
  std::ofstream(d + "/v.bin", std::ios::binary).write(bytes.data(), 1028);
  auto r = ReadTokenShardHeader(d + "/v.bin");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("version"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find(d + "/v.bin"), std::string::npos) << r.status();
  // A uint32 header over a file sized for uint16 tokens.
  const int32_t h2[3] = {20240801, 7, 2};
  std::memcpy(&bytes[0], h2, sizeof(h2));
  std::ofstream(d + "/s.bin", std::ios::binary).write(bytes.data(), 1028);
  EXPECT_EQ(ReadTokenShardHeader(d + "/s.bin").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TokenDataset, ExpandFileDirectoryAndGlob) {
  const std::string d = TempDir("expand");
  for (const char* n : {"train_002.bin", "train_000.bin", "val_000.bin", "train_001.bin"}) {
    WriteCountingShard(d + "/" + n, 0, 10);
  }
  std::ofstream(d + "/notes.txt") << "not a shard";
  auto one = ExpandShardPaths(d + "/train_001.bin");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, std::vector<std::string>{d + "/train_001.bin"});
  auto dir = ExpandShardPaths(d);
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(*dir, (std::vector<std::string>{d + "/train_000.bin", d + "/train_001.bin",
                                            d + "/train_002.bin", d + "/val_000.bin"}));
  auto glob = ExpandShardPaths(d + "/train_*.bin");
  ASSERT_TRUE(glob.ok()) << glob.status();
  EXPECT_EQ(*glob, (std::vector<std::string>{d + "/train_000.bin", d + "/train_001.bin",
                                             d + "/train_002.bin"}));
  auto none = ExpandShardPaths(d + "/test_*.bin");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find(d + "/test_*.bin"), std::string::npos) << none.status();
  const std::string empty = TempDir("expand_empty");
  EXPECT_EQ(ExpandShardPaths(empty).status().code(), absl::StatusCode::kNotFound);
  auto missing = TokenData::Load(d + "/missing.bin", 4, 256, 4, Sampling::kEpoch);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(d + "/missing.bin"), std::string::npos);
}

TEST(TokenDataset, PermuteIndexIsABijection) {
  for (uint64_t n : {1ull, 2ull, 3ull, 4ull, 5ull, 15ull, 16ull, 17ull, 63ull, 64ull, 65ull,
                     1000ull, 4097ull}) {
    for (uint64_t key : {0ull, 1ull, 0xdeadbeefull}) {
      std::vector<int> seen(n, 0);
      for (uint64_t q = 0; q < n; ++q) {
        const uint64_t x = PermuteIndex(q, n, key);
        ASSERT_LT(x, n) << "n " << n;
        ++seen[x];
      }
      for (uint64_t x = 0; x < n; ++x) ASSERT_EQ(seen[x], 1) << "n " << n << " x " << x;
    }
  }
  // Not the identity, and the key matters.
  int fixed = 0, same = 0;
  for (uint64_t q = 0; q < 1000; ++q) {
    fixed += PermuteIndex(q, 1000, 7) == q;
    same += PermuteIndex(q, 1000, 7) == PermuteIndex(q, 1000, 8);
  }
  EXPECT_LT(fixed, 20);
  EXPECT_LT(same, 20);
}

TEST(TokenDataset, WindowsPerShardByHand) {
  // floor((n - 1) / seq_len) windows at stride seq_len.
  EXPECT_EQ(ShardWindows(257, 256), 1);
  EXPECT_EQ(ShardWindows(256, 256), 0);
  EXPECT_EQ(ShardWindows(512, 256), 1);
  EXPECT_EQ(ShardWindows(513, 256), 2);
  EXPECT_EQ(ShardWindows(0, 4), 0);
  const DataOrder order({257, 256, 513, 1000}, 256, 16, Sampling::kEpoch);
  EXPECT_EQ(order.total_windows(), 1 + 0 + 2 + 3);
  EXPECT_EQ(order.total_starts(), 1 + 0 + 257 + 744);
  // (step + 1) * global_batch / windows.
  EXPECT_DOUBLE_EQ(order.EpochAfterStep(0), 16.0 / 6.0);
  const DataOrder big({1000001}, 100, 4, Sampling::kEpoch);
  EXPECT_DOUBLE_EQ(big.EpochAfterStep(2499), 1.0);  // 10,000 windows of 100 tokens
}

// Reads epoch e's sequences the way `world` ranks read them (rank r takes global indices
// [r * local, (r + 1) * local) of each step) and returns each window's (base-encoded) first token
// with the number of times it was read.
std::map<uint32_t, int> ReadOneEpoch(const TokenData& data, int world, int global_batch,
                                     int seq_len, int64_t first_step, int64_t steps) {
  std::map<uint32_t, int> count;
  const int local = global_batch / world;
  std::vector<int32_t> in(static_cast<size_t>(local) * seq_len), tg(in.size());
  for (int64_t k = first_step; k < first_step + steps; ++k) {
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(data.Batch(99, k, r * local, local, kTrainStream, in.data(), tg.data()).ok());
      for (int s = 0; s < local; ++s) {
        const int32_t* x = &in[static_cast<size_t>(s) * seq_len];
        const int32_t* y = &tg[static_cast<size_t>(s) * seq_len];
        for (int t = 0; t < seq_len; ++t) {  // consecutive tokens of one shard, targets shifted
          EXPECT_EQ(x[t], x[0] + t);
          EXPECT_EQ(y[t], x[0] + t + 1);
        }
        ++count[static_cast<uint32_t>(x[0])];
      }
    }
  }
  return count;
}

TEST(TokenDataset, OneEpochVisitsEveryWindowOnceOnOneTwoAndThreeRanks) {
  const std::string d = TempDir("epoch");
  const int T = 8;
  // Shard sizes: 8 * 10 + 1 (10 windows), 8 * 7 (6 windows: the last window would need one more
  // token), 5 (none), 8 * 8 + 3 (8 windows). Token = shard base + offset.
  const std::vector<std::pair<uint32_t, int64_t>> shards = {
      {0, 81}, {100000, 56}, {200000, 5}, {300000, 67}};
  std::set<uint32_t> expected;
  for (size_t s = 0; s < shards.size(); ++s) {
    WriteCountingShard(d + "/train_" + std::to_string(s) + ".bin", shards[s].first,
                       shards[s].second);
    for (int64_t j = 0; (j + 1) * T + 1 <= shards[s].second; ++j) {
      expected.insert(shards[s].first + static_cast<uint32_t>(j * T));
    }
  }
  ASSERT_EQ(expected.size(), 24u);
  const int global_batch = 6;  // 24 windows = 4 steps per epoch
  auto data = TokenData::Load(d, T, 1 << 20, global_batch, Sampling::kEpoch);
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_EQ((*data)->order().total_windows(), 24);
  std::vector<uint32_t> order_of_world1;
  for (int world : {1, 2, 3}) {
    for (int epoch = 0; epoch < 2; ++epoch) {
      const std::map<uint32_t, int> count =
          ReadOneEpoch(**data, world, global_batch, T, epoch * 4, 4);
      std::set<uint32_t> got;
      for (const auto& [first, n] : count) {
        EXPECT_EQ(n, 1) << "window at token " << first << " read " << n << " times";
        got.insert(first);
      }
      EXPECT_EQ(got, expected) << "world " << world << " epoch " << epoch;
    }
  }
}

TEST(TokenDataset, EpochOrderIsTheSameOnEveryWorldSizeAndAfterReload) {
  const std::string d = TempDir("order");
  const int T = 4, B = 6;
  WriteCountingShard(d + "/a.bin", 0, 4 * 20 + 1);
  WriteCountingShard(d + "/b.bin", 1000, 4 * 9 + 1);
  auto first = TokenData::Load(d, T, 1 << 20, B, Sampling::kEpoch);
  ASSERT_TRUE(first.ok());
  // The sequence at (step, index) as one rank reads it, steps 0..9 (29 windows: epochs 0, 1, 2).
  std::vector<int32_t> whole;
  std::vector<int32_t> in(B * T), tg(B * T);
  for (int k = 0; k < 10; ++k) {
    ASSERT_TRUE((*first)->Batch(5, k, 0, B, kTrainStream, in.data(), tg.data()).ok());
    for (int s = 0; s < B; ++s) whole.push_back(in[s * T]);
  }
  // A resumed job (a fresh load) at step 7, on 3 ranks, reads the same sequences.
  auto resumed = TokenData::Load(d, T, 1 << 20, B, Sampling::kEpoch);
  ASSERT_TRUE(resumed.ok());
  for (int k = 7; k < 10; ++k) {
    for (int r = 0; r < 3; ++r) {
      std::vector<int32_t> a(2 * T), b(2 * T);
      ASSERT_TRUE((*resumed)->Batch(5, k, 2 * r, 2, kTrainStream, a.data(), b.data()).ok());
      EXPECT_EQ(a[0], whole[k * B + 2 * r]);
      EXPECT_EQ(a[T], whole[k * B + 2 * r + 1]);
    }
  }
  // Epoch 1 (positions 29..57) is a different order of the same windows than epoch 0.
  std::vector<int32_t> e0(whole.begin(), whole.begin() + 29), e1(whole.begin() + 29,
                                                                 whole.begin() + 58);
  EXPECT_NE(e0, e1);
  std::sort(e0.begin(), e0.end());
  std::sort(e1.begin(), e1.end());
  EXPECT_EQ(e0, e1);
}

TEST(TokenDataset, RandomModeOnOneShardIsWindowStart) {
  const std::string d = TempDir("random1");
  WriteCountingShard(d + "/a.bin", 0, 5000);
  const int T = 16;
  auto data = TokenData::Load(d + "/a.bin", T, 1 << 20, 8, Sampling::kRandom);
  ASSERT_TRUE(data.ok());
  std::vector<int32_t> in(8 * T), tg(8 * T);
  for (int k = 0; k < 20; ++k) {
    ASSERT_TRUE((*data)->Batch(1234, k, 0, 8, kTrainStream, in.data(), tg.data()).ok());
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(in[i * T], WindowStart(1234, k, i, 5000, T, kTrainStream));
    }
  }
}

TEST(TokenDataset, RandomModeNeverStraddlesShardsAndCoversThem) {
  const std::string d = TempDir("random3");
  const int T = 16;
  WriteCountingShard(d + "/a.bin", 0, 40);        // 24 legal starts
  WriteCountingShard(d + "/b.bin", 100000, 10);   // none
  WriteCountingShard(d + "/c.bin", 200000, 400);  // 384 legal starts
  auto data = TokenData::Load(d, T, 1 << 20, 4, Sampling::kRandom);
  ASSERT_TRUE(data.ok());
  std::vector<int32_t> in(4 * T), tg(4 * T);
  int in_a = 0, in_c = 0;
  for (int k = 0; k < 500; ++k) {
    ASSERT_TRUE((*data)->Batch(3, k, 0, 4, kTrainStream, in.data(), tg.data()).ok());
    for (int i = 0; i < 4; ++i) {
      const int32_t x = in[i * T];
      const int32_t last = tg[i * T + T - 1];  // the window's last token, same shard as its first
      if (x < 100000) {
        ++in_a;
        EXPECT_LE(last, 39);
      } else {
        ASSERT_GE(x, 200000);
        ++in_c;
        EXPECT_LE(last, 200399);
      }
    }
  }
  // 2000 draws, 24 / 408 of the starts in shard a: about 118 expected.
  EXPECT_GT(in_a, 60);
  EXPECT_LT(in_a, 200);
  EXPECT_EQ(in_a + in_c, 2000);
}

TEST(TokenDataset, TokenBeyondVocabularyNamesShardAndOffset) {
  const std::string d = TempDir("vocab");
  WriteCountingShard(d + "/a.bin", 250, 20);  // tokens 250..269
  auto data = TokenData::Load(d + "/a.bin", 4, 256, 4, Sampling::kEpoch);
  ASSERT_TRUE(data.ok());
  std::vector<int32_t> in(16), tg(16);
  absl::Status s = (*data)->Batch(1, 0, 0, 4, kTrainStream, in.data(), tg.data());
  ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(d + "/a.bin"), std::string::npos) << s;
  EXPECT_NE(s.message().find(">= model.vocab_size 256"), std::string::npos) << s;
  // No shard holds a window: refused at load, naming the dataset.
  auto small = TokenData::Load(d + "/a.bin", 64, 1 << 20, 4, Sampling::kEpoch);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("seq_len + 1 = 65"), std::string::npos)
      << small.status();
}

// A shard that shrinks under a loaded dataset (a memory map would raise SIGBUS on the next read
// past the new end and kill the process): the next batch fails with DATA_LOSS naming the file,
// and the process goes on.
TEST(TokenDataset, ShardTruncatedAfterLoadFailsTheBatchNamingIt) {
  const std::string d = TempDir("truncated");
  const std::string p = d + "/a.bin";
  WriteCountingShard(p, 0, 4000);  // uint32 tokens 0..3999
  auto data = TokenData::Load(p, 8, 1 << 20, 4, Sampling::kEpoch);
  ASSERT_TRUE(data.ok()) << data.status();
  std::vector<int32_t> in(32), tg(32);
  ASSERT_TRUE((*data)->Batch(1, 0, 0, 4, kTrainStream, in.data(), tg.data()).ok());
  // Inputs of a window are consecutive counting tokens: the batch was read from the file.
  EXPECT_EQ(tg[0], in[0] + 1);
  ASSERT_EQ(::truncate(p.c_str(), 1024 + 4 * 10), 0);
  for (int64_t step = 1; step < 4; ++step) {  // whichever windows the steps read
    absl::Status s = (*data)->Batch(1, step, 0, 4, kTrainStream, in.data(), tg.data());
    ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find(p), std::string::npos) << s;
    EXPECT_NE(s.message().find("truncated"), std::string::npos) << s;
  }
}

// The reader itself: a read past the new end of a truncated file is DATA_LOSS, not a signal.
TEST(TokenDataset, ReadPastTheEndOfATruncatedShardIsDataLoss) {
  const std::string d = TempDir("shortread");
  const std::string p = d + "/a.bin";
  ASSERT_TRUE(WriteTokenShard(p, std::vector<uint16_t>(1000, 7)).ok());
  auto r = TokenShardReader::Open(p);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<uint32_t> out(100);
  ASSERT_TRUE((*r)->Read(900, 100, out.data()).ok());
  EXPECT_EQ(out, std::vector<uint32_t>(100, 7));
  ASSERT_EQ(::truncate(p.c_str(), 1024 + 2 * 950), 0);  // tokens 950.. gone
  EXPECT_TRUE((*r)->Read(900, 50, out.data()).ok());
  absl::Status s = (*r)->Read(900, 100, out.data());
  ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(p), std::string::npos) << s;
  // Tokens 900..999 are bytes [1024 + 2 * 900, 1024 + 2 * 1000) = [2824, 3024); the file now has
  // 1024 + 2 * 950 = 2924 bytes, 3024 when opened.
  EXPECT_NE(s.message().find("a read of bytes [2824, 3024) met its end (2924 bytes now, 3024 "
                             "when opened: truncated)"),
            std::string::npos)
      << s;
}

// A shard replaced by a rename (as WriteTokenShard and `fsdp8 prepare --overwrite` do), even with
// the same bytes, deleted, or rewritten in place: the next batch fails naming the file and what
// changed.
TEST(TokenDataset, ShardReplacedDeletedOrRewrittenAfterLoadFailsTheBatch) {
  const std::string d = TempDir("replaced");
  std::vector<int32_t> in(32), tg(32);
  auto load = [&](const std::string& p) {
    WriteCountingShard(p, 0, 4000);
    // An old modification time, so that a rewrite now changes it whatever the clock's grain.
    const struct timespec old[2] = {{946684800, 0}, {946684800, 0}};
    EXPECT_EQ(::utimensat(AT_FDCWD, p.c_str(), old, 0), 0);
    auto data = TokenData::Load(p, 8, 1 << 20, 4, Sampling::kEpoch);
    EXPECT_TRUE(data.ok()) << data.status();
    if (!data.ok()) return std::unique_ptr<TokenData>();
    EXPECT_TRUE((*data)->Batch(1, 0, 0, 4, kTrainStream, in.data(), tg.data()).ok());
    return std::move(*data);
  };
  auto expect_changed = [&](const TokenData& data, const std::string& p, const std::string& what) {
    absl::Status s = data.Batch(1, 1, 0, 4, kTrainStream, in.data(), tg.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find(p), std::string::npos) << s;
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
  };
  {
    const std::string p = d + "/renamed.bin";
    auto data = load(p);
    ASSERT_NE(data, nullptr);
    WriteCountingShard(p, 0, 4000);  // the same bytes, a new file renamed over the path
    expect_changed(*data, p, "replaced");
  }
  {
    const std::string p = d + "/deleted.bin";
    auto data = load(p);
    ASSERT_NE(data, nullptr);
    ASSERT_EQ(std::remove(p.c_str()), 0);
    expect_changed(*data, p, "no longer exists");
  }
  {
    const std::string p = d + "/rewritten.bin";
    auto data = load(p);
    ASSERT_NE(data, nullptr);
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1024);
    const uint32_t t = 5;
    f.write(reinterpret_cast<const char*>(&t), 4);
    f.close();
    expect_changed(*data, p, "rewritten in place");
  }
}

}  // namespace
}  // namespace fsdp8
