"""fsdp8-prepare: text and JSONL files -> llm.c token shards, through a real tokenizer.

    fsdp8-prepare --tokenizer tokenizer.json --out /data/corpus [--val-fraction 0.05]
                  [--shard-tokens 100000000] [--text-field text] [--workers K] INPUTS...

Documents: a file ending in .jsonl holds one document per line, the string in the field
--text-field of the line's JSON object (blank lines are skipped); any other file is one document,
its whole text. Inputs are UTF-8. Empty documents are skipped.

Each document becomes [BOS] + its tokens + [EOS] (fsdp8.text_tokenizer says where those ids come
from). Documents are numbered 0, 1, ... in input order; document g goes to the validation split
when floor((g + 1) * F) > floor(g * F) (F = --val-fraction), so every 1/F-th document is held out
and the split does not depend on --workers. The splits' token streams are cut into shards of
--shard-tokens tokens (the last one holds the rest): OUT/train_000000.bin, ...,
OUT/val_000000.bin, ... (fsdp8.token_shards: uint16 when the vocabulary has at most 65536 ids,
else uint32; --dtype forces one). Shards appear only when the whole run succeeds.

Beside the shards, OUT/tokenizer/ records the tokenizer used, for `fsdp8 export`: token_ids.json
({"kind", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", their token strings and
"source", the tokenizer file's absolute path; ids null when there is none}), a copy of the
tokenizer file as tokenizer.json or tokenizer.model, and a tokenizer_config.json (the one beside
a tokenizer.json, if any, with bos_token / eos_token / pad_token set to the tokens used) from which
transformers' AutoTokenizer loads it.

Errors name the file and line: invalid UTF-8, a JSONL line that is not a JSON object or lacks
the field, a token id that does not fit the output's token type. Exit status 0 on success, 1 on
an error in the input or the tokenizer, 2 on bad flags.
"""
import argparse
import collections
import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time

import numpy as np

from fsdp8 import token_shards
from fsdp8.text_tokenizer import TextTokenizer, TokenizerError

CHUNK_BYTES = 1 << 20      # JSONL is handed to the workers in chunks of about this many bytes
TASKS_PER_WORKER = 3       # chunks in flight per worker (bounds the memory held in queues)
PLAIN_PROGRESS_S = 10.0    # seconds between progress lines when stderr is not a terminal


class PrepareError(Exception):
    """Bad input; the message starts with FILE:LINE (or names the file)."""


class UsageError(PrepareError):
    """A flag's value outside its range (exit status 2)."""


@dataclasses.dataclass
class Chunk:
    """Whole lines of a JSONL file (first_line: the 1-based number of the first), or a text file."""
    path: str
    first_line: int
    jsonl: bool
    data: bytes


@dataclasses.dataclass
class ChunkTokens:
    """A chunk's documents as tokens: `tokens` every document's separators and tokens in order,
    `doc_tokens[j]` how many of them belong to document j."""
    tokens: np.ndarray
    doc_tokens: np.ndarray
    text_bytes: int       # UTF-8 bytes of the documents' text
    empty_docs: int
    input_bytes: int
    cpu_seconds: float    # the worker's CPU time on this chunk


# --- reading -------------------------------------------------------------------------------------
def read_chunks(paths, chunk_bytes=CHUNK_BYTES):
    """Chunks of the inputs in order: a text file whole, a JSONL file in runs of whole lines."""
    for path in paths:
        with open(path, "rb") as f:
            if not path.endswith(".jsonl"):
                yield Chunk(path, 1, False, f.read())
                continue
            line, rest = 1, bytearray()  # rest: the start of a line not yet complete
            while True:
                block = f.read(chunk_bytes)
                cut = block.rfind(b"\n") + 1
                if block and cut == 0:  # a line longer than a block: read on
                    rest += block
                    continue
                data = bytes(rest) + block[:cut] if block else bytes(rest)
                rest = bytearray(block[cut:])
                if data:
                    yield Chunk(path, line, True, data)
                    line += data.count(b"\n")
                if not block:
                    break


def _utf8(data, path, first_line):
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        line = first_line + data.count(b"\n", 0, e.start)
        raise PrepareError(f"{path}:{line}: invalid UTF-8 (byte 0x{data[e.start]:02x} at byte "
                           f"{e.start - line_start + 1} of the line)") from None


