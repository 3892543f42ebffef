"""Tracking never kills training: MLflow writes retried with backoff, then kept in the run folder and sent later.

The run folder is the record (log.jsonl, eval.jsonl); MLflow is its copy. A write the store refuses for a
transient reason (a sqlite file locked by another connection, a server down) is tried again after
``BACKOFF_S`` = 2, 4, 8, 16, 30 s: six tries, 60 s of sleeping (against sqlite each try also waits up to
MLflow's own 20 s busy timeout, so a lock of up to ~3 min is ridden out). Still failing, the write is appended to
``<run folder>/tracking.pending.jsonl`` (one JSON line per write, flushed and fsynced under an flock), training
goes on with one warning on stderr, and later writes go to the spool too and try, at most once a minute
(``RETRY_EVERY_S``), to send it, oldest first; the run's end tries with the full backoff. ``esbatch aggregate``
sends what is left (esbatch/tracking/pending.py).

A line is one write: metrics at a step, an artifact, dataset inputs, run tags, experiment tags, or the run's
status. Each (metric key, step) reaches MLflow once: sending skips the steps MLflow already has, so a crash between
sending and emptying the spool sends nothing twice (a dataset input or a tag sent again is one MLflow already
keeps once). Lines of a run the store does not know (a moved or deleted
store) are dropped with a warning: the folder's log.jsonl and eval.jsonl still hold them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from esbatch.clock import Anchor

FILE = "tracking.pending.jsonl"
BACKOFF_S = (2.0, 4.0, 8.0, 16.0, 30.0)  # sleeps between the 6 tries of one write
RETRY_EVERY_S = 60.0  # while writes are spooled, the store is tried at most this often
# MLflow errors that say the request itself is wrong: trying again cannot help (they raise, as before)
PERMANENT = {"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST", "INVALID_STATE"}
TERMINAL = {"FINISHED", "FAILED", "KILLED"}
DAMAGED = {"SQLITE_CORRUPT", "SQLITE_NOTADB"}  # sqlite's codes for a store file that is not (any more) a database
DAMAGED_WORDS = ("database disk image is malformed", "file is not a database")  # the same, as MLflow re-words them

T = TypeVar("T")


def pause(seconds: float) -> None:
    """The tracker's default sleep between tries (a test replaces it: nothing there waits)."""
    time.sleep(seconds)


def spool_path(run_folder: str | Path) -> Path:
    return Path(run_folder) / FILE


def transient(e: BaseException) -> bool:
    """Whether a failed tracking write may succeed later (the store busy, away or damaged), rather than being
    wrong: an MLflow error other than a bad request, a database or network error. Anything else (a bug) raises at
    once."""
    if damaged(e):  # not mended by waiting, but by replacing the store: until then the spool keeps the writes
        return True
    code = getattr(e, "error_code", None)  # MlflowException and its REST form
    if code is not None:
        return code not in PERMANENT | {"RESOURCE_DOES_NOT_EXIST"}
    return isinstance(e, (OSError, sqlite3.Error)) or type(e).__module__.startswith("sqlalchemy.")


