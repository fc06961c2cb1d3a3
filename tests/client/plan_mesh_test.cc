// `fsdp8 plan` shows the mesh a plan is for (human and --json): replicas, ranks per shard group,
// where the optimizer state lives and its shard count; auto is planned at --replicas. Runs the
// fsdp8 binary; the expected figures are worked out by hand (W = R x S; optimizer shards S, or W
// under WORLD).
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

struct CliOutput {
  int exit_code = -1;
  std::string out;  // stdout and stderr
};

CliOutput RunCli(const std::string& args) {
  CliOutput r;
  const std::string cmd = std::string(FSDP8_CLI_BIN) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n = 0;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string WriteSpec(const std::string& name, const std::string& sharding) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            (name + "-" + std::to_string(getpid()) + ".yaml"))
                               .string();
  std::ofstream(path) << "data: {train_path: /data/train.bin}\n"
                      << "model: {d_model: 32, n_layers: 1, n_heads: 2, ffn_dim: 64, seq_len: 16}\n"
                      << "training: {global_batch: 24}\n"
                      << "sharding: " << sharding << "\n";
  return path;
}

TEST(CliPlan, ShowsTheMeshInTextAndJson) {
  const std::string world =
      WriteSpec("mesh-world", "{min_workers: 4, replicas: 2, optimizer_sharding: world}");
  const CliOutput text = RunCli("plan " + world + " --world-size 4");
  ASSERT_EQ(text.exit_code, 0) << text.out;
  EXPECT_NE(text.out.find("mesh: 2 replicas x 2 ranks per shard group, optimizer state over the "
                          "world (4 shards)"),
            std::string::npos)
      << text.out;
  const CliOutput json = RunCli("plan " + world + " --world-size 4 --json");
  ASSERT_EQ(json.exit_code, 0) << json.out;
  EXPECT_NE(json.out.find("\"mesh\":{\"replicas\":2,\"shard_group_size\":2,"
                          "\"optimizer_sharding\":\"OPTIMIZER_SHARDING_WORLD\","
                          "\"optimizer_shards\":4}"),
            std::string::npos)
      << json.out;

  const std::string flat = WriteSpec("mesh-flat", "{min_workers: 2}");
  const CliOutput f = RunCli("plan " + flat + " --world-size 2");
  ASSERT_EQ(f.exit_code, 0) << f.out;
  EXPECT_NE(f.out.find("mesh: flat (1 replica x 2 ranks per shard group), optimizer state over "
                       "the shard group (2 shards)"),
            std::string::npos)
      << f.out;

  const std::string automatic = WriteSpec("mesh-auto", "{min_workers: 8, replicas: auto}");
  const CliOutput a = RunCli("plan " + automatic + " --world-size 8 --replicas 4");
  ASSERT_EQ(a.exit_code, 0) << a.out;
  EXPECT_NE(a.out.find("mesh: 4 replicas x 2 ranks per shard group, optimizer state over the "
                       "shard group (2 shards)"),
            std::string::npos)
      << a.out;
  // R must divide the world size: refused naming sharding.replicas.
  const CliOutput bad = RunCli("plan " + world + " --world-size 3");
  EXPECT_EQ(bad.exit_code, 2) << bad.out;
  EXPECT_NE(bad.out.find("sharding.replicas"), std::string::npos) << bad.out;
  // Without --world-size: the smallest and largest multiples of R in [min, max] (4 and 8 of 3..9;
  // 3, 5, 6, 7 and 9 are no world size of this job).
  const std::string range =
      WriteSpec("mesh-range", "{min_workers: 3, max_workers: 9, replicas: 4}");
  const CliOutput rr = RunCli("plan " + range);
  ASSERT_EQ(rr.exit_code, 0) << rr.out;
  EXPECT_NE(rr.out.find("backend cpu, 4 ranks, per rank"), std::string::npos) << rr.out;
  EXPECT_NE(rr.out.find("backend cpu, 8 ranks, per rank"), std::string::npos) << rr.out;
  EXPECT_EQ(rr.out.find("backend cpu, 3 ranks"), std::string::npos) << rr.out;
  EXPECT_EQ(rr.out.find("backend cpu, 9 ranks"), std::string::npos) << rr.out;
  const std::string none = WriteSpec("mesh-none", "{min_workers: 5, max_workers: 7, replicas: 4}");
  const CliOutput nr = RunCli("plan " + none);
  EXPECT_EQ(nr.exit_code, 2) << nr.out;
  EXPECT_NE(nr.out.find("sharding.replicas"), std::string::npos) << nr.out;
  for (const std::string& p : {world, flat, automatic, range, none}) std::filesystem::remove(p);
}

}  // namespace
}  // namespace fsdp8
