#!/usr/bin/env bash
# Checks bench/gpu/run.sh and its helpers without GPUs (numpy and PyYAML needed; no torch): token
# shard headers read back with numpy, fsdp8 specs for 1 and 2 workers, the external memory meter
# against a stand-in nvidia-smi and a stand-in NVML, and whole runs of run.sh with stand-ins for
# nvidia-smi, torchrun and the fsdp8 binaries (2 GPUs found by nvidia-smi -L; then
# CUDA_VISIBLE_DEVICES=1, world size 1, metered on NVML device 1); where PYTHON (python3) imports
# torch, bench/gpu/selftest_reference.py checks the PyTorch reference on the CPU (torchao from
# PYTHONPATH). Prints "selftest: ok" at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail() { echo "selftest: FAILED: $*" >&2; exit 1; }

echo "-- token shards"
python3 bench/gpu/benchtool.py tokens "$T/u32.bin" 128256 --tokens 100000
python3 bench/gpu/benchtool.py tokens "$T/u16.bin" 65536 --tokens 100000
python3 - "$T" <<'PY'
import os, sys, numpy as np
T = sys.argv[1]
for name, magic, version, dtype, vocab in (("u32.bin", 20240801, 7, "<u4", 128256),
                                           ("u16.bin", 20240520, 1, "<u2", 65536)):
    path = os.path.join(T, name)
    hdr = np.fromfile(path, dtype="<i4", count=256)
    tok = np.fromfile(path, dtype=dtype, offset=1024)
    assert (hdr[0], hdr[1], hdr[2]) == (magic, version, 100000), (name, hdr[:3])
    assert not hdr[3:].any(), name
    assert os.path.getsize(path) == 1024 + np.dtype(dtype).itemsize * 100000, name
    assert tok.size == 100000 and int(tok.max()) < vocab, name
    assert int(tok.max()) >= 65536 if vocab > 65536 else True, "uint32 shard holds no token above 65535"
PY

echo "-- fsdp8 specs"
for n in 1 2; do
  python3 bench/gpu/benchtool.py spec l3proxy --world $n --steps 11 --data "$T/u32.bin" > "$T/l3-$n.yaml"
  python3 bench/gpu/benchtool.py spec 1b --world $n --steps 16 --vocab 65536 --data "$T/u16.bin" --free > "$T/1b-$n.yaml"
done
python3 - "$T" <<'PY'
import sys, yaml
T = sys.argv[1]
for n in (1, 2):
    s = yaml.safe_load(open(f"{T}/l3-{n}.yaml"))
    # Llama 3.1 8B's rope_scaling (its config.json), the same in the PyTorch reference's shapes.
    l31 = dict(rope_type="llama3", factor=8, low_freq_factor=1, high_freq_factor=4,
               original_max_position_embeddings=8192)
    want = dict(d_model=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                seq_len=8192, rope_theta=500000, rope_scaling=l31)
    assert s["model"] == want, s["model"]
    sys.path.insert(0, "bench/gpu")
    import presets
    assert presets.shape("l3proxy")["rope_scaling"] == l31, presets.shape("l3proxy")
    assert s["training"]["global_batch"] == n and s["training"]["microbatch"] == 1, s["training"]
    assert s["training"]["steps"] == 11 and "free_running" not in s["training"]
    assert s["sharding"] == dict(min_workers=n, max_workers=n), s["sharding"]
    assert s["data"]["train_path"] == f"{T}/u32.bin"
    s = yaml.safe_load(open(f"{T}/1b-{n}.yaml"))
    assert s["model"]["vocab_size"] == 65536 and s["training"]["free_running"] is True
    assert s["training"]["global_batch"] == 8 * n and s["sharding"]["min_workers"] == n
PY
sed 's/n_kv_heads: 8/n_kv_heads: 4/' bench/presets/l3proxy.yaml > "$T/bad.yaml"
python3 - "$T/bad.yaml" <<'PY'
import sys
sys.path.insert(0, "bench/gpu")
import benchtool
try:
    benchtool.check_preset_yaml("l3proxy", open(sys.argv[1]).read().splitlines())
    sys.exit("selftest: FAILED: a preset YAML that disagrees with presets.py passed")
except ValueError as e:
    assert "model.n_kv_heads is 4, bench/gpu/presets.py says 8" in str(e), e
PY

