"""The disk a planned run will fill, for `esbatch sweep FILE --dry-run`: its weight files, from the model's
parameter count (read from the files' headers, esbatch/models.py:parameter_count) and the dtypes the config
sets. Logs (log.jsonl, eval.jsonl, MLflow) are a few MB per run and left out. An epochs budget counts as the
updates it makes over the training split as the dataset card counts it (``planned_updates``).

Per run (P parameters, d = bytes per parameter of model.dtype):

    ES, checkpoint.center: every    center.safetensors: P * 4 (es.restore: inplace: P * d), one file overwritten
                                    in place; while a checkpoint is written the new copy sits beside the old one
    ES, checkpoint.center: final    final_model/: P * d (the final model in the compute dtype)
    ES, checkpoint.center: none     nothing
    checkpoint.snapshots            one center-sized file per snapshot within the budget
    tracking.log_model              final_model/ (P * d) unless already there, plus its copy in the MLflow
                                    artifact store (P * d)
    GRPO                            center.safetensors P * 4 at the end, and the newest DeepSpeed checkpoint (an
                                    older one is deleted once the next is written, so two while one is written):
                                    the weights P * d plus AdamW's moments 8 bytes/param plus, for d < 4, the fp32
                                    master 4 bytes/param (an estimate of DeepSpeed's layout)
    pipeline                        its stages', summed (the root's center is a hard link)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from esbatch.es.config import ESConfig
from esbatch.models import NOMINAL_PARAMETERS, parameter_count
from esbatch.pipeline import stage_configs
from esbatch.tasks import TASKS
from esbatch.train.config import TrainConfig

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class RunDisk:
    """One planned run's weight files: (what, bytes) items, and what an atomic write adds for a moment."""

    params: int | None
    items: list[tuple[str, int]] = field(default_factory=list)
    transient: int = 0  # a checkpoint's new copy beside the old one while it is written

    @property
    def total(self) -> int:
        return sum(b for _, b in self.items)

    @property
    def peak(self) -> int:
        return self.total + self.transient


def human(n: float) -> str:
    """Decimal units, as disk quotas count: 538.1 MB, 28.0 GB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""  # unreachable


def train_problems(cfg: TrainConfig) -> int | None:
    """The training split's size: task.train_size, else the dataset card's count (``Task.train_rows``; a generated
    task: its default); None when unknown (a local data_path is not read)."""
    cls = TASKS.get(cfg.task.name)
    rows = None if cfg.task.data_path else cls.train_rows or getattr(cls, "default_train_size", None)
    if cfg.task.train_size:
        return min(cfg.task.train_size, rows) if rows else cfg.task.train_size
    return rows


def planned_updates(cfg: TrainConfig) -> int | None:
    """Updates the run will make: the config's, or for an epochs budget, from the training split's size."""
    planned = cfg.algo().planned_budget(cfg)
    if planned is not None:
        return planned
    n = train_problems(cfg)
    return cfg.total_updates(n) if n else None


def run_disk(cfg: TrainConfig, params: int | None) -> RunDisk:
    """The weight files run config ``cfg`` leaves on disk, for a model of ``params`` parameters."""
    out = RunDisk(params)
    if params is None:
        return out
    if cfg.algorithm == "pipeline":
        for rd, sc in stage_configs(cfg, Path(cfg.run.output_dir) / cfg.run.name, None):
            stage = run_disk(sc, params)
            out.items += [(f"{rd.path.name}: {what}", b) for what, b in stage.items]
            out.transient = max(out.transient, stage.transient)
        return out
    d = BYTES[cfg.model.dtype]
    budget = planned_updates(cfg)
    ck = cfg.checkpoint
    if cfg.algorithm == "grpo":
        center, dtype = params * 4, "fp32"
        out.items.append(("center.safetensors (fp32, at the end)", center))
        per_ckpt = params * (d + 8 + (4 if d < 4 else 0))
        out.items.append((f"ds_checkpoint/: the newest, {human(per_ckpt)} (estimate)", per_ckpt))
        out.transient = max(out.transient, per_ckpt)  # the next one written beside it
    else:
        inplace = cfg.section(ESConfig).restore == "inplace"
        center, dtype = params * (d if inplace else 4), (cfg.model.dtype if inplace else "fp32")
        if ck.center == "every":
            out.items.append((f"center.safetensors ({dtype})", center))
            out.transient = center
        elif ck.center == "final":
            out.items.append((f"final_model/ ({cfg.model.dtype})", params * d))
    snaps = [t for t in ck.snapshots if budget is None or t <= budget]
    if snaps:
        out.items.append((f"snapshots/: {len(snaps)} x {human(center)} ({dtype})", len(snaps) * center))
    if cfg.tracking.log_model:
        if not (cfg.algorithm == "es" and ck.center == "final"):
            out.items.append((f"final_model/ ({cfg.model.dtype}, tracking.log_model)", params * d))
        out.items.append((f"MLflow artifact copy of final_model/ ({cfg.model.dtype})", params * d))
    return out


def sweep_disk(runs: list[Any], out: Any) -> int:
    """Print each planned run's weight files and the sweep's total; returns the total in bytes (unknown models
    count 0 and are named)."""
    counts: dict[tuple[str, str | None, str | None], int | None] = {}
    total = peak = 0
    unknown = []
    print("\ndisk (weight files; logs and evals add a few MB per run):", file=out)
    for r in runs:
        m = r.config.model
        key = (m.name, m.gguf_file, m.revision)
        if key not in counts:
            counts[key], how = parameter_count(*key), "from its files' headers"
            if counts[key] is None and m.name in NOMINAL_PARAMETERS:
                counts[key], how = NOMINAL_PARAMETERS[m.name], "as its model card gives it: not on this machine yet"
            n = counts[key]
            said = f"{n:,} parameters ({how})" if n else "parameter count unknown (no weight files on this machine)"
            print(f"  model {m.name}: {said}", file=out)
        disk = run_disk(r.config, counts[key])
        if disk.params is None:
            unknown.append(r.key)
            print(f"  {r.key}  unknown (model {m.name} is not on this machine)", file=out)
            continue
        what = "; ".join(f"{w} {human(b)}" for w, b in disk.items) or "no weight files (checkpoint.center: none)"
        extra = f", {human(disk.peak)} while a checkpoint is written" if disk.transient else ""
        print(f"  {r.key}  {human(disk.total)}{extra}: {what}", file=out)
        total += disk.total
        peak += disk.transient
    tail = f" (+ {len(unknown)} run(s) of unknown size)" if unknown else ""
    runs_left = len(runs) - len(unknown)
    print(
        f"  total: {human(total)} for {runs_left} run(s){tail}; up to {human(total + peak)} if every run writes a "
        "checkpoint at once",
        file=out,
    )
    return total
