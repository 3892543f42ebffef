"""vLLM test helpers (tests/vllm_cpu): the tiny-model `esbatch train` config those tests share, a worker
extension that stops answering once, one that ignores weight loads (IgnoringLoadsWorkerExtension: it answers a
GRPO weight sync as if it had copied the tensors, and keeps its old weights), and a task recording the responses
it scores (RecordingDigitTask).

``HangingWorkerExtension``, for tests/vllm_cpu/test_vllm_hang.py (selected with backend.worker_extension:
toy_vllm:HangingWorkerExtension; imported inside the engine's worker process). Set in the environment of the run
(the engine inherits it): ESBATCH_TEST_HANG_GATE, the path of the test's gate (tests/gate.py). The call to
es_perturb after the first ESBATCH_TEST_HANG_AFTER (counted per worker process), while that gate is open, waits at
it with the tag "<worker pid> <its parent's pid (the EngineCore process)>", so the test knows the engine is about to
stop answering and which processes must not outlive the run; once the test releases it, it never returns
(ESBATCH_TEST_HANG_IN=rpc) or lets that RPC return and never finishes the next forward pass (=generate). A resumed
run (the gate closed: its socket is gone) does not hang again.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import yaml
from toy import DigitTask

from esbatch.backends.vllm_worker import ESWorkerExtension


def _forever(*_: Any, **__: Any) -> None:
    threading.Event().wait()


class HangingWorkerExtension(ESWorkerExtension):
    def es_perturb(self, seed: int, scale: float) -> dict[str, Any]:
        self.hang_calls = getattr(self, "hang_calls", 0) + 1
        gate = os.environ.get("ESBATCH_TEST_HANG_GATE", "")
        if self.hang_calls > int(os.environ.get("ESBATCH_TEST_HANG_AFTER", "0")) and gate and os.path.exists(gate):
            from gate import wait_at  # tests/ is on the run's PYTHONPATH, which the engine inherits

            wait_at(gate, f"{os.getpid()} {os.getppid()}")
            if os.environ.get("ESBATCH_TEST_HANG_IN", "rpc") == "rpc":
                _forever()
            self.execute_model = _forever  # the worker's own method, which vLLM calls by name for every step
        return super().es_perturb(seed, scale)


class IgnoringLoadsWorkerExtension(ESWorkerExtension):
    def es_set_weights(self, weights) -> dict[str, Any]:  # noqa: ANN001 - the RPC table types it
        return {"tensors": len(weights), "elements": 0}


def tiny_config(tmp: Path, model: Path, name: str, engines: int = 1, **es: object) -> Path:
    """The `esbatch train` config the tiny-model vLLM runs share (engines, dispatch and low rank aside): ES N=4 B=4,
    3 updates, a checkpoint after each (the hang test resumes from one). Written to ``tmp/name.yaml``."""
    cfg = {
        "run": {"name": name, "seed": 3, "output_dir": str(tmp / "runs")},
        "model": {"name": str(model), "dtype": "float32"},
        "backend": {"name": "vllm", "engines": engines, "kv_cache_gb": 1, "max_model_len": 256},
        "task": {"name": "toy:DigitTask", "params": {"size": 16}, "heldout_size": 0, "few_shot": 1},
        "generation": {"temperature": 1.0, "max_new_tokens": 6},
        "es": {"population_size": 4, "sigma": 0.05, "alpha": 0.02, "batch_size": 4, "updates": 3, **es},
        "eval": {"every": 0},
        "checkpoint": {"every": 1},
        "tracking": {"experiment": "vllm"},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def edit_config(path: Path, **sections: dict) -> Path:
    """Merge ``sections`` (e.g. run={"hang_timeout_s": 10}) into the config file at ``path``."""
    cfg = yaml.safe_load(path.read_text())
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(cfg: Path, *more: str) -> Path:
    """`esbatch train CFG`, or `esbatch train --resume DIR` when ``cfg`` is a run folder; asserts it succeeded and
    returns the run folder. ``more``: further arguments (e.g. --set KEY=VALUE)."""
    from toy import run_esbatch

    args = ("--resume", str(cfg)) if cfg.is_dir() else (str(cfg),)
    out = run_esbatch("train", *args, "--no-progress", *more, timeout=900, threads=None)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    if cfg.is_dir():
        return cfg
    run = yaml.safe_load(cfg.read_text())["run"]
    return Path(run["output_dir"]) / run["name"]


def run_log(run_dir: Path) -> list[dict]:
    """The run's log.jsonl, one dict per update."""
    return [yaml.safe_load(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]


class RecordingDigitTask(DigitTask):
    """DigitTask that appends every response it scores to ``<log>.rank<RANK>``, a line "pid<TAB>question<TAB>
    repr(response)" each, in scoring order, so a test can compare the rollouts of two runs or tell a pipeline's
    stages apart by their process (tests/vllm_cpu/test_vllm_grpo.py)."""

    def __init__(self, data_path: str | None = None, *, size: int = 40, log: str = "") -> None:
        super().__init__(data_path, size=size)
        self.log = f"{log}.rank{os.environ.get('RANK', '0')}"

    def score(self, response: str, ex: Any) -> Any:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\t{ex.question}\t{response!r}\n")
        return super().score(response, ex)
