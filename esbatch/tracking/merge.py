"""Merge a run's private MLflow store (offline mode) into the sweep's store, idempotently.

Compute nodes that cannot reach a tracking server log to ``sqlite:///<run folder>/mlflow.db``. Merging
copies params, tags, every metric step not yet present, artifacts and the status into one child run of
the sweep's parent, found again by its ``esbatch.run_key`` tag: merging twice adds nothing.
"""

from __future__ import annotations

import tempfile
from typing import Any

from esbatch.tracking.mlflow_tracker import sqlite_lock


def find_child(client: Any, experiment_id: str, sweep: str, key: str) -> Any | None:
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`esbatch.sweep` = '{sweep}' and tags.`esbatch.run_key` = '{key}'",
        max_results=5,
    )
    return runs[0] if runs else None


def merge_run(
    src_uri: str, src_run_id: str, dst_uri: str, experiment_id: str, parent_run_id: str | None, sweep: str, key: str
) -> tuple[str, int]:
    """Copy one offline run into ``dst_uri``; returns (destination run id, metric points added)."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    src = MlflowClient(tracking_uri=src_uri)
    run = src.get_run(src_run_id)
    with sqlite_lock(dst_uri):
        dst = MlflowClient(tracking_uri=dst_uri)
        existing = find_child(dst, experiment_id, sweep, key)
        tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.") or k == "mlflow.runName"}
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        if existing is None:
            dst_run = dst.create_run(
                experiment_id, run_name=run.info.run_name, tags=tags, start_time=run.info.start_time
            )
            dst_id = dst_run.info.run_id
            params = [Param(k, v) for k, v in run.data.params.items()]
            for i in range(0, len(params), 100):
                dst.log_batch(dst_id, params=params[i : i + 100])
        else:
            dst_id = existing.info.run_id
            dst.log_batch(dst_id, tags=[RunTag(k, v) for k, v in tags.items()])
        added = 0
        for name in run.data.metrics:
            have = {(m.step, m.timestamp) for m in dst.get_metric_history(dst_id, name)} if existing else set()
            new = [
                Metric(name, m.value, m.timestamp, m.step)
                for m in src.get_metric_history(src_run_id, name)
                if (m.step, m.timestamp) not in have
            ]
            for i in range(0, len(new), 1000):
                dst.log_batch(dst_id, metrics=new[i : i + 1000])
            added += len(new)
        with tempfile.TemporaryDirectory() as tmp:
            local = src.download_artifacts(src_run_id, "", tmp)
            dst.log_artifacts(dst_id, local)
        if run.info.status in ("FINISHED", "FAILED", "KILLED"):
            dst.set_terminated(dst_id, status=run.info.status, end_time=run.info.end_time)
        else:
            dst.update_run(dst_id, status=run.info.status)
    return dst_id, added
