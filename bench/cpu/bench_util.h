// Small timing helpers shared by the CPU benchmarks.
#pragma once

#include <chrono>
#include <functional>

namespace fsdp8::bench {

// Runs fn once to warm up, then repeatedly until at least min_seconds have passed (and at least
// 3 times); returns the mean seconds per call.
inline double TimeIt(const std::function<void()>& fn, double min_seconds = 0.3) {
  using Clock = std::chrono::steady_clock;
  fn();
  int reps = 0;
  const auto start = Clock::now();
  double elapsed = 0.0;
  do {
    fn();
    ++reps;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < min_seconds || reps < 3);
  return elapsed / reps;
}

}  // namespace fsdp8::bench
