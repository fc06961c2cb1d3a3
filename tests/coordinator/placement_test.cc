// Placement of hybrid-sharded jobs' ranks (coordinator/placement.h): shard groups inside one
// domain (host), replicas spread over domains, the documented split when that cannot be, and
// sharding.replicas auto. Expected rank orders are worked out by hand from the rules.
#include "coordinator/placement.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fsdp8::coord {
namespace {

// 8 workers registered alternately from two hosts: w0 A, w1 B, w2 A, ... (so the first 4 in
// registration order span both hosts).
std::vector<PlacementWorker> Interleaved(int n) {
  std::vector<PlacementWorker> ws;
  for (int i = 0; i < n; ++i)
    ws.push_back({"w" + std::to_string(i), i % 2 == 0 ? "127.0.0.1" : "127.0.0.2"});
  return ws;
}

std::string DomainOfId(const std::vector<PlacementWorker>& ws, const std::string& id) {
  for (const PlacementWorker& w : ws)
    if (w.id == id) return w.domain;
  return "?";
}

// The domains of each shard group (S consecutive ranks).
std::vector<std::set<std::string>> GroupDomains(const std::vector<PlacementWorker>& ws,
                                                const Placement& p, int s) {
  std::vector<std::set<std::string>> out;
  for (size_t g = 0; g * s < p.ranks.size(); ++g) {
    std::set<std::string> d;
    for (int k = 0; k < s; ++k) d.insert(DomainOfId(ws, p.ranks[g * s + k]));
    out.push_back(d);
  }
  return out;
}

TEST(Placement, DomainIsTheHostOrTheHostsNamedIsland) {
  EXPECT_EQ(DomainOf("10.0.0.1", ""), "10.0.0.1");
  EXPECT_EQ(DomainOf("10.0.0.1", "nvl0"), "10.0.0.1/nvl0");
  EXPECT_NE(DomainOf("10.0.0.1", "nvl0"), DomainOf("10.0.0.2", "nvl0"));
}

TEST(Placement, TwoReplicasOfFourKeepEachGroupOnOneHost) {
  const auto ws = Interleaved(8);
  const Placement p = PlaceMesh(ws, 8, 2);
  EXPECT_EQ(p.ranks, (std::vector<std::string>{"w0", "w2", "w4", "w6", "w1", "w3", "w5", "w7"}));
  EXPECT_EQ(p.replicas, 2);
  EXPECT_EQ(p.split_groups, 0);
}

TEST(Placement, FourReplicasOfTwoAlternateHosts) {
  const auto ws = Interleaved(8);
  const Placement p = PlaceMesh(ws, 8, 4);
  // Round-robin: replica 0 on host A, 1 on B, 2 on A, 3 on B.
  EXPECT_EQ(p.ranks, (std::vector<std::string>{"w0", "w2", "w1", "w3", "w4", "w6", "w5", "w7"}));
  const auto groups = GroupDomains(ws, p, 2);
  ASSERT_EQ(groups.size(), 4u);
  for (const auto& g : groups) EXPECT_EQ(g.size(), 1u);
  EXPECT_EQ(*groups[0].begin(), "127.0.0.1");
  EXPECT_EQ(*groups[1].begin(), "127.0.0.2");
  EXPECT_EQ(p.split_groups, 0);
}

TEST(Placement, TwoJobsSideBySideEachKeepsItsGroupsWhole) {
  auto ws = Interleaved(8);
  const Placement a = PlaceMesh(ws, 4, 2);
  EXPECT_EQ(a.ranks, (std::vector<std::string>{"w0", "w2", "w1", "w3"}));
  // The second job gets what the first left.
  std::vector<PlacementWorker> rest;
  for (const PlacementWorker& w : ws)
    if (std::find(a.ranks.begin(), a.ranks.end(), w.id) == a.ranks.end()) rest.push_back(w);
  const Placement b = PlaceMesh(rest, 4, 2);
  EXPECT_EQ(b.ranks, (std::vector<std::string>{"w4", "w6", "w5", "w7"}));
  EXPECT_EQ(a.split_groups + b.split_groups, 0);
}

TEST(Placement, UnavoidableSplitKeepsTheWorldSizeAndNamesTheSplitGroup) {
  // Two hosts of 3 free workers, R = 3, S = 2: two whole groups, the third spans both hosts.
  const std::vector<PlacementWorker> ws = {{"a0", "A"}, {"a1", "A"}, {"a2", "A"},
                                           {"b0", "B"}, {"b1", "B"}, {"b2", "B"}};
  const Placement p = PlaceMesh(ws, 6, 3);
  EXPECT_EQ(p.ranks, (std::vector<std::string>{"a0", "a1", "b0", "b1", "a2", "b2"}));
  EXPECT_EQ(p.split_groups, 1);
  EXPECT_EQ(p.split, (std::vector<int>{2}));
}

TEST(Placement, FlatJobsKeepRegistrationOrder) {
  const auto ws = Interleaved(8);
  const Placement p = PlaceMesh(ws, 4, 1);
  EXPECT_EQ(p.ranks, (std::vector<std::string>{"w0", "w1", "w2", "w3"}));
  EXPECT_EQ(p.split_groups, 0);
}

TEST(Placement, TooFewWorkersOrAReplicaCountNotDividingTheWorldPlaceNothing) {
  const auto ws = Interleaved(8);
  EXPECT_TRUE(PlaceMesh(ws, 6, 4).ranks.empty());  // 4 does not divide 6
  EXPECT_TRUE(PlaceMesh(Interleaved(3), 4, 2).ranks.empty());
  EXPECT_TRUE(PlaceOnePerDomain(ws, 8, 4).ranks.empty());  // 2 hosts, not 4
}

TEST(Placement, AutoIsTheHostsOfTheChosenWorkersWhenEachHoldsAsMany) {
  const auto ws = Interleaved(8);
  // 8 of 8 on two hosts of 4: R = 2, one group per host.
  const Placement all = PlaceAuto(ws, 8);
  EXPECT_EQ(all.replicas, 2);
  EXPECT_EQ(all.ranks, (std::vector<std::string>{"w0", "w2", "w4", "w6", "w1", "w3", "w5", "w7"}));
  // 4 of 8: one host holds them all: R = 1 there.
  const Placement four = PlaceAuto(ws, 4);
  EXPECT_EQ(four.replicas, 1);
  EXPECT_EQ(four.ranks, (std::vector<std::string>{"w0", "w2", "w4", "w6"}));
  // 6 on hosts of 4 and 2: no equal split, no host of 6 or 3 + 3: R = 1, the first 6.
  const std::vector<PlacementWorker> uneven = {{"a0", "A"}, {"a1", "A"}, {"a2", "A"},
                                               {"a3", "A"}, {"b0", "B"}, {"b1", "B"}};
  const Placement six = PlaceAuto(uneven, 6);
  EXPECT_EQ(six.replicas, 1);
  EXPECT_EQ(six.ranks, (std::vector<std::string>{"a0", "a1", "a2", "a3", "b0", "b1"}));
  // Three hosts of 2: R = 3.
  const std::vector<PlacementWorker> three = {{"a0", "A"}, {"b0", "B"}, {"c0", "C"},
                                              {"a1", "A"}, {"b1", "B"}, {"c1", "C"}};
  const Placement p3 = PlaceAuto(three, 6);
  EXPECT_EQ(p3.replicas, 3);
  EXPECT_EQ(p3.ranks, (std::vector<std::string>{"a0", "a1", "b0", "b1", "c0", "c1"}));
}

// Auto with a list per replica count (the scheduler's: the workers that hold the plan of each
// mesh, fewer as R grows). Two hosts of 3: R = 1 fits no host (4 > 3); at R = 2 only a1, a2, b1,
// b2 take part, so the groups are theirs, not the hosts' first workers a0, b0.
TEST(Placement, AutoTriesEachReplicaCountOnItsOwnWorkers) {
  const std::vector<PlacementWorker> all = {{"a0", "A"}, {"b0", "B"}, {"a1", "A"},
                                            {"b1", "B"}, {"a2", "A"}, {"b2", "B"}};
  const std::vector<PlacementWorker> big = {{"a1", "A"}, {"b1", "B"}, {"a2", "A"}, {"b2", "B"}};
  std::vector<int> asked;
  auto at = [&](int r) {
    asked.push_back(r);
    return r == 1 ? all : r == 2 ? big : std::vector<PlacementWorker>{};
  };
  const Placement two = PlaceAuto(at, 4);
  EXPECT_EQ(two.replicas, 2);
  EXPECT_EQ(two.ranks, (std::vector<std::string>{"a1", "a2", "b1", "b2"}));
  EXPECT_EQ(asked, (std::vector<int>{1, 2}));  // smallest first, stopping at the first that fits
  // Nobody holds a 2 x 2 mesh's plan: no R places groups per host; R = 1 on the first 4 of the
  // R = 1 list (interleaved, so spanning both hosts), after every divisor of 4 was tried.
  asked.clear();
  auto flat_only = [&](int r) {
    asked.push_back(r);
    return r == 1 ? all : std::vector<PlacementWorker>{};
  };
  const Placement flat = PlaceAuto(flat_only, 4);
  EXPECT_EQ(flat.replicas, 1);
  EXPECT_EQ(flat.ranks, (std::vector<std::string>{"a0", "b0", "a1", "b1"}));
  EXPECT_EQ(asked, (std::vector<int>{1, 2, 4, 1}));
  // Fewer than 4 hold even the flat plan: nothing placed.
  const Placement none = PlaceAuto(
      [&](int r) { return r == 1 ? std::vector<PlacementWorker>(all.begin(), all.begin() + 3)
                                 : std::vector<PlacementWorker>{}; },
      4);
  EXPECT_TRUE(none.ranks.empty());
}

}  // namespace
}  // namespace fsdp8::coord
