"""vLLM backend tests: they run in the second environment (`bash scripts/setup-vllm.sh`):
`.venv-vllm/bin/python -m pytest -q tests/vllm_cpu` (tests/conftest.py leaves them out elsewhere)."""

import os

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
