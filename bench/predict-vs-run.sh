#!/usr/bin/env bash
# The cost model against real runs on CPU ranks: calibrates from the CPU micro-benchmarks
# (bench/calibrate.sh; never from a training run), predicts the default job's step time
# (`fsdp8 plan --predict`) at each rank count of RANKS, runs that job through a local coordinator
# and workers (STEPS steps, the first WARMUP discarded; step time from the job's step events:
# seconds between the events of steps WARMUP and STEPS over their count), and prints predicted
# against measured step time and their ratio, with the host's load average before each run; and
# the workers' CPU seconds over the same steps, per step, divided by min(ranks, cores): what the
# step would take were the cores the ranks' own (a figure other processes on a shared host do not
# inflate; it leaves out waits, so on an idle host it is a lower bound of the wall time).
#
# The job: SPEC (default data/default-job.yaml) with eval_every 0, STEPS steps and
# sharding.min/max_workers = the rank count; its global batch where the rank count (times the
# microbatch) divides it, else its sequences per rank at max_workers times the rank count (the
# default job on 3 ranks: 24). DATA_DIR in the spec is replaced by DATA (default data/fortunes;
# for a spec reading DATA_DIR/tokens.bin without DATA: random tokens of its vocabulary, from
# bench/gpu/benchtool.py).
#
# Usage: bench/predict-vs-run.sh   Environment: RANKS (default "1 2 3"), STEPS (60), WARMUP (10),
# SPEC, DATA, BACKEND (cpu, or cuda: the spec's backend set to cuda, one worker per GPU
# 0..RANKS-1, calibration by BACKEND=cuda bench/calibrate.sh), CALIBRATION (an existing
# calibration file instead of a fresh one), BIN (default build/bin), RECALIBRATE (CPU, default
# 1: right before each run, the shared-host slowdown at that rank count is measured again,
# REPEATS (3) times `fsdp8-bench-cpu-ops --copies N`, and its median over the calibration's
# one-copy CPU time per step, host_step_cpu_s, replaces the file's host_slowdown for that run's
# prediction: the host's available speed as the run will see it; printed as "slowdown"; 0: the
# calibration's table as is).
# Needs build/bin: fsdp8, fsdp8-coordinator, fsdp8-worker, fsdp8-bench-cpu-gemm,
# fsdp8-bench-cpu-ops, fsdp8-bench-cpu-step; the fortunes corpus in data/fortunes (prepared here
# when missing). The ranks share the host's cores; on a machine shared with other work the
# measured times move with its load (printed beside each run).
set -euo pipefail
cd "$(dirname "$0")/.."
ranks_list=${RANKS:-1 2 3}
backend=${BACKEND:-cpu}
spec=${SPEC:-data/default-job.yaml}
steps=${STEPS:-60}
warmup=${WARMUP:-10}
bin=$(cd "${BIN:-build/bin}" && pwd)
[ "$steps" -gt "$warmup" ] || { echo "STEPS must exceed WARMUP ($warmup)" >&2; exit 2; }
tmp=$(mktemp -d)
if [ -n "${DATA:-}" ]; then
  data=$(cd "$DATA" && pwd)
elif grep -q 'DATA_DIR/tokens.bin' "$spec"; then
  data=$tmp/data; mkdir -p "$data"
  python3 bench/gpu/benchtool.py tokens "$data/tokens.bin" \
    "$(python3 -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['model']['vocab_size'])" "$spec")"
else
  data=$PWD/data/fortunes
  [ -f data/fortunes/train.bin ] || scripts/prepare-fortunes.sh "$bin/fsdp8" "$data"
fi
pids=()
stop_daemons() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap 'stop_daemons; rm -rf "$tmp"' EXIT

if [ -n "${CALIBRATION:-}" ]; then
  cal=$CALIBRATION
else
  cal=$tmp/cpu.json
  BACKEND=$backend BIN=$bin bench/calibrate.sh "$cal" > /dev/null
fi
echo "calibration: $cal ($(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['source'])" "$cal"))"

