// libFuzzer targets for the coordinator's RPCs (coordinator/services.h), built three times from
// this file: FSDP8_FUZZ_SERVICE 1 = JobService (job_service_fuzz), 2 = AdminService
// (admin_service_fuzz), 3 = WorkerControl (worker_control_fuzz: the worker's unary calls and its
// Session stream).
//
// One real CoordinatorServer per process (in-memory job table, a data root with a small token
// file, no authentication, 16 KiB message limit so that larger inputs are oversized) on loopback.
// An input is a sequence of records [op: 1 byte][length: 2 bytes][payload], each one call:
//   - the payload parsed as the call's request (random field values, job ids of jobs that exist,
//     valid job specs overlaid with random fields), or, when it does not parse, sent as raw bytes
//     (malformed messages: gRPC refuses them before our code runs);
//   - WorkerControl: Register, Heartbeat, KvSet, KvGet, and a Session that sends Hello and then
//     every following record as a WorkerMessage in input order (Ready, results for steps never
//     sent, errors, saves of jobs it does not serve, ...), while the scheduler may assign it a job.
// Every call has a 100 ms deadline (a Session 500 ms), at most 16 records an input. The coordinator
// must never crash or trip a sanitizer, and never wedge: after every input ListWorkers must answer
// within 5 s, else the input aborts (a crash for libFuzzer).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "common/log.h"
#include "common/token_shard.h"
#include "coordinator/services.h"
#include "fsdp8/v1/admin.grpc.pb.h"
#include "fsdp8/v1/jobs.grpc.pb.h"
#include "fsdp8/v1/worker.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

#ifndef FSDP8_FUZZ_SERVICE
#error "define FSDP8_FUZZ_SERVICE (1 JobService, 2 AdminService, 3 WorkerControl)"
#endif
#ifndef FSDP8_VERSION
#define FSDP8_VERSION "dev"
#endif

namespace fsdp8 {
namespace {

struct Env {
  std::string dir;
  std::unique_ptr<coord::CoordinatorServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::JobService::Stub> jobs;
  std::unique_ptr<v1::AdminService::Stub> admin;
  std::unique_ptr<v1::WorkerControl::Stub> worker;
  std::unique_ptr<grpc::GenericStub> generic;
  std::string last_job;     // the newest job submitted
  std::string last_worker;  // the newest worker registered
};

Env* Start() {
  SetLogLevel(LogLevel::kError);  // the job events of thousands of inputs are noise here
  auto* e = new Env;
  char tmpl[] = "/tmp/fsdp8-rpc-fuzz-XXXXXX";
  e->dir = mkdtemp(tmpl);
  std::vector<uint16_t> tokens(8192);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i * 31) % 256);
  if (!WriteTokenShard(e->dir + "/train.bin", tokens).ok()) abort();
  coord::CoordinatorOptions o;
  o.listen = "127.0.0.1:0";
  o.max_message_bytes = 16 << 10;
  o.jobs.state_db = ":memory:";
  o.jobs.data_roots = {e->dir};
  o.workers.version = FSDP8_VERSION;
  o.scheduler.start_timeout = std::chrono::milliseconds(500);
  o.scheduler.step_timeout = std::chrono::milliseconds(500);
  o.scheduler.abort_grace = std::chrono::milliseconds(0);
  auto s = coord::CoordinatorServer::Start(o);
  if (!s.ok()) abort();
  e->server = std::move(*s);
  e->channel = grpc::CreateChannel(e->server->address(), grpc::InsecureChannelCredentials());
  e->jobs = v1::JobService::NewStub(e->channel);
  e->admin = v1::AdminService::NewStub(e->channel);
  e->worker = v1::WorkerControl::NewStub(e->channel);
  e->generic = std::make_unique<grpc::GenericStub>(e->channel);
  return e;
}

Env& Get() {
  static Env* e = Start();
  return *e;
}

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
}

