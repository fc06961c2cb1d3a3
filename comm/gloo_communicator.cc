#include "comm/gloo_communicator.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace fsdp8 {
namespace {

enum Op : int { kAllGather = 1, kReduceScatter = 2, kAllReduceSum = 3, kAllReduceMax = 4,
                kBroadcast = 5, kBarrier = 6 };
enum Dtype : int { kU8 = 1, kF32 = 2, kNone = 3 };

const char* OpName(int op) {
  switch (op) {
    case kAllGather: return "all_gather";
    case kReduceScatter: return "reduce_scatter";
    case kAllReduceSum: return "all_reduce(sum)";
    case kAllReduceMax: return "all_reduce(max)";
    case kBroadcast: return "broadcast";
    case kBarrier: return "barrier";
  }
  return "unknown";
}
const char* DtypeName(int d) { return d == kU8 ? "u8" : d == kF32 ? "f32" : "none"; }

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

struct Header {  // one per rank per collective, all-gathered before the collective
  int64_t seq;  // equal on all ranks by construction (the exchange's tag is derived from it)
  int64_t op;
  int64_t count;
  int64_t dtype_and_extra;  // dtype in the low 32 bits, op-specific (root) in the high bits
};

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
  return std::unique_ptr<GlooCommunicator>(new GlooCommunicator(rank, world_size, ctx, timeout));
}

GlooCommunicator::GlooCommunicator(int rank, int world_size, std::shared_ptr<gloo::Context> ctx,
                                   std::chrono::milliseconds timeout)
    : rank_(rank), world_size_(world_size), ctx_(std::move(ctx)), timeout_(timeout) {}

GlooCommunicator::~GlooCommunicator() = default;

absl::Status GlooCommunicator::Failed() const {
  std::lock_guard<std::mutex> l(mu_);
  return absl::Status(error_.code() == absl::StatusCode::kOk ? absl::StatusCode::kUnavailable
                                                               : error_.code(),
                      absl::StrCat("communicator failed earlier: ", error_.message()));
}

absl::Status GlooCommunicator::Fail(absl::Status s) {
  std::lock_guard<std::mutex> l(mu_);
  if (!failed_.exchange(true)) error_ = s;
  return s;
}

void GlooCommunicator::Abort(const std::string& reason) {
  Fail(absl::AbortedError(absl::StrCat("aborted: ", reason))).IgnoreError();
}

absl::Status GlooCommunicator::Check(int op, int64_t count, int dtype, int64_t extra,
                                     uint64_t* seq) {
  if (failed_.load()) return Failed();
  *seq = ++seq_;
  Header mine{static_cast<int64_t>(*seq), op, count, (extra << 32) | dtype};
  if (world_size_ == 1) return absl::OkStatus();
  std::vector<Header> all(world_size_);
  absl::Status s = GlooCall(absl::StrCat(OpName(op), " #", *seq, " (header exchange)"), [&] {
    gloo::AllgatherOptions o(ctx_);
    o.setInput(reinterpret_cast<int64_t*>(&mine), 4);
    o.setOutput(reinterpret_cast<int64_t*>(all.data()), 4 * world_size_);
    o.setTag(static_cast<uint32_t>(2 * *seq));
    o.setTimeout(timeout_);
    gloo::allgather(o);
  });
  if (!s.ok()) return Fail(s);
  for (int r = 0; r < world_size_; ++r) {
    const Header& h = all[r];
    if (h.op != mine.op) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "collective #", *seq, ": rank ", rank_, " called ", OpName(op), ", rank ", r,
          " called ", OpName(static_cast<int>(h.op)))));
    }
  }
  for (int r = 1; r < world_size_; ++r) {
    const Header& a = all[0];
    const Header& b = all[r];
    if (a.count != b.count) {
      // u8 collectives count bytes, f32 ones elements.
      const char* unit = dtype == kU8 ? " bytes" : " elements";
      return Fail(absl::InvalidArgumentError(absl::StrCat(OpName(op), " #", *seq, ": rank 0 has ",
                                                          a.count, unit, ", rank ", r, " has ",
                                                          b.count, unit)));
    }
    if ((a.dtype_and_extra & 0xffffffff) != (b.dtype_and_extra & 0xffffffff)) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          OpName(op), " #", *seq, ": rank 0 has dtype ",
          DtypeName(static_cast<int>(a.dtype_and_extra & 0xffffffff)), ", rank ", r, " has ",
          DtypeName(static_cast<int>(b.dtype_and_extra & 0xffffffff)))));
    }
    if ((a.dtype_and_extra >> 32) != (b.dtype_and_extra >> 32)) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat(OpName(op), " #", *seq, ": rank 0 has root ", a.dtype_and_extra >> 32,
                       ", rank ", r, " has root ", b.dtype_and_extra >> 32)));
    }
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AllGather(const void* send, void* recv, int64_t bytes_per_rank) {
  uint64_t seq;
  if (absl::Status s = Check(kAllGather, bytes_per_rank, kU8, 0, &seq); !s.ok()) return s;
  bytes_.all_gather += bytes_per_rank * world_size_;
  if (bytes_per_rank == 0) return absl::OkStatus();
  if (world_size_ == 1) {
    if (recv != send) std::memmove(recv, send, bytes_per_rank);
    return absl::OkStatus();
  }
  absl::Status s = GlooCall(absl::StrCat("all_gather #", seq), [&] {
    gloo::AllgatherOptions o(ctx_);
    o.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(send)), bytes_per_rank);
    o.setOutput(static_cast<uint8_t*>(recv), bytes_per_rank * world_size_);
    o.setTag(static_cast<uint32_t>(2 * seq + 1));
    o.setTimeout(timeout_);
    gloo::allgather(o);
  });
  return s.ok() ? s : Fail(s);
}

