// fsdp8-bench-cpu-step: training steps of a job spec in one process, without the coordinator and
// worker daemons: `--world` ranks as threads, each with its own backend, their collectives through
// comm/cpu_communicator.h as in the workers (shared memory; FSDP8_CPU_TRANSPORT=gloo: Gloo on
// 127.0.0.1).
// Prints tokens/s over the timed steps (after `--warmup` untimed ones), per wall-clock second and
// per process-CPU second, the trainer's compute / communication / optimizer split of rank 0, and
// the process's CPU time per timed step split into the rank threads' and the rest (the ranks'
// collective helper threads, comm/async_communicator.h; with Gloo also its event-loop threads).
//
// Usage: fsdp8-bench-cpu-step --spec JOB.yaml --data DIR [--steps N] [--warmup N] [--world N]
//                             [--backend cpu|cpu-ref] [--threads N]
//        fsdp8-bench-cpu-step --collectives LINK [--world N]
//   --collectives: instead of steps, times the collectives the step issues (all-gather,
//   reduce-scatter, all-reduce; through the same communicator, helper thread included) on
//   --world rank threads at message sizes from 8 B to 4 MiB, the best of 3 rounds, and prints one
//   JSON list of curves for a calibration file (common/cost_model.h): per op, points
//   [bytes, bus GB/s] with bus GB/s = bytes * f / seconds (f = (n-1)/n, all-reduce 2(n-1)/n,
//   nccl-tests' convention; the latency folded in), tagged with LINK ("shm", or "gloo" with
//   FSDP8_CPU_TRANSPORT=gloo).
//   JOB.yaml: a job spec (e.g. data/default-job.yaml; "DATA_DIR" in it is replaced by --data).
//   --threads: OpenBLAS threads of the process (default 1).
// On a shared machine, the tokens per rank-thread CPU second (the timed steps' tokens over the
// busiest rank thread's CPU time; with --threads 1 the rank thread does all of its compute) are
// what the ranks would reach on cores of their own.
#include <cblas.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_replace.h"
#include "bench/cpu/bench_util.h"
#include "comm/cpu_communicator.h"
#include "comm/kv_store.h"
#include "common/spec.h"
#include "kernels/backend.h"
#include "train/trainer.h"

namespace {

class MemKv : public fsdp8::KvStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> l(mu_);
    kv_[key] = value;
    cv_.notify_all();
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& key,
                                  std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> l(mu_);
    if (!cv_.wait_for(l, timeout, [&] { return kv_.count(key) > 0; })) {
      return absl::DeadlineExceededError("key " + key);
    }
    return kv_[key];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

struct Args {
  std::string spec, data, backend = "cpu", collectives;
  int steps = 10, warmup = 2, world = 1, threads = 1;
};

bool ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--spec") a->spec = v;
    else if (k == "--data") a->data = v;
    else if (k == "--backend") a->backend = v;
    else if (k == "--steps") a->steps = std::atoi(v.c_str());
    else if (k == "--warmup") a->warmup = std::atoi(v.c_str());
    else if (k == "--world") a->world = std::atoi(v.c_str());
    else if (k == "--threads") a->threads = std::atoi(v.c_str());
    else if (k == "--collectives") a->collectives = v;
    else return false;
  }
  if (!a->collectives.empty()) return argc % 2 == 1 && a->world > 1;
  return argc % 2 == 1 && !a->spec.empty() && a->steps > 0 && a->world > 0;
}

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct RankResult {
  double seconds = 0, cpu_seconds = 0, compute = 0, comm = 0, optimizer = 0;
  double process_cpu_seconds = 0;  // the whole process's CPU time over this rank's timed steps
  int64_t tokens = 0;
  std::string transport;
  std::string error;
};

