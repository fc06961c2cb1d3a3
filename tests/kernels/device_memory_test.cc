// CgroupMemoryLimitBytes on fake /proc and /sys trees (the layouts of cgroups(7)).
#include "kernels/device_memory.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace fsdp8 {
namespace {

class CgroupLimit : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fsdp8-cgroup-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(root_); }
  void Write(const std::string& rel, const std::string& text) {
    const std::filesystem::path p = root_ + rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::string root_;
};

TEST_F(CgroupLimit, V2TakesTheSmallestLimitOnThePathToTheRoot) {
  Write("/proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  Write("/sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "max\n");
  Write("/sys/fs/cgroup/kubepods/pod1/memory.max", "2147483648\n");
  Write("/sys/fs/cgroup/kubepods/memory.max", "8589934592\n");
  EXPECT_EQ(CgroupMemoryLimitBytes(root_), int64_t{2} << 30);
}

TEST_F(CgroupLimit, V2InsideAContainerNamespaceReadsTheMountedRoot) {
  Write("/proc/self/cgroup", "0::/\n");
  Write("/sys/fs/cgroup/memory.max", "1073741824\n");
  EXPECT_EQ(CgroupMemoryLimitBytes(root_), int64_t{1} << 30);
}

TEST_F(CgroupLimit, V1MemoryControllerAmongOthers) {
  Write("/proc/self/cgroup", "12:cpu,cpuacct:/docker/abc\n7:blkio,memory:/docker/abc\n");
  Write("/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "3221225472\n");
  EXPECT_EQ(CgroupMemoryLimitBytes(root_), int64_t{3} << 30);
}

TEST_F(CgroupLimit, NoLimitIsZero) {
  EXPECT_EQ(CgroupMemoryLimitBytes(root_), 0) << "no /proc/self/cgroup";
  Write("/proc/self/cgroup", "0::/user.slice\n7:memory:/user.slice\n");
  Write("/sys/fs/cgroup/user.slice/memory.max", "max\n");
  // cgroup v1's "unlimited": the largest multiple of the page size below 2^63.
  Write("/sys/fs/cgroup/memory/user.slice/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(CgroupMemoryLimitBytes(root_), 0);
  Write("/sys/fs/cgroup/memory/user.slice/memory.limit_in_bytes", "garbage\n");
  EXPECT_EQ(CgroupMemoryLimitBytes(root_), 0);
}

TEST(DeviceMemory, CpuIsAtMostThePhysicalMemory) {
  std::string err;
  const int64_t m = DeviceMemoryBytes("cpu", 0, &err);
  ASSERT_GT(m, 0) << err;
  const int64_t limit = CgroupMemoryLimitBytes();
  if (limit > 0) {
    EXPECT_LE(m, limit);
  }
}

}  // namespace
}  // namespace fsdp8
