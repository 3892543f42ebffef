"""Truth tables for answer extraction and the App. G.1 math reward (1 / 0.1 / 0)."""

import re
from fractions import Fraction

import pytest

from esbatch.config import config_from_dict
from esbatch.tasks.verify import (
    Verdict,
    check_boxed_number,
    check_countdown,
    extract_answer_tag,
    extract_boxed,
    parse_number,
)
from esbatch.train.problems import reward_of

C, W, M = Verdict.CORRECT, Verdict.WRONG, Verdict.MISSING


@pytest.mark.parametrize(
    "text, expect",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{1} then \boxed{2}", "2"),  # the last box counts
        (r"\boxed {7}", "7"),
        (r"\boxed{", None),  # unbalanced
        ("no box", None),
        (r"\boxed{{a}{b}}", "{a}{b}"),
    ],
)
def test_extract_boxed(text, expect):
    assert extract_boxed(text) == expect


@pytest.mark.parametrize(
    "s, value",
    [
        ("1,000", Fraction(1000)),
        ("1{,}000", Fraction(1000)),
        (r"\$18", Fraction(18)),
        ("$18.00", Fraction(18)),
        (r"\frac{1}{2}", Fraction(1, 2)),
        (r"\dfrac{3}{4}", Fraction(3, 4)),
        ("0.5", Fraction(1, 2)),
        ("-7", Fraction(-7)),
        ("007", Fraction(7)),
        (r"72\%", Fraction(72)),
        (r"18 \text{ apples}", Fraction(18)),
        ("18 dollars", Fraction(18)),
        ("x = 5", Fraction(5)),
        ("5.", Fraction(5)),
        ("1/0", None),
        ("abc", None),
        ("**73**", None),
        ("", None),
        ("1,2", None),
        ("3 + 4", None),
    ],
)
def test_parse_number(s, value):
    assert parse_number(s) == value


@pytest.mark.parametrize(
    "response, gold, verdict",
    [
        (r"The answer is \boxed{72}.", "72", C),
        (r"\boxed{1,000}", "1000", C),
        (r"\boxed{\frac{1}{2}}", "0.5", C),
        (r"\boxed{0.50}", "1/2", C),
        (r"\boxed{072}", "72", C),
        (r"\boxed{\$72}", "72", C),
        (r"\boxed{71}", "72", W),
        (r"\boxed{seventy-two}", "72", W),
        (r"\boxed{72} no wait \boxed{73}", "72", W),
        ("The answer is 72.", "72", M),
        ("**72**", "72", M),
        ("", "72", M),
    ],
)
def test_boxed_number_truth_table(response, gold, verdict):
    assert check_boxed_number(response, gold) is verdict


def test_reward_values_follow_appendix_g1_and_are_configurable():
    cfg = config_from_dict({"es": {"updates": 1}})
    assert [reward_of(v, cfg) for v in (C, W, M)] == [1.0, 0.1, 0.0]
    cfg = config_from_dict({"es": {"updates": 1}, "reward": {"correct": 2.0, "format": 0.0, "missing": -1.0}})
    assert [reward_of(v, cfg) for v in (C, W, M)] == [2.0, 0.0, -1.0]


@pytest.mark.parametrize(
    "response, verdict",
    [
        ("<answer>(25 - 5) * 3</answer>", C),
        ("<answer>3 * (25 - 5)</answer>", C),
        ("<answer>(25 - 5) * 3 = 60</answer>", C),
        ("<answer>(25-5)*3</answer> <answer>25</answer>", W),  # the last tag counts
        ("<answer>25 * 3 - 5 * 3</answer>", W),  # 3 reused
        ("<answer>(25 - 5) * 3 + 0</answer>", W),  # number not given
        ("<answer>20 * 3</answer>", W),  # 25 and 5 missing
        ("<answer>(25 - 5) ** 3</answer>", W),  # power is not allowed
        ("<answer>__import__('os')</answer>", W),
        ("<answer>abs(25 - 5) * 3</answer>", W),  # calls are not allowed
        ("<answer>x * 3</answer>", W),  # names are not allowed
        ("<answer>(25 - 5) / 0 * 3</answer>", W),
        ("(25 - 5) * 3", M),
    ],
)
def test_countdown_truth_table(response, verdict):
    assert check_countdown(response, [25, 5, 3], 60) is verdict


