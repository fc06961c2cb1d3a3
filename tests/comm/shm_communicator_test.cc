// SharedMemoryCommunicator: results against values computed here and against GlooCommunicator
// (bit for bit, the same inputs), collectives larger than a slot, C09 messages, the abort
// contract, a failed or vanished peer, and the fallback to Gloo when the ranks do not share a
// machine (comm/cpu_communicator.h).
#include "comm/shm_communicator.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "comm/cpu_communicator.h"
#include "gtest/gtest.h"
#include "tests/support/ranks.h"
#include "tests/support/temp_dir.h"

namespace fsdp8 {
namespace {

using testing::RunRanksOver;
using testing::Transport;
using Clock = std::chrono::steady_clock;

// Random f32 values of rank r (seeded by r), wide enough in magnitude that the order of the
// additions changes the rounded sums.
std::vector<float> RandomFloats(int r, int64_t n) {
  std::mt19937 gen(1000 + r);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-20, 20);
  std::vector<float> v(n);
  for (float& x : v) x = std::ldexp(mant(gen), exp(gen));
  return v;
}

// Every collective of a step-like sequence, with sizes that do not divide evenly; what rank r
// ends with, as bytes.
std::vector<uint8_t> Sequence(int r, int world, Communicator* c) {
  std::vector<uint8_t> got;
  auto keep = [&](const void* p, size_t n) {
    got.insert(got.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  };
  std::vector<uint8_t> send(1001);
  for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<uint8_t>(r * 31 + i);
  std::vector<uint8_t> gathered(send.size() * world);
  EXPECT_TRUE(c->AllGather(send.data(), gathered.data(), 1001).ok());
  keep(gathered.data(), gathered.size());
  std::vector<float> in = RandomFloats(r, 777 * world), out(777);
  EXPECT_TRUE(c->ReduceScatterSum(in.data(), out.data(), 777).ok());
  keep(out.data(), out.size() * 4);
  std::vector<float> sum = RandomFloats(r + 50, 1003), mx = RandomFloats(r + 90, 5);
  EXPECT_TRUE(c->AllReduce(sum.data(), 1003, ReduceOp::kSum).ok());
  EXPECT_TRUE(c->AllReduce(mx.data(), 5, ReduceOp::kMax).ok());
  keep(sum.data(), sum.size() * 4);
  keep(mx.data(), mx.size() * 4);
  std::vector<uint8_t> b(333, static_cast<uint8_t>(r == world - 1 ? 7 : 0));
  EXPECT_TRUE(c->Broadcast(b.data(), 333, world - 1).ok());
  keep(b.data(), b.size());
  EXPECT_TRUE(c->Barrier().ok());
  EXPECT_TRUE(c->AllGather(send.data(), gathered.data(), 0).ok());  // empty shards (C05)
  return got;
}

TEST(SharedMemoryCommunicator, SameBitsAsGlooOnEveryRank) {
  for (int world : {1, 2, 3}) {
    SCOPED_TRACE(world);
    std::vector<std::vector<uint8_t>> shm(world), gloo(world);
    RunRanksOver(Transport::kSharedMemory, world,
                 [&](int r, Communicator* c) { shm[r] = Sequence(r, world, c); });
    RunRanksOver(Transport::kGloo, world,
                 [&](int r, Communicator* c) { gloo[r] = Sequence(r, world, c); });
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(shm[r].size(), gloo[r].size());
      EXPECT_EQ(std::memcmp(shm[r].data(), gloo[r].data(), shm[r].size()), 0) << "rank " << r;
    }
  }
}

// Direct computation: the all-reduce sums in rank order, (v0 + v1) + v2, on every rank; the
// reduce-scatter gives rank r slice r of that sum.
TEST(SharedMemoryCommunicator, ReductionsAddInRankOrder) {
  const int W = 3;
  RunRanksOver(Transport::kSharedMemory, W, [&](int r, Communicator* c) {
    const int64_t n = 4099;
    std::vector<float> buf = RandomFloats(r, n);
    ASSERT_TRUE(c->AllReduce(buf.data(), n, ReduceOp::kSum).ok());
    std::vector<float> in = RandomFloats(r, n), out(n / W);
    ASSERT_TRUE(c->ReduceScatterSum(in.data(), out.data(), n / W).ok());
    const auto v0 = RandomFloats(0, n), v1 = RandomFloats(1, n), v2 = RandomFloats(2, n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(buf[i], (v0[i] + v1[i]) + v2[i]) << i;
    for (int64_t i = 0; i < n / W; ++i) {
      const int64_t g = r * (n / W) + i;
      ASSERT_EQ(out[i], (v0[g] + v1[g]) + v2[g]) << i;
    }
  });
}

// Larger than one slot per rank: the collectives run in several rounds (here 2-3).
TEST(SharedMemoryCommunicator, CollectivesLargerThanASlot) {
  const int W = 2;
  const int64_t slot = SharedMemoryCommunicator::kSlotBytes;
  RunRanksOver(Transport::kSharedMemory, W, [&](int r, Communicator* c) {
    const int64_t bytes = 2 * slot + 12345;
    std::vector<uint8_t> send(bytes), recv(bytes * W);
    for (int64_t i = 0; i < bytes; ++i) send[i] = static_cast<uint8_t>((i * 7 + r * 3) & 0xff);
    ASSERT_TRUE(c->AllGather(send.data(), recv.data(), bytes).ok());
    for (int q = 0; q < W; ++q) {
      for (int64_t i = 0; i < bytes; i += 4093) {
        ASSERT_EQ(recv[q * bytes + i], static_cast<uint8_t>((i * 7 + q * 3) & 0xff)) << i;
      }
    }
    const int64_t n = slot / 4 + 1001;  // per rank: 2 rounds of slot / (4 W) floats and more
    std::vector<float> in(n * W), out(n);
    for (int64_t j = 0; j < n * W; ++j) in[j] = static_cast<float>(r + 1) * static_cast<float>(j % 1000);
    ASSERT_TRUE(c->ReduceScatterSum(in.data(), out.data(), n).ok());
    for (int64_t i = 0; i < n; i += 997) {
      ASSERT_EQ(out[i], 3.0f * static_cast<float>((r * n + i) % 1000)) << i;
    }
    std::vector<float> all(slot / 4 * 2 + 5, static_cast<float>(r + 1));
    ASSERT_TRUE(c->AllReduce(all.data(), static_cast<int64_t>(all.size()), ReduceOp::kSum).ok());
    EXPECT_EQ(all.front(), 3.0f);
    EXPECT_EQ(all.back(), 3.0f);
    std::vector<uint8_t> b(slot + 3, static_cast<uint8_t>(r == 0 ? 0xab : 0));
    ASSERT_TRUE(c->Broadcast(b.data(), static_cast<int64_t>(b.size()), 0).ok());
    EXPECT_EQ(b.back(), 0xab);
  });
}

TEST(SharedMemoryCommunicator, C09_MismatchesFailOnEveryRankWithGloosMessages) {
  std::vector<absl::Status> results(2);
  RunRanksOver(Transport::kSharedMemory, 2, [&](int r, Communicator* c) {
    std::vector<uint8_t> a(409600), b(2 * 409600);
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(c->Barrier().ok());
    results[r] = c->AllGather(a.data(), b.data(), r == 0 ? 409600 : 409598);
    // After a failure every call fails fast.
    EXPECT_FALSE(c->Barrier().ok());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kInvalidArgument) << results[r];
    EXPECT_NE(results[r].message().find("all_gather #4: rank 0 has 409600 bytes, rank 1 has 409598 bytes"),
              std::string::npos) << results[r];
  }
  RunRanksOver(Transport::kSharedMemory, 2, [&](int r, Communicator* c) {
    float v = 1;
    results[r] = c->AllReduce(&v, 1, r == 0 ? ReduceOp::kSum : ReduceOp::kMax);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(results[r].message().find("all_reduce(sum)"), std::string::npos) << results[r];
    EXPECT_NE(results[r].message().find("all_reduce(max)"), std::string::npos) << results[r];
  }
}

// The abort contract: a rank blocked on a peer that never enters the collective returns ABORTED
// with the reason well within a second of Abort(); and its peer, then blocked in a collective of
// its own, learns that this rank left (UNAVAILABLE naming it) within a sleep slice, not at the
// 30 s timeout.
TEST(SharedMemoryCommunicator, AbortWakesTheBlockedRankAndTellsThePeer) {
  absl::Status result0, result1;
  double abort_to_return = -1, peer_after = -1;
  RunRanksOver(Transport::kSharedMemory, 2, [&](int r, Communicator* c) {
    ASSERT_TRUE(c->Barrier().ok());
    std::vector<float> f(1024, 1.0f);
    if (r == 1) {  // enters the all-reduce late, after rank 0 was aborted
      std::this_thread::sleep_for(std::chrono::milliseconds(600));
      const auto t = Clock::now();
      result1 = c->AllReduce(f.data(), 1024, ReduceOp::kSum);
      peer_after = std::chrono::duration<double>(Clock::now() - t).count();
      return;
    }
    Clock::time_point t_abort;
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      t_abort = Clock::now();
      c->Abort("peer rank 1 hung");
    });
    result0 = c->Broadcast(f.data(), 4096, 0);
    const auto t_end = Clock::now();
    aborter.join();
    abort_to_return = std::chrono::duration<double>(t_end - t_abort).count();
    EXPECT_EQ(c->Barrier().code(), absl::StatusCode::kAborted);  // fails fast from now on
  }, std::chrono::seconds(30));
  EXPECT_EQ(result0.code(), absl::StatusCode::kAborted) << result0;
  EXPECT_NE(result0.message().find("peer rank 1 hung"), std::string::npos) << result0;
  EXPECT_LT(abort_to_return, 0.2);
  EXPECT_EQ(result1.code(), absl::StatusCode::kUnavailable) << result1;
  EXPECT_NE(result1.message().find("rank 0 left"), std::string::npos) << result1;
  EXPECT_LT(peer_after, 1.0);
}

TEST(SharedMemoryCommunicator, SilentPeerTimesOut) {
  absl::Status result;
  double took = -1;
  RunRanksOver(Transport::kSharedMemory, 2, [&](int r, Communicator* c) {
    ASSERT_TRUE(c->Barrier().ok());
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      return;
    }
    const auto t = Clock::now();
    result = c->Barrier();
    took = std::chrono::duration<double>(Clock::now() - t).count();
  }, std::chrono::milliseconds(500));
  EXPECT_EQ(result.code(), absl::StatusCode::kDeadlineExceeded) << result;
  EXPECT_NE(result.message().find("barrier #2"), std::string::npos) << result;
  EXPECT_GT(took, 0.45);
  EXPECT_LT(took, 1.2);
}

