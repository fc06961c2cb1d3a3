// Communicator::Split, Send/Recv and AllReduceAsync on CPU ranks (threads), over shared memory
// and over Gloo as CreateCpuCommunicator builds them (comm/cpu_communicator.h): the hybrid
// sharding mesh of 4 ranks (shard groups {0,1} {2,3}, replica groups {0,2} {1,3}) with values
// computed by hand, sub-groups that run different collectives at the same time, key order, C09
// inside a sub-group, the abort contract on a sub-communicator, a parent destroyed first, the
// transport chosen per sub-group, a ring of transfers, and the deferred all-reduce.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/async_communicator.h"
#include "comm/cpu_communicator.h"
#include "comm/gloo_communicator.h"
#include "comm/shm_communicator.h"
#include "gtest/gtest.h"
#include "tests/support/ranks.h"

namespace fsdp8 {
namespace {

using Clock = std::chrono::steady_clock;
using CommPtr = std::unique_ptr<Communicator>;

enum class Kind { kSharedMemory, kGloo };

std::string KindName(const ::testing::TestParamInfo<Kind>& info) {
  return info.param == Kind::kGloo ? "Gloo" : "SharedMemory";
}

struct WorldOptions {
  bool overlap = false;                // wrap in AsyncCommunicator (CpuCommOptions::overlap)
  std::vector<std::string> machines;   // per rank (CpuCommOptions::machine); empty: this one
  std::chrono::milliseconds timeout = std::chrono::seconds(20);
};

// Runs fn(rank, world communicator) on `world` threads, the communicators built by
// CreateCpuCommunicator over `kind` (FSDP8_CPU_TRANSPORT unset or "gloo").
void RunWorld(Kind kind, int world, const std::function<void(int, CommPtr&)>& fn,
              const WorldOptions& w = WorldOptions()) {
  static std::atomic<int> generation{0};
  const std::string prefix = absl::StrCat("split-test/", generation++, "/");
  testing::MemKvStore kv;  // outlives every communicator (comm/cpu_split.h)
  testing::RunOnThreads(world, [&](int r) {
    CpuCommOptions o;
    o.transport = kind == Kind::kGloo ? CpuCommOptions::Transport::kGloo
                                      : CpuCommOptions::Transport::kAuto;
    o.overlap = w.overlap;
    if (!w.machines.empty()) o.machine = w.machines[r];
    std::string transport;
    auto c = CreateCpuCommunicator(r, world, &kv, prefix, "127.0.0.1", w.timeout, w.timeout, o,
                                   &transport);
    ASSERT_TRUE(c.ok()) << c.status();
    if (w.machines.empty()) {
      EXPECT_EQ(transport, kind == Kind::kGloo ? "gloo" : "shared memory");
    }
    fn(r, *c);
  });
}

CommPtr SplitOrDie(Communicator* c, int color, int key) {
  auto s = c->Split(color, key);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

bool IsSharedMemory(Communicator* c) {
  return dynamic_cast<SharedMemoryCommunicator*>(c) != nullptr;
}
bool IsGloo(Communicator* c) { return dynamic_cast<GlooCommunicator*>(c) != nullptr; }

// The mesh of common/mesh.h with R = 2, S = 2: rank r is shard index r % 2 of replica r / 2.
struct Mesh4 {
  CommPtr shard;    // color replica, key shard index: {0,1} {2,3}
  CommPtr replica;  // color shard index, key replica: {0,2} {1,3}
};

Mesh4 SplitMesh(int r, Communicator* world) {
  Mesh4 m;
  m.shard = SplitOrDie(world, r / 2, r % 2);
  m.replica = SplitOrDie(world, r % 2, r / 2);
  return m;
}

// The old ranks of rank r's sub-groups, in sub-group rank order (by hand, from the mesh).
std::vector<int> ShardMembers(int r) { return {r / 2 * 2, r / 2 * 2 + 1}; }
std::vector<int> ReplicaMembers(int r) { return {r % 2, r % 2 + 2}; }

// Runs every collective on `c` (a sub-group whose rank i is old rank members[i]) with inputs
// that depend on the old rank, and checks the results against sums over `members` by hand.
void CheckCollectives(Communicator* c, int r, const std::vector<int>& members) {
  const int w = static_cast<int>(members.size());
  ASSERT_EQ(c->world_size(), w);
  ASSERT_EQ(members[c->rank()], r);
  // AllGather: 3 bytes per rank, 10 * old rank + i.
  uint8_t mine[3] = {static_cast<uint8_t>(10 * r), static_cast<uint8_t>(10 * r + 1),
                     static_cast<uint8_t>(10 * r + 2)};
  std::vector<uint8_t> all(3 * w);
  ASSERT_TRUE(c->AllGather(mine, all.data(), 3).ok());
  for (int i = 0; i < w; ++i) {
    for (int j = 0; j < 3; ++j) EXPECT_EQ(all[3 * i + j], 10 * members[i] + j) << i << " " << j;
  }
  // ReduceScatterSum: element j of old rank m's input is 100 * (m + 1) + j.
  std::vector<float> in(2 * w), out(2);
  for (int j = 0; j < 2 * w; ++j) in[j] = 100.0f * (r + 1) + j;
  ASSERT_TRUE(c->ReduceScatterSum(in.data(), out.data(), 2).ok());
  for (int j = 0; j < 2; ++j) {
    float want = 0;
    for (int m : members) want += 100.0f * (m + 1) + (2 * c->rank() + j);
    EXPECT_EQ(out[j], want) << j;
  }
  // AllReduce sum of old rank + 1, max of (old rank)^2 - 3 * old rank.
  float sum[2] = {static_cast<float>(r + 1), 0.5f};
  ASSERT_TRUE(c->AllReduce(sum, 2, ReduceOp::kSum).ok());
  float max = static_cast<float>(r * r - 3 * r);
  ASSERT_TRUE(c->AllReduce(&max, 1, ReduceOp::kMax).ok());
  float want_sum = 0, want_max = -1e9f;
  for (int m : members) {
    want_sum += static_cast<float>(m + 1);
    want_max = std::max(want_max, static_cast<float>(m * m - 3 * m));
  }
  EXPECT_EQ(sum[0], want_sum);
  EXPECT_EQ(sum[1], 0.5f * w);
  EXPECT_EQ(max, want_max);
  // Broadcast from sub-group rank 1: its old rank's bytes.
  std::vector<uint8_t> b(5, static_cast<uint8_t>(200 + r));
  ASSERT_TRUE(c->Broadcast(b.data(), 5, 1).ok());
  for (uint8_t x : b) EXPECT_EQ(x, 200 + members[1]);
  ASSERT_TRUE(c->Barrier().ok());
}

class SplitTest : public ::testing::TestWithParam<Kind> {};

TEST_P(SplitTest, ShardAndReplicaGroupsComputeHandValues) {
  RunWorld(GetParam(), 4, [&](int r, CommPtr& world) {
    Mesh4 m = SplitMesh(r, world.get());
    ASSERT_TRUE(m.shard && m.replica);
    EXPECT_EQ(m.shard->rank(), r % 2);
    EXPECT_EQ(m.replica->rank(), r / 2);
    CheckCollectives(m.shard.get(), r, ShardMembers(r));
    CheckCollectives(m.replica.get(), r, ReplicaMembers(r));
    // The same kind as the world (one machine: shared memory unless Gloo was asked for).
    const bool gloo = GetParam() == Kind::kGloo;
    EXPECT_TRUE(gloo ? IsGloo(m.shard.get()) : IsSharedMemory(m.shard.get()));
    EXPECT_TRUE(gloo ? IsGloo(m.replica.get()) : IsSharedMemory(m.replica.get()));
    // The world still works after the splits, and their exchanges are not FSDP traffic.
    EXPECT_EQ(world->bytes().all_gather, 0);
    CheckCollectives(world.get(), r, {0, 1, 2, 3});
    EXPECT_EQ(m.shard->bytes().all_gather, 3 * 2);
  });
}

// Shard groups run different collectives at the same time (group 0 all-reduces, group 1
// all-gathers), then replica groups do (broadcasts and reduce-scatters): sub-groups that shared
// any state would mismatch (C09), block each other or mix their values.
TEST_P(SplitTest, SubgroupsRunDifferentCollectivesConcurrently) {
  RunWorld(GetParam(), 4, [&](int r, CommPtr& world) {
    Mesh4 m = SplitMesh(r, world.get());
    ASSERT_TRUE(m.shard && m.replica);
    for (int it = 0; it < 40; ++it) {
      if (r / 2 == 0) {
        std::vector<float> v(1000, static_cast<float>(r + it));
        ASSERT_TRUE(m.shard->AllReduce(v.data(), 1000, ReduceOp::kSum).ok());
        EXPECT_EQ(v[999], static_cast<float>(0 + 1 + 2 * it));
      } else {
        std::vector<uint8_t> v(1000, static_cast<uint8_t>(r + it)), all(2000);
        ASSERT_TRUE(m.shard->AllGather(v.data(), all.data(), 1000).ok());
        EXPECT_EQ(all[999], static_cast<uint8_t>(2 + it));
        EXPECT_EQ(all[1999], static_cast<uint8_t>(3 + it));
      }
    }
    for (int it = 0; it < 40; ++it) {
      if (r % 2 == 0) {
        std::vector<uint8_t> v(777, static_cast<uint8_t>(r + it));
        ASSERT_TRUE(m.replica->Broadcast(v.data(), 777, 1).ok());
        EXPECT_EQ(v[776], static_cast<uint8_t>(2 + it));  // replica rank 1 is old rank 2
      } else {
        std::vector<float> in(4, static_cast<float>(r * it)), out(2);
        ASSERT_TRUE(m.replica->ReduceScatterSum(in.data(), out.data(), 2).ok());
        EXPECT_EQ(out[1], static_cast<float>(1 * it + 3 * it));
      }
    }
  });
}

// Ranks follow the keys: reversed keys reverse the ranks; equal keys keep the old order; a
// nested split of a sub-communicator works the same way.
TEST_P(SplitTest, KeysOrderTheRanks) {
  RunWorld(GetParam(), 4, [&](int r, CommPtr& world) {
    CommPtr reversed = SplitOrDie(world.get(), 7, -r);
    CommPtr ties = SplitOrDie(world.get(), r % 2, 0);
    ASSERT_TRUE(reversed && ties);
    EXPECT_EQ(reversed->rank(), 3 - r);
    uint8_t me = static_cast<uint8_t>(r), order[4];
    ASSERT_TRUE(reversed->AllGather(&me, order, 1).ok());
    EXPECT_EQ(std::vector<uint8_t>(order, order + 4), (std::vector<uint8_t>{3, 2, 1, 0}));
    EXPECT_EQ(ties->rank(), r / 2);
    ASSERT_TRUE(ties->AllGather(&me, order, 1).ok());
    EXPECT_EQ(order[0], r % 2);
    EXPECT_EQ(order[1], r % 2 + 2);
    // Nested: the reversed group split again by new rank parity, keys reversing it once more.
    CommPtr nested = SplitOrDie(reversed.get(), reversed->rank() % 2, -reversed->rank());
    ASSERT_TRUE(nested);
    ASSERT_TRUE(nested->AllGather(&me, order, 1).ok());
    // reversed ranks 0..3 are old 3..0; parity 0: reversed {0, 2} = old {3, 1}, keys 0, -2.
    const std::vector<uint8_t> want =
        (3 - r) % 2 == 0 ? std::vector<uint8_t>{1, 3} : std::vector<uint8_t>{0, 2};
    EXPECT_EQ(std::vector<uint8_t>(order, order + 2), want);
  });
}

TEST_P(SplitTest, NegativeColorFailsOnEveryRank) {
  RunWorld(GetParam(), 2, [&](int r, CommPtr& world) {
    auto s = world->Split(r == 1 ? -1 : 0, 0);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find("rank 1 passed color -1"), std::string::npos)
        << s.status();
  });
}

// C09 inside a sub-group: shard group {0,1} mismatches its all-gather and fails on both ranks
// with the collective named; group {2,3} meanwhile completes the same call; the world is not
// affected.
TEST_P(SplitTest, MismatchInsideASubgroupNamesTheCollective) {
  std::vector<absl::Status> got(4);
  RunWorld(GetParam(), 4, [&](int r, CommPtr& world) {
    CommPtr shard = SplitOrDie(world.get(), r / 2, r % 2);
    ASSERT_TRUE(shard);
    std::vector<uint8_t> a(100, 1), b(200);
    got[r] = shard->AllGather(a.data(), b.data(), r == 1 ? 99 : 100);
    float v = 1;
    ASSERT_TRUE(world->AllReduce(&v, 1, ReduceOp::kSum).ok());
    EXPECT_EQ(v, 4.0f);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r].code(), absl::StatusCode::kInvalidArgument) << got[r];
    EXPECT_NE(got[r].message().find("all_gather #1: rank 0 has 100 bytes, rank 1 has 99 bytes"),
              std::string::npos)
        << got[r];
  }
  EXPECT_TRUE(got[2].ok()) << got[2];
  EXPECT_TRUE(got[3].ok()) << got[3];
}

// The abort contract on a sub-communicator: rank 0 blocked in its shard group's all-reduce (its
// peer, rank 1, never enters) returns ABORTED with the reason within a second of Abort(), far
// from the 30 s timeout; the world communicator of every rank stays usable.
TEST_P(SplitTest, AbortOfASubcommunicatorEndsItsBlockedCollectiveOnly) {
  absl::Status result;
  double after_abort = -1;
  WorldOptions w;
  w.timeout = std::chrono::seconds(30);
  RunWorld(GetParam(), 4, [&](int r, CommPtr& world) {
    CommPtr shard = SplitOrDie(world.get(), r / 2, r % 2);
    ASSERT_TRUE(shard);
    if (r == 0) {
      Clock::time_point t_abort;
      std::thread aborter([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        t_abort = Clock::now();
        shard->Abort("shard peer hung");
      });
      std::vector<float> f(1024, 1.0f);
      result = shard->AllReduce(f.data(), 1024, ReduceOp::kSum);
      const auto t_end = Clock::now();
      aborter.join();
      after_abort = std::chrono::duration<double>(t_end - t_abort).count();
      EXPECT_EQ(shard->Barrier().code(), absl::StatusCode::kAborted);  // fails fast now
    }
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(800));  // silent
    float v = static_cast<float>(r);
    ASSERT_TRUE(world->AllReduce(&v, 1, ReduceOp::kMax).ok());
    EXPECT_EQ(v, 3.0f);
  }, w);
  EXPECT_EQ(result.code(), absl::StatusCode::kAborted) << result;
  EXPECT_NE(result.message().find("shard peer hung"), std::string::npos) << result;
  EXPECT_GE(after_abort, 0.0);
  EXPECT_LT(after_abort, 1.0);
}

