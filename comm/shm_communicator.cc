#include "comm/shm_communicator.h"

#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <new>
#include <random>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/collective_check.h"

namespace fsdp8 {

// The point-to-point words of one ordered pair (sender, receiver): pairs[sender][receiver].
struct ShmPair {
  std::atomic<uint32_t> bell;     // futex word: bumped after every change below
  std::atomic<uint32_t> waiters;  // sides asleep (or about to sleep) on bell
  std::atomic<int64_t> send_n;    // the sender's latest transfer whose size is published
  std::atomic<int64_t> send_bytes;
  std::atomic<int64_t> recv_n;    // the receiver's, likewise
  std::atomic<int64_t> recv_bytes;
  std::atomic<int64_t> posted;    // chunks written into the sender's slot, over the pair's life
  std::atomic<int64_t> taken;     // chunks the receiver has copied out
};

// The control block at the start of the segment. Plain data and lock-free atomics only: it is
// shared between processes.
struct SharedMemoryCommunicator::Control {
  uint64_t nonce;  // rank 0's random number; a peer that maps another segment sees a different one
  int32_t world;
  alignas(64) std::atomic<uint32_t> arrived;  // ranks at the current meeting
  alignas(64) std::atomic<uint32_t> gen;      // meetings completed; the futex word
  std::atomic<uint32_t> waiters;              // ranks asleep (or about to sleep) on gen
  alignas(64) std::atomic<int32_t> failed_rank;  // 0, or 1 + the first rank that failed
  char reason[kMaxRanks][192];                // rank p's first error, written before failed_rank
  int32_t pid[kMaxRanks];                     // 0 until rank p has mapped the segment
  CollectiveHeader headers[2][kMaxRanks];     // by the parity of the collective's number
  ShmPair pairs[kMaxRanks][kMaxRanks];        // point-to-point, [sender][receiver]
};

namespace {

using Control = SharedMemoryCommunicator::Control;
static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4,
              "the futex word must be a plain 32-bit word");
static_assert(std::atomic<int64_t>::is_always_lock_free, "shared between processes");
constexpr size_t kDataOffset = (sizeof(Control) + 4095) / 4096 * 4096;  // the slots, page aligned
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr auto kSleepSlice = std::chrono::milliseconds(20);

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected) {
  timespec ts{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kSleepSlice).count()};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// False once process `pid` has exited (gone, or a zombie not yet reaped).
bool ProcessAlive(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return kill(pid, 0) == 0 || errno == EPERM;
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');  // "pid (comm) S ...": the state follows the name
  if (paren == std::string::npos || paren + 2 >= line.size()) return true;
  return line[paren + 2] != 'Z' && line[paren + 2] != 'X';
}

std::string ReadLink(const char* path) {
  char buf[256];
  const ssize_t n = readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// Creates, reserves and maps segment `name` of `bytes`.
absl::StatusOr<void*> CreateSegment(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return absl::FailedPreconditionError(absl::StrCat("shm_open ", name, ": ", strerror(errno)));
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* p = rc == 0 ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int map_errno = errno;
  close(fd);
  if (p != MAP_FAILED) return p;
  shm_unlink(name.c_str());
  return absl::FailedPreconditionError(
      absl::StrCat(rc != 0 ? "reserving " : "mapping ", bytes, " bytes of shared memory (",
                   name, "): ", strerror(rc != 0 ? rc : map_errno)));
}

// Maps segment `name` of `bytes` made by rank 0; nullptr when it cannot.
void* MapSegment(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return nullptr;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  return p == MAP_FAILED ? nullptr : p;
}

size_t SegmentBytes(int world) {
  return kDataOffset + static_cast<size_t>(world) * SharedMemoryCommunicator::kSlotBytes;
}

}  // namespace

std::string SharedMemoryCommunicator::MachineIdentity() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(boot, boot_id);
  const std::string mnt = ReadLink("/proc/self/ns/mnt");
  const std::string pid = ReadLink("/proc/self/ns/pid");
  if (boot_id.empty() || mnt.empty() || pid.empty()) return "";
  return absl::StrCat(boot_id, " ", mnt, " ", pid);
}

// ---- Rendezvous ----

