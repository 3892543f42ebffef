"""Tests written to kill the mutmut survivors in the worker plumbing of esbatch/tasks/verify_math.py (mutmut 3.8.1):
``_serve``, ``_Worker``, ``_checkout``/``_checkin``, ``_call``, ``start_workers``, ``shutdown_workers``,
``timeout_count``.

What is checked is what the module promises about its worker processes: ``start_workers(n)`` leaves ``n`` idle
workers (at most ``MAX_IDLE_WORKERS``); ``shutdown_workers`` leaves no worker process behind, not even a zombie;
a worker runs ``_serve`` from the same ``esbatch`` under its address-space cap; the worker's stdout carries only
one JSON reply per request (library prints go to stderr, math-verify's "timeout is disabled" warning is muted);
a check that runs over its limit ends with a timeout within that limit, is counted, and its worker is killed; a
worker that died is reaped and replaced. Start-up failures are reported and reaped.

Besides real workers (sympy and math-verify imported, a few seconds each), most tests use stand-in workers:
a ``sitecustomize`` on the worker's ``PYTHONPATH`` that, by ``ESBATCH_TEST_WORKER_MODE``, exits, hangs, says
something other than "ready", splits its reply over two writes (the second once the test has read the first),
sends two replies in one write, or says "ready" and then never answers (the cheap way to get a timeout).

Nothing is timed. Where a limit must run out (a worker that never answers), a stand-in clock and ``select`` take
the place of verify_math's: the wait runs out at once, and the test reads how long the code asked to wait; where
a reply must come in time, the same stand-ins wait for it however long it takes. Anything that could hang runs
in a thread with a safety limit (minutes), so a broken build fails rather than hanging. Reads worker state from
/proc (Linux).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from esbatch.tasks import verify_math
from esbatch.tasks.verify_math import shutdown_workers, start_workers, timeout_count

pytestmark = pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads worker state from /proc")

#: The directory holding the esbatch package that this process imported (what a worker must import too).
ROOT = str(Path(verify_math.__file__).resolve().parents[2])
SERVE = "from esbatch.tasks.verify_math import _serve; _serve()"
#: A safety limit, not an expectation: how long a call may take before the test fails instead of hanging, and the
#: time limit given to real workers for their start and their replies (each takes well under a second, a few
#: seconds on a busy machine). Minutes, so no load reaches it.
SAFETY_S = 300.0
REPLY_S = 120.0

SITECUSTOMIZE = """
import os, sys, time

mode = os.environ.get("ESBATCH_TEST_WORKER_MODE", "")
if mode == "exit":  # dies before saying anything
    os._exit(3)
elif mode == "hang":  # never says anything
    time.sleep(30)
elif mode == "hello":  # says the wrong thing
    os.write(1, b'"hello"\\n')
    time.sleep(30)
elif mode == "split":  # says "ready" in two writes, the second once the test has read the first
    os.write(1, b'"rea')
    sys.stdin.readline()  # the test writes a line when it has read '"rea'
    os.write(1, b'dy"\\n')
    time.sleep(30)
elif mode == "two":  # says "ready" and a second reply in one write
    os.write(1, b'"ready"\\n"two words"\\n')
    time.sleep(30)
elif mode == "mute":  # says "ready", then never answers
    os.write(1, b'"ready"\\n')
    time.sleep(30)
elif mode == "noisy":  # a library that prints to stdout while the worker handles a request
    import json

    _loads = json.loads

    def loads(s, *args, **kwargs):
        print("noise from a library", flush=True)
        return _loads(s, *args, **kwargs)

    json.loads = loads
"""


def within(limit_s: float, fn, *args):
    """``fn(*args)``, failing the test if it has not returned after ``limit_s`` seconds (instead of hanging): a
    safety limit, see SAFETY_S."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {limit_s} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def exists(pid: int) -> bool:
    """True while the process exists, zombies included (a killed worker must also be reaped)."""
    return Path(f"/proc/{pid}").exists()


def reaped(w: verify_math._Worker) -> bool:
    return not exists(w.proc.pid) and w.proc.returncode is not None and w.proc.stdin.closed and w.proc.stdout.closed


def environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def address_space_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max address space"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no address-space line")


@pytest.fixture()
def pool(monkeypatch):
    """A private, empty pool of idle workers (at most 2), shut down afterwards."""
    monkeypatch.setattr(verify_math, "_idle", [])
    monkeypatch.setattr(verify_math, "MAX_IDLE_WORKERS", 2)
    monkeypatch.setattr(verify_math, "WORKER_STARTUP_TIMEOUT_S", REPLY_S)
    yield verify_math._idle
    within(SAFETY_S, shutdown_workers)


@pytest.fixture()
def stand_in(tmp_path, monkeypatch):
    """Workers started from here on load SITECUSTOMIZE; returns a function that sets their mode."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    def mode(name: str) -> None:
        monkeypatch.setenv("ESBATCH_TEST_WORKER_MODE", name)

    mode("")
    return mode


@pytest.fixture()
def popens(monkeypatch):
    """Every process started by verify_math (a failed start leaves no _Worker to look at)."""
    procs: list[subprocess.Popen] = []
    real = subprocess.Popen

    def recording(*args, **kwargs):
        procs.append(real(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(verify_math.subprocess, "Popen", recording)
    return procs


class Clock:
    """verify_math's clock and ``select()`` for one test: time moves only when a wait runs out, and ``waits`` are
    the waits the code asked for. ``replies=False``: every wait runs out at once, nothing arrives (a worker that
    never answers, without waiting for it). ``replies=True``: wait for the worker's real reply, however long it
    takes (no limit can run out on a busy machine)."""

    def __init__(self, replies: bool) -> None:
        self.now, self.replies, self.waits = 0.0, replies, []

    def monotonic(self) -> float:
        return self.now

    def select(self, rlist, wlist, xlist, timeout):
        self.waits.append(timeout)
        if self.replies:
            return select.select(rlist, wlist, xlist)  # no timeout: until the reply is there
        self.now += timeout
        return [], [], []


@pytest.fixture()
def clock(monkeypatch):
    """Installs a Clock in verify_math (start real workers before: their "ready" is read with the real clock)."""

    def install(replies: bool) -> Clock:
        c = Clock(replies)
        monkeypatch.setattr(verify_math, "time", SimpleNamespace(monotonic=c.monotonic))
        monkeypatch.setattr(verify_math, "select", SimpleNamespace(select=c.select))
        return c

    return install


# ----------------------------------------------------------------------------- start_workers / shutdown_workers


def test_start_workers_keeps_n_idle_workers_and_shutdown_leaves_no_process(pool, stand_in):
    stand_in("mute")  # cheap workers: only "ready" is needed here
    within(SAFETY_S, start_workers, 1)
    assert len(pool) == 1
    first = pool[0]
    within(SAFETY_S, start_workers, 1)  # already there: nothing started
    assert pool == [first]
    within(SAFETY_S, start_workers, 0)
    assert pool == [first]
    within(SAFETY_S, start_workers, 2)
    assert len(pool) == 2 and pool[0] is first
    within(SAFETY_S, start_workers, 5)  # capped at MAX_IDLE_WORKERS
    assert len(pool) == 2
    workers = list(pool)
    assert len({w.proc.pid for w in workers}) == 2
    assert all(exists(w.proc.pid) and w.proc.poll() is None for w in workers)
    within(SAFETY_S, shutdown_workers)
    assert pool == []
    assert all(reaped(w) for w in workers)
    assert all(w.proc.returncode == -signal.SIGKILL for w in workers)
    within(SAFETY_S, shutdown_workers)  # nothing left to stop
    assert pool == []


# ----------------------------------------------------------------------------- _Worker


def test_worker_imports_this_esbatch_under_its_memory_cap(pool, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(verify_math, "WORKER_MEMORY_LIMIT_BYTES", 3 << 30)
    w = within(SAFETY_S, verify_math._Worker)
    env = environ(w.proc.pid)
    assert env["PYTHONPATH"] == ROOT
    assert env["ESBATCH_MATH_WORKER_MEMORY"] == str(3 << 30)
    assert address_space_limit(w.proc.pid) == (3 << 30, 3 << 30)
    w.send("equal", (r"\sqrt{4}", "2"))
    assert within(SAFETY_S, w.recv, REPLY_S) is True
    within(SAFETY_S, w.kill)
    assert reaped(w) and w.proc.returncode == -signal.SIGKILL


def _read_line(p: subprocess.Popen, timeout_s: float) -> bytes:
    fd, buf, deadline = p.stdout.fileno(), b"", time.monotonic() + timeout_s
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            pytest.fail(f"no line from the worker within {timeout_s} s (got {buf!r})")
        chunk = os.read(fd, 1)
        if not chunk:
            pytest.fail(f"the worker ended its output (got {buf!r}, exit {p.wait()})")
        buf += chunk
    return buf


def test_serve_protocol_one_json_reply_per_line():
    """``_serve`` on its own: 4 GiB cap by default, ``null`` for anything it cannot do, exits at end of input."""
    env = {k: v for k, v in os.environ.items() if k != "ESBATCH_MATH_WORKER_MEMORY"}
    env["PYTHONPATH"] = ROOT
    p = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert _read_line(p, SAFETY_S) == b'"ready"\n'
        assert address_space_limit(p.pid) == (4 << 30, 4 << 30) == (verify_math.WORKER_MEMORY_LIMIT_BYTES,) * 2
        requests = [
            ({"op": "equal", "args": [r"\sqrt{4}", "2"]}, b"true\n"),
            ({"op": "equal", "args": ["3", "2"]}, b"false\n"),
            ({"op": "key", "args": [r"\frac{6}{4}"]}, b'"3/2"\n'),
            ({"op": "nope", "args": []}, b"null\n"),  # unknown op
            ({"op": "equal", "args": ["1"]}, b"null\n"),  # wrong arguments
        ]
        for req, reply in requests:
            p.stdin.write(json.dumps(req).encode() + b"\n")
            p.stdin.flush()
            assert _read_line(p, SAFETY_S) == reply, req
        p.stdin.write(b"not json\n")
        p.stdin.flush()
        assert _read_line(p, SAFETY_S) == b"null\n"
        p.stdin.close()
        assert p.wait(SAFETY_S) == 0  # the end of its input ends the worker
        assert p.stdout.read() == b""  # and nothing else was written
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stdout.close()


def test_worker_stdout_carries_only_replies(pool, stand_in, capfd):
    stand_in("noisy")
    w = within(SAFETY_S, verify_math._Worker)
    assert environ(w.proc.pid)["PYTHONPATH"] == os.pathsep.join([ROOT, os.environ["PYTHONPATH"]])
    for args, reply in [((r"\sqrt{4}", "2"), True), ((r"\sqrt{4}", "3"), False), ((r"\sqrt{4}", r"\sqrt[3]{8}"), True)]:
        w.send("equal", args)
        assert within(SAFETY_S, w.recv, REPLY_S) is reply
    within(SAFETY_S, w.kill)
    err = capfd.readouterr().err
    assert err.count("noise from a library") == 3  # the prints went to stderr...
    assert "Timeout is disabled" not in err  # ...and math-verify's expected warning is muted


@pytest.mark.parametrize(
    "mode, message, returncode",
    [
        ("exit", "math-verify worker did not start (_WorkerGone)", 3),
        ("hang", "math-verify worker did not start (_Timeout)", -signal.SIGKILL),
        ("hello", "math-verify worker said 'hello' instead of 'ready'", -signal.SIGKILL),
    ],
)
def test_a_worker_that_fails_to_start_is_reported_and_reaped(
    pool, stand_in, popens, clock, monkeypatch, mode, message, returncode
):
    stand_in(mode)
    monkeypatch.setattr(verify_math, "WORKER_STARTUP_TIMEOUT_S", 1.0 if mode == "hang" else REPLY_S)
    # "hang" never says anything: its start-up limit runs out at once on the stand-in clock. The others answer
    # (exit, a wrong word) on the real clock, with a start-up limit no busy machine reaches.
    waits = clock(replies=False).waits if mode == "hang" else None
    with pytest.raises(RuntimeError) as e:
        within(SAFETY_S, verify_math._Worker)
    assert str(e.value) == message
    if waits is not None:
        assert waits == [1.0]  # it waited WORKER_STARTUP_TIMEOUT_S for "ready", and no longer
    [p] = popens  # killed (or exited 3) rather than waited for: its stand-in sleeps 30 s and would exit 0
    assert p.returncode == returncode and not exists(p.pid)
    assert p.stdin.closed and p.stdout.closed


def test_a_reply_split_over_two_writes_is_put_back_together(pool, stand_in, popens, monkeypatch):
    stand_in("split")
    reads: list[bytes] = []

    class ReadingOs:
        """verify_math's ``os``, recording each read; on reading '"rea' it lets the stand-in write the rest."""

        def __getattr__(self, name):
            return getattr(os, name)

        def read(self, fd: int, n: int) -> bytes:
            reads.append(os.read(fd, n))
            if reads[-1] == b'"rea':
                popens[-1].stdin.write(b"go\n")
            return reads[-1]

    monkeypatch.setattr(verify_math, "os", ReadingOs())
    w = within(SAFETY_S, verify_math._Worker)  # "ready" is read as '"rea', then 'dy"\n'
    assert reads == [b'"rea', b'dy"\n']
    within(SAFETY_S, w.kill)
    assert reaped(w)


