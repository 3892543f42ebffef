"""Sequential compositions (paper Section 3.2): ES->GRPO and GRPO->ES under one total update budget.

    algorithm: pipeline
    pipeline: {stages: [es, grpo], split: [0.5, 0.5], updates: 300}
    es:   {...}      # the ES stage's settings (its budget is set by the pipeline)
    grpo: {...}      # the GRPO stage's settings

Each stage is an ordinary training run in ``<run dir>/stage<k>-<algorithm>/`` that starts from the
previous stage's weights (``model.init_weights`` = its ``center.safetensors``) and is nested under the
pipeline's MLflow run. Stages run as ``esbatch train`` subprocesses, so a GRPO stage gets its torchrun
ranks. The pipeline goes through the same run lifecycle as any run (run.json with its budget and progress,
one MLflow run, the stop policy); a re-run skips finished stages and resumes an interrupted one, and the
final stage's center becomes the pipeline's own ``center.safetensors``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from esbatch import durable
from esbatch.backends import BACKENDS
from esbatch.schema import setting
from esbatch.train import stop
from esbatch.train.config import ALGORITHMS, Algorithm, RunTarget, TrainConfig
from esbatch.train.lifecycle import RunSession
from esbatch.train.rundir import RunDir

STAGE_ALGORITHMS = ("es", "grpo")


@dataclass
class PipelineConfig:
    stages: list = setting([], "Algorithms run one after the other, each from the previous one's weights: [es, grpo].")
    split: list | None = setting(None, "Share of the total budget per stage (default: equal), e.g. [0.5, 0.5].")
    updates: int | None = setting(None, "Total update budget shared by the stages.", ge=1)


def stage_budgets(total: int, n: int, split: list[float] | None) -> list[int]:
    """Integer budgets that sum to ``total``, proportional to ``split`` (equal by default)."""
    shares = split or [1.0] * n
    raw = [total * s / sum(shares) for s in shares]
    out = [int(x) for x in raw]
    for i in sorted(range(n), key=lambda i: raw[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1  # largest remainders first
    return out


def stage_configs(
    cfg: TrainConfig, run_dir: Path, parent_run_id: str | None, uri: str | None = None
) -> list[tuple[RunDir, TrainConfig]]:
    """(stage folder, stage config) for every stage; weights flow from each stage to the next."""
    out = []
    prev = cfg.model.init_weights
    p = cfg.section(PipelineConfig)
    budgets = stage_budgets(p.updates, len(p.stages), p.split)
    before: list[list[int]] = []  # one data stream: each stage continues where the previous one stopped
    for k, (algo, n) in enumerate(zip(p.stages, budgets), 1):
        sc = copy.deepcopy(cfg)
        sc.algorithm = algo
        stage = ALGORITHMS.get(algo)
        section = getattr(sc, stage.section)
        section.updates, section.epochs = n, None
        sc.checkpoint.snapshots = [t for t in sc.checkpoint.snapshots if t <= n]  # a stage counts its own updates
        sc.run.data_before = [list(x) for x in before]
        batches = stage.data_batches(sc, n)
        before.append([batches, section.batch_size])
        sc.model.init_weights = prev
        rd = RunDir(run_dir).stage(k, algo)
        sc.run.output_dir, sc.run.name = str(run_dir), rd.path.name
        sc.tracking.parent_run_id = parent_run_id
        sc.tracking.uri = uri or cfg.tracking.uri  # the stages log next to their pipeline's run
        sc.section(PipelineConfig).stages, sc.section(PipelineConfig).updates = [], None
        out.append((rd, sc))
        prev = str(rd.center)
    return out


class Pipeline(Algorithm):
    name: ClassVar[str] = "pipeline"
    section: ClassVar[str] = "pipeline"
    config: ClassVar[type] = PipelineConfig
    multi_rank: ClassVar[bool] = False  # one driver process; a GRPO stage starts its own ranks
    keeps_weights: ClassVar[str] = (
        "a pipeline's stages hand their weights to the next stage through center.safetensors (its "
        "model.init_weights), and a GRPO stage cannot rebuild its weights from a log"
    )

    @classmethod
    def inert(cls, sections: tuple[str, ...]) -> tuple[str, ...]:
        return ()  # the stages read their algorithms' sections

    @classmethod
    def check(cls, cfg: TrainConfig, errors: list[str]) -> None:
        cls.check_center(cfg, errors)
        p = cfg.section(PipelineConfig)
        bad = [s for s in p.stages if s not in STAGE_ALGORITHMS]
        if not p.stages or bad:
            errors.append(f"pipeline.stages: expected a list of es / grpo, e.g. [es, grpo]; got {p.stages!r}")
        if p.updates is None:
            errors.append("pipeline.updates: set the total update budget the stages share (e.g. 300)")
        elif p.updates < len(p.stages):
            errors.append(f"pipeline.updates: {p.updates} updates cannot be split over {len(p.stages)} stages")
        if p.split is not None and (
            len(p.split) != len(p.stages) or not all(isinstance(x, (int, float)) and x > 0 for x in p.split)
        ):
            errors.append(f"pipeline.split: expected {len(p.stages)} positive shares, one per stage; got {p.split!r}")
        if not bad:
            for algo in dict.fromkeys(p.stages):
                why = BACKENDS.unsupported(cfg.backend.name, algo)
                if why:
                    errors.append(f"backend.name: {cfg.backend.name} cannot run the {algo} stage: {why}")
                ALGORITHMS.get(algo).check_stage(cfg, errors)

    @classmethod
    def planned_budget(cls, cfg: TrainConfig) -> int | None:
        return cfg.section(PipelineConfig).updates

    @classmethod
    def budget(cls, cfg: TrainConfig, n_train: int) -> int:
        return cfg.section(PipelineConfig).updates

    @classmethod
    def run(cls, cfg: TrainConfig, target: RunTarget) -> dict[str, Any]:
        """Run the stages in order; returns a summary with each stage's folder and MLflow run."""
        t = target
        with RunSession(cfg, t.run_dir, resume=t.resume, run_name=t.run_name, tags=t.tags, logs_updates=False) as run:
            if t.resume:  # budgets may have changed (RESUME_OVERRIDABLE): the folder keeps the current config
                durable.write_text(run.rd.config, cfg.to_yaml())
            p = cfg.section(PipelineConfig)
            total = p.updates
            run.tags["pipeline.stages"] = "->".join(p.stages)
            run.start(total, stages=list(p.stages))
            stages = stage_configs(cfg, run.rd.path, run.run_id, run.uri)
            done_before, summaries = 0, []
            for rd, sc in stages:
                stop.check()  # between stages; a running stage gets the stop passed on (_run_stage)
                if rd.read_meta().get("status") != "finished":
                    _run_stage(run, rd, sc, done_before, t.progress)
                done_before += ALGORITHMS.get(sc.algorithm).planned_budget(sc)
                run.rd.write_meta(done=done_before, **stage_scores(rd))
                summaries.append({"name": rd.path.name, "run_dir": str(rd.path), **_ids(rd)})
            run.rd.link_center(stages[-1][0].center)
            return run.summary(total, stages=summaries, center=str(run.rd.center))


