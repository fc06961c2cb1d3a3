// Communicator: the collectives one rank of a generation takes part in (Gloo on the CPU backend,
// NCCL on CUDA). Buffers are device pointers of the matching Backend.
//
// Every rank must call the same collectives in the same order with the same counts and dtypes.
// A collective whose counts disagree across ranks fails with an error naming the collective and
// both sizes (C09) instead of hanging; a peer that dies or stops answering fails the collective
// within the configured timeout (C10). After any failure the communicator is unusable: Abort() it
// and build a new one for the next generation.
//
// The abort contract (every implementation: Gloo, NCCL): Abort(reason) may be called from any
// thread, at any time, any number of times (the first reason is kept). A collective blocked in
// the communicator when it is called returns within about a second (not at the collective
// timeout), whatever the peers do, and every later call fails fast: both with ABORTED and a
// message containing the reason. It is how a worker gives up a collective on a hung peer once the
// coordinator has told it to (Gloo: the waits of the collective in flight are woken; NCCL:
// ncclCommAbort ends the kernels in flight and the host waits see the abort).
//
// Thread-safety: collectives are issued by one thread (the trainer's). Abort() may be called from
// any thread (the watchdog, the worker's session reader).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp8 {

enum class ReduceOp : uint8_t { kSum = 0, kMax = 1 };

// Bytes of this rank's enqueued collectives since the communicator was built, by kind: for an
// all-gather the gathered output (world_size * bytes_per_rank), for a reduce-scatter its f32
// input (world_size * count * 4), for an all-reduce its buffer (count * 4) — the sizes FSDP
// accounting uses (a unit's full buffer per gather), independent of the algorithm's wire traffic.
struct CommBytes {
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t all_reduce = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // recv (world_size * bytes_per_rank) = concatenation over ranks of send (bytes_per_rank).
  // Used as uint8 for FP8 weights and as raw bytes for bf16/f32 buffers. bytes_per_rank may be 0.
  virtual absl::Status AllGather(const void* send, void* recv, int64_t bytes_per_rank) = 0;
  // recv (count) = sum over ranks of send[rank * count, (rank + 1) * count), f32, accumulated in
  // f32 (C12). send (world_size * count).
  virtual absl::Status ReduceScatterSum(const float* send, float* recv, int64_t count) = 0;
  // In place over `count` f32 elements.
  virtual absl::Status AllReduce(float* buf, int64_t count, ReduceOp op) = 0;
  virtual absl::Status Broadcast(void* buf, int64_t bytes, int root) = 0;
  virtual absl::Status Barrier() = 0;
  // See the abort contract above.
  virtual void Abort(const std::string& reason) = 0;

  // Deferred-wait variants for compute/communication overlap (FSDP prefetch): the collective is
  // ordered after every compute op enqueued before the call, as above, but ops enqueued later do
  // *not* wait for it until Wait(ticket) is called; recv must not be read (and send/recv not
  // freed or rewritten) before that. Each ticket is waited for exactly once. Collectives complete
  // in call order, so waiting for a ticket also covers every collective called before it.
  // The default implementations run the blocking collective and return ticket 0 (Wait no-op).
  virtual absl::StatusOr<int64_t> AllGatherAsync(const void* send, void* recv,
                                                 int64_t bytes_per_rank) {
    return TicketOr(AllGather(send, recv, bytes_per_rank), 0);
  }
  virtual absl::StatusOr<int64_t> ReduceScatterSumAsync(const float* send, float* recv,
                                                        int64_t count) {
    return TicketOr(ReduceScatterSum(send, recv, count), 0);
  }
  virtual void Wait(int64_t ticket) { (void)ticket; }

  // Seconds the backend's compute stream stood waiting for collectives since the last call: the
  // exposed (not overlapped) communication, measured with device events (CUDA). 0 for
  // communicators whose collectives block the calling thread (Gloo): time them on the host.
  // Call after the compute stream was synchronized; blocks until the recorded waits are over.
  virtual double ConsumeExposedSeconds() { return 0.0; }

  // Returns once every collective called so far is known to have matched across ranks (C09):
  // communicators that check asynchronously finish their outstanding checks here (the trainer
  // calls it at the end of each step, so no step reports success over a mismatched collective).
  // The error names the collective and the sizes; the communicator is then aborted.
  virtual absl::Status Verify() { return absl::OkStatus(); }

  // Counters of AllGather / ReduceScatterSum / AllReduce calls that were accepted (CommBytes).
  const CommBytes& bytes() const { return bytes_; }

 protected:
  // An async variant's result: `ticket` when the collective was accepted, else its error.
  static absl::StatusOr<int64_t> TicketOr(const absl::Status& s, int64_t ticket) {
    if (!s.ok()) return s;
    return ticket;
  }
  CommBytes bytes_;
};

}  // namespace fsdp8
