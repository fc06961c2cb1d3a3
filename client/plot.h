// The loss curve of a job as an image (`fsdp8 watch JOB --plot FILE`), drawn by gnuplot (Debian
// gnuplot-nox), run as a separate program: FILE's extension picks the terminal (.png: pngcairo,
// .svg: svg, .pdf: pdfcairo). The image is written to a temporary file next to FILE and renamed,
// so FILE is either the previous complete image or the new one.
//
// Thread-safety: WriteLossPlot may be called from several threads for different files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace fsdp8 {

struct LossPoint {
  int64_t step = 0;     // steps completed (1-based)
  double loss = 0;      // train loss, nats per token
  double val_loss = 0;  // NaN unless evaluated at this step
};

// INVALID_ARGUMENT when `path` does not end in .png, .svg or .pdf.
absl::Status CheckPlotPath(const std::string& path);

// Plots train loss (line) and validation loss (points) against the step. FAILED_PRECONDITION
// when `points` is empty or gnuplot is not installed (the message says which package),
// INTERNAL when gnuplot fails (with its output) or runs over 60 s, INVALID_ARGUMENT as in
// CheckPlotPath.
absl::Status WriteLossPlot(const std::string& path, const std::string& title,
                           const std::vector<LossPoint>& points);

}  // namespace fsdp8
