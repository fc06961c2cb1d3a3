// CudaStreams: what a component that enqueues its own CUDA work beside a backend's (the NCCL
// communicator, comm/nccl_communicator.h) needs of that backend: the device it is bound to and
// the compute stream every one of its ops is enqueued on, in call order. Work ordered against
// that stream with events is ordered against the backend's ops. CudaBackend implements it.
//
// Thread-safety: both accessors are constant for the object's lifetime and may be read from any
// thread.
#pragma once

#include <cuda_runtime_api.h>

namespace fsdp8 {

class CudaStreams {
 public:
  virtual ~CudaStreams() = default;
  // The CUDA device (cudaSetDevice index) the backend's work runs on.
  virtual int device() const = 0;
  // The compute stream the backend enqueues every op on.
  virtual cudaStream_t stream() const = 0;
};

}  // namespace fsdp8
