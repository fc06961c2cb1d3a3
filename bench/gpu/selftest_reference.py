#!/usr/bin/env python3
"""CPU checks of bench/gpu/fsdp2_reference.py (run by bench/gpu/selftest.sh when torch imports):

- every preset's model has the parameter count presets.py's FLOP formula assumes;
- a GQA block equals the same block computed with k and v repeated to every head (plain SDPA);
- the RoPE table uses rope_theta;
- the torchao precisions (when torchao imports) convert every block linear and leave the LM head;
- build() + 3 steps + after_optimizer_step run under FSDP2 on a 1-rank gloo group for bf16, fp8
  and torchao-tensorwise (rowwise needs the GPU: CPU _scaled_mm takes per-tensor scales only), and
  the FP8 all-gather saves exactly one byte per block-linear weight per gather.
Prints "reference: ok".
"""
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp2_reference as R  # noqa: E402
import presets  # noqa: E402

TINY = dict(d=64, layers=2, heads=8, kv_heads=2, ffn=96, seq=32, batch=2, vocab=70000, rope_theta=500000.0)


def check_param_counts():
    for name in presets.PRESETS:
        for vocab in (None, 65536):
            p = presets.shape(name, vocab)
            with torch.device("meta"):
                m = R.Llama(p, nn.Linear)
            n = sum(x.numel() for x in m.parameters()) - m.embed.weight.numel()
            assert n == presets.non_embedding_params(p), (name, vocab, n)


def check_gqa_block():
    torch.manual_seed(0)
    m = R.Llama(TINY, nn.Linear)
    blk, x = m.blocks[0], torch.randn(2, TINY["seq"], TINY["d"])
    b, t, d = x.shape
    rep = TINY["heads"] // TINY["kv_heads"]
    h = blk.n1(x)
    q = blk.q(h).view(b, t, TINY["heads"], -1).transpose(1, 2)
    k = blk.k(h).view(b, t, TINY["kv_heads"], -1).transpose(1, 2)
    v = blk.v(h).view(b, t, TINY["kv_heads"], -1).transpose(1, 2)
    q = q * m.cos + R.rotate_half(q) * m.sin
    k = (k * m.cos + R.rotate_half(k) * m.sin).repeat_interleave(rep, dim=1)
    a = F.scaled_dot_product_attention(q, k, v.repeat_interleave(rep, dim=1), is_causal=True)
    x1 = x + blk.o(a.transpose(1, 2).reshape(b, t, d))
    h = blk.n2(x1)
    want = x1 + blk.down(F.silu(blk.gate(h)) * blk.up(h))
    got = blk(x, m.cos, m.sin)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    cos, _ = R.rope_tables(16, 8, 500000.0)
    assert abs(cos[3, 1].item() - math.cos(3 * 500000.0 ** (-2 / 8))) < 1e-6


def have_torchao():
    try:
        import torchao.float8  # noqa: F401
        return True
    except ImportError:
        return False


def check_torchao_conversion():
    for prec in ("torchao-tensorwise", "torchao-rowwise"):
        with torch.device("meta"):
            m = R.Llama(presets.shape("l3proxy"), nn.Linear)
        R.convert_torchao(m, prec)
        kinds = {n: type(mod).__name__ for n, mod in m.named_modules() if isinstance(mod, nn.Linear)}
        assert kinds.pop("head") == "Linear", prec
        assert len(kinds) == 7 * 8 and set(kinds.values()) == {"Float8Linear"}, (prec, kinds)


def check_fsdp_steps(precisions):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ag = {}
    for prec in precisions:
        torch.manual_seed(0)
        model, opt = R.build(TINY, prec, torch.device("cpu"))
        for _ in range(3):
            tok = torch.randint(0, TINY["vocab"], (2, TINY["seq"] + 1))
            loss = model(tok[:, :-1], tok[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            R.after_optimizer_step(model, prec)
        assert math.isfinite(loss.item()) and abs(loss.item() - math.log(TINY["vocab"])) < 1.0, (prec, loss)
        ag[prec] = R.comm_bytes(model, prec)[0]
    dist.destroy_process_group()
    if "torchao-tensorwise" in ag:
        block_linear = TINY["layers"] * presets.block_linear_params(TINY)
        assert ag["bf16"] - ag["torchao-tensorwise"] == 2 * block_linear, ag


def main():
    check_param_counts()
    check_gqa_block()
    precisions = ["bf16", "fp8"]
    if have_torchao():
        check_torchao_conversion()
        precisions.append("torchao-tensorwise")
    else:
        print("reference: torchao not importable, its checks skipped")
    check_fsdp_steps(precisions)
    print("reference: ok")


if __name__ == "__main__":
    main()
