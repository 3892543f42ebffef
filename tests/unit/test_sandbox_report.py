"""The file system report init sends the evaluator survives the status pipe and is read back without the parser
(``ast.literal_eval`` in threads raised SystemError on Python 3.11: CPython gh-106905)."""

from __future__ import annotations

import marshal
import threading

from hypothesis import given
from hypothesis import strategies as st

from esbatch.sandbox._run import _decode_report, _parse_reports

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


def test_reports_decode_in_many_threads_at_once() -> None:
    field = marshal.dumps({"proc": "fresh", "hidden": [f"/p{i}" for i in range(50)], "visible": []}).hex()
    errors: list[BaseException] = []

    def decode() -> None:
        try:
            for _ in range(200):
                assert _decode_report(field)["hidden"][-1] == "/p49"
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=decode) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
