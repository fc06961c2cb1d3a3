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
#include <memory>
#include <string>
#include <utility>
#include <vector>

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

// One rank's place in a Split (Communicator::Split): the sub-group of the ranks that passed its
// color, ranked by (key, old rank).
struct SplitPlan {
  int color = 0;
  int rank = 0;                  // in the sub-group
  std::vector<int> members;      // the sub-group's old ranks, in new-rank order
  int64_t split_seq = 0;         // this parent's splits so far, this one included (1, 2, ...)
  int world_size() const { return static_cast<int>(members.size()); }
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

  // Sub-communicators (hybrid sharding: shard groups and replica groups of one world).
  //
  // A collective over this communicator: every rank calls it, in the same order as its other
  // collectives (a rank that calls another collective instead fails as a C09 mismatch). The ranks
  // that pass the same `color` form a new communicator, ranked by (`key`, then rank here): the
  // member with the smallest key is rank 0. `color` must be >= 0 on every rank (any int `key`).
  // The result follows this header's whole contract (C09 checks, timeouts, the abort contract)
  // and is independent of this communicator afterwards: either may be destroyed first, and
  // aborting (or a failure of) one does not abort the other (the owner aborts each it wants
  // ended). Its CommBytes start at 0; the split's own exchange counts in neither.
  // Errors: INVALID_ARGUMENT for a negative color (CPU: on every rank, naming the rank; NCCL: on
  // the rank that passed it, whose peers then time out), the errors of a failed collective here
  // (this communicator then fails as after any collective), and those of building the
  // sub-communicator (its rendezvous or initialisation: DEADLINE_EXCEEDED, UNAVAILABLE, ...).
  // CPU communicators rendezvous the sub-group through the KvStore they were created with (see
  // comm/cpu_split.h: it must outlive them). UNIMPLEMENTED for communicators without sub-groups.
  // Thread-safety: as a collective (the collectives' thread).
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) {
    (void)color;
    (void)key;
    return absl::UnimplementedError("this communicator cannot split");
  }

  // Point-to-point: this rank and `peer` only (the other ranks take no part and are not ordered
  // with it). Send moves `bytes` bytes from buf to peer's matching Recv, which writes them into
  // its buf; the n-th Send to a peer matches that peer's n-th Recv from this rank. Both block:
  // Send until buf may be reused and the peer's matching Recv has started (so order them that
  // each Send meets its Recv, e.g. even ranks send first in a ring: a ring where every rank
  // sends first deadlocks), Recv until the data is in buf (NCCL: stream-ordered as its blocking
  // collectives: compute ops enqueued later see the data). bytes may be 0 (it still meets the
  // peer). buf is device memory of the matching Backend.
  // Errors: INVALID_ARGUMENT for a peer out of [0, world_size) or equal to rank() or negative
  // bytes (the communicator stays usable); a size that differs between the Send and its Recv
  // fails both (INVALID_ARGUMENT naming both ranks and sizes) as C09 mismatches do, where the
  // transport checks (shared memory, Gloo, NCCL unless its checks are off); a peer that does
  // not answer: DEADLINE_EXCEEDED at the collective timeout; aborted: ABORTED (the abort
  // contract). Any of these but the first make the communicator unusable, as a failed
  // collective. UNIMPLEMENTED for communicators without point-to-point.
  // Thread-safety: as a collective (the collectives' thread).
  virtual absl::Status Send(const void* buf, int64_t bytes, int peer) {
    (void)buf, (void)bytes, (void)peer;
    return absl::UnimplementedError("this communicator has no point-to-point Send");
  }
  virtual absl::Status Recv(void* buf, int64_t bytes, int peer) {
    (void)buf, (void)bytes, (void)peer;
    return absl::UnimplementedError("this communicator has no point-to-point Recv");
  }

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
  // AllReduce with the deferred wait above: buf (count f32 elements, in place) must not be read,
  // rewritten or freed before Wait(ticket). Counts in CommBytes::all_reduce as AllReduce does.
  virtual absl::StatusOr<int64_t> AllReduceAsync(float* buf, int64_t count, ReduceOp op) {
    return TicketOr(AllReduce(buf, count, op), 0);
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
  // INVALID_ARGUMENT unless `peer` is another rank of this communicator and bytes >= 0; `what`
  // ("send", "recv") names the call.
  absl::Status CheckPeer(const char* what, int peer, int64_t bytes) const {
    if (peer < 0 || peer >= world_size() || peer == rank()) {
      return absl::InvalidArgumentError(std::string(what) + ": peer " + std::to_string(peer) +
                                        " is not another rank of " +
                                        std::to_string(world_size()) + " (this is rank " +
                                        std::to_string(rank()) + ")");
    }
    if (bytes < 0) {
      return absl::InvalidArgumentError(std::string(what) + ": negative size " +
                                        std::to_string(bytes));
    }
    return absl::OkStatus();
  }
  // The exchange of a Split over host memory (the CPU communicators): all-gathers every rank's
  // (color, key) through AllGather (so C09 and the timeouts apply; not counted in CommBytes)
  // and plans this rank's sub-group (PlanSplit).
  absl::StatusOr<SplitPlan> ExchangeSplit(int color, int key);
  // This rank's plan from every rank's (color, key) (all[r] is rank r's); INVALID_ARGUMENT
  // naming the first rank with a negative color.
  static absl::StatusOr<SplitPlan> PlanSplit(const std::vector<std::pair<int, int>>& all,
                                             int rank, int64_t split_seq);

  CommBytes bytes_;
  int64_t splits_ = 0;  // Splits started (the collectives' thread)
};

}  // namespace fsdp8
