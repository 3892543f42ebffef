"""Sweep files: a base run config plus the axes to vary (expanded into runs by esbatch/launch/sweep.py).

``SweepFile`` is the schema: name, base and overrides; grid, zip, methods and seeds as axes (a grid axis may also be
given W&B-style as ``{values: [...]}``); the ``evaluate`` and ``threshold`` phases (``EvaluateSpec``,
``ThresholdSpec``); launcher and aggregate. An example file: docs/sweeps-and-slurm.md; every key:
docs/config-reference.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from esbatch.config.aggregate import parse_specs
from esbatch.schema import ConfigError, Invalid, Schema, expects, flatten, folder_name, output_folder, setting


@expects("an eval config name or path, or a non-empty list of them")
def _configs(v: Any) -> str | list[str]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not items or not all(isinstance(x, str) and x.strip() for x in items):
        raise Invalid(f"got {v!r}")
    return v


@dataclass
class EvaluateSpec(Schema):
    """The evaluation phase of a sweep (paper RQ1: every final model and its base model on one suite)."""

    config: Any = setting(
        help="Eval config(s): a built-in name (`esbatch ls`) or a path relative to the sweep file, or a list of "
        "them (e.g. the Hard setting's math suite and its held-out suite); task labels must be distinct.",
        check=_configs,
    )
    base_models: bool = setting(True, "Also evaluate each distinct base model (the tables' Base rows and deltas).")
    train_task: str | None = setting(
        None, "Label of the suite's training task: shown, but left out of the average over held-out tasks."
    )
    set: dict = setting({}, "Overrides of the eval config for this sweep, e.g. {sampling: {n: 8}}.")
    models: list = setting(
        [],
        "Models evaluated without training here (a released checkpoint): [{method: GRPO, model: {name: PATH}, "
        "as: MODEL}]; `as` is the model name its row is tabulated under (default: model.name).",
    )


@expects("an eval config name or path")
def _config(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise Invalid(f"got {v!r}")
    return v


@expects(
    "a non-empty list of thresholds, each a finite number > 0 (|delta| in (0, tau] is zeroed), e.g. "
    "[1.0e-6, 1.0e-5, 1.0e-4]; distinct at 6 significant digits (each names a folder tau-<tau>)"
)
def _taus(v: Any) -> list[float]:
    items = v if isinstance(v, list) else [v]
    if not items or v is None:
        raise Invalid(f"got {v!r}")
    out: list[float] = []
    for x in items:
        try:  # YAML 1.1 reads 1e-6 (no dot) as a string; users write it that way
            tau = float(x.strip() if isinstance(x, str) else x) if not isinstance(x, bool) else math.nan
        except (TypeError, ValueError):
            tau = math.nan
        if not (math.isfinite(tau) and tau > 0):
            raise Invalid(f"{x!r} is not a finite number > 0")
        same = [t for t in out if f"{t:g}" == f"{tau:g}"]
        if same:
            raise Invalid(f"{x!r} and {same[0]!r} are the same threshold (folder tau-{tau:g})")
        out.append(tau)
    return sorted(out)


@dataclass
class ThresholdSpec(Schema):
    """The threshold phase of a sweep (paper Section 4.2, Figure 4): after training, each final model's
    magnitude-thresholded checkpoints, one per tau, each evaluated on the target task."""

    tau: list = setting(
        help="Thresholds: per tau a checkpoint <run>/thresholded/tau-<tau>/ where updates with 0 < |delta| <= tau "
        "are set to 0 (esbatch threshold), evaluated after the run's training. The unthresholded final model "
        "(tau 0, s_tau 0) is evaluated too, as the curve's anchor (the `evaluate:` eval when its config is the same).",
        check=_taus,
    )
    config: str = setting(
        help="The target task's eval config: a built-in name (`esbatch ls`) or a path relative to the sweep file.",
        check=_config,
    )
    set: dict = setting({}, "Overrides of that eval config, e.g. {sampling: {n: 8}}.")
    task: str | None = setting(
        None,
        "Label of the target task in that config: the curve's y axis (default: evaluate.train_task when the config "
        "has it, else the config's only task).",
    )
    methods: list = setting(
        [], "Threshold only the runs of these methods (names of the sweep's `methods:`); default every trained run."
    )
    base_dtype: str | None = setting(
        None,
        "Round theta_0 to this dtype (default: each run's model.dtype, as the trainer loaded it; float32 for a GRPO "
        "run trained on CPU, which loads fp32 whatever model.dtype says).",
        choices=("float32", "bfloat16", "float16"),
    )
    as_dtype: str | None = setting(
        None,
        "Compare the final weights with theta_0 in this dtype (default: base_dtype, the compute dtype: a bf16 model's "
        "deployed weights, as the paper counts; float32 = the fp32 center, where nearly every coordinate moved).",
        choices=("float32", "bfloat16", "float16"),
    )


@dataclass
class SweepFile(Schema):
    unknown_key: ClassVar[str] = "unknown sweep key"

    name: str = setting(help="Sweep name; its folder is <output_dir>/<name>.", check=folder_name)
    description: str = setting("", "Free text shown by `esbatch status` and in the report.")
    base: str = setting("quickstart", "Built-in run config name or YAML path every run starts from.")
    config: dict = setting({}, "Nested overrides applied to every run.")
    grid: dict = setting({}, "{config.key: [values]}: the cartesian product of the lists.")
    zip: list = setting([], "[{config.key: [values], ...}]: keys in one group vary together.")
    methods: dict = setting(
        {},
        "{name: {config overrides}}: named variants, one more axis (e.g. ES, GRPO, ES->GRPO); the name is the "
        "run's `method` in labels and tables.",
    )
    seeds: list | None = setting(None, "run.seed values, one more grid axis.")
    evaluate: EvaluateSpec | None = setting(
        None,
        "Evaluate every trained run's final model (and the base models) as jobs that start when their training "
        "ends (docs/sweeps-and-slurm.md).",
    )
    threshold: ThresholdSpec | None = setting(
        None,
        "Figure 4: after training, thresholded checkpoints of every trained run's final model, one per tau, each "
        "evaluated on the target task as jobs that start when the training ends (docs/diagnostics.md).",
    )
    launcher: str | None = setting(None, "Launcher profile name or path (default: local).")
    launcher_overrides: dict = setting({}, "Fields of the launcher profile changed for this sweep.")
    output_dir: str | None = setting(
        None, "Where the sweep folder goes (default: the base config's run.output_dir).", check=output_folder
    )
    experiment: str | None = setting(None, "MLflow experiment (default: the sweep name).")
    aggregate: list | None = setting(None, "Tables and plots of `esbatch aggregate` (docs/sweeps-and-slurm.md).")
    max_runs: int = setting(
        1000, "Refuse to expand to more runs than this (a guard against a grid typo); raise it for big sweeps.", ge=1
    )

    def validate(self, path: str, errors: list[str]) -> None:
        if self.aggregate is not None:
            try:
                parse_specs(self.aggregate, "aggregate")
            except ConfigError as e:
                errors.extend(e.errors)
        errors.extend(axis_overlaps(self))


def axis_overlaps(sweep: SweepFile) -> list[str]:
    """A config key varied by two axes (grid and zip, two zip groups, seeds and run.seed, a method's overrides
    and an axis): one axis's values would override the other's and the points would collapse."""
    axes: dict[str, list[str]] = {}
    for key in sweep.grid:
        axes.setdefault(key, []).append("grid")
    for i, group in enumerate(sweep.zip):
        for key in group if isinstance(group, dict) else ():
            axes.setdefault(key, []).append(f"zip[{i}]")
    if sweep.seeds is not None:
        axes.setdefault("run.seed", []).append("seeds")
    for name, overrides in sweep.methods.items():
        for key in flatten(overrides) if isinstance(overrides, dict) else ():
            if key in axes:
                axes[key].append(f"methods.{name}")
    return [
        f"{key}: varied by {' and '.join(where)}; one axis per key (the later one would override the other's "
        "values and collapse the grid's points)"
        for key, where in axes.items()
        if len(where) > 1
    ]


SWEEP_KEYS = {f.name: f.metadata["help"] for f in dataclasses.fields(SweepFile)}
