// WorkerRegistry: version checks, which workers are assignable, named workers' ids.
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "coordinator/worker_registry.h"
#include "gtest/gtest.h"
#include "tests/coordinator/test_util.h"

namespace fsdp8::coord {
namespace {

using fsdp8::testing::CpuWorkerRegistration;

TEST(WorkerRegistry, VersionMismatchIsRefused) {
  WorkerRegistry reg({"1.2.3"});
  auto r = reg.Register(CpuWorkerRegistration("0.0.9"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(), "worker version 0.0.9 != coordinator version 1.2.3");
  EXPECT_TRUE(reg.List().empty());
  auto ok = reg.Register(CpuWorkerRegistration());
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->heartbeat_interval_ms(), 500);  // the default WorkerRegistryOptions
  EXPECT_TRUE(reg.Heartbeat(ok->worker_id()).ok());
  EXPECT_EQ(reg.Heartbeat("w-999").code(), absl::StatusCode::kNotFound);
}

class NullSink : public SessionSink {
 public:
  bool Send(const v1::CoordinatorMessage&) override { return true; }
  void Close() override {}
};

TEST(WorkerRegistry, OnlyWorkersWithSessionAreAssignable) {
  WorkerRegistry reg({"1.2.3"});
  auto a = reg.Register(CpuWorkerRegistration());
  auto b = reg.Register(CpuWorkerRegistration());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(reg.FreeWorkers("cpu").empty());
  auto tok = reg.AttachSession(a->worker_id(), std::make_shared<NullSink>());
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ(reg.FreeWorkers("cpu"), std::vector<std::string>{a->worker_id()});
  EXPECT_TRUE(reg.FreeWorkers("cuda").empty());
  EXPECT_EQ(reg.AttachSession("w-999", std::make_shared<NullSink>()).status().code(),
            absl::StatusCode::kNotFound);
  reg.DetachSession(a->worker_id(), *tok, "session stream ended");
  EXPECT_TRUE(reg.FreeWorkers("cpu").empty());
  auto list = reg.List();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_FALSE(list[0].healthy());
  EXPECT_EQ(list[0].rank(), -1);
}

// CPU workers without a memory limit share their host's RAM: each is planned with the RAM divided
// by the live CPU workers on that host; a worker whose session ended no longer takes a share.
TEST(WorkerRegistry, SharedHostMemoryIsDividedAmongLiveWorkers) {
  WorkerRegistryOptions options{"1.2.3"};
  options.heartbeat_timeout = std::chrono::milliseconds(250);
  WorkerRegistry reg(options);
  const int64_t ram = int64_t{12} << 30;
  std::vector<std::string> ids;
  std::vector<uint64_t> tokens;
  for (const char* host : {"10.0.0.1", "10.0.0.1", "10.0.0.1", "10.0.0.2"}) {
    v1::RegisterRequest r = CpuWorkerRegistration();
    r.set_host(host);
    r.set_memory_bytes(ram);
    r.set_memory_shared(true);
    auto w = reg.Register(r);
    ASSERT_TRUE(w.ok()) << w.status();
    auto tok = reg.AttachSession(w->worker_id(), std::make_shared<NullSink>());
    ASSERT_TRUE(tok.ok());
    ids.push_back(w->worker_id());
    tokens.push_back(*tok);
  }
  auto m = reg.WorkerMemory("cpu");
  EXPECT_EQ(m[ids[0]], ram / 3);
  EXPECT_EQ(m[ids[3]], ram) << "alone on its host";
  // A hung worker (no heartbeat, its session open) keeps its memory: still a share.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  for (int i : {0, 1, 3}) ASSERT_TRUE(reg.Heartbeat(ids[i]).ok());
  reg.CheckHeartbeats();
  m = reg.WorkerMemory("cpu");
  EXPECT_EQ(m.count(ids[2]), 0u) << "not healthy: not offered";
  EXPECT_EQ(m[ids[0]], ram / 3) << "the hung worker still takes a share";
  reg.DetachSession(ids[2], tokens[2], "session stream ended");
  m = reg.WorkerMemory("cpu");
  EXPECT_EQ(m.count(ids[2]), 0u) << "not healthy: not offered";
  EXPECT_EQ(m[ids[0]], ram / 2);
  EXPECT_EQ(m[ids[1]], ram / 2);
}

// Named workers keep their id: a second live process under the name is refused naming the first,
// the same process (its session dropped) or a successor after the first's session ended takes the
// entry over, drain included; malformed names are refused naming the field and the rule.
TEST(WorkerRegistry, NamedWorkerKeepsItsIdAndALiveDuplicateIsRefused) {
  WorkerRegistry reg({"1.2.3"});
  v1::RegisterRequest a = CpuWorkerRegistration();
  a.set_name("fsdp8-worker-0");
  a.set_pid(100);
  auto r1 = reg.Register(a);
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r1->worker_id(), "fsdp8-worker-0");
  auto sink = std::make_shared<NullSink>();
  auto tok = reg.AttachSession("fsdp8-worker-0", sink);
  ASSERT_TRUE(tok.ok());
  ASSERT_TRUE(reg.Drain("fsdp8-worker-0", false).ok());

