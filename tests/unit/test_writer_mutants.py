"""The run's tracking writer (esbatch/tracking/writer.py), pinned where planted faults survived the other tests
(issue 44 D6, mutmut 3.8.1): what logging appends, what one try says and counts, which store a record goes to,
what the end returns and says, and the thread's backoff. No MLflow store: the tracker is a stand-in whose client
is tests/unit/test_spool_mutants.py's ``Store``; the thread, where one runs, is waited for by the end itself."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import sys
import threading
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE
from test_spool_mutants import Store

from esbatch.tracking import writer as writing
from esbatch.tracking.spool import FILE, Spool
from esbatch.tracking.writer import TrackingWriter


class Tracker:
    """A started MLflowTracker's surface that the writer uses."""

    def __init__(self, folder: Path, store: Store, uri: str = "A") -> None:
        self.spool, self.run_id, self.uri, self.experiment_id = Spool(folder / FILE), "r1", uri, "7"
        self.client, self.t = store, 100
        self.locks = 0

    @contextlib.contextmanager
    def _lock(self):
        self.locks += 1
        self.client.locked = True
        try:
            yield
        finally:
            self.client.locked = False

    def _record(self, **what):
        self.t += 1
        return {"run_id": self.run_id, "uri": self.uri, "time": self.t, **what}

    def last_step(self, key):
        return {"reward/mean": 41}.get(key, -1)


class Down:
    """The store's writes raise ``error`` while ``left`` > 0 (counted down per try)."""

    def __init__(self, store: Store, error: Exception, left: int) -> None:
        self.error, self.left = error, left
        real = store.log_batch

        def log_batch(rid, **kw):
            if self.left:
                self.left -= 1
                raise self.error
            return real(rid, **kw)

        store.log_batch = log_batch


LOCKED = MlflowException("database is locked\nmore", error_code=TEMPORARILY_UNAVAILABLE)


@pytest.fixture
def tracker(tmp_path):
    return Tracker(tmp_path, Store("A", runs={"r1"}))


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv(writing.DEBUG_ENV, raising=False)
    monkeypatch.delenv(writing.END_WAIT_ENV, raising=False)


def test_a_writer_needs_a_started_tracker_with_a_spool(tracker):
    tracker.spool = None
    with pytest.raises(ValueError) as e:
        TrackingWriter(tracker, start=False)
    assert str(e.value) == "a TrackingWriter needs a started tracker with a spool"
    tracker.spool, tracker.run_id = Spool("x"), None
    with pytest.raises(ValueError):
        TrackingWriter(tracker, start=False)


def test_logging_appends_floats_without_none_and_never_calls_the_store(tracker, tmp_path):
    w = TrackingWriter(tracker, start=False)
    assert (w.spool, w.uri, w.run_id, w.experiment_id) == (tracker.spool, "A", "r1", "7")
    assert (w.failures, w.tries, w.error, w.outages, w.dead) == (0, 0, None, 0, None)
    w.log_metrics({"a": 1, "b": None, "c": 2.5}, step="3")
    w.log_metrics({"b": None}, step=4)  # nothing to log: no line
    (tmp_path / "ck").mkdir()
    w.log_artifact(tmp_path / "x" / ".." / "ck", "checkpoints")
    w.log_artifacts(tmp_path / "ck")
    assert w.spool.records() == [
        {"run_id": "r1", "uri": "A", "time": 101, "step": 3, "metrics": {"a": 1.0, "c": 2.5}},
        {"run_id": "r1", "uri": "A", "time": 102, "artifact": str(tmp_path / "ck"), "artifact_path": "checkpoints"},
        {"run_id": "r1", "uri": "A", "time": 103, "artifact": str(tmp_path / "ck"), "artifact_path": None},
    ]
    assert type(w.spool.records()[0]["metrics"]["a"]) is float
    w.log_inputs([])  # nothing to log: no line
    w.log_inputs([{"dataset": {"name": "d"}}])
    assert w.spool.records()[-1] == {"run_id": "r1", "uri": "A", "time": 104, "inputs": [{"dataset": {"name": "d"}}]}
    assert len(w.spool.records()) == 4
    assert tracker.client.calls == [] and w.last_step("reward/mean") == 41


