"""MBPP: code extraction, sandboxed scoring truth table, loading (local file and hub call), prompts, vote keys."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from esbatch.tasks.mbpp import CODE_SYSTEM_PROMPT, MBPPTask, extract_code
from esbatch.tasks.verify import Verdict

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "mbpp_tiny.jsonl"
RIGHT = "def digit_square_sum(n):\n    return sum(int(d) ** 2 for d in str(n))"
WRONG = "def digit_square_sum(n):\n    return sum(int(d) for d in str(n))"


def block(code: str, lang: str = "python") -> str:
    return f"```{lang}\n{code}\n```"


@pytest.fixture(scope="module")
def task():
    return MBPPTask(str(FIXTURE), timeout_s=2.0)


@pytest.fixture(scope="module")
def examples(task):
    return task.eval_examples(None)


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


def test_scoring_truth_table(task, examples):
    ex = examples[0]
    assert ex.meta["tests"][0].startswith("assert digit_square_sum")
    names = list(TRUTH_TABLE)
    t = time.monotonic()
    got = task.score_many([TRUTH_TABLE[n][0] for n in names], [ex] * len(names))
    assert time.monotonic() - t < 20, "the hanging answer held the batch up"
    assert dict(zip(names, got)) == {n: TRUTH_TABLE[n][1] for n in names}


@pytest.mark.parametrize("name", ["correct", "wrong", "no code block", "hangs"])
def test_score_single(task, examples, name):
    response, want = TRUTH_TABLE[name]
    t = time.monotonic()
    assert task.score(response, examples[0]) is want
    assert time.monotonic() - t < 6


def test_every_reference_solution_passes_its_own_tests(task, examples):
    """The fixture is self-consistent, and demo_response is a block the scorer accepts (incl. test_imports)."""
    assert len(examples) == 6
    assert task.score_many([task.demo_response(e) for e in examples], examples) == [Verdict.CORRECT] * 6
    assert examples[3].meta["setup"] == ["import math"]
    assert task.score(block(examples[3].answer.replace("import math\n", "")), examples[3]) is Verdict.CORRECT
    # someone else's solution fails a problem's tests
    assert task.score(task.demo_response(examples[1]), examples[0]) is Verdict.WRONG


def test_score_many_checks_lengths(task, examples):
    with pytest.raises(ValueError, match="2 responses for 1 examples"):
        task.score_many(["a", "b"], examples[:1])
    assert task.score_many([], []) == []


def test_extract_code():
    assert extract_code("no code") is None
    assert extract_code(block("a = 1")) == "a = 1"
    assert extract_code(f"{block('a = 1')}\n{block('b = 2', 'py')}") == "b = 2"
    assert extract_code(f"{block('a = 1')}\n{block('x', 'text')}") == "a = 1"
    assert extract_code("```Python3 title=x\nc = 3\n```") == "c = 3"


def test_local_file_splits_and_eval_examples(task):
    sp = task.splits(None, 2, 1, seed=0)
    assert [len(sp[k]) for k in ("train", "heldout", "demo")] == [3, 2, 1]
    ids = [[e.meta["task_id"] for e in sp[k]] for k in ("demo", "train", "heldout")]
    assert ids == [[1], [2, 3, 4], [5, 6]]
    assert len(task.splits(2, 2, 1, seed=0)["train"]) == 2
    assert [e.meta["task_id"] for e in task.eval_examples(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="6 rows"):
        task.splits(None, 5, 1, seed=0)


def test_prompt_contents(task, examples):
    ex, demo = examples[1], examples[0]
    msg = task.user_message(ex)
    assert msg.startswith("Task: Write a function to count the vowels in a string, ignoring case.\nTest Cases:\n")
    assert all(t in msg for t in ex.meta["tests"]) and "def count_vowels" not in msg
    msgs = task.messages(ex, [demo])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"] == CODE_SYSTEM_PROMPT
    assert CODE_SYSTEM_PROMPT.startswith("You are a Python programming assistant. Write clean, correct Python code")
    assert CODE_SYSTEM_PROMPT.endswith(
        "Output exactly one Python markdown code block containing only the final solution code."
    )
    assert msgs[2]["content"] == f"```python\n{demo.answer}\n```" and msgs[-1]["content"] == msg
    assert task.messages(ex, [], "custom")[0]["content"] == "custom"


def test_answer_key_votes_by_program(task, examples):
    ex = examples[0]
    key = task.answer_key(block(RIGHT), ex)
    reformatted = "def digit_square_sum(n):  # squares\n    return sum(int(d)**2 for d in str(n))"
    assert key is not None and task.answer_key(block(reformatted), ex) == key
    assert task.answer_key(block(WRONG), ex) != key
    assert task.answer_key(RIGHT, ex) is None
    assert task.answer_key(block("def f(:\n  pass"), ex) == "def f(: pass"


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


def test_bad_rows_name_the_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x", "code": "pass"}\n' * 3)
    with pytest.raises(ValueError, match="'test_list'"):
        MBPPTask(str(bad)).eval_examples(None)


def test_params_validate_like_other_tasks():
    errors: list[str] = []
    MBPPTask.check_params({"timeout_s": 3, "hub_config": "full", "workers": 4}, "task.params", errors)
    assert errors == []
    MBPPTask.check_params({"timeout": 3}, "task.params", errors)
    assert len(errors) == 1 and "timeout_s" in errors[0]


def test_code_is_not_run_where_it_cannot_be_isolated_unless_allowed(monkeypatch, capsys):
    import esbatch.tasks.mbpp as mbpp
    from esbatch.sandbox import SandboxError

    refused = {"isolated": False, "missing": "unshare(CLONE_NEWUSER): Operation not permitted"}
    monkeypatch.setattr(mbpp, "isolation_report", lambda: refused)
    with pytest.raises(SandboxError, match="cannot be isolated on this machine .*allow_unconfined: true"):
        MBPPTask(str(FIXTURE))
    task = MBPPTask(str(FIXTURE), allow_unconfined=True)
    assert "UNCONFINED" in capsys.readouterr().err
    assert task.tracking_tags() == {
        "sandbox.allow_unconfined": "True",
        "sandbox.isolated": "False",
        "sandbox.missing": refused["missing"],
    }


def test_runs_record_how_the_sandbox_confines_code():
    tags = MBPPTask(str(FIXTURE)).tracking_tags()
    assert tags["sandbox.isolated"] == "True" and tags["sandbox.pid_namespace"] == "True"
