#!/usr/bin/env bash
# Installs fsdp8's build and run dependencies from Debian 12 packages (run as root).
# Skips apt entirely when every package is already installed.
set -euo pipefail
PKGS=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler   # RPC
  libabsl-dev                                                              # Status, flags, strings
  libgloo-dev                                                              # CPU collectives
  libopenblas-dev                                                          # CPU GEMM
  libsqlite3-dev                                                           # coordinator job table
  libyaml-cpp-dev                                                          # YAML job specs
  zlib1g-dev                                                               # checkpoint checksums (CRC-32)
  libmicrohttpd-dev libjs-chart.js                                         # /metrics, status page + charts
  gnuplot-nox                                                              # fsdp8 watch --plot
  chromium python3-prometheus-client                                       # tests: status page, exposition parser
  libgtest-dev libgmock-dev                                                # tests
  openssl                                                                  # test certificates (TLS tests)
  clang libclang-rt-14-dev                                                 # libFuzzer (spec parser fuzz test)
  fortunes                                                                 # the default corpus
  python3-pip                                                              # test tools (below)
)
# Test tools from PyPI: the `safetensors` reader (and numpy) that checks `fsdp8 export` output.
pip_tools() {
  command -v python3 >/dev/null || return 0
  python3 -c 'import safetensors, numpy' 2>/dev/null && return 0
  echo "install-deps: pip install safetensors numpy"
  python3 -m pip install --quiet --disable-pip-version-check safetensors numpy 2>/dev/null ||
    python3 -m pip install --quiet --disable-pip-version-check --break-system-packages safetensors numpy
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
