#include "coordinator/status_page.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace fsdp8::coord {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

Value Num(double v) {
  Value x;
  if (std::isfinite(v)) x.set_number_value(v);
  else x.set_null_value(google::protobuf::NULL_VALUE);  // JSON has no NaN or infinity
  return x;
}
Value Str(const std::string& s) {
  Value x;
  x.set_string_value(s);
  return x;
}

std::string QueryParam(const std::string& query, const std::string& name) {
  for (absl::string_view kv : absl::StrSplit(query, '&')) {
    std::pair<absl::string_view, absl::string_view> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    if (p.first == name) return std::string(p.second);
  }
  return "";
}

// The status page. It renders from the embedded JSON at once (no round trip before the first
// paint), then polls /api/status every 2 s. After each update it copies what the loss chart holds
// into data-steps / data-losses on its canvas, so a reader of the DOM sees the chart's data.
constexpr char kPageHead[] = R"HTML(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>fsdp8 coordinator</title>
<style>
body { font: 14px/1.4 sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px 0; } h2 { font-size: 16px; margin: 18px 0 6px 0; }
table { border-collapse: collapse; } th, td { padding: 3px 10px; border-bottom: 1px solid #ddd; text-align: left; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.RUNNING { color: #0a6; font-weight: bold; } .FAILED { color: #c22; font-weight: bold; }
.RECOVERING, .STARTING, .PENDING { color: #b70; font-weight: bold; } .SUCCEEDED { color: #036; }
.charts { display: flex; gap: 24px; flex-wrap: wrap; } .chart { width: 560px; height: 300px; }
#error, #chart-error { color: #c22; font-weight: bold; } .muted { color: #777; }
</style>
<script src="/chart.js"></script>
</head><body>
<h1>fsdp8 coordinator</h1>
<div class="muted">updated <span id="updated"></span></div>
<div id="error"></div>
<div id="chart-error"></div>
<h2>Jobs</h2>
<table id="jobs"><thead><tr><th>job</th><th>name</th><th>state</th><th>step</th><th>loss</th>
<th>val loss</th><th>tokens</th><th>ranks</th><th>restarts</th><th>reason</th></tr></thead><tbody></tbody></table>
<h2>Workers</h2>
<table id="workers"><thead><tr><th>worker</th><th>host</th><th>backend</th><th>device</th>
<th>health</th><th>job</th><th>rank</th><th>last heartbeat</th></tr></thead><tbody></tbody></table>
<h2>Job <span id="chart-job"></span></h2>
<div class="charts">
<div class="chart"><canvas id="loss-chart"></canvas></div>
<div class="chart"><canvas id="throughput-chart"></canvas></div>
</div>
<script id="initial-state" type="application/json">)HTML";

constexpr char kPageTail[] = R"HTML(</script>
<script>
"use strict";
let lossChart = null, tputChart = null;
function fmt(v, d) { return v === null || v === undefined ? "-" : Number(v).toFixed(d); }
function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}
function lineChart(canvas, datasets, ytitle) {
  return new Chart(canvas, {
    type: "line",
    data: { datasets: datasets },
    options: {
      animation: false, responsive: true, maintainAspectRatio: false, parsing: false,
      elements: { point: { radius: 0 } },
      scales: { x: { type: "linear", title: { display: true, text: "step" } },
                y: { title: { display: true, text: ytitle } } }
    }
  });
}
function render(st) {
  document.getElementById("updated").textContent = new Date(st.time * 1000).toISOString();
  const jobs = document.querySelector("#jobs tbody");
  jobs.replaceChildren();
  for (const j of st.jobs) {
    const tr = document.createElement("tr");
    tr.dataset.job = j.job_id;
    const a = document.createElement("a");
    a.href = "?job=" + encodeURIComponent(j.job_id);
    a.textContent = j.job_id;
    cell(tr, "").appendChild(a);
    cell(tr, j.name);
    cell(tr, j.state, j.state);
    cell(tr, j.step + "/" + j.total_steps, "num");
    cell(tr, fmt(j.loss, 4), "num");
    cell(tr, fmt(j.val_loss, 4), "num");
    cell(tr, String(j.tokens), "num");
    const live = j.configured_replicas > j.replicas
        ? " (" + j.replicas + " of " + j.configured_replicas + " replicas live)" : "";
    cell(tr, j.worker_ids.length ? (j.mesh ? j.mesh + live + ": " : "") + j.worker_ids.join(", ")
                                 : "-");
    cell(tr, String(j.restarts), "num");
    cell(tr, j.reason);
    jobs.appendChild(tr);
  }
  const workers = document.querySelector("#workers tbody");
  workers.replaceChildren();
  for (const w of st.workers) {
    const tr = document.createElement("tr");
    tr.dataset.worker = w.worker_id;
    cell(tr, w.worker_id);
    cell(tr, w.host);
    cell(tr, w.backend);
    cell(tr, String(w.device), "num");
    cell(tr, w.healthy ? "healthy" : "unhealthy", w.healthy ? "RUNNING" : "FAILED");
    cell(tr, w.job_id || "idle");
    cell(tr, w.rank >= 0 ? String(w.rank) : "-", "num");
    cell(tr, fmt(st.time - w.last_heartbeat, 1) + " s ago", "num");
    workers.appendChild(tr);
  }
  document.getElementById("chart-job").textContent = st.chart_job || "(no steps yet)";
  if (typeof Chart === "undefined") {
    document.getElementById("chart-error").textContent =
      "charts unavailable: /chart.js did not load (" + st.chartjs_error + ")";
    return;
  }
  const loss = st.points.map(p => ({ x: p.step, y: p.loss }));
  const val = st.points.filter(p => p.val_loss !== null).map(p => ({ x: p.step, y: p.val_loss }));
  const tput = st.points.map(p => ({ x: p.step, y: p.tokens_per_second }));
  if (!lossChart) {
    lossChart = lineChart(document.getElementById("loss-chart"), [
      { label: "train loss", data: loss, borderColor: "#1f77b4", backgroundColor: "#1f77b4", borderWidth: 1.5 },
      { label: "val loss", data: val, borderColor: "#d62728", backgroundColor: "#d62728", borderWidth: 2,
        pointRadius: 3 }], "nats per token");
    tputChart = lineChart(document.getElementById("throughput-chart"), [
      { label: "tokens per second", data: tput, borderColor: "#2ca02c", backgroundColor: "#2ca02c",
        borderWidth: 1.5 }], "tokens / s");
  } else {
    lossChart.data.datasets[0].data = loss;
    lossChart.data.datasets[1].data = val;
    tputChart.data.datasets[0].data = tput;
    lossChart.update("none");
    tputChart.update("none");
  }
  const c = document.getElementById("loss-chart");
  c.dataset.job = st.chart_job;
  c.dataset.steps = JSON.stringify(lossChart.data.datasets[0].data.map(p => p.x));
  c.dataset.losses = JSON.stringify(lossChart.data.datasets[0].data.map(p => p.y));
}
render(JSON.parse(document.getElementById("initial-state").textContent));
setInterval(async () => {
  try {
    const r = await fetch("/api/status" + location.search, { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = "coordinator unreachable: " + e.message;
  }
}, 2000);
</script>
</body></html>
)HTML";

}  // namespace

