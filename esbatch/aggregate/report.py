"""Sweep reports: the analyses of a sweep YAML's ``aggregate:`` list, written as CSV, Markdown and PNG.

The analyses of the runs' metrics and folders, each one function (``write_scaling``, ``write_curves``,
``write_final``, ``write_heldout_change``; ``drift`` in esbatch/aggregate/drift.py, the eval kinds in evals.py):

* ``scaling`` - paper Table 6: a rows x cols grid of the smoothed metric at update T, with each
  column's gap to a reference column and the cells within ``tolerance`` of it marked;
* ``curves`` - paper Appendix F: smoothed metric vs update, one line per ``hue`` value, one panel per
  ``panels`` value, shaded by the local spread of the raw-minus-smoothed residuals (``band: residual``) or by
  the Wilson 95% interval of the raw held-out accuracy (``band: wilson``);
* ``final`` - the smoothed metric at T (and held-out accuracy) of every run, grouped by ``by``;
* ``heldout_change`` - did held-out accuracy change during training: each run's two evaluations paired problem
  by problem (esbatch/aggregate/paired.py), the change with a paired 95% interval, and a forest plot.

Runs that did not produce a value (missing, pending, failed, killed, still running, metric never
logged, stopped before T) are never dropped silently: their cells say why, and the index file
``README.md`` lists every such run with its status.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from esbatch import durable
from esbatch.aggregate.drift import write_drift
from esbatch.aggregate.evals import BOOTSTRAP, LEVEL, SEED, WRITERS
from esbatch.aggregate.paired import PairedChange, paired_change, wilson
from esbatch.aggregate.results import RunResult
from esbatch.aggregate.smoothing import debiased_ema, local_std
from esbatch.aggregate.tables import Section, finish, md_table, write_csv
from esbatch.config.aggregate import (
    EVAL_KINDS,
    HELDOUT,
    INDEX_FILE,
    RUN_FOLDER_KINDS,
    Analysis,
    CurvesAnalysis,
    DriftAnalysis,
    FinalAnalysis,
    HeldoutChangeAnalysis,
    ScalingAnalysis,
    is_num,
    parse_specs,
)
from esbatch.launch.state import SweepDir
from esbatch.registry import did_you_mean
from esbatch.schema import ConfigError
from esbatch.train.rundir import RunDir, read_jsonl

SEED_KEYS = ("run.seed",)
# Parameters that differ between runs without changing what is measured: not grouping axes.
BOOKKEEPING_KEYS = ("run.name", "run.output_dir", "run.threads", "model.device", "generation.batch_size")
BOOKKEEPING_PREFIXES = ("tracking.", "checkpoint.")
HELDOUT_SIZE = "task.heldout_size"
EvalRecords = Callable[[RunResult], dict[int, dict[str, Any]]]  # a run's eval.jsonl records by update
# esbatch.train.problems.HELDOUT_CORRECT (an eval.jsonl record's per-problem verdicts), spelled here: importing
# that module imports torch (esbatch.backends.base), 1.3 s of CPU that `esbatch aggregate` and every other CLI
# command paid at import for this one string. tests/unit/test_aggregate_imports.py checks the two agree.
HELDOUT_CORRECT = "heldout/correct"


def parse_analyses(
    raw: list | None, where: str = "aggregate", *, runs: Sequence[RunResult] | None = None
) -> list[Analysis]:
    """The specs of a sweep's ``aggregate:`` list (esbatch/config/aggregate.py), checked against ``runs`` too.

    ``raw=None`` (no ``aggregate:`` key) gives ``default_analyses(runs)``, or ``[]`` without runs. With
    ``runs``, the parameter names used (``rows``, ``hue``, ``by``, ``select``...) and the scaling ``reference``
    are checked against the runs' params, so a typo fails before anything is written.
    """
    if raw is None:
        return default_analyses(list(runs)) if runs is not None else []
    analyses = parse_specs(raw, where)
    if runs is not None:
        errors = [e for a in analyses for e in _param_errors(a, runs)]
        if errors:
            raise ConfigError(errors)
    return analyses


def _param_errors(a: Analysis, runs: Sequence[RunResult]) -> list[str]:
    """Problems with the parameter names and reference value of ``a`` given the actual runs."""
    if not runs:
        return []
    known = sorted({k for r in runs for k in r.params})
    varying = varying_params(runs)
    hint = f"Parameters that vary between runs: {', '.join(varying) or 'none'}"
    path = a.path or a.name
    errors = []
    for fname, key in a.param_fields().items():
        if key not in known:
            errors.append(f"{path}.{fname}: unknown parameter {key!r}.{did_you_mean(key, known)} {hint}")
    errors += _metric_errors(a, runs)
    if isinstance(a, ScalingAnalysis) and a.reference is not None and a.cols in known:
        values = _ordered(_param(r, a.cols) for r in runs)
        if a.reference not in values:
            shown = ", ".join(_fmt_param(v) for v in values)
            errors.append(f"{path}.reference: {a.reference!r} is not a value of {a.cols}; its values: {shown}")
    return errors


def logged_metrics(runs: Sequence[RunResult]) -> list[str]:
    """Every metric at least one run logged a point of, sorted."""
    return sorted({m for r in runs for m, pts in r.history.items() if pts})


def _metric_errors(a: Analysis, runs: Sequence[RunResult]) -> list[str]:
    """The metrics ``a`` asks for that no run logged, each named with the closest logged name and the full list.
    Nothing is checked while no run has logged anything yet (a sweep still queued still gets its report)."""
    available = logged_metrics(runs)
    if not available or isinstance(a, HeldoutChangeAnalysis):  # its metric is fixed; each run's row says why not
        return []
    asked = [("metric", a.metric)]
    if isinstance(a, FinalAnalysis):
        asked += [(f"also[{i}]", m) for i, m in enumerate(a.also)]
    return [
        f"{a.path or a.name}.{field}: no run logged {m!r}.{did_you_mean(m, available)} "
        f"Logged metrics: {', '.join(available)}"
        for field, m in asked
        if m not in available
    ]


def varying_params(runs: Sequence[RunResult]) -> list[str]:
    """Parameters whose value differs between runs (bookkeeping keys such as run.name excluded), in param order."""
    keys: list[str] = []
    for r in runs:
        keys.extend(k for k in r.params if k not in keys)
    return [k for k in keys if not _is_bookkeeping(k) and len(_ordered(_param(r, k) for r in runs)) > 1]


def default_analyses(runs: Sequence[RunResult]) -> list[Analysis]:
    """What a sweep without an ``aggregate:`` list gets: every run's final values grouped by all
    varying params, and reward curves coloured by the first varying param (seeds are averaged, so a
    non-seed param is preferred) with one panel per value of the second one."""
    varying = varying_params(runs)
    axes = [k for k in varying if k not in SEED_KEYS] or varying
    hue = axes[0] if axes else None
    panels = axes[1] if len(axes) > 1 and axes[1] not in SEED_KEYS else None
    logged = logged_metrics(runs)
    also = [HELDOUT] if not logged or HELDOUT in logged else []  # no held-out evaluation: not asked for
    return [
        FinalAnalysis(name="final_table", by=varying, also=also, path="default"),
        CurvesAnalysis(name="reward_curves", metric="reward/mean", hue=hue, panels=panels, path="default"),
    ]


# ============================================================================ run data helpers


def _is_bookkeeping(key: str) -> bool:
    return key in BOOKKEEPING_KEYS or key.startswith(BOOKKEEPING_PREFIXES)


def _param(run: RunResult, key: str | None) -> Any:
    return None if key is None else run.params.get(key)


def _ordered(values: Iterable[Any]) -> list[Any]:
    """Distinct values, numerically sorted when all are numbers, else in order of first appearance."""
    out: list[Any] = []
    for v in values:
        if not any(_same(v, u) for u in out):
            out.append(v)
    return sorted(out) if out and all(is_num(v) for v in out) else out


def _same(a: Any, b: Any) -> bool:
    return a == b and (type(a) is type(b) or (is_num(a) and is_num(b)))


def _fmt_param(v: Any) -> str:
    if v is None:
        return "(unset)"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _short(key: str | None) -> str:
    return key.rsplit(".", 1)[-1] if key else ""


def _points(run: RunResult, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Finite (step, value) points of ``metric``, sorted by step."""
    pts = sorted((int(s), float(v)) for s, v in run.history.get(metric, []) if v is not None and math.isfinite(v))
    steps = np.array([s for s, _ in pts], dtype=np.int64)
    return steps, np.array([v for _, v in pts], dtype=np.float64)


