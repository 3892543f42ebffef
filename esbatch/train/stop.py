"""One stop policy for every entry point (train, eval, a local sweep task, a SLURM task, the local launcher).

A signal never raises where it lands: SIGTERM and SIGINT (and, in a SLURM task, USR2) only set ``STOP``,
and the loops check it between updates (or eval chunks, or stages) and raise ``Stopped`` there. So a
signal can never interrupt an MLflow sqlite write half way (which left the database locked and the run
stuck RUNNING), however often it is repeated. The run is then marked killed and is resumable.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable
from typing import Any

STOP = threading.Event()
_REQUESTED: list[int] = []


class Stopped(KeyboardInterrupt):
    """Raised between units of work after a stop was asked for (a KeyboardInterrupt: Ctrl-C semantics)."""


def _on_signal(signum: int, frame: Any) -> None:
    if not STOP.is_set():
        name = signal.Signals(signum).name
        print(f"\n{name}: stopping after the current update (the run stays resumable)", file=sys.stderr, flush=True)
    _REQUESTED.append(signum)
    STOP.set()


def install(signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Make ``signals`` set the stop flag (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in signals:
        signal.signal(s, _on_signal)


def settle() -> None:
    """Once a stop has been handled, ignore further stop signals while the process exits (Python restores the
    default handlers during shutdown, so a late signal would otherwise end a clean exit as 'killed')."""
    if STOP.is_set() and threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)


def check() -> None:
    """Raise ``Stopped`` if a stop was asked for; call between units of work."""
    if STOP.is_set():
        raise Stopped()


def requested() -> bool:
    return STOP.is_set()


def received(signum: int) -> bool:
    """Whether this signal was among those that asked to stop (e.g. USR2: requeue after stopping)."""
    return signum in _REQUESTED
