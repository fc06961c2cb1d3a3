#!/usr/bin/env python3
"""Throughput of fsdp8-prepare (MB of text per second) with a byte-level BPE tokenizer.json and a
SentencePiece model, both trained here (vocabulary 32000) on the Debian fortunes corpus.

The corpus: every fortune of /usr/share/games/fortunes (files without .dat/.u8, split at the "%"
lines) is one document, written as JSONL and repeated until it holds at least --mb MB of text.
Prints fsdp8-prepare's summary line for each tokenizer.

Usage: PYTHONPATH=<installed SDK> python3 bench/prepare-throughput.py [--mb 50] [--workers 2]
(the SDK with its [prepare] extra, e.g. build/python after ctest's python_sdk_install).
"""
import argparse
import io
import json
import os
import subprocess
import sys
import tempfile

FORTUNES = "/usr/share/games/fortunes"


def fortunes():
    docs = []
    for name in sorted(os.listdir(FORTUNES)):
        if name.endswith((".dat", ".u8")) or not os.path.isfile(os.path.join(FORTUNES, name)):
            continue
        with open(os.path.join(FORTUNES, name), encoding="utf-8", errors="replace") as f:
            docs += [d.strip("\n") for d in f.read().split("\n%\n") if d.strip()]
    return docs


def write_corpus(path, docs, mb):
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    text_bytes = sum(len(d.encode()) for d in docs)
    repeats = -(-int(mb * 1e6) // text_bytes)
    with open(path, "w") as f:
        for _ in range(repeats):
            f.write(lines)
    return repeats * text_bytes


def train_tokenizers(docs, work):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import sentencepiece as spm
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=32000, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(os.path.join(work, "tokenizer.json"))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(  # Llama 2's kind: BPE with byte fallback
        sentence_iterator=iter(docs), model_writer=model, vocab_size=32000, model_type="bpe",
        byte_fallback=True, minloglevel=2)
    with open(os.path.join(work, "sp.model"), "wb") as f:
        f.write(model.getvalue())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=50)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fsdp8-prepare-bench-") as work:
        docs = fortunes()
        train_tokenizers(docs, work)
        corpus = os.path.join(work, "corpus.jsonl")
        mb = write_corpus(corpus, docs, args.mb) / 1e6
        print(f"corpus: {len(docs):,} fortunes, {mb:.1f} MB of text as JSONL; "
              f"{os.cpu_count()} cores", flush=True)
        for tok in ("tokenizer.json", "sp.model"):
            out = os.path.join(work, "out-" + tok)
            cmd = [sys.executable, "-m", "fsdp8.prepare", "--tokenizer", os.path.join(work, tok),
                   "--out", out, "--workers", str(args.workers), corpus]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr}")
            print(r.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
