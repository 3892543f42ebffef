"""What the MBPP tests share: the local fixture, its first problem's right and wrong solutions, a code block, and
the task built without the sandbox's probe.

tests/unit (no process may start) and tests/integration (the programs run in the sandbox) both use them:
tests/unit/test_mbpp.py and tests/integration/test_mbpp_sandboxed.py, tests/unit/test_reward_hacking.py and
tests/integration/test_reward_hacking_sandboxed.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import esbatch.tasks.mbpp as mbpp
from esbatch.tasks.mbpp import MBPPTask

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "mbpp_tiny.jsonl"
RIGHT = "def digit_square_sum(n):\n    return sum(int(d) ** 2 for d in str(n))"
WRONG = "def digit_square_sum(n):\n    return sum(int(d) for d in str(n))"
#: what isolation_report() says where every layer is in force (only "isolated" is read when a task is built)
ISOLATED = {"isolated": True, "missing": ""}


def block(code: str, lang: str = "python") -> str:
    return f"```{lang}\n{code}\n```"


def unprobed_task(data_path: str | None = None, **kwargs) -> MBPPTask:
    """An MBPPTask built without asking the sandbox what it can isolate (that probe runs a program): for tests
    that never score code (data, prompts, plans, vote keys)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mbpp, "isolation_report", lambda: dict(ISOLATED))
        return MBPPTask(data_path, **kwargs)


def record_sandbox_runs(monkeypatch: pytest.MonkeyPatch) -> tuple[list[list], list]:
    """From here on, what the scorer runs in the sandbox, with how each run ended (``SandboxResult.reason``):
    ``(batches, judges)``: per ``run_many`` call the solution programs and their results, ``[(program, result)]``,
    and the result of each judge run."""
    from esbatch.tasks import code_check

    batches: list[list] = []
    judges: list = []
    run_many, run_python = code_check.run_many, code_check.run_python

    def recording_many(programs, **kwargs):
        results = run_many(programs, **kwargs)
        batches.append(list(zip(programs, results)))
        return results

    def recording_python(code, **kwargs):
        judges.append(run_python(code, **kwargs))
        return judges[-1]

    monkeypatch.setattr(code_check, "run_many", recording_many)
    monkeypatch.setattr(code_check, "run_python", recording_python)
    return batches, judges
