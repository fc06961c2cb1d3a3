#!/usr/bin/env python3
"""BPE token shards of the Linux kernel documentation: a tokenizer trained on the corpus itself.

The text is prepare.py's, byte for byte: the reStructuredText sources of Debian's linux-doc-6.1
(every *.rst.gz under /usr/share/doc/linux-doc-6.1/Documentation) in the SHA-1 order of their
paths, joined by a blank line. The held-out tail is prepare.py's too: the last floor(F * bytes)
bytes (F = --val-fraction, default 0.05) are validation text, the rest training text (the cut moved
forward to the next UTF-8 character boundary when it falls inside a character; the corpus is
UTF-8).

1. Tokenizer: a byte-level BPE of --vocab-size ids (default 16,384) trained with the `tokenizers`
   package on the training text only (the held-out tail is never seen): the GPT-2 pre-tokenizer
   (ByteLevel, no prefix space), the 256 byte symbols as the initial alphabet, one special token
   <|endoftext|> (id 0; the end-of-text separator, as GPT-2), merges up to the vocabulary size
   (min_frequency 2). The documents are fed in their fixed order, so the result is the same on
   every run (bpe.py checks nothing else: `sha256sum OUT/tokenizer.json` compares two runs).
   Written to OUT/tokenizer.json with a tokenizer_config.json beside it.
2. Shards: `fsdp8 prepare --tokenizer OUT/tokenizer.json --val-fraction 0.5 --no-bos
   --eos-token <|endoftext|> train.txt val.txt`. The two files are two documents; fsdp8-prepare
   holds out document g when floor((g + 1) F) > floor(g F), which at F = 0.5 is document 1: the
   training text becomes OUT/train_000000.bin (its tokens then <|endoftext|>) and the held-out tail
   OUT/val_000000.bin. fsdp8-prepare also writes OUT/tokenizer/ (the tokenizer record).
3. The validation shard is cut to a whole number of validation batches: 1 + --batch x E x
   --seq-len tokens (E as large as fits), i.e. exactly --batch x E windows of --seq-len + 1 tokens
   (docs/data.md). An evaluation of training.eval_batches = E batches of --batch sequences then reads
   every validation window once whatever training.seed is (the sampler permutes the windows by the
   seed), so runs at different seeds are judged on the same held-out tokens.
4. OUT/corpus.json: the counts (documents, bytes, tokens, windows, E, the tokenizer's sha256).

Usage: bench/kernel-docs/bpe.py [--cli build/bin/fsdp8] [--out .dev/corpus] [--vocab-size 16384]
                                [--val-fraction 0.05] [--seq-len 1024] [--batch 8] [--src DIR]
Needs: apt-get install linux-doc-6.1; the `tokenizers` package (pip install tokenizers); the CLI
(build/bin/fsdp8) and fsdp8-prepare on PATH (pip install './client/python[prepare]'). None of
them is in scripts/install-deps.sh: no test reads them. About a minute on two cores.
"""
import argparse
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import prepare  # noqa: E402  (documents(): the same files in the same order)

EOT = "<|endoftext|>"
HEADER_BYTES = 1024  # llm.c shard header: 256 int32 (docs/data.md)


def corpus_pieces(src):
    """The documents' texts as prepare.py joins them: the first as read, every later one with the
    blank line ("\\n\\n") that separates it from the one before in front."""
    pieces = []
    for i, path in enumerate(prepare.documents(src)):
        with gzip.open(path, "rb") as f:
            data = f.read()
        pieces.append(data if i == 0 else b"\n\n" + data)
    return pieces


def split_tail(pieces, val_fraction):
    """(training pieces, held-out bytes): the last floor(F * total) bytes held out, the cut moved
    forward past UTF-8 continuation bytes so that both sides are whole characters."""
    text = b"".join(pieces)
    cut = len(text) - int(val_fraction * len(text))
    while cut < len(text) and (text[cut] & 0xC0) == 0x80:
        cut += 1
    train, used = [], 0
    for p in pieces:
        if used + len(p) <= cut:
            train.append(p)
        elif used < cut:
            train.append(p[:cut - used])
        used += len(p)
    return train, text[cut:]