// Aborting the parent leaves its sub-communicators usable, and they outlive it.
TEST_P(SplitTest, SubcommunicatorsOutliveAnAbortedAndDestroyedParent) {
  RunWorld(GetParam(), 4, [&](int r, CommPtr& world) {
    Mesh4 m = SplitMesh(r, world.get());
    ASSERT_TRUE(m.shard && m.replica);
    world->Abort("the world is gone");
    EXPECT_EQ(world->Barrier().code(), absl::StatusCode::kAborted);
    world.reset();
    CheckCollectives(m.shard.get(), r, ShardMembers(r));
    CheckCollectives(m.replica.get(), r, ReplicaMembers(r));
  });
}

// A ring of transfers over 3 ranks: each rank sends to rank + 1 and receives from rank - 1
// (even ranks send first), of 0 bytes, 1 MiB and 9 MiB (more than two shared-memory slots);
// then mismatched sizes fail both sides naming the transfer, and a bad peer is refused.
TEST_P(SplitTest, SendRecvRing) {
  RunWorld(GetParam(), 3, [&](int r, CommPtr& c) {
    const int next = (r + 1) % 3, prev = (r + 2) % 3;
    for (int64_t n : {int64_t{0}, int64_t{1} << 20, int64_t{9} << 20}) {
      SCOPED_TRACE(n);
      std::vector<uint8_t> out(n), in(n, 0xee);
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>((i * 13 + r * 101) % 251);
      uint8_t canary = 0x5a;
      uint8_t* dst = n > 0 ? in.data() : &canary;
      absl::Status a, b;
      if (r % 2 == 0) {
        a = c->Send(n > 0 ? out.data() : &canary, n, next);
        b = c->Recv(dst, n, prev);
      } else {
        b = c->Recv(dst, n, prev);
        a = c->Send(n > 0 ? out.data() : &canary, n, next);
      }
      ASSERT_TRUE(a.ok()) << a;
      ASSERT_TRUE(b.ok()) << b;
      EXPECT_EQ(canary, 0x5a);
      for (int64_t i = 0; i < n; i += 4093) {
        ASSERT_EQ(in[i], static_cast<uint8_t>((i * 13 + prev * 101) % 251)) << i;
      }
      if (n > 0) {
        EXPECT_EQ(in[n - 1], static_cast<uint8_t>(((n - 1) * 13 + prev * 101) % 251));
      }
    }
    EXPECT_EQ(c->Send(&r, 4, r).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(c->Recv(&r, 4, 3).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(c->Barrier().ok());  // still usable
  });
}

TEST_P(SplitTest, SendRecvSizeMismatchFailsBothSides) {
  std::vector<absl::Status> got(2);
  RunWorld(GetParam(), 2, [&](int r, CommPtr& c) {
    std::vector<uint8_t> buf(100, 1);
    got[r] = r == 0 ? c->Send(buf.data(), 100, 1) : c->Recv(buf.data(), 64, 0);
    EXPECT_FALSE(c->Barrier().ok());  // unusable after the failure
  });
  EXPECT_EQ(got[0].code(), absl::StatusCode::kInvalidArgument) << got[0];
  EXPECT_EQ(got[1].code(), absl::StatusCode::kInvalidArgument) << got[1];
  const std::string what = "#1 from rank 0 to rank 1: rank 0 sends 100 bytes, rank 1 receives 64";
  EXPECT_NE(got[0].message().find("send " + what), std::string::npos) << got[0];
  EXPECT_NE(got[1].message().find("recv " + what), std::string::npos) << got[1];
}

// Through the AsyncCommunicator (overlap on): the splits are wrapped again; on a shard group,
// rank 0's AllReduceAsync and AllGatherAsync both return before its peer enters them (the peer
// comes 400 ms late), and after Wait on the later ticket both results are there. The deferred
// all-reduce counts in CommBytes::all_reduce.
TEST_P(SplitTest, AllReduceAsyncOverlapsAnAllGatherAsync) {
  WorldOptions w;
  w.overlap = true;
  RunWorld(GetParam(), 4, [&](int r, CommPtr& world) {
    EXPECT_NE(dynamic_cast<AsyncCommunicator*>(world.get()), nullptr);
    CommPtr shard = SplitOrDie(world.get(), r / 2, r % 2);
    ASSERT_TRUE(shard);
    EXPECT_NE(dynamic_cast<AsyncCommunicator*>(shard.get()), nullptr);
    if (r % 2 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(400));
    std::vector<float> grad(3000, static_cast<float>(r + 1));
    uint8_t mine[2] = {static_cast<uint8_t>(r), static_cast<uint8_t>(r + 50)}, all[4];
    const auto t0 = Clock::now();
    auto t1 = shard->AllReduceAsync(grad.data(), 3000, ReduceOp::kSum);
    auto t2 = shard->AllGatherAsync(mine, all, 2);
    const double issued = std::chrono::duration<double>(Clock::now() - t0).count();
    ASSERT_TRUE(t1.ok() && t2.ok());
    EXPECT_GT(*t1, 0);
    EXPECT_GT(*t2, *t1);
    if (r % 2 == 0) {
      EXPECT_LT(issued, 0.2);  // did not wait for the late peer
    }
    shard->Wait(*t2);  // covers t1
    const float want = static_cast<float>(r / 2 * 2 + 1 + r / 2 * 2 + 2);
    EXPECT_EQ(grad[0], want);
    EXPECT_EQ(grad[2999], want);
    EXPECT_EQ(all[0], r / 2 * 2);
    EXPECT_EQ(all[2], r / 2 * 2 + 1);
    EXPECT_EQ(all[3], r / 2 * 2 + 51);
    EXPECT_TRUE(shard->Verify().ok());
    EXPECT_EQ(shard->bytes().all_reduce, 3000 * 4);
    EXPECT_EQ(world->bytes().all_reduce, 0);
    // Point-to-point through the wrapper too: the shard pair swaps a word.
    int32_t got = -1, send = 1000 + r;
    const int peer = 1 - shard->rank();
    absl::Status a = shard->rank() == 0 ? shard->Send(&send, 4, peer) : shard->Recv(&got, 4, peer);
    absl::Status b = shard->rank() == 0 ? shard->Recv(&got, 4, peer) : shard->Send(&send, 4, peer);
    ASSERT_TRUE(a.ok() && b.ok()) << a << b;
    EXPECT_EQ(got, 1000 + (r ^ 1));
  }, w);
}

INSTANTIATE_TEST_SUITE_P(Transports, SplitTest,
                         ::testing::Values(Kind::kSharedMemory, Kind::kGloo), KindName);

// The transport per sub-group: ranks 0, 1 on machine "A" and 2, 3 on "B" (as two hosts): the
// world is Gloo, each shard group (inside one machine) shared memory, each replica group (across
// the machines) Gloo, and all of them compute the right values. With FSDP8_CPU_TRANSPORT=gloo
// every sub-group is Gloo.
TEST(SplitTransport, SharedMemoryWhereTheSubgroupSharesAMachine) {
  WorldOptions w;
  w.machines = {"A " + SharedMemoryCommunicator::MachineIdentity(),
                "A " + SharedMemoryCommunicator::MachineIdentity(),
                "B " + SharedMemoryCommunicator::MachineIdentity(),
                "B " + SharedMemoryCommunicator::MachineIdentity()};
  for (Kind kind : {Kind::kSharedMemory, Kind::kGloo}) {
    SCOPED_TRACE(kind == Kind::kGloo ? "gloo" : "auto");
    RunWorld(kind, 4, [&](int r, CommPtr& world) {
      EXPECT_TRUE(IsGloo(world.get()));
      Mesh4 m = SplitMesh(r, world.get());
      ASSERT_TRUE(m.shard && m.replica);
      EXPECT_TRUE(kind == Kind::kGloo ? IsGloo(m.shard.get()) : IsSharedMemory(m.shard.get()));
      EXPECT_TRUE(IsGloo(m.replica.get()));
      CheckCollectives(m.shard.get(), r, ShardMembers(r));
      CheckCollectives(m.replica.get(), r, ReplicaMembers(r));
    }, w);
  }
}

// The defaults of comm/communicator.h: AllReduceAsync runs the blocking all-reduce (ticket 0,
// counted), and a communicator without sub-groups or point-to-point says so.
TEST(SplitDefaults, BlockingAllReduceAsyncAndUnimplementedSplit) {
  class Summing : public Communicator {
   public:
    int rank() const override { return 0; }
    int world_size() const override { return 1; }
    absl::Status AllGather(const void*, void*, int64_t) override { return absl::OkStatus(); }
    absl::Status ReduceScatterSum(const float*, float*, int64_t) override {
      return absl::OkStatus();
    }
    absl::Status AllReduce(float* buf, int64_t count, ReduceOp) override {
      for (int64_t i = 0; i < count; ++i) buf[i] *= 2;  // visible: the call ran
      bytes_.all_reduce += count * 4;
      return absl::OkStatus();
    }
    absl::Status Broadcast(void*, int64_t, int) override { return absl::OkStatus(); }
    absl::Status Barrier() override { return absl::OkStatus(); }
    void Abort(const std::string&) override {}
  } c;
  float v[2] = {1, 2};
  auto t = c.AllReduceAsync(v, 2, ReduceOp::kSum);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t, 0);
  EXPECT_EQ(v[1], 4.0f);
  EXPECT_EQ(c.bytes().all_reduce, 8);
  EXPECT_EQ(c.Split(0, 0).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(c.Send(v, 4, 0).code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace fsdp8
