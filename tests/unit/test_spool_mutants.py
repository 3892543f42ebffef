"""The tracking spool and its replay, pinned where planted faults survived the other tests (issue 44 D6, mutmut
3.8.1 on esbatch/tracking/spool.py and pending.py): which store each spooled record goes to, the exactly-once
bookkeeping as records are sent (a crash after k sends leaves exactly those k in the store and marked), that a
replay refuses a store that has disappeared, and the spool file's own atomic rewrite (its replace followed by an
fsync of the folder).

No MLflow store is opened: ``Store`` is a stand-in for one store's client that keeps the points it was sent and
logs every call in order, so every assertion is on exact values and call sequences.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INVALID_PARAMETER_VALUE,
    RESOURCE_DOES_NOT_EXIST,
    TEMPORARILY_UNAVAILABLE,
)

from esbatch.tracking import pending
from esbatch.tracking import spool as spooling
from esbatch.tracking.spool import FILE, SendCache, Spool, TrackingStoreError

# ---------------------------------------------------------------------------------------------- a store stand-in


class Crash(Exception):
    """A failure planted at a counted call: the process 'dies' there."""


class Store:
    """One MLflow store's client: ``points[(run, key)]`` = {step: (value, time)}; ``calls`` in order; the runs it
    knows (``deleted``: known but deleted). ``fail_at``: the log_batch call (1-based) that raises ``Crash`` after
    ``land`` (the batch landed, then the answer was lost) or before it."""

    def __init__(self, name: str, runs=("r1", "r2"), deleted=(), have=None) -> None:
        self.name, self.runs, self.deleted = name, set(runs), set(deleted)
        self.points: dict[tuple[str, str], dict[int, tuple[float, int]]] = {}
        for (rid, key), steps in (have or {}).items():
            self.points[rid, key] = {s: (0.0, 0) for s in steps}
        self.calls: list[tuple] = []
        self.batches = 0
        self.fail_at: int | None = None
        self.land = False
        self.locked = False
        self.get_run_error: Exception | None = None

    def _check(self):
        assert self.locked, f"store {self.name} called without its writer lock"

    def get_run(self, rid):
        self._check()
        self.calls.append(("get_run", rid))
        if self.get_run_error is not None:
            raise self.get_run_error
        if rid not in self.runs:
            raise MlflowException(f"Run '{rid}' not found", error_code=RESOURCE_DOES_NOT_EXIST)
        stage = "deleted" if rid in self.deleted else "active"
        return SimpleNamespace(info=SimpleNamespace(lifecycle_stage=stage, experiment_id="0"))

    def get_metric_history(self, rid, key):
        self._check()
        self.calls.append(("history", rid, key))
        return [SimpleNamespace(step=s) for s in sorted(self.points.get((rid, key), {}))]

    def log_batch(self, rid, metrics=(), **kw):
        self._check()
        self.batches += 1
        crash = self.fail_at == self.batches
        if crash and not self.land:
            raise Crash(f"log_batch {self.batches}")
        self.calls.append(("log_batch", rid, [(m.key, m.step) for m in metrics]))
        if "tags" in kw:
            self.calls.append(("tags", rid, [(t.key, t.value) for t in kw["tags"]]))
        for m in metrics:
            self.points.setdefault((rid, m.key), {})[m.step] = (m.value, m.timestamp)
        if crash:
            raise Crash(f"log_batch {self.batches} landed")

    def set_terminated(self, rid, status, end_time):
        self._check()
        self.calls.append(("set_terminated", rid, status, end_time))

    def update_run(self, rid, status):
        self._check()
        self.calls.append(("update_run", rid, status))

    def log_artifact(self, rid, path, artifact_path=None):
        self._check()
        self.calls.append(("log_artifact", rid, path, artifact_path))

    def log_artifacts(self, rid, path, artifact_path=None):
        self._check()
        self.calls.append(("log_artifacts", rid, path, artifact_path))

    def log_inputs(self, rid, datasets):
        self._check()
        self.calls.append(("log_inputs", rid, datasets))

    def set_experiment_tag(self, exp, key, value):
        self._check()
        self.calls.append(("set_experiment_tag", exp, key, value))

    def steps(self, rid, key):
        return sorted(self.points.get((rid, key), {}))


class Stores:
    """``client_for`` for Spool.send: each uri's Store, and its lock (entering and leaving it logged)."""

    def __init__(self, *stores: Store) -> None:
        self.by_uri = {s.name: s for s in stores}
        self.asked: list[str] = []

    def __call__(self, uri: str):
        self.asked.append(uri)
        store = self.by_uri[uri]

        @contextlib.contextmanager
        def lock():
            assert not store.locked
            store.locked = True
            store.calls.append(("lock",))
            try:
                yield
            finally:
                store.locked = False
                store.calls.append(("unlock",))

        return store, lock


def met(rid, step, uri="A", t=None, **values):
    return {"run_id": rid, "uri": uri, "time": 1000 + step if t is None else t, "step": step, "metrics": values}


def status(rid, s, uri="A", t=5000):
    return {"run_id": rid, "uri": uri, "time": t, "status": s}


