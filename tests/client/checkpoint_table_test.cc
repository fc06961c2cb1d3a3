// `fsdp8 checkpoints JOB`: byte sizes and the table layout.
#include "client/client.h"
#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

TEST(CheckpointTable, FormatBytes) {
  EXPECT_EQ(FormatBytes(0), "0B");
  EXPECT_EQ(FormatBytes(1023), "1023B");
  EXPECT_EQ(FormatBytes(1536), "1.50KiB");
  EXPECT_EQ(FormatBytes(12 * 1024 * 1024), "12.0MiB");
  EXPECT_EQ(FormatBytes(3LL * 1024 * 1024 * 1024 + 256LL * 1024 * 1024), "3.25GiB");
}

TEST(CheckpointTable, RowsInOrder) {
  EXPECT_EQ(FormatCheckpointTable({}), "no committed checkpoints\n");
  std::vector<v1::CheckpointInfo> cks(2);
  cks[0].set_step(20);
  cks[0].set_world_size(2);
  cks[0].set_bytes(2048);
  cks[0].set_dir("/data/ck/step-20");
  cks[1].set_step(40);
  cks[1].set_world_size(4);
  cks[1].set_bytes(100);
  cks[1].set_dir("/data/ck/step-40");
  EXPECT_EQ(FormatCheckpointTable(cks),
            "STEP       WORLD  BYTES      DIR\n"
            "20         2      2.00KiB    /data/ck/step-20\n"
            "40         4      100B       /data/ck/step-40\n");
}

}  // namespace
}  // namespace fsdp8
