// NcclCommunicator implementation (see nccl_communicator.h).
#include "comm/nccl_communicator.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_streams.h"

namespace fsdp8 {
namespace {

using Clock = std::chrono::steady_clock;

std::string CudaErr(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

std::string NcclErr(ncclResult_t r) {
  return absl::StrCat(ncclGetErrorString(r), " [", static_cast<int>(r), "]",
                      ncclGetLastError(nullptr) ? absl::StrCat(": ", ncclGetLastError(nullptr)) : "");
}

std::string Seconds(std::chrono::milliseconds ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3gs", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

std::string HexEncode(const void* data, size_t n) {
  static const char* kHex = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = kHex[p[i] >> 4];
    s[2 * i + 1] = kHex[p[i] & 15];
  }
  return s;
}

bool HexDecode(const std::string& s, void* out, size_t n) {
  if (s.size() != 2 * n) return false;
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  auto* p = static_cast<unsigned char*>(out);
  for (size_t i = 0; i < n; ++i) {
    const int hi = nib(s[2 * i]), lo = nib(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    p[i] = static_cast<unsigned char>(hi * 16 + lo);
  }
  return true;
}

enum class Op : int64_t {
  kAllGather = 1, kReduceScatterSum, kAllReduceSum, kAllReduceMax, kBroadcast, kBarrier, kSplit,
  kSend, kRecv
};

const char* OpName(int64_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kAllGather: return "AllGather";
    case Op::kReduceScatterSum: return "ReduceScatterSum";
    case Op::kAllReduceSum: return "AllReduce(sum)";
    case Op::kAllReduceMax: return "AllReduce(max)";
    case Op::kBroadcast: return "Broadcast";
    case Op::kBarrier: return "Barrier";
    case Op::kSplit: return "Split";
    case Op::kSend: return "Send";
    case Op::kRecv: return "Recv";
  }
  return "unknown collective";
}

const char* CountUnit(int64_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kAllGather: return "bytes per rank";
    case Op::kBroadcast: return "bytes";
    case Op::kSend: return "bytes";
    case Op::kRecv: return "bytes";
    case Op::kBarrier: return "";
    case Op::kSplit: return "";
    default: return "f32 elements";
  }
}

// The per-collective header all ranks compare (C09).
struct Header {
  int64_t seq;
  int64_t op;
  int64_t count;
  int64_t root;
};
static_assert(sizeof(Header) == 32, "header layout");

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int world, CudaStreams* backend, std::chrono::milliseconds timeout,
                   const NcclOptions& options)
      : rank_(rank), world_(world), backend_(backend), timeout_(timeout), options_(options),
        sends_(world), recvs_(world) {
    check_headers_ = options.check_collectives != NcclOptions::CollectiveCheck::kOff;
    sync_headers_ = options.check_collectives == NcclOptions::CollectiveCheck::kSync;
  }

