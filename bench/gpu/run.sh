#!/usr/bin/env bash
# fsdp8 against PyTorch FSDP2 (BF16, FP8, torchao float8) on the GPUs present, in one go; prints one
# table (bench/gpu/table.py).
#
# On a GPU host with PyTorch (torchrun) and the fsdp8 binaries (a build with CUDA, or the bundle of
# scripts/gpu-dev.sh build unpacked in .dev/gpu):
#   bench/gpu/run.sh                                  # every preset, every precision and mode
#   PRESETS=l3proxy TORCH_PRECISIONS="bf16 torchao-tensorwise" MODES=driven bench/gpu/run.sh
# World size = the GPUs present (CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`), or NGPUS:
# PyTorch runs torchrun --nproc_per_node N, fsdp8 N CUDA workers on devices 0..N-1, and every
# preset keeps its sequences per GPU (global batch = sequences per GPU x N).
# Options (environment):
#   PRESETS           "125m 1b l3proxy" (bench/presets/, shapes in bench/gpu/presets.py; also
#                     "default", the default model on CUDA)
#   TORCH_PRECISIONS  "bf16 fp8 torchao-tensorwise torchao-rowwise" (bench/gpu/fsdp2_reference.py)
#   MODES             fsdp8 modes, "driven free"
#   VOCAB             vocabulary of every preset (default: each preset's; l3proxy 128256)
#   LAYERS            layer count of every preset (default: each preset's); the largest model per
#                     GPU is searched by repeating the bench with LAYERS (and APPEND=1)
#   TORCH_NO_COMPILE=1  the PyTorch reference without torch.compile
#   STEPS, WARMUP     timed and warm-up steps (default: each preset's; 12 after 4, l3proxy 8 after 3)
#   NGPUS             world size; BIN (fsdp8 binaries; default .dev/gpu, else build/bin);
#   OUT_DIR           logs (default runs/bench-<time>); APPEND=1 adds to OUT_DIR's results (a run
#                     split over several commands prints one table); SKIP_TORCH=1, SKIP_FSDP8=1;
#   SKIP_WARMUP_JOB=1 (no discarded first fsdp8 job per preset); METER_INTERVAL (s, 0.05).
#   SPEC_SET          spec fields set in every fsdp8 job, SECTION.KEY=VALUE separated by spaces
#                     (e.g. "training.saved_norm_inputs=bf16")
#   VARIANT           a label for what SPEC_SET changes (e.g. blockwise): appended to the fsdp8
#                     rows' mode ("driven-blockwise") and file names, so that variants run with
#                     APPEND=1 into one OUT_DIR print as rows of one table
# torchao 0.18.0 comes from WHEELS (.dev/wheels; bench/gpu/fetch-wheels.sh, run where there is
# network) and is installed into PYLIB (.dev/pylib, put on PYTHONPATH) on first use.
#
# Memory: every run is metered from outside by bench/gpu/memmeter.py (NVML, else nvidia-smi; every
# METER_INTERVAL s): the peak device memory used minus the idle baseline taken before the measured
# processes started (torchrun's workers; fsdp8's workers, started per preset, metered over each
# job). Beside it, each system's own count: torch.cuda.max_memory_allocated() for PyTorch,
# peak_memory_bytes of the step events for fsdp8; and fsdp8's memory plan (`fsdp8 plan`), the
# prediction of both: its peak_bytes against the own count, its device_bytes against the meter.
# fsdp8 figures come from the job's events (`fsdp8 watch --json`): the median over the timed steps
# of the step time and its compute / exposed-communication / optimizer split. Free-running mode
# (training.free_running: workers step back to back without the coordinator's per-step round trip)
# against driven mode gives the coordinator overhead.
# bench/gpu/selftest.sh checks this script and its helpers without GPUs (stand-ins for nvidia-smi,
# NVML, torchrun and the fsdp8 binaries).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
tool=bench/gpu/benchtool.py
meter=bench/gpu/memmeter.py
PRESETS=${PRESETS:-125m 1b l3proxy}
TORCH_PRECISIONS=${TORCH_PRECISIONS:-bf16 fp8 torchao-tensorwise torchao-rowwise}
MODES=${MODES:-driven free}
OUT_DIR=${OUT_DIR:-$root/runs/bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR"
if [ -z "${BIN:-}" ]; then
  if [ -x "$root/.dev/gpu/fsdp8-worker" ]; then BIN=$root/.dev/gpu; else BIN=$root/build/bin; fi
fi
WHEELS=${WHEELS:-$root/.dev/wheels}
PYLIB=${PYLIB:-$root/.dev/pylib}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export CUDA_DEVICE_ORDER=${CUDA_DEVICE_ORDER:-PCI_BUS_ID}  # CUDA's numbering = NVML's (the meter's)

# ---- world size, and the NVML ids of CUDA devices 0..N-1 -----------------------------------------
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  visible=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | sed '/^ *$/d')
else
  visible=$(nvidia-smi -L 2>/dev/null | awk '/^GPU /{print n++}')
