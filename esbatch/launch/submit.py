"""`esbatch sweep` / `esbatch status`: plan a sweep, submit what is not done, report each run's state.

Idempotent: finished runs are skipped, queued or running ones are left alone, and failed, cancelled or
interrupted ones are submitted again and continue from their checkpoints. The MLflow parent run is
created once and reused; children are found again by their stable run key.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from esbatch.launch import slurm
from esbatch.launch.state import RunState, SweepDir, combine, disk_state, now
from esbatch.launch.sweep import Sweep

DONE_OR_ACTIVE = {"finished", "queued", "running"}


def write_plan(sweep: Sweep) -> SweepDir:
    """Write plan/<key>.yaml for every run and the sweep's entry in sweep.json (runs, tracking, launcher)."""
    sd = SweepDir(sweep.dir)
    sd.plan.mkdir(parents=True, exist_ok=True)
    for r in sweep.runs:
        text = r.config.to_yaml()
        p = sd.plan_path(r.key)
        if not p.exists() or p.read_text() != text:
            p.write_text(text)
    with sd.locked() as meta:
        meta.update(
            name=sweep.name,
            source=sweep.source,
            description=sweep.description,
            launcher=sweep.launcher,
            cluster=sweep.profile.cluster,
            tracking=sweep.profile.tracking,
            tracking_uri=sweep.tracking_uri,
            experiment=sweep.experiment,
            aggregate=sweep.aggregate_raw,
            runs=[{"key": r.key, "label": r.label, "index": r.index, "point": r.point} for r in sweep.runs],
        )
        meta.setdefault("submissions", [])
        meta.setdefault("created", now())
    return sd


def ensure_parent(sweep: Sweep, sd: SweepDir) -> str:
    """The sweep's MLflow parent run: created on the first submission, reused afterwards."""
    from esbatch.tracking import MLflowTracker, run_tags

    meta = sd.read()
    tr = MLflowTracker(sweep.tracking_uri, sweep.experiment, sd.path / "mlartifacts")
    if meta.get("parent_run_id"):
        tr.run_id = meta["parent_run_id"]
        return tr.run_id
    params = {"sweep.source": sweep.source, "sweep.runs": len(sweep.runs), "sweep.launcher": sweep.launcher}
    params.update(
        {f"sweep.axis.{k}": str(sorted({repr(r.point.get(k)) for r in sweep.runs})) for k in sweep.runs[0].point}
    )
    tags = {**run_tags(), "esbatch.sweep": sweep.name, "esbatch.role": "parent", "launcher": sweep.launcher}
    run_id = tr.start(sweep.name, params, tags)
    with sd.locked() as m:
        m["parent_run_id"] = run_id
    return run_id


def tag_parent(sd: SweepDir, tags: dict[str, str]) -> None:
    from mlflow.tracking import MlflowClient

    from esbatch.tracking.mlflow_tracker import _sqlite_lock

    meta = sd.read()
    if not meta.get("parent_run_id"):
        return
    with _sqlite_lock(meta["tracking_uri"]):
        client = MlflowClient(tracking_uri=meta["tracking_uri"])
        for k, v in tags.items():
            client.set_tag(meta["parent_run_id"], k, v)


def run_states(sd: SweepDir, query_scheduler: bool = True) -> list[RunState]:
    """Each planned run's state from its folder, corrected by ONE batched scheduler query."""
    import yaml

    meta = sd.read()
    subs = sd.last_submission()
    sched: dict[tuple[str, int], str] = {}
    if query_scheduler:
        sched = slurm.scheduler_states([s for s in meta.get("submissions", []) if s.get("kind") == "slurm"])
    out = []
    for r in meta.get("runs", []):
        plan = yaml.safe_load(sd.plan_path(r["key"]).read_text())
        budget = (plan.get("es") or {}).get("updates")
        disk, done, total, reward, heldout = disk_state(sd.run_dir(r["key"]), budget)
        sub = subs.get(r["key"])
        job, s = None, None
        if sub and sub.get("kind") == "slurm":
            job = f"{sub['job_id']}_{sub['array_index']}" if sub.get("array", True) else sub["job_id"]
            s = sched.get((sub["job_id"], sub["array_index"]))
        elif sub and sub.get("kind") == "local":
            pid = sub.get("pids", {}).get(r["key"])
            s = "RUNNING" if pid and _alive(pid) and disk != "finished" else None
        out.append(RunState(r["key"], r["label"], combine(disk, s), done, total, reward, heldout, job, s))
    return out


