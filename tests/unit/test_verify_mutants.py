"""Tests written to kill the mutmut survivors in esbatch/tasks/verify.py (mutmut 3.8.1).

Each test states an independent expectation: a reference implementation written from the docstring (the
extractors), a truth table of nasty inputs with the values a reader works out by hand (the parsers and the
Countdown checker), or the documented warning contract (what is warned, how often, with which text).
Mutants left alive are equivalent; the mutation-testing section of docs/benchmarks.md lists why.
"""

from __future__ import annotations

import re
import signal
from contextlib import contextmanager
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from esbatch.tasks import verify
from esbatch.tasks.verify import (
    Verdict,
    check_boxed_number,
    check_countdown,
    extract_answer_tag,
    extract_boxed,
    guarded_answer_key,
    guarded_score,
    guarded_score_many,
    parse_number,
    scoring_warning,
)

C, W, M = Verdict.CORRECT, Verdict.WRONG, Verdict.MISSING
FAST = settings(max_examples=150, deadline=None, database=None)


class Hang(Exception):
    pass


@contextmanager
def bounded(seconds: float = 2.0):
    """The extractors must finish in linear time; a loop that never ends fails here instead of hanging the run."""

    def hang(signum, frame):
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- extract_boxed


def _boxed_reference(text: str) -> str | None:
    r"""The docstring's rule, naively: of all ``\boxed`` (spaces allowed before ``{``) whose brace closes, the
    one that starts last."""
    found = None
    for m in re.finditer(r"\\boxed *\{", text):
        depth = 0
        for j in range(m.end() - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                found = text[m.end() : j]
                break
    return found


@pytest.mark.parametrize(
    "text, expect",
    [
        ("\\boxed", None),  # the text ends right after the command
        ("so \\boxed   ", None),  # ...or after its spaces
        ("\\boxed x{1}", None),  # not a brace after the spaces: no box
        ("\\boxedx{1}", None),
        ("\\boxed{1} \\boxed{", "1"),  # the last box never closes: the previous one counts
        ("\\boxed{1}\\boxed{", "1"),  # ...also when it starts at 0
        ("\\boxed{1}\\boxed{2}\\boxed{", "2"),  # ...the latest closed one, not the first
        ("\\boxed{1} \\boxed{\\boxed{", "1"),
        ("\\boxed{\\boxed{3}}", "3"),  # nested: the inner box starts last
        ("\\boxed{a \\boxed{b}", "b"),
        ("\\boxed{}", ""),
    ],
)
def test_extract_boxed_corners(text, expect):
    with bounded():
        assert extract_boxed(text) == expect == _boxed_reference(text)


@FAST
@given(st.lists(st.sampled_from(["\\boxed", "{", "}", " ", "1", "x", "\\boxed{", "\\"]), max_size=20).map("".join))
def test_extract_boxed_matches_the_reference(text):
    with bounded():
        assert extract_boxed(text) == _boxed_reference(text)


# ----------------------------------------------------------------------------- parse_number


@pytest.mark.parametrize(
    "s, value",
    [
        ("1" * 1000, Fraction(int("1" * 1000))),  # MAX_NUMBER_CHARS itself is still a number
        ("  " + "1" * 1000 + " ", Fraction(int("1" * 1000))),  # counted after stripping
        ("1" * 1001, None),
        (r"\text{5}", Fraction(5)),  # \text{} keeps its content
        (r"\mathrm{5}", Fraction(5)),
        (r"\textbf{7}", Fraction(7)),
        (r"\mathbf{8}", Fraction(8)),
        (r"5\mathrm{cm}", Fraction(5)),
        (r"1\!000", Fraction(1000)),  # LaTeX spacing inside a number
        (r"1\,000", Fraction(1000)),
        ("72%", Fraction(72)),  # unescaped percent
        ("%50", Fraction(50)),  # percent sign first, as in Turkish: still dropped
        (r"\%50", Fraction(50)),
        ("−7", Fraction(-7)),  # U+2212 minus sign
        ("−3/4", Fraction(-3, 4)),
        ("X = 5", Fraction(5)),  # capital variable
        ("$ x = 5 $", Fraction(5)),  # spaces inside the math delimiters
        ("18 Dollars", Fraction(18)),  # capitalised unit
        ("5 CM", Fraction(5)),
        (r"\frac{1}{2}.", Fraction(1, 2)),  # a sentence's full stop after a fraction
        ("3/4.", Fraction(3, 4)),
        ("5 .", Fraction(5)),
        (".5", Fraction(1, 2)),
        ("+5", Fraction(5)),
        ("1e5", None),  # Fraction() would take it; a final answer is not written so
        ("1,000,000", Fraction(1000000)),
        ("1,0000", None),
        (r"\tfrac{-1}{2}", Fraction(-1, 2)),
        (r"\frac{1}{0}", None),
        ("-3 / -4", Fraction(3, 4)),
    ],
)
def test_parse_number_corners(s, value):
    assert parse_number(s) == value


# ----------------------------------------------------------------------------- check_boxed_number


def test_check_boxed_number_names_a_bad_gold_answer():
    with pytest.raises(ValueError, match=r"^gold answer 'seven' is not a number$"):
        check_boxed_number(r"\boxed{7}", "seven")
    assert check_boxed_number("no box", "seven") is M  # only a box is checked against the gold


# ----------------------------------------------------------------------------- extract_answer_tag


def _tag_reference(text: str) -> str | None:
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)  # as the docstring says
    return found[-1].strip() if found else None