def test_countdown_exact_fractions():
    assert check_countdown("<answer>(1 + 1 / 3) * 3</answer>", [1, 1, 3, 3], 4) is C


@pytest.mark.parametrize("target", [1.5, "1.5", "3/2"])
def test_countdown_non_integer_targets_compare_exactly(target):
    """3/2 == 1.5 exactly, a wrong value is not rounded onto the target, and '= 1.5' / '= 3/2' may follow."""
    assert check_countdown("<answer>3 / 2</answer>", [3, 2], target) is C
    assert check_countdown("<answer>3 / 2 = 1.5</answer>", [3, 2], target) is C
    assert check_countdown("<answer>3 / 2 = 3/2</answer>", [3, 2], target) is C
    assert check_countdown("<answer>3 - 2</answer>", [3, 2], target) is W  # 1, not 1.5
    assert check_countdown("<answer>3 / 2 = 1</answer>", [3, 2], target) is W


@pytest.mark.parametrize("length, verdict", [(200, C), (201, W)])
@pytest.mark.parametrize("tail", ["", " = 3"], ids=["bare", "with-target"])
def test_countdown_answers_are_read_up_to_exactly_200_characters(length, verdict, tail):
    """The length cap (a guard against huge expressions) at its boundary, with and without a trailing '= target'."""
    expr = "1 +" + " " * (length - len("1 +2") - len(tail)) + "2" + tail
    assert len(expr) == length
    assert check_countdown(f"<answer>{expr}</answer>", [1, 2], 3) is verdict


@pytest.mark.parametrize("target", [True, "abc", "1/0"])
def test_a_countdown_target_that_is_no_number_is_refused_by_name(target):
    with pytest.raises(ValueError, match=f"^Countdown target {re.escape(repr(target))} is not a number$"):
        check_countdown("<answer>1 + 2</answer>", [1, 2], target)


def test_countdown_float_targets_mean_their_decimal_value():
    """0.1 is not exactly 1/10 in binary; the target means the decimal it is written as, unless it is a rounded
    fraction: repr(2/3) means 2/3 (tests/unit/test_countdown_targets.py), and nothing merely near it is right."""
    assert check_countdown("<answer>1 / 10</answer>", [1, 10], 0.1) is C
    assert check_countdown("<answer>2 / 3</answer>", [2, 3], 0.6666666666666666) is C  # repr(2/3) means 2/3
    assert check_countdown("<answer>6666 / 10000</answer>", [6666, 10000], 0.6666666666666666) is W  # no tolerance
    assert check_countdown("<answer>(25 - 5) * 3</answer>", [25, 5, 3], 60.0) is C


def test_answer_tag_multiline():
    assert extract_answer_tag("<answer>\n 1 + 2\n</answer>") == "1 + 2"


def test_vote_keys_unify_equal_numbers_and_abstain_without_an_answer():
    from esbatch.tasks.verify import countdown_key, number_key

    assert number_key(r"so \boxed{0.5}") == number_key(r"\boxed{\frac{1}{2}}") == number_key(r"\boxed{1/2}") == "1/2"
    assert number_key(r"\boxed{1,000}") == number_key(r"\boxed{1000.0}") == "1000"
    assert number_key(r"\boxed{1} then \boxed{2}") == "2"  # the last box, as scored
    assert number_key("**73**") is None and number_key(r"\boxed{seven}") is None
    assert countdown_key("<answer> (3 + 5) * 2 </answer>") == "(3+5)*2"
    assert countdown_key("no tags") is None and countdown_key("<answer>  </answer>") is None