def _jsonl_text(raw, path, line, field):
    """The text of one JSONL line, or None for a blank line."""
    text = _utf8(raw, path, line)
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise PrepareError(f"{path}:{line}: not JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise PrepareError(f"{path}:{line}: not a JSON object (got {type(obj).__name__})")
    if field not in obj:
        raise PrepareError(f"{path}:{line}: no field \"{field}\" (--text-field)")
    text = obj[field]
    if not isinstance(text, str):
        raise PrepareError(f"{path}:{line}: field \"{field}\" is not a string "
                           f"(got {type(text).__name__})")
    return text


def documents(chunk, field):
    """[(line, text)] of a chunk; the text of a text file is its line 1."""
    if not chunk.jsonl:
        return [(1, _utf8(chunk.data, chunk.path, 1))]
    docs = []
    for i, raw in enumerate(chunk.data.split(b"\n")):
        text = _jsonl_text(raw, chunk.path, chunk.first_line + i, field)
        if text is not None:
            docs.append((chunk.first_line + i, text))
    return docs


# --- tokenizing (in the workers) ------------------------------------------------------------------
_worker = {}


def init_worker(tokenizer_args, field, dtype, tokenizer=None):
    """Pool initializer: loads this process's tokenizer (unless given one already loaded)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _worker.clear()
    try:
        _worker["tokenizer"] = tokenizer or TextTokenizer(**tokenizer_args)
    except TokenizerError as e:  # raised by tokenize_chunk: a failing initializer would respawn
        _worker["error"] = e
    _worker["field"] = field
    _worker["dtype"] = dtype


def _utf8_size(text, path, line, field):
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise PrepareError(f"{path}:{line}: field \"{field}\" is not valid Unicode "
                           f"({e.reason})") from None


def tokenize_chunk(chunk):
    """ChunkTokens of a chunk (in a worker after init_worker)."""
    if "error" in _worker:
        raise _worker["error"]
    cpu_start = time.process_time()
    tok, field, dtype = _worker["tokenizer"], _worker["field"], _worker["dtype"]
    docs = documents(chunk, field)
    text_bytes = sum(_utf8_size(t, chunk.path, line, field) for line, t in docs)
    nonempty = [(line, t) for line, t in docs if t]
    ids_per_doc = tok.encode([t for _, t in nonempty])
    stream, lengths = [], []
    for ids in ids_per_doc:
        if tok.bos_id is not None:
            stream.append(tok.bos_id)
        stream.extend(ids)
        stream.append(tok.eos_id)
        lengths.append(len(ids) + 1 + (tok.bos_id is not None))
    tokens = np.array(stream, dtype=np.int64)
    limit = np.iinfo(dtype).max
    if len(tokens) and tokens.max() > limit:
        _raise_out_of_range(tok, chunk, nonempty, ids_per_doc, dtype)
    return ChunkTokens(tokens.astype(dtype), np.array(lengths, dtype=np.int64), text_bytes,
                       len(docs) - len(nonempty), len(chunk.data),
                       time.process_time() - cpu_start)


def _raise_out_of_range(tok, chunk, docs, ids_per_doc, dtype):
    limit = np.iinfo(dtype).max
    for (line, _), ids in zip(docs, ids_per_doc):
        bad = [k for k, i in enumerate(ids) if i > limit]
        if bad:
            if not chunk.jsonl:  # the line of a text file's token: newlines before it
                line += tok.decode(ids[:bad[0]]).count("\n")
            token_id = ids[bad[0]]
            raise PrepareError(
                f"{chunk.path}:{line}: token id {token_id} ({tok.token_name(token_id)!r}) does "
                f"not fit the output's {dtype} tokens (at most {limit}); use --dtype uint32")
    raise AssertionError("no token out of range")


# --- progress -----------------------------------------------------------------------------------
class Progress:
    """A bar on a terminal (tqdm when installed), else a plain line every PLAIN_PROGRESS_S."""

    def __init__(self, total_bytes, stream=None):
        stream = stream or sys.stderr
        self.total, self.done, self.docs, self.stream = total_bytes, 0, 0, stream
        self.start = self.last = time.monotonic()
        self.bar = None
        if stream.isatty():
            try:
                import tqdm
                self.bar = tqdm.tqdm(total=total_bytes, unit="B", unit_scale=True,
                                     unit_divisor=1000, desc="tokenizing", file=stream)
            except ImportError:
                pass
        self.tty = stream.isatty()

    def update(self, input_bytes, docs):
        self.done += input_bytes
        self.docs += docs
        if self.bar is not None:
            self.bar.update(input_bytes)
            return
        now = time.monotonic()
        if not self.tty and now - self.last < PLAIN_PROGRESS_S:
            return
        self.last = now
        rate = self.done / 1e6 / max(now - self.start, 1e-9)
        line = (f"fsdp8-prepare: {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
                f"({100 * self.done / max(self.total, 1):.0f}%), {self.docs:,} documents, "
                f"{rate:.2f} MB/s")
        self.stream.write("\r" + line if self.tty else line + "\n")
        self.stream.flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            self.stream.write("\n")


# --- the run --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Totals:
    docs: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    empty_docs: int = 0
    text_bytes: int = 0
    cpu_seconds: float = 0.0  # the workers' CPU time tokenizing


class SplitRouter:
    """Sends each chunk's documents to the train or the validation writer (rule in the module
    doc) and counts them."""

    def __init__(self, val_fraction, writers):
        self.val_fraction, self.writers = val_fraction, writers
        self.next_doc = 0
        self.totals = Totals()

    def add(self, result):
        n = len(result.doc_tokens)
        g = np.arange(self.next_doc, self.next_doc + n, dtype=np.float64)
        is_val = np.floor((g + 1) * self.val_fraction) > np.floor(g * self.val_fraction)
        self.next_doc += n
        mask = np.repeat(is_val, result.doc_tokens)
        self.writers["train"].add(result.tokens[~mask])
        self.writers["val"].add(result.tokens[mask])
        self.totals.docs["val"] += int(is_val.sum())
        self.totals.docs["train"] += n - int(is_val.sum())
        self.totals.empty_docs += result.empty_docs
        self.totals.text_bytes += result.text_bytes
        self.totals.cpu_seconds += result.cpu_seconds


def tokenize_all(chunks, workers, init_args, on_result, tokenizer):
    """Runs tokenize_chunk over chunks on `workers` processes, calling on_result in input order;
    one worker tokenizes here, with `tokenizer`."""
    if workers == 1:
        init_worker(*init_args, tokenizer=tokenizer)
        for chunk in chunks:
            on_result(tokenize_chunk(chunk))
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=init_worker, initargs=init_args) as pool:
        pending = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(tokenize_chunk, (chunk,)))
            if len(pending) >= TASKS_PER_WORKER * workers:
                on_result(pending.popleft().get())
        while pending:
            on_result(pending.popleft().get())


def check_inputs(args):
    """Raises UsageError for flag values outside their range, PrepareError for inputs that are
    not readable files; returns the inputs' total size in bytes."""
    if not 0 <= args.val_fraction < 1:
        raise UsageError(f"--val-fraction: must be in [0, 1) (got {args.val_fraction})")
    if not 0 < args.shard_tokens <= token_shards.MAX_SHARD_TOKENS:
        raise UsageError(f"--shard-tokens: must be in [1, 2^31) (got {args.shard_tokens})")
    if args.workers < 1:
        raise UsageError(f"--workers: must be at least 1 (got {args.workers})")
    total = 0
    for path in args.inputs:
        if not os.path.isfile(path):
            raise PrepareError(f"{path}: no such file")
        if not os.access(path, os.R_OK):
            raise PrepareError(f"{path}: not readable")
        total += os.path.getsize(path)
    return total


