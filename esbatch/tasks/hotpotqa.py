"""HotpotQA (Yang et al., 2018), distractor setting: an open-QA held-out task of the Easy Setting (App. G.6).

The user message gives the ten context paragraphs (two gold, eight distractors) and the question; the G.5
prompt asks for a short answer inside ``<answer> </answer>`` tags. Scoring uses the official
``hotpot_evaluate_v1.py`` answer normalization (lower-case, drop punctuation, drop the articles a/an/the,
collapse whitespace): exact match is CORRECT; :func:`hotpot_f1` gives the official token F1 for reporting.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from esbatch.tasks.base import Example
from esbatch.tasks.math_tasks import BenchmarkTask, field
from esbatch.tasks.verify import Verdict, extract_answer_tag

_PUNCT = set(string.punctuation)


def hotpot_normalize(s: str) -> str:
    """The SQuAD/HotpotQA answer normalization: lower, strip punctuation, articles and extra whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def hotpot_em(pred: str, gold: str) -> float:
    """1.0 iff the normalized strings are equal."""
    return float(hotpot_normalize(pred) == hotpot_normalize(gold))


def hotpot_f1(pred: str, gold: str) -> float:
    """Official token-level F1. yes/no/noanswer answers score 0 unless matched exactly (after normalization)."""
    p, g = hotpot_normalize(pred), hotpot_normalize(gold)
    if (p in ("yes", "no", "noanswer") or g in ("yes", "no", "noanswer")) and p != g:
        return 0.0
    pt, gt = p.split(), g.split()
    same = sum((Counter(pt) & Counter(gt)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pt), same / len(gt)
    return 2 * precision * recall / (precision + recall)


def check_hotpot(response: str, gold: str) -> Verdict:
    """MISSING without ``<answer>...</answer>``; with several, the last one counts (answers are often restated
    after a draft); CORRECT iff it matches ``gold`` exactly after normalization."""
    pred = extract_answer_tag(response)
    if pred is None:
        return Verdict.MISSING
    return Verdict.CORRECT if hotpot_em(pred, gold) else Verdict.WRONG


class HotpotQATask(BenchmarkTask):
    """HotpotQA distractor, validation split (7,405 questions; the test split has no answers). Demos: train."""

    family = "open_qa"
    title = "HotpotQA"
    eval_rows = 7405  # distractor, validation
    demo_split = "train"

    def __init__(
        self,
        data_path: str | None = None,
        *,
        hub_id: str = "hotpotqa/hotpot_qa",
        hub_config: str = "distractor",
        split: str = "validation",
        revision: str | None = None,
        demo_path: str | None = None,
    ) -> None:
        super().__init__(
            data_path, hub_id=hub_id, split=split, hub_config=hub_config, revision=revision, demo_path=demo_path
        )

    def _convert(self, row: dict[str, Any]) -> Example:
        question = str(field(row, "question", what=self.title)).strip()
        answer = str(field(row, "answer", what=self.title)).strip()
        ctx = field(row, "context", what=self.title)
        paragraphs = [(str(t), "".join(s).strip()) for t, s in zip(ctx["title"], ctx["sentences"])]
        meta: dict[str, Any] = {"context": paragraphs}
        for k in ("id", "type", "level"):
            if row.get(k):
                meta[k] = row[k]
        return Example(question=question, answer=answer, meta=meta)

    def user_message(self, ex: Example) -> str:
        paras = "\n\n".join(f"{title}: {text}" for title, text in ex.meta["context"])
        return f"Context:\n{paras}\n\nQuestion: {ex.question}"

    def demo_response(self, ex: Example) -> str:
        return f"<answer>{ex.answer}</answer>"

    def score(self, response: str, ex: Example) -> Verdict:
        return check_hotpot(response, ex.answer)

    def answer_key(self, response: str, ex: Example) -> str | None:
        """The normalized answer; None without an answer tag or when it normalizes to nothing."""
        pred = extract_answer_tag(response)
        return (hotpot_normalize(pred) or None) if pred is not None else None

    def f1(self, response: str, ex: Example) -> float:
        """Official token F1 of the response's last answer tag (0.0 without one)."""
        pred = extract_answer_tag(response)
        return 0.0 if pred is None else hotpot_f1(pred, ex.answer)
