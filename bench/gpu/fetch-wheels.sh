#!/usr/bin/env bash
# Downloads the Python wheels bench/gpu/run.sh installs on a GPU host without network (torchao
# 0.18.0, for the PyTorch float8 references) into .dev/wheels, for the GPU host's Python (3.12,
# x86-64 Linux). Run it where there is network, then carry .dev/wheels with the checkout.
#   bench/gpu/fetch-wheels.sh            # PYTHON_VERSION=3.12 by default
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.dev/wheels
mkdir -p "$dest"
if ! git check-ignore -q "$dest/x.whl"; then
  echo "fetch-wheels.sh: $dest is not ignored by git; add /.dev/ to .git/info/exclude first" >&2
  exit 1
fi
python3 -m pip download --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --dest "$dest" torchao==0.18.0
ls -l "$dest"
