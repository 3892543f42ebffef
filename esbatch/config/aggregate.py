"""Aggregate analyses: the specs of a sweep file's ``aggregate:`` list (written by esbatch/aggregate/report.py).

Kinds, picked by ``kind``: ``scaling`` (paper Table 6), ``curves`` (Appendix F) and ``final`` read the runs'
training metrics; ``heldout_change`` pairs two held-out evaluations of each run problem by problem (did held-out
accuracy change during training?); ``eval_table``, ``eval_wins``, ``pareto`` and ``passk`` read a sweep's evaluations
(``evaluate:``; esbatch/aggregate/evals.py: paper Tables 2/3/5/8/9/10 and Figure 3); ``threshold_curve`` reads
the evals of its ``threshold:`` phase (Figure 4).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from esbatch.schema import REQUIRED, ConfigError, Invalid, Schema, build, expects, setting

HELDOUT = "heldout/accuracy"
INDEX_FILE = "README.md"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


# ============================================================================ field checks


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool))


@expects("a non-empty string")
def _str(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise Invalid(f"got {type(v).__name__} {v!r}")
    return v


@expects("a parameter name (dotted config key) or null")
def _opt_key(v: Any) -> str | None:
    return None if v is None else _str(v)


@expects("a parameter name (dotted config key)")
def _key(v: Any) -> str:
    if v is None:
        raise Invalid("must be set")
    return _str(v)


@expects("a filename-safe name: letters, digits, '_', '-', '.', starting with a letter or digit, at most 100 chars")
def _name(v: Any) -> str:
    if not isinstance(v, str) or not _NAME_RE.match(v):
        raise Invalid(f"got {v!r}")
    if v.lower() in ("readme", "readme.md"):
        raise Invalid(f"{v!r} is reserved for the report index {INDEX_FILE}")
    return v


@expects("a number with 0 <= weight < 1 (0 = no smoothing)")
def _weight(v: Any) -> float:
    if not is_num(v) or not 0 <= v < 1:
        raise Invalid(f"got {v!r}")
    return float(v)


@expects("a number >= 0")
def _nonneg(v: Any) -> float:
    if not is_num(v) or not v >= 0:
        raise Invalid(f"got {v!r}")
    return float(v)


@expects("an update count (integer >= 0)")
def _update(v: Any) -> int:
    if not is_num(v) or int(v) != v or v < 0:
        raise Invalid(f"got {v!r}")
    return int(v)


@expects("an update count (integer >= 0) or null for each run's budget")
def _opt_update(v: Any) -> int | None:
    return None if v is None else _update(v)


@expects("an update count (integer >= 0) or null for each run's last evaluation")
def _opt_last(v: Any) -> int | None:
    return None if v is None else _update(v)


@expects("an integer >= 2 (points in the rolling window)")
def _window(v: Any) -> int:
    if not is_num(v) or int(v) != v or v < 2:
        raise Invalid(f"got {v!r}")
    return int(v)


@expects("a value of `cols` (string, number or bool) or null for the last column")
def _opt_scalar(v: Any) -> Any:
    if v is not None and not _is_scalar(v):
        raise Invalid(f"got {type(v).__name__} {v!r}")
    return v


@expects("a parameter name or a list of them")
def _key_list(v: Any) -> list[str]:
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(k, str) and k.strip() for k in items):
        raise Invalid(f"got {v!r}")
    return list(items)


@expects("a metric name or a list of them")
def _metric_list(v: Any) -> list[str]:
    return _key_list(v)


@expects("a mapping {parameter: value or [values]} keeping only the runs that match")
def _select(v: Any) -> dict[str, list[Any]]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise Invalid(f"got {type(v).__name__} {v!r}")
    out: dict[str, list[Any]] = {}
    for k, vals in v.items():
        vals = vals if isinstance(vals, list) else [vals]
        if not isinstance(k, str) or not vals or not all(x is None or _is_scalar(x) for x in vals):
            raise Invalid(f"bad entry {k!r}: {vals!r}")
        out[k] = vals
    return out


# ============================================================================ analysis specs


@dataclass(kw_only=True)
class Analysis(Schema):
    """Fields every analysis has. ``path`` is where it came from in the YAML (for error lines)."""

    tag: ClassVar[str] = "kind"
    tag_noun: ClassVar[str] = "analysis kind"
    kind: ClassVar[str] = ""
    name: str = setting("", "output file stem: <name>.csv/.md(/.png) (default: <kind>_<position>)", check=_name)
    metric: str = setting("reward/mean", "history metric to analyse", check=_str)
    smoothing: float = setting(0.99, "debiased EMA weight", check=_weight)
    select: dict[str, list[Any]] = setting({}, "keep only runs whose params match", check=_select)
    path: str = field(default="", compare=False, repr=False, metadata={"internal": True})  # not a YAML key

    def param_fields(self) -> dict[str, str]:
        """Field name -> run parameter key, for every field that names a parameter."""
        out = {f"select.{k}": k for k in self.select}
        for f in dataclasses.fields(self):
            if f.metadata.get("check") in (_key, _opt_key) and getattr(self, f.name):
                out[f.name] = getattr(self, f.name)
            elif f.metadata.get("check") is _key_list:
                out.update({f"{f.name}[{i}]": k for i, k in enumerate(getattr(self, f.name))})
        return out


@dataclass(kw_only=True)
class ScalingAnalysis(Analysis):
    """Paper Table 6: smoothed metric at update ``at`` for rows x cols, gap of each column to ``reference``."""

    kind: ClassVar[str] = "scaling"
    unknown_key: ClassVar[str] = "unknown key for kind 'scaling'"
    cols: str = setting(REQUIRED, "parameter whose values are the columns (e.g. es.population_size)", check=_key)
    rows: str | None = setting(None, "parameter whose values are the rows (null = one row)", check=_opt_key)
    reference: Any = setting(None, "column value the gaps are taken to (null = last column)", check=_opt_scalar)
    at: int | None = setting(None, "update to read the smoothed value at (null = each run's budget)", check=_opt_update)
    tolerance: float = setting(0.01, "cells with |gap| <= tolerance are marked", check=_nonneg)


@dataclass(kw_only=True)
class CurvesAnalysis(Analysis):
    """Paper Appendix F: smoothed metric vs update, one line per ``hue`` value, one panel per ``panels`` value."""

    kind: ClassVar[str] = "curves"
    unknown_key: ClassVar[str] = "unknown key for kind 'curves'"
    panels: str | None = setting(None, "parameter with one subplot per value (null = one panel)", check=_opt_key)
    hue: str | None = setting(None, "parameter with one line per value (null = one line)", check=_opt_key)
    band_window: int = setting(21, "points in the local-std window of the shaded band", check=_window)
    band: str = setting(
        "residual",
        "what the shading shows: residual = ± the local std (window band_window) of the raw-minus-smoothed "
        "residuals; wilson = the Wilson 95% interval of the raw held-out accuracy at each evaluation (metric "
        "heldout/accuracy only; n = the problems of that evaluation, runs sharing a line pooled; drawn also with "
        "smoothing 0)",
        choices=("residual", "wilson"),
    )

    def validate(self, path: str, errors: list[str]) -> None:
        if self.band == "wilson" and self.metric != HELDOUT:
            errors.append(
                f"{path}.band: 'wilson' is an interval of a proportion over held-out problems, so it needs "
                f"metric: {HELDOUT} (got metric: {self.metric!r}); use band: residual for other metrics"
            )


@dataclass(kw_only=True)
class FinalAnalysis(Analysis):
    """Every run's smoothed metric at update ``at`` and its other metrics there, grouped by ``by``."""

    kind: ClassVar[str] = "final"
    unknown_key: ClassVar[str] = "unknown key for kind 'final'"
    by: list[str] = setting([], "parameters to group (and sort) the runs by", check=_key_list)
    at: int | None = setting(None, "update to read values at (null = each run's budget)", check=_opt_update)
    also: list[str] = setting([HELDOUT], "further metrics, raw, at the last logged step <= at", check=_metric_list)


