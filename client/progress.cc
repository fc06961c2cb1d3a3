#include "client/progress.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client.h"

namespace fsdp8 {
namespace {

std::string Loss(double v) { return std::isnan(v) ? "-" : absl::StrFormat("%.4f", v); }

}  // namespace

bool IsStepEvent(const v1::JobEvent& ev) { return ev.message().empty() && ev.step() > 0; }

void WatchProgress::Add(const v1::JobEvent& ev) {
  if (!IsStepEvent(ev)) return;
  if (!std::isnan(ev.val_loss())) last_val_ = ev.val_loss();
  if (ev.step_seconds() > 0) {
    ema_step_seconds_ = std::isnan(ema_step_seconds_)
                            ? ev.step_seconds()
                            : (1 - kEtaWeight) * ema_step_seconds_ + kEtaWeight * ev.step_seconds();
  }
}

double WatchProgress::ElapsedAt(double time) const {
  if (job_start_ <= 0 || time <= 0) return std::nan("");
  return time - job_start_;
}

double WatchProgress::EtaAfter(const v1::JobEvent& ev) const {
  const int64_t left = ev.total_steps() - ev.step();
  if (left <= 0) return 0;
  return ema_step_seconds_ * static_cast<double>(left);  // NaN while no step time is known
}

std::string StepLine(const v1::JobEvent& ev, const WatchProgress& p) {
  std::string line = absl::StrFormat("step %d/%d loss %s val %s tok/s %d elapsed %s ETA %s",
                                     ev.step(), ev.total_steps(), Loss(ev.loss()),
                                     Loss(p.last_val_loss()),
                                     static_cast<int64_t>(ev.tokens_per_second()),
                                     FormatDuration(p.ElapsedAt(ev.time())),
                                     FormatDuration(p.EtaAfter(ev)));
  if (ev.epoch() > 0) absl::StrAppend(&line, absl::StrFormat(" epoch %.2f", ev.epoch()));
  return line;
}

}  // namespace fsdp8
