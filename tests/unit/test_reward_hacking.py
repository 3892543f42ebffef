"""MBPP's reward cannot be won without solving the problem: the pieces that run no program. The test plan lifts
only the solution's calls out of the asserts, and the program the solution runs in names those calls, never the
values they must return. The hacks themselves, run in the sandbox, are in
tests/integration/test_reward_hacking_sandboxed.py.
"""

from __future__ import annotations

import pytest
from mbpp_cases import FIXTURE, RIGHT, unprobed_task

from esbatch.tasks.code_check import plan_tests


@pytest.fixture(scope="module")
def task():
    return unprobed_task(str(FIXTURE), timeout_s=3.0)


@pytest.fixture(scope="module")
def examples(task):
    return task.eval_examples(None)


def test_the_sandboxed_program_holds_no_expected_value(task, examples):
    """What the solution could read (its own program) names the calls, never the values they must return."""
    ex = examples[0]
    prog = task.program(RIGHT, ex, "@@m@@")
    assert "digit_square_sum(12)" in prog and "== 5" not in prog and "34" not in prog and "assert" not in prog


def test_plan_lifts_only_solution_calls():
    p = plan_tests(
        ["assert math.isclose(f(g(1)), 0.5)", "assert set(h(2)) == {3}", "assert K == len(C(1).m())",
         "assert sys.getsizeof(f(1)) > 0", "assert sum(1, 2) == 3"],
        ["import math"], reference="def sum(a, b): pass",
    )  # fmt: skip
    assert p.calls == ("f(g(1))", "h(2)", "K", "C(1).m()", "f(1)", "sum(1, 2)")
    assert [a for a, _ in p.asserts] == [
        "math.isclose(__v[0], 0.5)", "set(__v[1]) == {3}", "__v[2] == len(__v[3])",
        "sys.getsizeof(__v[4]) > 0", "__v[5] == 3",
    ]  # fmt: skip
    assert p.asserts[2][1] == (2, 3) and p.setup == ("import math", "import sys")
    with pytest.raises(ValueError, match="not an assert"):
        plan_tests(["x = f(1)"], [])
    with pytest.raises(ValueError, match="bound elsewhere in the assert"):
        plan_tests(["assert all(f(x) for x in range(3))"], [])
    assert plan_tests(["assert f(lambda x: x + 1, [y for y in 'ab']) == 2"], []).calls == (
        "f(lambda x: x + 1, [y for y in 'ab'])",
    )
