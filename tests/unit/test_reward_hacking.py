"""MBPP's reward cannot be won without solving the problem: the pieces that run no program. The test plan lifts
only the solution's calls out of the asserts, and the program the solution runs in names those calls, never the
values they must return. The hacks themselves, run in the sandbox, are in
tests/integration/test_reward_hacking_sandboxed.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from mbpp_cases import FIXTURE, RIGHT, unprobed_task

from esbatch.sandbox import SandboxError
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


def _plans(n):
    from esbatch.tasks.code_check import TestPlan

    return [TestPlan(setup=(), calls=(), asserts=())] * n


@pytest.mark.parametrize("n", [1, 3])
def test_a_sandbox_that_cannot_start_stops_judging_instead_of_failing_every_response(monkeypatch, n):
    """The sandbox raising for the batch judge and then for every single judge run is a sandbox that does not run
    here: an error, not n WRONG verdicts."""
    from esbatch.tasks import code_check
    from esbatch.tasks.code_check import Limits, SandboxUnavailable, judge

    def refuse(*a, **k):
        raise SandboxError("the sandbox could not start the program: unshare refused")

    monkeypatch.setattr(code_check, "run_python", refuse)
    with pytest.raises(SandboxUnavailable, match=rf"could not run any of {n} judge programs \(SandboxError: the sa"):
        judge(_plans(1), [(0, "x")] * n, Limits())


def test_a_response_that_breaks_its_judge_run_fails_alone(monkeypatch):
    """One of three values makes the sandbox raise; the batch judge fails, the single runs judge the other two."""
    from esbatch.tasks import code_check
    from esbatch.tasks.code_check import Limits, judge

    real = code_check.judge_program

    def run(program, **k):
        if "poison" in program:
            raise SandboxError("the sandbox launcher failed (exit 1): config too large")
        return SimpleNamespace(ok=True, stdout=program.split("MARK=")[1].split("\n")[0])

    def program(plans, items, marker):  # the judge's verdicts, as it would print them: True for each value
        return real(plans, items, marker) + f"\nMARK={marker}{json.dumps([True] * len(items))}\n"

    monkeypatch.setattr(code_check, "run_python", run)
    monkeypatch.setattr(code_check, "judge_program", program)
    assert judge(_plans(1), [(0, "a"), (0, "poison"), (0, "b")], Limits()) == [True, False, True]
