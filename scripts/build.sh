#!/usr/bin/env bash
# Configures and builds fsdp8 into ./build (CPU backend; CUDA too when nvcc is found, unless
# FSDP8_CUDA=OFF is set in the environment). Usage: scripts/build.sh [TARGET...]: every target
# (tests included) by default, else only the named ones (e.g. fsdp8-coordinator fsdp8-worker fsdp8).
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=${FSDP8_CUDA:-AUTO}
cmake -S . -B build -G Ninja -DFSDP8_CUDA="$cuda" > build.configure.log 2>&1 || { cat build.configure.log; exit 1; }
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build build -j "$(nproc)" "${targets[@]}"
