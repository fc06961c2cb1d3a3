// What `fsdp8 watch` shows about a job's progress: elapsed time from the job's start, an ETA and
// the last validation loss, for the live bar and the plain (piped) lines alike.
//
// Times are the coordinator's: the job's start_time and each event's `time` (seconds since the
// Unix epoch), so elapsed time is the job's own, whenever the watch attached and whatever the
// client's clock says, and history replayed to a watch that attached mid-job shows the elapsed
// time each step had.
//
// Thread-safety: none; one WatchProgress per watch, fed from one thread.
#pragma once

#include <limits>
#include <string>

#include "fsdp8/v1/jobs.pb.h"

namespace fsdp8 {

// Whether an event reports a step (a step's results), not a state change or a notice.
bool IsStepEvent(const v1::JobEvent& ev);

class WatchProgress {
 public:
  // Weight of the newest step's seconds in the moving average the ETA uses.
  static constexpr double kEtaWeight = 0.1;

  // Sets the job's start (Job.start_time, seconds since the epoch); 0 or less: not known yet.
  void set_job_start(double start_time) { job_start_ = start_time; }
  bool knows_job_start() const { return job_start_ > 0; }

  // Feeds one event, in stream order: step events update the last validation loss (a step that
  // validated) and the average step time (step_seconds > 0).
  void Add(const v1::JobEvent& ev);

  // Seconds from the job's start to `time` (an event's time, seconds since the epoch). NaN
  // when the start or `time` is unknown (0).
  double ElapsedAt(double time) const;
  // Seconds left for `ev`'s remaining steps (total_steps - step) at the average step time of
  // the steps fed so far (exponential moving average, kEtaWeight); NaN before any step time.
  double EtaAfter(const v1::JobEvent& ev) const;
  // The newest validation loss fed (NaN before the first validation).
  double last_val_loss() const { return last_val_; }

 private:
  double job_start_ = 0;
  double last_val_ = std::numeric_limits<double>::quiet_NaN();
  double ema_step_seconds_ = std::numeric_limits<double>::quiet_NaN();
};

// The plain progress line of a step event:
//   "step N/T loss X val V tok/s R elapsed E ETA D [epoch P]"
// V is the newest validation loss fed to `p` so far ("-" before the first), E the job's elapsed
// time at the event (ElapsedAt(ev.time()), "?" when unknown), D EtaAfter(ev) ("?" when unknown);
// durations as FormatDuration (client/client.h), losses with 4 decimals.
std::string StepLine(const v1::JobEvent& ev, const WatchProgress& p);

}  // namespace fsdp8
