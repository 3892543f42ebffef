r"""Multiple-choice held-out tasks of the Easy Setting (App. G.6): GPQA-Diamond and CommonsenseQA.

The G.5 prompt asks for the choice letter inside ``\boxed{}``. Models box it in many ways, so the last box's
content is mapped to a letter by :func:`choice_letter` (see there for what is accepted), then compared with
the gold letter. ``Example.answer`` and ``Example.meta["gold_letter"]`` hold the gold letter;
``meta["options"]`` maps letters to option texts, and the user message lists the options as ``A. text``.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from esbatch.tasks.base import Example
from esbatch.tasks.math_tasks import BenchmarkTask, field
from esbatch.tasks.verify import Verdict, extract_boxed

_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|textit|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_PREFIX = re.compile(r"^(?:the\s+)?(?:final\s+|correct\s+)?(?:answer|option|choice)\s*(?:is\s*)?[:\-]?\s*", re.I)
_LETTER_ONLY = re.compile(r"\(?([A-Za-z])\)?[.:)]?")
_LETTER_THEN_TEXT = re.compile(r"(?:\(([A-Za-z])\)|([A-Za-z])[.:)])\s*(.+)", re.S)


def _norm_text(s: str) -> str:
    s = _WRAPPER.sub(r"\1", s).replace("$", "")
    return " ".join(s.lower().split()).rstrip(".").strip()


def choice_letter(boxed: str, options: dict[str, str]) -> str | None:
    r"""The option letter a ``\boxed{}`` content names, or None.

    Accepted: ``C``, ``c``, ``(C)``, ``C)``, ``C.``, ``C:``, ``\text{C}`` / ``\textbf{(C)}``, ``$C$``, a prefix like
    ``Answer: C`` / ``Option C``; ``C. option text`` / ``(C) option text`` (the letter decides, even if the text
    belongs to another option); or the exact text of one option (case, whitespace, ``$`` and a final period
    ignored) -> its letter. Letters that are not among ``options`` give None.
    """
    s = boxed
    for _ in range(3):  # nested wrappers: \textbf{\text{C}}
        s = _WRAPPER.sub(r"\1", s)
    s = _PREFIX.sub("", s.replace("$", "").strip()).strip()
    if m := _LETTER_ONLY.fullmatch(s):
        return m.group(1).upper() if m.group(1).upper() in options else None
    want = _norm_text(boxed)
    for letter, text in options.items():  # before "C. text", so an option like "C. elegans" maps to its own letter
        if want and want == _norm_text(text):
            return letter
    if m := _LETTER_THEN_TEXT.fullmatch(s):
        letter = (m.group(1) or m.group(2)).upper()
        return letter if letter in options else None
    return None


def check_choice(response: str, options: dict[str, str], gold_letter: str) -> Verdict:
    r"""MISSING without ``\boxed{}``; CORRECT iff the last box names ``gold_letter``; else WRONG."""
    boxed = extract_boxed(response)
    if boxed is None:
        return Verdict.MISSING
    return Verdict.CORRECT if choice_letter(boxed, options) == gold_letter else Verdict.WRONG


def format_choices(stem: str, options: dict[str, str]) -> str:
    return stem.strip() + "\n\n" + "\n".join(f"{k}. {v}" for k, v in options.items())


class _ChoiceTask(BenchmarkTask):
    family = "multiple_choice"

    def demo_response(self, ex: Example) -> str:
        letter = ex.meta["gold_letter"]
        return f"The correct option is {letter}: {ex.meta['options'][letter]}. The answer is \\boxed{{{letter}}}."

    def score(self, response: str, ex: Example) -> Verdict:
        return check_choice(response, ex.meta["options"], ex.meta["gold_letter"])

    def answer_key(self, response: str, ex: Example) -> str | None:
        """The upper-case letter the response chose; None without a box or when the box names no option."""
        boxed = extract_boxed(response)
        return None if boxed is None else choice_letter(boxed, ex.meta["options"])


class GPQATask(_ChoiceTask):
    """GPQA-Diamond (Rein et al., 2023): 198 graduate-level science questions, 4 options.

    The dataset stores the correct answer first ("Correct Answer", "Incorrect Answer 1..3"), so the options are
    shuffled per question with a seed derived from ``shuffle_seed`` and the question text (sha256, not Python's
    salted ``hash``): the same letters on every run and machine, with the correct letter spread over A-D.
    The hub dataset is gated (accept its terms and log in with ``huggingface-cli login``) and has one split,
    ``train``, which is the whole benchmark; there is no demo pool.
    """

    title = "GPQA"
    eval_rows = 198  # GPQA-Diamond

    def __init__(
        self,
        data_path: str | None = None,
        *,
        hub_id: str = "Idavidrein/gpqa",
        hub_config: str = "gpqa_diamond",
        split: str = "train",
        revision: str | None = None,
        demo_path: str | None = None,
        shuffle_seed: int = 0,
    ) -> None:
        super().__init__(
            data_path, hub_id=hub_id, split=split, hub_config=hub_config, revision=revision, demo_path=demo_path
        )
        self.shuffle_seed = shuffle_seed

    def _convert(self, row: dict[str, Any]) -> Example:
        stem = str(field(row, "Question", what=self.title)).strip()
        correct = str(field(row, "Correct Answer", what=self.title)).strip()
        texts = [correct] + [str(field(row, f"Incorrect Answer {i}", what=self.title)).strip() for i in (1, 2, 3)]
        digest = hashlib.sha256(f"{self.shuffle_seed}\n{stem}".encode()).digest()
        random.Random(int.from_bytes(digest[:8], "big")).shuffle(texts)
        options = dict(zip("ABCD", texts))
        gold = "ABCD"[texts.index(correct)]
        meta = {"options": options, "gold_letter": gold, "stem": stem}
        if row.get("Record ID"):
            meta["id"] = row["Record ID"]
        return Example(question=format_choices(stem, options), answer=gold, meta=meta)


class CommonsenseQATask(_ChoiceTask):
    """CommonsenseQA (Talmor et al., 2019): 5-option commonsense questions; the validation split (1,221
    questions) is the evaluation set because the test split has no public answers. Demos: the train split."""

    title = "CommonsenseQA"
    eval_rows = 1221  # the validation split
    demo_split = "train"

    def __init__(
        self,
        data_path: str | None = None,
        *,
        hub_id: str = "tau/commonsense_qa",
        split: str = "validation",
        revision: str | None = None,
        demo_path: str | None = None,
    ) -> None:
        super().__init__(data_path, hub_id=hub_id, split=split, revision=revision, demo_path=demo_path)

    def _convert(self, row: dict[str, Any]) -> Example:
        stem = str(field(row, "question", what=self.title)).strip()
        choices = field(row, "choices", what=self.title)
        options = {str(k).strip().upper(): str(v).strip() for k, v in zip(choices["label"], choices["text"])}
        gold = str(row.get("answerKey") or "").strip().upper()
        if gold not in options:
            raise ValueError(
                f"{self.title}: answerKey {gold!r} is not one of {sorted(options)} "
                "(the test split has no answers; evaluate on validation)"
            )
        meta = {"options": options, "gold_letter": gold, "stem": stem}
        if row.get("id"):
            meta["id"] = row["id"]
        return Example(question=format_choices(stem, options), answer=gold, meta=meta)
