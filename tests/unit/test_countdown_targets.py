"""Countdown targets given as rounded decimals, and signs in answers (issue 31, deliverable 7).

A public Countdown set stores 800/3 as 266.6666666666667 (``repr(800/3)``): the target means the fraction it
stands for (:func:`esbatch.tasks.verify.exact_target`), and the answer must equal that fraction exactly. Signs
are not operations of the game; ``-3`` is the negative number -3, which must be given
(:func:`esbatch.tasks.verify.check_countdown`).
"""

from __future__ import annotations

import itertools
import math
import re
from fractions import Fraction as F

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from esbatch.tasks.verify import Verdict, check_countdown, exact_target

C, W = Verdict.CORRECT, Verdict.WRONG


def answer(expr: str) -> str:
    return f"<answer>{expr}</answer>"


# ----------------------------------------------------------------------------- (a) what each target means


@pytest.mark.parametrize(
    "target, means",
    [
        (60, F(60)),
        (60.0, F(60)),
        (-4, F(-4)),
        (10**400, F(10**400)),
        (F(7, 3), F(7, 3)),
        ("3/2", F(3, 2)),
        (" 3 / 2 ", F(3, 2)),
        (1.5, F(3, 2)),
        ("1.5", F(3, 2)),
        ("+0.5", F(1, 2)),
        ("-.25", F(-1, 4)),
        ("1,000.5", F(2001, 2)),
        # rounded fractions: the fraction they stand for
        (800 / 3, F(800, 3)),
        (repr(800 / 3), F(800, 3)),
        ("266.6666666666667", F(800, 3)),
        ("266.66666666666667", F(800, 3)),  # 17 digits, as '%.17g' prints it
        ("266.6667", F(800, 3)),  # four decimals: 1/3 is the only simple fraction that close
        (-7 / 3, F(-7, 3)),
        (repr(-7 / 3), F(-7, 3)),  # '-2.3333333333333335': 1.7e-16 off -7/3, more than half its last digit
        (2 / 3, F(2, 3)),
        (1 / 7, F(1, 7)),
        (repr(1 / 7), F(1, 7)),
        (8e6 / 3, F(8_000_000, 3)),
        (repr(8e6 / 3), F(8_000_000, 3)),
        (1 / 999_999, F(1, 999_999)),  # denominator at the cap
        # short decimals mean themselves
        (0.1, F(1, 10)),
        ("0.1", F(1, 10)),
        (0.3, F(3, 10)),
        ("0.3", F(3, 10)),  # not 1/3, which also rounds to 0.3
        (266.67, F(26667, 100)),
        ("266.67", F(26667, 100)),  # not 800/3: two decimals admit 800/3, 21067/79, ...
        ("266.667", F(266667, 1000)),
        ("0.333", F(333, 1000)),
        ("0.3333", F(1, 3)),
        ("5.000", F(5)),
        ("0.3000000000000", F(3, 10)),
        # nothing simple enough: the decimal as written
        (1 / 1_000_001, F(repr(1 / 1_000_001))),  # denominator just over 10**6
        (1 / 3_000_000, F(repr(1 / 3_000_000))),
        (1e15 + 1 / 6, F(10**16 + 1, 10)),  # the float is 1e15 + 0.125: too coarse to tell 1/6 from 1/8 or 1/10
        (0.30000000000000004, F("0.30000000000000004")),
        (0.1234567, F(1234567, 10**7)),
        ("0.6666666666666666000000000", F("0.6666666666666666")),  # 25 decimals: no printed double, exact
        # huge and tiny
        (1e308, F(10**308)),
        (-1e23, F(-(10**23))),  # the decimal written, not the binary 99999999999999991611392
        (1e-300, F(1, 10**300)),
        (5e-324, F("5e-324")),
        (-5e-324, F("-5e-324")),
        ("0." + "0" * 300 + "1", F(1, 10**301)),
    ],
)
def test_a_target_means_this_fraction(target, means):
    got = exact_target(target)
    assert type(got) is F and got == means


