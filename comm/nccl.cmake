# fsdp8_comm_nccl: the NCCL Communicator of the CUDA backend, which it reaches only through the
# CudaStreams interface (kernels/cuda/cuda_streams.h).
find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include /usr/include /usr/local/include)
find_library(NCCL_LIBRARY NAMES nccl
  HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu /usr/local/lib)
if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
  message(FATAL_ERROR "NCCL not found (nccl.h / libnccl.so): install libnccl-dev or point "
                      "NCCL_INCLUDE_DIR / NCCL_LIBRARY at it")
endif()
message(STATUS "fsdp8: NCCL ${NCCL_LIBRARY} (headers ${NCCL_INCLUDE_DIR})")

add_library(fsdp8_comm_nccl STATIC nccl_communicator.cc)
target_include_directories(fsdp8_comm_nccl PUBLIC ${CMAKE_SOURCE_DIR} PRIVATE ${NCCL_INCLUDE_DIR})
target_link_libraries(fsdp8_comm_nccl PUBLIC fsdp8_kernels absl::status
                      absl::statusor absl::strings absl::synchronization CUDA::cudart
                      ${NCCL_LIBRARY} Threads::Threads)