def _budget(run: RunResult, at: int | None) -> int:
    """The update a value is read at: ``at`` or the run's planned budget."""
    return at if at is not None else int(run.total_updates)


def _reason(run: RunResult, metric: str, t: int) -> str | None:
    """Why ``run`` has no value of ``metric`` at update ``t`` (None when it has one)."""
    steps, _ = _points(run, metric)
    if not len(steps):
        return run.status if run.status in ("missing", "pending") else f"{run.status}, no {metric}"
    if steps[-1] < t:
        prefix = "" if run.status in ("finished", "running") else f"{run.status} "
        return f"{prefix}at {steps[-1]}/{t}"
    if steps[0] > t:
        return f"no {metric} at or before update {t}"
    return None


def smoothed_at(run: RunResult, metric: str, at: int | None, weight: float) -> tuple[float | None, str | None]:
    """(debiased-EMA value of ``metric`` at the largest logged step <= T, None) or (None, why not).

    T is ``at`` or the run's budget. A run whose last step is before T has not reached it and gets
    no value: reading it earlier would compare runs at different points of training.
    """
    t = _budget(run, at)
    why = _reason(run, metric, t)
    if why is not None:
        return None, why
    steps, values = _points(run, metric)
    idx = int(np.searchsorted(steps, t, side="right")) - 1
    return float(debiased_ema(values, weight)[idx]), None


def _raw_at(run: RunResult, metric: str, t: int) -> tuple[float | None, int | None]:
    """Last raw value of ``metric`` at a step <= t and its step (evaluations are sparse: no smoothing)."""
    steps, values = _points(run, metric)
    idx = int(np.searchsorted(steps, t, side="right")) - 1
    return (float(values[idx]), int(steps[idx])) if idx >= 0 else (None, None)


def _progress(run: RunResult, metric: str = "reward/mean") -> str:
    steps, _ = _points(run, metric)
    return f"{steps[-1] if len(steps) else 0}/{run.total_updates}"


def _selected(runs: Sequence[RunResult], a: Analysis) -> list[RunResult]:
    return [r for r in runs if all(any(_same(_param(r, k), v) for v in vals) for k, vals in a.select.items())]


def _pooled_keys(groups: Iterable[Sequence[RunResult]], used: Iterable[str | None]) -> list[str]:
    """Non-seed params that differ inside a group: averaging those runs would mix settings."""
    skip = {k for k in used if k} | set(SEED_KEYS)
    out: list[str] = []
    for g in groups:
        out.extend(k for k in varying_params(g) if k not in skip and k not in out)
    return out


# ============================================================================ output helpers


def _num(v: float | None, digits: int = 4, sign: bool = False) -> str:
    if v is None:
        return "—"
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def _at_text(runs: Sequence[RunResult], at: int | None) -> str:
    if at is not None:
        return f"update {at}"
    budgets = sorted({r.total_updates for r in runs})
    return (
        f"update {budgets[0]}"
        if len(budgets) == 1
        else "each run's budget (updates " + ", ".join(map(str, budgets)) + ")"
    )


# ============================================================================ scaling (Table 6)


@dataclass
class ScalingCell:
    """One (row, col) cell: smoothed values of the runs that reached T, and why the others have none."""

    row: Any
    col: Any
    runs: list[RunResult]
    values: list[float]
    missing: list[tuple[RunResult, str]]
    at: list[int]
    gap: float | None = None
    within: bool | None = None  # None for the reference column and cells without a value

    @property
    def value(self) -> float | None:
        return float(np.mean(self.values)) if self.values else None

    @property
    def std(self) -> float | None:
        return float(np.std(self.values, ddof=1)) if len(self.values) > 1 else None

    @property
    def status(self) -> str:
        if not self.runs:
            return "no runs"
        why = "; ".join(f"{r.label}: {w}" for r, w in self.missing)
        if not self.missing:
            return "ok"
        if self.values:
            return f"partial: {len(self.values)}/{len(self.runs)} runs ({why})"
        return f"missing ({why})"


