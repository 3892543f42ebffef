"""Did held-out accuracy change during training? Two evaluations of one run paired problem by problem.

Each held-out evaluation keeps its per-problem verdicts (eval.jsonl's ``heldout/correct``: one character per
problem, "1" correct, "0" not, in the same problem order at every evaluation of a run). Two such strings of one
run, say at update 0 and at the run's last update, pair problem by problem: the change in accuracy gets a paired
95% interval (the bootstrap of the paper's Table 10, :func:`esbatch.aggregate.evals.bootstrap_ci`, over the
per-problem differences), each accuracy its Wilson score interval, and the discordant problems (gained: wrong ->
right, lost: right -> wrong) McNemar's exact test. Pure functions; the ``heldout_change`` analysis
(esbatch/aggregate/report.py) and the ``curves`` analysis's Wilson band use them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from esbatch.aggregate.evals import bootstrap_ci


def wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval (lo, hi) of a proportion ``k / n`` at confidence ``level``.

    With p = k / n and z the two-sided normal quantile of ``level``::

        centre = (p + z^2 / (2n)) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))

    clipped to [0, 1], with lo exactly 0 at k = 0 and hi exactly 1 at k = n (where the formula gives them up to
    rounding). Unlike the normal (Wald) interval it is not empty at k = 0 or k = n.
    """
    if isinstance(k, bool) or isinstance(n, bool) or int(k) != k or int(n) != n or n < 1 or not 0 <= k <= n:
        raise ValueError(f"wilson needs integers 0 <= k <= n and n >= 1, got k={k!r}, n={n!r}")
    if not 0 < level < 1:
        raise ValueError(f"wilson: level must be in (0, 1), got {level!r}")
    z = NormalDist().inv_cdf((1 + level) / 2)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


def mcnemar_exact(gained: int, lost: int) -> float:
    """Exact two-sided McNemar p-value: the binomial test of ``gained`` out of ``gained + lost`` discordant pairs
    against 1/2, i.e. ``min(1, 2 P(X <= min(gained, lost)))`` with X ~ Binomial(gained + lost, 1/2); 1 when there
    are no discordant pairs. Exact integer arithmetic (no overflow or underflow for thousands of problems)."""
    if gained < 0 or lost < 0:
        raise ValueError(f"mcnemar_exact needs counts >= 0, got gained={gained}, lost={lost}")
    m = gained + lost
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(gained, lost) + 1))
    return min(1.0, 2 * tail / 2**m)


@dataclass(frozen=True)
class PairedChange:
    """One run's held-out accuracy at two evaluations, paired problem by problem.

    ``change = acc_last - acc_first``; ``lo``/``hi``: the paired 95% percentile bootstrap interval of the change
    (the problems resampled with replacement, each keeping both of its verdicts); ``gained``: problems wrong at
    the first evaluation and right at the last, ``lost``: the reverse; ``mcnemar_p``: McNemar's exact two-sided
    test on those discordant problems (1 when there are none).
    """

    n: int
    acc_first: float
    acc_last: float
    change: float
    lo: float
    hi: float
    gained: int
    lost: int
    mcnemar_p: float

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly on one side of 0; an interval with an end exactly at 0 does not."""
        return self.lo > 0 or self.hi < 0

    @property
    def k_first(self) -> int:
        return round(self.acc_first * self.n)

    @property
    def k_last(self) -> int:
        return round(self.acc_last * self.n)


def _verdicts(s: str, which: str, first: str, last: str) -> np.ndarray:
    if not isinstance(s, str) or (s and s.strip("01")):
        bad = sorted(set(s) - {"0", "1"}) if isinstance(s, str) else type(s).__name__
        raise ValueError(
            f"paired_change: {which} must hold only '0' and '1' (one per problem), got {bad!r} "
            f"(lengths: first {_len(first)}, last {_len(last)})"
        )
    return np.frombuffer(s.encode("ascii"), dtype=np.uint8).astype(np.int64) - ord("0")


def _len(s: object) -> str:
    return str(len(s)) if isinstance(s, str) else f"n/a ({type(s).__name__})"


def paired_change(first: str, last: str) -> PairedChange:
    """The change from the verdicts ``first`` to the verdicts ``last`` of the same problems (eval.jsonl's
    ``heldout/correct`` strings of two evaluations of one run).

    The interval is ``bootstrap_ci`` (esbatch/aggregate/evals.py: 2,000 resamples, seed 0, percentile 95%) of the
    per-problem differences ``last - first`` (each -1, 0 or 1). numpy's percentile interpolation is not exactly
    sign-symmetric (the two ends differ in the last bit), so the bootstrap runs on one canonical orientation of
    the differences, the one whose first non-zero difference is +1, and the other orientation gets it mirrored:
    swapping ``first`` and ``last`` negates the change and mirrors the interval exactly.

    Raises ValueError, naming both lengths, when the strings differ in length, are empty, or hold anything but
    '0' and '1'.
    """
    a = _verdicts(first, "first", first, last)
    b = _verdicts(last, "last", first, last)
    if len(a) != len(b) or not len(a):
        why = "differ in length" if len(a) != len(b) else "are empty"
        raise ValueError(
            f"paired_change: the verdict strings {why} (first {len(a)} problems, last {len(b)}): only two "
            "evaluations of the same problems pair"
        )
    n = len(a)
    d = (b - a).astype(np.float64)
    nonzero = np.flatnonzero(d)
    flip = bool(len(nonzero)) and d[nonzero[0]] < 0
    _, lo, hi = bootstrap_ci([-d if flip else d])
    if flip:
        lo, hi = -hi + 0.0, -lo + 0.0  # + 0.0: no -0.0
    k_first, k_last = int(a.sum()), int(b.sum())
    acc_first, acc_last = k_first / n, k_last / n
    gained, lost = int(np.sum(d > 0)), int(np.sum(d < 0))
    return PairedChange(
        n=n,
        acc_first=acc_first,
        acc_last=acc_last,
        change=acc_last - acc_first,
        lo=float(lo),
        hi=float(hi),
        gained=gained,
        lost=lost,
        mcnemar_p=mcnemar_exact(gained, lost),
    )
