#!/usr/bin/env python3
"""fsdp8 against Hugging Face transformers: for every committed fixture (fixtures/<variant>.json,
written by transformers_reference.py from transformers' float32 outputs), regenerates the
variant's checkpoint with make_weights.py (checking its SHA-256 against the fixture's), runs
fsdp8-hf-reference on it (one CPU rank, all-FP32 plan, the sharded checkpoint read through
init.from_hf) and compares. Prints the largest differences found.

Tolerances. Both sides evaluate the same float32 weights in float32 and differ only in summation
order (GEMM blocking, attention, reductions) and in exp/log/sin/cos implementations, each a
relative error of a few float32 ulps (2^-24 ~ 6e-8) per operation, accumulated through 2 blocks of
<= 128-term dot products and a softmax. Measured against transformers 5.24 / torch 2.15 on CPU:
logits within 1.5e-6 absolute (2e-7 of max |logit|), loss within 3e-7, gradient elements within
1.3e-8 (1e-6 of max |g|). The bounds below are 20-50x over that (room for a GPU's other summation
order, TF32 off) and far below what a real difference gives (plain RoPE on the llama3 variant
exceeds the logit bound 350x, a missing tie or an unscaled gradient by more):
  loss:        |d| <= 1e-5 * |loss|
  logits:      |d| <= 2e-5 * max |logit| of the variant (per element), and the same for the
               log-sum-exp of every position (which covers the whole vocabulary)
  gradients:   |d| <= 5e-5 * max |g| of that tensor (per sampled element), and max |g| and the
               L2 norm within 5e-5 relative

Exit status: 0 all match; 1 a mismatch or error (a usage error too); 77 (ctest's skip code) no
fixture committed yet.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

LOSS_RTOL = 1e-5
LOGIT_RTOL = 2e-5
GRAD_RTOL = 5e-5


def compare(name, ref, got):
    """[(what, worst ratio of |d| to its bound, |d|)] and the failures."""
    fails, worst = [], {}

    def check(what, d, bound):
        r = d / bound if bound > 0 else (0.0 if d == 0 else float("inf"))
        if r > worst.get(what, (0, 0))[0]:
            worst[what] = (r, d)
        if not d <= bound:
            fails.append("%s: %s differs by %.3g (bound %.3g)" % (name, what, d, bound))

    check("loss", abs(ref["loss"] - got["loss"]), LOSS_RTOL * abs(ref["loss"]))
    scale = max(abs(x) for row in ref["logits"] for x in row)
    for i, (a, b) in enumerate(zip(ref["logits"], got["logits"])):
        for x, y in zip(a, b):
            check("logits", abs(x - y), LOGIT_RTOL * scale)
    if len(ref["logits"]) != len(got["logits"]):
        fails.append("%s: %d logit rows, the fixture has %d" % (name, len(got["logits"]), len(ref["logits"])))
    for x, y in zip(ref["logsumexp"], got["logsumexp"]):
        check("logsumexp", abs(x - y), LOGIT_RTOL * scale)
    for t, g in ref["grads"].items():
        h = got["grads"][t]
        bound = GRAD_RTOL * g["max_abs"]
        for x, y in zip(g["values"], h["values"]):
            check("grad elements", abs(x - y), bound)
        check("grad max_abs", abs(g["max_abs"] - h["max_abs"]), GRAD_RTOL * g["max_abs"])
        check("grad l2", abs(g["l2"] - h["l2"]), GRAD_RTOL * g["l2"])
    return worst, fails


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary", metavar="FSDP8_HF_REFERENCE_BIN")
    ap.add_argument("work", metavar="WORK_DIR")
    ap.add_argument("--all", action="store_true",
                    help="the gpu_only variants too (vocabulary 128256: run on the GPU machine, "
                         "where its fixture was made; fsdp8's side still runs on one CPU rank)")
    return ap.parse_args()


def main():
    try:
        a = parse_args()
    except SystemExit as e:  # --help: 0; a usage error: 1, as any other failure of the check
        return 0 if e.code == 0 else 1
    binary, work, include_gpu_only = a.binary, a.work, a.all
    fixtures_dir = os.path.join(HERE, "fixtures")
    names = sorted(f[:-5] for f in os.listdir(fixtures_dir) if f.endswith(".json")) \
        if os.path.isdir(fixtures_dir) else []
    if not names:
        print("SKIPPED: no fixtures in %s yet: run on a machine with torch and transformers\n"
              "  python3 tests/hf_reference/transformers_reference.py --all --out %s\n"
              "and commit the files it writes." % (fixtures_dir, "tests/hf_reference/fixtures"))
        return 77
    import make_weights
    os.makedirs(work, exist_ok=True)
    failures = []
    for name in list(names):
        if make_weights.VARIANTS[name].get("gpu_only") and not include_gpu_only:
            print("%s: not checked here (gpu_only: vocabulary 128256)" % name)
            names.remove(name)
            continue
        ref = json.load(open(os.path.join(fixtures_dir, name + ".json")))
        d = make_weights.write_variant(name, work)
        batch = json.load(open(os.path.join(d, "batch.json")))
        if batch["weights_sha256"] != ref["weights_sha256"]:
            failures.append("%s: regenerated weights differ from the fixture's (SHA-256 %s, fixture "
                            "%s): numpy's stream or make_weights.py changed"
                            % (name, batch["weights_sha256"], ref["weights_sha256"]))
            continue
        out = os.path.join(work, name + ".fsdp8.json")
        r = subprocess.run([binary, "--hf", d, "--fixture", os.path.join(fixtures_dir, name + ".json"),
                            "--out", out], capture_output=True, text=True)
        if r.returncode != 0:
            failures.append("%s: fsdp8-hf-reference failed: %s" % (name, r.stderr.strip()))
            continue
        worst, fails = compare(name, ref, json.load(open(out)))
        failures += fails
        print("%s (transformers %s, %s): loss %.6f vs %.6f; largest differences: %s" % (
            name, ref["transformers_version"], ref["device"], ref["loss"],
            json.load(open(out))["loss"],
            ", ".join("%s %.3g (%.2g of the bound)" % (k, v[1], v[0]) for k, v in sorted(worst.items()))))
    for f in failures:
        print("FAIL: " + f)
    print("%d passed, %d failed" % (len(names) - len({f.split(":")[0] for f in failures}),
                                    len({f.split(":")[0] for f in failures})))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
