#!/usr/bin/env python3
"""Torch-free pieces of bench/gpu/run.sh (numpy only).

  benchtool.py defaults PRESET                 prints "WARMUP STEPS VOCAB SEQ_PER_GPU"
  benchtool.py tokens OUT VOCAB [--tokens N]   random tokens in the llm.c shard format fsdp8 reads
  benchtool.py spec PRESET --world N --steps S --data FILE [--vocab V] [--free] > spec.yaml
  benchtool.py fsdp8-result EVENTS PRESET MODE WARMUP --world N --vocab V [--meter FILE]
  benchtool.py line KEY VALUE ...              one JSON line (an error row of the results)

Token shard formats (llm.c, dev/data/data_common.py `write_datafile`): a header of 256 little-endian
int32 — [0] magic, [1] version, [2] token count, the rest 0 — then the tokens: magic 20240520,
version 1, uint16 tokens (vocabularies up to 65536); magic 20240801, version 7, uint32 tokens
(larger vocabularies, the Llama 3 format).
"""
import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import presets  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
UINT16_FORMAT = (20240520, 1)
UINT32_FORMAT = (20240801, 7)


def write_tokens(path, vocab, n, seed=1234):
    """Writes n random tokens in [0, vocab) to path (via a temp file), in the narrowest format."""
    import numpy as np
    if vocab < 1 or vocab > 2 ** 32:
        raise ValueError(f"vocab must be in [1, 2^32] (got {vocab})")
    if n < 1 or n > 2 ** 31 - 1:
        raise ValueError(f"token count must be in [1, 2^31 - 1] (the header holds an int32; got {n})")
    (magic, version), dtype = (UINT16_FORMAT, np.uint16) if vocab <= 65536 else (UINT32_FORMAT, np.uint32)
    hdr = np.zeros(256, dtype="<i4")
    hdr[0], hdr[1], hdr[2] = magic, version, n
    tok = np.random.default_rng(seed).integers(0, vocab, size=n, dtype=np.uint64).astype(dtype)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(hdr.tobytes())
        f.write(tok.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)


# ---- fsdp8 job spec from bench/presets/NAME.yaml ------------------------------------------------
# The presets are two-level YAML (sections, then "  key: value" lines); they are edited line by line
# so that no YAML library is needed on the GPU host.
def _parse(lines):
    """{(section, key): (line index, value)} of a two-level YAML document."""
    out, section = {}, None
    for i, line in enumerate(lines):
        m = re.match(r"^(\w+):\s*(#.*)?$", line)
        if m:
            section = m.group(1)
            continue
        m = re.match(r"^  (\w+):\s*(.*?)\s*(#.*)?$", line)
        if m and section:
            out[(section, m.group(1))] = (i, m.group(2))
    return out


def _set(lines, section, key, value):
    """Sets section.key (key "sub.name": the third-level field name of the two-level line
    "  sub:", which is added when missing)."""
    fields = _parse(lines)
    if "." in key:
        sub, name = key.split(".", 1)
        if (section, sub) not in fields:
            _set(lines, section, sub, "")
            fields = _parse(lines)
        at = fields[(section, sub)][0] + 1
        while at < len(lines) and lines[at].startswith("    "):
            if re.match(rf"^    {re.escape(name)}:", lines[at]):
                lines[at] = f"    {name}: {value}"
                return
            at += 1
        lines.insert(fields[(section, sub)][0] + 1, f"    {name}: {value}")
        return
    if (section, key) in fields:
        lines[fields[(section, key)][0]] = f"  {key}: {value}".rstrip()
        return
    last = max((i for (s, _), (i, _) in fields.items() if s == section), default=None)
    if last is None:
        raise ValueError(f"preset has no section {section!r}")
    lines.insert(last + 1, f"  {key}: {value}".rstrip())


# preset field -> (section, key) in the fsdp8 spec
_SPEC_FIELDS = dict(d=("model", "d_model"), layers=("model", "n_layers"), heads=("model", "n_heads"),
                    kv_heads=("model", "n_kv_heads"), ffn=("model", "ffn_dim"), seq=("model", "seq_len"),
                    rope_theta=("model", "rope_theta"), batch=("training", "microbatch"))
_SPEC_DEFAULTS = {("model", "n_kv_heads"): None, ("model", "rope_theta"): 10000.0}


def check_preset_yaml(name, lines):
    """Raises ValueError naming the field when the YAML's shapes differ from presets.PRESETS."""
    p, fields = presets.shape(name), _parse(lines)
    for k, (sec, key) in _SPEC_FIELDS.items():
        if (sec, key) in fields:
            got = float(fields[(sec, key)][1])
        elif (sec, key) in _SPEC_DEFAULTS:
            dflt = _SPEC_DEFAULTS[(sec, key)]
            got = float(p["heads"] if dflt is None else dflt)
        else:
            raise ValueError(f"bench/presets/{name}.yaml: {sec}.{key} missing")
        if got != float(p[k]):
            raise ValueError(f"bench/presets/{name}.yaml: {sec}.{key} is {got:g}, "
                             f"bench/gpu/presets.py says {p[k]:g}")