def open_writers(args, dtype):
    os.makedirs(args.out, exist_ok=True)
    old = token_shards.existing_shards(args.out, "train") + \
        token_shards.existing_shards(args.out, "val")
    if old and not args.overwrite:
        raise PrepareError(f"{args.out}: already holds shards ({', '.join(old[:3])}"
                           f"{', ...' if len(old) > 3 else ''}); remove them or pass --overwrite")
    return {split: token_shards.ShardSetWriter(args.out, split, args.shard_tokens, dtype)
            for split in ("train", "val")}


def run(args, out=None):
    out = out or sys.stdout
    total_bytes = check_inputs(args)
    tokenizer_args = dict(path=args.tokenizer, eos_token=args.eos_token,
                          bos_token=args.bos_token, no_bos=args.no_bos)
    tok = TextTokenizer(**tokenizer_args)
    dtype = token_shards.dtype_for_vocab(tok.vocab_size) if args.dtype == "auto" else args.dtype
    for name, token_id in (("EOS", tok.eos_id), ("BOS", tok.bos_id)):
        if token_id is not None and token_id > np.iinfo(dtype).max:
            raise PrepareError(f"{name} id {token_id} does not fit --dtype {dtype}")
    start = time.monotonic()
    writers = open_writers(args, dtype)
    router = SplitRouter(args.val_fraction, writers)
    progress = Progress(total_bytes)

    def on_result(result):
        router.add(result)
        progress.update(result.input_bytes, len(result.doc_tokens))

    try:
        tokenize_all(read_chunks(args.inputs), args.workers,
                     (tokenizer_args, args.text_field, dtype), on_result, tok)
        progress.close()
        if writers["train"].tokens == 0:
            raise PrepareError("no tokens: every document is empty")
        paths = {s: w.commit(remove_stale=args.overwrite) for s, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    write_tokenizer_record(args.out, tok)
    seconds = time.monotonic() - start
    print_summary(out, args, tok, dtype, router.totals, writers, paths, seconds)
    return 0


RECORD_DIR = "tokenizer"  # common/hf_model.h kTokenizerRecordDir


def write_tokenizer_record(out_dir, tok):
    """OUT/tokenizer/: the tokenizer used and its special token ids (module doc). Written under a
    hidden name and renamed over the previous record."""
    final = os.path.join(out_dir, RECORD_DIR)
    tmp = os.path.join(out_dir, "." + RECORD_DIR + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    hf = tok.kind == "hf"
    shutil.copyfile(tok.path, os.path.join(tmp, "tokenizer.json" if hf else "tokenizer.model"))
    ids = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    names = {k: None if i is None else tok.token_name(i) for k, i in ids.items()}
    config = tok.hf_config()
    config.update({f"{k}_token": v for k, v in names.items()})
    if hf:
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    else:
        config.update(tokenizer_class="LlamaTokenizer", add_bos_token=tok.bos_id is not None,
                      add_eos_token=False)
    record = {"kind": tok.kind, "vocab_size": tok.vocab_size, "source": os.path.abspath(tok.path)}
    record.update({f"{k}_token_id": v for k, v in ids.items()})
    record.update({f"{k}_token": v for k, v in names.items()})
    for name, data in (("tokenizer_config.json", config), ("token_ids.json", record)):
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, ensure_ascii=False)
            f.write("\n")
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)


