// WORKER_CHECK(cond) << "context": a broken invariant aborts with file:line, the condition and the
// streamed context (programming errors only; failures from the outside world are Status values).
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

}  // namespace internal
}  // namespace fsdp8

#define WORKER_CHECK(cond) \
  if (cond) {              \
  } else                   \
    ::fsdp8::internal::CheckFailure(__FILE__, __LINE__, #cond).stream()
