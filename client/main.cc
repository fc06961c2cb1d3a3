// fsdp8: the command-line client of an fsdp8 coordinator.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "client/cli_args.h"
#include "client/client.h"
#include "client/plan_predict.h"
#include "client/local_run.h"
#include "client/plot.h"
#include "client/prepare.h"
#include "client/progress.h"
#include "client/tensorboard.h"
#include "common/env_settings.h"
#include "common/hf_model.h"
#include "common/memory_plan.h"
#include "common/mesh.h"
#include "common/spec.h"
#include "google/protobuf/util/json_util.h"

namespace {

constexpr char kUsage[] =
    "usage: fsdp8 [--coordinator host:port] COMMAND ...\n"
    "\n"
    "commands:\n"
    "  submit SPEC_FILE [--request-id ID] [--no-watch]   submit a job (YAML or JSON), then watch it\n"
    "  watch JOB [--json] [--plot FILE] [--log FILE] [--tensorboard DIR]\n"
    "                                                    follow a job until it ends (--json: one event per\n"
    "                                                    line; --plot, also on submit: the loss curve\n"
    "                                                    as an image, .png, .svg or .pdf, by gnuplot;\n"
    "                                                    --log, also on submit: the progress lines and\n"
    "                                                    the summary appended to FILE, while a terminal\n"
    "                                                    shows the live bar; --tensorboard, also on\n"
    "                                                    submit: TensorBoard event files under DIR/JOB\n"
    "                                                    by fsdp8-tensorboard, Python SDK)\n"
    "  status JOB [--json]                               one job's state\n"
    "  list [--page-size N] [--page-token T]             every job you may see, oldest first (with a\n"
    "                                                    flag: one page, then the next page's token)\n"
    "  cancel JOB [--no-save]                            cancel a job; a running job with a checkpoint.dir\n"
    "                                                    first saves a checkpoint after its current step\n"
    "                                                    (--no-save: stop at once, saving nothing)\n"
    "  resume JOB [--no-watch] [--json] [--plot FILE] [--log FILE] [--tensorboard DIR]\n"
    "                                                    continue your CANCELLED or FAILED job, same id,\n"
    "                                                    from its newest committed checkpoint, then watch\n"
    "                                                    it (the whole history, from its first step)\n"
    "  run SPEC_FILE [--state-dir DIR] [--threads N] [--plot FILE] [--log FILE] [--json]\n"
    "      [--tensorboard DIR]\n"
    "                                                    local mode: start a coordinator and the workers the\n"
    "                                                    spec asks for (CPU: sharding.min_workers; cuda: one\n"
    "                                                    per GPU) as child processes, train and watch; Ctrl-C\n"
    "                                                    saves a checkpoint and stops; run it again to resume\n"
    "                                                    (state in SPEC_DIR/SPEC_NAME.fsdp8/)\n"
    "  delete JOB                                        remove an ended job from the job table (its\n"
    "                                                    checkpoints stay)\n"
    "  workers                                           registered workers\n"
    "  scaling JOB                                       a running job's FP8 scales and amax histories\n"
    "  checkpoint JOB                                    save a checkpoint of a running job after its next step\n"
    "  checkpoints JOB                                   committed checkpoints of a job (step, world size, bytes, dir)\n"
    "  drain WORKER [--undo]                             give a worker no more work (admin)\n"
    "  log-level LEVEL                                   coordinator log level: error|warning|info|debug (admin)\n"
    "  prepare --out DIR [--val-fraction 0.05] FILES...  text files -> byte-level token shards\n"
    "  prepare --tokenizer FILE --out DIR ... INPUTS...  text/JSONL -> token shards through a Hugging\n"
    "                                                    Face tokenizer.json or SentencePiece .model:\n"
    "                                                    runs fsdp8-prepare (Python SDK) with these\n"
    "                                                    arguments (fsdp8-prepare --help)\n"
    "  export JOB|CHECKPOINT_DIR --out DIR [--step N] [--dtype f32|bf16] [--max-shard-size 5GB]\n"
    "         [--tokenizer DIR]                          a committed checkpoint (default: the newest) as a\n"
    "                                                    Hugging Face directory (config.json, model.safetensors\n"
    "                                                    or shards + model.safetensors.index.json, the tokenizer\n"
    "                                                    files and special token ids of --tokenizer, else of\n"
    "                                                    the record prepare left beside the job's shards,\n"
    "                                                    else of the job's init.from_hf)\n"
    "  model-section HF_DIR|CONFIG_JSON [--seq-len 2048] the spec's model section (YAML) for a Hugging Face\n"
    "                                                    config.json\n"
    "  plan SPEC_FILE [--world-size N] [--json]          each rank's predicted peak device memory, broken\n"
    "                                                    down, and the mesh (default: at sharding.min/max_workers;\n"
    "                                                    --replicas R: the R of a replicas auto spec)\n"
    "  plan SPEC_FILE --predict [--world-size N] [--replicas R] [--calibration FILE] [--json]\n"
    "                                                    the predicted step time and its compute /\n"
    "                                                    exposed communication / optimizer split\n"
    "\n"
    "--coordinator defaults to $FSDP8_COORDINATOR, else localhost:50051.\n"
    "security: --tls-ca FILE (verify the coordinator; TLS), --tls-cert FILE --tls-key FILE (mutual\n"
    "TLS), --token TOKEN or --token-file FILE (bearer token); defaults from $FSDP8_TLS_CA,\n"
    "$FSDP8_TLS_CERT, $FSDP8_TLS_KEY, $FSDP8_TOKEN, $FSDP8_TOKEN_FILE.\n"
    "watch/submit/resume/run exit 0 only when the job SUCCEEDED (run: 130 when Ctrl-C cancelled it).\n"
    "Flags are spelled with dashes; the underscore spelling (--request_id, --val_fraction,\n"
    "--no_watch) is deprecated and still accepted for one release.\n";

using Args = fsdp8::CliArgs;

int Usage(const std::string& error) {
  if (!error.empty()) fprintf(stderr, "error: %s\n", error.c_str());
  fputs(kUsage, stderr);
  return 2;
}

std::string Num(double v, int decimals = 4) {
  if (std::isnan(v)) return "-";
  return absl::StrFormat("%.*f", decimals, v);
}

std::string Thousands(int64_t v) {
  std::string s = absl::StrCat(v < 0 ? -v : v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string State(fsdp8::v1::JobState s) {
  std::string n = fsdp8::v1::JobState_Name(s);
  return n.rfind("JOB_STATE_", 0) == 0 ? n.substr(10) : n;
}

// `fsdp8 prepare --tokenizer ...`: replaces this process by fsdp8-prepare (found on PATH) with the
// same arguments. Returns only when it cannot: 2 with the commands that install and run it when it
// is not installed, 1 on any other exec failure.
int HandOverPrepare(const std::vector<std::string>& args) {
  const char* kProgram = "fsdp8-prepare";
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(kProgram));
  for (const std::string& s : args) argv.push_back(const_cast<char*>(s.c_str()));
  argv.push_back(nullptr);
  fflush(nullptr);
  execvp(kProgram, argv.data());
  const int err = errno;
  if (err != ENOENT) {
    fprintf(stderr, "error: cannot run %s: %s\n", kProgram, std::strerror(err));
    return 1;
  }
  constexpr char kShellSpecial[] = " \t\n'\"\\$`*?[]{}()<>|&;#~!";
  std::string call = kProgram;  // the same arguments, quoted for a shell where needed
  for (const std::string& s : args) {
    const bool plain = !s.empty() && s.find_first_of(kShellSpecial) == std::string::npos;
    call += " " + (plain ? s : "'" + absl::StrReplaceAll(s, {{"'", "'\\''"}}) + "'");
  }
  fprintf(stderr,
          "error: prepare --tokenizer runs fsdp8-prepare from fsdp8's Python SDK, which is not on "
          "PATH.\n"
          "Install it (from the fsdp8 source tree; a virtual environment on Debian 12):\n"
          "  python3 -m pip install './client/python[prepare]'\n"
          "then run:\n"
          "  %s\n",
          call.c_str());
  return 2;
}

int ReportError(const absl::Status& s) {
  fprintf(stderr, "error: %s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
          std::string(s.message()).c_str());
  return 1;
}

// "5GB", "500MB", "64KiB", "1000" -> bytes (transformers' max_shard_size spellings: KB/MB/GB are
// powers of 10, KiB/MiB/GiB of 2).
absl::StatusOr<int64_t> ParseByteSize(const std::string& text) {
  static const std::pair<const char*, int64_t> kUnits[] = {
      {"KiB", int64_t{1} << 10}, {"MiB", int64_t{1} << 20}, {"GiB", int64_t{1} << 30},
      {"KB", 1000}, {"MB", 1000000}, {"GB", 1000000000}, {"B", 1}};
  std::string num = text;
  int64_t unit = 1;
  for (const auto& [suffix, bytes] : kUnits) {
    if (absl::EndsWith(text, suffix)) {
      num = text.substr(0, text.size() - std::strlen(suffix));
      unit = bytes;
      break;
    }
  }
  double v = 0;
  if (!absl::SimpleAtod(num, &v) || !(v * unit >= 1) || v * unit > 9e18) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-shard-size: must be a size such as 5GB, 500MB or 1000000 (got \"", text, "\")"));
  }
  return static_cast<int64_t>(v * static_cast<double>(unit));
}

