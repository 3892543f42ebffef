"""The sweep folder: the plan every task reads, what was submitted, and each run's state on disk.

<sweep>/sweep.json        name, launcher, tracking, parent MLflow run, runs [{key, label, index}],
                          submissions [{kind, job_id, keys, time, ...}]
<sweep>/plan/<key>.yaml   the resolved config of each run (what the task trains)
<sweep>/runs/<key>/       the run folder (esbatch/train/rundir.py)
<sweep>/plan/<key>.eval.yaml, <sweep>/evals/<key>/   a planned eval and its folder (esbatch/launch/evals.py)
<sweep>/slurm/            submitit's scripts, pickles and task logs
<sweep>/results/          tables and plots from `esbatch aggregate`

A run's state comes from its folder (run.json: status, budget, progress; the same for every algorithm)
corrected by what the launcher's scheduler says (esbatch/launch/submit.py:run_states).
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from esbatch import durable
from esbatch.config.run import load_config
from esbatch.launch.evals import is_eval_key
from esbatch.tracking import MLflowTracker, run_tags
from esbatch.train.rundir import RunDir, RunFolderError, read_json_object

# Scheduler states (SLURM's words) that mean "still queued or running": such runs are never resubmitted.
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


#: Keys of sweep.json that `esbatch sweep` always writes and that status and aggregate read.
SWEEP_RECORD_KEYS = ("name", "tracking_uri", "experiment", "runs")


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
            durable.write_text(self.meta_path, json.dumps(meta, indent=1))

    def read(self, require: tuple[str, ...] = ()) -> dict[str, Any]:
        """sweep.json ({} before the first submission); a RunFolderError naming it when it is damaged, or (an
        existing one) lacks a key of ``require`` (SWEEP_RECORD_KEYS: what every submission writes)."""
        if self.runs.exists() and not self.runs.is_dir():
            raise RunFolderError(
                f"{self.runs}: not a folder, so no run of sweep {self.path} can be read. Move it aside (mv {self.runs} "
                f"{self.runs}.damaged) and restore the runs folder, or submit the sweep again to retrain every run."
            )
        exists = self.meta_path.exists()

        def valid(m: dict[str, Any]) -> str:
            if missing := [k for k in require if k not in m] if exists else []:
                return f"it lacks {', '.join(repr(k) for k in missing)}, which every submission writes"
            return "" if isinstance(m.get("runs", []), list) else "its 'runs' is not a list"

        return read_json_object(
            self.meta_path,
            "a valid sweep record",
            f"Move it aside (mv {self.meta_path} {self.meta_path}.damaged) and submit the sweep file again: the "
            f"plan is rewritten and the run folders in {self.runs} are kept and resumed (jobs it had queued are no "
            "longer tracked: cancel them first).",
            valid=valid,
        )

    def unplanned(self) -> list[str]:
        """Run folders under runs/ that the plan no longer holds (a grid edited since): listed, never read."""
        planned = {r["key"] for r in self.read().get("runs", [])}
        found = sorted(p.name for p in self.runs.iterdir() if p.is_dir()) if self.runs.is_dir() else []
        return [k for k in found if k not in planned]

    def run_dir(self, key: str) -> RunDir:
        return RunDir(self.runs / key)

    def plan_path(self, key: str) -> Path:
        return self.plan / f"{key}.yaml"

    def eval_plan_path(self, key: str) -> Path:
        return self.plan / f"{key}.eval.yaml"

    def eval_dir(self, key: str) -> Path:
        return self.path / "evals" / key

    def task_log(self, key: str) -> Path:
        """Where the local launcher writes a task's output (a run's, or an eval's)."""
        return self.eval_dir(key) / RunDir.TASK_LOG if is_eval_key(key) else self.run_dir(key).task_log

    def plan_config(self, key: str) -> Any:
        return load_config(str(self.plan_path(key)))

    def last_submission(self) -> dict[str, dict[str, Any]]:
        """key -> the newest submission record that included it (job id, array index)."""
        out: dict[str, dict[str, Any]] = {}
        for sub in self.read().get("submissions", []):
            for i, k in enumerate(sub["keys"]):
                out[k] = {**sub, "array_index": i}
        return out

    def ensure_parent_run(self) -> str:
        """The sweep's MLflow parent run: created by whoever needs it first (a task, or the aggregator),
        under the sweep lock, so submitting never waits for MLflow to create its store."""
        meta = self.read(require=SWEEP_RECORD_KEYS)
        if meta.get("parent_run_id"):
            return meta["parent_run_id"]
        with self.locked() as m:
            if m.get("parent_run_id"):
                return m["parent_run_id"]
            tr = MLflowTracker(m["tracking_uri"], m["experiment"], self.path / "mlartifacts")
            runs = m.get("runs", [])
            params = {"sweep.source": m.get("source"), "sweep.runs": len(runs), "sweep.launcher": m.get("launcher")}
            axes = runs[0]["point"] if runs else {}
            params.update({f"sweep.axis.{k}": str(sorted({repr(r["point"].get(k)) for r in runs})) for k in axes})
            tags = {**run_tags(), "esbatch.sweep": m["name"], "esbatch.role": "parent", "launcher": m.get("launcher")}
            m["parent_run_id"] = tr.start(m["name"], params, tags)
            return m["parent_run_id"]


