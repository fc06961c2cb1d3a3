// `fsdp8 watch JOB --tensorboard DIR`: the job's events handed to `fsdp8-tensorboard`, the Python
// SDK's TensorBoard writer (client/python/fsdp8/tensorboard.py, through the `tensorboard`
// package's own event-file writer), run as a child process that reads one JSON JobEvent a line on
// its standard input (the lines `fsdp8 watch --json` prints) and writes the scalars into
// DIR/JOB (one TensorBoard run per job).
//
// The event files are left to the maintained writer rather than written here: their framing needs
// a CRC-32C, which Debian 12 packages for C++ neither in abseil (20220623 has no absl/crc) nor as
// a library of its own, and whoever reads the files runs TensorBoard from the same package.
//
// Thread-safety: none; one TensorBoardSink per watch, used from one thread.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp8/v1/jobs.pb.h"

namespace fsdp8 {

// The program the sink runs (found on PATH).
inline constexpr char kTensorBoardProgram[] = "fsdp8-tensorboard";

// OK when kTensorBoardProgram is an executable on PATH, else FAILED_PRECONDITION saying how to
// install it (what Start reports then too).
absl::Status CheckTensorBoardProgram();

class TensorBoardSink {
 public:
  // Starts `fsdp8-tensorboard --logdir DIR --job JOB` and waits (up to 120 s) for its first line,
  // which it prints once the `tensorboard` package is loaded and DIR/JOB is writable. Ignores
  // SIGPIPE in this process (a child that dies shows up as a failed Write). FAILED_PRECONDITION
  // when the program is not on PATH (the message says how to install it) or it exits before its
  // first line (its exit status; its own error went to this process's standard error);
  // DEADLINE_EXCEEDED when it does not answer in time.
  static absl::StatusOr<std::unique_ptr<TensorBoardSink>> Start(const std::string& dir,
                                                                const std::string& job_id);
  ~TensorBoardSink();  // kills the child if Finish was not called
  TensorBoardSink(const TensorBoardSink&) = delete;
  TensorBoardSink& operator=(const TensorBoardSink&) = delete;

  // Sends one event. INTERNAL once the child has stopped reading (it exited).
  absl::Status Write(const v1::JobEvent& ev);
  // Closes the child's input, waits (up to 120 s) for it to exit and returns the last line it
  // printed (what it wrote where). INTERNAL when it failed or a Write did; DEADLINE_EXCEEDED when
  // it does not exit in time (it is killed).
  absl::StatusOr<std::string> Finish();

 private:
  TensorBoardSink() = default;
  pid_t pid_ = -1;
  int to_child_ = -1;    // the child's standard input
  int from_child_ = -1;  // its standard output
  bool write_failed_ = false;
};

}  // namespace fsdp8