def spool_with(tmp_path, recs, extra_lines=()) -> Spool:
    sp = Spool(tmp_path / FILE)
    for r in recs:
        sp.append(r)
    if extra_lines:
        with open(sp.path, "a") as f:
            f.writelines(extra_lines)
    return sp


def locked(store: Store):
    store.locked = True
    return store


# ---------------------------------------------------------------------------------------------- which store


def test_each_spooled_record_goes_to_the_store_it_was_spooled_for(tmp_path):
    a, b = Store("sqlite:///a.db", runs={"r1"}), Store("sqlite:///b.db", runs={"r2"})
    recs = [
        met("r1", 1, uri=a.name, x=1.0),
        met("r2", 1, uri=b.name, x=2.0),
        met("r1", 2, uri=a.name, x=3.0),
        status("r2", "FINISHED", uri=b.name),
    ]
    stores = Stores(a, b)
    assert spool_with(tmp_path, recs).send(stores) == 3
    assert stores.asked == [a.name, b.name]  # one client per store, in the order the spool first names it
    assert a.points == {("r1", "x"): {1: (1.0, 1001), 2: (3.0, 1002)}}
    assert b.points == {("r2", "x"): {1: (2.0, 1001)}}
    assert [c[0] for c in a.calls] == ["lock", "get_run", "history", "log_batch", "unlock"]
    assert [c for c in b.calls if c[0] == "set_terminated"] == [("set_terminated", "r2", "FINISHED", 5000)]
    assert (tmp_path / FILE).read_text() == ""  # all sent: the spool is emptied


def test_a_store_named_by_the_replay_takes_every_record(tmp_path):
    moved = Store("sqlite:///moved.db", runs={"r1", "r2"})
    recs = [met("r1", 1, uri="sqlite:///old.db", x=1.0), met("r2", 1, uri="sqlite:///other.db", x=2.0)]
    stores = Stores(moved)
    assert spool_with(tmp_path, recs).send(stores, uri=moved.name) == 2
    assert stores.asked == [moved.name]
    assert moved.steps("r1", "x") == [1] and moved.steps("r2", "x") == [1]


def test_a_record_that_names_no_store_goes_to_the_default_one(tmp_path):
    blank = Store("", runs={"r1"})
    rec = met("r1", 1, x=1.0)
    del rec["uri"]
    stores = Stores(blank)
    assert spool_with(tmp_path, [rec]).send(stores) == 1
    assert stores.asked == [""]


# ---------------------------------------------------------------------------------------------- exactly once


def test_each_key_and_step_is_sent_once_even_when_spooled_twice(tmp_path):
    s = Store("A", runs={"r1"}, have={("r1", "x"): {1}})
    recs = [met("r1", 1, x=9.0), met("r1", 2, x=2.0, y=5.0), met("r1", 2, x=7.0), met("r1", 3, x=3.0)]
    assert spool_with(tmp_path, recs).send(Stores(s)) == 3
    assert s.points[("r1", "x")] == {1: (0.0, 0), 2: (2.0, 1002), 3: (3.0, 1003)}  # the first value of a step
    assert s.points[("r1", "y")] == {2: (5.0, 1002)}
    assert s.calls.count(("history", "r1", "x")) == 1 and s.calls.count(("get_run", "r1")) == 1
    assert [c for c in s.calls if c[0] == "log_batch"] == [("log_batch", "r1", [("x", 2), ("y", 2), ("x", 3)])]


def test_the_bookkeeping_marks_each_point_as_it_is_sent(tmp_path):
    """A cache kept across sends (the writer thread's) knows exactly the points sent and those the store had: a
    second send of the same lines (the spool could not be emptied) reads nothing again and sends nothing."""
    s = Store("A", runs={"r1", "r2"}, have={("r1", "x"): {0}})
    recs = [met("r1", 1, x=1.0), met("r2", 1, x=1.0), met("r1", 2, x=2.0, y=2.0), status("r1", "RUNNING")]
    cache = SendCache()
    assert spooling.send(locked(s), recs, cache) == 4
    assert cache.have == {("r1", "x"): {0, 1, 2}, ("r2", "x"): {1}, ("r1", "y"): {2}}
    assert cache.known == {"r1": True, "r2": True}
    calls = len(s.calls)
    assert spooling.send(s, recs, cache) == 0
    assert [c[0] for c in s.calls[calls:]] == ["update_run"]  # statuses are sent again: setting one is idempotent


@pytest.mark.parametrize("land", [False, True], ids=["lost", "landed-then-lost"])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_crash_after_k_sends_leaves_exactly_k_in_the_store_and_the_rest_for_the_next_send(tmp_path, k, land):
    """Four batches (the run changes at every line); the (k+1)-th log_batch fails. The store holds exactly the
    first k (k+1 when that batch landed before the failure), the spool is kept whole, the cache is forgotten (a
    failed batch may or may not have landed), and the next send sends exactly the rest, each point once."""
    s = Store("A", runs={"r1", "r2"})
    recs = [met("r1", 1, x=1.0), met("r2", 1, x=1.0), met("r1", 2, x=2.0), met("r2", 2, x=2.0)]
    sp = spool_with(tmp_path, recs)
    before = sp.path.read_bytes()
    s.fail_at, s.land = k + 1, land
    cache = SendCache()
    with pytest.raises(Crash):
        sp.send(Stores(s), cache=cache)
    landed = recs[: k + land]
    assert sorted((r["run_id"], r["step"]) for r in landed) == sorted(
        (rid, step) for (rid, _), steps in s.points.items() for step in steps
    )
    assert cache.have == {} and cache.known == {}
    assert sp.path.read_bytes() == before
    s.fail_at = None
    assert sp.send(Stores(s), cache=cache) == 4 - len(landed)
    assert {rid: s.steps(rid, "x") for rid in ("r1", "r2")} == {"r1": [1, 2], "r2": [1, 2]}
    sent = [p for c in s.calls if c[0] == "log_batch" for p in c[2]]
    assert len(sent) == 4  # no point twice, across the crash
    assert sp.path.read_text() == ""


