r"""The local subtraction diagnostic of Appendix E: kappa_base and kappa_pair (Table 13).

Each objective J is evaluated at theta + sigma eps (J+), theta (J0) and theta - sigma eps (J-); observations o =
(prompt or example, generation seed, direction) are pooled (App. E.3-E.4):

    kappa_base = Var_o[J+_o - J0_o] / Var_o[J+_o]        kappa_pair = Var_o[J+_o - J-_o] / Var_o[J+_o]

with Var_o the sample variance (divisor n - 1), reported with the correlations rho(J+, J0) and rho(J+, J-).
Our reading, since Eqs. (47)-(51) are missing from our text of the paper: the raw one-point evaluation as
denominator and no 1/2 in the pair difference, as the paper reports kappa_pair > 1 for weakly correlated rewards
(at equal variances kappa_pair = 2 (1 - rho)). The observations: :mod:`esbatch.diagnose.protocol`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class KappaStats:
    """The variance ratios of one (objective, coupling, sigma) cell, and what they are made of."""

    n: int  # pooled scalar observations
    var_raw: float  # Var[J+]
    var_base: float  # Var[J+ - J0]
    var_pair: float  # Var[J+ - J-]
    kappa_base: float  # var_base / var_raw (nan when var_raw = 0)
    kappa_pair: float  # var_pair / var_raw
    corr_base: float  # corr(J+, J0) (nan when either is constant)
    corr_pair: float  # corr(J+, J-)
    mean_plus: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _var(x: np.ndarray) -> float:
    return float(np.var(x, ddof=1))


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    sa, sb = float(np.std(a)), float(np.std(b))
    if sa == 0 or sb == 0:
        return math.nan
    return float(np.mean((a - a.mean()) * (b - b.mean())) / (sa * sb))


def kappa_stats(plus: Sequence[float], center: Sequence[float], minus: Sequence[float]) -> KappaStats:
    """kappa_base and kappa_pair of pooled observations (the three lists are aligned: one o per index)."""
    p, c, m = (np.asarray(x, dtype=np.float64) for x in (plus, center, minus))
    if not (p.shape == c.shape == m.shape) or p.ndim != 1:
        raise ValueError(
            f"plus, center and minus must be equally long 1-d lists, got shapes {p.shape}, {c.shape}, {m.shape}"
        )
    if p.size < 2:
        raise ValueError(f"a variance needs at least 2 pooled observations, got {p.size}")
    if not (np.isfinite(p).all() and np.isfinite(c).all() and np.isfinite(m).all()):
        raise ValueError("observations must be finite numbers (an objective returned nan or inf)")
    var_raw, var_base, var_pair = _var(p), _var(p - c), _var(p - m)
    ratio = (lambda v: v / var_raw) if var_raw > 0 else (lambda v: math.nan)
    return KappaStats(
        n=int(p.size),
        var_raw=var_raw,
        var_base=var_base,
        var_pair=var_pair,
        kappa_base=ratio(var_base),
        kappa_pair=ratio(var_pair),
        corr_base=_corr(p, c),
        corr_pair=_corr(p, m),
        mean_plus=float(p.mean()),
    )
