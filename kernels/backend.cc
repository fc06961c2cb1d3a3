#include "kernels/backend.h"

#include "kernels/cpu/cpu_backend.h"

#ifdef FSDP8_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace fsdp8 {

std::unique_ptr<Backend> CreateBackend(const std::string& name, int device, std::string* error) {
  if (name == "cpu") return std::make_unique<CpuBackend>();
  if (name == "cuda") {
#ifdef FSDP8_WITH_CUDA
    return CreateCudaBackend(device, error);
#else
    (void)device;
    if (error != nullptr) {
      *error = "backend 'cuda' is not built: configure with -DFSDP8_CUDA=ON on a machine with nvcc";
    }
    return nullptr;
#endif
  }
  if (error != nullptr) *error = "unknown backend '" + name + "': expected 'cpu' or 'cuda'";
  return nullptr;
}

}  // namespace fsdp8
