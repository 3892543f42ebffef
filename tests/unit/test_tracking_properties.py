"""Properties of tracking through store outages and of how a run ends (issue 44 D5), on a stand-in store
(tests/tracking_schedules.py; tests/integration/test_tracking_properties_mlflow.py checks it against MLflow's):

- whatever the interleaving of outages with a run's updates, its processes' ends (a crash mid-send among them),
  the end's bounded wait and `esbatch aggregate`, each metric (key, step) the run folder records is in MLflow
  exactly once afterwards, and the run's MLflow status and params are run.json's and the config's;
- whatever ends `esbatch train` (an update raising, a hang past run.hang_timeout_s, SIGTERM, a store that never
  answers or is down at the start), run.json's status and reason are what its exit code says, over resumes.

Played through the real code (RunSession, MLflowTracker, TrackingWriter, the spool, the drain, cli.main);
derandomized, so CI runs the same examples every time."""

from __future__ import annotations

import copy
import json
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlflow.tracking
import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from store_outage import Outage
from tracking_schedules import (
    STATUS,
    Executor,
    FakeClient,
    Schedule,
    Segment,
    check_each_metric_once,
    fake_uri,
    fresh_dirs,
    metrics,
    no_waiting,
    play,
    recorded,
    schedules,
)

from esbatch import cli
from esbatch.es import ES
from esbatch.tasks.verify import ScoringError
from esbatch.tracking.pending import drain_all
from esbatch.tracking.spool import spool_path
from esbatch.train import lifecycle, stop, watchdog
from esbatch.train.lifecycle import Trainer
from esbatch.train.rundir import RunDir
from esbatch.train.watchdog import EXIT_HUNG, Watchdog

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(schedules())
@example(  # a resume whose store goes down while it reopens the run: MLflow stayed FINISHED, run.json failed (01cdca0)
    Schedule(1, [Segment(False, [], "finish", [], 0.0) for _ in range(3)], {12: "down_after"})
)
@example(  # two outages that begin mid-send: a send that skipped nothing would send steps 1-3 twice
    Schedule(3, [Segment(False, [], "finish", [(True, 0.5)], 1.0)], {0: "down_after", 11: "down_after"})
)
@example(  # an update recorded while the spool is being sent: a send that dropped every line would lose it
    Schedule(1, [Segment(False, ["pump"], "finish", [], 0.0), Segment(False, [], "finish", [], 0.0)], {1: "update"})
)
def test_any_interleaving_of_outages_leaves_each_metric_once_and_the_status_of_run_json(s):
    with fresh_dirs() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(mlflow.tracking, "MlflowClient", FakeClient)
        uri = fake_uri()
        played = play(s, uri, Path(tmp), mp, FakeClient)
        store = FakeClient.STORES.pop(uri)
        meta = json.loads((played.run_dir / "run.json").read_text())
        assert meta["status"] == played.status
        want = recorded(played.run_dir)
        rid = meta.get("mlflow_run_id")
        runs = dict(store.runs)
        run = runs.pop(rid) if rid else {"metrics": [], "status": "FAILED", "params": played.params}
        check_each_metric_once(run["metrics"], want)
        assert run["status"] == STATUS[played.status] and run["params"] == played.params
        assert all(not r["metrics"] for r in runs.values())  # a run whose start failed got nothing
        assert not spool_path(played.run_dir).exists() or spool_path(played.run_dir).stat().st_size == 0


# ---------------------------------------------------------------------------------------------- run.json = exit
EXIT_STATUS = {0: "finished", 1: "failed", EXIT_HUNG: "failed", 130: "killed"}  # esbatch train's exit codes
CAUSES = (
    "success",
    "error",  # an update raises
    "scoring",  # the verifier fails an update (ScoringError: main's one-paragraph error)
    "hang_step",  # a scorer that never returns: the update outlives run.hang_timeout_s
    "hang_offline",  # the same while the store is down (the end's FAILED waits in the spool)
    "hang_save",  # a checkpoint write that never returns
    "sigterm",  # preemption: SIGTERM during an update
    "store_never_answers",  # from an update on: the run trains to the end, its end's wait expires
    "store_down",  # when the process starts: it fails before training
)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)  # what `esbatch train` installs handlers for


class ProcessGone(BaseException):
    """The watchdog's os._exit: the process is over. Here the stack unwinds instead, and the run folder and the
    store are put back as they were at the exit."""


@dataclass
class Cause:
    what: str
    at: int  # the update (counted from where the process starts) at which it happens


class Process:
    """`esbatch train` in this process (cli.main, as the console script calls it) on a trainer that does no
    work but fails as told; the exit code the shell would see: main's return, 1 for an exception main lets
    through (Python's), the watchdog's os._exit code."""

    def __init__(self, mp: pytest.MonkeyPatch, root: Path, uri: str, outage: Any, ex: Executor) -> None:
        self.root, self.uri, self.outage, self.ex = root, uri, outage, ex
        self.run_dir = root / "r"
        self.clock = 0.0  # the watchdog's: a hang is the clock moved past run.hang_timeout_s, by construction
        self.cause = Cause("success", 0)
        self.code: int | None = None
        self.at_exit: tuple[Path, Any] | None = None
        mp.setattr(lifecycle, "Watchdog", lambda limit: Watchdog(limit, clock=lambda: self.clock))
        mp.setattr(watchdog, "os", SimpleNamespace(_exit=self._exit))
        mp.setattr(ES, "trainer", classmethod(lambda cls, cfg, session: Idle(session, self)))

    def _exit(self, code: int) -> None:
        self.code = code
        snap = self.root / "at-exit"
        shutil.rmtree(snap, ignore_errors=True)
        shutil.copytree(self.run_dir, snap)
        self.at_exit = (snap, copy.deepcopy(FakeClient.STORES[self.uri]))

    def run(self, argv: list[str], cause: Cause) -> int:
        self.cause, self.code, self.at_exit = cause, None, None
        self.outage.down = cause.what == "store_down"
        self.ex.plan = [None] * 3  # the end's tries: the store as it is then
        saved = {s: signal.getsignal(s) for s in SIGNALS}
        try:
            return cli.main(argv)
        except ProcessGone:
            assert self.code is not None and self.at_exit is not None
            snap, store = self.at_exit
            shutil.rmtree(self.run_dir)
            shutil.copytree(snap, self.run_dir)
            FakeClient.STORES[self.uri] = store
            return self.code
        except Exception:  # noqa: BLE001 - what Python does with an exception main lets through
            return 1
        finally:
            for s, h in saved.items():
                signal.signal(s, h)
            stop.STOP.clear()
            stop._REQUESTED.clear()

    def happens(self, what: str, t: int) -> bool:
        return self.cause.what == what and t == self.start + self.cause.at

    def hang(self, session: Any) -> None:
        self.clock += session.cfg.run.hang_timeout_s + 1
        assert session.watchdog.poke(timeout=60)  # the watchdog has seen the hang and "exited"
        raise ProcessGone


