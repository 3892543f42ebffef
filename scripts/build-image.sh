#!/usr/bin/env bash
# Build esbatch's CPU image with podman, with no container registry: the base image is a Debian bookworm
# root filesystem that this script makes itself (debootstrap) and imports, and the Dockerfile is built with
# the build arguments that swap its CUDA base for that CPU one (docs/containers.md, "CPU image").
#
#   scripts/build-image.sh                  # make the base (once) and build localhost/esbatch:cpu
#   scripts/build-image.sh run [OPTS --] CMD...   # run CMD in the built image, e.g. `run esbatch --version`;
#                                                  # OPTS go to `podman run` (e.g. -v DIR:/home/esbatch/esbatch-runs)
#   scripts/build-image.sh flags            # print the podman flags this machine needs (see below)
#
# Run as root (rootful podman; debootstrap needs root). Needs podman, debootstrap and a Debian mirror; pip
# in the build reaches PyPI. Everything runs under nice 19 / ionice idle. Idempotent: the base is made only
# when its image is missing, and podman's layer cache turns a rebuild with unchanged inputs into seconds.
#
# Environment (all optional):
#   ESBATCH_IMAGE        tag to build                         (localhost/esbatch:cpu)
#   ESBATCH_BASE_IMAGE   base image made by debootstrap        (localhost/debian-base:bookworm)
#   ESBATCH_IMAGE_WORK   scratch folder for the root fs        (/var/tmp/esbatch-image; emptied after import)
#   DEBIAN_MIRROR        debootstrap's mirror                  (http://deb.debian.org/debian)
#   TORCH_VERSION        the torch pin                         (2.13.0+cpu: the local part makes pip refuse
#                                                               PyPI's CUDA build of 2.13.0)
#   TORCH_FIND_LINKS     where the CPU torch wheel is: a folder (bind-mounted into the build) or a URL
#                        (/opt/wheels if it holds a torch wheel, else https://download.pytorch.org/whl/cpu/torch/)
#   PIP_CERT, PIP_INDEX_URL  this host's pip settings, passed on to pip in the build when set (PIP_CERT: the
#                        CA bundle of a TLS-inspecting proxy; mounted into the build)
#
# Machines that refuse podman's defaults: some sandboxes (a VM without CAP_SYS_RESOURCE, hybrid cgroups
# v1 + v2 with a controller on the v2 side) refuse both of crun's and podman's defaults:
#   crun: setrlimit `RLIMIT_NOFILE`: Operation not permitted        (default nofile 1048576 > the hard limit)
#   crun: cgroups in hybrid mode not supported, drop all controllers from cgroupv2
# so the script first tries a plain `podman run` of the base and, when that fails, uses runc and ulimits
# within the host's hard limits instead (printed by `flags`).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${ESBATCH_IMAGE:-localhost/esbatch:cpu}
BASE=${ESBATCH_BASE_IMAGE:-localhost/debian-base:bookworm}
WORK=${ESBATCH_IMAGE_WORK:-/var/tmp/esbatch-image}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_VERSION=${TORCH_VERSION:-2.13.0+cpu}
if [ -z "${TORCH_FIND_LINKS:-}" ]; then
  if compgen -G "/opt/wheels/torch-*.whl" >/dev/null; then
    TORCH_FIND_LINKS=/opt/wheels
  else
    TORCH_FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/
  fi
fi

renice -n 19 -p $$ >/dev/null
ionice -c3 -p $$ 2>/dev/null || true

log() { echo "build-image: $*" >&2; }

make_base() {
  if podman image exists "$BASE"; then
    return
  fi
  command -v debootstrap >/dev/null || {
    log "debootstrap is missing (apt-get install debootstrap)"
    exit 1
  }
  log "making $BASE with debootstrap from $MIRROR (~2 minutes)"
  rm -rf "$WORK/rootfs"
  mkdir -p "$WORK"
  debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log"
  rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
  tar -C "$WORK/rootfs" --numeric-owner -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$WORK/rootfs"
}

# The global podman flags (RUNTIME) and the per-container ones (LIMITS) this machine needs.
RUNTIME=()
LIMITS=()
probe() {
  local err
  if err=$(podman run --rm "$BASE" true 2>&1); then
    return
  fi
  log "podman run with the defaults was refused: $err"
  RUNTIME=(--runtime runc)
  # nproc: 32768 passed here, 65536 was refused although `ulimit -Hu` said 96363
  LIMITS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=32768:32768)
  if ! err=$(podman "${RUNTIME[@]}" run --rm "${LIMITS[@]}" "$BASE" true 2>&1); then
    log "and with ${RUNTIME[*]} ${LIMITS[*]}: $err"
    exit 1
  fi
  log "using ${RUNTIME[*]} ${LIMITS[*]}"
}

build() {
  local mounts=() links=$TORCH_FIND_LINKS pip=()
  # (podman leaves each mount point behind in the image, empty: hence under /tmp)
  if [ -d "$TORCH_FIND_LINKS" ]; then
    mounts+=(--volume "$(realpath "$TORCH_FIND_LINKS"):/tmp/wheels:ro")
    links=/tmp/wheels
  fi
  # this host's pip settings that pip in the build needs too: a mirror, and the CA bundle of a proxy that
  # inspects TLS (without it: CERTIFICATE_VERIFY_FAILED, self-signed certificate in certificate chain)
  if [ -n "${PIP_CERT:-}" ]; then
    mounts+=(--volume "$(realpath "$PIP_CERT"):/tmp/pip-cert.pem:ro")
    pip+=(--build-arg PIP_CERT=/tmp/pip-cert.pem)
  fi
  log "building $IMAGE from $BASE (torch $TORCH_VERSION from $TORCH_FIND_LINKS)"
  # --format docker: OCI images cannot hold the Dockerfile's HEALTHCHECK
  podman "${RUNTIME[@]}" build "${LIMITS[@]}" "${mounts[@]}" --format docker \
    --build-arg BASE_IMAGE="$BASE" \
    --build-arg ACCELERATOR=cpu \
    --build-arg PYTHON_VERSION=3.11 \
    --build-arg TORCH_VERSION="$TORCH_VERSION" \
    --build-arg PIP_INDEX_URL="${PIP_INDEX_URL:-https://pypi.org/simple}" \
    --build-arg PIP_FIND_LINKS="$links" "${pip[@]}" \
    --tag "$IMAGE" .
  podman image prune --force >/dev/null # the dangling layers of earlier builds of the tag
}

case "${1:-build}" in
  build)
    make_base
    probe
    build
    podman image ls "$IMAGE"
    ;;
  run)
    shift
    opts=()
    if [[ " $* " == *" -- "* ]]; then # podman run options first
      while [ "$1" != -- ]; do
        opts+=("$1")
        shift
      done
      shift
    fi
    probe
    # --no-healthcheck: podman starts the image's HEALTHCHECK timer through systemd, which a sandbox may lack
    # ("unable to get systemd connection to add healthchecks"); no -t: callers capture the output
    exec podman "${RUNTIME[@]}" run --rm --no-healthcheck "${LIMITS[@]}" "${opts[@]}" "$IMAGE" "$@"
    ;;
  flags)
    probe
    echo "${RUNTIME[*]}" "${LIMITS[*]}"
    ;;
  *)
    log "unknown command $1 (build, run CMD..., flags)"
    exit 2
    ;;
esac
