"""Every registered task's ``score`` and ``answer_key`` on random and adversarial text: a Verdict / a str or
None, never an exception, and never super-linear time (a policy optimised against the verifier will find
whatever input makes it raise or hang). Tasks are built from the local fixtures, as test_tasks.py and
test_eval_tasks.py build them, so nothing touches the network.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from esbatch.tasks import TASKS, Example, Task, Verdict
from esbatch.tasks.verify import extract_answer_tag, extract_boxed, parse_number

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def _fixture(name: str) -> str:
    return str(FIX / f"{name}_tiny.jsonl")


BUILD = {  # registered name -> (task, a few of its examples)
    "gsm8k": lambda t: (t := t(_fixture("gsm8k")), t.splits(None, 1, 0, seed=0)["train"][:2]),
    "arithmetic": lambda t: (t := t(), t.splits(2, 0, 0, seed=0)["train"]),
    "chain_sum": lambda t: (t := t(), t.splits(2, 0, 0, seed=0)["train"]),
    "countdown": lambda t: (t := t(_fixture("countdown")), t.eval_examples(2)),
    "countdown-gold": lambda t: (t := t(_fixture("countdown_gold")), t.eval_examples(2)),
    "math500": lambda t: (t := t(_fixture("math500"), timeout_s=1.0), t.eval_examples(2)),
    "aime2024": lambda t: (t := t(_fixture("aime"), timeout_s=1.0), t.eval_examples(2)),
    "aime2025": lambda t: (t := t(_fixture("aime"), timeout_s=1.0), t.eval_examples(2)),
    "amc2023": lambda t: (t := t(_fixture("amc"), timeout_s=1.0), t.eval_examples(2)),
    "deepscaler": lambda t: (t := t(_fixture("deepscaler"), timeout_s=1.0), t.splits(2, 1, 0, seed=0)["train"]),
    "gpqa": lambda t: (t := t(_fixture("gpqa")), t.eval_examples(2)),
    "commonsenseqa": lambda t: (t := t(_fixture("csqa")), t.eval_examples(2)),
    "hotpotqa": lambda t: (t := t(_fixture("hotpotqa")), t.eval_examples(2)),
    "mbpp": lambda t: (t := t(_fixture("mbpp"), timeout_s=1.0), t.eval_examples(2)),
    "sst2": lambda t: (t := t(_fixture("sst2")), t.eval_examples(2)),
}
#: random examples per task: fewer where a check leaves the process (the MBPP sandbox, the math-verify worker)
#: (the math tasks share one scorer, _MathScoring: MATH-500 gets the most)
EXAMPLES = {"mbpp": 15, "math500": 40, "aime2024": 15, "aime2025": 15, "amc2023": 15, "deepscaler": 15}

BIG = 100_000
ADVERSARIAL = [
    "\\boxed{" + "1" * 5000 + "}",
    "\\boxed{" + "9" * BIG + "}",
    "\\boxed{-" + "1" * 4301 + "/7}",
    "\\boxed{\\frac{" + "1" * 5000 + "}{" + "3" * 5000 + "}}",
    "\\boxed{1/" + "0" * 5000 + "}",
    "\\boxed{" + "1," * 3000 + "000}",
    "\\boxed{" + "{" * (BIG // 2) + "}" * (BIG // 2) + "}",
    "\\boxed{" + "{" * BIG,
    "\\boxed{" * (BIG // 7),
    "\\boxed " * (BIG // 7) + "{1}",
    "\\boxed{1" + ".a" * (BIG // 2) + "!}",
    "\\boxed{" + "\\text{" * (BIG // 6) + "}",
    "\\boxed{" + "\\frac{" * 5000 + "}" * 5000,
    "\x00" * 1000 + "\\boxed{\x00}",
    "\\boxed{\ud800\udfff}",
    "<answer>" * (BIG // 8),
    "<answer>" + "(" * BIG + "</answer>",
    "<answer>" + "1*" * 99 + "1</answer>",
    "<answer>" + "9" * 5000 + "</answer>",
    "```python\n" * (BIG // 10),
    "```python\n" + "(" * BIG + "\n```",
    "```python\ndef f(:\n```",
    "```\n" + "x = 1\n" * (BIG // 6) + "```",
    "\\boxed{\\text{(A)}}\\boxed{" + "A" * BIG + "}",
    "é" * BIG,
    "x" * BIG,
]
#: answers that keep sympy busy past any timeout: math-verify's worker is killed and they count as WRONG
SYMPY_BOMBS = ["\\boxed{\\sqrt{" + "x^{" * 300 + "2" + "}" * 301 + "}", "\\boxed{9^{9^{9^{9}}}}"]
FRAGMENTS = ["\\boxed", "{", "}", "\\boxed{", "\\frac{1}{", "<answer>", "</answer>", "```python\n", "```", "\n",
             "1", "-", "/", ".", ",", "0" * 50, "9" * 4400, "\x00", "é", "\ud800", "A", "(C)", "\\text{", "$",
             "%", "=", " ", "x", "yes", "def f(x):\n    return x\n", "\\sqrt", "^", "pi"]  # fmt: skip

TEXT = st.one_of(
    st.text(max_size=300),
    st.text(st.characters(exclude_categories=()), max_size=100),  # surrogates too
    st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join),
    st.sampled_from(ADVERSARIAL),
)


@pytest.fixture(scope="module", params=sorted(BUILD))
def built(request):
    name = request.param
    return name, *BUILD[name](TASKS.get(name))


def test_every_registered_task_is_fuzzed():
    assert set(TASKS.names()) == set(BUILD)


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_text_is_fast_in_the_extractors(text):
    t = time.perf_counter()
    extract_boxed(text), extract_answer_tag(text), parse_number(text)
    assert time.perf_counter() - t < 1.0


def test_score_and_answer_key_never_raise(built):
    name, task, examples = built
    assert examples

    @settings(max_examples=EXAMPLES.get(name, 200), deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(text=TEXT, k=st.integers(0, len(examples) - 1))
    def check(text, k):
        ex = examples[k]
        assert isinstance(task.score(text, ex), Verdict)
        key = task.answer_key(text, ex)
        assert key is None or isinstance(key, str)

    check()


def test_sympy_bombs_time_out_as_wrong():
    task, examples = BUILD["math500"](TASKS.get("math500"))
    t = time.perf_counter()
    for text in SYMPY_BOMBS:  # (each timeout also costs a worker restart)
        assert task.score(text, examples[0]) is Verdict.WRONG
    assert isinstance(task.answer_key(SYMPY_BOMBS[1], examples[0]), str)
    assert time.perf_counter() - t < 30


def test_adversarial_text_scores_fast_on_every_task(built):
    """Each adversarial text in one go; a pathological one would time out the whole sandbox/worker call."""
    name, task, examples = built
    t = time.perf_counter()
    for text in ADVERSARIAL:
        assert isinstance(task.score(text, examples[0]), Verdict)
        key = task.answer_key(text, examples[0])
        assert key is None or isinstance(key, str)
    assert time.perf_counter() - t < 30


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
