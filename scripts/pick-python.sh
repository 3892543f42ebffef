#!/usr/bin/env bash
# Prints the interpreter scripts/setup.sh and scripts/setup-vllm.sh build their venvs on: $PYTHON when set; else the
# distribution's /usr/bin/python3.11 when it can make venvs; else python3 on PATH. Debian builds its CPython with PGO
# and LTO and links libpython statically; pyenv's default build does neither. A toy `esbatch train` took ~10% less CPU
# on Debian's 3.11.2 than on pyenv's 3.11.7, and the test suite starts ~700 Python processes (docs/benchmarks.md,
# "Test suite time").
if [ -n "${PYTHON:-}" ]; then
  echo "$PYTHON"
elif /usr/bin/python3.11 -c 'import ensurepip, venv' 2> /dev/null; then
  echo /usr/bin/python3.11
else
  echo python3
fi