void RunRank(const fsdp8::v1::JobSpec& spec, const Args& a, int rank, fsdp8::KvStore* kv,
             RankResult* out) {
  auto comm = fsdp8::CreateCpuCommunicator(rank, a.world, kv, "bench/", "127.0.0.1",
                                           std::chrono::seconds(60), std::chrono::seconds(60),
                                           fsdp8::CpuCommOptions::FromEnvironment(),
                                           &out->transport);
  if (!comm.ok()) {
    out->error = comm.status().ToString();
    return;
  }
  std::string error;
  auto be = fsdp8::CreateBackend(a.backend, 0, &error);
  if (!be) {
    out->error = error;
    return;
  }
  absl::StatusOr<fsdp8::v1::JobSpec> resolved = fsdp8::ResolveSpec(spec, a.world, {}, false);
  if (!resolved.ok()) {
    out->error = resolved.status().ToString();
    return;
  }
  auto t = fsdp8::Trainer::Create(*resolved, rank, a.world, be.get(), comm->get());
  if (!t.ok()) {
    out->error = t.status().ToString();
    return;
  }
  std::chrono::steady_clock::time_point start;
  double cpu_start = 0, process_cpu_start = 0;
  for (int k = 0; k < a.warmup + a.steps; ++k) {
    if (k == a.warmup) {
      start = std::chrono::steady_clock::now();
      cpu_start = ThreadCpuSeconds();
      process_cpu_start = fsdp8::bench::ProcessCpuSeconds();
    }
    auto s = (*t)->Step(k, false, false);
    if (!s.ok()) {
      out->error = s.status().ToString();
      return;
    }
    if (k < a.warmup) continue;
    out->tokens += s->tokens;
    out->compute += s->compute_seconds;
    out->comm += s->comm_seconds;
    out->optimizer += s->optimizer_seconds;
  }
  out->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out->cpu_seconds = ThreadCpuSeconds() - cpu_start;
  out->process_cpu_seconds = fsdp8::bench::ProcessCpuSeconds() - process_cpu_start;
}

// --collectives: message sizes (the full buffer, bytes) and the best seconds per op and size.
constexpr int64_t kSizes[] = {8, 256, 4096, 65536, 262144, 1 << 20, 4 << 20};
constexpr int kOps = 3;  // all-gather, reduce-scatter, all-reduce

// The all-gather's and reduce-scatter's bytes per rank for a full buffer of about `bytes`
// (whole floats); the full buffer is then this times the world.
int64_t PerRankBytes(int64_t bytes, int world) { return std::max<int64_t>(4, bytes / world / 4 * 4); }

// Rank `rank`'s part of the collectives' timing; rank 0 writes (*best)[op][size index].
void RunCollectiveRank(const Args& a, int rank, fsdp8::KvStore* kv,
                       std::vector<std::vector<double>>* best, std::string* error) {
  auto comm = fsdp8::CreateCpuCommunicator(rank, a.world, kv, "bench-comm/", "127.0.0.1",
                                           std::chrono::seconds(60), std::chrono::seconds(60),
                                           fsdp8::CpuCommOptions::FromEnvironment());
  if (!comm.ok()) {
    *error = comm.status().ToString();
    return;
  }
  fsdp8::Communicator* c = comm->get();
  const int64_t max_bytes = kSizes[std::size(kSizes) - 1];
  std::vector<float> send(max_bytes / 4 + a.world), recv(max_bytes / 4 + a.world);
  for (size_t i = 0; i < send.size(); ++i) send[i] = 1e-3f * static_cast<float>(i % 97);
  for (int round = 0; round < 3; ++round) {
    for (int op = 0; op < kOps; ++op) {
      for (size_t si = 0; si < std::size(kSizes); ++si) {
        const int64_t bytes = kSizes[si];
        // Per rank: the all-gather sends bytes / world; the reduce-scatter keeps count floats of
        // the full buffer's bytes / 4; the all-reduce reduces all of it.
        const int64_t per_rank = PerRankBytes(bytes, a.world);
        const int reps = static_cast<int>(std::clamp<int64_t>((int64_t{16} << 20) / bytes, 4, 300));
        absl::Status s = c->Barrier();
        const auto t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < reps && s.ok(); ++r) {
          if (op == 0) s = c->AllGather(send.data(), recv.data(), per_rank);
          if (op == 1) s = c->ReduceScatterSum(send.data(), recv.data(), per_rank / 4);
          if (op == 2) s = c->AllReduce(send.data(), std::max<int64_t>(1, bytes / 4), fsdp8::ReduceOp::kSum);
        }
        if (s.ok()) s = c->Barrier();
        if (!s.ok()) {
          *error = s.ToString();
          return;
        }
        const double sec =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
        if (rank == 0) (*best)[op][si] = std::min((*best)[op][si], sec);
      }
    }
  }
}