# Runs the job $1 on $2 workers; prints the mean seconds per step after the warmup, wall clock,
# and the workers' CPU seconds over the same steps per step divided by min(ranks, cores): the
# step time the ranks' work would take with the host's cores to themselves.
measure() {
  local job=$1 n=$2 port addr out id wpids=()
  port=$((20000 + RANDOM % 20000)); addr=127.0.0.1:$port
  "$bin/fsdp8-coordinator" --listen "$addr" --state_db "$tmp/db-$n" --data_roots "$data" \
    > "$tmp/coord-$n.log" 2>&1 & pids+=($!)
  for i in $(seq "$n"); do
    dev=(--threads 1)
    [ "$backend" = cuda ] && dev=(--backend cuda --device $((i - 1)))
    "$bin/fsdp8-worker" --coordinator "$addr" "${dev[@]}" --name "pvr-$i" > "$tmp/w$n-$i.log" 2>&1 &
    pids+=($!); wpids+=($!)
  done
  for _ in $(seq 150); do
    [ "$("$bin/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c " $backend ")" -ge "$n" ] && break
    sleep 0.2
  done
  out=$("$bin/fsdp8" --coordinator "$addr" submit --no-watch "$job") || { echo "submit failed: $out" >&2; exit 1; }
  id=$(echo "$out" | head -1)
  python3 - "$warmup" "$n" "$(nproc)" "$bin/fsdp8" "$addr" "$id" "${wpids[@]}" <<'PY' || {
import json, os, subprocess, sys
warmup, n, cores = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cli, addr, job = sys.argv[4:7]
workers = [int(p) for p in sys.argv[7:]]
tck = os.sysconf("SC_CLK_TCK")
def cpu():  # the workers' user + system seconds (every thread)
    total = 0
    for p in workers:
        f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        total += int(f[11]) + int(f[12])
    return total / tck
t, c = {}, {}
w = subprocess.Popen([cli, "--coordinator", addr, "watch", "--json", job], stdout=subprocess.PIPE, text=True)
for line in w.stdout:
    e = json.loads(line)
    if not e.get("message") and int(e.get("step", 0)) > 0:
        s = int(e["step"])
        t[s] = float(e["time"])
        c[s] = cpu()
if w.wait() != 0:
    sys.exit(1)
last = max(t)
steps = last - warmup
print(f"{(t[last] - t[warmup]) / steps:.6f} {(c[last] - c[warmup]) / steps / min(n, cores):.6f}")
PY
    echo "job on $n rank(s) did not succeed; worker log:" >&2; tail -20 "$tmp/w$n-1.log" >&2; exit 1; }
  stop_daemons
}

printf '%-6s %-6s %-8s %-10s %-10s %-8s %-10s %-8s %s\n' ranks batch slowdown pred-ms wall-ms ratio cpu-ms ratio load-before
for n in $ranks_list; do
  job=$tmp/job-$n.yaml
  gb=$(python3 - "$spec" "$job" "$n" "$steps" "$data" "$backend" <<'PY'
import sys, yaml
src, out, n, steps, data, backend = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
s = yaml.safe_load(open(src).read().replace("DATA_DIR", data))
t, sh = s.setdefault("training", {}), s.setdefault("sharding", {})
gb, mb = t.get("global_batch", 16), t.get("microbatch", 1)
if gb % (n * mb):
    gb = gb // max(1, sh.get("max_workers", 1)) * n
t.update(global_batch=gb, steps=steps, eval_every=0)
sh.update(min_workers=n, max_workers=n)
if backend == "cuda":
    s["backend"] = "cuda"
yaml.safe_dump(s, open(out, "w"), sort_keys=False)
print(gb)
PY
)
  runcal=$cal
  if [ "$backend" = cpu ] && [ "${RECALIBRATE:-1}" != 0 ]; then
    # The host's available speed now, as the run will see it: n synchronised copies of the
    # synthetic step, REPEATS times, the median wall time per step over the calibration's one-copy
    # CPU time per step (host_step_cpu_s) replaces host_slowdown for this run.
    runcal=$tmp/cal-$n.json
    : > "$tmp/copies-$n.list"
    for _ in $(seq "${REPEATS:-3}"); do
      OMP_NUM_THREADS=1 "$bin/fsdp8-bench-cpu-ops" --threads 1 --copies "$n" >> "$tmp/copies-$n.list"
    done
    slow=$(python3 - "$cal" "$tmp/copies-$n.list" "$runcal" "$n" <<'PY'
import json, statistics, sys
cal = json.load(open(sys.argv[1]))
walls = [json.loads(l)["wall_s"] for l in open(sys.argv[2]) if l.strip()]
base = cal.get("host_step_cpu_s")
if not base:
    sys.exit(f"{sys.argv[1]}: no host_step_cpu_s (made by an older bench/calibrate.sh); "
             "recalibrate or set RECALIBRATE=0")
f = statistics.median(walls) / base
cal["host_slowdown"] = [[int(sys.argv[4]), round(f, 4)]]
json.dump(cal, open(sys.argv[3], "w"), indent=1)
print(f"{f:.3f}")
PY
)
  else
    slow=-
  fi
  pred=$("$bin/fsdp8" plan "$job" --predict --world-size "$n" --calibration "$runcal" --json |
         python3 -c "import json,sys; print(json.load(sys.stdin)['step_ms'])")
  load=$(cut -d' ' -f1 /proc/loadavg)
  read -r wall cpu < <(measure "$job" "$n")
  python3 -c "
p, m, c = $pred, $wall * 1e3, $cpu * 1e3
print(f'{$n:<6} {$gb:<6} {\"$slow\":<8} {p:<10.1f} {m:<10.1f} {p / m:<8.3f} {c:<10.1f} {p / c:<8.3f} $load')"
done
echo "ratio: predicted / measured. wall-ms: seconds between step events per step; cpu-ms: the"
echo "workers' CPU seconds per step / min(ranks, $(nproc) cores), the step on cores of their own"
echo "(on a shared host the wall figure also counts the time other processes held the cores)."
