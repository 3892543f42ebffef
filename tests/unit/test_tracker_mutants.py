"""The MLflow tracker (esbatch/tracking/mlflow_tracker.py) against a stand-in store, pinned where planted faults
survived the other tests (issue 44 D6, mutmut 3.8.1): the experiment it opens or makes, the run it creates or
reopens, what each write sends on its first try and on a retry, when writes go to the spool and when the spool is
tried again, the end, and the small helpers (tags, the store lock, the digest). ``mlflow.tracking.MlflowClient``
is replaced by a client of ``Server``, which logs every call; clocks are injected, sleeps recorded."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

import esbatch
from esbatch.tracking import mlflow_tracker as mt
from esbatch.tracking.mlflow_tracker import MLflowTracker, NullTracker
from esbatch.tracking.spool import BACKOFF_S, FILE, RETRY_EVERY_S, Spool, TrackingStoreError

URI = "http://store"  # not sqlite: no file lock, no seeding
LOCKED = MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE)


class Server:
    """One store: experiments by name, runs by id, every call logged. ``down``: the number of calls still refused
    (``LOCKED``), or -1 for all; ``refuse``: {method: exception} raised by that method."""

    def __init__(self) -> None:
        self.experiments: dict[str, SimpleNamespace] = {}
        self.runs: dict[str, dict] = {}
        self.calls: list[tuple] = []
        self.down = 0
        self.refuse: dict[str, Exception] = {}

    def call(self, name, *args, **kw):
        self.calls.append((name, *args, *sorted(kw.items())))
        if name in self.refuse:
            raise self.refuse[name]
        if self.down:
            self.down -= self.down > 0
            raise LOCKED

    def names(self):
        return [c[0] for c in self.calls]


class Client:
    def __init__(self, server: Server) -> None:
        self.s = server

    def get_experiment_by_name(self, name):
        self.s.call("get_experiment_by_name", name)
        return self.s.experiments.get(name)

    def restore_experiment(self, exp_id):
        self.s.call("restore_experiment", exp_id)
        for e in self.s.experiments.values():
            if e.experiment_id == exp_id:
                e.lifecycle_stage = "active"

    def create_experiment(self, name, artifact_location=None):
        self.s.call("create_experiment", name, artifact_location=artifact_location)
        exp_id = str(len(self.s.experiments) + 10)
        self.s.experiments[name] = SimpleNamespace(experiment_id=exp_id, lifecycle_stage="active", name=name)
        return exp_id

    def create_run(self, exp_id, start_time=None, run_name=None, tags=None):
        self.s.call("create_run", exp_id, start_time=start_time, run_name=run_name, tags=tags)
        rid = f"run{len(self.s.runs) + 1}"
        self.s.runs[rid] = {"status": "RUNNING", "stage": "active", "metrics": {}, "params": [], "tags": {}}
        return SimpleNamespace(info=SimpleNamespace(run_id=rid))

    def get_run(self, rid):
        self.s.call("get_run", rid)
        if rid not in self.s.runs:
            raise MlflowException(f"Run '{rid}' not found", error_code=RESOURCE_DOES_NOT_EXIST)
        r = self.s.runs[rid]
        return SimpleNamespace(info=SimpleNamespace(lifecycle_stage=r["stage"], experiment_id="10"))

    def update_run(self, rid, status=None):
        self.s.call("update_run", rid, status=status)
        self.s.runs[rid]["status"] = status

    def set_terminated(self, rid, status=None, end_time=None):
        self.s.call("set_terminated", rid, status=status, end_time=end_time)
        self.s.runs[rid]["status"] = status

    def log_batch(self, rid, metrics=(), params=(), tags=()):
        self.s.call("log_batch", rid)
        r = self.s.runs[rid]
        r["params"].append([(p.key, p.value) for p in params])
        r["tags"].update({t.key: t.value for t in tags})
        for m in metrics:
            r["metrics"].setdefault(m.key, {})[m.step] = (m.value, m.timestamp)

    def get_metric_history(self, rid, key):
        self.s.call("get_metric_history", rid, key)
        return [SimpleNamespace(step=s) for s in sorted(self.s.runs[rid]["metrics"].get(key, {}))]

    def log_artifact(self, rid, path, artifact_path=None):
        self.s.call("log_artifact", rid, path, artifact_path)

    def log_artifacts(self, rid, path, artifact_path=None):
        self.s.call("log_artifacts", rid, path, artifact_path)

    def log_inputs(self, rid, datasets=None):
        self.s.call("log_inputs", rid)


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def server(monkeypatch):
    servers: dict[str, Server] = {URI: Server()}
    made: list[str] = []

    def client(tracking_uri):
        made.append(tracking_uri)
        return Client(servers.setdefault(tracking_uri, Server()))

    monkeypatch.setattr("mlflow.tracking.MlflowClient", client)
    servers[URI].made, servers[URI].servers = made, servers
    return servers[URI]


@pytest.fixture
def clock():
    return Clock()


def tracker(tmp_path, server, clock, sleeps=None, spool=True, uri=URI, **kw) -> MLflowTracker:
    return MLflowTracker(
        uri,
        "exp",
        spool=tmp_path / FILE if spool else None,
        sleep=(sleeps if sleeps is not None else []).append,
        clock=clock,
        wall=lambda: 1_700_000_000.0,
        **kw,
    )


def spooled(tmp_path) -> list[dict]:
    return Spool(tmp_path / FILE).records()


# ---------------------------------------------------------------------------------------------- the experiment


def test_a_new_experiment_is_created_with_no_location_for_a_server(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock, artifact_root=tmp_path / "art")
    assert tr.experiment_id == "10" and tr.run_id is None and tr.uri == URI
    assert server.calls == [
        ("get_experiment_by_name", "exp"),
        ("create_experiment", "exp", ("artifact_location", None)),
    ]
    assert server.made == [URI]


def test_a_sqlite_store_gets_the_artifact_root_as_its_location(tmp_path, server, clock, monkeypatch):
    monkeypatch.setattr(mt, "seed_sqlite", lambda db: None)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tracker(tmp_path, server, clock, uri=uri, artifact_root=tmp_path / "x" / ".." / "art")
    s = server.servers[uri]
    assert s.calls[1] == ("create_experiment", "exp", ("artifact_location", (tmp_path / "art").as_uri()))
    tracker(tmp_path / "b", server, clock, uri=f"sqlite:///{tmp_path / 'n.db'}")
    assert server.servers[f"sqlite:///{tmp_path / 'n.db'}"].calls[1] == (
        "create_experiment",
        "exp",
        ("artifact_location", None),
    )


def test_an_existing_experiment_is_used(tmp_path, server, clock, capsys):
    server.experiments["exp"] = SimpleNamespace(experiment_id="3", lifecycle_stage="active")
    assert tracker(tmp_path, server, clock).experiment_id == "3"
    assert server.names() == ["get_experiment_by_name"] and capsys.readouterr().err == ""


def test_a_deleted_experiment_is_restored_and_said(tmp_path, server, clock, capsys):
    server.experiments["exp"] = SimpleNamespace(experiment_id="3", lifecycle_stage="deleted")
    assert tracker(tmp_path, server, clock).experiment_id == "3"
    assert server.calls == [("get_experiment_by_name", "exp"), ("restore_experiment", "3")]
    assert capsys.readouterr().err == (
        f"warning: MLflow experiment 'exp' in {URI} was deleted; restored it (and its runs) to log this run. Delete "
        "it again afterwards, or set tracking.experiment to log elsewhere\n"
    )


def test_an_experiment_created_meanwhile_by_another_process_is_used(tmp_path, server, clock):
    def raced(name, artifact_location=None):
        server.experiments[name] = SimpleNamespace(experiment_id="77", lifecycle_stage="active")
        raise MlflowException("already exists", error_code=INVALID_PARAMETER_VALUE)

    real_client = Client.create_experiment
    Client.create_experiment = lambda self, name, artifact_location=None: raced(name)
    try:
        assert tracker(tmp_path, server, clock).experiment_id == "77"
    finally:
        Client.create_experiment = real_client


def test_a_store_that_never_answers_is_a_store_error_after_every_try(tmp_path, server, clock):
    server.down = -1
    sleeps: list[float] = []
    with pytest.raises(TrackingStoreError) as e:
        tracker(tmp_path, server, clock, sleeps)
    assert sleeps == list(BACKOFF_S) and server.names().count("get_experiment_by_name") == 6
    assert e.value.uri == URI and isinstance(e.value.__cause__, MlflowException)
    assert f"the MLflow store {URI} did not answer after 6 tries (MlflowException: database is locked)" in str(e.value)


def test_a_bug_opening_the_store_raises_as_itself(tmp_path, server, clock):
    server.refuse["get_experiment_by_name"] = ValueError("a bug")
    with pytest.raises(ValueError, match="a bug"):
        tracker(tmp_path, server, clock)


def test_a_store_that_answers_on_the_third_try(tmp_path, server, clock):
    server.down = 2
    sleeps: list[float] = []
    assert tracker(tmp_path, server, clock, sleeps).experiment_id == "10"
    assert sleeps == [2.0, 4.0]


# ---------------------------------------------------------------------------------------------- the run


def test_a_new_run_with_its_start_name_tags_and_params_in_batches(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    clock.t += 2.5
    params = {f"p{i:03d}": i for i in range(230)}
    params["long"] = "x" * 7000
    assert tr.start("r", params, {"host": "h"}) == "run1" and tr.run_id == "run1"
    create = [c for c in server.calls if c[0] == "create_run"]
    assert create == [
        ("create_run", "10", ("run_name", "r"), ("start_time", 1_700_000_002_500), ("tags", {"host": "h"}))
    ]
    batches = server.runs["run1"]["params"]
    assert [len(b) for b in batches] == [100, 100, 31]
    flat = dict(p for b in batches for p in b)
    assert flat["p007"] == "7" and flat["long"] == "x" * 6000 and len(flat) == 231


def test_a_run_whose_create_landed_then_failed_is_not_created_twice(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    real = Client.log_batch
    left = [1]

    def flaky(self, rid, **kw):
        if left[0]:
            left[0] -= 1
            raise LOCKED
        return real(self, rid, **kw)

    Client.log_batch = flaky
    try:
        assert tr.start("r", {"a": 1}, {}) == "run1"
    finally:
        Client.log_batch = real
    assert server.names().count("create_run") == 1 and server.runs["run1"]["params"] == [[("a", "1")]]


def test_a_resumed_run_is_reopened_running_with_its_tags(tmp_path, server, clock, capsys):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    server.runs["run1"]["status"] = "FAILED"
    tr2 = tracker(tmp_path, server, clock)
    n = len(server.calls)
    assert tr2.start("r", {"a": 1}, {"k": 5}, run_id="run1") == "run1" and tr2.run_id == "run1"
    assert server.calls[n:] == [
        ("get_run", "run1"),
        ("update_run", "run1", ("status", "RUNNING")),
        ("log_batch", "run1"),
    ]
    assert server.runs["run1"]["tags"] == {"k": "5"} and server.runs["run1"]["params"][-1] == []
    assert capsys.readouterr().err == ""


def test_a_resume_sends_the_spool_first_and_its_running_status_after_what_stays(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    sp = Spool(tmp_path / FILE)
    sp.append({"run_id": "run1", "uri": URI, "time": 5, "status": "FAILED"})  # a crashed process's end
    tr2 = tracker(tmp_path, server, clock)
    tr2.start("r", {}, {}, run_id="run1")
    names = server.names()
    assert names.index("set_terminated") < names.index("update_run")  # the old end first, then RUNNING
    assert server.runs["run1"]["status"] == "RUNNING" and not sp.pending()


def test_a_resume_whose_spool_could_not_be_sent_appends_running_after_it(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    sp = Spool(tmp_path / FILE)
    sp.append({"run_id": "run1", "uri": "http://gone", "time": 5, "status": "FAILED"})
    server.servers["http://gone"] = Server()
    server.servers["http://gone"].down = -1
    tr2 = tracker(tmp_path, server, clock)
    tr2.start("r", {}, {}, run_id="run1")
    assert [r.get("status") for r in sp.records()] == ["FAILED", "RUNNING"]
    assert sp.records()[-1] == {"run_id": "run1", "uri": URI, "time": 1_700_000_000_000, "status": "RUNNING"}


@pytest.mark.parametrize("how", ["missing", "deleted"])
def test_a_resumed_run_the_store_cannot_log_to_becomes_a_new_run(tmp_path, server, clock, capsys, how):
    tr = tracker(tmp_path, server, clock)
    if how == "deleted":
        tr.start("r", {}, {})
        server.runs["run1"]["stage"] = "deleted"
        capsys.readouterr()
    rid = "run1" if how == "deleted" else "nope"
    tr = tracker(tmp_path, server, clock)  # the resumed process's tracker
    assert tr.start("r", {"a": 1}, {}, run_id=rid) == ("run2" if how == "deleted" else "run1")
    why = f"was deleted from {URI}" if how == "deleted" else f"is not in {URI} (a moved run folder or another store)"
    assert capsys.readouterr().err == (
        f"warning: MLflow run {rid} {why}; logging the resumed run as a new MLflow run\n"
    )


def test_a_busy_store_on_resume_is_tried_again_not_taken_for_a_missing_run(tmp_path, server, clock, capsys):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    server.refuse["get_run"] = LOCKED
    sleeps: list[float] = []
    tr2 = tracker(tmp_path, server, clock, sleeps)
    with pytest.raises(TrackingStoreError):
        tr2.start("r", {}, {}, run_id="run1")
    assert "logging the resumed run as a new MLflow run" not in capsys.readouterr().err
    assert sleeps == list(BACKOFF_S) and server.names().count("create_run") == 1


# ---------------------------------------------------------------------------------------------- writes


def test_a_metric_write_is_one_batch_at_the_anchored_time(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    n = len(server.calls)
    clock.t += 1.25
    tr.log_metrics({"a": 1, "b": None, "c": 0.5}, step="3")
    tr.log_metrics({"b": None}, step=4)  # nothing to send
    assert server.calls[n:] == [("log_batch", "run1")]  # the first try reads nothing back
    assert server.runs["run1"]["metrics"] == {"a": {3: (1.0, 1_700_000_001_250)}, "c": {3: (0.5, 1_700_000_001_250)}}
    assert not (tmp_path / FILE).exists() or not Spool(tmp_path / FILE).pending()


def test_a_retried_metric_write_skips_the_steps_that_landed(tmp_path, server, clock):
    sleeps: list[float] = []
    tr = tracker(tmp_path, server, clock, sleeps)
    tr.start("r", {}, {})
    server.down = 1
    n = len(server.calls)
    tr.log_metrics({"a": 1.0}, step=1)
    assert sleeps == [2.0]
    assert [c[0] for c in server.calls[n:]] == ["log_batch", "get_run", "get_metric_history", "log_batch"]


def test_artifacts_inputs_and_the_end_are_sent(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    n = len(server.calls)
    tr.log_artifact(tmp_path / "x" / ".." / "f", "a")
    tr.log_artifacts(tmp_path / "d")
    tr.log_inputs([])
    tr.log_inputs([{"dataset": {"name": "d", "digest": "1", "source_type": "code", "source": "{}"}}])
    clock.t += 3
    tr.end("KILLED")
    assert [c for c in server.calls[n:] if c[0] not in ("get_run",)] == [
        ("log_artifact", "run1", str(tmp_path / "f"), "a"),
        ("log_artifacts", "run1", str(tmp_path / "d"), None),
        ("log_inputs", "run1"),
        ("set_terminated", "run1", ("end_time", 1_700_000_003_000), ("status", "KILLED")),
    ]


def test_the_end_of_a_run_never_started_sends_nothing(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    n = len(server.calls)
    tr.end()
    assert server.calls[n:] == [] and not (tmp_path / FILE).exists()


def test_a_refused_write_is_spooled_said_once_and_retried_a_minute_later(tmp_path, server, clock, capsys):
    sleeps: list[float] = []
    tr = tracker(tmp_path, server, clock, sleeps)
    tr.start("r", {}, {})
    server.down = -1
    tr.log_metrics({"a": 1.0}, step=1)
    assert sleeps == list(BACKOFF_S) and [r["step"] for r in spooled(tmp_path)] == [1]
    assert capsys.readouterr().err == (
        f"warning: the MLflow store {URI} is unavailable (MlflowException: database is locked); training goes on, "
        f"tracking writes are kept in {tmp_path / FILE} and sent when it answers again\n"
    )
    n = len(server.calls)
    clock.t += RETRY_EVERY_S - 1
    tr.log_metrics({"a": 2.0}, step=2)
    assert server.calls[n:] == [] and len(spooled(tmp_path)) == 2  # not tried again within the minute
    clock.t += 1
    tr.log_metrics({"a": 3.0}, step=3)
    assert len(server.calls) == n + 1 and len(spooled(tmp_path)) == 3  # one try, no backoff
    assert sleeps == list(BACKOFF_S) and capsys.readouterr().err == ""
    server.down = 0
    clock.t += RETRY_EVERY_S
    tr.log_metrics({"a": 4.0}, step=4)
    assert sorted(server.runs["run1"]["metrics"]["a"]) == [1, 2, 3, 4] and spooled(tmp_path) == []
    assert capsys.readouterr().err == f"note: the MLflow store {URI} answers again: 4 spooled metric points sent\n"
    n = len(server.calls)
    tr.log_metrics({"a": 5.0}, step=5)  # back to direct writes
    assert server.calls[n:] == [("log_batch", "run1")]


def test_without_a_spool_a_refused_write_raises(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock, spool=False)
    tr.start("r", {}, {})
    server.down = -1
    with pytest.raises(MlflowException):
        tr.log_metrics({"a": 1.0}, step=1)
    assert not (tmp_path / FILE).exists()


def test_a_refused_request_raises_and_is_not_spooled(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    server.refuse["log_batch"] = MlflowException("bad", error_code=INVALID_PARAMETER_VALUE)
    with pytest.raises(MlflowException, match="bad"):
        tr.log_metrics({"a": 1.0}, step=1)
    assert spooled(tmp_path) == []


def test_the_end_while_spooling_sends_with_the_full_backoff_or_says_what_stays(tmp_path, server, clock, capsys):
    sleeps: list[float] = []
    tr = tracker(tmp_path, server, clock, sleeps)
    tr.start("r", {}, {})
    server.down = -1
    tr.log_metrics({"a": 1.0}, step=1)
    capsys.readouterr()
    sleeps.clear()
    tr.end("FAILED")
    assert sleeps == list(BACKOFF_S)
    assert [r.get("status") for r in spooled(tmp_path)] == [None, "FAILED"]
    assert capsys.readouterr().err == (
        f"warning: the run's MLflow writes (its end, FAILED) stay in {tmp_path / FILE}: `esbatch aggregate` or a "
        "resume sends them\n"
    )
    server.down = 0
    tr.end("FINISHED")  # the store answers: all of it goes, the end last
    assert server.runs["run1"]["status"] == "FINISHED" and spooled(tmp_path) == []


def test_a_bug_while_draining_raises(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    Spool(tmp_path / FILE).append({"run_id": "run1", "uri": URI, "time": 1, "step": 1, "metrics": {"a": 1.0}})
    server.refuse["get_metric_history"] = MlflowException("bad", error_code=INVALID_PARAMETER_VALUE)
    with pytest.raises(MlflowException, match="bad"):
        tr.end()


def test_spooled_writes_of_another_store_go_there(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    other = server.servers.setdefault("http://other", Server())
    Client(other).create_run("1")
    Spool(tmp_path / FILE).append(
        {"run_id": "run1", "uri": "http://other", "time": 1, "step": 1, "metrics": {"b": 1.0}}
    )
    tr.log_metrics({"a": 1.0}, step=1)  # a pending spool: this write goes after it
    assert other.runs["run1"]["metrics"] == {"b": {1: (1.0, 1)}}
    assert server.runs["run1"]["metrics"]["a"][1][0] == 1.0 and "b" not in server.runs["run1"]["metrics"]


# ---------------------------------------------------------------------------------------------- last_step


def test_last_step_is_the_largest_in_the_store_or_the_spool(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    assert tr.start("r", {}, {}) == "run1"
    assert tr.last_step("a") == -1
    tr.log_metrics({"a": 1.0}, step=4)
    tr.log_metrics({"a": 1.0}, step=2)
    assert tr.last_step("a") == 4 and tr.last_step("b") == -1
    server.down = -1
    assert tr.last_step("a") == -1  # the store cannot be read: later writes go through the spool
    tr.log_metrics({"a": 1.0, "b": 2.0}, step=9)
    Spool(tmp_path / FILE).append({"run_id": "other", "uri": URI, "time": 1, "step": 99, "metrics": {"a": 1.0}})
    Spool(tmp_path / FILE).append({"run_id": "run1", "uri": URI, "time": 1, "status": "RUNNING"})  # no metrics
    assert tr.last_step("a") == 9 and tr.last_step("b") == 9 and tr.last_step("c") == -1


def test_last_step_sends_the_spool_first(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    Spool(tmp_path / FILE).append({"run_id": "run1", "uri": URI, "time": 1, "step": 7, "metrics": {"a": 1.0}})
    assert tr.last_step("a") == 7 and not Spool(tmp_path / FILE).pending()


def test_last_step_without_a_spool_raises_when_the_store_cannot_be_read(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock, spool=False)
    tr.start("r", {}, {})
    server.down = -1
    with pytest.raises(MlflowException):
        tr.last_step("a")


def test_last_step_raises_a_bug(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    server.refuse["get_metric_history"] = ValueError("bug")
    with pytest.raises(ValueError):
        tr.last_step("a")


# ---------------------------------------------------------------------------------------------- helpers


def test_the_null_tracker_does_nothing():
    n = NullTracker()
    assert n.experiment_id is None and n.run_id is None
    assert n.start("r", {}, {}) is None and n.last_step("k") == -1
    assert n.log_metrics({"a": 1}, 1) is None and n.log_artifact("x") is None and n.log_artifacts("x") is None
    assert n.log_inputs([{}]) is None and n.end() is None


def test_tags_and_the_default_store(tmp_path, monkeypatch):
    assert mt.parent_tag("p1") == {"mlflow.parentRunId": "p1"} and mt.parent_tag(None) == {} and mt.parent_tag("") == {}
    assert mt.point_tags({"es.sigma": 0.05, 3: True}) == {"es.sigma": "0.05", "3": "True"}
    monkeypatch.chdir(tmp_path)
    assert mt.default_tracking_uri("out") == f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"
    tags = mt.run_tags()
    assert set(tags) == {"git_commit", "host", "esbatch_version"} and tags["esbatch_version"] == esbatch.__version__
    assert tags["git_commit"] == mt._git_commit() == mt.git_commit(Path(esbatch.__file__).resolve().parent)


def test_the_problems_digest_is_the_first_16_hex_of_the_compact_json():
    rows = [("What is 1+1?", "2"), ("Ünïcode", "é")]
    assert mt.DIGEST_LEN == 16
    assert mt.problems_digest(rows) == "1ef154f05120863a"
    assert mt.problems_digest(rows[::-1]) != mt.problems_digest(rows) and len(mt.problems_digest([])) == 16


def test_the_store_lock_is_held_while_its_block_runs_and_seeds_the_store(tmp_path, monkeypatch):
    seeded = []
    monkeypatch.setattr(mt, "seed_sqlite", seeded.append)
    db = tmp_path / "new" / "m.db"
    with mt.sqlite_lock(f"sqlite:///{db}"):
        assert seeded == [db]
        with open(db.with_name("m.db.lock")) as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(db.with_name("m.db.lock")) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    with mt.sqlite_lock("http://server"):
        pass
    assert seeded == [db] and sorted(p.name for p in db.parent.iterdir()) == ["m.db.lock"]


def test_log_artifacts_to_checks_the_run_then_sends(tmp_path, server, monkeypatch):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    Client(server).create_run("1")
    mt.log_artifacts_to(URI, "run1", tmp_path, "analysis")
    assert server.calls[-2:] == [("get_run", "run1"), ("log_artifacts", "run1", str(tmp_path), "analysis")]
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0" and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "10"
    with pytest.raises(MlflowException):
        mt.log_artifacts_to(URI, "nope", tmp_path)
    assert server.calls[-1] == ("get_run", "nope")


def test_the_tracker_turns_off_mlflows_progress_bar(tmp_path, server, clock, monkeypatch):
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    tracker(tmp_path, server, clock)
    assert os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "false"


def test_a_record_names_run_store_and_time(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    clock.t += 0.5
    assert tr._record(x=1) == {"run_id": "run1", "uri": URI, "time": 1_700_000_000_500, "x": 1}
    assert json.dumps(tr._record())  # plain JSON


def test_a_worktree_whose_git_folder_path_holds_the_word_gitdir(tmp_path):
    """Only the first ``gitdir:`` of a worktree's .git file is its key: the rest is the path."""
    git = tmp_path / "gitdir: x" / "wt-git"
    git.mkdir(parents=True)
    (git / "HEAD").write_text("c" * 40 + "\n")
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / ".git").write_text(f"gitdir: {git}\n")
    assert mt.git_commit(wt) == "c" * 40


