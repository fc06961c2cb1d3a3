#!/usr/bin/env bash
# Writes the cost model's calibration file (common/cost_model.h) from micro-benchmarks only:
#
#   BACKEND=cpu (default): fsdp8-bench-cpu-gemm --json (GEMM shape classes: fp8, bf16, fp32),
#     fsdp8-bench-cpu-ops --json (memory-bound passes' bandwidth, attention, AdamW) and
#     fsdp8-bench-cpu-step --collectives shm --world N for N = 2..MAX_RANKS (shared-memory
#     collectives' bus bandwidth by message size, ranks as threads); "cores" = the CPUs this
#     process may run on (the CPU ranks of a job share them); "host_slowdown" from
#     fsdp8-bench-cpu-ops --copies N for N = 1..MAX_COPIES (N synchronised processes running the
#     synthetic step): [N, the copies' wall seconds per step at N / one copy's CPU seconds per
#     step], the slowdown of each rank's work when N ranks share the host (its cores, caches and
#     memory bandwidth, and the waits where they meet). Default OUT data/calibration/cpu.json.
#   BACKEND=cuda (on the GPU machine; build with CUDA first): fsdp8-bench-cuda --calibration
#     (FP8 GEMMs through the backend, bf16 / f32 GEMMs, cuDNN attention, memory-bound passes,
#     AdamW), plus the collectives' published NCCL bus bandwidths (below, with their sources):
#     NVLink 4 within a host of 8 GPUs, 400 Gb/s InfiniBand (NDR, one NIC per GPU) across hosts.
#     Default OUT data/calibration/cuda-h100.json.
#
# Usage: bench/calibrate.sh [OUT]   Environment: BACKEND (cpu | cuda), BIN (the binaries' folder,
# default build/bin), MAX_RANKS (CPU collectives up to this many ranks, default 4), MAX_COPIES
# (the shared-host slowdown up to this many processes, default 3), DEVICE (CUDA
# device, default 0), LOG (BACKEND=cuda: keep fsdp8-bench-cuda's output there), STEP_OVERHEAD
# (0: skip bench/step-overhead.sh, the per-step round trip of a trivial job, "step_overhead_us"). Run on an otherwise idle machine: every figure is the best of 3 rounds; the
# CPU's compute figures are per CPU second of the (single-threaded) benchmark, so that a shared
# host's other processes do not slow them (the model predicts the step on cores of the ranks' own).
set -euo pipefail
cd "$(dirname "$0")/.."
backend=${BACKEND:-cpu}
bin=$(cd "${BIN:-build/bin}" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
case "$backend" in
  cpu)
    out=${1:-data/calibration/cpu.json}
    OMP_NUM_THREADS=1 "$bin/fsdp8-bench-cpu-gemm" --threads 1 --json > "$tmp/gemm.json"
    OMP_NUM_THREADS=1 "$bin/fsdp8-bench-cpu-ops" --threads 1 --json > "$tmp/ops.json"
    : > "$tmp/copies.list"
    for n in $(seq 1 "${MAX_COPIES:-3}"); do
      OMP_NUM_THREADS=1 "$bin/fsdp8-bench-cpu-ops" --threads 1 --copies "$n" >> "$tmp/copies.list"
    done
    : > "$tmp/coll.list"
    for n in $(seq 2 "${MAX_RANKS:-4}"); do
      "$bin/fsdp8-bench-cpu-step" --collectives shm --world "$n" > "$tmp/coll-$n.json"
      echo "$tmp/coll-$n.json" >> "$tmp/coll.list"
    done
    ;;
  cuda)
    out=${1:-data/calibration/cuda-h100.json}
    "$bin/fsdp8-bench-cuda" --device "${DEVICE:-0}" --calibration "$tmp/cuda.json" > "$tmp/cuda.log" ||
      { tail -20 "$tmp/cuda.log" >&2; exit 1; }
    [ -z "${LOG:-}" ] || cp "$tmp/cuda.log" "$LOG"
    ;;
  *) echo "BACKEND must be cpu or cuda" >&2; exit 2 ;;
esac
# The per-step costs of driving a job (the worker's handling; the coordinator's cycle), through
# a real coordinator and a CPU worker with a trivial model (bench/step-overhead.sh);
# STEP_OVERHEAD=0 leaves it out (the binaries fsdp8, fsdp8-coordinator, fsdp8-worker are needed).
echo '{}' > "$tmp/overhead.json"
if [ "${STEP_OVERHEAD:-1}" != 0 ]; then
  BIN=$bin bench/step-overhead.sh > "$tmp/overhead.json"
