// OpProfile: GPU time per Backend op on the compute stream, for finding where a step's time goes
// (FSDP8_PROFILE_OPS=1 in a worker's environment). Each top-level op call records a CUDA event
// before and after its work; Harvest() adds the elapsed times of completed pairs per op name
// (and GEMM shape); every `report_every_s` seconds of wall time the table since the last report
// goes to stderr with the sum of op times against the wall time (the rest is the stream idle
// or waiting on a collective: host-bound gaps and exposed communication).
//
// Cost: two event records per op (about 2 x 2 us of host time); off unless enabled.
// Thread-safety: one thread (the backend's).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace fsdp8::cuda {

class OpProfile {
 public:
  OpProfile(cudaStream_t stream, int device, double report_every_s)
      : stream_(stream), device_(device), every_s_(report_every_s), last_(Clock::now()) {}
  ~OpProfile() {
    // A harvested op's end event lives on as its successor's prev_b, or as last_b_.
    if (!pending_.empty() && pending_.front().prev_b != nullptr) {
      cudaEventDestroy(pending_.front().prev_b);
    } else if (pending_.empty() && last_b_ != nullptr) {
      cudaEventDestroy(last_b_);
    }
    for (auto& p : pending_) {
      cudaEventDestroy(p.a);
      cudaEventDestroy(p.b);
    }
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  }

  // Nested ops (an op calling another) count once, under the outermost name.
  bool Begin(std::string name) {
    if (depth_++ > 0) return false;
    cudaSetDevice(device_);  // events belong to the stream's device (several backends per thread)
    Pair p{std::move(name), Take(), Take(), last_b_, Clock::now(), 0.0};
    cudaEventRecord(p.a, stream_);
    pending_.push_back(std::move(p));
    return true;
  }
  void End(bool outer) {
    --depth_;
    if (!outer) return;
    Pair& p = pending_.back();
    // The GPU reached the op's start while the host was still enqueueing the op: its GPU time
    // then includes the stream idling on the host.
    p.starved = cudaEventQuery(p.a) == cudaSuccess;
    cudaEventRecord(p.b, stream_);
    last_b_ = p.b;
    p.host_ms = 1e3 * std::chrono::duration<double>(Clock::now() - p.t0).count();
    if (pending_.size() > 8192) Harvest(/*block=*/true);
  }

  // Adds the completed pairs (all of them when block) and reports when due.
  void Harvest(bool block) {
    if (depth_ > 0) return;  // inside an op: its own pair is not closed yet
    size_t done = 0;
    for (; done < pending_.size(); ++done) {
      Pair& p = pending_[done];
      if (!block && cudaEventQuery(p.b) != cudaSuccess) break;
      float ms = 0;
      cudaEventSynchronize(p.b);
      cudaEventElapsedTime(&ms, p.a, p.b);
      Stat& s = stats_[p.name];
      if (p.prev_b != nullptr) {
        float gap = 0;
        if (cudaEventElapsedTime(&gap, p.prev_b, p.a) == cudaSuccess) s.gap_ms += gap;
        pool_.push_back(p.prev_b);  // each end event is freed as its successor's prev_b
      }
      s.calls += 1;
      s.ms += ms;
      s.host_ms += p.host_ms;
      s.starved += p.starved ? 1 : 0;
      pool_.push_back(p.a);
    }
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(done));
    const double wall = std::chrono::duration<double>(Clock::now() - last_).count();
    if (wall >= every_s_) Report(wall);
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Pair {
    std::string name;
    cudaEvent_t a, b;
    cudaEvent_t prev_b;    // the previous op's end (null for the first): the stream gap before
    Clock::time_point t0;  // host time at the op's start
    double host_ms;        // host time inside the op call
    bool starved = false;
  };
  struct Stat {
    int64_t calls = 0;
    double ms = 0;
    double host_ms = 0;
    int64_t starved = 0;
    double gap_ms = 0;  // stream time between the previous op's end and this op's start
  };

  cudaEvent_t Take() {
    if (!pool_.empty()) {
      cudaEvent_t e = pool_.back();
      pool_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    cudaEventCreate(&e);
    return e;
  }

  void Report(double wall_s) {
    std::vector<std::pair<std::string, Stat>> rows(stats_.begin(), stats_.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& x, const auto& y) { return x.second.ms > y.second.ms; });
    double total = 0, host = 0, gaps = 0;
    for (auto& r : rows) {
      total += r.second.ms;
      host += r.second.host_ms;
      gaps += r.second.gap_ms;
    }
    std::fprintf(stderr,
                 "fsdp8 op profile: %.3f s wall, %.3f s in ops on the GPU (%.1f%%), %.3f s of host "
                 "time inside op calls, %.3f s of stream gaps between ops (waits on collectives, host-bound "
                 "gaps, step boundaries)\n",
                 wall_s, total * 1e-3, wall_s > 0 ? 100.0 * total * 1e-3 / wall_s : 0.0,
                 host * 1e-3, gaps * 1e-3);
    for (auto& r : rows) {
      std::fprintf(stderr, "  %-48s %8lld calls %10.2f ms %6.1f%% %9.1f us/call  host %7.1f us/call  stream idle at start %3.0f%%  gap before %8.2f ms\n",
                   r.first.c_str(), static_cast<long long>(r.second.calls), r.second.ms,
                   total > 0 ? 100.0 * r.second.ms / total : 0.0,
                   r.second.calls ? 1e3 * r.second.ms / r.second.calls : 0.0,
                   r.second.calls ? 1e3 * r.second.host_ms / r.second.calls : 0.0,
                   r.second.calls ? 100.0 * r.second.starved / r.second.calls : 0.0,
                   r.second.gap_ms);
    }
    std::fflush(stderr);
    stats_.clear();
    last_ = Clock::now();
  }

  cudaStream_t stream_;
  int device_;
  double every_s_;
  Clock::time_point last_;
  int depth_ = 0;
  cudaEvent_t last_b_ = nullptr;  // the newest op's end event
  std::vector<Pair> pending_;
  std::vector<cudaEvent_t> pool_;
  std::map<std::string, Stat> stats_;
};

// RAII scope for one op; a null profile costs a branch.
class OpScope {
 public:
  OpScope(OpProfile* p, const char* name) : p_(p) {
    if (p_) outer_ = p_->Begin(name);
  }
  OpScope(OpProfile* p, const char* name, int64_t m, int64_t n, int64_t k) : p_(p) {
    if (p_) {
      outer_ = p_->Begin(std::string(name) + " " + std::to_string(m) + "x" + std::to_string(n) +
                         "x" + std::to_string(k));
    }
  }
  ~OpScope() {
    if (p_) p_->End(outer_);
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  OpProfile* p_;
  bool outer_ = false;
};

}  // namespace fsdp8::cuda
