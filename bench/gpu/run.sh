#!/usr/bin/env bash
# fsdp8 against PyTorch FSDP2 on the same GPUs, in one go; prints one table.
#
# On a GPU host with 2 GPUs, PyTorch (torchrun) and the fsdp8 binaries (a build with CUDA, or the
# bundle of scripts/gpu-dev.sh build unpacked in .dev/gpu):
#   bench/gpu/run.sh                 # presets 125m and 1b
#   PRESETS=1b bench/gpu/run.sh      # one preset
# Options (environment): BIN (fsdp8 binaries; default .dev/gpu, else build/bin), OUT_DIR (logs;
# default runs/bench-<time>), PRESETS, SKIP_TORCH=1, SKIP_FSDP8=1, STEPS (timed steps, 12),
# WARMUP (4), MODES (fsdp8 modes, "driven free"), TORCH_PRECISIONS ("bf16 fp8"),
# SKIP_WARMUP_JOB=1 (no discarded first fsdp8 job).
#
# For each preset it runs:
#   * PyTorch FSDP2 BF16 and FP8 (bench/gpu/fsdp2_reference.py, torchrun, 2 processes);
#   * fsdp8 through the coordinator (2 CUDA workers), driven step by step;
#   * fsdp8 free-running (training.free_running: the same workers step back to back without the
#     coordinator's per-step round trip): the difference is the coordinator overhead.
# fsdp8 figures come from the job's events (`fsdp8 watch --json`): the median over the timed
# steps of the step time, the compute / exposed-communication / optimizer split, peak device
# memory (bytes allocated) and the bytes of the step's all-gathers and reduce-scatters.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
PRESETS=${PRESETS:-125m 1b}
STEPS=${STEPS:-12}
WARMUP=${WARMUP:-4}
OUT_DIR=${OUT_DIR:-$root/runs/bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR"
if [ -z "${BIN:-}" ]; then
  if [ -x "$root/.dev/gpu/fsdp8-worker" ]; then BIN=$root/.dev/gpu; else BIN=$root/build/bin; fi
fi
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
results=$OUT_DIR/results.jsonl
: > "$results"
data=$OUT_DIR/data
mkdir -p "$data"

# Random tokens (vocab 32768) in the llm.c token-shard format fsdp8 reads (common/token_shard.h).
python3 - "$data/tokens.bin" <<'PY'
import sys, numpy as np
n = 16 * 1024 * 1024
hdr = np.zeros(256, dtype=np.int32); hdr[0] = 20240520; hdr[1] = 1; hdr[2] = n
tok = np.random.default_rng(1234).integers(0, 32768, size=n, dtype=np.uint16)
with open(sys.argv[1], "wb") as f:
    f.write(hdr.tobytes()); f.write(tok.tobytes())
PY

run_torch() {  # preset precision
  local log=$OUT_DIR/torch-$1-$2.log
  echo "== PyTorch FSDP2 $1 $2"
  timeout 900 torchrun --standalone --nproc_per_node 2 bench/gpu/fsdp2_reference.py \
    --preset "$1" --precision "$2" --steps "$STEPS" --warmup "$WARMUP" > "$log" 2>&1
  local rc=$?
  grep '^{' "$log" | tail -1 >> "$results"
  [ $rc -eq 0 ] || { echo "torch $1 $2 failed (rc $rc), see $log"; tail -5 "$log"; }
}

pids=()
start_fsdp8() {
  local port=$((20000 + RANDOM % 20000))
  addr=127.0.0.1:$port
  "$BIN/fsdp8-coordinator" --listen "$addr" --state_db "$OUT_DIR/coordinator.db" \
    --data_roots "$data" > "$OUT_DIR/coordinator.log" 2>&1 & pids+=($!)
  sleep 1
  for d in 0 1; do
    "$BIN/fsdp8-worker" --coordinator "$addr" --host 127.0.0.1 --backend cuda --device "$d" \
      > "$OUT_DIR/worker-$d.log" 2>&1 & pids+=($!)
  done
  for _ in $(seq 100); do
    [ "$("$BIN/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c '^w-')" -ge 2 ] && break
    sleep 0.2
  done
}
stop_fsdp8() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=(); }
trap stop_fsdp8 EXIT

