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
# The job: data/default-job.yaml with eval_every 0 and STEPS steps; global_batch 16 where the
# rank count divides it (1, 2, 4 ranks), else 8 sequences per rank (3 ranks: 24).
#
# Usage: bench/predict-vs-run.sh   Environment: RANKS (default "1 2 3"), STEPS (60), WARMUP (10),
# CALIBRATION (an existing calibration file instead of a fresh one), BIN (default build/bin).
# Needs build/bin: fsdp8, fsdp8-coordinator, fsdp8-worker, fsdp8-bench-cpu-gemm,
# fsdp8-bench-cpu-ops, fsdp8-bench-cpu-step; the fortunes corpus in data/fortunes (prepared here
# when missing). The ranks share the host's cores; on a machine shared with other work the
# measured times move with its load (printed beside each run).
set -euo pipefail
cd "$(dirname "$0")/.."
ranks_list=${RANKS:-1 2 3}
steps=${STEPS:-60}
warmup=${WARMUP:-10}
bin=$(cd "${BIN:-build/bin}" && pwd)
[ "$steps" -gt "$warmup" ] || { echo "STEPS must exceed WARMUP ($warmup)" >&2; exit 2; }
[ -f data/fortunes/train.bin ] || scripts/prepare-fortunes.sh "$bin/fsdp8" "$PWD/data/fortunes"
tmp=$(mktemp -d)
pids=()
stop_daemons() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap 'stop_daemons; rm -rf "$tmp"' EXIT

if [ -n "${CALIBRATION:-}" ]; then
  cal=$CALIBRATION
else
  cal=$tmp/cpu.json
  BIN=$bin bench/calibrate.sh "$cal" > /dev/null
fi
echo "calibration: $cal ($(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['source'])" "$cal"))"

# Runs the job $1 on $2 workers; prints the mean seconds per step after the warmup, wall clock,
# and the workers' CPU seconds over the same steps per step divided by min(ranks, cores): the
# step time the ranks' work would take with the host's cores to themselves.
measure() {
  local job=$1 n=$2 port addr out id wpids=()
  port=$((20000 + RANDOM % 20000)); addr=127.0.0.1:$port
  "$bin/fsdp8-coordinator" --listen "$addr" --state_db "$tmp/db-$n" --data_roots "$PWD/data" \
    > "$tmp/coord-$n.log" 2>&1 & pids+=($!)
  for i in $(seq "$n"); do
    "$bin/fsdp8-worker" --coordinator "$addr" --threads 1 --name "pvr-$i" > "$tmp/w$n-$i.log" 2>&1 &
    pids+=($!); wpids+=($!)
  done
  for _ in $(seq 150); do
    [ "$("$bin/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c ' cpu ')" -ge "$n" ] && break
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

printf '%-6s %-6s %-10s %-10s %-8s %-10s %-8s %s\n' ranks batch pred-ms wall-ms ratio cpu-ms ratio load-before
for n in $ranks_list; do
  gb=16
  [ $((16 % n)) -eq 0 ] || gb=$((8 * n))
  job=$tmp/job-$n.yaml
  sed -e "s|DATA_DIR|$PWD/data/fortunes|" -e "s|steps: 600|steps: $steps|" \
      -e "s|global_batch: 16|global_batch: $gb|" -e "s|eval_every: 100|eval_every: 0|" \
      -e "s|min_workers: 2|min_workers: $n|" -e "s|max_workers: 2|max_workers: $n|" \
      data/default-job.yaml > "$job"
  pred=$("$bin/fsdp8" plan "$job" --predict --world-size "$n" --calibration "$cal" --json |
         python3 -c "import json,sys; print(json.load(sys.stdin)['step_ms'])")
  load=$(cut -d' ' -f1 /proc/loadavg)
  read -r wall cpu < <(measure "$job" "$n")
  python3 -c "
p, m, c = $pred, $wall * 1e3, $cpu * 1e3
print(f'{$n:<6} {$gb:<6} {p:<10.1f} {m:<10.1f} {p / m:<8.3f} {c:<10.1f} {p / c:<8.3f} $load')"
done
echo "ratio: predicted / measured. wall-ms: seconds between step events per step; cpu-ms: the"
echo "workers' CPU seconds per step / min(ranks, $(nproc) cores), the step on cores of their own"
echo "(on a shared host the wall figure also counts the time other processes held the cores)."