def damaged(e: BaseException) -> str | None:
    """sqlite's words when ``e``, or an error behind it, says the store file is damaged (not a database, a
    malformed image: a truncated or overwritten file); None otherwise. Trying again cannot mend it."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        words = str(x).splitlines()[0] if str(x) else ""
        if getattr(x, "sqlite_errorname", None) in DAMAGED or any(m in words for m in DAMAGED_WORDS):
            return next((m for m in DAMAGED_WORDS if m in words), words)
        x = getattr(x, "orig", None) or x.__cause__ or x.__context__
    return None


class TrackingStoreError(RuntimeError):
    """The MLflow store could not be opened, or a run not created in it (so before training starts): damaged, or
    still refusing after every try. The message is one paragraph: the store, why, what to do."""

    def __init__(self, uri: str, e: BaseException) -> None:
        db = uri[len("sqlite:///") :] if uri.startswith("sqlite:///") else None
        why = damaged(e)
        if why is not None and db is not None:
            msg = (
                f"the MLflow store {db} is damaged ({why}): MLflow cannot read it. Nothing is lost: the run folders "
                f"keep everything computed. Move the file aside (mv {db} {db}.damaged; `sqlite3 "
                f"{db}.damaged .recover` may rescue its runs) and run again, which makes a new store there, or set "
                "tracking.uri to another store"
            )
        else:
            msg = (
                f"the MLflow store {db or uri} did not answer after {len(BACKOFF_S) + 1} tries ({describe(e)}). "
                "Nothing is lost: the run folders keep everything computed. If another process holds it (a long "
                "write on a busy disk) or the server is down, run again later; or set tracking.uri to another store"
            )
        super().__init__(msg)
        self.uri = uri


def retry(op: Callable[[int], T], sleep: Callable[[float], None], delays: tuple[float, ...] = BACKOFF_S) -> T:
    """``op(attempt)`` until it returns, sleeping ``delays[i]`` after the (i+1)-th transient failure; the last
    failure (or any non-transient one, or a damaged store: trying again cannot mend it) is raised."""
    for attempt in range(len(delays) + 1):
        try:
            return op(attempt)
        except Exception as e:
            if attempt == len(delays) or not transient(e) or damaged(e):
                raise
            sleep(delays[attempt])
    raise AssertionError("unreachable")


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


class Spool:
    """The pending tracking writes of one run folder, one JSON object a line, oldest first."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def pending(self) -> bool:
        try:
            return self.path.stat().st_size > 0
        except (FileNotFoundError, NotADirectoryError):  # no spool, or no run folder (the reader names that)
            return False

    @contextlib.contextmanager
    def locked(self) -> Iterator[IO[str]]:
        """The spool file open for reading and appending, under an exclusive flock held briefly (appending, taking
        a snapshot, dropping what was sent: never while a store is talked to). A file replaced while we waited for
        its lock (``_keep``) is opened again: a line appended to the old one would be lost."""
        while True:
            f = open(self.path, "a+")  # noqa: SIM115 - closed below, or by the caller's with
            try:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    same = os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
            except BaseException:
                f.close()
                raise
            if same:
                break
            f.close()
        with f:
            try:
                yield f
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """One sender at a time (the run's writer thread, `esbatch aggregate`, a resume), across processes: a flock
        on ``<spool>.lock``, held while the store is talked to. Appending never waits for it."""
        with open(self.path.with_name(self.path.name + ".lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def append(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, sort_keys=True) + "\n"
        with self.locked() as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:  # a line torn by a crash gets its newline: the new line stays whole
                f.seek(f.tell() - 1)
                if f.read(1) != "\n":
                    line = "\n" + line
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def records(self, f: IO[str] | None = None) -> list[dict[str, Any]]:
        return self._snapshot(f)[0]

    def _snapshot(self, f: IO[str] | None = None) -> tuple[list[dict[str, Any]], int]:
        """The records and the number of lines they were read from (torn lines included)."""
        if f is None:
            if not self.pending():
                return [], 0
            with self.locked() as g:
                return self._snapshot(g)
        f.seek(0)
        lines = f.read().splitlines()
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash: its write never returned, the folder's logs hold it
            if isinstance(rec, dict) and isinstance(rec.get("run_id"), str):
                out.append(rec)
        return out, len(lines)

    def send(
        self,
        client_for: Callable[[str], tuple[Any, Callable[[], Any]]],
        uri: str | None = None,
        cache: SendCache | None = None,
    ) -> int:
        """Send every pending write, then drop the lines sent; returns the metric points sent. ``client_for(uri)``:
        an MlflowClient for the store and its writer lock. The spool's own lock is held only to read it and to drop
        what was sent, so lines appended meanwhile (training goes on) stay for the next send. A failure raises and
        leaves the spool whole. ``cache``: what a previous send of this process learnt the store holds."""
        with self.sending():
            recs, n = self._snapshot()
            if not n:
                return 0
            stores: dict[str, list[dict[str, Any]]] = {}
            for r in recs:
                stores.setdefault(uri or r.get("uri", ""), []).append(r)
            sent = 0
            for u, rs in stores.items():
                client, lock = client_for(u)
                with lock():
                    sent += send(client, rs, cache)
            with self.locked() as f:
                f.seek(0)
                rest = f.read().splitlines(keepends=True)[n:]
                if rest:
                    _keep(self.path, "".join(rest))
                else:
                    _truncate(f)
        return sent


class SendCache:
    """What one process has learnt its store holds, across sends (the run's writer thread sends after every
    update: reading each key's history again each time would cost O(updates) store reads per update). Forgotten
    after any failure, when a write may or may not have landed."""

    def __init__(self) -> None:
        self.have: dict[tuple[str, str], set[int]] = {}
        self.known: dict[str, bool] = {}

    def clear(self) -> None:
        self.have.clear()
        self.known.clear()


def _keep(path: Path, rest: str) -> None:
    """Replace the spool with the lines appended while it was being sent (atomically: a crash keeps the old file,
    whose sent lines the next send skips); appenders waiting for the old file's lock open the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as g:
        g.write(rest)
        g.flush()
        os.fsync(g.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _truncate(f: IO[str]) -> None:
    """Empty the spool once everything in it is in MLflow (a test makes this raise: a crash right here)."""
    f.truncate(0)
    f.flush()
    os.fsync(f.fileno())


def send(client: Any, recs: Iterable[dict[str, Any]], cache: SendCache | None = None) -> int:
    """Send spooled writes to their runs in order, each (run, key, step) once: steps MLflow already has are
    skipped. Returns the metric points sent. ``cache``: kept across calls, cleared when one fails."""
    cache = cache if cache is not None else SendCache()
    try:
        return _send(client, recs, cache.have, cache.known)
    except BaseException:
        cache.clear()  # a batch may or may not have landed: read the store again next time
        raise


def _send(
    client: Any, recs: Iterable[dict[str, Any]], have: dict[tuple[str, str], set[int]], known: dict[str, bool]
) -> int:
    from mlflow.entities import Metric, RunTag
    from mlflow.exceptions import MlflowException

    batch: list[Any] = []
    batch_run: str | None = None
    sent = dropped = 0

    def flush() -> None:
        nonlocal batch, sent
        for i in range(0, len(batch), 1000):
            client.log_batch(batch_run, metrics=batch[i : i + 1000])
        sent += len(batch)
        batch = []

    for r in recs:
        rid = r["run_id"]
        if rid not in known:
            try:
                known[rid] = client.get_run(rid).info.lifecycle_stage != "deleted"  # a deleted run takes no writes
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                known[rid] = False
        if not known[rid]:
            dropped += 1
            continue
        if rid != batch_run:
            flush()
            batch_run = rid
        if "metrics" in r:
            step = int(r["step"])
            for k, v in r["metrics"].items():
                if (rid, k) not in have:
                    have[rid, k] = {m.step for m in client.get_metric_history(rid, k)}
                if step not in have[rid, k]:
                    batch.append(Metric(k, float(v), int(r["time"]), step))
                    have[rid, k].add(step)
            continue
        flush()
        if "status" in r:
            if r["status"] in TERMINAL:
                client.set_terminated(rid, status=r["status"], end_time=int(r["time"]))
            else:
                client.update_run(rid, status=r["status"])
        elif "artifact" in r:
            path = Path(r["artifact"])
            if not path.exists():
                print(f"warning: {path} is gone: not sent to MLflow run {rid}", file=sys.stderr)
            elif path.is_dir():
                client.log_artifacts(rid, str(path), r.get("artifact_path"))
            else:
                client.log_artifact(rid, str(path), r.get("artifact_path"))
        elif "inputs" in r:  # MLflow dataset inputs: the store keeps each (dataset, run) once
            client.log_inputs(rid, datasets=[_dataset_input(d) for d in r["inputs"]])
        elif "tags" in r:  # run tags: setting one again to its value changes nothing
            client.log_batch(rid, tags=[RunTag(k, str(v)) for k, v in r["tags"].items()])
        elif "experiment_tags" in r:  # tags of the run's experiment (e.g. a saved view of the runs table)
            exp = client.get_run(rid).info.experiment_id
            for k, v in r["experiment_tags"].items():
                client.set_experiment_tag(exp, k, str(v))
    flush()
    if dropped:
        gone = sorted(k for k, v in known.items() if not v)
        print(
            f"warning: {dropped} spooled tracking writes of MLflow runs {', '.join(gone)} not sent: the store does "
            "not know these runs, or they were deleted (the run folder's log.jsonl and eval.jsonl keep the metrics)",
            file=sys.stderr,
        )
    return sent


def _dataset_input(d: dict[str, Any]) -> Any:
    """A spooled dataset input (esbatch/tracking/mlflow_tracker.py: dataset_input) as MLflow's entity."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    return DatasetInput(Dataset(**d["dataset"]), [InputTag(k, str(v)) for k, v in d.get("tags", {}).items()])


_ANCHOR = Anchor()  # this process's wall clock, read once: later times add monotonic elapsed time


def now_ms() -> int:
    """A timestamp for MLflow (ms since the epoch) that a wall-clock jump does not move (esbatch/clock.py)."""
    return _ANCHOR.now_ms()
