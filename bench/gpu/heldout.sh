#!/usr/bin/env bash
# The cost model against the held-out runs on one GPU: calibrates from the CUDA micro-benchmarks
# (BACKEND=cuda bench/calibrate.sh: fsdp8-bench-cuda --calibration, bench/step-overhead.sh; no
# training run of the model's), runs the held-out jobs through bench/gpu/run.sh (driven mode, no
# PyTorch), predicts each run's step with `fsdp8 plan SPEC --predict` from its spec and the fresh
# calibration only, and prints predicted against measured (the median step of the job's events).
#
# The held-out runs (bench/RESULTS.md, "The deferred optimizer and the cost model's held-out
# runs"): 1b at seq 4096 (global batch 4, microbatch 4), l3proxy at 12 layers, the 8B shape at 20
# layers, the default model on CUDA.
#
# Usage (on the GPU machine, the bundle of scripts/gpu-dev.sh build in .dev/gpu):
#   bench/gpu/heldout.sh
# Environment: RUNS (default "1b l3proxy 8b default"; a subset splits the work over several
# calls), CALIBRATION (an existing calibration file: no new calibration), OUT_DIR (default
# runs/heldout-<time>; the calibration is kept there as cuda.json), BIN (default .dev/gpu).
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-$PWD/.dev/gpu}
RUNS=${RUNS:-1b l3proxy 8b default}
OUT_DIR=${OUT_DIR:-$PWD/runs/heldout-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR"
cal=${CALIBRATION:-}
if [ -z "$cal" ]; then
  cal=$OUT_DIR/cuda.json
  echo "== calibrating (fsdp8-bench-cuda --calibration, bench/step-overhead.sh)"
  BACKEND=cuda BIN=$BIN LOG=$OUT_DIR/calibration.log bench/calibrate.sh "$cal" || exit 1
fi
python3 - "$cal" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
print("calibration:", sys.argv[1], {k: c.get(k) for k in
      ("op_floor_us", "launch_us", "alloc_us", "sync_us", "step_overhead_us")})
PY
for r in $RUNS; do
  case "$r" in
    1b) env PRESETS=1b SPEC_SET="model.seq_len=4096 training.global_batch=4 training.microbatch=4" \
          SKIP_TORCH=1 MODES=driven APPEND=1 OUT_DIR="$OUT_DIR" BIN="$BIN" bench/gpu/run.sh ;;
    l3proxy) env PRESETS=l3proxy LAYERS=12 SKIP_TORCH=1 MODES=driven APPEND=1 OUT_DIR="$OUT_DIR" \
               BIN="$BIN" bench/gpu/run.sh ;;
    8b) env PRESETS=8b LAYERS=20 SKIP_TORCH=1 MODES=driven APPEND=1 OUT_DIR="$OUT_DIR" \
          BIN="$BIN" bench/gpu/run.sh ;;
    default) env PRESETS=default SKIP_TORCH=1 MODES=driven APPEND=1 OUT_DIR="$OUT_DIR" \
               BIN="$BIN" bench/gpu/run.sh ;;
    *) echo "unknown run $r (1b, l3proxy, 8b, default)" >&2; exit 2 ;;
  esac > "$OUT_DIR/run-$r.log" 2>&1 || { echo "run $r failed:"; tail -20 "$OUT_DIR/run-$r.log"; }
done
# Predicted (from each run's spec and the calibration) against measured (results.jsonl).
python3 - "$OUT_DIR" "$BIN/fsdp8" "$cal" <<'PY'
import glob, json, os, subprocess, sys
out, cli, cal = sys.argv[1:4]
rows = [json.loads(l) for l in open(os.path.join(out, "results.jsonl"))] if os.path.exists(
    os.path.join(out, "results.jsonl")) else []
print(f"{'run':<28} {'measured ms':>12} {'predicted ms':>13} {'ratio':>7}  predicted split")
for spec in sorted(glob.glob(os.path.join(out, "fsdp8-*-driven.yaml"))):
    name = os.path.basename(spec)[len("fsdp8-"):-len("-driven.yaml")]
    preset = name.split("-")[0]
    got = [r for r in rows if r.get("system") == "fsdp8" and r.get("preset") == preset and
           r.get("mode") == "driven"]
    p = subprocess.run([cli, "plan", spec, "--predict", "--world-size", "1", "--calibration", cal,
                        "--json"], capture_output=True, text=True)
    if p.returncode != 0:
        print(f"{name:<28} prediction failed: {p.stderr.strip()}")
        continue
    pr = json.loads(p.stdout.splitlines()[0])
    split = (f"compute {pr['compute_ms']:.2f} (deferred optimizer {pr['optimizer_in_forward_ms']:.2f})"
             f" + optimizer {pr['optimizer_ms']:.2f} + host {pr['host_ms']:.2f}"
             f" [{pr['calls']} calls, {pr['syncs']} syncs]")
    if not got:
        print(f"{name:<28} {'-':>12} {pr['step_ms']:>13.2f} {'-':>7}  {split}")
        continue
    m = got[-1]
    ms = m["step_s_median"] * 1e3
    print(f"{name:<28} {ms:>12.2f} {pr['step_ms']:>13.2f} {pr['step_ms'] / ms:>7.3f}  {split}")
    print(f"{'':<28} measured: compute {m['compute_s'] * 1e3:.2f} + comm {m['comm_s'] * 1e3:.2f}"
          f" + optimizer {m['optimizer_s'] * 1e3:.2f}")
PY
