// Bounded inputs under a flood: 5,000 accepted jobs from 4 users, every string field of their
// specs at its limit (common/spec.h), through the real gRPC services in process, with no workers
// (the jobs stay PENDING). Checked: the process's resident memory stays under 300 MB, every
// ListJobs page stays under the page budget (4 MiB, far under the 64 MiB message limit), each
// user lists exactly its own jobs, and once the jobs ended, retention brings the table back to
// --retain_ended_jobs (also across a restart).
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/spec.h"
#include "coordinator/services.h"
#include "gtest/gtest.h"
#include "tests/coordinator/test_util.h"

namespace fsdp8::coord {
namespace {

namespace fs = std::filesystem;
using fsdp8::testing::SmallSpec;
using fsdp8::testing::TempDir;
using namespace std::chrono_literals;

constexpr int kJobs = 5000;
constexpr int kUsers = 4;
constexpr int64_t kRssBound = 300 << 20;

int64_t ResidentBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// `prefix` followed by `fill` up to exactly n bytes.
std::string Padded(const std::string& prefix, size_t n, char fill) {
  EXPECT_LE(prefix.size(), n);
  return prefix + std::string(n - prefix.size(), fill);
}

// A directory path of exactly n bytes under base, made of components of at most 200 bytes
// (NAME_MAX is 255), the last one naming job i.
std::string LongDir(const std::string& base, int i, size_t n) {
  std::string p = base;
  while (p.size() + 201 < n) p += "/" + std::string(200, 'd');
  return Padded(absl::StrCat(p, "/job", i, "-"), n, 'x');
}

v1::JobSpec FloodSpec(const std::string& ck_base, int i) {
  v1::JobSpec s = SmallSpec("/unused", 1, 3);
  s.set_name(Padded(absl::StrCat("flood-", i, "-"), kMaxNameBytes, 'n'));
  s.set_backend("cuda");  // one of two values: "cpu" or "cuda"
  s.mutable_data()->set_train_path(Padded("/data/train-", kMaxPathBytes, 't'));
  s.mutable_data()->set_val_path(Padded("/data/val-", kMaxPathBytes, 'v'));
  // resume_from must lie under dir, so dir leaves it room.
  const std::string dir = LongDir(ck_base, i, kMaxPathBytes - 24);
  s.mutable_checkpoint()->set_dir(dir);
  s.mutable_checkpoint()->set_resume_from(Padded(dir + "/step-", kMaxPathBytes, '7'));
  s.mutable_init()->set_from_hf(Padded("/data/hf-", kMaxPathBytes, 'h'));
  return s;
}

TEST(Flood, FiveThousandJobsFromFourUsersStayBounded) {
  TempDir dir;
  // Checkpoint directories (claimed at submit, OWNER written and fsynced) on tmpfs when there is.
  std::string shm = "/dev/shm/fsdp8-flood-XXXXXX";
  const bool on_shm = fs::is_directory("/dev/shm") && ::mkdtemp(shm.data()) != nullptr;
  const std::string ck_base = on_shm ? shm : dir.File("ck");
  const char* users[kUsers] = {"ann", "ben", "cat", "dan"};
  {
    std::ofstream t(dir.File("tokens"));
    for (int u = 0; u < kUsers; ++u) t << "token-of-user-" << users[u] << " submitter " << users[u] << "\n";
    t << "token-of-the-admin-1 admin root\n";
  }
  CoordinatorOptions o;
  o.listen = "127.0.0.1:0";
  o.tokens = dir.File("tokens");
  o.jobs.state_db = dir.File("jobs.db");
  o.jobs.check_files = false;  // the paths name no files; their lengths are the point
  o.jobs.retain_ended_jobs = 100;
  auto server = CoordinatorServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto connect = [&](const std::string& token) {
    ChannelSecurity sec;
    sec.token = token;
    auto c = Client::Connect((*server)->address(), sec);
    EXPECT_TRUE(c.ok());
    return std::move(*c);
  };
  const int64_t rss_before = ResidentBytes();

  // 5,000 submissions, the users' interleaved, every string at its limit (request ids too).
  std::map<std::string, std::vector<std::string>> ids;
  int failures = 0;
  std::vector<std::unique_ptr<Client>> clients;
  for (int u = 0; u < kUsers; ++u) clients.push_back(connect(absl::StrCat("token-of-user-", users[u])));
  for (int i = 0; i < kJobs; ++i) {
    const int u = i % kUsers;
    auto j = clients[u]->Submit(FloodSpec(ck_base, i),
                                Padded(absl::StrCat("req-", i, "-"), kMaxNameBytes, 'r'));
    if (!j.ok()) {
      if (failures++ < 3) ADD_FAILURE() << j.status();
      continue;
    }
    ids[users[u]].push_back(j->job_id());
  }
  ASSERT_EQ(failures, 0);
  ASSERT_EQ((*server)->jobs()->size(), static_cast<size_t>(kJobs));
  const int64_t rss_after = ResidentBytes();
  std::printf("resident memory: %.1f MB before, %.1f MB with %d jobs\n", rss_before / 1e6,
              rss_after / 1e6, kJobs);
  EXPECT_LT(rss_after, kRssBound);

  // Each user pages through exactly its own jobs; no page passes the budget.
  for (int u = 0; u < kUsers; ++u) {
    auto c = connect(absl::StrCat("token-of-user-", users[u]));
    std::vector<std::string> seen;
    std::string token;
    int pages = 0;
    do {
      auto page = c->ListJobsPage(1000, token);
      ASSERT_TRUE(page.ok()) << page.status();
      EXPECT_LE(page->ByteSizeLong(), static_cast<size_t>(4 << 20) + 1024);
      EXPECT_LT(page->ByteSizeLong(), static_cast<size_t>(o.max_message_bytes));
      for (const auto& j : page->jobs()) {
        EXPECT_EQ(j.owner(), users[u]);
        seen.push_back(j.job_id());
      }
      token = page->next_page_token();
      ++pages;
    } while (!token.empty());
    EXPECT_EQ(seen, ids[users[u]]) << users[u];
    EXPECT_GE(pages, 2) << "1250 jobs of ~7 KB fill more than one 4 MiB page";
  }
  auto admin = connect("token-of-the-admin-1");
  auto all = admin->ListJobs();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), static_cast<size_t>(kJobs));

