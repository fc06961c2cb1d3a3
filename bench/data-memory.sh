#!/usr/bin/env bash
# A worker's anonymous resident memory does not grow with the dataset: the same job (a small model,
# 200 steps, one CPU worker) on a 1-million-token dataset and on a dataset of SHARDS uint32 shards
# holding TOKENS tokens (default 4 shards, 1,000,000,000 tokens: 4 GB), sampled with the default
# epoch mode. Prints the worker's largest RssAnon and RssFile (/proc/PID/status, polled every
# 0.2 s while the job runs) for each, and their difference.
#
#   bench/data-memory.sh                     # uses build/bin; data under runs/data-memory
# Options (environment): BIN, OUT_DIR, TOKENS, SHARDS, STEPS (200).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
BIN=${BIN:-$root/build/bin}
OUT_DIR=${OUT_DIR:-$root/runs/data-memory}
TOKENS=${TOKENS:-1000000000}
SHARDS=${SHARDS:-4}
STEPS=${STEPS:-200}
mkdir -p "$OUT_DIR/small" "$OUT_DIR/large"

# Random byte-valued tokens in the uint32 format (magic 20240801, version 7), written in chunks.
write_shards() {  # dir shards tokens_total
  python3 - "$@" <<'PY'
import os, sys, numpy as np
d, shards, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(7)
per = total // shards
for s in range(shards):
    n = per if s < shards - 1 else total - per * (shards - 1)
    path = os.path.join(d, f"train_{s:03d}.bin")
    if os.path.exists(path) and os.path.getsize(path) == 1024 + 4 * n:
        continue
    hdr = np.zeros(256, dtype=np.int32); hdr[0] = 20240801; hdr[1] = 7; hdr[2] = n
    with open(path + ".tmp", "wb") as f:
        f.write(hdr.tobytes())
        for i in range(0, n, 1 << 26):
            f.write(rng.integers(0, 256, size=min(1 << 26, n - i), dtype=np.uint32).tobytes())
    os.replace(path + ".tmp", path)
PY
}
write_shards "$OUT_DIR/small" 1 1000000
write_shards "$OUT_DIR/large" "$SHARDS" "$TOKENS"

port=$((30000 + RANDOM % 20000)); addr=127.0.0.1:$port
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
"$BIN/fsdp8-coordinator" --listen "$addr" --state_db "$OUT_DIR/coordinator.db" \
  --data_roots "$OUT_DIR" > "$OUT_DIR/coordinator.log" 2>&1 & pids+=($!)

# A fresh worker for each job, so that neither inherits the other's heap.
run_job() {  # name data_dir -> prints "max_rss_anon_kb max_rss_file_kb"
  "$BIN/fsdp8-worker" --coordinator "$addr" --host 127.0.0.1 --threads 1 --name "mem-$1" \
    > "$OUT_DIR/worker-$1.log" 2>&1 &
  local wpid=$!
  for _ in $(seq 150); do
    "$BIN/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -q "mem-$1 .*IDLE" && break
    sleep 0.2
  done
  cat > "$OUT_DIR/$1.yaml" <<YAML
name: data-memory-$1
backend: cpu
model: {d_model: 64, n_layers: 2, n_heads: 2, ffn_dim: 192, vocab_size: 256, seq_len: 256}
data: {train_path: $2}
training: {steps: $STEPS, global_batch: 16, eval_every: 0}
sharding: {min_workers: 1, max_workers: 1}
YAML
  local id
  id=$("$BIN/fsdp8" --coordinator "$addr" submit --no-watch "$OUT_DIR/$1.yaml" | head -1)
  "$BIN/fsdp8" --coordinator "$addr" watch --json "$id" > "$OUT_DIR/$1.events.jsonl" &
  local watch=$! anon=0 file=0 a f
  while kill -0 "$watch" 2>/dev/null; do
    a=$(awk '/^RssAnon/ {print $2}' "/proc/$wpid/status"); f=$(awk '/^RssFile/ {print $2}' "/proc/$wpid/status")
    [ "$a" -gt "$anon" ] && anon=$a
    [ "$f" -gt "$file" ] && file=$f
    sleep 0.2
  done
  grep -q '"JOB_STATE_SUCCEEDED"' "$OUT_DIR/$1.events.jsonl" || { echo "job $1 did not succeed" >&2; tail -3 "$OUT_DIR/$1.events.jsonl" >&2; exit 1; }
  kill "$wpid"; wait "$wpid" 2>/dev/null || true
  echo "$anon $file"
}
read -r small_anon small_file < <(run_job small "$OUT_DIR/small")
read -r large_anon large_file < <(run_job large "$OUT_DIR/large")
printf '| dataset | shards | tokens | worker max RssAnon | worker max RssFile |\n|---|---|---|---|---|\n'
printf '| small | 1 | 1,000,000 | %.1f MB | %.1f MB |\n' "$(echo "$small_anon/1024" | bc -l)" "$(echo "$small_file/1024" | bc -l)"
printf '| large | %d | %d | %.1f MB | %.1f MB |\n' "$SHARDS" "$TOKENS" "$(echo "$large_anon/1024" | bc -l)" "$(echo "$large_file/1024" | bc -l)"
printf 'RssAnon difference (large - small): %.1f MB\n' "$(echo "($large_anon-$small_anon)/1024" | bc -l)"
