"""Tracking never kills training (esbatch/tracking/spool.py), against a real sqlite MLflow store: a write the store
refuses is retried with backoff (the sleeps are recorded, never slept), then kept in the run folder's spool and
sent later, by the run or by `esbatch aggregate`, each (key, step) exactly once.

"Unavailable" is made true by construction, never by timing: the client's methods raise until the test says
the store is back, or a second sqlite connection holds an exclusive lock that only the injected sleep releases."""

from __future__ import annotations

import json
import sqlite3

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE
from mlflow.tracking import MlflowClient
from store_outage import Outage

from esbatch.config import config_from_dict
from esbatch.tracking import MLflowTracker, spool_path
from esbatch.tracking import spool as spooling
from esbatch.tracking.pending import drain, drain_all
from esbatch.tracking.spool import BACKOFF_S, RETRY_EVERY_S
from esbatch.train.lifecycle import RunSession

KEYS = ("reward/mean", "loss")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def store(tmp_path):
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def run_folder(tmp_path):
    (tmp_path / "run").mkdir()
    return tmp_path / "run"


def tracker(store, run_folder, sleeps, clock=None):
    tr = MLflowTracker(store, "t", spool=spool_path(run_folder), sleep=sleeps.append, clock=clock or Clock())
    tr.start("r", {"es.sigma": 0.05}, {})
    return tr


def history(store, run_id, key="reward/mean"):
    return sorted((m.step, m.value) for m in MlflowClient(store).get_metric_history(run_id, key))


def spooled(run_folder):
    p = spool_path(run_folder)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def metrics(step):
    return {"reward/mean": 0.1 * step, "loss": -float(step)}


def test_a_store_failing_a_few_times_gets_each_step_once_after_backing_off(store, run_folder, monkeypatch):
    sleeps: list[float] = []
    tr = tracker(store, run_folder, sleeps)
    real = tr.client.log_batch
    left = {"fail": 0, "land_then_fail": 0}
    points = []  # the metric points that reached the store

    def flaky(run_id, **kw):
        if left["fail"]:
            left["fail"] -= 1
            raise MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE)
        real(run_id, **kw)
        points.extend((m.key, m.step) for m in kw.get("metrics", []))
        if left["land_then_fail"]:  # a server that stored the batch, then timed out answering
            left["land_then_fail"] -= 1
            raise MlflowException("read timed out", error_code=TEMPORARILY_UNAVAILABLE)

    monkeypatch.setattr(tr.client, "log_batch", flaky)
    tr.log_metrics(metrics(1), step=1)
    assert sleeps == []
    left["fail"] = 3
    tr.log_metrics(metrics(2), step=2)
    assert sleeps == list(BACKOFF_S[:3])
    left["land_then_fail"] = 1
    tr.log_metrics(metrics(3), step=3)
    assert sleeps == [*BACKOFF_S[:3], BACKOFF_S[0]]
    left["fail"] = len(BACKOFF_S)  # the last try succeeds
    tr.log_metrics(metrics(4), step=4)
    tr.end("FINISHED")
    assert sleeps == [*BACKOFF_S[:3], BACKOFF_S[0], *BACKOFF_S]
    for key in KEYS:
        assert [s for s, _ in history(store, tr.run_id, key)] == [1, 2, 3, 4]
    assert history(store, tr.run_id) == [(s, pytest.approx(0.1 * s)) for s in (1, 2, 3, 4)]
    assert sorted(points) == sorted((k, s) for k in KEYS for s in (1, 2, 3, 4))  # the retry of 3 sent nothing
    assert MlflowClient(store).get_run(tr.run_id).info.status == "FINISHED"
    assert spooled(run_folder) == []


