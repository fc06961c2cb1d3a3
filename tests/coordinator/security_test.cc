// Security and operator RPCs of the coordinator: the tokens file, authentication and roles over
// real gRPC (UNAUTHENTICATED / PERMISSION_DENIED, a submitter confined to its own jobs, the worker
// channel), TLS and mutual TLS with certificates made at test time, message size limits, the drain
// (health NOT_SERVING), DrainWorker, SetLogLevel, the per-rank shard plan, the scaling summary and
// GetJob events.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "client/client.h"
#include "coordinator/auth.h"
#include "coordinator/log.h"
#include "coordinator/services.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "gtest/gtest.h"
#include "tests/coordinator/certs.h"
#include "tests/coordinator/test_util.h"

namespace fsdp8::coord {
namespace {

using fsdp8::testing::SmallSpec;
using fsdp8::testing::TempDir;
using fsdp8::testing::WaitFor;
using fsdp8::testing::WriteTokens;
using namespace std::chrono_literals;

// Tokens of the tests (>= 16 characters).
constexpr char kAlice[] = "alice-submitter-token-0001";
constexpr char kBob[] = "bob-submitter-token-000002";
constexpr char kAdmin[] = "root-admin-token-000000003";
constexpr char kWorker[] = "worker-pool-token-00000004";

// ---------------- the tokens file ----------------

TEST(TokenTable, ParsesLinesCommentsAndRoles) {
  auto t = TokenTable::Parse(
      "# token role user\n\n  alice-submitter-token-0001 submitter alice\n"
      "root-admin-token-000000003\tadmin\troot  \n",
      "tokens");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), 2u);
  auto a = t->Find(kAlice);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->user, "alice");
  EXPECT_EQ(a->role, Role::kSubmitter);
  auto r = t->Find(kAdmin);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->user, "root");
  EXPECT_EQ(r->role, Role::kAdmin);
  EXPECT_FALSE(t->Find("alice-submitter-token-000").has_value());  // a prefix is not the token
  EXPECT_FALSE(t->Find("").has_value());
}

TEST(TokenTable, RefusesMalformedLinesNamingTheLine) {
  struct Case {
    const char* text;
    const char* message;
  } cases[] = {
      {"alice-submitter-token-0001 submitter\n", "tokens line 1: must be \"TOKEN ROLE USER\" (got 2 fields)"},
      {"# c\nshort submitter alice\n", "tokens line 2: token must be at least 16 characters (got 5)"},
      {"alice-submitter-token-0001 owner alice\n",
       "tokens line 1: role must be submitter, admin or worker (got \"owner\")"},
      {"alice-submitter-token-0001 submitter alice\nalice-submitter-token-0001 admin eve\n",
       "tokens line 2: duplicate token (also given to user alice)"},
  };
  for (const Case& c : cases) {
    auto t = TokenTable::Parse(c.text, "tokens");
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_EQ(t.status().message(), c.message);
  }
}

TEST(TokenTable, LoadsAMountedKubernetesSecretDirectory) {
  // The layout the kubelet writes: keys are symlinks into ..data, which links to a timestamped
  // directory; the dot entries must not be read twice.
  TempDir dir;
  namespace fs = std::filesystem;
  fs::create_directory(dir.File("..2024_01_01"));
  std::ofstream(dir.File("..2024_01_01/submitters")) << kAlice << " submitter alice\n";
  std::ofstream(dir.File("..2024_01_01/admins")) << kAdmin << " admin root\n";
  fs::create_directory_symlink("..2024_01_01", dir.File("..data"));
  fs::create_symlink("..data/submitters", dir.File("submitters"));
  fs::create_symlink("..data/admins", dir.File("admins"));
  auto t = TokenTable::Load(dir.path());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), 2u);
  EXPECT_EQ(t->Find(kAdmin)->user, "root");
  EXPECT_EQ(t->Find(kAlice)->user, "alice");

  TempDir empty;
  EXPECT_EQ(TokenTable::Load(empty.path()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TokenTable::Load(empty.File("missing")).status().code(), absl::StatusCode::kNotFound);
}