def print_summary(out, args, tok, dtype, t, writers, paths, seconds):
    magic, version = token_shards.FORMATS[dtype]
    mb = t.text_bytes / 1e6
    skipped = f"; {t.empty_docs:,} empty skipped" if t.empty_docs else ""
    print(f"fsdp8-prepare: {t.docs['train'] + t.docs['val']:,} documents "
          f"({t.docs['train']:,} train, {t.docs['val']:,} val{skipped}), "
          f"{writers['train'].tokens + writers['val'].tokens:,} tokens "
          f"({writers['train'].tokens:,} train, {writers['val'].tokens:,} val) as {dtype} "
          f"(llm.c magic {magic}, version {version}) in {len(paths['train'])} train + "
          f"{len(paths['val'])} val shards under {args.out}; {mb:,.2f} MB of text in "
          f"{seconds:.1f} s = {mb / max(seconds, 1e-9):.2f} MB/s ({args.workers} workers, "
          f"{t.cpu_seconds:.1f} CPU-s tokenizing = {mb / max(t.cpu_seconds, 1e-9):.2f} MB per "
          f"CPU-s; {tok.kind} tokenizer, vocabulary {tok.vocab_size:,})", file=out)
    if args.val_fraction > 0 and t.docs["val"] == 0:
        print(f"fsdp8-prepare: warning: no document fell into the validation split "
              f"(--val-fraction {args.val_fraction} of {t.docs['train']:,} documents)",
              file=sys.stderr)


def available_cores():
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="fsdp8-prepare",
        description="Text and JSONL files -> llm.c token shards (train_NNNNNN.bin, "
                    "val_NNNNNN.bin) through a Hugging Face tokenizer.json or a SentencePiece "
                    "model. A .jsonl input holds one document per line (--text-field); any "
                    "other input is one document.")
    p.add_argument("--tokenizer", required=True, metavar="FILE",
                   help="tokenizer.json, a SentencePiece .model, or a directory holding one")
    p.add_argument("--out", required=True, metavar="DIR", help="directory of the shards")
    p.add_argument("--val-fraction", "--val_fraction", type=float, default=0.05, metavar="F",
                   help="fraction of the documents held out for validation (default 0.05)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                   help="tokens per shard (default 100000000)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the JSONL field holding a document's text (default text)")
    p.add_argument("--workers", type=int, default=available_cores(), metavar="K",
                   help="tokenizing processes (default: the cores available)")
    p.add_argument("--eos-token", metavar="TOKEN", help="end-of-text token (default: the "
                   "tokenizer's)")
    p.add_argument("--bos-token", metavar="TOKEN", help="beginning-of-text token (default: the "
                   "tokenizer's, if any)")
    p.add_argument("--no-bos", action="store_true", help="no BOS before documents")
    p.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto",
                   help="token type of the shards (default: uint16 for vocabularies of at most "
                        "65536 ids, else uint32)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the shards already in --out")
    p.add_argument("inputs", nargs="+", metavar="INPUTS", help="text or .jsonl files")
    return p.parse_args(argv)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run(), which removes the partial shards


def main(argv=None):
    args = parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    try:
        return run(args)
    except (PrepareError, TokenizerError, OSError) as e:
        print(f"fsdp8-prepare: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        print("fsdp8-prepare: interrupted; no shard written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
