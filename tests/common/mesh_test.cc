// The mesh arithmetic (common/mesh.h) against hand-written tables, and the spec's mesh fields.
#include "common/mesh.h"

#include <set>
#include <utility>
#include <vector>

#include "common/spec.h"
#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

TEST(Mesh, TwoReplicasOfTwoShards) {
  v1::JobSpec s;
  s.mutable_sharding()->set_replicas(2);
  absl::StatusOr<Mesh> m = MeshOf(s, 4);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->shard_size, 2);
  // rank: replica, shard index (hand table: groups {0,1} and {2,3}; replica groups {0,2}, {1,3}).
  const int want[4][2] = {{0, 0}, {0, 1}, {1, 0}, {1, 1}};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(m->Replica(r), want[r][0]) << r;
    EXPECT_EQ(m->ShardIndex(r), want[r][1]) << r;
    EXPECT_EQ(m->RankOf(want[r][0], want[r][1]), r);
    EXPECT_EQ(m->OptimizerIndex(r), want[r][1]);  // SHARD_GROUP: the shard index
  }
  EXPECT_EQ(m->OptimizerShards(), 2);
}

TEST(Mesh, WorldOptimizerShardingIsTheFlatWorldLayout) {
  v1::JobSpec s;
  s.mutable_sharding()->set_replicas(2);
  s.mutable_sharding()->set_optimizer_sharding(v1::OPTIMIZER_SHARDING_WORLD);
  absl::StatusOr<Mesh> m = MeshOf(s, 6);  // R 2, S 3
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->OptimizerShards(), 6);
  // Shard s of the group split in 2 pieces, piece p at flat index s * 2 + p.
  const int want[6] = {0, 2, 4, 1, 3, 5};
  std::set<int> seen;
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ(m->OptimizerIndex(r), want[r]) << r;
    seen.insert(m->OptimizerIndex(r));
  }
  EXPECT_EQ(seen.size(), 6u);
}

TEST(Mesh, FlatAndPureDataParallel) {
  v1::JobSpec s;  // replicas unset: 1
  absl::StatusOr<Mesh> flat = MeshOf(s, 3);
  ASSERT_TRUE(flat.ok());
  EXPECT_TRUE(flat->Flat());
  EXPECT_EQ(flat->shard_size, 3);
  s.mutable_sharding()->set_replicas(3);
  absl::StatusOr<Mesh> dp = MeshOf(s, 3);
  ASSERT_TRUE(dp.ok());
  EXPECT_EQ(dp->shard_size, 1);
  EXPECT_EQ(dp->Replica(2), 2);
}

TEST(Mesh, RefusesReplicasThatDoNotDivideOrAreUnresolved) {
  v1::JobSpec s;
  s.mutable_sharding()->set_replicas(2);
  absl::StatusOr<Mesh> m = MeshOf(s, 3);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("sharding.replicas"), std::string::npos);
  s.mutable_sharding()->set_replicas(0);  // auto, not resolved
  EXPECT_FALSE(MeshOf(s, 2).ok());
}

// Which checkpoint file each rank writes (a hand table per mesh): SHARD_GROUP, the ranks of
// replica 0 write file = shard index, the others none (-1); WORLD, every rank writes its flat
// optimizer index s * R + p (shard s, replica p).
TEST(Mesh, CheckpointFileOfEachRank) {
  struct Case {
    int replicas, shard_size;
    bool world;
    std::vector<int> files;  // by rank
  };
  const Case cases[] = {
      {2, 2, false, {0, 1, -1, -1}},
      {2, 2, true, {0, 2, 1, 3}},
      {3, 2, false, {0, 1, -1, -1, -1, -1}},
      {3, 2, true, {0, 3, 1, 4, 2, 5}},
      {1, 3, false, {0, 1, 2}},       // flat: every rank, its own index
      {1, 3, true, {0, 1, 2}},
      {3, 1, false, {0, -1, -1}},     // pure data parallelism: rank 0 writes the one file
      {3, 1, true, {0, 1, 2}},
  };
  for (const Case& c : cases) {
    Mesh m;
    m.replicas = c.replicas;
    m.shard_size = c.shard_size;
    m.optimizer_over_world = c.world;
    for (int r = 0; r < m.world_size(); ++r)
      EXPECT_EQ(m.CheckpointFile(r), c.files[r])
          << c.replicas << "x" << c.shard_size << (c.world ? " WORLD" : " SHARD_GROUP") << " rank "
          << r;
  }
}

