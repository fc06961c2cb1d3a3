#!/usr/bin/env bash
# The memory plan's device figure against NVML's peak, on the GPUs present: the presets 1b and
# l3proxy as written, and the 8B shape (bench/presets/8b.yaml) at the largest layer count (at most
# its 32) whose plan the coordinator admits on this card (device_bytes <= the card's memory, as
# coordinator/memory_fit.cc decides). Each runs through bench/gpu/run.sh (fsdp8 only, driven mode),
# which meters the workers from outside (bench/gpu/memmeter.py) and prints the plan beside the
# meter; the table's "device ... by the meter" ratio is the figure this script is for.
#
#   BIN=.dev/gpu bench/gpu/plan-vs-nvml.sh
# Options (environment): BIN, OUT_DIR (default runs/plan-vs-nvml-<time>), PRESETS (default
# "1b l3proxy"), STEPS / WARMUP (default 4 / 2: the peak is reached in the first steps), NGPUS.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.dev/gpu}
[ -x "$BIN/fsdp8" ] || BIN=build/bin
export OUT_DIR=${OUT_DIR:-runs/plan-vs-nvml-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR"
N=${NGPUS:-$(nvidia-smi -L | wc -l)}
card=$(($(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0) << 20))

# The largest layer count of the 8B shape whose device figure fits the card.
largest=0
for layers in $(seq 32 -1 1); do
  sed "s/^\(  n_layers:\).*/\1 $layers/" bench/presets/8b.yaml > "$OUT_DIR/8b-L$layers.yaml"
  dev=$("$BIN/fsdp8" plan "$OUT_DIR/8b-L$layers.yaml" --world-size "$N" --json |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["device_bytes"])')
  if [ "$dev" -le "$card" ]; then largest=$layers; break; fi
done
echo "plan-vs-nvml: card $((card >> 20)) MiB; 8B shape admitted up to $largest layers"

export SKIP_TORCH=1 MODES=driven SKIP_WARMUP_JOB=1 STEPS=${STEPS:-4} WARMUP=${WARMUP:-2} BIN
PRESETS=${PRESETS:-1b l3proxy} bench/gpu/run.sh
[ "$largest" -gt 0 ] && PRESETS=8b LAYERS=$largest APPEND=1 bench/gpu/run.sh
