// GlooCommunicator: collective results against values computed here, and C09 (mismatched counts
// fail fast on every rank with a message naming the collective and both sizes).
#include "comm/gloo_communicator.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/ranks.h"

namespace fsdp8 {
namespace {

using testing::RunRanks;

TEST(GlooCommunicator, CollectivesMatchDirectComputation) {
  const int W = 3;
  RunRanks(W, [&](int r, Communicator* c) {
    // AllGather: rank r sends r*10 + i.
    std::vector<uint8_t> send(5), recv(5 * W);
    for (int i = 0; i < 5; ++i) send[i] = static_cast<uint8_t>(r * 10 + i);
    ASSERT_TRUE(c->AllGather(send.data(), recv.data(), 5).ok());
    for (int q = 0; q < W; ++q)
      for (int i = 0; i < 5; ++i) EXPECT_EQ(recv[q * 5 + i], q * 10 + i);
    // Zero-size all-gather is legal (empty shards, C05).
    ASSERT_TRUE(c->AllGather(send.data(), recv.data(), 0).ok());
    // ReduceScatterSum: element j of rank q's input is q + j * 0.5; rank r keeps slice r.
    const int count = 4;
    std::vector<float> in(count * W), out(count);
    for (int j = 0; j < count * W; ++j) in[j] = static_cast<float>(r) + j * 0.5f;
    ASSERT_TRUE(c->ReduceScatterSum(in.data(), out.data(), count).ok());
    for (int j = 0; j < count; ++j) {
      const int g = r * count + j;
      EXPECT_FLOAT_EQ(out[j], (0 + 1 + 2) + W * g * 0.5f);
    }
    // AllReduce sum and max.
    float v[2] = {static_cast<float>(r + 1), static_cast<float>(-r)};
    ASSERT_TRUE(c->AllReduce(v, 2, ReduceOp::kSum).ok());
    EXPECT_FLOAT_EQ(v[0], 6.0f);
    EXPECT_FLOAT_EQ(v[1], -3.0f);
    float m[2] = {static_cast<float>(r == 1 ? 9 : r), 0.0f};
    ASSERT_TRUE(c->AllReduce(m, 2, ReduceOp::kMax).ok());
    EXPECT_FLOAT_EQ(m[0], 9.0f);
    EXPECT_FLOAT_EQ(m[1], 0.0f);
    // Broadcast from rank 2.
    int64_t b = r == 2 ? 123456789 : 0;
    ASSERT_TRUE(c->Broadcast(&b, sizeof(b), 2).ok());
    EXPECT_EQ(b, 123456789);
    ASSERT_TRUE(c->Barrier().ok());
  });
}

// The communicator keeps Gloo's buffers for the (pointer, size) pairs it has seen, up to a limit:
// many distinct buffers, revisited, reused sizes at the same address and new contents every round
// still give the directly computed results.
TEST(GlooCommunicator, ManyBuffersRevisitedKeepTheirResults) {
  const int W = 2, kBuffers = 80, kRounds = 3;
  RunRanks(W, [&](int r, Communicator* c) {
    std::vector<std::vector<uint8_t>> send(kBuffers), recv(kBuffers);
    std::vector<std::vector<float>> grads(kBuffers);
    for (int round = 0; round < kRounds; ++round) {
      for (int k = 0; k < kBuffers; ++k) {
        const int n = 1 + k % 7;  // bytes per rank; the same address gets other sizes below
        send[k].assign(8, 0);
        recv[k].assign(8 * W, 0);
        for (int i = 0; i < n; ++i) send[k][i] = static_cast<uint8_t>(r * 50 + k + round + i);
        ASSERT_TRUE(c->AllGather(send[k].data(), recv[k].data(), n + round % 2).ok());
        for (int q = 0; q < W; ++q) {
          for (int i = 0; i < n; ++i) {
            EXPECT_EQ(recv[k][q * (n + round % 2) + i], q * 50 + k + round + i);
          }
        }
        grads[k].assign(2 * W, 0.0f);
        for (int j = 0; j < 2 * W; ++j) grads[k][j] = static_cast<float>(r + k * j + round);
        float out[2];
        ASSERT_TRUE(c->ReduceScatterSum(grads[k].data(), out, 2).ok());
        for (int j = 0; j < 2; ++j) {
          const int g = r * 2 + j;
          EXPECT_FLOAT_EQ(out[j], static_cast<float>((0 + 1) + W * (k * g + round)));
        }
      }
    }
  });
}

TEST(GlooCommunicator, C09_MismatchedAllGatherCountsFailFastOnEveryRank) {
  const std::chrono::milliseconds timeout(10000);
  std::vector<absl::Status> results(2);
  std::vector<double> seconds(2);
  RunRanks(2, [&](int r, Communicator* c) {
    // A few matching collectives first, so the failing one is not #1.
    float x = 1;
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(c->AllReduce(&x, 1, ReduceOp::kSum).ok());
    const int64_t n = r == 0 ? 409600 : 409598;
    std::vector<uint8_t> send(n, 1), recv(409600 * 2, 0);
    const auto t0 = std::chrono::steady_clock::now();
    results[r] = c->AllGather(send.data(), recv.data(), n);
    seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Nothing was written: no silently wrong data.
    for (uint8_t b : recv) ASSERT_EQ(b, 0);
    // The communicator is unusable afterwards: later calls fail fast too.
    EXPECT_FALSE(c->AllReduce(&x, 1, ReduceOp::kSum).ok());
  }, timeout);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(r);
    EXPECT_EQ(results[r].code(), absl::StatusCode::kInvalidArgument) << results[r];
    EXPECT_NE(results[r].message().find("all_gather #4"), std::string::npos) << results[r];
    EXPECT_NE(results[r].message().find("rank 0 has 409600 bytes, rank 1 has 409598 bytes"),
              std::string::npos)
        << results[r];
    EXPECT_LT(seconds[r], 5.0);  // well within the 10 s timeout: no hang
  }
}

TEST(GlooCommunicator, C09_MismatchedCollectiveKindIsNamed) {
  std::vector<absl::Status> results(2);
  RunRanks(2, [&](int r, Communicator* c) {
    float x[4] = {0, 0, 0, 0};
    results[r] = r == 0 ? c->AllReduce(x, 4, ReduceOp::kSum) : c->AllReduce(x, 4, ReduceOp::kMax);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kInvalidArgument) << results[r];
    EXPECT_NE(results[r].message().find("all_reduce(sum)"), std::string::npos) << results[r];
    EXPECT_NE(results[r].message().find("all_reduce(max)"), std::string::npos) << results[r];
  }
}

TEST(GlooCommunicator, AbortMakesLaterCallsFailFast) {
  RunRanks(2, [&](int /*rank*/, Communicator* c) {
    ASSERT_TRUE(c->Barrier().ok());
    c->Abort("test");
    float x = 0;
    const absl::Status s = c->AllReduce(&x, 1, ReduceOp::kSum);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("test"), std::string::npos) << s;
  });
}

