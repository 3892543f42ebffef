"""MBPP (Austin et al., 2021): Python programming problems, scored by running their asserts in the sandbox.

Data: ``google-research-datasets/mbpp``, config ``"sanitized"`` by default: the subset the MBPP authors
hand-verified (clarified statements, explicit ``test_imports``); train split "train" (120 problems), eval
split "test" (257), few-shot demos from the "prompt" split (7). ``hub_config="full"`` gives the original
974 problems (500 in "test"; statement in ``text``, setup in ``test_setup_code``). A local ``data_path``
(jsonl/json/parquet/csv) with the fields task_id, text (or prompt), code, test_list, test_imports replaces
the hub: its last ``n_heldout`` rows are held out and its first ``n_demo`` rows are demos.

The prompt is the paper's (App. G.5): system ``CODE_SYSTEM_PROMPT``, user "Task: ...\\nTest Cases:\\n<asserts>".
A response is scored on its last ```python (or bare ```) block: none -> MISSING; every assert passes ->
CORRECT, else WRONG. The asserts are not run next to the code: a policy being optimised against the scorer
would learn to fake the exit code, return an always-equal object or patch ``assert``. Instead
(:mod:`esbatch.tasks.code_check`) only the calls of the solution's functions run in ``esbatch.sandbox``, their
return values come back as plain data, and a separate judge that never runs model code compares them with the
expected values.
"""

from __future__ import annotations

import ast
import functools
import sys
import textwrap
from typing import Any

from esbatch.sandbox import SandboxError, isolation_report
from esbatch.tasks.base import SYSTEM_PROMPTS, Example, Task, split_local_rows
from esbatch.tasks.code_check import Limits, TestPlan, check_solutions, harness_program, plan_tests
from esbatch.tasks.gsm8k import load_rows
from esbatch.tasks.verify import Verdict

# Appendix G.5, "Prompt for MBPP Code Generation", verbatim.
CODE_SYSTEM_PROMPT = SYSTEM_PROMPTS["code"]  # the paper's G.5 MBPP prompt, word for word
PYTHON_FENCES = ("", "python", "python3", "py")


def extract_code(response: str) -> str | None:
    """The last fenced block tagged python (or untagged), dedented; None when there is none.

    Fences are paired line by line, so another language's block (```bash) is skipped whole instead of its
    closing fence being taken for an opening one. An unclosed block (a response cut off at the token limit)
    does not count.
    """
    found, lang, lines = None, None, []
    for line in response.splitlines():
        s = line.strip()
        if lang is None:
            if s.startswith("```"):
                info = s[3:].split()
                lang, lines = (info[0].lower() if info else ""), []
        elif s.startswith("```") and not s.strip("`"):
            if lang in PYTHON_FENCES:
                found = textwrap.dedent("\n".join(lines))
            lang = None
        else:
            lines.append(line)
    return found