// Sends raw bytes (a message that did not parse) to `method`, waiting for the answer.
void SendRaw(const std::string& method, const std::string& payload) {
  grpc::Slice slice(payload);
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::CompletionQueue cq;
  auto call = Get().generic->PrepareUnaryCall(&ctx, method, req, &cq);
  call->StartCall();
  grpc::Status st;
  call->Finish(&resp, &st, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  cq.Next(&tag, &ok);
}

// A valid 1-rank job on the data root's tokens, overlaid with the fuzzed fields.
v1::JobSpec BaseSpec() {
  v1::JobSpec s;
  s.set_name("fuzz");
  s.set_backend("cpu");
  auto* m = s.mutable_model();
  m->set_d_model(16);
  m->set_n_layers(1);
  m->set_n_heads(2);
  m->set_ffn_dim(32);
  m->set_vocab_size(256);
  m->set_seq_len(8);
  s.mutable_data()->set_train_path(Get().dir + "/train.bin");
  s.mutable_training()->set_steps(3);
  s.mutable_training()->set_global_batch(1);
  s.mutable_sharding()->set_min_workers(1);
  s.mutable_sharding()->set_max_workers(1);
  return s;
}

// Fills an empty job_id with the newest job's.
void FillJob(std::string* job_id) {
  if (job_id->empty()) *job_id = Get().last_job;
}

template <typename Req>
bool Parse(const std::string& payload, Req* req) {
  return req->ParsePartialFromString(payload);
}

#if FSDP8_FUZZ_SERVICE == 1 || FSDP8_FUZZ_SERVICE == 3
void Submit(uint8_t op, const std::string& payload) {
  v1::SubmitJobRequest req;
  if (op & 0x80) {  // a valid spec with random fields on top
    *req.mutable_spec() = BaseSpec();
    v1::JobSpec extra;
    if (extra.ParsePartialFromString(payload)) req.mutable_spec()->MergeFrom(extra);
  } else if (!Parse(payload, &req)) {
    return SendRaw("/fsdp8.v1.JobService/SubmitJob", payload);
  }
  v1::Job job;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  if (Get().jobs->SubmitJob(&ctx, req, &job).ok()) Get().last_job = job.job_id();
}
#endif

#if FSDP8_FUZZ_SERVICE == 1
void Call(uint8_t op, const std::string& payload) {
  Env& e = Get();
  grpc::ClientContext ctx;
  Deadline(&ctx);
  switch (op % 5) {
    case 0:
      return Submit(op, payload);
    case 1: {
      v1::GetJobRequest req;
      if (!Parse(payload, &req)) return SendRaw("/fsdp8.v1.JobService/GetJob", payload);
      FillJob(req.mutable_job_id());
      v1::Job out;
      e.jobs->GetJob(&ctx, req, &out);
      return;
    }
    case 2: {
      v1::ListJobsRequest req;
      if (!Parse(payload, &req)) return SendRaw("/fsdp8.v1.JobService/ListJobs", payload);
      v1::ListJobsResponse out;
      e.jobs->ListJobs(&ctx, req, &out);
      return;
    }
    case 3: {
      v1::WatchJobRequest req;
      if (!Parse(payload, &req)) return SendRaw("/fsdp8.v1.JobService/WatchJob", payload);
      FillJob(req.mutable_job_id());
      auto reader = e.jobs->WatchJob(&ctx, req);
      v1::JobEvent ev;
      while (reader->Read(&ev)) {
      }
      reader->Finish();
      return;
    }
    default: {
      v1::CancelJobRequest req;
      if (!Parse(payload, &req)) return SendRaw("/fsdp8.v1.JobService/CancelJob", payload);
      FillJob(req.mutable_job_id());
      v1::Job out;
      e.jobs->CancelJob(&ctx, req, &out);
      return;
    }
  }
}
#endif

#if FSDP8_FUZZ_SERVICE == 2
// Calls `rpc` with the payload parsed as Req (job_id filled in when it has one), or raw.
template <typename Req, typename Resp, typename Rpc>
void Unary(const char* method, const std::string& payload, Rpc rpc) {
  Req req;
  if (!Parse(payload, &req)) return SendRaw(method, payload);
  if constexpr (std::is_same_v<Req, v1::GetShardPlanRequest> ||
                std::is_same_v<Req, v1::GetScalingStateRequest> ||
                std::is_same_v<Req, v1::TriggerCheckpointRequest> ||
                std::is_same_v<Req, v1::ListCheckpointsRequest>)
    FillJob(req.mutable_job_id());
  Resp resp;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  (Get().admin.get()->*rpc)(&ctx, req, &resp);
}

void Call(uint8_t op, const std::string& payload) {
  using S = v1::AdminService::Stub;
  switch (op % 8) {
    case 0:
      return Unary<v1::ListWorkersRequest, v1::ListWorkersResponse>(
          "/fsdp8.v1.AdminService/ListWorkers", payload, &S::ListWorkers);
    case 1:
      return Unary<v1::DrainWorkerRequest, v1::WorkerInfo>("/fsdp8.v1.AdminService/DrainWorker",
                                                            payload, &S::DrainWorker);
    case 2:
      return Unary<v1::GetShardPlanRequest, v1::ShardPlan>("/fsdp8.v1.AdminService/GetShardPlan",
                                                           payload, &S::GetShardPlan);
    case 3:
      return Unary<v1::GetScalingStateRequest, v1::ScalingState>(
          "/fsdp8.v1.AdminService/GetScalingState", payload, &S::GetScalingState);
    case 4:
      return Unary<v1::TriggerCheckpointRequest, v1::TriggerCheckpointResponse>(
          "/fsdp8.v1.AdminService/TriggerCheckpoint", payload, &S::TriggerCheckpoint);
    case 5:
      return Unary<v1::ListCheckpointsRequest, v1::ListCheckpointsResponse>(
          "/fsdp8.v1.AdminService/ListCheckpoints", payload, &S::ListCheckpoints);
    case 6:
      return Unary<v1::SetLogLevelRequest, v1::SetLogLevelResponse>(
          "/fsdp8.v1.AdminService/SetLogLevel", payload, &S::SetLogLevel);
    default: {  // a job to look at: a valid spec with random fields on top
      v1::SubmitJobRequest req;
      *req.mutable_spec() = BaseSpec();
      v1::JobSpec extra;
      if (extra.ParsePartialFromString(payload)) req.mutable_spec()->MergeFrom(extra);
      v1::Job job;
      grpc::ClientContext ctx;
      Deadline(&ctx);
      if (Get().jobs->SubmitJob(&ctx, req, &job).ok()) Get().last_job = job.job_id();
      return;
    }
  }
}
#endif

#if FSDP8_FUZZ_SERVICE == 3
// A Session: Hello, then every remaining record as a WorkerMessage, in order.
void Session(const std::vector<std::string>& messages) {
  Env& e = Get();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  auto stream = e.worker->Session(&ctx);
  v1::WorkerMessage hello;
  hello.mutable_hello()->set_worker_id(e.last_worker);
  stream->Write(hello);
  for (const std::string& payload : messages) {
    v1::WorkerMessage m;
    if (!m.ParsePartialFromString(payload)) continue;
    // Aim at the newest job: its id where a message leaves it empty.
    if (m.has_ready()) FillJob(m.mutable_ready()->mutable_job_id());
    if (m.has_result()) FillJob(m.mutable_result()->mutable_job_id());
    if (m.has_error()) FillJob(m.mutable_error()->mutable_job_id());
    if (m.has_saved()) FillJob(m.mutable_saved()->mutable_job_id());
    if (!stream->Write(m)) break;
  }
  stream->WritesDone();
  ctx.TryCancel();
  stream->Finish();
}

void Call(uint8_t op, const std::string& payload) {
  Env& e = Get();
  grpc::ClientContext ctx;
  Deadline(&ctx);
  switch (op % 5) {
    case 0: {
      v1::RegisterRequest req;
      if (!Parse(payload, &req)) return SendRaw("/fsdp8.v1.WorkerControl/Register", payload);
      if (op & 0x80) {  // a registration that succeeds
        req.set_version(FSDP8_VERSION);
        req.set_backend("cpu");
        if (req.host().empty()) req.set_host("127.0.0.1");
        req.clear_name();
      }
      v1::RegisterResponse resp;
      if (e.worker->Register(&ctx, req, &resp).ok()) e.last_worker = resp.worker_id();
      return;
    }
    case 1: {
      v1::HeartbeatRequest req;
      if (!Parse(payload, &req)) return SendRaw("/fsdp8.v1.WorkerControl/Heartbeat", payload);
      if (req.worker_id().empty()) req.set_worker_id(e.last_worker);
      v1::HeartbeatResponse resp;
      e.worker->Heartbeat(&ctx, req, &resp);
      return;
    }
    case 2: {
      v1::KvSetRequest req;
      if (!Parse(payload, &req)) return SendRaw("/fsdp8.v1.WorkerControl/KvSet", payload);
      v1::KvSetResponse resp;
      e.worker->KvSet(&ctx, req, &resp);
      return;
    }
    case 3: {
      v1::KvGetRequest req;
      if (!Parse(payload, &req)) return SendRaw("/fsdp8.v1.WorkerControl/KvGet", payload);
      v1::KvGetResponse resp;
      e.worker->KvGet(&ctx, req, &resp);
      return;
    }
    default:
      return Submit(op | 0x80, payload);  // a job for the fuzzed worker to be assigned
  }
}
#endif

// The coordinator still answers (ListWorkers within 5 s); aborts when it is wedged.
void CheckResponsive() {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ListWorkersResponse resp;
  const grpc::Status st = Get().admin->ListWorkers(&ctx, v1::ListWorkersRequest(), &resp);
  if (!st.ok()) {
    fprintf(stderr, "coordinator wedged: ListWorkers: %s\n", st.error_message().c_str());
    abort();
  }
}

// Splits the input into records [op][len lo][len hi][payload].
struct Record {
  uint8_t op;
  std::string payload;
};
std::vector<Record> Records(const uint8_t* data, size_t size) {
  std::vector<Record> out;
  size_t i = 0;
  while (i < size && out.size() < 16) {
    Record r;
    r.op = data[i++];
    size_t len = 0;
    if (i + 2 <= size) len = data[i] | (static_cast<size_t>(data[i + 1]) << 8);
    i = std::min(size, i + 2);
    len = std::min(len, size - i);
    r.payload.assign(reinterpret_cast<const char*>(data + i), len);
    i += len;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace
}  // namespace fsdp8

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fsdp8::Get();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<fsdp8::Record> records = fsdp8::Records(data, size);
#if FSDP8_FUZZ_SERVICE == 3
  // Records before the first op 0x7f are unary calls; 0x7f opens the Session, and every later
  // record is one of its messages.
  for (size_t i = 0; i < records.size(); ++i) {
    if (records[i].op == 0x7f) {
      std::vector<std::string> messages;
      for (size_t j = i + 1; j < records.size(); ++j) messages.push_back(records[j].payload);
      fsdp8::Session(messages);
      break;
    }
    fsdp8::Call(records[i].op, records[i].payload);
  }
#else
  for (const auto& r : records) fsdp8::Call(r.op, r.payload);
#endif
  fsdp8::CheckResponsive();
  return 0;
}