absl::StatusOr<std::string> ChartJsPath() {
  static const char* const kCandidates[] = {
      "/usr/share/javascript/chart.js/chart.min.js",   // libjs-chart.js 3.x (Debian 12)
      "/usr/share/javascript/chart.js/chart.umd.js",   // 4.x
      "/usr/share/javascript/chart.js/chart.js",
      "/usr/share/javascript/chart.js/Chart.min.js",   // 2.x
  };
  std::error_code ec;
  for (const char* p : kCandidates)
    if (std::filesystem::is_regular_file(p, ec)) return std::string(p);
  return absl::NotFoundError(
      "Chart.js not found under /usr/share/javascript/chart.js/ (apt-get install libjs-chart.js)");
}

namespace {

// The chart's points of job `id`: its kept step events (the job's history: they outlive
// coordinator restarts and go on across resumes) up to where the in-memory recent steps begin,
// then those; the newest kMaxPoints. A step trained again (after a recovery) keeps its newest point.
std::vector<CoordinatorMetrics::Point> ChartPoints(const JobManager& jobs,
                                                   const CoordinatorMetrics& metrics,
                                                   const std::string& id) {
  std::vector<CoordinatorMetrics::Point> recent = metrics.Recent(id);
  if (id.empty()) return recent;
  const int64_t first = recent.empty() ? std::numeric_limits<int64_t>::max() : recent.front().step;
  std::vector<CoordinatorMetrics::Point> out;
  auto events = jobs.RecentEvents(id, jobs.options().max_events_per_job);
  if (events.ok()) {
    for (const v1::JobEvent& ev : *events) {
      if (!ev.message().empty() || ev.step() <= 0 || ev.step() >= first) continue;
      while (!out.empty() && out.back().step >= ev.step()) out.pop_back();
      out.push_back({ev.step(), ev.loss(), ev.val_loss(), ev.tokens_per_second(), ev.step_seconds(),
                     ev.time()});
    }
  }
  out.insert(out.end(), recent.begin(), recent.end());
  if (out.size() > CoordinatorMetrics::kMaxPoints)
    out.erase(out.begin(), out.end() - static_cast<std::ptrdiff_t>(CoordinatorMetrics::kMaxPoints));
  return out;
}

}  // namespace

