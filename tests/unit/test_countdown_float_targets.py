"""Countdown targets that are another program's float result, a few ulps off the exact value (issue 44, D4).

'2.833333333333334' is 17/6 as a peer's float arithmetic left it (the double after the closest one to 17/6, which
prints as 2.8333333333333335): an answer whose exact value is within ``COUNTDOWN_REL_TOL`` of such a target is
right; every other target is met exactly (:func:`esbatch.tasks.verify.check_countdown`).
"""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction as F

import pytest

from esbatch.tasks.verify import COUNTDOWN_REL_TOL, Verdict, check_countdown, exact_target

C, W = Verdict.CORRECT, Verdict.WRONG
PEER = "2.833333333333334"  # 17/6 from a peer's float arithmetic


def answer(expr: str) -> str:
    return f"<answer>{expr}</answer>"


def test_the_peer_target_is_no_simple_fraction_and_1_ulp_from_17_6():
    x = float(PEER)
    assert exact_target(PEER) == F(PEER)  # read as written: no simple fraction rounds to it
    assert x != 17 / 6 and math.nextafter(17 / 6, 3) == x
    assert COUNTDOWN_REL_TOL == F(1, 10**12)


@pytest.mark.parametrize("target", [PEER, float(PEER), " 2.833333333333334 ", "2.8333333333333340"])
@pytest.mark.parametrize(
    "expr, numbers, verdict",
    [
        ("17 / (2 * 3)", [17, 2, 3], C),
        ("17 / 2 / 3", [17, 2, 3], C),
        ("17 / (2 * 3) = 2.833333333333334", [17, 2, 3], C),  # the target echoed
        ("17 / (2 * 3) = 17/6", [17, 2, 3], C),  # the exact value echoed
        ("17 / (2 * 3) = 2.83", [17, 2, 3], W),  # a false equation
        ("17 / (2 + 3)", [17, 2, 3], W),
        ("(17 - 2) / 3", [17, 2, 3], W),
        ("17 / 6", [17, 2, 3], W),  # 6 is no given number
        ("17 / (2 * 3)", [17, 2, 3, 3], W),  # a number unused
        ("-17 / (2 * 3)", [17, 2, 3], W),  # a sign
    ],
)
def test_a_peers_float_target_is_met_by_the_exact_answer(target, expr, numbers, verdict):
    assert check_countdown(answer(expr), numbers, target) is verdict


def test_the_tolerance_ends_exactly_at_its_bound():
    x = F(PEER)
    at = x * (1 + COUNTDOWN_REL_TOL)  # exactly at the bound: 2833333333333334 * (10**12 + 1) / 10**27
    assert at == F(2833333333333334 * (10**12 + 1), 10**27)
    for value, verdict in [
        (at, C),
        (x * (1 - COUNTDOWN_REL_TOL), C),
        (at + F(1, 10**27), W),  # one unit of the bound's denominator over it
        (x * (1 - COUNTDOWN_REL_TOL) - F(1, 10**27), W),
    ]:
        expr = f"{value.numerator} / {value.denominator}"
        assert check_countdown(answer(expr), [value.numerator, value.denominator], PEER) is verdict, value


@pytest.mark.parametrize(
    "target, near",
    [
        (60, F(60) + F(1, 10**20)),  # an integer target: exact
        (60.0, F(60) + F(1, 10**20)),
        ("60", F(60) + F(1, 10**20)),
        (800 / 3, F(800, 3) + F(1, 10**20)),  # a recovered fraction (repr(800/3)): exact
        ("3/2", F(3, 2) + F(1, 10**20)),  # a written fraction: exact
        (F(17, 6), F(17, 6) + F(1, 10**20)),
        ("2.83333333333333400", F(PEER) + F(1, 10**20)),  # 18 significant digits: no printed double, exact
        ("0.6666666666666666000000000", F(2, 3)),
    ],
)
def test_only_a_printed_double_gets_the_tolerance(target, near):
    assert (
        check_countdown(answer(f"{near.numerator} / {near.denominator}"), [near.numerator, near.denominator], target)
        is W
    )


def _reachable(numbers: tuple[int, ...]) -> set[F]:
    if len(numbers) == 1:
        return {F(numbers[0])}
    values: set[F] = set()
    idx = range(len(numbers))
    for k in range(1, len(numbers)):
        for left in itertools.combinations(idx, k):
            a = _reachable(tuple(numbers[i] for i in left))
            b = _reachable(tuple(numbers[i] for i in idx if i not in left))
            for x, y in itertools.product(a, b):
                values |= {x + y, x - y, x * y} | ({x / y} if y else set())
    return values


def _expr(numbers: tuple[int, ...], value: F) -> str | None:
    """An expression over ``numbers`` (each once) equal to ``value``, or None."""
    if len(numbers) == 1:
        return str(numbers[0]) if value == numbers[0] else None
    idx = range(len(numbers))
    for k in range(1, len(numbers)):
        for left in itertools.combinations(idx, k):
            ln, rn = tuple(numbers[i] for i in left), tuple(numbers[i] for i in idx if i not in left)
            for x, y in itertools.product(_reachable(ln), _reachable(rn)):
                for op, v in (("+", x + y), ("-", x - y), ("*", x * y), ("/", x / y if y else None)):
                    if v == value:
                        return f"({_expr(ln, x)}) {op} ({_expr(rn, y)})"
    return None


def test_no_two_values_of_small_problems_are_within_twice_the_tolerance():
    """The brute force of benchmarks/countdown_tolerance.py in small: every multiset of 3 numbers in 1..7."""
    smallest = math.inf
    for numbers in itertools.combinations_with_replacement(range(1, 8), 3):
        values = sorted(v for v in _reachable(numbers) if v)
        for v, w in itertools.pairwise(values):
            smallest = min(smallest, float((w - v) / min(abs(v), abs(w))))
    assert 2 * COUNTDOWN_REL_TOL < 1e-11 < smallest


def test_a_target_a_few_ulps_off_any_value_admits_that_value_and_no_other():
    """For every non-integer value v of sampled 3-number problems: a target 3 ulps off float(v), printed, is met
    by an expression equal to v, and by no expression equal to another value of the same numbers."""
    rng = random.Random(0)
    checked = 0
    for numbers in [(17, 2, 3), *(tuple(rng.randint(1, 100) for _ in range(3)) for _ in range(3))]:
        values = _reachable(numbers)
        for v in rng.sample(sorted(v for v in values if v.denominator != 1), 4):
            x = float(v)
            for _ in range(3):
                x = math.nextafter(x, math.inf)
            target = repr(x)
            if exact_target(target) != F(target):
                continue  # a simple fraction fits: met exactly (test_countdown_targets)
            near = [w for w in values if abs(w - F(target)) <= COUNTDOWN_REL_TOL * abs(F(target))]
            assert near == [v]
            assert check_countdown(answer(_expr(numbers, v)), list(numbers), target) is C
            checked += 1
    assert checked >= 8
