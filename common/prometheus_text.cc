#include "common/prometheus_text.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace fsdp8::prom {
namespace {

[[noreturn]] void Die(const std::string& what) {
  fprintf(stderr, "%s:%d: prometheus exposition: %s\n", __FILE__, __LINE__, what.c_str());
  abort();
}

bool NameChars(std::string_view s, bool colon) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                       (colon && c == ':');
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

}  // namespace

std::string EscapeLabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string EscapeHelp(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

bool ValidMetricName(std::string_view name) { return NameChars(name, true); }
bool ValidLabelName(std::string_view name) { return NameChars(name, false); }

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  std::sort(bounds_.begin(), bounds_.end());
  counts_.assign(bounds_.size(), 0);
}

void Histogram::Observe(double v) {
  for (size_t i = 0; i < bounds_.size(); ++i)
    if (v <= bounds_[i]) ++counts_[i];
  ++count_;
  sum_ += v;
}

std::vector<double> StepDurationBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
          1,     2.5,    5,     10,   30,    60,   120, 300, 600};
}

void ExpositionWriter::Family(std::string_view name, std::string_view type,
                              std::string_view help) {
  const std::string n(name);
  if (!ValidMetricName(n)) Die("invalid metric name \"" + n + "\"");
  if (type != "counter" && type != "gauge" && type != "histogram")
    Die("metric " + n + ": unsupported type " + std::string(type));
  const std::string suffix = "_total";
  if (type == "counter" &&
      (n.size() <= suffix.size() || n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0))
    Die("counter " + n + " must end in _total");
  if (std::find(seen_.begin(), seen_.end(), n) != seen_.end())
    Die("metric family " + n + " written twice");
  seen_.push_back(n);
  family_ = n;
  type_ = std::string(type);
  out_ += "# HELP " + n + " " + EscapeHelp(help) + "\n";
  out_ += "# TYPE " + n + " " + type_ + "\n";
}

void ExpositionWriter::Line(std::string_view name, const Labels& labels, double value) {
  out_ += name;
  if (!labels.empty()) {
    out_ += '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      if (!ValidLabelName(labels[i].first)) Die("invalid label name \"" + labels[i].first + "\"");
      if (i > 0) out_ += ',';
      out_ += labels[i].first;
      out_ += "=\"";
      out_ += EscapeLabelValue(labels[i].second);
      out_ += '"';
    }
    out_ += '}';
  }
  out_ += ' ';
  out_ += FormatValue(value);
  out_ += '\n';
}

void ExpositionWriter::Sample(const Labels& labels, double value) {
  if (family_.empty() || type_ == "histogram") Die("Sample outside a counter or gauge family");
  Line(family_, labels, value);
}

void ExpositionWriter::HistogramSeries(const Labels& labels, const Histogram& h) {
  if (type_ != "histogram") Die("HistogramSeries outside a histogram family (" + family_ + ")");
  Labels l = labels;
  l.emplace_back("le", "");
  for (size_t i = 0; i < h.bounds().size(); ++i) {
    l.back().second = FormatValue(h.bounds()[i]);
    Line(family_ + "_bucket", l, static_cast<double>(h.counts()[i]));
  }
  l.back().second = "+Inf";
  Line(family_ + "_bucket", l, static_cast<double>(h.count()));
  Line(family_ + "_sum", labels, h.sum());
  Line(family_ + "_count", labels, static_cast<double>(h.count()));
}

}  // namespace fsdp8::prom