def test_two_replies_in_one_read_are_returned_one_at_a_time(pool, stand_in):
    stand_in("two")
    w = within(SAFETY_S, verify_math._Worker)  # "ready" and "two words" arrive together
    assert within(SAFETY_S, w.recv, 1.0) == "two words"  # kept for the next recv
    with pytest.raises(verify_math._Timeout):
        within(SAFETY_S, w.recv, 0.2)
    within(SAFETY_S, w.kill)
    assert reaped(w)


# ----------------------------------------------------------------------------- _call, timeouts, replacement


def test_a_check_over_its_limit_times_out_is_counted_and_its_worker_killed(pool, stand_in, clock):
    stand_in("mute")
    before = timeout_count()
    within(SAFETY_S, start_workers, 2)  # on the real clock: they say "ready"
    c = clock(replies=False)  # the mute workers' replies never come: each limit runs out at once
    for n, (op, args) in enumerate([("equal", ("9^{9^{9}}", "1")), ("key", ("9^{9^{9}}",))], start=1):
        w = pool[-1]  # the next one checked out
        with pytest.raises(verify_math._Timeout):
            within(SAFETY_S, verify_math._call, op, args, 0.5)
        assert c.waits == [0.5] * n  # it waited the caller's limit for the reply: no less, and no longer
        assert timeout_count() == before + n
        assert w not in pool and reaped(w) and w.proc.returncode == -signal.SIGKILL
    assert pool == []


def test_a_worker_that_died_is_reaped_and_replaced(pool, stand_in, clock):
    stand_in("mute")
    within(SAFETY_S, start_workers, 1)
    [dead] = pool
    os.kill(dead.proc.pid, signal.SIGKILL)  # e.g. the OOM killer
    assert within(SAFETY_S, verify_math._call, "equal", (r"\sqrt{4}", "2"), 5.0) is None  # a failed check
    assert pool == [] and reaped(dead)
    before = timeout_count()
    stand_in("")  # real workers from here on
    assert within(SAFETY_S, verify_math._call, "equal", (r"\sqrt{4}", "2"), REPLY_S) is True
    [w] = pool  # a new worker, kept for the next call
    assert w is not dead and exists(w.proc.pid)
    c = clock(replies=True)  # the reply is waited for however long it takes: only a wrong deadline times out
    assert within(SAFETY_S, verify_math._call, "nope", (), 0.9) is None  # a sub-second limit: no timeout
    assert c.waits == [0.9]  # the wait asked for is the limit itself
    assert within(SAFETY_S, verify_math._call, "equal", (r"\sqrt{4}", "3"), REPLY_S) is False
    assert pool == [w] and w.proc.poll() is None  # the same worker answered all three
    assert timeout_count() == before
