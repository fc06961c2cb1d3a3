#!/usr/bin/env bash
# FP8 recipes against BF16 on a real corpus: bench/kernel-docs/125m-bpe.yaml (the 125m shapes, a
# 16,384-id BPE of the Linux kernel documentation, 1,100 steps of 8 x 1,024 tokens = 1.47 epochs)
# trained under BF16 linears at two seeds and under each FP8 granularity at the first seed, through
# the real coordinator, workers and CLI, on one GPU. Prints every validation point of every run
# (step x variant), the same relative to the BF16 mean, and per FP8 recipe the verdict
#   |final val - BF16 mean| / BF16 mean  <=  max(0.5 %, 2 x |bf16-a - bf16-b| / BF16 mean).
#
# Usage (environment):
#   BIN=.dev/gpu DATA=.dev/corpus bench/recipe-corpus.sh         # one GPU, the five runs side by side
#   BACKEND=cpu STEPS=20 bench/recipe-corpus.sh                  # the plumbing on CPU (a tiny model)
# Environment:
#   DATA      the shards of bench/kernel-docs/bpe.py (default .dev/corpus): train_000000.bin,
#             val_000000.bin; DATA_DIR in SPEC becomes DATA
#   SPEC      the job (default bench/kernel-docs/125m-bpe.yaml)
#   BACKEND   cuda (default) or cpu. cpu shrinks the model to CPU_MODEL (default d_model=128,
#             n_layers=2,n_heads=4,ffn_dim=256,seq_len=256; vocabulary kept) and evaluates
#             EVAL_BATCHES (default 2) batches every EVAL_EVERY (default 5) steps: it proves the
#             plumbing, not the numerics
#   VARIANTS  the runs (default "bf16-a bf16-b fp8-tensorwise fp8-rowwise fp8-blockwise"), of:
#               bf16-a, bf16-b          linears bf16, training.seed SEED_A / SEED_B (1234 / 1235)
#               fp8-tensorwise          linears fp8, granularity tensorwise (the default recipe:
#                                       delayed scaling, hybrid E4M3/E5M2), SEED_A
#               fp8-tensorwise-current  the same with recipe current
#               fp8-rowwise             granularity rowwise (current scaling, hybrid), SEED_A
#               fp8-blockwise           granularity blockwise (current scaling, E4M3), SEED_A
#             A run the coordinator refuses (rowwise / blockwise on cuda until their CUDA kernels
#             land) is reported as refused, with the coordinator's reason, and the others go on.
#   STEPS, WARMUP, EVAL_EVERY, EVAL_BATCHES   override the spec's training.steps,
#             optimizer.warmup_steps (with STEPS: the spec's, at most STEPS / 10), eval_every and
#             eval_batches. Unset on cuda, eval_batches is the validation shard's windows / global
#             batch (bpe.py cuts the shard to a whole number of batches, so every evaluation reads
#             every held-out window once whatever the seed); a warning when STEPS passes 1.5 epochs
#   LANES     runs side by side, each on its own coordinator and one worker (default: every
#             variant at once on cuda, all on device DEVICE, default 0; 1 on cpu). CPU lanes pin
#             their worker to core (lane mod nproc) with taskset, one BLAS thread each
#   BIN       the binaries (default ./build/bin; .dev/gpu for the bundle of scripts/gpu-dev.sh)
#   OUT       logs, specs, each run's events (events-<variant>.jsonl), val.csv and table.md
#             (default runs/recipe-corpus-<time>)
# Needs DATA prepared (bench/kernel-docs/bpe.py: linux-doc-6.1, the `tokenizers` package) and
# python3 (standard library only). Exit 0 when every run ended (succeeded, failed or refused):
# the verdict lines say PASS / FAIL; exit 2 on bad settings.
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC=${SPEC:-bench/kernel-docs/125m-bpe.yaml}
DATA=$(realpath -m "${DATA:-.dev/corpus}")
BACKEND=${BACKEND:-cuda}
VARIANTS=${VARIANTS:-bf16-a bf16-b fp8-tensorwise fp8-rowwise fp8-blockwise}
SEED_A=${SEED_A:-1234}
SEED_B=${SEED_B:-1235}
DEVICE=${DEVICE:-0}
OUT=$(realpath -m "${OUT:-runs/recipe-corpus-$(date +%Y%m%d-%H%M%S)}")
bin=$(realpath "${BIN:-build/bin}")
read -r -a variants <<< "$VARIANTS"
if [ "$BACKEND" = cuda ]; then LANES=${LANES:-${#variants[@]}}; else LANES=${LANES:-1}; fi
for f in train_000000.bin val_000000.bin; do
  [ -f "$DATA/$f" ] || { echo "$DATA/$f missing (bench/kernel-docs/bpe.py --out $DATA)" >&2; exit 2; }
done
for f in fsdp8 fsdp8-coordinator fsdp8-worker; do
  [ -x "$bin/$f" ] || { echo "$bin/$f missing (BIN)" >&2; exit 2; }
done
[ "$LANES" -ge 1 ] || { echo "LANES: must be >= 1" >&2; exit 2; }

# overrides_of VARIANT: the spec fields it sets (SECTION[.SUB].KEY=VALUE, comma separated)
overrides_of() {
  case $1 in
    bf16-a) echo "training.seed=$SEED_A" ;;
    bf16-b) echo "training.seed=$SEED_B" ;;
    fp8-tensorwise) echo "training.seed=$SEED_A,precision.linears=fp8,precision.fp8.granularity=tensorwise" ;;
    fp8-tensorwise-current) echo "training.seed=$SEED_A,precision.linears=fp8,precision.fp8.granularity=tensorwise,precision.fp8.recipe=current" ;;
    fp8-rowwise) echo "training.seed=$SEED_A,precision.linears=fp8,precision.fp8.granularity=rowwise" ;;
    fp8-blockwise) echo "training.seed=$SEED_A,precision.linears=fp8,precision.fp8.granularity=blockwise" ;;
    *) echo "VARIANTS: unknown variant '$1' (bf16-a bf16-b fp8-tensorwise fp8-tensorwise-current fp8-rowwise fp8-blockwise)" >&2; return 2 ;;
  esac
}

