"""Seeding a new sqlite MLflow store from the empty-store template, and telling a half-made store from a sound one
(esbatch/tracking/mlflow_tracker.py: _empty_store_template, half_made, seed_sqlite), pinned where planted faults
survived (issue 44 D6, mutmut 3.8.1). The template here is a hand-made sqlite file with the three tables these
functions read (no MLflow migrations: milliseconds); tests/unit/test_mlflow_store_template.py and
tests/integration/test_mlflow_store_seed.py check the real template against MLflow."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import mlflow
import pytest

from esbatch.tracking import mlflow_tracker as mt

HEAD = "head-rev"


def store(path: Path, version: str | None = HEAD, runs: int = 0, experiments: tuple[int, ...] = (0,)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(sqlite3.connect(path)) as con, con:
        if version is not None:
            con.execute("CREATE TABLE alembic_version (version_num TEXT)")
            con.execute("INSERT INTO alembic_version VALUES (?)", (version,))
        con.execute(
            "CREATE TABLE experiments (experiment_id INTEGER, name TEXT, artifact_location TEXT, "
            "creation_time INTEGER, last_update_time INTEGER)"
        )
        for e in experiments:
            con.execute("INSERT INTO experiments VALUES (?, ?, 'tmpl-loc', 1, 1)", (e, f"e{e}"))
        con.execute("CREATE TABLE runs (run_uuid TEXT)")
        for i in range(runs):
            con.execute("INSERT INTO runs VALUES (?)", (f"r{i}",))
    return path


@pytest.fixture
def template(tmp_path, monkeypatch):
    """The cached template this MLflow version would use, made by hand; seed_sqlite's per-process memory cleared."""
    cache = tmp_path / "cache"
    tmpl = store(cache / f"mlflow-{mlflow.__version__}-empty.db")
    monkeypatch.setenv("ESBATCH_CACHE", str(cache))
    monkeypatch.delenv("MLFLOW_ENABLE_WORKSPACES", raising=False)
    monkeypatch.delenv("_MLFLOW_SERVER_ARTIFACT_ROOT", raising=False)
    monkeypatch.setattr(mt, "_SOUND", set())
    return tmpl


def rows(db: Path, sql: str) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(db)) as con:
        return con.execute(sql).fetchall()


# ---------------------------------------------------------------------------------------------- the template


def test_a_cached_template_is_used_as_it_is(template, monkeypatch):
    monkeypatch.setattr("mlflow.tracking.MlflowClient", lambda *a, **k: pytest.fail("built again"))
    assert mt._empty_store_template() == template


