// Small timing helpers shared by the CPU benchmarks.
#pragma once

#include <time.h>

#include <algorithm>
#include <chrono>
#include <functional>

namespace fsdp8::bench {

struct Timing {
  double wall;  // mean wall-clock seconds per call
  double cpu;   // mean process CPU seconds per call (all threads): on a shared machine this is
                // the cost of the work itself, wall time also counts waiting for a core
};

inline double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Runs fn once to warm up, then repeatedly until at least min_seconds of wall time have passed
// (and at least 3 times); returns the mean time per call.
inline Timing TimeIt(const std::function<void()>& fn, double min_seconds = 0.3) {
  using Clock = std::chrono::steady_clock;
  fn();
  int reps = 0;
  const auto start = Clock::now();
  const double cpu_start = ProcessCpuSeconds();
  double elapsed = 0.0;
  do {
    fn();
    ++reps;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < min_seconds || reps < 3);
  return {elapsed / reps, (ProcessCpuSeconds() - cpu_start) / reps};
}

// Seconds per call for a calibration file (bench/calibrate.sh): the lowest of `rounds` TimeIt
// rounds, each round's the lower of its wall-clock and process-CPU mean. A single-threaded op on
// an idle core takes its CPU time in wall time; on a shared machine the wall time also counts
// waiting for a core, which the CPU time leaves out (an op running threads of its own spends
// more CPU than wall time: the wall time is taken then).
inline double BestSeconds(const std::function<void()>& fn, int rounds = 3, double min_seconds = 0.2) {
  double best = 0;
  for (int r = 0; r < rounds; ++r) {
    const Timing t = TimeIt(fn, min_seconds);
    const double s = std::min(t.wall, t.cpu);
    best = r == 0 ? s : std::min(best, s);
  }
  return best;
}

}  // namespace fsdp8::bench
