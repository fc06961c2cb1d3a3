// Metrics and the status page against a real cluster on loopback: an fsdp8-coordinator and two
// fsdp8-worker processes, each with --metrics_port, train one short FP8 job on 2 ranks.
//
// Expected values come from outside the code under test: the job's own events (WatchJob), the
// shard plan (GetShardPlan) and hand arithmetic (tokens = steps x global_batch x seq_len; the
// reduce-scatter moves each flat buffer's padded f32 gradient once per microbatch; a weight's FP8
// scale is 448 / amax with margin 0). The expositions are read by the reference Python parser
// (prometheus_client), the status page by headless Chromium (the DOM it rendered, and the data
// the Chart.js chart holds).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/token_shard.h"
#include "fsdp8/v1/admin.grpc.pb.h"
#include "fsdp8/v1/jobs.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/observability/test_util.h"
#include "tests/support/cluster.h"
#include "tests/support/temp_dir.h"

namespace fsdp8 {
namespace {

using namespace obs_test;  // NOLINT

constexpr int kSteps = 30;
constexpr int kGlobalBatch = 4;
constexpr int kSeqLen = 64;
constexpr int kWorkers = 2;

// Byte-level text with some structure, so the loss falls.
std::vector<uint16_t> Corpus(size_t n, uint32_t seed) {
  static const char* words[] = {"the ", "quick ", "brown ", "fox ", "jumps ", "over ", "lazy ",
                                "dog ", "and ", "runs ", "far ", "away.\n"};
  std::vector<uint16_t> out;
  uint32_t x = seed;
  while (out.size() < n) {
    x = x * 1664525u + 1013904223u;
    for (const char* c = words[(x >> 16) % 12]; *c; ++c) out.push_back(static_cast<uint8_t>(*c));
  }
  out.resize(n);
  return out;
}

class Observability : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new testing::TempDir("fsdp8-observability", testing::TempDir::Cleanup::kUnlessFailed);
    dir_ = new fs::path(tmp_->path());
    ASSERT_TRUE(WriteTokenShard((*dir_ / "train.bin").string(), Corpus(200000, 1)).ok());
    ASSERT_TRUE(WriteTokenShard((*dir_ / "val.bin").string(), Corpus(20000, 2)).ok());
    cluster_ = new testing::LocalCluster({FSDP8_COORDINATOR_BIN, FSDP8_WORKER_BIN}, *dir_,
                                         GroupOptions());
    ports_ = new std::vector<int>();
    for (int i = 0; i <= kWorkers; ++i) ports_->push_back(FreePort());
    const std::string addr = cluster_->StartCoordinator(
        {"--listen=127.0.0.1:0", "--state_db=:memory:", "--data_roots=" + dir_->string(),
         "--metrics_host=127.0.0.1", "--metrics_port=" + std::to_string((*ports_)[0])},
        "coordinator.log");
    ASSERT_FALSE(addr.empty()) << ReadFile(cluster_->LogPath("coordinator.log"));
    addr_ = new std::string(addr);
    for (int i = 0; i < kWorkers; ++i)
      cluster_->AddWorker({"--coordinator=" + addr, "--threads=1", "--metrics_host=127.0.0.1",
                           "--metrics_port=" + std::to_string((*ports_)[i + 1])},
                          "worker-" + std::to_string(i) + ".log");
    auto channel = grpc::CreateChannel(addr, grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel).release();
    admin_ = v1::AdminService::NewStub(channel).release();
    RunJob();
  }

  static void TearDownTestSuite() {
    delete jobs_;
    delete admin_;
    delete cluster_;  // stops the processes
    delete tmp_;  // removes the directory unless the suite failed
    delete dir_;
    delete ports_;
    delete during_;
    delete addr_;
  }