// ---------------- over gRPC ----------------

// The health status of `service` ("" = the server), or -1 when the call fails.
int HealthStatus(const std::shared_ptr<grpc::Channel>& ch, const std::string& service) {
  grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check",
                                   grpc::internal::RpcMethod::NORMAL_RPC);
  // HealthCheckRequest{service = 1}: tag 0x0a, length, bytes (names here are < 128 bytes).
  std::string req_bytes;
  if (!service.empty()) req_bytes = std::string("\x0a", 1) + static_cast<char>(service.size()) + service;
  grpc::Slice slice(req_bytes);
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      ch.get(), method, &ctx, req, &resp);
  if (!s.ok()) return -1;
  std::vector<grpc::Slice> slices;
  if (!resp.Dump(&slices).ok()) return -1;
  std::string b;
  for (const auto& sl : slices) b.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  // HealthCheckResponse{status = 1}: 08 <status>; an empty message is status 0 (UNKNOWN).
  return b.size() == 2 && b[0] == 0x08 ? b[1] : b.empty() ? 0 : -1;
}

class SecureTest : public ::testing::Test {
 protected:
  void StartServer(CoordinatorOptions o) {
    train_ = WriteTokens(dir_, "train.bin");
    o.listen = "127.0.0.1:0";
    o.jobs.data_roots = {dir_.path()};
    o.scheduler.tick = 20ms;
    auto s = CoordinatorServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }
  std::string WriteTokensFile() {
    std::ofstream(dir_.File("tokens")) << "# test tokens\n"
                                       << kAlice << " submitter alice\n"
                                       << kBob << " submitter bob\n"
                                       << kAdmin << " admin root\n"
                                       << kWorker << " worker pool\n";
    return dir_.File("tokens");
  }
  std::unique_ptr<Client> Connect(const std::string& token, ChannelSecurity sec = {},
                                  const std::string& host = "127.0.0.1") {
    sec.token = token;
    auto c = Client::Connect(host + ":" + std::to_string(server_->port()), sec);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }
  TempDir dir_;
  std::string train_;
  std::unique_ptr<CoordinatorServer> server_;
};

