"""The run's tracking writer (esbatch/tracking/writer.py, issue 44 D1, D2): logging only appends to the run
folder's spool, a thread sends it, an outage prints one line and no traceback (``--debug``: the tracebacks), the end
waits a bounded time and leaves the rest to `esbatch aggregate`, and a hang records the run as failed. The thread
is not started where a test drives ``pump`` itself: nothing here depends on timing."""

from __future__ import annotations

import json
import logging

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE
from mlflow.tracking import MlflowClient
from store_outage import Outage

from esbatch.config import config_from_dict
from esbatch.tracking import MLflowTracker, TrackingWriter, spool_path
from esbatch.tracking.pending import drain
from esbatch.tracking.writer import quiet_store_errors
from esbatch.train.lifecycle import RunSession


@pytest.fixture
def writer(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    tr = MLflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t", spool=spool_path(tmp_path / "run"), sleep=None)
    tr.start("r", {}, {})
    w = TrackingWriter(tr, start=False)
    w.store = Outage(monkeypatch, tr.client, down=False)
    return w


def steps(w: TrackingWriter, key: str = "reward/mean") -> list[int]:
    return sorted(m.step for m in MlflowClient(w.uri).get_metric_history(w.run_id, key))


def spooled(w: TrackingWriter) -> list[dict]:
    return [json.loads(line) for line in w.spool.path.read_text().splitlines()] if w.spool.path.exists() else []


def test_logging_makes_no_store_call_and_the_writer_sends_each_step_once(writer):
    for s in (1, 2, 3):
        writer.log_metrics({"reward/mean": s / 10, "loss": -s}, step=s)
    writer.log_artifact(writer.spool.path)
    assert writer.store.calls == 0 and len(spooled(writer)) == 4
    assert writer.pump() and writer.store.calls > 0
    assert steps(writer) == steps(writer, "loss") == [1, 2, 3] and spooled(writer) == []
    writer.log_metrics({"reward/mean": 0.4}, step=4)
    assert writer.pump() and steps(writer) == [1, 2, 3, 4]


def test_an_outage_prints_one_line_and_no_traceback_and_debug_shows_them(writer, capsys, monkeypatch):
    writer.store.down = True
    for s in (1, 2, 3):
        writer.log_metrics({"reward/mean": s}, step=s)
        assert not writer.pump()
    err = capsys.readouterr().err
    assert err.count("is unavailable") == 1 and err.count("\n") == 1 and "Traceback" not in err
    writer.store.down = False
    assert writer.pump()
    assert capsys.readouterr().err.count("answers again: 3 waiting metric points sent") == 1
    writer.store.down = True  # a second outage: a second line
    monkeypatch.setenv("ESBATCH_DEBUG", "1")
    writer.log_metrics({"reward/mean": 4}, step=4)
    assert not writer.pump()
    err = capsys.readouterr().err
    assert err.count("is unavailable") == 1 and "Traceback (most recent call last)" in err
    assert writer.outages == 2
    writer.store.down = False
    assert writer.pump() and steps(writer) == [1, 2, 3, 4]


def test_mlflows_own_store_tracebacks_are_dropped_unless_debug(caplog, monkeypatch):
    quiet_store_errors()
    log = logging.getLogger("mlflow.store.db.utils")
    for debug in ("", "1"):
        monkeypatch.setenv("ESBATCH_DEBUG", debug)
        try:
            raise RuntimeError("database is locked")
        except RuntimeError:
            log.exception("SQLAlchemy database error")
    assert [r.getMessage() for r in caplog.records if r.name == log.name] == ["SQLAlchemy database error"]


def test_writes_appended_while_a_send_is_in_flight_stay_for_the_next_send(writer, monkeypatch):
    real = writer.tracker.client.log_batch
    appended: list[int] = []

    def append_meanwhile(run_id, **kw):  # training logs update 9 while the thread talks to the store
        if not appended:
            appended.append(9)
            writer.log_metrics({"reward/mean": 0.9}, step=9)
        return real(run_id, **kw)

    monkeypatch.setattr(writer.tracker.client, "log_batch", append_meanwhile)
    for s in (1, 2):
        writer.log_metrics({"reward/mean": s / 10}, step=s)
    assert writer.pump()
    assert [r["step"] for r in spooled(writer)] == [9] and steps(writer) == [1, 2]
    assert writer.pump() and spooled(writer) == [] and steps(writer) == [1, 2, 9]


def test_a_batch_that_landed_then_failed_is_not_sent_again(writer, monkeypatch):
    real, left = writer.tracker.client.log_batch, []

    def land_then_fail(run_id, **kw):
        real(run_id, **kw)
        if left:
            left.clear()
            raise MlflowException("read timed out", error_code=TEMPORARILY_UNAVAILABLE)

    monkeypatch.setattr(writer.tracker.client, "log_batch", land_then_fail)
    writer.log_metrics({"reward/mean": 0.1}, step=1)
    assert writer.pump()  # the writer's cache now knows step 1
    writer.log_metrics({"reward/mean": 0.2}, step=2)
    left.append(1)
    assert not writer.pump()  # step 2 landed, the answer was lost: the cache is forgotten
    assert writer.pump()
    ms = MlflowClient(writer.uri).get_metric_history(writer.run_id, "reward/mean")
    assert sorted(m.step for m in ms) == [1, 2] and len(ms) == 2


def test_the_end_waits_a_bounded_time_then_leaves_the_rest_for_aggregate_and_says_so(writer, capsys):
    writer.store.down = True
    writer.log_metrics({"reward/mean": 0.1}, step=1)
    assert writer.end("FINISHED", wait_s=0) is False
    err = capsys.readouterr().err
    assert "2 of this run's MLflow writes (its end, FINISHED, among them) were not sent" in err
    assert "`esbatch aggregate` (or a resume) sends them" in err
    assert spooled(writer)[-1]["status"] == "FINISHED"
    writer.store.down = False
    assert drain(writer.spool.path.parent) == 1
    assert steps(writer) == [1] and MlflowClient(writer.uri).get_run(writer.run_id).info.status == "FINISHED"


def test_the_writer_thread_sends_everything_before_the_end_returns(tmp_path):
    (tmp_path / "run").mkdir()
    tr = MLflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t", spool=spool_path(tmp_path / "run"))
    tr.start("r", {}, {})
    w = TrackingWriter(tr)
    for s in range(1, 6):
        w.log_metrics({"reward/mean": s}, step=s)
    assert w.end("FINISHED", wait_s=120)  # returns once sent; the limit only fails a stuck writer
    assert steps(w) == [1, 2, 3, 4, 5] and spooled(w) == []
    assert MlflowClient(w.uri).get_run(w.run_id).info.status == "FINISHED"


def test_a_hang_leaves_run_json_failed_with_its_reason_and_mlflow_failed(tmp_path):
    """What the watchdog's before-exit hook does (the thread that hangs is not needed to call it)."""
    cfg = config_from_dict(
        {"run": {"name": "r", "output_dir": str(tmp_path), "hang_timeout_s": 30}, "es": {"updates": 3}}
    )
    session = RunSession(cfg, tmp_path / "r", resume=False).__enter__()
    try:
        run_id = session.start(3)
        session.record_update({"t": 0, "metrics": {"reward/mean": 0.5}})
        session._hung("update 1 (generation, scoring, reward exchange, weight update)")
        meta = session.rd.read_meta()
        assert meta["status"] == "failed"
        assert meta["reason"] == (
            "hung: update 1 (generation, scoring, reward exchange, weight update) did not finish within "
            "run.hang_timeout_s = 30 s"
        )
        run = MlflowClient(session.uri).get_run(run_id)
        assert run.info.status == "FAILED" and run.data.metrics["reward/mean"] == 0.5
    finally:
        session._lock.close()