@pytest.mark.parametrize(
    "target",
    [
        float("nan"),
        float("inf"),
        -float("inf"),
        True,
        None,
        "",
        "   ",
        "nan",
        "inf",
        "-inf",
        "abc",
        "1/0",
        "1e5",
        "0x10",
        "1.2.3",
        "1" * 1001,
    ],
)
def test_a_target_that_is_no_number_is_refused_by_name(target):
    message = f"^Countdown target {re.escape(repr(target))} is not a number$"
    with pytest.raises(ValueError, match=message):
        exact_target(target)
    with pytest.raises(ValueError, match=message):
        check_countdown(answer("1 + 2"), [1, 2], target)


@pytest.mark.parametrize("target", [800 / 3, repr(800 / 3), "266.6666666666667", "266.6667"])
@pytest.mark.parametrize(
    "expr, numbers, verdict",
    [
        ("800 / 3", [800, 3], C),
        ("(25 * 32) / 3", [25, 32, 3], C),
        ("800 / 3 = 266.6666666666667", [800, 3], C),  # the target as printed may be echoed
        ("800 / 3 = 800/3", [800, 3], C),
        ("800 / 3 = 266.67", [800, 3], W),  # a rounded right side is a false equation
        ("800 / 3 = 267", [800, 3], W),
        ("2666666 / 10000", [2666666, 10000], W),  # within 1e-5 of the target, not equal to it
        ("26667 / 100", [26667, 100], W),
        ("2666666666666667 / 10000000000000", [2666666666666667, 10000000000000], W),  # the decimal itself
        ("800 / 3 + 1 / 100000000000000000000", [800, 3, 1, 100000000000000000000], W),  # 1e-20 off
        ("801 / 3", [801, 3], W),
        ("800 / 3", [800, 3, 3], W),  # a number unused
    ],
)
def test_a_rounded_target_is_met_exactly_and_only_exactly(target, expr, numbers, verdict):
    assert check_countdown(answer(expr), numbers, target) is verdict


def test_the_exact_decimal_is_what_a_long_string_that_no_fraction_fits_needs():
    target = "0.6666666666666666000000000"
    assert check_countdown(answer("2 / 3"), [2, 3], target) is W
    assert check_countdown(answer("6666666666666666 / 10000000000000000"), [6666666666666666, 10**16], target) is C


# ----------------------------------------------------------------------------- (b) property: repr(p/q) means p/q


def expression(r: F) -> tuple[str, list[int]]:
    """An answer equal to ``r`` exactly, and the numbers it uses (no signs: a negative numerator is 0 - n)."""
    if r < 0:
        return f"(0 - {-r.numerator}) / {r.denominator}", [0, -r.numerator, r.denominator]
    return f"{r.numerator} / {r.denominator}", [r.numerator, r.denominator]


def verdict(r: F, target) -> Verdict:
    expr, numbers = expression(r)
    return check_countdown(answer(expr), numbers, target)


@settings(max_examples=300, deadline=None)
@given(p=st.integers(-(10**6), 10**6), q=st.integers(1, 1000), as_text=st.booleans())
def test_repr_of_p_over_q_means_p_over_q_and_its_neighbours_are_wrong(p, q, as_text):
    want = F(p, q)
    x = p / q  # the float, correctly rounded
    target = repr(x) if as_text else x
    assert float(want) == x
    assert exact_target(target) == want
    assert verdict(want, target) is C
    # near misses, each checked against exact arithmetic: the float's binary value, its shortest decimal, and
    # values the smallest steps away (1e-20, one unit of the denominator's 10**6-th part)
    for near in (F(x), F(repr(x)), want + F(1, 10**20), want - F(1, 10**20), want + F(1, q * 10**6)):
        assert verdict(near, target) is (C if near == want else W)


@settings(max_examples=300, deadline=None)
@given(x=st.floats(allow_nan=False, allow_infinity=False))
def test_a_float_target_always_means_a_value_that_rounds_to_it(x):
    assert float(exact_target(x)) == x