// fsdp8 export JOB|CHECKPOINT_DIR --out DIR [--step N] [--dtype f32|bf16]. A local directory is
// read directly; anything else is a job id whose checkpoints the coordinator lists (their
// directories must be reachable from here).
int Export(Args& a, const std::string& address, const fsdp8::ChannelSecurity& sec) {
  if (a.positional.size() != 1) return Usage("export: exactly one JOB or CHECKPOINT_DIR");
  if (!a.flags.count("out") || a.flags["out"].empty()) return Usage("export: --out DIR is required");
  std::optional<int64_t> step;
  if (a.flags.count("step")) {
    int64_t k = 0;
    if (!absl::SimpleAtoi(a.flags["step"], &k) || k < 0) {
      return Usage(absl::StrCat("--step: must be a step number >= 0 (got \"", a.flags["step"], "\")"));
    }
    step = k;
  }
  fsdp8::SafetensorsDtype dtype = fsdp8::SafetensorsDtype::kF32;
  if (a.flags.count("dtype")) {
    const std::string d = a.flags["dtype"];
    if (d == "bf16" || d == "bfloat16") dtype = fsdp8::SafetensorsDtype::kBF16;
    else if (d != "f32" && d != "fp32" && d != "float32")
      return Usage(absl::StrCat("--dtype: must be f32 or bf16 (got \"", d, "\")"));
  }
  fsdp8::HfExportOptions options;
  options.dtype = dtype;
  if (a.flags.count("max-shard-size")) {
    auto bytes = ParseByteSize(a.flags["max-shard-size"]);
    if (!bytes.ok()) return Usage(std::string(bytes.status().message()));
    options.max_shard_bytes = *bytes;
  }
  std::error_code ec;
  if (a.flags.count("tokenizer")) {
    options.tokenizer_dir = a.flags["tokenizer"];
    if (!std::filesystem::is_directory(options.tokenizer_dir, ec)) {
      return Usage(absl::StrCat("--tokenizer: \"", options.tokenizer_dir,
                                "\" is not a directory (the tokenizer files to copy)"));
    }
  }
  std::string src = a.positional[0];
  if (!std::filesystem::is_directory(src, ec)) {
    // No coordinator (after `fsdp8 run`, say): a checkpoint folder needs none.
    auto unreachable = [&](const absl::Status& s) {
      ReportError(s);
      // The transport's failure (no server there), not a coordinator's own UNAVAILABLE.
      if (absl::IsUnavailable(s) && absl::StrContains(s.message(), "connect"))
        fprintf(stderr, "export: \"%s\" is not a folder, so it was taken as a job id, and no "
                "coordinator answered at %s; give the job's checkpoint folder instead (fsdp8 run: "
                "<spec>.fsdp8/checkpoints, or the spec's checkpoint.dir)\n", src.c_str(),
                address.c_str());
      return 1;
    };
    auto client = fsdp8::Client::Connect(address, sec);
    if (!client.ok()) return unreachable(client.status());
    auto cks = (*client)->ListCheckpoints(src);
    if (!cks.ok()) return unreachable(cks.status());
    const fsdp8::v1::CheckpointInfo* pick = nullptr;
    for (const auto& ck : *cks) {
      if (step ? ck.step() == *step : (!pick || ck.step() > pick->step())) pick = &ck;
    }
    if (!pick) {
      return ReportError(absl::NotFoundError(
          step ? absl::StrCat("job ", src, " has no committed checkpoint of step ", *step)
               : absl::StrCat("job ", src, " has no committed checkpoint")));
    }
    src = pick->dir();
  }
  auto dir = fsdp8::ResolveCheckpointStepDir(src, step);
  if (!dir.ok()) return ReportError(dir.status());
  const std::string& out = a.flags["out"];
  std::vector<std::string> tokenizer_files;
  if (absl::Status s = fsdp8::ExportHf(*dir, out, options, &tokenizer_files); !s.ok()) {
    return ReportError(s);
  }
  const bool sharded = std::filesystem::exists(std::filesystem::path(out) / fsdp8::kHfIndexFile);
  std::vector<std::string> written = {fsdp8::kHfConfigFile,
                                      sharded ? fsdp8::kHfIndexFile : fsdp8::kHfWeightsFile};
  written.insert(written.end(), tokenizer_files.begin(), tokenizer_files.end());
  printf("exported %s as %s into %s: %s\n", dir->c_str(), fsdp8::SafetensorsDtypeName(dtype),
         out.c_str(), absl::StrJoin(written, ", ").c_str());
  return 0;
}

// fsdp8 model-section HF_DIR|CONFIG_JSON [--seq-len N]: prints the model section.
int ModelSection(Args& a) {
  if (a.positional.size() != 1) return Usage("model-section: exactly one HF_DIR or CONFIG_JSON");
  int seq_len = 2048;
  if (a.flags.count("seq-len") && (!absl::SimpleAtoi(a.flags["seq-len"], &seq_len) || seq_len < 1)) {
    return Usage(absl::StrCat("--seq-len: must be a positive integer (got \"", a.flags["seq-len"], "\")"));
  }
  std::string path = a.positional[0];
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) path += std::string("/") + fsdp8::kHfConfigFile;
  std::ifstream in(path);
  if (!in) return ReportError(absl::NotFoundError(absl::StrCat("cannot read ", path)));
  std::stringstream text;
  text << in.rdbuf();
  auto yaml = fsdp8::HfModelSectionYaml(text.str(), seq_len);
  if (!yaml.ok()) return ReportError(yaml.status());
  fputs(yaml->c_str(), stdout);
  return 0;
}

// The closing line of a watch: state, steps, the job's wall time (end_time - start_time; the
// watch's own when the job has no times, e.g. one watched from before it started), mean tokens/s
// of the job (tokens / that time) and the last train and validation losses.
std::string SummaryLine(const fsdp8::v1::Job& job, double elapsed_s) {
  const double run_s = job.end_time() - job.start_time();
  const bool timed = job.start_time() > 0 && job.end_time() > 0 && run_s > 0;
  std::string line = absl::StrFormat("job %s %s after %d/%d steps in %s", job.job_id(),
                                     State(job.state()), job.step(), job.total_steps(),
                                     fsdp8::FormatDuration(timed ? run_s : elapsed_s));
  if (timed && job.tokens() > 0) {
    absl::StrAppend(&line, " (mean ", Thousands(static_cast<int64_t>(job.tokens() / run_s)),
                    " tok/s)");
  }
  absl::StrAppend(&line, ": train loss ", Num(job.step() > 0 ? job.loss() : NAN), ", val loss ",
                  Num(job.val_loss()), " (nats per token)");
  return line;
}

