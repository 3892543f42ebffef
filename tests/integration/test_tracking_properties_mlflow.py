"""The tracking property of tests/unit/test_tracking_properties.py (issue 44 D5) against MLflow's own sqlite store,
and the stand-in checked against it: each generated schedule of outages, updates, process ends and `esbatch
aggregate` is played twice, on a real sqlite store and on the in-memory stand-in (tests/tracking_schedules.py). On
the real store each (key, step) of log.jsonl is in MLflow exactly once and the run's status is run.json's; and the
two stores end the same (runs, statuses, params, metric points), after the same calls, refused the same number of
times: what the unit property proves on the stand-in holds for MLflow. Few examples: about 15 s on one core."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlflow.tracking
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from mlflow.tracking import MlflowClient
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

MEMORY = "system/peak_rss_mb"  # the process's own figure: its value differs from one play to the other
WHERE = ("run.output_dir", "tracking.uri")  # params that name each play's own folder and store


def summary(runs: list[tuple[str, dict, list[tuple[str, int, float]]]]) -> list[tuple]:
    """Each run's status, params and metric points (values of MEMORY left out), in an order ids do not decide."""
    out = []
    for status, params, points in runs:
        pts = sorted((k, s, None if k == MEMORY else round(v, 9) + 0.0) for k, s, v in points)  # sqlite: -0.0 is 0.0
        out.append((status, sorted((k, v) for k, v in params.items() if k not in WHERE), pts))
    return sorted(out, key=repr)


def real_runs(uri: str) -> dict[str, tuple[str, dict, list[tuple[str, int, float]]]]:
    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    out = {}
    for run in client.search_runs(exps):
        rid = run.info.run_id
        points = [(m.key, m.step, m.value) for k in run.data.metrics for m in client.get_metric_history(rid, k)]
        out[rid] = (run.info.status, dict(run.data.params), points)
    return out


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),  # no explain phase: each example is a second
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(schedules(max_segments=3, max_ops=8, max_call=8))
@example(  # each trigger, an aggregate while the run trains, a crash, the end's tries with the store up and down
    Schedule(
        3,
        [
            Segment(False, ["update", "down", "update", "pump", "up", "aggregate"], "crash", [(True, 0.5)], 1.0),
            Segment(True, ["update"], "stop", [(False, 2.0), (True, 0.5)], 5.0),
            Segment(False, ["update", "pump"], "finish", [(False, 30.0)], 1.0),
        ],
        {1: "update", 2: "land_fail", 3: "crash_after", 4: "down_after", 6: "crash_before"},
    )
)
def test_mlflows_sqlite_store_keeps_each_metric_once_and_agrees_with_the_stand_in(s):
    with fresh_dirs() as tmp, pytest.MonkeyPatch.context() as mp:
        root = Path(tmp)
        real = play(s, f"sqlite:///{root / 'mlflow.db'}", root, mp, MlflowClient)
        real_calls = (real.tap.n, real.outage.refused)
        mp.undo()  # MlflowClient as MLflow made it, to read the store back
        meta = json.loads((real.run_dir / "run.json").read_text())
        assert meta["status"] == real.status
        runs = real_runs(real.uri)
        rid = meta.get("mlflow_run_id")
        status, _, points = runs[rid] if rid else ("FAILED", {}, [])
        check_each_metric_once(points, recorded(real.run_dir))
        assert status == STATUS[real.status]
        assert not spool_path(real.run_dir).exists() or os.path.getsize(spool_path(real.run_dir)) == 0
    with fresh_dirs() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(mlflow.tracking, "MlflowClient", FakeClient)
        uri = fake_uri()
        fake = play(s, uri, Path(tmp), mp, FakeClient)
        store = FakeClient.STORES.pop(uri)
        assert json.loads((fake.run_dir / "run.json").read_text())["status"] == meta["status"]
    assert (fake.tap.n, fake.outage.refused) == real_calls  # the same calls reached each store, the same refused
    stand_in = [(r["status"], r["params"], r["metrics"]) for r in store.runs.values()]
    assert summary(stand_in) == summary(list(runs.values()))
