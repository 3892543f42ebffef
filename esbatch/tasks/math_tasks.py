r"""Competition-math tasks of the Hard Setting (App. G.6): MATH-500, AIME 2024/2025, AMC 2023, DeepScaleR.

Answers are free-form LaTeX, so scoring goes through math-verify (:mod:`esbatch.tasks.verify_math`), not the
exact-number check GSM8K uses. Hub ids follow the paper: "the math-ai AIME and AMC releases" and MATH-500
(HuggingFaceH4/MATH-500, the Lightman et al. 500-problem subset); DeepScaleR (Luo et al., 2025) is the
Hard-Setting training set.

:class:`BenchmarkTask` is the shared shape of an *evaluation-only* benchmark (also used by
:mod:`esbatch.tasks.choice` and :mod:`esbatch.tasks.hotpotqa`):

* ``eval_examples(limit, seed)``: every row in dataset order, or, with ``limit`` below the row count, the
  rows at the first ``limit`` positions of a ``random.Random(seed)`` permutation, returned in dataset order
  (a random subset that is the same on every call with the same seed).
* ``splits``: ``heldout`` is ``eval_examples(n_heldout, seed)`` (``n_heldout=0`` -> none); there is no
  training split (asking for ``n_train > 0`` raises: training on a test set is contamination); demos come
  only from a separate pool (``demo_split`` of the hub dataset, or ``demo_path``), never from the evaluated
  rows; benchmarks without such a pool raise when ``n_demo > 0`` (the G.5 prompts are zero-shot).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from esbatch.tasks.base import Example, Task
from esbatch.tasks.gsm8k import load_rows
from esbatch.tasks.verify import Verdict, extract_boxed
from esbatch.tasks.verify_math import check_boxed_math, math_answer_key

#: Rows read from the hub's demo split (a slice, so e.g. HotpotQA's 90k-row train split is not materialized).
DEMO_POOL_ROWS = 1000


def field(row: dict[str, Any], *names: str, what: str) -> Any:
    """The first of ``names`` present in ``row``; a clear error naming the row's fields otherwise."""
    for n in names:
        if n in row and row[n] is not None:
            return row[n]
    raise ValueError(f"{what}: row has none of the fields {', '.join(names)} (has: {', '.join(row)})")


