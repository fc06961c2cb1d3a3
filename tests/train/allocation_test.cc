// Allocation failures as errors (train/device_buffer.h): a DevBuf over the backend's memory limit
// and a host std::bad_alloc both become RESOURCE_EXHAUSTED naming the bytes and what they were for,
// with everything allocated on the way freed; Trainer::Create over the limit fails that way too.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/spec.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/support/ranks.h"
#include "train/device_buffer.h"
#include "train/trainer.h"

namespace fsdp8 {
namespace {

std::unique_ptr<Backend> LimitedCpuBackend(int64_t limit_bytes) {
  BackendOptions o;
  o.memory_limit_bytes = limit_bytes;
  std::string err;
  auto be = CreateBackend("cpu", 0, &err, o);
  EXPECT_NE(be, nullptr) << err;
  return be;
}

TEST(CatchAllocationFailure, DeviceBufferOverTheLimitNamesBytesAndLabels) {
  auto be = LimitedCpuBackend(1 << 20);
  absl::Status s = CatchAllocationFailure("in step 3", [&] {
    const AllocationLabel outer("the forward of block", 2);
    DevBuf a(be.get(), 512 << 10);
    const AllocationLabel inner("the attention");
    DevBuf b(be.get(), 768 << 10);  // 512 KiB + 768 KiB > 1 MiB
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(s.message(),
            "out of memory in step 3: could not allocate 786432 bytes of device memory (524288 "
            "bytes in use) for the forward of block 2: the attention");
  EXPECT_EQ(be->AllocatedBytes(), 0);  // `a` was freed as the stack unwound
  // Within the limit it works, and no label is left behind.
  absl::StatusOr<int> ok = CatchAllocationFailure("again", [&]() -> absl::StatusOr<int> {
    DevBuf c(be.get(), 1 << 20);
    return 7;
  });
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, 7);
  EXPECT_EQ(AllocationLabel::Current(), "");
}

TEST(CatchAllocationFailure, HostBadAllocIsReportedWithTheLabelsInForce) {
  absl::Status s = CatchAllocationFailure("building the model", [] {
    const AllocationLabel label("the shards of unit", 5);
    std::vector<char> v;
    v.reserve(size_t{1} << 62);  // 4 EiB: no host has it
    return v.capacity() > 0 ? absl::OkStatus() : absl::InternalError("empty");
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(s.message(),
            "out of memory building the model: could not allocate host memory (std::bad_alloc) "
            "for the shards of unit 5");
}

// A 1-rank tiny model whose shards do not fit in 16 KiB: Trainer::Create fails (as the worker
// calls it) with RESOURCE_EXHAUSTED naming the first unit's shards, and holds nothing afterwards.
TEST(CatchAllocationFailure, TrainerOverTheMemoryLimitFailsToBuild) {
  const std::string train = testing::MakeTokenFile("alloc_train.bin", 4096);
  auto be = LimitedCpuBackend(16 << 10);
  testing::RunRanks(1, [&](int rank, Communicator* comm) {
    auto t = CatchAllocationFailure("building the model", [&] {
      return Trainer::Create(WithDefaults(testing::TinySpec(train), 1), rank, 1, be.get(), comm);
    });
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted) << t.status();
    EXPECT_NE(t.status().message().find(
                  "for the shards (weights, gradients, AdamW moments) of unit 0"),
              std::string::npos)
        << t.status();
  });
  EXPECT_EQ(be->AllocatedBytes(), 0);
}

// The CPU attention's T x T scratch over the backend's limit (1 MiB; T = 1024: 4 MiB of f32
// scores) is RESOURCE_EXHAUSTED naming the bytes asked for, not a bare std::bad_alloc.
TEST(CatchAllocationFailure, CpuAttentionScratchOverTheLimitNamesItsBytes) {
  auto be = LimitedCpuBackend(1 << 20);
  const int64_t T = 1024, D = 2;
  absl::Status s = CatchAllocationFailure("in step 0", [&] {
    const AllocationLabel label("the attention of block", 0);
    DevBuf q(be.get(), T * D * 4), k(be.get(), T * D * 4), v(be.get(), T * D * 4);
    DevBuf out(be.get(), T * D * 4), lse(be.get(), T * 4);
    for (DevBuf* b : {&q, &k, &v}) be->Memset(b->get(), 0, T * D * 4);
    be->AttentionForward(q.f32(), k.f32(), v.f32(), 1, T, 1, 1, D, out.f32(), lse.f32());
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("4194304 bytes"), std::string::npos) << s;
  EXPECT_NE(s.message().find("for the attention of block 0"), std::string::npos) << s;
}

}  // namespace
}  // namespace fsdp8