@dataclass(kw_only=True)
class HeldoutChangeAnalysis(Analysis):
    """Did held-out accuracy change during training? Each run's greedy held-out accuracy at update ``first`` and at
    ``last``, paired problem by problem (eval.jsonl's ``heldout/correct``, esbatch/aggregate/paired.py): both
    accuracies with Wilson 95% intervals, the change with a paired bootstrap 95% interval, problems gained and
    lost, McNemar's exact p; a forest plot of the changes. Reads the run folders' eval.jsonl."""

    kind: ClassVar[str] = "heldout_change"
    unknown_key: ClassVar[str] = "unknown key for kind 'heldout_change'"
    metric: str = field(default=HELDOUT, metadata={"internal": True})  # what it reads: not a YAML key
    smoothing: float = field(default=0.0, metadata={"internal": True})  # raw evaluations: not a YAML key
    hue: str | None = setting(
        None,
        "parameter whose values order and label the rows, one row per run (e.g. es.population_size: one row per "
        "population size); null = the sweep's order",
        check=_opt_key,
    )
    first: int = setting(0, "update of the 'before' evaluation (0 = the model before training)", check=_update)
    last: int | None = setting(
        None, "update of the 'after' evaluation (null = each run's last evaluation)", check=_opt_last
    )

    def validate(self, path: str, errors: list[str]) -> None:
        if self.last is not None and self.last <= self.first:
            errors.append(f"{path}.last: {self.last} is not after first ({self.first}); nothing to compare")