namespace {

struct Rendezvous {
  KvStore* store;
  std::string key;  // prefix + "shm/"
  std::chrono::milliseconds timeout;
  absl::StatusOr<std::string> Get(const std::string& k) const { return store->Get(key + k, timeout); }
  absl::Status Set(const std::string& k, const std::string& v) const { return store->Set(key + k, v); }
};

// Rank 0: whether every other rank published this rank's `machine` (never when it is "").
absl::StatusOr<bool> AllOnThisMachine(const Rendezvous& rv, int world, const std::string& machine) {
  bool same = !machine.empty() && world <= SharedMemoryCommunicator::kMaxRanks;
  for (int p = 1; p < world; ++p) {
    absl::StatusOr<std::string> v = rv.Get(absl::StrCat("machine/", p));
    if (!v.ok()) return v.status();
    same = same && *v == machine;
  }
  return same;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemoryCommunicator>> SharedMemoryCommunicator::Create(
    int rank, int world_size, KvStore* store, const std::string& prefix,
    std::chrono::milliseconds timeout, std::chrono::milliseconds bootstrap_timeout,
    const std::string& machine) {
  if (bootstrap_timeout.count() <= 0) bootstrap_timeout = timeout;
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("shm: bad rank ", rank, " of ", world_size));
  }
  const size_t bytes = SegmentBytes(world_size);
  const CpuBootstrap bootstrap{store, prefix, timeout, bootstrap_timeout};
  auto make = [&](void* base) {
    return std::unique_ptr<SharedMemoryCommunicator>(
        new SharedMemoryCommunicator(rank, world_size, base, bytes, bootstrap));
  };
  if (world_size == 1) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return absl::ResourceExhaustedError("shm: mapping the segment failed");
    new (p) Control();
    static_cast<Control*>(p)->world = 1;
    return make(p);
  }
  const Rendezvous rv{store, prefix + "shm/", bootstrap_timeout};
  const auto not_shared = [](const std::string& why) {
    return absl::FailedPreconditionError("the ranks do not share this machine's memory: " + why);
  };
  if (rank != 0) {
    if (absl::Status s = rv.Set(absl::StrCat("machine/", rank), machine); !s.ok()) return s;
    absl::StatusOr<std::string> seg = rv.Get("segment");
    if (!seg.ok()) return seg.status();
    if (*seg == "-") return not_shared("rank 0 found another machine or could not make a segment");
    std::istringstream in(*seg);
    std::string name;
    uint64_t nonce = 0;
    in >> name >> nonce;
    void* p = MapSegment(name, bytes);
    Control* ctl = static_cast<Control*>(p);
    const bool ok = p != nullptr && ctl->nonce == nonce && ctl->world == world_size;
    if (ok) ctl->pid[rank] = static_cast<int32_t>(getpid());
    if (absl::Status s = rv.Set(absl::StrCat("mapped/", rank), ok ? "1" : "0"); !s.ok()) return s;
    absl::StatusOr<std::string> use = rv.Get("use");
    if (ok && use.ok() && *use == "1") return make(p);
    if (p != nullptr) munmap(p, bytes);
    if (!use.ok()) return use.status();
    return not_shared(ok ? "another rank could not map the segment" : "cannot map " + name);
  }
  absl::StatusOr<bool> same = AllOnThisMachine(rv, world_size, machine);
  if (!same.ok()) return same.status();
  std::random_device rd;
  const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  const std::string name = absl::StrCat("/fsdp8-comm-", getpid(), "-", nonce);
  absl::StatusOr<void*> p = *same ? CreateSegment(name, bytes) : absl::StatusOr<void*>(nullptr);
  if (!*same || !p.ok()) {
    if (absl::Status s = rv.Set("segment", "-"); !s.ok()) return s;
    return not_shared(*same ? std::string(p.status().message()) : "the ranks' machines differ");
  }
  Control* ctl = new (*p) Control();
  ctl->nonce = nonce;
  ctl->world = world_size;
  ctl->pid[0] = static_cast<int32_t>(getpid());
  absl::Status s = rv.Set("segment", absl::StrCat(name, " ", nonce));
  bool all = s.ok();
  for (int q = 1; q < world_size && all; ++q) {
    absl::StatusOr<std::string> v = rv.Get(absl::StrCat("mapped/", q));
    if (!v.ok()) s = v.status();
    all = v.ok() && *v == "1";
  }
  shm_unlink(name.c_str());  // every peer has mapped it or never will
  if (s.ok()) s = rv.Set("use", all ? "1" : "0");
  if (s.ok() && all) return make(*p);
  munmap(*p, bytes);
  return s.ok() ? not_shared("a rank could not map the segment") : s;
}

