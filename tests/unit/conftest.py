"""The fast tier: `pytest tests/unit` checks the pure logic (ES math, metrics, verifiers, config validation,
sweep planning and state, analyses on hand-built inputs) in a few minutes on 2 cores.

Its rule, enforced here: no test starts a process. Tests that run the CLI, a sandboxed program, a tool, a
SmolLM2 load, an engine or a cluster belong in tests/integration, tests/slurm or tests/vllm_cpu. Two helpers
are shared by the whole session instead, started before any test: the noise kernel (compiled once into the
user's cache) and the math-verify worker pool (idle workers reused by every math check); MLflow and matplotlib's
font manager are imported first too (their imports run `uname -p`, and `fc-list` where the font cache is new),
and the tiny model of the ``tiny_model_dir`` fixture is built (once per session; else in its first test's time).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest


class ProcessStarted(AssertionError):
    """A unit test started a process: move it to tests/integration (or start the helper once per session)."""


_started: list[bool] = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """Start the helpers before the first test, so that no test's time includes them (scripts/test.sh names the
    unit cases over 1 s); not in pytest-xdist's controller, which runs no test."""
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        return
    if session.config.option.collectonly:  # --collect-only runs no test
        return
    if any("unit" in item.path.parts for item in session.items):
        _start_helpers(session.config._tmp_path_factory)  # pytest's own tmp_path_factory (its tmpdir plugin)


@pytest.fixture(scope="session")
def _session_helpers(tmp_path_factory: pytest.TempPathFactory) -> None:
    _start_helpers(tmp_path_factory)


def _start_helpers(tmp_path_factory: pytest.TempPathFactory) -> None:
    if _started:
        return
    _started.append(True)
    import matplotlib.font_manager  # noqa: F401 - on a fresh machine its import runs `fc-list` to build the font cache
    import mlflow.tracking  # noqa: F401 - its import runs `uname -p` once (platform.platform())
    from toy import session_tiny_model

    from esbatch.perturb import cpu_kernel
    from esbatch.tasks import verify_math

    cpu_kernel.cpu_simd()  # builds (or finds) the C kernel: `cc --version`, and `cc` once per source
    verify_math.start_workers(verify_math.MAX_IDLE_WORKERS)
    session_tiny_model(tmp_path_factory)  # the tiny_model_dir fixture's model (seconds: torch, transformers, a save)


@pytest.fixture(scope="module", autouse=True)
def _no_processes(_session_helpers):
    """Refuse every process start while a unit test module runs (its module fixtures included). Module scope:
    in a session that also runs tests/integration, the guard is lifted when pytest moves on to those."""

    def refuse(*args, **kwargs):
        raise ProcessStarted(
            "a test in tests/unit (the fast tier) started a process: move it to tests/integration "
            f"(args: {str([a for a in args if not isinstance(a, subprocess.Popen)])[:200]})"
        )

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", refuse)
        mp.setattr(multiprocessing.Process, "start", refuse)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
            if hasattr(os, name):
                mp.setattr(os, name, refuse)
        yield