def make_spec(name, world, steps, data, vocab=None, free=False, sets=(), layers=None):
    """The preset's spec text for `world` CUDA workers: global_batch = sequences per GPU x world.
    layers: another layer count. sets: "SECTION.KEY=VALUE" fields set last (the section must be in
    the preset)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1 (got {world})")
    with open(os.path.join(ROOT, "bench", "presets", f"{name}.yaml")) as f:
        lines = f.read().splitlines()
    check_preset_yaml(name, lines)
    p = presets.shape(name, vocab, layers)
    _set(lines, "model", "vocab_size", p["vocab"])
    _set(lines, "model", "n_layers", p["layers"])
    _set(lines, "data", "train_path", data)
    _set(lines, "training", "steps", steps)
    _set(lines, "training", "global_batch", p["batch"] * world)
    _set(lines, "sharding", "min_workers", world)
    _set(lines, "sharding", "max_workers", world)
    if free:
        _set(lines, "training", "free_running", "true")
    for item in sets:
        field, eq, value = item.partition("=")
        section, dot, key = field.partition(".")
        if not (eq and dot and section and key and value):
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        _set(lines, section, key, value)
    return "\n".join(lines) + "\n"


# ---- fsdp8 events -> one result line ------------------------------------------------------------
def fsdp8_result(events_file, preset, mode, warmup, world, vocab, layers=None):
    evs = [json.loads(l) for l in open(events_file) if l.startswith("{")]
    steps = [e for e in evs if not e.get("message") and int(e.get("step", 0)) > warmup]
    msgs = [e["message"] for e in evs if e.get("message")]
    p = presets.shape(preset, vocab, layers)
    row = dict(system="fsdp8", preset=preset, mode=mode, world=world, vocab=vocab, layers=p["layers"],
               params=presets.params(p))
    if not steps:
        row["error"] = msgs[-3:] or ["no step events"]
        return row
    med = lambda k: statistics.median(float(e.get(k, 0)) for e in steps)  # noqa: E731
    row.update(
        step_s_median=med("step_seconds"), compute_s=med("compute_seconds"),
        comm_s=med("comm_seconds"), optimizer_s=med("optimizer_seconds"),
        peak_mem_bytes=max(int(e.get("peak_memory_bytes", 0)) for e in steps),
        phase_peaks={k: max(int(e.get(k + "_peak_bytes", 0)) for e in steps)
                     for k in ("forward", "backward", "optimizer")},
        allgather_bytes_per_step=int(med("all_gather_bytes")),
        reduce_scatter_bytes_per_step=int(med("reduce_scatter_bytes")),
        final_loss=float(steps[-1]["loss"]), steps=len(steps))
    return row


def plan_fields(path):
    """plan_peak_bytes (the backend's own count) and plan_device_bytes (with the CUDA context, NCCL
    and the pool: what NVML sees) of an `fsdp8 plan --json` file; {} when it holds no plan."""
    try:
        with open(path) as f:
            plan = json.loads(f.readline())
        return dict(plan_peak_bytes=int(plan["peak_bytes"]), plan_device_bytes=int(plan["device_bytes"]),
                    plan_phase=plan.get("peak_phase", ""))
    except (OSError, ValueError, KeyError):
        return {}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("defaults")
    a.add_argument("preset")
    a = sub.add_parser("tokens")
    a.add_argument("out")
    a.add_argument("vocab", type=int)
    a.add_argument("--tokens", type=int, default=16 * 1024 * 1024)
    a = sub.add_parser("spec")
    a.add_argument("preset")
    a.add_argument("--world", type=int, required=True)
    a.add_argument("--steps", type=int, required=True)
    a.add_argument("--data", required=True)
    a.add_argument("--vocab", type=int)
    a.add_argument("--layers", type=int)
    a.add_argument("--free", action="store_true")
    a.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a spec field set last, e.g. training.saved_norm_inputs=bf16 (repeatable)")
    a = sub.add_parser("fsdp8-result")
    for k in ("events", "preset", "mode"):
        a.add_argument(k)
    a.add_argument("warmup", type=int)
    a.add_argument("--world", type=int, required=True)
    a.add_argument("--vocab", type=int, required=True)
    a.add_argument("--layers", type=int)
    a.add_argument("--meter", help="memmeter.py watch output to merge into the line")
    a.add_argument("--plan", help="`fsdp8 plan --json` output: the memory plan's prediction")
    a = sub.add_parser("line")
    a.add_argument("pairs", nargs="*")
    args = ap.parse_args()

    try:
        if args.cmd == "defaults":
            p = presets.shape(args.preset)
            print(p["warmup"], p["steps"], p["vocab"], p["batch"])
        elif args.cmd == "tokens":
            write_tokens(args.out, args.vocab, args.tokens)
        elif args.cmd == "spec":
            sys.stdout.write(make_spec(args.preset, args.world, args.steps, args.data, args.vocab, args.free,
                                       args.set, args.layers))
        elif args.cmd == "fsdp8-result":
            row = fsdp8_result(args.events, args.preset, args.mode, args.warmup, args.world, args.vocab,
                               args.layers)
            if args.meter:
                import memmeter
                row.update(memmeter.read_result(args.meter))
            if args.plan:
                row.update(plan_fields(args.plan))
            print(json.dumps(row))
        elif args.cmd == "line":
            if len(args.pairs) % 2:
                raise ValueError("line takes KEY VALUE pairs")
            print(json.dumps(dict(zip(args.pairs[::2], args.pairs[1::2]))))
    except (KeyError, ValueError, OSError) as e:
        sys.exit(f"benchtool.py {args.cmd}: {e.args[0] if isinstance(e, KeyError) else e}")


if __name__ == "__main__":
    main()
