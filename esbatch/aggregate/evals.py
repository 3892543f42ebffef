"""The evaluation tables and figures of a sweep with an ``evaluate:`` phase (paper RQ1, Section 3).

Kinds (esbatch/config/aggregate.py): ``eval_table`` (Tables 2/3/5 with ``metrics: [pass@1, pass@16, pass@32]``,
Tables 8/9 with ``[maj@16, maj@32]``; ``delta: true`` gives Table 10, the change vs the base model),
``eval_wins`` (how many (model, task, metric) comparisons one method wins over another), ``pareto`` (Figure 3:
Pass@1 vs Pass@K per task), ``passk`` (Pass@K profiles, K = 1..n) and ``threshold_curve`` (Figure 4: target-task
Pass@1 against the update sparsity s_tau of the ``threshold:`` phase's checkpoints, one line per run).

Every number is read back from the eval folders' per-problem samples (esbatch/eval/runner.py), so each cell
knows how many problems and samples it rests on. A difference between two models is paired over problems
(the same problems, in the same order, are evaluated for every model) and carries a 95% percentile
bootstrap interval over problems (2,000 resamples, seed 0). An average column is the mean over its tasks that
have the metric (an analysis's ``averages``; by default one over the held-out tasks: the training task is shown
but not averaged), its interval from a stratified bootstrap (each task's problems resampled on their own).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from esbatch.aggregate.tables import finish, md_table, write_csv
from esbatch.analyze.threshold import S_TAU, tau_dir
from esbatch.config.aggregate import parse_specs
from esbatch.launch.evals import SOURCE_FILE, THRESHOLD_PREFIX, eval_done, evaluated_updates
from esbatch.launch.state import SweepDir
from esbatch.metrics import pass_at_k, problem_metrics
from esbatch.registry import did_you_mean
from esbatch.schema import ConfigError
from esbatch.train.rundir import read_jsonl

BOOTSTRAP, SEED, LEVEL = 2000, 0, 0.95
AVG = "Held-out avg"


@dataclass
class TaskSamples:
    """One task of one eval: per-problem metric values (problems in evaluation order)."""

    ids: list[int]  # problem indices in the task's evaluation order
    questions: list[str]
    n: int  # samples per problem
    values: dict[str, np.ndarray]  # metric -> per-problem values
    correct: np.ndarray  # per-problem number of correct samples

    def mean(self, metric: str) -> float | None:
        v = self.values.get(metric)
        return float(v.mean()) if v is not None and len(v) else None


@dataclass
class EvalEntry:
    key: str
    label: str
    point: dict[str, Any]
    finished: bool
    tasks: dict[str, TaskSamples] = field(default_factory=dict)

    def param(self, key: str) -> Any:
        return self.point.get(key)


@dataclass
class ThresholdPoint:
    """One eval of the threshold phase: a run's final model (tau 0) or its checkpoint thresholded at tau."""

    key: str
    run: str  # the trained run's key
    label: str  # the run's label: one line of the curve
    point: dict[str, Any]
    tau: float
    finished: bool
    tasks: dict[str, TaskSamples]
    s_tau: float | None  # None: no s_tau.json (the checkpoint was never written)
    why: str | None = None  # why the point cannot be drawn, when it cannot