@pytest.mark.parametrize(
    "text, expect",
    [
        ("<answer></answer>", ""),
        ("<answer>1</answer>", "1"),
        ("<answer>1</answer><answer>2</answer>", "2"),  # adjacent tags
        ("<answer>1</answer><answer>2", "1"),  # the last tag never closes
        ("<answer>abc", None),
        ("<answer>a<answer>b</answer>", "a<answer>b"),  # leftmost start, shortest match
        ("<answer>1</answer> x </answer>", "1"),
        ("</answer><answer>3</answer>", "3"),
        ("<answer><answer></answer></answer>", "<answer>"),
    ],
)
def test_extract_answer_tag_corners(text, expect):
    with bounded():
        assert extract_answer_tag(text) == expect == _tag_reference(text)


@FAST
@given(
    st.lists(st.sampled_from(["<answer>", "</answer>", "1", " ", "<", ">", "answer", "/"]), max_size=16).map("".join)
)
def test_extract_answer_tag_matches_findall(text):
    with bounded():
        assert extract_answer_tag(text) == _tag_reference(text)


# ----------------------------------------------------------------------------- check_countdown

NUMS, TARGET = [25, 5, 3], 60


@pytest.mark.parametrize(
    "answer, verdict",
    [
        ("(25 + 5) * 3", W),  # every number used once, but 90
        ("25 * 3 / 5", W),  # 15
        ("(25 - 5) * 3 = 61", W),  # a false equation is not stripped to its left side
        ("(25 - 5) * 3 =60", C),
        ("(25 − 5) × 3", C),  # typographic operators
        ("(25 - 5) × 3 = 60", C),
        ("3 × (25 − 5)", C),
        ("(25 - 5) * 3 * True", W),  # bool is not a number given
        ("(25 - 5) * 3.0", W),
        ("(25 - 5) * 3 // 1", W),
        ("-(5 - 25) * 3", W),  # unary minus is not an operation of the game
        ("(25 - 5) * 3\x00", W),  # ast.parse refuses a NUL byte
    ],
)
def test_countdown_truth_table(answer, verdict):
    assert check_countdown(f"<answer>{answer}</answer>", NUMS, TARGET) is verdict


def test_countdown_division_sign():
    assert check_countdown("<answer>(1 + 1 ÷ 3) × 3</answer>", [1, 1, 3, 3], 4) is C
    assert check_countdown("<answer>(1 + 1 ÷ 3) × 3</answer>", [1, 1, 3, 3], 5) is W


def test_countdown_expressions_up_to_200_characters_are_read():
    at_limit = "(25-5)" + " " * 192 + "*3"  # 200 characters
    assert len(at_limit) == 200
    assert check_countdown(f"<answer>{at_limit}</answer>", NUMS, TARGET) is C
    assert check_countdown(f"<answer>{at_limit.replace('*', ' *')}</answer>", NUMS, TARGET) is W  # 201


# ----------------------------------------------------------------------------- scoring_warning, _warn


@pytest.fixture()
def fresh_warnings(monkeypatch):
    """Warnings are throttled per process; each test starts with none given."""
    monkeypatch.setattr(verify, "_warned", {})


def test_scoring_warning_first_three_then_every_thousandth_with_the_count(capsys, fresh_warnings):
    for _ in range(2000):
        scoring_warning("Src.score", "ValueError", "boom")
    out, err = capsys.readouterr()
    assert out == ""  # stderr only: stdout may carry results
    assert err.splitlines() == ["warning: Src.score: boom"] * 3 + [
        "warning: Src.score: boom (1000 so far)",
        "warning: Src.score: boom (2000 so far)",
    ]


