"""GSM8K (Cobbe et al., 2021): real hub loading through `datasets`, or a local file override."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from esbatch.tasks.base import DataFileError, Example, Task, split_local_rows
from esbatch.tasks.verify import Verdict, check_boxed_number, number_key


def gold_from_solution(solution: str) -> str:
    """GSM8K solutions end with '#### 72'; the gold answer is that number without separators."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution without '####' marker: {solution[-80:]!r}")
    return solution.split("####")[-1].strip().replace(",", "")


def load_rows(
    source: str, split: str, *, config: str | None = None, revision: str | None = None
) -> list[dict[str, Any]]:
    """Rows from a local file (jsonl/json/parquet/csv) or a hub dataset id. A local file that cannot be read (torn,
    not of its type) raises DataFileError naming it, and for jsonl the first bad line; so does a jsonl line over
    MAX_ROW_BYTES, found before the file is parsed (:func:`check_row_sizes`)."""
    p = Path(source)
    if p.exists():
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(p.suffix)
        if kind is None:
            raise ValueError(f"{source}: unsupported data file type {p.suffix!r}; use .jsonl, .json, .parquet or .csv")
        if p.suffix == ".jsonl":
            check_row_sizes(p)
    import datasets
    import pyarrow as pa

    if p.exists():
        try:
            with _quiet("datasets"):  # its own log of the failure (a traceback): the error below says it in a line
                return list(datasets.load_dataset(kind, data_files=str(p), split="train"))
        except (datasets.exceptions.DatasetGenerationError, pa.ArrowException, ValueError) as e:
            raise DataFileError(
                f"{p}: the data file cannot be read ({_damage(p, e)}). Copy or export it again, or "
                "point the task's data_path to a whole one"
            ) from e
    return list(datasets.load_dataset(source, config, split=split, revision=revision))


#: The largest line (one problem) of a jsonl data file, in bytes: no prompt a model can take is near it.
MAX_ROW_BYTES = 8 << 20


def check_row_sizes(path: Path) -> None:
    """Raise DataFileError naming ``path`` and the line where a line of it is over MAX_ROW_BYTES (newline not
    counted), reading at most MAX_ROW_BYTES + 1 bytes of any line (a file that is one huge line costs that much)."""
    with open(path, "rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_ROW_BYTES + 1), b""), 1):
            if len(line.rstrip(b"\r\n")) > MAX_ROW_BYTES:
                raise DataFileError(
                    f"{path}: line {number} is over {MAX_ROW_BYTES:,} bytes, the most one row (one problem) may be: "
                    "not a data file of problems one per line (a whole file on one line, or a wrong file?). Put one "
                    "JSON object per line"
                )


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _damage(p: Path, e: BaseException) -> str:
    """What is wrong with a data file that failed to load: a jsonl file's first line that is not JSON, else the
    innermost error."""
    if p.suffix == ".jsonl":
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as u:
            return f"not UTF-8 text: byte {u.start}"
        for i, line in enumerate(lines, 1):
            try:
                if line.strip():
                    json.loads(line)
            except json.JSONDecodeError as j:
                return f"line {i}, column {j.colno}: {j.msg}"
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


class GSM8KTask(Task):
    """GSM8K grade-school math word problems; numeric answer in \\boxed{}."""

    family = "math"
    train_rows, eval_rows = 7473, 1319  # openai/gsm8k main: train, test

    def __init__(
        self,
        data_path: str | None = None,
        *,
        hub_id: str = "openai/gsm8k",
        hub_config: str = "main",
        train_split: str = "train",
        heldout_split: str = "test",
    ) -> None:
        super().__init__(data_path)
        self.hub_id, self.hub_config = hub_id, hub_config
        self.train_split, self.heldout_split = train_split, heldout_split

    @staticmethod
    def _example(row: dict[str, Any]) -> Example:
        for key in ("question", "answer"):
            if key not in row:
                raise ValueError(f"GSM8K row lacks the '{key}' field (has: {', '.join(row)})")
        return Example(
            question=row["question"], answer=gold_from_solution(row["answer"]), meta={"solution": row["answer"]}
        )

    def splits(self, n_train: int | None, n_heldout: int, n_demo: int, seed: int) -> dict[str, list[Example]]:
        if self.data_path:
            # One local file: the last n_heldout rows are held out, the first n_demo are demos.
            rows = [self._example(r) for r in load_rows(self.data_path, "train")]
            train, heldout, demo = split_local_rows(rows, n_heldout, n_demo, self.data_path)
        else:
            train_rows = [self._example(r) for r in load_rows(self.hub_id, self.train_split, config=self.hub_config)]
            heldout = [self._example(r) for r in load_rows(self.hub_id, self.heldout_split, config=self.hub_config)]
            heldout = heldout[:n_heldout]
            demo, train = train_rows[:n_demo], train_rows[n_demo:]
        return {"train": train[:n_train] if n_train else train, "heldout": heldout, "demo": demo}

    def eval_examples(self, limit: int | None, seed: int = 0) -> list[Example]:
        """The hub's test split (a local file: all its rows), all of it or its first ``limit`` problems."""
        if self.data_path:
            rows = load_rows(self.data_path, "train")
        else:
            rows = load_rows(self.hub_id, self.heldout_split, config=self.hub_config)
        exs = [self._example(r) for r in rows]
        return exs[:limit] if limit else exs

    def demo_response(self, ex: Example) -> str:
        steps = re.sub(r"<<[^>]*>>", "", ex.meta["solution"].split("####")[0]).strip()
        return f"{steps}\nThe answer is \\boxed{{{ex.answer}}}."

    def score(self, response: str, ex: Example) -> Verdict:
        return check_boxed_number(response, ex.answer)

    def answer_key(self, response: str, ex: Example) -> str | None:
        return number_key(response)
