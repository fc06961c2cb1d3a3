#!/usr/bin/env bash
# Builds the CUDA binaries on a build host and runs the GPU checks on a GPU host.
#
#   scripts/gpu-dev.sh build   (on the build host; it needs no GPU)
#       configures build-gpu/ with -DFSDP8_CUDA=ON, builds fsdp8-worker fsdp8-coordinator fsdp8
#       fsdp8-conformance fsdp8-bench-cuda fsdp8-cuda-step-test and the CPU benchmarks fsdp8-bench-cpu-gemm
#       fsdp8-bench-cpu-step (whichever targets exist; bench/cpu/run.sh runs from the bundle with BIN=.dev/gpu) and packs them with their
#       shared libraries into .dev/gpu/ (scripts/bundle-deps.sh; xz-compressed when large).
#       First installs the header-only cuDNN frontend (pip package nvidia-cudnn-frontend, pinned
#       below; a user builds the cuDNN attention path the same way: `pip install
#       nvidia-cudnn-frontend==1.32.0`, or -DFSDP8_CUDNN_FRONTEND_INCLUDE=<dir of cudnn_frontend.h>).
#       CMake finds it through python3; without it the cuDNN attention is simply not built.
#       libcudnn.so.9 is linked dynamically and not bundled: the GPU host has its own.
#   scripts/gpu-dev.sh run     (on the GPU host, in a copy of the checkout that includes .dev/)
#       runs nvidia-smi -L, the conformance suite on GPU 0, the CUDA-vs-CPU training-step test
#       (fsdp8-cuda-step-test, GPU 0), the benchmark, and — when SPEC names a
#       job spec file — a coordinator + 2 CUDA workers (GPUs 0 and 1) training that spec. Logs go to
#       $FSDP8_LOG_DIR (or runs/gpu-<time>/); a short table is printed last.
#       Optional: CONFORMANCE_FILTER (gtest filter, default '*cuda*'), BENCH_ARGS (e.g. --quick),
#       SKIP_CONFORMANCE=1, SKIP_CUDA_STEP=1, SKIP_BENCH=1.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
CUDNN_FRONTEND_VERSION=1.32.0

build() {
  set -e
  local bdir=$root/build-gpu
  # Header-only cuDNN frontend for kernels/cuda/attention_cudnn.cc (no dependencies needed for
  # the headers). SKIP_CUDNN_FRONTEND=1 skips the install (offline builds).
  if [ "${SKIP_CUDNN_FRONTEND:-0}" != 1 ] &&
     ! python3 -c "import importlib.metadata as m, sys; sys.exit(m.version('nvidia-cudnn-frontend') != '$CUDNN_FRONTEND_VERSION')" 2>/dev/null; then
    python3 -m pip install --quiet --no-deps "nvidia-cudnn-frontend==$CUDNN_FRONTEND_VERSION" ||
      echo "gpu-dev: pip install nvidia-cudnn-frontend failed; the cuDNN attention path will not be built" >&2
  fi
  cmake -S "$root" -B "$bdir" -G Ninja -DFSDP8_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
  local want=(fsdp8-worker fsdp8-coordinator fsdp8 fsdp8-conformance fsdp8-bench-cuda fsdp8-cuda-step-test
              fsdp8-bench-cpu-gemm fsdp8-bench-cpu-step)
  local have=()
  local targets
  targets=$(ninja -C "$bdir" -t targets all 2>/dev/null | awk -F: '{print $1}')
  for t in "${want[@]}"; do
    if grep -qx "$t" <<<"$targets"; then have+=("$t"); else echo "gpu-dev: target $t not defined, skipped"; fi
  done
  ninja -C "$bdir" -j"${JOBS:-2}" "${have[@]}"
  grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo '/.dev/' >> .git/info/exclude
  rm -rf "$root/.dev/gpu"
  local bins=()
  for t in "${have[@]}"; do bins+=("$bdir/bin/$t"); done
  "$root/scripts/bundle-deps.sh" "$root/.dev/gpu" "${bins[@]}"
  # Small corpora the training hook may name (the job spec's data path), when present.
  if [ -d "$root/data/fortunes" ]; then mkdir -p "$root/.dev/gpu/data" && cp -r "$root/data/fortunes" "$root/.dev/gpu/data/"; fi
  # Debug info stays in build-gpu/; the bundle carries stripped copies.
  for t in "${have[@]}"; do strip --strip-debug "$root/.dev/gpu/$t"; done
  local size
  size=$(du -sm "$root/.dev/gpu" | awk '{print $1}')
  rm -f "$root/.dev/gpu.tar.xz"
  if [ "$size" -ge 60 ]; then
    # Large (mostly OpenBLAS): ship it compressed; `run` unpacks it.
    tar -C "$root/.dev" -cf - gpu | xz -T2 -6 > "$root/.dev/gpu.tar.xz"
    rm -rf "$root/.dev/gpu"
    echo "gpu-dev: bundle is ${size} MiB unpacked, $(du -sm "$root/.dev/gpu.tar.xz" | awk '{print $1}') MiB as .dev/gpu.tar.xz: ${have[*]}"
  else
    echo "gpu-dev: bundle .dev/gpu is ${size} MiB: ${have[*]}"
  fi
  local total
  total=$(du -sm "$root/.dev" | awk '{print $1}')
  echo "gpu-dev: .dev is ${total} MiB"
}

