#!/usr/bin/env bash
# Peak resident memory (VmHWM of /proc/PID/status) of each of 3 CPU workers for a job that starts
# from a 1.08 GB sharded Hugging Face checkpoint (init.from_hf: 6 float32 safetensors shards and
# model.safetensors.index.json, make_weights.py's memory_1g: d 1024, 16 layers, vocab 32000,
# 270 M parameters), against the same job started from random weights. Each run uses fresh worker
# processes and one training step (1 sequence of 16 tokens per rank, default precision plan).
# The import reads only each rank's own byte ranges, a few MiB at a time, so the two peaks should
# differ by far less than the checkpoint's size (target: < 10% of it).
# Usage: bench/hf_import_memory.sh. Needs a build in ./build (fsdp8, fsdp8-coordinator,
# fsdp8-worker), python3 with numpy and safetensors, ~5 GB of free memory and ~1.1 GB of disk.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$PWD/build/bin
mkdir -p data
tmp=$(mktemp -d "$PWD/data/bench-hfmem.XXXXXX")  # under the data root
pids=()
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap 'stop_all; rm -rf "$tmp"' EXIT
python3 tests/hf_reference/make_weights.py "$tmp" --variant memory_1g > /dev/null
hf=$tmp/memory_1g
ckpt_bytes=$(cat "$hf"/model-*.safetensors | wc -c)
shards=$(ls "$hf"/model-*.safetensors | wc -l)
"$bin/fsdp8" prepare --out "$tmp/corpus" /usr/share/common-licenses/* > /dev/null
{
  echo "name: hf-import-memory"
  "$bin/fsdp8" model-section "$hf" --seq-len 16
  printf 'data:\n  train_path: %s/corpus/train.bin\n' "$tmp"
  printf 'training:\n  steps: 1\n  global_batch: 3\n  microbatch: 1\n  eval_every: 0\n'
  printf 'sharding:\n  min_workers: 3\n  max_workers: 3\n'
  printf 'backend: cpu\n'
} > "$tmp/random.yaml"
cp "$tmp/random.yaml" "$tmp/import.yaml"
printf 'init:\n  from_hf: %s\n' "$hf" >> "$tmp/import.yaml"

# run NAME: a coordinator and 3 fresh workers, the job NAME.yaml to its end; prints each worker's
# VmHWM in MiB.
run() {
  local port=$((20000 + RANDOM % 20000)) log=$tmp/$1
  local addr=127.0.0.1:$port
  mkdir -p "$log"
  "$bin/fsdp8-coordinator" --listen "$addr" --state_db "$log/db" --data_roots "$PWD/data" \
    > "$log/coord.log" 2>&1 & pids+=($!)
  local w=()
  for i in 0 1 2; do
    "$bin/fsdp8-worker" --coordinator "$addr" --threads 1 --name "mem-$i" > "$log/w$i.log" 2>&1 &
    pids+=($!); w+=($!)
  done
  for _ in $(seq 300); do
    [ "$("$bin/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c ' cpu ')" -ge 3 ] && break
    sleep 0.2
  done
  "$bin/fsdp8" --coordinator "$addr" submit "$tmp/$1.yaml" > "$log/client.log" 2>&1 ||
    { echo "$1: the job failed:" >&2; tail -20 "$log/client.log" "$log"/w*.log >&2; exit 1; }
  local out=""
  for p in "${w[@]}"; do
    out+="$(awk '/VmHWM/ {printf "%.0f", $2 / 1024}' "/proc/$p/status") "
  done
  stop_all
  echo "$out"
}
random=$(run random)
import=$(run import)
echo "checkpoint: $((ckpt_bytes / 1048576)) MiB in $shards shards (memory_1g, float32)"
echo "VmHWM per worker, MiB: random weights: $random; from the checkpoint: $import"
read -r -a r <<< "$random"; read -r -a m <<< "$import"
worst=0
for i in 0 1 2; do
  d=$((m[i] - r[i])); [ "$d" -gt "$worst" ] && worst=$d
done
echo "largest excess of an importing worker: $worst MiB = $(python3 -c \
  "print('%.1f' % (100 * $worst * 1048576 / $ckpt_bytes))")% of the checkpoint (target < 10%)"
