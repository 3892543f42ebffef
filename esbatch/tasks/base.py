"""The task interface: where problems come from, how they are prompted, and how a response is scored."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

from esbatch.registry import did_you_mean
from esbatch.tasks.verify import Verdict

# Appendix G.5 system prompts, by task family.
SYSTEM_PROMPTS = {
    "math": "Please reason step by step, and put your final answer within \\boxed{}.",
    "multiple_choice": (
        "Please reason step by step to solve the following multiple-choice question. "
        "Put your final choice letter inside \\boxed{}, e.g., \\boxed{C}."
    ),
    "open_qa": (
        "Answer the question using the provided context. Keep the final answer short, "
        "and put it inside <answer> </answer> tags."
    ),
    "code": (
        "You are a Python programming assistant. Write clean, correct Python code that passes the given tests. "
        "The function name and signature must match exactly as specified in the test cases. The final code block "
        "must not include the tests; do not include the tests in your answer. Do not include explanations or text "
        "outside the code block. Output exactly one Python markdown code block containing only the final solution "
        "code."
    ),
    # ours, not G.5: the paper prints no SST-2 prompt (the App. E supervised control)
    "sentiment": "Classify the sentiment of the sentence. Answer with one word: positive or negative.",
    "countdown": (
        "Using the given numbers, each exactly once, and only + - * / and parentheses, write an "
        "expression equal to the target. Put the final expression inside <answer> </answer> tags."
    ),
}


class DataFileError(ValueError):
    """A task's local data file that cannot be read (torn, not of its type); the message names it and why."""


@dataclass
class Example:
    """One problem: the user-facing question, the gold answer, and whatever the verifier needs."""

    question: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task:
    """Base class. Subclasses set ``family`` and implement ``examples``, ``score`` and ``demo_response``.

    Constructor keyword arguments are the task's ``params`` in the config; ``check_params`` validates
    them against the signature before anything loads.
    """

    family: ClassVar[str] = "math"
    #: Problems ``eval_examples(None)`` draws from a task without a fixed test split (a generator has no
    #: "whole split"); tasks that read a dataset override ``eval_examples`` and return all of its rows.
    default_eval_size: ClassVar[int] = 500
    #: Problems of a dataset task's default hub splits as its dataset card counts them (training split; evaluation
    #: split, what ``eval_examples(None)`` returns), for `esbatch sweep --dry-run`'s cost plan, which downloads
    #: nothing; None: not known before the data is read.
    train_rows: ClassVar[int | None] = None
    eval_rows: ClassVar[int | None] = None

    #: False for a task that generates its problems and never reads ``data_path`` (validate refuses one).
    reads_data_path: ClassVar[bool] = True

    def __init__(self, data_path: str | None = None) -> None:
        self.data_path = data_path

    def tracking_tags(self) -> dict[str, str]:
        """Tags logged with every run or eval of this task (the code sandbox says how it confines programs)."""
        return {}

    # --- data ------------------------------------------------------------------------------
    def splits(self, n_train: int | None, n_heldout: int, n_demo: int, seed: int) -> dict[str, list[Example]]:
        """{"train", "heldout", "demo"} -> examples; no problem appears in two splits.

        ``n_train=None`` means the task's whole training split (procedural tasks: ``default_train_size``).
        """
        raise NotImplementedError

    # --- prompting -------------------------------------------------------------------------
    def user_message(self, ex: Example) -> str:
        return ex.question

    def demo_response(self, ex: Example) -> str:
        """A short worked answer in the required format, for few-shot demonstrations."""
        raise NotImplementedError

    def messages(self, ex: Example, demos: list[Example], system_prompt: str | None = None) -> list[dict[str, str]]:
        """Chat messages: G.5 system prompt, few-shot turns, then the question."""
        msgs = [{"role": "system", "content": system_prompt or SYSTEM_PROMPTS[self.family]}]
        for d in demos:
            msgs.append({"role": "user", "content": self.user_message(d)})
            msgs.append({"role": "assistant", "content": self.demo_response(d)})
        msgs.append({"role": "user", "content": self.user_message(ex)})
        return msgs

    # --- scoring ---------------------------------------------------------------------------
    def score(self, response: str, ex: Example) -> Verdict:
        raise NotImplementedError

    def answer_key(self, response: str, ex: Example) -> str | None:
        """The response's final answer in a canonical form, for Maj@K votes; None = no answer (abstain).

        Two responses vote together iff their keys are equal, so the key must be normalized the same way
        the verifier compares (e.g. numbers as reduced fractions, letters upper-case). A task without
        comparable answers keeps this default: every response abstains.
        """
        return None

    # --- evaluation ------------------------------------------------------------------------
    def eval_examples(self, limit: int | None, seed: int = 0) -> list[Example]:
        """The evaluation problems: a dataset task's whole test split (``limit``: its first ``limit``); a
        procedural task draws ``limit`` fresh problems, ``default_eval_size`` when ``limit`` is None."""
        return self.splits(0, limit or self.default_eval_size, 0, seed)["heldout"]

    # --- validation ------------------------------------------------------------------------
    @classmethod
    def param_spec(cls) -> dict[str, Any]:
        """name -> default for every accepted param."""
        sig = inspect.signature(cls.__init__)
        return {
            n: p.default
            for n, p in sig.parameters.items()
            if n not in ("self", "data_path") and p.kind == p.KEYWORD_ONLY
        }

    @classmethod
    def check_data_path(cls, data_path: str | None, path: str, errors: list[str]) -> None:
        """An error line for a ``data_path`` given to a task that never reads one (it would be ignored)."""
        if data_path is not None and not cls.reads_data_path:
            valid = ", ".join(cls.param_spec()) or "(none)"
            errors.append(
                f"{path}: {cls.__name__} generates its problems and never reads a data file, so {data_path!r} "
                f"would be ignored; remove it (or pick a task that reads one). Its params: {valid}"
            )

    @classmethod
    def check_params(cls, params: dict[str, Any], path: str, errors: list[str]) -> None:
        spec = cls.param_spec()
        for k, v in params.items():
            if k not in spec:
                valid = ", ".join(spec) or "(none)"
                errors.append(
                    f"{path}.{k}: unknown parameter of this task.{did_you_mean(k, list(spec))} Valid: {valid}"
                )
                continue
            d = spec[k]
            if d is not None and not _same_kind(v, d):
                errors.append(f"{path}.{k}: expected {type(d).__name__} like {d!r}, got {type(v).__name__} {v!r}")


