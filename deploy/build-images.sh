#!/usr/bin/env bash
# deploy/build-images.sh [all|--no-cuda|base|coordinator|cuda-bases|worker]: builds the images with
# podman on a machine that reaches no container registry (as root). Default all; --no-cuda: all but
# the CUDA worker image; a step's name: the base, then that step.
#   base        a Debian 12 root file system (debootstrap --variant=minbase, from the Debian
#               mirror), imported and tagged as the Dockerfiles' bases debian:12 and debian:12-slim
#               (skipped when both exist, e.g. pulled from a registry);
#   coordinator fsdp8/coordinator:VERSION by `podman build -f deploy/coordinator.Dockerfile`, the
#               Dockerfile a user with a registry builds from Docker Hub's debian:12(-slim);
#   cuda-bases  local stand-ins for NVIDIA's CUDA bases, tagged as the names worker.Dockerfile uses
#               (skipped when they exist): the Debian base plus this machine's CUDA toolkit
#               (CUDA_HOME, default /usr/local/cuda), all of it for -devel, for -runtime the
#               libraries the worker loads;
#   worker      cuda-bases, then fsdp8/worker:VERSION-cuda13 from deploy/worker.Dockerfile.
# Every image carries the labels org.opencontainers.image.version (CMakeLists.txt) and .revision
# (the git commit) and runs as a non-root user; both and `--version` are checked after the build.
# Settings: deploy/podman-env.sh; FSDP8_DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail
cd "$(dirname "$0")/.."
. deploy/podman-env.sh
what=${1:-all}
case $what in all|--no-cuda|base|coordinator|cuda-bases|worker) ;; *)
  echo "usage: $0 [all|--no-cuda|base|coordinator|cuda-bases|worker]" >&2; exit 2 ;; esac
