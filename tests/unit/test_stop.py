"""The stop policy's signal handler survives a signal that arrives while it runs (a storm of SIGINT/SIGTERM): a
nested call only records its signal. Before, a second signal inside ``STOP.set()`` re-entered it and blocked on
the Event's own lock (or recursed until RecursionError), killing the run mid-write."""

from __future__ import annotations

import signal
import threading

import pytest

from esbatch.train import stop


class NestedSignalEvent(threading.Event):
    """An Event whose set() takes a second signal while it holds its lock, as Python would run a handler for a
    signal that arrives between two bytecodes of Event.set."""

    def set(self) -> None:
        with self._cond:
            stop._on_signal(signal.SIGTERM, None)
            self._flag = True
            self._cond.notify_all()


@pytest.fixture()
def fresh(monkeypatch):
    monkeypatch.setattr(stop, "STOP", NestedSignalEvent())
    monkeypatch.setattr(stop, "_REQUESTED", [])
    monkeypatch.setattr(stop, "_in_handler", False)


def test_a_signal_inside_the_handler_is_recorded_and_does_not_block(fresh, capfd):
    done = threading.Event()

    def handle() -> None:
        stop._on_signal(signal.SIGINT, None)
        done.set()

    t = threading.Thread(target=handle, daemon=True)  # a daemon: a blocked handler must not hang the suite
    t.start()
    assert done.wait(60), "the nested signal blocked the handler"
    assert stop.requested() and stop.received(signal.SIGINT) and stop.received(signal.SIGTERM)
    assert stop._REQUESTED == [signal.SIGINT, signal.SIGTERM] and stop._in_handler is False
    err = capfd.readouterr().err
    assert err.count("stopping after the current update") == 1 and "SIGINT: stopping" in err


def test_later_signals_are_recorded_without_a_second_message(fresh, capfd):
    stop._on_signal(signal.SIGUSR2, None)
    stop._on_signal(signal.SIGTERM, None)
    assert stop._REQUESTED == [signal.SIGUSR2, signal.SIGTERM, signal.SIGTERM]  # SIGTERM twice: once nested
    assert capfd.readouterr().err.count("stopping after the current update") == 1
    with pytest.raises(stop.Stopped):
        stop.check()