def scaling_cells(runs: Sequence[RunResult], a: ScalingAnalysis) -> tuple[list[Any], list[Any], list[ScalingCell]]:
    """Row values, column values and the cells of a scaling table, gaps and tolerance marks filled in.

    Runs sharing a cell (e.g. seeds) are averaged over those that reached T. The reference is
    ``a.reference`` or, when null, the last column.
    """
    runs = _selected(runs, a)
    row_vals = _ordered(_param(r, a.rows) for r in runs)
    col_vals = _ordered(_param(r, a.cols) for r in runs)
    ref = col_vals[-1] if a.reference is None and col_vals else a.reference
    cells: list[ScalingCell] = []
    for rv in row_vals:
        row_cells = []
        for cv in col_vals:
            members = [r for r in runs if _same(_param(r, a.rows), rv) and _same(_param(r, a.cols), cv)]
            cell = ScalingCell(rv, cv, members, [], [], [_budget(r, a.at) for r in members])
            for r in members:
                value, why = smoothed_at(r, a.metric, a.at, a.smoothing)
                if value is None:
                    cell.missing.append((r, why or "no value"))
                else:
                    cell.values.append(value)
            row_cells.append(cell)
        ref_cell = next((c for c in row_cells if _same(c.col, ref)), None)
        for c in row_cells:
            if ref_cell is not None and ref_cell.value is not None and c.value is not None:
                c.gap = c.value - ref_cell.value
                if c is not ref_cell:
                    c.within = abs(c.gap) <= a.tolerance + 1e-12
        cells.extend(row_cells)
    return row_vals, col_vals, cells


def write_scaling(runs: Sequence[RunResult], a: ScalingAnalysis, out_dir: Path) -> Section:
    """Table 6 as CSV (one line per cell) and Markdown (values, then gaps; cells within tolerance bold ✓)."""
    row_vals, col_vals, cells = scaling_cells(runs, a)
    ref = col_vals[-1] if a.reference is None and col_vals else a.reference
    rows_key = a.rows or "rows"
    csv_rows = [
        [
            c.row if a.rows else "all",
            c.col,
            c.value,
            c.std,
            c.gap,
            c.within,
            len(c.values),
            len(c.runs),
            "/".join(str(t) for t in sorted(set(c.at))),
            c.status,
        ]
        for c in cells
    ]
    header = [rows_key, a.cols, "value", "std", "gap_to_reference", "within_tolerance", "n_runs", "n_planned", "at"]
    csv_path = write_csv(out_dir / f"{a.name}.csv", [*header, "status"], csv_rows)

    others = [v for v in col_vals if not _same(v, ref)]
    md_header = [
        a.rows or "",
        *(f"{_short(a.cols)}={_fmt_param(v)}" for v in col_vals),
        *(f"gap {_fmt_param(v)}" for v in others),
    ]
    md_rows = []
    for rv in row_vals:
        row_cells = [c for c in cells if _same(c.row, rv)]  # in column order
        gaps = [_num(c.gap, sign=True) for c in row_cells if not _same(c.col, ref)]
        md_rows.append([_fmt_param(rv) if a.rows else "all", *map(_scaling_md_cell, row_cells), *gaps])
    sel = _selected(runs, a)
    caption = (
        f"*{a.metric} smoothed by debiased exponential smoothing (weight {a.smoothing:g}) at {_at_text(sel, a.at)}; "
        f"gap = value − value at {a.cols}={_fmt_param(ref)} in the same row. "
        f"**Bold ✓** marks cells within {a.tolerance:g} of that reference (|gap| ≤ {a.tolerance:g}). "
        "(n=k): mean over k runs sharing the cell (e.g. seeds; std in the CSV); (n=k/m): only k of its m runs "
        "have a value.*"
    )
    notes = _missing_notes([(r, w) for c in cells for r, w in c.missing], "no value at update T")
    pooled = _pooled_keys([c.runs for c in cells], [a.rows, a.cols])
    if pooled:
        notes.append(
            f"- Warning: some cells average runs that also differ in {', '.join(pooled)}; "
            "add them to `rows`/`cols` or `select:` to separate them."
        )
    for rv in row_vals:
        ref_cell = next((c for c in cells if _same(c.row, rv) and _same(c.col, ref)), None)
        if ref_cell is None or ref_cell.value is None:
            notes.append(f"- Row {_fmt_param(rv) if a.rows else 'all'}: the reference has no value, so no gaps.")
    body = "\n\n".join(
        p for p in [md_table(md_header, md_rows, right=range(1, len(md_header))), caption, "\n".join(notes)] if p
    )
    return finish(a, out_dir, f"{a.name}: {a.metric} across {a.rows or 'runs'} and {a.cols}", body, [csv_path])


def _scaling_md_cell(c: ScalingCell) -> str:
    if c.value is None:
        if not c.runs:
            return "— (no run)"
        return "— (" + "; ".join(w for _, w in c.missing) + ")"
    text = _num(c.value)
    if c.within:
        text = f"**{text}** ✓"
    if c.missing:
        text += f" (n={len(c.values)}/{len(c.runs)})"
    elif len(c.values) > 1:
        text += f" (n={len(c.values)})"
    return text


def _missing_notes(items: Sequence[tuple[RunResult, str]], what: str) -> list[str]:
    if not items:
        return []
    return [f"Runs with {what}:"] + [f"- {r.label} (`{r.key}`): {w}" for r, w in items]


# ============================================================================ curves (Appendix F)


@dataclass
class Curve:
    """One line of a curves plot: the mean over its runs at their common steps, smoothed, with its band."""

    panel: Any
    hue: Any
    runs: list[RunResult]  # runs averaged into the curve
    without: list[tuple[RunResult, str]]  # runs of this (panel, hue) with no data, and why
    steps: np.ndarray
    raw: np.ndarray
    smoothed: np.ndarray
    band: np.ndarray  # band: residual: the local std
    lo: np.ndarray | None = None  # band: wilson: the interval of the raw accuracy (NaN where n is unknown)
    hi: np.ndarray | None = None
    problems: np.ndarray | None = None  # band: wilson: problems scored at each step, summed over the runs (0 = ?)


