#!/usr/bin/env bash
# A job that exhausts device memory fails, and does not take its workers with it.
#
# Starts a coordinator and one CUDA worker per GPU present (W workers; NCCL allows one rank per
# device in a communicator), then:
#   1. submits a job far too large for the devices (d_model 2048, seq_len 4096, 256 sequences per
#      rank on W ranks): it must end FAILED with RESOURCE_EXHAUSTED in its status message, and
#      every worker must be registered and IDLE afterwards;
#   2. submits a small job (the default model on the CUDA backend, 20 steps) on the same W workers:
#      it must end SUCCEEDED.
# Prints each check as it goes; exit status 0 when all hold, 1 otherwise.
#
# usage: tests/gpu/oom_check.sh [BIN_DIR]   (default .dev/gpu, else build/bin)
#   OUT_DIR (default runs/oom-check-<time>) keeps the logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
BIN=${1:-}
if [ -z "$BIN" ]; then
  if [ -x "$root/.dev/gpu/fsdp8-worker" ]; then BIN=$root/.dev/gpu; else BIN=$root/build/bin; fi
fi
OUT_DIR=${OUT_DIR:-$root/runs/oom-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[ "$ngpu" -ge 1 ] || { echo "oom_check: no GPU (nvidia-smi -L lists none)"; exit 1; }
W=$ngpu

data=$OUT_DIR/data
mkdir -p "$data"
python3 bench/gpu/benchtool.py tokens "$data/tokens.bin" 256 --tokens 4000000 >/dev/null \
  || { echo "oom_check: could not write $data/tokens.bin"; exit 1; }

port=$((20000 + RANDOM % 20000))
addr=127.0.0.1:$port
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
"$BIN/fsdp8-coordinator" --listen "$addr" --state_db "$OUT_DIR/jobs.db" --data_roots "$data" \
  > "$OUT_DIR/coordinator.log" 2>&1 & pids+=($!)
sleep 1
for ((w = 0; w < W; w++)); do
  "$BIN/fsdp8-worker" --coordinator "$addr" --host 127.0.0.1 --backend cuda --device $w \
    > "$OUT_DIR/worker-$w.log" 2>&1 & pids+=($!)
done
cli() { "$BIN/fsdp8" --coordinator "$addr" "$@"; }
for _ in $(seq 150); do
  [ "$(cli workers 2>/dev/null | grep -c '^w-')" -ge "$W" ] && break
  sleep 0.2
done

spec() {  # d_model seq_len microbatch steps
  cat <<EOF
name: oom-check
backend: cuda
model: {d_model: $1, n_layers: 4, n_heads: 16, ffn_dim: $(($1 * 8 / 3 / 64 * 64)), vocab_size: 256, seq_len: $2}
data: {train_path: $data/tokens.bin}
training: {steps: $4, global_batch: $(($3 * W)), microbatch: $3, eval_every: 0}
sharding: {min_workers: $W, max_workers: $W}
checkpoint: {every_steps: 0}
max_restarts: 2
EOF
}
fail=0
check() { if eval "$2"; then echo "PASS $1"; else echo "FAIL $1"; fail=1; fi; }

spec 2048 4096 256 5 > "$OUT_DIR/big.yaml"
id=$(cli submit --no-watch "$OUT_DIR/big.yaml" 2> "$OUT_DIR/big.submit.log" | head -1)
t0=$(date +%s.%N)
timeout 300 "$BIN/fsdp8" --coordinator "$addr" watch --json "$id" > "$OUT_DIR/big.events.jsonl"
cli status "$id" > "$OUT_DIR/big.status.txt" 2>&1
echo "big job $id ended after $(python3 -c "import sys; print(round($(date +%s.%N) - $t0, 1))") s: $(tr '\n' ' ' < "$OUT_DIR/big.status.txt" | cut -c1-400)"
check "the oversized job FAILED" "grep -q FAILED '$OUT_DIR/big.status.txt'"
check "its cause is RESOURCE_EXHAUSTED" "grep -q RESOURCE_EXHAUSTED '$OUT_DIR/big.status.txt'"
sleep 1
cli workers > "$OUT_DIR/workers-after.txt" 2>&1
cat "$OUT_DIR/workers-after.txt"
check "all $W workers still registered" "[ \$(grep -c '^w-' '$OUT_DIR/workers-after.txt') -eq $W ]"
check "all $W workers IDLE" "[ \$(grep '^w-' '$OUT_DIR/workers-after.txt' | grep -c IDLE) -eq $W ]"
check "no worker process died" "for p in ${pids[*]}; do kill -0 \$p || exit 1; done"

spec 128 256 8 20 > "$OUT_DIR/small.yaml"
id=$(cli submit --no-watch "$OUT_DIR/small.yaml" 2> "$OUT_DIR/small.submit.log" | head -1)
timeout 300 "$BIN/fsdp8" --coordinator "$addr" watch --json "$id" > "$OUT_DIR/small.events.jsonl"
cli status "$id" > "$OUT_DIR/small.status.txt" 2>&1
check "the next job on the same workers SUCCEEDED" "grep -q SUCCEEDED '$OUT_DIR/small.status.txt'"
exit $fail
