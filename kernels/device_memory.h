// The memory a backend's device offers, for the worker's registration (the coordinator plans jobs
// with it: common/memory_plan.h).
//
// Thread-safety: safe to call from any thread.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp8 {

// "cuda": the device's total memory (cudaMemGetInfo); the CPU backends: the host's physical memory
// (sysconf), or the memory limit of this process's cgroup where that is smaller (a container's
// limit: CgroupMemoryLimitBytes). 0 when unknown (no such device, a backend not built); *error
// then says why.
int64_t DeviceMemoryBytes(const std::string& backend, int device, std::string* error);

// The memory limit, in bytes, of the cgroup this process runs in, as a container runtime or
// Kubernetes sets it (resources.limits.memory): the smallest of cgroup v2's memory.max and
// cgroup v1's memory.limit_in_bytes over the process's own cgroup (named by /proc/self/cgroup)
// and its ancestors (cgroups(7)). 0 when no limit is set ("max", v1's 2^63 sentinel) or no
// cgroup file is readable. `root` is prepended to /proc and /sys paths (tests give a fake tree).
int64_t CgroupMemoryLimitBytes(const std::string& root = "");

// CUDA device `device`'s total memory in bytes; 0 when there is no such device or no usable driver
// (*error says why). Defined only in CUDA builds (kernels/cuda/cuda_backend.cu).
int64_t CudaDeviceTotalMemory(int device, std::string* error);

// CUDA device `device`'s PCI bus id ("0000:18:00.0", cudaDeviceGetPCIBusId); "" when there is no
// such device or no usable driver (*error says why). Defined only in CUDA builds
// (kernels/cuda/device_pci.cu).
std::string CudaDevicePciBusId(int device, std::string* error);

}  // namespace fsdp8