  static v1::JobSpec Spec() {
    v1::JobSpec s;
    s.set_name("observability <\"quoted\">");  // exercises label escaping and HTML safety
    s.set_backend("cpu");
    auto* m = s.mutable_model();
    m->set_d_model(64);
    m->set_n_layers(2);
    m->set_n_heads(4);
    m->set_ffn_dim(192);
    m->set_vocab_size(256);
    m->set_seq_len(kSeqLen);
    s.mutable_data()->set_train_path((*dir_ / "train.bin").string());
    s.mutable_data()->set_val_path((*dir_ / "val.bin").string());
    auto* t = s.mutable_training();
    t->set_steps(kSteps);
    t->set_global_batch(kGlobalBatch);
    t->set_microbatch(kGlobalBatch / kWorkers);  // one microbatch per rank and step
    t->set_seed(3);
    t->set_eval_every(10);
    t->set_eval_batches(1);
    s.mutable_optimizer()->set_peak_lr(3e-3);
    s.mutable_sharding()->set_min_workers(kWorkers);
    s.mutable_sharding()->set_max_workers(kWorkers);
    s.mutable_precision()->set_linears(v1::PRECISION_FP8);
    return s;
  }

  // Submits the job and watches it; scrapes all three endpoints once mid-job.
  static void RunJob() {
    // Wait for both workers to register.
    for (int i = 0; i < 600; ++i) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      v1::ListWorkersResponse resp;
      if (admin_->ListWorkers(&ctx, {}, &resp).ok() && resp.workers_size() == kWorkers) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    v1::SubmitJobRequest req;
    *req.mutable_spec() = Spec();
    grpc::ClientContext sctx;
    sctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    job_ = new v1::Job();
    grpc::Status st = jobs_->SubmitJob(&sctx, req, job_);
    ASSERT_TRUE(st.ok()) << st.error_message();
    during_ = new std::vector<std::string>();
    v1::WatchJobRequest wr;
    wr.set_job_id(job_->job_id());
    grpc::ClientContext wctx;
    wctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
    auto reader = jobs_->WatchJob(&wctx, wr);
    v1::JobEvent ev;
    while (reader->Read(&ev)) {
      if (ev.message().empty() && ev.step() > 0) {
        steps_.push_back(ev);
        if (ev.step() == 5) {  // mid-job: the job is RUNNING and has run 5 of kSteps steps
          for (int p : *ports_) during_->push_back(HttpGet(p, "/metrics").body);
        }
      }
      if (ev.state() != v1::JOB_STATE_UNSPECIFIED) final_state_ = ev.state();
    }
    reader->Finish();
    grpc::ClientContext gctx;
    v1::GetJobRequest g;
    g.set_job_id(job_->job_id());
    jobs_->GetJob(&gctx, g, job_);
  }

  void SetUp() override {
    ASSERT_NE(job_, nullptr) << "the cluster did not start";
    ASSERT_EQ(final_state_, v1::JOB_STATE_SUCCEEDED) << job_->reason();
    ASSERT_EQ(steps_.size(), static_cast<size_t>(kSteps));
  }

  // One microbatch per rank and step: each flat buffer's padded f32 gradient is reduce-scattered
  // once per step (sizes from the coordinator's shard plan).
  static double ReduceScatterBytesPerStep() {
    grpc::ClientContext ctx;
    v1::GetShardPlanRequest pr;
    pr.set_job_id(job_->job_id());
    v1::ShardPlan plan;
    EXPECT_TRUE(admin_->GetShardPlan(&ctx, pr, &plan).ok());
    double bytes = 0;
    for (const auto& u : plan.units())
      for (const auto& b : u.buffers()) bytes += 4.0 * b.padded_numel();
    return bytes;
  }

  // Parses the text with the reference parser (fails the test on a parse error).
  static Exposition Parse(const std::string& text, const std::string& tag) {
    Exposition e;
    std::string err;
    EXPECT_TRUE(ParseExposition(text, *dir_ / tag, &e, &err)) << err << "\n" << text;
    return e;
  }

  static testing::TempDir* tmp_;
  static fs::path* dir_;  // tmp_'s path
  static std::string* addr_;  // the coordinator's gRPC address
  static std::vector<int>* ports_;  // coordinator, worker 0, worker 1
  static testing::LocalCluster* cluster_;
  static v1::JobService::Stub* jobs_;
  static v1::AdminService::Stub* admin_;
  static v1::Job* job_;
  static std::vector<v1::JobEvent> steps_;  // step events, in order
  static std::vector<std::string>* during_;  // mid-job scrapes, same order as ports_
  static v1::JobState final_state_;
};
testing::TempDir* Observability::tmp_ = nullptr;
fs::path* Observability::dir_ = nullptr;
std::string* Observability::addr_ = nullptr;
std::vector<int>* Observability::ports_ = nullptr;
testing::LocalCluster* Observability::cluster_ = nullptr;
v1::JobService::Stub* Observability::jobs_ = nullptr;
v1::AdminService::Stub* Observability::admin_ = nullptr;
v1::Job* Observability::job_ = nullptr;
std::vector<v1::JobEvent> Observability::steps_;
std::vector<std::string>* Observability::during_ = nullptr;
v1::JobState Observability::final_state_ = v1::JOB_STATE_UNSPECIFIED;

