"""Generated schedules of a run's life against a tracking store that goes down and comes back, played through the
real code (RunSession, MLflowTracker, TrackingWriter, the spool, `esbatch aggregate`'s drain), for the properties
of issue 44 D5 (tests/unit/test_tracking_properties.py on a stand-in store, tests/integration/ on MLflow's sqlite).

Nothing depends on timing. The writer's thread is not started: its tries happen where the schedule says (``pump``
between updates; during the run's end, each of the end's waits is one try of the thread, ``Executor``), and the
end's bounded wait runs on a virtual clock. "While the store is being sent to" is made true by construction: the
schedule's ``triggers`` act inside the n-th write that reaches the store (``Tap``): the store goes down after it,
the call lands and its answer is lost, training records the next update meanwhile, or the process dies (before or
after the call lands). A dead process is one whose RunSession never exits (its locks are released, as the kernel
does); the next process resumes the folder."""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import event
from hypothesis import strategies as st
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE
from store_outage import WRITES, Outage

from esbatch.config import config_from_dict
from esbatch.deadlines import forget
from esbatch.tracking import spool as spooling
from esbatch.tracking import writer as writing
from esbatch.tracking.pending import drain_all
from esbatch.tracking.writer import TrackingWriter
from esbatch.train import lifecycle, stop
from esbatch.train.lifecycle import RunSession

STATUS = {"finished": "FINISHED", "killed": "KILLED", "failed": "FAILED", "running": "RUNNING"}


class Crash(BaseException):
    """The process dies here (SIGKILL, the node lost): nothing after it runs, no except clause sees it."""


# ---------------------------------------------------------------------------------------------- the schedule
@dataclass
class Segment:
    """One process's life: ``ops`` between its updates, then how it ends, and its end's tries (``end_tries``: the
    store up or down for each try of the writer's thread during the end's wait, and how long the try takes)."""

    start_down: bool
    ops: list[str]
    ending: str  # finish (trains to the budget), stop (SIGTERM: killed), error (an update raises), crash
    end_tries: list[tuple[bool, float]]
    end_wait_s: float


@dataclass
class Schedule:
    updates: int
    segments: list[Segment]
    triggers: dict[int, str] = field(default_factory=dict)  # n-th write reaching the store -> what happens in it


OPS = ("update", "update", "pump", "down", "up", "aggregate")
READS = ("get_run", "get_metric_history")
TRIGGERS = ("down_after", "land_fail", "land_fail", "update", "update", "crash_before", "crash_after")


@st.composite
def schedules(draw: Any, max_segments: int = 3, max_ops: int = 10, max_call: int = 8) -> Schedule:
    n = draw(st.integers(1, max_segments))
    segments = []
    for i in range(n):
        last = i == n - 1
        segments.append(
            Segment(
                start_down=False if last else draw(st.booleans()),  # the last process opens its MLflow run
                ops=draw(st.lists(st.sampled_from(OPS), max_size=max_ops)),
                ending=draw(st.sampled_from(("finish", "stop", "error") if last else ("finish", "stop", "crash"))),
                end_tries=draw(st.lists(st.tuples(st.booleans(), st.sampled_from((0.5, 2.0, 30.0))), max_size=3)),
                end_wait_s=draw(st.sampled_from((0.0, 1.0, 5.0))),
            )
        )
    triggers = draw(st.dictionaries(st.integers(0, max_call), st.sampled_from(TRIGGERS), min_size=1, max_size=6))
    return Schedule(draw(st.integers(1, 6)), segments, triggers)


# ---------------------------------------------------------------------------------------------- the store
class FakeStore:
    """What MLflow keeps, in memory: experiments, runs (status, params, every metric point: no deduplication, so a
    point sent twice is seen twice, which MLflow's sqlite store would hide when the two are identical)."""

    def __init__(self) -> None:
        self.experiments: dict[str, str] = {}
        self.runs: dict[str, dict[str, Any]] = {}


