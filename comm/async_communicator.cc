#include "comm/async_communicator.h"

#include <chrono>
#include <exception>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdp8 {

AsyncCommunicator::AsyncCommunicator(std::unique_ptr<Communicator> inner)
    : inner_(std::move(inner)) {
  thread_ = std::thread([this] { Loop(); });
}

AsyncCommunicator::~AsyncCommunicator() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  queued_cv_.Signal();
  thread_.join();
}

void AsyncCommunicator::Loop() {
  mu_.Lock();
  for (;;) {
    while (!stop_ && queue_.empty()) queued_cv_.Wait(&mu_);
    if (queue_.empty()) break;  // stop_ with nothing left
    auto [ticket, run] = std::move(queue_.front());
    queue_.pop_front();
    const bool skip = !error_.ok();  // fail fast behind the first error
    mu_.Unlock();
    absl::Status s = skip ? absl::OkStatus() : Run(run);
    mu_.Lock();
    if (!s.ok() && error_.ok()) error_ = std::move(s);
    completed_ = ticket;
    done_cv_.SignalAll();
  }
  mu_.Unlock();
}

absl::Status AsyncCommunicator::Run(const std::function<absl::Status()>& run) {
  // An exception must not leave the helper thread (std::terminate would take the worker down):
  // it becomes this communicator's error, as a failed collective's status.
  try {
    return run();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of host memory in a collective");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("collective threw: ", e.what()));
  }
}

absl::StatusOr<int64_t> AsyncCommunicator::Enqueue(std::function<absl::Status()> run) {
  int64_t ticket;
  {
    absl::MutexLock l(&mu_);
    if (!error_.ok()) return error_;
    ticket = ++issued_;
    queue_.emplace_back(ticket, std::move(run));
  }
  queued_cv_.Signal();
  return ticket;
}

double AsyncCommunicator::WaitLocked(int64_t ticket) {
  if (completed_ >= ticket) return 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (completed_ < ticket) done_cv_.Wait(&mu_);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void AsyncCommunicator::Wait(int64_t ticket) {
  if (ticket <= 0) return;
  absl::MutexLock l(&mu_);
  exposed_seconds_ += WaitLocked(ticket);
}

absl::Status AsyncCommunicator::Finish(absl::StatusOr<int64_t> ticket) {
  if (!ticket.ok()) return ticket.status();
  absl::MutexLock l(&mu_);
  WaitLocked(*ticket);
  return error_;
}

absl::Status AsyncCommunicator::AllGather(const void* send, void* recv, int64_t bytes_per_rank) {
  return Finish(AllGatherAsync(send, recv, bytes_per_rank));
}

absl::Status AsyncCommunicator::ReduceScatterSum(const float* send, float* recv, int64_t count) {
  return Finish(ReduceScatterSumAsync(send, recv, count));
}

absl::StatusOr<int64_t> AsyncCommunicator::AllGatherAsync(const void* send, void* recv,
                                                          int64_t bytes_per_rank) {
  absl::StatusOr<int64_t> t =
      Enqueue([=, this] { return inner_->AllGather(send, recv, bytes_per_rank); });
  if (t.ok()) bytes_.all_gather += bytes_per_rank * world_size();
  return t;
}

absl::StatusOr<int64_t> AsyncCommunicator::ReduceScatterSumAsync(const float* send, float* recv,
                                                                 int64_t count) {
  absl::StatusOr<int64_t> t =
      Enqueue([=, this] { return inner_->ReduceScatterSum(send, recv, count); });
  if (t.ok()) {
    bytes_.reduce_scatter += count * world_size() * static_cast<int64_t>(sizeof(float));
  }
  return t;
}

absl::StatusOr<int64_t> AsyncCommunicator::AllReduceAsync(float* buf, int64_t count,
                                                          ReduceOp op) {
  absl::StatusOr<int64_t> t = Enqueue([=, this] { return inner_->AllReduce(buf, count, op); });
  if (t.ok()) bytes_.all_reduce += count * static_cast<int64_t>(sizeof(float));
  return t;
}

absl::Status AsyncCommunicator::AllReduce(float* buf, int64_t count, ReduceOp op) {
  return Finish(AllReduceAsync(buf, count, op));
}

absl::Status AsyncCommunicator::Send(const void* buf, int64_t bytes, int peer) {
  return Finish(Enqueue([=, this] { return inner_->Send(buf, bytes, peer); }));
}

absl::Status AsyncCommunicator::Recv(void* buf, int64_t bytes, int peer) {
  return Finish(Enqueue([=, this] { return inner_->Recv(buf, bytes, peer); }));
}

absl::StatusOr<std::unique_ptr<Communicator>> AsyncCommunicator::Split(int color, int key) {
  absl::StatusOr<std::unique_ptr<Communicator>> child =
      absl::UnknownError("split: not run");  // set on the helper thread before Finish returns
  // The split's error is returned, not recorded: this communicator is left as the wrapped one
  // leaves it (failed when the exchange failed, usable when only the sub-group's rendezvous did).
  absl::Status s = Finish(Enqueue([&, this] {
    child = inner_->Split(color, key);
    return absl::OkStatus();
  }));
  if (!s.ok()) return s;
  if (!child.ok()) return child.status();
  return std::unique_ptr<Communicator>(std::make_unique<AsyncCommunicator>(std::move(*child)));
}

absl::Status AsyncCommunicator::Broadcast(void* buf, int64_t bytes, int root) {
  return Finish(Enqueue([=, this] { return inner_->Broadcast(buf, bytes, root); }));
}

absl::Status AsyncCommunicator::Barrier() {
  return Finish(Enqueue([this] { return inner_->Barrier(); }));
}

absl::Status AsyncCommunicator::Verify() {
  return Finish(Enqueue([this] { return inner_->Verify(); }));
}

void AsyncCommunicator::Abort(const std::string& reason) {
  {
    absl::MutexLock l(&mu_);  // the helper never holds mu_ while a collective runs
    if (error_.ok()) error_ = absl::AbortedError(absl::StrCat("aborted: ", reason));
  }
  inner_->Abort(reason);
}

double AsyncCommunicator::ConsumeExposedSeconds() {
  const double s = exposed_seconds_;
  exposed_seconds_ = 0;
  return s;
}

}  // namespace fsdp8
