#!/usr/bin/env python3
"""Loads an `fsdp8 export` directory with Hugging Face transformers (LlamaForCausalLM) and checks
that its loss on fsdp8's validation batch matches fsdp8's own loss on it.

Inputs: HF_DIR (config.json + model.safetensors from `fsdp8 export`) and HF_DIR/fsdp8_val_batch.json
from `fsdp8-hf-eval --hf HF_DIR --tokens VAL.bin` (input_ids, targets, and fsdp8's loss with an
all-FP32 precision plan on the CPU backend).

The loss is the mean next-token cross-entropy in nats over batch x seq_len targets, computed here
from transformers' float32 logits (TF32 off, eager attention). Both sides are float32 evaluations of
the same weights and differ only by summation order and transcendental implementations, so the
tolerance is |hf - fsdp8| <= 1e-4 * |fsdp8| + 1e-5 (override with --rtol / --atol).

Exit status: 0 match, 1 mismatch, 2 transformers/torch missing or bad input.

usage: python3 tests/gpu/hf_check.py HF_DIR [--device cuda|cpu] [--rtol 1e-4] [--atol 1e-5]
"""
import argparse
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("hf_dir")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--atol", type=float, default=1e-5)
    args = ap.parse_args()
    try:
        import torch
        import transformers
        from transformers import LlamaForCausalLM
    except ImportError as e:
        print("hf_check: needs torch and transformers (%s); not run" % e)
        return 2
    batch_file = os.path.join(args.hf_dir, "fsdp8_val_batch.json")
    if not os.path.exists(batch_file):
        print("hf_check: %s missing: run fsdp8-hf-eval --hf %s --tokens VAL.bin first"
              % (batch_file, args.hf_dir))
        return 2
    batch = json.load(open(batch_file))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        model = LlamaForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    except TypeError:  # transformers before `dtype`
        model = LlamaForCausalLM.from_pretrained(args.hf_dir, torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    model = model.to(device).eval()
    ids = torch.tensor(batch["input_ids"], dtype=torch.long, device=device)
    tg = torch.tensor(batch["targets"], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 tg.reshape(-1)).item()
    ref = float(batch["loss"])
    diff = abs(loss - ref)
    tol = args.rtol * abs(ref) + args.atol
    ok = diff <= tol
    print("transformers %s, torch %s, %s: batch %d x %d" % (
        transformers.__version__, torch.__version__, device, ids.shape[0], ids.shape[1]))
    print("loss transformers %.7f  fsdp8 %.7f  |diff| %.3g  tolerance %.3g  %s" % (
        loss, ref, diff, tol, "MATCH" if ok else "MISMATCH"))
    if "loss_fp8_plan" in batch:
        print("(fsdp8 with its FP8 precision plan: %.7f, for information)" % batch["loss_fp8_plan"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
