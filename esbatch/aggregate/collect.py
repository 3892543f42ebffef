"""`esbatch aggregate SWEEP`: read the sweep's runs back from MLflow, write tables and plots.

Offline run stores are merged first. Every planned run appears in the result, with its status: a run
that never reached MLflow is reported from its folder (or as missing), never silently dropped.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from esbatch.aggregate.evals import default_eval_analyses, load_evals
from esbatch.aggregate.mlflow_view import pipeline_records, spool_parent, stage_inputs, view_path
from esbatch.aggregate.report import default_analyses, parse_analyses, write_report
from esbatch.aggregate.results import RunResult
from esbatch.config import flatten
from esbatch.launch.state import SWEEP_RECORD_KEYS, RunState, SweepDir
from esbatch.launch.submit import folder_notes, run_states
from esbatch.tracking import MLflowTracker
from esbatch.tracking.merge import find_child, merge_run
from esbatch.tracking.mlflow_tracker import sqlite_lock
from esbatch.tracking.pending import drain, drain_all
from esbatch.tracking.spool import Spool, describe, spool_path
from esbatch.train.rundir import RunDir, RunFolderError, read_jsonl

STATUS = {"FINISHED": "finished", "RUNNING": "running", "FAILED": "failed", "KILLED": "killed", "SCHEDULED": "pending"}


def _typed(v: str) -> Any:
    try:
        return yaml.safe_load(v)
    except yaml.YAMLError:
        return v


def merge_offline(sd: SweepDir) -> int:
    """Merge each run folder's private store into the sweep's store; returns how many runs were merged."""
    parent = sd.ensure_parent_run()
    meta = sd.read()
    dst = MLflowTracker(meta["tracking_uri"], meta["experiment"], sd.path / "mlartifacts")
    n = 0
    for r in meta.get("runs", []):
        rd = sd.run_dir(r["key"])
        try:
            run_meta = rd.read_meta()
        except RunFolderError as e:
            print(f"warning: not merged: {e}", file=sys.stderr)
            continue
        if rd.offline_store.exists() and run_meta.get("mlflow_run_id"):
            merge_run(
                run_meta["tracking_uri"],
                run_meta["mlflow_run_id"],
                meta["tracking_uri"],
                dst.experiment_id,
                parent,
                meta["name"],
                r["key"],
            )
            n += 1
    return n


Points = dict[str, dict[int, float]]  # metric -> step -> value


def folder_history(rd: RunDir) -> dict[str, list[tuple[int, float]]]:
    """Every numeric metric a run folder logged, at the steps MLflow has them: ``log.jsonl``'s update metrics
    at step t + 1, ``eval.jsonl``'s held-out scores at step t. Reads only; a torn last line is skipped.

    A pipeline (esbatch/pipeline.py) logs in its stage folders: their histories are joined into one curve on the
    pipeline's update axis, stage k's step s at ``offset_k + s`` where ``offset_k`` sums the earlier stages'
    budgets (``RunDir.stage_budget``). Where two stages have a point at the same step (the step-0 eval of stage k
    and the final eval of stage k - 1 score the same weights) the earlier stage's is kept: it was logged first.
    Metrics of the pipeline folder itself fill steps the stages leave free."""
    hist: Points = {}
    offset = 0
    for st in rd.stages():
        _join(hist, _own_history(st), offset)
        offset += st.stage_budget()
    _join(hist, _own_history(rd), 0)
    return {k: sorted(pts.items()) for k, pts in hist.items()}


def _own_history(rd: RunDir) -> Points:
    """The metrics of ``rd``'s own ``log.jsonl`` (step t + 1) and ``eval.jsonl`` (step t)."""
    hist: Points = {}

    def add(name: str, step: int, v: Any) -> None:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            hist.setdefault(name, {})[step] = float(v)

    for rec in read_jsonl(rd.log)[0]:
        if isinstance(rec, dict) and isinstance(rec.get("t"), int) and isinstance(rec.get("metrics"), dict):
            for k, v in rec["metrics"].items():
                add(k, rec["t"] + 1, v)
    for rec in read_jsonl(rd.eval_log)[0]:
        if isinstance(rec, dict) and isinstance(rec.get("t"), int):
            for k, v in rec.items():
                if k != "t":
                    add(k, rec["t"], v)
    return hist


def _join(into: Points, pts: Points, offset: int) -> None:
    """Add ``pts`` shifted by ``offset`` steps; a step ``into`` already has keeps its value."""
    for name, steps in pts.items():
        mine = into.setdefault(name, {})
        for step, v in steps.items():
            mine.setdefault(offset + step, v)


