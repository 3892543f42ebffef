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
something other than "ready", splits its reply over two writes, sends two replies in one write, or says "ready"
and then never answers (the
cheap way to get a timeout). Anything that could hang runs in a thread with a time limit, so a broken build
fails here in seconds rather than hanging. Reads worker state from /proc (Linux).
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

import pytest

from esbatch.tasks import verify_math
from esbatch.tasks.verify_math import shutdown_workers, start_workers, timeout_count

pytestmark = pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads worker state from /proc")

#: The directory holding the esbatch package that this process imported (what a worker must import too).
ROOT = str(Path(verify_math.__file__).resolve().parents[2])
SERVE = "from esbatch.tasks.verify_math import _serve; _serve()"

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
elif mode == "split":  # says "ready" in two writes
    os.write(1, b'"rea')
    time.sleep(0.5)
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
    """``fn(*args)``, failing the test if it has not returned after ``limit_s`` seconds (instead of hanging)."""
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
    monkeypatch.setattr(verify_math, "WORKER_STARTUP_TIMEOUT_S", 30.0)
    yield verify_math._idle
    within(30, shutdown_workers)


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


# ----------------------------------------------------------------------------- start_workers / shutdown_workers


def test_start_workers_keeps_n_idle_workers_and_shutdown_leaves_no_process(pool, stand_in):
    stand_in("mute")  # cheap workers: only "ready" is needed here
    within(30, start_workers, 1)
    assert len(pool) == 1
    first = pool[0]
    within(30, start_workers, 1)  # already there: nothing started
    assert pool == [first]
    within(30, start_workers, 0)
    assert pool == [first]
    within(30, start_workers, 2)
    assert len(pool) == 2 and pool[0] is first
    within(30, start_workers, 5)  # capped at MAX_IDLE_WORKERS
    assert len(pool) == 2
    workers = list(pool)
    assert len({w.proc.pid for w in workers}) == 2
    assert all(exists(w.proc.pid) and w.proc.poll() is None for w in workers)
    within(30, shutdown_workers)
    assert pool == []
    assert all(reaped(w) for w in workers)
    assert all(w.proc.returncode == -signal.SIGKILL for w in workers)
    within(30, shutdown_workers)  # nothing left to stop
    assert pool == []


# ----------------------------------------------------------------------------- _Worker


def test_worker_imports_this_esbatch_under_its_memory_cap(pool, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(verify_math, "WORKER_MEMORY_LIMIT_BYTES", 3 << 30)
    w = within(60, verify_math._Worker)
    env = environ(w.proc.pid)
    assert env["PYTHONPATH"] == ROOT
    assert env["ESBATCH_MATH_WORKER_MEMORY"] == str(3 << 30)
    assert address_space_limit(w.proc.pid) == (3 << 30, 3 << 30)
    w.send("equal", (r"\sqrt{4}", "2"))
    assert within(60, w.recv, 30.0) is True
    within(30, w.kill)
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
        assert _read_line(p, 30) == b'"ready"\n'
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
            assert _read_line(p, 30) == reply, req
        p.stdin.write(b"not json\n")
        p.stdin.flush()
        assert _read_line(p, 30) == b"null\n"
        p.stdin.close()
        assert p.wait(30) == 0  # the end of its input ends the worker
        assert p.stdout.read() == b""  # and nothing else was written
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stdout.close()


def test_worker_stdout_carries_only_replies(pool, stand_in, capfd):
    stand_in("noisy")
    w = within(60, verify_math._Worker)
    assert environ(w.proc.pid)["PYTHONPATH"] == os.pathsep.join([ROOT, os.environ["PYTHONPATH"]])
    for args, reply in [((r"\sqrt{4}", "2"), True), ((r"\sqrt{4}", "3"), False), ((r"\sqrt{4}", r"\sqrt[3]{8}"), True)]:
        w.send("equal", args)
        assert within(60, w.recv, 30.0) is reply
    within(30, w.kill)
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
    pool, stand_in, popens, monkeypatch, mode, message, returncode
):
    stand_in(mode)
    monkeypatch.setattr(verify_math, "WORKER_STARTUP_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        within(30, verify_math._Worker)
    assert str(e.value) == message
    assert time.monotonic() - t0 < 10
    [p] = popens
    assert p.returncode == returncode and not exists(p.pid)
    assert p.stdin.closed and p.stdout.closed


def test_a_reply_split_over_two_writes_is_put_back_together(pool, stand_in):
    stand_in("split")
    w = within(30, verify_math._Worker)  # read "rea, then dy"\n half a second later
    within(30, w.kill)
    assert reaped(w)


def test_two_replies_in_one_read_are_returned_one_at_a_time(pool, stand_in):
    stand_in("two")
    w = within(30, verify_math._Worker)  # "ready" and "two words" arrive together
    assert within(30, w.recv, 1.0) == "two words"  # kept for the next recv
    with pytest.raises(verify_math._Timeout):
        within(30, w.recv, 0.2)
    within(30, w.kill)
    assert reaped(w)


# ----------------------------------------------------------------------------- _call, timeouts, replacement


def test_a_check_over_its_limit_times_out_is_counted_and_its_worker_killed(pool, stand_in):
    stand_in("mute")
    before = timeout_count()
    for n, (op, args) in enumerate([("equal", ("9^{9^{9}}", "1")), ("key", ("9^{9^{9}}",))], start=1):
        within(30, start_workers, 1)
        [w] = pool
        t0 = time.monotonic()
        with pytest.raises(verify_math._Timeout):
            within(10, verify_math._call, op, args, 0.5)
        assert 0.5 <= time.monotonic() - t0 < 3.0
        assert timeout_count() == before + n
        assert pool == [] and reaped(w) and w.proc.returncode == -signal.SIGKILL


def test_a_worker_that_died_is_reaped_and_replaced(pool, stand_in):
    stand_in("mute")
    within(30, start_workers, 1)
    [dead] = pool
    os.kill(dead.proc.pid, signal.SIGKILL)  # e.g. the OOM killer
    assert within(30, verify_math._call, "equal", (r"\sqrt{4}", "2"), 5.0) is None  # a failed check
    assert pool == [] and reaped(dead)
    before = timeout_count()
    stand_in("")  # real workers from here on
    assert within(60, verify_math._call, "equal", (r"\sqrt{4}", "2"), 30.0) is True
    [w] = pool  # a new worker, kept for the next call
    assert w is not dead and exists(w.proc.pid)
    assert within(30, verify_math._call, "nope", (), 0.9) is None  # well within 0.9 s: no timeout
    assert within(30, verify_math._call, "equal", (r"\sqrt{4}", "3"), 5.0) is False
    assert pool == [w] and w.proc.poll() is None  # the same worker answered all three
    assert timeout_count() == before
