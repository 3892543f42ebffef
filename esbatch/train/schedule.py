"""Keep-tail mini-batch schedule, reshuffled each epoch (paper App. G.1).

The batch of update t is a pure function of (seed, t, n, B): resuming needs no saved data position.
"""

from __future__ import annotations

import numpy as np


def updates_per_epoch(n: int, batch_size: int) -> int:
    return -(-n // batch_size)


def batch_indices(seed: int, t: int, n: int, batch_size: int) -> tuple[int, list[int]]:
    """(epoch, example indices) of update ``t``; the last batch of an epoch keeps the tail (may be short)."""
    if n <= 0:
        raise ValueError("the training split is empty")
    per_epoch = updates_per_epoch(n, batch_size)
    epoch, k = divmod(t, per_epoch)
    order = np.random.default_rng([seed, epoch, 0xDA7A]).permutation(n)
    return epoch, order[k * batch_size : (k + 1) * batch_size].tolist()