@dataclass
class EvalSet:
    entries: list[EvalEntry]
    task_order: list[str]
    train_task: str | None
    threshold: list[ThresholdPoint] = field(default_factory=list)
    threshold_task: str | None = None
    threshold_tasks: list[str] = field(default_factory=list)  # the task labels of the threshold evals

    def heldout(self, tasks: list[str] | None = None) -> list[str]:
        return [t for t in (tasks or self.task_order) if t != self.train_task]

    def param_errors(self, a: Any) -> list[str]:
        """Names in ``a`` (rows, panels, select) that no eval's point has (its method, model and sweep axes)."""
        points = [p.point for p in self.threshold] if a.kind == "threshold_curve" else [e.point for e in self.entries]
        known = sorted({k for p in points for k in p})
        names = {"rows": getattr(a, "rows", None), "panels": getattr(a, "panels", None)}
        names.update({f"select.{k}": k for k in a.select})
        errors = [
            f"{a.path or a.name}.{field}: unknown parameter {key!r}.{did_you_mean(key, known)} The evals have: "
            f"{', '.join(known)}"
            for field, key in names.items()
            if key and key not in known
        ]
        task = getattr(a, "task", None)
        if task and task not in self.threshold_tasks:
            errors.append(
                f"{a.path or a.name}.task: '{task}' is not a task of the threshold evals."
                f"{did_you_mean(task, self.threshold_tasks)} Their tasks: {', '.join(self.threshold_tasks)}"
            )
        return errors

    def tasks_of(self, a: Any) -> tuple[list[str], list[tuple[str, list[str]]]]:
        """(tasks shown, [(average label, the tasks it averages)]) for analysis ``a``: its ``tasks`` list, else
        every task; its ``averages``, else one "Held-out avg" over the tasks shown but the training task."""
        named = {f"{a.path or a.name}.tasks": a.tasks}
        named.update({f"{a.path or a.name}.averages.{k}": v for k, v in getattr(a, "averages", {}).items()})
        errors = [
            f"{where}: no eval has {unknown}; task labels: {self.task_order}"
            for where, given in named.items()
            if (unknown := [t for t in given if t not in self.task_order])
        ]
        if errors:
            raise ConfigError(errors)
        tasks = list(a.tasks) or self.task_order
        return tasks, list(getattr(a, "averages", {}).items()) or [(AVG, self.heldout(tasks))]


def load_evals(sd: SweepDir, ks: Sequence[int] = (1, 16, 32)) -> EvalSet:
    """Every planned eval of the sweep with whatever samples it has (an unfinished eval is marked so)."""
    meta = sd.read()
    run_labels = {r["key"]: r["label"] for r in meta.get("runs", [])}
    entries, order, threshold, thr_tasks = [], [], [], []
    for e in meta.get("evals", []):
        folder = sd.eval_dir(e["key"])
        plan = yaml.safe_load(sd.eval_plan_path(e["key"]).read_text())
        labels = [t.get("label") or t["name"] for t in plan["tasks"]]
        only_threshold = e["key"].startswith(THRESHOLD_PREFIX)  # not a row of the eval tables
        if not only_threshold:
            order += [t for t in labels if t not in order]
        point = dict(e["point"])
        if e.get("source"):  # the run's point says its method and axes; its config the model
            point.setdefault("model.name", plan["model"]["name"])
            own = run_labels.get(e["source"]) if only_threshold else e["label"].removesuffix(" (eval)")
            point.setdefault("method", own)  # a sweep without `methods:`
        entry = EvalEntry(e["key"], e["label"], point, eval_done(folder))
        for lab in labels:
            rows = read_jsonl(folder / "samples" / f"{lab.replace('/', '_')}.jsonl")[0]
            if rows:
                entry.tasks[lab] = task_samples(rows, plan.get("ks") or list(ks))
        if e.get("tau") is not None:
            thr_tasks += [t for t in labels if t not in thr_tasks]
            threshold.append(_threshold_point(sd, e, point, entry, run_labels))
        if only_threshold:
            continue
        same = next((x for x in entries if x.point == point), None)
        if same is None:
            entries.append(entry)
        else:  # another eval config's suite for the same model: one row with both suites' tasks
            same.tasks.update(entry.tasks)
            same.finished = same.finished and entry.finished
    thr_task = (meta.get("threshold") or {}).get("task")
    return EvalSet(entries, order, meta.get("train_task"), threshold, thr_task, thr_tasks)