TEST_F(SecureTest, TokensAuthenticateAndRolesAuthorize) {
  CoordinatorOptions o;
  o.tokens = WriteTokensFile();
  StartServer(o);
  auto anon = Connect("");
  auto wrong = Connect("not-a-known-token-at-all");
  auto alice = Connect(kAlice);
  auto bob = Connect(kBob);
  auto root = Connect(kAdmin);
  auto worker = Connect(kWorker);

  // No token, or an unknown one: UNAUTHENTICATED everywhere (not only on the admin service).
  EXPECT_EQ(anon->ListJobs().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anon->Submit(SmallSpec(train_)).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong->ListJobs().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anon->ListWorkers().status().code(), absl::StatusCode::kUnauthenticated);
  // A submitter is not an admin; a worker token is not a submitter.
  auto denied = alice->ListWorkers().status();
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(denied.message(), "user alice (role submitter) may not call AdminService/ListWorkers");
  EXPECT_EQ(alice->SetLogLevel("debug").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(alice->DrainWorker("w-1").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(worker->Submit(SmallSpec(train_)).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(worker->ListJobs().status().code(), absl::StatusCode::kPermissionDenied);

  // A submitter sees and cancels only its own jobs.
  auto a1 = alice->Submit(SmallSpec(train_), "alice-req");
  ASSERT_TRUE(a1.ok()) << a1.status();
  EXPECT_EQ(a1->owner(), "alice");
  auto b1 = bob->Submit(SmallSpec(train_));
  ASSERT_TRUE(b1.ok()) << b1.status();
  EXPECT_EQ(b1->owner(), "bob");
  EXPECT_EQ(bob->GetJob(a1->job_id()).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(bob->Cancel(a1->job_id()).status().code(), absl::StatusCode::kPermissionDenied);
  auto watch = bob->Watch(a1->job_id(), 0, [](const v1::JobEvent&) { return true; }, 0);
  EXPECT_EQ(watch.status().code(), absl::StatusCode::kPermissionDenied);
  // Bob's refused cancel changed nothing.
  auto still = alice->GetJob(a1->job_id());
  ASSERT_TRUE(still.ok());
  EXPECT_EQ(still->state(), v1::JOB_STATE_PENDING);
  // Reusing another user's request_id neither returns nor reveals that job.
  auto reuse = bob->Submit(SmallSpec(train_), "alice-req");
  EXPECT_EQ(reuse.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(absl::StrContains(reuse.status().message(), a1->job_id()));
  auto bob_list = bob->ListJobs();
  ASSERT_TRUE(bob_list.ok());
  ASSERT_EQ(bob_list->size(), 1u);
  EXPECT_EQ((*bob_list)[0].job_id(), b1->job_id());
  // The admin sees both and may cancel anyone's job.
  auto all = root->ListJobs();
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 2u);
  auto cancelled = root->Cancel(a1->job_id());
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
  auto own = bob->Cancel(b1->job_id());
  ASSERT_TRUE(own.ok()) << own.status();
  // Deleting an ended job: its owner or an admin, nobody else.
  EXPECT_EQ(bob->Delete(a1->job_id()).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(worker->Delete(b1->job_id()).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(alice->Delete(a1->job_id()).ok());
  EXPECT_TRUE(root->Delete(b1->job_id()).ok());
  EXPECT_EQ(root->ListJobs()->size(), 0u);

  // The worker control channel: no token UNAUTHENTICATED, a submitter PERMISSION_DENIED, the
  // worker token registers.
  v1::RegisterRequest reg;
  reg.set_version(FSDP8_VERSION);
  reg.set_host("127.0.0.1");
  reg.set_backend("cpu");
  auto register_with = [&](const std::string& token) {
    ChannelSecurity sec;
    sec.token = token;
    auto ch = MakeChannel(server_->address(), sec);
    EXPECT_TRUE(ch.ok());
    auto stub = v1::WorkerControl::NewStub(*ch);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 5s);
    v1::RegisterResponse resp;
    return stub->Register(&ctx, reg, &resp).error_code();
  };
  EXPECT_EQ(register_with(""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(register_with(kAlice), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(register_with(kWorker), grpc::StatusCode::OK);
  // Health needs no token (probes cannot send one).
  auto plain = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(plain, ""), 1);
  EXPECT_EQ(HealthStatus(plain, "fsdp8.v1.JobService"), 1);
}

TEST_F(SecureTest, StartRefusesABadTokensFile) {
  std::ofstream(dir_.File("bad-tokens")) << "tooshort admin root\n";
  CoordinatorOptions o;
  o.listen = "127.0.0.1:0";
  o.tokens = dir_.File("bad-tokens");
  auto s = CoordinatorServer::Start(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.status().message(), "line 1: token must be at least 16"))
      << s.status();
  o.tokens.clear();
  o.tls_cert = dir_.File("missing.crt");
  EXPECT_EQ(CoordinatorServer::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.tls_key = dir_.File("missing.key");
  EXPECT_EQ(CoordinatorServer::Start(o).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SecureTest, TlsAndMutualTls) {
  testing::TestCerts certs;
  ASSERT_TRUE(testing::MakeTestCerts(dir_.path(), &certs));
  CoordinatorOptions o;
  o.tls_cert = certs.server_cert;
  o.tls_key = certs.server_key;
  StartServer(o);
  ChannelSecurity tls;
  tls.tls_ca = certs.ca;
  auto ok = Connect("", tls, "localhost");
  auto jobs = ok->ListJobs();
  EXPECT_TRUE(jobs.ok()) << jobs.status();
  // A plaintext client, or one that trusts another CA, never gets an answer.
  EXPECT_EQ(Connect("", {}, "localhost")->ListJobs().status().code(), absl::StatusCode::kUnavailable);
  ChannelSecurity other;
  other.tls_ca = certs.other_ca;
  EXPECT_EQ(Connect("", other, "localhost")->ListJobs().status().code(),
            absl::StatusCode::kUnavailable);
  server_->Shutdown();
  server_.reset();

  // Mutual TLS: a client certificate from the configured CA is required.
  o.tls_client_ca = certs.ca;
  StartServer(o);
  EXPECT_EQ(Connect("", tls, "localhost")->ListJobs().status().code(),
            absl::StatusCode::kUnavailable);
  ChannelSecurity rogue = tls;
  rogue.tls_cert = certs.other_client_cert;
  rogue.tls_key = certs.other_client_key;
  EXPECT_EQ(Connect("", rogue, "localhost")->ListJobs().status().code(),
            absl::StatusCode::kUnavailable);
  ChannelSecurity mtls = tls;
  mtls.tls_cert = certs.client_cert;
  mtls.tls_key = certs.client_key;
  auto good = Connect("", mtls, "localhost")->ListJobs();
  EXPECT_TRUE(good.ok()) << good.status();
}

TEST_F(SecureTest, MessageSizeLimit) {
  CoordinatorOptions o;
  o.max_message_bytes = 64 << 10;
  StartServer(o);
  auto c = Connect("");
  v1::JobSpec spec = SmallSpec(train_);
  spec.set_name(std::string(100 << 10, 'x'));  // a 100 KiB request
  EXPECT_EQ(c->Submit(spec).status().code(), absl::StatusCode::kResourceExhausted);
  spec.set_name("small");
  EXPECT_TRUE(c->Submit(spec).ok());
}

TEST_F(SecureTest, DrainTurnsHealthNotServingAndRefusesSubmissions) {
  StartServer({});
  auto plain = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  for (const char* s : {"", "fsdp8.v1.JobService", "fsdp8.v1.AdminService", "fsdp8.v1.WorkerControl"})
    EXPECT_EQ(HealthStatus(plain, s), 1) << s;  // SERVING
  auto c = Connect("");
  auto job = c->Submit(SmallSpec(train_));
  ASSERT_TRUE(job.ok());
  auto report = server_->Drain(1s);
  EXPECT_TRUE(report.empty());  // nothing RUNNING
  for (const char* s : {"", "fsdp8.v1.JobService", "fsdp8.v1.AdminService", "fsdp8.v1.WorkerControl"})
    EXPECT_EQ(HealthStatus(plain, s), 2) << s;  // NOT_SERVING
  auto refused = c->Submit(SmallSpec(train_));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  // Reads still work while draining.
  auto again = c->GetJob(job->job_id());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->state(), v1::JOB_STATE_PENDING);
}

// ---------------- admin RPCs ----------------

TEST_F(SecureTest, DrainWorkerAndSetLogLevel) {
  StartServer({});
  auto c = Connect("");
  EXPECT_EQ(c->DrainWorker("w-404").status().code(), absl::StatusCode::kNotFound);
  v1::RegisterRequest reg;
  reg.set_version(FSDP8_VERSION);
  reg.set_host("10.0.0.7");
  reg.set_backend("cpu");
  reg.set_device(3);
  reg.set_memory_bytes(int64_t{80} << 30);
  auto w = server_->workers()->Register(reg);
  ASSERT_TRUE(w.ok());
  auto ws = c->ListWorkers();
  ASSERT_TRUE(ws.ok());
  ASSERT_EQ(ws->size(), 1u);
  EXPECT_EQ((*ws)[0].host(), "10.0.0.7");
  EXPECT_EQ((*ws)[0].device(), 3);
  EXPECT_EQ((*ws)[0].memory_bytes(), int64_t{80} << 30);
  EXPECT_EQ((*ws)[0].rank(), -1);
  EXPECT_GT((*ws)[0].last_heartbeat(), 0);
  EXPECT_EQ((*ws)[0].state(), v1::WORKER_STATE_UNHEALTHY);  // registered, no session yet
  auto d = c->DrainWorker(w->worker_id());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->draining());
  auto u = c->DrainWorker(w->worker_id(), /*undo=*/true);
  ASSERT_TRUE(u.ok());
  EXPECT_FALSE(u->draining());

  auto prev = c->SetLogLevel("debug");
  ASSERT_TRUE(prev.ok()) << prev.status();
  EXPECT_EQ(*prev, "info");
  EXPECT_EQ(GetLogLevel(), LogLevel::kDebug);
  auto bad = c->SetLogLevel("verbose");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "level: must be error, warning, info or debug (got \"verbose\")");
  ASSERT_TRUE(c->SetLogLevel("info").ok());
}

// A Session that records what it is sent.
class FakeSink : public SessionSink {
 public:
  bool Send(const v1::CoordinatorMessage&) override { return true; }
  void Close() override {}
};

TEST(WorkerDrain, DrainedWorkerFinishesItsJobThenGetsNoWork) {
  WorkerRegistry reg({FSDP8_VERSION, 5000ms, 1000});
  v1::RegisterRequest r;
  r.set_version(FSDP8_VERSION);
  r.set_host("127.0.0.1");
  r.set_backend("cpu");
  auto a = reg.Register(r);
  auto b = reg.Register(r);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(reg.AttachSession(a->worker_id(), std::make_shared<FakeSink>()).ok());
  ASSERT_TRUE(reg.AttachSession(b->worker_id(), std::make_shared<FakeSink>()).ok());
  ASSERT_TRUE(reg.Assign({a->worker_id()}, "job-1", [](const WorkerEvent&) {}).ok());
  auto d = reg.Drain(a->worker_id(), false);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->state(), v1::WORKER_STATE_DRAINING);  // still rank 0 of job-1
  EXPECT_EQ(d->job_id(), "job-1");
  EXPECT_EQ(reg.FreeWorkers("cpu"), std::vector<std::string>{b->worker_id()});
  reg.Release("job-1");
  auto list = reg.List();
  EXPECT_EQ(list[0].state(), v1::WORKER_STATE_DRAINED);
  EXPECT_EQ(list[1].state(), v1::WORKER_STATE_IDLE);
  EXPECT_EQ(reg.FreeWorkers("cpu"), std::vector<std::string>{b->worker_id()});
  EXPECT_FALSE(reg.Assign({a->worker_id()}, "job-2", [](const WorkerEvent&) {}).ok());
  ASSERT_TRUE(reg.Drain(a->worker_id(), true).ok());
  EXPECT_EQ(reg.FreeWorkers("cpu").size(), 2u);
  // The whole-coordinator drain: nobody is assignable.
  reg.SetAssigning(false);
  EXPECT_TRUE(reg.FreeWorkers("cpu").empty());
}

TEST_F(SecureTest, ShardPlanPerRankOffsetsPaddingAndBytes) {
  StartServer({});
  auto c = Connect("");
  // d_model 32, 1 layer, 2 heads (kv heads 2), ffn 64; FP8 linears, alignment 16, world size 3.
  v1::JobSpec spec = SmallSpec(train_);
  spec.mutable_training()->set_global_batch(6);  // divisible by world size 3
  auto plan = c->GetShardPlan("", spec, 3);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const v1::FsdpUnit* layer = nullptr;
  for (const auto& u : plan->units())
    if (u.name() == "layers.0") layer = &u;
  ASSERT_NE(layer, nullptr);
  // By hand. FP8 buffer: q, k, v, o 32*32 = 1024 each, gate, up, down 64*32 = 2048 each: 10240
  // elements, padded to a multiple of 3 * 16 = 48: 10272, shards of 3424; rank 2 holds
  // [6848, 10272) of which 10272 - 10240 = 32 are padding. 1 byte per element.
  // BF16 buffer: the two norms, 2 * 32 = 64 elements, padded to 96, shards of 32; rank 2 holds
  // [64, 96): all padding. 2 bytes per element.
  struct Want {
    std::string wire;
    int eb;
    int64_t shard;
    int64_t padding[3];
  } wants[] = {{"fp8", 1, 3424, {0, 0, 32}}, {"bf16", 2, 32, {0, 0, 32}}};
  for (const Want& w : wants) {
    const v1::FlatBuffer* buf = nullptr;
    for (const auto& b : layer->buffers())
      if (b.wire_dtype() == w.wire) buf = &b;
    ASSERT_NE(buf, nullptr) << w.wire;
    EXPECT_EQ(buf->element_bytes(), w.eb);
    ASSERT_EQ(buf->ranks_size(), 3);
    for (int r = 0; r < 3; ++r) {
      const v1::RankShard& s = buf->ranks(r);
      EXPECT_EQ(s.rank(), r);
      EXPECT_EQ(s.offset(), r * w.shard) << w.wire << " rank " << r;
      EXPECT_EQ(s.numel(), w.shard);
      EXPECT_EQ(s.padding(), w.padding[r]) << w.wire << " rank " << r;
      EXPECT_EQ(s.offset_bytes(), r * w.shard * w.eb);
      EXPECT_EQ(s.bytes(), w.shard * w.eb);
      EXPECT_EQ(s.padding_bytes(), w.padding[r] * w.eb);
    }
  }
}

TEST_F(SecureTest, ScalingSummaryAndJobEvents) {
  StartServer({});
  auto c = Connect("");
  auto job = c->Submit(SmallSpec(train_));
  ASSERT_TRUE(job.ok());
  v1::ScalingState st;
  st.set_job_id(job->job_id());
  st.set_step(7);
  v1::TensorScaling* t = st.add_tensors();
  t->set_name("layers.0.attn.q_proj.x");
  t->set_format("E4M3");
  t->set_scale(2.0f);
  t->set_scale_inv(0.5f);
  for (float a : {3.0f, 9.5f, 1.0f}) t->add_amax_history(a);
  server_->jobs()->SetScalingState(job->job_id(), st);
  auto full = c->GetScalingState(job->job_id());
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_EQ(full->tensors_size(), 1);
  EXPECT_EQ(full->tensors(0).amax_history_size(), 3);
  EXPECT_EQ(full->tensors(0).amax_history_len(), 3);
  EXPECT_EQ(full->tensors(0).amax_latest(), 3.0f);
  EXPECT_EQ(full->tensors(0).amax_max(), 9.5f);
  EXPECT_EQ(full->tensors(0).format(), "E4M3");
  EXPECT_EQ(full->tensors(0).scale(), 2.0f);

  auto plain = c->GetJob(job->job_id());
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->events_size(), 0);
  ASSERT_TRUE(c->Cancel(job->job_id()).ok());
  // Events: "submitted; ..." first, maybe a pending-reason update, the cancellation last.
  auto with = c->GetJob(job->job_id(), 100);
  ASSERT_TRUE(with.ok());
  const int n = with->events_size();
  ASSERT_GE(n, 2);
  for (int i = 0; i < n; ++i) EXPECT_EQ(with->events(i).seq(), i + 1);
  EXPECT_TRUE(absl::StartsWith(with->events(0).message(), "submitted")) << with->events(0).message();
  EXPECT_EQ(with->events(n - 1).state(), v1::JOB_STATE_CANCELLED);
  auto last = c->GetJob(job->job_id(), 1);
  ASSERT_TRUE(last.ok());
  ASSERT_EQ(last->events_size(), 1);
  EXPECT_EQ(last->events(0).seq(), n);
  EXPECT_EQ(last->events(0).state(), v1::JOB_STATE_CANCELLED);
}

}  // namespace
}  // namespace fsdp8::coord
