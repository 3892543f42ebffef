"""What a hang must do, process-wide: the hooks run before a hung process exits and what each thread waits on.

Kept below every layer (like esbatch/registry.py) so a backend can register its cleanup (the vLLM engines'
processes) and name its blocking calls without importing the training code; the watchdog that enforces the
deadline (esbatch/train/watchdog.py) reads both when it ends a run.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_before_exit: list[Callable[[str], None]] = []
_waits: dict[int, str] = {}  # thread id -> what that thread is blocked on, named in the hang message
_waits_lock = threading.Lock()


def before_exit(fn: Callable[[str], None]) -> None:
    """Register ``fn(what)`` to run when a hang ends the process (a SLURM task requeues itself there, the vLLM
    backend kills its engine processes)."""
    _before_exit.append(fn)


def forget(fn: Callable[[str], None]) -> None:
    """Unregister a ``before_exit`` function (its resources are gone)."""
    if fn in _before_exit:
        _before_exit.remove(fn)


def waits() -> list[str]:
    """What every thread is blocked on now (see ``waiting_on``)."""
    with _waits_lock:
        return list(_waits.values())


def run_before_exit(what: str) -> None:
    """Run every ``before_exit`` function with ``what`` (the phase that hung); one that raises (submitit's requeue
    ends with SystemExit) is reported and the rest still run: nothing may stop the exit."""
    for fn in list(_before_exit):
        try:
            fn(what)
        except BaseException as e:  # noqa: BLE001 - submitit's requeue ends with SystemExit
            print(f"esbatch: after the hang: {type(e).__name__}: {e}", file=sys.stderr)


@contextmanager
def waiting_on(what: str) -> Iterator[None]:
    """Name what this thread is about to block on (an RPC to a vLLM engine, a generate call), so a hang says
    which engine and call stopped answering. Sets no deadline: the phase around it does."""
    tid = threading.get_ident()
    with _waits_lock:
        outer = _waits.get(tid)
        _waits[tid] = what
    try:
        yield
    finally:
        with _waits_lock:
            if outer is None:
                _waits.pop(tid, None)
            else:
                _waits[tid] = outer
