#!/usr/bin/env python3
"""PyTorch FSDP2 reference for the fsdp8 benchmark presets, written the way users write it.

Llama-style decoder (RMSNorm, RoPE, SwiGLU, untied head, no biases; grouped-query attention where the
preset has fewer KV heads than heads, through SDPA's enable_gqa), `fully_shard` per block and on the
root with BF16 parameters and FP32 gradient reduction, `torch.compile` of the whole model, SDPA
attention, fused AdamW (lr 3e-4), random tokens. Shapes: bench/gpu/presets.py.

  --precision bf16                nn.Linear in BF16.
  --precision fp8                 block linears through torch._scaled_mm with tensorwise dynamic
                                  scaling (x, w in E4M3 forward; dY in E5M2 backward; BF16 all-gather,
                                  as FSDP2 gathers the BF16 parameters and the cast happens inside the
                                  compiled step).
  --precision torchao-tensorwise  torchao float8 training: convert_to_float8_training with
                                  Float8LinearConfig(enable_fsdp_float8_all_gather=True) (FP8
                                  all-gather of the block weights) and
                                  precompute_float8_dynamic_scale_for_fsdp after each optimizer step.
  --precision torchao-rowwise     torchao float8 training, Float8LinearConfig.from_recipe_name("rowwise").
The torchao precisions convert every block linear; the LM head stays BF16. torchao (0.18.0 wheel) is
installed by bench/gpu/run.sh from .dev/wheels.

--layers N overrides the preset's layer count. Blocks are checkpointed (their activations recomputed
in the backward, torch.utils.checkpoint through checkpoint_wrapper, applied before fully_shard as
torchtitan does) where the preset says torch_recompute (the full Llama-3-8B) or with --recompute.
Running out of device memory prints a JSON line with error "out of memory" and exits with 3.

Timing: median of --steps timed steps after --warmup steps (defaults: the preset's), each step timed
between device synchronisations. Model FLOPs per token = 6 x (all parameters except the token
embedding) + 12 x layers x d x seq. Peak memory = torch.cuda.max_memory_allocated() (bytes
allocated) over the timed steps; max_memory_reserved is reported beside it.
All-gather / reduce-scatter bytes per step are those FSDP2 moves per rank: each sharded parameter
is gathered once in the forward and once in the backward (the root's parameters, kept unsharded
after the forward, once), gradients reduce-scattered once, in the dtypes named above.

Run with: torchrun --standalone --nproc_per_node N bench/gpu/fsdp2_reference.py --preset 1b
Prints one JSON line (rank 0) with the figures.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import presets  # noqa: E402

PRECISIONS = ["bf16", "fp8", "torchao-tensorwise", "torchao-rowwise"]


# ---- FP8 tensorwise linear through torch._scaled_mm --------------------------------------------
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
E5M2_MAX = torch.finfo(torch.float8_e5m2).max


def _to_fp8(t, dtype, fmax):
    amax = t.abs().max().float().clamp(min=1e-12)
    scale = fmax / amax
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype).contiguous()
    return q, scale.reciprocal()


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w):
        xq, xs = _to_fp8(x2, torch.float8_e4m3fn, E4M3_MAX)
        wq, ws = _to_fp8(w, torch.float8_e4m3fn, E4M3_MAX)
        ctx.save_for_backward(xq, xs, wq, ws)
        # y (M, N) = x (M, K) @ w^T; _scaled_mm wants A row-major, B column-major.
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, dy):
        xq, xs, wq, ws = ctx.saved_tensors
        dyq, dys = _to_fp8(dy, torch.float8_e5m2, E5M2_MAX)
        # dx (M, K) = dy (M, N) @ w (N, K)
        dx = torch._scaled_mm(dyq, wq.t().contiguous().t(), scale_a=dys, scale_b=ws,
                              out_dtype=torch.bfloat16)
        # dw (N, K) = dy^T (N, M) @ x (M, K)
        dw = torch._scaled_mm(dyq.t().contiguous(), xq.t().contiguous().t(), scale_a=dys,
                              scale_b=xs, out_dtype=torch.bfloat16)
        return dx, dw


class Fp8Linear(nn.Linear):
    def forward(self, x):
        shape = x.shape
        y = _Fp8Matmul.apply(x.reshape(-1, shape[-1]), self.weight)
        return y.reshape(*shape[:-1], self.out_features)


# ---- model ----------------------------------------------------------------------------------------
def llama3_inv_freq(inv, s):
    """Llama 3.1's RoPE scaling (rope_type "llama3") of the inverse frequencies `inv`: wavelengths
    above original / low_freq_factor are divided by factor, those below original /
    high_freq_factor kept, those between interpolated linearly in original / wavelength."""
    orig, lo, hi = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    t = (orig / wavelen - lo) / (hi - lo)
    between = (1 - t) * inv / s["factor"] + t * inv
    out = torch.where(wavelen > orig / lo, inv / s["factor"], inv)
    return torch.where((wavelen <= orig / lo) & (wavelen >= orig / hi), between, out)


def rope_tables(seq, hd, theta, device=None, scaling=None):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    if scaling:
        inv = llama3_inv_freq(inv, scaling)
    ang = torch.outer(torch.arange(seq, device=device).float(), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Block(nn.Module):
    def __init__(self, p, linear):
        super().__init__()
        d, hd = p["d"], presets.head_dim(p)
        self.heads, self.kv_heads = p["heads"], p["kv_heads"]
        self.n1 = nn.RMSNorm(d, eps=1e-5)
        self.n2 = nn.RMSNorm(d, eps=1e-5)
        self.q = linear(d, d, bias=False)
        self.k = linear(d, self.kv_heads * hd, bias=False)
        self.v = linear(d, self.kv_heads * hd, bias=False)
        self.o = linear(d, d, bias=False)
        self.gate = linear(d, p["ffn"], bias=False)
        self.up = linear(d, p["ffn"], bias=False)
        self.down = linear(p["ffn"], d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, -1).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, -1).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.kv_heads == self.heads:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, p, linear):
        super().__init__()
        self.vocab = p["vocab"]
        self.embed = nn.Embedding(self.vocab, p["d"])
        self.blocks = nn.ModuleList([Block(p, linear) for _ in range(p["layers"])])
        self.norm = nn.RMSNorm(p["d"], eps=1e-5)
        self.head = nn.Linear(p["d"], self.vocab, bias=False)
        cos, sin = rope_tables(p["seq"], presets.head_dim(p), p["rope_theta"],
                               scaling=p.get("rope_scaling"))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1))


# ---- torchao float8 -------------------------------------------------------------------------------
def convert_torchao(model, precision):
    """Swaps every block nn.Linear for torchao's Float8Linear (the LM head stays BF16)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    if precision == "torchao-tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = Float8LinearConfig.from_recipe_name("rowwise")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn != "head")


