#!/usr/bin/env python3
"""Deterministic LlamaForCausalLM checkpoints for the transformers reference check.

For each variant, writes DIR/<variant>/: config.json (a LlamaConfig), the weights as float32
safetensors shards model-0000i-of-0000n.safetensors (n >= 2) with model.safetensors.index.json,
and batch.json (input_ids and next-token targets, B x T). Everything follows from the variant's
seed through numpy's PCG64 uniform doubles (Generator.random), a stream numpy keeps stable:
  linear weight (out, in):   U(-1, 1) / sqrt(in)
  embedding (V, C):          U(-1, 1) x embed_scale (1; tied: 0.25, as it is the LM head too)
  lm_head (V, C):            U(-1, 1) / sqrt(C)
  RMSNorm weight (C):        1 + 0.2 U(-1, 1)
  tokens:                    floor(U(0, 1) * V) for a (B, T + 1) array; input_ids = [:, :-1],
                             targets = [:, 1:]
drawn in that order, tensors in Hugging Face name order (embed_tokens, per layer input_layernorm,
q, k, v, o, post_attention_layernorm, gate, up, down; norm, lm_head), then the tokens. Shards (3, or the
variant's count) take the tensors in that order, round-robin by layer (the embedding, final norm
and head count as layer -1).

Variants (heads of 16 dimensions unless noted):
  tied         d 64, 2 layers, 4 heads, vocab 256, tie_word_embeddings, seq 32
  llama3_rope  d 64, 2 layers, rope_theta 500000, rope_scaling llama3 (factor 8, low 1, high 4,
               original_max_position_embeddings 64; its three frequency regimes all occur at
               head_dim 16), seq 96 beyond the original 64
  gqa          d 64, 2 layers, 8 query heads of 8 sharing 2 key/value heads, seq 32
  vocab128k    d 64, 2 layers, 4 heads / 2 kv heads, vocab 128256, Llama 3.1's rope_scaling
               (original 8192), seq 32: for the GPU machine (gpu_only)
  memory_1g    d 1024, 16 layers, 16 heads of 64, ffn 2816, vocab 32000, untied: 270 M parameters,
               1.08 GB of float32 in 6 shards, for bench/hf_import_memory.sh (bench_only)

usage: make_weights.py OUT_DIR [--variant NAME ...]   (default: every variant that is neither
       gpu_only nor bench_only; --all: those and the gpu_only ones)
"""
import argparse
import hashlib
import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=256, max_position_embeddings=128,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, rope_scaling=None)

VARIANTS = {
    "tied": dict(seed=101, batch=2, seq=32, embed_scale=0.25,
                 config=dict(tie_word_embeddings=True)),
    "llama3_rope": dict(seed=102, batch=2, seq=96, config=dict(
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    "gqa": dict(seed=103, batch=2, seq=32, config=dict(num_attention_heads=8,
                                                       num_key_value_heads=2)),
    "memory_1g": dict(seed=105, batch=1, seq=16, shards=6, bench_only=True, config=dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=32000)),
    "vocab128k": dict(seed=104, batch=1, seq=32, gpu_only=True, config=dict(
        vocab_size=128256, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192))),
}


def config_of(name):
    cfg = dict(BASE)
    cfg.update(VARIANTS[name]["config"])
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               attention_bias=False, mlp_bias=False,
               head_dim=cfg["hidden_size"] // cfg["num_attention_heads"], torch_dtype="float32")
    return cfg


def tensors_of(cfg, rng, embed_scale=1.0):
    """[(layer or -1, name, array)] in the documented order."""
    C, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = C // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def uniform(shape, scale):
        return ((rng.random(shape) * 2.0 - 1.0) * scale).astype(np.float32)

    def norm():
        return (1.0 + 0.2 * (rng.random(C) * 2.0 - 1.0)).astype(np.float32)

    out = [(-1, "model.embed_tokens.weight", uniform((V, C), embed_scale))]
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        out.append((i, p + "input_layernorm.weight", norm()))
        for n, o, k in (("q", C, C), ("k", kv, C), ("v", kv, C), ("o", C, C)):
            out.append((i, p + "self_attn.%s_proj.weight" % n, uniform((o, k), k ** -0.5)))
        out.append((i, p + "post_attention_layernorm.weight", norm()))
        for n, o, k in (("gate", F, C), ("up", F, C), ("down", C, F)):
            out.append((i, p + "mlp.%s_proj.weight" % n, uniform((o, k), k ** -0.5)))
    out.append((-1, "model.norm.weight", norm()))
    if not cfg["tie_word_embeddings"]:
        out.append((-1, "lm_head.weight", uniform((V, C), C ** -0.5)))
    return out


def write_variant(name, out_dir):
    v = VARIANTS[name]
    cfg = config_of(name)
    rng = np.random.Generator(np.random.PCG64(v["seed"]))
    tensors = tensors_of(cfg, rng, v.get("embed_scale", 1.0))
    ids = np.floor(rng.random((v["batch"], v["seq"] + 1)) * cfg["vocab_size"]).astype(np.int64)
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    n_shards = v.get("shards", 3)
    shards = [dict() for _ in range(n_shards)]
    for layer, tname, arr in tensors:
        shards[(layer + 1) % n_shards][tname] = arr
    weight_map, total, digest = {}, 0, hashlib.sha256()
    for i, s in enumerate(shards):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, n_shards)
        save_file(s, os.path.join(d, fname), metadata={"format": "pt"})
        for tname, arr in s.items():
            weight_map[tname] = fname
            total += arr.nbytes
    for _, tname, arr in tensors:
        digest.update(tname.encode())
        digest.update(np.ascontiguousarray(arr).tobytes())
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    batch = {"input_ids": ids[:, :-1].tolist(), "targets": ids[:, 1:].tolist(),
             "weights_sha256": digest.hexdigest()}
    with open(os.path.join(d, "batch.json"), "w") as f:
        json.dump(batch, f)
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args()
    names = a.variant or [n for n, v in VARIANTS.items()
                          if not v.get("bench_only") and (a.all or not v.get("gpu_only"))]
    for n in names:
        print(write_variant(n, a.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