def _threshold_point(
    sd: SweepDir, e: dict[str, Any], point: dict[str, Any], entry: EvalEntry, run_labels: dict[str, str]
) -> ThresholdPoint:
    """A threshold eval with its checkpoint's s_tau (0 for the unthresholded anchor), or why it has none."""
    tau, why, s_tau = float(e["tau"]), None, 0.0
    if tau > 0:
        try:
            s = json.loads((tau_dir(sd.run_dir(e["source"]).path, tau) / S_TAU).read_text())
            s_tau = float(s["s_tau"])
            evaluated = evaluated_updates(sd.eval_dir(e["key"]))
            if evaluated == "damaged":
                why = f"its eval's {SOURCE_FILE} cannot be read, so which center it scored is unknown: re-run the sweep"
            elif evaluated is not None and s.get("updates") != evaluated:
                why = f"its {S_TAU} is of update {s.get('updates')}, the eval of update {evaluated}: re-run the sweep"
        except (OSError, ValueError, KeyError, TypeError):
            s_tau, why = None, f"no readable {S_TAU} (its checkpoint was not written yet)"
    label = run_labels.get(e["source"], e["source"])
    return ThresholdPoint(e["key"], e["source"], label, point, tau, entry.finished, entry.tasks, s_tau, why)


def task_samples(rows: list[dict[str, Any]], ks: Sequence[int]) -> TaskSamples:
    rows = sorted(rows, key=lambda r: r["i"])
    per = []
    for r in rows:
        correct = [s["verdict"] == "correct" for s in r["samples"]]
        per.append(problem_metrics(correct, [s["key"] for s in r["samples"]], ks, [s["entropy"] for s in r["samples"]]))
    names = sorted({k for p in per for k in p})
    values = {m: np.array([p.get(m, np.nan) for p in per], dtype=np.float64) for m in names}
    n = len(rows[0]["samples"]) if rows else 0
    correct = np.array([sum(s["verdict"] == "correct" for s in r["samples"]) for r in rows])
    return TaskSamples([r["i"] for r in rows], [r["question"] for r in rows], n, values, correct)


# ----------------------------------------------------------------------------- statistics


def paired_diff(a: TaskSamples, b: TaskSamples, metric: str) -> np.ndarray:
    """Per-problem differences a - b over the problems both evaluated (matched by position and question)."""
    pos_a, pos_b = {i: j for j, i in enumerate(a.ids)}, {i: j for j, i in enumerate(b.ids)}
    common = [i for i in a.ids if i in pos_b]
    ia, ib = [pos_a[i] for i in common], [pos_b[i] for i in common]
    if [a.questions[j] for j in ia] != [b.questions[j] for j in ib]:
        raise ValueError("the two evals did not evaluate the same problems; cannot pair them")
    return a.values[metric][ia] - b.values[metric][ib]


