"""vLLM backend tests: they run in the second environment (`bash scripts/setup-vllm.sh`):
`.venv-vllm/bin/python -m pytest -q tests/vllm_cpu` (tests/conftest.py leaves them out elsewhere).

Faster on 2 cores: `-n 2 --dist loadgroup` (pytest-xdist). Every test names its xdist group, so a module's engines
start once, on one worker; the few things several groups need (the tiny model, the undisturbed one-engine run) are
built once per session, by whichever worker asks first (`once` below), the others waiting on its lock.

Where the time goes: each vLLM engine on CPU starts an EngineCore and a worker process, each importing vLLM (~12 s of
CPU each), and its shutdown waits ~5 s for the worker; an `esbatch train` process imports vLLM once more. So the tests
share engines within a module and runs across tests instead of starting their own.
"""

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _own_cores() -> None:
    """Each xdist worker keeps to its own share of the cores (2 workers on 2 cores: one each). An engine binds its
    OpenMP threads to the cores its process may use (esbatch/backends/vllm.py, _engine_envs), and its subprocesses
    inherit the share; unpinned, two workers' engines each bound a thread to every core and waited on each other's
    time slices at every barrier (the HF path measured 5-7x slower so). Off with ESBATCH_TEST_PIN=0."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or os.environ.get("ESBATCH_TEST_PIN", "1") == "0" or count < 2:
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        return
    i, per = int(worker[2:]), len(cores) // count
    os.sched_setaffinity(0, cores[i * per : (i + 1) * per])


_own_cores()


def shared_dir(tmp_path_factory) -> Path:
    """A folder all xdist workers of this session see (the session's base temp folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def once(tmp_path_factory, name: str):
    """``with once(f, "x") as (path, todo):`` -- build ``path`` (a folder) if ``todo``; every other xdist worker of
    the session waits for that on a file lock, then finds it done (nothing is timed: the lock is the order)."""
    from filelock import FileLock

    root = shared_dir(tmp_path_factory)
    done = root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        yield root / name, not done.exists()
        done.touch()


@pytest.fixture(scope="session")
def vllm_tiny(tmp_path_factory) -> Path:
    """The tiny random Llama the tiny-model tests share (head_dim 64: vLLM's CPU attention needs >= 32 or so)."""
    from toy import make_tiny_model

    with once(tmp_path_factory, "tiny") as (path, todo):
        if todo:
            make_tiny_model(path / "model", hidden=128, heads=2)
    return path / "model"


@pytest.fixture(scope="session")
def one_engine_run(tmp_path_factory, vllm_tiny) -> Path:
    """The undisturbed one-engine run of ``tiny_config`` (its center.safetensors and log.jsonl), trained once per
    session: the reference of tests/vllm_cpu/test_vllm_engines.py (two engines, static or dynamic) and of
    tests/vllm_cpu/test_vllm_hang.py (the run resumed after a hang)."""
    from toy_vllm import tiny_config, train

    with once(tmp_path_factory, "one-engine") as (path, todo):
        if todo:
            path.mkdir()
            train(tiny_config(path, vllm_tiny, "one"))
    return path / "runs" / "one"
