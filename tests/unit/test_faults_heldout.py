"""Held-out scoring (esbatch/train/problems.py:evaluate_heldout) with a generator double that returns known texts
and the toy digit task, whose verdict of each text is known by hand."""

import pytest
from toy import DigitTask

from esbatch.backends.base import Generation, Generator
from esbatch.config import config_from_dict
from esbatch.tasks.base import Example
from esbatch.train.problems import HELDOUT_CORRECT, Problems, evaluate_heldout


class CannedGenerator(Generator):
    """Answers prompt i with texts[i]; records the sampling parameters and seed it was called with."""

    def __init__(self, texts):
        self.texts, self.calls = texts, []

    def chat_prompt(self, messages):
        return messages[-1]["content"]

    def generate(self, prompts, sampling, seed):
        self.calls.append((list(prompts), sampling, seed))
        return [Generation(self.texts[p], 2) for p in prompts]


def _cfg(**reward):
    return config_from_dict(
        {
            "model": {"name": "nobody/no-model"},
            "task": {"name": "toy:DigitTask"},
            "generation": {"temperature": 1.0, "max_new_tokens": 6},
            "eval": {"max_new_tokens": 9},
            "es": {"updates": 1},
            **({"reward": reward} if reward else {}),
        }
    )


# gold digit, response, verdict by hand (DigitTask: gold digit present -> correct; another digit -> wrong;
# no digit -> missing)
CASES = [
    ("3", "it is 3", "correct"),
    ("4", "7", "wrong"),
    ("5", "five", "missing"),
    ("6", "6 or 2", "correct"),
    ("7", "1 2", "wrong"),
    ("8", "", "missing"),
    ("9", "9", "correct"),
    ("0", "8", "wrong"),
]


def _problems():
    heldout = [Example(f"q{i}", gold) for i, (gold, _, _) in enumerate(CASES)]
    prompts = [f"prompt {i}" for i in range(len(CASES))]
    return Problems(DigitTask(), [], heldout, [], prompts), {p: r for p, (_, r, _) in zip(prompts, CASES)}


def test_the_canned_verdicts_are_what_the_table_says():
    task = DigitTask()
    assert [str(task.score(r, Example("q", g))) for g, r, _ in CASES] == [v for _, _, v in CASES]


def test_heldout_accuracy_counts_only_correct_answers():
    probs, texts = _problems()
    gen = CannedGenerator(texts)
    out = evaluate_heldout(_cfg(), gen, probs)
    # 3 correct, 3 wrong, 2 missing of 8; reward 1 / 0.1 / 0 (paper App. G.1 defaults)
    assert out["heldout/accuracy"] == pytest.approx(3 / 8)
    assert out["heldout/reward"] == pytest.approx((3 * 1.0 + 3 * 0.1 + 2 * 0.0) / 8)
    assert out["heldout/format_rate"] == pytest.approx(6 / 8)
    # the per-problem verdicts, in the held-out order (what pairs two evaluations problem by problem)
    assert out[HELDOUT_CORRECT] == "".join("1" if v == "correct" else "0" for _, _, v in CASES) == "10010010"
    # greedy, at the eval token limit, every held-out prompt once
    ((prompts, sampling, _seed),) = gen.calls
    assert prompts == probs.heldout_prompts
    assert sampling.temperature == 0.0 and sampling.max_new_tokens == 9


def test_heldout_reward_uses_the_configured_reward_values():
    probs, texts = _problems()
    out = evaluate_heldout(_cfg(correct=2.0, format=-0.5, missing=-1.0), CannedGenerator(texts), probs)
    assert out["heldout/reward"] == pytest.approx((3 * 2.0 + 3 * -0.5 + 2 * -1.0) / 8)
    assert out["heldout/accuracy"] == pytest.approx(3 / 8)


def test_all_wrong_answers_score_zero_accuracy():
    probs, _ = _problems()
    texts = {
        p: "x" if i % 2 else str((int(ex.answer) + 1) % 10)
        for i, (p, ex) in enumerate(zip(probs.heldout_prompts, probs.heldout))
    }
    out = evaluate_heldout(_cfg(), CannedGenerator(texts), probs)
    assert out["heldout/accuracy"] == 0.0
    assert out["heldout/format_rate"] == pytest.approx(4 / 8)