def _ids(rd: RunDir) -> dict[str, Any]:
    return {"mlflow_run_id": rd.read_meta().get("mlflow_run_id")}


def stage_scores(rd: RunDir) -> dict[str, Any]:
    """The stage's ``last_reward`` / ``last_heldout`` as its run.json keeps them (esbatch/train/lifecycle.py), to
    keep in the pipeline's run.json for `esbatch status`. A score the stage has not logged yet is left out, so the
    pipeline keeps the previous stage's (a stage without held-out evals: the newest held-out score there is)."""
    meta = rd.read_meta()
    return {k: meta[k] for k in ("last_reward", "last_heldout") if meta.get(k) is not None}


def _run_stage(run: RunSession, rd: RunDir, sc: TrainConfig, done_before: int, progress: bool) -> None:
    """One stage as an `esbatch train` subprocess; its progress flows into the pipeline's run.json."""
    stage_yaml = run.rd.path / f"{rd.path.name}.yaml"
    durable.write_text(stage_yaml, sc.to_yaml())
    args = ["--resume", str(rd.path)] if rd.exists() else [str(stage_yaml)]
    cmd = [sys.executable, "-m", "esbatch", "train", *args] + ([] if progress else ["--no-progress"])
    print(f"pipeline stage {rd.path.name}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    child = subprocess.Popen(cmd, env=os.environ.copy())
    forwarded, last = False, time.monotonic()
    while child.poll() is None:
        if stop.requested() and not forwarded:
            child.terminate()  # the stage stops between its updates and marks itself killed
            forwarded = True
        if time.monotonic() - last > 2:
            run.rd.write_meta(done=done_before + rd.progress(), **stage_scores(rd))
            last = time.monotonic()
        time.sleep(0.2)
    run.rd.write_meta(done=done_before + rd.progress(), **stage_scores(rd))
    stop.check()
    if child.returncode:
        raise RuntimeError(f"stage {rd.path.name} exited with {child.returncode}; re-run to resume it")