@expects("eval metric names, e.g. [pass@1, pass@16, pass@32], [maj@16, maj@32], [entropy]")
def _eval_metrics(v: Any) -> list[str]:
    items = _key_list(v)
    bad = [m for m in items if not _EVAL_METRIC.match(m)]
    if not items or bad:
        raise Invalid(f"got {bad or v!r}; valid: a list of pass@K, maj@K, entropy, greedy, format, f1")
    return items


_EVAL_METRIC = re.compile(r"^((pass|maj)@\d+|entropy|greedy|format|f1)$")


@dataclass(kw_only=True)
class EvalAnalysis(Analysis):
    """Fields of every analysis that reads a sweep's evaluations."""

    tasks: list[str] = setting(
        [], "task labels to show, in this order (default: every task of the evals)", check=_key_list
    )

    def param_fields(self) -> dict[str, str]:
        return {k: v for k, v in super().param_fields().items() if not k.startswith("tasks[")}  # labels, not params


@expects(
    "a mapping of column label to task labels, e.g. {Math avg: [AIME24, AIME25, AMC23, MATH-500]}; {} = one "
    "'Held-out avg' over the shown tasks but the training task"
)
def _averages(v: Any) -> dict[str, list[str]]:
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) and k.strip() for k in v):
        raise Invalid(f"got {v!r}")
    out = {k: _key_list(t) for k, t in v.items()}
    empty = [k for k, t in out.items() if not t]
    if empty:
        raise Invalid(f"{empty[0]!r} averages no task")
    return out


@dataclass(kw_only=True)
class AveragedAnalysis(EvalAnalysis):
    """An eval analysis with average columns (or panels): which tasks each average covers."""

    averages: dict[str, list[str]] = setting(
        {},
        "average columns, label -> the task labels it averages (the paper's Hard setting keeps the math and the "
        "held-out non-math averages apart); {} = one 'Held-out avg' over the shown tasks but the training task",
        check=_averages,
    )


