#!/usr/bin/env bash
# The per-step cost of driving a job that does not scale with the model, measured through a real
# coordinator and one CPU worker training a trivial model (d_model 8, 1 layer, 1 head, ffn 8,
# vocabulary 16, 8 tokens, one sequence, FP32): the step command and result messages over gRPC,
# the coordinator's publishing of the step event, the worker's handling of the step, and the
# trainer's own per-step bookkeeping and data loading of a job with next to no compute.
#
# Prints one JSON object: {"step_overhead_us": median over the timed steps of the coordinator's
# step time (the step events' step_seconds) less the worker's timed step (compute + exposed
# communication + optimizer seconds of the same event), "step_us": the median step_seconds,
# "trainer_us": the median of what was subtracted, "steps": the steps timed}. The cost model adds
# step_overhead_us to every step (common/cost_model.h, Calibration::step_overhead_s), and on a
# CUDA device the trainer's host work is counted by its calls and synchronisations instead.
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
cat > "$tmp/job.yaml" <<EOF
name: step-overhead
backend: cpu
model: {d_model: 8, n_layers: 1, n_heads: 1, ffn_dim: 8, vocab_size: 16, seq_len: 8}
data: {train_path: $tmp/data/tokens.bin}
training: {steps: $steps, global_batch: 1, microbatch: 1, eval_every: 0, seed: 1}
sharding: {min_workers: 1, max_workers: 1}
precision: {linears: fp32, embedding: fp32, lm_head: fp32}
EOF
port=$((20000 + RANDOM % 20000)); addr=127.0.0.1:$port
"$bin/fsdp8-coordinator" --listen "$addr" --state_db "$tmp/db" --data_roots "$tmp/data" \
  > "$tmp/coord.log" 2>&1 & pids+=($!)
"$bin/fsdp8-worker" --coordinator "$addr" --threads 1 --name so-1 > "$tmp/w.log" 2>&1 & pids+=($!)
for _ in $(seq 150); do
  [ "$("$bin/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c " cpu ")" -ge 1 ] && break
  sleep 0.2
done
out=$("$bin/fsdp8" --coordinator "$addr" submit --no-watch "$tmp/job.yaml") ||
  { echo "submit failed: $out" >&2; tail -5 "$tmp/coord.log" >&2; exit 1; }
id=$(echo "$out" | head -1)
"$bin/fsdp8" --coordinator "$addr" watch --json "$id" > "$tmp/events.jsonl" ||
  { echo "the trivial job failed; worker log:" >&2; tail -10 "$tmp/w.log" >&2; exit 1; }
python3 - "$tmp/events.jsonl" "$warmup" <<'PY'
import json, statistics, sys
warmup = int(sys.argv[2])
ev = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ev = [e for e in ev if not e.get("message") and int(e.get("step", 0)) > warmup]
if len(ev) < 10:
    sys.exit(f"step-overhead: only {len(ev)} timed steps")
inner = [float(e.get("compute_seconds", 0)) + float(e.get("comm_seconds", 0)) +
         float(e.get("optimizer_seconds", 0)) for e in ev]
step = [float(e["step_seconds"]) for e in ev]
over = [s - i for s, i in zip(step, inner)]
print(json.dumps({"step_overhead_us": round(max(0.0, statistics.median(over)) * 1e6, 2),
                  "step_us": round(statistics.median(step) * 1e6, 2),
                  "trainer_us": round(statistics.median(inner) * 1e6, 2), "steps": len(ev)}))
PY