class FakeClient:
    """The MlflowClient calls esbatch makes, on the FakeStore of its URI (``STORES``)."""

    STORES: dict[str, FakeStore] = {}

    def __init__(self, tracking_uri: str | None = None, **_: Any) -> None:
        self.store = FakeClient.STORES.setdefault(str(tracking_uri), FakeStore())

    def get_experiment_by_name(self, name: str) -> Any:
        eid = self.store.experiments.get(name)
        return None if eid is None else SimpleNamespace(experiment_id=eid, lifecycle_stage="active")

    def create_experiment(self, name: str, artifact_location: str | None = None) -> str:
        return self.store.experiments.setdefault(name, str(len(self.store.experiments) + 1))

    def create_run(self, experiment_id: str, start_time: int | None = None, run_name: str = "", tags=None) -> Any:
        rid = f"run{len(self.store.runs)}"
        self.store.runs[rid] = {
            "experiment_id": experiment_id,
            "status": "RUNNING",
            "params": {},
            "tags": dict(tags or {}),
            "metrics": [],
        }
        return SimpleNamespace(info=SimpleNamespace(run_id=rid))

    def _run(self, rid: str) -> dict[str, Any]:
        if rid not in self.store.runs:
            raise MlflowException(f"Run '{rid}' not found", error_code=RESOURCE_DOES_NOT_EXIST)
        return self.store.runs[rid]

    def get_run(self, rid: str) -> Any:
        r = self._run(rid)
        info = {"run_id": rid, "experiment_id": r["experiment_id"], "status": r["status"], "lifecycle_stage": "active"}
        return SimpleNamespace(info=SimpleNamespace(**info))

    def update_run(self, rid: str, status: str | None = None, name: str | None = None) -> None:
        if status is not None:
            self._run(rid)["status"] = status

    def set_terminated(self, rid: str, status: str | None = None, end_time: int | None = None) -> None:
        self._run(rid)["status"] = status or "FINISHED"

    def log_batch(self, rid: str, metrics=(), params=(), tags=(), synchronous=None) -> None:
        r = self._run(rid)
        for p in params:  # MLflow refuses to change a logged param
            if r["params"].get(p.key, p.value) != p.value:
                raise MlflowException(f"param {p.key} changed", error_code=INVALID_PARAMETER_VALUE)
        r["params"].update({p.key: p.value for p in params})
        r["tags"].update({t.key: t.value for t in tags})
        r["metrics"].extend((m.key, m.step, m.value) for m in metrics)

    def get_metric_history(self, rid: str, key: str) -> list[Any]:
        return [SimpleNamespace(key=k, step=s, value=v) for k, s, v in self._run(rid)["metrics"] if k == key]

    def log_artifact(self, rid: str, local_path: str, artifact_path: str | None = None) -> None:
        self._run(rid)

    log_artifacts = log_artifact

    def log_inputs(self, rid: str, datasets=None, models=None) -> None:
        self._run(rid)

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None: ...


class Tap:
    """The schedule's triggers, inside the calls that reach the store (under ``Outage``: refused calls never do)."""

    def __init__(self, mp: pytest.MonkeyPatch, client: Any, triggers: dict[int, str]) -> None:
        self.triggers, self.n = dict(triggers), 0
        self.outage: Outage | None = None
        self.on_update: Any = None  # set while training: records the next update
        self.crashes = True  # false for the last process: its end is what the properties check
        for name in WRITES:  # writes are counted (the n of ``triggers``), reads are not: a read that lands
            mp.setattr(client, name, self._tap(getattr(client, name), name not in READS))  # changes nothing

    def _tap(self, real: Any, write: bool) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not write:
                return real(*args, **kwargs)
            what = self.triggers.get(self.n)
            self.n += 1
            if what in ("crash_before", "crash_after") and not self.crashes:
                what = None
            if what == "crash_before":
                raise Crash
            if what == "update" and self.on_update is not None:
                self.on_update()
            out = real(*args, **kwargs)
            if what == "land_fail":  # stored, then the answer was lost (a timeout)
                raise MlflowException("read timed out", error_code=TEMPORARILY_UNAVAILABLE)
            if what == "crash_after":
                raise Crash
            if what == "down_after" and self.outage is not None:
                self.outage.down = True
            return out

        return call


