#include "comm/gloo_communicator.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/collective_check.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"

namespace fsdp8 {
namespace {

// gloo::rendezvous::Store over a KvStore; Gloo expects exceptions for failures.
class KvGlooStore : public gloo::rendezvous::Store {
 public:
  KvGlooStore(KvStore* kv, std::string prefix, std::chrono::milliseconds timeout)
      : kv_(kv), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = kv_->Set(prefix_ + key, std::string(data.begin(), data.end()));
    if (!s.ok()) throw std::runtime_error("rendezvous set " + prefix_ + key + ": " + s.ToString());
  }
  std::vector<char> get(const std::string& key) override {
    auto v = kv_->Get(prefix_ + key, timeout_);
    if (!v.ok()) throw std::runtime_error("rendezvous get: " + v.status().ToString());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  // Gloo passes its context's timeout (the collective one); the rendezvous waits at least ours.
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    for (const std::string& k : keys) {
      auto v = kv_->Get(prefix_ + k, std::max(timeout, timeout_));
      if (!v.ok()) throw std::runtime_error("rendezvous wait: " + v.status().ToString());
    }
  }

 private:
  KvStore* kv_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

// Runs a Gloo call, translating its exceptions into a Status.
template <typename F>
absl::Status GlooCall(const std::string& what, F&& f) {
  try {
    f();
    return absl::OkStatus();
  } catch (const gloo::IoException& e) {
    const std::string msg = e.what();
    if (msg.find("imed out") != std::string::npos || msg.find("imeout") != std::string::npos) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": timed out (a peer is gone or stuck): ", msg));
    }
    return absl::UnavailableError(absl::StrCat(what, ": peer I/O failed: ", msg));
  } catch (const gloo::EnforceNotMet& e) {
    return absl::InternalError(absl::StrCat(what, ": gloo: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

// The slot of phase `phase` (0: the header exchange, 1 and 2: the data) of collective #seq; a
// pair's messages match by slot.
uint64_t SlotOf(uint64_t seq, int phase) { return seq * 4 + static_cast<uint64_t>(phase); }

// The slot of phase `phase` (0: the sender's size, 1: the receiver's, 2: the data) of transfer
// #n of a pair in one direction (low_sends: from the lower rank to the higher): bit 62 keeps it
// apart from the collectives'.
uint64_t TransferSlot(int64_t n, bool low_sends, int phase) {
  return (uint64_t{1} << 62) | (static_cast<uint64_t>(n) << 3) | (low_sends ? 4u : 0u) |
         static_cast<uint64_t>(phase);
}

// Slice bounds of `total` units over `world` ranks: rank p's are [begin[p], begin[p+1]). equal:
// total is a multiple of world (slices of total / world); otherwise near-equal slices
// (total * p / world).
std::vector<int64_t> SliceBounds(int world, int64_t total, bool equal) {
  std::vector<int64_t> begin(world + 1);
  for (int p = 0; p <= world; ++p) begin[p] = equal ? total / world * p : total * p / world;
  return begin;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    int rank, int world_size, KvStore* store, const std::string& prefix, const std::string& host,
    std::chrono::milliseconds timeout, std::chrono::milliseconds bootstrap_timeout) {
  if (bootstrap_timeout.count() <= 0) bootstrap_timeout = timeout;
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("gloo: bad rank ", rank, " of ", world_size));
  }
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  absl::Status s = GlooCall("gloo connect", [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    ctx = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
    // The context's timeout also bounds each pair's TCP connect (Gloo waits a multiple of it), which
    // starts only once the peer has published its address: the collective timeout is enough there.
    // Only the waits for the peers' addresses take the bootstrap timeout.
    ctx->setTimeout(timeout);
    KvGlooStore kv(store, prefix + "gloo/", bootstrap_timeout);
    ctx->connectFullMesh(kv, dev);
  });
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("rank ", rank, " of ", world_size,
                                               ": connecting the Gloo mesh via host ", host,
                                               " failed (are all ranks up and reachable?): ",
                                               s.message()));
  }
  const CpuBootstrap bootstrap{store, prefix, timeout, bootstrap_timeout};
  return std::unique_ptr<GlooCommunicator>(
      new GlooCommunicator(rank, world_size, ctx, bootstrap, host));
}

