"""Truth tables for the evaluation verifiers: math-verify equivalence, multiple-choice letters, HotpotQA EM/F1,
and Countdown. (math-verify's off-main-thread time limit kills the worker that runs over it, so the next check
starts a new one: those tests are in tests/integration/test_verify_math_timeouts.py.)"""

from fractions import Fraction

import pytest

from esbatch.tasks.choice import check_choice, choice_letter
from esbatch.tasks.hotpotqa import check_hotpot, hotpot_em, hotpot_f1, hotpot_normalize
from esbatch.tasks.verify import Verdict, check_countdown
from esbatch.tasks.verify_math import (
    check_boxed_math,
    math_answer_key,
    plain_number,
)

C, W, M = Verdict.CORRECT, Verdict.WRONG, Verdict.MISSING


# ----------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    "response, gold, expect",
    [
        (r"\boxed{1,000}", "1000", C),  # thousands separator
        (r"\boxed{1000}", "1,000", C),
        (r"\boxed{\frac{1}{2}}", "0.5", C),
        (r"\boxed{\dfrac12}", r"\frac{1}{2}", C),  # brace-less \dfrac: math-verify
        (r"\boxed{0.5}", "1/2", C),
        (r"\boxed{\frac{-2}{3}}", r"-\frac{2}{3}", C),
        (r"first \boxed{3}, finally \boxed{4}", "4", C),  # the last box counts
        (r"first \boxed{3}, finally \boxed{4}", "3", W),
        ("The answer is **73**", "73", M),  # bold is not a box
        ("no answer at all", "5", M),
        (r"\boxed 5", "5", M),  # brace-less \boxed is not extracted
        (r"\boxed{}", "5", W),  # the format is there, the answer is not
        (r"\boxed{007}", "7", C),  # leading zeros
        (r"\boxed{55}", "055", C),
        (r"\boxed{5 \text{ cm}}", "5", C),  # units are ignored
        (r"\boxed{5\text{ inches}^2}", "5", C),
        (r"\boxed{5 cm}", "5", C),  # bare known unit: math-verify drops it
        (r"\boxed{\$32,348}", "32348", C),
        (r"\boxed{30^\circ}", "30", C),
        (r"\boxed{80}", r"80\%", C),  # percent signs are dropped on both sides...
        (r"\boxed{0.8}", r"80\%", W),  # ...so 80% is 80, not 0.8
        (r"\boxed{x = 3}", "3", C),
        (r"\boxed{3}", "x = 3", C),
        (r"\boxed{3x}", "3", W),  # a variable is not a unit
        (r"\boxed{y = 2x + 3}", "2x+3", C),
        (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt2}{2}", C),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}", C),
        (r"\boxed{2\pi}", r"\pi \cdot 2", C),
        (r"\boxed{(x+1)^2}", "x^2+2x+1", C),
        (r"\boxed{\frac{14}{3}}", r"4\frac{2}{3}", C),  # mixed number
        (r"\boxed{0.333}", r"\frac13", W),
        (r"\boxed{0.333333}", r"\frac{1}{3}", W),  # plain numbers compare exactly
        (r"\boxed{[-2, 7]}", "[-2,7]", C),  # intervals
        (r"\boxed{(-2,7)}", "[-2,7]", W),
        (r"\boxed{(-\infty, 2) \cup (3, \infty)}", r"(-\infty,2)\cup(3,\infty)", C),
        (r"\boxed{\{3, 1, 2\}}", r"\{1,2,3\}", C),  # sets ignore order
        (r"\boxed{(3, \frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)", C),  # tuples
        (r"\boxed{(\frac{\pi}{2}, 3)}", r"\left( 3, \frac{\pi}{2} \right)", W),
        (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}", C),
        (r"\boxed{Briana}", r"\text{Evelyn}", W),
        (r"\boxed{\infty}", r"\infty", C),
    ],
)
def test_check_boxed_math(response, gold, expect):
    assert check_boxed_math(response, gold, timeout_s=10.0) is expect


def test_plain_number_fast_path_refuses_variables():
    assert plain_number(r"5 \text{ cm}") == 5
    assert plain_number(r"x = \frac{3}{4}") == Fraction(3, 4)
    assert plain_number("1,000") == 1000
    assert plain_number("3x") is None and plain_number("5 m") is None and plain_number(r"\sqrt{2}") is None