// Odd sizes (fewer elements than ranks, not a multiple of the world size) on 3 ranks, against
// values computed here; the sums run in rank order (documented), which these values tell apart:
// rank 0 adds 1e8, rank 1 adds 1, rank 2 adds -1e8, and (1e8 + 1) - 1e8 is 0 in f32 while any
// order that adds -1e8 before 1 gives 1. Every rank ends with the same bits.
TEST(GlooCommunicator, AllReduceOfOddSizesSumsInRankOrderToTheSameBits) {
  const int W = 3;
  const float kAdd[W] = {1e8f, 1.0f, -1e8f};
  std::vector<std::vector<float>> results(W);
  RunRanks(W, [&](int r, Communicator* c) {
    for (int count : {1, 2, 5, 7}) {
      std::vector<float> v(count);
      for (int i = 0; i < count; ++i) v[i] = kAdd[r];
      ASSERT_TRUE(c->AllReduce(v.data(), count, ReduceOp::kSum).ok());
      for (int i = 0; i < count; ++i) EXPECT_EQ(v[i], 0.0f) << "count " << count << " i " << i;
      std::vector<float> m(count);
      for (int i = 0; i < count; ++i) m[i] = static_cast<float>((r + i) % W);
      ASSERT_TRUE(c->AllReduce(m.data(), count, ReduceOp::kMax).ok());
      for (int i = 0; i < count; ++i) EXPECT_EQ(m[i], static_cast<float>(W - 1));
    }
    // Values whose sum rounds: the same bits on every rank.
    std::vector<float> x(11);
    for (int i = 0; i < 11; ++i) x[i] = 0.1f * static_cast<float>(r + 1) + 1e-3f * i;
    ASSERT_TRUE(c->AllReduce(x.data(), 11, ReduceOp::kSum).ok());
    results[r] = x;
    // ReduceScatterSum in rank order too: slice r of every rank's input.
    std::vector<float> in(2 * W), out(2);
    for (int j = 0; j < 2 * W; ++j) in[j] = kAdd[r];
    ASSERT_TRUE(c->ReduceScatterSum(in.data(), out.data(), 2).ok());
    EXPECT_EQ(out[0], 0.0f);
    EXPECT_EQ(out[1], 0.0f);
  });
  for (int r = 1; r < W; ++r)
    for (int i = 0; i < 11; ++i)
      EXPECT_EQ(std::memcmp(&results[r][i], &results[0][i], sizeof(float)), 0) << r << " " << i;
}