TEST_F(Observability, MetricsCoordinatorMatchesTheJobsOwnEvents) {
  const std::string id = job_->job_id();
  // Mid-job: parseable, the job RUNNING, between 5 and kSteps steps done.
  ASSERT_EQ(during_->size(), static_cast<size_t>(kWorkers + 1));
  Exposition mid = Parse((*during_)[0], "coord-mid");
  EXPECT_EQ(Value(mid, "fsdp8_job_info", "fsdp8_job_info", {{"job", id}, {"state", "RUNNING"}}), 1);
  const double mid_steps = Value(mid, "fsdp8_steps", "fsdp8_steps_total", {{"job", id}});
  EXPECT_GE(mid_steps, 5);
  EXPECT_LT(mid_steps, kSteps);

  HttpResult r = HttpGet((*ports_)[0], "/metrics");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.content_type, "text/plain; version=0.0.4; charset=utf-8");
  Exposition e = Parse(r.body, "coord-end");
  // Types as the spec wants them (the parser strips _total from counter family names).
  EXPECT_EQ(e["fsdp8_steps"].type, "counter");
  EXPECT_EQ(e["fsdp8_tokens"].type, "counter");
  EXPECT_EQ(e["fsdp8_step_duration_seconds"].type, "histogram");
  EXPECT_EQ(e["fsdp8_loss"].type, "gauge");
  EXPECT_EQ(e["fsdp8_job_restarts"].type, "counter");
  // The job's name came through label escaping intact.
  EXPECT_EQ(Value(e, "fsdp8_job_info", "fsdp8_job_info",
                  {{"job", id}, {"state", "SUCCEEDED"}, {"name", "observability <\"quoted\">"}}),
            1);
  const v1::JobEvent& last = steps_.back();
  EXPECT_EQ(Value(e, "fsdp8_steps", "fsdp8_steps_total", {{"job", id}}), kSteps);
  EXPECT_EQ(Value(e, "fsdp8_tokens", "fsdp8_tokens_total", {{"job", id}}),
            static_cast<double>(kSteps) * kGlobalBatch * kSeqLen);
  EXPECT_EQ(Value(e, "fsdp8_job_step", "fsdp8_job_step", {{"job", id}}), kSteps);
  EXPECT_EQ(Value(e, "fsdp8_job_restarts", "fsdp8_job_restarts_total", {{"job", id}}), 0);
  EXPECT_DOUBLE_EQ(Value(e, "fsdp8_loss", "fsdp8_loss", {{"job", id}}), last.loss());
  EXPECT_DOUBLE_EQ(Value(e, "fsdp8_grad_norm", "fsdp8_grad_norm", {{"job", id}}), last.grad_norm());
  EXPECT_DOUBLE_EQ(Value(e, "fsdp8_learning_rate", "fsdp8_learning_rate", {{"job", id}}), last.lr());
  double last_val = NAN, step_seconds = 0;
  int under_10s = 0;
  for (const v1::JobEvent& ev : steps_) {
    if (!std::isnan(ev.val_loss())) last_val = ev.val_loss();
    step_seconds += ev.step_seconds();
    under_10s += ev.step_seconds() <= 10;
  }
  ASSERT_FALSE(std::isnan(last_val));
  EXPECT_DOUBLE_EQ(Value(e, "fsdp8_val_loss", "fsdp8_val_loss", {{"job", id}}), last_val);
  // Histogram: count = steps, sum = the events' step seconds, buckets cumulative up to +Inf.
  EXPECT_EQ(Value(e, "fsdp8_step_duration_seconds", "fsdp8_step_duration_seconds_count", {{"job", id}}),
            kSteps);
  EXPECT_NEAR(Value(e, "fsdp8_step_duration_seconds", "fsdp8_step_duration_seconds_sum", {{"job", id}}),
              step_seconds, 1e-9 * step_seconds);
  EXPECT_EQ(Value(e, "fsdp8_step_duration_seconds", "fsdp8_step_duration_seconds_bucket",
                  {{"job", id}, {"le", "10"}}),
            under_10s);
  EXPECT_EQ(Value(e, "fsdp8_step_duration_seconds", "fsdp8_step_duration_seconds_bucket",
                  {{"job", id}, {"le", "+Inf"}}),
            kSteps);
  // Workers: both registered, healthy, idle again.
  EXPECT_EQ(Value(e, "fsdp8_workers", "fsdp8_workers", {{"backend", "cpu"}, {"state", "idle"}}), kWorkers);
  // Per-rank communication: the reduce-scatters the shard plan implies, and some all-gathers.
  for (int r = 0; r < kWorkers; ++r) {
    const std::string rank = std::to_string(r);
    EXPECT_EQ(Value(e, "fsdp8_comm_bytes", "fsdp8_comm_bytes_total",
                    {{"job", id}, {"rank", rank}, {"collective", "reduce_scatter"}}),
              kSteps * ReduceScatterBytesPerStep())
        << "rank " << r;
    EXPECT_GT(Value(e, "fsdp8_comm_bytes", "fsdp8_comm_bytes_total",
                    {{"job", id}, {"rank", rank}, {"collective", "all_gather"}}),
              0)
        << "rank " << r;
  }
  // FP8: the scales the coordinator exports are the ones GetScalingState returns.
  grpc::ClientContext ctx;
  v1::GetScalingStateRequest sr;
  sr.set_job_id(id);
  v1::ScalingState scaling;
  ASSERT_TRUE(admin_->GetScalingState(&ctx, sr, &scaling).ok());
  ASSERT_GT(scaling.tensors_size(), 0);
  for (const v1::TensorScaling& t : scaling.tensors()) {
    EXPECT_EQ(Value(e, "fsdp8_fp8_scale", "fsdp8_fp8_scale", {{"job", id}, {"tensor", t.name()}}),
              static_cast<double>(t.scale()))
        << t.name();
    EXPECT_EQ(Value(e, "fsdp8_fp8_amax", "fsdp8_fp8_amax", {{"job", id}, {"tensor", t.name()}}),
              static_cast<double>(t.amax_history(0)))
        << t.name();
  }
}

