"""Writes llm.c token shards (the format of llm.c's dev/data/data_common.py; fsdp8 reads them).

A shard is a header of 256 little-endian int32 - header[0] the magic, header[1] the version,
header[2] the token count n (0 < n < 2**31), the rest 0 - followed by n little-endian tokens:

    version 1:    magic 20240520, version 1, uint16 tokens (vocabularies of at most 65536 ids)
    Llama 3:      magic 20240801, version 7, uint32 tokens

`dtype_for_vocab` picks the narrowest of the two for a vocabulary. `ShardSetWriter` streams tokens
into shards of a fixed size under temporary names and renames them all into place on `commit`, so
that a run that fails leaves no shard behind, whole or partial.

Thread-safety: a ShardSetWriter is used by one thread.
"""
import os
import re

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_SHARD_TOKENS = 2**31 - 1
# numpy dtype name -> (magic, version)
FORMATS = {"uint16": (20240520, 1), "uint32": (20240801, 7)}
PARTIAL_SUFFIX = ".partial"


def dtype_for_vocab(vocab_size):
    """'uint16' for a vocabulary of at most 65536 ids, else 'uint32'."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def shard_header(dtype, n_tokens):
    """The 1024 header bytes of a shard of n_tokens tokens of dtype ('uint16' or 'uint32')."""
    if not 0 <= n_tokens <= MAX_SHARD_TOKENS:
        raise ValueError(f"token count {n_tokens} outside [0, 2^31)")
    magic, version = FORMATS[dtype]
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = magic, version, n_tokens
    return header.tobytes()


def shard_name(split, index):
    """'train_000000.bin' for split 'train', index 0."""
    return f"{split}_{index:06d}.bin"


def existing_shards(out_dir, split):
    """Names of the files in out_dir that look like shards of split (split_NNNNNN.bin), sorted."""
    if not os.path.isdir(out_dir):
        return []
    pattern = re.compile(re.escape(split) + r"_\d{6,}\.bin")
    return sorted(n for n in os.listdir(out_dir) if pattern.fullmatch(n))


class ShardSetWriter:
    """Shards out_dir/<split>_000000.bin, ... of exactly shard_tokens tokens each (the last one
    holds the rest), dtype 'uint16' or 'uint32'. Values of `add` must fit the dtype (the caller
    checks). Until `commit` the shards exist only as hidden .partial files; `abort` removes them."""

    def __init__(self, out_dir, split, shard_tokens, dtype):
        if not 0 < shard_tokens <= MAX_SHARD_TOKENS:
            raise ValueError(f"shard_tokens must be in [1, 2^31) (got {shard_tokens})")
        self.out_dir, self.split, self.dtype = out_dir, split, np.dtype(dtype).newbyteorder("<")
        self._dtype_name = dtype
        self.shard_tokens = shard_tokens
        self.tokens = 0          # tokens added so far
        self.finals = []         # final paths of the shards written so far (closed or open)
        self._partials = []      # their temporary paths
        self._file = None        # the open shard
        self._in_file = 0        # tokens in the open shard

    def add(self, tokens):
        """Appends a 1-D array of token ids."""
        tokens = np.asarray(tokens)
        pos = 0
        while pos < len(tokens):
            if self._file is None:
                self._open_next()
            take = min(len(tokens) - pos, self.shard_tokens - self._in_file)
            self._file.write(tokens[pos:pos + take].astype(self.dtype, copy=False).tobytes())
            self._in_file += take
            pos += take
            if self._in_file == self.shard_tokens:
                self._close_current()
        self.tokens += len(tokens)

    def commit(self, remove_stale=False):
        """Finishes the last shard and renames every shard into place. With remove_stale, older
        shards of this split in out_dir that this run did not write are deleted first. Returns the
        shard paths."""
        if self._file is not None:
            self._close_current()
        if remove_stale:
            mine = {os.path.basename(p) for p in self.finals}
            for name in existing_shards(self.out_dir, self.split):
                if name not in mine:
                    os.unlink(os.path.join(self.out_dir, name))
        for partial, final in zip(self._partials, self.finals):
            os.replace(partial, final)
        self._partials = []
        return list(self.finals)

    def abort(self):
        """Removes every temporary shard file (safe to call more than once)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for partial in self._partials:
            try:
                os.unlink(partial)
            except FileNotFoundError:
                pass
        self._partials = []

    def _open_next(self):
        name = shard_name(self.split, len(self.finals))
        final = os.path.join(self.out_dir, name)
        partial = os.path.join(self.out_dir, "." + name + PARTIAL_SUFFIX)
        self.finals.append(final)
        self._partials.append(partial)
        self._file = open(partial, "wb")
        self._file.write(shard_header(self._dtype_name, 0))  # rewritten with the count on close
        self._in_file = 0

    def _close_current(self):
        self._file.seek(0)
        self._file.write(shard_header(self._dtype_name, self._in_file))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
