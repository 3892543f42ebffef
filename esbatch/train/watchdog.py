"""No hang without a deadline: a watchdog thread that ends a run stuck in one phase, with a named error.

A rank that stops answering leaves its peers waiting inside a collective; an engine RPC or a scorer that
never returns blocks in C code or a thread no exception can reach. So every phase of an update (generation
and scoring, the collectives, the checkpoint, the held-out evaluation) runs under ``phase(what)``; when one
outlasts ``run.hang_timeout_s`` the watchdog prints which phase hung, dumps every thread's stack, and ends
the process with ``EXIT_HUNG``. The run folder is intact (the log is appended before anything else), so the
resumed run (the next `esbatch sweep`, or SLURM requeueing the task: see esbatch/launch/task.py) continues
bit for bit. Setup (loading a model, possibly downloading it) is not timed, nor is tracking: MLflow is written by
a thread (esbatch/tracking/writer.py). Before the exit, the run session's hook records the run as failed, with the
phase that hung, in run.json and MLflow (esbatch/train/lifecycle.py).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from esbatch.deadlines import before_exit, forget, run_before_exit, waiting_on, waits

EXIT_HUNG = 75  # EX_TEMPFAIL: try again (the sweep resubmits, a SLURM task requeues)
__all__ = ["EXIT_HUNG", "Watchdog", "before_exit", "forget", "waiting_on"]


class Watchdog:
    """One deadline at a time; ``phase`` arms it, leaving the phase disarms it.

    ``clock``: seconds, read for the deadlines (time.monotonic; a test passes a fake one, advances it by hand and
    calls ``poke``, so nothing depends on how fast threads run).
    """

    def __init__(
        self,
        limit_s: float,
        on_hang: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit_s = limit_s
        self.on_hang = on_hang or _exit_hung
        self._clock = clock
        self._what: str | None = None
        self._deadline = float("inf")
        self._looks = 0  # times the watch thread has compared the phase's deadline with the clock
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="esbatch-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        with self._cond:
            outer = (self._what, self._deadline)  # phases nest: the innermost deadline counts while it lasts
            self._what, self._deadline = what, self._clock() + self.limit_s
            self._cond.notify_all()  # all: a test's poke may wait on the condition too
        try:
            yield
        finally:
            with self._cond:
                self._what, self._deadline = outer
                self._cond.notify_all()

    def poke(self, timeout: float | None = None) -> bool:
        """Wake the watch thread and return once it has looked at the current phase and clock (and called
        ``on_hang`` if the phase is past its deadline); False if it did not look within ``timeout`` seconds.
        For tests that drive ``clock`` by hand: after ``poke`` they know what the watchdog saw."""
        with self._cond:
            seen = self._looks
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._looks > seen, timeout)

    def _watch(self) -> None:
        with self._cond:
            while True:
                left = self._deadline - self._clock()
                if left <= 0 and self._what is not None:
                    self.on_hang(self._what, self.limit_s)
                    self._deadline = float("inf")  # on_hang returned (tests): wait for the next phase
                    continue
                self._looks += 1
                self._cond.notify_all()  # a poke waiting for this look
                self._cond.wait(timeout=None if left == float("inf") else max(left, 0.01))


def _exit_hung(what: str, limit_s: float) -> None:
    print(
        f"\nesbatch: hung: {what} did not finish within run.hang_timeout_s = {limit_s:g} s (a rank that stopped "
        "answering, an engine or a scorer that never returns). Stacks of every thread follow; the run folder is "
        f"intact and resumes where it stopped. Exit code {EXIT_HUNG}.",
        file=sys.stderr,
        flush=True,
    )
    blocked = waits()
    if blocked:
        print(f"esbatch: hung: waiting on {'; '.join(blocked)}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    run_before_exit(what)
    sys.stderr.flush()
    os._exit(EXIT_HUNG)  # the main thread may be stuck in C code: nothing else reliably ends it
