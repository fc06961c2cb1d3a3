#!/usr/bin/env python3
"""Prints the benchmark table of bench/gpu/run.sh from its results.jsonl: one row per system run.

tokens/s per GPU = sequences per GPU x seq / median step time; model FLOPs per token as in
bench/gpu/presets.py. "vs PyTorch BF16" compares with PyTorch FSDP2 BF16 on the same preset,
vocabulary and world size in the same results. Peak (external) is bench/gpu/memmeter.py's figure:
device memory used at the peak minus the idle baseline, per GPU (the largest GPU); peak (own count)
is what each system counts itself: torch.cuda.max_memory_allocated() (reserved in brackets) and
fsdp8's peak_memory_bytes. "vs shared" compares with the reference figures below (PyTorch FSDP2 and fsdp8 runs
published with the GPU build notes) for the same preset, vocabulary and world size (1 H200 2026-12-01, 2 H200 2026-11-29), where there is one.

Usage: table.py results.jsonl
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import presets  # noqa: E402

GiB = 1024 ** 3
# (preset, vocab, world, system key) -> tokens/s per GPU: the reference figures of the GPU build
# notes (1 H200 2026-12-01, 2 H200 2026-11-29).
SHARED = {
    ("125m", 32768, 2, "PyTorch bf16"): 209166, ("125m", 32768, 2, "PyTorch fp8"): 196454,
    ("1b", 32768, 2, "PyTorch bf16"): 55827, ("1b", 32768, 2, "PyTorch fp8"): 60308,
    ("1b", 32768, 1, "PyTorch bf16"): 56110, ("1b", 32768, 1, "PyTorch fp8"): 62028,
    ("1b", 32768, 1, "PyTorch torchao-tensorwise"): 61118,
    ("1b", 32768, 1, "PyTorch torchao-rowwise"): 55644, ("1b", 32768, 1, "fsdp8 driven"): 82316,
    ("l3proxy", 65536, 1, "PyTorch bf16"): 34523,
    ("l3proxy", 65536, 1, "PyTorch torchao-tensorwise"): 39682,
    ("l3proxy", 65536, 1, "fsdp8 driven"): 49186,
    ("l3proxy", 128256, 1, "PyTorch bf16"): 30755,
    ("l3proxy", 128256, 1, "PyTorch torchao-tensorwise"): 33705,
}


def system_key(r):
    if r.get("system") == "pytorch-fsdp2":
        return f"PyTorch {r.get('precision')}"
    return f"{r.get('system')} {r.get('mode')}"


def group_key(r):
    """(preset, vocab, world, layers): rows compared with each other."""
    p = presets.shape(r["preset"])
    return (r["preset"], int(r.get("vocab") or p["vocab"]), int(r.get("world") or 0),
            int(r.get("layers") or p["layers"]))


def tokens_per_s(r):
    return presets.shape(r["preset"])["batch"] * presets.shape(r["preset"])["seq"] / float(r["step_s_median"])


def gib(x):
    return "" if x is None else f"{int(x) / GiB:.1f}"


def mem(x):
    """Bytes as GiB, or MiB below one GiB."""
    x = int(x)
    return f"{x / GiB:.2f} GiB" if x >= GiB else f"{x / 2**20:.1f} MiB"


def row_cells(r, base):
    preset, vocab, world, layers = group_key(r)
    p = presets.shape(preset, vocab, layers)
    cells = [system_key(r), preset, str(vocab), str(world), str(layers), f"{presets.params(p) / 1e9:.2f}"]
    if "error" in r or "step_s_median" not in r:
        err = r.get("error", "no figures")
        return cells + [f"failed: {err if isinstance(err, str) else '; '.join(map(str, err))}"] + [""] * 7
    t = tokens_per_s(r)
    fpt = presets.flops_per_token(p)
    own = gib(r.get("peak_mem_bytes"))
    if r.get("peak_reserved_bytes"):
        own += f" ({gib(r['peak_reserved_bytes'])} reserved)"
    ext = gib(r.get("ext_peak_mem_bytes")) if "ext_peak_mem_bytes" in r else "n/a"
    ref = SHARED.get((preset, vocab, world, system_key(r))) if layers == presets.shape(preset)["layers"] else None
    return cells + [f"{t:,.0f}", f"{t / base:.3f}" if base else "", f"{t * fpt / 1e12:.0f}", ext, own,
                    f"{1e3 * float(r['step_s_median']):.1f}", f"{t / ref:.3f}" if ref else ""]


def fsdp8_notes(rows):
    out = []
    for r in rows:
        if r.get("system") != "fsdp8" or "error" in r or "step_s_median" not in r:
            continue
        g = group_key(r)
        ms = lambda x: f"{1e3 * float(x):.1f}"  # noqa: E731
        line = (f"fsdp8 {r['mode']} {g[0]}/{g[1]}/{g[2]}/L{g[3]}: step {ms(r['step_s_median'])} ms = compute "
                f"{ms(r['compute_s'])} + exposed comm {ms(r['comm_s'])} + optimizer {ms(r['optimizer_s'])}")
        free = next((f for f in rows if f.get("system") == "fsdp8" and f.get("mode") == "free"
                     and group_key(f) == g and "step_s_median" in f), None)
        if r["mode"] == "driven" and free is not None:
            over = float(r["step_s_median"]) - float(free["step_s_median"])
            line += f"; coordinator overhead {ms(over)} ms ({100 * over / float(r['step_s_median']):.2f}%)"
        if r.get("plan_peak_bytes"):
            own, ext = r.get("peak_mem_bytes"), r.get("ext_peak_mem_bytes")
            ratio = lambda a, b: f" ({float(a) / float(b):.3f}x)" if a and b else ""  # noqa: E731
            line += (f"; memory plan: own count {mem(r['plan_peak_bytes'])} predicted, "
                     f"{mem(own) if own else 'n/a'} measured{ratio(r['plan_peak_bytes'], own)}; "
                     f"device {mem(r['plan_device_bytes'])} predicted, {mem(ext) if ext else 'n/a'} "
                     f"by the meter{ratio(r['plan_device_bytes'], ext)}")
        pk = r.get("phase_peaks")
        if pk:
            line += (f"; peak GiB per phase: forward {gib(pk['forward'])}, backward {gib(pk['backward'])}, "
                     f"optimizer {gib(pk['optimizer'])}")
        out.append(line)
    return out


def main():
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
    rows = [r for r in rows if r.get("preset") in presets.PRESETS]
    base = {group_key(r): tokens_per_s(r) for r in rows
            if system_key(r) == "PyTorch bf16" and "step_s_median" in r and "error" not in r}
    print("| system | preset | vocab | world | layers | params (B) | tokens/s/GPU | vs PyTorch BF16 "
          "| model TFLOP/s/GPU | peak GiB (external) | peak GiB (own count) | step ms | vs shared |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(row_cells(r, base.get(group_key(r)))) + " |")
    print()
    for g in sorted({group_key(r) for r in rows}):
        print(f"- {presets.describe(g[0], presets.shape(g[0], g[1], g[3]))}; world size {g[2]}")
    meters = sorted({r["ext_meter"] for r in rows if r.get("ext_meter")})
    if meters:
        print(f"- external meter: {', '.join(meters)} (peak used minus idle baseline, per GPU)")
    for r in rows:
        if r.get("ext_error"):
            print(f"- {system_key(r)} {'/'.join(map(str, group_key(r)))}: no external figure: {r['ext_error']}")
    for line in fsdp8_notes(rows):
        print(f"- {line}")


if __name__ == "__main__":
    main()
