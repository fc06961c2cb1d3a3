// Communicator: the collectives one rank of a generation takes part in (Gloo on the CPU backend,
// NCCL on CUDA). Buffers are device pointers of the matching Backend.
//
// Every rank must call the same collectives in the same order with the same counts and dtypes.
// A collective whose counts disagree across ranks fails with an error naming the collective and
// both sizes (C09) instead of hanging; a peer that dies or stops answering fails the collective
// within the configured timeout (C10). After any failure the communicator is unusable: Abort() it
// and build a new one for the next generation.
//
// Thread-safety: collectives are issued by one thread (the trainer's). Abort() may be called from
// any thread (the watchdog) and makes pending and future collectives fail.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace fsdp8 {

enum class ReduceOp : uint8_t { kSum = 0, kMax = 1 };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // recv (world_size * bytes_per_rank) = concatenation over ranks of send (bytes_per_rank).
  // Used as uint8 for FP8 weights and as raw bytes for bf16/f32 buffers. bytes_per_rank may be 0.
  virtual absl::Status AllGather(const void* send, void* recv, int64_t bytes_per_rank) = 0;
  // recv (count) = sum over ranks of send[rank * count, (rank + 1) * count), f32, accumulated in
  // f32 (C12). send (world_size * count).
  virtual absl::Status ReduceScatterSum(const float* send, float* recv, int64_t count) = 0;
  // In place over `count` f32 elements.
  virtual absl::Status AllReduce(float* buf, int64_t count, ReduceOp op) = 0;
  virtual absl::Status Broadcast(void* buf, int64_t bytes, int root) = 0;
  virtual absl::Status Barrier() = 0;
  virtual void Abort(const std::string& reason) = 0;
};

}  // namespace fsdp8
