"""The sweep folder: the plan every task reads, what was submitted, and each run's state on disk.

<sweep>/sweep.json        name, launcher, tracking, parent MLflow run, runs [{key, label, index}],
                          submissions [{job_id, keys, aggregate_job, time}]
<sweep>/plan/<key>.yaml   the resolved config of each run (what the task trains)
<sweep>/runs/<key>/       the run directory (config, log.jsonl, checkpoints; see es/checkpoint.py)
<sweep>/slurm/            submitit's scripts, pickles and task logs
<sweep>/results/          tables and plots from `esbatch aggregate`
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from esbatch.es.checkpoint import RunDir

# Scheduler states (sacct) that mean "still queued or running": such runs are never resubmitted.
ACTIVE_STATES = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "RESIZING",
    "SUSPENDED",
    "CONFIGURING",
    "COMPLETING",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SIGNALING",
    "STAGE_OUT",
}


class SweepDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta_path = self.path / "sweep.json"
        self.plan = self.path / "plan"
        self.runs = self.path / "runs"
        self.slurm = self.path / "slurm"
        self.results = self.path / "results"

    def exists(self) -> bool:
        return self.meta_path.exists()

    @contextmanager
    def locked(self) -> Iterator[dict[str, Any]]:
        """Read-modify-write sweep.json under a file lock (a task and `esbatch sweep` may write at once)."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / ".sweep.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            meta = self.read()
            yield meta
            tmp = self.meta_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, self.meta_path)

    def read(self) -> dict[str, Any]:
        return json.loads(self.meta_path.read_text()) if self.meta_path.exists() else {}

    def run_dir(self, key: str) -> RunDir:
        return RunDir(self.runs / key)

    def plan_path(self, key: str) -> Path:
        return self.plan / f"{key}.yaml"

    def last_submission(self) -> dict[str, dict[str, Any]]:
        """key -> the newest submission record that included it (job id, array index)."""
        out: dict[str, dict[str, Any]] = {}
        for sub in self.read().get("submissions", []):
            for i, k in enumerate(sub["keys"]):
                out[k] = {**sub, "array_index": i}
        return out


@dataclass
class RunState:
    key: str
    label: str
    state: str  # pending | queued | running | finished | killed | failed | interrupted
    done: int  # updates logged
    total: int | None
    last_reward: float | None
    heldout: float | None
    job: str | None = None
    scheduler: str | None = None


def disk_state(rd: RunDir, budget: int | None) -> tuple[str, int, int | None, float | None, float | None]:
    """(state, updates done, total, last mean reward, last held-out accuracy) from a run directory alone."""
    if not rd.exists():
        return "pending", 0, budget, None, None
    meta = rd.read_meta()
    ups = _tail_updates(rd)
    done = ups[0]
    evals = rd.evals()
    heldout = max(evals, key=lambda e: e["t"])["heldout/accuracy"] if evals else None
    total = budget or meta.get("total_updates")
    status = meta.get("status", "running")
    if status == "finished" and total is not None and done < total:
        status = "interrupted"  # finished under a smaller budget: continue it
    return status, done, total, ups[1], heldout


def _tail_updates(rd: RunDir) -> tuple[int, float | None]:
    """Number of logged updates and the last one's mean reward, without parsing the whole log."""
    if not rd.log.exists():
        return 0, None
    n, last = 0, None
    with open(rd.log, "rb") as f:
        for line in f:
            if line.endswith(b"\n"):
                n += 1
                last = line
    if last is None:
        return 0, None
    try:
        return n, json.loads(last)["metrics"]["reward/mean"]
    except (json.JSONDecodeError, KeyError):
        return n, None


def combine(disk: str, sched: str | None) -> str:
    """One state from what the run folder says and what the scheduler says (None = not known to it)."""
    if disk == "finished":
        return "finished"
    if sched in ACTIVE_STATES:
        return "running" if sched == "RUNNING" and disk != "pending" else "queued"
    if disk == "running":  # the folder says running but no live job owns it: died without a word
        return "interrupted" if sched is None or sched == "COMPLETED" else sched.lower().split()[0]
    if disk == "pending" and sched and sched not in ACTIVE_STATES:
        return "failed" if sched == "COMPLETED" else sched.lower().split()[0]  # ended before the trainer began
    return disk


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")