@settings(max_examples=300, deadline=None)
@given(digits=st.integers(0, 10**12), decimals=st.integers(1, 12), negative=st.booleans())
def test_a_decimal_string_means_a_value_that_rounds_to_it(digits, decimals, negative):
    text = ("-" if negative else "") + f"{digits // 10**decimals}.{digits % 10**decimals:0{decimals}d}"
    value, got = F(text), exact_target(text)
    assert abs(got - value) <= F(1, 2 * 10**decimals) or float(got) == float(value)
    if decimals <= 3:  # too few decimals to single out a fraction: exactly as written
        assert got == value


# ----------------------------------------------------------------------------- (c) signs


@pytest.mark.parametrize(
    "expr, verdict",
    [
        ("92 + 54 - 48", C),
        ("-48 + 92 + 54", W),  # -48 is a number not given
        ("- 48 + 92 + 54", W),  # a sign
        ("−48 + 92 + 54", W),  # typographic minus, the same
        ("(-48) + 92 + 54", W),
        ("-48 + 92 + 54 = 98", W),
        ("+92 + 54 - 48", W),  # unary plus
        ("92 + +54 - 48", W),
        ("92 + 54 - --48", W),  # double minus: still 98
        ("92 + 54 - +-+-48", W),
        ("92 - -54 - 48", W),
        ("-(48 - 92) + 54", W),
        ("-(-92) + 54 - 48", W),
        ("-0 + 92 + 54 - 48", W),  # 0 not given
        ("92 + 54 - 48 - -0", W),
        ("(-\n48) + 92 + 54", W),  # the minus and the digits on different lines: a sign
        ("92 + 54 - 48 + 48 - 48", W),  # 48 thrice
    ],
)
def test_signs_are_not_operations_of_the_game(expr, verdict):
    assert check_countdown(answer(expr), [48, 92, 54], 98) is verdict


@pytest.mark.parametrize(
    "expr, numbers, target, verdict",
    [
        ("-3 * 5", [-3, 5], -15, C),  # a given negative number is written as itself
        ("5 * -3", [-3, 5], -15, C),
        ("(-3) * 5", [-3, 5], -15, C),
        ("5 - -3", [-3, 5], 8, C),
        ("-3 * -5", [-3, -5], 15, C),
        ("- 3 * 5", [-3, 5], -15, W),  # a space: a sign on 3, and 3 is not given
        ("-(3) * 5", [-3, 5], -15, W),
        ("-(3 * 5)", [-3, 5], -15, W),
        ("--3 * 5", [-3, 5], 15, W),
        ("3 * 5", [-3, 5], 15, W),
        ("-3 * 5", [3, 5], -15, W),  # negative targets out of reach of the four operations stay so
        ("-(3 * 5)", [3, 5], -15, W),
        ("-3 * 5 - -3", [-3, 5], -12, W),  # -3 twice
        ("2 * 3 - -2", [2, 3], 8, W),  # 2 twice
    ],
)
def test_a_negative_literal_is_a_number_that_must_be_given(expr, numbers, target, verdict):
    assert check_countdown(answer(expr), numbers, target) is verdict


def _reachable(numbers: tuple[int, ...], signs: bool) -> set[F]:
    """Every value of an expression using each number once with + - * / (and unary minus anywhere if signs)."""
    if len(numbers) == 1:
        values = {F(numbers[0])}
    else:
        values = set()
        idx = range(len(numbers))
        for k in range(1, len(numbers)):
            for left in itertools.combinations(idx, k):
                a = _reachable(tuple(numbers[i] for i in left), signs)
                b = _reachable(tuple(numbers[i] for i in idx if i not in left), signs)
                for x, y in itertools.product(a, b):
                    values |= {x + y, x - y, x * y} | ({x / y} if y else set())
    return values | {-v for v in values} if signs else values


@settings(max_examples=40, deadline=None)
@given(numbers=st.lists(st.integers(1, 12), min_size=1, max_size=3))
def test_signs_reach_no_positive_target_the_four_operations_cannot(numbers):
    """Why refusing signs costs no solvable problem: with positive numbers the positive values are the same."""
    plain, signed = _reachable(tuple(numbers), False), _reachable(tuple(numbers), True)
    assert {v for v in signed if v > 0} == {v for v in plain if v > 0}
    assert math.prod(numbers) in plain
