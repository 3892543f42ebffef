"""A resume whose MLflow run or experiment was deleted goes on with one warning line, no traceback (issue 44, D8).

Deleting the run (or its experiment) in the MLflow UI made the resume's ``update_run`` fail with "must be in the
'active' state": the resumed run is now logged as a new MLflow run; a deleted experiment is restored, with the
runs deleted with it, and the run resumes in it; spooled writes of a deleted run are dropped with a warning (the
run folder keeps the metrics) instead of failing the resume.
"""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from esbatch.tracking.mlflow_tracker import MLflowTracker


@pytest.fixture
def store(tmp_path):
    """A store holding run 'r' of experiment 'exp' with metric m at step 0, finished; (uri, run id, experiment id)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tr = MLflowTracker(uri, "exp", tmp_path / "mlartifacts", sleep=lambda s: None)
    run_id = tr.start("r", {"a": 1}, {})
    tr.log_metrics({"m": 1.0}, 0)
    tr.end()
    return uri, run_id, tr.experiment_id


def resume(tmp_path, uri, run_id, spool=None):
    tr = MLflowTracker(uri, "exp", tmp_path / "mlartifacts", spool, sleep=lambda s: None)
    got = tr.start("r", {"a": 1}, {}, run_id=run_id)
    tr.log_metrics({"m": 2.0}, 1)
    tr.end()
    return tr, got


def test_a_deleted_run_is_resumed_as_a_new_mlflow_run(tmp_path, store, capsys):
    uri, run_id, _ = store
    MlflowClient(uri).delete_run(run_id)
    tr, got = resume(tmp_path, uri, run_id)
    assert got != run_id
    run = MlflowClient(uri).get_run(got)
    assert run.info.status == "FINISHED" and run.data.metrics == {"m": 2.0}
    assert MlflowClient(uri).get_run(run_id).info.lifecycle_stage == "deleted"  # left as the user made it
    err = capsys.readouterr().err
    assert f"warning: MLflow run {run_id} was deleted from {uri}; logging the resumed run as a new MLflow run" in err
    assert "Traceback" not in err


def test_a_deleted_experiment_is_restored_and_the_run_resumed_in_it(tmp_path, store, capsys):
    uri, run_id, exp_id = store
    MlflowClient(uri).delete_experiment(exp_id)
    tr, got = resume(tmp_path, uri, run_id)
    assert got == run_id and tr.experiment_id == exp_id
    client = MlflowClient(uri)
    assert client.get_experiment(exp_id).lifecycle_stage == "active"
    assert [m.value for m in client.get_metric_history(run_id, "m")] == [1.0, 2.0]
    err = capsys.readouterr().err
    assert err.count(f"warning: MLflow experiment 'exp' in {uri} was deleted; restored it (and its runs)") == 1


def test_spooled_writes_of_a_deleted_run_are_dropped_with_a_warning(tmp_path, store, capsys):
    uri, run_id, _ = store
    spool = tmp_path / "tracking.pending.jsonl"
    spool.write_text(json.dumps({"run_id": run_id, "uri": uri, "time": 1, "step": 5, "metrics": {"m": 9.0}}) + "\n")
    MlflowClient(uri).delete_run(run_id)
    tr, got = resume(tmp_path, uri, run_id, spool)
    assert got != run_id and spool.read_text() == ""
    assert [m.step for m in MlflowClient(uri).get_metric_history(run_id, "m")] == [0]  # nothing sent to it
    err = capsys.readouterr().err
    assert f"warning: 1 spooled tracking writes of MLflow runs {run_id} not sent" in err