int RunCollectives(const Args& a) {
  MemKv kv;
  std::vector<std::vector<double>> best(kOps, std::vector<double>(std::size(kSizes), 1e30));
  std::vector<std::string> errors(a.world);
  std::vector<std::thread> threads;
  for (int r = 0; r < a.world; ++r) {
    threads.emplace_back([&, r] { RunCollectiveRank(a, r, &kv, &best, &errors[r]); });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) {
    if (!e.empty()) {
      std::fprintf(stderr, "error: %s\n", e.c_str());
      return 1;
    }
  }
  const char* names[kOps] = {"all_gather", "reduce_scatter", "all_reduce"};
  const double n = a.world;
  std::printf("[");
  for (int op = 0; op < kOps; ++op) {
    const double f = op == 2 ? 2 * (n - 1) / n : (n - 1) / n;
    std::printf("%s\n {\"link\": \"%s\", \"op\": \"%s\", \"ranks\": %d, \"latency_us\": 0, \"points\": [",
                op ? "," : "", a.collectives.c_str(), names[op], a.world);
    for (size_t si = 0; si < std::size(kSizes); ++si) {
      const double bytes = op == 2 ? static_cast<double>(std::max<int64_t>(1, kSizes[si] / 4) * 4)
                                   : static_cast<double>(PerRankBytes(kSizes[si], a.world) * a.world);
      std::printf("%s[%.0f, %.6g]", si ? ", " : "", bytes, bytes * f / best[op][si] / 1e9);
    }
    std::printf("]}");
  }
  std::printf("\n]\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!ParseArgs(argc, argv, &a)) {
    std::fprintf(stderr,
                 "usage: %s --spec JOB.yaml --data DIR [--steps N] [--warmup N] [--world N] "
                 "[--backend cpu|cpu-ref] [--threads N]\n       %s --collectives LINK [--world N >= 2]\n",
                 argv[0], argv[0]);
    return 2;
  }
  if (!a.collectives.empty()) return RunCollectives(a);
  openblas_set_num_threads(a.threads);
  std::ifstream in(a.spec);
  std::stringstream text;
  text << in.rdbuf();
  auto spec = fsdp8::ParseSpec(absl::StrReplaceAll(text.str(), {{"DATA_DIR", a.data}}));
  if (!spec.ok()) {
    std::fprintf(stderr, "%s: %s\n", a.spec.c_str(), spec.status().ToString().c_str());
    return 2;
  }
  spec->mutable_sharding()->set_min_workers(a.world);
  spec->mutable_sharding()->set_max_workers(a.world);
  MemKv kv;
  std::vector<RankResult> results(a.world);
  std::vector<std::thread> threads;
  const double cpu0 = fsdp8::bench::ProcessCpuSeconds();
  for (int r = 0; r < a.world; ++r) {
    threads.emplace_back([&, r] { RunRank(*spec, a, r, &kv, &results[r]); });
  }
  for (auto& t : threads) t.join();
  const double cpu = fsdp8::bench::ProcessCpuSeconds() - cpu0;
  int64_t tokens = 0;
  double seconds = 0, rank_cpu = 0, rank_cpu_sum = 0;
  for (const RankResult& r : results) {
    if (!r.error.empty()) {
      std::fprintf(stderr, "error: %s\n", r.error.c_str());
      return 1;
    }
    tokens += r.tokens;
    seconds = std::max(seconds, r.seconds);
    rank_cpu = std::max(rank_cpu, r.cpu_seconds);
    rank_cpu_sum += r.cpu_seconds;
  }
  const RankResult& r0 = results[0];
  std::printf("backend %s, %d rank(s), %d BLAS thread(s), %d timed steps, collectives over %s\n",
              a.backend.c_str(), a.world, a.threads, a.steps, results[0].transport.c_str());
  // On a shared machine the wall figure also counts waiting for a core; the per-CPU-second one
  // divides by the busiest rank thread's CPU time (what the ranks would take on their own cores).
  std::printf("tokens/s %.0f (wall), %.0f (per rank-thread CPU second); process CPU %.2f s incl. "
              "setup and warmup\n",
              static_cast<double>(tokens) / seconds, static_cast<double>(tokens) / rank_cpu, cpu);
  std::printf("rank 0 per step: compute %.1f ms, comm %.1f ms, optimizer %.1f ms, wall %.1f ms\n",
              1e3 * r0.compute / a.steps, 1e3 * r0.comm / a.steps, 1e3 * r0.optimizer / a.steps,
              1e3 * r0.seconds / a.steps);
  // What the rank threads do not account for: the ranks' collective helper threads (unless
  // FSDP8_CPU_COMM_OVERLAP=0) and, with Gloo, its event-loop threads (one per rank) and the
  // kernel's TCP work for them, waking once per message of every collective.
  std::printf("timed steps, per step: process CPU %.1f ms, rank threads %.1f ms, other threads "
              "%.1f ms\n",
              1e3 * r0.process_cpu_seconds / a.steps, 1e3 * rank_cpu_sum / a.steps,
              1e3 * (r0.process_cpu_seconds - rank_cpu_sum) / a.steps);
  return 0;
}
