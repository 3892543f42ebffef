"""`esbatch sweep` / `esbatch status`: plan a sweep, submit what is not done, report each run's state.

Idempotent: finished runs are skipped, queued or running ones are left alone, and failed, cancelled or
interrupted ones are submitted again and continue from their folders. Submitting touches no MLflow store:
the sweep's parent run is created by the first task that logs (SweepDir.ensure_parent_run).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import yaml

from esbatch import durable
from esbatch.config.launcher import LauncherProfile, mem_mb
from esbatch.launch.base import LAUNCHERS, launcher_for
from esbatch.launch.cost import print_plan
from esbatch.launch.disk import sweep_disk
from esbatch.launch.evals import eval_disk_state, eval_progress, is_eval_key
from esbatch.launch.slurm import image_warning, job_state
from esbatch.launch.state import ACTIVE_STATES, RunState, SweepDir, combine, disk_state, folder_problem, now
from esbatch.launch.sweep import Sweep
from esbatch.launch.throughput import Table
from esbatch.train import stop
from esbatch.train.lock import writer_lock
from esbatch.train.rundir import RunDir, RunFolderError

DONE_OR_ACTIVE = {"finished", "queued", "running", "damaged"}  # not submitted (damaged: said why, left alone)


class BackendUnavailable(RuntimeError):
    """Tasks of the sweep need a generation backend the interpreter that would run them cannot import."""


def vllm_importable() -> bool:
    """Whether this interpreter can import vLLM (located, not imported: importing it takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def missing_vllm(sweep: Sweep, keys: list[str] | None = None) -> str | None:
    """Why the runs and evals among ``keys`` (default: all) that generate on vLLM cannot run, or None: their tasks
    run in this interpreter (the local launcher, or SLURM without a container: python_command) and it cannot import
    vLLM. A container's image has it."""
    if sweep.profile.container.runtime != "none" or vllm_importable():
        return None
    keys_set = None if keys is None else set(keys)
    runs = [
        str(r.point.get("method", r.label))
        for r in sweep.runs
        if r.config.backend.name == "vllm" and (keys_set is None or r.key in keys_set)
    ]
    evals = [
        e.label
        for e in sweep.evals
        if (e.config.get("backend") or {}).get("name") == "vllm" and (keys_set is None or e.key in keys_set)
    ]
    if not runs and not evals:
        return None
    what = "; ".join(
        f"{kind} {', '.join(dict.fromkeys(names))}" for kind, names in (("runs", runs), ("evals", evals)) if names
    )
    return (
        f"sweep {sweep.name}: backend.name: vllm ({what}) needs vLLM, which {sys.executable} cannot import, and the "
        f"launcher profile {sweep.launcher} runs every task with this interpreter. On a CPU, run the sweep with "
        ".venv-vllm/bin/esbatch (made by bash scripts/setup-vllm.sh); on GPU nodes use the container image (a "
        "launcher profile with container:, docs/containers.md)."
    )


def write_plan(sweep: Sweep) -> SweepDir:
    """Write plan/<key>.yaml for every run and the sweep's entry in sweep.json (runs, tracking, launcher)."""
    sd = SweepDir(sweep.dir)
    if RunDir(sd.path).exists():
        raise FileExistsError(
            f"{sd.path} is a run folder (it holds {RunDir.CONFIG}), not a sweep folder; rename the sweep (--name) "
            "or set its output_dir"
        )
    sd.plan.mkdir(parents=True, exist_ok=True)
    for r in sweep.runs:
        _write_if_changed(sd.plan_path(r.key), r.config.to_yaml())
    for e in sweep.evals:
        _write_if_changed(sd.eval_plan_path(e.key), yaml.safe_dump(e.config, sort_keys=False))
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
            mem_request_mb=mem_mb(sweep.profile.mem),
            max_requeues=sweep.profile.max_requeues,
            runs=[{"key": r.key, "label": r.label, "index": r.index, "point": r.point} for r in sweep.runs],
            evals=[_eval_entry(e) for e in sweep.evals],
            train_task=sweep.train_task,
            threshold=sweep.threshold,
        )
        meta.setdefault("submissions", [])
        meta.setdefault("created", now())
    return sd


def _eval_entry(e: Any) -> dict[str, Any]:
    entry = {"key": e.key, "label": e.label, "source": e.source, "point": e.point}
    return entry if e.tau is None else {**entry, "tau": e.tau}  # a point of the threshold curve