namespace {

absl::StatusOr<std::unique_ptr<Communicator>> MakeSharedMemorySubgroup(int rank, int world,
                                                                       const CpuBootstrap& b) {
  auto c = SharedMemoryCommunicator::Create(rank, world, b.store, b.prefix, b.timeout,
                                            b.bootstrap_timeout);
  if (!c.ok()) return c.status();
  return std::unique_ptr<Communicator>(std::move(*c));
}

}  // namespace

SharedMemoryCommunicator::SharedMemoryCommunicator(int rank, int world_size, void* base,
                                                   size_t bytes, const CpuBootstrap& bootstrap)
    : CpuCommunicatorBase(bootstrap, MakeSharedMemorySubgroup), rank_(rank),
      world_size_(world_size), base_(base), mapped_bytes_(bytes),
      ctl_(static_cast<Control*>(base)), timeout_(bootstrap.timeout), sends_(world_size),
      recvs_(world_size), chunks_out_(world_size), chunks_in_(world_size) {}

// A rank that leaves tells its peers, as a closed TCP connection would: a collective they are
// blocked in (one this rank will never join) fails at once.
SharedMemoryCommunicator::~SharedMemoryCommunicator() {
  Fail(absl::CancelledError("closed its communicator")).IgnoreError();
  munmap(base_, mapped_bytes_);
}

uint8_t* SharedMemoryCommunicator::Slot(int p) const {
  return static_cast<uint8_t*>(base_) + kDataOffset + static_cast<size_t>(p) * kSlotBytes;
}

// ---- Failure and abort ----

absl::Status SharedMemoryCommunicator::Failed() const {
  absl::MutexLock l(&mu_);
  return absl::Status(error_.code(), absl::StrCat("communicator failed earlier: ", error_.message()));
}

absl::Status SharedMemoryCommunicator::Fail(absl::Status s) {
  absl::MutexLock l(&mu_);
  if (!failed_.exchange(true)) {
    error_ = std::move(s);
    std::snprintf(ctl_->reason[rank_], sizeof(ctl_->reason[rank_]), "%s",
                  std::string(error_.message()).c_str());
    int32_t none = 0;
    ctl_->failed_rank.compare_exchange_strong(none, rank_ + 1);
  }
  FutexWake(&ctl_->gen);
  return error_;
}

void SharedMemoryCommunicator::Abort(const std::string& reason) {
  Fail(absl::AbortedError(absl::StrCat("aborted: ", reason))).IgnoreError();
}

std::string SharedMemoryCommunicator::Call::Name() const {
  if (from < 0) return absl::StrCat(CollectiveOpName(op), " #", seq);
  return absl::StrCat(CollectiveOpName(op), " #", seq, " from rank ", from, " to rank ", to);
}

absl::Status SharedMemoryCommunicator::PeerFailure(const Call& call) {
  const int32_t failed = ctl_->failed_rank.load();
  if (failed == 0 || failed - 1 == rank_) return absl::OkStatus();
  return Fail(absl::UnavailableError(absl::StrCat(call.Name(), ": rank ", failed - 1,
                                                  " left the collective: ",
                                                  ctl_->reason[failed - 1])));
}

