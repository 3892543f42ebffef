"""Durations come from a monotonic clock: a wall-clock jump (NTP, a VM resumed, an operator's `date -s`) changes no
figure and no decision. Wall-clock time is read once, where a timestamp is needed, and later timestamps are that
reading plus monotonic elapsed time (``Anchor``); progress bars time themselves monotonically (``progress``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class Anchor:
    """Timestamps that move with a monotonic clock: ``wall()`` read once, at creation, plus ``clock()``'s elapsed
    seconds since. Both are injectable (a test jumps the wall clock and checks nothing moves)."""

    def __init__(self, wall: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.wall0, self.mono0 = wall(), clock()

    def now(self) -> float:
        """Seconds since the epoch: the wall clock at creation plus monotonic time elapsed since."""
        return self.wall0 + (self.clock() - self.mono0)

    def now_ms(self) -> int:
        return int(self.now() * 1000)


def progress(*args: Any, clock: Callable[[], float] = time.monotonic, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)`` whose rate, elapsed time and ETA come from ``clock`` (tqdm reads
    time.time through its ``_time`` attribute: an ETA of hours after the wall clock went back)."""
    from tqdm.auto import tqdm

    bar = tqdm(*args, **kwargs)
    bar._time = clock
    bar.start_t = bar.last_print_t = clock()
    return bar
