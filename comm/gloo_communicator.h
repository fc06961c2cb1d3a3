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
// ReduceScatterSum is an f32 all-reduce (sum, f32 accumulation) of the whole send buffer followed by
// keeping this rank's slice: simple and exact-order deterministic for a given world size; it moves
// ~world_size times more bytes than a true reduce-scatter, acceptable for the CPU reference.
//
// Errors: Gloo exceptions are caught here and returned as Status: timeouts DEADLINE_EXCEEDED, peer
// I/O failures UNAVAILABLE, other failures INTERNAL, each with Gloo's message. After any failure
// (or Abort) every later call fails fast with the first error.
//
// Thread-safety: collectives from one thread; Abort() from any thread. Abort does not interrupt a
// collective already in flight: that one ends at the collective timeout at the latest.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/kv_store.h"

namespace gloo {
class Context;
}

namespace fsdp8 {

class GlooCommunicator : public Communicator {
 public:
  // Connects the full mesh (blocks until every rank has published its address or
  // `bootstrap_timeout` passes; 0: `timeout`). `timeout` bounds each TCP connect (Gloo waits up to
  // 5x it) and each collective afterwards.
  // host: the address peers use to reach this rank. prefix: this generation's key prefix.
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

 private:
  GlooCommunicator(int rank, int world_size, std::shared_ptr<gloo::Context> ctx,
                   std::chrono::milliseconds timeout);
  // Header exchange + mismatch check; returns the collective's sequence number in *seq.
  absl::Status Check(int op, int64_t count, int dtype, int64_t extra, uint64_t* seq);
  absl::Status Fail(absl::Status s);
  absl::Status Failed() const;

  const int rank_;
  const int world_size_;
  std::shared_ptr<gloo::Context> ctx_;
  std::chrono::milliseconds timeout_;
  uint64_t seq_ = 0;
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  absl::Status error_;  // guarded by mu_
};

}  // namespace fsdp8