def test_one_try_sends_the_spool_with_the_runs_own_client_and_lock(tracker):
    w = TrackingWriter(tracker, start=False)
    w.log_metrics({"x": 1.0}, step=1)
    w.log_metrics({"x": 2.0}, step=2)
    assert w.pump() is True
    assert tracker.client.steps("r1", "x") == [1, 2] and tracker.locks == 1 and not w.spool.pending()
    assert (w.tries, w.failures, w.error) == (1, 0, None)
    w.log_metrics({"x": 3.0}, step=3)
    assert w.pump() and w.tries == 2
    assert tracker.client.calls.count(("history", "r1", "x")) == 1  # what the store holds is remembered


def test_an_outage_is_counted_and_said_once_then_its_end_is_said(tracker, capsys):
    w = TrackingWriter(tracker, start=False)
    down = Down(tracker.client, LOCKED, 3)
    w.log_metrics({"x": 1.0}, step=1)
    for i in (1, 2, 3):
        assert w.pump() is False
        assert (w.tries, w.failures, w.outages, w.error) == (i, i, 1, LOCKED)
    err = capsys.readouterr().err
    assert err == (
        f"warning: tracking: the MLflow store A is unavailable (MlflowException: database is locked); training goes "
        f"on, its writes wait in {w.spool.path} and are sent when the store answers\n"
    )
    w.log_metrics({"x": 2.0}, step=2)
    assert w.pump() is True and down.left == 0
    assert (w.failures, w.error, w.outages) == (0, None, 1)
    assert capsys.readouterr().err == "note: tracking: the MLflow store A answers again: 2 waiting metric points sent\n"
    down.left = 1  # a second outage is said again
    w.log_metrics({"x": 3.0}, step=3)
    assert not w.pump() and w.outages == 2 and capsys.readouterr().err.count("is unavailable") == 1
    assert w.pump() and capsys.readouterr().err.startswith("note: tracking: the MLflow store A answers again: 1 ")
    assert w.pump() and capsys.readouterr().err == ""  # no outage, nothing said


def test_debug_prints_each_failures_traceback(tracker, capsys, monkeypatch):
    monkeypatch.setenv(writing.DEBUG_ENV, "1")
    w = TrackingWriter(tracker, start=False)
    Down(tracker.client, LOCKED, 2)
    w.log_metrics({"x": 1.0}, step=1)
    assert not w.pump() and not w.pump()
    err = capsys.readouterr().err
    assert err.count("Traceback (most recent call last)") == 2 and err.count("is unavailable") == 1


def test_after_the_end_a_failure_says_nothing(tracker, capsys, monkeypatch):
    monkeypatch.setenv(writing.DEBUG_ENV, "1")
    w = TrackingWriter(tracker, start=False)
    w._closed = True
    down = Down(tracker.client, LOCKED, 1)
    w.log_metrics({"x": 1.0}, step=1)
    assert not w.pump() and w.failures == 1 and w.outages == 0
    assert w.pump() and down.left == 0
    assert capsys.readouterr().err == ""


def test_a_bug_or_a_refused_request_raises_from_a_try(tracker):
    w = TrackingWriter(tracker, start=False)
    Down(tracker.client, MlflowException("bad", error_code=INVALID_PARAMETER_VALUE), 1)
    w.log_metrics({"x": 1.0}, step=1)
    with pytest.raises(MlflowException, match="bad"):
        w.pump()
    assert w.failures == 0 and w.error is None and w.spool.pending()


def test_a_record_of_another_store_goes_to_that_store(tracker, monkeypatch):
    made, locks = [], []
    other = Store("B", runs={"r9"})
    monkeypatch.setattr("mlflow.tracking.MlflowClient", lambda tracking_uri: made.append(tracking_uri) or other)

    @contextlib.contextmanager
    def lock(uri):
        locks.append(uri)
        other.locked = True
        yield
        other.locked = False

    monkeypatch.setattr(writing, "sqlite_lock", lock)
    w = TrackingWriter(tracker, start=False)
    client, own_lock = w._store("A")
    assert client is tracker.client and own_lock == tracker._lock
    w.spool.append({"run_id": "r9", "uri": "B", "time": 5, "step": 1, "metrics": {"y": 1.0}})
    w.log_metrics({"x": 1.0}, step=1)
    assert w.pump()
    assert made == ["B"] and locks == ["B"]
    assert other.steps("r9", "y") == [1] and tracker.client.steps("r1", "x") == [1]


def test_the_end_without_a_thread_leaves_everything_and_says_so(tracker, capsys):
    w = TrackingWriter(tracker, start=False)
    w.log_metrics({"x": 1.0}, step=1)
    assert w.end("FAILED", wait_s=0.5) is False
    assert w.spool.records()[-1] == {"run_id": "r1", "uri": "A", "time": 102, "status": "FAILED"}
    assert capsys.readouterr().err == (
        f"warning: tracking: 2 of this run's MLflow writes (its end, FAILED, among them) were not sent to A within "
        f"0.5 s; they stay in {w.spool.path}: `esbatch aggregate` (or a resume) sends them\n"
    )
    assert w._closed and tracker.client.calls == []