def curves_data(
    runs: Sequence[RunResult], a: CurvesAnalysis, records: EvalRecords | None = None
) -> tuple[list[Any], list[Any], list[Curve]]:
    """Panel values, hue values and one ``Curve`` per (panel, hue) that has runs.

    Runs sharing a (panel, hue), e.g. seeds, are averaged point-wise at the steps *all* of them
    logged, so every point of a curve is a mean over the same runs (a run that stopped early ends
    the curve there instead of silently changing which runs it averages). The mean is then smoothed
    with the debiased EMA and the band is smoothed ± ``local_std(raw mean - smoothed, band_window)``;
    with ``band: wilson`` the band is instead the Wilson 95% interval of the raw accuracy at each step
    (:func:`wilson_counts`: the runs' correct answers and problems summed).
    """
    runs = _selected(runs, a)
    panel_vals = _ordered(_param(r, a.panels) for r in runs)
    hue_vals = _ordered(_param(r, a.hue) for r in runs)
    curves = []
    for pv in panel_vals:
        for hv in hue_vals:
            members = [r for r in runs if _same(_param(r, a.panels), pv) and _same(_param(r, a.hue), hv)]
            if not members:
                continue
            series = {id(r): _points(r, a.metric) for r in members}
            used = [r for r in members if len(series[id(r)][0])]
            without = [(r, _reason(r, a.metric, 0) or "no data") for r in members if r not in used]
            common = sorted(set.intersection(*(set(series[id(r)][0].tolist()) for r in used))) if used else []
            steps = np.array(common, dtype=np.int64)
            if len(steps):
                stacked = [dict(zip(*(x.tolist() for x in series[id(r)]))) for r in used]
                raw = np.array([np.mean([d[s] for d in stacked]) for s in common])
                smooth = debiased_ema(raw, a.smoothing)
                band = local_std(raw - smooth, a.band_window)
            else:
                raw = smooth = band = np.zeros(0)
            curve = Curve(pv, hv, used, without, steps, raw, smooth, band)
            if a.band == "wilson":
                _wilson_band(curve, a.metric, records)
            curves.append(curve)
    return panel_vals, hue_vals, curves


def wilson_counts(run: RunResult, step: int, metric: str, records: EvalRecords | None) -> tuple[int, int] | None:
    """(correct, problems) of ``run``'s held-out evaluation at ``step``: counted from its per-problem verdicts
    (eval.jsonl's ``heldout/correct``) where ``records`` has them, else ``round(accuracy * n)`` of ``n`` = the run's
    ``task.heldout_size``; None when neither tells how many problems were scored."""
    rec = (records(run) if records is not None else {}).get(step, {})
    verdicts = rec.get(HELDOUT_CORRECT)
    if isinstance(verdicts, str) and verdicts and not verdicts.strip("01"):
        return verdicts.count("1"), len(verdicts)
    n = run.params.get(HELDOUT_SIZE)
    acc = dict(run.history.get(metric, [])).get(step)
    if not is_num(n) or int(n) != n or n < 1 or acc is None or not 0 <= acc <= 1:
        return None
    return round(acc * int(n)), int(n)


def _wilson_band(c: Curve, metric: str, records: EvalRecords | None) -> None:
    """Fill ``c.lo``/``c.hi``/``c.problems``: the Wilson 95% interval of the pooled counts of its runs per step."""
    c.lo, c.hi = np.full(len(c.steps), np.nan), np.full(len(c.steps), np.nan)
    c.problems = np.zeros(len(c.steps), dtype=np.int64)
    cache: dict[int, dict[int, dict[str, Any]]] = {}

    def cached(r: RunResult) -> dict[int, dict[str, Any]]:
        if id(r) not in cache:
            cache[id(r)] = records(r) if records is not None else {}
        return cache[id(r)]

    for i, step in enumerate(c.steps.tolist()):
        counts = [wilson_counts(r, step, metric, cached if records is not None else None) for r in c.runs]
        if counts and all(x is not None for x in counts):
            k, n = sum(x[0] for x in counts), sum(x[1] for x in counts)  # type: ignore[index]
            c.lo[i], c.hi[i] = wilson(k, n)
            c.problems[i] = n


def write_curves(
    runs: Sequence[RunResult], a: CurvesAnalysis, out_dir: Path, title: str = "", records: EvalRecords | None = None
) -> Section:
    """Appendix F-style PNG (one panel per ``panels`` value), the plotted numbers as CSV, a Markdown summary.

    ``records``: each run's eval.jsonl records by update, for ``band: wilson``'s problem counts (without them, or
    where a record lacks its verdicts, the run's ``task.heldout_size`` is the count)."""
    wilson_band = a.band == "wilson"
    panel_vals, hue_vals, curves = curves_data(runs, a, records)
    rows = []
    for c in curves:
        for i in range(len(c.steps)):
            band_cells = [c.lo[i], c.hi[i], int(c.problems[i]) or None] if wilson_band else [c.band[i]]  # type: ignore[index]
            rows.append([c.panel, c.hue, int(c.steps[i]), c.raw[i], c.smoothed[i], *band_cells, len(c.runs)])
    band_header = ["wilson_lo", "wilson_hi", "problems"] if wilson_band else ["band_std"]
    csv_path = write_csv(
        out_dir / f"{a.name}.csv",
        [a.panels or "panel", a.hue or "hue", "step", "raw_mean", "smoothed", *band_header, "n_runs"],
        rows,
    )
    png_path = _plot_curves(a, panel_vals, hue_vals, curves, out_dir / f"{a.name}.png", title)

    md_rows = []
    for c in curves:
        planned = len(c.runs) + len(c.without)
        last = int(c.steps[-1]) if len(c.steps) else None
        md_rows.append(
            [
                *([_fmt_param(c.panel)] if a.panels else []),
                _fmt_param(c.hue) if a.hue else "all",
                f"{len(c.runs)}/{planned}",
                f"{int(c.steps[0])}–{last}" if last is not None else "—",
                _num(float(c.smoothed[-1])) if last is not None else "—",
                (_wilson_cell(c) if wilson_band else _num(float(c.band[-1]))) if last is not None else "—",
            ]
        )
    header = [*([_short(a.panels)] if a.panels else []), _short(a.hue) or "curve", "runs", "updates"]
    header += [f"smoothed {a.metric} at last update", "Wilson 95% there" if wilson_band else "band std there"]
    if wilson_band:
        lines = (
            f"{a.metric} smoothed by debiased exponential smoothing (weight {a.smoothing:g}); faint: raw values"
            if a.smoothing > 0
            else f"raw {a.metric} (no smoothing)"
        )
        shading = (
            "shading: the Wilson 95% score interval of the raw held-out accuracy at each evaluation, n = the problems "
            f"it scored (the length of {HELDOUT_CORRECT}, else the run's {HELDOUT_SIZE}); runs sharing a line pool "
            "their counts (correct answers and problems summed)"
        )
        caption = (
            f"![{a.name}]({png_path.name})\n\n*Lines: {lines}; {shading}. Runs sharing a line are averaged at the "
            "updates all of them logged (runs: with data / planned).*"
        )
    else:
        caption = (
            f"![{a.name}]({png_path.name})\n\n"
            f"*Lines: {a.metric} smoothed by debiased exponential smoothing (weight {a.smoothing:g}); shading: ± the "
            f"local standard deviation (window {a.band_window}) of the raw-minus-smoothed residuals; faint: raw "
            "values. Runs sharing a line are averaged at the updates all of them logged (runs: with data / planned).*"
        )
    notes = _missing_notes([w for c in curves for w in c.without], f"no {a.metric} (not plotted)")
    if wilson_band:
        unknown = [c for c in curves if c.lo is not None and len(c.steps) and np.isnan(c.lo).any()]
        notes += [
            f"- Line {_fmt_param(c.hue) if a.hue else 'all'}"
            + (f" ({a.panels}={_fmt_param(c.panel)})" if a.panels else "")
            + f": no Wilson band at {int(np.isnan(c.lo).sum())} of its {len(c.steps)} updates: how many problems "
            f"were scored is unknown there (no {HELDOUT_CORRECT} in eval.jsonl and no {HELDOUT_SIZE})"
            for c in unknown
        ]
    short = [
        f"- {r.label}: {_progress(r, a.metric)}, longer than the others of its line, which ends at update "
        f"{int(c.steps[-1])}"
        for c in curves
        if len(c.runs) > 1 and len(c.steps)
        for r in c.runs
        if _points(r, a.metric)[0][-1] > c.steps[-1]
    ]
    if short:
        notes += ["Lines cut at their shortest run:", *short]
    pooled = _pooled_keys([c.runs for c in curves], [a.panels, a.hue])
    if pooled:
        notes.append(f"- Warning: some lines average runs that also differ in {', '.join(pooled)}.")
    body = "\n\n".join(
        p
        for p in [md_table(header, md_rows, right=range(len(header) - 2, len(header))), caption, "\n".join(notes)]
        if p
    )
    return finish(a, out_dir, f"{a.name}: {a.metric} vs update", body, [csv_path, png_path])