def _write_if_changed(p: Any, text: str) -> None:
    if not p.exists() or p.read_text() != text:
        durable.write_text(p, text)


def scheduler_states(sd: SweepDir, query: bool = True) -> dict[str, tuple[str, str | None]]:
    """Run key -> (scheduler state, job id) of its newest submission, one query per launcher kind."""
    subs = sd.read().get("submissions", [])
    newest = sd.last_submission()
    out: dict[str, tuple[str, str | None]] = {}
    for kind in sorted({s.get("kind", "slurm") for s in subs}):
        if not query and kind != "local":
            continue
        mine = [s for s in subs if s.get("kind", "slurm") == kind]
        for key, state in _launcher(kind).states(sd, mine).items():
            sub = newest.get(key)
            if sub and sub.get("kind", "slurm") == kind:
                out[key] = (state, _job_label(sub))
    return out


def _launcher(kind: str) -> Any:
    return LAUNCHERS.get(kind)(LauncherProfile(cluster=kind))


def _job_label(sub: dict[str, Any]) -> str:
    if sub.get("kind") == "local":
        return str(sub.get("pids", {}).get(sub["keys"][sub["array_index"]], "-"))
    return f"{sub['job_id']}_{sub['array_index']}" if sub.get("array", True) else sub["job_id"]


def run_states(sd: SweepDir, query_scheduler: bool = True) -> list[RunState]:
    """Each planned run's state from its folder, corrected by ONE batched scheduler query."""
    sched = scheduler_states(sd, query_scheduler)
    newest = sd.last_submission()
    out = []
    for r in sd.read().get("runs", []):
        disk, done, total, reward, heldout = disk_state(sd.run_dir(r["key"]), sd.plan_config(r["key"]))
        state, job = sched.get(r["key"], (None, None))
        if disk == "pending" and state is None and r["key"] in newest.get(r["key"], {}).get("pids", {}):
            disk = "missing"  # its local task started (and made the folder), which is gone: trained again
        if job is None and r["key"] in newest and newest[r["key"]].get("kind") != "local":
            job = _job_label(newest[r["key"]])
        out.append(RunState(r["key"], r["label"], combine(disk, state), done, total, reward, heldout, job, state))
    return out + _eval_states(sd, {s.key: s for s in out}, sched, newest)


def _eval_states(
    sd: SweepDir, runs: dict[str, RunState], sched: dict[str, tuple[str, str | None]], newest: dict[str, Any]
) -> list[RunState]:
    """The planned evals' states (kind "eval"; ``done`` counts problems evaluated, over every task)."""
    out = []
    for e in sd.read().get("evals", []):
        folder, src = sd.eval_dir(e["key"]), runs.get(e["source"]) if e.get("source") else None
        disk = eval_disk_state(folder, src.done if src else None, src is not None and src.state == "finished")
        state, job = sched.get(e["key"], (None, None))
        if job is None and e["key"] in newest and newest[e["key"]].get("kind") != "local":
            job = _job_label(newest[e["key"]])
        st = "stale" if disk == "stale" and state not in ACTIVE_STATES else combine(disk, state)
        out.append(RunState(e["key"], e["label"], st, eval_progress(folder), None, None, None, job, state, "eval"))
    return out


def memory_warnings(sd: SweepDir, margin: float = 0.10) -> list[str]:
    """Runs whose peak memory (run.json) came within ``margin`` of the profile's request, or went over it:
    a cluster that enforces --mem kills such runs, or will at the next peak."""
    meta = sd.read()
    request = meta.get("mem_request_mb")
    if not request:
        return []
    out = []
    for r in meta.get("runs", []):
        rd = sd.run_dir(r["key"])
        # a pipeline's stages run as their own processes: its peak is the largest of theirs (stage*/run.json)
        peaks = []
        for folder in [rd.path, *sorted(rd.path.glob("stage*/"))]:
            try:
                peaks.append(RunDir(folder).read_meta().get("peak_rss_mb"))
            except RunFolderError:
                continue
        peak = max((p for p in peaks if p is not None), default=None)
        if peak is not None and peak >= (1 - margin) * request:
            over = "over" if peak > request else f"within {100 * (request - peak) / request:.0f}% of"
            out.append(
                f"{r['key']} ({r['label']}): peak memory {peak:.0f} MB is {over} the {request} MB requested (mem: "
                f"in the launcher profile {meta.get('launcher')}); raise it, or the cluster may kill the run"
            )
    return out


