"""Submitting a 64-run sweep to SLURM: how many sbatch calls, how long `esbatch sweep` takes, and how many
scheduler queries `esbatch status` makes. Needs a running cluster (scripts/slurm/start-slurm.sh).

    python benchmarks/sweep_submit.py [--runs 64]

The array is submitted held and cancelled afterwards (this measures launching, not training).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=64)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="esbatch-submit-"))
    shim = tmp / "bin"
    shim.mkdir()
    for tool in ("sbatch", "sacct", "squeue", "scontrol"):
        real = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        (shim / tool).write_text(f'#!/bin/sh\necho "$@" >> {tmp}/{tool}.calls\nexec {real} "$@"\n')
        (shim / tool).chmod(0o755)
    n_pop = 4
    sweep = {
        "name": "submit-bench",
        "base": "quickstart",
        "output_dir": str(tmp / "out"),
        "grid": {"es.population_size": [4, 8, 16, 32][:n_pop]},
        "seeds": list(range(args.runs // n_pop)),
        "launcher": "slurm-local",
        # held: the tasks are queued but never start, so nothing competes with the measurement
        "launcher_overrides": {"array_parallelism": 16, "mem": "500M", "extra_sbatch": {"hold": True}},
    }
    path = tmp / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}

    def calls(tool: str) -> int:
        f = tmp / f"{tool}.calls"
        return len(f.read_text().splitlines()) if f.exists() else 0

    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "esbatch", "sweep", str(path)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        sys.exit(p.stdout + p.stderr)
    meta = json.loads((tmp / "out" / "submit-bench" / "sweep.json").read_text())
    arrays = [s for s in meta["submissions"] if s["kind"] == "slurm"]
    sb = calls("sbatch")
    sa0 = calls("sacct")
    t1 = time.perf_counter()
    st = subprocess.run(
        [sys.executable, "-m", "esbatch", "status", str(tmp / "out" / "submit-bench")], env=env, capture_output=True
    )
    status_wall = time.perf_counter() - t1
    jobs = [s["job_id"] for s in arrays] + [s["aggregate_job"] for s in arrays if s.get("aggregate_job")]
    subprocess.run(["scancel", *jobs])
    print(f"runs planned and submitted:        {sum(len(s['keys']) for s in arrays)}")
    print(f"array jobs:                        {len(arrays)}  (tasks: {[len(s['keys']) for s in arrays]})")
    print(
        f"sbatch calls:                      {sb}  (arrays {len(arrays)} + afterok aggregator job "
        f"{sum(1 for s in arrays if s.get('aggregate_job'))})"
    )
    print(f"`esbatch sweep` wall time:         {wall:.1f} s  (CLI start to return; target < 3 s)")
    print(
        f"`esbatch status` scheduler calls:  {calls('sacct') - sa0} sacct + {calls('squeue')} squeue  "
        f"for {args.runs} runs, {status_wall:.1f} s, exit {st.returncode}"
    )
    print(f"(cancelled jobs {', '.join(jobs)}; scratch folder {tmp})")
    breakdown(path, tmp)


def breakdown(path: Path, tmp: Path) -> None:
    """The same submission in-process, phase by phase, into a fresh sweep folder."""
    t = time.perf_counter()
    from esbatch.launch import slurm, submit
    from esbatch.launch.sweep import load_sweep

    phases = {"imports": time.perf_counter() - t}
    t = time.perf_counter()
    sw = load_sweep(str(path))
    sw.dir = tmp / "out2" / sw.name
    for r in sw.runs:
        r.config.run.output_dir, r.config.tracking.uri = str(sw.dir / "runs"), f"sqlite:///{sw.dir}/mlflow.db"
    phases[f"parse + validate {len(sw.runs)} run configs"] = time.perf_counter() - t
    sd = submit.SweepDir(sw.dir)
    for name, fn in (
        ("write plan files", lambda: submit.write_plan(sw)),
        ("run states (one sacct/squeue query)", lambda: submit.run_states(sd)),
        ("submit (pickles + sbatch)", lambda: slurm.submit(sw.profile, sd, "b", [r.key for r in sw.runs])),
    ):
        t = time.perf_counter()
        out = fn()
        phases[name] = time.perf_counter() - t
    slurm.SlurmLauncher(sw.profile).cancel(sd, out)
    print("in-process breakdown:")
    for k, v in phases.items():
        print(f"  {k:48s} {v:6.2f} s")


if __name__ == "__main__":
    main()
