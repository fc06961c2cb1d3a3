// The coordinator over real gRPC, in process on a free port: status codes through the stubs, the
// health service, and one job driven end to end by a worker speaking the Session protocol.
#include <cmath>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "client/client.h"
#include "coordinator/checkpoint_store.h"
#include "coordinator/services.h"
#include "fsdp8/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "gtest/gtest.h"
#include "tests/coordinator/test_util.h"

namespace fsdp8::coord {
namespace {

using fsdp8::testing::SmallSpec;
using fsdp8::testing::TempDir;
using fsdp8::testing::WaitFor;
using fsdp8::testing::WriteTokens;
using namespace std::chrono_literals;

class GrpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    train_ = WriteTokens(dir_, "train.bin");
    CoordinatorOptions o;
    o.listen = "127.0.0.1:0";
    o.jobs.data_roots = {dir_.path()};
    o.scheduler.tick = 20ms;
    o.scheduler.start_timeout = 5s;
    o.scheduler.step_timeout = 5s;
    auto s = CoordinatorServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    ASSERT_GT(server_->port(), 0);
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }
  TempDir dir_;
  std::string train_;
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(GrpcTest, SubmitBadSpecIsInvalidArgument) {
  auto stub = v1::JobService::NewStub(channel_);
  grpc::ClientContext ctx;
  v1::SubmitJobRequest req;
  *req.mutable_spec() = SmallSpec(train_);
  req.mutable_spec()->mutable_model()->set_d_model(33);
  v1::Job job;
  grpc::Status s = stub->SubmitJob(&ctx, req, &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "model.d_model")) << s.error_message();
  grpc::ClientContext ctx2;
  v1::GetJobRequest get;
  get.set_job_id("job-missing");
  EXPECT_EQ(stub->GetJob(&ctx2, get, &job).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(GrpcTest, HealthCheckIsServing) {
  // grpc.health.v1.Health/Check with an empty HealthCheckRequest; the response's field 1 (status)
  // is SERVING = 1, i.e. the bytes 08 01.
  grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check",
                                   grpc::internal::RpcMethod::NORMAL_RPC);
  grpc::Slice empty("");
  grpc::ByteBuffer req(&empty, 1), resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel_.get(), method, &ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(resp.Dump(&slices).ok());
  std::string bytes;
  for (const auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
}

TEST_F(GrpcTest, RegisterVersionMismatchAndKvTimeout) {
  auto stub = v1::WorkerControl::NewStub(channel_);
  {
    grpc::ClientContext ctx;
    v1::RegisterRequest req;
    req.set_version("0.0.0-other");
    req.set_host("127.0.0.1");
    v1::RegisterResponse resp;
    grpc::Status s = stub->Register(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(s.error_message(),
              std::string("worker version 0.0.0-other != coordinator version ") + FSDP8_VERSION);
  }
  {
    grpc::ClientContext ctx;
    v1::KvGetRequest req;
    req.set_key("job/x/gen/1/rank0");
    req.set_timeout_ms(100);
    v1::KvGetResponse resp;
    grpc::Status s = stub->KvGet(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_TRUE(absl::StrContains(s.error_message(), "job/x/gen/1/rank0"));
  }
  {
    grpc::ClientContext c1, c2;
    v1::KvSetRequest set;
    set.set_key("k");
    set.set_value("v");
    v1::KvSetResponse sr;
    ASSERT_TRUE(stub->KvSet(&c1, set, &sr).ok());
    v1::KvGetRequest get;
    get.set_key("k");
    v1::KvGetResponse gr;
    ASSERT_TRUE(stub->KvGet(&c2, get, &gr).ok());
    EXPECT_EQ(gr.value(), "v");
  }
}

TEST_F(GrpcTest, KvGetEndsWhenTheClientCancels) {
  auto stub = v1::WorkerControl::NewStub(channel_);
  grpc::ClientContext ctx;
  grpc::Status s;
  std::thread t([&] {
    v1::KvGetRequest req;
    req.set_key("job/x/gen/1/never");
    req.set_timeout_ms(600000);
    v1::KvGetResponse resp;
    s = stub->KvGet(&ctx, req, &resp);
  });
  ASSERT_TRUE(WaitFor([&] { return server_->kv()->waiting() == 1; }, 5));
  ctx.TryCancel();
  t.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED);
  // The server side must let go too rather than hold its thread for the 10-minute timeout.
  EXPECT_TRUE(WaitFor([&] { return server_->kv()->waiting() == 0; }, 5));
}

// A job the registered workers cannot hold is refused at submit, before any worker allocates.
TEST_F(GrpcTest, SubmitRefusesAJobNoRegisteredWorkerCanHold) {
  auto stub = v1::WorkerControl::NewStub(channel_);
  grpc::ClientContext rctx;
  v1::RegisterRequest rreq;
  rreq.set_version(FSDP8_VERSION);
  rreq.set_host("127.0.0.1");
  rreq.set_backend("cpu");
  rreq.set_memory_bytes(int64_t{64} << 30);
  v1::RegisterResponse rresp;
  ASSERT_TRUE(stub->Register(&rctx, rreq, &rresp).ok());
  auto client = fsdp8::Client::Connect(server_->address());
  ASSERT_TRUE(client.ok());
  v1::JobSpec spec = SmallSpec(train_);
  spec.mutable_model()->set_n_layers(1000000);
  auto job = (*client)->Submit(spec);
  EXPECT_EQ(job.status().code(), absl::StatusCode::kResourceExhausted) << job.status();
  EXPECT_TRUE(absl::StrContains(job.status().message(), "68719476736 bytes")) << job.status();
  auto fits = (*client)->Submit(SmallSpec(train_));
  EXPECT_TRUE(fits.ok()) << fits.status();
}

// GetShardPlan names the mesh it planned: replicas, shard group size, optimizer sharding and the
// optimizer's shards (the checkpoint's files), in the plan and in its memory plan; auto is
// planned at the request's replicas; a replica count that does not divide the world is refused
// naming sharding.replicas.
TEST_F(GrpcTest, ShardPlanShowsTheMesh) {
  auto client = fsdp8::Client::Connect(server_->address());
  ASSERT_TRUE(client.ok());
  v1::JobSpec spec = SmallSpec(train_);
  spec.mutable_training()->set_global_batch(8);
  spec.mutable_sharding()->set_max_workers(8);
  spec.mutable_sharding()->set_replicas(2);
  spec.mutable_sharding()->set_optimizer_sharding(v1::OPTIMIZER_SHARDING_WORLD);
  auto world = (*client)->GetShardPlan("", spec, 4);
  ASSERT_TRUE(world.ok()) << world.status();
  EXPECT_EQ(world->world_size(), 4);
  EXPECT_EQ(world->mesh().replicas(), 2);
  EXPECT_EQ(world->mesh().shard_group_size(), 2);
  EXPECT_EQ(world->mesh().optimizer_sharding(), v1::OPTIMIZER_SHARDING_WORLD);
  EXPECT_EQ(world->mesh().optimizer_shards(), 4);
  EXPECT_EQ(world->memory().mesh().shard_group_size(), 2);
  spec.mutable_sharding()->set_optimizer_sharding(v1::OPTIMIZER_SHARDING_SHARD_GROUP);
  auto group = (*client)->GetShardPlan("", spec, 8);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(group->mesh().shard_group_size(), 4);
  EXPECT_EQ(group->mesh().optimizer_shards(), 4);
  spec.mutable_sharding()->set_replicas(0);  // auto: at the request's replicas
  auto autos = (*client)->GetShardPlan("", spec, 8, 4);
  ASSERT_TRUE(autos.ok()) << autos.status();
  EXPECT_EQ(autos->mesh().replicas(), 4);
  EXPECT_EQ(autos->mesh().shard_group_size(), 2);
  auto auto_flat = (*client)->GetShardPlan("", spec, 8);
  ASSERT_TRUE(auto_flat.ok()) << auto_flat.status();
  EXPECT_EQ(auto_flat->mesh().replicas(), 1);
  spec.mutable_sharding()->set_replicas(3);
  auto bad = (*client)->GetShardPlan("", spec, 4);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "sharding.replicas")) << bad.status();
}

TEST_F(GrpcTest, OneWorkerSessionRunsAJobThroughTheSdk) {
  auto stub = v1::WorkerControl::NewStub(channel_);
  grpc::ClientContext rctx;
  v1::RegisterRequest rreq;
  rreq.set_version(FSDP8_VERSION);
  rreq.set_host("127.0.0.1");
  rreq.set_backend("cpu");
  v1::RegisterResponse rresp;
  ASSERT_TRUE(stub->Register(&rctx, rreq, &rresp).ok());
  const std::string wid = rresp.worker_id();

  std::thread worker([&] {
    grpc::ClientContext ctx;
    auto stream = stub->Session(&ctx);
    v1::WorkerMessage hello;
    hello.mutable_hello()->set_worker_id(wid);
    ASSERT_TRUE(stream->Write(hello));
    v1::CoordinatorMessage m;
    std::string job;
    while (stream->Read(&m)) {
      v1::WorkerMessage r;
      if (m.has_assignment()) {
        job = m.assignment().job_id();
        r.mutable_ready()->set_job_id(job);
        r.mutable_ready()->set_generation(m.assignment().generation());
      } else if (m.has_step()) {
        r.mutable_result()->set_job_id(job);
        r.mutable_result()->set_step(m.step().step());
        r.mutable_result()->set_tokens(64);
        r.mutable_result()->set_loss_sum(64 * (3.0 - 0.1 * m.step().step()));
        r.mutable_result()->set_val_loss(NAN);
      } else {
        break;  // finish or abort
      }
      ASSERT_TRUE(stream->Write(r));
    }
    stream->WritesDone();
    stream->Finish();
  });

  auto client = fsdp8::Client::Connect(server_->address());
  ASSERT_TRUE(client.ok());
  auto job = (*client)->Submit(SmallSpec(train_, 1, 4), "grpc-req");
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<int64_t> seqs;
  std::vector<double> losses;
  auto end = (*client)->Watch(job->job_id(), 0, [&](const v1::JobEvent& e) {
    seqs.push_back(e.seq());
    if (e.step() > 0 && e.message().empty()) losses.push_back(e.loss());
    return true;
  });
  worker.join();
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_EQ(end->state(), v1::JOB_STATE_SUCCEEDED) << end->reason();
  EXPECT_EQ(end->step(), 4);
  ASSERT_EQ(losses.size(), 4u);
  EXPECT_NEAR(losses[3], 2.7, 1e-12);
  for (size_t i = 0; i < seqs.size(); ++i) EXPECT_EQ(seqs[i], static_cast<int64_t>(i + 1));
  // Idempotent over the wire too; the worker's session is gone, so it is unhealthy now.
  auto again = (*client)->Submit(SmallSpec(train_, 1, 4), "grpc-req");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->job_id(), job->job_id());
  EXPECT_TRUE(WaitFor([&] {
    auto ws = (*client)->ListWorkers();
    return ws.ok() && ws->size() == 1 && !(*ws)[0].healthy();
  }));
  auto plan = (*client)->GetShardPlan(job->job_id());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->world_size(), 1);
  EXPECT_GT(plan->total_numel(), 0);
  // The memory plan travels with it: its terms add up to its peak, which covers at least the
  // parameters' f32 master, gradient and two AdamW moments.
  EXPECT_EQ(plan->memory().world_size(), 1);
  int64_t sum = 0;
  for (const v1::MemoryTerm& t : plan->memory().terms()) sum += t.bytes();
  EXPECT_EQ(sum, plan->memory().peak_bytes());
  EXPECT_GE(plan->memory().peak_bytes(), plan->total_numel() * 16);
  auto bad_plan = (*client)->GetShardPlan("", SmallSpec(train_), 0);
  EXPECT_EQ(bad_plan.status().code(), absl::StatusCode::kInvalidArgument);
  // The mesh: a flat job's is 1 x its world size, optimizer state over the shard group.
  EXPECT_EQ(plan->mesh().replicas(), 1);
  EXPECT_EQ(plan->mesh().shard_group_size(), 1);
  EXPECT_EQ(plan->mesh().optimizer_shards(), 1);
  EXPECT_EQ(plan->memory().mesh().replicas(), 1);
  EXPECT_EQ((*client)->GetScalingState(job->job_id()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(GrpcTest, TriggerAndListCheckpointCodes) {
  auto client = fsdp8::Client::Connect(server_->address());
  ASSERT_TRUE(client.ok());
  Client& c = **client;
  EXPECT_EQ(c.TriggerCheckpoint("job-missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c.ListCheckpoints("job-missing").status().code(), absl::StatusCode::kNotFound);
  // No workers: the jobs stay PENDING.
  auto plain = c.Submit(SmallSpec(train_, 1, 4));
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto st = c.TriggerCheckpoint(plain->job_id()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(), "no checkpoint.dir")) << st;
  auto none = c.ListCheckpoints(plain->job_id());
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());

  v1::JobSpec spec = SmallSpec(train_, 1, 4);
  spec.mutable_checkpoint()->set_dir(dir_.File("ck"));
  auto pending = c.Submit(spec);
  ASSERT_TRUE(pending.ok()) << pending.status();
  st = c.TriggerCheckpoint(pending->job_id()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(), "PENDING")) << st;
  // checkpoint.dir outside the data roots is refused at submit.
  spec.mutable_checkpoint()->set_dir("/elsewhere/ck");
  EXPECT_EQ(c.Submit(spec).status().code(), absl::StatusCode::kInvalidArgument);

  // The job's committed checkpoints, oldest first (a MANIFEST names its job: another job's
  // checkpoint in the directory is not listed).
  CheckpointStore store(dir_.File("ck"), pending->job_id());
  for (int64_t k : {6, 3, 4}) {
    auto d = store.Prepare(k);
    ASSERT_TRUE(d.ok());
    { std::ofstream(*d + "/rank-0.ckpt") << std::string(100, 'x'); }
    v1::CheckpointManifest m;
    m.set_job_id(k == 4 ? "job-other" : pending->job_id());
    m.set_step(k);
    m.set_world_size(1);
    m.set_time(1.5);
    auto* f = m.add_files();
    f->set_file("rank-0.ckpt");
    f->set_bytes(100);
    ASSERT_TRUE((k == 4 ? CheckpointStore(dir_.File("ck")) : store).Commit(m).ok());
  }
  auto list = c.ListCheckpoints(pending->job_id());
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].step(), 3);
  EXPECT_EQ((*list)[1].step(), 6);
  EXPECT_EQ((*list)[1].dir(), dir_.File("ck") + "/step-6");
  EXPECT_EQ((*list)[1].world_size(), 1);
  EXPECT_EQ((*list)[1].bytes(), 100);
  EXPECT_DOUBLE_EQ((*list)[1].time(), 1.5);
}