def cancel_sweep(sd: SweepDir) -> list[str]:
    """Stop every queued or running run of the sweep through the launcher that started it; returns the keys.
    The runs stay resumable: the next `esbatch sweep` continues them."""
    active = [s for s in run_states(sd) if s.state in ("queued", "running")]
    keys = {s.key for s in active}
    subs = sd.read().get("submissions", [])
    for kind in sorted({s.get("kind", "slurm") for s in subs}):
        mine = [s for s in subs if s.get("kind", "slurm") == kind and keys & set(s["keys"])]
        if mine:
            _launcher(kind).cancel(sd, mine)
    return sorted(keys)


def format_table(states: list[RunState]) -> str:
    rows = [("key", "run", "state", "updates", "reward", "held-out", "job")]
    for s in states:
        rows.append(
            (
                s.key,
                s.label,
                s.state,
                f"{s.done} problems" if s.kind == "eval" else f"{s.done}/{s.total if s.total is not None else '?'}",
                f"{s.last_reward:.3f}" if s.last_reward is not None else "-",
                f"{s.heldout:.3f}" if s.heldout is not None else "-",
                s.job or "-",
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for kind in ("run", "eval"):
        mine = [s for s in states if s.kind == kind]
        counts = Counter(s.state for s in mine)
        if mine or kind == "run":
            lines.append(f"{len(mine)} {kind}s: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return "\n".join(lines)


def _bar_figures(states: list[RunState]) -> tuple[int, int, dict[str, Any]]:
    """(updates done, updates planned, postfix) for the sweep bar. Only runs count in the bar: an eval's
    ``done`` counts problems, which summed with updates made the bar read 128 of 32."""
    runs = [s for s in states if s.kind == "run"]
    evals = [s for s in states if s.kind == "eval"]
    post: dict[str, Any] = dict(sorted(Counter(s.state for s in runs).items()))
    if evals:
        post["evals"] = f"{sum(s.state == 'finished' for s in evals)}/{len(evals)}"
    return sum(s.done for s in runs), sum(s.total or 0 for s in runs), post


def follow(
    sd: SweepDir, poll_s: float = 2.0, max_poll_s: float = 60.0, until: Callable[[], bool] | None = None
) -> None:
    """Live progress (total updates across runs) until no run is queued or running.

    The scheduler is asked once per poll for every array at once, and the interval backs off while
    nothing changes (2 s doubling to ``max_poll_s``), so a large sweep never floods slurmctld.
    """
    from esbatch.clock import progress as tqdm  # monotonic: a clock jump moves no ETA

    states = run_states(sd)
    bar = tqdm(total=_bar_figures(states)[1], desc=f"sweep {sd.read().get('name')}", unit="upd")
    delay, last, idle = poll_s, None, 0
    try:
        while True:
            done, total, post = _bar_figures(states)
            bar.total = max(bar.total, total)
            bar.n = done
            counts = Counter(s.state for s in states)
            bar.set_postfix(post, refresh=True)
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


def folder_notes(sd: SweepDir, states: list[RunState]) -> list[str]:
    """What `esbatch status`, `sweep` and `aggregate` all say about run folders that are not as planned: damaged
    (why, and what to do), missing (gone after the run started), and folders the plan no longer holds."""
    notes = [f"damaged, not resubmitted: {folder_problem(sd.run_dir(s.key))}" for s in states if s.state == "damaged"]
    notes += [
        f"missing: {sd.run_dir(s.key).path} is gone (its run had started); `esbatch sweep` trains it again"
        for s in states
        if s.state == "missing"
    ]
    if extra := sd.unplanned():
        notes.append(f"not in the grid any more (left as they are, not reported): {', '.join(extra)} in {sd.runs}")
    return notes


def dry_run(sweep: Sweep, out: Any, table: Table | None = None) -> int:
    """Print the runs, evals, disk, cost plan (``table``: the throughput rates, esbatch/launch/cost.py) and what
    the launcher would do; submit nothing."""
    sd = SweepDir(sweep.dir)
    existing = {s.key: s for s in run_states(sd)} if sd.exists() else {}
    prof = sweep.profile
    head = f"sweep {sweep.name}: {len(sweep.runs)} runs, launcher {sweep.launcher} ({prof.cluster}), folder {sd.path}"
    print(head, file=out)
    for r in sweep.runs:
        st = existing.get(r.key)
        print(f"  {r.index:3d}  {r.key}  {r.label:50s} {st.state if st else 'new'}", file=out)
    for e in sweep.evals:
        st = existing.get(e.key)
        after = f"after {e.source}" if e.source else "at once"
        print(f"       {e.key}  {e.label:50s} {st.state if st else 'new'} ({after})", file=out)
    sweep_disk(sweep.runs, out)
    print_plan(sweep, out, table=table)
    todo = [r.key for r in sweep.runs if not (existing.get(r.key) and existing[r.key].state in DONE_OR_ACTIVE)]
    eval_todo, _ = evals_to_submit(sweep, existing, todo, out)  # as the submission picks them, waiting ones named
    print("\n" + launcher_for(prof).describe(sd, sweep.name, len(todo) + len(eval_todo)), file=out)
    if warning := image_warning(prof, sweep.launcher):
        print(f"\n{warning}", file=out)
    if why := missing_vllm(sweep, todo + eval_todo):
        print(f"\nwould be refused: {why}", file=out)
    return 0


def submit_sweep(sweep: Sweep, *, wait: bool = False, out: Any = None, table: Table | None = None) -> int:
    """Plan, skip what is finished or active, submit the rest. Returns a process exit code (130: stopped).

    Under the sweep folder's writer lock (esbatch/train/lock.py) from planning until it returns, which for the
    local launcher includes driving every run: a second `esbatch sweep` of the folder exits 2 meanwhile."""
    with writer_lock(sweep.dir, "sweep folder"):
        return _submit_sweep(sweep, wait=wait, out=out or sys.stdout, table=table)


def _submit_sweep(sweep: Sweep, *, wait: bool, out: Any, table: Table | None = None) -> int:
    sd = write_plan(sweep)
    states = {s.key: s for s in run_states(sd)}
    todo = [r.key for r in sweep.runs if states[r.key].state not in DONE_OR_ACTIVE]
    skipped = Counter(states[r.key].state for r in sweep.runs if r.key not in todo)
    evals = " and " + f"{len(sweep.evals)} evals" if sweep.evals else ""
    print(f"sweep {sweep.name}: {len(sweep.runs)} runs{evals} in {sd.path}", file=out)
    if skipped:
        print("  skipping " + ", ".join(f"{n} {k}" for k, n in sorted(skipped.items())), file=out)
    for note in folder_notes(sd, list(states.values())):
        print(f"  {note}", file=out)
    eval_todo, after = evals_to_submit(sweep, states, todo, out)
    if not todo and not eval_todo:
        print("  nothing to submit.", file=out)
        return 0
    if why := missing_vllm(sweep, todo + eval_todo):  # before any task starts: not one task failing per run
        raise BackendUnavailable(f"{why} Nothing was submitted.")
    resumed = sum(1 for k in todo if states[k].done > 0 or states[k].state not in ("pending", "missing"))
    print(f"  submitting {len(todo)} run(s) ({resumed} resume from their folders)", file=out)
    if eval_todo:
        print(f"  and {len(eval_todo)} eval(s), {len(after)} of them after their run's training", file=out)
    _plan_of_submission(sweep, todo, eval_todo, table, out)
    if warning := image_warning(sweep.profile, sweep.launcher):  # said before the jobs are in the queue
        print(f"  {warning}", file=out)
    launcher = launcher_for(sweep.profile)
    if launcher.foreground:
        return _run_here(launcher, sd, sweep, todo + eval_todo, out, after)
    records = launcher.submit(sd, sweep.name, todo + eval_todo, after)
    for r in records:
        agg = f", aggregator job {r['aggregate_job']} (afterok)" if r.get("aggregate_job") else ""
        dep = f" ({r['dependency']})" if r.get("dependency") else ""
        print(
            f"  array job {r['job_id']}{dep}: {len(r['keys'])} task(s), at most {sweep.profile.array_parallelism} "
            f"at once{agg}",
            file=out,
        )
    print(f"  follow it: esbatch status {sd.path}" + ("" if wait else "   (or re-run with --wait)"), file=out)
    if wait:
        follow(sd)
        agg_job = records[-1].get("aggregate_job")
        agg_state = _wait_job(agg_job) if agg_job else None
        if agg_state:
            print(f"  aggregator job {agg_job}: {agg_state}", file=out)
        print(format_table(run_states(sd)), file=out)
        if agg_state and agg_state.split()[0] != "COMPLETED":  # its log says why; the runs are safe on disk
            print(f"error: the aggregator job ended {agg_state}; retry with: esbatch aggregate {sd.path}", file=out)
            return 1
    return 0


def _plan_of_submission(sweep: Sweep, todo: list[str], eval_todo: list[str], table: Table | None, out: Any) -> None:
    """The cost plan of what is submitted now (its totals and time-limit warnings); a plan that cannot be made
    (a model whose config cannot be read) is said and never stops the submission."""
    runs, evals = [r for r in sweep.runs if r.key in todo], [e for e in sweep.evals if e.key in eval_todo]
    try:
        print_plan(sweep, out, runs, evals, table, detail=False)
    except Exception as e:  # noqa: BLE001 - an estimate: its failure is said, the submission goes on
        print(f"  cost plan not available ({type(e).__name__}: {e}); `esbatch sweep --dry-run` shows where", file=out)


def evals_to_submit(
    sweep: Sweep, states: dict[str, RunState], todo: list[str], out: Any
) -> tuple[list[str], dict[str, str]]:
    """(evals to submit, {eval: the run whose training it waits for}). An eval waits for its run when the run
    is submitted now or still queued/running; a run that is damaged or was left failed holds its eval back."""
    keys, after = [], {}
    for e in sweep.evals:
        if e.key in states and states[e.key].state in DONE_OR_ACTIVE:  # (a dry run of a new sweep has no states)
            continue
        src = states.get(e.source) if e.source else None
        if src is None or src.state == "finished":
            keys.append(e.key)
        elif e.source in todo or src.state in ("queued", "running"):
            keys.append(e.key)
            after[e.key] = e.source
        else:
            print(f"  eval {e.key} waits: its run {e.source} is {src.state}", file=out)
    return keys, after


def _run_here(
    launcher: Any, sd: SweepDir, sweep: Sweep, todo: list[str], out: Any, after: dict[str, str] | None = None
) -> int:
    launcher.tick = _throttled_bar(sd)
    try:
        (record,) = launcher.submit(sd, sweep.name, todo, after)
    except stop.Stopped:
        print("\ninterrupted: run `esbatch sweep` again to continue where each run stopped", file=out)
        return 130
    failed = {k: c for k, c in record["exit_codes"].items() if c}
    for k, c in failed.items():
        what = "eval" if is_eval_key(k) else "run"
        print(f"  {what} {k} exited with {c}; its log: {sd.task_log(k)}", file=out)
    for k in record.get("held_back", []):
        print(f"  eval {k} not started: the training it waits for did not finish", file=out)
    print(format_table(run_states(sd)), file=out)
    return 1 if failed else 0


def _throttled_bar(sd: SweepDir) -> Callable[[], None]:
    """A progress bar for the local launcher fed from the run folders every ~2 s."""
    from esbatch.clock import progress as tqdm  # monotonic: a clock jump moves no ETA

    state: dict[str, Any] = {"bar": None, "t": -float("inf")}

    def tick() -> None:
        if time.monotonic() - state["t"] < 2:
            return
        state["t"] = time.monotonic()
        states = run_states(sd, query_scheduler=False)
        done, total, post = _bar_figures(states)
        if state["bar"] is None:
            state["bar"] = tqdm(total=total, desc="sweep", unit="upd", dynamic_ncols=True)
        bar = state["bar"]
        snap = (done, sorted(post.items()))
        if snap != state.get("last") or sys.stderr.isatty():  # in a log file: one line per change only
            state["last"] = snap
            bar.n = done
            bar.set_postfix(post, refresh=True)

    return tick


def _wait_job(job_id: str, poll_s: float = 2.0) -> str:
    """Wait for one plain job (the aggregator) to end; returns its final state."""
    delay = poll_s
    while True:
        state = job_state(job_id)
        if state and state.split()[0] not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "CONFIGURING"):
            return state
        time.sleep(delay)
        delay = min(delay * 1.5, 30)