// The abort contract (comm/communicator.h): a rank blocked in a collective on a peer that never
// takes part (as a hung process would) returns ABORTED with the reason within a second of
// Abort(), not at the 30 s collective timeout: once waiting to receive (all-gather, all-reduce:
// the peer sends nothing), once waiting for its sends (a 32 MiB broadcast from the root that the
// peer never receives).
TEST(GlooCommunicator, AbortWakesACollectiveBlockedOnASilentPeer) {
  using Clock = std::chrono::steady_clock;
  for (int which = 0; which < 3; ++which) {
    SCOPED_TRACE(which);
    std::atomic<bool> done{false};
    absl::Status result;
    double after_abort = -1;
    RunRanks(2, [&](int r, Communicator* c) {
      ASSERT_TRUE(c->Barrier().ok());
      if (r == 1) {  // silent: never enters the collective, keeps its communicator open
        for (int i = 0; i < 600 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        return;
      }
      std::atomic<bool> aborted{false};
      Clock::time_point t_abort;
      std::thread aborter([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        t_abort = Clock::now();
        aborted = true;
        c->Abort("peer rank 1 hung");
      });
      std::vector<uint8_t> big(32 << 20, 1), out(64 << 20);
      std::vector<float> f(1024, 1.0f);
      if (which == 0) result = c->AllGather(big.data(), out.data(), 1 << 20);
      if (which == 1) result = c->AllReduce(f.data(), 1024, ReduceOp::kSum);
      if (which == 2) result = c->Broadcast(big.data(), static_cast<int64_t>(big.size()), 0);
      const auto t_end = Clock::now();
      aborter.join();
      EXPECT_TRUE(aborted.load()) << "the collective ended before the abort: " << result;
      after_abort = std::chrono::duration<double>(t_end - t_abort).count();
      done = true;
    }, std::chrono::seconds(30));
    EXPECT_EQ(result.code(), absl::StatusCode::kAborted) << result;
    EXPECT_NE(result.message().find("peer rank 1 hung"), std::string::npos) << result;
    EXPECT_LT(after_abort, 1.0);
  }
}

TEST(GlooCommunicator, MissingPeerTimesOutInsteadOfHanging) {
  testing::MemKvStore kv;
  const auto t0 = std::chrono::steady_clock::now();
  auto c = GlooCommunicator::Create(0, 2, &kv, "lonely/", "127.0.0.1",
                                    std::chrono::milliseconds(1500));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(c.ok());
  EXPECT_LT(s, 10.0);
  EXPECT_NE(c.status().message().find("rank 0 of 2"), std::string::npos) << c.status();
}

// The rendezvous waits the bootstrap timeout (a rank of the previous generation may join late,
// once its blocked collective timed out), the collectives afterwards only the collective timeout:
// rank 1 joins 2.5 s late (collective timeout 1 s, bootstrap 20 s) and the mesh connects; then a
// collective that rank 1 never enters fails on rank 0 after about 1 s, not 20 s.
TEST(GlooCommunicator, RendezvousWaitsTheBootstrapTimeoutCollectivesTheirOwn) {
  testing::MemKvStore kv;
  const std::chrono::milliseconds collective(1000), bootstrap(20000);
  absl::Status rank0, rank1;
  double op_seconds = -1;
  std::atomic<bool> rank0_done{false};
  std::thread t0([&] {
    auto c = GlooCommunicator::Create(0, 2, &kv, "late/", "127.0.0.1", collective, bootstrap);
    rank0 = c.status();
    if (c.ok()) {
      const auto start = std::chrono::steady_clock::now();
      float x = 1;
      rank0 = (*c)->AllReduce(&x, 1, ReduceOp::kSum);
      op_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    rank0_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  auto c1 = GlooCommunicator::Create(1, 2, &kv, "late/", "127.0.0.1", collective, bootstrap);
  rank1 = c1.status();
  // Rank 1 stays out of the all-reduce (its communicator stays open) until rank 0 gave up.
  for (int i = 0; i < 400 && !rank0_done; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  t0.join();
  ASSERT_TRUE(rank1.ok()) << rank1;
  ASSERT_GE(op_seconds, 0) << "rank 0 did not connect: " << rank0;
  EXPECT_FALSE(rank0.ok());
  EXPECT_GE(op_seconds, 0.9);
  EXPECT_LT(op_seconds, 10.0);
}

// An aborted job's bootstrap (2-rank job, only rank 0 present, 30 s rendezvous timeout) ends
// within ~1 s of the abort flag being set, instead of at the rendezvous timeout.
TEST(GlooCommunicator, CancelledRendezvousEndsPromptly) {
  testing::MemKvStore mem;
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  CancellableKvStore kv(&mem, cancelled);
  absl::Status result;
  std::atomic<bool> done{false};
  std::thread boot([&] {
    auto c = GlooCommunicator::Create(0, 2, &kv, "aborted/", "127.0.0.1", std::chrono::seconds(30));
    result = c.status();
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(done.load()) << "rendezvous ended before the abort: " << result;
  const auto t0 = std::chrono::steady_clock::now();
  cancelled->store(true);
  boot.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 2.0);
  EXPECT_FALSE(result.ok());
  EXPECT_NE(result.message().find("cancelled"), std::string::npos) << result;
}

TEST(CancellableKvStore, PassesValuesThroughAndKeepsTheTimeout) {
  testing::MemKvStore mem;
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  CancellableKvStore kv(&mem, cancelled, std::chrono::milliseconds(50));
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ASSERT_TRUE(mem.Set("k", "v").ok());
  });
  auto v = kv.Get("k", std::chrono::seconds(5));  // appears after several slices
  late.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "v");
  const auto t0 = std::chrono::steady_clock::now();
  auto missing = kv.Get("absent", std::chrono::milliseconds(300));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded) << missing.status();
  EXPECT_GT(s, 0.25);
  EXPECT_LT(s, 1.0);
  cancelled->store(true);
  EXPECT_EQ(kv.Get("k", std::chrono::seconds(5)).status().code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace fsdp8