// Ranks that report different machines get FAILED_PRECONDITION on every rank and nothing
// created (CreateCpuCommunicator's cue to use Gloo); with the transport set to Gloo
// (FSDP8_CPU_TRANSPORT=gloo) CreateCpuCommunicator connects them over Gloo, which works.
TEST(SharedMemoryCommunicator, RanksOnDifferentMachinesFallBackToGloo) {
  testing::MemKvStore kv;
  std::vector<absl::Status> created(2);
  testing::RunOnThreads(2, [&](int r) {
    auto c = SharedMemoryCommunicator::Create(r, 2, &kv, "apart/", std::chrono::seconds(10),
                                              std::chrono::seconds(10),
                                              r == 0 ? "machine-a" : "machine-b");
    created[r] = c.status();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(created[r].code(), absl::StatusCode::kFailedPrecondition) << created[r];
  }
  std::vector<std::string> transport(2);
  std::vector<float> sums(2);
  testing::RunOnThreads(2, [&](int r) {
    CpuCommOptions gloo;
    gloo.transport = CpuCommOptions::Transport::kGloo;
    auto c = CreateCpuCommunicator(r, 2, &kv, "forced/", "127.0.0.1", std::chrono::seconds(10),
                                   std::chrono::seconds(10), gloo, &transport[r]);
    ASSERT_TRUE(c.ok()) << c.status();
    float v = static_cast<float>(r + 1);
    ASSERT_TRUE((*c)->AllReduce(&v, 1, ReduceOp::kSum).ok());
    sums[r] = v;
  });
  EXPECT_EQ(transport[0], "gloo");
  EXPECT_EQ(sums[1], 3.0f);
}

TEST(SharedMemoryCommunicator, CreateCpuCommunicatorUsesSharedMemoryOnOneMachine) {
  testing::MemKvStore kv;
  std::vector<std::string> transport(2);
  testing::RunOnThreads(2, [&](int r) {
    auto c = CreateCpuCommunicator(r, 2, &kv, "one/", "127.0.0.1", std::chrono::seconds(10),
                                   std::chrono::seconds(10), CpuCommOptions(), &transport[r]);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->Barrier().ok());
  });
  EXPECT_EQ(transport[0], "shared memory");
  EXPECT_EQ(transport[1], "shared memory");
}

