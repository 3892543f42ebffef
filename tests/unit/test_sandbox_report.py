"""Parser use from threads (Python 3.11: CPython gh-106905). ``ast`` keeps its recursion depth per interpreter, so
when a thread switch lands inside an AST's construction (a finalizer run by the cyclic GC is such a point) and another
thread parses meanwhile, one of them raises "SystemError: AST constructor recursion depth mismatch" (CI saw it in
``run_many``). The sandbox's file system report therefore travels marshal-ed, not as a repr for
``ast.literal_eval``, and countdown's ``ast.parse`` holds a lock. ``under_gc_switches`` recreates the conditions:
with ``ast.literal_eval`` in place of either, the thread tests below fail (checked by hand, 2026-12-06)."""

from __future__ import annotations

import gc
import marshal
import sys
import threading
from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from esbatch.sandbox._run import _decode_report, _parse_reports
from esbatch.tasks.verify import Verdict, check_countdown

paths = st.lists(st.text(alphabet=st.characters(blacklist_characters="\n\x00"), max_size=40), max_size=8)


def _line(report: dict) -> bytes:
    """What init writes (the launcher's ``_emit`` line for the report)."""
    return f"init 7\nreport {marshal.dumps(report).hex()}\nstatus 0\n".encode()


@given(hidden=paths, visible=paths)
def test_the_report_round_trips_through_the_status_pipe(hidden: list[str], visible: list[str]) -> None:
    report = {"proc": "fresh", "hidden": hidden, "visible": visible}
    assert _decode_report(_parse_reports(_line(report))["report"]) == report


def test_a_damaged_or_cut_report_is_none_not_an_error() -> None:
    good = marshal.dumps({"proc": "fresh", "hidden": ["/tmp"]}).hex()
    for field in ["", "zz", good[:-2], good[: len(good) // 2], marshal.dumps([1, 2]).hex(), "{'proc': 'fresh'}"]:
        assert _decode_report(field) is None, field


class _Cycle:
    """Garbage only the cyclic GC frees; its finalizer runs Python code, where the interpreter may switch threads."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        sum(range(200))


def under_gc_switches(work: Callable[[], None], threads: int = 8, rounds: int = 600) -> list[BaseException]:
    """Run ``work`` ``rounds`` times in each of ``threads`` threads, each round after making cyclic garbage, with a
    GC threshold and a switch interval that make collections and thread switches frequent; the errors raised."""
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            for _ in range(rounds):
                junk = [_Cycle() for _ in range(20)]
                del junk
                work()
        except BaseException as e:  # noqa: BLE001 - collected and asserted by the caller
            errors.append(e)

    old_threshold, old_interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(50, 1, 1)
    sys.setswitchinterval(1e-6)
    try:
        pool = [threading.Thread(target=loop) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        gc.set_threshold(*old_threshold)
        sys.setswitchinterval(old_interval)
        gc.collect()
    return errors


def test_reports_decode_in_threads_while_the_gc_switches_them() -> None:
    field = marshal.dumps({"proc": "fresh", "hidden": [f"/p{i}" for i in range(50)], "visible": ["/x"]}).hex()

    def decode() -> None:
        assert _decode_report(field)["hidden"][-1] == "/p49"

    assert under_gc_switches(decode) == []


def test_countdown_scores_in_threads_while_the_gc_switches_them() -> None:
    def score() -> None:
        assert check_countdown("<answer>(((7 + 3) * (8 - 2)) - (9 / 3)) * 1</answer>", [7, 3, 8, 2, 9, 3, 1], 57) is (
            Verdict.CORRECT
        )

    assert under_gc_switches(score) == []
