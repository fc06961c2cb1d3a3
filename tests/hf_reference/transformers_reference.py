#!/usr/bin/env python3
"""Reference outputs of Hugging Face transformers for the checkpoints of make_weights.py.

For each variant: generates the checkpoint (make_weights.py, into a temporary directory unless
--weights is given), loads it with LlamaForCausalLM.from_pretrained (float32, eager attention,
TF32 off), and on its batch.json computes the logits, the mean next-token cross-entropy (nats per
token) and the gradients of that loss (one backward). Writes OUT_DIR/<variant>.json (a few tens of
KB each):
  loss; logits at every position for 16 vocabulary columns (linspace over the vocabulary) and the
  log-sum-exp of every position's full logits; per parameter tensor (Hugging Face name; a tied
  LM head is the embedding) 33 gradient elements (linspace over the flat tensor, and the largest
  |g|), max |g| and the L2 norm; the weights' SHA-256 (make_weights.py's), the versions and device.

On the GPU machine (no network needed):
    python3 tests/hf_reference/transformers_reference.py --all --out tests/hf_reference/fixtures
(--all includes vocab128k; without it the CPU variants only). Needs torch, transformers,
safetensors and numpy.
"""
import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_weights  # noqa: E402

LOGIT_COLUMNS = 16
GRAD_SAMPLES = 32


def grad_sample(g):
    flat = g.reshape(-1)
    idx = sorted(set(np.linspace(0, flat.size - 1, GRAD_SAMPLES).astype(np.int64).tolist()
                     + [int(np.argmax(np.abs(flat)))]))
    return {"indices": idx, "values": [float(flat[i]) for i in idx],
            "max_abs": float(np.max(np.abs(flat))), "l2": float(np.sqrt(np.sum(flat.astype(np.float64) ** 2)))}


def reference(model_dir, device):
    import torch
    import transformers
    from transformers import LlamaForCausalLM
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    except TypeError:  # transformers before `dtype`
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    model = model.to(device)
    model.train()
    batch = json.load(open(os.path.join(model_dir, "batch.json")))
    ids = torch.tensor(batch["input_ids"], dtype=torch.long, device=device)
    tg = torch.tensor(batch["targets"], dtype=torch.long, device=device)
    logits = model(input_ids=ids).logits.float()
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    loss = torch.nn.functional.cross_entropy(flat, tg.reshape(-1))
    loss.backward()
    cols = np.linspace(0, V - 1, LOGIT_COLUMNS).astype(np.int64).tolist()
    lg = flat.detach().cpu().numpy()
    out = {
        "weights_sha256": batch["weights_sha256"],
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": str(device) if device == "cpu" else torch.cuda.get_device_name(0),
        "loss": float(loss.item()),
        "logit_columns": cols,
        "logits": [[float(x) for x in row] for row in lg[:, cols]],
        "logsumexp": [float(x) for x in torch.logsumexp(flat.detach().double(), dim=-1).cpu().numpy()],
        "grads": {},
    }
    for name, p in model.named_parameters():
        out["grads"][name] = grad_sample(p.grad.detach().cpu().numpy())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for <variant>.json")
    ap.add_argument("--weights", help="make_weights.py output to use (default: a fresh temp dir)")
    ap.add_argument("--variant", action="append", choices=sorted(make_weights.VARIANTS))
    ap.add_argument("--all", action="store_true", help="also the gpu_only variants")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print("transformers_reference: needs torch and transformers (%s)" % e)
        return 2
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = a.variant or [n for n, v in make_weights.VARIANTS.items()
                          if not v.get("bench_only") and (a.all or not v.get("gpu_only"))]
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = a.weights or tmp
        for n in names:
            d = os.path.join(root, n)
            if not a.weights:
                make_weights.write_variant(n, root)
            r = reference(d, device)
            r["variant"] = n
            path = os.path.join(a.out, n + ".json")
            with open(path, "w") as f:
                json.dump(r, f, separators=(",", ":"))
            print("%s: loss %.6f on %s (transformers %s, torch %s) -> %s (%d bytes)"
                  % (n, r["loss"], r["device"], r["transformers_version"], r["torch_version"],
                     path, os.path.getsize(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
