// WorkerSettings: everything a worker process takes from its environment (the FSDP8_* variables,
// common/env_settings.h; docs/environment.md), read once by its main and handed to the daemon,
// which passes each part to what it builds for a job: the backend, the NCCL communicator, the
// trainer, and its own fault injection.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "comm/cpu_communicator.h"
#include "comm/nccl_communicator.h"
#include "kernels/backend.h"
#include "train/options.h"
#include "common/fault_injection.h"

namespace fsdp8 {

struct WorkerSettings {
  BackendOptions backend;  // FSDP8_CPU_FILL_NAN, FSDP8_PROFILE_OPS, FSDP8_GEMM_VERBOSE
  NcclOptions nccl;        // FSDP8_NCCL_CHECK_COLLECTIVES (cuda jobs)
  CpuCommOptions cpu_comm;  // FSDP8_CPU_TRANSPORT, FSDP8_CPU_COMM_OVERLAP (cpu jobs)
  // FSDP8_HEAD_CHUNK_LOGIT_BYTES, FSDP8_STEP_TIMING, FSDP8_PROFILE_OPS
  TrainerOptions trainer;
  FaultInjection faults;  // FSDP8_FAULT_STEP_ERROR, FSDP8_FAULT_CHECKPOINT_ENOSPC
  // FSDP8_FAULT_SLOW_SAVE=STEP@MS,...: the save of checkpoint step STEP waits MS milliseconds on
  // the job thread before it starts (a slow disk, for tests and drills of a coordinator lost
  // during a save). By step; empty: no save waits.
  std::map<int64_t, int64_t> slow_save_ms;
  // Defaults of the flags --tls_ca, --tls_cert, --tls_key and --token_file (FSDP8_TLS_CA,
  // FSDP8_TLS_CERT, FSDP8_TLS_KEY, FSDP8_TOKEN_FILE), and the bearer token itself when no token
  // file is given (FSDP8_TOKEN); "" when unset.
  std::string tls_ca, tls_cert, tls_key, token_file, token;

  // INVALID_ARGUMENT naming the variable when an on/off variable breaks the rule of
  // env::ParseOnOff (env::CheckEnvironment), checked before any part is read, or when an item of
  // FSDP8_FAULT_SLOW_SAVE is not STEP@MS (non-negative integers).
  static absl::StatusOr<WorkerSettings> FromEnvironment();
};

}  // namespace fsdp8