def _wilson_cell(c: Curve) -> str:
    lo, hi = float(c.lo[-1]), float(c.hi[-1])  # type: ignore[index]
    return "—" if math.isnan(lo) else f"[{lo:.4f}, {hi:.4f}] (n={int(c.problems[-1])})"  # type: ignore[index]


def _plot_curves(
    a: CurvesAnalysis, panel_vals: list[Any], hue_vals: list[Any], curves: list[Curve], out: Path, title: str
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    n = max(1, len(panel_vals))
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.4 * ncols, 4.0 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ax in enumerate(axes.flat):
        if i >= n:
            ax.set_visible(False)
            continue
        pv = panel_vals[i] if panel_vals else None
        drawn = False
        for c in (c for c in curves if _same(c.panel, pv) and len(c.steps)):
            color = colors[next(j for j, h in enumerate(hue_vals) if _same(h, c.hue)) % len(colors)]
            label = _fmt_param(c.hue) if a.hue else a.metric
            if len(c.runs) > 1:
                label += f" (n={len(c.runs)})"
            sparse = len(c.steps) <= 30  # e.g. evaluations every k updates: show where the points are
            if a.band == "wilson":  # the interval of the raw accuracy, with or without smoothing
                if a.smoothing > 0:
                    ax.plot(c.steps, c.raw, color=color, alpha=0.25, lw=0.7, zorder=1)
                ax.fill_between(c.steps, c.lo, c.hi, color=color, alpha=0.2, lw=0, zorder=2)
            elif a.smoothing > 0:  # raw values faint, a band only where a smoothed curve has residuals to show
                ax.plot(c.steps, c.raw, color=color, alpha=0.25, lw=0.7, zorder=1)
                ax.fill_between(
                    c.steps, c.smoothed - c.band, c.smoothed + c.band, color=color, alpha=0.2, lw=0, zorder=2
                )
            marker = "o" if sparse else None
            ax.plot(c.steps, c.smoothed, color=color, lw=1.8, label=label, zorder=3, marker=marker, ms=4)
            drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set(xlabel="update", ylabel=a.metric)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # updates are whole numbers
        if a.panels:
            ax.set_title(f"{a.panels}={_fmt_param(pv)}")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(title=a.hue, fontsize=8, title_fontsize=8)
    if a.band == "wilson":
        what = (f"debiased EMA {a.smoothing:g}" if a.smoothing > 0 else "raw") + ", band Wilson 95% of raw accuracy"
    else:
        what = f"debiased EMA {a.smoothing:g}, band ± local std (window {a.band_window})" if a.smoothing > 0 else "raw"
    fig.suptitle(  # two short lines so a one-panel figure does not cut the title off
        f"{title + ': ' if title else ''}{a.name}\n{a.metric}, {what}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ============================================================================ final table


def write_final(runs: Sequence[RunResult], a: FinalAnalysis, out_dir: Path) -> Section:
    """One line per run, sorted by ``by``: smoothed metric at T and the ``also`` metrics' last values by T."""
    sel = _selected(runs, a)
    orders = {k: _ordered(_param(r, k) for r in sel) for k in a.by}

    def sort_key(r: RunResult) -> list[int]:
        return [next(i for i, v in enumerate(orders[k]) if _same(v, _param(r, k))) for k in a.by]

    ordered = sorted(sel, key=sort_key)  # stable: ties keep the sweep's order
    csv_rows, md_rows, groups = [], [], {}
    for r in ordered:
        t = _budget(r, a.at)
        value, why = smoothed_at(r, a.metric, a.at, a.smoothing)
        extra = [_raw_at(r, m, t) for m in a.also]
        group = tuple(_fmt_param(_param(r, k)) for k in a.by)
        groups.setdefault(group, []).append((value, [v for v, _ in extra]))
        csv_rows.append(
            [
                *(_param(r, k) for k in a.by),
                r.label,
                r.key,
                r.status,
                _progress(r, a.metric),
                t,
                value,
                *(x for v, s in extra for x in (v, s)),
                why or "",
            ]
        )
        md_extra = [
            _num(v) + (f" (at {s})" if s is not None and s < t else "") if v is not None else "—" for v, s in extra
        ]
        md_rows.append([*group, r.label, r.status, _progress(r, a.metric), _num(value), *md_extra, why or ""])
    metric_col = f"{a.metric} (smoothed)"
    header = [*a.by, "run", "key", "status", "progress", "at", metric_col]
    header += [x for m in a.also for x in (m, f"{m} step")]
    csv_path = write_csv(out_dir / f"{a.name}.csv", [*header, "note"], csv_rows)

    md_header = [*(_short(k) for k in a.by), "run", "status", "progress", metric_col, *a.also, "note"]
    parts = [
        md_table(md_header, md_rows),
        f"*{a.metric}: debiased exponential smoothing (weight {a.smoothing:g}) at {_at_text(sel, a.at)}; "
        f"{', '.join(a.also) or 'other metrics'}: last logged value by then (its update in brackets when earlier). "
        "progress = last logged update / budget.*",
    ]
    if a.by and any(len(g) > 1 for g in groups.values()):
        parts += [
            "Mean over the runs of each group (runs with a value / runs):",
            md_table([*(_short(k) for k in a.by), "runs", "mean", "std", *a.also], _group_means(groups, a)),
        ]
    pooled = _pooled_keys(
        [[r for r in sel if tuple(_fmt_param(_param(r, k)) for k in a.by) == g] for g in groups], a.by
    )
    if pooled and a.by:
        parts.append(f"Groups also differ in: {', '.join(pooled)}.")
    return finish(a, out_dir, f"{a.name}: {a.metric} per run", "\n\n".join(parts), [csv_path])


def _group_means(groups: dict[tuple, list], a: FinalAnalysis) -> list[list[Any]]:
    """One row per group of runs: how many have a value, the mean and std of the metric, the means of ``also``."""
    rows = []
    for g, members in groups.items():
        vals = [v for v, _ in members if v is not None]
        extras = [[e[j] for _, e in members if e[j] is not None] for j in range(len(a.also))]
        rows.append(
            [
                *g,
                f"{len(vals)}/{len(members)}",
                _num(float(np.mean(vals))) if vals else "—",
                _num(float(np.std(vals, ddof=1))) if len(vals) > 1 else "—",
                *(_num(float(np.mean(x))) if x else "—" for x in extras),
            ]
        )
    return rows


# ============================================================================ held-out change


def run_eval_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    """A run folder's eval.jsonl records by update (a later record of the same update replaces an earlier one).

    A pipeline's evaluations are its stages': joined on the pipeline's update axis as
    esbatch/aggregate/collect.py:folder_history joins their metrics (stage k's update t at ``offset_k + t``; where
    two stages share an update the earlier stage's record is kept). Reads only; a torn last line is skipped."""
    rd = RunDir(run_dir)
    out: dict[int, dict[str, Any]] = {}
    offset = 0
    for st in rd.stages():
        for t, rec in _own_eval_records(st).items():
            out.setdefault(offset + t, rec)
        offset += st.stage_budget()
    for t, rec in _own_eval_records(rd).items():
        out.setdefault(t, rec)
    return dict(sorted(out.items()))


def _own_eval_records(rd: RunDir) -> dict[int, dict[str, Any]]:
    return {
        rec["t"]: rec
        for rec in read_jsonl(rd.eval_log)[0]
        if isinstance(rec, dict) and isinstance(rec.get("t"), int) and not isinstance(rec.get("t"), bool)
    }


def folder_records(sweep_dir: Path) -> EvalRecords:
    """Each run's eval.jsonl records (:func:`run_eval_records`) from its folder in ``sweep_dir``, read once."""
    sd, cache = SweepDir(sweep_dir), {}

    def records(r: RunResult) -> dict[int, dict[str, Any]]:
        if r.key not in cache:
            cache[r.key] = run_eval_records(sd.run_dir(r.key).path)
        return cache[r.key]

    return records


@dataclass
class ChangeRow:
    """One run of a ``heldout_change`` table: its paired change between two evaluations, or why it has none."""

    hue: Any
    run: RunResult
    first: int
    last: int | None
    change: PairedChange | None
    why: str = ""


def _steps_text(steps: Sequence[int]) -> str:
    shown = ", ".join(map(str, steps[:12])) + (f", … ({len(steps)} in all)" if len(steps) > 12 else "")
    return f"evaluated at updates {shown}" if steps else "no evaluations"


def change_row(run: RunResult, a: HeldoutChangeAnalysis, records: dict[int, dict[str, Any]]) -> ChangeRow:
    """The paired change of ``run`` from its evaluation at ``a.first`` to the one at ``a.last`` (or its last)."""
    hue = _param(run, a.hue)
    held = {t: rec for t, rec in records.items() if HELDOUT in rec or HELDOUT_CORRECT in rec}
    steps = sorted(held)
    last = a.last if a.last is not None else (steps[-1] if steps else None)
    row = ChangeRow(hue, run, a.first, last, None)
    if not steps:
        row.why = f"{run.status}: no held-out evaluation in eval.jsonl"
    elif a.first not in held:
        row.why = f"no evaluation at update {a.first} ({_steps_text(steps)})"
    elif last is None or last not in held:
        row.why = f"no evaluation at update {last} ({_steps_text(steps)})"
    elif last <= a.first:
        row.why, row.last = f"{run.status}: no evaluation after update {a.first} yet", None
    if row.why:
        return row
    verdicts = {t: held[t].get(HELDOUT_CORRECT) for t in (a.first, last)}
    old = [t for t, v in verdicts.items() if not isinstance(v, str)]
    if len(old) == 2:
        row.why = (
            f"no per-problem verdicts ({HELDOUT_CORRECT}) in eval.jsonl at updates {a.first} and {last}: the run "
            "predates them"
        )
    elif old:
        row.why = (
            f"no per-problem verdicts ({HELDOUT_CORRECT}) in eval.jsonl at update {old[0]}: that evaluation "
            "predates them"
        )
    elif len(verdicts[a.first]) != len(verdicts[last]):
        row.why = (
            f"{run.label}: its evaluations at updates {a.first} and {last} scored different numbers of problems "
            f"({len(verdicts[a.first])} and {len(verdicts[last])}), so they do not pair"
        )
    else:
        try:
            row.change = paired_change(verdicts[a.first], verdicts[last])
        except ValueError as e:
            row.why = f"{run.label}: unreadable {HELDOUT_CORRECT} ({e})"
    return row


def heldout_change_rows(runs: Sequence[RunResult], a: HeldoutChangeAnalysis, records: EvalRecords) -> list[ChangeRow]:
    """One row per selected run, ordered by its ``hue`` value (stable: the sweep's order within a value)."""
    sel = _selected(runs, a)
    order = _ordered(_param(r, a.hue) for r in sel)
    rank = {id(r): next(i for i, v in enumerate(order) if _same(v, _param(r, a.hue))) for r in sel}
    return [change_row(r, a, records(r)) for r in sorted(sel, key=lambda r: rank[id(r)])]


def _pct(v: float, sign: bool = False) -> str:
    return f"{100 * v:+.1f}" if sign else f"{100 * v:.1f}"


def _p_text(p: float) -> str:
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def _acc_cell(k: int, n: int) -> str:
    lo, hi = wilson(k, n)
    return f"{_pct(k / n)} [{_pct(lo)}, {_pct(hi)}]"


def heldout_change_markdown(rows: Sequence[ChangeRow], a: HeldoutChangeAnalysis) -> str:
    """The Markdown table of ``rows`` (accuracies in %, the change in percentage points) and its caption."""
    md_rows = []
    for r in rows:
        c = r.change
        updates = f"{r.first}→{r.last}" if r.last is not None else f"{r.first}→—"
        if c is None:
            cells = ["—"] * 6
        else:
            change = f"{_pct(c.change, sign=True)} [{_pct(c.lo, sign=True)}, {_pct(c.hi, sign=True)}]"
            cells = [
                str(c.n),
                _acc_cell(c.k_first, c.n),
                _acc_cell(c.k_last, c.n),
                f"**{change}**" if c.excludes_zero else change,
                f"{c.gained}/{c.lost}",
                _p_text(c.mcnemar_p),
            ]
        md_rows.append([*([_fmt_param(r.hue)] if a.hue else []), r.run.label, updates, *cells, r.why])
    header = [*([_short(a.hue)] if a.hue else []), "run", "updates", "problems"]
    header += ["accuracy first [Wilson 95%]", "accuracy last [Wilson 95%]", "change [paired 95%]"]
    header += ["gained/lost", "McNemar p", "note"]
    last = f"update {a.last}" if a.last is not None else "its last evaluation (updates: first→last)"
    caption = (
        f"*Greedy held-out accuracy (%) of each run at update {a.first} and at {last}, each with its Wilson score "
        f"95% interval over the problems; change = last − first in percentage points, with a paired {LEVEL:.0%} "
        f"interval: the {50 * (1 - LEVEL):g}th and {50 * (1 + LEVEL):g}th percentiles of the mean per-problem "
        "difference (last − first, each −1, 0 or 1) over "
        f"{BOOTSTRAP:,} bootstrap resamples of the held-out problems with replacement (seed {SEED}; the paired "
        "bootstrap of Table 10). **Bold**: the interval excludes 0 (an end exactly at 0 does not). gained/lost: "
        "problems wrong→right / right→wrong; McNemar p: exact two-sided binomial test on those.*"
    )
    n_first = len(header) - 7  # problems .. McNemar p
    return md_table(header, md_rows, right=range(n_first, len(header) - 1)) + "\n\n" + caption


def write_heldout_change(
    runs: Sequence[RunResult], a: HeldoutChangeAnalysis, out_dir: Path, records: EvalRecords, title: str = ""
) -> Section:
    """``<name>.csv`` (one line per run), ``<name>.md`` (the table) and ``<name>.png`` (a forest plot of the
    changes). ``records``: each run's eval.jsonl records by update (:func:`folder_records`)."""
    rows = heldout_change_rows(runs, a, records)
    csv_rows = []
    for r in rows:
        c = r.change
        cells: list[Any] = [None] * 16
        if c is not None:
            lo_f, hi_f = wilson(c.k_first, c.n)
            lo_l, hi_l = wilson(c.k_last, c.n)
            cells = [c.n, c.acc_first, lo_f, hi_f, c.acc_last, lo_l, hi_l, c.change, c.lo, c.hi]
            cells += [c.excludes_zero, c.gained, c.lost, c.mcnemar_p, c.k_first, c.k_last]
        csv_rows.append([r.hue, r.run.label, r.run.key, r.run.status, r.first, r.last, *cells, r.why])
    header = [a.hue or "hue", "run", "key", "status", "first", "last", "problems"]
    header += ["acc_first", "acc_first_lo", "acc_first_hi", "acc_last", "acc_last_lo", "acc_last_hi"]
    header += ["change", "change_lo", "change_hi", "excludes_zero", "gained", "lost", "mcnemar_p"]
    header += ["correct_first", "correct_last", "note"]
    csv_path = write_csv(out_dir / f"{a.name}.csv", header, csv_rows)
    png_path = _plot_forest(a, rows, out_dir / f"{a.name}.png", title)
    body = f"![{a.name}]({png_path.name})\n\n" + heldout_change_markdown(rows, a)
    heading = f"{a.name}: change of held-out accuracy" + (f" by {a.hue}" if a.hue else "")
    return finish(a, out_dir, heading, body, [csv_path, png_path])


def _plot_forest(a: HeldoutChangeAnalysis, rows: Sequence[ChangeRow], out: Path, title: str) -> Path:
    """A forest plot: each run's change (percentage points) with its paired 95% interval, a line at 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.change is not None]
    fig, ax = plt.subplots(figsize=(6.4, 1.6 + 0.35 * max(1, len(shown))))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    hues = _ordered(r.hue for r in shown)
    for y, r in enumerate(shown):
        c = r.change
        assert c is not None
        color = colors[next(i for i, h in enumerate(hues) if _same(h, r.hue)) % len(colors)]
        ax.errorbar(
            100 * c.change,
            y,
            xerr=[[100 * (c.change - c.lo)], [100 * (c.hi - c.change)]],
            fmt="o",
            color=color,
            capsize=3,
            ms=5,
        )
    ax.axvline(0, color="black", lw=0.8, zorder=0)

    def label(r: ChangeRow) -> str:  # the hue value, and the run's label where it says more (e.g. its seed)
        hue = f"{_short(a.hue)}={_fmt_param(r.hue)}" if a.hue else ""
        return r.run.label if not hue or r.run.label == hue else f"{hue}  {r.run.label}"

    labels = [label(r) for r in shown]
    ax.set_yticks(range(len(shown)), labels, fontsize=8)
    ax.set_ylim(len(shown) - 0.5 if shown else 0.5, -0.5)  # the table's order, top to bottom
    if not shown:
        ax.text(0.5, 0.5, "no run with per-problem verdicts", ha="center", va="center", transform=ax.transAxes)
    last = f"update {a.last}" if a.last is not None else "last eval"
    ax.set_xlabel(f"held-out accuracy change, update {a.first} → {last} (points)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{title + ': ' if title else ''}{a.name}\npaired bootstrap 95% interval over problems", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ============================================================================ the report


def write_report(
    runs: list[RunResult],
    analyses: list[Analysis] | None,
    out_dir: Path,
    title: str = "",
    evals: Any = None,
    sweep_dir: Path | None = None,
) -> list[Path]:
    """Write every analysis (``<name>.csv``, ``<name>.md``, curves also ``<name>.png``) and the index
    ``README.md`` that embeds them and lists every run that is not finished or lacks a metric.

    ``analyses=None`` uses ``default_analyses(runs)``. Parameter names are checked against the runs
    first (``ConfigError`` with "did you mean"), so nothing half-written is left by a typo.
    ``sweep_dir``: the sweep folder, whose run folders the ``drift`` and ``heldout_change`` analyses read (and
    ``curves`` with ``band: wilson``, for the problems each evaluation scored). Returns the paths written,
    the index last.
    """
    out_dir = Path(out_dir)
    if analyses is None:
        analyses = default_analyses(runs)
    errors = [e for a in analyses if not isinstance(a, EVAL_KINDS) for e in _param_errors(a, runs)]
    errors += [e for a in analyses if isinstance(a, EVAL_KINDS) and evals is not None for e in evals.param_errors(a)]
    errors += [
        f"{a.path or a.name}: kind '{a.kind}' reads the sweep's evaluations; add an `evaluate:` section to the sweep"
        for a in analyses
        if isinstance(a, EVAL_KINDS) and a.kind != "threshold_curve" and evals is None
    ]
    errors += [
        f"{a.path or a.name}: kind 'threshold_curve' reads the evals of thresholded checkpoints; add a `threshold:` "
        "section to the sweep (tau: [...], config: EVAL_CONFIG)"
        for a in analyses
        if a.kind == "threshold_curve" and (evals is None or not evals.threshold)
    ]
    errors += [
        f"{a.path or a.name}: kind '{a.kind}' reads the run folders of a sweep (esbatch aggregate SWEEP_DIR)"
        for a in analyses
        if isinstance(a, RUN_FOLDER_KINDS) and sweep_dir is None
    ]
    if errors:
        raise ConfigError(errors)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = folder_records(sweep_dir) if sweep_dir is not None else None
    sections = []
    for a in analyses:
        if isinstance(a, EVAL_KINDS):
            sections.append(WRITERS[a.kind](evals, a, out_dir))
        elif isinstance(a, ScalingAnalysis):
            sections.append(write_scaling(runs, a, out_dir))
        elif isinstance(a, CurvesAnalysis):
            sections.append(write_curves(runs, a, out_dir, title, records))
        elif isinstance(a, FinalAnalysis):
            sections.append(write_final(runs, a, out_dir))
        elif isinstance(a, DriftAnalysis):
            sections.append(write_drift(_selected(runs, a), a, out_dir, sweep_dir))
        elif isinstance(a, HeldoutChangeAnalysis) and records is not None:
            sections.append(write_heldout_change(runs, a, out_dir, records, title))
        else:
            raise TypeError(f"not an analysis: {a!r}")
    index = out_dir / INDEX_FILE
    text = _index_markdown(runs, [a for a in analyses if not isinstance(a, EVAL_KINDS)], sections, title)
    if evals is not None:
        text += _evals_markdown(evals)
    durable.write_text(index, text, encoding="utf-8")
    return [p for s in sections for p in s.files] + [index]


def run_problems(runs: Sequence[RunResult], analyses: Sequence[Analysis]) -> list[tuple[RunResult, list[str]]]:
    """Every run that is not finished, has not reached its budget, or lacks a metric an analysis needs."""
    metrics = list(dict.fromkeys(a.metric for a in analyses)) or ["reward/mean"]
    out = []
    for r in runs:
        problems = [] if r.status == "finished" else [r.status]
        for m in metrics:
            steps, _ = _points(r, m)
            if not len(steps):
                if r.status not in ("missing", "pending"):
                    problems.append(f"no {m}")
            elif steps[-1] < r.total_updates:
                problems.append(f"{m} at {steps[-1]}/{r.total_updates}")
        if problems:
            out.append((r, problems))
    return out


def _index_markdown(
    runs: Sequence[RunResult], analyses: Sequence[Analysis], sections: Sequence[Section], title: str
) -> str:
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.status] = counts.get(r.status, 0) + 1
    parts = [
        f"# {title or 'Sweep report'}",
        f"{len(runs)} runs: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".",
    ]
    if sections:
        parts.append(
            "\n".join(f"- [{s.analysis.name}](#{_anchor(s.analysis.name)}) ({s.analysis.kind})" for s in sections)
        )
    problems = run_problems(runs, analyses)
    parts.append("## Runs needing attention")
    if problems:
        parts.append(
            md_table(
                ["run", "key", "status", "progress", "problem"],
                [[r.label, f"`{r.key}`", r.status, _progress(r), "; ".join(p)] for r, p in problems],
            )
        )
    else:
        parts.append(f"None: all {len(runs)} runs finished their budget with every analysed metric logged.")
    for s in sections:
        links = ", ".join(f"[{p.name}]({p.name})" for p in s.files)
        parts += [f"## {s.analysis.name}", f"Kind `{s.analysis.kind}`; files: {links}.", s.markdown]
    parts.append("## All runs")
    parts.append(
        md_table(["run", "key", "status", "progress"], [[r.label, f"`{r.key}`", r.status, _progress(r)] for r in runs])
    )
    return "\n\n".join(parts) + "\n"


def _evals_markdown(evals: Any) -> str:
    rows = [
        [e.label, f"`{e.key}`", "finished" if e.finished else "not finished"]
        + [f"{len(e.tasks[t].ids)}×{e.tasks[t].n}" if t in e.tasks else "—" for t in evals.task_order]
        for e in evals.entries
    ]
    text = "\n## All evaluations\n\n" + md_table(["eval", "key", "status", *evals.task_order], rows) + "\n"
    if evals.threshold:
        thr = [
            [
                p.label,
                f"{p.tau:g}",
                f"`{p.key}`",
                ("finished" if p.finished else "not finished") + (f" ({p.why})" if p.why else ""),
                f"{100 * p.s_tau:.4f}" if p.s_tau is not None else "—",
            ]
            for p in evals.threshold
        ]
        text += "\n## Threshold evaluations\n\n" + md_table(["run", "tau", "key", "status", "s_tau (%)"], thr) + "\n"
    return text


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "", name.lower().replace(" ", "-"))
