"""Paired change of held-out accuracy (esbatch/aggregate/paired.py): Wilson intervals, McNemar's exact test, the
paired bootstrap interval of the change, and the properties a researcher relies on when reading the table."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binomtest

from esbatch.aggregate.evals import bootstrap_ci
from esbatch.aggregate.paired import PairedChange, mcnemar_exact, paired_change, wilson

Z95 = 1.959963984540054  # the two-sided 95% normal quantile


def wilson_by_hand(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval written out from its textbook formula."""
    p = k / n
    centre = (p + z**2 / (2 * n)) / (1 + z**2 / n)
    half = z / (1 + z**2 / n) * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    return centre - half, centre + half


@pytest.mark.parametrize("k,n", [(0, 1), (1, 1), (0, 10), (3, 10), (10, 10), (0, 200), (73, 200), (200, 200)])
def test_wilson_is_the_textbook_formula_with_exact_ends_at_the_boundaries(k, n):
    lo, hi = wilson(k, n)
    want_lo, want_hi = wilson_by_hand(k, n)
    assert lo == pytest.approx(max(0.0, want_lo), abs=1e-12) and hi == pytest.approx(min(1.0, want_hi), abs=1e-12)
    assert 0.0 <= lo <= k / n <= hi <= 1.0
    if k == 0:
        assert lo == 0.0 and hi > 0  # not an empty interval at 0 correct
    if k == n:
        assert hi == 1.0 and lo < 1
    if 0 < k < n:
        assert lo > 0 and hi < 1


def test_wilson_level_and_bad_counts():
    lo90, hi90 = wilson(30, 100, level=0.90)
    want = wilson_by_hand(30, 100, z=1.6448536269514722)
    assert (lo90, hi90) == pytest.approx(want, abs=1e-12)
    lo95, hi95 = wilson(30, 100)
    assert lo95 < lo90 and hi90 < hi95
    for k, n in [(-1, 10), (11, 10), (0, 0), (1.5, 10)]:
        with pytest.raises(ValueError, match="0 <= k <= n"):
            wilson(k, n)


@pytest.mark.parametrize("gained,lost", [(0, 0), (1, 0), (0, 5), (4, 0), (7, 3), (3, 7), (10, 10), (25, 9), (0, 60)])
def test_mcnemar_is_the_exact_binomial_test_on_the_discordant_pairs(gained, lost):
    want = 1.0 if gained + lost == 0 else binomtest(gained, gained + lost, 0.5).pvalue
    assert mcnemar_exact(gained, lost) == pytest.approx(want, rel=1e-12)
    assert mcnemar_exact(gained, lost) == mcnemar_exact(lost, gained)


def test_mcnemar_of_paired_change_counts_gained_and_lost():
    c = paired_change("1100110000", "0111111100")  # problem 0 lost; 2, 3, 6, 7 gained
    assert (c.n, c.gained, c.lost) == (10, 4, 1)
    assert (c.acc_first, c.acc_last) == (0.4, 0.7)
    assert c.change == 0.7 - 0.4
    assert c.mcnemar_p == pytest.approx(binomtest(4, 5, 0.5).pvalue, rel=1e-12)


def test_the_interval_is_bootstrap_ci_of_the_per_problem_differences():
    rng = np.random.default_rng(3)
    first = "".join(rng.choice(["0", "1"], 150))
    last = "".join(rng.choice(["0", "1"], 150, p=[0.3, 0.7]))
    d = np.array([int(b) - int(a) for a, b in zip(first, last)], dtype=np.float64)
    c = paired_change(first, last)
    _, lo, hi = bootstrap_ci([d])
    # The canonical orientation (first non-zero difference +1) is computed directly: equal to the last bit;
    # the other orientation is its mirror, equal to bootstrap_ci up to numpy's interpolation rounding.
    canonical = d[np.flatnonzero(d)[0]] > 0
    swapped = paired_change(last, first)
    direct, mirrored = (c, swapped) if canonical else (swapped, c)
    dd = d if canonical else -d
    assert (direct.lo, direct.hi) == bootstrap_ci([dd])[1:]
    assert (mirrored.lo, mirrored.hi) == (-direct.hi, -direct.lo)
    assert (c.lo, c.hi) == pytest.approx((lo, hi), abs=1e-12)
    assert c.lo < c.change < c.hi and c.change == pytest.approx(d.mean(), abs=1e-15)