def bootstrap_ci(diffs: Sequence[np.ndarray]) -> tuple[float, float, float]:
    """(mean, low, high): the mean over tasks of each task's mean difference, with a 95% percentile interval
    from resampling each task's problems with replacement (stratified; one task = the ordinary bootstrap)."""
    rng = np.random.default_rng(SEED)
    point = float(np.mean([d.mean() for d in diffs]))
    boots = np.zeros(BOOTSTRAP)
    for d in diffs:
        idx = rng.integers(0, len(d), size=(BOOTSTRAP, len(d)))
        boots += d[idx].mean(axis=1)
    boots /= len(diffs)
    lo, hi = np.quantile(boots, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return point, float(lo), float(hi)


def passk_profile(t: TaskSamples) -> list[float]:
    """Mean unbiased Pass@K over problems for K = 1..n."""
    return [float(np.mean([pass_at_k(t.n, int(c), k) for c in t.correct])) for k in range(1, t.n + 1)]


# ----------------------------------------------------------------------------- tables


def _fmt(metric: str, v: float | None, sign: bool = False) -> str:
    if v is None or np.isnan(v):
        return "—"
    if metric == "entropy":  # nats, often about 0.1 on a small model: three decimals tell runs apart
        return f"{v:+.3f}" if sign else f"{v:.3f}"
    x = 100 * v  # rates in percent, like the paper's tables
    return f"{x:+.1f}" if sign else f"{x:.1f}"


def _groups(es: EvalSet, a: Any) -> list[tuple[Any, list[EvalEntry]]]:
    """(panel value, entries) in the sweep's order, after ``select``."""
    keep = [e for e in es.entries if all(e.param(k) in vals for k, vals in a.select.items())]
    panels: list[Any] = []
    for e in keep:
        v = e.param(a.panels) if getattr(a, "panels", None) else None
        if v not in panels:
            panels.append(v)
    return [(p, [e for e in keep if not getattr(a, "panels", None) or e.param(a.panels) == p]) for p in panels]


def _base_of(entries: list[EvalEntry]) -> EvalEntry | None:
    return next((e for e in entries if e.param("method") == "Base"), None)


def heldout_mean(e: EvalEntry, tasks: list[str], metric: str) -> tuple[float | None, int]:
    vals = [e.tasks[t].mean(metric) for t in tasks if t in e.tasks and metric in e.tasks[t].values]
    return (float(np.mean(vals)), len(vals)) if vals else (None, 0)


def write_eval_table(es: EvalSet, a: Any, out_dir: Path) -> Any:
    tasks, averages = es.tasks_of(a)
    csv_rows, parts = [], []
    for panel, entries in _groups(es, a):
        base = _base_of(entries)
        for metric in a.metrics:
            header, rows = [a.rows], []
            for t in tasks:
                sizes = [(len(e.tasks[t].ids), e.tasks[t].n) for e in entries if t in e.tasks]
                p, n = max(sizes) if sizes else (0, 0)
                header.append(f"{t}{' (train)' if t == es.train_task else ''} ({p}×{n})")
            header += [f"{label} ({len(held)} tasks)" for label, held in averages]
            for e in entries:
                if a.delta and (e is base or base is None):
                    continue
                row = [str(e.param(a.rows)) + ("" if e.finished else " *")]
                diffs = _paired_diffs(e, base, metric) if a.delta else {}  # task -> differences from the base
                for t in tasks:
                    ts = e.tasks.get(t)
                    if ts is None or metric not in ts.values:
                        row.append("—")
                        continue
                    if a.delta:
                        d = diffs.get(t)
                        if d is None:
                            row.append("—")
                            continue
                        mean, lo, hi = bootstrap_ci([d])
                        row.append(_ci_cell(metric, mean, lo, hi))
                        csv_rows.append([panel, e.param(a.rows), t, metric, mean, lo, hi, len(d), ts.n, e.finished])
                    else:
                        v, p = ts.mean(metric), len(ts.ids)
                        full = max(len(x.tasks[t].ids) for x in entries if t in x.tasks)
                        row.append(_fmt(metric, v) + (f" (n={p})" if p < full else ""))
                        csv_rows.append([panel, e.param(a.rows), t, metric, v, None, None, p, ts.n, e.finished])
                for label, held in averages:
                    if a.delta:
                        ds = [diffs[t] for t in held if t in diffs]
                        if not ds:
                            row.append("—")
                            continue
                        mean, lo, hi = bootstrap_ci(ds)
                        row.append(_ci_cell(metric, mean, lo, hi) + ("" if len(ds) == len(held) else f" ({len(ds)})"))
                        csv_rows.append([panel, e.param(a.rows), label, metric, mean, lo, hi, None, None, e.finished])
                    else:
                        v, k = heldout_mean(e, held, metric)
                        row.append(_fmt(metric, v) + ("" if k in (0, len(held)) else f" ({k} tasks)"))
                        csv_rows.append([panel, e.param(a.rows), label, metric, v, None, None, None, None, e.finished])
                rows.append(row)
            what = f"change vs base in {metric}" if a.delta else metric
            title = f"**{what}**" + (f", {a.panels} = {panel}" if panel is not None else "")
            parts += [title, md_table(header, rows, right=range(1, len(header)))]
    notes = [
        "Rates in percent (entropy in nats). Column heads: problems × samples per problem. A cell resting on fewer "
        "problems says so (n=...); * = its eval has not finished.",
        _averages_note(averages),
    ]
    if a.delta:
        notes.append(
            "Change vs the same model before training, paired over problems; [95% bootstrap interval over problems, "
            f"{BOOTSTRAP} resamples; stratified by task for the average]; † = the interval excludes 0."
        )
    header = ["panel", "row", "task", "metric", "value", "ci_low", "ci_high", "problems", "samples", "finished"]
    csv_path = write_csv(out_dir / f"{a.name}.csv", header, csv_rows)
    body = "\n\n".join(parts + ["*" + " ".join(notes) + "*"])
    return finish(a, out_dir, f"{a.name}: {', '.join(a.metrics)}{' vs base' if a.delta else ''}", body, [csv_path])


def _paired_diffs(e: EvalEntry, base: EvalEntry, metric: str) -> dict[str, Any]:
    """Task -> per-problem differences of ``e`` from ``base`` in ``metric``, for every task both have (shown or
    only averaged)."""
    out = {}
    for t, ts in e.tasks.items():
        if t in base.tasks and metric in ts.values:
            d = paired_diff(ts, base.tasks[t], metric)
            if d is not None and len(d):
                out[t] = d
    return out


def _averages_note(averages: list[tuple[str, list[str]]]) -> str:
    """What each average column or panel averages, named task by task."""
    parts = "; ".join(f"{label} = mean over {', '.join(held) or 'no task'}" for label, held in averages)
    return f"{parts}: of those a model has the metric for (a count in brackets when it lacks some)."


def _ci_cell(metric: str, mean: float, lo: float, hi: float) -> str:
    mark = "†" if lo > 0 or hi < 0 else ""
    return f"{_fmt(metric, mean, True)}{mark} [{_fmt(metric, lo, True)}, {_fmt(metric, hi, True)}]"


def write_eval_wins(es: EvalSet, a: Any, out_dir: Path) -> Any:
    """Per metric: comparisons (model x task) where ``a`` > ``b``, those with a paired interval excluding 0,
    and how often each method is below its base model."""

    rows, csv_rows = [], []
    tasks, _ = es.tasks_of(a)
    for metric in a.metrics:
        n = wins = sig = 0
        below = {a.a: 0, a.b: 0}
        for _panel, entries in _groups(es, a):
            ea = next((e for e in entries if e.param("method") == a.a), None)
            eb = next((e for e in entries if e.param("method") == a.b), None)
            base = _base_of(entries)
            if ea is None or eb is None:
                continue
            for t in tasks:
                if t not in ea.tasks or t not in eb.tasks or metric not in ea.tasks[t].values:
                    continue
                d = paired_diff(ea.tasks[t], eb.tasks[t], metric)
                if not len(d):
                    continue
                n += 1
                mean, lo, hi = bootstrap_ci([d])
                wins += mean > 0
                sig += lo > 0
                for name, e in ((a.a, ea), (a.b, eb)):
                    if base is not None and t in base.tasks and e.tasks[t].mean(metric) < base.tasks[t].mean(metric):
                        below[name] += 1
        rows.append([metric, f"{wins} of {n}", f"{sig} of {n}", f"{below[a.a]} of {n}", f"{below[a.b]} of {n}"])
        csv_rows.append([metric, n, wins, sig, below[a.a], below[a.b]])
    header = ["metric", f"{a.a} > {a.b}", f"{a.a} > {a.b} (95% CI > 0)", f"{a.a} < base", f"{a.b} < base"]
    csv_path = write_csv(
        out_dir / f"{a.name}.csv",
        ["metric", "comparisons", "wins", "significant_wins", "a_below_base", "b_below_base"],
        csv_rows,
    )
    body = md_table(header, rows) + (
        "\n\n*One comparison = one (model, task) pair, every task of the suite; wins by the point estimate, and with "
        "a paired bootstrap interval over problems that excludes 0. '< base': below the same model before training, "
        "each metric on its own.*"
    )
    files = [csv_path]
    if a.below_base_on:
        joint_md, joint_csv = _below_base_jointly(es, a, tasks, out_dir)
        body += "\n\n" + joint_md
        files.append(joint_csv)
    return finish(a, out_dir, f"{a.name}: {a.a} vs {a.b}", body, files)


def _below_base_jointly(es: EvalSet, a: Any, tasks: list[str], out_dir: Path) -> tuple[str, Path]:
    """The paper's joint rule: the (model, task) cells where a method is below the same model before training on
    every ``a.below_base_on`` metric at once (a tie is not below). Markdown listing the cells, and a CSV."""
    ms = list(a.below_base_on)
    found: dict[str, list[str]] = {a.a: [], a.b: []}
    compared = {a.a: 0, a.b: 0}
    csv_rows = []
    for panel, entries in _groups(es, a):
        base = _base_of(entries)
        for name in (a.a, a.b):
            e = next((x for x in entries if x.param("method") == name), None)
            if base is None or e is None:
                continue
            for t in tasks:
                have = t in e.tasks and t in base.tasks
                if not have or any(m not in e.tasks[t].values or m not in base.tasks[t].values for m in ms):
                    continue
                values = [(e.tasks[t].mean(m), base.tasks[t].mean(m)) for m in ms]
                below = all(v < b for v, b in values)
                compared[name] += 1
                if below:
                    found[name].append(f"{panel}/{t}" if panel is not None else t)
                csv_rows.append([name, panel, t, below, *(x for pair in values for x in pair)])
    both = " and ".join(ms)
    rows = [[name, f"{len(found[name])} of {compared[name]}", ", ".join(found[name]) or "—"] for name in found]
    md = f"**Below the base model on {both} at once** (the paper's rule)\n\n" + md_table(
        ["method", "(model, task) cells below", "which"], rows
    )
    header = ["method", "model", "task", "below", *(f"{x}_{m}" for m in ms for x in ("value", "base"))]
    return md, write_csv(out_dir / f"{a.name}_below_base.csv", header, csv_rows)


# ----------------------------------------------------------------------------- figures

MARKERS = "osD^vP*X"


def _figure(n: int) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(3, max(1, n))
    nrows = -(-max(1, n) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, 3.9 * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _save(fig: Any, axes: list[Any], title: str, png: Path) -> Path:
    """One legend for every panel (taken from the first) under them, the title, and the PNG."""
    import matplotlib.pyplot as plt

    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06 + 0.03 * (len(labels) // 4), 1, 1))
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _styles(es: EvalSet) -> tuple[dict[Any, str], dict[Any, str]]:
    """A colour per method and a marker per model, in the sweep's order."""
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    methods = list(dict.fromkeys(e.param("method") for e in es.entries))
    models = list(dict.fromkeys(e.param("model.name") for e in es.entries))
    return (
        {m: ("black" if m == "Base" else colors[i % len(colors)]) for i, m in enumerate(methods)},
        {m: MARKERS[i % len(MARKERS)] for i, m in enumerate(models)},
    )


def write_pareto(es: EvalSet, a: Any, out_dir: Path) -> Any:
    """Figure 3: x = Pass@1, y = Pass@K, one point per (method, model), per task and per average."""

    tasks, averages = es.tasks_of(a)
    held_of = dict(averages)
    panels = [*tasks, *held_of]
    fig, axes = _figure(len(panels))
    color, marker = _styles(es)
    for ax, t in zip(axes, panels):
        for e in es.entries:
            if t in held_of:
                (x, _), (y, _) = heldout_mean(e, held_of[t], a.x), heldout_mean(e, held_of[t], a.y)
            else:
                ts = e.tasks.get(t)
                x, y = (ts.mean(a.x), ts.mean(a.y)) if ts else (None, None)
            if x is None or y is None:
                continue
            base = e.param("method") == "Base"  # hollow and larger: visible under a method at the same spot
            ax.scatter(
                100 * x,
                100 * y,
                facecolor="none" if base else color[e.param("method")],
                edgecolor=color[e.param("method")] if base else "white",
                marker=marker[e.param("model.name")],
                s=90 if base else 42,
                linewidth=1.2 if base else 0.6,
                zorder=3,
                label=f"{e.param('method')} · {e.param('model.name')}",
            )
        ax.set(title=t + (" (train)" if t == es.train_task else ""), xlabel=f"{a.x} (%)", ylabel=f"{a.y} (%)")
        ax.grid(alpha=0.3)
    png = _save(fig, axes, f"{a.name}: {a.x} vs {a.y} (up and right is better)", out_dir / f"{a.name}.png")
    body = f"![{a.name}]({png.name})\n\n*Colour = method, marker = model. {_averages_note(averages)}*"
    return finish(a, out_dir, f"{a.name}: {a.x} vs {a.y}", body, [png])


def write_passk(es: EvalSet, a: Any, out_dir: Path) -> Any:
    """Pass@K for K = 1..n per task: one line per (method, model), markers at every K."""

    tasks, _ = es.tasks_of(a)
    fig, axes = _figure(len(tasks))
    color, marker = _styles(es)
    styles = dict(zip(dict.fromkeys(e.param("model.name") for e in es.entries), ["-", "--", ":", "-."] * 4))
    rows = []
    for ax, t in zip(axes, tasks):
        for e in es.entries:
            ts = e.tasks.get(t)
            if ts is None:
                continue
            prof = passk_profile(ts)
            ks = list(range(1, len(prof) + 1))
            rows += [[e.param("model.name"), e.param("method"), t, k, v, len(ts.ids)] for k, v in zip(ks, prof)]
            ax.plot(
                ks,
                [100 * v for v in prof],
                color=color[e.param("method")],
                ls=styles[e.param("model.name")],
                marker=marker[e.param("model.name")],
                ms=3,
                lw=1.4,
                label=f"{e.param('method')} · {e.param('model.name')}",
            )
        ax.set_xscale("log", base=2)
        ax.set(title=t + (" (train)" if t == es.train_task else ""), xlabel="K", ylabel="Pass@K (%)")
        ax.grid(alpha=0.3)
    png = _save(fig, axes, f"{a.name}: unbiased Pass@K profiles", out_dir / f"{a.name}.png")
    csv_path = write_csv(out_dir / f"{a.name}.csv", ["model", "method", "task", "k", "pass_at_k", "problems"], rows)
    body = f"![{a.name}]({png.name})\n\n*Unbiased Pass@K (Chen et al. 2021) averaged over problems, K = 1..n.*"
    return finish(a, out_dir, f"{a.name}: Pass@K profiles", body, [png, csv_path])


def threshold_rows(es: EvalSet, a: Any) -> tuple[list[dict[str, Any]], list[tuple[ThresholdPoint, str]]]:
    """(the curve's points, one dict each, by run then tau; the threshold evals without a point, and why)."""
    task = a.task or es.threshold_task
    keep = [p for p in es.threshold if all(p.point.get(k) in vals for k, vals in a.select.items())]
    rows, missing = [], []
    for p in sorted(keep, key=lambda p: p.tau):
        ts = p.tasks.get(task)
        why = p.why
        if ts is None or a.y not in ts.values:
            why = why or ("no samples of " + task + " yet" if p.s_tau is not None else "not evaluated yet")
        if why:
            missing.append((p, why))
            continue
        mean, lo, hi = bootstrap_ci([ts.values[a.y]])
        rows.append(
            {
                "run": p.label,
                "method": p.point.get("method"),
                "model": p.point.get("model.name"),
                "run_key": p.run,
                "eval_key": p.key,
                "tau": p.tau,
                "s_tau": p.s_tau,
                "task": task,
                "metric": a.y,
                "value": mean,
                "ci_low": lo,
                "ci_high": hi,
                "problems": len(ts.ids),
                "samples": ts.n,
                "finished": p.finished,
            }
        )
    order = list(dict.fromkeys(p.label for p in keep))
    rows.sort(key=lambda r: (order.index(r["run"]), r["tau"]))
    return rows, missing


def write_threshold_curve(es: EvalSet, a: Any, out_dir: Path) -> Any:
    """Figure 4: x = update sparsity s_tau (% of the nonzero updates zeroed), y = target-task Pass@1 (%) with its
    95% bootstrap interval over problems; one line per run, a marker per tau (tau 0 = the final model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, missing = threshold_rows(es, a)
    task = a.task or es.threshold_task
    header = list(rows[0]) if rows else ["run", "method", "model", "run_key", "eval_key", "tau", "s_tau", "task"]
    csv_path = write_csv(out_dir / f"{a.name}.csv", header, [list(r.values()) for r in rows])
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(dict.fromkeys(r["run"] for r in rows)):
        mine = [r for r in rows if r["run"] == run]
        x = [100 * r["s_tau"] for r in mine]
        y = [100 * r["value"] for r in mine]
        err = [[100 * (r["value"] - r["ci_low"]) for r in mine], [100 * (r["ci_high"] - r["value"]) for r in mine]]
        color = colors[i % len(colors)]
        ax.errorbar(x, y, yerr=err, color=color, marker=MARKERS[i % len(MARKERS)], ms=5, lw=1.4, capsize=3, label=run)
        for r, xi, yi in zip(mine, x, y):
            ax.annotate(f"{r['tau']:g}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
    if not rows:
        ax.text(0.5, 0.5, "no finished threshold evals yet", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="update sparsity s_tau (% of nonzero updates zeroed)", ylabel=f"{a.y} (%), {task}")
    ax.set_title(f"{a.name}: {task} {a.y} vs update sparsity (labels: tau)", fontsize=10)
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = out_dir / f"{a.name}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)

    md_rows = [
        [
            r["run"] + ("" if r["finished"] else " *"),
            f"{r['tau']:g}",
            f"{100 * r['s_tau']:.4f}",
            f"{_fmt(a.y, r['value'])} [{_fmt(a.y, r['ci_low'])}, {_fmt(a.y, r['ci_high'])}]",
            f"{r['problems']}×{r['samples']}",
        ]
        for r in rows
    ]
    parts = [
        f"![{a.name}]({png.name})",
        md_table(["run", "tau", "s_tau (%)", f"{task} {a.y} (%) [95% CI]", "problems × samples"], md_rows, [1, 2, 3]),
        f"*tau 0: the run's final model. s_tau: share of the run's nonzero updates (|delta| > 0) with |delta| <= tau, "
        f"set to 0 in the checkpoint. {a.y} in percent with a 95% percentile bootstrap interval over problems "
        f"({BOOTSTRAP} resamples); * = its eval has not finished.*",
    ]
    if missing:
        parts.append("Not drawn:\n" + "\n".join(f"- {p.label}, tau {p.tau:g} (`{p.key}`): {w}" for p, w in missing))
    return finish(a, out_dir, f"{a.name}: {task} {a.y} vs update sparsity", "\n\n".join(parts), [png, csv_path])


WRITERS = {
    "eval_table": write_eval_table,
    "eval_wins": write_eval_wins,
    "pareto": write_pareto,
    "passk": write_passk,
    "threshold_curve": write_threshold_curve,
}


def default_eval_analyses(es: EvalSet) -> list[Any]:
    """What a sweep with evaluations but no ``aggregate:`` list gets: the paper's RQ1 tables and figures for the
    K values the evals have."""
    curve = [{"kind": "threshold_curve", "name": "threshold_curve"}] if es.threshold else []
    ks = sorted({int(m[5:]) for e in es.entries for t in e.tasks.values() for m in t.values if m.startswith("pass@")})
    if not ks:  # no eval has samples yet (or a sweep with a threshold phase only): no table to fill
        return parse_specs(curve)
    passk = [f"pass@{k}" for k in ks]
    majk = [f"maj@{k}" for k in ks if k > 1]
    methods = {e.param("method") for e in es.entries}
    specs: list[dict[str, Any]] = [{"kind": "eval_table", "name": "passk_table", "metrics": passk}]
    if majk:
        specs.append({"kind": "eval_table", "name": "majk_table", "metrics": majk})
    if "Base" in methods and len(methods) > 1:
        specs.append({"kind": "eval_table", "name": "change_vs_base", "metrics": passk, "delta": True})
    if {"ES", "GRPO"} <= methods:
        specs.append({"kind": "eval_wins", "name": "es_vs_grpo", "metrics": passk})
    if len(ks) > 1:
        specs.append({"kind": "pareto", "name": "pareto", "y": passk[-1]})
    specs.append({"kind": "passk", "name": "passk_profiles"})
    return parse_specs(specs + curve)
