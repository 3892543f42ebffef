"""Evaluation metrics over n sampled responses per problem (paper Appendix G.7).

- Pass@1: mean per-response correctness.
- Pass@K: the unbiased estimator of Chen et al. (2021), 1 - C(n-c, K) / C(n, K), computed as a product
  so it never forms huge binomials: 1 - prod_{i=n-c+1}^{n} (1 - K / i); exactly 1 when n - c < K.
- Maj@K: a plurality vote over the first K responses' normalized answers (see ``majority_vote``).
- Token entropy: the mean over responses of each response's mean token entropy (nats).

Population diversity (paper Section 3.1), from per-member, per-prompt success probabilities p_i(x):
``js_diversity``, ``weight_covariance`` and ``diversity_metrics`` (docs/diagnostics.md).
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


# ----------------------------------------------------------------------------- population diversity (Section 3.1)


def _success_matrix(p: Sequence[Sequence[float]]) -> np.ndarray:
    """p as an [N members, B prompts] float array, checked: a diversity record that does not add up is named."""
    try:
        a = np.asarray(p, dtype=np.float64)
    except (ValueError, TypeError):
        raise ValueError(
            "p must be a [members][prompts] table of numbers, as many per member (got ragged rows or non-numbers)"
        ) from None
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"p must be a non-empty [members][prompts] table of success shares, got shape {a.shape}")
    if not np.all((a >= 0) & (a <= 1)):
        raise ValueError("p holds success shares outside [0, 1] (or NaN)")
    return a


def bernoulli_entropy(p: np.ndarray | float) -> np.ndarray:
    """H(p) = -p ln p - (1 - p) ln(1 - p) in nats, with 0 ln 0 = 0 (H(0) = H(1) = 0, H(1/2) = ln 2)."""
    p = np.asarray(p, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(np.where(p > 0, p * np.log(p), 0.0) + np.where(p < 1, (1 - p) * np.log1p(-p), 0.0))
    return h


def js_diversity(p: Sequence[Sequence[float]]) -> float:
    """Verifier-projected Jensen-Shannon diversity of a population (paper Section 3.1, Lemma 2 and its proof in
    App. A.2, Eq. (10)), averaged over the prompts:

        B_i(x) = Bernoulli(p_i(x))              the verifier's projection of member i's responses to x
        pbar(x) = 1/N sum_i p_i(x)              the uniform member mixture's success probability
        JS_v(x) = JS_{1/N}(B_1(x), ..., B_N(x)) = H(pbar(x)) - 1/N sum_i H(p_i(x))
        js      = 1/B sum_x JS_v(x)              over the B prompts of the update (E_{x ~ D})

    with H the Bernoulli entropy in nats. 0 for identical members (and for a single policy, N = 1); at most
    ln 2, reached exactly when every member is deterministic (p_i(x) in {0, 1}) and half of them solve x.
    By data processing (Eq. (10)) it lower-bounds the JS divergence of the full response distributions.
    ``p`` is [N members][B prompts]. With p_i(x) estimated from m samples the member entropies are biased low,
    so js is biased high for small m (m = 1: every p_i(x) is 0 or 1 and js = mean_x H(pbar(x))).
    """
    a = _success_matrix(p)
    return float(np.mean(bernoulli_entropy(a.mean(0)) - bernoulli_entropy(a).mean(0)))


def weight_covariance(z: Sequence[float], p: Sequence[Sequence[float]]) -> float:
    """Cov_i(z_i, p_i(x)) under a uniform member draw (population covariance, 1/N), averaged over the prompts.

    Lemma 3 (Section 3.1): for normalized weights w_i >= 0 from a monotone transformation of the fitness, the
    reward-weighted mixture's success exceeds the uniform population's by p_w(x) - pbar(x) = N Cov_i(w_i, p_i(x)).
    Here z_i are the ES update weights themselves (the normalized rewards that multiply eps_i). Any positive
    affine map w = a z + b (a > 0) gives Cov(w, p) = a Cov(z, p): the sign says whether the update's weighting
    favours the members that succeed more. By linearity the prompt average equals Cov_i(z_i, 1/B sum_x p_i(x)).
    """
    a = _success_matrix(p)
    w = np.asarray(z, dtype=np.float64)
    if w.shape != (a.shape[0],):
        raise ValueError(f"z has {w.size} weights but p has {a.shape[0]} members")
    cov = ((w - w.mean())[:, None] * (a - a.mean(0))).mean(0)
    return float(cov.mean())


def leave_one_out(p: Sequence[Sequence[float]], first: Sequence[Sequence[float]], samples: int) -> np.ndarray:
    """p_i(x) without the response the reward came from: (m p_i(x) - first_i(x)) / (m - 1), ``first`` that
    response's 0/1 verdict and m = ``samples`` > 1. Cov(z, p) with the full p is biased upward: z_i is computed
    from first_i, which is also one of the m samples of p_i."""
    a, f = _success_matrix(p), _success_matrix(first)
    if f.shape != a.shape or samples < 2:
        raise ValueError(f"first must be p's shape {a.shape} (got {f.shape}) and samples >= 2 (got {samples})")
    if not np.all((f == 0) | (f == 1)):
        raise ValueError("first holds verdicts other than 0 and 1")
    return np.clip((samples * a - f) / (samples - 1), 0.0, 1.0)  # clip: float round-off at the ends only


def diversity_metrics(
    p: Sequence[Sequence[float]],
    z: Sequence[float] | None = None,
    first: Sequence[Sequence[float]] | None = None,
    samples: int = 1,
) -> dict[str, float]:
    """The logged diversity figures of one population ``p`` [N members][B prompts] (docs/diagnostics.md):

    js               js_diversity(p)
    h_members        1/B sum_x 1/N sum_i H(p_i(x)): the members' own verifier-level uncertainty
    p_mean           1/B sum_x pbar(x)
    pass_population  1/B sum_x [1 - prod_i (1 - p_i(x))]: one sample from each member solves x (Section 3.1,
                     "Multiple policies ... increase the chance of finding a correct answer")
    pass_matched     1/B sum_x [1 - (1 - pbar(x))^N]: N samples from one policy of the same mean success;
                     pass_population >= pass_matched (arithmetic-geometric mean inequality)
    cov_weight       weight_covariance(z, p), when the update weights ``z`` are given
    cov_weight_loo   weight_covariance(z, leave_one_out(p, first, samples)), when ``first`` (each member's reward
                     response, 0/1) is given and samples > 1: the unbiased form (z and p share no response)
    """
    a = _success_matrix(p)
    n = a.shape[0]
    pbar = a.mean(0)
    out = {
        "js": js_diversity(a),
        "h_members": float(bernoulli_entropy(a).mean()),
        "p_mean": float(pbar.mean()),
        "pass_population": float(np.mean(1 - np.prod(1 - a, axis=0))),
        "pass_matched": float(np.mean(1 - (1 - pbar) ** n)),
    }
    if z is not None:
        out["cov_weight"] = weight_covariance(z, a)
        if first is not None and samples > 1:
            out["cov_weight_loo"] = weight_covariance(z, leave_one_out(a, first, samples))
    return out