// Follows a job; returns the exit code (0 only for SUCCEEDED). With `plot`, writes the loss curve
// there when the watch ends, and every 30 s meanwhile. On a terminal, steps show as a live bar;
// otherwise as a line every 10 steps, at evaluations and at the end. `log` (may be null) gets the
// plain lines and the summary whether or not stdout is a terminal. Elapsed time and ETA are the
// job's (client/progress.h): from its start_time, at each event's time. `tensorboard` (may be
// null) gets every event (client/tensorboard.h).
int WatchJob(fsdp8::Client& c, const std::string& job_id, bool json = false,
             const std::string& plot = "", FILE* log = nullptr,
             fsdp8::TensorBoardSink* tensorboard = nullptr) {
  std::vector<fsdp8::LossPoint> curve;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {  // the watch's own, for a summary of a job that has no times
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  fsdp8::WatchProgress progress;
  // The job's start_time: asked for once, at the first step (a job watched from PENDING has none
  // before it starts); unknown (elapsed "?") if that call fails.
  bool asked_job_start = false;
  auto learn_job_start = [&] {
    if (asked_job_start) return;
    asked_job_start = true;
    auto j = c.GetJob(job_id);
    if (j.ok()) progress.set_job_start(j->start_time());
  };
  absl::Status tensorboard_status;
  auto last_plot = start;
  auto write_plot = [&]() {
    absl::Status s = fsdp8::WriteLossPlot(plot, absl::StrCat("fsdp8 job ", job_id), curve);
    last_plot = std::chrono::steady_clock::now();
    return s;
  };
  auto to_log = [&](const std::string& line) {
    if (log == nullptr) return;
    fprintf(log, "%s\n", line.c_str());
    fflush(log);
  };
  const bool tty = isatty(fileno(stdout));
  fsdp8::v1::JobState state = fsdp8::v1::JOB_STATE_UNSPECIFIED;
  bool bar_drawn = false;
  auto end_bar = [&] {  // keeps the last bar on its own line
    if (bar_drawn) {
      printf("\n");
      bar_drawn = false;
    }
  };
  auto job = c.Watch(job_id, 0, [&](const fsdp8::v1::JobEvent& ev) {
    if (tensorboard != nullptr && tensorboard_status.ok()) tensorboard_status = tensorboard->Write(ev);
    if (fsdp8::IsStepEvent(ev)) {
      if (!json) learn_job_start();
      progress.Add(ev);
      // A restarted generation replays the steps after its checkpoint: keep the newest ones.
      while (!curve.empty() && curve.back().step >= ev.step()) curve.pop_back();
      curve.push_back({ev.step(), ev.loss(), ev.val_loss()});
      if (!plot.empty() && std::chrono::steady_clock::now() - last_plot > std::chrono::seconds(30))
        write_plot().IgnoreError();  // a failure is reported at the end
    }
    if (json) {  // JSON lines (proto3 JSON mapping, NaN as "NaN") for scripts
      std::string line;
      google::protobuf::util::JsonPrintOptions o;
      o.always_print_primitive_fields = true;
      o.preserve_proto_field_names = true;
      (void)google::protobuf::util::MessageToJsonString(ev, &line, o);
      printf("%s\n", line.c_str());
      fflush(stdout);
      to_log(line);
      state = ev.state();
      return true;
    }
    const bool state_changed = ev.state() != state;
    state = ev.state();
    const bool is_step = fsdp8::IsStepEvent(ev);
    if (!is_step) {  // a state change or a notice
      end_bar();
      const std::string line = absl::StrCat(State(ev.state()), ": ", ev.message());
      printf("%s\n", line.c_str());
      fflush(stdout);
      to_log(line);
      return true;
    }
    const bool plain_due = !std::isnan(ev.val_loss()) || state_changed || ev.step() % 10 == 0 ||
                           ev.step() == ev.total_steps();
    if (plain_due) to_log(fsdp8::StepLine(ev, progress));
    if (tty) {
      const int width = 20;
      int filled = ev.total_steps() > 0
                       ? static_cast<int>(width * ev.step() / ev.total_steps()) : 0;
      std::string bar(filled, '#');
      bar += std::string(width - filled, '.');
      printf("\r\033[K[%s] step %lld/%lld  epoch %.2f  loss %s  val %s  %s tok/s  elapsed %s  ETA %s",
             bar.c_str(), static_cast<long long>(ev.step()),
             static_cast<long long>(ev.total_steps()), ev.epoch(), Num(ev.loss()).c_str(),
             Num(progress.last_val_loss()).c_str(),
             Thousands(static_cast<int64_t>(ev.tokens_per_second())).c_str(),
             fsdp8::FormatDuration(progress.ElapsedAt(ev.time())).c_str(),
             fsdp8::FormatDuration(progress.EtaAfter(ev)).c_str());
      bar_drawn = true;
      fflush(stdout);
    } else if (plain_due) {
      printf("%s\n", fsdp8::StepLine(ev, progress).c_str());
      fflush(stdout);
    }
    return true;
  });
  end_bar();
  if (!plot.empty()) {
    absl::Status ps = write_plot();
    if (ps.ok()) {
      const std::string line =
          absl::StrFormat("loss curve (%d steps) written to %s", curve.size(), plot);
      fprintf(json ? stderr : stdout, "%s\n", line.c_str());
      to_log(line);
    } else {
      fprintf(stderr, "error: %s\n", std::string(ps.message()).c_str());
    }
  }
  if (tensorboard != nullptr) {
    auto written = tensorboard->Finish();
    if (!tensorboard_status.ok()) written = tensorboard_status;
    if (written.ok()) {
      fprintf(json ? stderr : stdout, "%s\n", written->c_str());
      to_log(*written);
    } else {
      fprintf(stderr, "error: %s\n", std::string(written.status().message()).c_str());
    }
  }
  if (!job.ok()) return ReportError(job.status());
  if (json) return job->state() == fsdp8::v1::JOB_STATE_SUCCEEDED ? 0 : 1;
  const std::string summary = SummaryLine(*job, elapsed());
  printf("%s\n", summary.c_str());
  to_log(summary);
  if (job->state() == fsdp8::v1::JOB_STATE_SUCCEEDED) return 0;
  if (!job->reason().empty()) {
    printf("reason: %s\n", job->reason().c_str());
    to_log("reason: " + job->reason());
  }
  fflush(stdout);
  return 1;
}

std::string Ago(double t) {
  if (t <= 0) return "-";
  double now = std::chrono::duration<double>(
                   std::chrono::system_clock::now().time_since_epoch()).count();
  return fsdp8::FormatDuration(now - t) + " ago";
}

// "2 replicas x 4 ranks per shard group, optimizer state over the shard group (4 shards)", or
// "flat (1 replica x 8 ranks), ..." for R = 1.
std::string MeshLine(const fsdp8::Mesh& m) {
  return absl::StrCat(m.Flat() ? "flat (" : "", m.replicas, m.replicas == 1 ? " replica" : " replicas",
                      " x ", m.shard_size, m.shard_size == 1 ? " rank" : " ranks",
                      " per shard group", m.Flat() ? ")" : "", ", optimizer state over the ",
                      m.optimizer_over_world ? "world" : "shard group", " (",
                      m.OptimizerShards(), m.OptimizerShards() == 1 ? " shard)" : " shards)");
}

// A started job's mesh after its world size: " = 2x4" (R x S), "+" appended when the optimizer
// state is sharded over the world; "" for a flat job (R = 1) or one that has not started. A job
// that continued on fewer replicas says how many of its configured replicas are live:
// " = 1x2 replicas x shard group (1 of 2 replicas live)".
std::string JobMeshSuffix(const fsdp8::v1::Job& j) {
  const bool shrunk = j.configured_replicas() > j.replicas() && j.replicas() >= 1;
  if ((j.replicas() <= 1 && !shrunk) || j.world_size() % j.replicas() != 0) return "";
  return absl::StrCat(" = ", j.replicas(), "x", j.world_size() / j.replicas(),
                      j.spec().sharding().optimizer_sharding() == fsdp8::v1::OPTIMIZER_SHARDING_WORLD
                          ? " replicas x shard group, optimizer over the world"
                          : " replicas x shard group",
                      shrunk ? absl::StrCat(" (", j.replicas(), " of ", j.configured_replicas(),
                                            " replicas live)")
                             : "");
}

void PrintJob(const fsdp8::v1::Job& j) {
  printf("job %s  %s\n", j.job_id().c_str(), State(j.state()).c_str());
  if (!j.spec().name().empty()) printf("  name:       %s\n", j.spec().name().c_str());
  if (!j.reason().empty()) printf("  reason:     %s\n", j.reason().c_str());
  printf("  step:       %lld/%lld\n", static_cast<long long>(j.step()),
         static_cast<long long>(j.total_steps()));
  printf("  loss:       %s (train)  %s (val)\n", Num(j.step() > 0 ? j.loss() : NAN).c_str(),
         Num(j.val_loss()).c_str());
  printf("  tokens:     %s\n", Thousands(j.tokens()).c_str());
  if (j.world_size() > 0) {
    std::vector<std::string> ranks;
    for (int r = 0; r < j.worker_ids_size(); ++r)
      ranks.push_back(absl::StrCat(r, "=", j.worker_ids(r)));
    printf("  world size: %d%s (generation %lld; rank=worker %s)\n", j.world_size(),
           JobMeshSuffix(j).c_str(), static_cast<long long>(j.generation()),
           absl::StrJoin(ranks, " ").c_str());
  }
  if (j.restarts() > 0 || j.spec().max_restarts() > 0)
    printf("  restarts:   %d of %d\n", j.restarts(), j.spec().max_restarts());
  const auto& m = j.spec().model();
  printf("  model:      d_model %d, %d layers, %d heads, ffn %d, vocab %d, seq %d\n", m.d_model(),
         m.n_layers(), m.n_heads(), m.ffn_dim(), m.vocab_size(), m.seq_len());
  printf("  data:       %s%s%s\n", j.spec().data().train_path().c_str(),
         j.spec().data().val_path().empty() ? "" : ", val ",
         j.spec().data().val_path().c_str());
  printf("  created:    %s\n", Ago(j.create_time()).c_str());
  if (j.start_time() > 0) printf("  started:    %s\n", Ago(j.start_time()).c_str());
  if (j.end_time() > 0) printf("  ended:      %s\n", Ago(j.end_time()).c_str());
}

// What a command runs with: the command line and, for those that reach the coordinator, its
// address, the channel's security settings and a client.
struct Context {
  Args& a;
  std::string address;
  fsdp8::ChannelSecurity sec;
  fsdp8::Client* client = nullptr;  // set for commands with Needs::kClient
};

// The one positional argument of a command that takes exactly one (JOB, WORKER, ...), or "".
std::string OnlyArg(const Args& a) { return a.positional.size() == 1 ? a.positional[0] : ""; }

// A spec file's fields in their old place (kMovedFields, common/spec.h): one warning line each on
// stderr, naming the new place ("warning: job.yaml: training.gemm_autotune: moved to
// tuning.gemm_autotune (...)"). Fields set in both places with different values are left to the
// coordinator's refusal (or the plan's check) to report.
void PrintMovedFieldWarnings(const std::string& file, const fsdp8::v1::JobSpec& spec) {
  fsdp8::v1::JobSpec moved = spec;
  absl::StatusOr<std::vector<std::string>> warnings = fsdp8::MigrateSpec(&moved);
  if (!warnings.ok()) return;
  for (const std::string& w : *warnings) fprintf(stderr, "warning: %s: %s\n", file.c_str(), w.c_str());
}

// fsdp8 prepare --out DIR [--val-fraction F] FILES...
int RunPrepare(Context& ctx) {
  Args& a = ctx.a;
  if (!a.flags.count("out")) return Usage("prepare: --out DIR is required");
  if (a.positional.empty()) return Usage("prepare: no input files");
  double frac = 0.05;
  if (a.flags.count("val-fraction")) {
    const std::string& v = a.flags["val-fraction"];
    char* end = nullptr;
    frac = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0') return Usage("--val-fraction: not a number");
  }
  auto r = fsdp8::PrepareTokenShards(a.positional, a.flags["out"], frac);
  if (!r.ok()) {
    fprintf(stderr, "error: %s\n", std::string(r.status().message()).c_str());
    return absl::IsInvalidArgument(r.status()) ? 2 : 1;
  }
  printf("read %zu files, %s bytes\n", a.positional.size(),
         Thousands(r->train_tokens + r->val_tokens).c_str());
  printf("%s: %s tokens\n", r->train_path.c_str(), Thousands(r->train_tokens).c_str());
  printf("%s: %s tokens\n", r->val_path.c_str(), Thousands(r->val_tokens).c_str());
  return 0;
}

int RunExport(Context& ctx) { return Export(ctx.a, ctx.address, ctx.sec); }
int RunModelSection(Context& ctx) { return ModelSection(ctx.a); }

// fsdp8 plan SPEC_FILE [--world-size N] [--replicas R] [--json]: each rank's predicted peak device
// memory, broken down (common/memory_plan.h), and the mesh, at N ranks, else at the smallest and
// largest world sizes in the spec's [sharding.min_workers, max_workers] that its
// sharding.replicas divides. Computed here, as the coordinator does: no coordinator is needed.
int RunPlan(Context& ctx) {
  Args& a = ctx.a;
  if (a.positional.size() != 1) return Usage("plan: exactly one SPEC_FILE");
  // Bounded: an oversized file is refused before it is read (common/spec.h).
  auto text = fsdp8::ReadSpecFile(a.positional[0]);
  if (!text.ok()) {
    fprintf(stderr, "error: %s\n", std::string(text.status().message()).c_str());
    return 2;
  }
  auto spec = fsdp8::ParseSpec(*text);
  if (!spec.ok()) {
    fprintf(stderr, "error: %s: %s\n", a.positional[0].c_str(), std::string(spec.status().message()).c_str());
    return 2;
  }
  PrintMovedFieldWarnings(a.positional[0], *spec);
  std::vector<int> worlds;
  if (a.flags.count("world-size")) {
    int n = 0;
    if (!absl::SimpleAtoi(a.flags["world-size"], &n) || n < 1) {
      return Usage(absl::StrCat("--world-size: must be a positive integer (got \"", a.flags["world-size"], "\")"));
    }
    worlds.push_back(n);
  } else {
    auto d = fsdp8::ResolveSpec(*spec, 0, {}, /*check_files=*/false);
    if (!d.ok()) {
      fprintf(stderr, "error: invalid job spec: %s\n", std::string(d.status().message()).c_str());
      return 2;
    }
    // The smallest and largest world sizes of the range that sharding.replicas divides (the
    // coordinator gives a job only those; auto: any).
    auto range = fsdp8::MeshWorldSizeRange(*d);
    if (!range.ok()) {
      fprintf(stderr, "error: invalid job spec: %s\n",
              std::string(range.status().message()).c_str());
      return 2;
    }
    worlds.push_back(range->first);
    if (range->second > range->first) worlds.push_back(range->second);
  }
  // sharding.replicas auto is resolved by the coordinator's placement: planned at --replicas R
  // (default 1), as the coordinator does before a job has started.
  int auto_replicas = 1;
  if (a.flags.count("replicas") &&
      (!absl::SimpleAtoi(a.flags["replicas"], &auto_replicas) || auto_replicas < 1)) {
    return Usage(absl::StrCat("--replicas: must be a positive integer (got \"", a.flags["replicas"],
                              "\")"));
  }
  if (a.flags.count("predict")) {  // the cost model's step time instead of the memory plan
    return fsdp8::PrintStepPrediction(a.positional[0], *spec, worlds,
                                      {a.flags.count("replicas") ? a.flags["replicas"] : "",
                                       a.flags.count("calibration") ? a.flags["calibration"] : "",
                                       a.flags.count("json") > 0});
  }
  for (int n : worlds) {
    fsdp8::v1::JobSpec at = *spec;
    if (at.sharding().has_replicas() && at.sharding().replicas() == 0)
      at.mutable_sharding()->set_replicas(auto_replicas);
    auto d = fsdp8::ResolveSpec(at, n, {}, /*check_files=*/false);
    if (!d.ok()) {
      fprintf(stderr, "error: invalid job spec at world size %d: %s\n", n,
              std::string(d.status().message()).c_str());
      return 2;
    }
    auto mesh = fsdp8::MeshOf(*d, n);
    if (!mesh.ok()) {
      fprintf(stderr, "error: invalid job spec at world size %d: %s\n", n,
              std::string(mesh.status().message()).c_str());
      return 2;
    }
    auto plan = fsdp8::PlanMemory(*d, n);
    if (!plan.ok()) return ReportError(plan.status());
    if (a.flags.count("json")) {
      std::string json;
      google::protobuf::util::JsonPrintOptions jo;
      jo.preserve_proto_field_names = true;
      fsdp8::v1::MemoryPlan out = fsdp8::ToProto(*plan);
      *out.mutable_mesh() = fsdp8::MeshShapeOf(*mesh);
      (void)google::protobuf::util::MessageToJsonString(out, &json, jo);
      printf("%s\n", json.c_str());
      continue;
    }
    printf("memory plan of %s: backend %s, %d rank%s, per rank\n", a.positional[0].c_str(),
           plan->backend.c_str(), n, n == 1 ? "" : "s");
    printf("  mesh: %s\n", MeshLine(*mesh).c_str());
    for (const fsdp8::MemoryTerm& t : plan->terms) {
      printf("  %-22s %12s\n", t.name.c_str(), fsdp8::MemoryBytes(t.bytes).c_str());
    }
    printf("  %-22s %12s   (forward %s, backward %s, optimizer %s)\n",
           absl::StrCat("peak (", plan->peak_phase, ")").c_str(),
           fsdp8::MemoryBytes(plan->peak_bytes).c_str(),
           fsdp8::MemoryBytes(plan->forward_peak_bytes).c_str(),
           fsdp8::MemoryBytes(plan->backward_peak_bytes).c_str(),
           fsdp8::MemoryBytes(plan->optimizer_peak_bytes).c_str());
    for (const fsdp8::MemoryTerm& t : plan->device_extra) {
      printf("  + %-20s %12s\n", t.name.c_str(), fsdp8::MemoryBytes(t.bytes).c_str());
    }
    printf("  %-22s %12s\n", "device total", fsdp8::MemoryBytes(plan->device_bytes).c_str());
    if (plan->exceeds_int64) {
      printf("  (a figure exceeds 64-bit byte counts: no machine holds this job)\n");
    }
  }
  return 0;
}

// WatchJob with the --plot, --log and --tensorboard flags of ctx (the log file is appended to;
// the TensorBoard writer is started before anything is watched).
// Ctrl-C while submit, watch or resume watch a job detaches from it: a line on stderr saying the
// job goes on, then the process dies of the SIGINT (status 130 in a shell). Only async-signal-safe
// calls run in the handler: the line is formatted beforehand.
char g_detach_line[256];
size_t g_detach_len = 0;
void DetachOnInterrupt(const std::string& job_id) {
  const int n = snprintf(g_detach_line, sizeof g_detach_line,
                         "\ndetached: job %s keeps running (fsdp8 watch %s; fsdp8 cancel %s)\n",
                         job_id.c_str(), job_id.c_str(), job_id.c_str());
  g_detach_len = n < 0 ? 0 : std::min<size_t>(n, sizeof g_detach_line - 1);
  signal(SIGINT, [](int) {
    [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, g_detach_line, g_detach_len);
    // Die of the signal, as without the handler: a calling shell script stops too.
    signal(SIGINT, SIG_DFL);
    raise(SIGINT);
  });
}

int WatchWithLog(Context& ctx, const std::string& job_id, bool json) {
  DetachOnInterrupt(job_id);
  FILE* log = nullptr;
  if (ctx.a.flags.count("log")) {
    log = fopen(ctx.a.flags["log"].c_str(), "a");
    if (log == nullptr) {
      fprintf(stderr, "error: --log %s: %s\n", ctx.a.flags["log"].c_str(), std::strerror(errno));
      return 2;
    }
  }
  std::unique_ptr<fsdp8::TensorBoardSink> tensorboard;
  if (ctx.a.flags.count("tensorboard")) {
    auto sink = fsdp8::TensorBoardSink::Start(ctx.a.flags["tensorboard"], job_id);
    if (!sink.ok()) {
      fprintf(stderr, "error: %s\n", std::string(sink.status().message()).c_str());
      if (log != nullptr) fclose(log);
      return 2;
    }
    tensorboard = std::move(*sink);
  }
  const int rc = WatchJob(*ctx.client, job_id, json, ctx.a.flags["plot"], log, tensorboard.get());
  if (log != nullptr) fclose(log);
  return rc;
}

// fsdp8 submit SPEC_FILE [--request-id ID] [--no-watch] [--plot FILE] [--log FILE]
//              [--tensorboard DIR]
int RunSubmit(Context& ctx) {
  Args& a = ctx.a;
  if (a.positional.size() != 1) return Usage("submit: exactly one SPEC_FILE");
  const std::string& file = a.positional[0];
  // Bounded: an oversized file is refused before it is read (common/spec.h).
  auto text = fsdp8::ReadSpecFile(file);
  if (!text.ok()) {
    fprintf(stderr, "error: %s\n", std::string(text.status().message()).c_str());
    return 2;
  }
  auto spec = fsdp8::ParseSpec(*text);
  if (!spec.ok()) {
    fprintf(stderr, "error: %s: %s\n", file.c_str(), std::string(spec.status().message()).c_str());
    return 2;
  }
  // Sent as written: the coordinator moves the fields too, and records the warnings with the job.
  PrintMovedFieldWarnings(file, *spec);
  if (a.flags.count("tensorboard") && !a.flags.count("no-watch")) {
    // Before the job exists: a job is not submitted for a watch that could not write.
    if (absl::Status s = fsdp8::CheckTensorBoardProgram(); !s.ok()) {
      fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  auto job = ctx.client->Submit(*spec, a.flags.count("request-id") ? a.flags["request-id"] : "");
  if (!job.ok()) {
    if (absl::IsInvalidArgument(job.status())) {
      fprintf(stderr, "error: invalid job spec: %s\n", std::string(job.status().message()).c_str());
      return 2;
    }
    return ReportError(job.status());
  }
  printf("%s\n", job->job_id().c_str());
  const std::string& ck = job->spec().checkpoint().dir();
  printf("checkpoints: %s\n",
         ck.empty() ? "none (the spec has no checkpoint.dir)"
                    : absl::StrCat(ck, "/step-<k>/ (fsdp8 checkpoints ", job->job_id(), ")").c_str());
  printf("logs: the coordinator's and the workers' standard error; this job's events: fsdp8 watch "
         "%s%s%s\n",
         job->job_id().c_str(), a.flags.count("log") ? ", and " : "",
         a.flags.count("log") ? a.flags["log"].c_str() : "");
  fflush(stdout);
  if (a.flags.count("no-watch")) return 0;
  return WatchWithLog(ctx, job->job_id(), false);
}

int RunWatch(Context& ctx) {
  const std::string id = OnlyArg(ctx.a);
  if (id.empty()) return Usage("watch: exactly one JOB");
  return WatchWithLog(ctx, id, ctx.a.flags.count("json") > 0);
}

int RunStatus(Context& ctx) {
  const std::string id = OnlyArg(ctx.a);
  if (id.empty()) return Usage("status: exactly one JOB");
  auto job = ctx.client->GetJob(id);
  if (!job.ok()) return ReportError(job.status());
  if (!ctx.a.flags.count("json")) {
    PrintJob(*job);
    return 0;
  }
  std::string json;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(*job, &json, o);
  printf("%s", json.c_str());
  if (json.empty() || json.back() != '\n') printf("\n");
  return 0;
}

// Every job page by page, or with --page-size / --page-token the one page asked for, followed by
// the token of the next one.
int RunList(Context& ctx) {
  const bool one_page = ctx.a.flags.count("page-size") || ctx.a.flags.count("page-token");
  int page_size = 0;
  if (ctx.a.flags.count("page-size") &&
      (!absl::SimpleAtoi(ctx.a.flags["page-size"], &page_size) || page_size < 1))
    return Usage("list: --page-size must be a positive integer");
  const std::string first = ctx.a.flags.count("page-token") ? ctx.a.flags["page-token"] : "";
  std::vector<fsdp8::v1::Job> jobs;
  std::string next;
  if (one_page) {
    auto page = ctx.client->ListJobsPage(page_size, first);
    if (!page.ok()) return ReportError(page.status());
    jobs.assign(page->jobs().begin(), page->jobs().end());
    next = page->next_page_token();
  } else {
    auto all = ctx.client->ListJobs();
    if (!all.ok()) return ReportError(all.status());
    jobs = std::move(*all);
  }
  printf("%-14s %-10s %-11s %-8s %-8s %-16s %s\n", "JOB", "STATE", "STEP", "LOSS", "VAL", "NAME",
         "REASON");
  for (const auto& j : jobs) {
    printf("%-14s %-10s %-11s %-8s %-8s %-16s %s\n", j.job_id().c_str(), State(j.state()).c_str(),
           absl::StrCat(j.step(), "/", j.total_steps()).c_str(),
           Num(j.step() > 0 ? j.loss() : NAN).c_str(), Num(j.val_loss()).c_str(),
           j.spec().name().c_str(), j.reason().c_str());
  }
  if (!next.empty()) printf("next page: --page-token %s\n", next.c_str());
  return 0;
}

int RunDelete(Context& ctx) {
  const std::string id = OnlyArg(ctx.a);
  if (id.empty()) return Usage("delete: exactly one JOB");
  auto job = ctx.client->Delete(id);
  if (!job.ok()) return ReportError(job.status());
  printf("job %s deleted (%s; its checkpoints stay)\n", job->job_id().c_str(),
         State(job->state()).c_str());
  return 0;
}

// fsdp8 cancel JOB [--no-save]: returns once the job has ended (after its save).
int RunCancel(Context& ctx) {
  const std::string id = OnlyArg(ctx.a);
  if (id.empty()) return Usage("cancel: exactly one JOB");
  const bool save = !ctx.a.flags.count("no-save");
  auto job = ctx.client->Cancel(id, save);
  if (!job.ok()) return ReportError(job.status());
  printf("job %s %s%s%s\n", job->job_id().c_str(), State(job->state()).c_str(),
         job->reason().empty() ? "" : ": ", job->reason().c_str());
  return 0;
}

// fsdp8 resume JOB [--no-watch] [--json] [--plot FILE] [--log FILE]: the watch shows the job's
// whole history, from before the resume on.
int RunResume(Context& ctx) {
  const std::string id = OnlyArg(ctx.a);
  if (id.empty()) return Usage("resume: exactly one JOB");
  auto job = ctx.client->Resume(id);
  if (!job.ok()) return ReportError(job.status());
  const bool json = ctx.a.flags.count("json") > 0;
  fprintf(json ? stderr : stdout, "job %s %s: %s\n", job->job_id().c_str(),
          State(job->state()).c_str(), job->reason().c_str());
  fflush(stdout);
  if (ctx.a.flags.count("no-watch")) return 0;
  return WatchWithLog(ctx, id, json);
}

// "IDLE" for WORKER_STATE_IDLE.
std::string WorkerStateName(fsdp8::v1::WorkerState s) {
  std::string n = fsdp8::v1::WorkerState_Name(s);
  return n.rfind("WORKER_STATE_", 0) == 0 ? n.substr(13) : n;
}

int RunWorkers(Context& ctx) {
  auto ws = ctx.client->ListWorkers();
  if (!ws.ok()) return ReportError(ws.status());
  printf("%-8s %-20s %-8s %-6s %-10s %-10s %-14s %-5s %s\n", "WORKER", "HOST", "BACKEND",
         "DEVICE", "MEMORY", "STATE", "JOB", "RANK", "HEARTBEAT");
  for (const auto& w : *ws) {
    printf("%-8s %-20s %-8s %-6d %-10s %-10s %-14s %-5s %s\n", w.worker_id().c_str(),
           w.host().c_str(), w.backend().c_str(), w.device(),
           fsdp8::FormatBytes(w.memory_bytes()).c_str(), WorkerStateName(w.state()).c_str(),
           w.job_id().empty() ? "-" : w.job_id().c_str(),
           w.rank() < 0 ? "-" : absl::StrCat(w.rank()).c_str(), Ago(w.last_heartbeat()).c_str());
  }
  return 0;
}

int RunScaling(Context& ctx) {
  const std::string id = OnlyArg(ctx.a);
  if (id.empty()) return Usage("scaling: exactly one JOB");
  auto st = ctx.client->GetScalingState(id);
  if (!st.ok()) return ReportError(st.status());
  printf("job %s, scaling state after step %lld\n", st->job_id().c_str(),
         static_cast<long long>(st->step()));
  printf("%-36s %-5s %-12s %-12s %s\n", "TENSOR", "FMT", "SCALE", "SCALE_INV",
         "AMAX HISTORY (newest first)");
  for (const auto& t : st->tensors()) {
    std::string hist;
    for (int i = 0; i < t.amax_history_size() && i < 4; ++i) {
      absl::StrAppend(&hist, i ? " " : "", absl::StrFormat("%.4g", t.amax_history(i)));
    }
    if (t.amax_history_size() > 4) absl::StrAppend(&hist, " ... (", t.amax_history_size(), ")");
    printf("%-36s %-5s %-12.6g %-12.6g %s\n", t.name().c_str(), t.format().c_str(), t.scale(),
           t.scale_inv(), hist.c_str());
  }
  return 0;
}

int RunCheckpoint(Context& ctx) {
  const std::string id = OnlyArg(ctx.a);
  if (id.empty()) return Usage("checkpoint: exactly one JOB");
  auto step = ctx.client->TriggerCheckpoint(id);
  if (!step.ok()) return ReportError(step.status());
  printf("job %s: checkpoint will be saved after step %lld\n", id.c_str(),
         static_cast<long long>(*step));
  return 0;
}

int RunCheckpoints(Context& ctx) {
  const std::string id = OnlyArg(ctx.a);
  if (id.empty()) return Usage("checkpoints: exactly one JOB");
  auto cks = ctx.client->ListCheckpoints(id);
  if (!cks.ok()) return ReportError(cks.status());
  fputs(fsdp8::FormatCheckpointTable(*cks).c_str(), stdout);
  return 0;
}

int RunDrain(Context& ctx) {
  const std::string id = OnlyArg(ctx.a);
  if (id.empty()) return Usage("drain: exactly one WORKER");
  auto w = ctx.client->DrainWorker(id, ctx.a.flags.count("undo") > 0);
  if (!w.ok()) return ReportError(w.status());
  printf("worker %s %s\n", w->worker_id().c_str(), WorkerStateName(w->state()).c_str());
  return 0;
}

int RunLogLevel(Context& ctx) {
  const Args& a = ctx.a;
  if (a.positional.size() != 1) return Usage("log-level: exactly one LEVEL");
  auto prev = ctx.client->SetLogLevel(a.positional[0]);
  if (!prev.ok()) return ReportError(prev.status());
  printf("log level %s (was %s)\n", a.positional[0].c_str(), prev->c_str());
  return 0;
}

// ---- fsdp8 run: local mode ----

// The read end gets a byte per SIGINT/SIGTERM while `run` watches its job.
int g_interrupt_pipe[2] = {-1, -1};

extern "C" void OnInterrupt(int) {
  const char c = 'i';
  if (write(g_interrupt_pipe[1], &c, 1) < 0) {
  }
}

// Whether `program` is an executable on the PATH.
bool OnPath(const std::string& program) {
  const char* env = std::getenv("PATH");
  const std::string path = env == nullptr ? "" : env;
  for (const auto& dir : absl::StrSplit(path, ':', absl::SkipEmpty()))
    if (access(absl::StrCat(dir, "/", program).c_str(), X_OK) == 0) return true;
  return false;
}

// Ctrl-C handling of a watched job: the first interrupt cancels it with a save (Cancel returns
// once the job has ended), a second one stops it at once. Lives while the watch does.
class InterruptCanceller {
 public:
  InterruptCanceller(fsdp8::Client* client, std::string job_id)
      : client_(client), job_id_(std::move(job_id)) {
    if (pipe(g_interrupt_pipe) != 0) return;
    struct sigaction sa {};
    sa.sa_handler = OnInterrupt;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
    waiter_ = std::thread([this] { Wait(); });
  }
  ~InterruptCanceller() {
    if (!waiter_.joinable()) return;
    const char q = 'q';
    if (write(g_interrupt_pipe[1], &q, 1) < 0) {
    }
    waiter_.join();
    if (saver_.joinable()) saver_.join();
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    close(g_interrupt_pipe[0]);
    close(g_interrupt_pipe[1]);
  }
  bool interrupted() const { return interrupts_ > 0; }

 private:
  void Wait() {
    char c = 0;
    while (read(g_interrupt_pipe[0], &c, 1) == 1 && c != 'q') {
      if (++interrupts_ == 1) {
        fprintf(stderr, "\ninterrupted: saving a checkpoint after the current step, then stopping "
                        "(Ctrl-C again: stop at once, saving nothing)\n");
        saver_ = std::thread([this] {
          auto job = client_->Cancel(job_id_, /*save=*/true);
          if (!job.ok() && !absl::IsFailedPrecondition(job.status()))
            fprintf(stderr, "cancel: %s\n", std::string(job.status().message()).c_str());
        });
      } else {
        fprintf(stderr, "\ninterrupted again: stopping at once\n");
        client_->Cancel(job_id_, /*save=*/false).IgnoreError();
      }
    }
  }

  fsdp8::Client* client_;
  const std::string job_id_;
  struct sigaction old_int_ {}, old_term_ {};
  std::atomic<int> interrupts_{0};
  std::thread waiter_, saver_;
};

// The job `run` trains: the one submitted from this spec before (same request id, state db), else
// a new one; an ended one is resumed. Returns the exit code on an error, else -1 with *job set.
int LocalJob(fsdp8::Client& c, const fsdp8::v1::JobSpec& spec, const std::string& file,
             const std::string& state_dir, FILE* out, fsdp8::v1::Job* job) {
  auto submitted = c.Submit(spec, "fsdp8-run");
  if (!submitted.ok()) {
    if (absl::IsAlreadyExists(submitted.status())) {
      fprintf(stderr,
              "error: %s changed since its job was submitted (%s); fsdp8 run continues one job "
              "per spec: restore the spec, or start over with another --state-dir (or after "
              "removing %s, which removes its checkpoints too when they are in %s/checkpoints)\n",
              file.c_str(), std::string(submitted.status().message()).c_str(), state_dir.c_str(),
              state_dir.c_str());
      return 2;
    }
    if (absl::IsInvalidArgument(submitted.status())) {
      fprintf(stderr, "error: invalid job spec: %s\n", std::string(submitted.status().message()).c_str());
      return 2;
    }
    return ReportError(submitted.status());
  }
  *job = *submitted;
  const auto st = job->state();
  if (st == fsdp8::v1::JOB_STATE_CANCELLED || st == fsdp8::v1::JOB_STATE_FAILED) {
    fprintf(out, "job %s was %s (%s)\n", job->job_id().c_str(), State(st).c_str(), job->reason().c_str());
    auto resumed = c.Resume(job->job_id());
    if (!resumed.ok()) {
      ReportError(resumed.status());
      fprintf(stderr, "to start over as a new job, use another --state-dir (or remove %s)\n",
              state_dir.c_str());
      return 1;
    }
    *job = *resumed;
    fprintf(out, "job %s resumed: %s\n", job->job_id().c_str(), job->reason().c_str());
  } else if (st == fsdp8::v1::JOB_STATE_SUCCEEDED) {
    fprintf(out, "job %s already SUCCEEDED (%s); to train again, use another --state-dir\n",
           job->job_id().c_str(), job->reason().c_str());
  } else {
    fprintf(out, "job %s %s\n", job->job_id().c_str(), State(st).c_str());
  }
  fflush(out);
  return -1;
}

// fsdp8 run SPEC_FILE [--state-dir DIR] [--threads N] [--plot FILE] [--log FILE] [--json]
//           [--tensorboard DIR]
int RunLocal(Context& ctx) {
  Args& a = ctx.a;
  if (a.positional.size() != 1) return Usage("run: exactly one SPEC_FILE");
  const std::string& file = a.positional[0];
  auto text = fsdp8::ReadSpecFile(file);
  if (!text.ok()) {
    fprintf(stderr, "error: %s\n", std::string(text.status().message()).c_str());
    return 2;
  }
  auto spec = fsdp8::ParseSpec(*text);
  if (!spec.ok()) {
    fprintf(stderr, "error: %s: %s\n", file.c_str(), std::string(spec.status().message()).c_str());
    return 2;
  }
  fsdp8::LocalRunOptions o;
  o.bin_dir = fsdp8::ExecutableDir();
  o.state_dir = a.flags.count("state-dir")
                    ? std::filesystem::absolute(a.flags["state-dir"]).lexically_normal().string()
                    : fsdp8::LocalStateDir(file);
  if (a.flags.count("threads") && (!absl::SimpleAtoi(a.flags["threads"], &o.threads) || o.threads < 1))
    return Usage("run: --threads must be a positive integer");
  if (spec->checkpoint().dir().empty())
    spec->mutable_checkpoint()->set_dir(o.state_dir + "/checkpoints");
  // Checked here as the coordinator checks it at submit (its defaults applied, no world size
  // yet), so a spec it would refuse starts no daemon.
  PrintMovedFieldWarnings(file, *spec);
  auto resolved = fsdp8::ResolveSpec(*spec, 0, {}, /*check_files=*/false);
  if (!resolved.ok()) {
    fprintf(stderr, "error: invalid job spec: %s\n", std::string(resolved.status().message()).c_str());
    return 2;
  }
  const fsdp8::v1::JobSpec& d = *resolved;
  o.backend = d.backend().empty() ? "cpu" : d.backend();
  if (o.backend == "cuda") {
    o.workers = fsdp8::CountGpus();
    if (o.workers == 0) {
      fprintf(stderr, "error: run: backend: cuda, but no GPU is present (no /dev/nvidia<N>)\n");
      return 1;
    }
    if (d.sharding().min_workers() > o.workers) {
      fprintf(stderr,
              "error: %s: sharding.min_workers: %d, but fsdp8 run starts one worker per GPU and "
              "this machine has %d (set sharding.min_workers to at most %d)\n",
              file.c_str(), d.sharding().min_workers(), o.workers, o.workers);
      return 2;
    }
  } else {
    o.workers = std::max(1, d.sharding().min_workers());
  }
  const std::string plot = a.flags.count("plot") ? a.flags["plot"]
                           : OnPath("gnuplot") ? o.state_dir + "/loss.png" : "";
  const std::string log = a.flags.count("log") ? a.flags["log"] : o.state_dir + "/client.log";
  const bool json = a.flags.count("json") > 0;
  FILE* info = json ? stderr : stdout;
  fprintf(info, "fsdp8 run %s: %d %s worker%s; state and logs in %s\n", file.c_str(), o.workers,
          o.backend.c_str(), o.workers == 1 ? "" : "s", o.state_dir.c_str());
  fflush(info);
  auto services = fsdp8::LocalServices::Start(o);
  if (!services.ok()) return ReportError(services.status());
  auto client = fsdp8::Client::Connect((*services)->address());
  if (!client.ok()) return ReportError(client.status());
  fsdp8::v1::Job job;
  // Under --json, stdout holds only the events.
  if (const int rc = LocalJob(**client, *spec, file, o.state_dir, info, &job); rc >= 0) return rc;
  FILE* log_file = fopen(log.c_str(), "a");
  if (log_file == nullptr) {
    fprintf(stderr, "error: --log %s: %s\n", log.c_str(), std::strerror(errno));
    return 2;
  }
  std::unique_ptr<fsdp8::TensorBoardSink> tensorboard;
  if (a.flags.count("tensorboard")) {
    auto sink = fsdp8::TensorBoardSink::Start(a.flags["tensorboard"], job.job_id());
    if (!sink.ok()) {
      fprintf(stderr, "error: %s\n", std::string(sink.status().message()).c_str());
      fclose(log_file);
      return 2;
    }
    tensorboard = std::move(*sink);
  }
  int rc = 0;
  bool interrupted = false;
  {
    InterruptCanceller canceller(client->get(), job.job_id());
    rc = WatchJob(**client, job.job_id(), json, plot, log_file, tensorboard.get());
    interrupted = canceller.interrupted();
  }
  fclose(log_file);
  auto final_job = (*client)->GetJob(job.job_id());
  (*services)->Stop();
  fprintf(info, "logs:        %s (coordinator.log, worker-<i>.log, client.log)\n", o.state_dir.c_str());
  fprintf(info, "checkpoints: %s\n", spec->checkpoint().dir().c_str());
  if (final_job.ok() && final_job->state() == fsdp8::v1::JOB_STATE_SUCCEEDED)
    fprintf(info, "export:      fsdp8 export %s --out DIR (a Hugging Face model of the last one)\n",
            spec->checkpoint().dir().c_str());
  if (final_job.ok() && (final_job->state() == fsdp8::v1::JOB_STATE_CANCELLED ||
                         final_job->state() == fsdp8::v1::JOB_STATE_FAILED))
    fprintf(info, "run `fsdp8 run %s` again to resume job %s from its newest checkpoint\n",
            file.c_str(), job.job_id().c_str());
  if (final_job.ok() && final_job->state() == fsdp8::v1::JOB_STATE_CANCELLED && interrupted)
    return 130;
  return rc;
}

// What a command needs before it runs.
enum class Needs {
  kNothing,   // local work only
  kSecurity,  // the coordinator's address and the channel's security settings
  kClient,    // those and a client (a channel to the coordinator)
};

struct Command {
  const char* name;
  Needs needs;
  int (*run)(Context&);  // returns the exit code
};

constexpr Command kCommands[] = {
    {"prepare", Needs::kNothing, RunPrepare},
    {"export", Needs::kSecurity, RunExport},
    {"model-section", Needs::kNothing, RunModelSection},
    {"plan", Needs::kNothing, RunPlan},
    {"submit", Needs::kClient, RunSubmit},
    {"watch", Needs::kClient, RunWatch},
    {"status", Needs::kClient, RunStatus},
    {"list", Needs::kClient, RunList},
    {"cancel", Needs::kClient, RunCancel},
    {"resume", Needs::kClient, RunResume},
    {"run", Needs::kNothing, RunLocal},
    {"delete", Needs::kClient, RunDelete},
    {"workers", Needs::kClient, RunWorkers},
    {"scaling", Needs::kClient, RunScaling},
    {"checkpoint", Needs::kClient, RunCheckpoint},
    {"checkpoints", Needs::kClient, RunCheckpoints},
    {"drain", Needs::kClient, RunDrain},
    {"log-level", Needs::kClient, RunLogLevel},
};

// The coordinator's address (--coordinator, else $FSDP8_COORDINATOR, else localhost:50051) and
// the channel's security settings (each flag, else its environment variable). Returns 0, or the
// exit code of an unreadable token file.
int ResolveConnection(Context* ctx) {
  Args& a = ctx->a;
  // Flag, else environment variable (common/env_settings.h).
  auto setting = [&](const char* flag, const char* variable) -> std::string {
    if (a.flags.count(flag)) return a.flags[flag];
    return fsdp8::env::GetOrEmpty(variable);
  };
  ctx->address = setting("coordinator", fsdp8::env::kCoordinator);
  if (ctx->address.empty() && !a.flags.count("coordinator")) ctx->address = "localhost:50051";
  fsdp8::ChannelSecurity& sec = ctx->sec;
  sec.tls_ca = setting("tls-ca", fsdp8::env::kTlsCa);
  sec.tls_cert = setting("tls-cert", fsdp8::env::kTlsCert);
  sec.tls_key = setting("tls-key", fsdp8::env::kTlsKey);
  sec.token = setting("token", fsdp8::env::kToken);
  const std::string token_file = setting("token-file", fsdp8::env::kTokenFile);
  if (!token_file.empty() && sec.token.empty()) {
    auto t = fsdp8::ReadTokenFile(token_file);
    if (!t.ok()) return Usage(std::string(t.status().message()));
    sec.token = *t;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (auto args = fsdp8::TokenizerPrepareArgs(argc, argv)) return HandOverPrepare(*args);
  auto parsed = fsdp8::ParseCliArgs(argc, argv);
  if (!parsed.ok()) return Usage(std::string(parsed.status().message()));
  Args& a = *parsed;
  for (const std::string& old : a.deprecated) {
    fprintf(stderr, "warning: --%s is deprecated, use --%s\n", old.c_str(),
            fsdp8::DashedFlagName(old).c_str());
  }
  if (a.flags.count("plot")) {
    absl::Status s = fsdp8::CheckPlotPath(a.flags["plot"]);
    if (!s.ok()) return Usage(std::string(s.message()));
  }
  if (a.flags.count("help") || a.command.empty() || a.command == "help") {
    fputs(kUsage, a.command.empty() && !a.flags.count("help") ? stderr : stdout);
    return a.command.empty() && !a.flags.count("help") ? 2 : 0;
  }
  const Command* cmd = nullptr;
  for (const Command& c : kCommands) {
    if (a.command == c.name) cmd = &c;
  }
  if (cmd == nullptr) return Usage(absl::StrCat("unknown command '", a.command, "'"));
  Context ctx{a, /*address=*/"", /*sec=*/{}};
  if (cmd->needs != Needs::kNothing) {
    if (int rc = ResolveConnection(&ctx); rc != 0) return rc;
  }
  std::unique_ptr<fsdp8::Client> client;
  if (cmd->needs == Needs::kClient) {
    auto c = fsdp8::Client::Connect(ctx.address, ctx.sec);
    if (!c.ok()) return ReportError(c.status());
    client = std::move(*c);
    ctx.client = client.get();
  }
  return cmd->run(ctx);
}