absl::Status SharedMemoryCommunicator::Health(Clock::time_point deadline, const Call& call) {
  if (failed_.load()) return Fail(absl::AbortedError(call.Name() + ": aborted"));
  if (absl::Status s = PeerFailure(call); !s.ok()) return s;
  if (Clock::now() >= deadline) {
    return Fail(absl::DeadlineExceededError(absl::StrCat(
        call.Name(), ": timed out after ", timeout_.count(), " ms (a peer is gone or stuck)")));
  }
  for (int p = 0; p < world_size_; ++p) {
    const int pid = ctl_->pid[p];
    if (p != rank_ && pid != 0 && !ProcessAlive(pid)) {
      return Fail(absl::UnavailableError(
          absl::StrCat(call.Name(), ": rank ", p, " (process ", pid, ") is gone")));
    }
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryCommunicator::Meet(Clock::time_point deadline, const Call& call) {
  // A rank that failed may have arrived before it did: its arrival must not complete this meeting.
  if (absl::Status s = PeerFailure(call); !s.ok()) return s;
  const uint32_t gen = ctl_->gen.load(std::memory_order_acquire);
  if (ctl_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 ==
      static_cast<uint32_t>(world_size_)) {
    ctl_->arrived.store(0, std::memory_order_relaxed);
    ctl_->gen.fetch_add(1, std::memory_order_seq_cst);
    if (ctl_->waiters.load(std::memory_order_seq_cst) > 0) FutexWake(&ctl_->gen);
    return absl::OkStatus();
  }
  return Await(&ctl_->gen, &ctl_->waiters,
               [&] { return ctl_->gen.load(std::memory_order_acquire) != gen; }, deadline, call);
}

template <typename Done>
absl::Status SharedMemoryCommunicator::Await(std::atomic<uint32_t>* word,
                                             std::atomic<uint32_t>* waiters, Done done,
                                             Clock::time_point deadline, const Call& call) {
  const auto spin_end = Clock::now() + kSpin;
  for (int i = 1;; ++i) {
    if (done()) return absl::OkStatus();
    if (i % 64 == 0 && Clock::now() > spin_end) break;
    _mm_pause();
  }
  for (;;) {
    const uint32_t seen = word->load(std::memory_order_seq_cst);
    if (done()) return absl::OkStatus();
    if (absl::Status s = Health(deadline, call); !s.ok()) return s;
    waiters->fetch_add(1, std::memory_order_seq_cst);
    if (word->load(std::memory_order_seq_cst) == seen && !done()) FutexWait(word, seen);
    waiters->fetch_sub(1, std::memory_order_seq_cst);
  }
}

// ---- Collectives ----

template <typename Write, typename Read>
absl::Status SharedMemoryCommunicator::Run(int op, int64_t count, int dtype, int64_t extra,
                                           int64_t rounds, Write write, Read read) {
  if (failed_.load()) return Failed();
  const uint64_t seq = ++seq_;
  const Call call{op, seq};
  ctl_->headers[seq & 1][rank_] = CollectiveHeader::Make(seq, op, count, dtype, extra);
  const auto deadline = Clock::now() + timeout_;
  for (int64_t k = 0; k < std::max<int64_t>(rounds, 1); ++k) {
    if (k < rounds) write(k);
    if (absl::Status s = Meet(deadline, call); !s.ok()) return s;
    if (k == 0) {
      absl::Status s = CheckHeaders(ctl_->headers[seq & 1], world_size_, rank_);
      if (!s.ok()) return Fail(s);
      if (rounds == 0) return absl::OkStatus();
    }
    read(k);
    if (absl::Status s = Meet(deadline, call); !s.ok()) return s;
  }
  return absl::OkStatus();
}

namespace {

// Rounds of at most `chunk` units covering `count` units (0 for none), and round k's length.
int64_t Rounds(int64_t count, int64_t chunk) { return (count + chunk - 1) / chunk; }
int64_t RoundLen(int64_t k, int64_t count, int64_t chunk) { return std::min(chunk, count - k * chunk); }

}  // namespace

absl::Status SharedMemoryCommunicator::AllGather(const void* send, void* recv,
                                                 int64_t bytes_per_rank) {
  const int64_t n = bytes_per_rank;
  const int64_t chunk = std::max<int64_t>(1, std::min(n, kSlotBytes));
  const uint8_t* in = static_cast<const uint8_t*>(send);
  uint8_t* out = static_cast<uint8_t*>(recv);
  absl::Status s = Run(
      kOpAllGather, n, kDtypeU8, 0, Rounds(n, chunk),
      [&](int64_t k) { std::memcpy(Slot(rank_), in + k * chunk, RoundLen(k, n, chunk)); },
      [&](int64_t k) {
        for (int p = 0; p < world_size_; ++p) {
          std::memcpy(out + p * n + k * chunk, Slot(p), RoundLen(k, n, chunk));
        }
      });
  if (s.ok()) bytes_.all_gather += n * world_size_;
  return s;
}

absl::Status SharedMemoryCommunicator::ReduceScatterSum(const float* send, float* recv,
                                                        int64_t count) {
  const int64_t n = count;
  const int64_t chunk = std::max<int64_t>(
      1, std::min<int64_t>(n, kSlotBytes / (static_cast<int64_t>(sizeof(float)) * world_size_)));
  // Round k: slot p holds rank p's [q * n + k * chunk, + len) for every q at q * chunk.
  absl::Status s = Run(
      kOpReduceScatter, n, kDtypeF32, 0, Rounds(n, chunk),
      [&](int64_t k) {
        float* slot = reinterpret_cast<float*>(Slot(rank_));
        const int64_t len = RoundLen(k, n, chunk);
        for (int q = 0; q < world_size_; ++q) {
          std::memcpy(slot + q * chunk, send + q * n + k * chunk, len * sizeof(float));
        }
      },
      [&](int64_t k) {
        const int64_t len = RoundLen(k, n, chunk);
        float* dst = recv + k * chunk;
        std::memcpy(dst, reinterpret_cast<const float*>(Slot(0)) + rank_ * chunk,
                    len * sizeof(float));
        for (int p = 1; p < world_size_; ++p) {  // rank order, as GlooCommunicator
          const float* v = reinterpret_cast<const float*>(Slot(p)) + rank_ * chunk;
          for (int64_t i = 0; i < len; ++i) dst[i] += v[i];
        }
      });
  if (s.ok()) bytes_.reduce_scatter += n * world_size_ * static_cast<int64_t>(sizeof(float));
  return s;
}

absl::Status SharedMemoryCommunicator::AllReduce(float* buf, int64_t count, ReduceOp op) {
  const int64_t n = count;
  const int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>(n, kSlotBytes / static_cast<int64_t>(sizeof(float))));
  const int code = op == ReduceOp::kSum ? kOpAllReduceSum : kOpAllReduceMax;
  absl::Status s = Run(
      code, n, kDtypeF32, 0, Rounds(n, chunk),
      [&](int64_t k) {
        std::memcpy(Slot(rank_), buf + k * chunk, RoundLen(k, n, chunk) * sizeof(float));
      },
      [&](int64_t k) {
        const int64_t len = RoundLen(k, n, chunk);
        float* dst = buf + k * chunk;
        std::memcpy(dst, Slot(0), len * sizeof(float));
        for (int p = 1; p < world_size_; ++p) {  // rank order: every rank gets the same bits
          const float* v = reinterpret_cast<const float*>(Slot(p));
          if (op == ReduceOp::kSum) {
            for (int64_t i = 0; i < len; ++i) dst[i] += v[i];
          } else {
            for (int64_t i = 0; i < len; ++i) dst[i] = std::max(dst[i], v[i]);
          }
        }
      });
  if (s.ok()) bytes_.all_reduce += n * static_cast<int64_t>(sizeof(float));
  return s;
}

absl::Status SharedMemoryCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  if (root < 0 || root >= world_size_) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast: root ", root, " out of range"));
  }
  const int64_t n = bytes;
  const int64_t chunk = std::max<int64_t>(1, std::min(n, kSlotBytes));
  uint8_t* data = static_cast<uint8_t*>(buf);
  return Run(
      kOpBroadcast, n, kDtypeU8, root, Rounds(n, chunk),
      [&](int64_t k) {
        if (rank_ == root) std::memcpy(Slot(root), data + k * chunk, RoundLen(k, n, chunk));
      },
      [&](int64_t k) {
        if (rank_ != root) std::memcpy(data + k * chunk, Slot(root), RoundLen(k, n, chunk));
      });
}

