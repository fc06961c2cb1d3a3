// RankFailureTimer: fails rank 0 of a running job (a signal to its worker process: SIGSTOP for a
// hung rank, SIGKILL for a dead one) once the job's event stream reports it RUNNING at a given
// step, and times the recovery from the events that follow: the first RECOVERING event, the first
// RUNNING event after it, and the first step (an event with a loss) after that.
//
// Feed it every event of the job's WatchJob stream (OnEvent). Header-only; needs fsdp8_proto.
// Not thread-safe: the thread that reads the stream owns it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "fsdp8/v1/jobs.pb.h"
#include "gtest/gtest.h"
#include "tests/support/process.h"

namespace fsdp8::testing {

class RankFailureTimer {
 public:
  using Clock = std::chrono::steady_clock;
  // The worker that holds rank 0 of a job, and its process (null: not found, a test failure;
  // the next event tries again).
  struct Rank0 {
    std::string worker_id;
    ChildProcess* process = nullptr;
  };
  using FindRank0 = std::function<Rank0(const std::string& job_id)>;

  // Sends `signal` to rank 0's process (found by find_rank0) at the first RUNNING event of step
  // >= at_step.
  RankFailureTimer(int signal, int64_t at_step, FindRank0 find_rank0)
      : signal_(signal), at_step_(at_step), find_rank0_(std::move(find_rank0)) {}

  void OnEvent(const v1::JobEvent& ev) {
    const Clock::time_point now = Clock::now();
    if (victim_process_ == nullptr) {
      if (ev.step() >= at_step_ && ev.state() == v1::JOB_STATE_RUNNING) Fail(ev.job_id());
      return;
    }
    if (ev.state() == v1::JOB_STATE_RECOVERING && recovering_ == Clock::time_point()) {
      recovering_ = now;
      cause_ = ev.message();
    }
    if (recovering_ != Clock::time_point() && ev.state() == v1::JOB_STATE_RUNNING &&
        running_ == Clock::time_point()) {
      running_ = now;
    }
    if (running_ != Clock::time_point() && ev.loss() > 0 && first_step_ == Clock::time_point()) {
      first_step_ = now;
    }
  }

  // Whether the signal was sent; the failed worker's id and process; the job's id.
  bool failed() const { return victim_process_ != nullptr; }
  const std::string& victim() const { return victim_; }
  ChildProcess* victim_process() const { return victim_process_; }
  const std::string& job_id() const { return job_id_; }
  // The first RECOVERING event's message (why the coordinator restarts the job).
  const std::string& cause() const { return cause_; }
  // When the first RECOVERING event, the first RUNNING event after it and the first step after
  // that arrived; Clock::time_point() until then.
  Clock::time_point recovering() const { return recovering_; }
  Clock::time_point running() const { return running_; }
  Clock::time_point first_step() const { return first_step_; }
  // Seconds from the signal to t.
  double SecondsTo(Clock::time_point t) const {
    return std::chrono::duration<double>(t - failed_at_).count();
  }

 private:
  void Fail(const std::string& job_id) {
    const Rank0 r = find_rank0_(job_id);
    ASSERT_NE(r.process, nullptr) << "no process for worker '" << r.worker_id << "'";
    r.process->Signal(signal_);
    failed_at_ = Clock::now();
    victim_ = r.worker_id;
    victim_process_ = r.process;
    job_id_ = job_id;
  }

  const int signal_;
  const int64_t at_step_;
  const FindRank0 find_rank0_;
  std::string victim_, job_id_, cause_;
  ChildProcess* victim_process_ = nullptr;
  Clock::time_point failed_at_, recovering_, running_, first_step_;
};

}  // namespace fsdp8::testing
