"""`esbatch analyze diversity RUN...`: population diversity over training (paper Section 3.1), from log.jsonl.

Each update record may carry ``diversity: {"p": [[...]], "samples": m}``, the success share p_i(x) of member i
on prompt x: ES runs write it on every ``es.diversity.every``-th update (N members, m responses each), GRPO runs
on every generated batch (one policy, its G responses; esbatch/grpo/trainer.py). The figures are recomputed
from p (and the ES weights z) with esbatch/metrics.py:diversity_metrics, the code the trainers log with, so
older or hand-edited metrics never leak in. Written to ``out`` (default ``<first RUN>/analysis/diversity/``):

    diversity.csv   one row per (run, update with a record): run, algorithm, t, members, prompts, samples, and
                    js, h_members, p_mean, pass_population, pass_matched, cov_weight, cov_weight_loo with its
                    95% bootstrap interval over members (cov_loo_low, cov_loo_high) (GRPO: js is 0, pass_* and
                    cov_* are empty: one policy, no update weights; cov_*_loo empty for records without the
                    reward responses' verdicts, ``first``, or with one sample)
    diversity.md    per run: the updates with a record, and each figure's first, last and mean value; the mean
                    cov_weight_loo with a bootstrap interval resampling each record's members
    diversity.png   js, p_mean, h_members and cov_weight_loo against the update, all runs overlaid (ES solid,
                    GRPO dashed: its js is 0 by definition, a single policy)

A pipeline folder (``stage<k>-<algo>/`` subfolders, no log of its own) contributes its stages one after the
other on one update axis, each labelled ``<run>/<stage>``. Nothing in the run folders is changed.
"""

from __future__ import annotations

import csv
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from esbatch import durable
from esbatch.metrics import diversity_metrics, leave_one_out, weight_covariance
from esbatch.train.rundir import RunDir

FIGURES = ("js", "h_members", "p_mean", "pass_population", "pass_matched", "cov_weight", "cov_weight_loo")
COLUMNS = ("run", "algorithm", "t", "members", "prompts", "samples", *FIGURES, "cov_loo_low", "cov_loo_high")
RESAMPLES = 2000  # bootstrap resamples of the members (seed 0)
PANELS = (
    ("js", "verifier-projected JS diversity (nats)"),
    ("p_mean", "mean success share pbar"),
    ("h_members", "member entropy mean_i H(p_i(x)) (nats)"),
    ("cov_weight_loo", "Cov_i(z_i, p_i(x)), reward response left out (ES)"),
)
_STAGE = re.compile(r"^stage(\d+)-(\w+)$")


class DiversityInputError(ValueError):
    """A RUN that is not a run folder, holds no diversity records, or holds one that does not add up."""


@dataclass
class Series:
    """The diversity rows of one run (or pipeline stage), in update order."""

    label: str
    algorithm: str
    rows: list[dict[str, Any]] = field(default_factory=list)


def _algorithm(rd: RunDir) -> str:
    algo = rd.read_meta().get("algorithm")
    if not algo and rd.config.exists():
        cfg = yaml.safe_load(rd.config.read_text()) or {}
        algo = cfg.get("algorithm") if isinstance(cfg, dict) else None
    return str(algo or "es")


def _rows(rd: RunDir, label: str, algorithm: str, offset: int) -> list[dict[str, Any]]:
    """One row per record with a ``diversity`` field; a malformed one is named by file and update."""
    rows = []
    for rec in rd.updates():
        div = rec.get("diversity")
        if div is None:
            continue
        where = f"{rd.log}: the diversity record of update {rec['t']}"
        if not isinstance(div, dict) or "p" not in div:
            raise DiversityInputError(f"{where} is not a mapping with a `p` table ({str(div)[:80]})")
        single = algorithm == "grpo"  # one policy: no weights, and pass_* would just repeat p_mean
        z = None if single else rec.get("z")
        first, m = div.get("first"), div.get("samples") or 1
        try:
            figs = diversity_metrics(div["p"], z, first, m)
            loo = leave_one_out(div["p"], first, m) if "cov_weight_loo" in figs else None
        except ValueError as e:
            raise DiversityInputError(
                f"{where} does not add up: {e}. p must be [members][prompts] shares in [0, 1], and z (ES) one weight "
                "per member; the file may be damaged or written by another tool"
            ) from None
        p = div["p"]
        rows.append(
            {
                "run": label,
                "algorithm": algorithm,
                "t": offset + rec["t"],
                "members": len(p),
                "prompts": len(p[0]),
                "samples": div.get("samples", ""),
                **{k: "" if single and k.startswith("pass_") else figs.get(k, "") for k in FIGURES},
                **dict(zip(("cov_loo_low", "cov_loo_high"), member_interval([(z, loo)]) if loo is not None else "")),
                "_loo": (z, loo),  # for the run's pooled interval (not a column)
            }
        )
    return rows


