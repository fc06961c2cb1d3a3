#!/usr/bin/env python3
"""External device-memory meter, the same for every system of the GPU benchmark.

Reads each GPU's used memory from outside the measured processes: NVML (`pynvml`, from the
nvidia-ml-py package), or, when that cannot be imported or initialised, `nvidia-smi
--query-gpu=memory.used` (MiB resolution, and slower: each poll is a process start). The figure is
the peak of (used - idle baseline) over the polls, per GPU, the baseline being taken before the
measured processes start; it counts what the processes hold on the device (CUDA context, allocator
pools, library workspaces), not only the bytes a framework says it allocated. Peaks shorter than
the poll interval can be missed.

  memmeter.py baseline --devices 0,1 --out base.json
      the idle baseline: the median of 5 samples 50 ms apart.
  memmeter.py watch --devices 0,1 --out peak.json [--baseline base.json] [--ready FILE]
                    [--interval 0.05]
      takes the baseline (unless given), creates FILE, polls until SIGTERM or SIGINT, then writes
      {"ext_peak_mem_bytes": max over GPUs of (peak - baseline), "ext_peak_per_gpu": [...],
       "ext_meter": "nvml" | "nvidia-smi", "ext_samples": polls, "ext_seconds": ...}.
  memmeter.py merge peak.json < line.json
      prints the JSON result line with the meter's fields added.

--devices lists NVML device indices or UUIDs (GPU-...), which are not CUDA's when
CUDA_VISIBLE_DEVICES is set (run.sh maps them). With neither NVML nor nvidia-smi, the outputs say so
in "ext_error" and the exit status is 0 (a benchmark without the meter still runs).
"""
import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
import warnings


class NvmlReader:
    name = "nvml"

    def __init__(self, devices):
        with warnings.catch_warnings():  # the pynvml shim package warns that it is deprecated
            warnings.simplefilter("ignore")
            import pynvml
        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByUUID(d) if d.startswith(("GPU-", "MIG-"))
                         else pynvml.nvmlDeviceGetHandleByIndex(int(d)) for d in devices]

    def used(self):
        return [int(self._nvml.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles]


class SmiReader:
    name = "nvidia-smi"

    def __init__(self, devices):
        self._cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                     "-i", ",".join(devices)]
        self._n = len(devices)
        self.used()  # fails here, not in the poll loop

    def used(self):
        out = subprocess.run(self._cmd, capture_output=True, text=True, timeout=10, check=True).stdout
        vals = [int(float(v)) * 1024 * 1024 for v in out.split()]
        if len(vals) != self._n:
            raise RuntimeError(f"nvidia-smi gave {len(vals)} values for {self._n} devices: {out!r}")
        return vals


def open_reader(devices):
    """NVML, else nvidia-smi; raises RuntimeError with both reasons when neither works."""
    errors = []
    for cls in (NvmlReader, SmiReader):
        try:
            return cls(devices)
        except Exception as e:  # noqa: BLE001 - any failure means: try the next reader
            errors.append(f"{cls.name}: {type(e).__name__}: {e}")
    raise RuntimeError("; ".join(errors))


def take_baseline(reader, samples=5, gap=0.05):
    polls = []
    for i in range(samples):
        if i:
            time.sleep(gap)
        polls.append(reader.used())
    return [int(statistics.median(col)) for col in zip(*polls)]


def watch(reader, baseline, interval, ready):
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    peak, n, t0 = list(baseline), 0, time.monotonic()
    if ready:
        open(ready, "w").close()
    while True:
        t = time.monotonic()
        peak = [max(a, b) for a, b in zip(peak, reader.used())]
        n += 1
        if stop:
            break
        time.sleep(max(0.0, interval - (time.monotonic() - t)))
    per_gpu = [p - b for p, b in zip(peak, baseline)]
    return dict(ext_peak_mem_bytes=max(per_gpu), ext_peak_per_gpu=per_gpu, ext_baseline_bytes=baseline,
                ext_meter=reader.name, ext_samples=n, ext_seconds=round(time.monotonic() - t0, 3))


def read_result(path):
    """The meter's fields from a watch output; {"ext_error": ...} when there is none."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return dict(ext_error=f"no meter result ({e})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("baseline", "watch"):
        a = sub.add_parser(name)
        a.add_argument("--devices", required=True, help="NVML indices or UUIDs, comma-separated")
        a.add_argument("--out", required=True)
        if name == "watch":
            a.add_argument("--baseline", help="a baseline output; default: take one now")
            a.add_argument("--ready", help="file created once polling has begun")
            a.add_argument("--interval", type=float, default=0.05, help="seconds between polls")
    a = sub.add_parser("merge")
    a.add_argument("meter")
    args = ap.parse_args()

    if args.cmd == "merge":
        meter = read_result(args.meter)
        for line in sys.stdin:
            if line.strip().startswith("{"):
                row = json.loads(line)
                row.update(meter)
                print(json.dumps(row))
        return
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    try:
        reader = open_reader(devices)
        if args.cmd == "baseline":
            result = dict(ext_baseline_bytes=take_baseline(reader), ext_meter=reader.name)
        else:
            base = read_result(args.baseline).get("ext_baseline_bytes") if args.baseline else None
            if base is None or len(base) != len(devices):
                base = take_baseline(reader)
            result = watch(reader, base, args.interval, args.ready)
    except Exception as e:  # noqa: BLE001 - reported in the output, the benchmark goes on
        result = dict(ext_error=f"{type(e).__name__}: {e}")
        if getattr(args, "ready", None):
            open(args.ready, "w").close()
    with open(args.out, "w") as f:
        json.dump(result, f)
        f.write("\n")


if __name__ == "__main__":
    main()
