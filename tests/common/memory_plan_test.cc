// The memory plan's terms, computed by hand for a tiny spec from the shard plan's rule and the
// buffers FsdpParams and Trainer::RunBatch allocate (the comparison with measured peaks is in
// tests/train/memory_plan_test.cc).
#include "common/spec.h"
#include "common/memory_plan.h"

#include <chrono>
#include <map>
#include <string>

#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

// d 32, 2 layers, 2 heads, ffn 64, vocab 256, seq 32; global batch 6, microbatch 1; alignment 4;
// FP8 block linears, bf16 embedding and head, f32 attention.
v1::JobSpec Tiny() {
  v1::JobSpec s;
  auto* m = s.mutable_model();
  m->set_d_model(32);
  m->set_n_layers(2);
  m->set_n_heads(2);
  m->set_ffn_dim(64);
  m->set_vocab_size(256);
  m->set_seq_len(32);
  s.mutable_training()->set_global_batch(6);
  s.mutable_training()->set_microbatch(1);
  s.mutable_sharding()->set_alignment(4);
  return s;
}

std::map<std::string, int64_t> Terms(const MemoryPlan& p) {
  std::map<std::string, int64_t> t;
  for (const MemoryTerm& x : p.terms) t[x.name] = x.bytes;
  return t;
}

TEST(MemoryPlan, HandComputedShardTerms) {
  auto p = PlanMemory(WithDefaults(Tiny(), 2), 2);
  ASSERT_TRUE(p.ok()) << p.status();
  // Shards (elements per rank; quantum = world 2 x alignment 4 = 8):
  //   embedding bf16 256*32 = 8192 -> 4096; block fp8 linears 2*32*32 + 2*32*32 + 3*64*32 =
  //   10240 -> 5120, block bf16 norms 64 -> 32; head bf16 32 + 8192 = 8224 -> 4112.
  const int64_t shard = 4096 + 2 * (5120 + 32) + 4112;  // 18512
  std::map<std::string, int64_t> t = Terms(*p);
  // Master f32 + wire shard (bf16 2 bytes, fp8 1 byte).
  EXPECT_EQ(t["parameter shards"], 4096 * 6 + 2 * (5120 * 5 + 32 * 6) + 4112 * 6);
  EXPECT_EQ(t["gradient shards"], shard * 4);
  EXPECT_EQ(t["optimizer state"], shard * 8);  // AdamW m and v in f32
  // 14 FP8 weights (40 bytes each: scale and scale_inv slots of 16, two amaxes), 28 activation
  // and grad-output tensors (36 bytes each: two slots and an amax), one temporary amax.
  EXPECT_EQ(t["FP8 scaling state"], 14 * 40 + 28 * 36 + 4);
  // Token ids and targets of one microbatch (32 tokens, int32), losses of 3 sequences (f32).
  EXPECT_EQ(t["batch"], 32 * 4 * 2 + 3 * 32 * 4);
  int64_t sum = 0;
  for (const MemoryTerm& x : p->terms) sum += x.bytes;
  EXPECT_EQ(sum, p->peak_bytes);
  EXPECT_EQ(p->peak_bytes, std::max({p->forward_peak_bytes, p->backward_peak_bytes,
                                     p->optimizer_peak_bytes}));
  EXPECT_TRUE(p->device_extra.empty()) << "CPU: nothing outside the backend's count";
  EXPECT_EQ(p->device_bytes, p->peak_bytes);
}

TEST(MemoryPlan, RecomputeKeepsOnlyBlockInputs) {
  v1::JobSpec s = Tiny();
  s.mutable_training()->set_activation_recompute(true);
  auto p = PlanMemory(WithDefaults(s, 1), 1);
  ASSERT_TRUE(p.ok()) << p.status();
  // At most the two blocks' inputs (N = 32 tokens, C = 32, f32) are kept.
  EXPECT_LE(Terms(*p)["saved activations"], 2 * 32 * 32 * 4);
  auto full = PlanMemory(WithDefaults(Tiny(), 1), 1);
  ASSERT_TRUE(full.ok());
  EXPECT_GT(Terms(*full)["saved activations"], 2 * 32 * 32 * 4);
  EXPECT_LT(p->peak_bytes, full->peak_bytes);
}