def member_interval(records: list[tuple[Any, Any]], resamples: int = RESAMPLES) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean over ``records`` of Cov_i(z_i, p_i(x)) (each record a pair
    (z [N], leave-one-out p [N][B])), resampling every record's members with replacement, independently (seed 0).
    The members are the population's random draw; the prompts of a record stay fixed."""
    import numpy as np

    rng = np.random.default_rng(0)
    pairs = [(np.asarray(z, dtype=np.float64), np.asarray(p, dtype=np.float64)) for z, p in records]
    stats = np.empty(resamples)
    for b in range(resamples):
        covs = []
        for z, p in pairs:
            pick = rng.integers(0, len(z), len(z))
            covs.append(weight_covariance(z[pick], p[pick]))
        stats[b] = np.mean(covs)
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi)


def load_series(run: str | Path) -> list[Series]:
    """The series of one RUN: its own log, or a pipeline's stages in order on one update axis."""
    rd = RunDir(run)
    if not rd.path.is_dir() or not rd.exists():
        raise DiversityInputError(
            f"{run}: not a run folder (no {RunDir.CONFIG}); give the folders `esbatch train` wrote "
            "(<output_dir>/<run.name>), e.g. esbatch-runs/quickstart"
        )
    stages = sorted(
        (int(m.group(1)), m.group(2), p) for p in rd.path.iterdir() if p.is_dir() and (m := _STAGE.match(p.name))
    )
    if rd.log.exists() or not stages:
        return [Series(rd.path.name, _algorithm(rd), _rows(rd, rd.path.name, _algorithm(rd), 0))]
    out, offset = [], 0
    for _, algo, path in stages:
        srd = RunDir(path)
        label = f"{rd.path.name}/{path.name}"
        out.append(Series(label, algo, _rows(srd, label, algo, offset)))
        offset += len(srd.updates())
    return out


NO_RECORD = (
    "ES runs write it with es.diversity.every > 0 (e.g. --set es.diversity.every=10 --set es.diversity.samples=4; "
    "it never changes training, so a run can be resumed with it); GRPO runs write it on every generated batch "
    "(esbatch versions with this analysis)"
)


def collect(runs: list[str | Path]) -> list[Series]:
    """Every run's series that carries diversity records, the others as empty series (``without``); when none
    does, an error that says how to get them."""
    if not runs:
        raise DiversityInputError("give at least one run folder")
    series = [s for r in runs for s in load_series(r)]
    labels = [s.label for s in series]
    seen: dict[str, int] = {}
    for s in series:  # two runs of the same name from different sweeps: keep them apart
        if labels.count(s.label) > 1:
            seen[s.label] = seen.get(s.label, 0) + 1
            s.label = f"{s.label}#{seen[s.label]}"
            for r in s.rows:
                r["run"] = s.label
    if all(not s.rows for s in series):
        labels = ", ".join(s.label for s in series)
        raise DiversityInputError(f"no update in {labels} carries a `diversity` record. {NO_RECORD}")
    return series


def without(series: list[Series]) -> list[str]:
    """The runs (or pipeline stages) of ``series`` that carry no diversity record: left out of the tables."""
    return [s.label for s in series if not s.rows]


