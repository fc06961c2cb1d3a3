#!/usr/bin/env bash
# Trains variants of one job spec (each a few overridden fields) through the real coordinator,
# workers and CLI, and prints one line per variant: steps, final train and validation loss, wall
# time and tokens/s. For choosing a recipe (e.g. the demo job's learning rate and schedule) on the
# evidence of whole runs.
#
# Usage: bench/recipe-sweep.sh VARIANT...    a VARIANT is NAME or NAME:FIELD=VALUE[,FIELD=VALUE...]
#   where FIELD is SECTION.KEY of the spec (optimizer.peak_lr, training.steps, ...). A key the spec
#   lacks is added under its section (the section must exist).
#   e.g. bench/recipe-sweep.sh base lr5:optimizer.peak_lr=0.005 long:training.steps=800
# Environment:
#   SPEC     the job spec (default data/default-job.yaml); DATA_DIR in it becomes DATA
#   DATA     prepared token shards (default data/fortunes; scripts/prepare-fortunes.sh makes them)
#   BACKEND  cpu (default) or cuda; overrides the spec's backend
#   WORKERS  workers per job (default 2 on cpu, 1 on cuda); min/max_workers are set to it
#   LANES    variants run side by side, each lane on its own coordinator and workers (default 1).
#            CPU lanes pin each worker to one core of CORES with taskset; CUDA lanes share the
#            devices 0..WORKERS-1 (small models only).
#   CORES    the CPU cores for CPU lanes, as taskset lists them: "6-15", "0,1,4-7" or "6 7 8"
#            (default every core)
#   BIN      the folder of the binaries (default ./build/bin; BIN=.dev/gpu for a bundle of
#            scripts/gpu-dev.sh build); OUT the logs (default runs/recipe-sweep-<time>)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n 2,23p "$0" >&2; exit 2; }
SPEC=${SPEC:-data/default-job.yaml}
DATA=$(realpath -m "${DATA:-data/fortunes}")
BACKEND=${BACKEND:-cpu}
if [ "$BACKEND" = cuda ]; then WORKERS=${WORKERS:-1}; else WORKERS=${WORKERS:-2}; fi
LANES=${LANES:-1}
cores=()
for c in ${CORES:-0-$(($(nproc) - 1))}; do  # "a-b" ranges and single cores, comma or space separated
  for r in ${c//,/ }; do
    [[ "$r" =~ ^[0-9]+(-[0-9]+)?$ ]] || { echo "CORES: '$r' is not a core or a range a-b" >&2; exit 2; }
    if [[ "$r" == *-* ]]; then cores+=($(seq "${r%-*}" "${r#*-}")); else cores+=("$r"); fi
  done
done
OUT=$(realpath -m "${OUT:-runs/recipe-sweep-$(date +%Y%m%d-%H%M%S)}")
bin=$(realpath "${BIN:-${BUILD:-build}/bin}")
[ -f "$DATA/train.bin" ] || { echo "$DATA/train.bin missing" >&2; exit 2; }
if [ "$BACKEND" = cpu ] && [ $((LANES * WORKERS)) -gt ${#cores[@]} ]; then
  echo "LANES * WORKERS = $((LANES * WORKERS)) exceeds the ${#cores[@]} cores of CORES" >&2; exit 2
fi
mkdir -p "$OUT"

# spec_of NAME OVERRIDES: writes $OUT/NAME.yaml
spec_of() {
  python3 - "$SPEC" "$DATA" "$BACKEND" "$WORKERS" "$2" > "$OUT/$1.yaml" <<'PY'
import re, sys
spec, data, backend, workers, overrides = sys.argv[1:]
lines = open(spec).read().replace("DATA_DIR", data).splitlines()
fields = {"backend": backend, "sharding.min_workers": workers, "sharding.max_workers": workers}
for item in filter(None, overrides.split(",")):
    key, _, value = item.partition("=")
    fields[key] = value
for key, value in fields.items():
    section, _, leaf = key.rpartition(".")
    if not section:
        idx = [i for i, l in enumerate(lines) if re.match(rf"{leaf}:", l)]
        if idx: lines[idx[0]] = f"{leaf}: {value}"
        else: lines.append(f"{leaf}: {value}")
        continue
    head = [i for i, l in enumerate(lines) if l.rstrip() == f"{section}:"]
    if not head: sys.exit(f"{spec}: no section '{section}:' for {key}")
    i = head[0] + 1
    while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
        if re.match(rf"\s+{leaf}:", lines[i]):
            lines[i] = f"  {leaf}: {value}"
            break
        i += 1
    else:
        lines.insert(head[0] + 1, f"  {leaf}: {value}")
print("\n".join(lines))
PY
}

# lane L VARIANT...: one coordinator and WORKERS workers, the variants one after the other. Runs
# in its own subshell (lane ... &): its daemons are stopped when that subshell exits, also when a
# failing command ends it early (set -e; a function's locals are gone by then, so pids is global).
lane() {
  local l=$1 port addr i dev pin name id
  shift
  pids=()
  trap 'for q in "${pids[@]}"; do kill "$q" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT
  port=$((20000 + RANDOM % 20000)); addr=127.0.0.1:$port
  "$bin/fsdp8-coordinator" --listen "$addr" --state_db "$OUT/jobs-$l.db" --data_roots "$DATA" \
      --heartbeat_timeout_s 30 > "$OUT/coordinator-$l.log" 2>&1 &
  pids+=($!)
  for ((i = 0; i < WORKERS; i++)); do
    pin=()
    if [ "$BACKEND" = cuda ]; then dev=(--backend cuda --device "$i"); else
      dev=(--threads 1); pin=(taskset -c "${cores[$((l * WORKERS + i))]}"); fi
    "${pin[@]}" "$bin/fsdp8-worker" --coordinator "$addr" --host 127.0.0.1 "${dev[@]}" \
        > "$OUT/worker-$l-$i.log" 2>&1 &
    pids+=($!)
  done
  for _ in $(seq 300); do
    [ "$("$bin/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c "^w-")" -ge "$WORKERS" ] && break
    sleep 0.2
  done
  for v in "$@"; do
    name=${v%%:*}
    if ! "$bin/fsdp8" --coordinator "$addr" submit "$OUT/$name.yaml" --log "$OUT/client-$name.log" \
        > "$OUT/submit-$name.out" 2>&1; then
      echo "$name: the job did not succeed, see $OUT/client-$name.log" >&2
      continue
    fi
    id=$(head -1 "$OUT/submit-$name.out" | grep -oE '[A-Za-z0-9_-]{6,}' | head -1)
    "$bin/fsdp8" --coordinator "$addr" status --json "$id" > "$OUT/status-$name.json"
  done
}

names=()
declare -a per_lane
for ((k = 0; k < $#; k++)); do
  v=${@:$((k + 1)):1}
  name=${v%%:*}; overrides=""; [[ "$v" == *:* ]] && overrides=${v#*:}
  spec_of "$name" "$overrides" || exit 2
  names+=("$name")
  per_lane[$((k % LANES))]+="$v "
done
lane_pids=()
for ((l = 0; l < LANES; l++)); do
  # shellcheck disable=SC2086
  [ -n "${per_lane[$l]:-}" ] && { lane "$l" ${per_lane[$l]} & lane_pids+=($!); }
done
for p in "${lane_pids[@]}"; do wait "$p" || true; done

printf '%-14s %6s %11s %9s %9s %8s\n' variant steps train_loss val_loss tokens/s wall_s
for name in "${names[@]}"; do
  [ -f "$OUT/status-$name.json" ] || { printf '%-14s failed\n' "$name"; continue; }
  python3 - "$name" "$OUT/status-$name.json" <<'PY'
import json, sys
name, j = sys.argv[1], json.load(open(sys.argv[2]))
wall = float(j["end_time"]) - float(j["start_time"])
print(f"{name:<14} {int(j['step']):>6} {float(j['loss']):>11.4f} {float(j['val_loss']):>9.4f} "
      f"{float(j['tokens']) / wall:>9.0f} {wall:>8.1f}")
PY
done
echo "logs: $OUT"