fi
N=${NGPUS:-$(echo "$visible" | grep -c .)}
if ! [[ "$N" =~ ^[1-9][0-9]*$ ]]; then echo "run.sh: no GPUs found (NGPUS or CUDA_VISIBLE_DEVICES or nvidia-smi -L); got '$N'" >&2; exit 2; fi
if [ -z "$visible" ]; then
  visible=$(seq 0 $((N - 1)))  # NGPUS without nvidia-smi: the meter says whether it can read them
elif [ "$(echo "$visible" | grep -c .)" -lt "$N" ]; then
  echo "run.sh: NGPUS=$N but only $(echo "$visible" | grep -c .) GPUs are visible" >&2; exit 2
fi
meter_devices=$(echo "$visible" | head -n "$N" | paste -sd,)
echo "== world size $N (devices: $meter_devices); logs in $OUT_DIR"

for p in $PRESETS; do python3 "$tool" defaults "$p" > /dev/null || exit 2; done
results=$OUT_DIR/results.jsonl
[ "${APPEND:-0}" = 1 ] || : > "$results"
data=$OUT_DIR/data
mkdir -p "$data"
defaults() { python3 "$tool" defaults "$1"; }   # "WARMUP STEPS VOCAB SEQ_PER_GPU"
warmup_of() { [ -n "${WARMUP:-}" ] && echo "$WARMUP" || defaults "$1" | cut -d' ' -f1; }
steps_of() { [ -n "${STEPS:-}" ] && echo "$STEPS" || defaults "$1" | cut -d' ' -f2; }
vocab_of() { [ -n "${VOCAB:-}" ] && echo "$VOCAB" || defaults "$1" | cut -d' ' -f3; }
error_line() { python3 "$tool" line "$@" world "$N" ${LAYERS:+layers "$LAYERS"} >> "$results"; }

# ---- the external memory meter ---------------------------------------------------------------------
meter_pid=
meter_start() {  # out-file [baseline-file]
  rm -f "$1.ready"
  python3 "$meter" watch --devices "$meter_devices" --out "$1" --ready "$1.ready" \
    --interval "${METER_INTERVAL:-0.05}" ${2:+--baseline "$2"} & meter_pid=$!
  for _ in $(seq 150); do
    [ -e "$1.ready" ] && return 0
    kill -0 "$meter_pid" 2>/dev/null || return 0
    sleep 0.1
  done
}
meter_stop() { [ -n "$meter_pid" ] && { kill -TERM "$meter_pid" 2>/dev/null; wait "$meter_pid" 2>/dev/null; }; meter_pid=; }

