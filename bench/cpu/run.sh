#!/usr/bin/env bash
# fsdp8's CPU backend beside PyTorch CPU on the same pinned cores, in one run.
#
# Every process (coordinator, workers, CLI, python) runs under `taskset -c $CORES`. On those cores:
#   fsdp8, FP8 linears and FP32 linears: the default job (data/default-job.yaml: d 128, 4 layers,
#     seq 256, 16 sequences per step) through the real coordinator, workers and CLI, in the layout
#     LAYOUT: "2x1" (2 workers x 1 BLAS thread, the default) or "1x2" (1 worker x 2 threads);
#   PyTorch: the same model in FP32, eager, one process with 2 threads (bench/cpu/torch_reference.py;
#     skipped with a note when python3 has no torch).
# fsdp8's tokens/s are over the steps after the first WARMUP ones (from the job's step events:
# tokens trained / seconds between the events), so process start-up and the first steps' table
# and buffer set-up are left out, as the PyTorch figure leaves out its warm-up steps.
#
# Usage: bench/cpu/run.sh [STEPS]   (default 60 steps per fsdp8 run, 30 timed torch steps)
# Environment: CORES (default 0,1), LAYOUT (2x1 | 1x2), WARMUP (default 10), BIN (the binaries'
# folder, default build/bin; .dev/gpu for the bundle of scripts/gpu-dev.sh build, with
# LD_LIBRARY_PATH=$PWD/.dev/gpu/lib).
# Also prints OpenBLAS's kernel choice ("Core: ..."), the instruction set of oneDNN's kernels (the
# fast backend's GEMMs), the GEMM rates on the model's shapes, the workers' CPU seconds per job
# (tokens per worker-CPU second: below the tokens/s per core, the cores were shared or waited), and
# the same steps in one process without the daemons (fsdp8-bench-cpu-step, ranks as threads).
# Needs build/bin (scripts/build.sh; fsdp8-bench-cpu-gemm and fsdp8-bench-cpu-step too) and the
# fortunes corpus in data/fortunes (prepared here from /usr/share/games/fortunes when missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=${1:-60}
cores=${CORES:-0,1}
layout=${LAYOUT:-2x1}
warmup=${WARMUP:-10}
bin=$(cd "${BIN:-build/bin}" && pwd)
pin=(taskset -c "$cores")
case "$layout" in
  2x1) workers=2; threads=1 ;;
  1x2) workers=1; threads=2 ;;
  *) echo "LAYOUT must be 2x1 or 1x2" >&2; exit 2 ;;
esac
[ "$steps" -gt "$warmup" ] || { echo "STEPS must exceed WARMUP ($warmup)" >&2; exit 2; }
[ -f data/fortunes/train.bin ] || "${pin[@]}" scripts/prepare-fortunes.sh "$bin/fsdp8" "$PWD/data/fortunes"
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
port=$((20000 + RANDOM % 20000)); addr=127.0.0.1:$port
"${pin[@]}" "$bin/fsdp8-coordinator" --listen "$addr" --state_db "$tmp/db" --data_roots "$PWD/data" \
  > "$tmp/coord.log" 2>&1 & pids+=($!)
for i in $(seq "$workers"); do
  "${pin[@]}" "$bin/fsdp8-worker" --coordinator "$addr" --threads "$threads" --name "bench-$i" \
    > "$tmp/w$i.log" 2>&1 & pids+=($!)
done
for _ in $(seq 150); do  # until every worker has registered
  [ "$("${pin[@]}" "$bin/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c ' cpu ')" -ge "$workers" ] && break
  sleep 0.2
done