def test_a_crash_between_sending_and_emptying_the_spool_sends_nothing_twice_with_or_without_the_cache(
    tmp_path, monkeypatch
):
    s = Store("A", runs={"r1"})
    sp = spool_with(tmp_path, [met("r1", 1, x=1.0), met("r1", 2, x=2.0)])
    whole = sp.path.read_bytes()
    cache = SendCache()

    def crash(f):
        raise Crash("truncate")

    with monkeypatch.context() as m:
        m.setattr(spooling, "_truncate", crash)
        with pytest.raises(Crash):
            sp.send(Stores(s), cache=cache)
    assert cache.have == {("r1", "x"): {1, 2}} and cache.known == {"r1": True}  # the points sent are marked
    assert sp.path.read_bytes() == whole
    n = len(s.calls)
    assert sp.send(Stores(s), cache=cache) == 0  # the same process: the marks say all is there, nothing is read
    assert [c[0] for c in s.calls[n:]] == ["lock", "unlock"] and sp.path.read_text() == ""
    sp.path.write_bytes(whole)  # another process (a resume, `esbatch aggregate`) finds the spool whole
    n = len(s.calls)
    assert sp.send(Stores(s), cache=SendCache()) == 0
    assert [c[0] for c in s.calls[n:]] == ["lock", "get_run", "history", "unlock"]
    assert s.batches == 1 and sp.path.read_text() == ""


def test_a_fresh_send_reads_what_the_store_has(tmp_path):
    s = Store("A", runs={"r1"}, have={("r1", "x"): {1, 2}})
    sp = spool_with(tmp_path, [met("r1", 1, x=1.0), met("r1", 2, x=2.0), met("r1", 3, x=3.0)])
    assert sp.send(Stores(s)) == 1
    assert [c for c in s.calls if c[0] == "log_batch"] == [("log_batch", "r1", [("x", 3)])]


def test_runs_the_store_does_not_know_or_deleted_are_dropped_with_one_warning(tmp_path, capsys):
    s = Store("A", runs={"r1", "gone"}, deleted={"gone"})
    recs = [met("lost", 1, x=1.0), met("r1", 1, x=1.0), met("gone", 1, x=1.0), status("lost", "FINISHED")]
    cache = SendCache()
    assert spooling.send(locked(s), recs, cache) == 1
    assert cache.known == {"lost": False, "r1": True, "gone": False}
    assert s.calls.count(("get_run", "lost")) == 1
    assert [c for c in s.calls if c[0] in ("log_batch", "set_terminated")] == [("log_batch", "r1", [("x", 1)])]
    err = capsys.readouterr().err
    assert err == (
        "warning: 3 spooled tracking writes of MLflow runs gone, lost not sent: the store does not know these "
        "runs, or they were deleted (the run folder's log.jsonl and eval.jsonl keep the metrics)\n"
    )


def test_nothing_dropped_says_nothing(tmp_path, capsys):
    s = Store("A", runs={"r1"})
    spooling.send(locked(s), [met("r1", 1, x=1.0)])
    assert capsys.readouterr().err == ""


def test_a_store_that_fails_reading_a_run_raises_and_forgets(tmp_path):
    s = Store("A", runs={"r1"})
    s.get_run_error = MlflowException("locked", error_code=TEMPORARILY_UNAVAILABLE)
    cache = SendCache()
    cache.have[("r9", "x")] = {1}
    with pytest.raises(MlflowException):
        spooling.send(locked(s), [met("r1", 1, x=1.0)], cache)
    assert cache.have == {} and cache.known == {}


def test_statuses_and_artifacts_are_sent_in_order_after_the_metrics_before_them(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "f.txt").write_text("x")
    s = Store("A", runs={"r1"})
    recs = [
        met("r1", 1, x=1.0),
        {"run_id": "r1", "uri": "A", "time": 7, "artifact": str(tmp_path / "d"), "artifact_path": "ck"},
        met("r1", 2, x=2.0),
        {"run_id": "r1", "uri": "A", "time": 8, "artifact": str(tmp_path / "f.txt")},
        {"run_id": "r1", "uri": "A", "time": 9, "artifact": str(tmp_path / "missing")},
        status("r1", "RUNNING"),
        met("r1", 3, x=3.0),
        status("r1", "KILLED", t=6001),
        status("r1", "FAILED", t=6002),
        status("r1", "FINISHED", t=6003),
    ]
    assert spooling.send(locked(s), recs) == 3
    assert [c for c in s.calls if c[0] not in ("get_run", "history")] == [
        ("log_batch", "r1", [("x", 1)]),
        ("log_artifacts", "r1", str(tmp_path / "d"), "ck"),
        ("log_batch", "r1", [("x", 2)]),
        ("log_artifact", "r1", str(tmp_path / "f.txt"), None),
        ("update_run", "r1", "RUNNING"),
        ("log_batch", "r1", [("x", 3)]),
        ("set_terminated", "r1", "KILLED", 6001),
        ("set_terminated", "r1", "FAILED", 6002),
        ("set_terminated", "r1", "FINISHED", 6003),
    ]
    assert capsys.readouterr().err == f"warning: {tmp_path / 'missing'} is gone: not sent to MLflow run r1\n"


