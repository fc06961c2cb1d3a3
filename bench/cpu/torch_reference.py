#!/usr/bin/env python3
"""PyTorch CPU reference for fsdp8's CPU backend: the default model in FP32, one process.

The model of data/default-job.yaml (Llama semantics as fsdp8: RMSNorm eps 1e-5, RoPE theta 10000
in the rotate_half convention, causal SDPA, SwiGLU MLP, untied head, no biases; d 128, 4 layers,
4 heads, ffn 384, vocab 256, seq 256), 16 sequences per step of random byte tokens, AdamW
(lr 3e-3, weight decay 0.1) with gradient clipping at 1.0, all FP32, eager mode.

Prints one line: "torch <version> cpu fp32 threads N: tokens/s X (median step S s over K steps;
Y tokens per process-CPU second)". tokens/s = sequences * seq / median step time, after --warmup
untimed steps; Y divides by the process's CPU time instead (all threads), for shared hosts.

Run pinned, as bench/cpu/run.sh does: taskset -c 0,1 python3 bench/cpu/torch_reference.py --threads 2
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

D, LAYERS, HEADS, FFN, VOCAB, SEQ = 128, 4, 4, 384, 256, 256


def rope_tables(seq, hd, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.outer(torch.arange(seq).float(), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = nn.RMSNorm(D, eps=1e-5)
        self.n2 = nn.RMSNorm(D, eps=1e-5)
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, D, bias=False)
        self.v = nn.Linear(D, D, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.gate = nn.Linear(D, FFN, bias=False)
        self.up = nn.Linear(D, FFN, bias=False)
        self.down = nn.Linear(FFN, D, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, t, HEADS, -1).transpose(1, 2)
        k = self.k(h).view(b, t, HEADS, -1).transpose(1, 2)
        v = self.v(h).view(b, t, HEADS, -1).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(D, eps=1e-5)
        self.head = nn.Linear(D, VOCAB, bias=False)
        cos, sin = rope_tables(SEQ, D // HEADS)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1234)
    model = Llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    times = []
    cpu0 = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            cpu0 = time.process_time()
        tok = torch.randint(0, VOCAB, (args.batch, SEQ + 1), generator=gen)
        t0 = time.perf_counter()
        loss = model(tok[:, :-1], tok[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    med = statistics.median(times)
    tokens = args.batch * SEQ
    print(f"torch {torch.__version__} cpu fp32 threads {torch.get_num_threads()}: "
          f"tokens/s {tokens / med:.0f} (median step {med:.4f} s over {len(times)} steps; "
          f"{tokens * len(times) / cpu:.0f} tokens per process-CPU second)")


if __name__ == "__main__":
    main()