# ---------------------------------------------------------------------------------------------- the writer
class _Alive:
    def is_alive(self) -> bool:
        return True


class _Tries(threading.Condition):
    """The writer's condition: each wait of the run's end is one try of the writer's thread, as planned."""

    def __init__(self, executor: Executor, writer: TrackingWriter) -> None:
        super().__init__()
        self.executor, self.writer = executor, writer

    def wait(self, timeout: float | None = None) -> bool:
        self.executor.thread_try(self.writer, timeout or 0.0)
        return True


class Executor:
    """Builds the run's TrackingWriter with no thread; plays the thread's tries during the end on a virtual clock."""

    def __init__(self, mp: pytest.MonkeyPatch, outage: Outage) -> None:
        self.outage, self.now, self.plan = outage, 0.0, []
        self.writer: TrackingWriter | None = None
        mp.setattr(writing, "time", SimpleNamespace(monotonic=lambda: self.now))
        executor = self

        class Writer(TrackingWriter):  # what RunSession.start makes (and its hang hook checks for)
            def __init__(self, tracker: Any) -> None:
                super().__init__(tracker, start=False)
                self._thread, self._cond = _Alive(), _Tries(executor, self)
                executor.writer = self

        mp.setattr(lifecycle, "TrackingWriter", Writer)

    def thread_try(self, w: TrackingWriter, timeout: float) -> None:
        if not self.plan:  # no more tries within the wait (the thread backs off): time passes
            self.now += timeout
            return
        planned = self.plan.pop(0)  # None: the store as it is now, a try that never ends while it is down
        up, took = planned if planned is not None else (not self.outage.down, 1e9 if self.outage.down else 0.5)
        self.outage.down = not up
        w.pump()
        self.now += took


# ---------------------------------------------------------------------------------------------- playing
@dataclass
class Played:
    run_dir: Path
    uri: str
    status: str  # how the last process ended, as run.json should say it
    params: dict[str, str]  # what the MLflow run's params should be
    outage: Outage
    tap: Tap


def metrics(t: int) -> dict[str, float]:
    m = {"reward/mean": round(0.1 * (t + 1), 3)}
    if t % 2 == 0:
        m["loss"] = -float(t)
    return m


