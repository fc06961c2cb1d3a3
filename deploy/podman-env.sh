# Sourced by deploy/build-images.sh and deploy/podman-cpu-dev.sh: the podman command and the work
# directory.
#   FSDP8_DEPLOY_DIR   work directory (default build-deploy/ in the repository): the debootstrapped
#                      root file system, the translated manifests, the secret and config files
#   FSDP8_PODMAN       the podman command (default `podman --runtime runc`: runc, not crun, runs on
#                      hosts with cgroups in hybrid mode)
#   FSDP8_PODMAN_ROOT  a podman storage directory of its own (images, containers, volumes), e.g.
#                      for a test that must leave nothing behind; default: podman's usual store
# Unless CONTAINERS_CONF is set, podman reads a containers.conf with `default_ulimits = []`: hosts
# that refuse a container's setting RLIMIT_NOFILE / RLIMIT_NPROC run it with the host's limits.
FSDP8_DEPLOY_DIR=$(mkdir -p "${FSDP8_DEPLOY_DIR:-$PWD/build-deploy}" && cd "${FSDP8_DEPLOY_DIR:-$PWD/build-deploy}" && pwd)
export FSDP8_DEPLOY_DIR
if [ -z "${CONTAINERS_CONF:-}" ]; then
  printf '[containers]\ndefault_ulimits = []\n' > "$FSDP8_DEPLOY_DIR/containers.conf"
  export CONTAINERS_CONF=$FSDP8_DEPLOY_DIR/containers.conf
fi
FSDP8_PODMAN=${FSDP8_PODMAN:-podman --runtime runc}
if [ -n "${FSDP8_PODMAN_ROOT:-}" ]; then
  FSDP8_PODMAN="$FSDP8_PODMAN --root $FSDP8_PODMAN_ROOT/root --runroot $FSDP8_PODMAN_ROOT/run"
fi
export FSDP8_PODMAN
read -r -a PODMAN <<< "$FSDP8_PODMAN"