TEST_F(Observability, MetricsWorkersMatchTheJobAndTheShardPlan) {
  const std::string id = job_->job_id();
  const double rs_bytes_per_step = ReduceScatterBytesPerStep();
  ASSERT_GT(rs_bytes_per_step, 0);

  std::vector<double> rank_loss(kWorkers, NAN);
  std::set<int> ranks_seen;
  for (int w = 0; w < kWorkers; ++w) {
    SCOPED_TRACE("worker " + std::to_string(w));
    Exposition mid = Parse((*during_)[w + 1], "worker-mid-" + std::to_string(w));
    EXPECT_GE(Value(mid, "fsdp8_steps", "fsdp8_steps_total", {{"job", id}}), 4);
    HttpResult r = HttpGet((*ports_)[w + 1], "/metrics");
    ASSERT_EQ(r.status, 200);
    Exposition e = Parse(r.body, "worker-end-" + std::to_string(w));
    ASSERT_TRUE(e.count("fsdp8_steps")) << r.body;
    // This worker's rank, from its own series.
    int rank = -1;
    for (const Sample& s : e["fsdp8_steps"].samples)
      if (s.labels.count("job") && s.labels.at("job") == id) rank = std::stoi(s.labels.at("rank"));
    ASSERT_GE(rank, 0);
    ranks_seen.insert(rank);
    const std::map<std::string, std::string> lb = {{"job", id}, {"rank", std::to_string(rank)}};
    EXPECT_EQ(Value(e, "fsdp8_steps", "fsdp8_steps_total", lb), kSteps);
    EXPECT_EQ(Value(e, "fsdp8_tokens", "fsdp8_tokens_total", lb),
              static_cast<double>(kSteps) * kGlobalBatch / kWorkers * kSeqLen);
    EXPECT_EQ(Value(e, "fsdp8_step_duration_seconds", "fsdp8_step_duration_seconds_count", lb), kSteps);
    EXPECT_DOUBLE_EQ(Value(e, "fsdp8_grad_norm", "fsdp8_grad_norm", lb), steps_.back().grad_norm());
    rank_loss[rank] = Value(e, "fsdp8_loss", "fsdp8_loss", lb);
    auto with = [&](const char* collective) {
      auto l = lb;
      l["collective"] = collective;
      return l;
    };
    EXPECT_EQ(Value(e, "fsdp8_comm_bytes", "fsdp8_comm_bytes_total", with("reduce_scatter")),
              kSteps * rs_bytes_per_step);
    EXPECT_GT(Value(e, "fsdp8_comm_bytes", "fsdp8_comm_bytes_total", with("all_gather")), 0);
    EXPECT_GT(Value(e, "fsdp8_comm_bytes", "fsdp8_comm_bytes_total", with("all_reduce")), 0);
    EXPECT_GT(Value(e, "fsdp8_peak_memory_bytes", "fsdp8_peak_memory_bytes", lb), 0);
    EXPECT_GT(Value(e, "process_resident_memory_bytes", "process_resident_memory_bytes", {}), 1 << 20);
    EXPECT_EQ(Value(e, "fsdp8_worker_assignments", "fsdp8_worker_assignments_total", {}), 1);
    // FP8 weights use current scaling with margin 0: scale = 448 / amax (rounded once to f32).
    int weights = 0;
    for (const Sample& s : e["fsdp8_fp8_scale"].samples) {
      const std::string& t = s.labels.at("tensor");
      if (t.size() < 2 || t.substr(t.size() - 2) != ".w") continue;
      auto l = lb;
      l["tensor"] = t;
      const double amax = Value(e, "fsdp8_fp8_amax", "fsdp8_fp8_amax", l);
      ASSERT_GT(amax, 0) << t;
      EXPECT_NEAR(s.value, 448.0 / amax, 448.0 / amax * 1e-6) << t;
      ++weights;
    }
    EXPECT_EQ(weights, 2 * 7) << "every FP8 linear of 2 blocks has a weight scale";
  }
  EXPECT_EQ(ranks_seen, (std::set<int>{0, 1}));
  // The job's loss is the token-weighted mean of the ranks' losses (equal token counts here).
  EXPECT_NEAR((rank_loss[0] + rank_loss[1]) / 2, steps_.back().loss(), 1e-9 * steps_.back().loss());
}

