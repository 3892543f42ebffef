"""Tests written to kill the mutmut survivors in esbatch/tasks/verify_math.py (mutmut 3.8.1).

Expectations are worked out by hand from the module docstring: which answers stay in process (plain numbers,
identical strings, over-long answers), what reaches math-verify, and what the answer keys look like.
Mutants left alive are equivalent; the mutation-testing section of docs/benchmarks.md lists why.
"""

from __future__ import annotations

import logging
from fractions import Fraction

import pytest

from esbatch.tasks import verify_math
from esbatch.tasks.verify import Verdict
from esbatch.tasks.verify_math import (
    MAX_ANSWER_CHARS,
    Match,
    check_boxed_math,
    compare_math,
    math_answer_key,
    math_equal,
    plain_number,
)

C, W, M = Verdict.CORRECT, Verdict.WRONG, Verdict.MISSING


@pytest.fixture()
def no_worker(monkeypatch):
    """Fails the test if a check leaves the process: these answers must be decided in process."""

    def refuse(op, args, timeout_s):
        raise AssertionError(f"math-verify worker called: {op} {args}")

    monkeypatch.setattr(verify_math, "_call", refuse)


# ----------------------------------------------------------------------------- plain_number


@pytest.mark.parametrize(
    "s, value",
    [
        (r"\textbf{5}", Fraction(5)),
        (r"5 \mathrm{cm}", Fraction(5)),
        (r"5\mathbf{kg}", Fraction(5)),
        (r"\dfrac{1}{2}", Fraction(1, 2)),
        (r"\tfrac{3}{4}", Fraction(3, 4)),
        ("X = 3", Fraction(3)),
        ("  y=3", Fraction(3)),
        ("3X", None),  # a capital variable is still a variable
        ("3x", None),
        ("x", None),
        ("e", None),
        (r"3 \times 4", None),  # a command other than \frac: not plain
        ("5 = x", None),  # only a leading "x =" is dropped
    ],
)
def test_plain_number(s, value):
    assert plain_number(s) == value


# ----------------------------------------------------------------------------- compare_math: in-process paths


@pytest.mark.parametrize(
    "pred, gold, match",
    [
        ("", "", Match.UNEQUAL),  # an empty answer never matches, not even an empty gold
        ("  ", " ", Match.UNEQUAL),
        ("", "5", Match.UNEQUAL),
        ("5", "  ", Match.UNEQUAL),
        ("0.5", r"\frac{1}{2}", Match.EQUAL),  # both plain: exact fractions
        ("0.5", "0.50001", Match.UNEQUAL),
        ("x + 1", "x+1", Match.EQUAL),  # identical up to whitespace
        (" x\t+\n1 ", "x+1", Match.EQUAL),
        ("y" * (MAX_ANSWER_CHARS + 1), "y", Match.UNEQUAL),  # over-long: never sent to math-verify
        ("y", "y" * (MAX_ANSWER_CHARS + 1), Match.UNEQUAL),
        ("y " * MAX_ANSWER_CHARS, "y" * MAX_ANSWER_CHARS, Match.EQUAL),  # ...but still compared as strings
    ],
)
def test_compare_math_in_process(no_worker, pred, gold, match):
    assert compare_math(pred, gold) is match
    assert math_equal(pred, gold) is (match is Match.EQUAL)


def test_check_boxed_math_in_process(no_worker):
    assert check_boxed_math(r"so \boxed{0.5}", "1/2") is C
    assert check_boxed_math(r"so \boxed{0.5}", "1/3") is W
    assert check_boxed_math(r"\boxed{ }", "5") is W
    assert check_boxed_math("0.5", "1/2") is M


# ----------------------------------------------------------------------------- compare_math: math-verify


@pytest.fixture()
def fake_worker(monkeypatch):
    """Records what would be sent to a math-verify worker, which finds two answers equal iff both are 2."""
    calls, timeouts = [], []
    twos = {"2", r"\sqrt{4}"}

    def call(op, args, timeout_s):
        calls.append((op, args))
        timeouts.append(timeout_s)
        if op == "key":
            return None if "?" in args[0] else f"key:{len(args[0])}"
        return {a.replace(" ", "") for a in args} <= twos

    for cache in (verify_math._compare_cached, verify_math._key_cached):
        cache.cache_clear()
    monkeypatch.setattr(verify_math, "_call", call)
    yield calls, timeouts
    for cache in (verify_math._compare_cached, verify_math._key_cached):
        cache.cache_clear()


def test_one_plain_side_still_goes_to_math_verify(fake_worker):
    calls, timeouts = fake_worker
    assert compare_math("2", r"\sqrt{4}") is Match.EQUAL  # gold is not a plain number
    assert compare_math(r"\sqrt{4}", "2") is Match.EQUAL  # pred is not
    assert compare_math("3", r"\sqrt{4}") is Match.UNEQUAL
    assert calls == [("equal", ("2", r"\sqrt{4}")), ("equal", (r"\sqrt{4}", "2")), ("equal", ("3", r"\sqrt{4}"))]
    assert timeouts == [5.0] * 3  # the documented default