GlooCommunicator::GlooCommunicator(int rank, int world_size, std::shared_ptr<gloo::Context> ctx,
                                   const CpuBootstrap& bootstrap, const std::string& host)
    : CpuCommunicatorBase(bootstrap,
                          [host](int r, int w, const CpuBootstrap& b)
                              -> absl::StatusOr<std::unique_ptr<Communicator>> {
                            auto c = Create(r, w, b.store, b.prefix, host, b.timeout,
                                            b.bootstrap_timeout);
                            if (!c.ok()) return c.status();
                            return std::unique_ptr<Communicator>(std::move(*c));
                          }),
      rank_(rank), world_size_(world_size), ctx_(std::move(ctx)), timeout_(bootstrap.timeout),
      headers_(4 * static_cast<size_t>(world_size)), sends_(world_size), recvs_(world_size) {
  static_assert(sizeof(CollectiveHeader) == 4 * sizeof(int64_t), "a header is 4 words");
}

GlooCommunicator::~GlooCommunicator() {
  absl::MutexLock l(&mu_);
  live_.clear();
  cache_.clear();  // before the context
}

// ---- Failure and abort ----

absl::Status GlooCommunicator::Failed() const {
  absl::MutexLock l(&mu_);
  return absl::Status(error_.code() == absl::StatusCode::kOk ? absl::StatusCode::kUnavailable
                                                               : error_.code(),
                      absl::StrCat("communicator failed earlier: ", error_.message()));
}

absl::Status GlooCommunicator::Fail(absl::Status s) {
  absl::MutexLock l(&mu_);
  if (!failed_.exchange(true)) error_ = std::move(s);
  for (gloo::transport::UnboundBuffer* b : live_) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
  return error_;
}

void GlooCommunicator::Abort(const std::string& reason) {
  Fail(absl::AbortedError(absl::StrCat("aborted: ", reason))).IgnoreError();
}

// ---- Buffers in flight ----

// An unbound buffer over caller memory (CachedBuffer), known to Abort. Gloo's abort flag outlives
// a wait that has not started yet, so an Abort before a wait still ends that wait.
class GlooCommunicator::Buffer {
 public:
  Buffer(GlooCommunicator* comm, const void* ptr, size_t bytes)
      : buf_(comm->CachedBuffer(ptr, bytes)) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  gloo::transport::UnboundBuffer* operator->() const { return buf_; }

 private:
  gloo::transport::UnboundBuffer* buf_;
};

gloo::transport::UnboundBuffer* GlooCommunicator::CachedBuffer(const void* ptr, size_t bytes) {
  ++uses_;
  for (CachedUnbound& c : cache_) {
    if (c.ptr == ptr && c.bytes == bytes) {
      c.last_use = uses_;
      return c.buf.get();
    }
  }
  if (cache_.size() >= kCachedBuffers) {
    auto lru = std::min_element(cache_.begin(), cache_.end(),
                                [](const CachedUnbound& a, const CachedUnbound& b) {
                                  return a.last_use < b.last_use;
                                });
    Untrack(lru->buf.get());
    cache_.erase(lru);  // no operation of it is in flight: every collective waits for its own
  }
  cache_.push_back({ptr, bytes, uses_, ctx_->createUnboundBuffer(const_cast<void*>(ptr), bytes)});
  Track(cache_.back().buf.get());
  return cache_.back().buf.get();
}

void GlooCommunicator::Track(gloo::transport::UnboundBuffer* b) {
  absl::MutexLock l(&mu_);
  live_.push_back(b);
  if (failed_.load()) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
}

void GlooCommunicator::Untrack(gloo::transport::UnboundBuffer* b) {
  absl::MutexLock l(&mu_);
  live_.erase(std::remove(live_.begin(), live_.end(), b), live_.end());
}