def _same_kind(v: Any, d: Any) -> bool:
    if isinstance(d, bool):
        return isinstance(v, bool)
    if isinstance(d, int):
        return isinstance(v, int) and not isinstance(v, bool)
    if isinstance(d, float):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if isinstance(d, (list, tuple)):
        return isinstance(v, (list, tuple))
    return isinstance(v, type(d))


def split_local_rows(rows: list[Example], n_heldout: int, n_demo: int, source: Any) -> tuple[list, list, list]:
    """(train, heldout, demo) of one local file's rows: the last ``n_heldout`` are held out, the first ``n_demo``
    are demonstrations, the rest train; ``source`` names the file in the error when too few rows remain."""
    if len(rows) < n_heldout + n_demo + 1:
        raise ValueError(f"{source}: {len(rows)} rows, need more than heldout+demo = {n_heldout + n_demo}")
    heldout = rows[len(rows) - n_heldout :] if n_heldout else []
    return rows[n_demo : len(rows) - n_heldout], heldout, rows[:n_demo]


def disjoint_splits(make: Any, n_train: int, n_heldout: int, n_demo: int, seed: int) -> dict[str, list[Example]]:
    """Draw train/heldout/demo from a generator ``make(size, seed)`` with no question in two splits."""
    out: dict[str, list[Example]] = {}
    seen: set[str] = set()
    for i, (split, n) in enumerate((("heldout", n_heldout), ("demo", n_demo), ("train", n_train))):
        kept: list[Example] = []
        attempt = 0
        while len(kept) < n:
            # generators seed item k with (seed + k): retries jump far away from every range used so far
            for ex in make(2 * (n - len(kept)) + 8, seed * 1000 + i * 97 + attempt * 1_000_003):
                if ex.question not in seen and len(kept) < n:
                    seen.add(ex.question)
                    kept.append(ex)
            attempt += 1
            if attempt > 50:
                raise ValueError(f"could not draw {n} distinct {split} problems: the generator's space is too small")
        out[split] = kept
    return out
