#!/usr/bin/env bash
# Two builds of fsdp8 side by side on the GPUs present, in one run, for a change that must keep the
# step's bits and speed: OLD and NEW are folders holding fsdp8-worker, fsdp8-coordinator and fsdp8
# (both on the LD_LIBRARY_PATH the caller set, e.g. one scripts/gpu-dev.sh bundle with the other
# build's binaries copied into a sub-folder).
#   1. same bits: bench/gpu/same-bits.sh with each (FORTUNES, DEFAULT_STEPS, L3_STEPS as there),
#      compared step by step by bench/gpu/same_bits.py;
#   2. speed: bench/gpu/run.sh for PRESETS (default "l3proxy 1b"; SKIP_TORCH=1, MODES=driven),
#      ROUNDS (default 2) alternations OLD, NEW; tokens/s per GPU of each, and NEW / OLD per round.
# SKIP_BITS=1 or SKIP_SPEED=1 leaves a part out. Logs under OUT_DIR; a short table is printed last.
#   OLD=.dev/gpu/old NEW=.dev/gpu OUT_DIR=runs/compare bench/gpu/compare-builds.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT_DIR:-$PWD/runs/compare-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR"
summary=()
if [ "${SKIP_BITS:-0}" != 1 ]; then
  for b in old new; do
    bin=$([ $b = old ] && echo "$OLD" || echo "$NEW")
    BIN=$bin OUT_DIR=$OUT_DIR/bits-$b bash bench/gpu/same-bits.sh > "$OUT_DIR/bits-$b.log" 2>&1
    tail -2 "$OUT_DIR/bits-$b.log"
  done
  summary+=("$(python3 bench/gpu/same_bits.py "$OUT_DIR/bits-old/losses.json" "$OUT_DIR/bits-new/losses.json")")
fi
if [ "${SKIP_SPEED:-0}" != 1 ]; then
  for r in $(seq "${ROUNDS:-2}"); do
    for b in old new; do
      bin=$([ $b = old ] && echo "$OLD" || echo "$NEW")
      BIN=$bin PRESETS=${PRESETS:-l3proxy 1b} SKIP_TORCH=1 MODES=driven OUT_DIR=$OUT_DIR/speed-$b-$r \
        bash bench/gpu/run.sh > "$OUT_DIR/speed-$b-$r.log" 2>&1
    done
  done
  summary+=("$(python3 - "$OUT_DIR" "${ROUNDS:-2}" <<'PY'
import json, os, sys
sys.path.insert(0, "bench/gpu")
from table import tokens_per_s
out, rounds = sys.argv[1], int(sys.argv[2])
rows = []
for r in range(1, rounds + 1):
    tps = {}
    for b in ("old", "new"):
        path = os.path.join(out, f"speed-{b}-{r}", "results.jsonl")
        for line in open(path) if os.path.exists(path) else []:
            row = json.loads(line)
            if row.get("system") == "fsdp8" and "error" not in row:
                tps[(row["preset"], b)] = tokens_per_s(row)
    for p in sorted({k[0] for k in tps}):
        o, n = tps.get((p, "old")), tps.get((p, "new"))
        ratio = f"{n / o:.4f}" if o and n else "-"
        rows.append(f"round {r} {p}: old {o and round(o)} tok/s, new {n and round(n)} tok/s, new/old {ratio}")
print("\n".join(rows) or "no speed results")
PY
)")
fi
printf '%s\n' "${summary[@]}" | tee "$OUT_DIR/summary.txt"
