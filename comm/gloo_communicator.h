// GlooCommunicator: the Communicator of the CPU backend, over Gloo's TCP transport.
//
// Bootstrap: every rank creates a TCP device bound to `host`, then connects a full mesh through a
// gloo::rendezvous::Store adapter over the KvStore (keys under `prefix`), so the coordinator's
// rendezvous store is the only meeting point.
//
// Buffers are host memory (the CPU backend's "device" memory is host memory).
//
// Mismatch detection (C09): before every collective each rank all-gathers a fixed 32-byte header
// (op, count, dtype, root). If any rank disagrees, every rank returns INVALID_ARGUMENT naming the
// collective and the sizes (bytes for AllGather and Broadcast, elements for f32 collectives), e.g.
//   "all_gather #17: rank 0 has 409600 bytes, rank 1 has 409598 bytes"
// instead of hanging or returning wrong data. The header exchange of collective #k is tagged with
// k, so it only ever meets the other ranks' #k: a rank that skips a collective shows up as an op or
// count mismatch at the next one, and a rank that stops calling collectives makes the others'
// next one fail at the timeout (DEADLINE_EXCEEDED), not as a sequence mismatch.
//
// Collectives are direct exchanges between every pair of ranks over Gloo's unbound buffers: each
// rank posts every send and receive of a phase, then waits for them (deadline: the collective
// timeout).
//   AllGather: each rank sends its part to every other rank.
//   ReduceScatterSum: rank q receives the q-th slice of every rank's input and adds them in rank
//     order (0, 1, ..., W-1) in f32, so the result does not depend on arrival order.
//   AllReduce: the same over W near-equal slices of the buffer (rank p owns elements
//     [count*p/W, count*(p+1)/W)), then an all-gather of the reduced slices: every rank ends with
//     the same bits, summed in rank order.
//   Broadcast: the root sends to every rank. Barrier: the header exchange itself (a rank has
//     received every header only once every rank entered).
// Each rank moves 2 * (W-1)/W of the buffer for an all-reduce, as a ring would, in one round.
// Gloo's unbound buffers are kept for the last 64 (pointer, size) pairs used (a training step
// reuses the same few dozen buffers): destroying one waits for Gloo's event loop to let go of it,
// which cost a thread wake-up per buffer per collective (on 2 ranks of the default job, Gloo's
// threads then used about a third as much CPU as the ranks' compute).
//
// Point-to-point (Send/Recv): the two sides first send each other their sizes (so a mismatch
// fails both, C09, and a Send returns only once its Recv has started), then the data goes from
// the sender's buffer to the receiver's. Their slots are apart from the collectives' and per
// direction of the pair, numbered by the pair's transfer count.
//
// Split (comm/cpu_split.h): the sub-group connects a mesh of its own (its own TCP connections)
// through the KvStore this communicator was created with, under the sub-group's prefix, with
// the same host and timeouts.
//
// Errors: Gloo exceptions are caught here and returned as Status: timeouts DEADLINE_EXCEEDED, peer
// I/O failures UNAVAILABLE, other failures INTERNAL, each with Gloo's message. After any failure
// (or Abort) every later call fails fast with the first error.
//
// Abort (the contract of comm/communicator.h): Abort(reason) wakes every wait of the collective in
// flight (Gloo's abortWaitRecv/abortWaitSend on the buffers it registered), so a rank blocked on
// a hung peer returns ABORTED "aborted: <reason>" within milliseconds instead of at the
// collective timeout.
//
// Thread-safety: collectives from one thread; Abort() from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"
#include "comm/cpu_split.h"
#include "comm/kv_store.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}
}

namespace fsdp8 {

class GlooCommunicator : public CpuCommunicatorBase {
 public:
  // Connects the full mesh (blocks until every rank has published its address or
  // `bootstrap_timeout` passes; 0: `timeout`). `timeout` bounds each TCP connect (Gloo waits up to
  // 5x it) and each collective afterwards.
  // host: the address peers use to reach this rank. prefix: this generation's key prefix.
  // Split's sub-communicators are GlooCommunicators over the same store, host and timeouts (see
  // comm/cpu_split.h: the store must outlive them) unless set_subgroup_factory says otherwise.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(
      int rank, int world_size, KvStore* store, const std::string& prefix, const std::string& host,
      std::chrono::milliseconds timeout,
      std::chrono::milliseconds bootstrap_timeout = std::chrono::milliseconds(0));
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  absl::Status AllGather(const void* send, void* recv, int64_t bytes_per_rank) override;
  absl::Status ReduceScatterSum(const float* send, float* recv, int64_t count) override;
  absl::Status AllReduce(float* buf, int64_t count, ReduceOp op) override;
  absl::Status Broadcast(void* buf, int64_t bytes, int root) override;
  absl::Status Barrier() override;
  void Abort(const std::string& reason) override;
  absl::Status Send(const void* buf, int64_t bytes, int peer) override;
  absl::Status Recv(void* buf, int64_t bytes, int peer) override;

