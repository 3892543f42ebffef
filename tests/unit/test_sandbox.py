"""The code sandbox against hostile programs: each is contained, reported as a failure, and the evaluator goes on.

Several checks depend on the parent being root (the sandbox then drops to its own unprivileged uid) or on the
kernel allowing namespaces; where that is not so, they skip and say why rather than run something unsafe.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from esbatch.sandbox import network_isolation_available, processes_of_uid, run_many, run_python

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sandbox needs a POSIX system")

REPO = Path(__file__).resolve().parents[2]
HOSTILE = dict(timeout_s=3.0, cpu_s=2)
IS_ROOT = os.geteuid() == 0
NEEDS_ROOT = "only a root parent can run the program as a separate unprivileged uid"
NEEDS_NS = "the kernel refuses network/mount namespaces here (see network_isolation_available)"


def _assert_nothing_left(r) -> None:
    """No process of the run's uid survives it, and the machine can still start processes."""
    if r.uid is not None:
        assert processes_of_uid(r.uid) == [], f"processes of sandbox uid {r.uid} survived"
    assert subprocess.run(["true"], timeout=10).returncode == 0


def _sandbox_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("esbatch_sbx_*")}


# ----------------------------------------------------------------------------- ordinary programs


def test_normal_program_ok_with_output_captured():
    before = _sandbox_dirs()
    r = run_python("import sys\nprint('hello')\nprint('warn', file=sys.stderr)\nopen('scratch.txt', 'w').write('x')")
    assert (r.ok, r.returncode, r.timed_out, r.reason) == (True, 0, False, "ok")
    assert r.stdout == "hello\n" and r.stderr == "warn\n"
    assert r.network_isolated == network_isolation_available()
    assert (r.uid is not None) == IS_ROOT
    assert _sandbox_dirs() <= before, "the temporary working directory was not deleted"


def test_exit_1_is_a_failure_with_its_reason():
    r = run_python("import sys\nsys.exit(1)")
    assert (r.ok, r.returncode, r.reason) == (False, 1, "exit 1")


def test_exception_is_exit_1_with_the_traceback():
    r = run_python("raise ValueError('boom')")
    assert not r.ok and r.reason == "exit 1" and "ValueError: boom" in r.stderr


# ----------------------------------------------------------------------------- hostile programs


def test_infinite_loop_is_stopped_by_cpu_or_wall_limit():
    t = time.monotonic()
    r = run_python("while True: pass", timeout_s=4.0, cpu_s=1)
    assert not r.ok and r.reason in ("cpu limit", "timeout")
    assert time.monotonic() - t < 8


def test_program_ignoring_signals_is_killed_at_the_wall_timeout():
    code = (
        "import signal, time\n"
        "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
        "    signal.signal(s, signal.SIG_IGN)\n"
        "time.sleep(1000)\n"
    )
    r = run_python(code, timeout_s=1.5)
    assert not r.ok and r.timed_out and r.reason == "timeout"
    assert 1.4 < r.wall_s < 5
    _assert_nothing_left(r)


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True: os.fork()",
        # leaves the process group with setsid, so killing the group alone would miss it
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    while True:\n"
        "        try: os.fork()\n        except OSError: pass\nelse:\n    time.sleep(1000)",
    ],
    ids=["plain", "setsid"],
)
def test_fork_bomb_is_contained_and_leaves_nothing(code):
    t = time.monotonic()
    r = run_python(code, **HOSTILE)
    assert not r.ok and r.reason in ("exit 1", "timeout", "cpu limit")
    assert time.monotonic() - t < 10
    if not IS_ROOT:
        pytest.skip(f"cannot check for survivors by uid: {NEEDS_ROOT}")
    _assert_nothing_left(r)


def test_daemon_that_escapes_the_group_is_killed_and_does_not_hold_the_run():
    code = "import os, time\nif os.fork(): os._exit(0)\nos.setsid()\ntime.sleep(1000)"
    r = run_python(code, timeout_s=10.0)
    assert r.wall_s < 5, "the run waited on the daemon holding its output pipe"
    if not IS_ROOT:
        pytest.skip(f"cannot kill processes that left the group: {NEEDS_ROOT}")
    _assert_nothing_left(r)


@pytest.mark.parametrize(
    "code", ["x = bytearray(10**10)", "x = []\nwhile True: x.append(' ' * 10**6)"], ids=["one", "growing"]
)
def test_memory_bomb_fails_with_memory_error(code):
    r = run_python(code, memory_mb=256, **HOSTILE)
    assert not r.ok and r.reason == "memory" and "MemoryError" in r.stderr


def test_file_size_limit():
    r = run_python("open('big', 'wb').write(b'0' * (4 << 20))", file_size_mb=1)
    assert not r.ok and "File too large" in r.stderr


