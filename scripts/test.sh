#!/usr/bin/env bash
# Sets up, builds and runs every test (GoogleTest through ctest). CUDA cases skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 900
