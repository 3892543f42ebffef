"""The run lifecycle every algorithm shares (lifecycle.py), and what it is made of: the run folder
(rundir.py), the data schedule (schedule.py), problems and rewards (problems.py), FLOP accounting
(flops.py), ranks (ranks.py), the stop policy (stop.py), and the run config with the algorithm registry
(config.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from esbatch.train.config import RunTarget, TrainConfig


def train(
    cfg: TrainConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    run_name: str | None = None,
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Train (or resume) ``cfg`` into ``run_dir`` with its algorithm; returns the run's summary.

    ``run_name`` and ``tags`` go to the MLflow run (a sweep passes its label, parent run and SLURM ids).
    """
    algo = cfg.algo()
    return algo.run(cfg, RunTarget(Path(run_dir), resume, progress, run_name, tags or {}))