def test_the_callers_timeout_reaches_the_worker(fake_worker):
    calls, timeouts = fake_worker
    assert check_boxed_math(r"\boxed{\sqrt{4}}", "2", timeout_s=3) is C
    assert check_boxed_math(r"\boxed{\sqrt{4}}", "3") is W
    assert math_equal(r"\sqrt{4}", "2", timeout_s=2) is True
    assert math_equal(r"\sqrt{4}", "3", timeout_s=2) is False
    assert math_equal(r"\sqrt{4}", "5") is False
    assert math_answer_key(r"\boxed{\sqrt{5}}", timeout_s=4) == "key:8"
    assert math_answer_key(r"\boxed{\sqrt{6}}") == "key:8"
    assert timeouts == [3.0, 5.0, 2.0, 2.0, 5.0, 4.0, 5.0]
    assert all(type(t) is float for t in timeouts)


def test_answers_up_to_max_answer_chars_reach_math_verify(fake_worker):
    pred = r"\sqrt{4" + " " * (MAX_ANSWER_CHARS - 8) + "}"
    assert len(pred) == MAX_ANSWER_CHARS
    calls, _ = fake_worker
    assert compare_math(pred, "2") is Match.EQUAL
    assert compare_math("2", pred) is Match.EQUAL
    assert len(calls) == 2
    longer = r"\sqrt{4" + " " * (MAX_ANSWER_CHARS - 7) + "}"
    assert compare_math(longer, "2") is Match.UNEQUAL
    assert compare_math("2", longer) is Match.UNEQUAL
    assert len(calls) == 2  # not sent
    box = r"\boxed{" + r"\sqrt{5}" * (MAX_ANSWER_CHARS // 8) + "}"  # 2000 characters in the box
    assert math_answer_key(box) == "key:2000"
    assert math_answer_key(box.replace("5", "5 ", 1)) == r"\sqrt{5}" * (MAX_ANSWER_CHARS // 8)  # 2001: squashed
    assert math_answer_key(r"\boxed{\sqrt{?}}") == r"\sqrt{?}"  # no key from math-verify: the squashed text
    assert calls[2:] == [("key", (r"\sqrt{5}" * (MAX_ANSWER_CHARS // 8),)), ("key", (r"\sqrt{?}",))]


def test_compare_math_memoizes_per_pair_and_timeout(fake_worker):
    for _ in range(3):
        assert compare_math("2", r"\sqrt{4}") is Match.EQUAL
    assert compare_math("2", r"\sqrt{4}", timeout_s=2) is Match.EQUAL
    assert len(fake_worker[0]) == 2


# ----------------------------------------------------------------------------- math_answer_key


def test_answer_key_in_process(no_worker):
    assert math_answer_key(r"\boxed{ 0.5 }") == "1/2"
    assert math_answer_key(r"\boxed{   }") is None  # a blank box abstains like an empty one
    assert math_answer_key("no box") is None
    long = r"\boxed{" + "a b " * MAX_ANSWER_CHARS + "}"  # over-long: the squashed text, no math-verify
    assert math_answer_key(long) == "ab" * MAX_ANSWER_CHARS


def test_answer_key_from_math_verify():
    assert math_answer_key(r"\boxed{x = \sqrt{2}}") == "sqrt(2)"  # "x = " dropped from the equation
    assert math_answer_key(r"\boxed{ \frac{\sqrt{8}}{2} }") == "sqrt(2)"
    assert math_answer_key(r"\boxed{\sum_{k=1}^{3} k}") == "6"  # evaluated (doit)
    assert math_answer_key(r"\boxed{\frac{6}{4}}") == "3/2"
    assert math_answer_key(r"\boxed{\frac{3}{\sqrt{4}}}") == "3/2"  # a sympy Rational, written as a Fraction
    assert compare_math(r"\text{}", "1") is Match.UNEQUAL  # nothing parses on the pred side


class FakeWorker:
    def __init__(self):
        self.killed = False

    def kill(self):
        self.killed = True


def test_checkin_keeps_at_most_max_idle_workers(monkeypatch):
    monkeypatch.setattr(verify_math, "_idle", [])
    monkeypatch.setattr(verify_math, "MAX_IDLE_WORKERS", 2)
    a, b, c = FakeWorker(), FakeWorker(), FakeWorker()
    for w in (a, b, c):
        verify_math._checkin(w)
    assert verify_math._idle == [a, b]
    assert (a.killed, b.killed, c.killed) == (False, False, True)


def test_timeouts_are_logged_with_the_answer(caplog, monkeypatch):
    def slow(op, args, timeout_s):
        raise verify_math._Timeout

    monkeypatch.setattr(verify_math, "_call", slow)
    with caplog.at_level(logging.WARNING, logger="esbatch.tasks.verify_math"):
        assert compare_math(r"\sqrt{17}", "q_timeout_gold", timeout_s=0.5) is Match.TIMEOUT
        assert math_answer_key(r"\boxed{\sqrt{19}}", timeout_s=0.5) == r"\sqrt{19}"
    assert [r.getMessage() for r in caplog.records] == [
        "math-verify gave up after 0.5 s (counted as not equal): pred='\\\\sqrt{17}' gold='q_timeout_gold'",
        "math-verify gave up on an answer key after 0.5 s: '\\\\sqrt{19}'",
    ]