class Idle(Trainer):
    def __init__(self, session: Any, proc: Process) -> None:
        self.session, self.proc = session, proc

    def setup(self) -> int:
        return self.session.cfg.es.updates

    def restore(self, records: list[dict]) -> int:
        self.proc.start = self.saved_at = len(records)  # ES replays the log
        return len(records)

    def step(self, t: int) -> dict:
        p = self.proc
        if p.happens("error", t):
            raise RuntimeError(f"update {t} failed")
        if p.happens("scoring", t):
            raise ScoringError(f"the verifier raised on every response of update {t}")
        if p.happens("hang_offline", t):
            p.outage.down = True
        if p.happens("hang_step", t) or p.happens("hang_offline", t):
            p.hang(self.session)
        if p.happens("sigterm", t):
            signal.raise_signal(signal.SIGTERM)  # the handler `esbatch train` installed runs here, in this thread
        if p.happens("store_never_answers", t):
            p.outage.down = True
        return {"t": t, "metrics": metrics(t)}

    def save(self, t: int, final: bool) -> None:
        if self.proc.happens("hang_save", t - 1):
            self.proc.hang(self.session)

    def evaluate(self) -> dict:
        return {}

    @property
    def n_train(self) -> int:
        return 1


def expected(cause: Cause, left: int) -> tuple[int, str | None]:
    """The exit code of a process that has ``left`` updates to train and meets ``cause``, and the start of
    run.json's reason (None: none)."""
    if cause.what == "store_down":
        return 1, "TrackingStoreError: the MLflow store"
    if cause.at >= left or cause.what in ("success", "store_never_answers"):
        return 0, None
    return {
        "error": (1, "RuntimeError: update"),
        "scoring": (1, "ScoringError: the verifier"),
        "hang_step": (EXIT_HUNG, "hung: update"),
        "hang_offline": (EXIT_HUNG, "hung: update"),
        "hang_save": (EXIT_HUNG, "hung: the checkpoint after update"),
        "sigterm": (130, None) if cause.at < left - 1 else (0, None),  # a stop after the last update: finished
    }[cause.what]


@settings(SETTINGS, max_examples=16)
@example(updates=1, causes=[Cause("error", 0), Cause("success", 0)])  # finished, with the failure's reason (8c217c7)
@example(updates=3, causes=[Cause("hang_offline", 1), Cause("sigterm", 0), Cause("hang_step", 0)])
@example(updates=2, causes=[Cause("store_never_answers", 0), Cause("store_down", 0)])
@given(
    updates=st.integers(1, 3),
    causes=st.lists(st.builds(Cause, st.sampled_from(CAUSES), st.integers(0, 1)), min_size=1, max_size=3),
)
def test_run_json_says_what_the_exit_code_says_whatever_ends_the_run(updates, causes):
    with fresh_dirs() as tmp, pytest.MonkeyPatch.context() as mp:
        root = Path(tmp)
        mp.setattr(mlflow.tracking, "MlflowClient", FakeClient)
        no_waiting(mp)
        uri = fake_uri()
        outage = Outage(mp, FakeClient, down=False)
        proc = Process(mp, root, uri, outage, Executor(mp, outage))
        cfg = {"run": {"name": "r", "output_dir": str(root), "hang_timeout_s": 30}, "es": {"updates": updates}}
        (root / "r.yaml").write_text(yaml.safe_dump({**cfg, "checkpoint": {"every": 1}, "tracking": {"uri": uri}}))
        argv = ["train", str(root / "r.yaml"), "--no-progress"]
        for cause in causes:
            left = updates - (len(RunDir(proc.run_dir).updates()) if proc.run_dir.exists() else 0)
            code = proc.run(argv, cause)
            event(f"{cause.what}: exit {code}")
            argv = ["train", "--resume", str(proc.run_dir), "--no-progress"]
            meta = RunDir(proc.run_dir).read_meta()
            assert (code, meta["status"]) == (expected(cause, left)[0], EXIT_STATUS[code]), (cause, meta)
            why = expected(cause, left)[1]
            assert (meta.get("reason") or "").startswith(why or "") and (why is None) == ("reason" not in meta), meta
        outage.down = False
        drain_all([proc.run_dir])  # esbatch aggregate
        store = FakeClient.STORES.pop(uri)
        run = store.runs[meta["mlflow_run_id"]] if "mlflow_run_id" in meta else {"status": "FAILED", "metrics": []}
        assert run["status"] == STATUS[meta["status"]]
        check_each_metric_once(run["metrics"], recorded(proc.run_dir))
