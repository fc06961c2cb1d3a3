// Internal to kernels/cuda: error-checking macros and small device helpers shared by the .cu files.
//
// A failing CUDA / cuBLASLt call inside the backend is a broken invariant (backend.h, Errors): it
// prints the call, the error name and string and file:line to stderr and aborts. Other host-side
// invariants (shapes, alignment) use FSDP8_CHECK of common/check.h.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime_api.h>

namespace fsdp8::cuda {

[[noreturn]] inline void DieCuda(const char* what, cudaError_t e, const char* file, int line) {
  std::fprintf(stderr, "fsdp8 cuda: %s failed: %s (%s) at %s:%d\n", what, cudaGetErrorName(e),
               cudaGetErrorString(e), file, line);
  std::fflush(stderr);
  std::abort();
}

}  // namespace fsdp8::cuda

#define FSDP8_CUDA_CHECK(expr)                                              \
  do {                                                                      \
    cudaError_t fsdp8_e_ = (expr);                                          \
    if (fsdp8_e_ != cudaSuccess) ::fsdp8::cuda::DieCuda(#expr, fsdp8_e_, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: reports launch-configuration errors (not asynchronous faults).
#define FSDP8_CUDA_LAUNCH_CHECK() FSDP8_CUDA_CHECK(cudaGetLastError())
