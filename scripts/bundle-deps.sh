#!/usr/bin/env bash
# bundle-deps.sh OUT BIN...: copies each binary into OUT and the shared libraries it resolves to
# (per ldd) into OUT/lib, so that it runs on a host without the build host's -dev packages. The C
# runtime, the GCC runtime and the NVIDIA libraries (driver, CUDA runtime, cuBLAS, NCCL, cuDNN) are
# left out: a GPU host has its own, matched to its driver.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 OUT BIN..." >&2; exit 2; }
out=$1; shift
mkdir -p "$out/lib"
for bin in "$@"; do
  cp "$bin" "$out/"
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | while read -r lib; do
    case "${lib##*/}" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
      libcuda.so*|libcudart.so*|libcublas*.so*|libnccl.so*|libcudnn*.so*|libnvrtc*.so*) ;;
      *) [ -e "$out/lib/${lib##*/}" ] || cp -L "$lib" "$out/lib/" ;;
    esac
  done
done
