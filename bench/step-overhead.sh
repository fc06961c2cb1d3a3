#!/usr/bin/env bash
# The per-step costs of driving a job that do not scale with the model, measured through a real
# coordinator and one CPU worker training a trivial model (d_model 8, 1 layer, 1 head, ffn 8,
# vocabulary 16, 8 tokens, one sequence, FP32), twice: driven (the coordinator sends each step's
# command, ahead of time with --dispatch_ahead, and publishes each result) and free-running
# (training.free_running: one command, the worker steps back to back and reports each result).
#
# Prints one JSON object, medians over the timed steps of the step events:
#   "step_overhead_us": free-running step_seconds less the worker's timed step (compute + exposed
#       communication + optimizer seconds of the same event): the worker's own per-step handling
#       (the command, the result message, the step's bookkeeping), serial with every step;
#   "step_cycle_us": the driven step_seconds: the shortest step the coordinator's loop allows
#       (it handles step k's result while the worker runs step k+1, so a longer step hides it);
#   "driven_trainer_us", "free_trainer_us": the worker's timed steps; "steps": steps timed.
# The cost model (common/cost_model.h) adds step_overhead_us to every step and takes at least
# step_cycle_us for it.
#
# Usage: bench/step-overhead.sh   Environment: BIN (fsdp8, fsdp8-coordinator, fsdp8-worker;
# default build/bin), STEPS (default 200), WARMUP (default 20).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(cd "${BIN:-build/bin}" && pwd)
steps=${STEPS:-200}
warmup=${WARMUP:-20}
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
python3 - "$tmp/data/tokens.bin" <<'PY'
import os, struct, sys, random
path = sys.argv[1]
os.makedirs(os.path.dirname(path), exist_ok=True)
rng = random.Random(1234)
n = 1 << 16
header = [20240520, 1, n] + [0] * 253  # llm.c shard header: magic, version, token count
with open(path, "wb") as f:
    f.write(struct.pack("<256i", *header))
    f.write(struct.pack(f"<{n}H", *(rng.randrange(16) for _ in range(n))))
PY
for mode in driven free; do
  free=false
  [ "$mode" = free ] && free=true
  cat > "$tmp/job-$mode.yaml" <<YAML
name: step-overhead-$mode
backend: cpu
model: {d_model: 8, n_layers: 1, n_heads: 1, ffn_dim: 8, vocab_size: 16, seq_len: 8}
data: {train_path: $tmp/data/tokens.bin}
training: {steps: $steps, global_batch: 1, microbatch: 1, eval_every: 0, seed: 1, free_running: $free}
sharding: {min_workers: 1, max_workers: 1}
precision: {linears: fp32, embedding: fp32, lm_head: fp32}
YAML
done
port=$((20000 + RANDOM % 20000)); addr=127.0.0.1:$port
"$bin/fsdp8-coordinator" --listen "$addr" --state_db "$tmp/db" --data_roots "$tmp/data" \
  > "$tmp/coord.log" 2>&1 & pids+=($!)
"$bin/fsdp8-worker" --coordinator "$addr" --threads 1 --name so-1 > "$tmp/w.log" 2>&1 & pids+=($!)
for _ in $(seq 150); do
  [ "$("$bin/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c " cpu ")" -ge 1 ] && break
  sleep 0.2
done
for mode in driven free; do
  out=$("$bin/fsdp8" --coordinator "$addr" submit --no-watch "$tmp/job-$mode.yaml") ||
    { echo "submit failed: $out" >&2; tail -5 "$tmp/coord.log" >&2; exit 1; }
  id=$(echo "$out" | head -1)
  "$bin/fsdp8" --coordinator "$addr" watch --json "$id" > "$tmp/events-$mode.jsonl" ||
    { echo "the trivial $mode job failed; worker log:" >&2; tail -10 "$tmp/w.log" >&2; exit 1; }
done
python3 - "$tmp" "$warmup" <<'PY'
import json, os, statistics, sys
tmp, warmup = sys.argv[1], int(sys.argv[2])
def figures(mode):
    ev = [json.loads(l) for l in open(os.path.join(tmp, f"events-{mode}.jsonl")) if l.strip()]
    ev = [e for e in ev if not e.get("message") and int(e.get("step", 0)) > warmup]
    if len(ev) < 10:
        sys.exit(f"step-overhead: only {len(ev)} timed steps ({mode})")
    inner = [float(e.get("compute_seconds", 0)) + float(e.get("comm_seconds", 0)) +
             float(e.get("optimizer_seconds", 0)) for e in ev]
    step = [float(e["step_seconds"]) for e in ev]
    return (statistics.median(step), statistics.median(inner),
            statistics.median(s - i for s, i in zip(step, inner)), len(ev))
d_step, d_inner, _, n = figures("driven")
f_step, f_inner, f_over, _ = figures("free")
print(json.dumps({"step_overhead_us": round(max(0.0, f_over) * 1e6, 2),
                  "step_cycle_us": round(d_step * 1e6, 2),
                  "driven_trainer_us": round(d_inner * 1e6, 2),
                  "free_trainer_us": round(f_inner * 1e6, 2), "steps": n}))
PY