  v1::RegisterRequest other = a;
  other.set_pid(200);
  auto dup = reg.Register(other);
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(dup.status().message(),
            "name: 'fsdp8-worker-0' is registered by a live worker (host 127.0.0.1, pid 100); "
            "retry once it is gone");

  // The same process again (its stream dropped before the coordinator noticed): taken over, and
  // the old session is no longer the worker's.
  auto again = reg.Register(a);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->worker_id(), "fsdp8-worker-0");
  EXPECT_FALSE(reg.Send("fsdp8-worker-0", v1::CoordinatorMessage()));

  // Another process once the first is gone: the same id, still drained, listed once.
  auto succ = reg.Register(other);
  ASSERT_TRUE(succ.ok()) << succ.status();
  EXPECT_EQ(succ->worker_id(), "fsdp8-worker-0");
  ASSERT_TRUE(reg.AttachSession("fsdp8-worker-0", std::make_shared<NullSink>()).ok());
  auto list = reg.List();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].state(), v1::WORKER_STATE_DRAINED);
  EXPECT_TRUE(reg.FreeWorkers("cpu").empty());

  // An unnamed worker next to it gets a generated id.
  auto anon = reg.Register(CpuWorkerRegistration());
  ASSERT_TRUE(anon.ok());
  EXPECT_EQ(anon->worker_id().rfind("w-", 0), 0u) << anon->worker_id();
  EXPECT_NE(anon->worker_id(), "fsdp8-worker-0");

  const std::pair<std::string, std::string> bad[] = {
      {std::string(64, 'a'), "name: 64 characters; at most 63 are allowed"},
      {"pod/0", "name: 'pod/0' has a character other than A-Z, a-z, 0-9, '.', '_' and '-'"},
      {"w-12", "name: 'w-12' has the form w-<digits>, which is kept for unnamed workers"}};
  for (const auto& [name, message] : bad) {
    v1::RegisterRequest b = CpuWorkerRegistration();
    b.set_name(name);
    auto r = reg.Register(b);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_EQ(r.status().message(), message);
  }
  v1::RegisterRequest ok = CpuWorkerRegistration();
  ok.set_name(std::string(63, 'a'));
  EXPECT_TRUE(reg.Register(ok).ok());
  ok.set_name("w-x1");  // not w-<digits>
  EXPECT_TRUE(reg.Register(ok).ok());
  EXPECT_EQ(reg.List().size(), 4u);
}

// Placement domains: CPU workers on different loopback addresses are different hosts; a named
// NVLink island is a domain of its host only (the same name on another host is another domain).
// A sink that keeps what it is sent.
class RecordingSink : public SessionSink {
 public:
  bool Send(const v1::CoordinatorMessage& m) override {
    sent.push_back(m);
    return true;
  }
  void Close() override {}
  std::vector<v1::CoordinatorMessage> sent;
};

