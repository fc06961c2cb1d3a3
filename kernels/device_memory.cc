// The memory limit of this process's cgroup (kernels/device_memory.h).
#include "kernels/device_memory.h"

#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp8 {
namespace {

// The first line of `path` as a byte count; "max" (cgroup v2's "no limit"), values of 2^62 and
// above (cgroup v1's "no limit" is the largest page multiple below 2^63), unreadable or malformed
// files give -1.
int64_t ReadLimit(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line) || line.empty() || line == "max") return -1;
  int64_t v = 0;
  for (char c : line) {
    if (c < '0' || c > '9') return -1;
    if (v > (std::numeric_limits<int64_t>::max() - (c - '0')) / 10) return -1;
    v = v * 10 + (c - '0');
  }
  return v >= (int64_t{1} << 62) ? -1 : v;
}

// The smallest limit among `file` in dir and every ancestor of dir up to `top` (a cgroup's
// limit is capped by its parents'); -1 when none is set.
int64_t SmallestUpTo(const std::string& top, std::string dir, const std::string& file) {
  int64_t best = -1;
  while (true) {
    const int64_t v = ReadLimit(top + dir + "/" + file);
    if (v >= 0 && (best < 0 || v < best)) best = v;
    if (dir.empty() || dir == "/") break;
    const size_t slash = dir.rfind('/');
    dir = slash == std::string::npos ? "" : dir.substr(0, slash);
  }
  return best;
}

}  // namespace

int64_t CgroupMemoryLimitBytes(const std::string& root) {
  std::ifstream f(root + "/proc/self/cgroup");
  std::string line;
  int64_t best = -1;
  auto take = [&best](int64_t v) {
    if (v >= 0 && (best < 0 || v < best)) best = v;
  };
  while (std::getline(f, line)) {
    // hierarchy-ID:controller-list:cgroup-path (cgroups(7)).
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    if (path == "/") path.clear();
    if (controllers.empty()) {  // v2, the unified hierarchy
      take(SmallestUpTo(root + "/sys/fs/cgroup", path, "memory.max"));
      continue;
    }
    std::stringstream list(controllers);
    std::string c;
    while (std::getline(list, c, ',')) {
      if (c == "memory") {
        take(SmallestUpTo(root + "/sys/fs/cgroup/memory", path, "memory.limit_in_bytes"));
      }
    }
  }
  return best < 0 ? 0 : best;
}

}  // namespace fsdp8
