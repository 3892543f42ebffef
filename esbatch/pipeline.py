"""Sequential compositions (paper Section 3.2): ES->GRPO and GRPO->ES under one total update budget.

    algorithm: pipeline
    pipeline: {stages: [es, grpo], split: [0.5, 0.5], updates: 300}
    es:   {...}      # the ES stage's settings (its budget is set by the pipeline)
    grpo: {...}      # the GRPO stage's settings

Each stage is an ordinary training run in ``<run dir>/stage<k>-<algorithm>/`` that starts from the
previous stage's weights (``model.init_weights`` = its ``center.safetensors``) and is nested under the
pipeline's MLflow run. Stages run as ``esbatch train`` subprocesses, so a GRPO stage gets its torchrun
ranks. A re-run skips finished stages and resumes an interrupted one.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from esbatch.config import TrainConfig, flatten
from esbatch.es.trainer import STOP


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
) -> list[tuple[Path, TrainConfig]]:
    """(stage folder, stage config) for every stage; weights flow from each stage to the next."""
    out = []
    prev = cfg.model.init_weights
    for k, (algo, n) in enumerate(
        zip(cfg.pipeline.stages, stage_budgets(cfg.pipeline.updates, len(cfg.pipeline.stages), cfg.pipeline.split)), 1
    ):
        sc = copy.deepcopy(cfg)
        sc.algorithm = algo
        section = sc.grpo if algo == "grpo" else sc.es
        section.updates, section.epochs = n, None
        sc.model.init_weights = prev
        sc.run.output_dir, sc.run.name = str(run_dir), f"stage{k}-{algo}"
        sc.tracking.parent_run_id = parent_run_id
        sc.tracking.uri = uri or cfg.tracking.uri  # the stages log next to their pipeline's run
        sc.pipeline.stages, sc.pipeline.updates = [], None
        folder = run_dir / sc.run.name
        out.append((folder, sc))
        prev = str(folder / "center.safetensors")
    return out


def run_pipeline(
    cfg: TrainConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    run_name: str | None = None,
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run the stages in order; returns a summary with each stage's folder and MLflow run."""
    from esbatch.tracking import MLflowTracker, default_tracking_uri, parent_tag, run_tags

    rd = Path(run_dir)
    rd.mkdir(parents=True, exist_ok=True)
    meta_path = rd / "run.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if not resume and meta:
        raise FileExistsError(f"{rd} already holds a pipeline; resume it or pick another run.name")
    (rd / "config.yaml").write_text(cfg.to_yaml())
    uri = cfg.tracking.uri or default_tracking_uri(cfg.run.output_dir)
    tracker = MLflowTracker(uri, cfg.tracking.experiment, Path(cfg.run.output_dir) / "mlartifacts")
    parent_tags = {
        **run_tags(),
        "algorithm": "pipeline",
        "pipeline.stages": "->".join(cfg.pipeline.stages),
        **parent_tag(cfg.tracking.parent_run_id),
        **(tags or {}),
    }
    run_id = tracker.start(
        run_name or cfg.run.name, flatten(cfg.to_dict()), parent_tags, run_id=meta.get("mlflow_run_id")
    )
    meta.update(mlflow_run_id=run_id, tracking_uri=uri, status="running")
    meta_path.write_text(json.dumps(meta))
    stages = stage_configs(cfg, rd, run_id, uri)
    summary = {"run_dir": str(rd), "mlflow_run_id": run_id, "tracking_uri": uri, "stages": []}
    status = "FAILED"
    try:
        for folder, sc in stages:
            if STOP.is_set():  # SIGTERM (see es/trainer.py): stop between stages
                raise KeyboardInterrupt
            smeta = json.loads((folder / "run.json").read_text()) if (folder / "run.json").exists() else {}
            if smeta.get("status") != "finished":
                stage_yaml = rd / f"{folder.name}.yaml"
                stage_yaml.write_text(sc.to_yaml())
                args = ["--resume", str(folder)] if (folder / "config.yaml").exists() else [str(stage_yaml)]
                cmd = [sys.executable, "-m", "esbatch", "train", *args] + ([] if progress else ["--no-progress"])
                print(f"pipeline stage {folder.name}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
                code = subprocess.call(cmd, env=os.environ.copy())
                if code:
                    raise RuntimeError(f"stage {folder.name} exited with {code}; re-run to resume it")
                smeta = json.loads((folder / "run.json").read_text())
            summary["stages"].append(
                {"name": folder.name, "run_dir": str(folder), "mlflow_run_id": smeta["mlflow_run_id"]}
            )
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        meta["status"] = status.lower()
        meta_path.write_text(json.dumps(meta))
        tracker.end(status)
    summary["center"] = str(stages[-1][0] / "center.safetensors")
    return summary