declare -a TABLE=()
row() { TABLE+=("$(printf '%-22s %-8s %s' "$1" "$2" "$3")"); }

# Starts .dev/gpu/fsdp8-coordinator and two CUDA workers on GPUs 0 and 1, submits $SPEC, waits.
train_2gpu() {
  local logs=$1 bin=$root/.dev/gpu
  if [ -z "${SPEC:-}" ]; then row "train 2 GPUs" "skip" "SPEC not set"; return 0; fi
  if [ ! -x "$bin/fsdp8-coordinator" ] || [ ! -x "$bin/fsdp8-worker" ] || [ ! -x "$bin/fsdp8" ]; then
    row "train 2 GPUs" "skip" "coordinator/worker/CLI not in bundle"; return 0
  fi
  local port=${FSDP8_PORT:-50071} addr
  addr=127.0.0.1:$port
  local pids=()
  "$bin/fsdp8-coordinator" --listen "$addr" --state_db "$logs/coordinator.db" \
    --data_roots "${DATA_ROOTS:-$root/data,$root/.dev/gpu/data}" > "$logs/coordinator.log" 2>&1 &
  pids+=($!)
  sleep 1
  for d in 0 1; do
    "$bin/fsdp8-worker" --coordinator "$addr" --host 127.0.0.1 --backend cuda --device "$d" \
      > "$logs/worker-$d.log" 2>&1 &
    pids+=($!)
  done
  sleep 2
  local t0 rc
  t0=$(date +%s)
  local id
  id=$("$bin/fsdp8" --coordinator "$addr" submit --no-watch "$SPEC" 2> "$logs/train.log" | head -1)
  # The scaling state twice while the job runs: scales and amax histories should move.
  for k in 1 2; do
    sleep "${SCALING_PROBE_S:-3}"
    "$bin/fsdp8" --coordinator "$addr" scaling "$id" > "$logs/scaling-$k.txt" 2>&1
  done
  timeout "${TRAIN_TIMEOUT_S:-1800}" "$bin/fsdp8" --coordinator "$addr" watch "$id" >> "$logs/train.log" 2>&1
  rc=$?
  echo "== scaling state, two reads during training (first 8 tensors)"
  head -10 "$logs/scaling-1.txt"; head -10 "$logs/scaling-2.txt"
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait "${pids[@]}" 2>/dev/null
  local last
  last=$(grep -iE "loss" "$logs/train.log" | tail -1)
  row "train 2 GPUs" "$([ $rc -eq 0 ] && echo ok || echo "rc=$rc")" "$(( $(date +%s) - t0 ))s ${last:0:60}"
  tail -20 "$logs/train.log"
}