@pytest.mark.parametrize(
    "responses, key",
    [
        ([r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{1/2}", r"\boxed{\dfrac12}", r"\boxed{0.50}"], "1/2"),
        ([r"\boxed{1,000}", r"\boxed{1000}", r"\boxed{1000 \text{ apples}}"], "1000"),
        ([r"\boxed{007}", r"\boxed{7}", r"\boxed{x = 7}"], "7"),
        ([r"\boxed{\sqrt{2}/2}", r"\boxed{\frac{\sqrt2}{2}}", r"\boxed{\dfrac{\sqrt{2}}{2}}"], "sqrt(2)/2"),
        ([r"\boxed{2\pi}", r"\boxed{\pi \cdot 2}"], "2*pi"),
        ([r"\boxed{\{3,1,2\}}", r"\boxed{\{1, 2, 3\}}"], "{1, 2, 3}"),
        ([r"\boxed{[-2,7]}", r"\boxed{[-2, 7]}"], "Interval(-2, 7)"),
    ],
)
def test_answer_keys_unify_equivalent_forms(responses, key):
    assert {math_answer_key(r) for r in responses} == {key}


def test_answer_key_edge_cases():
    assert math_answer_key("no box, **7**") is None
    assert math_answer_key(r"\boxed{}") is None
    assert math_answer_key(r"\boxed{3} then \boxed{4}") == "4"
    # not unified (would need simplification): documented
    assert math_answer_key(r"\boxed{(x+1)^2}") != math_answer_key(r"\boxed{x^2+2x+1}")
    # an answer whose key runs out of time falls back to its text: tests/integration/test_verify_math_timeouts.py


# ----------------------------------------------------------------------------- multiple choice

OPTS = {"A": "10^-11 eV", "B": "10^-9 eV", "C": "10^-4 eV", "D": "10^-8 eV"}


@pytest.mark.parametrize(
    "response, expect",
    [
        (r"\boxed{C}", C),
        (r"\boxed{c}", C),
        (r"\boxed{(C)}", C),
        (r"\boxed{C)}", C),
        (r"\boxed{C.}", C),
        (r"\boxed{\text{C}}", C),
        (r"\boxed{\textbf{(C)}}", C),
        (r"$\boxed{C}$", C),
        (r"\boxed{C. 10^-4 eV}", C),
        (r"\boxed{(C) 10^-4 eV}", C),
        (r"\boxed{10^-4 eV}", C),  # the option text itself
        (r"\boxed{10^-4 EV.}", C),
        (r"\boxed{Answer: C}", C),
        (r"\boxed{Option C}", C),
        (r"\boxed{A} no wait \boxed{C}", C),  # last box wins
        (r"\boxed{C} no wait \boxed{A}", W),
        (r"\boxed{(b)}", W),
        (r"\boxed{E}", W),  # not an option
        (r"\boxed{C or D}", W),
        (r"\boxed{}", W),
        ("The answer is C.", M),
        ("**C**", M),
    ],
)
def test_check_choice(response, expect):
    assert check_choice(response, OPTS, "C") is expect


def test_choice_letter_maps_option_text_before_letter_prefixes():
    opts = {"A": "D. melanogaster", "B": "E. coli", "C": "S. cerevisiae", "D": "C. elegans"}
    assert choice_letter("E. coli", opts) == "B"  # the text of option B, not "option E"
    assert choice_letter("C. elegans", opts) == "D"
    assert choice_letter("(b)", opts) == "B"
    assert choice_letter("F", opts) is None


# ----------------------------------------------------------------------------- HotpotQA


@pytest.mark.parametrize(
    "response, gold, expect",
    [
        ("<answer>Chief of Protocol</answer>", "Chief of Protocol", C),
        ("<answer> the chief of protocol. </answer>", "Chief of Protocol", C),
        ("<answer>Chief of Protocol of the United States</answer>", "Chief of Protocol", W),
        ("Chief of Protocol", "Chief of Protocol", M),
        ("<answer>Chief of Protocol", "Chief of Protocol", M),  # unclosed
        ("<answer>yes</answer> on reflection <answer>no</answer>", "no", C),  # the last tag counts
        ("<answer>yes</answer> on reflection <answer>no</answer>", "yes", W),
        ("<answer></answer>", "yes", W),
        ("<answer>Yes.</answer>", "yes", C),
    ],
)
def test_check_hotpot(response, gold, expect):
    assert check_hotpot(response, gold) is expect


@pytest.mark.parametrize(
    "pred, gold, em, f1",
    [
        ("The Animorphs!", "animorphs", 1.0, 1.0),
        ("Animorphs series", "Animorphs", 0.0, 2 / 3),  # P 1/2, R 1
        # "chief of protocol of united states" vs "chief of protocol": 3 common of 6 / 3 tokens -> P 1/2, R 1
        ("the Chief of Protocol of the United States", "Chief of Protocol", 0.0, 2 / 3),
        ("United States ambassador", "ambassador to Ghana", 0.0, 1 / 3),  # P 1/3, R 1/3
        ("yes it is", "yes", 0.0, 0.0),  # yes/no gold: anything but an exact yes scores 0
        ("no", "no answer here", 0.0, 0.0),  # yes/no prediction against a span: 0
        ("Yes.", "yes", 1.0, 1.0),
        ("an", "the", 1.0, 0.0),  # both normalize to empty: EM 1, no tokens in common
        ("Laleli", "Ortakoy", 0.0, 0.0),
    ],
)
def test_hotpot_em_f1(pred, gold, em, f1):
    assert hotpot_em(pred, gold) == em
    assert hotpot_f1(pred, gold) == pytest.approx(f1)


def test_hotpot_normalize():
    assert hotpot_normalize("  The  U.S. Army, an  army ") == "us army army"


# ----------------------------------------------------------------------------- Countdown (gym.py's verifier)


@pytest.mark.parametrize(
    "response, expect",
    [
        ("<answer>(6 - 1) * 4</answer>", C),
        ("<answer>4 * (6 - 1) = 20</answer>", C),
        ("<answer>(6 - 1) * 4</answer> <answer>6 * 4 - 1</answer>", W),  # last tag counts: 23
        ("<answer>6 * 4 - 4</answer>", W),  # 4 used twice, 1 unused
        ("<answer>(6 - 1) * 4 * 1</answer>", W),  # 1 used twice
        ("<answer>__import__('os')</answer>", W),
        ("(6 - 1) * 4", M),
    ],
)
def test_countdown(response, expect):
    assert check_countdown(response, [1, 4, 6], 20) is expect