absl::Status GlooCommunicator::Wait(Buffer& b, bool recv, int n, Clock::time_point deadline,
                                    const std::string& what) {
  for (int i = 0; i < n; ++i) {
    bool done = false;
    absl::Status s = GlooCall(what, [&] {
      const auto left = std::max(std::chrono::milliseconds(1),
                                 std::chrono::duration_cast<std::chrono::milliseconds>(
                                     deadline - Clock::now()));
      done = recv ? b->waitRecv(nullptr, left) : b->waitSend(nullptr, left);
    });
    if (!s.ok()) return Fail(s);
    if (!done || failed_.load()) return Fail(absl::AbortedError(absl::StrCat(what, ": aborted")));
  }
  return absl::OkStatus();
}

// ---- Exchanges ----

absl::Status GlooCommunicator::GatherSlices(void* data, const std::vector<int64_t>& begin,
                                            uint64_t slot, const std::string& what) {
  const auto deadline = Clock::now() + timeout_;
  uint8_t* bytes = static_cast<uint8_t*>(data);
  const int64_t total = begin[world_size_];
  if (total == 0) return absl::OkStatus();
  Buffer out(this, bytes, total);
  const int64_t mine = begin[rank_ + 1] - begin[rank_];
  int sends = 0, recvs = 0;
  absl::Status s = GlooCall(what, [&] {
    for (int p = 0; p < world_size_; ++p) {
      const int64_t n = begin[p + 1] - begin[p];
      if (p == rank_) continue;
      if (mine > 0) {
        out->send(p, slot, begin[rank_], mine);
        ++sends;
      }
      if (n > 0) {
        out->recv(p, slot, begin[p], n);
        ++recvs;
      }
    }
  });
  if (!s.ok()) return Fail(s);
  if (absl::Status w = Wait(out, true, recvs, deadline, what); !w.ok()) return w;
  return Wait(out, false, sends, deadline, what);
}

absl::Status GlooCommunicator::ReduceSlices(const float* data, const std::vector<int64_t>& begin,
                                            ReduceOp op, float* out, uint64_t slot,
                                            const std::string& what) {
  const auto deadline = Clock::now() + timeout_;
  const int64_t len = begin[rank_ + 1] - begin[rank_];
  // parts_[p * len, (p + 1) * len): rank p's slice of this rank's range.
  if (parts_.size() < static_cast<size_t>(len) * world_size_) {
    parts_.resize(static_cast<size_t>(len) * world_size_);
  }
  float* parts = parts_.data();
  {
    Buffer in(this, data, begin[world_size_] * sizeof(float));
    Buffer got(this, parts, static_cast<size_t>(len) * world_size_ * sizeof(float));
    int sends = 0, recvs = 0;
    absl::Status s = GlooCall(what, [&] {
      for (int p = 0; p < world_size_; ++p) {
        const int64_t n = begin[p + 1] - begin[p];
        if (p == rank_) continue;
        if (n > 0) {
          in->send(p, slot, begin[p] * sizeof(float), n * sizeof(float));
          ++sends;
        }
        if (len > 0) {
          got->recv(p, slot, p * len * sizeof(float), len * sizeof(float));
          ++recvs;
        }
      }
    });
    if (!s.ok()) return Fail(s);
    if (absl::Status w = Wait(got, true, recvs, deadline, what); !w.ok()) return w;
    if (absl::Status w = Wait(in, false, sends, deadline, what); !w.ok()) return w;
  }
  if (len == 0) return absl::OkStatus();
  std::copy(data + begin[rank_], data + begin[rank_ + 1], parts + rank_ * len);
  std::vector<float> acc(parts, parts + len);  // rank 0's, then 1, 2, ... in order
  for (int p = 1; p < world_size_; ++p) {
    const float* v = parts + p * len;
    if (op == ReduceOp::kSum) {
      for (int64_t i = 0; i < len; ++i) acc[i] += v[i];
    } else {
      for (int64_t i = 0; i < len; ++i) acc[i] = std::max(acc[i], v[i]);
    }
  }
  std::copy(acc.begin(), acc.end(), out);
  return absl::OkStatus();
}

