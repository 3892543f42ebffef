"""The math verifiers must compare (prediction, gold) in that order: math-verify's ``verify(gold, pred)`` is not
symmetric, so swapping the arguments anywhere on the path changes verdicts.

The pair used: gold ``x > 1`` (an inequality) accepts the predicted interval ``(1, \\infty)``, but gold
``(1, \\infty)`` does not accept the predicted inequality ``x > 1`` (math-verify 0.9: an interval gold wants an
interval). Plain numbers and identical strings are symmetric (fast path), so only such pairs expose a swap.
"""

import pytest

from esbatch.tasks.verify import Verdict
from esbatch.tasks.verify_math import Match, check_boxed_math, compare_math, math_equal

INEQ, INTERVAL = "x>1", r"(1,\infty)"


@pytest.mark.parametrize(
    "pred, gold, equal",
    [
        (INTERVAL, INEQ, True),  # gold inequality, predicted interval: accepted
        (INEQ, INTERVAL, False),  # gold interval, predicted inequality: rejected
    ],
)
def test_compare_math_is_pred_then_gold(pred, gold, equal):
    assert compare_math(pred, gold) is (Match.EQUAL if equal else Match.UNEQUAL)
    assert math_equal(pred, gold) is equal


def test_check_boxed_math_scores_the_response_against_the_gold_in_order():
    assert check_boxed_math(rf"so the answer is \boxed{{{INTERVAL}}}", INEQ) is Verdict.CORRECT
    assert check_boxed_math(rf"so the answer is \boxed{{{INEQ}}}", INTERVAL) is Verdict.WRONG
    assert check_boxed_math(INTERVAL, INEQ) is Verdict.MISSING  # the response must box its answer, not the gold


def test_math_task_score_uses_the_example_answer_as_gold():
    from esbatch.tasks.base import Example
    from esbatch.tasks.math_tasks import Math500Task

    task = Math500Task.__new__(Math500Task)  # no dataset: only score() is used
    task.timeout_s = 5.0
    assert task.score(rf"\boxed{{{INTERVAL}}}", Example("q", INEQ)) is Verdict.CORRECT
    assert task.score(rf"\boxed{{{INEQ}}}", Example("q", INTERVAL)) is Verdict.WRONG
