#!/usr/bin/env bash
# Training throughput of the default model on the CPU backend with 1 and 2 workers, through the real
# coordinator, workers and CLI. Prints tokens/s (job tokens / (end_time - start_time), which excludes
# process start-up but includes every step's collectives and RPCs).
# Usage: bench/train-throughput.sh [STEPS] (default 40). Needs a build in ./build and the prepared
# corpus in data/fortunes (scripts/demo.sh makes both).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-40}
bin=$PWD/build/bin
[ -f data/fortunes/train.bin ] || scripts/prepare-fortunes.sh "$bin/fsdp8" "$PWD/data/fortunes"
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
port=$((20000 + RANDOM % 20000)); addr=127.0.0.1:$port
"$bin/fsdp8-coordinator" --listen "$addr" --state_db "$tmp/db" > "$tmp/coord.log" 2>&1 & pids+=($!)
for i in 0 1; do "$bin/fsdp8-worker" --coordinator "$addr" --threads 1 > "$tmp/w$i.log" 2>&1 & pids+=($!); done
for _ in $(seq 100); do  # wait until both workers are registered
  [ "$("$bin/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c '^w-')" -ge 2 ] && break
  sleep 0.2
done
printf '%-8s %-12s %-10s\n' workers tokens/s s/step
for n in 1 2; do
  sed -e "s|DATA_DIR|$PWD/data/fortunes|" -e "s|steps: 600|steps: $steps|" \
      -e "s|min_workers: 2|min_workers: $n|" -e "s|max_workers: 2|max_workers: $n|" \
      -e "s|eval_every: 100|eval_every: 0|" data/default-job.yaml > "$tmp/job$n.yaml"
  out=$("$bin/fsdp8" --coordinator "$addr" submit --no-watch "$tmp/job$n.yaml")
  id=$(echo "$out" | grep -oE '[A-Za-z0-9_-]{6,}' | head -1)
  "$bin/fsdp8" --coordinator "$addr" watch "$id" > /dev/null
  python3 - "$n" "$steps" <<PY "$("$bin/fsdp8" --coordinator "$addr" status --json "$id")"
import json, sys
n, steps, j = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
dt = float(j["end_time"]) - float(j["start_time"])
print(f"{n:<8} {float(j['tokens'])/dt:<12.0f} {dt/steps:<10.3f}")
PY
done