echo "-- stand-ins"
mkdir -p "$T/bin" "$T/py" "$T/fsdp8"
cat > "$T/bin/nvidia-smi" <<'SH'
#!/bin/sh
# 2 GPUs; memory.used (MiB) of device i is line i+1 of $FAKE_MEM (the stand-ins replace it by mv)
case "$1" in -L) echo "GPU 0: H200 (UUID: GPU-a)"; echo "GPU 1: H200 (UUID: GPU-b)"; exit 0;; esac
ids=$(echo "$@" | sed 's/.*-i \([^ ]*\).*/\1/')
for i in $(echo "$ids" | tr , ' '); do sed -n "$((i + 1))p" "$FAKE_MEM"; done
SH
cat > "$T/bin/torchrun" <<'SH'
#!/bin/sh
# prints the line fsdp2_reference.py would, after raising device 0's memory by 2000 MiB for a while
n=0; l=8; while [ $# -gt 0 ]; do case "$1" in --nproc_per_node) n=$2; shift;; --preset) p=$2; shift;;
  --precision) x=$2; shift;; --vocab) v=$2; shift;; --layers) l=$2; shift;; esac; shift; done
cp "$FAKE_MEM" "$FAKE_MEM.idle"; { echo 2500; sed -n 2p "$FAKE_MEM.idle"; } > "$FAKE_MEM.t"
mv "$FAKE_MEM.t" "$FAKE_MEM"; sleep 0.6; cp "$FAKE_MEM.idle" "$FAKE_MEM.t"; mv "$FAKE_MEM.t" "$FAKE_MEM"
echo "{\"system\": \"pytorch-fsdp2\", \"preset\": \"$p\", \"precision\": \"$x\", \"world\": $n, \"vocab\": $v, \"layers\": $l, \"step_s_median\": 0.25, \"peak_mem_bytes\": 1073741824, \"pythonpath\": \"$PYTHONPATH\"}"
SH
cat > "$T/fsdp8/fsdp8-coordinator" <<'SH'
#!/bin/sh
exec sleep 600
SH
cat > "$T/fsdp8/fsdp8-worker" <<'SH'
#!/bin/sh
echo "$@" >> "$FAKE_LOG/workers"; exec sleep 600
SH
cat > "$T/fsdp8/fsdp8" <<'SH'
#!/bin/sh
# workers: one line per started worker; submit: keeps the spec; watch: step events, device 0 busier
shift 2
case "$1" in
  workers) sed 's/.*--device \([0-9]*\).*/w-\1/' "$FAKE_LOG/workers";;
  submit) cp "$3" "$FAKE_LOG/spec-$(basename "$3")"; echo job-1;;
  watch) cp "$FAKE_MEM" "$FAKE_MEM.idle"; { echo 3000; sed -n 2p "$FAKE_MEM.idle"; } > "$FAKE_MEM.t"
         mv "$FAKE_MEM.t" "$FAKE_MEM"; sleep 0.6; cp "$FAKE_MEM.idle" "$FAKE_MEM.t"; mv "$FAKE_MEM.t" "$FAKE_MEM"
         for s in 1 2 3 4 5; do
           echo "{\"step\": $s, \"step_seconds\": 0.2, \"compute_seconds\": 0.18, \"comm_seconds\": 0.01, \"optimizer_seconds\": 0.01, \"peak_memory_bytes\": 2147483648, \"loss\": 10.5}"
         done;;
esac
SH
cat > "$T/py/pynvml.py" <<'PY'
import os
class _Info:
    def __init__(self, used): self.used = used
def nvmlInit(): pass
def nvmlDeviceGetHandleByIndex(i): return int(i)
def nvmlDeviceGetHandleByUUID(u): raise ValueError(u)
def nvmlDeviceGetMemoryInfo(h):
    return _Info(int(open(os.environ["FAKE_MEM"]).read().split()[h]) << 20)