absl::Status SharedMemoryCommunicator::Barrier() {
  return Run(kOpBarrier, 0, kDtypeNone, 0, 0, [](int64_t) {}, [](int64_t) {});
}

// ---- Point-to-point ----

namespace {

// Wakes the side of `pair` that waits for the change just made.
void Ring(ShmPair& pair) {
  pair.bell.fetch_add(1, std::memory_order_seq_cst);
  if (pair.waiters.load(std::memory_order_seq_cst) > 0) FutexWake(&pair.bell);
}

}  // namespace

absl::Status SharedMemoryCommunicator::Send(const void* buf, int64_t bytes, int peer) {
  return Transfer(const_cast<void*>(buf), bytes, peer, /*sending=*/true);
}

absl::Status SharedMemoryCommunicator::Recv(void* buf, int64_t bytes, int peer) {
  return Transfer(buf, bytes, peer, /*sending=*/false);
}

absl::Status SharedMemoryCommunicator::Transfer(void* buf, int64_t bytes, int peer,
                                                bool sending) {
  if (absl::Status s = CheckPeer(sending ? "send" : "recv", peer, bytes); !s.ok()) return s;
  if (failed_.load()) return Failed();
  const int from = sending ? rank_ : peer, to = sending ? peer : rank_;
  const int64_t n = ++(sending ? sends_ : recvs_)[peer];
  const Call call{sending ? kOpSend : kOpRecv, static_cast<uint64_t>(n), from, to};
  const auto deadline = Clock::now() + timeout_;
  if (absl::Status s = MatchSizes(bytes, sending, call, deadline); !s.ok()) return s;
  return MoveChunks(static_cast<uint8_t*>(buf), bytes, sending, call, deadline);
}