absl::Status GlooCommunicator::ReduceScatterSum(const float* send, float* recv, int64_t count) {
  uint64_t seq;
  if (absl::Status s = Check(kReduceScatter, count, kF32, 0, &seq); !s.ok()) return s;
  bytes_.reduce_scatter += count * world_size_ * static_cast<int64_t>(sizeof(float));
  if (count == 0) return absl::OkStatus();
  if (world_size_ == 1) {
    if (recv != send) std::memmove(recv, send, count * sizeof(float));
    return absl::OkStatus();
  }
  std::vector<float> tmp(send, send + count * world_size_);
  absl::Status s = GlooCall(absl::StrCat("reduce_scatter #", seq), [&] {
    gloo::AllreduceOptions o(ctx_);
    o.setOutput(tmp.data(), tmp.size());
    o.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
        &gloo::sum<float>));
    o.setTag(static_cast<uint32_t>(2 * seq + 1));
    o.setTimeout(timeout_);
    gloo::allreduce(o);
  });
  if (!s.ok()) return Fail(s);
  std::memcpy(recv, tmp.data() + count * rank_, count * sizeof(float));
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AllReduce(float* buf, int64_t count, ReduceOp op) {
  uint64_t seq;
  const int code = op == ReduceOp::kSum ? kAllReduceSum : kAllReduceMax;
  if (absl::Status s = Check(code, count, kF32, 0, &seq); !s.ok()) return s;
  bytes_.all_reduce += count * static_cast<int64_t>(sizeof(float));
  if (count == 0 || world_size_ == 1) return absl::OkStatus();
  absl::Status s = GlooCall(absl::StrCat(OpName(code), " #", seq), [&] {
    gloo::AllreduceOptions o(ctx_);
    o.setOutput(buf, count);
    if (op == ReduceOp::kSum) {
      o.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
          &gloo::sum<float>));
    } else {
      o.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
          &gloo::max<float>));
    }
    o.setTag(static_cast<uint32_t>(2 * seq + 1));
    o.setTimeout(timeout_);
    gloo::allreduce(o);
  });
  return s.ok() ? s : Fail(s);
}

absl::Status GlooCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  uint64_t seq;
  if (root < 0 || root >= world_size_) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast: root ", root, " out of range"));
  }
  if (absl::Status s = Check(kBroadcast, bytes, kU8, root, &seq); !s.ok()) return s;
  if (bytes == 0 || world_size_ == 1) return absl::OkStatus();
  absl::Status s = GlooCall(absl::StrCat("broadcast #", seq), [&] {
    gloo::BroadcastOptions o(ctx_);
    o.setOutput(static_cast<uint8_t*>(buf), bytes);
    o.setRoot(root);
    o.setTag(static_cast<uint32_t>(2 * seq + 1));
    o.setTimeout(timeout_);
    gloo::broadcast(o);
  });
  return s.ok() ? s : Fail(s);
}

absl::Status GlooCommunicator::Barrier() {
  uint64_t seq;
  if (absl::Status s = Check(kBarrier, 0, kNone, 0, &seq); !s.ok()) return s;
  if (world_size_ == 1) return absl::OkStatus();
  absl::Status s = GlooCall(absl::StrCat("barrier #", seq), [&] {
    gloo::BarrierOptions o(ctx_);
    o.setTag(static_cast<uint32_t>(2 * seq + 1));
    o.setTimeout(timeout_);
    gloo::barrier(o);
  });
  return s.ok() ? s : Fail(s);
}

}  // namespace fsdp8
