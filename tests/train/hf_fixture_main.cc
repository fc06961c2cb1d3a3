// fsdp8-test-hf-fixture ROOT [STEPS]: writes ROOT/train.bin and a committed checkpoint
// ROOT/ckpt/step-<STEPS> (default 2) of the interchange test model (tests/train/hf_test_util.h),
// trained STEPS steps on 2 ranks, for tests/interchange/check_export.py. Exit 0 on success.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/token_shard.h"
#include "tests/train/hf_test_util.h"

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s ROOT [STEPS]\n", argv[0]);
    return 2;
  }
  const std::string root = argv[1];
  std::filesystem::create_directories(root);
  std::vector<uint16_t> toks;
  uint64_t x = 5;
  for (int i = 0; i < 20000; ++i) {
    x = fsdp8::SplitMix64(x);
    toks.push_back(static_cast<uint16_t>(97 + x % 26));
  }
  const std::string train = root + "/train.bin";
  if (absl::Status s = fsdp8::WriteTokenShard(train, toks); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  const int steps = argc == 3 ? std::atoi(argv[2]) : 2;
  if (steps < 1) return 2;
  fsdp8::v1::JobSpec spec = fsdp8::testing::InterchangeSpec(train);
  spec.mutable_training()->set_steps(std::max(steps, 20));
  auto m = fsdp8::testing::WriteCommittedCheckpoint(spec, 2, steps, root + "/ckpt");
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", m.status().ToString().c_str());
    return 1;
  }
  std::printf("%s/ckpt/step-%d\n", root.c_str(), steps);
  return 0;
}