@dataclass
class RunState:
    key: str
    label: str
    state: str  # pending | queued | running | finished | killed | failed | interrupted | damaged
    done: int  # updates done
    total: int | None
    last_reward: float | None
    heldout: float | None
    job: str | None = None
    scheduler: str | None = None
    kind: str = "run"  # or "eval" (done = problems evaluated)


def planned_total(plan: Any, meta: dict[str, Any]) -> int | None:
    """A run's budget as its plan now says: in updates, or from its epochs and the training-set size the run
    recorded; else what the run itself recorded. A raised budget thus reopens a finished run."""
    algo = plan.algo()
    total = algo.planned_budget(plan)
    if total is None and meta.get("n_train"):
        total = algo.budget(plan, int(meta["n_train"]))
    return total if total is not None else meta.get("total_updates")


STARTING = {".lock", "task.log"}  # what a task writes before the run's config.yaml: a run folder still starting


def folder_problem(rd: RunDir) -> str | None:
    """Why ``rd`` is not a readable run folder (None when it is one, or not there yet): the one message that
    `esbatch status`, `sweep` and `aggregate` give for it. A folder that resume would refuse (``check_resume``:
    its log.jsonl deleted next to a checkpoint, a log behind its checkpoint) is damaged here too: one verdict."""
    if not rd.path.exists():
        return None
    if not rd.path.is_dir():
        return f"{rd.path}: not a folder. Move it aside; the next `esbatch sweep` trains the run again"
    if not rd.exists():
        found = sorted(p.name for p in rd.path.iterdir() if p.name not in STARTING)
        if found:
            return (
                f"{rd.path}: holds {', '.join(found[:4])} but no {RunDir.CONFIG}: restore it from a backup, or move "
                "the folder aside to train the run again"
            )
        return None
    try:
        if rd.read_meta().get("algorithm") != "pipeline":  # a pipeline resumes stage by stage, each checked so
            rd.check_resume()
    except RunFolderError as e:
        return str(e)
    return None


def disk_state(rd: RunDir, plan: Any) -> tuple[str, int, int | None, float | None, float | None]:
    """(state, updates done, total, last mean reward, last held-out accuracy) from a run folder alone: pending
    (no folder yet), damaged (``folder_problem``: named by `esbatch sweep`, which leaves it alone), or run.json's
    status."""
    if folder_problem(rd):
        return "damaged", 0, planned_total(plan, {}), None, None
    if not rd.exists():
        return "pending", 0, planned_total(plan, {}), None, None
    meta = rd.read_meta()
    done = rd.progress()
    total = planned_total(plan, meta)
    status = meta.get("status", "running")
    if status == "finished" and total is not None and done < total:
        status = "interrupted"  # finished under a smaller budget: continue it
    reward, heldout = kept_scores(rd, meta)
    return status, done, total, reward, heldout


def kept_scores(rd: RunDir, meta: dict[str, Any]) -> tuple[float | None, float | None]:
    """(last mean reward, last held-out accuracy) as run.json keeps them. A folder from before run.json kept
    them reads its logs; a pipeline from before its run.json kept them reads them from its newest stage that has
    each (a damaged stage folder is passed over)."""
    if "last_reward" in meta:
        return meta.get("last_reward"), meta.get("last_heldout")
    stages = rd.stages()
    if stages:
        scores = []
        for st in reversed(stages):
            try:
                scores.append(kept_scores(st, st.read_meta()))
            except RunFolderError:
                continue
        return _first_known(r for r, _ in scores), _first_known(h for _, h in scores)
    ups, evals = rd.updates() if rd.log.exists() else [], rd.evals()
    reward = ups[-1]["metrics"].get("reward/mean") if ups else None
    heldout = max(evals, key=lambda e: e["t"]).get("heldout/accuracy") if evals else None
    return reward, heldout


def _first_known(values: Iterable[float | None]) -> float | None:
    return next((v for v in values if v is not None), None)


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