def train_tokenizer(train_pieces, vocab_size):
    """A byte-level BPE trained on train_pieces (bytes, UTF-8) in their order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((p.decode("utf-8") for p in train_pieces), trainer=trainer,
                            length=len(train_pieces))
    return tok


def shard_tokens(path):
    """(dtype, token count) of an llm.c shard, from its header."""
    header = np.fromfile(path, dtype="<i4", count=3)
    dtype = {20240520: "<u2", 20240801: "<u4"}[int(header[0])]
    return dtype, int(header[2])


def trim_val(path, seq_len, batch):
    """Cuts the shard at path to 1 + batch * E * seq_len tokens (E as large as fits); returns E."""
    dtype, n = shard_tokens(path)
    windows = (n - 1) // seq_len
    batches = windows // batch
    if batches == 0:
        sys.exit(f"bpe: {path}: {windows} windows of {seq_len + 1} tokens, fewer than --batch {batch}")
    keep = 1 + batches * batch * seq_len
    with open(path, "r+b") as f:
        header = np.fromfile(f, dtype="<i4", count=256)
        header[2] = keep
        f.seek(0)
        f.write(header.tobytes())
        f.truncate(HEADER_BYTES + keep * np.dtype(dtype).itemsize)
    return batches


def main():
    root = os.path.dirname(os.path.dirname(HERE))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", default=os.path.join(root, "build/bin/fsdp8"))
    ap.add_argument("--out", default=os.path.join(root, ".dev/corpus"))
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="training.global_batch of the jobs")
    ap.add_argument("--src", default=prepare.SRC)
    args = ap.parse_args()
    if not os.path.isdir(args.src):
        sys.exit(f"bpe: {args.src} missing (apt-get install linux-doc-6.1)")
    if not 0 < args.val_fraction < 1:
        sys.exit(f"bpe: --val-fraction must be in (0, 1) (got {args.val_fraction})")
    pieces = corpus_pieces(args.src)
    if not pieces:
        sys.exit(f"bpe: no *.rst.gz under {args.src}")
    train, val = split_tail(pieces, args.val_fraction)
    train_bytes = sum(len(p) for p in train)
    print(f"bpe: {len(pieces)} documents, {train_bytes + len(val)} bytes: {train_bytes} training, "
          f"{len(val)} held out", flush=True)

    os.makedirs(args.out, exist_ok=True)
    tok = train_tokenizer(train, args.vocab_size)
    tok_path = os.path.join(args.out, "tokenizer.json")
    tok.save(tok_path)
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT,
                   "bos_token": None, "model_max_length": args.seq_len}, f, indent=2)
    with open(tok_path, "rb") as f:
        tok_sha = hashlib.sha256(f.read()).hexdigest()
    print(f"bpe: tokenizer {tok_path}: {tok.get_vocab_size()} ids, sha256 {tok_sha}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, "train.txt"), os.path.join(tmp, "val.txt")]
        with open(paths[0], "wb") as f:
            for p in train:
                f.write(p)
        with open(paths[1], "wb") as f:
            f.write(val)
        subprocess.run([args.cli, "prepare", "--tokenizer", tok_path, "--out", args.out,
                        "--val-fraction", "0.5", "--no-bos", "--eos-token", EOT, "--workers", "2",
                        "--overwrite", *paths], check=True)

    train_shard = os.path.join(args.out, "train_000000.bin")
    val_shard = os.path.join(args.out, "val_000000.bin")
    _, n_train = shard_tokens(train_shard)
    _, n_val_full = shard_tokens(val_shard)
    eval_batches = trim_val(val_shard, args.seq_len, args.batch)
    _, n_val = shard_tokens(val_shard)
    counts = {
        "documents": len(pieces), "train_bytes": train_bytes, "val_bytes": len(val),
        "vocab_size": tok.get_vocab_size(), "tokenizer_sha256": tok_sha,
        "train_tokens": n_train, "train_windows": (n_train - 1) // args.seq_len,
        "val_tokens_prepared": n_val_full, "val_tokens": n_val,
        "val_windows": (n_val - 1) // args.seq_len, "seq_len": args.seq_len,
        "global_batch": args.batch, "eval_batches": eval_batches,
        "max_steps_1_5_epochs": int(1.5 * ((n_train - 1) // args.seq_len) / args.batch),
    }
    with open(os.path.join(args.out, "corpus.json"), "w") as f:
        json.dump(counts, f, indent=2)
    print(f"bpe: train {n_train} tokens ({train_bytes / n_train:.2f} bytes/token, "
          f"{counts['train_windows']} windows of {args.seq_len + 1}); val {n_val} tokens "
          f"(of {n_val_full}; {counts['val_windows']} windows = {eval_batches} batches of "
          f"{args.batch}); 1.5 epochs = {counts['max_steps_1_5_epochs']} steps of {args.batch}",
          flush=True)


if __name__ == "__main__":
    main()
