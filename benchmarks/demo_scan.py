"""Demonstration scan: does ES raise SmolLM2's held-out accuracy on 2-shot addition, and at which sigma/alpha?

Runs the built-in quickstart config for several (sigma, alpha, generation_seeds) settings through the real
CLI, then prints held-out greedy accuracy and population reward before/after and writes a plot.

    python benchmarks/demo_scan.py --updates 20 --parallel 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from esbatch.aggregate.plots import plot_runs  # noqa: E402
from esbatch.train.rundir import RunDir  # noqa: E402

DEFAULT_SETTINGS = [
    "0.01,0.005,independent",
    "0.01,0.005,population",
    "0.003,0.0015,independent",
    "0.01,0.01,independent",
]


def run_one(setting: str, args: argparse.Namespace) -> tuple[str, float, int]:
    sigma, alpha, seeds = setting.split(",")
    name = f"scan-s{sigma}-a{alpha}-{seeds}"
    cmd = [
        sys.executable,
        "-m",
        "esbatch",
        "train",
        args.config,
        "--no-progress",
        "--set",
        f"run.name={name}",
        "--set",
        f"run.output_dir={args.out}",
        "--set",
        f"es.sigma={sigma}",
        "--set",
        f"es.alpha={alpha}",
        "--set",
        f"es.generation_seeds={seeds}",
        "--set",
        f"es.updates={args.updates}",
        "--set",
        f"run.threads={args.threads}",
        "--set",
        f"eval.every={args.eval_every}",
    ]
    if (Path(args.out) / name / "config.yaml").exists():
        cmd = [sys.executable, "-m", "esbatch", "train", "--no-progress", "--resume", str(Path(args.out) / name)]
    t0 = time.time()
    with open(Path(args.out) / f"{name}.log", "a") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    return name, time.time() - t0, rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="quickstart")
    ap.add_argument("--settings", nargs="*", default=DEFAULT_SETTINGS, help="sigma,alpha,generation_seeds")
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/demo_scan")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda s: run_one(s, args), args.settings))
    rows = []
    print(f"{'run':44s} {'acc@0':>6s} {'acc@end':>7s} {'acc max':>7s} {'R first3':>8s} {'R last3':>8s} {'wall s':>7s}")
    for name, wall, rc in results:
        rd = RunDir(Path(args.out) / name)
        ev = sorted(rd.evals(), key=lambda e: e["t"])
        ups = rd.updates()
        if rc != 0 or not ev:
            print(f"{name:44s} FAILED (rc={rc}); see {args.out}/{name}.log")
            continue
        r = [u["metrics"]["reward/mean"] for u in ups]
        row = dict(
            run=name,
            acc0=ev[0]["heldout/accuracy"],
            acc_end=ev[-1]["heldout/accuracy"],
            acc_max=max(e["heldout/accuracy"] for e in ev),
            r_first3=sum(r[:3]) / 3,
            r_last3=sum(r[-3:]) / 3,
            wall_s=wall,
            curve=[(e["t"], e["heldout/accuracy"]) for e in ev],
        )
        rows.append(row)
        print(
            f"{name:44s} {row['acc0']:6.3f} {row['acc_end']:7.3f} {row['acc_max']:7.3f} {row['r_first3']:8.3f} "
            f"{row['r_last3']:8.3f} {wall:7.0f}"
        )
    (Path(args.out) / "summary.json").write_text(json.dumps(rows, indent=2))
    png = plot_runs(
        [Path(args.out) / n for n, _, rc in results if rc == 0],
        Path(args.out) / "demo_scan.png",
        title="ES on SmolLM2-135M-Instruct, 2-shot 2-digit addition (N=8, B=16, fp32)",
    )
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
