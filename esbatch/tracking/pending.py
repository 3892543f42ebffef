"""Sending the tracking writes a run left in its folder (esbatch/tracking/spool.py) from outside the run:
`esbatch aggregate` does, for each run folder of the sweep, before it reads the runs back from MLflow."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from esbatch.tracking.mlflow_tracker import sqlite_lock
from esbatch.tracking.spool import FILE, Spool, describe, spool_path


def _store_for(uri: str) -> tuple[Any, Callable[[], Any]]:
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        raise FileNotFoundError(f"no MLflow store at {uri} (moved?)")  # not a new, empty store
    return MlflowClient(tracking_uri=uri), lambda: sqlite_lock(uri)


def drain(run_folder: str | Path, uri: str | None = None) -> int:
    """Send the tracking writes spooled in a run folder (and in its stage folders, a pipeline's) to their store
    (``uri``: another store than the one each line names, e.g. the folder's moved store); returns the metric
    points sent. A store that still fails is a warning: the spool stays for the next try."""
    folder = Path(run_folder)
    n = 0
    for path in [spool_path(folder), *sorted(folder.glob(f"*/{FILE}"))]:
        sp = Spool(path)
        if not sp.pending():
            continue
        try:
            sent = sp.send(_store_for, uri)
        except Exception as e:  # noqa: BLE001 - a report must not fail because a run's tracking is still pending
            print(f"warning: {sp.path}: spooled tracking writes not sent ({describe(e)}); kept", file=sys.stderr)
            continue
        print(f"note: {sp.path}: sent {sent} spooled metric points to MLflow", file=sys.stderr)
        n += sent
    return n


def drain_all(run_folders: Iterable[str | Path]) -> int:
    """:func:`drain` each folder (``esbatch aggregate``, before it reads the runs back from MLflow)."""
    return sum(drain(f) for f in run_folders)