TEST_F(Observability, HttpRefusesOtherMethodsAndUnknownPaths) {
  for (int p : *ports_) {
    EXPECT_EQ(HttpRequest(p, "POST", "/metrics").status, 405);
    EXPECT_EQ(HttpGet(p, "/no-such-page").status, 404);
    HttpResult head = HttpRequest(p, "HEAD", "/metrics");
    EXPECT_EQ(head.status, 200);
    EXPECT_TRUE(head.body.empty());
  }
}

// Runs headless Chromium on `url` with `extra` arguments; returns its stdout ("" on failure).
std::string Chromium(const fs::path& dir, const std::vector<std::string>& extra, const std::string& url,
                     const std::string& tag) {
  std::vector<std::string> argv = {"/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu",
                                    "--disable-dev-shm-usage", "--no-first-run", "--hide-scrollbars",
                                    "--user-data-dir=" + (dir / ("chromium-profile-" + tag)).string(),
                                    "--window-size=1280,1100", "--virtual-time-budget=5000"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back(url);
  const fs::path out = dir / ("chromium-" + tag + ".out");
  ChildProcess p(argv, out.string(), GroupOptions());
  const int rc = p.Wait(std::chrono::seconds(120));
  EXPECT_EQ(rc, 0) << "chromium " << tag << " failed; output:\n" << ReadFile(out).substr(0, 4000);
  return ReadFile(out);
}

TEST_F(Observability, StatusPageInHeadlessChromiumShowsJobWorkersAndLossChart) {
  if (!fs::exists("/usr/bin/chromium")) GTEST_SKIP() << "chromium is not installed (apt-get install chromium)";
  const std::string id = job_->job_id();
  const std::string url = "http://127.0.0.1:" + std::to_string((*ports_)[0]) + "/";
  const std::string dom = Chromium(*dir_, {"--dump-dom"}, url, "dom");
  ASSERT_NE(dom.find("<html"), std::string::npos) << dom.substr(0, 2000);
  // The page's error lines stay empty: it reached the coordinator and Chart.js loaded.
  EXPECT_NE(dom.find("<div id=\"error\"></div>"), std::string::npos) << dom.substr(0, 3000);
  EXPECT_NE(dom.find("<div id=\"chart-error\"></div>"), std::string::npos) << dom.substr(0, 3000);
  // The job's row, with its state.
  const std::regex job_row("<tr data-job=\"" + id + "\">(.*?)</tr>");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(dom, m, job_row)) << dom;
  EXPECT_NE(m[1].str().find("SUCCEEDED"), std::string::npos) << m[1];
  EXPECT_NE(m[1].str().find(std::to_string(kSteps) + "/" + std::to_string(kSteps)), std::string::npos);
  // Every registered worker has a row.
  grpc::ClientContext ctx;
  v1::ListWorkersResponse workers;
  ASSERT_TRUE(admin_->ListWorkers(&ctx, {}, &workers).ok());
  ASSERT_EQ(workers.workers_size(), kWorkers);
  for (const auto& w : workers.workers())
    EXPECT_NE(dom.find("<tr data-worker=\"" + w.worker_id() + "\">"), std::string::npos) << w.worker_id();
  // The chart's own data (copied from the Chart.js object after it rendered): this job's losses.
  const std::regex canvas("<canvas id=\"loss-chart\"([^>]*)>");
  ASSERT_TRUE(std::regex_search(dom, m, canvas)) << dom;
  const std::string attrs = m[1];
  std::smatch a;
  ASSERT_TRUE(std::regex_search(attrs, a, std::regex("data-job=\"([^\"]*)\""))) << attrs;
  EXPECT_EQ(a[1], id);
  ASSERT_TRUE(std::regex_search(attrs, a, std::regex("data-losses=\"\\[([^\\]]*)\\]\""))) << attrs;
  std::vector<double> losses;
  const std::string list = a[1];
  for (size_t pos = 0; pos < list.size();) {
    size_t comma = list.find(',', pos);
    if (comma == std::string::npos) comma = list.size();
    losses.push_back(std::strtod(list.substr(pos, comma - pos).c_str(), nullptr));
    pos = comma + 1;
  }
  ASSERT_EQ(losses.size(), steps_.size());
  for (size_t k = 0; k < losses.size(); ++k)
    EXPECT_DOUBLE_EQ(losses[k], steps_[k].loss()) << "step " << k + 1;

  // A screenshot kept under the build directory for a person to look at.
  fs::create_directories(FSDP8_SCREENSHOT_DIR);
  const fs::path shot = fs::path(FSDP8_SCREENSHOT_DIR) / "status-page.png";
  fs::remove(shot);
  Chromium(*dir_, {"--screenshot=" + shot.string()}, url, "screenshot");
  ASSERT_TRUE(fs::exists(shot));
  const std::string png = ReadFile(shot);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_GT(png.size(), 20000u) << "a blank page compresses to almost nothing";
  std::printf("status page screenshot: %s (%zu bytes)\n", shot.c_str(), png.size());
}