  ~NcclCommunicator() override {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    cv_.SignalAll();
    if (watchdog_.joinable()) watchdog_.join();
    cudaSetDevice(backend_->device());
    if (comm_ != nullptr) {
      if (aborted_.load()) {
        // ncclCommAbort already released it.
      } else {
        // Let enqueued work finish, then release; abort instead if it does not finish in time.
        const auto deadline = Clock::now() + timeout_;
        bool done = false;
        while (Clock::now() < deadline) {
          const cudaError_t q = cudaStreamQuery(comm_stream_);
          if (q != cudaErrorNotReady) {
            done = true;
            break;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        if (done) {
          ncclCommFinalize(comm_);
          WaitNotInProgress(Clock::now() + timeout_);
          ncclCommDestroy(comm_);
        } else {
          ncclCommAbort(comm_);
        }
      }
    }
    for (auto& p : pending_) cudaEventDestroy(p.done);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    for (auto& w : waits_) timing_pool_.insert(timing_pool_.end(), {w.first, w.second});
    for (cudaEvent_t e : timing_pool_) cudaEventDestroy(e);
    for (auto& t : tickets_) cudaEventDestroy(t.second);
    for (cudaEvent_t e : ticket_pool_) cudaEventDestroy(e);
    if (compute_ready_) cudaEventDestroy(compute_ready_);
    for (cudaEvent_t e : hdr_events_) if (e) cudaEventDestroy(e);
    if (hdr_dev_) cudaFree(hdr_dev_);
    if (hdr_host_) cudaFreeHost(hdr_host_);
    if (scratch_dev_) cudaFree(scratch_dev_);
    if (sizes_host_) cudaFreeHost(sizes_host_);
    if (sizes_event_) cudaEventDestroy(sizes_event_);
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
  }

  // Waits up to `bootstrap` for every rank to join.
  absl::Status Init(const ncclUniqueId& id, std::chrono::milliseconds bootstrap) {
    if (absl::Status s = SetupCuda(); !s.ok()) return s;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, world_, id, rank_, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      return absl::InternalError(absl::StrCat("nccl: ncclCommInitRankConfig (rank ", rank_, " of ",
                                              world_, ", device ", backend_->device(), "): ", NcclErr(r)));
    }
    const auto deadline = Clock::now() + bootstrap;
    r = WaitNotInProgress(deadline);
    if (r == ncclInProgress) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      return absl::DeadlineExceededError(absl::StrCat(
          "nccl: rank ", rank_, " of ", world_, " timed out after ", Seconds(bootstrap),
          " initialising the NCCL communicator: is every rank of the generation running and "
          "reachable (same NCCL version, network interfaces; run with NCCL_DEBUG=WARN)?"));
    }
    if (r != ncclSuccess) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      return absl::InternalError(absl::StrCat("nccl: communicator initialisation failed on rank ",
                                              rank_, " of ", world_, ": ", NcclErr(r)));
    }
    watchdog_ = std::thread([this] { WatchdogLoop(); });
    return absl::OkStatus();
  }

  // Takes over `comm`, an initialised communicator (ncclCommSplit's result); aborts it when the
  // CUDA setup fails.
  absl::Status Adopt(ncclComm_t comm) {
    if (absl::Status s = SetupCuda(); !s.ok()) {
      ncclCommAbort(comm);
      return s;
    }
    comm_ = comm;
    watchdog_ = std::thread([this] { WatchdogLoop(); });
    return absl::OkStatus();
  }

  // The communication stream, events and buffers of the device.
  absl::Status SetupCuda() {
    cudaError_t e = cudaSetDevice(backend_->device());
    if (e != cudaSuccess) return absl::InternalError(absl::StrCat("nccl: cudaSetDevice: ", CudaErr(e)));
    int prio_lo = 0, prio_hi = 0;
    cudaDeviceGetStreamPriorityRange(&prio_lo, &prio_hi);
    if ((e = cudaStreamCreateWithPriority(&comm_stream_, cudaStreamNonBlocking, prio_hi)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&compute_ready_, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaMalloc(&hdr_dev_, sizeof(Header) * (world_ + 1) * kHeaderSlots)) != cudaSuccess ||
        (e = cudaMallocHost(&hdr_host_, sizeof(Header) * (world_ + 1) * kHeaderSlots)) != cudaSuccess ||
        (e = cudaMalloc(&scratch_dev_, 256)) != cudaSuccess) {
      return absl::InternalError(absl::StrCat("nccl: CUDA setup on device ", backend_->device(), ": ", CudaErr(e)));
    }
    hdr_events_.assign(kHeaderSlots, nullptr);
    {
      absl::MutexLock l(&mu_);  // no other thread yet: the watchdog starts after SetupCuda
      hdr_slot_seq_.assign(kHeaderSlots, 0);
    }
    for (cudaEvent_t& ev : hdr_events_) {
      if ((e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)) != cudaSuccess) {
        return absl::InternalError(absl::StrCat("nccl: cudaEventCreate: ", CudaErr(e)));
      }
    }
    if ((e = cudaMallocHost(&sizes_host_, 2 * sizeof(int64_t))) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&sizes_event_, cudaEventDisableTiming)) != cudaSuccess) {
      return absl::InternalError(absl::StrCat("nccl: CUDA setup on device ", backend_->device(), ": ", CudaErr(e)));
    }
    return absl::OkStatus();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  absl::Status AllGather(const void* send, void* recv, int64_t bytes_per_rank) override {
    return AllGatherImpl(send, recv, bytes_per_rank, nullptr);
  }
  absl::StatusOr<int64_t> AllGatherAsync(const void* send, void* recv,
                                         int64_t bytes_per_rank) override {
    int64_t ticket = 0;
    const absl::Status s = AllGatherImpl(send, recv, bytes_per_rank, &ticket);
    return TicketOr(s, ticket);
  }

  absl::Status ReduceScatterSum(const float* send, float* recv, int64_t count) override {
    return ReduceScatterImpl(send, recv, count, nullptr);
  }
  absl::StatusOr<int64_t> ReduceScatterSumAsync(const float* send, float* recv,
                                                int64_t count) override {
    int64_t ticket = 0;
    const absl::Status s = ReduceScatterImpl(send, recv, count, &ticket);
    return TicketOr(s, ticket);
  }

  absl::Status Verify() override {
    if (aborted_.load()) return AbortedStatus();
    cudaSetDevice(backend_->device());
    while (true) {
      int slot = -1;
      int64_t seq = 0;
      {
        absl::MutexLock l(&mu_);
        while (!hdr_pending_.empty() && hdr_slot_seq_[hdr_pending_.front()] == 0) hdr_pending_.pop_front();
        if (hdr_pending_.empty()) break;
        slot = hdr_pending_.front();
        seq = hdr_slot_seq_[slot];
      }
      absl::Status s = WaitEvent(hdr_events_[slot], Clock::now() + timeout_, "header", seq);
      if (!s.ok()) return s;
      std::string msg;
      {
        absl::MutexLock l(&mu_);
        if (hdr_slot_seq_[slot] == seq) {
          msg = CompareHeaders(slot);
          hdr_slot_seq_[slot] = 0;
        }
      }
      if (!msg.empty()) {
        Abort(msg);
        return absl::FailedPreconditionError(msg);
      }
    }
    return aborted_.load() ? AbortedStatus() : absl::OkStatus();
  }

  void Wait(int64_t ticket) override {
    auto it = tickets_.find(ticket);
    if (it == tickets_.end()) return;
    cudaSetDevice(backend_->device());
    WaitOnCompute(it->second);
    ticket_pool_.push_back(it->second);
    tickets_.erase(it);
  }

  absl::Status AllReduce(float* buf, int64_t count, ReduceOp op) override {
    return AllReduceImpl(buf, count, op, nullptr);
  }
  absl::StatusOr<int64_t> AllReduceAsync(float* buf, int64_t count, ReduceOp op) override {
    int64_t ticket = 0;
    const absl::Status s = AllReduceImpl(buf, count, op, &ticket);
    return TicketOr(s, ticket);
  }

  // Point-to-point on the comm stream, ordered and waited for as a blocking collective (the
  // compute stream waits for it); no header exchange with the other ranks. With the C09 checks
  // on, the two sides first swap their sizes (a host wait for the swap) and both fail on a
  // mismatch.
  absl::Status Send(const void* buf, int64_t bytes, int peer) override {
    return Transfer(const_cast<void*>(buf), bytes, peer, /*sending=*/true);
  }
  absl::Status Recv(void* buf, int64_t bytes, int peer) override {
    return Transfer(buf, bytes, peer, /*sending=*/false);
  }

  // A collective of this communicator (its C09 header, op Split, compared before NCCL splits),
  // then ncclCommSplit in non-blocking mode without resource sharing, so that the child aborts
  // and frees independently of its parent; polled until the child is ready (the collective
  // timeout). A failed or timed-out split aborts this communicator.
  // A negative color rides in the header (extra -1), so every rank fails at once on a mix.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    absl::Status s = Collective(Op::kSplit, 0, color < 0 ? -1 : 0, [] { return ncclSuccess; },
                                /*nonempty=*/false);
    if (s.ok()) s = Verify();
    if (!s.ok()) return s;
    if (color < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("nccl Split: rank ", rank_, " passed color ", color, " (colors must be >= 0)"));
    }
    ncclComm_t child = nullptr;
    if (s = SplitComm(color, key, &child); !s.ok()) return s;
    int rank = 0, world = 0;
    const ncclResult_t ur = ncclCommUserRank(child, &rank);
    const ncclResult_t cr = ncclCommCount(child, &world);
    if (ur != ncclSuccess || cr != ncclSuccess) {
      ncclCommAbort(child);
      return absl::InternalError(absl::StrCat("nccl Split (color ", color, ") on rank ", rank_,
                                              ": the sub-communicator's rank and size: ",
                                              NcclErr(ur != ncclSuccess ? ur : cr)));
    }
    auto sub = std::make_unique<NcclCommunicator>(rank, world, backend_, timeout_, options_);
    if (s = sub->Adopt(child); !s.ok()) return s;
    return std::unique_ptr<Communicator>(std::move(sub));
  }

  absl::Status Broadcast(void* buf, int64_t bytes, int root) override {
    if (root < 0 || root >= world_) {
      return absl::InvalidArgumentError(absl::StrCat("nccl Broadcast: root ", root, " not in [0, ", world_, ")"));
    }
    return Collective(Op::kBroadcast, bytes, root, [&] {
      return ncclBroadcast(buf, buf, static_cast<size_t>(bytes), ncclUint8, root, comm_, comm_stream_);
    }, bytes > 0);
  }

  absl::Status Barrier() override {
    absl::Status s = Collective(Op::kBarrier, 1, 0, [&] {
      return ncclAllReduce(scratch_dev_, scratch_dev_, 1, ncclFloat32, ncclSum, comm_, comm_stream_);
    }, true);
    if (!s.ok()) return s;
    // A barrier is host-visible: wait for the all-reduce itself.
    return WaitEvent(last_done_, Clock::now() + timeout_, "Barrier", enqueued_seq_.load());
  }

  void Abort(const std::string& reason) override {
    {
      // The reason is set before the flag, so a wait that sees the flag reports this reason.
      absl::MutexLock l(&mu_);
      if (aborted_.load()) return;
      abort_reason_ = reason;
      aborted_ = true;
    }
    std::fprintf(stderr, "fsdp8 nccl rank %d: aborting communicator: %s\n", rank_, reason.c_str());
    cudaSetDevice(backend_->device());
    // ncclCommAbort may be called from another thread; it terminates outstanding operations.
    absl::MutexLock l(&comm_mu_);
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_aborted_ = true;
  }

 private:
  struct Pending {
    int64_t seq;
    int64_t op;
    int64_t count;
    cudaEvent_t done;
    Clock::time_point deadline;
  };

  // Polls ncclCommGetAsyncError until the communicator is not "in progress" or the deadline.
  // Non-blocking communicators report most enqueues as in progress for microseconds: spin (with
  // yields) for the first millisecond, then sleep between polls. (Sleeping 200 us per poll from
  // the start cost about 0.3 ms per collective, several percent of a step.)
  ncclResult_t WaitNotInProgress(Clock::time_point deadline) {
    ncclResult_t st = ncclInProgress;
    const auto spin_until = Clock::now() + std::chrono::milliseconds(1);
    while (true) {
      ncclResult_t r = ncclCommGetAsyncError(comm_, &st);
      if (r != ncclSuccess) return r;
      if (st != ncclInProgress) return st;
      const auto now = Clock::now();
      if (now >= deadline) return ncclInProgress;
      if (now < spin_until) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  absl::Status AbortedStatus() {
    absl::MutexLock l(&mu_);
    return absl::AbortedError(absl::StrCat("nccl communicator (rank ", rank_, " of ", world_,
                                           ") was aborted: ", abort_reason_,
                                           "; last enqueued collective #", enqueued_seq_.load(),
                                           ", last completed #", completed_seq_.load()));
  }

  std::string Progress() const {
    return absl::StrCat("last enqueued collective #", enqueued_seq_.load(), ", last completed #",
                        completed_seq_.load());
  }

  // Host wait for an event with a deadline, watching for asynchronous NCCL errors and aborts.
  absl::Status WaitEvent(cudaEvent_t ev, Clock::time_point deadline, const char* what, int64_t seq) {
    while (true) {
      if (aborted_.load()) return AbortedStatus();
      const cudaError_t q = cudaEventQuery(ev);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) {
        const std::string msg = absl::StrCat("nccl ", what, " #", seq, ": CUDA error ", CudaErr(q));
        Abort(msg);
        return absl::InternalError(msg);
      }
      ncclResult_t st = ncclSuccess;
      {
        absl::MutexLock l(&comm_mu_);
        if (!comm_aborted_) ncclCommGetAsyncError(comm_, &st);
      }
      if (st != ncclSuccess && st != ncclInProgress) {
        const std::string msg = absl::StrCat("nccl ", what, " #", seq, " on rank ", rank_,
                                             ": asynchronous NCCL error ", NcclErr(st),
                                             " (a peer probably failed); ", Progress());
        Abort(msg);
        return absl::InternalError(msg);
      }
      if (Clock::now() >= deadline) {
        const std::string msg = absl::StrCat(
            "nccl ", what, " #", seq, " on rank ", rank_, " of ", world_, " did not complete within ",
            Seconds(timeout_), ": a peer is dead, stuck, or called a different collective; ", Progress());
        Abort(msg);
        return absl::DeadlineExceededError(msg);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // Checks an NCCL enqueue result (non-blocking communicators may return ncclInProgress). Called
  // with comm_mu_ held, so it does not abort itself (Abort takes comm_mu_): the caller aborts
  // with the returned message after unlocking.
  absl::Status CheckEnqueue(ncclResult_t r, const char* what, int64_t seq) {
    if (r == ncclInProgress) {
      r = WaitNotInProgress(Clock::now() + timeout_);
      if (r == ncclInProgress) {
        return absl::DeadlineExceededError(absl::StrCat("nccl ", what, " #", seq,
                                                        ": enqueue did not finish within ",
                                                        Seconds(timeout_), "; ", Progress()));
      }
    }
    if (r != ncclSuccess) {
      return absl::InternalError(absl::StrCat("nccl ", what, " #", seq, " on rank ", rank_, ": ",
                                              NcclErr(r), "; ", Progress()));
    }
    return absl::OkStatus();
  }

  absl::Status CheckCuda(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return absl::OkStatus();
    const std::string msg = absl::StrCat("nccl: ", what, ": ", CudaErr(e));
    Abort(msg);
    return absl::InternalError(msg);
  }

  // C09: all ranks exchange (seq, op, count, root) in a 32-byte all-gather enqueued just before
  // the collective, and compare. By default the comparison is deferred: the exchanged headers land
  // in a ring of pinned host slots and the watchdog compares each as soon as its event completes
  // (within its 50 ms poll), aborting the communicator with the message below; the data
  // collective of a mismatch cannot complete meanwhile (its peers disagree on its size), so it
  // fails instead of hanging, and the host never waits here. FSDP8_NCCL_CHECK_COLLECTIVES=sync
  // compares before enqueueing the collective (a host wait per collective: FAILED_PRECONDITION
  // from the call itself); =0 skips the check.
  static constexpr int kHeaderSlots = 64;
  Header* HostSlot(int slot) {
    return reinterpret_cast<Header*>(hdr_host_) + static_cast<size_t>(slot) * (world_ + 1);
  }

  // The mismatch message of a completed header slot, or "" when every rank agrees.
  std::string CompareHeaders(int slot) {
    const Header* mine = HostSlot(slot);
    const Header* all = mine + 1;
    const int64_t seq = mine->seq;
    for (int r = 0; r < world_; ++r) {
      const Header& h = all[r];
      if (h.seq == mine->seq && h.op == mine->op && h.count == mine->count && h.root == mine->root) continue;
      if (h.op != mine->op || h.seq != mine->seq) {
        return absl::StrCat("collective mismatch at #", seq, ": rank ", rank_, " called ", OpName(mine->op),
                            " (", mine->count, " ", CountUnit(mine->op), ") but rank ", r, " called ",
                            OpName(h.op), " #", h.seq, " (", h.count, " ", CountUnit(h.op), ")");
      }
      if (h.count != mine->count) {
        return absl::StrCat(OpName(mine->op), " #", seq, " size mismatch: rank ", rank_, " has ", mine->count,
                            " ", CountUnit(mine->op), ", rank ", r, " has ", h.count);
      }
      return absl::StrCat(OpName(mine->op), " #", seq, " root mismatch: rank ", rank_, " uses root ",
                          mine->root, ", rank ", r, " uses root ", h.root);
    }
    return "";
  }

  absl::Status CheckHeader(int64_t seq, Op op, int64_t count, int64_t root) {
    const int slot = static_cast<int>(seq % kHeaderSlots);
    // The slot's previous header must be compared before it is overwritten (64 collectives in
    // flight: rare; then this waits for it).
    int64_t prev = 0;
    {
      absl::MutexLock l(&mu_);
      prev = hdr_slot_seq_[slot];
    }
    if (prev != 0) {
      absl::Status s = WaitEvent(hdr_events_[slot], Clock::now() + timeout_, "header", prev);
      if (!s.ok()) return s;
      std::string msg;
      {
        absl::MutexLock l(&mu_);
        if (hdr_slot_seq_[slot] != 0) {
          msg = CompareHeaders(slot);
          hdr_slot_seq_[slot] = 0;
        }
      }
      if (!msg.empty()) {
        Abort(msg);
        return absl::FailedPreconditionError(msg);
      }
    }
    Header* mine = HostSlot(slot);
    *mine = Header{seq, static_cast<int64_t>(op), count, root};
    Header* dev_mine = reinterpret_cast<Header*>(hdr_dev_) + static_cast<size_t>(slot) * (world_ + 1);
    Header* dev_all = dev_mine + 1;
    absl::Status s = CheckCuda(cudaMemcpyAsync(dev_mine, mine, sizeof(Header), cudaMemcpyHostToDevice, comm_stream_),
                               "header copy to device");
    if (!s.ok()) return s;
    bool comm_aborted = false;
    {
      absl::MutexLock l(&comm_mu_);
      comm_aborted = comm_aborted_;
      if (!comm_aborted) {
        s = CheckEnqueue(ncclAllGather(dev_mine, dev_all, sizeof(Header), ncclUint8, comm_, comm_stream_),
                         "header all-gather", seq);
      }
    }
    if (comm_aborted) return AbortedStatus();  // after comm_mu_: it takes mu_ (see WatchdogLoop)
    if (!s.ok()) {
      Abort(std::string(s.message()));
      return s;
    }
    s = CheckCuda(cudaMemcpyAsync(mine + 1, dev_all, sizeof(Header) * world_, cudaMemcpyDeviceToHost, comm_stream_),
                  "header copy to host");
    if (!s.ok()) return s;
    s = CheckCuda(cudaEventRecord(hdr_events_[slot], comm_stream_), "cudaEventRecord(header)");
    if (!s.ok()) return s;
    if (!sync_headers_) {
      absl::MutexLock l(&mu_);
      hdr_slot_seq_[slot] = seq;
      hdr_pending_.push_back(slot);
      return absl::OkStatus();
    }
    s = WaitEvent(hdr_events_[slot], Clock::now() + timeout_, OpName(static_cast<int64_t>(op)), seq);
    if (!s.ok()) return s;
    const std::string msg = CompareHeaders(slot);
    if (!msg.empty()) {
      Abort(msg);
      return absl::FailedPreconditionError(msg);
    }
    return absl::OkStatus();
  }

  absl::Status AllReduceImpl(float* buf, int64_t count, ReduceOp op, int64_t* ticket) {
    const Op o = op == ReduceOp::kMax ? Op::kAllReduceMax : Op::kAllReduceSum;
    const ncclRedOp_t nop = op == ReduceOp::kMax ? ncclMax : ncclSum;
    bytes_.all_reduce += count * static_cast<int64_t>(sizeof(float));
    return Collective(o, count, 0, [&] {
      return ncclAllReduce(buf, buf, static_cast<size_t>(count), ncclFloat32, nop, comm_, comm_stream_);
    }, count > 0, ticket);
  }

  absl::Status Transfer(void* buf, int64_t bytes, int peer, bool sending) {
    if (absl::Status s = CheckPeer(sending ? "nccl Send" : "nccl Recv", peer, bytes); !s.ok()) return s;
    if (aborted_.load()) return AbortedStatus();
    const int64_t n = ++(sending ? sends_ : recvs_)[peer];
    if (check_headers_) {
      if (absl::Status s = CompareSizes(bytes, peer, sending, n); !s.ok()) return s;
    }
    const size_t len = static_cast<size_t>(bytes);
    return Collective(sending ? Op::kSend : Op::kRecv, bytes, peer, [&] {
      return sending ? ncclSend(buf, len, ncclUint8, peer, comm_, comm_stream_)
                     : ncclRecv(buf, len, ncclUint8, peer, comm_, comm_stream_);
    }, bytes > 0, nullptr, /*checked=*/false);
  }

  // Sends dev[0] to `peer` and receives its dev[1], grouped (both sides call it).
  ncclResult_t SwapSizes(int64_t* dev, int peer) {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    const ncclResult_t a = ncclSend(dev, sizeof(int64_t), ncclUint8, peer, comm_, comm_stream_);
    const ncclResult_t b = ncclRecv(dev + 1, sizeof(int64_t), ncclUint8, peer, comm_, comm_stream_);
    r = ncclGroupEnd();
    if (a != ncclSuccess && a != ncclInProgress) return a;
    if (b != ncclSuccess && b != ncclInProgress) return b;
    return r;
  }

  // C09 for transfer #n with `peer`: both sides swap their sizes through scratch memory and
  // compare them after a host wait; a mismatch aborts the communicator (INVALID_ARGUMENT).
  absl::Status CompareSizes(int64_t bytes, int peer, bool sending, int64_t n) {
    const char* what = sending ? "Send (sizes)" : "Recv (sizes)";
    absl::Status s = CheckCuda(cudaSetDevice(backend_->device()), "cudaSetDevice");
    if (!s.ok()) return s;
    int64_t* host = static_cast<int64_t*>(sizes_host_);
    int64_t* dev = reinterpret_cast<int64_t*>(static_cast<char*>(scratch_dev_) + 128);
    host[0] = bytes;
    s = CheckCuda(cudaMemcpyAsync(dev, host, sizeof(int64_t), cudaMemcpyHostToDevice, comm_stream_),
                  "size copy to device");
    if (!s.ok()) return s;
    bool comm_aborted = false;
    {
      absl::MutexLock l(&comm_mu_);
      comm_aborted = comm_aborted_;
      if (!comm_aborted) s = CheckEnqueue(SwapSizes(dev, peer), what, n);
    }
    if (comm_aborted) return AbortedStatus();  // after comm_mu_: it takes mu_
    if (!s.ok()) {
      Abort(std::string(s.message()));
      return s;
    }
    s = CheckCuda(cudaMemcpyAsync(host + 1, dev + 1, sizeof(int64_t), cudaMemcpyDeviceToHost, comm_stream_),
                  "size copy to host");
    if (s.ok()) s = CheckCuda(cudaEventRecord(sizes_event_, comm_stream_), "cudaEventRecord(sizes)");
    if (s.ok()) s = WaitEvent(sizes_event_, Clock::now() + timeout_, what, n);
    if (!s.ok()) return s;
    const int from = sending ? rank_ : peer, to = sending ? peer : rank_;
    const int64_t sent = sending ? bytes : host[1], received = sending ? host[1] : bytes;
    if (sent == received) return absl::OkStatus();
    const std::string msg = absl::StrCat(sending ? "Send #" : "Recv #", n, " from rank ", from, " to rank ", to,
                                         ": rank ", from, " sends ", sent, " bytes, rank ", to, " receives ",
                                         received, " bytes");
    Abort(msg);
    return absl::InvalidArgumentError(msg);
  }

  // ncclCommSplit of comm_ into *child, polled until the child is ready; on failure, timeout or
  // abort the child is aborted, and so is this communicator.
  absl::Status SplitComm(int color, int key, ncclComm_t* child) {
    absl::Status s = CheckCuda(cudaSetDevice(backend_->device()), "cudaSetDevice");
    if (!s.ok()) return s;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    config.splitShare = 0;
    ncclResult_t r = ncclSuccess;
    bool comm_aborted = false;
    {
      absl::MutexLock l(&comm_mu_);
      comm_aborted = comm_aborted_;
      if (!comm_aborted) r = ncclCommSplit(comm_, color, key, child, &config);
    }
    if (comm_aborted) return AbortedStatus();  // after comm_mu_: it takes mu_
    const auto deadline = Clock::now() + timeout_;
    ncclResult_t st = r;
    while (st == ncclInProgress || (st == ncclSuccess && *child == nullptr)) {
      if (aborted_.load() || Clock::now() >= deadline) break;
      if (*child != nullptr) ncclCommGetAsyncError(*child, &st);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (st == ncclSuccess && *child != nullptr && !aborted_.load()) return absl::OkStatus();
    if (*child != nullptr) ncclCommAbort(*child);
    *child = nullptr;
    if (aborted_.load()) return AbortedStatus();
    const std::string msg = absl::StrCat(
        "nccl Split (color ", color, ") on rank ", rank_, " of ", world_, ": ",
        st == ncclInProgress || st == ncclSuccess ? "the sub-communicator was not ready within " + Seconds(timeout_)
                                                  : NcclErr(st),
        "; ", Progress());
    Abort(msg);
    return st == ncclInProgress || st == ncclSuccess ? absl::DeadlineExceededError(msg)
                                                     : absl::InternalError(msg);
  }

  absl::Status AllGatherImpl(const void* send, void* recv, int64_t bytes_per_rank, int64_t* ticket) {
    bytes_.all_gather += bytes_per_rank * world_;
    return Collective(Op::kAllGather, bytes_per_rank, 0, [&] {
      return ncclAllGather(send, recv, static_cast<size_t>(bytes_per_rank), ncclUint8, comm_, comm_stream_);
    }, bytes_per_rank > 0, ticket);
  }
  absl::Status ReduceScatterImpl(const float* send, float* recv, int64_t count, int64_t* ticket) {
    bytes_.reduce_scatter += count * world_ * static_cast<int64_t>(sizeof(float));
    return Collective(Op::kReduceScatterSum, count, 0, [&] {
      return ncclReduceScatter(send, recv, static_cast<size_t>(count), ncclFloat32, ncclSum, comm_, comm_stream_);
    }, count > 0, ticket);
  }

  // Makes the compute stream wait for `ev` (recorded on the comm stream), with timing events on
  // both sides of the wait: how long the compute stream stalls on it (exposed time).
  void WaitOnCompute(cudaEvent_t ev) {
    cudaEvent_t before = TakeTimingEvent(), after = TakeTimingEvent();
    if (before != nullptr) cudaEventRecord(before, backend_->stream());
    cudaStreamWaitEvent(backend_->stream(), ev, 0);
    if (before != nullptr && after != nullptr) {
      cudaEventRecord(after, backend_->stream());
      waits_.emplace_back(before, after);
    }
  }

  // Timing events for the exposed-communication measurement (trainer thread only).
  cudaEvent_t TakeTimingEvent() {
    if (!timing_pool_.empty()) {
      cudaEvent_t e = timing_pool_.back();
      timing_pool_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) return nullptr;
    return e;
  }

 public:
  double ConsumeExposedSeconds() override {
    double total = 0;
    for (auto& [a, b] : waits_) {
      float ms = 0;
      if (cudaEventSynchronize(b) == cudaSuccess && cudaEventElapsedTime(&ms, a, b) == cudaSuccess) {
        total += ms * 1e-3;
      }
      timing_pool_.push_back(a);
      timing_pool_.push_back(b);
    }
    waits_.clear();
    return total;
  }

 private:
  cudaEvent_t TakeEvent() {
    absl::MutexLock l(&mu_);
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) return nullptr;
    return e;
  }

  // ticket == nullptr: later compute-stream ops wait for the collective. Otherwise an event
  // recorded after it is kept under *ticket = seq, for Wait().
  // checked: exchange and compare the C09 header first (not for point-to-point, which the
  // other ranks do not take part in).
  template <typename Enqueue>
  absl::Status Collective(Op op, int64_t count, int64_t root, Enqueue enqueue, bool nonempty,
                          int64_t* ticket = nullptr, bool checked = true) {
    if (aborted_.load()) return AbortedStatus();
    if (count < 0) return absl::InvalidArgumentError(absl::StrCat(OpName(static_cast<int64_t>(op)), ": negative count"));
    absl::Status s = CheckCuda(cudaSetDevice(backend_->device()), "cudaSetDevice");
    if (!s.ok()) return s;
    const int64_t seq = enqueued_seq_.load() + 1;
    if (check_headers_ && checked) {
      s = CheckHeader(++header_seq_, op, count, root);
      if (!s.ok()) return s;
    }
    cudaEvent_t done = TakeEvent();
    if (done == nullptr) return CheckCuda(cudaErrorMemoryAllocation, "cudaEventCreate");
    // Order: the collective sees every compute op enqueued before this call.
    s = CheckCuda(cudaEventRecord(compute_ready_, backend_->stream()), "cudaEventRecord(compute)");
    if (!s.ok()) return s;
    s = CheckCuda(cudaStreamWaitEvent(comm_stream_, compute_ready_, 0), "cudaStreamWaitEvent(comm)");
    if (!s.ok()) return s;
    if (nonempty) {
      bool comm_aborted = false;
      {
        absl::MutexLock l(&comm_mu_);
        comm_aborted = comm_aborted_;
        if (!comm_aborted) s = CheckEnqueue(enqueue(), OpName(static_cast<int64_t>(op)), seq);
      }
      if (comm_aborted) return AbortedStatus();  // after comm_mu_: it takes mu_ (see WatchdogLoop)
    }
    if (!s.ok()) {
      Abort(std::string(s.message()));
      return s;
    }
    s = CheckCuda(cudaEventRecord(done, comm_stream_), "cudaEventRecord(done)");
    if (!s.ok()) return s;
    if (ticket == nullptr) {
      // Every compute op enqueued after this call sees the collective's result.
      WaitOnCompute(done);
    } else {
      cudaEvent_t t = nullptr;
      if (!ticket_pool_.empty()) {
        t = ticket_pool_.back();
        ticket_pool_.pop_back();
      } else {
        s = CheckCuda(cudaEventCreateWithFlags(&t, cudaEventDisableTiming), "cudaEventCreate");
        if (!s.ok()) return s;
      }
      s = CheckCuda(cudaEventRecord(t, comm_stream_), "cudaEventRecord(ticket)");
      if (!s.ok()) return s;
      tickets_[seq] = t;
      *ticket = seq;
    }
    last_done_ = done;
    enqueued_seq_.store(seq);
    {
      absl::MutexLock l(&mu_);
      pending_.push_back(Pending{seq, static_cast<int64_t>(op), count, done, Clock::now() + timeout_});
    }
    cv_.SignalAll();
    return absl::OkStatus();
  }

  void WatchdogLoop() {
    cudaSetDevice(backend_->device());
    mu_.Lock();
    while (!stop_) {
      cv_.WaitWithTimeout(&mu_, absl::Milliseconds(50));
      if (stop_ || aborted_.load()) continue;
      std::string failure;
      // Compare the C09 headers that arrived, in order.
      while (!hdr_pending_.empty()) {
        const int slot = hdr_pending_.front();
        if (hdr_slot_seq_[slot] == 0) {  // already compared by the trainer thread
          hdr_pending_.pop_front();
          continue;
        }
        if (cudaEventQuery(hdr_events_[slot]) != cudaSuccess) break;
        failure = CompareHeaders(slot);
        hdr_slot_seq_[slot] = 0;
        hdr_pending_.pop_front();
        if (!failure.empty()) break;
      }
      // Retire completed collectives in order.
      while (failure.empty() && !pending_.empty()) {
        Pending& p = pending_.front();
        const cudaError_t q = cudaEventQuery(p.done);
        if (q == cudaSuccess) {
          completed_seq_.store(p.seq);
          // An event may be re-recorded by the trainer only after it is returned here.
          free_events_.push_back(p.done);
          pending_.pop_front();
          continue;
        }
        if (q != cudaErrorNotReady) {
          failure = absl::StrCat("CUDA error while waiting for ", OpName(p.op), " #", p.seq, ": ", CudaErr(q));
        } else if (Clock::now() > p.deadline) {
          failure = absl::StrCat(OpName(p.op), " #", p.seq, " (", p.count, " ", CountUnit(p.op),
                                 ") on rank ", rank_, " of ", world_, " did not complete within ",
                                 Seconds(timeout_), ": a peer is dead or stuck");
        }
        break;
      }
      if (failure.empty() && !pending_.empty()) {
        ncclResult_t st = ncclSuccess;
        {
          absl::MutexLock cl(&comm_mu_);  // mu_ then comm_mu_: never the other way round
          if (!comm_aborted_) ncclCommGetAsyncError(comm_, &st);
        }
        if (st != ncclSuccess && st != ncclInProgress) {
          failure = absl::StrCat("asynchronous NCCL error on rank ", rank_, ": ", NcclErr(st),
                                 " (a peer probably failed)");
        }
      }
      if (!failure.empty()) {
        failure = absl::StrCat("watchdog: ", failure, "; ", Progress());
        mu_.Unlock();
        Abort(failure);
        mu_.Lock();
      }
    }
    mu_.Unlock();
  }

  const int rank_, world_;
  CudaStreams* const backend_;
  const std::chrono::milliseconds timeout_;
  const NcclOptions options_;           // for the sub-communicators of Split
  std::vector<int64_t> sends_, recvs_;  // point-to-point transfers by peer (trainer thread)
  int64_t header_seq_ = 0;              // collectives with a C09 header (trainer thread)
  void* sizes_host_ = nullptr;          // pinned: a transfer's two sizes (CompareSizes)
  cudaEvent_t sizes_event_ = nullptr;
  bool check_headers_ = true;
  bool sync_headers_ = false;
  std::vector<cudaEvent_t> hdr_events_;  // per header slot
  // seq whose header is in the slot, not yet compared (0: none)
  std::vector<int64_t> hdr_slot_seq_ ABSL_GUARDED_BY(mu_);
  std::deque<int> hdr_pending_ ABSL_GUARDED_BY(mu_);  // slots in enqueue order, for the watchdog

  ncclComm_t comm_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t compute_ready_ = nullptr;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> waits_;  // (before, after) a compute-stream wait
  std::vector<cudaEvent_t> timing_pool_;
  std::map<int64_t, cudaEvent_t> tickets_;  // deferred waits by sequence number
  std::vector<cudaEvent_t> ticket_pool_;
  cudaEvent_t last_done_ = nullptr;
  void* hdr_dev_ = nullptr;
  void* hdr_host_ = nullptr;
  void* scratch_dev_ = nullptr;

  std::atomic<bool> aborted_{false};
  std::atomic<int64_t> enqueued_seq_{0};
  std::atomic<int64_t> completed_seq_{0};

  // Serialises NCCL calls on comm_ with ncclCommAbort. Taken after mu_ (the watchdog), never
  // before it: AbortedStatus (mu_) is called once comm_mu_ is released.
  absl::Mutex comm_mu_ ABSL_ACQUIRED_AFTER(mu_);
  bool comm_aborted_ ABSL_GUARDED_BY(comm_mu_) = false;

  absl::Mutex mu_;
  absl::CondVar cv_;  // wakes the watchdog: a new collective, Stop
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<cudaEvent_t> free_events_ ABSL_GUARDED_BY(mu_);
  std::string abort_reason_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watchdog_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    int rank, int world_size, KvStore* store, const std::string& prefix, Backend* backend,
    std::chrono::milliseconds timeout, std::chrono::milliseconds bootstrap_timeout,
    const NcclOptions& options) {
  if (bootstrap_timeout.count() <= 0) bootstrap_timeout = timeout;
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("nccl: rank ", rank, " not in [0, ", world_size, ")"));
  }
  // The CUDA backend's device and compute stream (CudaBackend implements CudaStreams).
  auto* cuda_backend = dynamic_cast<CudaStreams*>(backend);
  if (cuda_backend == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl: the NCCL communicator needs the cuda backend, got '",
        backend == nullptr ? std::string("null") : backend->Name(), "'"));
  }
  if (store == nullptr) return absl::InvalidArgumentError("nccl: no rendezvous store");
  const std::string key = prefix + "nccl_id";
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      return absl::InternalError(absl::StrCat("nccl: rank 0 could not create the NCCL unique id: ", NcclErr(r),
                                              " (no usable network interface? see NCCL_SOCKET_IFNAME)"));
    }
    absl::Status s = store->Set(key, HexEncode(&id, sizeof(id)));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("nccl: rank 0 could not publish the NCCL unique id under key '",
                                                 key, "' in the rendezvous store: ", s.message()));
    }
  } else {
    absl::StatusOr<std::string> v = store->Get(key, bootstrap_timeout);
    if (!v.ok()) {
      if (v.status().code() == absl::StatusCode::kDeadlineExceeded) {
        return absl::DeadlineExceededError(absl::StrCat(
            "nccl: rank ", rank, " timed out after ", Seconds(bootstrap_timeout), " waiting for rank 0's NCCL unique id (key '",
            key, "'): is rank 0 alive and in the same generation?"));
      }
      return absl::Status(v.status().code(),
                          absl::StrCat("nccl: rank ", rank, " could not read rank 0's NCCL unique id (key '", key,
                                       "') from the rendezvous store: ", v.status().message()));
    }
    if (!HexDecode(*v, &id, sizeof(id))) {
      return absl::InternalError(absl::StrCat("nccl: rank ", rank, ": the value under key '", key,
                                              "' is not a hex-encoded NCCL unique id (", v->size(),
                                              " characters, expected ", 2 * sizeof(id), ")"));
    }
  }
  auto comm = std::make_unique<NcclCommunicator>(rank, world_size, cuda_backend, timeout, options);
  absl::Status s = comm->Init(id, bootstrap_timeout);
  if (!s.ok()) return s;
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace fsdp8
