"""Keep-tail mini-batch schedule, reshuffled each epoch (paper App. G.1).

The batch of update t is a pure function of (seed, t, n, B, start): resuming needs no saved data position.
``start`` counts the examples an earlier pipeline stage consumed from the same stream (epoch e, position p
is e * n + p), so ES->GRPO sees the examples one single run would, not the first half twice.
"""

from __future__ import annotations

import numpy as np


def updates_per_epoch(n: int, batch_size: int) -> int:
    return -(-n // batch_size)


def _span(t: int, n: int, batch_size: int, start: int) -> tuple[int, int, int]:
    """(epoch, lo, hi): update ``t`` takes positions [lo, hi) of that epoch's permutation."""
    if n <= 0:
        raise ValueError("the training split is empty")
    e0, p0 = divmod(start, n)
    first = updates_per_epoch(n - p0, batch_size)  # updates left in the epoch the stream is in
    if t < first:
        epoch, lo = e0, p0 + t * batch_size
    else:
        epoch, k = divmod(t - first, updates_per_epoch(n, batch_size))
        epoch, lo = e0 + 1 + epoch, k * batch_size
    return epoch, lo, min(lo + batch_size, n)


def batch_indices(seed: int, t: int, n: int, batch_size: int, start: int = 0) -> tuple[int, list[int]]:
    """(epoch, example indices) of update ``t``; the last batch of an epoch keeps the tail (may be short)."""
    epoch, lo, hi = _span(t, n, batch_size, start)
    order = np.random.default_rng([seed, epoch, 0xDA7A]).permutation(n)
    return epoch, order[lo:hi].tolist()


def consumed(updates: int, n: int, batch_size: int, start: int = 0) -> int:
    """Stream position after ``updates`` updates of ``batch_size`` that began at ``start``."""
    if updates <= 0:
        return start
    epoch, _, hi = _span(updates - 1, n, batch_size, start)
    return epoch * n + hi


def schedule_start(n: int, before: list) -> int:
    """Stream position after the earlier stages ``before`` = [[updates, batch_size], ...] (run.data_before)."""
    start = 0
    for updates, batch_size in before:
        start = consumed(int(updates), n, int(batch_size), start)
    return start
