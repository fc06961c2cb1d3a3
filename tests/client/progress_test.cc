// The progress `fsdp8 watch` shows (client/progress.h): elapsed time from the job's start at each
// event's time, the ETA from the moving average of step times, the last validation loss carried
// to the following plain lines. Expected lines are worked out by hand below.
#include "client/progress.h"

#include <cmath>
#include <string>

#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

v1::JobEvent Step(int64_t step, int64_t total, double time, double step_seconds, double loss,
                  double val_loss = std::nan("")) {
  v1::JobEvent ev;
  ev.set_state(v1::JOB_STATE_RUNNING);
  ev.set_step(step);
  ev.set_total_steps(total);
  ev.set_time(time);
  ev.set_step_seconds(step_seconds);
  ev.set_loss(loss);
  ev.set_val_loss(val_loss);
  ev.set_tokens_per_second(1234.9);
  return ev;
}

TEST(WatchProgress, PlainLinesCarryEtaAndTheLastValidationLoss) {
  WatchProgress p;
  p.set_job_start(1000.0);
  auto e1 = Step(1, 10, 1002.0, 2.0, 5.0);
  p.Add(e1);
  // Average step 2 s, 9 steps left: 18 s; no validation yet.
  EXPECT_EQ(StepLine(e1, p), "step 1/10 loss 5.0000 val - tok/s 1234 elapsed 2s ETA 18s");
  auto e2 = Step(2, 10, 1006.0, 12.0, 4.5, 3.25);
  p.Add(e2);
  // 0.9 * 2 + 0.1 * 12 = 3 s a step, 8 left: 24 s.
  EXPECT_EQ(StepLine(e2, p), "step 2/10 loss 4.5000 val 3.2500 tok/s 1234 elapsed 6s ETA 24s");
  // A notice at a step (a message) is no step: neither the loss nor the average move.
  v1::JobEvent notice = Step(2, 10, 1007.0, 50.0, 9.0, 9.0);
  notice.set_message("checkpoint saved");
  p.Add(notice);
  auto e3 = Step(3, 10, 1070.0, 3.0, 4.0);
  p.Add(e3);
  // 0.9 * 3 + 0.1 * 3 = 3 s, 7 left: 21 s; the validation loss of step 2 stays on the line.
  EXPECT_EQ(StepLine(e3, p), "step 3/10 loss 4.0000 val 3.2500 tok/s 1234 elapsed 1m10s ETA 21s");
  EXPECT_DOUBLE_EQ(p.last_val_loss(), 3.25);
  auto last = Step(10, 10, 1100.0, 3.0, 3.5, 3.0);
  last.set_epoch(1.5);
  p.Add(last);
  EXPECT_EQ(StepLine(last, p), "step 10/10 loss 3.5000 val 3.0000 tok/s 1234 elapsed 1m40s ETA 0s epoch 1.50");
}

TEST(WatchProgress, ElapsedCountsFromTheJobStartNotFromTheFirstEventSeen) {
  // A watch that attached at step 500 of a job that started an hour and a minute before.
  WatchProgress p;
  p.set_job_start(50000.0);
  auto ev = Step(500, 1000, 53660.0, 7.2, 2.0);
  p.Add(ev);
  EXPECT_DOUBLE_EQ(p.ElapsedAt(ev.time()), 3660.0);
  EXPECT_DOUBLE_EQ(p.EtaAfter(ev), 3600.0);  // 7.2 s x 500 steps
  EXPECT_EQ(StepLine(ev, p), "step 500/1000 loss 2.0000 val - tok/s 1234 elapsed 1h01m ETA 1h00m");
}

TEST(WatchProgress, UnknownStartOrStepTimeShowsAQuestionMark) {
  WatchProgress p;
  EXPECT_FALSE(p.knows_job_start());
  auto ev = Step(4, 8, 1234.0, 0.0, 1.0);  // no step time reported
  p.Add(ev);
  EXPECT_TRUE(std::isnan(p.ElapsedAt(ev.time())));
  EXPECT_TRUE(std::isnan(p.EtaAfter(ev)));
  EXPECT_EQ(StepLine(ev, p), "step 4/8 loss 1.0000 val - tok/s 1234 elapsed ? ETA ?");
  p.set_job_start(1200.0);
  EXPECT_TRUE(p.knows_job_start());
  EXPECT_DOUBLE_EQ(p.ElapsedAt(ev.time()), 34.0);
  EXPECT_TRUE(std::isnan(p.ElapsedAt(0)));  // an event without a time
}

TEST(WatchProgress, StepEventsAreThoseWithoutAMessageAfterStepZero) {
  v1::JobEvent ev;
  EXPECT_FALSE(IsStepEvent(ev));  // PENDING at submit: step 0
  ev.set_step(3);
  EXPECT_TRUE(IsStepEvent(ev));
  ev.set_message("RECOVERING: rank 1 failed");
  EXPECT_FALSE(IsStepEvent(ev));
}

}  // namespace
}  // namespace fsdp8
