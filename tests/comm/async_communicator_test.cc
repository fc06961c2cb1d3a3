// AsyncCommunicator over shared memory and Gloo: values computed here, deferred calls that return
// before the peer arrives and the wait they leave exposed, the byte counters, a failed collective
// (fail fast, Wait returns, Verify reports it), Abort of a running and a queued collective and
// while idle, an exception of the wrapped communicator, the destructor running what is queued,
// and CreateCpuCommunicator's choice (comm/cpu_communicator.h).
#include "comm/async_communicator.h"

#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
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

// Deferred all-gather and reduce-scatter issued back to back; the last rank issues them 100 ms
// late, so the values are there only if Wait really waited; then a blocking all-reduce. Rank r's
// values are small integers, so every sum is exact and is computed here directly. Over shared
// memory and over Gloo.
TEST(AsyncCommunicator, DeferredAndBlockingCallsGiveTheExpectedValues) {
  for (Transport transport : {Transport::kSharedMemoryOverlapped, Transport::kGlooOverlapped}) {
    for (int world : {2, 3}) {
      SCOPED_TRACE(world);
      RunRanksOver(transport, world, [&](int r, Communicator* c) {
        std::vector<uint8_t> send(1001), gathered(1001 * world, 0xee);
        for (int i = 0; i < 1001; ++i) send[i] = static_cast<uint8_t>(r * 31 + i);
        std::vector<float> in(777 * world), out(777, -1.0f);
        for (int64_t j = 0; j < 777 * world; ++j) in[j] = static_cast<float>((r + 1) * (j % 100));
        if (r == world - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        auto t1 = c->AllGatherAsync(send.data(), gathered.data(), 1001);
        auto t2 = c->ReduceScatterSumAsync(in.data(), out.data(), 777);
        ASSERT_TRUE(t1.ok() && t2.ok());
        EXPECT_LT(*t1, *t2);
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
        float v = static_cast<float>(r + 1);
        ASSERT_TRUE(c->AllReduce(&v, 1, ReduceOp::kSum).ok());
        EXPECT_EQ(v, ranks_sum);
        ASSERT_TRUE(c->Verify().ok());
        EXPECT_EQ(c->bytes().all_gather, 1001 * world);
        EXPECT_EQ(c->bytes().reduce_scatter, 777 * world * 4);
        EXPECT_EQ(c->bytes().all_reduce, 4);
      });
    }
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

// Rank 1 never enters the all-gathers; Abort on rank 0 (from another thread) ends the running
// one and the one queued behind it within a fraction of a second, both Waits return, and every
// later call fails fast with the reason.
TEST(AsyncCommunicator, AbortEndsTheRunningAndTheQueuedCollectives) {
  std::atomic<bool> rank0_done{false};
  absl::Status verified, later;
  double abort_to_wait_end = -1;
  RunRanksOver(Transport::kSharedMemoryOverlapped, 2, [&](int r, Communicator* c) {
    ASSERT_TRUE(c->Barrier().ok());
    if (r == 1) {  // stays alive (so the peer is not seen gone) until rank 0 is done
      while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    std::vector<uint8_t> a(64), b(128), b2(128);
    auto t = c->AllGatherAsync(a.data(), b.data(), 64);
    auto t2 = c->AllGatherAsync(a.data(), b2.data(), 64);
    ASSERT_TRUE(t.ok() && t2.ok());
    Clock::time_point t_abort;
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      t_abort = Clock::now();
      c->Abort("peer rank 1 hung");
    });
    c->Wait(*t2);
    c->Wait(*t);
    const auto t_end = Clock::now();
    aborter.join();
    abort_to_wait_end = std::chrono::duration<double>(t_end - t_abort).count();
    verified = c->Verify();
    later = c->AllGatherAsync(a.data(), b.data(), 64).status();
    rank0_done = true;
  }, std::chrono::seconds(30));
  EXPECT_EQ(verified.code(), absl::StatusCode::kAborted) << verified;
  EXPECT_NE(verified.message().find("peer rank 1 hung"), std::string::npos) << verified;
  EXPECT_EQ(later, verified);
  EXPECT_LT(abort_to_wait_end, 0.5);
}

// A communicator of one rank that records its calls, in order, into a log that outlives it;
// AllGather of 13 bytes throws std::bad_alloc, of 17 bytes a std::runtime_error.
struct CallLog {
  std::mutex mu;
  std::vector<std::string> calls;
  std::vector<std::string> Get() {
    std::lock_guard<std::mutex> l(mu);
    return calls;
  }
};

class RecordingComm : public Communicator {
 public:
  explicit RecordingComm(CallLog* log) : log_(log) {}
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  absl::Status AllGather(const void*, void*, int64_t n) override {
    if (n == 13) throw std::bad_alloc();
    if (n == 17) throw std::runtime_error("bad buffer");
    return Record("all_gather " + std::to_string(n));
  }
  absl::Status ReduceScatterSum(const float*, float*, int64_t n) override {
    return Record("reduce_scatter " + std::to_string(n));
  }
  absl::Status AllReduce(float*, int64_t n, ReduceOp) override {
    return Record("all_reduce " + std::to_string(n));
  }
  absl::Status Broadcast(void*, int64_t, int) override { return Record("broadcast"); }
  absl::Status Barrier() override { return Record("barrier"); }
  void Abort(const std::string& reason) override { Record("abort " + reason).IgnoreError(); }

 private:
  absl::Status Record(const std::string& call) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));  // the caller gets ahead
    std::lock_guard<std::mutex> l(log_->mu);
    log_->calls.push_back(call);
    return absl::OkStatus();
  }
  CallLog* log_;
};