def write_csv(series: list[Series], path: Path) -> Path:
    with durable.open_text(path, newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for s in series:
            w.writerows(s.rows)
    return path


def _fmt(v: Any) -> str:
    return "" if v == "" else f"{v:.4f}"


def write_markdown(series: list[Series], path: Path) -> Path:
    """Per run: updates with a record, population shape, and first / last / mean of each figure."""
    lines = [
        "# Population diversity (paper Section 3.1)",
        "",
        "js: verifier-projected Jensen-Shannon diversity of the population, mean over the update's prompts (nats, "
        "at most ln 2 = 0.6931; 0 for a single policy). p_mean: mean success share. h_members: mean member "
        "Bernoulli entropy. pass_population / pass_matched: one sample per member vs N samples from one policy of "
        "the same mean success; pass_population >= pass_matched for any numbers (arithmetic-geometric mean "
        "inequality), so their gap shows only how unequal the members are, not that diversity helps. cov_weight: "
        "Cov_i(z_i, p_i(x)) of the ES update weights (Lemma 3), biased upward: z_i and p_i(x) share the reward's "
        "response. cov_weight_loo: the same with that response left out of p_i(x) (unbiased), mean [95% bootstrap "
        f"interval over members, {RESAMPLES} resamples]: an interval above 0 is evidence that the update weights "
        "favour members that succeed more. Definitions: docs/diagnostics.md. Values: first -> last (mean).",
        "",
        "| run | algorithm | records | members x prompts x samples | " + " | ".join(FIGURES) + " |",
        "|---|---|---|---|" + "---|" * len(FIGURES),
    ]
    for s in (s for s in series if s.rows):
        r0, r1 = s.rows[0], s.rows[-1]
        cells = []
        for k in FIGURES:
            vals = [r[k] for r in s.rows if r[k] != ""]
            cell = f"{_fmt(r0[k])} -> {_fmt(r1[k])} ({sum(vals) / len(vals):.4f}" if vals else "-"
            if vals and k == "cov_weight_loo":
                lo, hi = member_interval([r["_loo"] for r in s.rows if r[k] != ""])
                cell += f" [{lo:.4f}, {hi:.4f}]"
            cells.append(cell + (")" if vals else ""))
        shape = f"{r1['members']} x {r1['prompts']} x {r1['samples']}"
        lines.append(
            f"| {s.label} | {s.algorithm} | {len(s.rows)} (t {r0['t']}..{r1['t']}) | {shape} | "
            + " | ".join(cells)
            + " |"
        )
    if missing := without(series):
        lines += ["", f"Left out, no update carries a `diversity` record: {', '.join(missing)}. {NO_RECORD}."]
    durable.write_text(path, "\n".join(lines) + "\n")
    return path


def plot(series: list[Series], path: Path) -> Path:
    """Four panels against the update, every series overlaid: ES solid, GRPO dashed."""
    import matplotlib.pyplot as plt

    fig = figure(series)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(series: list[Series]) -> Any:
    """The matplotlib figure of ``plot`` (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for s in series:
            pts = [(r["t"], r[key]) for r in s.rows if r[key] != ""]
            if pts:
                style = "--" if s.algorithm == "grpo" else "-"
                ax.plot(*zip(*pts), style, marker="o", ms=3, label=f"{s.label} ({s.algorithm})")
        ax.set(xlabel="update t (population of the center after t updates)", title=title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # updates are whole numbers, in every panel
        ax.grid(alpha=0.3)
    axes.flat[0].axhline(0.6931, color="grey", lw=0.6, ls=":")  # ln 2, the maximum
    axes.flat[3].axhline(0.0, color="grey", lw=0.6)
    handles, labels = axes.flat[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)) or 1, fontsize=8)
    fig.suptitle("Population diversity over training (paper Section 3.1)")
    fig.tight_layout(rect=(0, 0.06 + 0.025 * ((len(labels) - 1) // 3), 1, 1))
    return fig


def analyze(runs: list[str | Path], out: str | Path | None = None) -> dict[str, Path]:
    """Tables and the figure of ``runs`` into ``out`` (default <first run>/analysis/diversity); returns the files."""
    series = collect(runs)
    if missing := without(series):
        print(f"warning: left out, no diversity record: {', '.join(missing)} (see diversity.md)", file=sys.stderr)
    folder = Path(out) if out is not None else Path(runs[0]) / "analysis" / "diversity"
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "csv": write_csv(series, folder / "diversity.csv"),
        "markdown": write_markdown(series, folder / "diversity.md"),
        "png": plot(series, folder / "diversity.png"),
    }