run() {
  local logs=${FSDP8_LOG_DIR:-$root/runs/gpu-$(date +%Y%m%d-%H%M%S)}
  mkdir -p "$logs"
  if [ ! -d "$root/.dev/gpu" ] && [ -f "$root/.dev/gpu.tar.xz" ]; then
    echo "== unpacking .dev/gpu.tar.xz"; xz -dc "$root/.dev/gpu.tar.xz" | tar -C "$root/.dev" -xf - || exit 1
  fi
  if [ ! -d "$root/.dev/gpu" ]; then echo "gpu-dev: no .dev/gpu bundle: run 'scripts/gpu-dev.sh build' first and copy .dev/ here" >&2; exit 1; fi
  export LD_LIBRARY_PATH=$root/.dev/gpu/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export NCCL_NVLS_ENABLE=0
  local bin=$root/.dev/gpu
  echo "== nvidia-smi -L"; nvidia-smi -L 2>&1 | tee "$logs/nvidia-smi.txt"
  local ngpu
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  row "GPUs" "$ngpu" "$(head -1 "$logs/nvidia-smi.txt" | cut -c1-60)"
  for b in fsdp8-conformance fsdp8-cuda-step-test fsdp8-bench-cuda fsdp8-worker; do
    if [ -x "$bin/$b" ] && ldd "$bin/$b" | grep -q "not found"; then
      echo "gpu-dev: $b has unresolved libraries:"; ldd "$bin/$b" | grep "not found"
    fi
  done

  if [ "${SKIP_CONFORMANCE:-0}" != 1 ] && [ -x "$bin/fsdp8-conformance" ]; then
    echo "== conformance"
    local t0=$(date +%s) rc
    "$bin/fsdp8-conformance" --gtest_filter="${CONFORMANCE_FILTER:-*cuda*}" > "$logs/conformance.log" 2>&1
    rc=$?
    grep -E "seed|^op |FAILED|Failure|PASSED|SKIPPED|fsdp8 cuda|check failed" "$logs/conformance.log" | tail -400
    local nfail
    nfail=$(grep -c '^\[  FAILED  \]' "$logs/conformance.log")
    row "conformance" "$([ $rc -eq 0 ] && echo pass || echo FAIL)" "rc=$rc failed-lines=$nfail $(( $(date +%s) - t0 ))s"
    # Per-op worst error (cuda), for the issue report.
    grep -E '^op .* backend cuda ' "$logs/conformance.log" |
      awk '{split($2,a,"/"); k=a[1]; v=$6+0; if (!(k in m) || v>m[k]) m[k]=v} END {for (k in m) printf "  %-22s %.3g\n", k, m[k]}' |
      sort > "$logs/conformance-max-err.txt"
    echo "== max_rel_err per op (cuda)"; cat "$logs/conformance-max-err.txt"
  fi

  if [ "${SKIP_CUDA_STEP:-0}" != 1 ] && [ -x "$bin/fsdp8-cuda-step-test" ]; then
    echo "== cuda step vs cpu"
    local t0=$(date +%s) rc
    FSDP8_CUDA_STEP_DEVICE=0 "$bin/fsdp8-cuda-step-test" > "$logs/cuda-step.log" 2>&1
    rc=$?
    grep -E "^cuda-step|Failure|FAILED|PASSED|SKIPPED|Skipped" "$logs/cuda-step.log" | tail -100
    local nfail nskip
    nfail=$(grep -c '^\[  FAILED  \]' "$logs/cuda-step.log")
    nskip=$(grep -c '^\[  SKIPPED \]' "$logs/cuda-step.log")
    row "cuda step vs cpu" "$([ $rc -eq 0 ] && echo pass || echo FAIL)" "rc=$rc failed-lines=$nfail skipped-lines=$nskip $(( $(date +%s) - t0 ))s"
  fi

  if [ "${SKIP_BENCH:-0}" != 1 ] && [ -x "$bin/fsdp8-bench-cuda" ]; then
    echo "== bench"
    "$bin/fsdp8-bench-cuda" ${BENCH_ARGS:-} > "$logs/bench.log" 2>&1
    local rc=$?
    cat "$logs/bench.log"
    row "bench" "$([ $rc -eq 0 ] && echo ok || echo "rc=$rc")" "see bench.log"
  fi

  if [ "$ngpu" -ge 2 ]; then train_2gpu "$logs"; else row "train 2 GPUs" "skip" "needs 2 GPUs"; fi

  echo
  echo "== summary (logs in $logs)"
  printf '%s\n' "${TABLE[@]}" | tee "$logs/summary.txt"
  if [ -f "$logs/bench.log" ]; then sed -n '/^section/,$p' "$logs/bench.log"; fi
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
