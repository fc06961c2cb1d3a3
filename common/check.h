// FSDP8_CHECK(cond) << "context": a broken invariant aborts the process after printing
//   <file>:<line>: check failed: <cond> <context>
// to stderr. For programming errors only (null pointers, shape mismatches, host out of memory);
// failures from the outside world are absl::Status values. The one assertion macro of the project,
// in every library and in host code of the CUDA backend (kernels/cuda/cuda_check.h keeps
// FSDP8_CUDA_CHECK, which checks a CUDA API's error code instead).
//
// The macro is one expression, so `if (a) FSDP8_CHECK(b) << "x"; else ...` binds the else to the
// caller's if. `cond` is evaluated once; the context only when it is false.
#pragma once

#include <cstdlib>
#include <iostream>
#include <sstream>

namespace fsdp8 {
namespace internal {

class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* cond) {
    os_ << file << ":" << line << ": check failed: " << cond << " ";
  }
  [[noreturn]] ~CheckFailure() {
    std::cerr << os_.str() << std::endl;
    std::abort();
  }
  std::ostream& stream() { return os_; }

 private:
  std::ostringstream os_;
};

// Turns the streamed failure into void, the type of the other branch of FSDP8_CHECK's ?:.
// operator& binds looser than <<, so every `<< context` reaches the stream first.
struct CheckVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace internal
}  // namespace fsdp8

#define FSDP8_CHECK(cond)                   \
  (cond) ? static_cast<void>(0)             \
         : ::fsdp8::internal::CheckVoidify() & \
               ::fsdp8::internal::CheckFailure(__FILE__, __LINE__, #cond).stream()