def test_a_hub_dataset_source_names_its_split_and_revision():
    s = mt.dataset_source(hub_id="openai/gsm8k", hub_config="main", hub_split="test", revision="abc")
    d = s.to_dict()
    assert (d["path"], d["config_name"], d["split"], d["revision"]) == ("openai/gsm8k", "main", "test", "abc")


def test_a_generated_dataset_source_names_its_generator_as_text():
    s = mt.dataset_source(generator={"task": "countdown", "params": {"n": 3}, "seed": 7, "none": None})
    assert s.to_dict() == {
        "tags": {"esbatch.task": "countdown", "esbatch.params": '{"n": 3}', "esbatch.seed": "7", "esbatch.none": "null"}
    }
    assert mt.dataset_source().to_dict() == {"tags": {}}


def test_only_mlflows_user_warning_about_local_sources_is_silenced(tmp_path, monkeypatch):
    import warnings

    import mlflow.data.dataset_source_registry as registry

    real = registry.resolve_dataset_source

    def noisy(path):
        warnings.warn("picked one of two", UserWarning, stacklevel=1)
        warnings.warn("something else", FutureWarning, stacklevel=1)
        return real(path)

    monkeypatch.setattr(registry, "resolve_dataset_source", noisy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mt.dataset_source(data_path=str(tmp_path / "x" / ".." / "p.jsonl"))
    assert [(w.category, str(w.message)) for w in seen] == [(FutureWarning, "something else")]


def test_log_artifacts_keeps_its_artifact_path(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    tr.log_artifacts(tmp_path, "sub")
    assert server.calls[-1] == ("log_artifacts", "run1", str(tmp_path), "sub")


def test_a_head_ref_without_a_space_and_an_empty_ref_file(tmp_path):
    git = tmp_path / "r" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref:refs/heads/main\n")  # git reads "ref:" with or without the space
    (git / "refs" / "heads" / "main").write_text("d" * 40 + "\n")
    assert mt.git_commit(tmp_path / "r") == "d" * 40
    (git / "refs" / "heads" / "main").write_text("\n")  # a ref being written
    assert mt.git_commit(tmp_path / "r") == "unknown"


def test_last_step_sends_the_spool_even_within_the_minute_between_tries(tmp_path, server, clock, capsys):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    server.down = -1
    tr.log_metrics({"a": 1.0}, step=3)  # refused: spooled, the store not tried again for a minute
    server.down = 0
    assert tr.last_step("a") == 3
    assert not Spool(tmp_path / FILE).pending() and server.runs["run1"]["metrics"]["a"] == {3: (1.0, 1_700_000_000_000)}


def test_last_step_says_why_the_store_could_not_be_read(tmp_path, server, clock, capsys):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    server.down = -1
    assert tr.last_step("a") == -1
    assert capsys.readouterr().err == (
        f"warning: the MLflow store {URI} is unavailable (MlflowException: database is locked); training goes on, "
        f"tracking writes are kept in {tmp_path / FILE} and sent when it answers again\n"
    )


def test_the_spool_is_not_tried_within_the_minute_and_says_so(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    server.down = -1
    tr.log_metrics({"a": 1.0}, step=1)
    server.down = 0
    n = len(server.calls)
    assert tr._drain() is False and server.calls[n:] == []  # not yet: nothing tried, not empty
    clock.t += RETRY_EVERY_S
    assert tr._drain() is True and not Spool(tmp_path / FILE).pending()


def test_a_spool_left_by_another_process_that_cannot_be_sent_at_the_end_says_why(tmp_path, server, clock, capsys):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    Spool(tmp_path / FILE).append({"run_id": "run1", "uri": URI, "time": 1, "step": 1, "metrics": {"a": 1.0}})
    server.down = -1
    tr.end("FAILED")
    assert capsys.readouterr().err == (
        f"warning: the MLflow store {URI} is unavailable (MlflowException: database is locked); training goes on, "
        f"tracking writes are kept in {tmp_path / FILE} and sent when it answers again\n"
        f"warning: the run's MLflow writes (its end, FAILED) stay in {tmp_path / FILE}: `esbatch aggregate` or a "
        "resume sends them\n"
    )


def test_the_end_by_default_is_finished_and_sent_directly(tmp_path, server, clock):
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    tr.end()
    assert server.calls[-1] == ("set_terminated", "run1", ("end_time", 1_700_000_000_000), ("status", "FINISHED"))
    assert not (tmp_path / FILE).exists()  # the spool was never needed
    bare = tracker(tmp_path / "b", server, clock, spool=False)
    bare.start("r", {}, {})
    bare.end("FAILED")
    assert server.calls[-1] == ("set_terminated", "run2", ("end_time", 1_700_000_000_000), ("status", "FAILED"))


def test_a_spool_left_over_is_sent_at_the_first_write_even_at_a_clock_reading_under_one(tmp_path, server, clock):
    clock.t = 0.5  # a monotonic clock read just after boot
    tr = tracker(tmp_path, server, clock)
    tr.start("r", {}, {})
    Spool(tmp_path / FILE).append({"run_id": "run1", "uri": URI, "time": 1, "step": 1, "metrics": {"a": 1.0}})
    tr.log_metrics({"a": 2.0}, step=2)
    assert sorted(server.runs["run1"]["metrics"]["a"]) == [1, 2] and not Spool(tmp_path / FILE).pending()
