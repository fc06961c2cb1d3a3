// NcclCommunicator: the Communicator (comm/communicator.h) of the CUDA backend, over NCCL.
//
// Bootstrap: rank 0 creates the ncclUniqueId and Set()s it, hex-encoded, in the generation's
// rendezvous store under `prefix + "nccl_id"`; the other ranks Get() it with the deadline. Every
// rank then calls ncclCommInitRankConfig in non-blocking mode and polls it, so a rank that never
// shows up turns into a DEADLINE_EXCEEDED error (and ncclCommAbort) instead of a hang.
//
// Streams: collectives run on a dedicated communication stream of the backend's device. Each
// collective first waits (cudaStreamWaitEvent) for an event recorded on the backend's compute
// stream at the call, so it sees every op enqueued before it; the compute stream then waits for
// the collective's completion event, so ops enqueued after the call see its result. The host
// does not block on the data collectives.
//
// C09 (mismatched collectives): before each collective every rank all-gathers a 32-byte header
// (sequence number, op, count, root). By default the headers are compared without stalling the
// host: the watchdog compares each as it arrives and, on a mismatch, aborts the communicator with
// a message naming the collective and both ranks' sizes; the mismatched collective then fails
// (ABORTED, with that message) instead of hanging. NcclOptions::check_collectives = kSync
// (FSDP8_NCCL_CHECK_COLLECTIVES=sync) compares before enqueueing each collective (a host wait per
// collective; the call itself returns FAILED_PRECONDITION); kOff (=0) skips the check.
//
// C10 (dead or stuck peer): a watchdog thread polls every pending collective's completion event
// and ncclCommGetAsyncError; a collective not complete `timeout` after it was enqueued, or an
// asynchronous NCCL error, calls ncclCommAbort and the next (or the current, if waiting on the
// header) collective returns DEADLINE_EXCEEDED / INTERNAL with the last enqueued and completed
// sequence numbers. The worker's step deadline covers the case where the trainer is blocked in a
// device synchronisation when that happens (the abort completes the aborted kernels).
//
// Split(color, key): a collective of this communicator (its C09 header, op "Split", compared
// with a host wait before NCCL is called), then ncclCommSplit in non-blocking mode with
// splitShare off, polled until the sub-communicator is ready (at most `timeout`; then
// DEADLINE_EXCEEDED and this communicator is aborted). The sub-communicator is a
// NcclCommunicator of its own (its comm stream, watchdog and checks, the same options and
// timeout); parent and child may be destroyed in either order, and aborting one does not abort
// the other. A negative color fails on the calling rank only (its peers then time out).
//
// Send/Recv: ncclSend/ncclRecv of bytes on the comm stream, ordered after the compute stream
// and waited for by it as a blocking collective; they take no part in the other ranks' C09
// header numbering. With the C09 checks on (the default and sync modes), the two sides first
// swap their sizes with a grouped 8-byte ncclSend/ncclRecv and compare them after a host wait:
// a mismatch aborts the communicator and returns INVALID_ARGUMENT on both sides.
//
// AllReduceAsync: the all-reduce with a ticket, as AllGatherAsync and ReduceScatterSumAsync.
//
// Dtypes: AllGather and Broadcast move bytes (ncclUint8); ReduceScatterSum and AllReduce are
// f32 (ncclFloat32) accumulated in f32.
//
// Thread-safety: collectives from one thread; Abort() from any thread.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/env_settings.h"
#include "kernels/backend.h"
#include "comm/communicator.h"
#include "comm/kv_store.h"

namespace fsdp8 {

// The NCCL communicator's settings from the environment (common/env_settings.h).
struct NcclOptions {
  // How the C09 headers are compared (FSDP8_NCCL_CHECK_COLLECTIVES): on the watchdog, without a
  // host wait (unset or an on value), before each collective ("sync"), or not at all (an off
  // value: 0, false, off); anything else exits (env::SwitchOrExit).
  enum class CollectiveCheck { kWatchdog, kSync, kOff };
  CollectiveCheck check_collectives = CollectiveCheck::kWatchdog;

  static NcclOptions FromEnvironment() {
    const std::string mode = env::GetOrEmpty(env::kNcclCheckCollectives);
    NcclOptions o;
    if (mode == "sync") {
      o.check_collectives = CollectiveCheck::kSync;
    } else if (!env::SwitchOrExit(env::kNcclCheckCollectives, /*unset=*/true)) {
      o.check_collectives = CollectiveCheck::kOff;
    }
    return o;
  }
};

// backend must be the CUDA backend (kernels/cuda/cuda_backend.h): the communicator uses only its
// CudaStreams interface (kernels/cuda/cuda_streams.h), the device and the compute stream;
// INVALID_ARGUMENT for another backend. It must outlive the communicator.
// bootstrap_timeout (0: timeout) bounds the unique-id wait and the NCCL initialisation, which
// wait for every rank of the generation; timeout bounds every collective.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    int rank, int world_size, KvStore* store, const std::string& prefix, Backend* backend,
    std::chrono::milliseconds timeout,
    std::chrono::milliseconds bootstrap_timeout = std::chrono::milliseconds(0),
    const NcclOptions& options = NcclOptions::FromEnvironment());

}  // namespace fsdp8