def test_the_template_is_built_once_into_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "c" / "esb"
    monkeypatch.setenv("ESBATCH_CACHE", str(cache))
    built = []

    class Client:
        def __init__(self, uri):
            built.append(uri)
            self.db = Path(uri[len("sqlite:///") :])

        def search_experiments(self):
            store(self.db)
            return []

    monkeypatch.setattr("mlflow.tracking.MlflowClient", Client)
    tmpl = mt._empty_store_template()
    assert tmpl == cache / f"mlflow-{mlflow.__version__}-empty.db" and tmpl.is_file()
    assert len(built) == 1 and built[0].startswith(f"sqlite:///{cache}/") and built[0].endswith("/empty.db")
    assert rows(tmpl, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert sorted(p.name for p in cache.iterdir()) == [tmpl.name]  # its build folder is gone
    assert mt._empty_store_template() == tmpl and len(built) == 1
    tmpl.unlink()  # the cache folder exists: the template is built into it again
    assert mt._empty_store_template() == tmpl and len(built) == 2


def test_the_default_cache_is_under_home(tmp_path, monkeypatch):
    monkeypatch.delenv("ESBATCH_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    store(tmp_path / ".cache" / "esbatch" / f"mlflow-{mlflow.__version__}-empty.db")
    assert mt._empty_store_template() == tmp_path / ".cache" / "esbatch" / f"mlflow-{mlflow.__version__}-empty.db"


def test_a_template_that_cannot_be_built_is_none_and_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ESBATCH_CACHE", str(tmp_path / "c"))

    class Client:
        def __init__(self, uri):
            pass

        def search_experiments(self):
            raise RuntimeError("no schema")

    monkeypatch.setattr("mlflow.tracking.MlflowClient", Client)
    assert mt._empty_store_template() is None
    assert capsys.readouterr().err == (
        f"warning: no MLflow store template in {tmp_path / 'c'} (RuntimeError: no schema)\n"
    )
    assert list((tmp_path / "c").iterdir()) == []


# ---------------------------------------------------------------------------------------------- half-made


def test_a_store_at_the_templates_revision_is_whole(tmp_path, template):
    assert mt.half_made(store(tmp_path / "m.db"), template) is None


def test_a_store_at_another_revision_with_nothing_logged_is_half_made(tmp_path, template):
    assert mt.half_made(store(tmp_path / "m.db", version="old-rev"), template) == (
        f"an MLflow store whose creation stopped partway (schema revision old-rev, not {HEAD}; no runs)"
    )
    assert mt.half_made(store(tmp_path / "n.db", version=None), template) == (
        f"an MLflow store whose creation stopped partway (schema revision none, not {HEAD}; no runs)"
    )
    empty = tmp_path / "e.db"
    empty.write_bytes(b"")
    assert mt.half_made(empty, template) == (
        f"an MLflow store whose creation stopped partway (schema revision none, not {HEAD}; no runs)"
    )


@pytest.mark.parametrize("kw", [{"runs": 1}, {"experiments": (0, 1)}, {"experiments": (5,)}])
def test_a_store_with_something_logged_is_left_to_mlflow(tmp_path, template, kw):
    assert mt.half_made(store(tmp_path / "m.db", version="old-rev", **kw), template) is None


def test_a_store_sqlite_cannot_read_is_left_to_mlflow(tmp_path, template):
    bad = tmp_path / "m.db"
    bad.write_bytes(b"not a database, not at all" * 100)
    assert mt.half_made(bad, template) is None


def test_half_made_only_reads(tmp_path, template):
    db = store(tmp_path / "m.db", version="old-rev")
    before = db.read_bytes()
    mt.half_made(db, template)
    assert db.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["m.db"]


# ---------------------------------------------------------------------------------------------- seeding


def test_a_new_store_is_the_template_with_the_default_experiments_location_and_times(tmp_path, template, monkeypatch):
    monkeypatch.setattr(mt.time, "time", lambda: 1_700_000_000.25)
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "runs" / "mlflow.db"
    db.parent.mkdir()
    mt.seed_sqlite(db)
    assert rows(db, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert rows(
        db, "SELECT experiment_id, name, artifact_location, creation_time, last_update_time FROM experiments"
    ) == [(0, "e0", f"{tmp_path / 'mlruns' / '0'}", 1_700_000_000_250, 1_700_000_000_250)]
    assert sorted(p.name for p in db.parent.iterdir()) == ["mlflow.db"]  # no seed file left
    assert rows(template, "SELECT artifact_location FROM experiments") == [("tmpl-loc",)]  # the template unchanged


def test_a_server_artifact_root_is_the_default_experiments_location(tmp_path, template, monkeypatch):
    monkeypatch.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", "/srv/art")
    db = tmp_path / "m.db"
    mt.seed_sqlite(db)
    assert rows(db, "SELECT artifact_location FROM experiments") == [("/srv/art/0",)]


@pytest.mark.parametrize("value", ["1", "true", "TRUE"])
def test_workspaces_leave_the_store_to_mlflow(tmp_path, template, monkeypatch, value):
    monkeypatch.setenv("MLFLOW_ENABLE_WORKSPACES", value)
    mt.seed_sqlite(tmp_path / "m.db")
    assert not (tmp_path / "m.db").exists()


def test_a_sound_store_is_left_alone_and_checked_once(tmp_path, template, monkeypatch):
    db = store(tmp_path / "m.db", runs=2)
    before = db.read_bytes()
    checks = []
    real = mt.half_made
    monkeypatch.setattr(mt, "half_made", lambda d, t: checks.append(d) or real(d, t))
    mt.seed_sqlite(db)
    mt.seed_sqlite(db)
    assert db.read_bytes() == before and checks == [db]
    assert mt._SOUND == {(db, db.stat().st_ino)}


def test_a_store_replaced_by_another_file_is_checked_again(tmp_path, template, monkeypatch):
    db = store(tmp_path / "m.db")
    mt.seed_sqlite(db)
    other = store(tmp_path / "other.db", version="old-rev")  # made while db exists: another inode
    assert other.stat().st_ino != db.stat().st_ino
    other.rename(db)  # not the store found sound
    mt.seed_sqlite(db)
    assert (tmp_path / "m.db.half-made").exists() and rows(db, "SELECT version_num FROM alembic_version") == [(HEAD,)]


def test_a_half_made_store_is_moved_aside_and_made_again(tmp_path, template, capsys):
    db = store(tmp_path / "m.db", version="old-rev")
    half = db.read_bytes()
    mt.seed_sqlite(db)
    aside = tmp_path / "m.db.half-made"
    assert aside.read_bytes() == half and rows(db, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert capsys.readouterr().err == (
        f"warning: {db}: an MLflow store whose creation stopped partway (schema revision old-rev, not {HEAD}; no "
        f"runs); moved aside to {aside} and made again\n"
    )


def test_without_a_template_an_existing_store_is_left_and_a_new_one_left_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.setattr(mt, "_SOUND", set())
    monkeypatch.setattr(mt, "_empty_store_template", lambda: None)
    monkeypatch.delenv("MLFLOW_ENABLE_WORKSPACES", raising=False)
    db = store(tmp_path / "m.db", version="old-rev")
    before = db.read_bytes()
    mt.seed_sqlite(db)
    assert db.read_bytes() == before and (db, db.stat().st_ino) in mt._SOUND
    mt.seed_sqlite(tmp_path / "new.db")
    assert not (tmp_path / "new.db").exists()


def test_a_seed_that_fails_leaves_no_store_and_no_seed_file_and_says_why(tmp_path, template, monkeypatch, capsys):
    def full(src, dst):
        Path(dst).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mt.shutil, "copyfile", full)
    db = tmp_path / "m.db"
    mt.seed_sqlite(db)
    assert list(tmp_path.glob("*m.db*")) == []
    assert capsys.readouterr().err == (
        f"warning: could not seed {db} from {template} (OSError: [Errno 28] No space left on device)\n"
    )


def test_a_seed_whose_template_is_not_a_store_says_why(tmp_path, template, capsys):
    template.write_bytes(b"garbage" * 1000)
    mt.seed_sqlite(tmp_path / "m.db")
    assert not (tmp_path / "m.db").exists() and not list(tmp_path.glob(".m.db.seed*"))
    assert "warning: could not seed" in capsys.readouterr().err
