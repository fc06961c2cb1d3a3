// The PCI bus id of a CUDA device (kernels/device_memory.h), for the worker's NVLink placement
// domain (worker/nvlink_domain.h).
#include <cuda_runtime_api.h>

#include <string>

#include "kernels/device_memory.h"

namespace fsdp8 {

std::string CudaDevicePciBusId(int device, std::string* error) {
  char buf[64] = {0};
  const cudaError_t e = cudaDeviceGetPCIBusId(buf, sizeof buf, device);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (error) {
      *error = "cudaDeviceGetPCIBusId(" + std::to_string(device) + "): " + cudaGetErrorString(e);
    }
    return "";
  }
  return buf;
}

}  // namespace fsdp8