// A worker that registers holding a job (RegisterRequest.held_job) is listed BUSY and never
// assignable; Adopt takes only workers holding that job and makes them its ranks; DropHeld sends
// Abort with the reason and frees the worker after the grace; a registration without a held job
// clears an earlier report.
TEST(WorkerRegistry, HeldJobsAreAdoptedOrDropped) {
  WorkerRegistry reg({"1.2.3"});
  auto held_req = [](const std::string& name, int rank) {
    v1::RegisterRequest r = CpuWorkerRegistration("1.2.3");
    r.set_name(name);
    v1::HeldJob* h = r.mutable_held_job();
    h->set_job_id("job-1");
    h->set_generation(3);
    h->set_rank(rank);
    h->set_world_size(2);
    h->set_steps_completed(7);
    h->set_intact(true);
    return r;
  };
  std::map<std::string, std::shared_ptr<RecordingSink>> sinks;
  for (const auto& [name, rank] : std::vector<std::pair<std::string, int>>{{"a", 0}, {"b", 1}}) {
    ASSERT_TRUE(reg.Register(held_req(name, rank)).ok());
    sinks[name] = std::make_shared<RecordingSink>();
    ASSERT_TRUE(reg.AttachSession(name, sinks[name]).ok());
  }
  v1::RegisterRequest plain = CpuWorkerRegistration("1.2.3");
  plain.set_name("c");
  ASSERT_TRUE(reg.Register(plain).ok());
  ASSERT_TRUE(reg.AttachSession("c", std::make_shared<NullSink>()).ok());
  EXPECT_EQ(reg.FreeWorkers("cpu"), std::vector<std::string>{"c"});
  for (const auto& w : reg.List())
    EXPECT_EQ(w.state(), w.worker_id() == "c" ? v1::WORKER_STATE_IDLE : v1::WORKER_STATE_BUSY)
        << w.worker_id();
  const auto held = reg.HeldJobs();
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held.at("b").rank(), 1);
  EXPECT_EQ(held.at("b").steps_completed(), 7);
  // Only workers that hold the job: "c" holds none, nothing changes.
  EXPECT_EQ(reg.Adopt({"a", "c"}, "job-1", nullptr).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg.Adopt({"a"}, "job-2", nullptr).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg.HeldJobs().size(), 2u);
  ASSERT_TRUE(reg.Adopt({"a"}, "job-1", nullptr).ok());
  for (const auto& w : reg.List()) {
    if (w.worker_id() != "a") continue;
    EXPECT_EQ(w.job_id(), "job-1");
    EXPECT_EQ(w.rank(), 0);
  }
  EXPECT_EQ(reg.HeldJobs().count("a"), 0u);
  // "b" is told to drop it; after the grace it is free.
  EXPECT_TRUE(reg.DropHeld("b", "job job-1 is not re-adopted", std::chrono::milliseconds(100)));
  EXPECT_FALSE(reg.DropHeld("b", "again", std::chrono::milliseconds(0)));
  ASSERT_EQ(sinks["b"]->sent.size(), 1u);
  EXPECT_EQ(sinks["b"]->sent[0].abort().reason(), "job job-1 is not re-adopted");
  EXPECT_EQ(reg.FreeWorkers("cpu"), std::vector<std::string>{"c"});
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_EQ(reg.FreeWorkers("cpu"), (std::vector<std::string>{"b", "c"}));
  // A worker registering again without a held job clears its report.
  ASSERT_TRUE(reg.Register(held_req("c", 0)).ok());
  EXPECT_EQ(reg.HeldJobs().count("c"), 0u) << "no session attached again yet";
  ASSERT_TRUE(reg.AttachSession("c", std::make_shared<NullSink>()).ok());
  EXPECT_EQ(reg.HeldJobs().count("c"), 1u);
  ASSERT_TRUE(reg.Register(plain).ok());
  EXPECT_EQ(reg.HeldJobs().count("c"), 0u);
}