absl::Status SharedMemoryCommunicator::MatchSizes(int64_t bytes, bool sending, const Call& call,
                                                  Clock::time_point deadline) {
  ShmPair& pair = ctl_->pairs[call.from][call.to];
  const int64_t n = static_cast<int64_t>(call.seq);
  (sending ? pair.send_bytes : pair.recv_bytes).store(bytes);
  (sending ? pair.send_n : pair.recv_n).store(n);
  Ring(pair);
  std::atomic<int64_t>& other_n = sending ? pair.recv_n : pair.send_n;
  if (absl::Status s = Await(&pair.bell, &pair.waiters, [&] { return other_n.load() >= n; },
                             deadline, call);
      !s.ok())
    return s;
  const int64_t other = (sending ? pair.recv_bytes : pair.send_bytes).load();
  absl::Status s = CheckTransfer(sending, n, call.from, sending ? bytes : other, call.to,
                                 sending ? other : bytes);
  return s.ok() ? s : Fail(s);
}

absl::Status SharedMemoryCommunicator::MoveChunks(uint8_t* data, int64_t bytes, bool sending,
                                                  const Call& call, Clock::time_point deadline) {
  ShmPair& pair = ctl_->pairs[call.from][call.to];
  int64_t& base = (sending ? chunks_out_ : chunks_in_)[sending ? call.to : call.from];
  const int64_t chunks = std::max<int64_t>(1, (bytes + kSlotBytes - 1) / kSlotBytes);
  // Chunk k (cumulative number base + k + 1 of the pair): the sender writes it once chunk k - 1
  // was taken, the receiver copies it out once it is posted.
  std::atomic<int64_t>& awaited = sending ? pair.taken : pair.posted;
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t len = std::min(kSlotBytes, bytes - k * kSlotBytes);
    const int64_t ready = base + k + (sending ? 0 : 1);
    if (absl::Status s = Await(&pair.bell, &pair.waiters, [&] { return awaited.load() >= ready; },
                               deadline, call);
        !s.ok())
      return s;
    if (len > 0 && sending) std::memcpy(Slot(call.from), data + k * kSlotBytes, len);
    if (len > 0 && !sending) std::memcpy(data + k * kSlotBytes, Slot(call.from), len);
    (sending ? pair.posted : pair.taken).store(base + k + 1);
    Ring(pair);
  }
  base += chunks;
  if (!sending) return absl::OkStatus();
  return Await(&pair.bell, &pair.waiters, [&] { return pair.taken.load() >= base; }, deadline,
               call);
}

}  // namespace fsdp8
