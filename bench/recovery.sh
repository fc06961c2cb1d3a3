#!/usr/bin/env bash
# Failure detection and recovery figures for the default model (data/default-job.yaml: d_model 128,
# 4 layers, 2 CPU ranks) through the real coordinator, workers and CLI, with the coordinator's
# default timeouts unless COORDINATOR_FLAGS says otherwise:
#   - detection time of a killed worker (SIGKILL) and of a hung one (SIGSTOP): fault -> the job's
#     RECOVERING event;
#   - recovery time: fault -> RUNNING again, and fault -> first step of the new generation done;
#   - checkpoint write and read bandwidth per rank (from the workers' "saved ... in T s" and
#     "loaded checkpoint ... in T s" log lines).
# One job of STEPS steps (default 40) with a checkpoint every 10 steps; a worker is killed after
# step 12 and another stopped after step 28; 4 workers, so a spare is free each time.
# Usage: bench/recovery.sh [STEPS]. Needs a build in ./build and the prepared corpus in
# data/fortunes (scripts/demo.sh makes both). Event times are taken when the CLI prints them and
# steps by polling every 0.1 s, so figures are good to about 0.2 s.
#
# bench/recovery.sh hang [RUNS]: the hung-rank test with the coordinator's default flags
# (tests/integration/lifecycle_test.cc: 2 ranks plus a spare worker, a checkpoint every 5 steps,
# rank 0 stopped after step 8), RUNS times (default 5), each with a fresh cluster; prints each
# run's times from SIGSTOP (detected, RUNNING again, first step of the new generation done).
#
# bench/recovery.sh coordinator [RUNS]: the coordinator-restart test
# (tests/integration/readopt_test.cc: the default model on 2 CPU ranks, the coordinator SIGKILLed
# after step 6 and started again on the same address and state db, checkpoint reads made to fail),
# RUNS times (default 5), each with a fresh cluster; prints each run's times from the new
# coordinator's start to the job RUNNING again (re-adopted) and to its next step done.
#
# bench/recovery.sh replica [RUNS]: the lost-replica test (tests/integration/elastic_test.cc: the
# default model as 2 replicas x 2 CPU ranks on 2 simulated hosts, sharding.elastic, rank 3
# SIGKILLed after step 6, checkpoint reads made to fail), RUNS times (default 5), each with a fresh
# cluster; prints each run's time from the SIGKILL to the next step done on the surviving replica
# (target <= 2 s).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$PWD/build/bin
if [ "${1:-}" = hang ]; then
  runs=${2:-5}
  [ -x "$bin/lifecycle_test" ] || { echo "build lifecycle_test first (ninja -C build lifecycle_test)" >&2; exit 1; }
  echo "hung rank (SIGSTOP), default coordinator flags, 2 ranks + 1 spare, checkpoint every 5 steps"
  printf '%-4s %12s %17s %22s\n' run detected_s running_again_s first_new_step_done_s
  for i in $(seq "$runs"); do
    out=$("$bin/lifecycle_test" --gtest_filter='LifecycleTest.HungRankCostsSecondsWithDefaultFlags' 2>&1) || true
    line=$(grep -m1 '^hung rank recovery:' <<< "$out" || true)
    if [ -z "$line" ]; then echo "run $i: no figure"; echo "$out" | tail -20; continue; fi
    python3 - "$i" "$line" "$(grep -c '\[  PASSED  \]' <<< "$out" || true)" <<'PY'
import re, sys
run, line, passed = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
det, run_again, step = (float(x) for x in re.findall(r"after ([0-9.]+) s", line))
print(f"{run:<4} {det:>12.2f} {run_again:>17.2f} {step:>22.2f}{'' if passed else '  (test failed)'}")
PY
  done
  exit 0
