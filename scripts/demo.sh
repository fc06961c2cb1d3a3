#!/usr/bin/env bash
# Sets up, builds the daemons and the CLI, starts a local coordinator and 2 CPU workers, and trains
# the default model on the fortunes corpus with a live progress bar (on a terminal; the CLI writes
# the progress lines to runs/<time>/client.log either way). Ends with a summary: steps, wall time,
# mean tokens/s, final train and validation loss, where the logs, the loss plot and the checkpoints
# are. Logs go to runs/<time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
t_setup=$(date +%s)
scripts/install-deps.sh --demo  # the build packages, the corpus, gnuplot
# The demo trains on CPU workers and needs only the daemons and the CLI (no test targets).
FSDP8_CUDA=${FSDP8_CUDA:-OFF} scripts/build.sh fsdp8-coordinator fsdp8-worker fsdp8
bin=$PWD/build/bin
run=$PWD/runs/$(date +%Y%m%d-%H%M%S); mkdir -p "$run"
scripts/prepare-fortunes.sh "$bin/fsdp8" "$PWD/data/fortunes"
t_ready=$(date +%s)

port=${FSDP8_PORT:-50051}
addr=127.0.0.1:$port
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
"$bin/fsdp8-coordinator" --listen "$addr" --state_db "$run/coordinator.db" \
  --data_roots "$PWD/data" > "$run/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do  # until it listens; a coordinator that exits (port taken) is reported
  grep -q "listening on" "$run/coordinator.log" && break
  if ! kill -0 "${pids[0]}" 2>/dev/null; then
    echo "the coordinator did not start (port $port taken? set FSDP8_PORT):" >&2
    cat "$run/coordinator.log" >&2
    exit 1
  fi
  sleep 0.1
done
for i in 0 1; do
  "$bin/fsdp8-worker" --coordinator "$addr" --host 127.0.0.1 --threads 1 --name "demo-worker-$i" \
    > "$run/worker-$i.log" 2>&1 &
  pids+=($!)
done
# The demo's job: the default one, with a final checkpoint in the run folder (under the data root).
sed "s|DATA_DIR|$PWD/data/fortunes|" data/default-job.yaml > "$run/job.yaml"
mkdir -p "$PWD/data/checkpoints"
ckpt=$PWD/data/checkpoints/$(basename "$run")
printf 'checkpoint:\n  dir: %s\n' "$ckpt" >> "$run/job.yaml"
for _ in $(seq 150); do  # until the coordinator answers and both workers have registered
  [ "$("$bin/fsdp8" --coordinator "$addr" workers 2>/dev/null | grep -c ' cpu ')" -ge 2 ] && break
  sleep 0.2
done

t_submit=$(date +%s)
set +e
plot_flag=()
command -v gnuplot >/dev/null && plot_flag=(--plot "$run/loss.png")
# The CLI draws the bar on this terminal and writes the plain progress lines to client.log itself.
"$bin/fsdp8" --coordinator "$addr" submit "$run/job.yaml" --log "$run/client.log" "${plot_flag[@]}"
rc=$?
set -e
t_end=$(date +%s)
echo
echo "setup + build + prepare: $((t_ready - t_setup)) s; submit to final loss: $((t_end - t_submit)) s"
echo "logs:        $run (coordinator.log, worker-0.log, worker-1.log, client.log, job.yaml)"
[ ${#plot_flag[@]} -gt 0 ] && echo "loss plot:   $run/loss.png"
echo "checkpoints: $ckpt"
echo "export:      $bin/fsdp8 export $ckpt --out DIR (a Hugging Face model of the last one)"
exit "$rc"