// The world sizes a spec's mesh allows (multiples of sharding.replicas; auto and unset: any) and
// the smallest and largest of them in the worker range.
TEST(Mesh, WorldSizesTheReplicasDivide) {
  v1::JobSpec s;
  s.mutable_sharding()->set_min_workers(3);
  s.mutable_sharding()->set_max_workers(7);
  EXPECT_TRUE(MeshAllows(s, 5));  // unset: R = 1
  absl::StatusOr<std::pair<int, int>> range = MeshWorldSizeRange(s);
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(*range, std::make_pair(3, 7));
  s.mutable_sharding()->set_replicas(2);
  EXPECT_FALSE(MeshAllows(s, 5));
  EXPECT_TRUE(MeshAllows(s, 6));
  range = MeshWorldSizeRange(s);
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(*range, std::make_pair(4, 6));
  s.mutable_sharding()->set_replicas(6);  // only 6
  range = MeshWorldSizeRange(s);
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(*range, std::make_pair(6, 6));
  s.mutable_sharding()->set_replicas(0);  // auto: any
  EXPECT_TRUE(MeshAllows(s, 7));
  range = MeshWorldSizeRange(s);
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(*range, std::make_pair(3, 7));
  s.mutable_sharding()->set_replicas(4);
  s.mutable_sharding()->set_min_workers(5);
  range = MeshWorldSizeRange(s);
  ASSERT_FALSE(range.ok());
  EXPECT_EQ(range.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(range.status().message().find("sharding.replicas"), std::string::npos)
      << range.status();
  EXPECT_NE(range.status().message().find("4 divides none of 5..7"), std::string::npos)
      << range.status();
}

TEST(Mesh, ShapeAsTheApiReportsIt) {
  Mesh m;
  m.replicas = 2;
  m.shard_size = 3;
  v1::MeshShape group = MeshShapeOf(m);
  EXPECT_EQ(group.replicas(), 2);
  EXPECT_EQ(group.shard_group_size(), 3);
  EXPECT_EQ(group.optimizer_sharding(), v1::OPTIMIZER_SHARDING_SHARD_GROUP);
  EXPECT_EQ(group.optimizer_shards(), 3);
  m.optimizer_over_world = true;
  v1::MeshShape world = MeshShapeOf(m);
  EXPECT_EQ(world.optimizer_sharding(), v1::OPTIMIZER_SHARDING_WORLD);
  EXPECT_EQ(world.optimizer_shards(), 6);
}

TEST(Mesh, YamlSpellings) {
  absl::StatusOr<v1::JobSpec> s =
      ParseSpec("sharding: {replicas: auto, optimizer_sharding: world}\n");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->sharding().has_replicas());
  EXPECT_EQ(s->sharding().replicas(), 0);
  EXPECT_EQ(s->sharding().optimizer_sharding(), v1::OPTIMIZER_SHARDING_WORLD);
  EXPECT_FALSE(ParseSpec("sharding: {replicas: many}\n").ok());
  const v1::JobSpec d = WithDefaults(v1::JobSpec(), 4);
  EXPECT_EQ(d.sharding().replicas(), 1);
  EXPECT_EQ(d.sharding().optimizer_sharding(), v1::OPTIMIZER_SHARDING_SHARD_GROUP);
}

}  // namespace
}  // namespace fsdp8