fi
if [ "${1:-}" = coordinator ]; then
  runs=${2:-5}
  [ -x "$bin/readopt_test" ] || { echo "build readopt_test first (scripts/build.sh readopt_test)" >&2; exit 1; }
  echo "coordinator SIGKILL + restart, default model, 2 ranks, re-adopted (no checkpoint read)"
  printf '%-4s %17s %18s\n' run running_again_s next_step_done_s
  for i in $(seq "$runs"); do
    out=$("$bin/readopt_test" --gtest_filter='ReadoptTest.CoordinatorSigkillReadoptsIntactRanksWithoutACheckpointRead' 2>&1) || true
    line=$(grep -m1 '^coordinator SIGKILLed after step' <<< "$out" || true)
    if [ -z "$line" ]; then echo "run $i: no figure"; echo "$out" | tail -20; continue; fi
    python3 - "$i" "$line" "$(grep -c '\[  PASSED  \]' <<< "$out" || true)" <<'PY'
import re, sys
run, line, passed = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
running, step = (float(x) for x in re.findall(r"([0-9.]+) s", line))
print(f"{run:<4} {running:>17.2f} {step:>18.2f}{'' if passed else '  (test failed)'}")
PY
  done
  exit 0
fi
if [ "${1:-}" = replica ]; then
  runs=${2:-5}
  [ -x "$bin/elastic_test" ] || { echo "build elastic_test first (scripts/build.sh elastic_test)" >&2; exit 1; }
  echo "SIGKILL of a rank of replica 1 of 2 (2 x 2 CPU ranks, 2 simulated hosts): continue on 1 replica"
  printf '%-4s %18s\n' run next_step_done_s
  for i in $(seq "$runs"); do
    out=$("$bin/elastic_test" --gtest_filter='ElasticTest.SigkillOfAReplicaRankContinuesOnOneReplicaWithoutACheckpointRead' 2>&1) || true
    line=$(grep -m1 '^SIGKILL of rank 3 after step' <<< "$out" || true)
    if [ -z "$line" ]; then echo "run $i: no figure"; echo "$out" | tail -20; continue; fi
    python3 - "$i" "$line" "$(grep -c '\[  PASSED  \]' <<< "$out" || true)" <<'PY'
import re, sys
run, line, passed = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
step = float(re.findall(r"([0-9.]+) s after the fault", line)[0])
print(f"{run:<4} {step:>18.2f}{'' if passed else '  (test failed)'}")
PY
  done
  exit 0
fi
steps=${1:-40}
[ -f data/fortunes/train.bin ] || scripts/prepare-fortunes.sh "$bin/fsdp8" "$PWD/data/fortunes"
tmp=$(mktemp -d "$PWD/data/bench-recovery.XXXXXX")  # under the data root: the checkpoints go here
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
now() { date +%s.%N; }
port=$((20000 + RANDOM % 20000)); addr=127.0.0.1:$port
cli() { "$bin/fsdp8" --coordinator "$addr" "$@"; }
# shellcheck disable=SC2086
"$bin/fsdp8-coordinator" --listen "$addr" --state_db "$tmp/db" --data_roots "$PWD/data" \
  ${COORDINATOR_FLAGS:-} > "$tmp/coord.log" 2>&1 & pids+=($!)
declare -A pid_of  # worker id -> pid; started one at a time so that w-<i> is the i-th
for i in 1 2 3 4; do
  "$bin/fsdp8-worker" --coordinator "$addr" --threads 1 > "$tmp/w$i.log" 2>&1 & pids+=($!)
  pid_of[w-$i]=$!
  for _ in $(seq 150); do
    [ "$(cli workers 2>/dev/null | grep -c '^w-')" -ge "$i" ] && break
    sleep 0.1
  done
done
sed -e "s|DATA_DIR|$PWD/data/fortunes|" -e "s|steps: 600|steps: $steps|" \
    -e "s|eval_every: 100|eval_every: 0|" data/default-job.yaml > "$tmp/job.yaml"
