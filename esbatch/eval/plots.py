"""Eval plots: Pass@K profiles of several models on one chart (Appendix I) and Pass@1-vs-Pass@K Pareto
fronts over a set of evaluated runs (Figure 3). Both read eval folders (their passk.csv / metrics.json)."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path


def _curves(ed: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    with open(ed / "passk.csv") as f:
        for row in csv.DictReader(f):
            out[row["task"]].append(float(row["pass_at_k"]))
    return dict(out)


def plot_passk(eval_dirs: list[str | Path], out: str | Path, tasks: list[str] | None = None) -> Path:
    """One panel per task plus the task average: mean unbiased Pass@K (x100) for K = 1..n, one line per eval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {Path(d).name: _curves(Path(d)) for d in eval_dirs}
    names = tasks or sorted({t for c in data.values() for t in c})
    panels = [*names, "Average"] if len(names) > 1 else names
    ncols = min(len(panels), 3)
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    for ax, task in zip(axes.flat, panels):
        for label, curves in data.items():
            if task == "Average":
                present = [curves[t] for t in names if t in curves]
                if not present:
                    continue
                n = min(len(c) for c in present)
                ys = [sum(c[k] for c in present) / len(present) for k in range(n)]
            elif task in curves:
                ys = curves[task]
            else:
                continue
            ax.plot(range(1, len(ys) + 1), [100 * y for y in ys], marker="o", ms=2.5, label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(task)
        ax.set_xlabel("K")
        ax.set_ylabel("Pass@K (x100)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Pass@K profile (unbiased estimator)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both axes (higher is better), sorted by x."""
    keep = [
        i
        for i, (x, y) in enumerate(points)
        if not any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for x2, y2 in points)
    ]
    return sorted(keep, key=lambda i: points[i][0])


def plot_pareto(eval_dirs: list[str | Path], out: str | Path, k: int = 32, task: str = "average") -> Path:
    """Pass@1 (x) vs Pass@K (y) per eval; the non-dominated ones are joined into the Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, pts = [], []
    for d in eval_dirs:
        m = json.loads((Path(d) / "metrics.json").read_text())["tasks"]
        rows = list(m.values()) if task == "average" else [m[task]] if task in m else []
        rows = [r for r in rows if f"pass@{k}" in r]
        if not rows:
            raise ValueError(f"{d}: no pass@{k} for {task} (evaluated with n < {k}?)")
        pts.append((sum(r["pass@1"] for r in rows) / len(rows), sum(r[f"pass@{k}"] for r in rows) / len(rows)))
        labels.append(Path(d).name)
    front = pareto_front(pts)
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    ax.scatter([100 * x for x, _ in pts], [100 * y for _, y in pts], color="tab:gray", zorder=2)
    ax.plot(
        [100 * pts[i][0] for i in front],
        [100 * pts[i][1] for i in front],
        "-o",
        color="tab:red",
        label="Pareto front",
        zorder=3,
    )
    for (x, y), lab in zip(pts, labels):
        ax.annotate(lab, (100 * x, 100 * y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("Pass@1 (x100)")
    ax.set_ylabel(f"Pass@{k} (x100)")
    ax.set_title(f"Pass@1 vs Pass@{k} ({task})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)