# CPU seconds (user + system) used so far by the processes $@.
cpu_seconds() {
  local ticks=0 p
  for p in "$@"; do ticks=$((ticks + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done
  python3 -c "print($ticks / $(getconf CLK_TCK))"
}

# Runs the default job with linears $1; prints its steady-state tokens/s; the workers' CPU seconds
# for the whole job go to $tmp/cpu-$1.
fsdp8_run() {
  sed -e "s|DATA_DIR|$PWD/data/fortunes|" -e "s|steps: 600|steps: $steps|" \
      -e "s|min_workers: 2|min_workers: $workers|" -e "s|max_workers: 2|max_workers: $workers|" \
      -e "s|eval_every: 100|eval_every: 0|" -e "s|linears: fp8 |linears: $1 |" \
      data/default-job.yaml > "$tmp/job-$1.yaml"
  local out id c0
  c0=$(cpu_seconds "${pids[@]:1}")
  out=$("${pin[@]}" "$bin/fsdp8" --coordinator "$addr" submit --no-watch "$tmp/job-$1.yaml") || {
    echo "fsdp8 submit ($1 linears) failed: $out" >&2; exit 1; }
  id=$(echo "$out" | head -1)  # submit --no-watch prints the job id first
  "${pin[@]}" "$bin/fsdp8" --coordinator "$addr" watch --json "$id" > "$tmp/events-$1.json" || {
    echo "fsdp8 job ($1 linears) did not succeed; worker log:" >&2; tail -20 "$tmp/w1.log" >&2; exit 1; }
  python3 -c "print(f'{$(cpu_seconds "${pids[@]:1}") - $c0:.1f}')" > "$tmp/cpu-$1"
  python3 - "$warmup" "$tmp/events-$1.json" <<'PY'
import json, sys
warmup, path = int(sys.argv[1]), sys.argv[2]
steps = {}
for line in open(path):
    e = json.loads(line)
    if not e.get("message") and int(e.get("step", 0)) > 0:
        steps[int(e["step"])] = (int(e["tokens"]), float(e["time"]))
last = max(steps)
t0, s0 = steps[warmup]
t1, s1 = steps[last]
print(f"{(t1 - t0) / (s1 - s0):.0f}")
PY
}

echo "cores $cores ($(taskset -c "$cores" nproc) CPUs): $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
# OpenBLAS's kernel choice (the reference backend's GEMMs; the fast one's are oneDNN's) and the
# single-thread GEMM rates on the model's shapes.
OPENBLAS_VERBOSE=2 OMP_NUM_THREADS=1 taskset -c "${cores%%,*}" "$bin/fsdp8-bench-cpu-gemm" --threads 1 2>&1 | sed 's/^/  /'

fp8=$(fsdp8_run fp8)
fp32=$(fsdp8_run fp32)
# PyTorch with its own libraries: LD_LIBRARY_PATH without the fsdp8 bundle's folder (.dev/gpu/lib).
torch_ld=$(echo "${LD_LIBRARY_PATH:-}" | tr ':' '\n' | grep -vE '(^|/)\.dev/gpu/lib/?$' | paste -sd: || true)
torch_line=$("${pin[@]}" env LD_LIBRARY_PATH="$torch_ld" python3 bench/cpu/torch_reference.py --threads 2 2>&1) || torch_line="(no torch: $(echo "$torch_line" | tail -1))"
torch_tps=$(echo "$torch_line" | grep -oE 'tokens/s [0-9]+' | cut -d' ' -f2 || true)
printf '%-58s %10s %8s\n' system tokens/s vs-torch
ratio() { [ -n "$torch_tps" ] && python3 -c "print(f'{$1 / $torch_tps:.2f}')" || echo -; }
printf '%-58s %10s %8s\n' "fsdp8 cpu, $workers worker(s) x $threads thread(s), FP8 linears" "$fp8" "$(ratio "$fp8")"
printf '%-58s %10s %8s\n' "fsdp8 cpu, $workers worker(s) x $threads thread(s), FP32 linears" "$fp32" "$(ratio "$fp32")"
printf '%-58s %10s %8s\n' "PyTorch CPU FP32, 1 process x 2 threads" "${torch_tps:--}" "${torch_tps:+1.00}"
echo "$torch_line"
for l in fp8 fp32; do
  echo "fsdp8 $l job: workers' CPU $(cat "$tmp/cpu-$l") s for $steps steps of 4096 tokens" \
    "($(python3 -c "print(f'{$steps * 4096 / $(cat "$tmp/cpu-$l"):.0f}')") tokens per worker-CPU second, start-up included)"
done
# The same steps without the daemons: ranks as threads of one process over Gloo.
step_line=$("${pin[@]}" "$bin/fsdp8-bench-cpu-step" --spec data/default-job.yaml --data data/fortunes \
  --steps 20 --warmup 3 --world "$workers" --threads "$threads" 2>&1 | grep -E 'tokens/s|per step')
echo "in one process (fsdp8-bench-cpu-step, FP8, $workers rank(s) x $threads thread(s)): $step_line"