# ---- PyTorch ---------------------------------------------------------------------------------------
torchao_ready=
torchao_version() {
  python3 -c 'from importlib.metadata import version; import torchao.float8; print(version("torchao"))' 2>/dev/null
}
ensure_torchao() {  # torchao 0.18.0 importable, from .dev/pylib (installed there from .dev/wheels)
  [ -n "$torchao_ready" ] && return "$torchao_ready"
  export PYTHONPATH=$PYLIB${PYTHONPATH:+:$PYTHONPATH}
  local want=0.18.0 have
  if [ "$(torchao_version)" != "$want" ]; then
    local whl
    whl=$(ls "$WHEELS"/torchao-$want-*.whl 2>/dev/null | head -1)
    if [ -z "$whl" ]; then
      echo "no $WHEELS/torchao-$want-*.whl: run bench/gpu/fetch-wheels.sh on a host with network and carry .dev/wheels"
      torchao_ready=1; return 1
    fi
    echo "== installing $(basename "$whl") into $PYLIB"
    rm -rf "$PYLIB/torchao" "$PYLIB"/torchao-*.dist-info
    python3 -m pip install --no-deps --no-index --target "$PYLIB" "$whl" > "$OUT_DIR/torchao-install.log" 2>&1 ||
      python3 -m zipfile -e "$whl" "$PYLIB" >> "$OUT_DIR/torchao-install.log" 2>&1  # no pip: a wheel is a zip
  fi
  have=$(torchao_version)
  if [ "$have" != "$want" ]; then
    echo "torchao $want not importable after install (got '${have}'); see $OUT_DIR/torchao-install.log"
    torchao_ready=1; return 1
  fi
  torchao_ready=0
}

run_torch() {  # preset precision
  local log=$OUT_DIR/torch-$1${LAYERS:+-L$LAYERS}-$2.log m=$OUT_DIR/meter-torch-$1${LAYERS:+-L$LAYERS}-$2.json
  local vocab warm steps
  vocab=$(vocab_of "$1"); warm=$(warmup_of "$1"); steps=$(steps_of "$1")
  echo "== PyTorch FSDP2 $1 $2 (vocab $vocab, $N GPU(s), $steps steps after $warm)"
  if [[ "$2" == torchao-* ]] && ! ensure_torchao; then
    error_line system pytorch-fsdp2 preset "$1" precision "$2" vocab "$vocab" error "torchao 0.18.0 missing"
    return
  fi
  meter_start "$m"
  timeout 900 torchrun --standalone --nproc_per_node "$N" bench/gpu/fsdp2_reference.py \
    --preset "$1" --precision "$2" --vocab "$vocab" --steps "$steps" --warmup "$warm" \
    ${LAYERS:+--layers "$LAYERS"} $([ "${TORCH_NO_COMPILE:-0}" = 1 ] && echo --no-compile) > "$log" 2>&1
  local rc=$?
  meter_stop
  if grep -q '^{' "$log"; then
    grep '^{' "$log" | tail -1 | python3 "$meter" merge "$m" >> "$results"
  else
    error_line system pytorch-fsdp2 preset "$1" precision "$2" vocab "$vocab" error "rc $rc, see $log"
  fi
  [ $rc -eq 0 ] || { echo "torch $1 $2 failed (rc $rc), see $log"; tail -5 "$log"; }
}

# ---- fsdp8 -----------------------------------------------------------------------------------------
pids=()
start_fsdp8() {  # preset
  local port=$((20000 + RANDOM % 20000)) d
  addr=127.0.0.1:$port
  rm -f "$OUT_DIR/coordinator-$1.db"
  # --start_timeout_s: a worker initialises a large model's shards before it is Ready (8b: 8 G
  # master weights drawn on the host).
  "$BIN/fsdp8-coordinator" --listen "$addr" --state_db "$OUT_DIR/coordinator-$1.db" --start_timeout_s 900 \
    --data_roots "$data" > "$OUT_DIR/coordinator-$1.log" 2>&1 & pids+=($!)
  sleep 1
  for ((d = 0; d < N; d++)); do
    "$BIN/fsdp8-worker" --coordinator "$addr" --host 127.0.0.1 --backend cuda --device "$d" \
      > "$OUT_DIR/worker-$1-$d.log" 2>&1 & pids+=($!)
  done
  for _ in $(seq 150); do
    [ "$("$BIN/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c '^w-')" -ge "$N" ] && return 0
    sleep 0.2
  done
  echo "fsdp8: fewer than $N workers registered after 30 s; see $OUT_DIR/worker-$1-*.log"
}
stop_fsdp8() {
  meter_stop
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  pids=()
}
trap stop_fsdp8 EXIT

