"""Curve smoothing for reward tables and plots (paper Table 6 and Appendix F).

Per-update ES rewards are mini-batch estimates and noisy, so the paper reports them after
TensorBoard-style debiased exponential smoothing (weight 0.99) and shades the plots with the
local spread of what the smoothing removed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def debiased_ema(values: Sequence[float] | np.ndarray, weight: float = 0.99) -> np.ndarray:
    """Debiased exponential moving average, as TensorBoard's smoothing slider computes it.

    With w = ``weight``::

        s_{-1} = 0
        s_t    = w * s_{t-1} + (1 - w) * x_t
        y_t    = s_t / (1 - w^(t + 1))          for t = 0 .. n-1

    Dividing by ``1 - w^(t+1)`` (the total weight given to real data so far) removes the pull
    towards the zero start: a constant series stays constant, ``y_0 == x_0`` and ``w = 0`` is the
    identity. Points are taken as equally spaced in order; the input must be free of NaN/inf
    (one NaN would poison every later value), so callers drop non-finite points first.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must satisfy 0 <= weight < 1, got {weight!r}")
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    out = np.empty_like(x)
    s = 0.0
    kept = 1.0  # w^(t+1), the weight still held by the zero start
    for t, v in enumerate(x):
        s = weight * s + (1.0 - weight) * v
        kept *= weight
        out[t] = s / (1.0 - kept)
    return out


def local_std(residuals: Sequence[float] | np.ndarray, window: int) -> np.ndarray:
    """Centered rolling standard deviation of ``residuals`` (raw minus smoothed), for shaded bands.

    Point t uses the ``window`` points ``[t - (window-1)//2, t - (window-1)//2 + window)``, clipped
    to the series; where clipping leaves fewer than 2 points, the window is widened inwards to 2.
    This is the *sample* standard deviation (ddof = 1): windows near the ends hold only a few
    points, where the population formula (ddof = 0) noticeably understates the spread, e.g. it
    gives half the distance of two points instead of their spread. A series of one point has no
    spread to estimate and gets 0 (no band).
    """
    if int(window) != window or window < 2:
        raise ValueError(f"local_std window must be an integer >= 2, got {window!r}")
    window = int(window)
    r = np.asarray(residuals, dtype=np.float64).reshape(-1)
    n = len(r)
    out = np.zeros(n)
    if n < 2:
        return out
    before = (window - 1) // 2
    for t in range(n):
        lo = max(0, t - before)
        hi = min(n, t - before + window)
        if hi - lo < 2:
            lo, hi = (lo, lo + 2) if lo + 2 <= n else (hi - 2, hi)
        out[t] = np.std(r[lo:hi], ddof=1)
    return out
