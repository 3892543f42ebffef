"""`esbatch center RUN --at T`: the center after update T of any run, as a file `esbatch eval` can take.

ES: the center is theta_0 (the run's base model, plus model.init_weights) and the updates in log.jsonl
(seeds and weights), so it is rebuilt by replaying the first T logged updates with the trainer's own code
(esbatch/es/replay.py on the HF backend, on CPU): bit for bit the center the run held after T.
GRPO's updates cannot be replayed (gradients of sampled responses): its centers come from the snapshots
the run kept (``checkpoint.snapshots``) or its final center, which are copied.

``newest_center`` is what every reader of a run's final weights goes through (esbatch eval --checkpoint, the
sweeps' evaluations, analyze drift, threshold): center.safetensors when the run keeps one, else (an ES run with
checkpoint.center: final or none) the center after every logged update, rebuilt by the same replay into a
temporary file that is deleted once read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from esbatch import durable
from esbatch.config import load_run_config
from esbatch.train.config import TrainConfig
from esbatch.train.lock import writer_lock
from esbatch.train.rundir import RunDir, RunFolderError


def center_at(run: str | Path, t: int, out: str | Path | None = None) -> Path:
    """Write the center of run folder ``run`` after ``t`` updates to ``out`` (default:
    ``<run>/snapshots/center-<t>.safetensors``); returns the file."""

    rd = RunDir(run)
    if not rd.exists():
        raise FileNotFoundError(f"{rd.path}: not a run folder (no {RunDir.CONFIG})")
    if t < 0:
        raise ValueError(f"--at {t}: give an update count >= 0")
    cfg = load_run_config(rd.path)  # the run's own es.noise (legacy-cpu when it predates the key)
    target = Path(out) if out else rd.snapshot(t)
    inside = target.resolve().is_relative_to(rd.path.resolve())
    with writer_lock(rd.path) if inside else contextlib.nullcontext():  # a file inside the run: one writer
        return _write_center(rd, cfg, t, target)


def _write_center(rd: RunDir, cfg: TrainConfig, t: int, target: Path) -> Path:
    from esbatch.es.replay import rebuild_center  # heavy: torch (the HF backend replays on the CPU)

    if cfg.algorithm == "es":
        rd.save_center(rebuild_center(cfg, rd, t), t, target)
        return target
    if cfg.algorithm == "pipeline":
        stages = ", ".join(sorted(p.name for p in rd.path.glob("stage*-*"))) or "none yet"
        raise RunFolderError(
            f"{rd.path} is a pipeline: rebuild a center of one of its stages (esbatch center {rd.path}/STAGE --at T; "
            f"stages: {stages})"
        )
    source = stored_center(rd, t, cfg.algorithm)
    if source.resolve() != target.resolve():
        target.parent.mkdir(parents=True, exist_ok=True)
        with durable.replacing(target) as tmp:
            shutil.copyfile(source, tmp)
    return target


def stored_center(rd: RunDir, t: int, algorithm: str) -> Path:
    """The run's own file holding the center after ``t`` updates: its center or a snapshot; else an error
    saying which updates it kept."""
    if rd.center.exists() and rd.center_t() == t:
        return rd.center
    if rd.snapshot(t).exists():
        return rd.snapshot(t)
    kept = rd.snapshot_updates()
    final = rd.center_t() if rd.center.exists() else None
    what = {"grpo": "GRPO centers come from snapshots: its updates cannot be replayed from the log"}.get(
        algorithm, f"{algorithm} centers come from snapshots"
    )
    raise RunFolderError(
        f"--at {t}: {rd.path} holds no center after update {t} ({what}). It kept snapshots at "
        f"{kept or 'no update'} ({rd.snapshots}) and its center.safetensors is at "
        f"{'update ' + str(final) if final is not None else 'no update yet'}. Train with "
        f"checkpoint.snapshots: [{t}] to keep it (settable on resume for updates still to come)."
    )


def newest_t(rd: RunDir, algorithm: str) -> int:
    """The update of the newest center a run folder yields: its center.safetensors, else (ES) its logged updates;
    a RunFolderError when there is neither."""
    if rd.center.exists():
        return rd.center_t()
    n = len(rd.updates()) if algorithm == "es" else 0
    if not n:
        keeps = "GRPO writes it at the end" if algorithm == "grpo" else "ES writes it at every checkpoint"
        raise RunFolderError(
            f"{rd.path}: no {RunDir.CENTER} and no logged update to rebuild it from: the run has not saved its "
            f"weights yet ({keeps}; an ES run with checkpoint.center: final or none rebuilds them from log.jsonl). "
            "Resume the run, or use a snapshot: esbatch center RUN --at T"
        )
    return n


@contextmanager
def newest_center(rd: RunDir, algorithm: str) -> Iterator[tuple[Path, int]]:
    """(file, update) of the run's newest center: center.safetensors, or (ES without one) the center after all
    logged updates rebuilt from theta_0 into a temporary file inside the run folder, deleted on exit."""
    t = newest_t(rd, algorithm)
    if rd.center.exists():
        yield rd.center, t
        return
    tmp = rd.path / f".center-rebuilt-{t}.tmp{os.getpid()}.safetensors"
    with writer_lock(rd.path):  # the temporary file is written into the run folder
        try:
            center_at(rd.path, t, tmp)
            yield tmp, t
        finally:
            tmp.unlink(missing_ok=True)