@pytest.mark.parametrize("where", ["tmp", "repo", "shm"])
def test_writing_outside_its_directory_fails(where):
    if not network_isolation_available():
        pytest.skip(f"world-writable places like /tmp stay writable without a read-only mount: {NEEDS_NS}")
    base = {"tmp": Path("/tmp"), "repo": REPO, "shm": Path("/dev/shm")}[where]
    if not base.is_dir():
        pytest.skip(f"{base} does not exist here")
    target = base / f"esbatch_sandbox_escape_{uuid.uuid4().hex}"
    try:
        r = run_python(f"open({str(target)!r}, 'w').write('escaped')")
        assert not r.ok and ("Read-only file system" in r.stderr or "Permission denied" in r.stderr), r.stderr
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


def test_parent_environment_is_not_visible(monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("ESBATCH_TEST_SECRET", secret)
    r = run_python("import os\nprint(os.environ.get('ESBATCH_TEST_SECRET'))\nprint(sorted(os.environ))")
    assert r.ok and secret not in r.stdout
    first, keys = r.stdout.splitlines()
    assert first == "None"
    assert set(eval(keys)) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE"}
    if not IS_ROOT:
        pytest.skip(f"/proc/<parent>/environ is readable by the same uid: {NEEDS_ROOT}")
    r = run_python("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())")
    assert not r.ok and secret not in r.stdout and "Permission denied" in r.stderr


def test_reading_root_only_files_fails():
    if not IS_ROOT:
        pytest.skip(NEEDS_ROOT)
    d = Path(tempfile.mkdtemp(prefix="esbatch_sandbox_test_"))
    try:
        d.chmod(0o755)
        private = d / "private.txt"
        private.write_text("root only")
        code = f"print(open({str(private)!r}).read())"
        private.chmod(0o600)
        r = run_python(code)
        assert not r.ok and "Permission denied" in r.stderr and "root only" not in r.stdout
        private.chmod(0o644)  # control: the path is reachable, only the permission stopped it
        assert run_python(code).stdout == "root only\n"
    finally:
        shutil.rmtree(d)


def test_network_is_unreachable():
    if not network_isolation_available():
        pytest.skip(f"no network isolation: {NEEDS_NS}")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')"
        outside = "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)"
        for code in (connect, outside):
            r = run_python(code, timeout_s=5.0)
            assert not r.ok and r.network_isolated and "OSError" in r.stderr, r.stderr
        with pytest.raises(TimeoutError):
            server.accept()
        # control: with network=True the same program reaches the server, so the check above means something
        r = run_python(connect, timeout_s=5.0, network=True)
        assert r.ok and not r.network_isolated, r.stderr
        server.accept()[0].close()


def test_killing_the_parent_fails():
    if not IS_ROOT:
        pytest.skip(f"the program would run as our own uid and could kill this test: {NEEDS_ROOT}")
    r = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    assert not r.ok and "PermissionError" in r.stderr
    # kill(-1) signals everything the caller may signal: with a uid of its own, only itself (which the kernel
    # spares) -- not this test, and not another sandbox running at the same time.
    killall, sleeper = run_many(
        ["import os, signal, time\ntime.sleep(0.3)\nos.kill(-1, signal.SIGKILL)\nprint('still here')",
         "import time\ntime.sleep(1.5)\nprint('slept')"],
        workers=2,
    )  # fmt: skip
    assert killall.ok and killall.stdout == "still here\n"
    assert sleeper.ok and sleeper.stdout == "slept\n"
    assert killall.uid != sleeper.uid


def test_huge_output_is_truncated_and_parent_memory_stays_bounded():
    tracemalloc.start()
    try:
        r = run_python("print('x' * 10**8)", max_output=10_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.ok
    assert r.stdout.startswith("x" * 10_000) and "output truncated: 100000001 bytes" in r.stdout
    assert len(r.stdout) < 10_200
    assert peak < 5 * 2**20, f"parent peak {peak} bytes while reading 100 MB of output"


def test_endless_output_times_out_with_truncated_output():
    r = run_python("while True: print('y' * 1000)", timeout_s=2.0, max_output=5_000)
    assert not r.ok and r.timed_out and "output truncated" in r.stdout and len(r.stdout) < 5_200


# ----------------------------------------------------------------------------- run_many


def test_run_many_mixed_programs_in_order():
    programs = [
        "print(0)",
        "while True: pass",
        "print(2)",
        "import os\nwhile True: os.fork()",
        "x = bytearray(10**10)",
        "print(5)",
        "raise SystemExit(1)",
        "import sys; print(7); print('e', file=sys.stderr)",
    ]
    t = time.monotonic()
    rs = run_many(programs, timeout_s=3.0, cpu_s=1)
    assert time.monotonic() - t < 15
    assert [r.ok for r in rs] == [True, False, True, False, False, True, False, True]
    assert [r.stdout for r in rs if r.ok] == ["0\n", "2\n", "5\n", "7\n"]
    assert rs[1].reason in ("cpu limit", "timeout") and rs[4].reason == "memory" and rs[6].reason == "exit 1"
    for r in rs:
        _assert_nothing_left(r)
    assert run_many([]) == []
