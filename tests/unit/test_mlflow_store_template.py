"""A new sqlite MLflow store starts as a copy of an empty store made once per MLflow version (esbatch/tracking/
mlflow_tracker.py: seed_sqlite): it holds exactly what MLflow itself would have created, row for row (the Default
experiment's location resolved from the current folder, its times now), and works as a store."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from mlflow.tracking import MlflowClient

from esbatch.tracking import mlflow_tracker
from esbatch.tracking.mlflow_tracker import MLflowTracker, seed_sqlite


def dump(db: Path) -> dict[str, list[tuple]]:
    with sqlite3.connect(db) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        schema = [  # MLflow's own migrations write a table's constraints in varying order: compare them as a set
            (kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
            for kind, name, sql in con.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name")
        ]
        return {"": schema, **{t: sorted(con.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in tables}}


def test_a_seeded_store_is_what_mlflow_creates(tmp_path, monkeypatch):
    monkeypatch.setenv("ESBATCH_CACHE", str(tmp_path / "cache"))
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)  # the Default experiment's location depends on the current folder
    fresh, seeded = tmp_path / "fresh.db", tmp_path / "seeded.db"
    MlflowClient(f"sqlite:///{fresh}").search_experiments()
    seed_sqlite(seeded)
    assert len(list((tmp_path / "cache").glob("mlflow-*-empty.db"))) == 1
    a, b = dump(fresh), dump(seeded)
    assert a.keys() == b.keys() and a[""] == b[""]  # the same tables, indexes and schema text
    (exp_a,), (exp_b,) = a.pop("experiments"), b.pop("experiments")
    assert a == b  # every other row, e.g. alembic_version and the default workspace
    assert exp_b[2] == exp_a[2] == str(here / "mlruns" / "0")
    assert exp_a[:2] == exp_b[:2] and exp_a[3:4] == exp_b[3:4] and exp_a[6:] == exp_b[6:]
    assert abs(exp_b[4] - exp_a[4]) < 3_600_000 and exp_b[4] == exp_b[5]  # created now, not when the template was


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