@dataclass(kw_only=True)
class EvalTableAnalysis(AveragedAnalysis):
    """Paper Tables 2/3/5 (Pass@K), 8/9 (Maj@K) and, with ``delta``, 10 (change vs the base model): one table
    per metric and ``panels`` value, ``rows`` x tasks plus each average of ``averages``."""

    kind: ClassVar[str] = "eval_table"
    unknown_key: ClassVar[str] = "unknown key for kind 'eval_table'"
    metrics: list[str] = setting(["pass@1", "pass@16", "pass@32"], "eval metrics, one table each", check=_eval_metrics)
    rows: str = setting("method", "sweep parameter whose values are the rows", check=_key)
    panels: str | None = setting("model.name", "parameter with one table per value (null = one)", check=_opt_key)
    delta: bool = setting(False, "change vs the base model with a paired bootstrap 95% interval (Table 10)")


@dataclass(kw_only=True)
class EvalWinsAnalysis(EvalAnalysis):
    """How many (model, task, metric) comparisons method ``a`` wins over ``b``, how often each falls below the base
    model per metric, and the (model, task) cells below it on every ``below_base_on`` metric at once (the paper's
    "15 of 18 comparisons")."""

    kind: ClassVar[str] = "eval_wins"
    unknown_key: ClassVar[str] = "unknown key for kind 'eval_wins'"
    a: str = setting("ES", "method counted as winning when it is higher", check=_str)
    b: str = setting("GRPO", "the method it is compared with", check=_str)
    metrics: list[str] = setting(["pass@1", "pass@16", "pass@32"], "eval metrics compared", check=_eval_metrics)
    panels: str | None = setting(
        "model.name", "parameter whose values are the models: a comparison is one (model, task) pair", check=_opt_key
    )
    below_base_on: list[str] = setting(
        ["pass@16", "pass@32"],
        "a (model, task) cell is below the base model when it is below on every one of these metrics: the paper's "
        "joint rule ('below ... on both Pass@16 and Pass@32 in 15 of 18 comparisons', Sec. 4.1); [] = not counted",
        check=lambda v: _eval_metrics(v) if v != [] else [],
    )


@dataclass(kw_only=True)
class ParetoAnalysis(AveragedAnalysis):
    """Paper Figure 3: every model's Pass@1 (x) against Pass@K (y), one panel per task and per average."""

    kind: ClassVar[str] = "pareto"
    unknown_key: ClassVar[str] = "unknown key for kind 'pareto'"
    x: str = setting("pass@1", "metric on the x axis", check=_str)
    y: str = setting("pass@32", "metric on the y axis", check=_str)


@dataclass(kw_only=True)
class PassKAnalysis(EvalAnalysis):
    """Pass@K for K = 1..n per task, one line per method (line style per model): where the curves cross."""

    kind: ClassVar[str] = "passk"
    unknown_key: ClassVar[str] = "unknown key for kind 'passk'"


@expects("one eval metric, e.g. pass@1, pass@16, maj@16")
def _eval_metric(v: Any) -> str:
    if not isinstance(v, str) or not _EVAL_METRIC.match(v) or v == "entropy":
        raise Invalid(f"got {v!r}")
    return v


@expects("a task label of the threshold phase's eval config, or null for the phase's target task")
def _opt_label(v: Any) -> str | None:
    return None if v is None else _str(v)


@dataclass(kw_only=True)
class ThresholdCurveAnalysis(Analysis):
    """Paper Figure 4: target-task Pass@1 against update sparsity s_tau of the magnitude-thresholded checkpoints
    (the sweep's ``threshold:`` phase), one line per run, a marker per tau, 95% bootstrap intervals over problems."""

    kind: ClassVar[str] = "threshold_curve"
    unknown_key: ClassVar[str] = "unknown key for kind 'threshold_curve'"
    task: str | None = setting(None, "target task label (default: the threshold phase's `task`)", check=_opt_label)
    y: str = setting("pass@1", "eval metric on the y axis", check=_eval_metric)


