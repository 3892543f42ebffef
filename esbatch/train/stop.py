"""One stop policy for every entry point (train, eval, a local sweep task, a SLURM task, the local launcher).

A signal never raises where it lands: SIGTERM and SIGINT (and, in a SLURM task, USR2) only set ``STOP``,
and the loops check it between updates (or eval chunks, or stages) and raise ``Stopped`` there. So a
signal can never interrupt an MLflow sqlite write half way (which left the database locked and the run
stuck RUNNING), however often it is repeated. The run is then marked killed and is resumable.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable
from typing import Any

STOP = threading.Event()
_REQUESTED: list[int] = []
_in_handler = False


class Stopped(KeyboardInterrupt):
    """Raised between units of work after a stop was asked for (a KeyboardInterrupt: Ctrl-C semantics)."""


def _on_signal(signum: int, frame: Any) -> None:
    """Python runs a handler between two bytecodes of the main thread, also inside another handler: a second
    signal arriving while ``STOP.set()`` holds its lock would run this again and block on that lock forever (seen
    under a signal storm as a recursion in ``Event.set``). So a handler that finds one already running only
    records its signal, and the message goes out with ``os.write``, which cannot meet a half-done ``print``."""
    global _in_handler
    _REQUESTED.append(signum)
    if _in_handler or STOP.is_set():
        return
    _in_handler = True
    try:
        name = signal.Signals(signum).name
        try:
            os.write(2, f"\n{name}: stopping after the current update (the run stays resumable)\n".encode())
        except OSError:  # stderr closed: the stop still counts
            pass
        STOP.set()
    finally:
        _in_handler = False


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
