"""MBPP without running code: extraction, batch-length checks, loading (local file), prompts, vote keys,
parameters, and refusing an unisolated machine. Sandboxed scoring, the hub path scored end to end and the
sandbox's report: tests/integration/test_mbpp_sandboxed.py."""

from __future__ import annotations

import pytest
from mbpp_cases import FIXTURE, RIGHT, WRONG, block, unprobed_task

from esbatch.tasks.mbpp import CODE_SYSTEM_PROMPT, MBPPTask, extract_code


@pytest.fixture(scope="module")
def task():
    return unprobed_task(str(FIXTURE), timeout_s=2.0)


@pytest.fixture(scope="module")
def examples(task):
    return task.eval_examples(None)


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


def test_bad_rows_name_the_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x", "code": "pass"}\n' * 3)
    with pytest.raises(ValueError, match="'test_list'"):
        unprobed_task(str(bad)).eval_examples(None)


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
