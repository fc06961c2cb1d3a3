// StepTimer: where the host's time in one optimizer step goes (Trainer::Step), for the step's
// reported split (compute, exposed communication, optimizer) and, when asked for
// (TrainerOptions::log_step_timing: FSDP8_STEP_TIMING or FSDP8_PROFILE_OPS on), a one-line
// breakdown per step on stderr.
//
// Times are CommClock::Now() wall seconds on the host. The forward/backward phase ends with the
// losses' copy to the host (a device synchronisation); the optimizer phase with a device
// synchronisation after the next step's first all-gathers are enqueued.
//
// Thread-safety: one thread (the trainer's).
#pragma once

#include <array>
#include <cstdint>

namespace fsdp8 {

class StepTimer {
 public:
  // The points of a step after its start, in the order the step reaches them.
  enum Point {
    kForwardBackward,  // every microbatch's forward and backward ran (device synchronised)
    kGradNorm,         // the global grad norm (and the losses' check) read back
    kScaleUpdate,      // delayed-scaling update of the activation scales
    kAdamW,            // AdamW enqueued
    kWeightCasts,      // the next step's FP8 weight casts enqueued
    kVerify,           // the step's collectives verified (C09)
    kOptimizer,        // the optimizer phase done (device synchronised)
    kNumPoints
  };

  // log: print each step's breakdown (MaybePrint).
  explicit StepTimer(bool log = false) : log_(log) {}

  // A step starts now; clears the previous step's figures.
  void Begin();
  // The step reached `p` now.
  void Mark(Point p);
  // Host seconds spent enqueueing the model's forward/backward (LlamaModel::Run).
  void AddHostEnqueue(double seconds) { host_enqueue_ += seconds; }
  // The forward/backward's exposed communication: host seconds inside its own collective calls,
  // and seconds the compute stream waited on collectives (Communicator::ConsumeExposedSeconds).
  void SetForwardBackwardComm(double host_seconds, double wait_seconds) {
    fb_host_comm_ = host_seconds;
    fb_waits_ = wait_seconds;
  }

  // The reported split. The forward/backward part ends with the reductions enqueued behind the
  // backward; its exposed communication counts their compute-stream waits, not their host time.
  double comm_seconds() const { return fb_host_comm_ + fb_waits_; }
  double compute_seconds() const;  // forward/backward minus its exposed communication, >= 0
  double optimizer_seconds() const { return at_[kOptimizer] - at_[kForwardBackward]; }

  // Prints the step's breakdown to stderr when the timer logs (the split of the
  // exposed-communication figure, kernels/cuda/op_profile.h).
  void MaybePrint(int64_t step) const;
  // The step ended now (after its evaluation, if any).
  void End();

 private:
  bool log_ = false;
  double start_ = 0;
  std::array<double, kNumPoints> at_{};
  double host_enqueue_ = 0;
  double fb_host_comm_ = 0, fb_waits_ = 0;
  double last_end_ = 0;  // end of the previous step; 0 before the first
};

}  // namespace fsdp8