// A KvStore over files in a directory, shared by a parent and a forked child process.
class DirKvStore : public KvStore {
 public:
  explicit DirKvStore(std::string dir) : dir_(std::move(dir)) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    const std::string path = Path(key);
    { std::ofstream(path + ".tmp") << value; }
    std::filesystem::rename(path + ".tmp", path);
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override {
    const auto end = Clock::now() + timeout;
    while (Clock::now() < end) {
      std::ifstream in(Path(key));
      if (in) return std::string(std::istreambuf_iterator<char>(in), {});
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return absl::DeadlineExceededError("key " + key);
  }

 private:
  std::string Path(const std::string& key) const {
    std::string k = key;
    for (char& ch : k) if (ch == '/') ch = '_';
    return dir_ + "/" + k;
  }
  std::string dir_;
};

// Two processes: a collective works across them, then the child exits without a word while the
// parent waits in a barrier: the parent sees the process gone (UNAVAILABLE naming rank 1) within
// a second, not at the 30 s timeout, whether or not the child has been reaped yet.
TEST(SharedMemoryCommunicator, PeerProcessThatExitsFailsTheCollectiveAtOnce) {
  testing::TempDir dir;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    DirKvStore kv(dir.path());
    auto c = SharedMemoryCommunicator::Create(1, 2, &kv, "proc/", std::chrono::seconds(30));
    if (!c.ok()) _exit(3);
    float v = 2.0f;
    if (!(*c)->AllReduce(&v, 1, ReduceOp::kSum).ok() || v != 3.0f) _exit(4);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    _exit(0);  // no destructor: as a killed process
  }
  DirKvStore kv(dir.path());
  auto c = SharedMemoryCommunicator::Create(0, 2, &kv, "proc/", std::chrono::seconds(30));
  ASSERT_TRUE(c.ok()) << c.status();
  float v = 1.0f;
  ASSERT_TRUE((*c)->AllReduce(&v, 1, ReduceOp::kSum).ok());
  EXPECT_EQ(v, 3.0f);
  const auto t = Clock::now();
  absl::Status s = (*c)->Barrier();
  const double took = std::chrono::duration<double>(Clock::now() - t).count();
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 1 (process"), std::string::npos) << s;
  EXPECT_LT(took, 1.5);
}

}  // namespace
}  // namespace fsdp8
