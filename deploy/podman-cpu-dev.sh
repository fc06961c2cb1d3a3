#!/usr/bin/env bash
# bash deploy/podman-cpu-dev.sh [--no-cuda]: on a machine without a registry or a Kubernetes
# cluster (as root), builds the images (deploy/build-images.sh: the Debian 12 base by debootstrap,
# the coordinator image, the CUDA worker image from a stand-in base), then plays
# deploy/k8s/overlays/cpu-dev with `podman kube play` (deploy/kube_play.py): the probes SERVING, the
# default job SUCCEEDED with its checkpoints on the shared volume, a worker's preStop + SIGTERM and
# a coordinator SIGKILL + restart mid-job, each followed by the job resuming. Removes the pods,
# volumes and network it made when it ends; keeps the images (unless FSDP8_PODMAN_ROOT, below).
#
# The CUDA worker image is built where the CUDA toolkit is (CUDA_HOME, default /usr/local/cuda, with
# bin/nvcc) and PyPI answers (its build stage installs cudnn-frontend with pip); elsewhere it is left
# out with a line `SKIP: the CUDA worker image ...` saying why, and the rest runs. --no-cuda: left out.
# Exit 0: passed; 1: failed; 77: skipped, podman cannot run containers here or the Debian mirror is
# unreachable (the reason printed).
# Settings (deploy/podman-env.sh, deploy/kube_play.py): FSDP8_DEPLOY_DIR, FSDP8_PODMAN,
# FSDP8_DEPLOY_STEPS (default 600, the default job's), FSDP8_DEPLOY_FAULT_STEPS (120),
# FSDP8_DEPLOY_PORT, FSDP8_DEPLOY_NETWORK (default fsdp8-dev); FSDP8_PODMAN_ROOT: a storage
# directory of its own, removed at the end with every image, container and volume in it (the
# ctest's way to leave nothing behind).
set -euo pipefail
cd "$(dirname "$0")/.."
images=${1:-all}
case $images in all|--no-cuda) ;; *) echo "usage: $0 [--no-cuda]" >&2; exit 2 ;; esac
skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root (rootful podman for the pods' network, debootstrap)"
for t in podman runc debootstrap python3; do
  command -v $t > /dev/null || skip "$t is not installed (scripts/install-deps.sh installs it)"
done
command -v "${KUBECTL:-kubectl}" > /dev/null || skip "no kubectl (scripts/install-deps.sh installs it)"
python3 -c 'import grpc, yaml' 2> /dev/null || skip "python3 lacks grpc or yaml (scripts/install-deps.sh)"
. deploy/podman-env.sh
"${PODMAN[@]}" info > /dev/null 2>&1 || skip "'$FSDP8_PODMAN info' fails: $("${PODMAN[@]}" info 2>&1 | tail -1)"

cleanup_store() {  # the private store, when there is one, with everything in it
  [ -n "${FSDP8_PODMAN_ROOT:-}" ] || return 0
  "${PODMAN[@]}" pod rm -a -f -t 0 > /dev/null 2>&1 || true
  "${PODMAN[@]}" rm -a -f -t 0 > /dev/null 2>&1 || true
  "${PODMAN[@]}" volume rm -a -f > /dev/null 2>&1 || true
  "${PODMAN[@]}" rmi -a -f > /dev/null 2>&1 || true
  rm -rf "$FSDP8_PODMAN_ROOT"
}
cleanup_store  # what a killed earlier run left
trap cleanup_store EXIT
# SIGTERM or SIGINT (a timeout, ctest, Ctrl-C): the step running gets SIGTERM and its time to tear
# down (kube_play.py removes what it made), then the cleanup. Each step runs in the background and
# is waited for: bash runs a trap only between commands, and `wait` is one it interrupts.
child=
on_signal() {
  [ -z "$child" ] || { kill -TERM "$child" 2> /dev/null; wait "$child" 2> /dev/null; }
  exit 143
}
trap on_signal TERM INT
run_step() {  # run_step COMMAND...: COMMAND's exit status
  local rc=0
  "$@" & child=$!
  wait "$child" || rc=$?
  child=
  return $rc
}

# Can podman run a container here? One whose root is /bin/true and its libraries, before anything
# is built.
probe=$FSDP8_DEPLOY_DIR/probe-rootfs
rm -rf "$probe"
for f in /bin/true $(ldd /bin/true | grep -o '/[^ ]*'); do
  mkdir -p "$probe$(dirname "$f")" && cp -L "$f" "$probe$f"
done
out=$("${PODMAN[@]}" run --rm --rootfs "$probe" /bin/true 2>&1) ||
  skip "podman cannot run a container here: $out"
rm -rf "$probe"
# The Debian mirror (debootstrap, apt-get in the build stages): reachable?
mirror=${FSDP8_DEBIAN_MIRROR:-http://deb.debian.org/debian}
out=$(python3 -c 'import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/dists/bookworm/Release", timeout=30).read(1)' "$mirror" 2>&1) ||
  skip "the Debian mirror $mirror is unreachable: $(tail -1 <<< "$out")"

# The CUDA worker image: the toolkit its stand-in bases copy, and PyPI for its build stage's pip.
cuda_home=${CUDA_HOME:-/usr/local/cuda}
cuda_skip() { echo "SKIP: the CUDA worker image (deploy/worker.Dockerfile) is not built: $*"; images=--no-cuda; }
if [ "$images" = all ]; then
  if [ ! -x "$cuda_home/bin/nvcc" ]; then
    cuda_skip "no CUDA toolkit here (no $cuda_home/bin/nvcc; CUDA_HOME names another)"
  elif ! out=$(python3 -c 'import urllib.request
urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=30).read(1)' 2>&1); then
    cuda_skip "PyPI is unreachable: $(tail -1 <<< "$out")"
  fi
fi

t0=$SECONDS
run_step deploy/build-images.sh "$images"
t_images=$((SECONDS - t0))
t1=$SECONDS
rc=0
run_step python3 deploy/kube_play.py || rc=$?
echo "podman-cpu-dev: images ${t_images} s, kube play and jobs $((SECONDS - t1)) s, total $((SECONDS - t0)) s"
if [ "$images" = --no-cuda ]; then
  echo "podman-cpu-dev: the CUDA worker image (deploy/worker.Dockerfile) was not built"
fi
exit $rc
