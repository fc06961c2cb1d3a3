// AsyncCommunicator: gives a communicator whose collectives block the calling thread (shared
// memory, Gloo) the deferred-wait variants of comm/communicator.h, by running every collective
// on one helper thread in call order. FSDP's prefetched all-gathers and its reduce-scatters then
// overlap the rank's compute, and a rank that reaches a collective ahead of its peers keeps
// computing instead of waiting there: on CPU ranks, whose per-block compute times differ by the
// host's jitter, the waits at the many per-unit collectives of a step shrink to the lag that is
// left when the data is needed (bench/RESULTS.md).
//
// Order: collectives run on the helper thread in the order they were called, so the ranks'
// sequences still match (C09). A blocking call (AllGather, ReduceScatterSum, AllReduce,
// Broadcast, Barrier, Verify) waits for every collective called before it and for itself.
//
// Errors: a failed collective's status is kept as this communicator's first error; every later
// call then fails fast with it (a deferred call when it is issued, a blocking call on return),
// and Verify() returns it. An exception thrown by the wrapped communicator becomes such an error
// (std::bad_alloc: RESOURCE_EXHAUSTED, others INTERNAL) instead of leaving the helper thread.
// Wait(ticket) returns once the collective has finished, failed or not (so no later than the
// wrapped communicator's collective timeout); the recv buffer of a failed collective is then
// undefined, and the step that used it fails at its Verify() (the trainer calls it at the end of
// each step).
//
// Abort(reason) records ABORTED "aborted: <reason>" as the first error (unless one is recorded)
// and forwards to the wrapped communicator at once (from any thread, its contract): the
// collective running on the helper thread returns, every queued one is skipped, and every later
// call fails fast.
//
// ConsumeExposedSeconds(): seconds the caller stood blocked in Wait() since the last call. The
// time inside blocking calls is the caller's to measure, as for a blocking communicator. For
// communicators whose collectives block (their own figure is always 0); not for NCCL.
//
// Thread-safety: collectives, Wait, Verify and ConsumeExposedSeconds from one thread (the
// trainer's); Abort from any thread. Once wrapped, the wrapped communicator's collectives run on
// the helper thread only; its Abort may come from any thread, and it is destroyed with this
// object after the helper thread has stopped.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"

namespace fsdp8 {

class AsyncCommunicator : public Communicator {
 public:
  // Starts the helper thread. `inner` must not be null.
  explicit AsyncCommunicator(std::unique_ptr<Communicator> inner);
  // Runs the collectives still queued (their buffers are the callers' to keep alive until their
  // tickets were waited for, so normally none are left), then stops the helper thread.
  ~AsyncCommunicator() override;
  AsyncCommunicator(const AsyncCommunicator&) = delete;
  AsyncCommunicator& operator=(const AsyncCommunicator&) = delete;

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  absl::Status AllGather(const void* send, void* recv, int64_t bytes_per_rank) override;
  absl::Status ReduceScatterSum(const float* send, float* recv, int64_t count) override;
  absl::Status AllReduce(float* buf, int64_t count, ReduceOp op) override;
  absl::Status Broadcast(void* buf, int64_t bytes, int root) override;
  absl::Status Barrier() override;
  void Abort(const std::string& reason) override;

  absl::StatusOr<int64_t> AllGatherAsync(const void* send, void* recv,
                                         int64_t bytes_per_rank) override;
  absl::StatusOr<int64_t> ReduceScatterSumAsync(const float* send, float* recv,
                                                int64_t count) override;
  void Wait(int64_t ticket) override;
  double ConsumeExposedSeconds() override;
  absl::Status Verify() override;

 private:
  // Queues `run` (it runs on the helper thread unless an earlier collective failed) and returns
  // its ticket (> 0); the first error instead when one is recorded.
  absl::StatusOr<int64_t> Enqueue(std::function<absl::Status()> run);
  // Blocks on `l` (holding mu_) until `ticket`'s collective, and every one before it, has
  // finished; returns the seconds it blocked.
  double WaitLocked(std::unique_lock<std::mutex>& l, int64_t ticket);
  // Waits for `ticket`'s collective (and every one before it); the first error when any of them
  // failed, or ticket's own error.
  absl::Status Finish(absl::StatusOr<int64_t> ticket);
  // Runs one collective on the helper thread; an exception becomes its status.
  static absl::Status Run(const std::function<absl::Status()>& run);
  void Loop();

  std::unique_ptr<Communicator> inner_;  // rank() and world_size() are plain getters
  double exposed_seconds_ = 0;  // the caller's thread only

  mutable std::mutex mu_;
  std::condition_variable queued_cv_;  // the helper waits for work
  std::condition_variable done_cv_;    // callers wait for tickets
  std::deque<std::pair<int64_t, std::function<absl::Status()>>> queue_;  // guarded by mu_
  int64_t issued_ = 0;                                                  // guarded by mu_
  int64_t completed_ = 0;                                               // guarded by mu_
  absl::Status error_;                                                  // guarded by mu_
  bool stop_ = false;                                                   // guarded by mu_
  std::thread thread_;
};

}  // namespace fsdp8
