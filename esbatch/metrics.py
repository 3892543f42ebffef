"""Evaluation metrics over n sampled responses per problem (paper Appendix G.7).

- Pass@1: mean per-response correctness.
- Pass@K: the unbiased estimator of Chen et al. (2021), 1 - C(n-c, K) / C(n, K), computed as a product
  so it never forms huge binomials: 1 - prod_{i=n-c+1}^{n} (1 - K / i); exactly 1 when n - c < K.
- Maj@K: a plurality vote over the first K responses' normalized answers (see ``majority_vote``).
- Token entropy: the mean over responses of each response's mean token entropy (nats).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k for a problem with ``c`` correct among ``n`` samples (k <= n)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    if k == 1:  # exactly the fraction correct (the product form would round it)
        return c / n
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def majority_vote(keys: Sequence[str | None]) -> tuple[int | None, int]:
    """Index of the winning response and its vote count, over normalized answer keys.

    ``None`` (no extractable answer) abstains. Ties go to the answer that appeared first, which is
    deterministic and independent of correctness. All abstain -> (None, 0).
    """
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key is None:
            continue
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None, 0
    best = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[best], counts[best]


def maj_at_k(keys: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 if the plurality answer among the first ``k`` responses is correct, else 0.0 (all abstain -> 0)."""
    if not 1 <= k <= len(keys):
        raise ValueError(f"maj_at_k needs 1 <= k <= {len(keys)} responses, got k={k}")
    idx, _ = majority_vote(keys[:k])
    return float(idx is not None and correct[idx])


def problem_metrics(
    correct: Sequence[bool], keys: Sequence[str | None], ks: Sequence[int], entropies: Sequence[float | None] = ()
) -> dict[str, float]:
    """All metrics of one problem's n responses; K values above n are skipped."""
    n, c = len(correct), int(sum(correct))
    out = {"pass@1": c / n if n else 0.0}
    for k in ks:
        if k <= n:
            out[f"pass@{k}"] = pass_at_k(n, c, k)
            out[f"maj@{k}"] = maj_at_k(keys, correct, k)
    ents = [e for e in entropies if e is not None]
    if ents:
        out["entropy"] = float(np.mean(ents))
    return out


def mean_metrics(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """Average per-problem metrics into a task score (each problem weighs the same)."""
    keys = sorted({k for r in rows for k in r})
    return {k: float(np.mean([r[k] for r in rows if k in r])) for k in keys}