def test_scoring_warning_counts_per_source_and_kind(capsys, fresh_warnings):
    for _ in range(3):
        scoring_warning("A.score", "ValueError", "v")
    scoring_warning("A.score", "KeyError", "k")  # another error type of the same method: its own three
    scoring_warning("B.score", "ValueError", "b")  # another method: its own three
    scoring_warning("A.score", "ValueError", "v")  # the fourth: counted only
    assert capsys.readouterr().err.splitlines() == [
        "warning: A.score: v",
        "warning: A.score: v",
        "warning: A.score: v",
        "warning: A.score: k",
        "warning: B.score: b",
    ]
    assert verify._warned == {("A.score", "ValueError"): 4, ("A.score", "KeyError"): 1, ("B.score", "ValueError"): 1}


class Scorer:
    """A task whose scoring raises on responses starting with "!" and records the calls it gets."""

    def __init__(self):
        self.calls = []

    def score(self, response, ex):
        self.calls.append(("score", response, ex))
        if response.startswith("!"):
            raise ValueError(response[1:])
        if response.startswith("?"):
            raise LookupError(response[1:])
        return C if response == ex else W

    def answer_key(self, response, ex):
        self.calls.append(("answer_key", response, ex))
        if response.startswith("!"):
            raise KeyError(response[1:])
        return response.upper()


class BatchScorer(Scorer):
    def score_many(self, responses, examples):
        self.calls.append(("score_many", list(responses), list(examples)))
        if any(r.startswith("!!") for r in responses):
            raise RuntimeError("batch down")
        return (M for _ in responses)  # a generator: the guard returns a list


def test_guarded_score_returns_the_verdict_or_wrong_with_a_warning(capsys, fresh_warnings):
    task = Scorer()
    assert guarded_score(task, "7", "7") is C
    assert guarded_score(task, "6", "7") is W
    assert task.calls == [("score", "7", "7"), ("score", "6", "7")]
    assert capsys.readouterr().err == ""
    assert guarded_score(task, "!bad", "7") is W
    assert capsys.readouterr().err == "warning: Scorer.score: raised ValueError, counted as WRONG: 'bad'\n"


def test_guarded_answer_key_returns_the_key_or_none_with_a_warning(capsys, fresh_warnings):
    task = Scorer()
    assert guarded_answer_key(task, "abc", "ex") == "ABC"
    assert task.calls == [("answer_key", "abc", "ex")]
    assert guarded_answer_key(task, "!k", "ex") is None
    assert capsys.readouterr().err == "warning: Scorer.answer_key: raised KeyError, no answer key: \"'k'\"\n"


def test_each_error_type_of_a_method_has_its_own_warnings(capsys, fresh_warnings):
    task = Scorer()
    assert [guarded_score(task, r, "7") for r in ["!a", "!b", "!c", "!d", "?e"]] == [W] * 5
    assert capsys.readouterr().err.splitlines() == [
        "warning: Scorer.score: raised ValueError, counted as WRONG: 'a'",
        "warning: Scorer.score: raised ValueError, counted as WRONG: 'b'",
        "warning: Scorer.score: raised ValueError, counted as WRONG: 'c'",
        "warning: Scorer.score: raised LookupError, counted as WRONG: 'e'",  # a new error type is not muted
    ]


def test_warning_quotes_at_most_160_characters_of_the_error(capsys, fresh_warnings):
    message = "".join(chr(ord("a") + i % 26) for i in range(300))  # an error that echoes a long response
    assert guarded_score(Scorer(), "!" + message, "7") is W
    assert capsys.readouterr().err == f"warning: Scorer.score: raised ValueError, counted as WRONG: {message[:160]!r}\n"


def test_guarded_score_many_uses_the_batch_call(capsys, fresh_warnings):
    task = BatchScorer()
    assert guarded_score_many(task, ["1", "2"], ["1", "3"]) == [M, M]
    assert task.calls == [("score_many", ["1", "2"], ["1", "3"])]
    assert capsys.readouterr().err == ""


def test_guarded_score_many_falls_back_to_single_scoring(capsys, fresh_warnings):
    task = BatchScorer()
    assert guarded_score_many(task, ["!!x", "1", "2"], ["1", "1", "3"]) == [W, C, W]
    assert task.calls[1:] == [("score", "!!x", "1"), ("score", "1", "1"), ("score", "2", "3")]
    assert capsys.readouterr().err.splitlines() == [
        "warning: BatchScorer.score_many: raised RuntimeError, counted as WRONG: 'batch down'",
        "warning: BatchScorer.score: raised ValueError, counted as WRONG: '!x'",
    ]


def test_guarded_score_many_without_a_batch_method_scores_one_by_one(capsys, fresh_warnings):
    task = Scorer()
    assert guarded_score_many(task, ["1", "!e", "2"], ["1", "1", "3"]) == [C, W, W]
    assert [c[0] for c in task.calls] == ["score"] * 3
    assert capsys.readouterr().err == "warning: Scorer.score: raised ValueError, counted as WRONG: 'e'\n"