def test_dataset_inputs_run_tags_and_experiment_tags_are_sent_in_their_place(tmp_path):
    s = Store("A", runs={"r1"})
    source = '{"uri": "/data/train.jsonl"}'
    recs = [
        met("r1", 1, x=1.0),
        {
            "run_id": "r1",
            "uri": "A",
            "time": 7,
            "inputs": [
                {
                    "dataset": {"name": "gsm8k", "digest": "d1", "source_type": "local", "source": source},
                    "tags": {"mlflow.data.context": "train", "n": 3},
                },
                {"dataset": {"name": "held", "digest": "d2", "source_type": "local", "source": source}},
            ],
        },
        met("r1", 2, x=2.0),
        {"run_id": "r1", "uri": "A", "time": 8, "tags": {"es.sigma": 0.05, "method": "es"}},
        {"run_id": "r1", "uri": "A", "time": 9, "experiment_tags": {"view": {"a": 1}, "n": 2}},
        met("r1", 3, x=3.0),
    ]
    assert spooling.send(locked(s), recs) == 3
    calls = [c for c in s.calls if c[0] != "history"]
    assert [c[0] for c in calls] == [
        "get_run", "log_batch", "log_inputs", "log_batch", "log_batch", "tags", "get_run",
        "set_experiment_tag", "set_experiment_tag", "log_batch",
    ]  # fmt: skip
    (_, rid, datasets) = calls[2]
    assert rid == "r1"
    assert [
        (d.dataset.name, d.dataset.digest, d.dataset.source_type, d.dataset.source, [(t.key, t.value) for t in d.tags])
        for d in datasets
    ] == [
        ("gsm8k", "d1", "local", source, [("mlflow.data.context", "train"), ("n", "3")]),
        ("held", "d2", "local", source, []),
    ]
    assert calls[5] == ("tags", "r1", [("es.sigma", "0.05"), ("method", "es")])
    assert calls[7:9] == [("set_experiment_tag", "0", "view", "{'a': 1}"), ("set_experiment_tag", "0", "n", "2")]
    assert [c[2] for c in calls if c[0] == "log_batch"] == [[("x", 1)], [("x", 2)], [], [("x", 3)]]


def test_a_batch_is_sent_in_chunks_of_a_thousand_points_with_their_values_times_and_steps(tmp_path):
    s = Store("A", runs={"r1"})
    recs = [met("r1", i, t=10_000 + i, **{f"k{j}": i + j / 10 for j in range(5)}) for i in range(500)]
    recs[7]["time"] = 10_007.9  # MLflow's times are integer ms
    recs[8]["step"] = "8"  # a step read back as text is still step 8
    assert spooling.send(locked(s), recs) == 2500
    assert [len(c[2]) for c in s.calls if c[0] == "log_batch"] == [1000, 1000, 500]
    assert s.points[("r1", "k3")][499] == (499.3, 10_499)
    assert s.points[("r1", "k0")][7] == (7.0, 10_007) and 8 in s.points[("r1", "k0")]
    assert all(isinstance(v, float) for v, _ in s.points[("r1", "k0")].values())


def test_a_value_spooled_as_an_integer_is_sent_as_a_float(tmp_path):
    s = Store("A", runs={"r1"})
    spooling.send(locked(s), [met("r1", 1, x=3)])
    ((value, _),) = s.points[("r1", "x")].values()
    assert value == 3.0 and type(value) is float


# ---------------------------------------------------------------------------------------------- the spool file


def test_lines_appended_while_a_send_is_in_flight_stay_and_the_rewrite_is_durable(tmp_path, monkeypatch):
    """The sender keeps what training appended meanwhile: the spool is rewritten to those lines (a tmp file,
    fsynced, renamed over it, then the folder fsynced: the recorded order)."""
    s = Store("A", runs={"r1"})
    sp = spool_with(tmp_path, [met("r1", 1, x=1.0)], extra_lines=["{torn\n"])
    late = met("r1", 2, x=2.0)
    real_log_batch = s.log_batch

    def log_batch(rid, **kw):
        sp.append(late)  # training goes on while the store is talked to
        real_log_batch(rid, **kw)

    s.log_batch = log_batch
    steps = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: (steps.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1]
    )
    monkeypatch.setattr(os, "replace", lambda a, b: (steps.append(("replace", str(a), str(b))), real_replace(a, b))[1])
    assert sp.send(Stores(s)) == 1
    assert sp.records() == [late]
    assert sp.path.read_text() == json.dumps(late, sort_keys=True) + "\n"
    tmp = str(tmp_path / f".{FILE}.{os.getpid()}.tmp")
    assert steps[-3:] == [("fsync", tmp), ("replace", tmp, str(sp.path)), ("fsync", str(tmp_path))]
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE, FILE + ".lock"]


