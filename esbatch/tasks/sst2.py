"""SST-2 (Socher et al., 2013; GLUE): binary sentence sentiment, the supervised control of Appendix E.

The paper uses SST-2 as the fixed-data objective of its local subtraction diagnostic (App. E.3, "SST-2
supervised CE"): the cross-entropy of the gold label word given the prompt, evaluated on the same fixed batch
at the positive, center and negative parameter points. :meth:`SST2Task.target` gives that label word (the
tokens the CE scores); :meth:`SST2Task.score` makes the task usable for generation too (exact label match).

Hub ``stanfordnlp/sst2``: columns ``idx``, ``sentence``, ``label`` (0 = negative, 1 = positive); splits
``train`` (67,349), ``validation`` (872) and ``test`` (1,821, labels hidden as -1, so unusable here). A local
``data_path`` (jsonl/json/parquet/csv with ``sentence`` and ``label``) replaces the hub. The paper does not
print its SST-2 prompt; the one here (a one-word answer, positive or negative) is ours.
"""

from __future__ import annotations

import string
from typing import Any

from esbatch.tasks.base import Example, Task, split_local_rows
from esbatch.tasks.gsm8k import load_rows
from esbatch.tasks.verify import Verdict

HUB_ID = "stanfordnlp/sst2"
#: label id -> the word the model should answer (and the CE target)
LABEL_WORDS = ("negative", "positive")


def sst2_example(row: dict[str, Any], source: str) -> Example:
    """One row -> Example(question=sentence, answer=label word); a clear error for rows outside the schema."""
    for key in ("sentence", "label"):
        if key not in row or row[key] is None:
            raise ValueError(
                f"{source}: SST-2 row lacks the '{key}' field (has: {', '.join(row)}); expected columns sentence, label"
            )
    label = row["label"]
    if isinstance(label, str) and label.strip().lower() in LABEL_WORDS:
        label = LABEL_WORDS.index(label.strip().lower())
    if isinstance(label, bool) or not isinstance(label, int) or label not in (0, 1):
        raise ValueError(
            f"{source}: SST-2 label {label!r} is not 0 (negative) or 1 (positive); the hub's test split hides its "
            "labels as -1, use train or validation"
        )
    return Example(question=str(row["sentence"]).strip(), answer=LABEL_WORDS[label], meta={"label": label})


def label_word(response: str) -> str | None:
    """The response's answer as a label word: the whole response, lower-cased, without surrounding whitespace,
    punctuation or quotes; None when that is not exactly one of the label words."""
    word = response.strip().strip(string.punctuation + string.whitespace).lower()
    return word if word in LABEL_WORDS else None


class SST2Task(Task):
    """SST-2 sentiment: answer ``positive`` or ``negative``; scored by exact label match."""

    family = "sentiment"
    train_rows, eval_rows = 67349, 872  # stanfordnlp/sst2: train, validation

    def __init__(
        self,
        data_path: str | None = None,
        *,
        hub_id: str = HUB_ID,
        train_split: str = "train",
        heldout_split: str = "validation",
        revision: str | None = None,
    ) -> None:
        super().__init__(data_path)
        self.hub_id, self.revision = hub_id, revision
        self.train_split, self.heldout_split = train_split, heldout_split

    def _rows(self, split: str) -> list[Example]:
        source = self.data_path or self.hub_id
        raw = load_rows(
            source, "train" if self.data_path else split, revision=None if self.data_path else self.revision
        )
        if not raw:
            raise ValueError(f"SST-2: {source} ({split}) has no rows")
        return [sst2_example(r, source) for r in raw]

    def splits(self, n_train: int | None, n_heldout: int, n_demo: int, seed: int) -> dict[str, list[Example]]:
        if self.data_path:  # one local file: the last n_heldout rows are held out, the first n_demo are demos
            rows = self._rows("train")
            train, heldout, demo = split_local_rows(rows, n_heldout, n_demo, self.data_path)
        else:
            train_rows = self._rows(self.train_split)
            heldout = self._rows(self.heldout_split)[:n_heldout] if n_heldout else []
            demo, train = train_rows[:n_demo], train_rows[n_demo:]
        return {"train": train[:n_train] if n_train else train, "heldout": heldout, "demo": demo}

    def eval_examples(self, limit: int | None, seed: int = 0) -> list[Example]:
        """The validation split (a local file: all its rows), all of it or its first ``limit`` rows."""
        rows = self._rows(self.heldout_split)
        return rows[:limit] if limit else rows

    # --- prompting -------------------------------------------------------------------------
    def user_message(self, ex: Example) -> str:
        return f"Sentence: {ex.question}\nIs the sentiment of this sentence positive or negative?"

    def demo_response(self, ex: Example) -> str:
        return ex.answer

    def target(self, ex: Example) -> str:
        """The assistant reply the supervised CE scores: the gold label word (App. E.3, SST-2 supervised CE)."""
        return ex.answer

    # --- scoring ---------------------------------------------------------------------------
    def score(self, response: str, ex: Example) -> Verdict:
        got = label_word(response)
        if got is None:
            return Verdict.MISSING
        return Verdict.CORRECT if got == ex.answer else Verdict.WRONG

    def answer_key(self, response: str, ex: Example) -> str | None:
        return label_word(response)
