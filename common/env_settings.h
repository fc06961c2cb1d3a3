// The FSDP8_* environment variables fsdp8's processes read, each a named constant, and the
// readers the option structs' FromEnvironment() use (docs/environment.md lists every variable with
// its reader, default and meaning).
//
// Each process reads them in one place: the worker's main builds WorkerSettings
// (worker/settings.h) once and passes the options down; the CLI's main reads its own. Libraries
// take the options as arguments; their FromEnvironment() defaults serve tools and tests that
// construct a backend or a trainer directly.
//
// Thread-safety: the readers call getenv; safe while no thread changes the environment.
#pragma once

#include <optional>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp8::env {

// ---- CLI and worker: where the coordinator is and how to reach it (flags override them) ----
// Coordinator address host:port (CLI, Python SDK; default localhost:50051).
inline constexpr char kCoordinator[] = "FSDP8_COORDINATOR";
// PEM CA bundle that the coordinator's certificate must chain to (CLI --tls-ca, worker --tls_ca).
inline constexpr char kTlsCa[] = "FSDP8_TLS_CA";
// PEM client certificate for mutual TLS (CLI --tls-cert, worker --tls_cert).
inline constexpr char kTlsCert[] = "FSDP8_TLS_CERT";
// PEM key of the client certificate (CLI --tls-key, worker --tls_key).
inline constexpr char kTlsKey[] = "FSDP8_TLS_KEY";
// Bearer token itself (CLI --token; the worker when no token file is given).
inline constexpr char kToken[] = "FSDP8_TOKEN";
// File holding the bearer token, its first line (CLI --token-file, worker --token_file).
inline constexpr char kTokenFile[] = "FSDP8_TOKEN_FILE";

// ---- backends (kernels/backend.h, BackendOptions) ----
// Switch: the CPU backend's fresh allocations read as NaN until written (the tests set it).
inline constexpr char kCpuFillNan[] = "FSDP8_CPU_FILL_NAN";
// Switch or <seconds> (a number > 0): the CUDA backend times every op and reports every 10 s
// (or every <seconds> when above 1); "0" or another off value: off.
inline constexpr char kProfileOps[] = "FSDP8_PROFILE_OPS";
// Switch: the CUDA backend logs each cuBLASLt GEMM shape's algorithm choice.
inline constexpr char kGemmVerbose[] = "FSDP8_GEMM_VERBOSE";

// ---- communicators (comm/nccl_communicator.h, NcclOptions) ----
// The NCCL communicator's check of matched collectives (C09): unset or on (a switch's on value)
// on the watchdog, "sync" before each collective, off (a switch's off value) not at all.
inline constexpr char kNcclCheckCollectives[] = "FSDP8_NCCL_CHECK_COLLECTIVES";
// CPU jobs' collectives (comm/cpu_communicator.h, CpuCommOptions): "gloo" always over Gloo's TCP;
// unset/"auto" through shared memory when every rank runs on this machine.
inline constexpr char kCpuTransport[] = "FSDP8_CPU_TRANSPORT";
// Switch, default on: off runs a CPU job's collectives on the trainer's thread (blocking); on (or
// unset) on a helper thread per rank, overlapping compute (comm/async_communicator.h).
inline constexpr char kCpuCommOverlap[] = "FSDP8_CPU_COMM_OVERLAP";

// ---- training (train/options.h, ModelOptions and TrainerOptions) ----
// f32 logit bytes per row chunk of the BF16 head (default 1 GiB).
inline constexpr char kHeadChunkLogitBytes[] = "FSDP8_HEAD_CHUNK_LOGIT_BYTES";
// Switch: the trainer logs each step's timing split to stderr (so does FSDP8_PROFILE_OPS).
inline constexpr char kStepTiming[] = "FSDP8_STEP_TIMING";

// ---- fault injection for tests and drills (common/fault_injection.h) ----
// RANK@STEP,...: that rank's step runs, then fails (once per process and entry).
inline constexpr char kFaultStepError[] = "FSDP8_FAULT_STEP_ERROR";
// SUBSTRING,...: a checkpoint shard write whose path contains one fails as on a full disk.
inline constexpr char kFaultCheckpointEnospc[] = "FSDP8_FAULT_CHECKPOINT_ENOSPC";
// POINT@SUBSTRING,...: SIGKILL at that crash point of a checkpoint write (shard.* in a worker,
// manifest.* in the coordinator) whose path contains SUBSTRING.
inline constexpr char kFaultCrashAt[] = "FSDP8_FAULT_CRASH_AT";
// SUBSTRING,...: a checkpoint load (a worker's) whose step directory contains one fails.
inline constexpr char kFaultCheckpointRead[] = "FSDP8_FAULT_CHECKPOINT_READ";

// The variable's value; nullopt when it is unset (an empty value is returned as "").
std::optional<std::string> Get(const char* name);
// The variable's value; "" when it is unset.
std::string GetOrEmpty(const char* name);
// The one rule for every on/off value, environment switches and the daemons' boolean flags
// alike: "1", "true", "on" are on; "0", "false", "off" are off; any case. Anything else is
// INVALID_ARGUMENT naming `name` and the rule:
//   FSDP8_GEMM_VERBOSE: "yes" is not an on/off value (on: 1, true, on; off: 0, false, off; any case)
absl::StatusOr<bool> ParseOnOff(absl::string_view name, absl::string_view value);

// The switch variable `name` under ParseOnOff's rule; `unset` when it is unset or empty.
absl::StatusOr<bool> GetSwitch(const char* name, bool unset = false);

// GetSwitch for the option structs' FromEnvironment(), which return plain structs: a value that
// breaks the rule prints GetSwitch's message to stderr and exits the process with status 2 (a
// setting that cannot be read is never guessed). Process mains call CheckEnvironment first and
// report the error themselves.
bool SwitchOrExit(const char* name, bool unset = false);

// FSDP8_PROFILE_OPS: nullopt when off (unset, empty or an off value), else the report period in
// seconds (10 for an on value or a number <= 1; the number when above 1). INVALID_ARGUMENT naming
// the variable for anything else (not an on/off value nor a number > 0).
absl::StatusOr<std::optional<double>> ProfileOpsPeriod();

// Every variable above that holds a switch (FSDP8_PROFILE_OPS and FSDP8_NCCL_CHECK_COLLECTIVES
// included, with their extra values) checked against its rule: the first error, naming the
// variable.
absl::Status CheckEnvironment();

}  // namespace fsdp8::env