def test_an_emptied_spool_is_truncated_and_fsynced_in_place(tmp_path, monkeypatch):
    s = Store("A", runs={"r1"})
    sp = spool_with(tmp_path, [met("r1", 1, x=1.0)])
    ino = sp.path.stat().st_ino
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    assert sp.send(Stores(s)) == 1
    assert sp.path.stat().st_ino == ino and sp.path.stat().st_size == 0
    assert synced == [str(sp.path)] and not sp.pending()


def test_a_spool_of_torn_lines_only_is_emptied_without_a_store(tmp_path):
    sp = spool_with(tmp_path, [], extra_lines=['{"run_id": 5}\n', "[1]\n", "{torn"])
    assert sp.records() == [] and sp._snapshot() == ([], 3)
    asked = []
    assert sp.send(lambda u: asked.append(u)) == 0
    assert asked == [] and sp.path.read_text() == ""


def test_an_empty_or_missing_spool_sends_nothing_and_asks_no_store(tmp_path):
    assert Spool(tmp_path / FILE).send(lambda u: pytest.fail("asked a store")) == 0
    assert not (tmp_path / FILE).exists()
    (tmp_path / FILE).write_text("")
    assert Spool(tmp_path / FILE).send(lambda u: pytest.fail("asked a store")) == 0


def test_records_read_the_file_handle_they_are_given(tmp_path):
    import io

    sp = spool_with(tmp_path, [{"run_id": "on-disk"}])
    given = io.StringIO('{"run_id": "given"}\n{torn\n')
    assert sp.records(given) == [{"run_id": "given"}] and sp._snapshot(given) == ([{"run_id": "given"}], 2)
    assert sp.records() == [{"run_id": "on-disk"}]


def test_pending_is_false_without_a_spool_a_folder_or_a_line(tmp_path):
    assert not Spool(tmp_path / FILE).pending()
    (tmp_path / "file").write_text("")
    assert not Spool(tmp_path / "file" / FILE).pending()  # the folder is a file
    (tmp_path / FILE).write_text("")
    assert not Spool(tmp_path / FILE).pending()
    (tmp_path / FILE).write_text("x")
    assert Spool(tmp_path / FILE).pending()


def test_append_writes_one_sorted_line_and_mends_a_torn_last_line(tmp_path, monkeypatch):
    sp = Spool(tmp_path / FILE)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    sp.append({"z": 1, "run_id": "r", "a": 2})
    assert sp.path.read_text() == '{"a": 2, "run_id": "r", "z": 1}\n'
    with open(sp.path, "a") as f:
        f.write('{"run_id": "r", "to')  # a crash mid-line
    sp.append({"run_id": "r2"})
    assert sp.path.read_text().splitlines() == [
        '{"a": 2, "run_id": "r", "z": 1}',
        '{"run_id": "r", "to',
        '{"run_id": "r2"}',
    ]
    assert sp.records() == [{"a": 2, "run_id": "r", "z": 1}, {"run_id": "r2"}]
    assert synced == [str(sp.path)] * 2


def test_an_append_that_waited_for_a_replaced_spool_writes_to_the_new_file(tmp_path, monkeypatch):
    """A sender replaced the spool (``_keep``) while this appender waited for the old file's lock: the appender
    opens the new file again, or its line would be lost with the old one."""
    sp = spool_with(tmp_path, [{"run_id": "old"}])
    real_flock = fcntl.flock
    replaced = []

    def flock(f, op):
        if op == fcntl.LOCK_EX and not replaced:
            replaced.append(True)
            new = tmp_path / "new"
            new.write_text('{"run_id": "kept"}\n')
            os.replace(new, sp.path)
        return real_flock(f, op)

    monkeypatch.setattr(spooling.fcntl, "flock", flock)
    sp.append({"run_id": "late"})
    assert [r["run_id"] for r in sp.records()] == ["kept", "late"]


def test_an_append_that_waited_for_a_deleted_spool_makes_a_new_one(tmp_path, monkeypatch):
    sp = spool_with(tmp_path, [{"run_id": "old"}])
    real_flock = fcntl.flock
    gone = []

    def flock(f, op):
        if op == fcntl.LOCK_EX and not gone:
            gone.append(True)
            sp.path.unlink()
        return real_flock(f, op)

    monkeypatch.setattr(spooling.fcntl, "flock", flock)
    sp.append({"run_id": "late"})
    assert sp.records() == [{"run_id": "late"}]


def test_an_interrupt_while_waiting_for_the_spool_lock_closes_the_file(tmp_path, monkeypatch):
    sp = spool_with(tmp_path, [{"run_id": "old"}])
    before = set(os.listdir("/proc/self/fd"))

    def flock(f, op):
        raise KeyboardInterrupt

    monkeypatch.setattr(spooling.fcntl, "flock", flock)
    with pytest.raises(KeyboardInterrupt):
        sp.append({"run_id": "late"})
    assert set(os.listdir("/proc/self/fd")) == before


