"""Properties of tracking through store outages (issue 44 D5), on a stand-in store (tests/tracking_schedules.py):
whatever the interleaving of outages with a run's updates, its processes' ends and `esbatch aggregate`, each
metric (key, step) the run folder records is in MLflow exactly once afterwards, and the run's MLflow status is
run.json's. Generated schedules, played through the real RunSession, MLflowTracker, TrackingWriter, spool and
drain; derandomized, so CI runs the same examples every time."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow.tracking
import pytest
from hypothesis import HealthCheck, example, given, settings
from tracking_schedules import (
    STATUS,
    FakeClient,
    Schedule,
    Segment,
    check_each_metric_once,
    fake_uri,
    fresh_dirs,
    play,
    recorded,
    schedules,
)

from esbatch.tracking.spool import spool_path

SETTINGS = settings(
    max_examples=35,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(schedules())
@example(  # a resume whose store goes down while it reopens the run: MLflow stayed FINISHED, run.json failed (01cdca0)
    Schedule(1, [Segment(False, [], "finish", [], 0.0) for _ in range(3)], {12: "down_after"})
)
def test_any_interleaving_of_outages_leaves_each_metric_once_and_the_status_of_run_json(s):
    with fresh_dirs() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(mlflow.tracking, "MlflowClient", FakeClient)
        uri = fake_uri()
        played = play(s, uri, Path(tmp), mp, FakeClient)
        store = FakeClient.STORES.pop(uri)
        meta = json.loads((played.run_dir / "run.json").read_text())
        assert meta["status"] == played.status
        want = recorded(played.run_dir)
        rid = meta.get("mlflow_run_id")
        runs = dict(store.runs)
        run = runs.pop(rid) if rid else {"metrics": [], "status": "FAILED"}
        check_each_metric_once(run["metrics"], want)
        assert run["status"] == STATUS[played.status]
        assert all(not r["metrics"] for r in runs.values())  # a run whose start failed got nothing
        assert not spool_path(played.run_dir).exists() or spool_path(played.run_dir).stat().st_size == 0