// Adopt with the reports it decided on adopts the workers only while each still reports that very
// rank: the same job, generation, rank, world size and replicas (a worker that registered again
// with another report in between is not adopted, and nothing changes).
TEST(WorkerRegistry, AdoptChecksTheWholeHeldReport) {
  WorkerRegistry reg({"1.2.3"});
  auto report = [](int rank) {
    v1::HeldJob h;
    h.set_job_id("job-1");
    h.set_generation(3);
    h.set_rank(rank);
    h.set_world_size(2);
    h.set_replicas(1);
    h.set_steps_completed(7);
    h.set_steps_received(7);
    h.set_intact(true);
    return h;
  };
  for (const auto& [name, rank] : std::vector<std::pair<std::string, int>>{{"a", 0}, {"b", 1}}) {
    v1::RegisterRequest r = CpuWorkerRegistration("1.2.3");
    r.set_name(name);
    *r.mutable_held_job() = report(rank);
    ASSERT_TRUE(reg.Register(r).ok());
    ASSERT_TRUE(reg.AttachSession(name, std::make_shared<NullSink>()).ok());
  }
  const std::vector<std::string> ids{"a", "b"};
  const std::vector<v1::HeldJob> right{report(0), report(1)};
  auto changed = [&](const std::function<void(std::vector<v1::HeldJob>*)>& edit) {
    std::vector<v1::HeldJob> e = right;
    edit(&e);
    return e;
  };
  const std::vector<std::vector<v1::HeldJob>> wrong{
      changed([](auto* e) { (*e)[1].set_generation(4); }),
      changed([](auto* e) { (*e)[1].set_job_id("job-2"); }),
      changed([](auto* e) { std::swap((*e)[0], (*e)[1]); }),  // ranks crossed
      changed([](auto* e) { (*e)[0].set_world_size(3); }),
      changed([](auto* e) { (*e)[0].set_replicas(2); }),
      changed([](auto* e) { e->pop_back(); }),  // fewer reports than workers
  };
  for (size_t i = 0; i < wrong.size(); ++i) {
    EXPECT_EQ(reg.Adopt(ids, wrong[i], nullptr).code(), absl::StatusCode::kFailedPrecondition)
        << "case " << i;
    EXPECT_EQ(reg.HeldJobs().size(), 2u) << "case " << i << ": nothing changes";
  }
  // Worker "b" registers again holding generation 4: the reports decided on no longer hold.
  v1::RegisterRequest again = CpuWorkerRegistration("1.2.3");
  again.set_name("b");
  *again.mutable_held_job() = report(1);
  again.mutable_held_job()->set_generation(4);
  ASSERT_TRUE(reg.Register(again).ok());
  ASSERT_TRUE(reg.AttachSession("b", std::make_shared<NullSink>()).ok());
  EXPECT_EQ(reg.Adopt(ids, right, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  *again.mutable_held_job() = report(1);
  ASSERT_TRUE(reg.Register(again).ok());
  ASSERT_TRUE(reg.AttachSession("b", std::make_shared<NullSink>()).ok());
  ASSERT_TRUE(reg.Adopt(ids, right, nullptr).ok());
  EXPECT_TRUE(reg.HeldJobs().empty());
  for (const auto& w : reg.List()) {
    EXPECT_EQ(w.job_id(), "job-1") << w.worker_id();
    EXPECT_EQ(w.rank(), w.worker_id() == "a" ? 0 : 1);
  }
}

TEST(WorkerRegistry, PlacementDomainsAreHostsOrTheirNamedIslands) {
  WorkerRegistry reg({"1.2.3"});
  std::vector<std::string> ids;
  for (auto [host, island] : std::vector<std::pair<std::string, std::string>>{
           {"127.0.0.1", ""}, {"127.0.0.2", ""}, {"10.0.0.5", "nvl1"}, {"10.0.0.6", "nvl1"}}) {
    v1::RegisterRequest req = CpuWorkerRegistration();
    req.set_host(host);
    req.set_placement_domain(island);
    auto r = reg.Register(req);
    ASSERT_TRUE(r.ok()) << r.status();
    ids.push_back(r->worker_id());
  }
  const std::map<std::string, std::string> d = reg.WorkerDomains("cpu");
  ASSERT_EQ(d.size(), 4u);
  EXPECT_EQ(d.at(ids[0]), "127.0.0.1");
  EXPECT_EQ(d.at(ids[1]), "127.0.0.2");
  EXPECT_EQ(d.at(ids[2]), "10.0.0.5/nvl1");
  EXPECT_EQ(d.at(ids[3]), "10.0.0.6/nvl1");
  EXPECT_TRUE(reg.WorkerDomains("cuda").empty());
  EXPECT_EQ(reg.List()[2].placement_domain(), "nvl1");
}

}  // namespace
}  // namespace fsdp8::coord