// Collectives run in call order, and the destructor runs those still queued before it returns.
TEST(AsyncCommunicator, DestructorRunsWhatIsQueuedInOrder) {
  CallLog log;
  std::vector<float> f(8);
  size_t seen_before_destruction = 0;
  {
    AsyncCommunicator c(std::make_unique<RecordingComm>(&log));
    for (int i = 1; i <= 3; ++i) {
      ASSERT_TRUE(c.AllGatherAsync(f.data(), f.data(), i).ok());
      ASSERT_TRUE(c.ReduceScatterSumAsync(f.data(), f.data(), i).ok());
    }
    seen_before_destruction = log.Get().size();
  }
  EXPECT_LT(seen_before_destruction, 6u);  // the calls took 25 ms each: some were still queued
  const std::vector<std::string> calls = log.Get();
  ASSERT_EQ(calls.size(), 6u);
  for (int i = 1; i <= 3; ++i) {
    EXPECT_EQ(calls[2 * (i - 1)], "all_gather " + std::to_string(i));
    EXPECT_EQ(calls[2 * (i - 1) + 1], "reduce_scatter " + std::to_string(i));
  }
}

// An exception of the wrapped communicator becomes the communicator's error (bad_alloc:
// RESOURCE_EXHAUSTED; others INTERNAL with the message) instead of ending the process; Wait
// returns and later calls fail fast.
TEST(AsyncCommunicator, ExceptionsBecomeErrors) {
  CallLog log;
  std::vector<uint8_t> buf(64);
  {
    AsyncCommunicator c(std::make_unique<RecordingComm>(&log));
    auto t = c.AllGatherAsync(buf.data(), buf.data(), 13);
    ASSERT_TRUE(t.ok());
    c.Wait(*t);
    const absl::Status v = c.Verify();
    EXPECT_EQ(v.code(), absl::StatusCode::kResourceExhausted) << v;
    EXPECT_EQ(c.Barrier(), v);
    EXPECT_EQ(c.AllGatherAsync(buf.data(), buf.data(), 1).status(), v);
  }
  AsyncCommunicator c(std::make_unique<RecordingComm>(&log));
  const absl::Status s = c.AllGather(buf.data(), buf.data(), 17);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("bad buffer"), std::string::npos) << s;
}

// Abort while nothing runs: the wrapped communicator hears it, and the next deferred call fails
// at once with ABORTED and the reason (it is never queued).
TEST(AsyncCommunicator, AbortWhileIdleFailsTheNextCallAtOnce) {
  CallLog log;
  AsyncCommunicator c(std::make_unique<RecordingComm>(&log));
  std::vector<uint8_t> buf(8);
  ASSERT_TRUE(c.Barrier().ok());
  c.Abort("job cancelled");
  const absl::StatusOr<int64_t> t = c.AllGatherAsync(buf.data(), buf.data(), 1);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kAborted) << t.status();
  EXPECT_NE(t.status().message().find("job cancelled"), std::string::npos) << t.status();
  const std::vector<std::string> calls = log.Get();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0], "barrier");
  EXPECT_EQ(calls[1], "abort job cancelled");
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

// FSDP8_CPU_COMM_OVERLAP: "0" turns the helper thread off; unset or any other value leaves it on.
TEST(AsyncCommunicator, OverlapSettingFromTheEnvironment) {
  unsetenv("FSDP8_CPU_COMM_OVERLAP");
  EXPECT_TRUE(CpuCommOptions::FromEnvironment().overlap);
  setenv("FSDP8_CPU_COMM_OVERLAP", "0", 1);
  EXPECT_FALSE(CpuCommOptions::FromEnvironment().overlap);
  setenv("FSDP8_CPU_COMM_OVERLAP", "1", 1);
  EXPECT_TRUE(CpuCommOptions::FromEnvironment().overlap);
  unsetenv("FSDP8_CPU_COMM_OVERLAP");
}

}  // namespace
}  // namespace fsdp8
