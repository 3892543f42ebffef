"""Every MBPP row's reference solution, scored by MBPPTask.score_many: does the exploit-proof checker
(esbatch.tasks.code_check) still pass the real dataset's correct answers, and what does it cost?

    python benchmarks/mbpp_reference.py /tmp/mbpp/sanitized-mbpp.json [--workers 2] [--timeout-s 5] [--no-old]

The file is a local MBPP json (a list of rows) or jsonl with task_id, prompt/text, code, test_list,
test_imports. Prints the CORRECT / WRONG / MISSING counts, each non-CORRECT row with what went wrong (the
values its solution returned, or the harness's error), and the wall time of the new scoring next to the old
one-process scoring (``setup + code + asserts + raise SystemExit(random code)``, which anything could fake).
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import time
from collections import Counter

from esbatch.sandbox import run_many
from esbatch.tasks.code_check import result_payload
from esbatch.tasks.mbpp import MBPPTask
from esbatch.tasks.verify import Verdict


def old_scores(task: MBPPTask, examples: list, workers: int | None) -> list[Verdict]:
    """The scoring this repository used before: one program, CORRECT iff it exits with a random code."""
    code = 3 + secrets.randbelow(120)
    progs = [
        "\n".join([*e.meta["setup"], e.answer, *e.meta["tests"], f"raise SystemExit({code})", ""]) for e in examples
    ]
    cpu_s = max(1, math.ceil(task.timeout_s))
    res = run_many(progs, workers=workers, timeout_s=task.timeout_s, cpu_s=cpu_s, memory_mb=task.memory_mb)
    return [Verdict.CORRECT if r.returncode == code and not r.timed_out else Verdict.WRONG for r in res]


def explain(task: MBPPTask, ex) -> str:
    """The harness's view of a failing reference solution: the values it returned (or its error) per call."""
    from esbatch.sandbox import run_python

    cpu_s = max(1, math.ceil(task.timeout_s))
    r = run_python(task.program(ex.answer, ex, "@@x@@"), timeout_s=task.timeout_s, cpu_s=cpu_s, max_output=1 << 20)
    payload = result_payload(r.stdout, "@@x@@")
    if payload is None:
        return f"no result ({r.reason}): {r.stderr[-300:]!r}"
    calls = task.plan(ex).calls
    return "; ".join(f"{c} -> {json.dumps(v)[:120]}" for c, v in zip(calls, json.loads(payload)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="local MBPP .json / .jsonl")
    ap.add_argument("--workers", type=int, default=0, help="parallel sandboxes (0: one per CPU core)")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="per-solution limit (MBPPTask's default: 5)")
    ap.add_argument("--no-old", action="store_true", help="skip timing the old scoring")
    args = ap.parse_args()

    task = MBPPTask(args.path, workers=args.workers, timeout_s=args.timeout_s)
    examples = task.eval_examples(None)
    responses = [f"```python\n{e.answer}\n```" for e in examples]
    t0 = time.perf_counter()
    verdicts = task.score_many(responses, examples)
    new_s = time.perf_counter() - t0
    counts = Counter(str(v) for v in verdicts)
    print(f"{len(examples)} rows: " + ", ".join(f"{v.name} {counts.get(str(v), 0)}" for v in Verdict))
    print(f"new scoring: {new_s:.1f} s wall")
    for ex, v in zip(examples, verdicts):
        if v is not Verdict.CORRECT:
            print(f"  task {ex.meta['task_id']}: {v.name}: {explain(task, ex)}")
    if not args.no_old:
        t0 = time.perf_counter()
        old = old_scores(task, examples, args.workers or None)
        old_s = time.perf_counter() - t0
        print(f"old scoring: {old_s:.1f} s wall, CORRECT {sum(v is Verdict.CORRECT for v in old)}")
        for ex, a, b in zip(examples, old, verdicts):
            if a is not b:
                print(f"  task {ex.meta['task_id']}: old {a.name}, new {b.name}")


if __name__ == "__main__":
    main()
