#!/usr/bin/env bash
# The cost model's scaling table (docs/cost-model.md): predicted tokens/s per GPU and weak-scaling
# efficiency of the l3proxy preset (vocab 128256) and the full Llama-3-8B shape (the 8b preset,
# 32 layers), one 8192-token sequence per GPU (global batch = GPUs), at 8, 64, 512 and 1,024 GPUs,
# flat FSDP (one shard group over every GPU) against hybrid sharding (replica groups of one host:
# 8 GPUs per shard group, R = GPUs / 8). `fsdp8 plan --predict` with CALIBRATION (default
# data/calibration/cuda-h100.json: an H100's micro-benchmarks, NVLink 4 within 8-GPU hosts and
# 400 Gb/s InfiniBand across them, published NCCL bus bandwidths). Nothing runs on a GPU.
# Efficiency: tokens/s/GPU over the same preset's at 8 GPUs, flat.
#
# Usage: bench/scaling-table.sh   Environment: PRESETS (default "l3proxy 8b"), GPUS (default
# "8 64 512 1024"), PER_HOST (GPUs per shard group of the hybrid mesh, default 8), BIN (build/bin).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BIN:-build/bin}
cal=${CALIBRATION:-data/calibration/cuda-h100.json}
per_host=${PER_HOST:-8}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "| preset | GPUs | mesh | step ms | compute | exposed comm | optimizer | tokens/s/GPU | efficiency |"
echo "|---|---|---|---|---|---|---|---|---|"
for preset in ${PRESETS:-l3proxy 8b}; do
  base=""
  for n in ${GPUS:-8 64 512 1024}; do
    python3 bench/gpu/benchtool.py spec "$preset" --world "$n" --steps 8 --vocab 128256 \
      --data /tmp/none > "$tmp/$preset-$n.yaml"
    meshes=1
    [ $((n / per_host)) -gt 1 ] && meshes="1 $((n / per_host))"
    for r in $meshes; do
      json=$("$bin/fsdp8" plan "$tmp/$preset-$n.yaml" --predict --world-size "$n" --replicas "$r" \
             --calibration "$cal" --json 2> /dev/null)
      line=$(python3 - "$json" "$preset" "$n" "$r" "$base" <<'PY'
import json, sys
j = json.loads(sys.argv[1]); preset, n, r, base = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
per_gpu = j["tokens_per_rank"] / (j["step_ms"] / 1e3)
eff = per_gpu / float(base) if base else 1.0
mesh = "flat" if r == 1 else f"hybrid {r} x {n // r}"
print(f"{per_gpu}\t| {preset} | {n} | {mesh} | {j['step_ms']:.1f} | {j['compute_ms']:.1f} | "
      f"{j['exposed_comm_ms']:.1f} | {j['optimizer_ms']:.1f} | {per_gpu:,.0f} | {eff:.3f} |")
PY
)
      [ -n "$base" ] || base=${line%%$'\t'*}
      echo "${line#*$'\t'}"
    done
  done
done