def collect(
    sd: SweepDir, metrics: tuple[str, ...] | None = None, states: list[RunState] | None = None
) -> list[RunResult]:
    """One RunResult per planned run, params and histories read from MLflow.

    ``metrics=None`` reads every metric each run logged (any name an analysis may ask for, not a fixed
    list). A metric MLflow lacks (a run that never reached it, or a store that was lost) is read from the run
    folder's ``log.jsonl`` / ``eval.jsonl`` (:func:`folder_history`). A pipeline's MLflow run logs no metrics
    (its stages' runs, nested under it, do): its whole history is its stages' curve joined from their folders."""
    from mlflow.tracking import MlflowClient

    meta = sd.read()
    client = MlflowClient(tracking_uri=meta["tracking_uri"])
    exp = client.get_experiment_by_name(meta["experiment"])
    by_key = {s.key: s for s in (states if states is not None else run_states(sd))}
    out = []
    for r in meta.get("runs", []):
        key = r["key"]
        plan = yaml.safe_load(sd.plan_path(key).read_text())
        point = {k: v for k, v in r.get("point", {}).items() if "." not in k}  # e.g. method: not a config key
        child = find_child(client, exp.experiment_id, meta["name"], key) if exp else None
        st = by_key.get(key)
        local = folder_history(sd.run_dir(key))
        if metrics is not None:
            local = {m: pts for m, pts in local.items() if m in metrics}
        if st is not None and st.state in ("pending", "missing", "damaged") and child is not None:
            child = None  # the folder is the record: MLflow's run of a folder that is gone or damaged is not read
        if child is None:
            status = st.state if st and st.state != "pending" else "missing"
            params = {**flatten(plan), **point}
            out.append(RunResult(key, r["label"], status, params, (st.total if st else None) or 0, local))
            continue
        params = {**{k: _typed(v) for k, v in child.data.params.items()}, **point}
        history = {}
        for m in sorted(child.data.metrics) if metrics is None else metrics:
            hist = client.get_metric_history(child.info.run_id, m)
            if hist:
                history[m] = sorted({h.step: h.value for h in hist}.items())
        for m, pts in local.items():
            history.setdefault(m, pts)
        status = st.state if st is not None else STATUS.get(child.info.status, child.info.status.lower())
        total = (st.total if st else None) or 0
        out.append(RunResult(key, r["label"], status, params, total, history))
    return out


def spool_pipelines(sd: SweepDir, planned: list[dict[str, Any]]) -> None:
    """Give each pipeline run of the sweep its stages' joined curves and dataset inputs in MLflow
    (esbatch/aggregate/mlflow_view.py), through the pipeline folder's spool: sent now, or kept there while the
    store refuses (nothing is added to a spool that still holds unsent writes: they are sent first)."""
    from mlflow.tracking import MlflowClient

    for r in planned:
        rd = sd.run_dir(r["key"])
        try:
            meta = rd.read_meta()
            stage_ids = [st.read_meta().get("mlflow_run_id") for st in rd.stages()]
        except RunFolderError:
            continue  # `esbatch status` and the report name a damaged folder
        rid, uri = meta.get("mlflow_run_id"), meta.get("tracking_uri")
        sp = Spool(spool_path(rd.path))
        if meta.get("algorithm") != "pipeline" or not rid or not uri or sp.pending():
            continue
        if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
            continue  # a moved store: not a new, empty one
        inputs = stage_inputs(MlflowClient(tracking_uri=uri), [i for i in stage_ids if i])
        for rec in pipeline_records(rid, uri, folder_history(rd), inputs):
            sp.append(rec)
        drain(rd.path)


def publish(sd: SweepDir, meta: dict[str, Any], runs: list[RunResult]) -> None:
    """The parent run's results, sweep file, tags and compare view (esbatch/aggregate/mlflow_view.py), through the
    sweep folder's spool; a store that refuses keeps them there for the next `esbatch aggregate`."""
    from mlflow.tracking import MlflowClient

    def store(uri: str) -> tuple[Any, Any]:
        return MlflowClient(tracking_uri=uri), lambda: sqlite_lock(uri)

    finished = all(r.status == "finished" for r in runs)
    metrics = sorted({m for r in runs for m in r.history})
    sp = spool_parent(sd.path, meta, sd.results, finished, metrics)
    try:
        sp.send(store)
    except Exception as e:  # noqa: BLE001 - the report is written; MLflow gets its copy on the next try
        print(f"warning: {sp.path}: the sweep's MLflow writes not sent ({describe(e)}); kept", file=sys.stderr)
        return
    exp = MlflowClient(tracking_uri=meta["tracking_uri"]).get_run(meta["parent_run_id"]).info.experiment_id
    print(
        f"note: MLflow compare view (runs grouped by the sweep's keys, reward and held-out charts first): "
        f"`mlflow ui --backend-store-uri {meta['tracking_uri']}`, then http://127.0.0.1:5000/{view_path(exp)}",
        file=sys.stderr,
    )


def aggregate(sweep_dir: str | Path) -> Path:
    """Merge, collect, write ``results/`` and log it to the parent run; returns the results folder."""

    sd = SweepDir(sweep_dir)
    if not sd.exists():
        raise FileNotFoundError(f"{sd.path}: not a sweep folder (no sweep.json); submit it with `esbatch sweep FILE`")
    planned = sd.read(require=SWEEP_RECORD_KEYS)["runs"]
    drain_all(sd.run_dir(r["key"]).path for r in planned)  # MLflow writes kept in run folders
    spool_pipelines(sd, planned)  # into each pipeline's own store: merged with it below when offline
    if sd.read().get("tracking") == "offline":
        merge_offline(sd)
    sd.ensure_parent_run()  # a sweep whose runs never logged still gets its parent run and report
    meta = sd.read()
    states = run_states(sd)
    for note in folder_notes(sd, states):  # the same words as `esbatch status` and `esbatch sweep`
        print(f"note: {note}", file=sys.stderr)
    runs = collect(sd, states=states)
    analyses = parse_analyses(meta["aggregate"]) if meta.get("aggregate") else default_analyses(runs)
    evals = None
    if meta.get("evals"):
        evals = load_evals(sd)
        if not meta.get("aggregate"):
            analyses = [*default_eval_analyses(evals), *analyses]
    write_report(runs, analyses, sd.results, title=f"sweep {meta['name']}", evals=evals, sweep_dir=sd.path)
    if meta.get("parent_run_id"):
        publish(sd, meta, runs)
    return sd.results