def after_optimizer_step(model, precision):
    if precision == "torchao-tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        precompute_float8_dynamic_scale_for_fsdp(model)


def torchao_version():
    try:
        from importlib.metadata import version
        return version("torchao")
    except Exception:  # noqa: BLE001 - not installed
        return None


# ---- benchmark ------------------------------------------------------------------------------------
def checkpoint_blocks(model):
    """Wraps every block in a non-reentrant activation checkpoint (recomputed in the backward)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, blk in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(blk, preserve_rng_state=False)


def build(p, precision, dev, recompute=False):
    """The FSDP2-sharded model with initialised parameters, and its optimizer."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    with torch.device("meta"):
        model = Llama(p, Fp8Linear if precision == "fp8" else nn.Linear)
    if precision.startswith("torchao-"):
        convert_torchao(model, precision)
    if recompute:
        checkpoint_blocks(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=dev)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "n1" in name or "n2" in name or name.startswith("norm"):
                prm.fill_(1.0)
            else:
                prm.normal_(0.0, 0.02)
        cos, sin = rope_tables(p["seq"], presets.head_dim(p), p["rope_theta"], device=dev,
                               scaling=p.get("rope_scaling"))
        model.cos.copy_(cos)
        model.sin.copy_(sin)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)


def comm_bytes(model, precision):
    """(all-gather, reduce-scatter) bytes per rank per step, as the module docstring counts them."""
    n_params = sum(prm.numel() for prm in model.parameters())
    block = sum(prm.numel() for prm in model.blocks.parameters())
    block_linear = sum(m.weight.numel() for m in model.blocks.modules() if isinstance(m, nn.Linear))
    root = n_params - block
    wire = 1 if precision == "torchao-tensorwise" else 2  # FP8 all-gather of the block linears
    ag = 2 * (wire * block_linear + 2 * (block - block_linear)) + 2 * root
    return ag, 4 * n_params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(presets.PRESETS), required=True)
    ap.add_argument("--precision", choices=PRECISIONS, default="bf16")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the preset's)")
    ap.add_argument("--warmup", type=int, help="warm-up steps (default: the preset's)")
    ap.add_argument("--steps", type=int, help="timed steps (default: the preset's)")
    ap.add_argument("--layers", type=int, help="layer count (default: the preset's)")
    ap.add_argument("--recompute", action="store_true",
                    help="checkpoint every block (default: the preset's torch_recompute)")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    p = presets.shape(args.preset, args.vocab, args.layers)
    try:
        run(args, p)
    except torch.OutOfMemoryError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps(dict(system="pytorch-fsdp2", preset=args.preset, precision=args.precision,
                                  vocab=p["vocab"], layers=p["layers"], params=presets.params(p),
                                  error="out of memory", detail=str(e).splitlines()[0][:300])),
                  flush=True)
        sys.exit(3)