def test_the_spool_locks_are_released_after_each_use(tmp_path):
    sp = spool_with(tmp_path, [{"run_id": "a"}])
    with sp.locked(), sp.sending():
        pass
    for path in (sp.path, sp.path.with_name(FILE + ".lock")):
        with open(path) as f:  # another open file description gets each at once: released
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_sender_lock_is_its_own_file_beside_the_spool(tmp_path):
    sp = Spool(tmp_path / FILE)
    with sp.sending():
        with open(tmp_path / (FILE + ".lock")) as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not sp.path.exists()  # sending alone does not make a spool


def test_spool_path_is_the_file_in_the_run_folder(tmp_path):
    assert spooling.spool_path(tmp_path) == tmp_path / "tracking.pending.jsonl"
    assert spooling.spool_path(str(tmp_path)) == tmp_path / FILE


# ---------------------------------------------------------------------------------------------- a replay


def test_a_replay_refuses_a_store_that_has_disappeared_and_keeps_the_spool(tmp_path, capsys):
    gone = tmp_path / "moved" / "mlflow.db"
    folder = tmp_path / "run"
    folder.mkdir()
    sp = spool_with(folder, [met("r1", 1, uri=f"sqlite:///{gone}", x=1.0)])
    before = sp.path.read_bytes()
    with pytest.raises(FileNotFoundError, match=rf"^no MLflow store at sqlite:///{gone} \(moved\?\)$"):
        pending._store_for(f"sqlite:///{gone}")
    assert pending.drain(folder) == 0
    assert sp.path.read_bytes() == before and not gone.exists() and not gone.parent.exists()  # no new, empty store
    assert capsys.readouterr().err == (
        f"warning: {sp.path}: spooled tracking writes not sent (FileNotFoundError: no MLflow store at "
        f"sqlite:///{gone} (moved?)); kept\n"
    )


def test_a_replay_drains_the_run_and_its_stage_folders_and_says_what_it_sent(tmp_path, monkeypatch, capsys):
    s = Store("A", runs={"r1", "r2"})
    monkeypatch.setattr(pending, "_store_for", Stores(s))
    run = tmp_path / "run"
    (run / "stage1").mkdir(parents=True)
    (run / "stage2").mkdir()
    (run / "deeper" / "x").mkdir(parents=True)
    spool_with(run, [met("r1", 1, x=1.0, y=1.0)])
    spool_with(run / "stage1", [met("r2", 1, x=1.0)])
    spool_with(run / "deeper" / "x", [met("r2", 9, x=1.0)])  # not a stage folder: not this run's
    (run / "stage2" / FILE).write_text("")
    assert pending.drain(run) == 3
    assert s.steps("r1", "x") == [1] and s.steps("r2", "x") == [1]
    assert capsys.readouterr().err == (
        f"note: {run / FILE}: sent 2 spooled metric points to MLflow\n"
        f"note: {run / 'stage1' / FILE}: sent 1 spooled metric points to MLflow\n"
    )
    assert pending.drain_all([run, tmp_path / "none"]) == 0


def test_a_folder_whose_own_spool_fails_still_drains_its_stages(tmp_path, monkeypatch, capsys):
    s = Store("A", runs={"r2"})
    monkeypatch.setattr(pending, "_store_for", Stores(s))
    (tmp_path / "stage1").mkdir()
    spool_with(tmp_path, [met("r1", 1, uri="sqlite:///gone.db", x=1.0)])
    spool_with(tmp_path / "stage1", [met("r2", 1, x=1.0)])
    assert pending.drain(tmp_path) == 1
    assert s.steps("r2", "x") == [1] and Spool(tmp_path / FILE).pending()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"warning: {tmp_path / FILE}: spooled tracking writes not sent (KeyError: ")
    assert err[1:] == [f"note: {tmp_path / 'stage1' / FILE}: sent 1 spooled metric points to MLflow"]


def test_a_run_folder_without_a_spool_of_its_own_still_drains_its_stages(tmp_path, monkeypatch):
    s = Store("A", runs={"r2"})
    monkeypatch.setattr(pending, "_store_for", Stores(s))
    for stage in ("stage1", "stage2"):
        (tmp_path / stage).mkdir()
    (tmp_path / "stage1" / FILE).write_text("")
    spool_with(tmp_path / "stage2", [met("r2", 1, x=1.0)])
    assert pending.drain(tmp_path) == 1 and s.steps("r2", "x") == [1]


def test_a_replay_into_another_store_sends_there(tmp_path, monkeypatch):
    s = Store("sqlite:///new.db", runs={"r1"})
    stores = Stores(s)
    monkeypatch.setattr(pending, "_store_for", stores)
    spool_with(tmp_path, [met("r1", 1, uri="sqlite:///old.db", x=1.0)])
    assert pending.drain(tmp_path, uri=s.name) == 1
    assert stores.asked == [s.name]


