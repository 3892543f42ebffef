"""The diagnostic's outputs: kappa.csv / kappa.md (one row per objective, coupling and sigma), observations.csv
(every pooled scalar, to recompute or re-slice the ratios) and kappa.png (kappa against sigma, log axes)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from esbatch import durable
from esbatch.diagnose.protocol import Cell

COLUMNS = (
    "objective",
    "coupling",
    "sigma",
    "n",
    "kappa_base",
    "kappa_pair",
    "corr_base",
    "corr_pair",
    "var_raw",
    "var_base",
    "var_pair",
    "mean_plus",
)


def rows(cells: list[Cell]) -> list[dict[str, object]]:
    """One dict per cell, keyed by ``COLUMNS``."""
    return [{"objective": c.objective, "coupling": c.coupling, "sigma": c.sigma, **c.stats().as_dict()} for c in cells]


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def markdown(table: list[dict[str, object]], cells: list[Cell]) -> str:
    """A Markdown table like Table 13 (lower kappa is better; below 1 = subtraction reduces raw variance)."""
    head = ["objective", "coupling", "sigma", "n", "kappa_base", "kappa_pair", "corr(J+,J0)", "corr(J+,J-)"]
    keys = ["objective", "coupling", "sigma", "n", "kappa_base", "kappa_pair", "corr_base", "corr_pair"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, c in zip(table, cells):
        vals = [c.label] + [_fmt(r[k]) for k in keys[1:]]
        lines.append("| " + " | ".join(vals) + " |")
    note = (
        "\nkappa_base = Var[J+ - J0] / Var[J+], kappa_pair = Var[J+ - J-] / Var[J+] over the pooled observations "
        "(paper App. E, Table 13); below 1 = subtraction reduces raw variance. n/a: J+ was constant.\n"
    )
    return "\n".join(lines) + "\n" + note


def write_outputs(cells: list[Cell], out: Path) -> dict[str, Path]:
    """Write the table (CSV + Markdown), the observations and the plot into ``out``; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    table = rows(cells)
    paths = {k: out / n for k, n in (("csv", "kappa.csv"), ("md", "kappa.md"), ("obs", "observations.csv"))}
    with durable.open_text(paths["csv"], newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(table)
    durable.write_text(paths["md"], markdown(table, cells))
    with durable.open_text(paths["obs"], newline="") as f:
        w = csv.writer(f)
        w.writerow(["objective", "coupling", "sigma", "item", "seed", "direction", "plus", "center", "minus"])
        for c in cells:
            for (i, s, d), p, z, m in zip(c.keys, c.plus, c.center, c.minus):
                w.writerow([c.objective, c.coupling, c.sigma, i, s, d, repr(p), repr(z), repr(m)])
    paths["png"] = plot(table, cells, out / "kappa.png")
    return paths


def plot(table: list[dict[str, object]], cells: list[Cell], path: Path) -> Path:
    """kappa_base and kappa_pair against sigma, one line per objective and coupling, log-log, with kappa = 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    series: dict[str, list[tuple[float, float, float]]] = {}
    for r, c in zip(table, cells):
        name = c.label if c.coupling in ("fixed batch", "fixed rollouts") else f"{c.label} ({c.coupling} seeds)"
        series.setdefault(name, []).append((float(r["sigma"]), float(r["kappa_base"]), float(r["kappa_pair"])))
    for ax, col, title in (
        (axes[0], 1, "kappa_base = Var[J+ - J0] / Var[J+]"),
        (axes[1], 2, "kappa_pair = Var[J+ - J-] / Var[J+]"),
    ):
        for name, pts in series.items():
            pts = sorted(p for p in pts if math.isfinite(p[col]) and p[col] > 0)  # log axes: positive values only
            if pts:
                ax.plot([p[0] for p in pts], [p[col] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sigma")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    zeros = sum(1 for r in table for k in ("kappa_base", "kappa_pair") if float(r[k]) == 0.0)
    if zeros:  # identical evaluations at the three points: exactly 0, which log axes cannot show
        fig.text(0.5, 0.01, f"{zeros} ratio(s) exactly 0 (identical evaluations) not drawn; see kappa.csv", ha="center")
    axes[0].set_ylabel("variance ratio (below 1: subtraction helps)")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle("Local subtraction diagnostic (paper App. E, Table 13)")
    fig.tight_layout(rect=(0, 0.12 if handles else 0, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