def test_a_store_down_for_the_whole_run_keeps_every_step_then_drain_sends_each_once(
    store, run_folder, monkeypatch, capsys
):
    sleeps: list[float] = []
    clock = Clock()
    tr = tracker(store, run_folder, sleeps, clock)
    outage = Outage(monkeypatch, tr.client)
    steps = range(1, 21)
    for step in steps:  # the training loop's writes: an update every 10 s, a held-out score every 5 updates
        tr.log_metrics(metrics(step), step=step)
        if step % 5 == 0:
            tr.log_metrics({"heldout/accuracy": step / 100}, step=step)
        clock.t += 10
    assert sleeps == list(BACKOFF_S)  # the first write backs off; then one try a minute, no sleeping
    tries_while_spooling = outage.refused - (len(BACKOFF_S) + 1)
    assert RETRY_EVERY_S == 60 and tries_while_spooling == 3  # 60, 120 and 180 s after the first refusal
    assert capsys.readouterr().err.count("unavailable") == 1  # one warning, not one per step
    tr.end("FINISHED")
    assert sleeps == [*BACKOFF_S, *BACKOFF_S]  # the end tries with the full backoff
    recs = spooled(run_folder)
    assert [r["step"] for r in recs if "reward/mean" in r.get("metrics", {})] == list(steps)
    assert [r["step"] for r in recs if "heldout/accuracy" in r.get("metrics", {})] == [5, 10, 15, 20]
    assert recs[-1]["status"] == "FINISHED" and {r["run_id"] for r in recs} == {tr.run_id}
    assert history(store, tr.run_id) == []
    assert MlflowClient(store).get_run(tr.run_id).info.status == "RUNNING"

    assert drain(run_folder) == 2 * len(steps) + 4  # the store is back: `esbatch aggregate` sends the spool
    for key in KEYS:
        assert [s for s, _ in history(store, tr.run_id, key)] == list(steps)
    assert [s for s, _ in history(store, tr.run_id, "heldout/accuracy")] == [5, 10, 15, 20]
    assert MlflowClient(store).get_run(tr.run_id).info.status == "FINISHED"
    assert spooled(run_folder) == []
    assert drain(run_folder) == 0 and drain_all([run_folder, run_folder.parent / "nothing"]) == 0
    assert [s for s, _ in history(store, tr.run_id)] == list(steps)


def test_the_run_sends_its_spool_itself_in_order_when_the_store_answers_again(store, run_folder, monkeypatch):
    sleeps: list[float] = []
    clock = Clock()
    tr = tracker(store, run_folder, sleeps, clock)
    outage = Outage(monkeypatch, tr.client)
    for step in (1, 2, 3):
        tr.log_metrics(metrics(step), step=step)
    outage.down = False
    tr.log_metrics(metrics(4), step=4)  # within a minute of the last refusal: spooled, the store not tried
    assert len(spooled(run_folder)) == 4 and history(store, tr.run_id) == []
    clock.t += RETRY_EVERY_S
    tr.log_metrics(metrics(5), step=5)  # sends the spool, oldest first, with this write last
    assert spooled(run_folder) == []
    tr.log_metrics(metrics(6), step=6)  # and writes go straight to the store again
    assert spooled(run_folder) == []
    tr.end("FINISHED")
    for key in KEYS:
        assert [s for s, _ in history(store, tr.run_id, key)] == [1, 2, 3, 4, 5, 6]
    assert sleeps == list(BACKOFF_S)
    assert MlflowClient(store).get_run(tr.run_id).info.status == "FINISHED"


def test_a_crash_between_sending_and_emptying_the_spool_sends_nothing_twice(store, run_folder, monkeypatch):
    sleeps: list[float] = []
    tr = tracker(store, run_folder, sleeps)
    outage = Outage(monkeypatch, tr.client)
    for step in (1, 2, 3):
        tr.log_metrics(metrics(step), step=step)
    tr.end("KILLED")
    outage.down = False

    def crash(f):
        raise RuntimeError("killed right after sending")

    with monkeypatch.context() as m:
        m.setattr(spooling, "_truncate", crash)
        assert drain(run_folder) == 0  # a warning; everything was sent, the spool is still whole
    assert [s for s, _ in history(store, tr.run_id)] == [1, 2, 3]
    assert len(spooled(run_folder)) == 4
    assert drain(run_folder) == 0  # the next drain finds every step in MLflow
    for key in KEYS:
        assert [s for s, _ in history(store, tr.run_id, key)] == [1, 2, 3]
    assert spooled(run_folder) == []
    assert MlflowClient(store).get_run(tr.run_id).info.status == "KILLED"


def test_a_resumed_run_sends_the_spool_before_reopening_and_counts_spooled_steps(store, run_folder, monkeypatch):
    sleeps: list[float] = []
    tr = tracker(store, run_folder, sleeps)
    tr.log_metrics(metrics(1), step=1)
    outage = Outage(monkeypatch, tr.client)
    tr.log_metrics(metrics(2), step=2)
    tr.end("KILLED")  # the process dies; its end status waits in the spool too
    outage.down = False
    again = MLflowTracker(store, "t", spool=spool_path(run_folder), sleep=sleeps.append, clock=Clock())
    assert again.start("r", {}, {}, run_id=tr.run_id) == tr.run_id
    assert spooled(run_folder) == []
    assert MlflowClient(store).get_run(tr.run_id).info.status == "RUNNING"  # the old KILLED went first
    assert again.last_step("reward/mean") == 2
    again.log_metrics(metrics(3), step=3)
    again.end("FINISHED")
    assert [s for s, _ in history(store, tr.run_id)] == [1, 2, 3]
    assert MlflowClient(store).get_run(tr.run_id).info.status == "FINISHED"