TEST_F(Observability, WatchPlotWritesTheLossCurve) {
  fs::create_directories(FSDP8_SCREENSHOT_DIR);
  const fs::path png = fs::path(FSDP8_SCREENSHOT_DIR) / "watch-plot.png";
  fs::remove(png);
  const fs::path out = *dir_ / "watch.out";
  ChildProcess cli({FSDP8_CLI_BIN, "--coordinator=" + *addr_, "watch", job_->job_id(),
                    "--plot=" + png.string()},
                   out.string(), GroupOptions());
  EXPECT_EQ(cli.Wait(std::chrono::seconds(60)), 0) << ReadFile(out);
  EXPECT_NE(ReadFile(out).find("loss curve (" + std::to_string(kSteps) + " steps) written to"),
            std::string::npos)
      << ReadFile(out);
  const std::string img = ReadFile(png);
  ASSERT_GT(img.size(), 10000u);
  EXPECT_EQ(img.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  // A name gnuplot cannot write is refused before anything is watched.
  ChildProcess bad(
      {FSDP8_CLI_BIN, "--coordinator=" + *addr_, "watch", job_->job_id(), "--plot=x.gif"},
      (*dir_ / "bad.out").string(), GroupOptions());
  EXPECT_EQ(bad.Wait(std::chrono::seconds(30)), 2);
  EXPECT_NE(ReadFile(*dir_ / "bad.out").find("must end in .png, .svg or .pdf"), std::string::npos);
}

}  // namespace
}  // namespace fsdp8