class MBPPTask(Task):
    """MBPP Python problems; the answer is one Python code block, checked by running the problem's asserts."""

    family = "code"
    train_rows, eval_rows = 120, 257  # sanitized: train, test

    def __init__(
        self,
        data_path: str | None = None,
        *,
        hub_id: str = "google-research-datasets/mbpp",
        hub_config: str = "sanitized",
        train_split: str = "train",
        heldout_split: str = "test",
        demo_split: str = "prompt",
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        workers: int = 0,
        allow_unconfined: bool = False,
    ) -> None:
        """``allow_unconfined``: score even where the sandbox cannot isolate programs (namespaces refused by
        the kernel); otherwise such a machine is refused here, before any training or evaluation starts."""
        super().__init__(data_path)
        self.hub_id, self.hub_config = hub_id, hub_config
        self.train_split, self.heldout_split, self.demo_split = train_split, heldout_split, demo_split
        self.timeout_s, self.memory_mb, self.workers = timeout_s, memory_mb, workers
        self.allow_unconfined = allow_unconfined
        report = isolation_report()
        if not report["isolated"]:
            if not allow_unconfined:
                raise SandboxError(
                    f"mbpp: model-written code cannot be isolated on this machine ({report['missing']}), so it is "
                    "not run. Enable unprivileged user namespaces, or set task.params.allow_unconfined: true to "
                    "run it under rlimits only (unsafe for untrusted code; recorded in MLflow as sandbox.isolated)"
                )
            print("warning: mbpp runs model-written code UNCONFINED (task.params.allow_unconfined)", file=sys.stderr)

    def tracking_tags(self) -> dict[str, str]:
        """What confines the generated code here, logged with every run and eval that scores it."""
        rep = isolation_report()
        return {
            "sandbox.allow_unconfined": str(self.allow_unconfined),
            **{f"sandbox.{k}": str(v) for k, v in rep.items()},
        }

    # --- data ------------------------------------------------------------------------------
    @staticmethod
    def _example(row: dict[str, Any]) -> Example:
        text = row.get("text") or row.get("prompt")
        for key, value in (("text' or 'prompt", text), ("code", row.get("code")), ("test_list", row.get("test_list"))):
            if not value:
                raise ValueError(f"MBPP row lacks the '{key}' field (has: {', '.join(row)})")
        setup = list(row.get("test_imports") or []) + ([row["test_setup_code"]] if row.get("test_setup_code") else [])
        meta = {"task_id": row.get("task_id"), "tests": list(row["test_list"]), "setup": setup}
        return Example(question=text.strip(), answer=row["code"], meta=meta)

    def _rows(self, split: str) -> list[Example]:
        return [self._example(r) for r in load_rows(self.hub_id, split, config=self.hub_config)]

    def splits(self, n_train: int | None, n_heldout: int, n_demo: int, seed: int) -> dict[str, list[Example]]:
        if self.data_path:
            rows = [self._example(r) for r in load_rows(self.data_path, "train")]
            train, heldout, demo = split_local_rows(rows, n_heldout, n_demo, self.data_path)
        else:  # MBPP's splits are disjoint by construction
            train = self._rows(self.train_split)
            heldout = self._rows(self.heldout_split)[:n_heldout]
            demo = self._rows(self.demo_split)[:n_demo] if n_demo else []
        return {"train": train[:n_train] if n_train else train, "heldout": heldout, "demo": demo}

    def eval_examples(self, limit: int | None, seed: int = 0) -> list[Example]:
        """The hub's test split (a local file: all its rows), the first ``limit`` of them."""
        if self.data_path:
            rows = [self._example(r) for r in load_rows(self.data_path, "train")]
        else:
            rows = self._rows(self.heldout_split)
        return rows[:limit] if limit else rows

    # --- prompting -------------------------------------------------------------------------
    def user_message(self, ex: Example) -> str:
        return f"Task: {ex.question}\nTest Cases:\n" + "\n".join(ex.meta["tests"])

    def demo_response(self, ex: Example) -> str:
        return f"```python\n{ex.answer.strip()}\n```"

    def messages(self, ex: Example, demos: list[Example], system_prompt: str | None = None) -> list[dict[str, str]]:
        return super().messages(ex, demos, system_prompt or CODE_SYSTEM_PROMPT)

    # --- scoring ---------------------------------------------------------------------------
    @staticmethod
    def plan(ex: Example) -> TestPlan:
        """The problem's asserts split into solution calls and judge expressions (ValueError: not plannable)."""
        return _plan(tuple(ex.meta["tests"]), tuple(ex.meta["setup"]), ex.answer)

    def program(self, code: str, ex: Example, marker: str = "@@values@@") -> str:
        """The sandboxed program for ``code``: setup, the code, the placeholder calls, values printed after
        ``marker`` (no expected value and no comparison is in it)."""
        return harness_program(self.plan(ex), code, marker)

    def score(self, response: str, ex: Example) -> Verdict:
        return self.score_many([response], [ex])[0]

    def score_many(self, responses: list[str], examples: list[Example]) -> list[Verdict]:
        """Score a batch: the solutions run in parallel sandboxes (``workers``; 0 = one per CPU core), then one
        judge run compares all their values with the expected ones."""
        if len(responses) != len(examples):
            raise ValueError(f"{len(responses)} responses for {len(examples)} examples")
        verdicts = [Verdict.MISSING] * len(responses)
        todo, plans = [], []
        for i, (r, ex) in enumerate(zip(responses, examples)):
            if (code := extract_code(r)) is None:
                continue
            try:
                plans.append(self.plan(ex))
                todo.append((i, code))
            except ValueError as e:  # a dataset row the checker cannot split: nobody can pass it
                _warn_once(ex.meta.get("task_id"), str(e))
                verdicts[i] = Verdict.WRONG
        limits = Limits(self.timeout_s, self.memory_mb, self.workers or None, self.allow_unconfined)
        passed = check_solutions([c for _, c in todo], plans, limits)
        for (i, _), ok in zip(todo, passed):
            verdicts[i] = Verdict.CORRECT if ok else Verdict.WRONG
        return verdicts

    def answer_key(self, response: str, ex: Example) -> str | None:
        """The extracted program in canonical form (``ast.unparse``: formatting and comments dropped), so the
        same program written twice votes once in Maj@K; its verdict is the same for every copy. No code
        block -> None (abstains); code that does not parse -> its whitespace-collapsed text."""
        code = extract_code(response)
        if code is None:
            return None
        try:
            return ast.unparse(ast.parse(code))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return " ".join(code.split())


@functools.lru_cache(maxsize=4096)
def _plan(tests: tuple[str, ...], setup: tuple[str, ...], reference: str) -> TestPlan:
    return plan_tests(tests, setup, reference)


@functools.lru_cache(maxsize=256)
def _warn_once(task_id: Any, error: str) -> None:
    print(
        f"warning: MBPP problem {task_id}: its tests cannot be checked, every answer is WRONG: {error}", file=sys.stderr
    )