// DeleteJob removes only an ended job; ListJobs pages with tokens (the SDK's ListJobs follows
// them to the end).
TEST_F(GrpcTest, DeleteJobAndListJobsPages) {
  auto client = fsdp8::Client::Connect(server_->address());
  ASSERT_TRUE(client.ok());
  Client& c = **client;
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(c.Submit(SmallSpec(train_, 1, 4))->job_id());
  auto st = c.Delete(ids[0]).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(), "only an ended job can be deleted")) << st;
  EXPECT_EQ(c.Delete("job-missing").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(c.Cancel(ids[0]).ok());
  auto gone = c.Delete(ids[0]);
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_EQ(gone->job_id(), ids[0]);
  EXPECT_EQ(gone->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(c.GetJob(ids[0]).status().code(), absl::StatusCode::kNotFound);
  auto first = c.ListJobsPage(3, "");
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->jobs_size(), 3);
  EXPECT_EQ(first->jobs(0).job_id(), ids[1]);
  ASSERT_FALSE(first->next_page_token().empty());
  auto second = c.ListJobsPage(3, first->next_page_token());
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->jobs_size(), 1);
  EXPECT_EQ(second->jobs(0).job_id(), ids[4]);
  EXPECT_TRUE(second->next_page_token().empty());
  EXPECT_EQ(c.ListJobsPage(3, "not-a-token").status().code(), absl::StatusCode::kInvalidArgument);
  auto all = c.ListJobs();
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 4u);
}

}  // namespace
}  // namespace fsdp8::coord