TEST(MemoryPlan, CudaAddsWorkspaceAndDeviceExtras) {
  v1::JobSpec s = Tiny();
  s.set_backend("cuda");
  auto p = PlanMemory(WithDefaults(s, 2), 2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GE(Terms(*p)["workspaces"], kCudaGemmWorkspaceBytes);
  ASSERT_EQ(p->device_extra.size(), 3u);
  EXPECT_EQ(p->device_extra[0].bytes, kCudaContextBytes);
  EXPECT_EQ(p->device_extra[1].bytes, kNcclBufferBytes);
  EXPECT_GT(p->device_bytes, p->peak_bytes + kCudaContextBytes + kNcclBufferBytes);
}

TEST(MemoryPlan, HugeModelsArePlannedQuickly) {
  for (int which = 0; which < 2; ++which) {
    v1::JobSpec s;
    if (which == 0) s.mutable_model()->set_n_layers(1000000);
    if (which == 1) s.mutable_model()->set_d_model(1048576);
    const auto t0 = std::chrono::steady_clock::now();
    auto p = PlanMemory(WithDefaults(s, 1), 1);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(p.ok()) << p.status();
    // n_layers 1e6: 212,992 linear parameters per block, 17 bytes of shards each (f32 master,
    // grad, m, v and the FP8 wire shard); d_model 2^20:
    // the embedding alone is 256 * 2^20 parameters.
    EXPECT_GT(p->peak_bytes, which == 0 ? int64_t{3} << 40 : int64_t{1} << 30);
    EXPECT_LT(secs, 10.0);
  }
}

TEST(MemoryPlan, BadInputs) {
  EXPECT_FALSE(PlanMemory(WithDefaults(Tiny(), 0), 0).ok());
  v1::JobSpec s = Tiny();
  s.mutable_model()->set_n_heads(3);  // 32 % 3 != 0
  EXPECT_EQ(PlanMemory(WithDefaults(s, 1), 1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MemoryPlan, MemoryBytes) {
  EXPECT_EQ(MemoryBytes(100), "100 B");
  EXPECT_EQ(MemoryBytes(int64_t{3} << 29), "1.50 GiB");
  EXPECT_EQ(MemoryBytes(int64_t{512} << 20), "512.0 MiB");
}

// The CPU backends' scratch slots (CpuRefBackend::Scratch), counted by the backend and kept for
// the job: Tiny at seq 2048, one rank, one sequence per microbatch (N = 2048 tokens), FP8 linears
// unfused (f32 attention). By hand, in f32 elements: slot 0 = N * max(in, out) over the linears =
// N * 64 (ffn 64); slot 1 = max(in * out, N * in) = N * 64 (down_proj's input); the attention's
// scores and their gradient 2 * T * T; the RoPE cos/sin tables T * D (D = 16).
TEST(MemoryPlan, CpuScratchSlotsAreWorkspaces) {
  v1::JobSpec s = Tiny();
  s.mutable_model()->set_seq_len(2048);
  s.mutable_training()->set_global_batch(1);
  auto p = PlanMemory(WithDefaults(s, 1), 1);
  ASSERT_TRUE(p.ok()) << p.status();
  const int64_t n = 2048, scratch = (n * 64 + n * 64 + 2 * n * n + n * 16) * 4;  // 34,734,080
  const int64_t work = Terms(*p)["workspaces"];
  EXPECT_GE(work, scratch);
  // Besides it, one block's transients: a few dozen (N, C) f32 tensors at most.
  EXPECT_LE(work, scratch + 64 * n * 32 * 4);
  EXPECT_EQ(LargestTerms(*p, 1), "workspaces " + MemoryBytes(work));
  // The same at seq 4096: the T x T matrices grow fourfold.
  s.mutable_model()->set_seq_len(4096);
  auto q = PlanMemory(WithDefaults(s, 1), 1);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_GE(Terms(*q)["workspaces"], int64_t{2} * 4096 * 4096 * 4);
}

// 2e9 blocks of width 2^20: beyond 64-bit byte counts. The plan says so (exceeds_int64, the figure
// kBytesExceeded), and people read "exceeds 8 EiB", never a saturated count.
TEST(MemoryPlan, OverflowSaysExceeds) {
  v1::JobSpec s = Tiny();
  s.mutable_model()->set_n_layers(2000000000);
  s.mutable_model()->set_d_model(1048576);
  s.mutable_model()->set_n_heads(8192);
  s.mutable_model()->set_ffn_dim(4194304);
  auto p = PlanMemory(WithDefaults(s, 1), 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->exceeds_int64);
  EXPECT_EQ(p->device_bytes, kBytesExceeded);
  EXPECT_TRUE(ToProto(*p).exceeds_int64());
  EXPECT_EQ(MemoryBytes(p->device_bytes), "exceeds 8 EiB");
  EXPECT_EQ(MemoryBytesAndCount(p->device_bytes), "exceeds 8 EiB");
  EXPECT_EQ(LargestTerms(*p, 1).find("9223372036854775807"), std::string::npos);
  auto small = PlanMemory(WithDefaults(Tiny(), 1), 1);
  ASSERT_TRUE(small.ok());
  EXPECT_FALSE(small->exceeds_int64);
  EXPECT_EQ(MemoryBytesAndCount(int64_t{3} << 29), "1.50 GiB (1610612736 bytes)");
}

}  // namespace
}  // namespace fsdp8

namespace fsdp8 {
namespace {

// Tiny() on 2 replicas x 2 ranks (global batch 4 -> 1 microbatch, quantum 4 x 4 = 16, every
// buffer already a multiple of it): shards of the embedding 8192 -> 4096, a block's fp8 linears
// 10240 -> 5120 and norms 64 -> 32, the head 8224 -> 4112: as on 2 flat ranks. SHARD_GROUP holds
// them as a flat world-2 rank does; WORLD halves the master weights (f32 4 bytes) and the moments
// (8 bytes) and holds, at the optimizer, half the gradient shards.
TEST(MemoryPlan, HybridShardTerms) {
  const int64_t shard = 4096 + 2 * (5120 + 32) + 4112;
  const int64_t wire = 4096 * 2 + 2 * (5120 + 32 * 2) + 4112 * 2;  // bf16 2 bytes, fp8 1 byte
  for (bool world : {false, true}) {
    v1::JobSpec s = Tiny();
    s.mutable_training()->set_global_batch(4);
    s.mutable_sharding()->set_max_workers(4);
    s.mutable_sharding()->set_replicas(2);
    if (world) s.mutable_sharding()->set_optimizer_sharding(v1::OPTIMIZER_SHARDING_WORLD);
    auto p = PlanMemory(WithDefaults(s, 4), 4);
    ASSERT_TRUE(p.ok()) << p.status();
    std::map<std::string, int64_t> o;
    for (const MemoryTerm& x : p->optimizer_terms) o[x.name] = x.bytes;
    const int64_t piece = world ? shard / 2 : shard;
    EXPECT_EQ(o["parameter shards"], piece * 4 + wire) << world;
    EXPECT_EQ(o["optimizer state"], piece * 8) << world;
    EXPECT_EQ(o["gradient shards"], piece * 4) << world;
  }
}

}  // namespace
}  // namespace fsdp8
