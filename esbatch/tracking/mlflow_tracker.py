"""MLflow logging for training runs: params = flattened resolved config, metrics per update, artifacts.

The default store is a local sqlite database beside the run directories (no server needed):
``sqlite:///<output_dir>/mlflow.db`` with artifacts in ``<output_dir>/mlartifacts``. Open it with
``mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import socket
import sqlite3
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import esbatch
from esbatch.clock import Anchor
from esbatch.tracking import spool as spooling
from esbatch.tracking.spool import (
    BACKOFF_S,
    RETRY_EVERY_S,
    Spool,
    TrackingStoreError,
    describe,
    retry,
    send,
    transient,
)

T = TypeVar("T")


@contextlib.contextmanager
def sqlite_lock(uri: str) -> Iterator[None]:
    """An exclusive file lock beside a sqlite store while it is opened (and possibly created: from the empty-store
    template, ``seed_sqlite``)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            seed_sqlite(db)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _empty_store_template() -> Path | None:
    """An empty sqlite store made by this MLflow version, built once into the cache (ESBATCH_CACHE, default
    ~/.cache/esbatch); None where it cannot be made (MLflow then builds each store itself)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    cache = Path(os.environ.get("ESBATCH_CACHE", Path.home() / ".cache" / "esbatch"))
    tmpl = cache / f"mlflow-{mlflow.__version__}-empty.db"
    if tmpl.is_file():
        return tmpl
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            MlflowClient(f"sqlite:///{tmp}/empty.db").search_experiments()  # creates the schema
            os.replace(f"{tmp}/empty.db", tmpl)  # atomic: processes building it at once all see a whole file
    except Exception as e:  # noqa: BLE001 - a cache we cannot write costs time, never the run
        print(f"warning: no MLflow store template in {cache} ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    return tmpl


_SOUND: set[tuple[Path, int]] = set()  # (store, inode) this process found whole: seed_sqlite checks each once


def half_made(db: Path, tmpl: Path) -> str | None:
    """Why ``db`` is a store whose creation stopped partway (a full disk, a kill during MLflow's migrations, which
    are not transactional: every later open fails with "table scorers already exists"), or None. Half-made: its
    schema revision is not the template's and nothing was logged in it (no run, no experiment but Default). A
    store with runs in it, or one sqlite cannot read, is left to MLflow's own error (TrackingStoreError)."""
    try:
        with contextlib.closing(sqlite3.connect(tmpl)) as con:
            head = con.execute("SELECT version_num FROM alembic_version").fetchall()
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

            def rows(sql: str, table: str) -> list[Any]:
                return con.execute(sql).fetchall() if table in tables else []

            have = rows("SELECT version_num FROM alembic_version", "alembic_version")
            if have == head:
                return None
            if rows("SELECT 1 FROM runs LIMIT 1", "runs") or rows(
                "SELECT 1 FROM experiments WHERE experiment_id != 0 LIMIT 1", "experiments"
            ):
                return None
    except sqlite3.Error:
        return None
    found = have[0][0] if have else "none"
    return f"an MLflow store whose creation stopped partway (schema revision {found}, not {head[0][0]}; no runs)"