printf 'checkpoint:\n  dir: %s/ck\n  every_steps: 10\n  keep_last: 10\n' "$tmp" >> "$tmp/job.yaml"
id=$(cli submit --no-watch "$tmp/job.yaml" | grep -oE 'job-[0-9a-f]+' | head -1)
# Every event line with the time it arrived.
cli watch "$id" | while IFS= read -r l; do printf '%s %s\n' "$(now)" "$l"; done > "$tmp/events" &
status() { cli status --json "$id"; }
field() { python3 -c "import json,sys; j=json.load(sys.stdin); print(j.get('$1', ${2:-0}))"; }
wait_step() {  # until the job has completed more than $1 steps in a generation above $2
  # One CLI call and one python per poll, every 0.1 s, to keep the polling off the workers' cores.
  while :; do
    r=$(status | python3 -c "
import json,sys; j=json.load(sys.stdin)
done = j.get('state') in ('JOB_STATE_FAILED', 'JOB_STATE_SUCCEEDED')
print(int(done or (int(j.get('generation', 0)) > $2 and int(j.get('step', 0)) > $1)))")
    [ "$r" = 1 ] && break
    sleep 0.1
  done
  now
}
rank0() { status | python3 -c "import json,sys; print(json.load(sys.stdin)['worker_ids'][0])"; }
# The time of the first event line after $1 that contains $2.
event_after() {
  for _ in $(seq 1200); do
    t=$(awk -v t0="$1" -v pat="$2" '$1 > t0 && index($0, pat) { print $1; exit }' "$tmp/events")
    [ -n "$t" ] && { echo "$t"; return; }
    sleep 0.05
  done
  echo nan
}

fault() {  # $1: signal, $2: fault after this many steps, $3: generation before the fault
  wait_step "$2" "$(( $3 - 1 ))" > /dev/null
  local victim; victim=$(rank0)
  local t0; t0=$(now)
  kill "-$1" "${pid_of[$victim]}"
  local ckpt=$(( $2 / 10 * 10 ))
  local t_det; t_det=$(event_after "$t0" "RECOVERING:")
  local t_run; t_run=$(event_after "$t_det" "running on")
  local t_step; t_step=$(wait_step "$ckpt" "$3")
  python3 - "$1" "$victim" "$t0" "$t_det" "$t_run" "$t_step" <<'PY'
import sys
sig, victim, t0, det, run, step = sys.argv[1], sys.argv[2], *map(float, sys.argv[3:])
print(f"SIG{sig:<5} {victim:<6} {det - t0:>12.2f} {run - t0:>17.2f} {step - t0:>22.2f}")
PY
  [ "$1" = STOP ] && kill -KILL "${pid_of[$victim]}"
  return 0
}

echo "default model, 2 ranks, $steps steps, checkpoint every 10; coordinator flags: ${COORDINATOR_FLAGS:-(defaults)}"
printf '%-8s %-6s %12s %17s %22s\n' fault rank0 detected_s running_again_s first_new_step_done_s
fault KILL 12 1
fault STOP 28 2
cli watch "$id" > /dev/null || true
echo "final: $(status | field state '""'), restarts $(status | field restarts)"
python3 - "$tmp" <<'PY'
import glob, os, re, sys
saves, loads = [], []
for f in glob.glob(sys.argv[1] + "/w*.log"):
    for line in open(f, errors="replace"):
        m = re.search(r"saved \S+ \((\d+) bytes in ([0-9.e-]+) s\)", line)
        if m: saves.append((int(m.group(1)), float(m.group(2))))
        m = re.search(r"loaded checkpoint (\S+) \((\d+) ranks\) in ([0-9.e-]+) s", line)
        if m:
            # keep_last 10: the loaded checkpoint is still there; a rank reads its share of it
            size = sum(os.path.getsize(p) for p in glob.glob(m.group(1) + "/rank-*.ckpt"))
            loads.append((size // int(m.group(2)), float(m.group(3))))
if saves:
    b = sum(s for s, _ in saves) / len(saves); t = sum(t for _, t in saves) / len(saves)
    print(f"checkpoint write: {len(saves)} shard writes of {b/1e6:.2f} MB, {t:.3f} s each (fsynced): {b/t/1e6:.0f} MB/s per rank")
if loads and all(s for s, _ in loads):
    b = sum(s for s, _ in loads) / len(loads); t = sum(t for _, t in loads) / len(loads)
    print(f"checkpoint read:  {len(loads)} shard loads of {b/1e6:.2f} MB, {t:.3f} s each (verified, FP8 re-cast): {b/t/1e6:.0f} MB/s per rank")
PY