std::string StatusJson(const JobManager& jobs, const WorkerRegistry& workers,
                       const CoordinatorMetrics& metrics, const std::string& chart_job_in) {
  Struct doc;
  auto& f = *doc.mutable_fields();
  f["time"] = Num(NowSeconds());
  const std::vector<v1::Job> all = jobs.List();
  ListValue* jl = f["jobs"].mutable_list_value();
  for (auto it = all.rbegin(); it != all.rend(); ++it) {  // newest first
    const v1::Job& j = *it;
    Struct* o = jl->add_values()->mutable_struct_value();
    auto& g = *o->mutable_fields();
    g["job_id"] = Str(j.job_id());
    g["name"] = Str(j.spec().name());
    g["state"] = Str(StateName(j.state()));
    g["reason"] = Str(j.reason());
    g["step"] = Num(static_cast<double>(j.step()));
    g["total_steps"] = Num(static_cast<double>(j.total_steps()));
    g["loss"] = Num(j.step() > 0 ? j.loss() : NAN);
    g["val_loss"] = Num(j.val_loss());
    g["tokens"] = Num(static_cast<double>(j.tokens()));
    g["restarts"] = Num(j.restarts());
    // The mesh of a hybrid-sharded job, "RxS" (replicas x shard group); empty when flat. A job
    // that continued on fewer replicas: its live replicas (the mesh's R) and configured ones.
    const bool shrunk = j.configured_replicas() > j.replicas() && j.replicas() >= 1;
    g["mesh"] = Str((j.replicas() > 1 || shrunk) && j.world_size() % j.replicas() == 0
                        ? absl::StrCat(j.replicas(), "x", j.world_size() / j.replicas())
                        : std::string());
    g["replicas"] = Num(j.replicas());
    g["configured_replicas"] = Num(std::max(j.configured_replicas(), j.replicas()));
    ListValue* ids = g["worker_ids"].mutable_list_value();
    for (const std::string& w : j.worker_ids()) *ids->add_values() = Str(w);
  }
  ListValue* wl = f["workers"].mutable_list_value();
  for (const v1::WorkerInfo& w : workers.List()) {
    auto& g = *wl->add_values()->mutable_struct_value()->mutable_fields();
    g["worker_id"] = Str(w.worker_id());
    g["host"] = Str(w.host());
    g["backend"] = Str(w.backend());
    g["device"] = Num(w.device());
    g["healthy"].set_bool_value(w.healthy());
    g["job_id"] = Str(w.job_id());
    g["rank"] = Num(w.rank());
    g["last_heartbeat"] = Num(w.last_heartbeat());
  }
  std::string chart_job = chart_job_in;
  if (chart_job.empty()) {  // newest running job with steps, else the newest job with steps
    for (int pass = 0; pass < 2 && chart_job.empty(); ++pass)
      for (auto it = all.rbegin(); it != all.rend() && chart_job.empty(); ++it)
        if ((pass == 1 || !IsTerminalState(it->state())) && !metrics.Recent(it->job_id()).empty())
          chart_job = it->job_id();
  }
  f["chart_job"] = Str(chart_job);
  ListValue* pl = f["points"].mutable_list_value();
  for (const CoordinatorMetrics::Point& p : ChartPoints(jobs, metrics, chart_job)) {
    auto& g = *pl->add_values()->mutable_struct_value()->mutable_fields();
    g["step"] = Num(static_cast<double>(p.step));
    g["loss"] = Num(p.loss);
    g["val_loss"] = Num(p.val_loss);
    g["tokens_per_second"] = Num(p.tokens_per_second);
    g["step_seconds"] = Num(p.step_seconds);
  }
  auto chart = ChartJsPath();
  f["chartjs_error"] = Str(chart.ok() ? "" : std::string(chart.status().message()));
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(doc, &out);
  // '<' only occurs inside strings, where \u003c means the same: the document can then sit inside
  // a <script> element without a "</script>" in a job name closing it.
  return absl::StrReplaceAll(out, {{"<", "\\u003c"}});
}

HttpResponse ServeStatusHttp(const std::string& path, const std::string& query,
                             const JobManager& jobs, const WorkerRegistry& workers,
                             const CoordinatorMetrics& metrics) {
  if (path == "/metrics")
    return {200, "text/plain; version=0.0.4; charset=utf-8", metrics.Render(jobs, workers)};
  if (path == "/api/status")
    return {200, "application/json",
            StatusJson(jobs, workers, metrics, QueryParam(query, "job"))};
  if (path == "/" || path == "/index.html")
    return {200, "text/html; charset=utf-8",
            absl::StrCat(kPageHead, StatusJson(jobs, workers, metrics, QueryParam(query, "job")),
                         kPageTail)};
  if (path == "/chart.js") {
    auto p = ChartJsPath();
    if (!p.ok()) return {500, "text/plain; charset=utf-8", std::string(p.status().message()) + "\n"};
    std::ifstream in(*p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!in) return {500, "text/plain; charset=utf-8", absl::StrCat("cannot read ", *p, "\n")};
    return {200, "text/javascript; charset=utf-8", ss.str()};
  }
  return {404, "text/plain; charset=utf-8", "not found: try /, /metrics or /api/status\n"};
}

}  // namespace fsdp8::coord
