// DevBuf: an owning handle to one Backend allocation (RAII), typed views for convenience.
//
// Allocation failure (a device out of memory) aborts with the size: the trainer's buffers are
// sized from the job spec, and the CPU backend aborts on out-of-memory anyway.
//
// Thread-safety: as the Backend (one thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>
#include <utility>

#include "common/check.h"
#include "kernels/backend.h"

namespace fsdp8 {

class DevBuf {
 public:
  DevBuf() = default;
  DevBuf(Backend* be, size_t bytes) : be_(be), bytes_(bytes) {
    if (bytes > 0) {
      p_ = be->Alloc(bytes);
      FSDP8_CHECK(p_ != nullptr) << "device out of memory allocating " << bytes << " bytes";
    }
  }
  // Allocates and zeroes.
  static DevBuf Zeros(Backend* be, size_t bytes) {
    DevBuf b(be, bytes);
    if (bytes > 0) be->Memset(b.p_, 0, bytes);
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
    if (p_ != nullptr) be_->Free(p_);
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

}  // namespace fsdp8
