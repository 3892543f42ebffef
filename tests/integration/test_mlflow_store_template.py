"""A new sqlite MLflow store starts as a copy of an empty store made once per MLflow version (esbatch/tracking/
mlflow_tracker.py: seed_sqlite): it holds exactly what MLflow itself would have created, row for row (the Default
experiment's location resolved from the current folder, its times now: tests/integration/test_mlflow_store_seed.py,
which builds both with MLflow's migrations), and works as a store."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from esbatch.tracking import mlflow_tracker
from esbatch.tracking.mlflow_tracker import MLflowTracker, seed_sqlite


def test_a_seeded_store_takes_runs_and_an_existing_store_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("ESBATCH_CACHE", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    tracker = MLflowTracker(uri, "exp")
    run_id = tracker.start("r", {"es.sigma": 0.01}, {"t": "1"})
    tracker.client.log_metric(run_id, "reward/mean", 0.5, step=1)
    before = (tmp_path / "runs" / "mlflow.db").read_bytes()
    seed_sqlite(tmp_path / "runs" / "mlflow.db")
    assert (tmp_path / "runs" / "mlflow.db").read_bytes() == before
    again = MlflowClient(uri)
    assert [m.value for m in again.get_metric_history(run_id, "reward/mean")] == [0.5]
    assert again.get_run(run_id).data.params == {"es.sigma": "0.01"}
    assert not list((tmp_path / "runs").glob(".mlflow.db.seed*"))


def test_no_template_where_the_cache_cannot_be_written(tmp_path, monkeypatch, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")  # the cache folder's place holds a file: it cannot be created
    monkeypatch.setenv("ESBATCH_CACHE", str(blocked / "cache"))
    seed_sqlite(tmp_path / "m.db")
    assert not (tmp_path / "m.db").exists() and "no MLflow store template" in capsys.readouterr().err
    assert mlflow_tracker._empty_store_template() is None
