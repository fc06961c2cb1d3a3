// The memory a backend's device offers, for the worker's registration (the coordinator plans jobs
// with it: common/memory_plan.h).
//
// Thread-safety: safe to call from any thread.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp8 {

// "cuda": the device's total memory (cudaMemGetInfo); the CPU backends: the host's physical memory
// (sysconf). 0 when unknown (no such device, a backend not built); *error then says why.
int64_t DeviceMemoryBytes(const std::string& backend, int device, std::string* error);

// CUDA device `device`'s total memory in bytes; 0 when there is no such device or no usable driver
// (*error says why). Defined only in CUDA builds (kernels/cuda/cuda_backend.cu).
int64_t CudaDeviceTotalMemory(int device, std::string* error);

}  // namespace fsdp8
