// Prometheus text exposition format, version 0.0.4 (what /metrics serves; no Prometheus C++ client
// is packaged in Debian 12, so the format is written here, following the spec:
// https://prometheus.io/docs/instrumenting/exposition_formats/).
//
// Every family is written as "# HELP name text", "# TYPE name type", then its samples, each family
// once. Label values escape \ " and newline; HELP text escapes \ and newline. Values print as
// the shortest text that reads back exactly, "+Inf", "-Inf", "NaN". Names follow the
// conventions: base units (seconds, bytes) in the name, counters end in "_total".
//
// Thread-safety: ExpositionWriter and Histogram are plain values (no locking); callers serialise.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fsdp8::prom {

using Labels = std::vector<std::pair<std::string, std::string>>;

// "a\\b", "say \"hi\"", "two\\nlines": label-value escaping.
std::string EscapeLabelValue(std::string_view v);
// HELP-text escaping (backslash and newline only).
std::string EscapeHelp(std::string_view v);
// The shortest text that parses back to exactly v (std::to_chars); "+Inf", "-Inf", "NaN".
std::string FormatValue(double v);
// [a-zA-Z_:][a-zA-Z0-9_:]* (metric names) / [a-zA-Z_][a-zA-Z0-9_]* (label names).
bool ValidMetricName(std::string_view name);
bool ValidLabelName(std::string_view name);

// Cumulative histogram with fixed upper bounds (seconds or bytes); +Inf is implicit.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  // counts()[i]: observations <= bounds()[i] (cumulative); count(): all observations.
  const std::vector<uint64_t>& counts() const { return counts_; }
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  uint64_t count_ = 0;
  double sum_ = 0;
};

// Step durations from 1 ms to ~10 min.
std::vector<double> StepDurationBuckets();

class ExpositionWriter {
 public:
  // Starts family `name` of `type` ("counter", "gauge" or "histogram"). A counter's name must end
  // in "_total"; an invalid name, a counter without "_total" or a family started twice is a
  // programming error (aborts with the name).
  void Family(std::string_view name, std::string_view type, std::string_view help);
  // One sample of the current counter or gauge family. Label names must be valid (aborts
  // otherwise).
  void Sample(const Labels& labels, double value);
  // The current family's histogram series with `labels` (le added): _bucket..., _sum, _count.
  void HistogramSeries(const Labels& labels, const Histogram& h);
  // The text so far (ends in a newline when non-empty).
  const std::string& text() const { return out_; }

 private:
  void Line(std::string_view name, const Labels& labels, double value);
  std::string family_, type_;
  std::vector<std::string> seen_;
  std::string out_;
};

}  // namespace fsdp8::prom