// ---- Collectives ----

absl::Status GlooCommunicator::Check(int op, int64_t count, int dtype, int64_t extra,
                                     uint64_t* seq) {
  if (failed_.load()) return Failed();
  *seq = ++seq_;
  if (world_size_ == 1) return absl::OkStatus();
  CollectiveHeader* all = reinterpret_cast<CollectiveHeader*>(headers_.data());  // one per rank
  all[rank_] = CollectiveHeader::Make(*seq, op, count, dtype, extra);
  std::vector<int64_t> begin(world_size_ + 1);
  for (int p = 0; p <= world_size_; ++p) begin[p] = p * static_cast<int64_t>(sizeof(CollectiveHeader));
  if (absl::Status s = GatherSlices(all, begin, SlotOf(*seq, 0),
                                    absl::StrCat(CollectiveOpName(op), " #", *seq,
                                                 " (header exchange)"));
      !s.ok())
    return s;
  if (absl::Status s = CheckHeaders(all, world_size_, rank_); !s.ok()) return Fail(s);
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AllGather(const void* send, void* recv, int64_t bytes_per_rank) {
  uint64_t seq;
  if (absl::Status s = Check(kOpAllGather, bytes_per_rank, kDtypeU8, 0, &seq); !s.ok()) return s;
  bytes_.all_gather += bytes_per_rank * world_size_;
  if (bytes_per_rank == 0) return absl::OkStatus();
  uint8_t* out = static_cast<uint8_t*>(recv);
  if (out + rank_ * bytes_per_rank != send)
    std::memmove(out + rank_ * bytes_per_rank, send, bytes_per_rank);
  if (world_size_ == 1) return absl::OkStatus();
  return GatherSlices(recv, SliceBounds(world_size_, bytes_per_rank * world_size_, true),
                      SlotOf(seq, 1), absl::StrCat("all_gather #", seq));
}

absl::Status GlooCommunicator::ReduceScatterSum(const float* send, float* recv, int64_t count) {
  uint64_t seq;
  if (absl::Status s = Check(kOpReduceScatter, count, kDtypeF32, 0, &seq); !s.ok()) return s;
  bytes_.reduce_scatter += count * world_size_ * static_cast<int64_t>(sizeof(float));
  if (count == 0) return absl::OkStatus();
  if (world_size_ == 1) {
    if (recv != send) std::memmove(recv, send, count * sizeof(float));
    return absl::OkStatus();
  }
  return ReduceSlices(send, SliceBounds(world_size_, count * world_size_, true), ReduceOp::kSum,
                      recv, SlotOf(seq, 1), absl::StrCat("reduce_scatter #", seq));
}

absl::Status GlooCommunicator::AllReduce(float* buf, int64_t count, ReduceOp op) {
  uint64_t seq;
  const int code = op == ReduceOp::kSum ? kOpAllReduceSum : kOpAllReduceMax;
  if (absl::Status s = Check(code, count, kDtypeF32, 0, &seq); !s.ok()) return s;
  bytes_.all_reduce += count * static_cast<int64_t>(sizeof(float));
  if (count == 0 || world_size_ == 1) return absl::OkStatus();
  const std::string what = absl::StrCat(CollectiveOpName(code), " #", seq);
  std::vector<int64_t> begin = SliceBounds(world_size_, count, false);
  if (absl::Status s = ReduceSlices(buf, begin, op, buf + begin[rank_], SlotOf(seq, 1), what);
      !s.ok())
    return s;
  for (int64_t& b : begin) b *= static_cast<int64_t>(sizeof(float));
  return GatherSlices(buf, begin, SlotOf(seq, 2), what);
}

absl::Status GlooCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  uint64_t seq;
  if (root < 0 || root >= world_size_) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast: root ", root, " out of range"));
  }
  if (absl::Status s = Check(kOpBroadcast, bytes, kDtypeU8, root, &seq); !s.ok()) return s;
  if (bytes == 0 || world_size_ == 1) return absl::OkStatus();
  const std::string what = absl::StrCat("broadcast #", seq);
  const auto deadline = Clock::now() + timeout_;
  Buffer b(this, buf, bytes);
  absl::Status s = GlooCall(what, [&] {
    if (rank_ != root) {
      b->recv(root, SlotOf(seq, 1), 0, bytes);
      return;
    }
    for (int p = 0; p < world_size_; ++p)
      if (p != root) b->send(p, SlotOf(seq, 1), 0, bytes);
  });
  if (!s.ok()) return Fail(s);
  return rank_ == root ? Wait(b, false, world_size_ - 1, deadline, what)
                       : Wait(b, true, 1, deadline, what);
}

