// The coordinator's log: the daemons' log (common/log.h) under the coordinator's namespace. The
// level is process-wide and can be changed at run time (AdminService.SetLogLevel); debug also logs
// every authorized RPC with its caller. --log_format picks text or JSON lines.
//
// Thread-safety: every function is safe to call from several threads.
#pragma once

#include "common/log.h"

namespace fsdp8::coord {

using ::fsdp8::GetLogLevel;
using ::fsdp8::Log;
using ::fsdp8::LogEnabled;
using ::fsdp8::LogEvent;
using ::fsdp8::LogLevel;
using ::fsdp8::LogLevelName;
using ::fsdp8::ParseLogLevel;
using ::fsdp8::SetLogLevel;

}  // namespace fsdp8::coord
