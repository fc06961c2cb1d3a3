#include "coordinator/placement.h"

#include <map>
#include <set>

namespace fsdp8::coord {
namespace {

// The workers of each domain (registration order kept), domains in first-appearance order.
struct Domains {
  std::vector<std::string> order;
  std::map<std::string, std::vector<std::string>> members;
};

Domains GroupByDomain(const std::vector<PlacementWorker>& workers) {
  Domains d;
  for (const PlacementWorker& w : workers) {
    auto [it, added] = d.members.try_emplace(w.domain);
    if (added) d.order.push_back(w.domain);
    it->second.push_back(w.id);
  }
  return d;
}

Placement FirstN(const std::vector<PlacementWorker>& workers, int world_size) {
  Placement p;
  p.replicas = 1;
  for (int i = 0; i < world_size; ++i) p.ranks.push_back(workers[i].id);
  return p;
}

}  // namespace

std::string DomainOf(const std::string& host, const std::string& placement_domain) {
  return placement_domain.empty() ? host : host + "/" + placement_domain;
}

Placement PlaceMesh(const std::vector<PlacementWorker>& workers, int world_size, int replicas) {
  if (world_size < 1 || replicas < 1 || world_size % replicas != 0 ||
      static_cast<int>(workers.size()) < world_size)
    return {};
  if (replicas == 1) return FirstN(workers, world_size);
  const int s = world_size / replicas;
  Domains d = GroupByDomain(workers);
  std::map<std::string, size_t> used;  // workers taken per domain (a prefix of its members)
  Placement p;
  p.replicas = replicas;
  int groups = 0;
  // Whole groups, dealt round-robin over the domains that still hold S workers.
  for (bool progress = true; groups < replicas && progress;) {
    progress = false;
    for (const std::string& dom : d.order) {
      if (groups == replicas) break;
      const std::vector<std::string>& m = d.members[dom];
      size_t& u = used[dom];
      if (m.size() - u < static_cast<size_t>(s)) continue;
      p.ranks.insert(p.ranks.end(), m.begin() + u, m.begin() + u + s);
      u += s;
      ++groups;
      progress = true;
    }
  }
  // Split groups from the leftovers, domain by domain.
  std::vector<std::pair<std::string, std::string>> rest;  // (id, domain)
  for (const std::string& dom : d.order) {
    const std::vector<std::string>& m = d.members[dom];
    for (size_t i = used[dom]; i < m.size(); ++i) rest.emplace_back(m[i], dom);
  }
  size_t next = 0;
  for (; groups < replicas; ++groups) {
    std::set<std::string> spans;
    for (int k = 0; k < s; ++k, ++next) {
      p.ranks.push_back(rest[next].first);
      spans.insert(rest[next].second);
    }
    if (spans.size() > 1) {
      ++p.split_groups;
      p.split.push_back(groups);
    }
  }
  return p;
}

Placement PlaceOnePerDomain(const std::vector<PlacementWorker>& workers, int world_size,
                            int replicas) {
  if (world_size < 1 || replicas < 1 || world_size % replicas != 0) return {};
  const Domains d = GroupByDomain(workers);
  const size_t s = static_cast<size_t>(world_size / replicas);
  Placement p;
  p.replicas = replicas;
  int groups = 0;
  for (const std::string& dom : d.order) {
    if (groups == replicas) break;
    const std::vector<std::string>& m = d.members.at(dom);
    if (m.size() < s) continue;
    p.ranks.insert(p.ranks.end(), m.begin(), m.begin() + s);
    ++groups;
  }
  if (groups < replicas) return {};
  return p;
}

Placement PlaceAuto(const WorkersAt& at, int world_size) {
  if (world_size < 1) return {};
  for (int r = 1; r <= world_size; ++r) {
    if (world_size % r != 0) continue;
    Placement p = PlaceOnePerDomain(at(r), world_size, r);
    if (!p.ranks.empty()) return p;
  }
  const std::vector<PlacementWorker> flat = at(1);
  if (static_cast<int>(flat.size()) < world_size) return {};
  return FirstN(flat, world_size);
}

Placement PlaceAuto(const std::vector<PlacementWorker>& workers, int world_size) {
  if (static_cast<int>(workers.size()) < world_size) return {};
  return PlaceAuto([&workers](int) { return workers; }, world_size);
}

}  // namespace fsdp8::coord
