#include "train/step_timer.h"

#include <algorithm>
#include <cstdio>

#include "train/fsdp.h"

namespace fsdp8 {

void StepTimer::Begin() {
  start_ = CommClock::Now();
  at_.fill(0);
  host_enqueue_ = 0;
  fb_host_comm_ = fb_waits_ = 0;
}

void StepTimer::Mark(Point p) { at_[p] = CommClock::Now(); }

double StepTimer::compute_seconds() const {
  return std::max(0.0, (at_[kForwardBackward] - start_) - comm_seconds());
}

void StepTimer::MaybePrint(int64_t step) const {
  if (!log_) return;
  auto ms = [this](Point from, Point to) { return 1e3 * (at_[to] - at_[from]); };
  std::fprintf(stderr,
               "fsdp8 step %lld: forward+backward %.1f ms (host time enqueueing it %.1f ms, of "
               "which inside collective calls %.1f ms; compute stream waiting on collectives "
               "%.1f ms), optimizer %.1f ms (host: grad norm %.2f, scale updates %.2f, AdamW "
               "enqueued %.2f, casts enqueued %.2f, verify %.2f, prefetch enqueued and waiting "
               "for the device %.2f), host between the previous step's end and this step's "
               "start %.2f ms\n",
               static_cast<long long>(step), 1e3 * (at_[kForwardBackward] - start_),
               1e3 * host_enqueue_, 1e3 * fb_host_comm_, 1e3 * fb_waits_,
               ms(kForwardBackward, kOptimizer), ms(kForwardBackward, kGradNorm),
               ms(kGradNorm, kScaleUpdate), ms(kScaleUpdate, kAdamW), ms(kAdamW, kWeightCasts),
               ms(kWeightCasts, kVerify), ms(kVerify, kOptimizer),
               last_end_ > 0 ? 1e3 * (start_ - last_end_) : 0.0);
}

void StepTimer::End() { last_end_ = CommClock::Now(); }

}  // namespace fsdp8
