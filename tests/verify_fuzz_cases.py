"""What the verifier fuzz tests share: every registered task built from the local fixtures (as test_tasks.py and
test_eval_tasks.py build them, so nothing touches the network), random and adversarial text, and the checks run
on each task.

Tasks whose checks stay in this process are fuzzed in tests/unit/test_verify_fuzz.py. Those whose checks leave
it (MBPP: the sandbox; the math tasks: math-verify's workers, where a check that runs over its limit kills the
worker, so the next one starts a process) are fuzzed in tests/integration/test_verify_fuzz_workers.py.
"""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from esbatch.tasks import TASKS, Verdict

FIX = Path(__file__).resolve().parent / "fixtures"


def _fixture(name: str) -> str:
    return str(FIX / f"{name}_tiny.jsonl")


BUILD = {  # registered name -> (task, a few of its examples), given the time limit of one check (s)
    "gsm8k": lambda t, s: (t := t(_fixture("gsm8k")), t.splits(None, 1, 0, seed=0)["train"][:2]),
    "arithmetic": lambda t, s: (t := t(), t.splits(2, 0, 0, seed=0)["train"]),
    "chain_sum": lambda t, s: (t := t(), t.splits(2, 0, 0, seed=0)["train"]),
    "countdown": lambda t, s: (t := t(_fixture("countdown")), t.eval_examples(2)),
    "countdown-gold": lambda t, s: (t := t(_fixture("countdown_gold")), t.eval_examples(2)),
    "math500": lambda t, s: (t := t(_fixture("math500"), timeout_s=s), t.eval_examples(2)),
    "aime2024": lambda t, s: (t := t(_fixture("aime"), timeout_s=s), t.eval_examples(2)),
    "aime2025": lambda t, s: (t := t(_fixture("aime"), timeout_s=s), t.eval_examples(2)),
    "amc2023": lambda t, s: (t := t(_fixture("amc"), timeout_s=s), t.eval_examples(2)),
    "deepscaler": lambda t, s: (t := t(_fixture("deepscaler"), timeout_s=s), t.splits(2, 1, 0, seed=0)["train"]),
    "gpqa": lambda t, s: (t := t(_fixture("gpqa")), t.eval_examples(2)),
    "commonsenseqa": lambda t, s: (t := t(_fixture("csqa")), t.eval_examples(2)),
    "hotpotqa": lambda t, s: (t := t(_fixture("hotpotqa")), t.eval_examples(2)),
    "mbpp": lambda t, s: (t := t(_fixture("mbpp"), timeout_s=s), t.eval_examples(2)),
    "sst2": lambda t, s: (t := t(_fixture("sst2")), t.eval_examples(2)),
}
#: the tasks whose checks leave this process: MBPP (the sandbox) and the math tasks (math-verify's workers)
MATH = ("math500", "aime2024", "aime2025", "amc2023", "deepscaler")
OUT_OF_PROCESS = ("mbpp", *MATH)
IN_PROCESS = tuple(sorted(set(BUILD) - set(OUT_OF_PROCESS)))
#: the time limit of one check in the random fuzz: short, so a random sympy bomb costs a second
FUZZ_TIMEOUT_S = 1.0
#: random examples per task: fewer where a check leaves the process (the MBPP sandbox, the math-verify worker)
#: (the math tasks share one scorer, _MathScoring: MATH-500 gets the most)
EXAMPLES = {"mbpp": 15, "math500": 40, "aime2024": 15, "aime2025": 15, "amc2023": 15, "deepscaler": 15}
#: CPU seconds of this process for all the adversarial text on one task: a safety bound (it takes ~0.2 s), far
#: below what a super-linear extractor costs on 100 kB (a catastrophic regex backtrack costs CPU minutes). CPU time,
#: not wall time: it does not grow when the machine is busy with other work.
ADVERSARIAL_CPU_S = 10.0


def build(name: str, timeout_s: float = FUZZ_TIMEOUT_S) -> tuple:
    """(task, a few of its examples) for a registered task name."""
    return BUILD[name](TASKS.get(name), timeout_s)


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


TEXT = st.one_of(
    st.text(max_size=300),
    st.text(st.characters(exclude_categories=()), max_size=100),  # surrogates too
    st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join),
    st.sampled_from(ADVERSARIAL),
)


def check_score_and_answer_key_never_raise(name: str, task, examples: list) -> None:
    """Random and adversarial text: ``score`` gives a Verdict and ``answer_key`` a str or None, never an exception."""
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


def check_adversarial_text(task, examples: list) -> None:
    """Each adversarial text in one go: a Verdict and a key each, within ADVERSARIAL_CPU_S of this process's CPU
    (work done in a worker or the sandbox is the caller's to check: see test_verify_fuzz_workers.py)."""
    cpu = time.process_time()
    for text in ADVERSARIAL:
        assert isinstance(task.score(text, examples[0]), Verdict)
        key = task.answer_key(text, examples[0])
        assert key is None or isinstance(key, str)
    assert time.process_time() - cpu < ADVERSARIAL_CPU_S