def test_the_end_says_the_wait_from_the_environment(tracker, capsys, monkeypatch):
    monkeypatch.setenv(writing.END_WAIT_ENV, "0")
    w = TrackingWriter(tracker, start=False)
    assert w.end() is False
    assert "writes (its end, FINISHED, among them) were not sent to A within 0 s;" in capsys.readouterr().err
    assert w.spool.records()[-1]["status"] == "FINISHED"


def test_the_thread_sends_everything_before_the_end_returns(tracker, capsys):
    w = TrackingWriter(tracker)
    for s in (1, 2, 3):
        w.log_metrics({"x": float(s)}, step=s)
    assert w.end("FINISHED", wait_s=600) is True
    assert tracker.client.steps("r1", "x") == [1, 2, 3]
    assert ("set_terminated", "r1", "FINISHED", 104) in tracker.client.calls
    assert not w.spool.pending() and capsys.readouterr().err == ""
    w._thread.join(60)
    assert not w._thread.is_alive() and w.dead is None


def test_a_writer_started_on_a_left_over_spool_wakes_to_send_it(tracker):
    tracker.spool.append({"run_id": "r1", "uri": "A", "time": 5, "step": 9, "metrics": {"x": 9.0}})
    assert TrackingWriter(tracker, start=False)._pending  # woken at once: nothing logged yet
    tracker.spool.path.write_text("")
    assert not TrackingWriter(tracker, start=False)._pending
    tracker.spool.append({"run_id": "r1", "uri": "A", "time": 5, "step": 9, "metrics": {"x": 9.0}})
    w = TrackingWriter(tracker)
    assert w.end(wait_s=600) is True and tracker.client.steps("r1", "x") == [9]


def test_the_thread_backs_off_after_a_failure_and_the_end_hurries_it(tracker):
    """One failed try (made here, before the thread starts); the thread then waits the first delay, an hour,
    unless the end asks it to hurry, which it does at once."""
    w = TrackingWriter(tracker, start=False, delays=(3600.0, 1.0))
    down = Down(tracker.client, LOCKED, 1)
    w.log_metrics({"x": 1.0}, step=1)
    assert not w.pump() and w.failures == 1
    waits = []
    real_wait_for = w._cond.wait_for

    def wait_for(pred, timeout=None):
        waits.append(timeout)
        return real_wait_for(pred, timeout=timeout)

    w._cond.wait_for = wait_for
    w._thread = threading.Thread(target=w._loop, daemon=True)
    w._thread.start()
    assert w.end(wait_s=600) is True and down.left == 0
    w._thread.join(600)
    assert waits == [3600.0, None]  # the backoff, then (the store answering) waiting for work until the end
    assert w.tries == 2 and tracker.client.steps("r1", "x") == [1] and not w._thread.is_alive()


def test_a_damaged_store_is_not_waited_for_past_one_try(tracker, capsys):
    w = TrackingWriter(tracker, delays=(3600.0,))
    Down(tracker.client, sqlite3.DatabaseError("file is not a database"), 10**6)
    w.log_metrics({"x": 1.0}, step=1)
    assert w.end(wait_s=3600) is False
    assert w.tries >= 1 and "were not sent to A within 3600 s" in capsys.readouterr().err


def test_a_bug_in_the_thread_ends_it_and_says_so(tracker, capsys):
    w = TrackingWriter(tracker)
    Down(tracker.client, MlflowException("refused", error_code=INVALID_PARAMETER_VALUE), 1)
    w.log_metrics({"x": 1.0}, step=1)
    assert w.end(wait_s=600) is False
    assert isinstance(w.dead, MlflowException)
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: tracking: sending to the MLflow store A stopped (MlflowException: refused); the writes stay in "
        f"{w.spool.path} (`esbatch aggregate` tries them again)\nTraceback"
    )
    assert not w._busy


@pytest.mark.parametrize(
    "raw, expected", [(None, 60.0), ("", 60.0), ("2.5", 2.5), ("-3", 0.0), ("abc", 60.0), ("0", 0.0)]
)
def test_end_wait_s(monkeypatch, raw, expected):
    if raw is not None:
        monkeypatch.setenv("ESBATCH_TRACKING_END_WAIT_S", raw)
    assert writing.end_wait_s() == expected
    assert writing.END_WAIT_S == 60.0


