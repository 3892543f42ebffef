"""What `esbatch aggregate` adds to the sweep's MLflow experiment for comparing its runs in the UI.

* The parent run: the sweep's results (``results/``: tables, PNGs, README), its sweep file and ``sweep.json`` as
  artifacts, its SLURM job ids as a tag, FINISHED once every run is.
* A pipeline's run (which trains nothing itself: its stages, nested under it, log): the stages' curves joined on
  the pipeline's update axis (``collect.folder_history``) under the same metric names as an ES or GRPO run, and
  its stages' dataset inputs, so every method's run of the sweep has its reward and held-out curves side by side.
* A saved view of the runs table (MLflow's own "share view" state, an experiment tag
  ``mlflow.sharedViewState.<key>`` that the UI opens from ``?viewStateShareKey=<key>``): the sweep's runs (not
  their stages, evals or the parent: a search filter) grouped by the sweep's keys, their columns shown, and the
  charts of reward and held-out accuracy first.

Everything goes through the spool of the folder it belongs to (the sweep folder's for the parent, the run
folder's for a pipeline; esbatch/tracking/spool.py), then is sent: a store that is down keeps it there for the
next `esbatch aggregate`, and sending it again adds nothing (metric steps are sent once, artifacts, tags and
dataset inputs replace or equal what is there).

Chart order in MLflow 3's UI is the browser's state, not the store's: with no saved state it makes one section per
metric-name prefix (the part before the last ``/``), sections sorted alphabetically, names without a prefix
("Model metrics") last; each user's reordering is kept in their browser (local storage). A run's own page has no
saved view: there ``heldout/`` and ``reward/`` come first because a run's other prefixes sort after them (FLOPs
are ``update/flops``), except the opt-in ``diversity/`` and in-training ``eval/<label>/`` sections and GRPO's
``policy/`` (between the two). The experiment's charts, opened through the view link, start with reward and
held-out accuracy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from esbatch.tracking.spool import FILE, Spool, now_ms

VIEW_KEY = "esbatch-compare"  # ?viewStateShareKey=esbatch-compare
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
FIRST_CHARTS = ("reward/mean", "heldout/accuracy")  # what a researcher compares first, ES and GRPO alike
SECTION = "esbatch-first"
SECTION_NAME = "reward and held-out accuracy"
METHOD = "method"  # a sweep's methods axis (esbatch/launch/sweep.py)
# the sweep's own runs: not their pipeline stages, evals or the parent run (the search box shows it; clear it to
# see those too)
SWEEP_RUNS = "tags.`esbatch.run_key` LIKE '%'"


def compare_view(group_keys: list[str], metrics: list[str], first: tuple[str, ...] = FIRST_CHARTS) -> dict[str, Any]:
    """The MLflow UI state of the sweep's compare view (the JSON the UI's "Share" button saves): runs grouped by
    ``group_keys`` (tags named by the sweep's keys, each run's value: esbatch/launch/task.py), the runs table
    showing those keys and the first metrics, and a first chart section with one line chart per metric of
    ``first`` that was logged; the UI adds the other metrics' sections after it."""
    shown = [m for m in first if m in metrics]
    charts = [
        {
            "uuid": f"esbatch-chart-{i}",
            "type": "LINE",
            "runsCountToCompare": 10,
            "metricSectionId": SECTION,
            "deleted": False,
            "isGenerated": True,
            "metricKey": m,
            "selectedMetricKeys": [m],
            "displayName": m,
            "lineSmoothness": 0,
            "xAxisKey": "step",
            "xAxisScaleType": "linear",
            "scaleType": "linear",
            "range": {},
            "useGlobalXaxisKey": True,
            "useGlobalLineSmoothing": True,
        }
        for i, m in enumerate(shown)
    ]
    return {
        "groupBy": {
            "aggregateFunction": "average",
            "groupByKeys": [{"mode": "tag", "groupByData": k} for k in group_keys],
        }
        if group_keys
        else None,
        "selectedColumns": [
            "attributes.`Dataset`",
            *(f"tags.`{k}`" for k in group_keys),
            *(f"metrics.`{m}`" for m in shown),
        ],
        "compareRunCharts": charts,
        "compareRunSections": [
            {
                "uuid": SECTION,
                "name": SECTION_NAME,
                "display": True,
                "isReordered": False,
                "deleted": False,
                "isGenerated": False,
            }
        ],
        "isAccordionReordered": True,
        "searchFilter": SWEEP_RUNS,
        "runsHiddenMode": "SHOW_ALL",
        "hideEmptyCharts": True,
    }