def _alive(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"esbatch.launch.task" in cmd


def format_table(states: list[RunState]) -> str:
    rows = [("key", "run", "state", "updates", "reward", "held-out", "job")]
    for s in states:
        rows.append(
            (
                s.key,
                s.label,
                s.state,
                f"{s.done}/{s.total if s.total is not None else '?'}",
                f"{s.last_reward:.3f}" if s.last_reward is not None else "-",
                f"{s.heldout:.3f}" if s.heldout is not None else "-",
                s.job or "-",
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    counts = Counter(s.state for s in states)
    lines.append(f"{len(states)} runs: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return "\n".join(lines)


def follow(
    sd: SweepDir, poll_s: float = 2.0, max_poll_s: float = 60.0, until: Callable[[], bool] | None = None
) -> None:
    """Live progress (total updates across runs) until no run is queued or running.

    The scheduler is asked once per poll for every array at once, and the interval backs off while
    nothing changes (2 s doubling to ``max_poll_s``), so a large sweep never floods slurmctld.
    """
    from tqdm.auto import tqdm

    states = run_states(sd)
    total = sum(s.total or 0 for s in states)
    bar = tqdm(total=total, desc=f"sweep {sd.read().get('name')}", unit="upd", dynamic_ncols=True)
    delay, last, idle = poll_s, None, 0
    try:
        while True:
            done = sum(s.done for s in states)
            bar.total = max(total, sum(s.total or 0 for s in states))
            bar.n = done
            counts = Counter(s.state for s in states)
            bar.set_postfix({k: v for k, v in sorted(counts.items())}, refresh=True)
            if until is not None and until():
                break
            idle = 0 if (counts["queued"] or counts["running"]) else idle + 1
            if until is None and idle >= 2:  # twice in a row: a job the scheduler has not listed yet is not lost
                break
            snapshot = (done, tuple(sorted(counts.items())))
            delay = poll_s if snapshot != last else min(delay * 2, max_poll_s)
            last = snapshot
            time.sleep(delay)
            states = run_states(sd)
    finally:
        bar.close()


def submit_sweep(sweep: Sweep, *, dry_run: bool = False, wait: bool = False, out: Any = None) -> int:
    """Plan, skip what is finished or active, submit the rest. Returns a process exit code."""
    out = out or sys.stdout
    sd = SweepDir(sweep.dir)
    prof = sweep.profile
    if dry_run:
        existing = {s.key: s for s in run_states(sd)} if sd.exists() else {}
        print(
            f"sweep {sweep.name}: {len(sweep.runs)} runs, launcher {sweep.launcher} ({prof.cluster}), folder {sd.path}",
            file=out,
        )
        for r in sweep.runs:
            st = existing.get(r.key)
            print(f"  {r.index:3d}  {r.key}  {r.label:50s} {st.state if st else 'new'}", file=out)
        todo = [r for r in sweep.runs if not (existing.get(r.key) and existing[r.key].state in DONE_OR_ACTIVE)]
        if prof.cluster == "slurm":
            print(f"\n# sbatch script for {len(todo)} task(s) (one array job; nothing submitted):\n", file=out)
            print(slurm.render_sbatch(prof, sd.path, f"esbatch-{sweep.name}", max(len(todo), 1)), file=out)
        else:
            print(f"\nwould run {len(todo)} task(s) here, {prof.array_parallelism} at a time (nothing run)", file=out)
        return 0

    sd = write_plan(sweep)
    ensure_parent(sweep, sd)
    states = {s.key: s for s in run_states(sd)}
    todo = [r.key for r in sweep.runs if states[r.key].state not in DONE_OR_ACTIVE]
    skipped = Counter(states[r.key].state for r in sweep.runs if r.key not in todo)
    print(f"sweep {sweep.name}: {len(sweep.runs)} runs in {sd.path}", file=out)
    if skipped:
        print("  skipping " + ", ".join(f"{n} {k}" for k, n in sorted(skipped.items())), file=out)
    if not todo:
        print("  nothing to submit.", file=out)
        if prof.cluster == "local" or wait:
            _aggregate_quietly(sd, out)
        return 0
    resumed = sum(1 for k in todo if states[k].done > 0 or states[k].state != "pending")
    print(f"  submitting {len(todo)} run(s) ({resumed} resume from their folders)", file=out)

    if prof.cluster == "local":
        from esbatch.launch import local

        try:
            record = local.run(prof, sd, todo, tick=_throttled_bar(sd))
        except KeyboardInterrupt:
            print("\ninterrupted: run `esbatch sweep` again to continue where each run stopped", file=out)
            return 130
        failed = {k: c for k, c in record["exit_codes"].items() if c}
        for k, c in failed.items():
            print(f"  run {k} exited with {c}; its log: {sd.runs / k / 'task.log'}", file=out)
        print(format_table(run_states(sd)), file=out)
        _aggregate_quietly(sd, out)
        return 1 if failed else 0

    records = slurm.submit(prof, sd, sweep.name, todo)
    with sd.locked() as meta:
        meta["submissions"].extend(records)
    ids = [r["job_id"] for r in sd.read()["submissions"] if r.get("kind") == "slurm"]
    tag_parent(sd, {"slurm.array_job_ids": ",".join(ids)})
    for r in records:
        agg = f", aggregator job {r['aggregate_job']} (afterok)" if r.get("aggregate_job") else ""
        print(
            f"  array job {r['job_id']}: {len(r['keys'])} task(s), at most {prof.array_parallelism} at once{agg}",
            file=out,
        )
    print(f"  follow it: esbatch status {sd.path}" + ("" if wait else "   (or re-run with --wait)"), file=out)
    if wait:
        follow(sd)
        agg_job = records[-1].get("aggregate_job")
        if agg_job:
            print(f"  aggregator job {agg_job}: {_wait_job(agg_job)}", file=out)
        print(format_table(run_states(sd)), file=out)
        if agg_job and (sd.results / "README.md").exists():
            print(f"results: {sd.results}", file=out)
        if not agg_job:
            _aggregate_quietly(sd, out)
    return 0


def _throttled_bar(sd: SweepDir) -> Callable[[], None]:
    """A progress bar for the local launcher fed from the run folders every ~2 s."""
    from tqdm.auto import tqdm

    state: dict[str, Any] = {"bar": None, "t": 0.0}

    def tick() -> None:
        if time.time() - state["t"] < 2:
            return
        state["t"] = time.time()
        states = run_states(sd, query_scheduler=False)
        if state["bar"] is None:
            state["bar"] = tqdm(total=sum(s.total or 0 for s in states), desc="sweep", unit="upd", dynamic_ncols=True)
        bar = state["bar"]
        counts = Counter(s.state for s in states)
        snap = (sum(s.done for s in states), sorted(counts.items()))
        if snap != state.get("last") or sys.stderr.isatty():  # in a log file: one line per change only
            state["last"] = snap
            bar.n = snap[0]
            bar.set_postfix(dict(snap[1]), refresh=True)

    return tick


def _wait_job(job_id: str, poll_s: float = 2.0) -> str:
    """Wait for one plain job (the aggregator) to end; returns its final state."""
    delay = poll_s
    while True:
        state = _single_state(job_id)
        if state and state.split()[0] not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "CONFIGURING"):
            return state
        time.sleep(delay)
        delay = min(delay * 1.5, 30)


def _single_state(job_id: str) -> str | None:
    import subprocess

    out = subprocess.run(["sacct", "-X", "-n", "-P", "--format=State", "-j", job_id], capture_output=True, text=True)
    lines = [x for x in out.stdout.split() if x]
    return lines[0] if lines else None


def _aggregate_quietly(sd: SweepDir, out: Any) -> None:
    from esbatch.aggregate.collect import aggregate

    try:
        path = aggregate(sd.path)
        print(f"results: {path}", file=out)
    except Exception as e:  # the runs are safe on disk; say what failed and how to retry
        print(f"aggregation failed ({type(e).__name__}: {e}); retry with: esbatch aggregate {sd.path}", file=out)
