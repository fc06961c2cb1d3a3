#include "comm/collective_check.h"

#include "absl/strings/str_cat.h"

namespace fsdp8 {
namespace {

const char* DtypeName(int64_t d) {
  return d == kDtypeU8 ? "u8" : d == kDtypeF32 ? "f32" : "none";
}

}  // namespace

const char* CollectiveOpName(int op) {
  switch (op) {
    case kOpAllGather: return "all_gather";
    case kOpReduceScatter: return "reduce_scatter";
    case kOpAllReduceSum: return "all_reduce(sum)";
    case kOpAllReduceMax: return "all_reduce(max)";
    case kOpBroadcast: return "broadcast";
    case kOpBarrier: return "barrier";
    case kOpSend: return "send";
    case kOpRecv: return "recv";
  }
  return "unknown";
}

absl::Status CheckHeaders(const CollectiveHeader* all, int world, int rank) {
  const CollectiveHeader& mine = all[rank];
  const char* name = CollectiveOpName(static_cast<int>(mine.op));
  for (int r = 0; r < world; ++r) {
    if (all[r].op != mine.op) {
      return absl::InvalidArgumentError(absl::StrCat(
          "collective #", mine.seq, ": rank ", rank, " called ", name, ", rank ", r, " called ",
          CollectiveOpName(static_cast<int>(all[r].op))));
    }
  }
  const CollectiveHeader& a = all[0];
  const int64_t dtype = a.dtype_and_extra & 0xffffffff;
  for (int r = 1; r < world; ++r) {
    const CollectiveHeader& b = all[r];
    if (a.count != b.count) {
      const char* unit = dtype == kDtypeU8 ? " bytes" : " elements";
      return absl::InvalidArgumentError(absl::StrCat(name, " #", mine.seq, ": rank 0 has ",
                                                     a.count, unit, ", rank ", r, " has ",
                                                     b.count, unit));
    }
    if (dtype != (b.dtype_and_extra & 0xffffffff)) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " #", mine.seq, ": rank 0 has dtype ", DtypeName(dtype), ", rank ", r,
          " has dtype ", DtypeName(b.dtype_and_extra & 0xffffffff)));
    }
    if ((a.dtype_and_extra >> 32) != (b.dtype_and_extra >> 32)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " #", mine.seq, ": rank 0 has root ", a.dtype_and_extra >> 32,
                       ", rank ", r, " has root ", b.dtype_and_extra >> 32));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTransfer(bool sending, int64_t n, int sender, int64_t sent, int receiver,
                           int64_t received) {
  if (sent == received) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      sending ? "send #" : "recv #", n, " from rank ", sender, " to rank ", receiver, ": rank ",
      sender, " sends ", sent, " bytes, rank ", receiver, " receives ", received, " bytes"));
}

}  // namespace fsdp8
