"""Every registered task's ``score`` and ``answer_key`` on random and adversarial text: a Verdict / a str or
None, never an exception, and never super-linear time (a policy optimised against the verifier will find
whatever input makes it raise or hang). Here: the extractors, and the tasks whose checks stay in this process;
MBPP and the math tasks (the sandbox, math-verify's workers) are fuzzed in
tests/integration/test_verify_fuzz_workers.py. The tasks, texts and checks: tests/verify_fuzz_cases.py.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from verify_fuzz_cases import (
    ADVERSARIAL,
    BUILD,
    IN_PROCESS,
    OUT_OF_PROCESS,
    build,
    check_adversarial_text,
    check_score_and_answer_key_never_raise,
)

from esbatch.tasks import TASKS, Example, Task
from esbatch.tasks.verify import extract_answer_tag, extract_boxed, parse_number


@pytest.fixture(scope="module", params=IN_PROCESS)
def built(request):
    name = request.param
    return name, *build(name)


def test_every_registered_task_is_fuzzed():
    assert set(TASKS.names()) == set(BUILD) == set(IN_PROCESS) | set(OUT_OF_PROCESS)


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_text_is_fast_in_the_extractors(text):
    # CPU time of this thread, not wall time: pure in-process work, ~15 ms at worst; a super-linear extractor
    # (a catastrophic regex backtrack) on 100 kB costs CPU seconds however busy the machine is
    cpu = time.thread_time()
    extract_boxed(text), extract_answer_tag(text), parse_number(text)
    assert time.thread_time() - cpu < 1.0


def test_score_and_answer_key_never_raise(built):
    check_score_and_answer_key_never_raise(*built)


def test_adversarial_text_scores_fast_on_every_task(built):
    """Each adversarial text in one go, within a bound on this process's CPU time (see ADVERSARIAL_CPU_S)."""
    _, task, examples = built
    check_adversarial_text(task, examples)


# ----------------------------------------------------------------------------- a task that raises


class BoomTask(Task):
    """Every scoring call raises, as a verifier bug on some model text would."""

    def splits(self, n_train, n_heldout, n_demo, seed):
        exs = [Example(f"q{i}", str(i)) for i in range(4)]
        return {"train": exs[:2], "heldout": exs[2:], "demo": []}

    def score(self, response, ex):
        raise ValueError("verifier bug")

    def answer_key(self, response, ex):
        raise KeyError("no key")


class BoomManyTask(BoomTask):
    def score_many(self, responses, examples):
        raise RuntimeError("batch verifier bug")


@pytest.fixture()
def fresh_warnings(monkeypatch):
    """Warnings are throttled per process; each test starts with none given."""
    from esbatch.tasks import verify

    monkeypatch.setattr(verify, "_warned", {})


def test_an_exception_in_scoring_is_a_logged_wrong_in_eval(capsys, fresh_warnings):
    from esbatch.eval.runner import score_responses

    for task in (BoomTask(), BoomManyTask()):
        verdicts, keys = score_responses(task, ["a"] * 20, [Example("q", "1")] * 20, workers=2)
        assert verdicts == ["wrong"] * 20 and keys == [None] * 20
    lines = capsys.readouterr().err.splitlines()
    assert "BoomTask.score: raised ValueError" in lines[0] and "verifier bug" in lines[0]
    assert any("BoomManyTask.score_many: raised RuntimeError" in line for line in lines)
    per_source = Counter(line.split(": ")[1] for line in lines)  # a few per (task method, error), not per response
    assert (
        set(per_source)
        == {f"{t}.{m}" for t in ("BoomTask", "BoomManyTask") for m in ("score", "answer_key")}
        | {"BoomManyTask.score_many"}
        and max(per_source.values()) == 3
    ), lines


def test_an_exception_in_scoring_is_a_logged_wrong_in_training(monkeypatch, capsys, fresh_warnings):
    """load_problems guards task.score, which the ES and GRPO trainers call; reward_of takes any verdict."""
    from types import SimpleNamespace as NS

    from esbatch.backends.base import Generation
    from esbatch.train import problems

    monkeypatch.setattr(problems.TASKS, "get", lambda name: BoomTask)
    gen = NS(chat_prompt=lambda msgs: msgs[-1]["content"], generate=lambda p, s, seed: [Generation("x", 1) for _ in p])
    cfg = NS(
        task=NS(name="boom", data_path=None, params={}, train_size=2, heldout_size=2, few_shot=0, system_prompt=None),
        run=NS(seed=0), reward=NS(correct=1.0, format=0.1, missing=0.0),
        eval=NS(max_new_tokens=4), generation=NS(max_new_tokens=4),
    )  # fmt: skip
    probs = problems.load_problems(cfg, gen)
    assert [problems.reward_of(probs.task.score("x", ex), cfg) for ex in probs.train] == [0.1, 0.1]
    assert problems.evaluate_heldout(cfg, gen, probs)["heldout/accuracy"] == 0.0
    assert problems.reward_of(None, cfg) == 0.1 and problems.reward_of("correct", cfg) == 1.0
    err = capsys.readouterr().err
    assert "BoomTask.score: raised ValueError" in err and "reward_of" in err
