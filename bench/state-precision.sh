#!/usr/bin/env bash
# Convergence with FP32 and with BF16 AdamW moments (optimizer.state_precision): the same job twice,
# through the real coordinator, workers and CLI, then one line per run (steps, final train and
# validation loss, tokens/s, wall time) and the validation losses' relative difference.
#
# Usage (environment):
#   bench/state-precision.sh                                   # the demo's job: the default model
#       on data/fortunes, 600 steps, 2 CPU workers (SPEC=data/default-job.yaml DATA=data/fortunes)
#   SPEC=bench/kernel-docs/125m.yaml DATA=data/kernel-docs BACKEND=cuda WORKERS=1 \
#       bench/state-precision.sh                               # 125m on the kernel docs, one GPU
# SPEC's `state_precision: fp32` line is set to each precision, DATA_DIR in it to DATA, and its
# min/max_workers to WORKERS (default 2 on cpu, else the GPUs nvidia-smi lists). CUDA workers
# serve devices 0..WORKERS-1. Needs a build in BUILD (default ./build; CUDA: FSDP8_CUDA=ON
# scripts/build.sh) and DATA prepared (data/fortunes: scripts/prepare-fortunes.sh;
# data/kernel-docs: bench/kernel-docs/prepare.py). Logs and the progress lines of each run go to
# OUT (default runs/state-precision-<time>). PRECISIONS="fp32 bf16" (default) picks the runs, one
# after the other, or side by side, each on its own coordinator and workers, with PARALLEL=1 (CPU
# only: twice the workers). HEARTBEAT_TIMEOUT_S (default 30) is the coordinators'
# --heartbeat_timeout_s: on a host shared with other load the default 3 s can fail a healthy run.
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC=${SPEC:-data/default-job.yaml}
DATA=$(realpath -m "${DATA:-data/fortunes}")
BACKEND=${BACKEND:-cpu}
if [ "$BACKEND" = cuda ]; then WORKERS=${WORKERS:-$(nvidia-smi -L | wc -l)}; else WORKERS=${WORKERS:-2}; fi
OUT=${OUT:-runs/state-precision-$(date +%Y%m%d-%H%M%S)}
PRECISIONS=${PRECISIONS:-fp32 bf16}
bin=$(realpath "${BUILD:-build}")/bin
grep -q '^  state_precision: fp32' "$SPEC" || { echo "$SPEC: no 'state_precision: fp32' line" >&2; exit 2; }
if [ ! -f "$DATA/train.bin" ]; then
  [ "$DATA" = "$PWD/data/fortunes" ] || { echo "$DATA/train.bin missing" >&2; exit 2; }
  scripts/prepare-fortunes.sh "$bin/fsdp8" "$DATA"
fi
mkdir -p "$OUT"

# One precision on its own coordinator and workers; writes $OUT/status-<p>.json.
run_one() {
  local p=$1 pids=() port addr i dev id
  trap 'for q in "${pids[@]}"; do kill "$q" 2>/dev/null || true; done; wait 2>/dev/null || true' RETURN
  port=$((20000 + RANDOM % 20000)); addr=127.0.0.1:$port
  "$bin/fsdp8-coordinator" --listen "$addr" --state_db "$OUT/jobs-$p.db" \
      --heartbeat_timeout_s "${HEARTBEAT_TIMEOUT_S:-30}" > "$OUT/coordinator-$p.log" 2>&1 &
  pids+=($!)
  for ((i = 0; i < WORKERS; i++)); do
    if [ "$BACKEND" = cuda ]; then dev=(--backend cuda --device "$i"); else dev=(--threads 1); fi
    "$bin/fsdp8-worker" --coordinator "$addr" --host 127.0.0.1 "${dev[@]}" > "$OUT/worker-$p-$i.log" 2>&1 &
    pids+=($!)
  done
  for _ in $(seq 300); do  # until every worker has registered
    [ "$("$bin/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c "^w-")" -ge "$WORKERS" ] && break
    sleep 0.2
  done
  sed -e "s|DATA_DIR|$DATA|" -e "s|^  state_precision: fp32|  state_precision: $p|" \
      -e "s|min_workers: [0-9]*|min_workers: $WORKERS|" -e "s|max_workers: [0-9]*|max_workers: $WORKERS|" \
      "$SPEC" > "$OUT/job-$p.yaml"
  if ! "$bin/fsdp8" --coordinator "$addr" submit "$OUT/job-$p.yaml" --log "$OUT/client-$p.log" \
      > "$OUT/submit-$p.out" 2>&1; then
    echo "$p: the job did not succeed, see $OUT/client-$p.log" >&2
    return 1
  fi
  id=$(head -1 "$OUT/submit-$p.out" | grep -oE '[A-Za-z0-9_-]{6,}' | head -1)
  "$bin/fsdp8" --coordinator "$addr" status --json "$id" > "$OUT/status-$p.json"
}

if [ "${PARALLEL:-0}" = 1 ]; then
  jobs_=()
  for p in $PRECISIONS; do run_one "$p" & jobs_+=($!); done
  for j in "${jobs_[@]}"; do wait "$j"; done
else
  for p in $PRECISIONS; do run_one "$p"; done
fi
printf '%-16s %6s %11s %9s %9s %8s\n' state_precision steps train_loss val_loss tokens/s wall_s
for p in $PRECISIONS; do
  python3 - "$p" "$OUT/status-$p.json" <<'PY'
import json, sys
p, j = sys.argv[1], json.load(open(sys.argv[2]))
wall = float(j["end_time"]) - float(j["start_time"])
print(f"{p:<16} {int(j['step']):>6} {float(j['loss']):>11.4f} {float(j['val_loss']):>9.4f} "
      f"{float(j['tokens']) / wall:>9.0f} {wall:>8.1f}")
PY
done
if [ -f "$OUT/status-fp32.json" ] && [ -f "$OUT/status-bf16.json" ]; then
  python3 - "$OUT/status-fp32.json" "$OUT/status-bf16.json" <<'PY'
import json, sys
a, b = (float(json.load(open(f))["val_loss"]) for f in sys.argv[1:])
print(f"validation loss, bf16 moments vs fp32: {100 * (b - a) / a:+.2f}%")
PY
fi
echo "logs: $OUT"