def test_a_store_that_cannot_be_read_on_resume_routes_writes_through_the_spool(store, run_folder, monkeypatch):
    """last_step fails: the resumed run re-logs every step it has, and the spool's sending drops the ones the
    store already holds."""
    sleeps: list[float] = []
    tr = tracker(store, run_folder, sleeps)
    for step in (1, 2):
        tr.log_metrics(metrics(step), step=step)
    clock = Clock()
    again = MLflowTracker(store, "t", spool=spool_path(run_folder), sleep=sleeps.append, clock=clock)
    again.start("r", {}, {}, run_id=tr.run_id)
    outage = Outage(monkeypatch, again.client)
    assert again.last_step("reward/mean") == -1
    outage.down = False
    for step in (1, 2, 3):  # log_missing_steps, knowing nothing
        again.log_metrics(metrics(step), step=step)
    again.end("FINISHED")
    for key in KEYS:
        assert [s for s, _ in history(store, tr.run_id, key)] == [1, 2, 3]
    assert spooled(run_folder) == []


def test_a_real_sqlite_lock_is_waited_out_and_training_goes_on(store, run_folder, monkeypatch):
    """Another connection holds mlflow.db under BEGIN EXCLUSIVE; the injected sleep commits it on the second
    retry, so the write fails exactly twice, however fast the machine."""
    import sqlalchemy.sql

    text = sqlalchemy.sql.text  # MLflow waits 20 s on a locked sqlite file before failing (PRAGMA busy_timeout)
    monkeypatch.setattr(
        sqlalchemy.sql, "text", lambda s, *a: text(s.replace("busy_timeout = 20000", "busy_timeout = 20"), *a)
    )
    sleeps: list[float] = []
    tr = tracker(store, run_folder, sleeps)
    tr.log_metrics(metrics(1), step=1)
    con = sqlite3.connect(store[len("sqlite:///") :], isolation_level=None)
    con.execute("BEGIN EXCLUSIVE")

    def sleep(s):
        sleeps.append(s)
        if len(sleeps) == 2:
            con.execute("COMMIT")

    tr._sleep = sleep
    tr.log_metrics(metrics(2), step=2)  # returns: the run is not interrupted
    assert sleeps == list(BACKOFF_S[:2])
    con.execute("BEGIN EXCLUSIVE")  # again, for longer than every try: the step waits in the spool
    sleeps.clear()
    tr._sleep = sleeps.append
    tr.log_metrics(metrics(3), step=3)
    assert sleeps == list(BACKOFF_S) and [r["step"] for r in spooled(run_folder)] == [3]
    con.execute("COMMIT")
    con.close()
    tr.end("FINISHED")
    for key in KEYS:
        assert [s for s, _ in history(store, tr.run_id, key)] == [1, 2, 3]
    assert spooled(run_folder) == []


def test_the_run_session_keeps_refused_writes_in_its_folder(tmp_path, monkeypatch, capsys):
    """RunSession wires the spool and its writer thread (esbatch/tracking/writer.py): a training-like session whose
    store refuses everything after start finishes, its folder records every update, the end (given no time to
    wait here) leaves the writes in the spool and says so, and `esbatch aggregate`'s drain sends them once."""
    monkeypatch.setenv("ESBATCH_TRACKING_END_WAIT_S", "0")
    cfg = config_from_dict({"run": {"name": "r", "output_dir": str(tmp_path)}, "es": {"updates": 3}})
    with RunSession(cfg, tmp_path / "r", resume=False) as session:
        run_id = session.start(3)
        Outage(monkeypatch, session.tracker.tracker.client)
        for t in range(3):
            session.record_update({"t": t, "metrics": {"reward/mean": t / 10}})
    # the end stopped waiting at once; the writer thread's try in flight then (if any) fails against the store
    # still down, and the thread returns: joined here, it cannot send behind the drain below once the store is up
    session.tracker._thread.join()
    assert session.rd.read_meta()["status"] == "finished" and len(session.rd.updates()) == 3
    assert "`esbatch aggregate` (or a resume) sends them" in capsys.readouterr().err
    recs = spooled(tmp_path / "r")
    assert [r["step"] for r in recs if "metrics" in r] == [1, 2, 3] and recs[-1]["status"] == "FINISHED"
    store = session.uri
    assert history(store, run_id) == []
    monkeypatch.undo()
    assert drain_all([tmp_path / "r"]) == 6  # reward/mean and system/peak_rss_mb, 3 steps each
    assert [s for s, _ in history(store, run_id)] == [1, 2, 3]
    assert MlflowClient(store).get_run(run_id).info.status == "FINISHED"


