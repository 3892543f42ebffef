"""Training never waits on tracking: an update's MLflow writes are appended to the run folder's spool (a local
file, fsynced, like log.jsonl) and a background thread sends the spool to the store.

The store is never on an update's critical path: a store locked by another process, a server down, a sqlite file
on a stalled NFS mount only delay the thread. Its tries back off (``BACKOFF_S``, then every 30 s); an outage prints
one line when it begins and one when the store answers again, no traceback (``esbatch --debug`` shows them, and
MLflow's own). Each (key, step) reaches MLflow once (esbatch/tracking/spool.py). At the end of the run the thread
gets a bounded wait (``END_WAIT_S``, or the environment's ``ESBATCH_TRACKING_END_WAIT_S``) to send the rest, the
end status last; what it has not sent stays in the spool for `esbatch aggregate` or a resume, and stderr says so.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from esbatch.tracking.mlflow_tracker import MLflowTracker, sqlite_lock
from esbatch.tracking.spool import BACKOFF_S, SendCache, damaged, describe, transient

END_WAIT_S = 60.0
END_WAIT_ENV = "ESBATCH_TRACKING_END_WAIT_S"
DEBUG_ENV = "ESBATCH_DEBUG"  # set by `esbatch --debug`


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def end_wait_s() -> float:
    """How long a run's end waits for its tracking writes to be sent."""
    raw = os.environ.get(END_WAIT_ENV, "")
    try:
        return max(0.0, float(raw)) if raw else END_WAIT_S
    except ValueError:
        return END_WAIT_S


class _NoStoreTracebacks(logging.Filter):
    """MLflow logs every failed sqlite transaction with its traceback ("SQLAlchemy database error..."): one per try
    of a locked store. The writer says it in one line; ``--debug`` lets them through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return debug() or record.exc_info is None


_QUIET = _NoStoreTracebacks()


def quiet_store_errors() -> None:
    log = logging.getLogger("mlflow.store.db.utils")
    if _QUIET not in log.filters:
        log.addFilter(_QUIET)


class TrackingWriter:
    """A started ``MLflowTracker`` whose writes are sent from a thread (``start=False``: no thread; a test calls
    ``pump`` itself). ``log_metrics``, ``log_artifact`` and ``log_inputs`` only append to the spool."""

    def __init__(self, tracker: MLflowTracker, *, start: bool = True, delays: tuple[float, ...] = BACKOFF_S) -> None:
        if tracker.spool is None or tracker.run_id is None:
            raise ValueError("a TrackingWriter needs a started tracker with a spool")
        quiet_store_errors()
        self.tracker, self.spool, self.uri = tracker, tracker.spool, tracker.uri
        self.run_id, self.experiment_id = tracker.run_id, tracker.experiment_id
        self.delays = delays
        self.failures = 0  # failed tries since the store last answered
        self.tries = 0  # tries made
        self.error: BaseException | None = None  # the last try's failure
        self.outages = 0  # outages seen (each printed once)
        self.dead: BaseException | None = None  # a bug or a refused request ended the thread
        self._cache = SendCache()
        self._cond = threading.Condition()
        self._pending = self._urgent = self._busy = self._closed = False
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="esbatch-tracking", daemon=True)
            self._thread.start()
        if self.spool.pending():
            self._wake()

    # ------------------------------------------------------------------ what training calls: never the store
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        if values:
            self._put(self.tracker._record(step=int(step), metrics=values))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._put(self.tracker._record(artifact=str(Path(path).resolve()), artifact_path=artifact_path))

    log_artifacts = log_artifact

    def log_inputs(self, inputs: list[dict[str, Any]]) -> None:
        if inputs:
            self._put(self.tracker._record(inputs=inputs))

    def last_step(self, key: str) -> int:
        return self.tracker.last_step(key)

    def _put(self, rec: dict[str, Any]) -> None:
        self.spool.append(rec)
        self._wake()

    def _wake(self, urgent: bool = False) -> None:
        with self._cond:
            self._pending = True
            self._urgent = self._urgent or urgent
            self._cond.notify_all()

    # ------------------------------------------------------------------ the end
    def end(self, status: str = "FINISHED", wait_s: float | None = None) -> bool:
        """Append the end status and give the thread ``wait_s`` (default ``end_wait_s()``) to send everything;
        whether it did. What it did not send stays in the spool, and stderr says so. A damaged store (trying again
        cannot mend it) is not waited for past one try."""
        wait = end_wait_s() if wait_s is None else wait_s
        self.spool.append(self.tracker._record(status=status))
        tries = self.tries
        self._wake(urgent=True)
        deadline = time.monotonic() + wait
        with self._cond:
            while not self._done() and self._thread is not None and self._thread.is_alive():
                if self.tries > tries and self.error is not None and damaged(self.error):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 1.0))  # 1 s: the spool may also be emptied by another sender
        with self._cond:  # the thread stops after the try in flight (the process is about to end)
            self._closed = True
            self._cond.notify_all()
        if self._done():
            return True
        n = len(self.spool.records())
        print(
            f"warning: tracking: {n} of this run's MLflow writes (its end, {status}, among them) were not sent to "
            f"{self.uri} within {wait:g} s; they stay in {self.spool.path}: `esbatch aggregate` (or a resume) sends "
            "them",
            file=sys.stderr,
            flush=True,
        )
        return False

    def _done(self) -> bool:
        return not self._busy and not self.spool.pending()  # appended first, sent, then dropped from the spool

    # ------------------------------------------------------------------ the thread
    def pump(self) -> bool:
        """One try at sending the spool (the thread's work; tests call it directly): whether the store took it.
        A transient failure is counted, and printed once per outage; anything else raises."""
        self.tries += 1
        try:
            n = self.spool.send(self._store, cache=self._cache)
        except Exception as e:
            if not transient(e):
                raise
            self.error = e
            self.failures += 1
            if self.failures == 1 and not self._closed:
                self.outages += 1
                print(
                    f"warning: tracking: the MLflow store {self.uri} is unavailable ({describe(e)}); training goes "
                    f"on, its writes wait in {self.spool.path} and are sent when the store answers",
                    file=sys.stderr,
                    flush=True,
                )
            if debug() and not self._closed:
                traceback.print_exception(e, file=sys.stderr)
            return False
        if self.failures and not self._closed:
            print(
                f"note: tracking: the MLflow store {self.uri} answers again: {n} waiting metric points sent",
                file=sys.stderr,
                flush=True,
            )
        self.failures, self.error = 0, None
        return True

    def _store(self, uri: str) -> tuple[Any, Any]:
        if uri == self.uri:
            return self.tracker.client, self.tracker._lock
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=uri), lambda: sqlite_lock(uri)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self.failures:  # back off, unless the run is ending
                    delay = self.delays[min(self.failures, len(self.delays)) - 1]
                    self._cond.wait_for(lambda: self._urgent or self._closed, timeout=delay)
                else:
                    self._cond.wait_for(lambda: self._pending or self._urgent or self._closed)
                if self._closed:
                    return
                self._pending = self._urgent = False
                self._busy = True
            try:
                self.pump()
            except BaseException as e:  # noqa: BLE001 - a bug, or a request the store refuses: said, then stop
                self.dead = e
                print(
                    f"error: tracking: sending to the MLflow store {self.uri} stopped ({describe(e)}); the writes "
                    f"stay in {self.spool.path} (`esbatch aggregate` tries them again)",
                    file=sys.stderr,
                    flush=True,
                )
                traceback.print_exception(e, file=sys.stderr)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self._cond.notify_all()
