// AsyncCommunicator over shared memory: the same results as the blocking communicator (values
// computed here), deferred calls that return before the peer arrives and the wait they leave
// exposed, the byte counters, a failed collective (fail fast, Wait returns, Verify reports it),
// Abort of a queued collective, and CreateCpuCommunicator's choice (comm/cpu_communicator.h).
#include "comm/async_communicator.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/cpu_communicator.h"
#include "gtest/gtest.h"
#include "tests/support/ranks.h"

namespace fsdp8 {
namespace {

using testing::RunRanksOver;
using testing::Transport;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Deferred all-gather and reduce-scatter issued back to back, then a blocking all-reduce, then
// the tickets waited for out of order; rank r's values are small integers, so every sum is exact
// and is computed here directly.
TEST(AsyncCommunicator, DeferredAndBlockingCallsGiveTheExpectedValues) {
  for (int world : {2, 3}) {
    SCOPED_TRACE(world);
    RunRanksOver(Transport::kSharedMemoryOverlapped, world, [&](int r, Communicator* c) {
      std::vector<uint8_t> send(1001), gathered(1001 * world);
      for (int i = 0; i < 1001; ++i) send[i] = static_cast<uint8_t>(r * 31 + i);
      std::vector<float> in(777 * world), out(777);
      for (int64_t j = 0; j < 777 * world; ++j) in[j] = static_cast<float>((r + 1) * (j % 100));
      auto t1 = c->AllGatherAsync(send.data(), gathered.data(), 1001);
      auto t2 = c->ReduceScatterSumAsync(in.data(), out.data(), 777);
      ASSERT_TRUE(t1.ok() && t2.ok());
      EXPECT_LT(*t1, *t2);
      float v = static_cast<float>(r + 1);
      ASSERT_TRUE(c->AllReduce(&v, 1, ReduceOp::kSum).ok());  // behind both deferred calls
      EXPECT_EQ(v, static_cast<float>(world * (world + 1) / 2));
      c->Wait(*t2);  // covers t1 too
      c->Wait(*t1);
      for (int q = 0; q < world; ++q) {
        for (int i = 0; i < 1001; i += 97) {
          ASSERT_EQ(gathered[q * 1001 + i], static_cast<uint8_t>(q * 31 + i)) << q << " " << i;
        }
      }
      const float ranks_sum = static_cast<float>(world * (world + 1) / 2);
      for (int64_t i = 0; i < 777; ++i) {
        ASSERT_EQ(out[i], ranks_sum * static_cast<float>((r * 777 + i) % 100)) << i;
      }
      ASSERT_TRUE(c->Verify().ok());
      EXPECT_EQ(c->bytes().all_gather, 1001 * world);
      EXPECT_EQ(c->bytes().reduce_scatter, 777 * world * 4);
      EXPECT_EQ(c->bytes().all_reduce, 4);
    });
  }
}

// Rank 1 enters the all-gather 300 ms late: rank 0's deferred call returns at once (the blocking
// communicator would hold it for the 300 ms), its Wait holds it until rank 1 arrives, and that
// wait is what ConsumeExposedSeconds reports, once.
TEST(AsyncCommunicator, DeferredCallReturnsBeforeThePeerArrives) {
  double issue = -1, wait = -1, exposed = -1, exposed_again = -1;
  RunRanksOver(Transport::kSharedMemoryOverlapped, 2, [&](int r, Communicator* c) {
    ASSERT_TRUE(c->Barrier().ok());
    std::vector<uint8_t> send(4096, static_cast<uint8_t>(r + 1)), recv(8192);
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const auto t0 = Clock::now();
    auto t = c->AllGatherAsync(send.data(), recv.data(), 4096);
    ASSERT_TRUE(t.ok()) << t.status();
    if (r == 0) issue = Since(t0);
    const auto t1 = Clock::now();
    c->Wait(*t);
    EXPECT_EQ(recv[0], 1);
    EXPECT_EQ(recv[4096], 2);
    if (r == 0) {
      wait = Since(t1);
      exposed = c->ConsumeExposedSeconds();
      exposed_again = c->ConsumeExposedSeconds();
    }
    ASSERT_TRUE(c->Verify().ok());
  });
  EXPECT_LT(issue, 0.1);
  EXPECT_GT(wait, 0.2);
  EXPECT_GE(exposed, 0.2);
  EXPECT_LE(exposed, wait + 1e-3);
  EXPECT_EQ(exposed_again, 0.0);
}

// A mismatched deferred all-gather (C09): Wait returns on both ranks, Verify reports the
// mismatch with the blocking communicator's message, and every later call fails fast with it.
TEST(AsyncCommunicator, FailedCollectiveFailsFastAndVerifyReportsIt) {
  std::vector<absl::Status> verified(2), later(2), deferred_later(2);
  RunRanksOver(Transport::kSharedMemoryOverlapped, 2, [&](int r, Communicator* c) {
    std::vector<uint8_t> a(4096), b(8192);
    auto t = c->AllGatherAsync(a.data(), b.data(), r == 0 ? 4096 : 4094);
    ASSERT_TRUE(t.ok());
    c->Wait(*t);
    verified[r] = c->Verify();
    later[r] = c->Barrier();
    deferred_later[r] = c->AllGatherAsync(a.data(), b.data(), 16).status();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(verified[r].code(), absl::StatusCode::kInvalidArgument) << verified[r];
    EXPECT_NE(verified[r].message().find("rank 0 has 4096 bytes, rank 1 has 4094 bytes"),
              std::string::npos)
        << verified[r];
    EXPECT_EQ(later[r], verified[r]);
    EXPECT_EQ(deferred_later[r], verified[r]);
  }
}

// Rank 1 never enters the all-gather; Abort on rank 0 (from another thread) ends the queued
// collective within a fraction of a second, Wait returns, and Verify reports the reason.
TEST(AsyncCommunicator, AbortEndsAQueuedCollective) {
  std::atomic<bool> rank0_done{false};
  absl::Status verified;
  double abort_to_wait_end = -1;
  RunRanksOver(Transport::kSharedMemoryOverlapped, 2, [&](int r, Communicator* c) {
    ASSERT_TRUE(c->Barrier().ok());
    if (r == 1) {  // stays alive (so the peer is not seen gone) until rank 0 is done
      while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    std::vector<uint8_t> a(64), b(128);
    auto t = c->AllGatherAsync(a.data(), b.data(), 64);
    ASSERT_TRUE(t.ok());
    Clock::time_point t_abort;
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      t_abort = Clock::now();
      c->Abort("peer rank 1 hung");
    });
    c->Wait(*t);
    const auto t_end = Clock::now();
    aborter.join();
    abort_to_wait_end = std::chrono::duration<double>(t_end - t_abort).count();
    verified = c->Verify();
    rank0_done = true;
  }, std::chrono::seconds(30));
  EXPECT_EQ(verified.code(), absl::StatusCode::kAborted) << verified;
  EXPECT_NE(verified.message().find("peer rank 1 hung"), std::string::npos) << verified;
  EXPECT_LT(abort_to_wait_end, 0.2);
}

// CreateCpuCommunicator wraps the communicator of 2 or more ranks unless overlap is off
// (FSDP8_CPU_COMM_OVERLAP=0), and never that of one rank.
TEST(AsyncCommunicator, CreateCpuCommunicatorWrapsUnlessOverlapIsOff) {
  for (bool overlap : {true, false}) {
    testing::MemKvStore kv;
    CpuCommOptions o;
    o.overlap = overlap;
    std::vector<int> wrapped(2);  // not vector<bool>: the ranks write at once
    testing::RunOnThreads(2, [&](int r) {
      auto c = CreateCpuCommunicator(r, 2, &kv, "w/", "127.0.0.1", std::chrono::seconds(10),
                                     std::chrono::seconds(10), o);
      ASSERT_TRUE(c.ok()) << c.status();
      wrapped[r] = dynamic_cast<AsyncCommunicator*>(c->get()) != nullptr ? 1 : 0;
      float v = 1.0f;
      ASSERT_TRUE((*c)->AllReduce(&v, 1, ReduceOp::kSum).ok());
      EXPECT_EQ(v, 2.0f);
    });
    EXPECT_EQ(wrapped[0], overlap ? 1 : 0);
    EXPECT_EQ(wrapped[1], overlap ? 1 : 0);
  }
  testing::MemKvStore kv;
  auto one = CreateCpuCommunicator(0, 1, &kv, "one/", "127.0.0.1", std::chrono::seconds(10),
                                   std::chrono::seconds(10), CpuCommOptions());
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(dynamic_cast<AsyncCommunicator*>(one->get()), nullptr);
}

}  // namespace
}  // namespace fsdp8
