#!/usr/bin/env bash
# Turns the Debian fortunes corpus into byte-level token shards: every file in
# /usr/share/games/fortunes except *.dat and *.u8, concatenated in name order (C locale), last 5%
# held out for validation. Usage: prepare-fortunes.sh FSDP8_CLI OUT_DIR
set -euo pipefail
cli=$1; out=$2
src=/usr/share/games/fortunes
[ -d "$src" ] || { echo "prepare-fortunes: $src missing (apt-get install fortunes)" >&2; exit 1; }
mapfile -t files < <(cd "$src" && ls | grep -vE '\.(dat|u8)$' | LC_ALL=C sort | sed "s|^|$src/|")
"$cli" prepare --out "$out" --val-fraction 0.05 "${files[@]}"
