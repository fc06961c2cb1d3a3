#include "worker/settings.h"

#include "common/env_settings.h"

namespace fsdp8 {

absl::StatusOr<WorkerSettings> WorkerSettings::FromEnvironment() {
  if (absl::Status st = env::CheckEnvironment(); !st.ok()) return st;
  WorkerSettings s;
  s.backend = BackendOptions::FromEnvironment();
  s.nccl = NcclOptions::FromEnvironment();
  s.cpu_comm = CpuCommOptions::FromEnvironment();
  s.trainer = TrainerOptions::FromEnvironment();
  s.faults = FaultInjection::FromEnvironment();
  s.tls_ca = env::GetOrEmpty(env::kTlsCa);
  s.tls_cert = env::GetOrEmpty(env::kTlsCert);
  s.tls_key = env::GetOrEmpty(env::kTlsKey);
  s.token_file = env::GetOrEmpty(env::kTokenFile);
  s.token = env::GetOrEmpty(env::kToken);
  return s;
}

}  // namespace fsdp8
