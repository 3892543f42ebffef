"""The verifier fuzz (tests/verify_fuzz_cases.py) on the tasks whose checks leave the process: MBPP (each program
in the sandbox) and the math tasks (math-verify's workers; a check that runs over its limit kills its worker,
and the next one starts a new process). Random and adversarial text scores without an exception; adversarial
text never runs a check to its time limit; sympy bombs do, and count as WRONG. The in-process tasks and the
extractors: tests/unit/test_verify_fuzz.py.
"""

from __future__ import annotations

import pytest
from mbpp_cases import record_sandbox_runs
from verify_fuzz_cases import MATH, OUT_OF_PROCESS, SYMPY_BOMBS, build, check_adversarial_text
from verify_fuzz_cases import check_score_and_answer_key_never_raise as check_never_raise

from esbatch.tasks import Verdict, verify_math

#: the time limit of one check for the adversarial text: a safety limit, not an expectation. Its checks take
#: ~0.1 s, so a busy machine never reaches it, and a text that does reach it is pathological (the test fails on
#: the count of checks that ran to their limit, not on a clock)
GENEROUS_TIMEOUT_S = 60.0
#: the sandbox's reasons for a program ended by its time limits (wall clock, CPU time)
LIMITS = ("timeout", "cpu limit")


@pytest.fixture()
def fresh_memo():
    """math-verify's checks (timeouts included) are memoized per process: forget them, so these run and count."""
    for cache in (verify_math._compare_cached, verify_math._key_cached):
        cache.cache_clear()


@pytest.mark.parametrize("name", OUT_OF_PROCESS)
def test_score_and_answer_key_never_raise(name):
    check_never_raise(name, *build(name))


@pytest.mark.parametrize("name", MATH)
def test_adversarial_text_scores_fast_on_every_math_task(name, fresh_memo):
    """Each adversarial text in one go: the caller's CPU bounded (in check_adversarial_text), and no check in the
    worker ran to its (generous) limit."""
    task, examples = build(name, timeout_s=GENEROUS_TIMEOUT_S)
    before = verify_math.timeout_count()
    check_adversarial_text(task, examples)
    assert verify_math.timeout_count() == before


def test_adversarial_text_scores_fast_on_mbpp(monkeypatch):
    """Each adversarial text in one go: the caller's CPU bounded, and no program ran to its (generous) limits."""
    task, examples = build("mbpp", timeout_s=GENEROUS_TIMEOUT_S)
    batches, judges = record_sandbox_runs(monkeypatch)
    check_adversarial_text(task, examples)
    ended = [r.reason for batch in batches for _, r in batch] + [r.reason for r in judges]
    assert ended and not [reason for reason in ended if reason in LIMITS], ended


def test_sympy_bombs_time_out_as_wrong(fresh_memo):
    task, examples = build("math500")  # a 1 s limit per check
    before = verify_math.timeout_count()
    for text in SYMPY_BOMBS:  # (each timeout also costs a worker restart)
        assert task.score(text, examples[0]) is Verdict.WRONG
    assert isinstance(task.answer_key(SYMPY_BOMBS[1], examples[0]), str)
    # WRONG because each check ran to its limit (two scores, one key) and was abandoned, not because it failed
    assert verify_math.timeout_count() == before + 3