run_fsdp8() {  # preset mode(driven|free)
  local spec=$OUT_DIR/fsdp8-$1-$2.yaml ev=$OUT_DIR/fsdp8-$1-$2.events.jsonl
  sed -e "s|DATA_DIR|$data|" -e "s|steps: 16|steps: $((STEPS + WARMUP))|" "bench/presets/$1.yaml" > "$spec"
  [ "$2" = free ] && sed -i 's|^  eval_every: 0$|  eval_every: 0\n  free_running: true|' "$spec"
  echo "== fsdp8 $1 ($2)"
  local id
  id=$("$BIN/fsdp8" --coordinator "$addr" submit --no-watch "$spec" 2> "$OUT_DIR/fsdp8-$1-$2.submit.log" | head -1)
  timeout 900 "$BIN/fsdp8" --coordinator "$addr" watch --json "$id" > "$ev"
  local rc=$?
  python3 - "$ev" "$1" "$2" "$WARMUP" >> "$results" <<'PY'
import json, statistics, sys
ev_file, preset, mode, warm = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
evs = [json.loads(l) for l in open(ev_file) if l.startswith("{")]
steps = [e for e in evs if not e.get("message") and int(e.get("step", 0)) > warm]
msgs = [e["message"] for e in evs if e.get("message")]
if not steps:
    print(json.dumps(dict(system="fsdp8", preset=preset, mode=mode, error=msgs[-3:])))
    sys.exit(0)
med = lambda k: statistics.median(float(e.get(k, 0)) for e in steps)
print(json.dumps(dict(
    system="fsdp8", preset=preset, mode=mode, step_s_median=med("step_seconds"),
    compute_s=med("compute_seconds"), comm_s=med("comm_seconds"), optimizer_s=med("optimizer_seconds"),
    peak_mem_bytes=max(int(e.get("peak_memory_bytes", 0)) for e in steps),
    phase_peaks={k: max(int(e.get(k + "_peak_bytes", 0)) for e in steps)
                 for k in ("forward", "backward", "optimizer")},
    allgather_bytes_per_step=int(med("all_gather_bytes")),
    reduce_scatter_bytes_per_step=int(med("reduce_scatter_bytes")),
    final_loss=float(steps[-1]["loss"]), steps=len(steps))))
PY
  [ $rc -eq 0 ] || echo "fsdp8 $1 $2: watch rc $rc; last events: $(tail -2 "$ev")"
}

if [ "${SKIP_TORCH:-0}" != 1 ]; then
  for p in $PRESETS; do for x in ${TORCH_PRECISIONS:-bf16 fp8}; do run_torch "$p" "$x"; done; done
fi
# A short job first, discarded: the first job on freshly started workers ran a constant ~2 ms per
# step slower than later ones (seen on 125m, whichever mode came first), which would be charged to
# the driven mode as coordinator overhead.
warm_fsdp8() {  # preset
  local spec=$OUT_DIR/fsdp8-warmup.yaml
  sed -e "s|DATA_DIR|$data|" -e "s|steps: 16|steps: 6|" "bench/presets/$1.yaml" > "$spec"
  echo "== fsdp8 $1 (warm-up job, not timed)"
  local id
  id=$("$BIN/fsdp8" --coordinator "$addr" submit --no-watch "$spec" 2> "$OUT_DIR/fsdp8-warmup.submit.log" | head -1)
  timeout 900 "$BIN/fsdp8" --coordinator "$addr" watch --json "$id" > "$OUT_DIR/fsdp8-warmup.events.jsonl"
}

if [ "${SKIP_FSDP8:-0}" != 1 ]; then
  start_fsdp8
  [ "${SKIP_WARMUP_JOB:-0}" = 1 ] || warm_fsdp8 "${PRESETS%% *}"
  for p in $PRESETS; do for m in ${MODES:-driven free}; do run_fsdp8 "$p" "$m"; done; done
  stop_fsdp8
fi

python3 bench/gpu/table.py "$results" | tee "$OUT_DIR/table.md"