def test_esbatch_aggregate_sends_what_the_runs_spooled(tmp_path, monkeypatch):
    """Two runs of a sweep whose store refused their last writes, one a pipeline (its stage folder holds the
    spool): `esbatch aggregate` sends both before it reads MLflow back, each step once."""
    from esbatch.aggregate.collect import aggregate
    from esbatch.launch.state import SweepDir

    sd = SweepDir(tmp_path / "sweep")
    uri = f"sqlite:///{sd.path / 'mlflow.db'}"
    keys = ["s0", "s1"]
    sd.plan.mkdir(parents=True)
    with sd.locked() as m:
        m.update(
            name="t",
            tracking="online",
            tracking_uri=uri,
            experiment="t",
            runs=[{"key": k, "label": f"seed={i}", "index": i, "point": {"run.seed": i}} for i, k in enumerate(keys)],
        )
    ids = {}
    for i, k in enumerate(keys):
        cfg = config_from_dict({"es": {"updates": 3}, "run": {"seed": i}})
        sd.plan_path(k).write_text(cfg.to_yaml())
        rd = sd.run_dir(k)
        rd.path.mkdir(parents=True)
        rd.write_meta(status="finished", done=3, mlflow_run_id=None)
        folder = rd.path / "stage1-es" if k == "s1" else rd.path
        folder.mkdir(exist_ok=True)
        tr = MLflowTracker(uri, "t", spool=spool_path(folder), sleep=lambda s: None, clock=Clock())
        ids[k] = tr.start(k, {"run.seed": i}, {"esbatch.sweep": "t", "esbatch.run_key": k})
        tr.log_metrics({"reward/mean": 0.1}, step=1)
        Outage(monkeypatch, tr.client)
        for step in (2, 3):
            tr.log_metrics({"reward/mean": 0.1 * step}, step=step)
        tr.end("FINISHED")
        assert history(uri, ids[k]) == [(1, pytest.approx(0.1))]
    aggregate(sd.path)
    for k in keys:
        assert [s for s, _ in history(uri, ids[k])] == [1, 2, 3]
        assert MlflowClient(uri).get_run(ids[k]).info.status == "FINISHED"
    assert spooled(sd.run_dir("s0").path) == spooled(sd.run_dir("s1").path / "stage1-es") == []
    aggregate(sd.path)
    assert all([s for s, _ in history(uri, ids[k])] == [1, 2, 3] for k in keys)


def test_a_start_that_fails_after_creating_the_run_makes_no_second_run(store, run_folder, monkeypatch):
    sleeps: list[float] = []
    tr = MLflowTracker(store, "t", spool=spool_path(run_folder), sleep=sleeps.append, clock=Clock())
    real, left = tr.client.log_batch, {"fail": 1}

    def flaky(run_id, **kw):
        if left["fail"]:
            left["fail"] -= 1
            raise MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE)
        real(run_id, **kw)

    monkeypatch.setattr(tr.client, "log_batch", flaky)
    run_id = tr.start("r", {"es.sigma": 0.05}, {"k": "v"})
    assert sleeps == [BACKOFF_S[0]]
    runs = MlflowClient(store).search_runs([tr.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id] and runs[0].data.params == {"es.sigma": "0.05"}


def test_a_bug_or_a_bad_request_raises_at_once_instead_of_being_spooled(store, run_folder, monkeypatch):
    sleeps: list[float] = []
    tr = tracker(store, run_folder, sleeps)

    def bad(run_id, **kw):
        raise MlflowException("Invalid metric name", error_code=INVALID_PARAMETER_VALUE)

    monkeypatch.setattr(tr.client, "log_batch", bad)
    with pytest.raises(MlflowException, match="Invalid metric name"):
        tr.log_metrics(metrics(1), step=1)
    monkeypatch.setattr(tr.client, "log_batch", lambda run_id, **kw: None.missing)
    with pytest.raises(AttributeError):
        tr.log_metrics(metrics(1), step=1)
    assert sleeps == [] and spooled(run_folder) == []