  // Every job ends: retention keeps the 100 most recently ended.
  for (int u = 0; u < kUsers; ++u) {
    auto c = connect(absl::StrCat("token-of-user-", users[u]));
    for (const std::string& id : ids[users[u]]) ASSERT_TRUE(c->Cancel(id).ok()) << id;
  }
  EXPECT_EQ((*server)->jobs()->size(), 100u);
  (*server)->Shutdown();
  server->reset();
  auto again = CoordinatorServer::Start(o);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->jobs()->size(), 100u);
  (*again)->Shutdown();
  if (on_shm) fs::remove_all(shm);
}

// A second coordinator asked to listen on the first one's port is refused (gRPC would otherwise
// share the port through SO_REUSEPORT and split the clients between the two).
TEST(Listen, TakenPortIsRefused) {
  TempDir dir;
  CoordinatorOptions o;
  o.listen = "127.0.0.1:0";
  o.jobs.state_db = dir.File("a.db");
  auto first = CoordinatorServer::Start(o);
  ASSERT_TRUE(first.ok()) << first.status();
  CoordinatorOptions taken = o;
  taken.listen = absl::StrCat("127.0.0.1:", (*first)->port());
  taken.jobs.state_db = dir.File("b.db");
  auto second = CoordinatorServer::Start(taken);
  EXPECT_FALSE(second.ok());
  if (second.ok()) (*second)->Shutdown();
  (*first)->Shutdown();
}

}  // namespace
}  // namespace fsdp8::coord