# field SPECFILE SECTION KEY: a top-level section's scalar (enough for the specs written above)
field() {
  awk -v s="$2:" -v k="$3:" '$0 == s {in_s = 1; next} /^[^ ]/ {in_s = 0}
      in_s && $1 == k {print $2; exit}' "$1"
}

# The fields every variant shares: backend, one worker, the CPU model, step and evaluation counts.
common=("backend=$BACKEND" "sharding.min_workers=1" "sharding.max_workers=1")
if [ "$BACKEND" = cpu ]; then
  IFS=, read -r -a cpu_model <<< "${CPU_MODEL:-d_model=128,n_layers=2,n_heads=4,ffn_dim=256,seq_len=256}"
  for m in "${cpu_model[@]}"; do common+=("model.$m"); done
  EVAL_BATCHES=${EVAL_BATCHES:-2} EVAL_EVERY=${EVAL_EVERY:-5}
fi
if [ -z "${EVAL_BATCHES:-}" ]; then  # every validation window once: windows / global batch
  EVAL_BATCHES=$(python3 - "$DATA/val_000000.bin" "$(field "$SPEC" model seq_len)" \
      "$(field "$SPEC" training global_batch)" <<'PY'
import struct, sys
with open(sys.argv[1], "rb") as f:
    n = struct.unpack("<3i", f.read(12))[2]
print(max(1, (n - 1) // int(sys.argv[2]) // int(sys.argv[3])))
PY
)
fi
if [ -n "${STEPS:-}" ] && [ -z "${WARMUP:-}" ]; then  # the spec's warmup, at most STEPS / 10
  w=$(field "$SPEC" optimizer warmup_steps); WARMUP=$((w < STEPS / 10 ? w : STEPS / 10))
fi
[ -n "${STEPS:-}" ] && common+=("training.steps=$STEPS")
[ -n "${WARMUP:-}" ] && common+=("optimizer.warmup_steps=$WARMUP")
[ -n "${EVAL_EVERY:-}" ] && common+=("training.eval_every=$EVAL_EVERY")
[ -n "${EVAL_BATCHES:-}" ] && common+=("training.eval_batches=$EVAL_BATCHES")
mkdir -p "$OUT"

# spec_of NAME OVERRIDES: writes $OUT/NAME.yaml (SPEC with DATA_DIR set and the fields set, a
# missing key or subsection added under its section).
spec_of() {
  python3 - "$SPEC" "$DATA" "$OUT/$1.yaml" "$2" <<'PY'
import sys
spec, data, out, overrides = sys.argv[1:]
lines = open(spec).read().replace("DATA_DIR", data).splitlines()

def block_end(start, indent):
    """Index after the block of lines[start] (lines indented deeper than indent, or blank)."""
    i = start + 1
    while i < len(lines) and (not lines[i].strip() or
                              len(lines[i]) - len(lines[i].lstrip()) > indent):
        i += 1
    return i

def set_field(path, value):
    head, indent = -1, -2  # the enclosing block: the whole file
    for depth, key in enumerate(path):
        indent = 2 * depth
        lo, hi = head + 1, block_end(head, indent - 2) if head >= 0 else len(lines)
        found = next((i for i in range(lo, hi) if lines[i].startswith(" " * indent + key + ":")
                      and len(lines[i]) - len(lines[i].lstrip()) == indent), None)
        if depth == len(path) - 1:
            text = f"{' ' * indent}{key}: {value}"
            if found is None: lines.insert(hi if head >= 0 else len(lines), text)
            else: lines[found] = text
            return
        if found is None:
            found = hi if head >= 0 else len(lines)
            lines.insert(found, f"{' ' * indent}{key}:")
        head = found

for item in filter(None, overrides.split(",")):
    key, _, value = item.partition("=")
    set_field(key.split("."), value)
open(out, "w").write("\n".join(lines) + "\n")
PY
}

# The data checks: epochs of the training windows, a validation set independent of the seed.
check_data() {
  local y=$1 seq gb steps evb
  seq=$(field "$y" model seq_len); gb=$(field "$y" training global_batch)
  steps=$(field "$y" training steps); evb=$(field "$y" training eval_batches)
  python3 - "$DATA" "$seq" "$gb" "$steps" "$evb" <<'PY'
import struct, sys
data, seq, gb, steps, evb = sys.argv[1], *map(int, sys.argv[2:])
def windows(name):
    with open(f"{data}/{name}", "rb") as f:
        n = struct.unpack("<3i", f.read(12))[2]
    return (n - 1) // seq
wt, wv = windows("train_000000.bin"), windows("val_000000.bin")
epochs = steps * gb / wt
print(f"data: {wt} training windows of {seq + 1} tokens: {steps} steps x {gb} = {epochs:.2f} epochs; "
      f"{wv} validation windows, {evb} x {gb} read per evaluation")
if epochs > 1.5:
    print(f"warning: {epochs:.2f} epochs (> 1.5): the curves measure overfitting as much as precision")
if evb * gb != wv:
    print(f"warning: an evaluation reads {evb * gb} of {wv} validation windows: which ones depends "
          f"on the seed (bench/kernel-docs/bpe.py cuts the validation shard to whole batches)")
PY
}

# lane L VARIANT...: one coordinator and one worker, the variants one after the other. Runs in its
# own subshell (lane ... &); its daemons are stopped when that subshell exits.
lane() {
  local l=$1 port addr dev pin name id
  shift
  pids=()
  trap 'for q in "${pids[@]}"; do kill "$q" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT
  port=$((20000 + RANDOM % 20000)); addr=127.0.0.1:$port
  "$bin/fsdp8-coordinator" --listen "$addr" --state_db "$OUT/jobs-$l.db" --data_roots "$DATA" \
      --heartbeat_timeout_s "${HEARTBEAT_TIMEOUT_S:-30}" > "$OUT/coordinator-$l.log" 2>&1 &
  pids+=($!)
  pin=()
  if [ "$BACKEND" = cuda ]; then dev=(--backend cuda --device "$DEVICE"); else
    dev=(--threads 1); pin=(taskset -c $((l % $(nproc)))); fi
  "${pin[@]}" "$bin/fsdp8-worker" --coordinator "$addr" --host 127.0.0.1 "${dev[@]}" \
      > "$OUT/worker-$l.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 300); do
    "$bin/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -q "^w-" && break
    sleep 0.2
  done
  for name in "$@"; do
    echo "$name: started (lane $l)"
    if ! "$bin/fsdp8" --coordinator "$addr" submit "$OUT/$name.yaml" --log "$OUT/client-$name.log" \
        > "$OUT/submit-$name.out" 2>&1; then
      if grep -q "invalid job spec" "$OUT/submit-$name.out"; then
        sed -n 's/^error: invalid job spec: //p' "$OUT/submit-$name.out" | head -1 > "$OUT/refused-$name.txt"
        echo "$name: refused: $(cat "$OUT/refused-$name.txt")"
      else
        echo "$name: the job did not succeed, see $OUT/client-$name.log and $OUT/submit-$name.out"
      fi
    fi
    id=$(head -1 "$OUT/submit-$name.out" | grep -oE '^job-[A-Za-z0-9_-]+' || true)
    [ -n "$id" ] || continue
    "$bin/fsdp8" --coordinator "$addr" watch "$id" --json > "$OUT/events-$name.jsonl" 2>/dev/null || true
    "$bin/fsdp8" --coordinator "$addr" status --json "$id" > "$OUT/status-$name.json" || true
    echo "$name: $(tail -1 "$OUT/client-$name.log" 2>/dev/null)"
  done
}

declare -a per_lane
for ((k = 0; k < ${#variants[@]}; k++)); do
  v=${variants[$k]}
  o=$(overrides_of "$v") || exit 2
  spec_of "$v" "$(IFS=,; echo "${common[*]},$o")"
  per_lane[k % LANES]+="$v "
done
check_data "$OUT/${variants[0]}.yaml"
echo "runs: ${variants[*]} on $BACKEND, $LANES lane(s); logs: $OUT"
lane_pids=()
for ((l = 0; l < LANES; l++)); do
  # shellcheck disable=SC2086
  [ -n "${per_lane[$l]:-}" ] && { lane "$l" ${per_lane[$l]} & lane_pids+=($!); }
done
for p in "${lane_pids[@]}"; do wait "$p" || true; done

python3 - "$OUT" "${variants[@]}" <<'PY'
import json, math, os, sys
out, names = sys.argv[1], sys.argv[2:]
runs = {}  # name -> {"val": {step: loss}, "status": dict or None, "refused": str or None}
for n in names:
    r = {"val": {}, "status": None, "refused": None}
    ev = os.path.join(out, f"events-{n}.jsonl")
    if os.path.exists(ev):
        for line in open(ev):
            try: e = json.loads(line)
            except ValueError: continue
            v = e.get("val_loss")
            if e.get("state") == "JOB_STATE_RUNNING" and v not in (None, "NaN") and not math.isnan(float(v)):
                r["val"][int(e["step"])] = float(v)  # a replayed step keeps its newest value
    st = os.path.join(out, f"status-{n}.json")
    if os.path.exists(st):
        try: r["status"] = json.load(open(st))
        except ValueError: pass
    rf = os.path.join(out, f"refused-{n}.txt")
    if os.path.exists(rf): r["refused"] = open(rf).read().strip()
    runs[n] = r

def outcome(n):
    r = runs[n]
    if r["refused"]: return "refused"
    s = r["status"]
    if not s: return "failed"
    return "ok" if s.get("state") == "JOB_STATE_SUCCEEDED" else s.get("state", "failed").replace("JOB_STATE_", "").lower()

steps = sorted({s for r in runs.values() for s in r["val"]})
bf16 = [n for n in ("bf16-a", "bf16-b") if n in runs and outcome(n) == "ok" and runs[n]["val"]]
mean_at = {}
if len(bf16) == 2:
    for s in steps:
        if all(s in runs[n]["val"] for n in bf16):
            mean_at[s] = sum(runs[n]["val"][s] for n in bf16) / 2
shown = [n for n in names if runs[n]["val"]]
w = max([14] + [len(n) + 1 for n in shown])

print("\nvalidation loss (nats per token) at every evaluation" + ("" if steps else ": none (no run evaluated)"))
if steps:
    print(f"{'step':>6}" + "".join(f"{n:>{w}}" for n in shown) + (f"{'bf16 mean':>{w}}" if mean_at else ""))
for s in steps:
    row = "".join(f"{runs[n]['val'][s]:>{w}.4f}" if s in runs[n]["val"] else f"{'-':>{w}}" for n in shown)
    print(f"{s:>6}" + row + (f"{mean_at[s]:>{w}.4f}" if s in mean_at else ""))
if mean_at:
    print("\nrelative to the BF16 mean at the same step (%)")
    print(f"{'step':>6}" + "".join(f"{n:>{w}}" for n in shown))
    for s in steps:
        if s not in mean_at: continue
        row = "".join(f"{100 * (runs[n]['val'][s] - mean_at[s]) / mean_at[s]:>+{w}.3f}"
                      if s in runs[n]["val"] else f"{'-':>{w}}" for n in shown)
        print(f"{s:>6}" + row)

print(f"\n{'variant':<24} {'outcome':>8} {'steps':>6} {'train_loss':>10} {'val_loss':>9} {'tokens/s':>9} {'wall_s':>7}")
for n in names:
    o, s = outcome(n), runs[n]["status"]
    if s and o != "refused":
        wall = float(s.get("end_time", 0)) - float(s.get("start_time", 0))
        tps = float(s.get("tokens", 0)) / wall if wall > 0 else float("nan")
        print(f"{n:<24} {o:>8} {int(s.get('step', 0)):>6} {float(s.get('loss', 'nan')):>10.4f} "
              f"{float(s.get('val_loss', 'nan')):>9.4f} {tps:>9.0f} {wall:>7.1f}")
    else:
        print(f"{n:<24} {o:>8}" + (f"  {runs[n]['refused']}" if o == "refused" else ""))

# The verdict: the final validation loss (the last evaluation) of a run that completed.
def final(n):
    return runs[n]["val"][max(runs[n]["val"])] if outcome(n) == "ok" and runs[n]["val"] else None

print()
if len(bf16) < 2:
    print("verdict: none (both BF16 runs, bf16-a and bf16-b, must complete with a validation loss)")
else:
    a, b = final("bf16-a"), final("bf16-b")
    mean = (a + b) / 2
    spread = abs(a - b) / mean
    tol = max(0.005, 2 * spread)
    print(f"BF16 final val: {a:.4f} (seed a), {b:.4f} (seed b), mean {mean:.4f}, spread "
          f"{100 * spread:.3f} %; tolerance max(0.5 %, 2 x spread) = {100 * tol:.3f} %")
    for n in names:
        if not n.startswith("fp8"): continue
        o = outcome(n)
        if o != "ok":
            print(f"verdict {n}: {o.upper()}" + (f" ({runs[n]['refused']})" if o == "refused" else ""))
            continue
        f = final(n)
        if f is None:
            print(f"verdict {n}: NO VALIDATION LOSS"); continue
        d = abs(f - mean) / mean
        print(f"verdict {n}: final val {f:.4f}, {100 * (f - mean) / mean:+.3f} % of the BF16 mean: "
              f"{'PASS' if d <= tol else 'FAIL'} (|{100 * d:.3f} %| vs {100 * tol:.3f} %)")

# val.csv (step, one column per run) and table.md, for bench/RESULTS.md and plotting.
with open(os.path.join(out, "val.csv"), "w") as f:
    f.write("step," + ",".join(shown) + "\n")
    for s in steps:
        f.write(f"{s}," + ",".join(f"{runs[n]['val'][s]:.6f}" if s in runs[n]["val"] else "" for n in shown) + "\n")
with open(os.path.join(out, "table.md"), "w") as f:
    f.write("| step | " + " | ".join(shown) + " |\n|---:|" + "---:|" * len(shown) + "\n")
    for s in steps:
        f.write(f"| {s} | " + " | ".join(f"{runs[n]['val'][s]:.4f}" if s in runs[n]["val"] else "-" for n in shown) + " |\n")
PY
echo "logs: $OUT (val.csv, table.md: the validation curves)"