work=$FSDP8_DEPLOY_DIR
mirror=${FSDP8_DEBIAN_MIRROR:-http://deb.debian.org/debian}
version=$(sed -n 's/^project(fsdp8 VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit=$commit-dirty
say() { echo "[build-images $(date +%T)] $*"; }

# Docker Hub's debian:12 lists these sources and no package lists.
debian_sources() {  # debian_sources ROOTFS
  local keys=/usr/share/keyrings/debian-archive-keyring.gpg
  rm -f "$1/etc/apt/sources.list"
  cat > "$1/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: $keys

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: $keys
SOURCES
  rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/archives/*.deb
}

base_image() {
  local d=docker.io/library/debian
  if "${PODMAN[@]}" image exists $d:12 && "${PODMAN[@]}" image exists $d:12-slim; then
    say "base: $d:12 and $d:12-slim present"; return
  fi
  local tar=$work/debian-12-rootfs.tar rootfs=$work/rootfs t0=$SECONDS
  if [ ! -s "$tar" ]; then
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 ||
      { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    debian_sources "$rootfs"
    tar -C "$rootfs" -cf "$tar.tmp" . && mv "$tar.tmp" "$tar" && rm -rf "$rootfs"
    say "base: debootstrap bookworm in $((SECONDS - t0)) s ($tar)"
  fi
  # An imported file system has no image config: PATH and the command as Docker Hub's image.
  "${PODMAN[@]}" import --change 'CMD ["bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    "$tar" $d:12 > /dev/null
  "${PODMAN[@]}" tag $d:12 $d:12-slim
  say "base: $d:12 and $d:12-slim imported"
}

# The CUDA libraries the worker loads: linked (cudart, cuBLASLt, cuDNN, NCCL) and loaded by those
# (cuBLAS, cuDNN's sub-libraries, and NVRTC with its builtins and nvJitLink for cuDNN's
# runtime-compiled engines). The devel stand-in also needs the cuDNN and NCCL headers.
CUDA_RUNTIME_LIBS="libcudart.so.* libcublas.so.* libcublasLt.so.* libnccl.so.* libcudnn*.so.*
  libnvrtc.so.* libnvrtc-builtins.so.* libnvJitLink.so.*"
CUDA_HEADERS="cudnn*.h nccl*.h"

# host_files PATTERNS DIR...: for each pattern, the files matching it in the first DIR that has one;
# status 1, naming the pattern, when no DIR has it.
host_files() {
  local pat d patterns=$1; shift
  for pat in $patterns; do
    for d in "$@"; do
      if compgen -G "$d/$pat" > /dev/null; then ls -d "$d"/$pat; continue 2; fi
    done
    echo "build-images: no $pat in $* (CUDA_HOME; cuDNN and NCCL may come from packages)" >&2
    return 1
  done
}

# cuda_standin KIND CUDADIR: sets SCRIPT, the container script that makes the stand-in for NVIDIA's
# -KIND base (the toolkit under /usr/local/cuda-X.Y, linked from /usr/local/cuda, its lib64 in the
# linker's path, every library's dependencies resolved), and MOUNTS, the host directories it copies
# from. Libraries come from the toolkit's lib64 (a link to targets/x86_64-linux/lib in NVIDIA's
# layout) or, for cuDNN and NCCL installed from packages, the linker's directories; headers from
# the toolkit's include/ or /usr/include.
cuda_standin() {
  local kind=$1 cudadir=$2 lib libs headers f d libdirs
  local -A mounted=()
  lib=/usr/local/$(basename "$cudadir")
  mapfile -t libdirs < <(readlink -f "$cudadir/lib64"
                         ldconfig -p | sed -n 's|.* => \(.*\)/[^/]*$|\1|p' | sort -u)
  libs=$(host_files "$CUDA_RUNTIME_LIBS" "${libdirs[@]}") || exit 1
  headers=$(host_files "$CUDA_HEADERS" "$cudadir/include" /usr/include \
            /usr/include/x86_64-linux-gnu) || exit 1
  MOUNTS=() SCRIPT="mkdir -p $lib"
  if [ "$kind" = devel ]; then
    MOUNTS+=(-v "$cudadir:/opt/host-cuda:ro")
    SCRIPT+=$'\n'"cp -a /opt/host-cuda/. $lib/"
  else
    headers=
  fi
  SCRIPT+=$'\n'"mkdir -p $lib/lib64 $lib/include"
  for f in $libs $headers; do
    d=$(dirname "$f")
    if [ -z "${mounted[$d]:-}" ]; then
      mounted[$d]=/opt/host/${#mounted[@]}
      MOUNTS+=(-v "$d:${mounted[$d]}:ro")
    fi
    case $f in *.h) SCRIPT+=$'\n'"cp -Ln ${mounted[$d]}/${f##*/} $lib/include/" ;;
               *) SCRIPT+=$'\n'"cp -Ln ${mounted[$d]}/${f##*/} $lib/lib64/" ;; esac
  done
  SCRIPT+=$'\n'"cd $lib/lib64"$'\n'
  SCRIPT+='for f in lib*.so.*; do [ -e "${f%%.so.*}.so" ] || ln -s "$f" "${f%%.so.*}.so"; done'
  SCRIPT+=$'\n'"ln -sfn $lib /usr/local/cuda"
  SCRIPT+=$'\n'"echo /usr/local/cuda/lib64 > /etc/ld.so.conf.d/cuda.conf && ldconfig"
  SCRIPT+=$'\n'"if ldd $(for f in $libs; do printf '%s ' "${f##*/}"; done)| grep -B20 'not found'; then"
  SCRIPT+=$'\n'"  echo 'a CUDA library misses a dependency in the Debian base' >&2; exit 1; fi"
}

cuda_bases() {
  local tag cudadir name t0
  tag=$(sed -n 's/^ARG CUDA_IMAGE_TAG=//p' deploy/worker.Dockerfile)
  cudadir=$(readlink -f "${CUDA_HOME:-/usr/local/cuda}")
  [ -x "$cudadir/bin/nvcc" ] || { echo "build-images: no nvcc under $cudadir (CUDA_HOME)" >&2; exit 1; }
  for kind in devel runtime; do
    name=docker.io/nvidia/cuda:$tag-$kind-ubuntu24.04
    if "${PODMAN[@]}" image exists "$name"; then say "cuda: $name present"; continue; fi
    t0=$SECONDS
    cuda_standin $kind "$cudadir"
    "${PODMAN[@]}" rm -f fsdp8-cuda-standin > /dev/null 2>&1 || true
    "${PODMAN[@]}" run --name fsdp8-cuda-standin "${MOUNTS[@]}" docker.io/library/debian:12 \
      sh -ec "$SCRIPT" > "$work/cuda-$kind.log" 2>&1 ||
      { tail -20 "$work/cuda-$kind.log" >&2; echo "build-images: the $kind stand-in failed" >&2; exit 1; }
    "${PODMAN[@]}" commit -q --change 'CMD ["bash"]' --change "ENV CUDA_HOME=/usr/local/cuda" \
      --change "ENV PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
      --change "ENV LD_LIBRARY_PATH=/usr/local/cuda/lib64" fsdp8-cuda-standin "$name" > /dev/null
    "${PODMAN[@]}" rm fsdp8-cuda-standin > /dev/null
    say "cuda: $name: a stand-in from $cudadir in $((SECONDS - t0)) s"
  done
}

# pip in the worker's build stage (HTTPS to PyPI) trusts what this host trusts (e.g. a proxy's CA):
# the host's CA bundle and a pip.conf naming it, mounted read-only into the RUN steps only.
host_ca_mounts() {
  local ca=/etc/ssl/certs/ca-certificates.crt
  [ -s $ca ] || return 0
  printf '[global]\ncert = /run/fsdp8-host-ca.crt\n' > "$work/pip.conf"
  echo "-v $ca:/run/fsdp8-host-ca.crt:ro -v $work/pip.conf:/etc/pip.conf:ro"
}

# The host's compiler cache (the one scripts/build.sh fills) as a build volume at /ccache, where the
# Dockerfiles' build stages compile through it (as scripts/build.sh does, reusing its objects), with
# the host's locale variables, which ccache hashes: FSDP8_CCACHE_DIR, else ccache's cache directory
# when ccache is installed and the directory exists. FSDP8_CCACHE=0: none, a cold build as a user's.
ccache_args() {
  local dir=${FSDP8_CCACHE_DIR:-} v
  [ "${FSDP8_CCACHE:-1}" != 0 ] || return 0
  [ -n "$dir" ] || ! command -v ccache > /dev/null || dir=$(ccache -k cache_dir)
  [ -n "$dir" ] && [ -d "$dir" ] || return 0
  echo "-v $(cd "$dir" && pwd):/ccache"
  for v in LANG LC_ALL LC_CTYPE LC_MESSAGES; do [ -z "${!v:-}" ] || echo "--build-arg $v=${!v}"; done
}

build() {  # build DOCKERFILE TAG BINARY [BUILD_OPTION...]: the image; its labels, user, --version
  local t0=$SECONDS log v c u
  log=$work/build-$(basename "$1" .Dockerfile).log
  "${PODMAN[@]}" build -f "$1" --build-arg "FSDP8_VERSION=$version" \
    --build-arg "FSDP8_COMMIT=$commit" "${@:4}" -t "$2" . > "$log" 2>&1 ||
    { tail -40 "$log" >&2; echo "build-images: $1 failed (log: $log)" >&2; exit 1; }
  local f='{{index .Labels "org.opencontainers.image.version"}} '
  f+='{{index .Labels "org.opencontainers.image.revision"}} {{.User}}'
  read -r v c u <<< "$("${PODMAN[@]}" image inspect "$2" --format "$f")"
  [ "$v" = "$version" ] && [ "$c" = "$commit" ] ||
    { echo "build-images: $2 has labels version '$v' revision '$c'" >&2; exit 1; }
  case ${u%%:*} in ""|0|root) echo "build-images: $2 runs as '$u', not non-root" >&2; exit 1 ;; esac
  "${PODMAN[@]}" run --rm --entrypoint "$3" "$2" --version > /dev/null  # every library resolves
  say "$2 built from $1 in $((SECONDS - t0)) s: version $v, revision $c, user $u"
  [ -z "$(ccache_args)" ] || say "compiler cache $(ccache_args | head -1): $(grep -E '^ +(Hits|Misses):' "$log" |
    tr -s ' ' | tr '\n' ' ')"
}

base_image
case $what in all|--no-cuda|coordinator)
  # shellcheck disable=SC2046
  build deploy/coordinator.Dockerfile "fsdp8/coordinator:$version" /usr/local/bin/fsdp8-coordinator \
    $(ccache_args) ;;
esac
case $what in all|worker|cuda-bases) cuda_bases ;; esac
case $what in all|worker)
  # shellcheck disable=SC2046
  build deploy/worker.Dockerfile "fsdp8/worker:$version-cuda13" /usr/local/bin/fsdp8-worker \
    $(host_ca_mounts) $(ccache_args) ;;
esac
