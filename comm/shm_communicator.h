// SharedMemoryCommunicator: the Communicator of CPU ranks that all run on one machine (one
// kernel, one /dev/shm, one process-id namespace): collectives through a POSIX shared-memory
// segment instead of TCP, with no helper threads. On 2 ranks of the default job this halves the
// step's communication time against Gloo over 127.0.0.1 and frees the CPU that Gloo's event-loop
// threads used (bench/RESULTS.md).
//
// Segment: a control block (barrier words, the ranks' process ids and C09 headers), then one slot
// of kSlotBytes per rank; rank p writes only slot p. A collective runs in rounds of at most a
// slot per rank: every rank writes its part of the round into its slot, meets the others at a
// barrier, reads the slots it needs, and meets them at a second barrier (so no slot is rewritten
// before every rank has read it). The first barrier of a collective also publishes the headers,
// which every rank then checks (comm/collective_check.h: the same checks and messages as
// GlooCommunicator). Results are those of GlooCommunicator bit for bit: reductions add (or take
// the max of) the ranks' values in rank order 0, 1, ..., W-1 in f32, and every rank of an
// all-reduce ends with the same bits.
//
// Point-to-point (Send/Recv): the ordered pair (sender p, receiver q) has its own words in the
// control block: each side publishes its transfer number and size, waits for the other's and
// compares them (a mismatch fails both, C09); the data then goes through the sender's slot in
// chunks of at most a slot, each copied out by the receiver before the next is written, so the
// Send returns once the receiver has the data. Other ranks take no part; the sender's slot is
// free for it because every collective ends with a meeting after its reads.
//
// Split (comm/cpu_split.h): the sub-group gets a segment of its own, rendezvoused through the
// KvStore this communicator was created with under the sub-group's prefix.
//
// Waits (barriers and point-to-point) spin for about 50 us, then sleep on a futex of the segment in slices of at most
// 20 ms, between which they check this communicator's abort flag, the collective's deadline, the
// segment's "a rank failed" word and whether every peer process is still alive.
//
// Errors: a collective not completed within `timeout`: DEADLINE_EXCEEDED; a peer process that is
// gone, or a peer whose communicator failed or was aborted: UNAVAILABLE naming that rank; a
// mismatched collective (C09): INVALID_ARGUMENT on every rank. Any failure (and Abort) marks the
// segment, so the peers' collectives fail within a slice instead of at the timeout, and makes
// every later call of this communicator fail fast with the first error.
//
// Abort (the contract of comm/communicator.h): Abort(reason) sets the flag and wakes the futex;
// a collective blocked here returns ABORTED "aborted: <reason>" within microseconds.
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

namespace fsdp8 {

class SharedMemoryCommunicator : public CpuCommunicatorBase {
 public:
  // Bytes of each rank's slot: the most one round of a collective moves per rank.
  static constexpr int64_t kSlotBytes = int64_t{4} << 20;
  // The most ranks one segment serves.
  static constexpr int kMaxRanks = 64;
  struct Control;  // the segment's control block (shm_communicator.cc)

  // The identity of this machine as the shared-memory path needs it to match across ranks: the
  // kernel's boot id and this process's mount and process-id namespaces (from /proc); "" when
  // /proc cannot tell.
  static std::string MachineIdentity();

  // Rendezvous through `store` (keys under prefix + "shm/"): every rank publishes `machine`; rank
  // 0 creates the segment (with its pages reserved, so a full /dev/shm fails here, not at a
  // write) when every rank published its own non-empty identity and world_size <= kMaxRanks, the
  // others map it and confirm, and rank 0 removes its name once all have (the mappings stay).
  // Returns the communicator when every rank mapped the segment; FAILED_PRECONDITION, on every
  // rank alike and with nothing left behind, when the ranks do not share this machine (the
  // caller then uses Gloo); DEADLINE_EXCEEDED / CANCELLED / UNAVAILABLE from the rendezvous
  // (bootstrap_timeout per wait; 0: timeout). world_size 1 needs no peers and no store.
  // Split's sub-communicators are SharedMemoryCommunicators over the same store (see
  // comm/cpu_split.h: it must outlive them) unless set_subgroup_factory says otherwise.
  static absl::StatusOr<std::unique_ptr<SharedMemoryCommunicator>> Create(
      int rank, int world_size, KvStore* store, const std::string& prefix,
      std::chrono::milliseconds timeout,
      std::chrono::milliseconds bootstrap_timeout = std::chrono::milliseconds(0),
      const std::string& machine = MachineIdentity());
  ~SharedMemoryCommunicator() override;

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
  // The collective a wait belongs to; its name ("all_gather #17", "send #2 from rank 0 to rank
  // 1") is built only for an error.
  struct Call {
    int op;
    uint64_t seq;
    int from = -1;  // point-to-point: the sender and the receiver
    int to = -1;
    std::string Name() const;
  };

  SharedMemoryCommunicator(int rank, int world_size, void* base, size_t bytes,
                           const CpuBootstrap& bootstrap);
  uint8_t* Slot(int p) const;
  // Runs collective (op, count, dtype, extra) in `rounds` rounds (0: the header exchange alone):
  // round k calls write(k) (this rank's part into its slot), meets the peers, [round 0: checks
  // the headers], calls read(k) (from the slots), meets them again.
  template <typename Write, typename Read>
  absl::Status Run(int op, int64_t count, int dtype, int64_t extra, int64_t rounds, Write write,
                   Read read);
  // Meets every rank of the segment; `call` names the collective in errors.
  absl::Status Meet(Clock::time_point deadline, const Call& call);
  // Waits until done() (spinning, then sleeping on futex `word`, which the side that makes
  // done() true bumps, with `waiters` counting the sleepers) or until Health fails.
  template <typename Done>
  absl::Status Await(std::atomic<uint32_t>* word, std::atomic<uint32_t>* waiters, Done done,
                     Clock::time_point deadline, const Call& call);
  // Send (sending) or Recv of `bytes` at buf with `peer`.
  absl::Status Transfer(void* buf, int64_t bytes, int peer, bool sending);
  // Transfer `call` (from, to, number): publishes this side's size, waits for the other side's
  // and compares them (C09).
  absl::Status MatchSizes(int64_t bytes, bool sending, const Call& call,
                          Clock::time_point deadline);
  // The data of transfer `call` through the sender's slot, a slot at a time (an empty transfer
  // passes one empty chunk); the sender returns once the receiver took the last chunk.
  absl::Status MoveChunks(uint8_t* data, int64_t bytes, bool sending, const Call& call,
                          Clock::time_point deadline);
  // UNAVAILABLE naming the peer when another rank marked the segment failed, else OK.
  absl::Status PeerFailure(const Call& call);
  // Why waiting must stop now (abort, a failed or vanished peer, the deadline), or OK.
  absl::Status Health(Clock::time_point deadline, const Call& call);
  // Records the first error, marks the segment for the peers, wakes every waiter; returns the
  // first error.
  absl::Status Fail(absl::Status s) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Failed() const ABSL_LOCKS_EXCLUDED(mu_);

  const int rank_;
  const int world_size_;
  void* base_;  // the mapping
  size_t mapped_bytes_;
  Control* ctl_;
  std::chrono::milliseconds timeout_;
  uint64_t seq_ = 0;
  std::vector<int64_t> sends_, recvs_;            // point-to-point transfers by peer
  std::vector<int64_t> chunks_out_, chunks_in_;   // their chunks by peer, over this life
  std::atomic<bool> failed_{false};
  mutable absl::Mutex mu_;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fsdp8