// The header exchange is the barrier: no rank gets past it before every rank has sent its header.
absl::Status GlooCommunicator::Barrier() {
  uint64_t seq;
  return Check(kOpBarrier, 0, kDtypeNone, 0, &seq);
}

// ---- Point-to-point ----

absl::Status GlooCommunicator::Send(const void* buf, int64_t bytes, int peer) {
  return Transfer(const_cast<void*>(buf), bytes, peer, /*sending=*/true);
}

absl::Status GlooCommunicator::Recv(void* buf, int64_t bytes, int peer) {
  return Transfer(buf, bytes, peer, /*sending=*/false);
}

absl::Status GlooCommunicator::ExchangeSizes(int peer, uint64_t send_slot, uint64_t recv_slot,
                                             Clock::time_point deadline,
                                             const std::string& name) {
  Buffer mine(this, &sizes_[0], sizeof(int64_t));
  Buffer theirs(this, &sizes_[1], sizeof(int64_t));
  absl::Status s = GlooCall(name, [&] {
    mine->send(peer, send_slot, 0, sizeof(int64_t));
    theirs->recv(peer, recv_slot, 0, sizeof(int64_t));
  });
  if (!s.ok()) return Fail(s);
  if (s = Wait(theirs, true, 1, deadline, name); !s.ok()) return s;
  return Wait(mine, false, 1, deadline, name);
}

absl::Status GlooCommunicator::Transfer(void* buf, int64_t bytes, int peer, bool sending) {
  const char* what = sending ? "send" : "recv";
  if (absl::Status s = CheckPeer(what, peer, bytes); !s.ok()) return s;
  if (failed_.load()) return Failed();
  const int from = sending ? rank_ : peer, to = sending ? peer : rank_;
  const int64_t n = ++(sending ? sends_ : recvs_)[peer];
  const bool low = from < to;
  const std::string name = absl::StrCat(what, " #", n, " from rank ", from, " to rank ", to);
  const auto deadline = Clock::now() + timeout_;
  sizes_[0] = bytes;
  if (absl::Status s = ExchangeSizes(peer, TransferSlot(n, low, sending ? 0 : 1),
                                     TransferSlot(n, low, sending ? 1 : 0), deadline, name);
      !s.ok())
    return s;
  const int64_t other = sizes_[1];
  if (absl::Status s = CheckTransfer(sending, n, from, sending ? bytes : other, to,
                                     sending ? other : bytes);
      !s.ok())
    return Fail(s);
  if (bytes == 0) return absl::OkStatus();
  Buffer data(this, buf, static_cast<size_t>(bytes));
  absl::Status s = GlooCall(name, [&] {
    if (sending) data->send(peer, TransferSlot(n, low, 2), 0, static_cast<size_t>(bytes));
    if (!sending) data->recv(peer, TransferSlot(n, low, 2), 0, static_cast<size_t>(bytes));
  });
  if (!s.ok()) return Fail(s);
  return Wait(data, !sending, 1, deadline, name);
}

}  // namespace fsdp8
