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
// Broadcast, Barrier, Verify, Split, Send, Recv) waits for every collective called before it and for itself.
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
// Split(color, key) waits for every collective called before it (they run first, in order),
// then splits the wrapped communicator on the helper thread and wraps the sub-communicator in an
// AsyncCommunicator of its own (its own helper thread): it overlaps as this one does, and is
// independent of it (either may be destroyed or aborted first). A failed split is returned, not
// recorded here: this communicator is then as the wrapped one is (failed when the exchange
// failed; usable when only the sub-group's rendezvous did). Send and Recv are blocking
// calls: they wait for every collective called before them, then run on the helper thread.
// AllReduceAsync is deferred as AllGatherAsync is.
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

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
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
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override;
  absl::Status Send(const void* buf, int64_t bytes, int peer) override;
  absl::Status Recv(void* buf, int64_t bytes, int peer) override;

  absl::StatusOr<int64_t> AllReduceAsync(float* buf, int64_t count, ReduceOp op) override;
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
  absl::StatusOr<int64_t> Enqueue(std::function<absl::Status()> run) ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks (mu_ released while it waits) until `ticket`'s collective, and every one before it,
  // has finished; returns the seconds it blocked.
  double WaitLocked(int64_t ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for `ticket`'s collective (and every one before it); the first error when any of them
  // failed, or ticket's own error.
  absl::Status Finish(absl::StatusOr<int64_t> ticket) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs one collective on the helper thread; an exception becomes its status.
  static absl::Status Run(const std::function<absl::Status()>& run);
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  std::unique_ptr<Communicator> inner_;  // rank() and world_size() are plain getters
  double exposed_seconds_ = 0;  // the caller's thread only

  mutable absl::Mutex mu_;
  absl::CondVar queued_cv_;  // the helper waits for work
  absl::CondVar done_cv_;    // callers wait for tickets
  std::deque<std::pair<int64_t, std::function<absl::Status()>>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t issued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace fsdp8
