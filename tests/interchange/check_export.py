#!/usr/bin/env python3
"""Reads `fsdp8 export` output with the `safetensors` package and checks every tensor's name,
shape, dtype and values against the checkpoint's rank files, parsed here from the format documented
in common/checkpoint_format.h with the tensor order of common/shard_plan.h (not through the exporter).

usage: check_export.py FIXTURE_BIN FSDP8_CLI WORK_DIR
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib

import numpy as np
import safetensors
from safetensors.numpy import load_file


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def plan_units(spec):
    """[(unit, [(wire, [(name, shape)])])] by the rule of common/shard_plan.h."""
    m = spec["model"]
    C, L, H, Hkv = m["d_model"], m["n_layers"], m["n_heads"], m["n_kv_heads"]
    F, V = m["ffn_dim"], m["vocab_size"]
    hd = C // H
    p = spec["precision"]
    wire = {"PRECISION_FP8": 0, "PRECISION_BF16": 1, "PRECISION_FP32": 2}
    overrides = {o.get("layer", 0): o["linears"] for o in p.get("overrides", [])}
    units = [("embedding", {wire[p["embedding"]]: [("model.embed_tokens.weight", (V, C))]})]
    for i in range(L):
        lin = overrides.get(i, p["linears"])
        w = wire[lin]
        norm_w = 2 if lin == "PRECISION_FP32" else 1
        pre = "model.layers.%d." % i
        bufs = {}
        order = [("input_layernorm.weight", (C,), norm_w),
                 ("self_attn.q_proj.weight", (C, C), w),
                 ("self_attn.k_proj.weight", (Hkv * hd, C), w),
                 ("self_attn.v_proj.weight", (Hkv * hd, C), w),
                 ("self_attn.o_proj.weight", (C, C), w),
                 ("post_attention_layernorm.weight", (C,), norm_w),
                 ("mlp.gate_proj.weight", (F, C), w),
                 ("mlp.up_proj.weight", (F, C), w),
                 ("mlp.down_proj.weight", (C, F), w)]
        for name, shape, wd in order:
            bufs.setdefault(wd, []).append((pre + name, shape))
        units.append(("layers.%d" % i, bufs))
    hw = wire[p["lm_head"]]
    units.append(("head", {hw: [("model.norm.weight", (C,)), ("lm_head.weight", (V, C))]}))
    return [(u, sorted(b.items())) for u, b in units]


def expected_from_rank_files(step_dir):
    man = json.load(open(os.path.join(step_dir, "MANIFEST")))
    world = man["world_size"]
    units = plan_units(man["spec"])
    buffers = [(u, w, ts) for u, bufs in units for w, ts in bufs]
    full = [[] for _ in buffers]
    for r, f in enumerate(man["files"]):
        blob = open(os.path.join(step_dir, f["file"]), "rb").read()
        if zlib.crc32(blob) != f["crc32"]:
            fail("rank file %s does not match its MANIFEST CRC-32" % f["file"])
        pos = 8
        version, rank, w, step, _fp = struct.unpack_from("<IiiqQ", blob, pos)
        pos += 28
        (dlen,) = struct.unpack_from("<I", blob, pos)
        pos += 4 + dlen
        (nbuf,) = struct.unpack_from("<I", blob, pos)
        pos += 4
        assert blob[:8] == b"FSDP8CKP" and version == 1 and rank == r and w == world
        assert nbuf == len(buffers), (nbuf, len(buffers))
        for k in range(nbuf):
            u, b, wire, _z, numel, padded, shard = struct.unpack_from("<IIIIqqq", blob, pos)
            pos += 40
            assert wire == buffers[k][1], (k, wire, buffers[k])
            master = np.frombuffer(blob, dtype="<f4", count=shard, offset=pos)
            pos += 3 * shard * 4  # master, AdamW m, v
            full[k].append(master)
    out = {}
    for k, (_u, _w, tensors) in enumerate(buffers):
        flat = np.concatenate(full[k])
        off = 0
        for name, shape in tensors:
            n = int(np.prod(shape))
            out[name] = (shape, flat[off:off + n].reshape(shape))
            off += n
    return man, out


def bf16_bits(x):
    """Round-to-nearest-even f32 -> bf16 bits, in numpy."""
    u = x.astype("<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    fixture, cli, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    subprocess.run([fixture, work], check=True, timeout=240, stdout=subprocess.DEVNULL)
    ckpt = os.path.join(work, "ckpt")
    f32_dir, bf16_dir = os.path.join(work, "hf_f32"), os.path.join(work, "hf_bf16")
    # The checkpoint root (newest step) and an explicit step directory.
    subprocess.run([cli, "export", ckpt, "--out", f32_dir], check=True, timeout=120)
    subprocess.run([cli, "export", os.path.join(ckpt, "step-2"), "--step", "2", "--out", bf16_dir,
                    "--dtype", "bf16"], check=True, timeout=120)
    bad = subprocess.run([cli, "export", ckpt, "--step", "7", "--out", os.path.join(work, "x")],
                         timeout=60, capture_output=True, text=True)
    if bad.returncode == 0 or "step-7" not in bad.stderr:
        fail("export of a missing step: rc %d, stderr %r" % (bad.returncode, bad.stderr))

    man, expected = expected_from_rank_files(os.path.join(ckpt, "step-2"))
    m = man["spec"]["model"]

    got = load_file(os.path.join(f32_dir, "model.safetensors"))
    if set(got) != set(expected):
        fail("F32 names differ: extra %s, missing %s" % (set(got) - set(expected),
                                                          set(expected) - set(got)))
    for name, (shape, want) in expected.items():
        t = got[name]
        if t.dtype != np.float32 or tuple(t.shape) != tuple(shape):
            fail("%s: %s %s, want float32 %s" % (name, t.dtype, t.shape, shape))
        if not np.array_equal(t.view("<u4"), want.view("<u4")):
            fail("%s: values differ (max |diff| %g)" % (name, np.abs(t - want).max()))
    with safetensors.safe_open(os.path.join(f32_dir, "model.safetensors"), framework="numpy") as f:
        meta = f.metadata()
        if meta.get("format") != "pt" or meta.get("fsdp8_step") != "2":
            fail("metadata %r" % meta)

    # BF16: numpy has no bfloat16, so take the raw bytes that safetensors hands back.
    raw = safetensors.deserialize(open(os.path.join(bf16_dir, "model.safetensors"), "rb").read())
    raw = {name: info for name, info in raw}
    if set(raw) != set(expected):
        fail("BF16 names differ")
    for name, (shape, want) in expected.items():
        info = raw[name]
        if info["dtype"] != "bfloat16" and info["dtype"] != "BF16":
            fail("%s: dtype %s, want BF16" % (name, info["dtype"]))
        if tuple(info["shape"]) != tuple(shape):
            fail("%s: shape %s, want %s" % (name, info["shape"], shape))
        bits = np.frombuffer(bytes(info["data"]), dtype="<u2").reshape(shape)
        if not np.array_equal(bits, bf16_bits(want)):
            fail("%s: BF16 values are not the nearest-even rounding of the master weights" % name)

    for d, dtype in ((f32_dir, "float32"), (bf16_dir, "bfloat16")):
        cfg = json.load(open(os.path.join(d, "config.json")))
        want = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": m["d_model"], "intermediate_size": m["ffn_dim"],
                "num_attention_heads": m["n_heads"], "num_key_value_heads": m["n_kv_heads"],
                "num_hidden_layers": m["n_layers"], "vocab_size": m["vocab_size"],
                "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_theta"],
                "max_position_embeddings": m["seq_len"], "tie_word_embeddings": False,
                "torch_dtype": dtype}
        for k, v in want.items():
            if cfg.get(k) != v:
                fail("%s/config.json %s = %r, want %r" % (d, k, cfg.get(k), v))
    n = sum(int(np.prod(s)) for s, _ in expected.values())
    print("OK: %d tensors, %d parameters; F32 bit-identical, BF16 nearest-even, config.json matches"
          % (len(expected), n))


if __name__ == "__main__":
    main()