verdicts = st.integers(1, 60).flatmap(
    lambda n: st.tuples(st.text(alphabet="01", min_size=n, max_size=n), st.text(alphabet="01", min_size=n, max_size=n))
)


@settings(derandomize=True, database=None, max_examples=60, deadline=None)
@given(verdicts)
def test_swapping_first_and_last_negates_the_change_and_mirrors_the_interval_exactly(pair):
    first, last = pair
    c, s = paired_change(first, last), paired_change(last, first)
    assert s.change == -c.change
    assert (s.lo, s.hi) == (-c.hi, -c.lo)
    assert (s.gained, s.lost) == (c.lost, c.gained) and s.mcnemar_p == c.mcnemar_p
    assert s.excludes_zero == c.excludes_zero
    assert all(x != 0 or math.copysign(1.0, x) > 0 for x in (c.lo, c.hi, s.lo, s.hi))  # no -0.0 from mirroring


@settings(derandomize=True, database=None, max_examples=60, deadline=None)
@given(verdicts)
def test_counts_are_those_of_the_strings(pair):
    first, last = pair
    c = paired_change(first, last)
    assert c.n == len(first)
    assert c.gained == sum(a == "0" and b == "1" for a, b in zip(first, last))
    assert c.lost == sum(a == "1" and b == "0" for a, b in zip(first, last))
    assert (c.k_first, c.k_last) == (first.count("1"), last.count("1"))
    assert c.change == last.count("1") / c.n - first.count("1") / c.n
    assert c.k_last - c.k_first == c.gained - c.lost
    assert -1.0 <= c.lo <= c.hi <= 1.0
    assert c.excludes_zero == (c.lo > 0 or c.hi < 0)
    if c.gained + c.lost == 0:
        assert c.mcnemar_p == 1.0


@settings(derandomize=True, database=None, max_examples=30, deadline=None)
@given(st.text(alphabet="01", min_size=1, max_size=80))
def test_identical_verdicts_change_nothing(s):
    c = paired_change(s, s)
    assert (c.change, c.lo, c.hi, c.gained, c.lost, c.mcnemar_p) == (0.0, 0.0, 0.0, 0, 0, 1.0)
    assert not c.excludes_zero


def test_an_interval_ending_exactly_at_zero_does_not_exclude_zero():
    c = paired_change("0" * 10, "1" + "0" * 9)  # one problem gained: most resamples miss it
    assert c.lo == 0.0 and c.hi > 0 and c.change == 0.1
    assert not c.excludes_zero
    s = paired_change("1" + "0" * 9, "0" * 10)
    assert s.hi == 0.0 and math.copysign(1.0, s.hi) == 1.0 and not s.excludes_zero
    gained = paired_change("0" * 40, "1" * 12 + "0" * 28)
    assert gained.lo > 0 and gained.excludes_zero
    assert PairedChange(10, 0.0, 0.1, 0.1, 0.0, 0.3, 1, 0, 1.0).excludes_zero is False
    assert PairedChange(10, 0.1, 0.0, -0.1, -0.3, -0.0, 0, 1, 1.0).excludes_zero is False
    assert PairedChange(10, 0.1, 0.0, -0.1, -0.3, -1e-9, 0, 1, 1.0).excludes_zero is True


@pytest.mark.parametrize(
    "first,last,words",
    [
        ("0101", "010", ["first 4", "last 3", "differ in length"]),
        ("01", "0110", ["first 2", "last 4"]),
        ("", "", ["first 0", "last 0", "empty"]),
        ("01x1", "0111", ["first", "'x'", "first 4, last 4"]),
        ("0111", "01 1", ["last", "' '", "first 4, last 4"]),
        ("0111", "0121", ["'2'", "first 4, last 4"]),
    ],
)
def test_bad_verdicts_raise_naming_both_lengths(first, last, words):
    with pytest.raises(ValueError) as e:
        paired_change(first, last)
    assert all(w in str(e.value) for w in words), str(e.value)
