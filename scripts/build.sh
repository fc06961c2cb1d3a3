#!/usr/bin/env bash
# Configures and builds fsdp8 into ./build (CPU backend; CUDA too when nvcc is found, unless
# FSDP8_CUDA=OFF is set in the environment). Usage: scripts/build.sh [TARGET...]: every target
# (tests included) by default, else only the named ones (e.g. fsdp8-coordinator fsdp8-worker fsdp8).
# Compiles through ccache when it is installed (scripts/install-deps.sh; FSDP8_CCACHE=0: without),
# into CCACHE_DIR or ccache's default (~/.cache/ccache), with paths relative to the checkout
# (CCACHE_BASEDIR, CCACHE_NOHASHDIR): other checkouts and the images' build stage
# (deploy/build-images.sh mounts this cache) reuse its objects.
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=${FSDP8_CUDA:-AUTO}
launcher=()
if [ "${FSDP8_CCACHE:-1}" != 0 ] && command -v ccache > /dev/null; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
  for lang in C CXX CUDA; do launcher+=(-DCMAKE_${lang}_COMPILER_LAUNCHER=ccache); done
fi
cmake -S . -B build -G Ninja -DFSDP8_CUDA="$cuda" "${launcher[@]}" > build.configure.log 2>&1 || { cat build.configure.log; exit 1; }
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build build -j "$(nproc)" "${targets[@]}"
