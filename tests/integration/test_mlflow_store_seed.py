"""A seeded sqlite MLflow store (esbatch/tracking/mlflow_tracker.py: seed_sqlite, a copy of an empty store made once
per MLflow version) holds exactly what MLflow itself creates, row for row. In tests/integration since issue 40: it
builds two stores with MLflow's migrations (seconds); tests/unit/test_mlflow_store_template.py keeps the rest."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from mlflow.tracking import MlflowClient

from esbatch.tracking.mlflow_tracker import seed_sqlite


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