def seed_sqlite(db: Path) -> None:
    """Start a new sqlite store at ``db`` as a copy of the empty-store template, with the Default experiment's
    location and times as MLflow would have written them. Creating the schema runs MLflow's migrations (2-3 s,
    once per sweep and once per run with offline tracking); the copy takes milliseconds. Called under the store's
    lock; nothing happens when ``db`` exists (checked once per process: a half-made one, ``half_made``, is moved
    aside to ``<db>.half-made`` and made again) or MLflow's workspaces are on (a different schema)."""
    if os.environ.get("MLFLOW_ENABLE_WORKSPACES", "").lower() in ("1", "true"):
        return
    if db.exists():
        if (db, db.stat().st_ino) in _SOUND:
            return
        tmpl = _empty_store_template()
        if tmpl is None or not (why := half_made(db, tmpl)):
            _SOUND.add((db, db.stat().st_ino))
            return
        aside = db.with_name(f"{db.name}.half-made")
        os.replace(db, aside)
        print(f"warning: {db}: {why}; moved aside to {aside} and made again", file=sys.stderr)
    tmpl = _empty_store_template()
    if tmpl is None:
        return
    from mlflow.utils.uri import append_to_uri_path, resolve_uri_if_local

    root = os.environ.get("_MLFLOW_SERVER_ARTIFACT_ROOT", "./mlruns")  # MLflow's default artifact root
    tmp = db.with_name(f".{db.name}.seed{os.getpid()}")
    try:
        shutil.copyfile(tmpl, tmp)
        now = int(time.time() * 1000)
        with contextlib.closing(sqlite3.connect(tmp)) as con, con:
            con.execute(
                "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                "WHERE experiment_id = 0",
                (append_to_uri_path(resolve_uri_if_local(root), "0"), now, now),
            )
        os.replace(tmp, db)
    except (OSError, sqlite3.Error) as e:  # MLflow then creates the store itself, and reports what it cannot do
        print(f"warning: could not seed {db} from {tmpl} ({type(e).__name__}: {e})", file=sys.stderr)
    finally:
        tmp.unlink(missing_ok=True)


def default_tracking_uri(output_dir: str | Path) -> str:
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


@functools.cache
def _git_commit() -> str:
    return git_commit(Path(esbatch.__file__).resolve().parent)


