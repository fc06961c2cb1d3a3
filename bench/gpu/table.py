#!/usr/bin/env python3
"""Prints the benchmark table of bench/gpu/run.sh from its results.jsonl.

Model FLOPs per token = 6 x (all parameters except the token embedding; the LM head counts)
+ 12 x layers x d x seq (the attention score and value products), as in the reference numbers.
tokens/s per GPU = sequences per GPU x seq / median step time.
"""
import json
import sys

PRESETS = {
    "125m": dict(d=768, layers=12, heads=12, ffn=2048, seq=1024, batch=16),
    "1b": dict(d=2048, layers=24, heads=16, ffn=5632, seq=2048, batch=8),
}
VOCAB = 32768
GiB = 1024 ** 3


def shapes(p):
    d, L, f = p["d"], p["layers"], p["ffn"]
    block_linear = 4 * d * d + 3 * d * f
    non_embed = L * (block_linear + 2 * d) + d + VOCAB * d
    return block_linear, non_embed


def flops_per_token(p):
    return 6 * shapes(p)[1] + 12 * p["layers"] * p["d"] * p["seq"]


def main():
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
    for name, p in PRESETS.items():
        rs = [r for r in rows if r.get("preset") == name]
        if not rs:
            continue
        tok_step = p["batch"] * p["seq"]
        fpt = flops_per_token(p)
        print(f"\n### preset {name}: d {p['d']}, {p['layers']} layers, ffn {p['ffn']}, seq {p['seq']}, "
              f"{p['batch']} seq/GPU, 2 GPUs; {fpt / 1e9:.2f} GFLOP/token\n")
        print("| system | tokens/s/GPU | model TFLOP/s/GPU | vs torch BF16 | vs torch FP8 | peak mem GiB "
              "| all-gather GB/step | reduce-scatter GB/step | step ms | compute | exposed comm | optimizer | coordinator |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        tput = {}
        for r in rs:
            if "error" in r:
                print(f"| {r.get('system')} {r.get('mode', r.get('precision'))} | failed: {r['error']} |")
                continue
            if r["system"] == "pytorch-fsdp2":
                key = f"torch {r['precision']}"
            else:
                key = f"fsdp8 {r['mode']}"
            tput[key] = tok_step / r["step_s_median"]
        free = next((r for r in rs if r.get("mode") == "free" and "error" not in r), None)
        for r in rs:
            if "error" in r:
                continue
            key = f"torch {r['precision']}" if r["system"] == "pytorch-fsdp2" else f"fsdp8 {r['mode']}"
            t = tput[key]
            vb = t / tput["torch bf16"] if "torch bf16" in tput else float("nan")
            vf = t / tput["torch fp8"] if "torch fp8" in tput else float("nan")
            split = "| | | | "
            if r["system"] == "fsdp8":
                ms = lambda x: f"{1e3 * x:.1f}"
                coord = ""
                if r["mode"] == "driven" and free is not None:
                    over = r["step_s_median"] - free["step_s_median"]
                    coord = f"{ms(over)} ({100 * over / r['step_s_median']:.2f}%)"
                split = f"| {ms(r['compute_s'])} | {ms(r['comm_s'])} | {ms(r['optimizer_s'])} | {coord} "
            print(f"| {key} | {t:,.0f} | {t * fpt / 1e12:.0f} | {vb:.3f} | {vf:.3f} | "
                  f"{r['peak_mem_bytes'] / GiB:.1f} | {r['allgather_bytes_per_step'] / 1e9:.2f} | "
                  f"{r['reduce_scatter_bytes_per_step'] / 1e9:.2f} | {1e3 * r['step_s_median']:.1f} {split}|")
        for r in rs:
            if r.get("system") == "fsdp8" and "error" not in r and r.get("phase_peaks"):
                pk = r["phase_peaks"]
                print(f"\nfsdp8 {r['mode']}: peak memory per phase (GiB): forward {pk['forward'] / GiB:.1f}, "
                      f"backward {pk['backward'] / GiB:.1f}, optimizer {pk['optimizer'] / GiB:.1f}")
        # FP8 on the wire: all-gather bytes per block-linear parameter per gather. Blocks are
        # gathered twice a step (forward, backward); embedding and head (bf16) once.
        bl, _ = shapes(p)
        for r in rs:
            if r.get("system") == "fsdp8" and "error" not in r:
                other = 2 * (2 * VOCAB * p["d"]) + 2 * p["d"]  # embedding + head + final norm, bf16
                norms = 2 * p["layers"] * 2 * p["d"] * 2        # block norms, bf16, twice
                per = (r["allgather_bytes_per_step"] - other - norms) / (2 * p["layers"] * bl)
                print(f"\nfsdp8 {r['mode']}: all-gather bytes per FP8 block weight per gather = {per:.4f} "
                      "(1 byte/param expected; padding adds a few parts per million)")
                break


if __name__ == "__main__":
    main()
