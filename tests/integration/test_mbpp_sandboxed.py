"""MBPP's sandboxed scoring (truth table, single answers, the fixture's reference solutions), the hub path
scored end to end, and the sandbox's report in the run's tags: each runs programs (or the sandbox's probe).
Code extraction, loading, prompts and vote keys are in tests/unit/test_mbpp.py."""

from __future__ import annotations

import pytest
from mbpp_cases import FIXTURE, RIGHT, WRONG, block, record_sandbox_runs

from esbatch.tasks.mbpp import MBPPTask
from esbatch.tasks.verify import Verdict

#: the sandbox's reasons for a program ended by its time limits (wall clock, CPU time)
LIMITS = ("timeout", "cpu limit")
HANG_BODY = "while True"  # in the hanging answer only (the harness embeds the code as a literal)


@pytest.fixture(scope="module")
def task():
    return MBPPTask(str(FIXTURE), timeout_s=2.0)


@pytest.fixture(scope="module")
def examples(task):
    return task.eval_examples(None)


@pytest.fixture()
def sandbox_runs(monkeypatch):
    """Each batch of solution programs the scorer runs: [(program, SandboxResult), ...] per run_many call."""
    return record_sandbox_runs(monkeypatch)[0]


TRUTH_TABLE = {
    "correct": (block(RIGHT), Verdict.CORRECT),
    "correct, bare fence, prose around": (f"Here it is:\n{block(RIGHT, '')}\nDone.", Verdict.CORRECT),
    "wrong": (block(WRONG), Verdict.WRONG),
    "no code block": (RIGHT, Verdict.MISSING),
    "only another language": (block("echo hi", "bash"), Verdict.MISSING),
    "unclosed block": (f"```python\n{RIGHT}\n", Verdict.MISSING),
    "two blocks, last right": (f"{block(WRONG)}\nFixed:\n{block(RIGHT)}", Verdict.CORRECT),
    "two blocks, first right": (f"{block(RIGHT)}\nOr:\n{block(WRONG)}", Verdict.WRONG),
    "python block then bash block": (f"{block(RIGHT)}\nRun:\n{block('python main.py', 'bash')}", Verdict.CORRECT),
    "indented block in a list": (
        "1. Code:\n   ```python\n   " + RIGHT.replace("\n", "\n   ") + "\n   ```",
        Verdict.CORRECT,
    ),
    "syntax error": (block("def digit_square_sum(n)\n    return 0"), Verdict.WRONG),
    "empty block": (block(""), Verdict.WRONG),
    "hangs": (block("def digit_square_sum(n):\n    while True:\n        pass"), Verdict.WRONG),
    "huge output, passes": (block("print('x' * 10**7)\n" + RIGHT), Verdict.CORRECT),
    "exits 0 before the asserts": (block("import sys\nsys.exit(0)"), Verdict.WRONG),
    "os._exit(0) before the asserts": (block("import os\nos._exit(0)"), Verdict.WRONG),
    "includes the tests too": (block(RIGHT + "\nassert digit_square_sum(12) == 5"), Verdict.CORRECT),
}


def test_scoring_truth_table(task, examples, sandbox_runs):
    ex = examples[0]
    assert ex.meta["tests"][0].startswith("assert digit_square_sum")
    names = list(TRUTH_TABLE)
    got = task.score_many([TRUTH_TABLE[n][0] for n in names], [ex] * len(names))
    assert dict(zip(names, got)) == {n: TRUTH_TABLE[n][1] for n in names}
    # one batch, and the hanging answer was ended by its limit (the sandbox's reason), not waited for
    (batch,) = sandbox_runs
    hung = [r.reason for code, r in batch if HANG_BODY in code]
    assert len(hung) == 1 and hung[0] in LIMITS, ("the hanging answer held the batch up", hung)


@pytest.mark.parametrize("name", ["correct", "wrong", "no code block", "hangs"])
def test_score_single(task, examples, sandbox_runs, name):
    response, want = TRUTH_TABLE[name]
    assert task.score(response, examples[0]) is want
    # how each run ended, in the sandbox's words: no program for no code, a limit for the hanging one
    reasons = [r.reason for batch in sandbox_runs for _, r in batch]
    expect = {"correct": ["ok"], "wrong": ["ok"], "no code block": []}  # the wrong answer's values fail in the judge
    if name == "hangs":
        assert len(reasons) == 1 and reasons[0] in LIMITS, reasons
    else:
        assert reasons == expect[name]


def test_every_reference_solution_passes_its_own_tests(task, examples):
    """The fixture is self-consistent, and demo_response is a block the scorer accepts (incl. test_imports)."""
    assert len(examples) == 6
    assert task.score_many([task.demo_response(e) for e in examples], examples) == [Verdict.CORRECT] * 6
    assert examples[3].meta["setup"] == ["import math"]
    assert task.score(block(examples[3].answer.replace("import math\n", "")), examples[3]) is Verdict.CORRECT
    # someone else's solution fails a problem's tests
    assert task.score(task.demo_response(examples[1]), examples[0]) is Verdict.WRONG


def test_hub_path_calls_datasets_with_the_hub_id(monkeypatch):
    """The hub is unreachable here; check the real loading code asks `datasets` for the right thing."""
    import datasets

    calls = []
    sanitized = [
        {"task_id": i, "prompt": f"Write f{i}.", "code": f"def f{i}(): return {i}",
         "test_list": [f"assert f{i}() == {i}"], "test_imports": []}
        for i in range(4)
    ]  # fmt: skip
    full = [{"task_id": 9, "text": "Write g.", "code": "def g(): return X", "test_list": ["assert g() == 1"],
             "test_setup_code": "X = 1", "challenge_test_list": []}]  # fmt: skip

    def fake_load(path, name=None, split=None, revision=None, **kw):
        calls.append((path, name, split))
        return full if name == "full" else sanitized

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    sp = MBPPTask().splits(None, 2, 1, seed=0)
    hub = "google-research-datasets/mbpp"
    assert calls == [(hub, "sanitized", "train"), (hub, "sanitized", "test"), (hub, "sanitized", "prompt")]
    assert [len(sp[k]) for k in ("train", "heldout", "demo")] == [4, 2, 1]
    assert sp["train"][0].question == "Write f0."
    calls.clear()
    (ex,) = MBPPTask(hub_config="full").eval_examples(None)
    assert calls == [(hub, "full", "test")] and ex.question == "Write g." and ex.meta["setup"] == ["X = 1"]
    assert MBPPTask().score(MBPPTask().demo_response(ex), ex) is Verdict.CORRECT  # setup code is run first


def test_runs_record_how_the_sandbox_confines_code():
    tags = MBPPTask(str(FIXTURE)).tracking_tags()
    assert tags["sandbox.isolated"] == "True" and tags["sandbox.pid_namespace"] == "True"
