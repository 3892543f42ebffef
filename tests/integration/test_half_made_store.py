"""A sqlite MLflow store whose creation stopped partway is made again, not failed on forever (issue 44, D8).

A disk that fills while MLflow creates a store (its migrations are not transactional) leaves tables without the
schema revision that records them; every later open then fails with "table scorers already exists". Such a
store, with nothing logged in it, is moved aside to ``mlflow.db.half-made`` and made again
(esbatch/tracking/mlflow_tracker.py: half_made, seed_sqlite); one with runs in it is left alone.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from esbatch.tracking import mlflow_tracker
from esbatch.tracking.mlflow_tracker import MLflowTracker, half_made

# the revision before MLflow's "add scorer table" migration: stamped there, the store holds the tables of every
# later migration, as when the stamp of a migration was lost to a full disk
BEFORE_SCORERS = "1a0cddfcaa16"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # one template for the module: MLflow builds it in seconds


@pytest.fixture
def template(cache, monkeypatch) -> Path:
    monkeypatch.setenv("ESBATCH_CACHE", str(cache))
    tmpl = mlflow_tracker._empty_store_template()
    assert tmpl is not None
    return tmpl


def half_made_store(db: Path, tmpl: Path) -> None:
    shutil.copyfile(tmpl, db)
    with sqlite3.connect(db) as con:
        con.execute("UPDATE alembic_version SET version_num = ?", (BEFORE_SCORERS,))
        con.execute("DROP TABLE online_scoring_configs")  # the newest table missing: MLflow migrates again


def test_mlflow_itself_fails_on_the_half_made_store_for_good(tmp_path, template):
    db = tmp_path / "mlflow.db"
    half_made_store(db, template)
    for _ in range(2):
        with pytest.raises(Exception, match="table scorers already exists"):
            MlflowClient(f"sqlite:///{db}").search_experiments()


def test_a_half_made_store_is_moved_aside_and_made_again(tmp_path, template, capsys):
    db = tmp_path / "mlflow.db"
    half_made_store(db, template)
    head = sqlite3.connect(template).execute("SELECT version_num FROM alembic_version").fetchone()[0]
    why = half_made(db, template)
    assert why == (
        f"an MLflow store whose creation stopped partway (schema revision {BEFORE_SCORERS}, not {head}; no runs)"
    )
    aside = db.read_bytes()
    tr = MLflowTracker(f"sqlite:///{db}", "exp", tmp_path / "mlartifacts")
    run_id = tr.start("r", {"a": 1}, {})
    tr.log_metrics({"m": 1.0}, 0)
    tr.end()
    assert MlflowClient(f"sqlite:///{db}").get_run(run_id).data.metrics == {"m": 1.0}
    assert (tmp_path / "mlflow.db.half-made").read_bytes() == aside  # kept, as it was
    err = capsys.readouterr().err
    assert err.count(f"warning: {db}: {why}; moved aside to {db}.half-made and made again") == 1
    assert half_made(db, template) is None


def test_an_empty_file_is_half_made(tmp_path, template):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"")  # the first write failed: nothing in it
    head = sqlite3.connect(template).execute("SELECT version_num FROM alembic_version").fetchone()[0]
    assert half_made(db, template) == (
        f"an MLflow store whose creation stopped partway (schema revision none, not {head}; no runs)"
    )


@pytest.mark.parametrize("what", ["a store with a run in it", "a whole store", "not a database"])
def test_what_is_not_half_made_is_left_alone(tmp_path, template, what):
    db = tmp_path / "mlflow.db"
    if what == "not a database":  # MLflow's own error names it (TrackingStoreError): nothing is moved
        db.write_bytes(b"x" * 4096)
        assert half_made(db, template) is None
        return
    shutil.copyfile(template, db)
    if what == "a store with a run in it":
        run_id = MlflowClient(f"sqlite:///{db}").create_run("0").info.run_id
        with sqlite3.connect(db) as con:
            con.execute("UPDATE alembic_version SET version_num = ?", (BEFORE_SCORERS,))
        assert run_id
    assert half_made(db, template) is None