def no_waiting(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(spooling, "pause", lambda seconds: None)  # the tracker's backoff: recorded by nobody, never slept
    mp.setattr(os, "fsync", lambda fd: None)  # durability is not what these properties are about: milliseconds


def play(s: Schedule, uri: str, root: Path, mp: pytest.MonkeyPatch, client: Any) -> Played:
    """Run ``s``: its processes one after another on one run folder, then `esbatch aggregate` with the store up.
    ``client``: the class whose calls are the store's (MlflowClient, or FakeClient patched in for it)."""
    no_waiting(mp)
    tap = Tap(mp, client, s.triggers)
    outage = Outage(mp, client, down=False)
    tap.outage = outage
    ex = Executor(mp, outage)
    cfg = config_from_dict(
        {"run": {"name": "r", "output_dir": str(root)}, "es": {"updates": s.updates}, "tracking": {"uri": uri}}
    )
    run_dir = root / "r"
    status = "running"
    for i, seg in enumerate(s.segments):
        tap.crashes = i < len(s.segments) - 1
        outage.down = seg.start_down
        status = _process(cfg, run_dir, seg, s.updates, i > 0, ex, tap, outage, mp)
    fired = sorted({what for n, what in s.triggers.items() if n < tap.n})
    event(f"triggers fired: {', '.join(fired) or 'none'}")
    event(f"calls refused while down: {'some' if outage.refused else 'none'}")
    event(f"left for aggregate: {'yes' if spooling.Spool(spooling.spool_path(run_dir)).pending() else 'no'}")
    event(f"processes: {len(s.segments)}, endings: {' '.join(g.ending for g in s.segments)}")
    tap.triggers.clear()
    outage.down = False
    drain_all([run_dir])
    return Played(run_dir, uri, status, {k: str(v)[:6000] for k, v in cfg.params().items()}, outage, tap)


def _process(cfg, run_dir, seg, total, resume, ex, tap, outage, mp) -> str:  # noqa: ANN001 - the play's own parts
    """One process; returns the status its run.json should end with ("running": it died)."""
    mp.setenv("ESBATCH_TRACKING_END_WAIT_S", str(seg.end_wait_s))
    session = RunSession(cfg, run_dir, resume=resume).__enter__()

    def train_next() -> None:
        t = len(session.rd.updates())
        if t < total:
            session.record_update({"t": t, "metrics": metrics(t)})

    try:
        try:
            session.start(total)
            if resume:
                session.log_missing_steps(session.rd.updates())
            tap.on_update = train_next
            for op in seg.ops:
                if op == "update":
                    train_next()
                elif op == "pump":
                    session.tracker.pump()
                elif op in ("down", "up"):
                    outage.down = op == "down"
                elif op == "aggregate":  # another process: its death is not the run's
                    try:
                        drain_all([run_dir])
                    except Crash:
                        pass
            if seg.ending == "stop":
                raise stop.Stopped()
            if seg.ending == "error":
                raise RuntimeError("an update failed")
            for _ in range(total):
                train_next()
            if seg.ending == "crash":
                raise Crash
        finally:
            tap.on_update = None
    except Crash:
        _die(session)
        return "running"
    except BaseException as e:  # noqa: BLE001 - what `with RunSession(...)` does with it
        ex.plan = list(seg.end_tries)
        try:
            session.__exit__(type(e), e, None)
        except Crash:
            _die(session)
        return "killed" if isinstance(e, KeyboardInterrupt) else "failed"
    ex.plan = list(seg.end_tries)
    try:
        session.__exit__(None, None, None)
    except Crash:  # died during the end's wait: run.json already says finished, the spool holds FINISHED
        _die(session)
    return "finished"


def _die(session: RunSession) -> None:
    """What the kernel does for a dead process: its locks go."""
    forget(session._hung)
    session._lock.close()


# ---------------------------------------------------------------------------------------------- the property
def recorded(run_dir: Path) -> dict[tuple[str, int], float]:
    """Every metric (key, step) the run folder's log.jsonl holds, with its value; every update also logged
    system/peak_rss_mb (its value is the process's, not in the log)."""
    from esbatch.train.rundir import RunDir

    out: dict[tuple[str, int], float] = {}
    for r in RunDir(run_dir).updates():
        out.update({(k, r["t"] + 1): v for k, v in r["metrics"].items() if isinstance(v, (int, float))})
        out[("system/peak_rss_mb", r["t"] + 1)] = float("nan")
    return out


def check_each_metric_once(points: list[tuple[str, int, float]], want: dict[tuple[str, int], float]) -> None:
    seen = sorted((k, s) for k, s, _ in points)
    assert seen == sorted(want), (
        "missing",
        sorted(set(want) - set(seen)),
        "extra",
        sorted(set(seen) - set(want)),
        "twice",
        sorted({x for x in seen if seen.count(x) > 1}),
    )
    for k, s, v in points:
        if want[k, s] == want[k, s]:  # not NaN: the log holds the value
            assert v == pytest.approx(want[k, s]), (k, s, v)


def fresh_dirs() -> Any:
    """One temporary folder per example (hypothesis runs many examples in one test)."""
    return tempfile.TemporaryDirectory(prefix="esbatch-prop-")


_ids = itertools.count()


def fake_uri() -> str:
    return f"http://fake-store-{next(_ids)}:5000"
