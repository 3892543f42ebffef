"""math-verify's time limit, off the main thread: a check that runs over it is abandoned as not equal (a key: the
answer's text), counted in ``timeout_count()``, and its worker is killed (the only way to stop sympy), so the
next check starts a new worker; four threads at once each check out a worker of their own and wait together.

Integration, not unit: killing workers empties the session's shared pool, and a new worker is a new process.
Nothing here is timed: the deadline's own results (the TIMEOUT verdict, the counter, which worker served which
call) are checked; the only clock is a safety limit that fails a test instead of letting it hang.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from esbatch.tasks import verify_math
from esbatch.tasks.verify import Verdict
from esbatch.tasks.verify_math import (
    Match,
    check_boxed_math,
    compare_math,
    math_answer_key,
    math_equal,
    start_workers,
    timeout_count,
)

W = Verdict.WRONG
SLOW = r"9^{9^{9^{9}}}"  # sympy tries to evaluate this tower and never finishes
#: a safety limit (the threads' joins, the barrier), not an expectation: the test takes a few seconds
SAFETY_S = 300.0


@pytest.fixture()
def fresh_memo():
    """Checks (timeouts included) are memoized per process: forget earlier tests' so these run and count."""
    for cache in (verify_math._compare_cached, verify_math._key_cached):
        cache.cache_clear()


def test_pathological_expression_times_out_as_not_equal(fresh_memo):
    start_workers(1)
    before = timeout_count()
    # TIMEOUT, not UNEQUAL: the caller gave up at its limit instead of waiting for the tower (which never ends)
    assert compare_math(SLOW, "1", timeout_s=1.0) is Match.TIMEOUT
    assert timeout_count() == before + 1
    hits = verify_math._compare_cached.cache_info().hits
    assert check_boxed_math(rf"\boxed{{{SLOW}}}", "1", timeout_s=1.0) is W
    assert timeout_count() == before + 1  # the timeout is memoized: not run (and timed out) again...
    assert verify_math._compare_cached.cache_info().hits == hits + 1  # ...but answered from the memo
    assert math_equal(r"\sqrt{2}/2", r"\frac{\sqrt2}{2}")  # the pool recovers after a worker was killed


def test_math_equal_from_four_threads_honours_the_timeout(fresh_memo, monkeypatch):
    start_workers(4)
    before = timeout_count()
    results: dict[int, tuple[bool, bool]] = {}
    served: dict[int, int] = {}  # thread -> pid of the worker its slow check waited on
    slow_call = threading.local()
    # The four waits overlap: each slow check waits here, holding its worker, until all four are waiting. Calls
    # that were served one at a time would never all arrive (the barrier breaks at the safety limit instead).
    together = threading.Barrier(4, timeout=SAFETY_S)
    real_recv = verify_math._Worker.recv

    def recv(self, timeout_s):
        i = getattr(slow_call, "i", None)
        if i is not None and timeout_s == 1.0:  # the slow check's reply (not a new worker's "ready")
            served[i] = self.proc.pid
            together.wait()
        return real_recv(self, timeout_s)

    monkeypatch.setattr(verify_math._Worker, "recv", recv)

    def work(i: int) -> None:
        slow_call.i = i
        slow = math_equal(rf"9^{{9^{{9^{{{9 - i}}}}}}}", str(i + 2), timeout_s=1.0)  # fresh pairs: no memo
        slow_call.i = None
        fast = math_equal(r"\dfrac{\sqrt{2}}{2}", rf"\frac{{\sqrt{{2}}}}{{2}}+{i}-{i}", timeout_s=10.0)
        results[i] = (slow, fast)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SAFETY_S)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(slow is False and fast is True for slow, fast in results.values()), results
    assert sorted(served) == [0, 1, 2, 3] and len(set(served.values())) == 4, served  # a worker each
    assert timeout_count() == before + 4  # each slow check was abandoned at its limit...
    assert not any(Path(f"/proc/{pid}").exists() for pid in served.values())  # ...and its worker killed and reaped


def test_answer_key_falls_back_to_the_text_after_a_timeout(fresh_memo):
    before = timeout_count()
    assert math_answer_key(rf"\boxed{{{SLOW}}}", timeout_s=1.0) == SLOW  # falls back to the raw text
    assert timeout_count() == before + 1  # because its key ran out of time (the worker was stopped)