@expects("a list of thresholds, each a number > 0, or null for the drift analysis's default grid")
def _opt_taus(v: Any) -> list[float] | None:
    if v is None:
        return None
    items = v if isinstance(v, list) else [v]
    if not items or not all(is_num(t) and 0 < t < float("inf") for t in items):
        raise Invalid(f"got {v!r}")
    return sorted(float(t) for t in items)


@dataclass(kw_only=True)
class DriftAnalysis(Analysis):
    """Paper Table 4: each finished run's relative L2 distance from theta_0, its ratio to the reference's, s_tau per
    tau, and where the largest updates are (parameter type), one table per ``panels`` value (esbatch analyze drift,
    read from the run folders; nothing is written into them)."""

    kind: ClassVar[str] = "drift"
    unknown_key: ClassVar[str] = "unknown key for kind 'drift'"
    reference: str | None = setting(
        None,
        "the ratio's denominator (the paper's GRPO): a method of the sweep (its run in the same panel), or a run "
        "folder or model (alias, hub id, hf:// folder, local folder: a released checkpoint) compared with the "
        "runs' base model; null = no ratio",
        check=_opt_key,
    )
    taus: list[float] | None = setting(
        None, "s_tau thresholds (null: esbatch analyze drift's default grid)", check=_opt_taus
    )
    as_dtype: str | None = setting(
        None,
        "dtype the weights are compared in (null: the run's compute dtype, as the paper counts bf16 models)",
        choices=("float32", "bfloat16", "float16"),
    )
    panels: str | None = setting("model.name", "parameter with one table per value (null = one)", check=_opt_key)
    top_k: int = setting(100, "largest updates located by parameter type", gt=0)

    def param_fields(self) -> dict[str, str]:
        return {k: v for k, v in super().param_fields().items() if k != "reference"}  # a method, run or model


EVAL_KINDS = (EvalTableAnalysis, EvalWinsAnalysis, ParetoAnalysis, PassKAnalysis, ThresholdCurveAnalysis)
RUN_FOLDER_KINDS = (DriftAnalysis, HeldoutChangeAnalysis)
KINDS: dict[str, type[Analysis]] = {
    c.kind: c for c in (ScalingAnalysis, CurvesAnalysis, FinalAnalysis, *RUN_FOLDER_KINDS, *EVAL_KINDS)
}
Analysis.variants = KINDS


def parse_specs(raw: Any, where: str = "aggregate") -> list[Analysis]:
    """Validate a sweep's ``aggregate:`` list into analysis specs, reporting every problem at once.

    Raises ``ConfigError`` with one line per problem, naming its YAML path and listing what is valid.
    An analysis without a ``name`` is named ``<kind>_<position>``; names must be unique (case-insensitively:
    they name the output files).
    """
    if not isinstance(raw, list):
        raise ConfigError([f"{where}: expected a list of analyses (each a mapping with a `kind`), got {raw!r}"])
    errors: list[str] = []
    out: list[Analysis] = []
    seen: dict[str, str] = {}
    for i, entry in enumerate(raw):
        path = f"{where}[{i}]"
        n_before = len(errors)
        a = build(Analysis, entry, path, errors)
        name = entry.get("name") if isinstance(entry, dict) else None
        if isinstance(name, str) and _NAME_RE.match(name):  # a duplicate is reported even beside other errors
            if name.lower() in seen:
                errors.append(
                    f"{path}.name: {name!r} is already used by {seen[name.lower()]}; names must be unique "
                    "(case-insensitively: they name the output files)"
                )
            else:
                seen[name.lower()] = path
        if a is None or len(errors) > n_before:
            continue
        a.path = path
        if "name" not in entry:
            a.name = f"{a.kind}_{i}"
        out.append(a)
    if errors:
        raise ConfigError(errors)
    return out