def run(args, p):
    """Builds, warms up and times the model; rank 0 prints the figures as one JSON line."""
    recompute = args.recompute or p["torch_recompute"]
    warmup = p["warmup"] if args.warmup is None else args.warmup
    steps = p["steps"] if args.steps is None else args.steps

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda")
    torch.manual_seed(1234)
    model, opt = build(p, args.precision, dev, recompute)
    n_params = sum(prm.numel() for prm in model.parameters())
    n_embed = model.embed.weight.numel()
    if n_params - n_embed != presets.non_embedding_params(p):
        raise SystemExit(f"parameter count {n_params - n_embed} (without the embedding) differs from "
                         f"presets.non_embedding_params {presets.non_embedding_params(p)}")
    step_fn = model if args.no_compile else torch.compile(model)

    g = torch.Generator(device=dev)
    g.manual_seed(1234 + rank)
    B, T = p["batch"], p["seq"]

    def one_step():
        tok = torch.randint(0, p["vocab"], (B, T + 1), device=dev, generator=g)
        loss = step_fn(tok[:, :-1], tok[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_optimizer_step(model, args.precision)
        return loss

    t_compile = time.time()
    for _ in range(warmup):
        loss = one_step()
    torch.cuda.synchronize()
    t_compile = time.time() - t_compile
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = one_step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tok_s = B * T / med
    peaks = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()],
                         device=dev, dtype=torch.int64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    ag, rs = comm_bytes(model, args.precision)
    if rank == 0:
        print(json.dumps(dict(
            system="pytorch-fsdp2", preset=args.preset, precision=args.precision, world=world,
            vocab=p["vocab"], layers=p["layers"], recompute=recompute, tokens_per_s_per_gpu=tok_s,
            model_tflops_per_gpu=tok_s * presets.flops_per_token(p) / 1e12,
            peak_mem_bytes=int(peaks[0].item()), peak_reserved_bytes=int(peaks[1].item()),
            step_s_median=med, step_s_min=min(times), step_s_max=max(times), steps=steps,
            warmup=warmup, allgather_bytes_per_step=ag, reduce_scatter_bytes_per_step=rs,
            params=n_params, warmup_s=t_compile, final_loss=float(loss.item()),
            torch=torch.__version__, torchao=torchao_version())), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