def answer_text(value: Any) -> str:
    """Dataset answers as strings: ``27.0`` (some releases store numbers as floats) -> ``27``."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


class BenchmarkTask(Task):
    """An evaluation-only benchmark: a fixed list of problems from one hub split or a local file."""

    title: ClassVar[str] = "benchmark"
    #: hub split with solved examples usable as few-shot demos; None = this benchmark has no demo pool
    demo_split: ClassVar[str | None] = None

    def __init__(
        self,
        data_path: str | None = None,
        *,
        hub_id: str,
        split: str,
        hub_config: str | None = None,
        revision: str | None = None,
        demo_path: str | None = None,
    ) -> None:
        super().__init__(data_path)
        self.hub_id, self.split, self.hub_config, self.revision = hub_id, split, hub_config, revision
        self.demo_path = demo_path
        self._rows: list[Example] | None = None

    def _convert(self, row: dict[str, Any]) -> Example:
        raise NotImplementedError

    def rows(self) -> list[Example]:
        """All problems in dataset order (loaded once per task object)."""
        if self._rows is None:
            source = self.data_path or self.hub_id
            raw = load_rows(source, self.split, config=self.hub_config, revision=self.revision)
            if not raw:
                raise ValueError(f"{self.title}: {source} ({self.split}) has no rows")
            self._rows = [self._convert(r) for r in raw]
        return self._rows

    def eval_examples(self, limit: int | None, seed: int = 0) -> list[Example]:
        rows = self.rows()
        if not limit or limit >= len(rows):
            return list(rows)
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        return [rows[i] for i in sorted(order[:limit])]

    def splits(self, n_train: int | None, n_heldout: int, n_demo: int, seed: int) -> dict[str, list[Example]]:
        if n_train:
            raise ValueError(
                f"{self.title} is an evaluation benchmark with no training split (train_size must be 0); "
                "train on a training task such as deepscaler or gsm8k"
            )
        heldout = self.eval_examples(n_heldout, seed) if n_heldout else []
        demo = self._demos(n_demo, seed, {e.question for e in heldout}) if n_demo else []
        return {"train": [], "heldout": heldout, "demo": demo}

    def _demos(self, n: int, seed: int, exclude: set[str]) -> list[Example]:
        if self.demo_path:
            raw = load_rows(self.demo_path, "train")
        elif self.demo_split is None:
            raise ValueError(
                f"{self.title} has no pool of few-shot demonstrations (its rows are the test set); "
                "use few_shot: 0 (the paper's prompts are zero-shot) or pass demo_path"
            )
        elif self.data_path:
            raise ValueError(f"{self.title}: with a local data_path, pass demo_path for few-shot demonstrations")
        else:
            split = f"{self.demo_split}[:{DEMO_POOL_ROWS}]"
            raw = load_rows(self.hub_id, split, config=self.hub_config, revision=self.revision)
        pool = [ex for ex in (self._convert(r) for r in raw) if ex.question not in exclude]
        random.Random(seed).shuffle(pool)
        return pool[:n]


# ----------------------------------------------------------------------------- math benchmarks


def _math_example(row: dict[str, Any], what: str) -> Example:
    r"""Question from ``problem``/``question``; gold from ``answer``, else the last ``\boxed{}`` of ``solution``
    (math-ai/aime24 stores the answer only as ``solution: "\boxed{204}"``)."""
    question = field(row, "problem", "question", what=what)
    solution = row.get("solution") or ""
    if row.get("answer") is not None:
        answer = answer_text(row["answer"])
    else:
        boxed = extract_boxed(str(solution))
        if boxed is None:
            raise ValueError(
                f"{what}: row has no 'answer' field and no \\boxed{{}} in 'solution' (has: {', '.join(row)})"
            )
        answer = boxed.strip()
    keep = ("subject", "level", "unique_id", "id", "url") + (("solution",) if row.get("answer") is not None else ())
    meta = {k: row[k] for k in keep if row.get(k) is not None}  # a solution that is only the box is no solution
    return Example(question=str(question).strip(), answer=answer, meta=meta)


class _MathScoring:
    """Boxed answer, math-verify equivalence, canonical keys for Maj@K."""

    timeout_s: float

    def demo_response(self, ex: Example) -> str:
        r"""The dataset's worked solution, ending in ``\boxed{answer}`` (appended when the solution has no box;
        a solution whose last box differs from the answer field is dropped), else just the boxed answer."""
        solution = str(ex.meta.get("solution") or "").strip()
        if solution and extract_boxed(solution) == ex.answer:
            return solution
        steps = f"{solution}\n\n" if solution and extract_boxed(solution) is None else ""
        return f"{steps}The answer is \\boxed{{{ex.answer}}}."

    def score(self, response: str, ex: Example) -> Verdict:
        return check_boxed_math(response, ex.answer, self.timeout_s)

    def answer_key(self, response: str, ex: Example) -> str | None:
        return math_answer_key(response, self.timeout_s)


class MathBenchmarkTask(_MathScoring, BenchmarkTask):
    """A math benchmark: subclasses name their hub release in ``default_hub_id`` (``hub_id`` overrides it)."""

    family = "math"
    default_hub_id: str = ""

    def __init__(
        self,
        data_path: str | None = None,
        *,
        hub_id: str | None = None,
        split: str = "test",
        revision: str | None = None,
        demo_path: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        hub = hub_id or self.default_hub_id
        super().__init__(data_path, hub_id=hub, split=split, revision=revision, demo_path=demo_path)
        self.timeout_s = timeout_s

    def _convert(self, row: dict[str, Any]) -> Example:
        return _math_example(row, self.title)


class Math500Task(MathBenchmarkTask):
    """MATH-500 (Lightman et al., 2023): 500 MATH test problems; fields problem/answer/solution."""

    title = "MATH-500"
    eval_rows = 500
    default_hub_id = "HuggingFaceH4/MATH-500"


class AIME2024Task(MathBenchmarkTask):
    r"""AIME 2024 I+II, 30 problems (math-ai/aime24: fields problem, solution = ``\boxed{N}``)."""

    title = "AIME 2024"
    eval_rows = 30
    default_hub_id = "math-ai/aime24"


class AIME2025Task(MathBenchmarkTask):
    """AIME 2025 I+II, 30 problems (math-ai/aime25: fields problem, answer)."""

    title = "AIME 2025"
    eval_rows = 30
    default_hub_id = "math-ai/aime25"


class AMC2023Task(MathBenchmarkTask):
    """AMC 2023, 40 problems (math-ai/amc23: fields question, answer)."""

    title = "AMC 2023"
    eval_rows = 40
    default_hub_id = "math-ai/amc23"


# ----------------------------------------------------------------------------- training set


class DeepScaleRTask(_MathScoring, Task):
    """DeepScaleR-Preview (Luo et al., 2025), ~40k competition problems; the Hard Setting's training data.

    The hub release has a single split, so held-out and demo problems are carved out of it: problems are
    de-duplicated by text, permuted once with a fixed seed (0, independent of the run seed, so every run
    holds out the same problems), then heldout = the first ``n_heldout``, demo = the next ``n_demo``,
    train = the rest, shuffled by ``seed`` before taking ``n_train``.
    """

    family = "math"
    title = "DeepScaleR"
    train_rows = 40315  # the release's rows, before de-duplication and the held-out and demo problems
    partition_seed: ClassVar[int] = 0

    def __init__(
        self,
        data_path: str | None = None,
        *,
        hub_id: str = "agentica-org/DeepScaleR-Preview-Dataset",
        split: str = "train",
        revision: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        super().__init__(data_path)
        self.hub_id, self.split, self.revision, self.timeout_s = hub_id, split, revision, timeout_s

    def splits(self, n_train: int | None, n_heldout: int, n_demo: int, seed: int) -> dict[str, list[Example]]:
        source = self.data_path or self.hub_id
        unique: dict[str, Example] = {}
        for r in load_rows(source, self.split, revision=self.revision):
            ex = _math_example(r, self.title)
            unique.setdefault(ex.question, ex)
        rows = list(unique.values())
        if len(rows) < n_heldout + n_demo + 1:
            raise ValueError(
                f"{source}: {len(rows)} distinct problems, need more than heldout+demo = {n_heldout + n_demo}"
            )
        random.Random(self.partition_seed).shuffle(rows)
        heldout, demo, train = rows[:n_heldout], rows[n_heldout : n_heldout + n_demo], rows[n_heldout + n_demo :]
        random.Random(seed).shuffle(train)
        return {"train": train[:n_train] if n_train else train, "heldout": heldout, "demo": demo}