def git_commit(path: Path) -> str:
    """The commit checked out in the repository holding ``path``, read from its .git (no git process: one per
    tracked run added up in sweeps and tests); "unknown" outside a repository (an installed wheel) or when it
    cannot be read."""
    for top in (path, *path.parents):
        dot = top / ".git"
        if dot.exists():
            break
    else:
        return "unknown"
    try:
        gitdir = dot if dot.is_dir() else (top / dot.read_text().split("gitdir:", 1)[1].strip()).resolve()
        common = gitdir / "commondir"  # a worktree keeps its refs in the main repository
        common = (gitdir / common.read_text().strip()).resolve() if common.exists() else gitdir
        head = (gitdir / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or "unknown"  # a detached HEAD holds the commit itself
        ref = head[4:].strip()
        for base in (gitdir, common):
            if (base / ref).is_file():
                return (base / ref).read_text().strip() or "unknown"
        packed = common / "packed-refs"
        for line in packed.read_text().splitlines() if packed.exists() else []:
            if line.endswith(" " + ref):
                return line.split(" ", 1)[0]
    except (OSError, IndexError):
        pass
    return "unknown"


def parent_tag(parent_run_id: str | None) -> dict[str, str]:
    """The tag that nests a run under ``parent_run_id`` in the MLflow UI (pipelines, sweeps, evals)."""
    return {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}


def run_tags() -> dict[str, str]:
    return {"git_commit": _git_commit(), "host": socket.gethostname(), "esbatch_version": esbatch.__version__}


def point_tags(point: dict[str, Any]) -> dict[str, str]:
    """A sweep run's grid point as MLflow tags named by the sweep's own keys (``es.population_size``, ``method``),
    so the runs table groups by them ("Group by" a tag); config keys are params with the same names too."""
    return {str(k): str(v) for k, v in point.items()}


# ----------------------------------------------------------------------------- datasets (MLflow dataset inputs)
DIGEST_LEN = 16  # hex characters of sha256 kept (MLflow's own digests are 8; its column holds up to 36)


def problems_digest(rows: list[tuple[str, str]]) -> str:
    """The content digest of a run's problems, in order: sha256 of their JSON ``[[question, answer], ...]``
    (compact separators, UTF-8), first DIGEST_LEN hex characters. Two runs show the same digest exactly when they
    trained (or were scored) on the same problems in the same order."""
    text = json.dumps([[q, a] for q, a in rows], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_LEN]


def dataset_source(
    data_path: str | None = None,
    hub_id: str | None = None,
    hub_config: str | None = None,
    hub_split: str | None = None,
    revision: str | None = None,
    generator: dict[str, Any] | None = None,
) -> Any:
    """Where a task's problems come from, as an MLflow dataset source: a local data file (``local``), a Hugging
    Face hub dataset (``hugging_face``: id, config, split, revision), else the task's generator (``code``: its
    name, params and seed, which reproduce the problems)."""
    if data_path:
        from mlflow.data.dataset_source_registry import resolve_dataset_source

        with warnings.catch_warnings():  # MLflow registers two local-file sources alike and warns that it picks one
            warnings.simplefilter("ignore", UserWarning)
            return resolve_dataset_source(str(Path(data_path).resolve()))
    if hub_id:
        from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

        return HuggingFaceDatasetSource(hub_id, config_name=hub_config, split=hub_split, revision=revision)
    from mlflow.data.code_dataset_source import CodeDatasetSource

    gen = generator or {}
    return CodeDatasetSource({f"esbatch.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in gen.items()})


def dataset_input(name: str, rows: list[tuple[str, str]], source: Any, split: str, context: str) -> dict[str, Any]:
    """One MLflow dataset input as the spool keeps it (plain strings): the dataset's name, digest
    (``problems_digest``), source type and source, schema and profile (``num_rows``: its size), made by
    ``mlflow.data.from_pandas`` over the problems' question and answer columns; and the input's tags, MLflow's
    context (``training`` / ``eval``, what the UI's Datasets column shows) and ``esbatch.split``."""
    import mlflow.data
    import pandas as pd

    df = pd.DataFrame([list(r) for r in rows], columns=["question", "answer"])
    ds = mlflow.data.from_pandas(df, source=source, name=name, digest=problems_digest(rows))
    fields = ds.to_dict()
    keep = ("name", "digest", "source_type", "source", "schema", "profile")
    tags = {"mlflow.data.context": context, "esbatch.split": split}
    return {"dataset": {k: fields.get(k) for k in keep}, "tags": tags}


class MLflowTracker:
    """One MLflow run per training run; resumable by run id so a resumed run keeps one MLflow run.

    Every write is tried with backoff (esbatch/tracking/spool.py: six tries over about a minute). With ``spool``
    (the run folder's ``tracking.pending.jsonl``), metrics, artifacts and the end status the store still
    refuses are kept there and sent later, each metric step once, and training goes on; without it the last
    failure raises. ``sleep`` (default ``spool.pause``, looked up when the tracker is made) and ``clock`` are
    injectable: tests never wait. Times sent to MLflow (the run's start, each metric's, the end) are ``wall()``
    read once, here, plus ``clock()``'s elapsed time (esbatch/clock.py): a wall-clock jump moves none of them."""

    def __init__(
        self,
        uri: str,
        experiment: str,
        artifact_root: str | Path | None = None,
        spool: str | Path | None = None,
        *,
        sleep: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        import mlflow
        from mlflow.tracking import MlflowClient

        self.mlflow, self.uri = mlflow, uri
        self.spool = Spool(spool) if spool is not None else None
        self._sleep, self._clock = sleep or spooling.pause, clock
        self._times = Anchor(wall, clock)
        self._spooling = False  # the store refused a write after every try: writes go to the spool
        self._next_try = 0.0  # while spooling, the store is not tried again before this clock reading

        def open_store(attempt: int) -> str:
            with sqlite_lock(uri):  # concurrent first use of one sqlite file races on schema creation
                self.client = MlflowClient(tracking_uri=uri)
                return self._experiment(experiment, uri, artifact_root)

        self.experiment_id = self._before_training(lambda: retry(open_store, self._sleep))
        self.run_id: str | None = None

    def _before_training(self, op: Callable[[], T]) -> T:
        """``op()``, a store that is damaged or still refuses after every try raised as TrackingStoreError: a clear
        failure while nothing has been trained (after that, the spool keeps what the store refuses)."""
        try:
            return op()
        except Exception as e:
            if not transient(e):
                raise
            raise TrackingStoreError(self.uri, e) from e

    def _experiment(self, experiment: str, uri: str, artifact_root: str | Path | None) -> str:
        exp = self.client.get_experiment_by_name(experiment)
        if exp is not None and exp.lifecycle_stage == "deleted":  # its runs could not be logged to, or resumed
            self.client.restore_experiment(exp.experiment_id)  # with the runs deleted with it
            print(
                f"warning: MLflow experiment {experiment!r} in {uri} was deleted; restored it (and its runs) to log "
                "this run. Delete it again afterwards, or set tracking.experiment to log elsewhere",
                file=sys.stderr,
            )
        if exp is None:
            loc = None
            if artifact_root is not None and uri.startswith("sqlite:"):
                loc = Path(artifact_root).resolve().as_uri()
            try:
                return self.client.create_experiment(experiment, artifact_location=loc)
            except Exception:  # created concurrently by another process
                return self.client.get_experiment_by_name(experiment).experiment_id
        return exp.experiment_id

    def start(self, run_name: str, params: dict[str, Any], tags: dict[str, str], run_id: str | None = None) -> str:
        """Create the run (or reopen ``run_id`` on resume) and log params once. Writes a crashed process left in
        the spool are sent first (its end status must not land after this reopening)."""
        if self.spool is not None and self.spool.pending():
            self._drain(force=True)
        return self._before_training(
            lambda: retry(lambda attempt: self._start(run_name, params, tags, run_id), self._sleep)
        )

    def _start(self, run_name: str, params: dict[str, Any], tags: dict[str, str], run_id: str | None) -> str:
        from mlflow.entities import Param, RunTag

        with self._lock():
            if run_id is not None and (gone := self._gone(run_id)):
                print(
                    f"warning: MLflow run {run_id} {gone}; logging the resumed run as a new MLflow run", file=sys.stderr
                )
                run_id = None
            if run_id is not None:
                self.run_id = run_id
                self.client.update_run(run_id, status="RUNNING")
                self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
                if self.spool is not None and self.spool.pending():  # an old end status there is sent before it
                    self.spool.append(self._record(status="RUNNING"))
                return run_id
            if self.run_id is None:  # else an earlier try created it, then failed: not a second run
                self.run_id = self.client.create_run(
                    self.experiment_id, start_time=self._times.now_ms(), run_name=run_name, tags=tags
                ).info.run_id
            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[i : i + 100])
        return self.run_id

    def _gone(self, run_id: str) -> str | None:
        """Why the run to resume cannot be logged to (not in this store, or deleted), or None."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as e:
            if transient(e):
                raise  # the store is busy, not missing the run: try again
            return f"is not in {self.uri} (a moved run folder or another store)"
        if run.info.lifecycle_stage == "deleted":
            return f"was deleted from {self.uri}"
        return None

    def _lock(self) -> contextlib.AbstractContextManager[None]:
        """Writers to one sqlite file take turns (many array tasks may log at once); servers need no lock."""
        return sqlite_lock(self.uri)

    def last_step(self, key: str) -> int:
        """Largest step logged for ``key`` (-1 if none), in MLflow or still in the spool: lets a resumed run log
        each step exactly once. When the store cannot be read, later writes go through the spool, whose sending
        skips the steps MLflow has."""
        if self.spool is not None and self.spool.pending():
            self._drain(force=True)

        def read(attempt: int) -> list[Any]:
            with self._lock():
                return self.client.get_metric_history(self.run_id, key)

        try:
            hist = retry(read, self._sleep)
        except Exception as e:
            if self.spool is None or not transient(e):
                raise
            self._spool_from_now(e)
            hist = []
        steps = [m.step for m in hist]
        if self.spool is not None:
            steps += [
                r["step"] for r in self.spool.records() if r["run_id"] == self.run_id and key in r.get("metrics", {})
            ]
        return max(steps, default=-1)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        if values:
            self._write(self._record(step=int(step), metrics=values))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._write(self._record(artifact=str(Path(path).resolve()), artifact_path=artifact_path))

    def log_artifacts(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._write(self._record(artifact=str(Path(path).resolve()), artifact_path=artifact_path))

    def log_inputs(self, inputs: list[dict[str, Any]]) -> None:
        """Dataset inputs (``dataset_input``); the store keeps each (dataset, run) once, however often sent."""
        if inputs:
            self._write(self._record(inputs=inputs))

    def end(self, status: str = "FINISHED") -> None:
        """Mark the run ended; a spool left from the run is sent first, with the full backoff. What the store
        still refuses stays in the spool (`esbatch aggregate` sends it)."""
        if not self.run_id:
            return
        rec = self._record(status=status)
        if self.spool is not None and (self._spooling or self.spool.pending()):
            self.spool.append(rec)
            if not self._drain(force=True, backoff=True):
                print(
                    f"warning: the run's MLflow writes (its end, {status}) stay in {self.spool.path}: "
                    "`esbatch aggregate` or a resume sends them",
                    file=sys.stderr,
                )
            return
        self._write(rec)

    # ------------------------------------------------------------------ writing, retrying, spooling
    def _record(self, **what: Any) -> dict[str, Any]:
        return {"run_id": self.run_id, "uri": self.uri, "time": self._times.now_ms(), **what}

    def _write(self, rec: dict[str, Any]) -> None:
        """Send one write, tried with backoff (a retry skips the metric steps an earlier try may have landed);
        into the spool when the store still refuses it, or while earlier writes wait there (they go first)."""
        if self.spool is not None and (self._spooling or self.spool.pending()):
            self.spool.append(rec)
            self._drain()
            return

        def attempt(i: int) -> None:
            with self._lock():
                if i > 0 or "metrics" not in rec:
                    send(self.client, [rec])
                else:
                    self._send_metrics(rec)

        try:
            retry(attempt, self._sleep)
        except Exception as e:
            if self.spool is None or not transient(e):
                raise
            self.spool.append(rec)
            self._spool_from_now(e)

    def _send_metrics(self, rec: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        ms = [Metric(k, v, rec["time"], rec["step"]) for k, v in rec["metrics"].items()]
        self.client.log_batch(rec["run_id"], metrics=ms)

    def _spool_from_now(self, e: BaseException) -> None:
        self._next_try = self._clock() + RETRY_EVERY_S
        if not self._spooling:
            self._spooling = True
            print(
                f"warning: the MLflow store {self.uri} is unavailable ({describe(e)}); training goes on, tracking "
                f"writes are kept in {self.spool.path if self.spool else '?'} and sent when it answers again",
                file=sys.stderr,
            )

    def _drain(self, force: bool = False, backoff: bool = False) -> bool:
        """Send the spool, oldest first (at most once per RETRY_EVERY_S unless ``force``); whether it is empty."""
        if self.spool is None or (not force and self._clock() < self._next_try):
            return False
        from mlflow.tracking import MlflowClient

        def store(uri: str) -> tuple[Any, Any]:
            if uri == self.uri:
                return self.client, self._lock
            return MlflowClient(tracking_uri=uri), lambda: sqlite_lock(uri)

        try:
            n = retry(lambda attempt: self.spool.send(store), self._sleep, delays=BACKOFF_S if backoff else ())
        except Exception as e:
            if not transient(e):
                raise
            self._spool_from_now(e)
            return False
        if self._spooling:
            print(f"note: the MLflow store {self.uri} answers again: {n} spooled metric points sent", file=sys.stderr)
        self._spooling = False
        return True


class NullTracker:
    """What ranks other than 0 log to: nothing (rank 0 holds the MLflow run)."""

    experiment_id = None
    run_id = None

    def start(self, *args: Any, **kwargs: Any) -> None:
        return None

    def last_step(self, key: str) -> int:
        return -1

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def log_artifacts(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def log_inputs(self, inputs: list[dict[str, Any]]) -> None: ...

    def end(self, status: str = "FINISHED") -> None: ...


def log_artifacts_to(uri: str, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
    """Add the files of folder ``path`` to an existing (possibly finished) MLflow run, e.g. post-hoc analyses.
    An unreachable server fails after one try instead of MLflow's minutes of retries."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    with sqlite_lock(uri):
        client = MlflowClient(tracking_uri=uri)
        client.get_run(run_id)  # a run missing from this store is an error, not a new run
        client.log_artifacts(run_id, str(path), artifact_path)
