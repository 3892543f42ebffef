"""Training never waits on tracking (issue 44 D1, D2), against a real sqlite MLflow store held by another process.

Every outage is made by construction, never by timing: the run waits at a gate inside update 1 (tests/gate.py)
while a second process takes the store (sqlite's BEGIN EXCLUSIVE, or the file lock esbatch's writers share); the
store is given back only once the run's log.jsonl shows the updates it trained meanwhile, or once the run has ended.
Afterwards every metric (key, step) of log.jsonl is in MLflow exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from gate import Gate
from mlflow.tracking import MlflowClient
from toy import ROOT, examples_before, toy_config

from esbatch.tracking.pending import drain
from esbatch.tracking.spool import spool_path
from esbatch.train.watchdog import EXIT_HUNG

UPDATES = 10
DURING = 5  # updates the run must train while the store is held
SAFETY_S = 300  # fails a test whose run never gets there; nothing waits for it to pass

HOLD = """
import fcntl, sqlite3, sys
db = sys.argv[2]
if sys.argv[1] == "exclusive":  # what another MLflow client mid-write does
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("BEGIN EXCLUSIVE")
else:  # the file lock esbatch's writers take around each store call (a writer stuck on NFS)
    f = open(db + ".lock", "a")
    fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
if sys.argv[1] == "exclusive":
    con.execute("COMMIT")
print("released", flush=True)
"""


class Holder:
    """A process holding the store until ``release``."""

    def __init__(self, how: str, db: Path) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", HOLD, how, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.p.stdout.readline() == "held\n"

    def release(self) -> None:
        self.p.stdin.write("\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline() == "released\n"
        self.p.wait(30)


def write(tmp: Path, model_dir: Path, gate: Gate, **run) -> tuple[Path, Path]:
    cfg = toy_config(model_dir, heldout=0, es_updates=UPDATES, eval={"every": 0}, checkpoint={"every": 5})
    cfg["task"] = {**cfg["task"], "name": "toy:GatedDigitTask"}
    cfg["task"]["params"] = {"size": 48, "gate": gate.path, "after_examples": examples_before(cfg, 1)}
    cfg["run"] = {**cfg["run"], "name": "r", "output_dir": str(tmp / "runs"), **run}
    path = tmp / "r.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, tmp / "runs" / "r"


def start(cfg: Path, **env: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1", **env}
    cmd = [sys.executable, "-m", "esbatch", "train", str(cfg), "--no-progress"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def updates(run_dir: Path) -> int:
    log = run_dir / "log.jsonl"
    return log.read_text().count("\n") if log.exists() else 0


def each_metric_once(run_dir: Path) -> str:
    """Every (key, step) of the run folder's log in its MLflow run, once; returns the run's MLflow status."""
    meta = json.loads((run_dir / "run.json").read_text())
    client = MlflowClient(meta["tracking_uri"])
    recs = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    keys = {k for r in recs for k, v in r["metrics"].items() if isinstance(v, (int, float))}
    assert "reward/mean" in keys
    for key in keys:
        steps = [m.step for m in client.get_metric_history(meta["mlflow_run_id"], key)]
        want = [r["t"] + 1 for r in recs if isinstance(r["metrics"].get(key), (int, float))]
        assert sorted(steps) == want, (key, steps)
    return client.get_run(meta["mlflow_run_id"]).info.status


def test_training_goes_on_while_another_process_holds_the_store_locked(tmp_path, tiny_model_dir):
    gate = Gate(limit_s=SAFETY_S)
    cfg, run_dir = write(tmp_path, tiny_model_dir, gate)
    p = start(cfg, ESBATCH_TRACKING_END_WAIT_S="2")
    arrival = gate.next()  # the run is inside update 1: its MLflow run is open
    assert arrival is not None
    holder = Holder("exclusive", tmp_path / "runs" / "mlflow.db")
    before = updates(run_dir)
    arrival.release()
    gate.close()
    _, err = p.communicate(timeout=SAFETY_S)  # the lock is held until the run has ended: every later update under it
    assert holder.p.poll() is None  # the lock was held the whole time
    holder.release()
    assert p.returncode == 0, err[-3000:]
    assert updates(run_dir) == UPDATES and UPDATES - before >= DURING, before
    # a run that waited for the store would print MLflow's traceback at each try (4-10 per outage before issue 44)
    assert "Traceback" not in err and err.count("is unavailable") <= 1, err[-3000:]
    drain(run_dir)  # what the end (2 s for the store) left in the spool
    assert each_metric_once(run_dir) == "FINISHED"
    assert not spool_path(run_dir).exists() or spool_path(run_dir).stat().st_size == 0


def test_a_store_that_never_answers_does_not_stop_a_run_with_a_short_hang_timeout(tmp_path, tiny_model_dir):
    """The store's file lock is held from update 1 until the run has ended: each tracking write would wait for
    ever. With run.hang_timeout_s = 5 and an end that waits 8 s for the store, the run trains to the end, leaves
    its writes in the spool and says so; `esbatch aggregate`'s drain then sends each once."""
    gate = Gate(limit_s=SAFETY_S)
    cfg, run_dir = write(tmp_path, tiny_model_dir, gate, hang_timeout_s=5)
    p = start(cfg, ESBATCH_TRACKING_END_WAIT_S="8")
    arrival = gate.next()
    assert arrival is not None
    holder = Holder("flock", tmp_path / "runs" / "mlflow.db")
    arrival.release()
    gate.close()
    _, err = p.communicate(timeout=SAFETY_S)
    assert holder.p.poll() is None
    holder.release()
    assert p.returncode == 0, err[-3000:]
    assert "esbatch: hung" not in err and "Traceback" not in err
    assert "were not sent to" in err and "`esbatch aggregate` (or a resume) sends them" in err
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "finished" and updates(run_dir) == UPDATES
    spooled = [json.loads(line) for line in spool_path(run_dir).read_text().splitlines()]
    assert spooled[-1]["status"] == "FINISHED"
    assert drain(run_dir) > 0
    assert each_metric_once(run_dir) == "FINISHED"


def test_a_scorer_that_never_returns_ends_the_run_failed_in_run_json_and_mlflow(tmp_path, tiny_model_dir):
    marker = tmp_path / "hang"
    marker.touch()
    cfg = toy_config(tiny_model_dir, heldout=0, es_updates=UPDATES, eval={"every": 0}, checkpoint={"every": 1})
    cfg["task"] = {**cfg["task"], "name": "toy:HangingDigitTask"}
    cfg["task"]["params"] = {"size": 16, "marker": str(marker), "hang_after": 16}  # in update 1
    cfg["run"] = {**cfg["run"], "name": "r", "output_dir": str(tmp_path / "runs"), "hang_timeout_s": 5}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = start(path)
    _, err = p.communicate(timeout=SAFETY_S)
    run_dir = tmp_path / "runs" / "r"
    assert p.returncode == EXIT_HUNG and not marker.exists(), err[-3000:]
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "failed", meta
    assert meta["reason"].startswith("hung: update 1 (generation, scoring") and "hang_timeout_s = 5 s" in meta["reason"]
    client = MlflowClient(meta["tracking_uri"])
    if client.get_run(meta["mlflow_run_id"]).info.status != "FAILED":  # the store was slow: the spool says so
        assert json.loads(spool_path(run_dir).read_text().splitlines()[-1])["status"] == "FAILED"
        drain(run_dir)
    assert each_metric_once(run_dir) == "FAILED"
