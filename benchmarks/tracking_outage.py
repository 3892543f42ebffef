"""Updates a tiny-model run trains while another process holds its sqlite MLflow store (BEGIN EXCLUSIVE) for
--hold-s seconds, and in the same span with nobody holding it (issue 44 D1). The lock is taken while the run waits
at a gate inside update 1 (tests/gate.py), so it covers an open MLflow run; the run is stopped (SIGTERM) after.

    .venv/bin/python benchmarks/tracking_outage.py --hold-s 60 [--no-lock] [--src DIR]

--src: the esbatch source tree to run (e.g. a `git worktree` of an older commit, for the before figure)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from gate import Gate  # noqa: E402
from toy import examples_before, make_tiny_model, toy_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold-s", type=float, default=60.0)
    ap.add_argument("--no-lock", action="store_true")
    ap.add_argument("--src", default=str(ROOT))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="esbatch-outage-"))
    model = make_tiny_model(tmp / "model")
    gate = Gate(limit_s=600)
    cfg = toy_config(model, heldout=0, es_updates=100000, eval={"every": 0}, checkpoint={"every": 1000})
    cfg["task"] = {**cfg["task"], "name": "toy:GatedDigitTask"}
    cfg["task"]["params"] = {"size": 48, "gate": gate.path, "after_examples": examples_before(cfg, 1)}
    cfg["run"] = {**cfg["run"], "name": "r", "output_dir": str(tmp / "runs")}
    (tmp / "r.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": f"{a.src}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "esbatch", "train", str(tmp / "r.yaml"), "--no-progress"]
    p = subprocess.Popen(cmd, cwd=a.src, env=env, stderr=open(tmp / "stderr.txt", "w"))
    arrival = gate.next()
    log = tmp / "runs" / "r" / "log.jsonl"
    con = None
    if not a.no_lock:
        import sqlite3

        con = sqlite3.connect(tmp / "runs" / "mlflow.db", isolation_level=None)
        con.execute("BEGIN EXCLUSIVE")
    before = log.read_text().count("\n")
    t0 = time.monotonic()
    arrival.release()
    gate.close()
    time.sleep(a.hold_s)
    during = log.read_text().count("\n") - before
    if con is not None:
        con.execute("COMMIT")
    p.send_signal(signal.SIGTERM)
    p.wait(300)
    err = (tmp / "stderr.txt").read_text()
    print(
        f"{'no lock' if a.no_lock else 'locked'} for {time.monotonic() - t0:.0f} s: {during} updates "
        f"(from {before}); stderr: {err.count('Traceback')} tracebacks, {err.count('unavailable')} 'unavailable' "
        f"lines; exit {p.returncode}; {tmp}"
    )


if __name__ == "__main__":
    main()
