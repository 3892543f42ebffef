"""Training curves of run directories: held-out greedy accuracy of the center and population reward."""

from __future__ import annotations

from pathlib import Path

from esbatch.train.rundir import RunDir


def plot_runs(run_dirs: list[str | Path], out: str | Path, title: str = "ES training") -> Path:
    """One PNG with two panels: held-out accuracy vs update, and population mean reward (+- std) vs update."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for d in run_dirs:
        rd = RunDir(d)
        label = rd.path.name
        evals = sorted((e for e in rd.evals() if "heldout/accuracy" in e), key=lambda e: e["t"])
        if evals:
            ax1.plot([e["t"] for e in evals], [e["heldout/accuracy"] for e in evals], marker="o", label=label)
        ups = rd.updates()
        if ups:
            xs = [u["t"] + 1 for u in ups]
            mean = [u["metrics"]["reward/mean"] for u in ups]
            std = [u["metrics"]["reward/std"] for u in ups]
            (line,) = ax2.plot(xs, mean, label=label)
            ax2.fill_between(
                xs,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                color=line.get_color(),
                alpha=0.15,
            )
    ax1.set(xlabel="update", ylabel="held-out greedy accuracy", title="center, held-out set")
    ax2.set(xlabel="update", ylabel="mean reward over population", title="population reward (mini-batch, +-std)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
