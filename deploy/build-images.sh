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

cuda_bases() {
  local tag cudadir lib copy name
  tag=$(sed -n 's/^ARG CUDA_IMAGE_TAG=//p' deploy/worker.Dockerfile)
  cudadir=$(readlink -f "${CUDA_HOME:-/usr/local/cuda}")
  [ -x "$cudadir/bin/nvcc" ] || { echo "build-images: no nvcc under $cudadir (CUDA_HOME)" >&2; exit 1; }
  lib=/usr/local/$(basename "$cudadir")
  for kind in devel runtime; do
    name=docker.io/nvidia/cuda:$tag-$kind-ubuntu24.04
    if "${PODMAN[@]}" image exists "$name"; then say "cuda: $name present"; continue; fi
    copy="cp -a /opt/host-cuda/. $lib/"
    [ $kind = devel ] || copy="mkdir -p $lib/lib && cd /opt/host-cuda/lib && cp -a libcudart.so* \
      libcublas.so* libcublasLt.so* libnccl.so* libcudnn*.so* libnvrtc*.so* libnvJitLink.so* $lib/lib/"
    "${PODMAN[@]}" rm -f fsdp8-cuda-standin > /dev/null 2>&1 || true
    "${PODMAN[@]}" run --name fsdp8-cuda-standin -v "$cudadir:/opt/host-cuda:ro" \
      docker.io/library/debian:12 sh -ec "mkdir -p $lib && $copy
        [ -e $lib/lib64 ] || ln -s lib $lib/lib64
        ln -sfn $lib /usr/local/cuda
        echo /usr/local/cuda/lib64 > /etc/ld.so.conf.d/cuda.conf && ldconfig"
    "${PODMAN[@]}" commit -q --change 'CMD ["bash"]' --change "ENV CUDA_HOME=/usr/local/cuda" \
      --change "ENV PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
      --change "ENV LD_LIBRARY_PATH=/usr/local/cuda/lib64" fsdp8-cuda-standin "$name" > /dev/null
    "${PODMAN[@]}" rm fsdp8-cuda-standin > /dev/null
    say "cuda: $name: a stand-in from $cudadir"
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
}

base_image
case $what in all|--no-cuda|coordinator)
  build deploy/coordinator.Dockerfile "fsdp8/coordinator:$version" /usr/local/bin/fsdp8-coordinator ;;
esac
case $what in all|worker|cuda-bases) cuda_bases ;; esac
case $what in all|worker)
  # shellcheck disable=SC2046
  build deploy/worker.Dockerfile "fsdp8/worker:$version-cuda13" /usr/local/bin/fsdp8-worker \
    $(host_ca_mounts) ;;
esac