def view_path(experiment_id: str) -> str:
    """Where the compare view opens in the MLflow UI (after its address, e.g. http://127.0.0.1:5000/)."""
    return f"#/experiments/{experiment_id}?viewStateShareKey={VIEW_KEY}"


def group_keys(runs: list[dict[str, Any]]) -> list[str]:
    """The sweep's keys whose value differs between its runs (grid axes, ``method``), in the sweep's order; the
    settings a method sets (its ``algorithm``, ``pipeline.stages``) are named by the method, as in run labels."""
    points = [r.get("point", {}) for r in runs]
    by_method = {k for p in points if METHOD in p for k in p if k != METHOD}
    keys = dict.fromkeys(k for p in points for k in p)
    return [k for k in keys if k not in by_method and len({repr(p.get(k)) for p in points}) > 1]


def spool_parent(
    sweep_dir: Path,
    meta: dict[str, Any],
    results: Path,
    finished: bool,
    metrics: list[str],
) -> Spool:
    """Append the parent run's writes to the sweep folder's spool (the caller sends it)."""
    sp = Spool(sweep_dir / FILE)
    rid, uri = meta["parent_run_id"], meta["tracking_uri"]

    def add(**what: Any) -> None:
        sp.append({"run_id": rid, "uri": uri, "time": now_ms(), **what})

    add(artifact=str(results.resolve()), artifact_path="results")
    source = Path(meta["source"]) if meta.get("source") else None
    if source is not None and source.is_file():
        add(artifact=str(source.resolve()), artifact_path="sweep")
    add(artifact=str((sweep_dir / "sweep.json").resolve()), artifact_path="sweep")
    jobs = [s["job_id"] for s in meta.get("submissions", []) if s.get("kind") == "slurm"]
    keys = group_keys(meta.get("runs", []))
    add(experiment_tags={VIEW_TAG: json.dumps(compare_view(keys, metrics))})
    tags = {"esbatch.compare_view": VIEW_KEY}
    if jobs:
        tags["slurm.array_job_ids"] = ",".join(jobs)
    add(tags=tags)
    if finished:
        add(status="FINISHED")
    return sp


def pipeline_records(
    run_id: str, uri: str, history: dict[str, list[tuple[int, float]]], inputs: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A pipeline run's writes: its joined history, one record per step (metric names as its stages logged
    them), and its stages' dataset inputs (each once)."""
    t = now_ms()
    steps: dict[int, dict[str, float]] = {}
    for name, pts in history.items():
        for step, v in pts:
            steps.setdefault(step, {})[name] = v
    recs: list[dict[str, Any]] = [
        {"run_id": run_id, "uri": uri, "time": t, "step": s, "metrics": steps[s]} for s in sorted(steps)
    ]
    seen: set[tuple[str, str]] = set()
    unique = []
    for d in inputs:
        key = (d["dataset"]["name"], d["dataset"]["digest"])
        if key not in seen:
            seen.add(key)
            unique.append(d)
    if unique:
        recs.append({"run_id": run_id, "uri": uri, "time": t, "inputs": unique})
    return recs


def stage_inputs(client: Any, run_ids: list[str]) -> list[dict[str, Any]]:
    """The dataset inputs of a pipeline's stage runs as MLflow has them, in the spool's form; a stage MLflow does
    not answer for is left out (a warning): its own run keeps them."""
    out = []
    for rid in run_ids:
        try:
            run = client.get_run(rid)
        except Exception as e:  # noqa: BLE001 - a missing stage run costs its datasets on the pipeline's run only
            print(f"warning: the datasets of stage run {rid} not copied to its pipeline's run ({e})", file=sys.stderr)
            continue
        for di in run.inputs.dataset_inputs if run.inputs else []:
            ds = di.dataset
            out.append(
                {
                    "dataset": {
                        "name": ds.name,
                        "digest": ds.digest,
                        "source_type": ds.source_type,
                        "source": ds.source,
                        "schema": ds.schema,
                        "profile": ds.profile,
                    },
                    "tags": {t.key: t.value for t in di.tags},
                }
            )
    return out