fi
mkdir -p "$(dirname "$out")"
python3 - "$backend" "$tmp" "$out" "$(nproc)" "$(date -u +%Y-%m-%d)" <<'PY'
import json, os, platform, sys
backend, tmp, out, cores, day = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]

def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()

if backend == "cpu":
    ops = json.load(open(os.path.join(tmp, "ops.json")))
    copies = [json.loads(line) for line in open(os.path.join(tmp, "copies.list")) if line.strip()]
    one_cpu = next(c["cpu_s"] for c in copies if c["processes"] == 1)
    cal = {
        "backend": "cpu",
        "device": f"{cpu_model()}, {cores} CPUs",
        "source": f"bench/calibrate.sh on {day}: fsdp8-bench-cpu-gemm --json, fsdp8-bench-cpu-ops "
                  "--json (best of 3 rounds, per CPU second of the benchmark), fsdp8-bench-cpu-step "
                  "--collectives shm (best of 3 rounds, wall clock), fsdp8-bench-cpu-ops --copies N "
                  "(host_slowdown: wall per step at N over CPU per step at 1)",
        "cores": cores,
        "ranks_per_host": 0,
        "intra_link": "shm",
        "inter_link": "shm",
        "memory_gbps": ops["memory_gbps"],
        "optimizer_gbps": ops["optimizer_gbps"],
        "attention": ops["attention"],
        "gemm": json.load(open(os.path.join(tmp, "gemm.json"))),
        "collectives": [c for path in open(os.path.join(tmp, "coll.list")).read().split()
                        for c in json.load(open(path))],
        "host_slowdown": [[c["processes"], round(c["wall_s"] / one_cpu, 4)] for c in copies],
        # The synthetic step's CPU seconds of one copy: the base the host_slowdown factors divide
        # by (bench/predict-vs-run.sh remeasures the factor before each run against it).
        "host_step_cpu_s": one_cpu,
    }
else:
    cal = json.load(open(os.path.join(tmp, "cuda.json")))
    # Published NCCL bus bandwidths (nccl-tests' busbw, doc/PERFORMANCE.md), time = latency +
    # bytes * f / busbw:
    # - NVLink 4 (H100 SXM, NVSwitch, 8 GPUs): "450GB/s is the line rate. With the protocol
    #   overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s, which you can observe
    #   as BusBw when running non-allreduce operations"; all-reduce with NVLink SHARP reaches "a peak
    #   busBw of ~480GB/s" on 8 GPUs (S. Jeaugey, NCCL, github.com/NVIDIA/nccl-tests/issues/212,
    #   2024-05-06); 476 GB/s single-node all-reduce "in the expected range for H100"
    #   (github.com/NVIDIA/nccl-tests/issues/290, 2025-03-03). Latency 15 us: an assumption of
    #   this file (small-message NCCL time within a host), not a published figure.
    # - 400 Gb/s InfiniBand (NDR, ConnectX-7, one NIC per GPU): "For NDR @ 400Gbps you should see
    #   46-48GB/s per NIC" (github.com/NVIDIA/nccl-tests/issues/290); latency 46 us: the small
    #   message all-reduce time of 2 nodes x 8 GPUs over NDR (github.com/NVIDIA/nccl/issues/1244,
    #   2024-04-09, 46-48 us for 4 B to 1 KiB).
    def curves(link, latency_us, busbw):
        return [{"link": link, "op": op, "ranks": 0, "latency_us": latency_us,
                 "points": [[1 << 30, bw]]} for op, bw in busbw.items()]
    cal.update({
        "source": f"bench/calibrate.sh BACKEND=cuda on {day}: fsdp8-bench-cuda --calibration "
                  "(median of 21); collectives: published NCCL busbw (nccl-tests issues 212, 290; "
                  "nccl issue 1244), see bench/calibrate.sh",
        "cores": 0,
        "ranks_per_host": 8,
        "intra_link": "nvlink4",
        "inter_link": "ib400",
        "collectives": curves("nvlink4", 15, {"all_gather": 370, "reduce_scatter": 370,
                                              "all_reduce": 480})
                       + curves("ib400", 46, {"all_gather": 46, "reduce_scatter": 46,
                                              "all_reduce": 46}),
    })
overhead = json.load(open(os.path.join(tmp, "overhead.json")))
if "step_overhead_us" in overhead:
    cal["step_overhead_us"] = overhead["step_overhead_us"]
    cal["step_cycle_us"] = overhead["step_cycle_us"]
    cal["source"] += ("; step_overhead_us, step_cycle_us: bench/step-overhead.sh (trivial job, "
                      "free-running and driven, medians)")
with open(out, "w") as f:
    json.dump(cal, f, indent=1)
    f.write("\n")
print(f"calibration written to {out}")
PY
