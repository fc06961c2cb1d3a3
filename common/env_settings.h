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
// "1": the CPU backend's fresh allocations read as NaN until written (the tests set it).
inline constexpr char kCpuFillNan[] = "FSDP8_CPU_FILL_NAN";
// "1" or <seconds>: the CUDA backend times every op and reports every 10 s (or <seconds> > 1).
inline constexpr char kProfileOps[] = "FSDP8_PROFILE_OPS";
// Set (any value): the CUDA backend logs each cuBLASLt GEMM shape's algorithm choice.
inline constexpr char kGemmVerbose[] = "FSDP8_GEMM_VERBOSE";

// ---- communicators (comm/nccl_communicator.h, NcclOptions) ----
// The NCCL communicator's check of matched collectives (C09): unset/"1" on the watchdog, "sync"
// before each collective, "0" off.
inline constexpr char kNcclCheckCollectives[] = "FSDP8_NCCL_CHECK_COLLECTIVES";
// CPU jobs' collectives (comm/cpu_communicator.h, CpuCommOptions): "gloo" always over Gloo's TCP;
// unset/"auto" through shared memory when every rank runs on this machine.
inline constexpr char kCpuTransport[] = "FSDP8_CPU_TRANSPORT";
// "0" runs a CPU job's collectives on the trainer's thread (blocking); unset or anything else on
// a helper thread per rank, overlapping compute (comm/async_communicator.h).
inline constexpr char kCpuCommOverlap[] = "FSDP8_CPU_COMM_OVERLAP";

// ---- training (train/options.h, ModelOptions and TrainerOptions) ----
// f32 logit bytes per row chunk of the BF16 head (default 1 GiB).
inline constexpr char kHeadChunkLogitBytes[] = "FSDP8_HEAD_CHUNK_LOGIT_BYTES";
// "1": one GEMM per linear where a group of projections shares scales (the tests' reference).
inline constexpr char kUnfusedProjections[] = "FSDP8_UNFUSED_PROJECTIONS";
// "1": down_proj's FP8 input kept from the forward, not recast in the backward (the tests' reference).
inline constexpr char kSaveDownProjInput[] = "FSDP8_SAVE_DOWN_PROJ_INPUT";
// "1": the trainer logs each step's timing split to stderr (so does FSDP8_PROFILE_OPS).
inline constexpr char kStepTiming[] = "FSDP8_STEP_TIMING";

// ---- fault injection for tests and drills (common/fault_injection.h) ----
// RANK@STEP,...: that rank's step runs, then fails (once per process and entry).
inline constexpr char kFaultStepError[] = "FSDP8_FAULT_STEP_ERROR";
// SUBSTRING,...: a checkpoint shard write whose path contains one fails as on a full disk.
inline constexpr char kFaultCheckpointEnospc[] = "FSDP8_FAULT_CHECKPOINT_ENOSPC";
// POINT@SUBSTRING,...: SIGKILL at that crash point of a checkpoint write (shard.* in a worker,
// manifest.* in the coordinator) whose path contains SUBSTRING.
inline constexpr char kFaultCrashAt[] = "FSDP8_FAULT_CRASH_AT";

// The variable's value; nullopt when it is unset (an empty value is returned as "").
std::optional<std::string> Get(const char* name);
// The variable's value; "" when it is unset.
std::string GetOrEmpty(const char* name);
// A switch: on when set, non-empty and not starting with '0' ("1", "yes", "2.5"; not "0", "").
bool IsOn(const char* name);

}  // namespace fsdp8::env
