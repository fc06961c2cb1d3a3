#!/usr/bin/env bash
# Per-step losses of fixed-bits runs on the GPUs present, to check that a change keeps the step's
# arithmetic bit for bit (run it with the old and the new binaries on the same card model):
#   default   data/default-job.yaml on the fortunes shards (FORTUNES: a folder with train.bin and
#             val.bin, from scripts/prepare-fortunes.sh), backend cuda, world size = the GPUs present,
#             its 600 steps (DEFAULT_STEPS)
#   l3proxy   bench/presets/l3proxy.yaml's first 10 steps (L3_STEPS) on random tokens
# both with training.gemm_autotune false and training.deterministic true.
# Writes OUT_DIR/losses.json: {"default": {"STEP": {"loss": L, "grad_norm": G}, ...}, "l3proxy": ...}
# from the jobs' step events (`fsdp8 watch --json`), and OUT_DIR/step_seconds.json beside it.
#   BIN=.dev/gpu FORTUNES=.dev/fortunes OUT_DIR=runs/same-bits bench/gpu/same-bits.sh
#   python3 bench/gpu/same_bits.py A/losses.json B/losses.json      # first differing step, if any
# JOBS: which of the two to run (default "default l3proxy"); BACKEND=cpu with NGPUS=K runs them on K
# CPU workers instead (a check of this script without a GPU). OVERLAP_OPTIMIZER=true|false sets
# training.overlap_optimizer in both jobs (default: the spec's default, true); the two orders give
# the same bits.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
BIN=${BIN:-$root/.dev/gpu}
OUT_DIR=${OUT_DIR:-$root/runs/same-bits-$(date +%Y%m%d-%H%M%S)}
FORTUNES=${FORTUNES:-$root/.dev/fortunes}
mkdir -p "$OUT_DIR"
N=${NGPUS:-$(nvidia-smi -L | grep -c '^GPU')}
BACKEND=${BACKEND:-cuda}
JOBS=${JOBS:-default l3proxy}
export NCCL_NVLS_ENABLE=0
fixed="training.gemm_autotune=false training.deterministic=true${OVERLAP_OPTIMIZER:+ training.overlap_optimizer=$OVERLAP_OPTIMIZER}"

pids=()
start() {
  local port=$((20000 + RANDOM % 20000)) d
  addr=127.0.0.1:$port
  "$BIN/fsdp8-coordinator" --listen "$addr" --state_db "$OUT_DIR/coordinator.db" --start_timeout_s 900 \
    --data_roots "$FORTUNES,$OUT_DIR" > "$OUT_DIR/coordinator.log" 2>&1 & pids+=($!)
  sleep 1
  for ((d = 0; d < N; d++)); do
    "$BIN/fsdp8-worker" --coordinator "$addr" --host 127.0.0.1 --backend "$BACKEND" $([ "$BACKEND" = cuda ] && echo --device "$d") \
      > "$OUT_DIR/worker-$d.log" 2>&1 & pids+=($!)
  done
  for _ in $(seq 150); do
    [ "$("$BIN/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c '^w-')" -ge "$N" ] && return 0
    sleep 0.2
  done
  echo "same-bits: fewer than $N workers after 30 s"
}
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }
trap stop EXIT

job() {  # name spec
  local id
  id=$("$BIN/fsdp8" --coordinator "$addr" submit --no-watch "$2" 2> "$OUT_DIR/$1.submit.log" | head -1)
  timeout 1200 "$BIN/fsdp8" --coordinator "$addr" watch --json "$id" > "$OUT_DIR/$1.events.jsonl"
  echo "same-bits: $1 watch rc $? ($(grep -c '"step"' "$OUT_DIR/$1.events.jsonl") step events)"
}

# The default job on CUDA: backend, world size and data paths replaced, then the fixed-bits fields.
sed -e "s|^backend: cpu|backend: $BACKEND|" -e "s|DATA_DIR|$FORTUNES|" \
    -e "s|^  min_workers: .*|  min_workers: $N|" -e "s|^  max_workers: .*|  max_workers: $N|" \
    -e "s|^  steps: 600|  steps: ${DEFAULT_STEPS:-600}|" \
    -e "s|^training:|training:\n  gemm_autotune: false\n  deterministic: true${OVERLAP_OPTIMIZER:+\n  overlap_optimizer: $OVERLAP_OPTIMIZER}|" \
    data/default-job.yaml > "$OUT_DIR/default.yaml"
if [[ " $JOBS " == *" l3proxy "* ]]; then
  python3 bench/gpu/benchtool.py tokens "$OUT_DIR/tokens-128256.bin" 128256
  python3 bench/gpu/benchtool.py spec l3proxy --world "$N" --steps "${L3_STEPS:-10}" --vocab 128256 \
  --data "$OUT_DIR/tokens-128256.bin" $(for s in $fixed; do echo --set "$s"; done) > "$OUT_DIR/l3proxy.yaml"
fi
start
for j in $JOBS; do job "$j" "$OUT_DIR/$j.yaml"; done
stop
python3 - "$OUT_DIR" "$JOBS" <<'PY'
import json, sys, os, statistics
out = sys.argv[1]
losses, speed = {}, {}
for name in sys.argv[2].split():
    evs = [json.loads(l) for l in open(os.path.join(out, name + ".events.jsonl")) if l.startswith("{")]
    steps = [e for e in evs if not e.get("message") and "loss" in e]
    losses[name] = {str(e["step"]): {"loss": e["loss"], "grad_norm": e.get("grad_norm")} for e in steps}
    ts = [float(e["step_seconds"]) for e in steps[3:] if e.get("step_seconds")]
    if ts:
        speed[name] = {"median_step_s": statistics.median(ts), "steps": len(ts)}
json.dump(losses, open(os.path.join(out, "losses.json"), "w"), indent=1, sort_keys=True)
json.dump(speed, open(os.path.join(out, "step_seconds.json"), "w"), indent=1)
for n, v in losses.items():
    last = max(v, key=int) if v else None
    print(f"{n}: {len(v)} steps, last step {last} loss {v[last]['loss'] if last else '-'}; {speed.get(n)}")
PY
