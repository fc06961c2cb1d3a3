// DevBuf: an owning handle to one Backend allocation (RAII), typed views for convenience; or a
// non-owning view of another DevBuf's memory (View).
//
// Allocation failure (out of device memory, or of host memory for the CPU backend, or over the
// backend's memory limit) throws DeviceOutOfMemory, a std::bad_alloc naming the bytes and what
// they were for (the AllocationLabels in force). The worker catches it, and a host std::bad_alloc,
// at its boundaries (CatchAllocationFailure): the job fails with RESOURCE_EXHAUSTED, its memory is
// freed as the stack unwinds and the job is dropped, and the worker itself stays up.
//
// Thread-safety: as the Backend (one thread). AllocationLabels are per thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "kernels/backend.h"

namespace fsdp8 {

// Names what the allocations made on this thread while it lives are for, e.g.
// AllocationLabel l("the activations of block", 3). Labels nest (outermost first). `what` must
// outlive the label (a string literal); index < 0: none.
class AllocationLabel {
 public:
  explicit AllocationLabel(const char* what, int64_t index = -1)
      : uncaught_(std::uncaught_exceptions()) {
    Stack().emplace_back(what, index);
  }
  // An exception unwinding through the innermost label records the labels in force (TakeFailed).
  ~AllocationLabel() {
    if (std::uncaught_exceptions() > uncaught_ && Failed().empty()) Failed() = Current();
    Stack().pop_back();
  }
  AllocationLabel(const AllocationLabel&) = delete;
  AllocationLabel& operator=(const AllocationLabel&) = delete;

  // The labels in force on this thread, outermost first, joined by ": "; "" when none.
  static std::string Current() {
    std::string out;
    for (const auto& [what, index] : Stack())
      absl::StrAppend(&out, out.empty() ? "" : ": ", what, index >= 0 ? absl::StrCat(" ", index) : "");
    return out;
  }
  // The labels in force where the last exception on this thread started unwinding through them
  // ("" when none), and forgets them.
  static std::string TakeFailed() { return std::exchange(Failed(), std::string()); }

 private:
  static std::vector<std::pair<const char*, int64_t>>& Stack() {
    thread_local std::vector<std::pair<const char*, int64_t>> stack;
    return stack;
  }
  static std::string& Failed() {
    thread_local std::string failed;
    return failed;
  }
  int uncaught_;
};

// A Backend allocation that failed: the bytes asked for, the backend's bytes in use, and the
// AllocationLabels in force.
class DeviceOutOfMemory : public std::bad_alloc {
 public:
  DeviceOutOfMemory(size_t bytes, int64_t allocated)
      : message_(absl::StrCat("could not allocate ", bytes, " bytes of ", "device memory (",
                              allocated, " bytes in use)")) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

class DevBuf {
 public:
  DevBuf() = default;
  // Throws DeviceOutOfMemory when the backend cannot allocate `bytes`.
  DevBuf(Backend* be, size_t bytes) : be_(be), bytes_(bytes) {
    if (bytes > 0) {
      p_ = be->Alloc(bytes);
      if (p_ == nullptr) throw DeviceOutOfMemory(bytes, be->AllocatedBytes());
    }
  }
  // Allocates under memory label `label` (common/memory_label.h) instead of the backend account's
  // current one (MemoryLabelScope).
  DevBuf(Backend* be, size_t bytes, MemoryLabel label) {
    const MemoryLabelScope scope(&be->account(), label);
    *this = DevBuf(be, bytes);
  }
  static DevBuf Zeros(Backend* be, size_t bytes, MemoryLabel label) {
    const MemoryLabelScope scope(&be->account(), label);
    return Zeros(be, bytes);
  }
  // Moves this buffer's bytes to `label` in its backend's account (a view or an empty buffer:
  // nothing).
  void Relabel(MemoryLabel label) const {
    if (p_ != nullptr && be_ != nullptr) be_->account().Relabel(p_, label);
  }
  // Allocates and zeroes.
  static DevBuf Zeros(Backend* be, size_t bytes) {
    DevBuf b(be, bytes);
    if (bytes > 0) be->Memset(b.p_, 0, bytes);
    return b;
  }
  // A view of `bytes` at `p`, memory owned by another DevBuf that must outlive it: Reset and the
  // destructor free nothing.
  static DevBuf View(void* p, size_t bytes) {
    DevBuf b;
    b.p_ = p;
    b.bytes_ = bytes;
    return b;
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept { *this = std::move(o); }
  DevBuf& operator=(DevBuf&& o) noexcept {
    if (this != &o) {
      Reset();
      be_ = o.be_;
      p_ = o.p_;
      bytes_ = o.bytes_;
      o.p_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  ~DevBuf() { Reset(); }
  void Reset() {
    if (p_ != nullptr && be_ != nullptr) be_->Free(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  void* get() const { return p_; }
  float* f32() const { return static_cast<float*>(p_); }
  uint8_t* u8() const { return static_cast<uint8_t*>(p_); }
  uint16_t* u16() const { return static_cast<uint16_t*>(p_); }
  int32_t* i32() const { return static_cast<int32_t*>(p_); }
  size_t bytes() const { return bytes_; }
  bool empty() const { return p_ == nullptr; }

 private:
  Backend* be_ = nullptr;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Per-tensor FP8 scales live in device arrays with one 16-byte slot each: cuBLASLt refuses FP8
// scale pointers that are not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED at cublasLtMatmul,
// measured on H200 with cuBLASLt 13.1), and the slots are handed to GemmFp8 as pointers.
inline constexpr int64_t kScaleStride = 4;  // floats per slot

// Uploads values[i] to slot i of a (n * kScaleStride) f32 device array; no copy when values is
// empty.
inline void UploadScaleSlots(Backend* be, float* dev, const std::vector<float>& values) {
  if (values.empty()) return;
  std::vector<float> slots(values.size() * kScaleStride, 0.0f);
  for (size_t i = 0; i < values.size(); ++i) slots[i * kScaleStride] = values[i];
  be->CopyToDevice(dev, slots.data(), slots.size() * sizeof(float));
}

// Runs fn() (returning absl::Status or absl::StatusOr<T>). An allocation failure inside it, a
// DevBuf's or a host std::bad_alloc, becomes RESOURCE_EXHAUSTED "out of memory <doing>: <detail>
// for <labels>", e.g. "out of memory in step 3: could not allocate 268435456 bytes of device
// memory (1048576 bytes in use) for the activations of block 0". Everything fn allocated on the
// way has been freed by then (RAII).
template <typename F>
auto CatchAllocationFailure(const std::string& doing, F&& fn) -> decltype(fn()) {
  AllocationLabel::TakeFailed();  // nothing stale from an earlier exception
  try {
    return fn();
  } catch (const std::bad_alloc& e) {
    const std::string labels = AllocationLabel::TakeFailed();
    const bool device = dynamic_cast<const DeviceOutOfMemory*>(&e) != nullptr;
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory ", doing, ": ",
                     device ? std::string(e.what())
                            : absl::StrCat("could not allocate host memory (", e.what(), ")"),
                     labels.empty() ? "" : absl::StrCat(" for ", labels)));
  }
}

}  // namespace fsdp8