 private:
  using Clock = std::chrono::steady_clock;
  class Buffer;  // a cached unbound buffer (CachedBuffer)
  // A cached Gloo unbound buffer over [ptr, ptr + bytes).
  struct CachedUnbound {
    const void* ptr;
    size_t bytes;
    uint64_t last_use;
    std::unique_ptr<gloo::transport::UnboundBuffer> buf;
  };
  static constexpr size_t kCachedBuffers = 64;

  GlooCommunicator(int rank, int world_size, std::shared_ptr<gloo::Context> ctx,
                   const CpuBootstrap& bootstrap, const std::string& host);
  // Send (sending) or Recv of `bytes` at buf with `peer`.
  absl::Status Transfer(void* buf, int64_t bytes, int peer, bool sending);
  // Sends this side's size of transfer `name` to the peer and receives the peer's (sizes_).
  absl::Status ExchangeSizes(int peer, uint64_t send_slot, uint64_t recv_slot,
                             Clock::time_point deadline, const std::string& name);
  // Header exchange + mismatch check; returns the collective's sequence number in *seq.
  absl::Status Check(int op, int64_t count, int dtype, int64_t extra, uint64_t* seq);
  // data holds W slices, rank p's bytes [begin[p], begin[p+1]); this rank's is in place. Sends it
  // to every other rank and receives theirs into place.
  absl::Status GatherSlices(void* data, const std::vector<int64_t>& begin, uint64_t slot,
                            const std::string& what);
  // out (the length of this rank's slice) = op over ranks 0..W-1, in that order, of slice `rank`
  // of every rank's `data` (f32 elements [begin[p], begin[p+1]) are slice p). out may alias data.
  absl::Status ReduceSlices(const float* data, const std::vector<int64_t>& begin, ReduceOp op,
                            float* out, uint64_t slot, const std::string& what);
  // Waits for `n` receives (recv) or sends of `b` until `deadline`; ABORTED once aborted.
  absl::Status Wait(Buffer& b, bool recv, int n, Clock::time_point deadline,
                    const std::string& what);
  // The unbound buffer over [ptr, ptr + bytes), from the cache (the least recently used one
  // evicted when it is full) or new. Gloo's UnboundBuffer destructor waits, yielding the CPU, until
  // the event loop has let go of it: one wake-up per buffer per collective when buffers lived for
  // one collective only. Every cached buffer is known to Abort.
  gloo::transport::UnboundBuffer* CachedBuffer(const void* ptr, size_t bytes);
  void Track(gloo::transport::UnboundBuffer* b) ABSL_LOCKS_EXCLUDED(mu_);
  void Untrack(gloo::transport::UnboundBuffer* b) ABSL_LOCKS_EXCLUDED(mu_);
  // Records the first error (later ones are dropped), wakes every wait in flight; returns the
  // first error.
  absl::Status Fail(absl::Status s) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Failed() const ABSL_LOCKS_EXCLUDED(mu_);

  const int rank_;
  const int world_size_;
  std::shared_ptr<gloo::Context> ctx_;
  std::chrono::milliseconds timeout_;
  uint64_t seq_ = 0;
  std::atomic<bool> failed_{false};
  mutable absl::Mutex mu_;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::vector<gloo::transport::UnboundBuffer*> live_ ABSL_GUARDED_BY(mu_);  // the cached buffers
  std::vector<CachedUnbound> cache_;  // collectives' thread only
  uint64_t uses_ = 0;
  std::vector<int64_t> headers_;  // the header exchange's buffer: 4 words per rank
  std::vector<float> parts_;      // ReduceSlices' receive buffer
  std::vector<int64_t> sends_, recvs_;  // point-to-point transfers by peer
  int64_t sizes_[2] = {0, 0};           // a transfer's sizes: this side's, the peer's
};

}  // namespace fsdp8