@pytest.mark.parametrize("raw, expected", [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)])
def test_debug(monkeypatch, raw, expected):
    if raw is not None:
        monkeypatch.setenv("ESBATCH_DEBUG", raw)
    assert writing.debug() is expected


def test_mlflows_store_tracebacks_are_dropped_unless_debug(monkeypatch):
    log = logging.getLogger("mlflow.store.db.utils")
    monkeypatch.setattr(log, "filters", [])
    writing.quiet_store_errors()
    writing.quiet_store_errors()
    assert log.filters == [writing._QUIET]
    plain = logging.LogRecord("n", logging.ERROR, "p", 1, "m", None, None)
    try:
        raise ValueError
    except ValueError:
        with_tb = logging.LogRecord("n", logging.ERROR, "p", 1, "m", None, sys.exc_info())
    assert writing._QUIET.filter(plain) and not writing._QUIET.filter(with_tb)
    monkeypatch.setenv(writing.DEBUG_ENV, "1")
    assert writing._QUIET.filter(with_tb)


def test_the_thread_is_a_daemon_named_for_tracking(tracker):
    w = TrackingWriter(tracker)
    try:
        assert w._thread.daemon and w._thread.name == "esbatch-tracking"
        assert w._thread in threading.enumerate()
    finally:
        w.end(wait_s=600)


def test_the_thread_sends_a_write_without_waiting_for_the_end_and_is_busy_while_it_does(tracker):
    """Woken by the write alone (not urgent): the test waits on the writer's own condition, bounded, for the spool
    to be empty; the store records that the writer said it was busy during the send."""
    busy = []
    real = tracker.client.log_batch

    def log_batch(rid, **kw):
        busy.append(w._busy)
        return real(rid, **kw)

    tracker.client.log_batch = log_batch
    w = TrackingWriter(tracker)
    w.log_metrics({"x": 1.0}, step=1)
    with w._cond:
        assert w._cond.wait_for(lambda: not w._busy and not w.spool.pending(), timeout=30)
    assert tracker.client.steps("r1", "x") == [1] and busy == [True] and not w._urgent
    assert w.end(wait_s=600) is True


def test_a_store_found_damaged_before_the_end_gets_one_more_try_at_the_end(tracker):
    """The end waits for a try of its own before giving up on a damaged store. The test holds the writer's
    condition while it calls end(), so the thread can try only while end() waits: an end that gave up on the
    earlier try's error would return with no new try."""
    w = TrackingWriter(tracker, start=False, delays=(3600.0,))
    Down(tracker.client, sqlite3.DatabaseError("file is not a database"), 10**6)
    w.log_metrics({"x": 1.0}, step=1)
    assert not w.pump() and w.tries == 1
    w._thread = threading.Thread(target=w._loop, daemon=True)
    w._thread.start()
    with w._cond:
        assert w.end(wait_s=600) is False
        assert w.tries == 2
    w._thread.join(600)


class StepClock:
    """The writer's monotonic clock: each reading half a second after the last (at most 1000 readings)."""

    def __init__(self) -> None:
        self.t, self.n = 100.0, 0

    def monotonic(self) -> float:
        self.n += 1
        assert self.n < 1000, "the end never stopped waiting"
        self.t += 0.5
        return self.t


def test_the_end_waits_in_steps_of_at_most_a_second_until_its_deadline(tracker, monkeypatch, capsys):
    """A store down for good (not damaged): the end waits ``wait_s`` by the writer's clock, in waits of at most
    1 s (another sender may empty the spool meanwhile), then gives up and says so. The clock is a stand-in and the
    waits return at once: nothing here takes time."""
    w = TrackingWriter(tracker, start=False, delays=(3600.0,))
    Down(tracker.client, LOCKED, 10**6)
    monkeypatch.setattr(writing, "time", StepClock())
    waits = []
    real_wait = w._cond.wait
    w._cond.wait = lambda timeout=None: waits.append(timeout) or real_wait(0)
    w._thread = threading.Thread(target=lambda: None)  # "alive" for the end's loop: started, never joined
    w._thread.is_alive = lambda: True
    w.log_metrics({"x": 1.0}, step=1)
    assert w.end("FAILED", wait_s=3) is False
    assert waits == [1.0, 1.0, 1.0, 1.0, 0.5]  # deadline 103.5: left 2.5, 2.0, 1.5, 1.0, 0.5, then 0
    assert w._closed and "were not sent to A within 3 s" in capsys.readouterr().err