def test_a_replay_that_fails_goes_on_with_the_next_folder(tmp_path, monkeypatch, capsys):
    s = Store("A", runs={"r2"})
    monkeypatch.setattr(pending, "_store_for", Stores(s))
    for name, rid in (("a", "r1"), ("b", "r2")):
        (tmp_path / name).mkdir()
        spool_with(tmp_path / name, [met(rid, 1, x=1.0)])
    s.get_run_error = None
    real = s.get_run

    def get_run(rid):
        if rid == "r1":
            raise MlflowException("locked", error_code=TEMPORARILY_UNAVAILABLE)
        return real(rid)

    s.get_run = get_run
    assert pending.drain_all([tmp_path / "a", tmp_path / "b"]) == 1
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / 'a' / FILE}: spooled tracking writes not sent (MlflowException: locked); kept" in err
    assert len(Spool(tmp_path / "a" / FILE).records()) == 1 and not Spool(tmp_path / "b" / FILE).pending()


def test_a_store_that_exists_is_opened_with_its_writer_lock(tmp_path, monkeypatch):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"")
    made = []
    monkeypatch.setattr("mlflow.tracking.MlflowClient", lambda tracking_uri: made.append(tracking_uri) or "client")
    locks = []
    monkeypatch.setattr(pending, "sqlite_lock", lambda uri: locks.append(uri) or contextlib.nullcontext())
    client, lock = pending._store_for(f"sqlite:///{db}")
    assert client == "client" and made == [f"sqlite:///{db}"]
    with lock():
        pass
    assert locks == [f"sqlite:///{db}"]
    client, _ = pending._store_for("http://tracking:5000")  # a server: nothing on disk to check
    assert made[-1] == "http://tracking:5000"


# ---------------------------------------------------------------------------------------------- errors and retries


@pytest.mark.parametrize(
    "e, expected",
    [
        (MlflowException("locked", error_code=TEMPORARILY_UNAVAILABLE), True),
        (MlflowException("bad", error_code=INVALID_PARAMETER_VALUE), False),
        (MlflowException("nope", error_code=RESOURCE_DOES_NOT_EXIST), False),
        (OSError(errno.EIO, "io"), True),
        (ConnectionError("refused"), True),
        (sqlite3.OperationalError("database is locked"), True),
        (ValueError("a bug"), False),
        (KeyError("a bug"), False),
        (sqlite3.DatabaseError("file is not a database"), True),
        (ValueError("database disk image is malformed"), True),  # damaged: kept in the spool, not raised
    ],
)
def test_transient(e, expected):
    assert spooling.transient(e) is expected


@pytest.mark.parametrize("code", sorted(spooling.PERMANENT))
def test_every_permanent_mlflow_error_is_not_transient(code):
    e = Exception("x")
    e.error_code = code
    assert not spooling.transient(e)
    e.error_code = "SOMETHING_ELSE"
    assert spooling.transient(e)


def test_an_error_of_sqlalchemy_is_transient():
    e = type("OperationalError", (Exception,), {"__module__": "sqlalchemy.exc"})("locked")
    assert spooling.transient(e)
    assert not spooling.transient(type("E", (Exception,), {"__module__": "xsqlalchemy.exc"})("x"))


def test_damaged_finds_sqlites_words_anywhere_in_the_chain():
    assert spooling.damaged(ValueError("all fine")) is None
    assert spooling.damaged(ValueError("")) is None
    e = sqlite3.DatabaseError("odd words")
    e.sqlite_errorname = "SQLITE_NOTADB"
    assert spooling.damaged(e) == "odd words"
    e.sqlite_errorname = "SQLITE_CORRUPT"
    assert spooling.damaged(e) == "odd words"
    e.sqlite_errorname = "SQLITE_BUSY"
    assert spooling.damaged(e) is None
    outer = RuntimeError("(sqlite3.DatabaseError) file is not a database\n[SQL: SELECT 1]")
    assert spooling.damaged(outer) == "file is not a database"
    inner = sqlite3.DatabaseError("database disk image is malformed")
    wrapped = RuntimeError("wrapper")
    wrapped.orig = inner
    assert spooling.damaged(wrapped) == "database disk image is malformed"
    try:
        try:
            raise inner
        except sqlite3.DatabaseError as x:
            raise RuntimeError("while handling") from x
    except RuntimeError as r:
        assert spooling.damaged(r) == "database disk image is malformed"
    try:
        try:
            raise inner
        except sqlite3.DatabaseError:
            raise RuntimeError("during") from None
    except RuntimeError as r:
        assert r.__context__ is inner and spooling.damaged(r) == "database disk image is malformed"
    silent = sqlite3.DatabaseError("")
    silent.sqlite_errorname = "SQLITE_NOTADB"
    assert spooling.damaged(silent) == ""  # damaged, in no words
    second_line = RuntimeError("first line\nfile is not a database")
    assert spooling.damaged(second_line) is None  # only the first line of a message is read
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert spooling.damaged(a) is None  # a cycle ends