fsdp8_job() {  # spec events-file: submit, then follow the job to its end
  local id
  id=$("$BIN/fsdp8" --coordinator "$addr" submit --no-watch "$1" 2> "${2%.events.jsonl}.submit.log" | head -1)
  timeout 900 "$BIN/fsdp8" --coordinator "$addr" watch --json "$id" > "$2"
}

run_fsdp8() {  # preset mode(driven|free) baseline-file
  local name=fsdp8-$1${LAYERS:+-L$LAYERS}-$2${VARIANT:+-$VARIANT} vocab warm steps
  vocab=$(vocab_of "$1"); warm=$(warmup_of "$1"); steps=$(steps_of "$1")
  local spec=$OUT_DIR/$name.yaml ev=$OUT_DIR/$name.events.jsonl m=$OUT_DIR/meter-$name.json
  echo "== fsdp8 $1 ($2; vocab $vocab, $N worker(s), $steps steps after $warm)"
  python3 "$tool" spec "$1" --world "$N" --steps $((steps + warm)) --vocab "$vocab" \
    ${LAYERS:+--layers "$LAYERS"} --data "$data/tokens-$vocab.bin" $([ "$2" = free ] && echo --free) \
    $(for s in ${SPEC_SET:-}; do echo --set "$s"; done) > "$spec" || {
    error_line system fsdp8 preset "$1" mode "$2" vocab "$vocab" error "no spec"; return; }
  meter_start "$m" "$3"
  # The memory plan's prediction for this spec (common/memory_plan.h), printed beside the measured
  # peaks by table.py.
  "$BIN/fsdp8" plan "$spec" --world-size "$N" --json > "$OUT_DIR/$name.plan.json" 2> /dev/null
  fsdp8_job "$spec" "$ev"
  local rc=$?
  meter_stop
  python3 "$tool" fsdp8-result "$ev" "$1" "$2${VARIANT:+-$VARIANT}" "$warm" --world "$N" --vocab "$vocab" \
    ${LAYERS:+--layers "$LAYERS"} --meter "$m" \
    --plan "$OUT_DIR/$name.plan.json" >> "$results"
  [ $rc -eq 0 ] || echo "fsdp8 $1 $2: watch rc $rc; last events: $(tail -2 "$ev")"
}

# A short job first, discarded: the first job on freshly started workers ran a constant ~2 ms per
# step slower than later ones (seen on 125m, whichever mode came first), which would be charged to
# the driven mode as coordinator overhead.
warm_fsdp8() {  # preset
  local spec=$OUT_DIR/fsdp8-$1-warmup.yaml vocab
  vocab=$(vocab_of "$1")
  echo "== fsdp8 $1 (warm-up job, not timed)"
  python3 "$tool" spec "$1" --world "$N" --steps 6 --vocab "$vocab" --data "$data/tokens-$vocab.bin" \
    ${LAYERS:+--layers "$LAYERS"} $(for s in ${SPEC_SET:-}; do echo --set "$s"; done) > "$spec" &&
    fsdp8_job "$spec" "$OUT_DIR/fsdp8-$1-warmup.events.jsonl"
}

run_fsdp8_preset() {  # preset: fresh workers, metered against the baseline before they started
  local vocab base=$OUT_DIR/meter-fsdp8-$1-baseline.json
  vocab=$(vocab_of "$1")
  [ -f "$data/tokens-$vocab.bin" ] || python3 "$tool" tokens "$data/tokens-$vocab.bin" "$vocab" || return
  python3 "$meter" baseline --devices "$meter_devices" --out "$base"
  start_fsdp8 "$1"
  [ "${SKIP_WARMUP_JOB:-0}" = 1 ] || warm_fsdp8 "$1"
  for m in $MODES; do run_fsdp8 "$1" "$m" "$base"; done
  stop_fsdp8
}

if [ "${SKIP_TORCH:-0}" != 1 ]; then
  for p in $PRESETS; do for x in $TORCH_PRECISIONS; do run_torch "$p" "$x"; done; done
fi
if [ "${SKIP_FSDP8:-0}" != 1 ]; then
  for p in $PRESETS; do run_fsdp8_preset "$p"; done
fi

python3 bench/gpu/table.py "$results" | tee "$OUT_DIR/table.md"
