"""Shapes of the GPU benchmark presets: the one place the PyTorch reference, the fsdp8 spec writer
and the table read them from (bench/presets/NAME.yaml carries the same shapes for fsdp8; the spec
writer checks that they agree). Torch-free.

batch is sequences per GPU; vocab the default vocabulary (a run may choose another); warmup and
steps the default warm-up and timed step counts; torch_recompute (default False): the PyTorch
reference checkpoints every block (recomputes its activations in the backward), as it must to fit
the full Llama-3-8B on one H200. A run may also choose another layer count (shape(layers=...)).

Model FLOPs per token = 6 x (all parameters except the token embedding; the LM head counts)
+ 12 x layers x d x seq (the attention score and value products, forward and backward).
"""

PRESETS = {
    # The default model (data/default-job.yaml: 0.92 M parameters), on CUDA.
    "default": dict(d=128, layers=4, heads=4, kv_heads=4, ffn=384, seq=256, batch=8,
                    vocab=256, rope_theta=10000.0, warmup=4, steps=12),
    "125m": dict(d=768, layers=12, heads=12, kv_heads=12, ffn=2048, seq=1024, batch=16,
                 vocab=32768, rope_theta=10000.0, warmup=4, steps=12),
    "1b": dict(d=2048, layers=24, heads=16, kv_heads=16, ffn=5632, seq=2048, batch=8,
               vocab=32768, rope_theta=10000.0, warmup=4, steps=12),
    # Llama-3-8B block shapes, 8 of its 32 layers; RoPE scaled as in Llama 3.1 8B's config.json.
    "l3proxy": dict(d=4096, layers=8, heads=32, kv_heads=8, ffn=14336, seq=8192, batch=1,
                    vocab=128256, rope_theta=500000.0, warmup=3, steps=8,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=8192)),
    # The full Llama-3-8B shape (32 layers); also the base of the largest-model search (other layer
    # counts: bench/gpu/run.sh's LAYERS).
    "8b": dict(d=4096, layers=32, heads=32, kv_heads=8, ffn=14336, seq=8192, batch=1,
               vocab=128256, rope_theta=500000.0, warmup=2, steps=4, torch_recompute=True,
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192)),
}


def shape(name, vocab=None, layers=None):
    """The preset's shape dict (a copy), with vocab and layers replaced when given. KeyError names
    the preset; ValueError a layer count below 1."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    p = dict(PRESETS[name])
    p.setdefault("torch_recompute", False)
    if vocab is not None:
        p["vocab"] = int(vocab)
    if layers is not None:
        if int(layers) < 1:
            raise ValueError(f"layers must be >= 1 (got {layers})")
        p["layers"] = int(layers)
    return p


def params(p):
    """Every parameter, the token embedding included (untied head)."""
    return non_embedding_params(p) + p["vocab"] * p["d"]


def head_dim(p):
    return p["d"] // p["heads"]


def block_linear_params(p):
    """Weights of one block's linears: q and o (d x d), k and v (d x kv_heads*head_dim), SwiGLU."""
    d, f, kv = p["d"], p["ffn"], p["kv_heads"] * head_dim(p)
    return 2 * d * d + 2 * d * kv + 3 * d * f


def non_embedding_params(p):
    """Blocks (linears + two RMSNorm weights), the final norm and the untied LM head."""
    d = p["d"]
    return p["layers"] * (block_linear_params(p) + 2 * d) + d + p["vocab"] * d


def flops_per_token(p):
    return 6 * non_embedding_params(p) + 12 * p["layers"] * p["d"] * p["seq"]


def describe(name, p):
    kv = f", {p['kv_heads']} KV heads" if p["kv_heads"] != p["heads"] else ""
    return (f"{name}: d {p['d']}, {p['layers']} layers, {p['heads']} heads{kv}, ffn {p['ffn']}, "
            f"vocab {p['vocab']}, seq {p['seq']}, {p['batch']} seq/GPU, rope_theta {p['rope_theta']:g}; "
            f"{flops_per_token(p) / 1e9:.2f} GFLOP/token")