PY
chmod +x "$T"/bin/* "$T"/fsdp8/*

echo "-- memmeter"
export FAKE_MEM=$T/mem FAKE_LOG=$T
printf '500\n600\n' > "$FAKE_MEM"
PATH="$T/bin:$PATH" python3 bench/gpu/memmeter.py watch --devices 1 --out "$T/m.json" --ready "$T/m.ready" & mp=$!
while [ ! -e "$T/m.ready" ]; do sleep 0.05; done
printf '500\n1600\n' > "$FAKE_MEM.t"; mv "$FAKE_MEM.t" "$FAKE_MEM"; sleep 0.4
printf '500\n900\n' > "$FAKE_MEM.t"; mv "$FAKE_MEM.t" "$FAKE_MEM"; sleep 0.2
kill -TERM $mp; wait $mp
python3 -c "import json,sys; m=json.load(open(sys.argv[1])); assert m['ext_peak_mem_bytes']==1000<<20 and m['ext_meter']=='nvidia-smi', m" "$T/m.json"

run() {  # extra env for run.sh; checks follow
  rm -f "$T/workers" "$T"/spec-*
  env PATH="$T/bin:$PATH" BIN="$T/fsdp8" OUT_DIR="$T/out" PRESETS=l3proxy VOCAB=65536 \
    TORCH_PRECISIONS="bf16 torchao-tensorwise" MODES="driven free" SKIP_WARMUP_JOB=1 \
    WHEELS="$T/nowheels" PYLIB="$T/pylib" "$@" bash bench/gpu/run.sh > "$T/run.log" 2>&1 ||
    { cat "$T/run.log"; fail "run.sh $*"; }
}
for case in "2 nvidia-smi" "1 nvml"; do
  set -- $case
  echo "-- run.sh, world size $1, meter $2"
  if [ "$1" = 2 ]; then run; else run CUDA_VISIBLE_DEVICES=1 PYTHONPATH="$T/py" LAYERS=12; fi
  python3 - "$T" "$1" "$2" <<'PY' || { cat "$T/run.log"; fail "results of world size $1"; }
import json, sys, yaml
T, n, meter = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = [json.loads(l) for l in open(f"{T}/out/results.jsonl")]
assert [r["system"] for r in rows] == ["pytorch-fsdp2"] * 2 + ["fsdp8"] * 2, rows
torch, ao, driven, free = rows
assert torch["world"] == n and torch["vocab"] == 65536, torch
assert ao.get("error") == "torchao 0.18.0 missing", ao     # no wheel in WHEELS
assert driven["world"] == n and driven["mode"] == "driven" and free["mode"] == "free"
assert driven["step_s_median"] == 0.2 and driven["peak_mem_bytes"] == 2 << 30, driven
# device 0 rose by 2000 MiB (torch) and 2500 MiB (fsdp8) over its idle 500 MiB; with
# CUDA_VISIBLE_DEVICES=1 the meter watches NVML device 1, which stayed idle.
want_torch, want_fsdp8 = ((2000 << 20), (2500 << 20)) if n == 2 else (0, 0)
assert torch["ext_peak_mem_bytes"] == want_torch and torch["ext_meter"] == meter, torch
assert driven["ext_peak_mem_bytes"] == want_fsdp8 and driven["ext_meter"] == meter, driven
workers = open(f"{T}/workers").read().split("\n")
assert len([w for w in workers if w]) == n, workers
spec = yaml.safe_load(open(f"{T}/spec-fsdp8-l3proxy{'-L12' if n == 1 else ''}-driven.yaml"))
assert spec["sharding"]["min_workers"] == n and spec["training"]["global_batch"] == n, spec
assert spec["training"]["steps"] == 11 and spec["model"]["vocab_size"] == 65536, spec
# LAYERS=12 (world size 1 case) reaches the spec and the table: 12 x 218,112,000 block linear
# parameters, 12 x 2 x 4096 norm weights, the final norm, head and embedding (2 x 65536 x 4096).
layers, params = (12, "3.15") if n == 1 else (8, "2.28")
assert spec["model"]["n_layers"] == layers and driven["layers"] == layers, (spec, driven)
table = open(f"{T}/out/table.md").read()
assert "| fsdp8 driven | l3proxy | 65536 | %d | %d | %s | 40,960 | 1.250 |" % (n, layers, params) in table, table
PY
done
if "${PYTHON:-python3}" -c 'import torch' 2> /dev/null; then
  echo "-- PyTorch reference on CPU"
  PYTHONWARNINGS=ignore "${PYTHON:-python3}" bench/gpu/selftest_reference.py || fail "bench/gpu/selftest_reference.py"
else
  echo "-- PyTorch reference: torch not importable by ${PYTHON:-python3}, skipped"
fi
echo "selftest: ok"
