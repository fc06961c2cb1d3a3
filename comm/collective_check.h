// The C09 check shared by the CPU communicators (GlooCommunicator, SharedMemoryCommunicator):
// before each collective every rank publishes a CollectiveHeader, and every rank checks all of
// them with CheckHeaders, so all ranks reach the same verdict and fail together with the same
// message, e.g. "all_gather #17: rank 0 has 409600 bytes, rank 1 has 409598 bytes".
//
// Thread-safety: plain functions and data.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace fsdp8 {

// Collective kinds and payload types as they travel in a header.
enum CollectiveOp : int {
  kOpAllGather = 1,
  kOpReduceScatter = 2,
  kOpAllReduceSum = 3,
  kOpAllReduceMax = 4,
  kOpBroadcast = 5,
  kOpBarrier = 6,
  kOpSend = 7,  // point-to-point (no header exchange: the two sides compare their sizes)
  kOpRecv = 8
};
enum CollectiveDtype : int { kDtypeU8 = 1, kDtypeF32 = 2, kDtypeNone = 3 };

// "all_gather", "reduce_scatter", "all_reduce(sum)", "all_reduce(max)", "broadcast", "barrier",
// "send", "recv".
const char* CollectiveOpName(int op);

// One rank's description of its collective #seq (32 bytes, plain data: it travels as bytes).
struct CollectiveHeader {
  int64_t seq;
  int64_t op;
  int64_t count;            // bytes (u8 collectives) or elements (f32 ones)
  int64_t dtype_and_extra;  // dtype in the low 32 bits, op-specific (the broadcast root) above

  static CollectiveHeader Make(uint64_t seq, int op, int64_t count, int dtype, int64_t extra) {
    return CollectiveHeader{static_cast<int64_t>(seq), op, count, (extra << 32) | dtype};
  }
};

// OK when the `world` headers in `all` (rank r's at all[r]) describe the same collective;
// otherwise INVALID_ARGUMENT naming the collective, its sequence number and what differs (the op,
// the count with its unit, the dtype or the root), from the view of `rank`.
absl::Status CheckHeaders(const CollectiveHeader* all, int world, int rank);

// OK when a point-to-point transfer's sizes agree; otherwise INVALID_ARGUMENT from the view of
// `rank` (its side: "send" or "recv"; n: the pair's transfer number, 1, 2, ...), the same on
// both sides but for the side, e.g.
//   "send #3 from rank 0 to rank 2: rank 0 sends 1024 bytes, rank 2 receives 1000 bytes".
absl::Status CheckTransfer(bool sending, int64_t n, int sender, int64_t sent, int receiver,
                           int64_t received);

}  // namespace fsdp8