def test_retry_backs_off_then_raises_the_last_failure():
    sleeps = []
    tries = []

    def op(attempt):
        tries.append(attempt)
        raise MlflowException(f"locked {attempt}", error_code=TEMPORARILY_UNAVAILABLE)

    with pytest.raises(MlflowException, match="locked 3"):
        spooling.retry(op, sleeps.append, delays=(1.0, 2.0, 3.0))
    assert tries == [0, 1, 2, 3] and sleeps == [1.0, 2.0, 3.0]
    sleeps.clear()

    def third_time(attempt):
        if attempt < 2:
            raise OSError("down")
        return attempt * 10

    assert spooling.retry(third_time, sleeps.append) == 20 and sleeps == [2.0, 4.0]
    assert spooling.BACKOFF_S == (2.0, 4.0, 8.0, 16.0, 30.0)


@pytest.mark.parametrize(
    "e", [ValueError("a bug"), sqlite3.DatabaseError("file is not a database")], ids=["bug", "damaged"]
)
def test_retry_raises_a_bug_or_a_damaged_store_at_once(e):
    sleeps, tries = [], []

    def op(attempt):
        tries.append(attempt)
        raise e

    with pytest.raises(type(e)):
        spooling.retry(op, sleeps.append)
    assert tries == [0] and sleeps == []


def test_retry_with_no_delays_tries_once():
    with pytest.raises(OSError):
        spooling.retry(lambda a: (_ for _ in ()).throw(OSError("x")), pytest.fail, delays=())


def test_describe_gives_the_type_and_the_first_line_cut_at_200():
    assert spooling.describe(ValueError("one\ntwo")) == "ValueError: one"
    assert spooling.describe(KeyError()) == "KeyError: "
    assert spooling.describe(OSError("x" * 300)) == "OSError: " + "x" * 200


def test_the_store_error_for_a_damaged_sqlite_file_says_how_to_move_it_aside():
    err = TrackingStoreError("sqlite:////r/mlflow.db", sqlite3.DatabaseError("file is not a database"))
    assert str(err) == (
        "the MLflow store /r/mlflow.db is damaged (file is not a database): MLflow cannot read it. Nothing is lost: "
        "the run folders keep everything computed. Move the file aside (mv /r/mlflow.db /r/mlflow.db.damaged; "
        "`sqlite3 /r/mlflow.db.damaged .recover` may rescue its runs) and run again, which makes a new store there, "
        "or set tracking.uri to another store"
    )
    assert err.uri == "sqlite:////r/mlflow.db"


@pytest.mark.parametrize("uri, named", [("sqlite:////r/mlflow.db", "/r/mlflow.db"), ("http://h:5000", "http://h:5000")])
def test_the_store_error_for_a_store_that_did_not_answer(uri, named):
    err = TrackingStoreError(uri, MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE))
    assert str(err) == (
        f"the MLflow store {named} did not answer after 6 tries (MlflowException: database is locked). Nothing is "
        "lost: the run folders keep everything computed. If another process holds it (a long write on a busy "
        "disk) or the server is down, run again later; or set tracking.uri to another store"
    )
    assert err.uri == uri


def test_a_damaged_server_store_is_said_as_not_answering():
    err = TrackingStoreError("http://h", sqlite3.DatabaseError("file is not a database"))
    assert str(err).startswith("the MLflow store http://h did not answer after 6 tries (DatabaseError: file is not")


def test_pause_sleeps_the_seconds_asked(monkeypatch):
    slept = []
    monkeypatch.setattr(spooling.time, "sleep", slept.append)
    spooling.pause(2.5)
    assert slept == [2.5]


def test_the_send_cache_forgets_everything():
    c = SendCache()
    c.have[("r", "k")] = {1}
    c.known["r"] = True
    c.clear()
    assert c.have == {} and c.known == {}


def test_now_ms_is_the_anchor_clock(monkeypatch):
    monkeypatch.setattr(spooling._ANCHOR, "now_ms", lambda: 1234)
    assert spooling.now_ms() == 1234


def test_the_spool_constants():
    assert FILE == "tracking.pending.jsonl" and spooling.RETRY_EVERY_S == 60.0
    assert spooling.TERMINAL == {"FINISHED", "FAILED", "KILLED"}
    assert spooling.PERMANENT == {"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST", "INVALID_STATE"}
    assert Path(spooling.spool_path("/x")).name == FILE


def test_a_one_character_torn_spool_gets_its_newline_before_the_next_line(tmp_path):
    (tmp_path / FILE).write_text("{")
    sp = Spool(tmp_path / FILE)
    sp.append({"run_id": "r"})
    assert sp.path.read_text() == '{\n{"run_id": "r"}\n' and sp.records() == [{"run_id": "r"}]


def test_exactly_the_lines_read_are_dropped_after_a_send(tmp_path):
    """Lines read (an empty one and a torn one among them) are dropped after the send, and every line appended
    during it is kept whole."""
    s = Store("A", runs={"r1"})
    sp = Spool(tmp_path / FILE)
    sp.path.write_text("\n" + json.dumps(met("r1", 1, x=1.0)) + "\n{torn\n")
    late = [met("r1", 2, x=2.0), met("r1", 3, x=3.0)]
    real = s.log_batch

    def log_batch(rid, **kw):
        for r in late:
            sp.append(r)
        real(rid, **kw)

    s.log_batch = log_batch
    assert sp.send(Stores(s)) == 1
    assert sp.records() == late
    assert sp.path.read_text() == "".join(json.dumps(r, sort_keys=True) + "\n" for r in late)
