#!/usr/bin/env python3
"""Byte-level token shards of the Linux kernel documentation, a second real corpus.

Reads the reStructuredText sources of Debian's linux-doc-6.1 package (every *.rst.gz under
/usr/share/doc/linux-doc-6.1/Documentation), orders the documents by the SHA-1 of their path
relative to that directory (a fixed order that mixes the subsystems, so the held-out tail is not
one part of the tree), joins them with a blank line into one text file and runs
`fsdp8 prepare --val-fraction F` on it: every byte is a token (vocabulary 256) and the last
floor(F * bytes) bytes are the validation split (val.bin), the rest train.bin.

Usage: bench/kernel-docs/prepare.py [--cli build/bin/fsdp8] [--out data/kernel-docs]
                                    [--val-fraction 0.05] [--src DIR]
Needs: apt-get install linux-doc-6.1 (not in scripts/install-deps.sh: no test reads it).
"""
import argparse
import gzip
import hashlib
import os
import subprocess
import sys
import tempfile

SRC = "/usr/share/doc/linux-doc-6.1/Documentation"


def documents(src):
    """Paths of every *.rst.gz under src, in the SHA-1 order of their relative paths."""
    found = []
    for root, _, names in os.walk(src):
        for name in names:
            if name.endswith(".rst.gz"):
                found.append(os.path.relpath(os.path.join(root, name), src))
    found.sort(key=lambda rel: hashlib.sha1(rel.encode()).hexdigest())
    return [os.path.join(src, rel) for rel in found]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", default=os.path.join(root, "build/bin/fsdp8"))
    ap.add_argument("--out", default=os.path.join(root, "data/kernel-docs"))
    ap.add_argument("--val-fraction", default="0.05")
    ap.add_argument("--src", default=SRC)
    args = ap.parse_args()
    if not os.path.isdir(args.src):
        sys.exit(f"prepare: {args.src} missing (apt-get install linux-doc-6.1)")
    docs = documents(args.src)
    if not docs:
        sys.exit(f"prepare: no *.rst.gz under {args.src}")
    with tempfile.TemporaryDirectory() as tmp:
        text = os.path.join(tmp, "kernel-docs.rst")
        size = 0
        with open(text, "wb") as out:
            for i, path in enumerate(docs):
                with gzip.open(path, "rb") as f:
                    data = f.read()
                out.write(data if i == 0 else b"\n\n" + data)
                size += len(data) + (0 if i == 0 else 2)
        print(f"prepare: {len(docs)} documents, {size} bytes of text", flush=True)
        subprocess.run([args.cli, "prepare", "--out", args.out, "--val-fraction",
                        args.val_fraction, text], check=True)


if __name__ == "__main__":
    main()
