"""The code sandbox's interface: results, limits, output capture, isolation report, refusal without isolation.

The hostile programs (killing the evaluator, escaping, bombs, snooping) are in ``test_sandbox_hostile.py``,
run there both as root and as an unprivileged user.
"""

from __future__ import annotations

import functools
import os
import socket
import tempfile
import tracemalloc
import uuid
import warnings
from pathlib import Path

import pytest

import esbatch.sandbox as sandbox
from esbatch.sandbox import SandboxError, isolation_report, network_isolation_available, run_many, run_python

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sandbox needs a POSIX system")

REPO = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0
NEEDS_NS = "the kernel refuses the namespaces here (see isolation_report()['missing'])"
isolated_only = pytest.mark.skipif(not network_isolation_available(), reason=NEEDS_NS)


# ----------------------------------------------------------------------------- ordinary programs


@isolated_only
def test_normal_program_ok_with_output_captured():
    code = "import os, sys\nprint('hello')\nprint('warn', file=sys.stderr)\nopen('scratch.txt', 'w').write('x')\n"
    r = run_python(code + "print(os.getcwd())")
    assert (r.ok, r.returncode, r.timed_out, r.reason) == (True, 0, False, "ok")
    hello, workdir = r.stdout.splitlines()
    assert hello == "hello" and r.stderr == "warn\n"
    assert r.isolated and r.network_isolated
    assert (r.uid is not None) == IS_ROOT
    assert r.memory_peak_mb is not None and 0 < r.memory_peak_mb < 100
    assert workdir.startswith(os.path.realpath(tempfile.gettempdir()))
    assert not os.path.exists(workdir), "the working folder was not deleted"


def test_exit_1_is_a_failure_with_its_reason():
    r = run_python("import sys\nsys.exit(1)")
    assert (r.ok, r.returncode, r.reason) == (False, 1, "exit 1")


def test_exception_is_exit_1_with_the_traceback():
    r = run_python("raise ValueError('boom')")
    assert not r.ok and r.reason == "exit 1" and "ValueError: boom" in r.stderr


def test_program_sees_its_working_folder_as_home_and_tmpdir():
    r = run_python("import os, tempfile\nprint(os.getcwd() == os.environ['HOME'] == tempfile.gettempdir())")
    assert r.ok and r.stdout == "True\n"


# ----------------------------------------------------------------------------- limits and output


@pytest.mark.parametrize("code", ["x = []\nwhile True: x.append(' ' * 10**6)"], ids=["growing"])
def test_memory_bomb_fails_with_memory_error(code):
    r = run_python(code, memory_mb=256, timeout_s=5.0, cpu_s=3)
    assert not r.ok and r.reason == "memory"


def test_file_size_limit():
    r = run_python("open('big', 'wb').write(b'0' * (4 << 20))", file_size_mb=1)
    assert not r.ok and "File too large" in r.stderr


@isolated_only
def test_disk_and_file_count_are_capped_separately():
    code = "for i in range(40):\n    open(f'f{i}', 'wb').write(b'0' * (1 << 20))\nprint('wrote 40 MB')"
    assert run_python(code, file_size_mb=2, disk_mb=64).stdout == "wrote 40 MB\n"
    r = run_python(code, file_size_mb=2, disk_mb=8)
    assert not r.ok and "No space left on device" in r.stderr
    r = run_python("for i in range(300):\n    open(f'f{i}', 'w').close()", max_files=100)
    assert not r.ok and "No space left on device" in r.stderr


@isolated_only
def test_writing_into_the_checkout_fails():
    target = REPO / f"esbatch_sandbox_escape_{uuid.uuid4().hex}"
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


@isolated_only
def test_network_is_unreachable_unless_asked_for():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)  # accept() answers from the queue at once: no waiting to see if one comes
        connect = f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)"
        r = run_python(connect, timeout_s=5.0)
        assert not r.ok and r.network_isolated and "OSError" in r.stderr, r.stderr
        with pytest.raises(BlockingIOError):  # the program has ended: a connection it made would be queued
            server.accept()
        # control: with network=True the same program reaches the server, so the check above means something
        r = run_python(connect, timeout_s=5.0, network=True)
        assert r.ok and r.isolated and not r.network_isolated, r.stderr
        server.accept()[0].close()  # queued before the program's connect returned


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
    rs = run_many(programs, timeout_s=3.0, cpu_s=1)  # the endless loop's reason below shows its limit fired
    assert [r.ok for r in rs] == [True, False, True, False, False, True, False, True]
    assert [r.stdout for r in rs if r.ok] == ["0\n", "2\n", "5\n", "7\n"]
    assert rs[1].reason in ("cpu limit", "timeout") and rs[4].reason == "memory" and rs[6].reason == "exit 1"
    if IS_ROOT:
        assert len({r.uid for r in rs}) > 1 and all(sandbox.processes_of_uid(r.uid) == [] for r in rs)
    assert run_many([]) == []


# ----------------------------------------------------------------------------- isolation report and refusal


@isolated_only
def test_isolation_report_names_every_layer():
    report = isolation_report()
    assert report["isolated"] is True and report["missing"] == ""
    for key in ("pid_namespace", "network_namespace", "mount_namespace", "ipc_namespace"):
        assert report[key] is True
    assert report["proc"].startswith("fresh") and report["workdir"].startswith("size- and inode-capped")
    assert report["tree_limits"].startswith(("cgroup", "accounting"))
    assert {"/tmp", "/dev/shm"} <= set(report["hidden"].split(":"))
    user = "a leased unprivileged uid (root evaluator)" if IS_ROOT else "unprivileged user namespace"
    assert report["user"] == user
    assert all(isinstance(v, str | bool) for v in report.values()), "flat, for MLflow params"


def test_refuses_to_run_without_isolation_unless_allowed(monkeypatch):
    monkeypatch.setattr(sandbox, "_probe", lambda: ("user namespace (Operation not permitted)", {}))
    monkeypatch.setattr(sandbox, "_warned", False)
    # the interpreter is chosen again: without the namespaces a root parent's uid cannot reach the venv's
    monkeypatch.setattr(sandbox, "sandbox_python", functools.cache(sandbox.sandbox_python.__wrapped__))
    with pytest.raises(SandboxError, match="cannot isolate.*user namespace.*allow_unconfined") as err:
        run_python("print('should not run')")
    assert isinstance(err.value, RuntimeError)
    with pytest.raises(RuntimeError, match="user namespace"):
        run_many(["print(1)"])
    with pytest.warns(RuntimeWarning, match="WITHOUT isolation"):
        r = run_python("print('ran')", allow_unconfined=True)
    assert r.ok and r.stdout == "ran\n" and not r.isolated and not r.network_isolated
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        rs = run_many(["print(1)", "import sys; sys.exit(2)"], allow_unconfined=True)
    assert [(r.ok, r.isolated) for r in rs] == [(True, False), (False, False)]
    assert isolation_report()["isolated"] is False


@isolated_only
def test_interpreter_that_cannot_start_raises():
    with pytest.raises(SandboxError, match="starting the program"):
        run_python("pass", python="/nonexistent/python3")


@isolated_only
def test_hidden_folders_show_at_most_the_interpreter():
    """A hidden folder is empty, but for the program's working folder and the path down to the interpreter's
    own folder when they lie inside."""
    code = "import os\nprint(os.getcwd())\nfor d in ('/root', '/home', '/tmp', '/run'):\n"
    code += "    print(d, sorted(os.listdir(d)))"
    r = run_python(code)
    assert r.ok, r.stderr
    workdir, *lines = r.stdout.splitlines()
    exe = sandbox.sandbox_python()
    kept = {os.path.abspath(exe), os.path.realpath(exe)}  # a venv (wherever the checkout is) and its base Python
    for line in lines:
        folder, shown = line.split(" ", 1)
        for name in eval(shown):
            path = f"{folder}/{name}"
            assert any(k.startswith(path + "/") for k in kept) or path == workdir, f"{path} is visible ({kept})"


@isolated_only
def test_tree_memory_accounting_without_cgroups(monkeypatch):
    """init's own accounting (what an unprivileged evaluator gets here) kills a tree of children over the limit."""
    monkeypatch.setattr(sandbox._cgroup, "_disabled", True)
    code = "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        x = b'1' * (100 << 20)\n"
    code += "        time.sleep(5)\n        os._exit(0)\nos.wait()"
    r = run_python(code, memory_mb=200, timeout_s=8.0)
    # "memory" means killed while the children slept: unkilled, they would exit after 5 s and the run end "ok"
    assert not r.ok and r.reason == "memory"
    assert r.memory_peak_mb is not None and 200 < r.memory_peak_mb < 400


@isolated_only
def test_per_run_cgroups_are_removed():
    run_python("pass")
    parents = sandbox._cgroup._parents() if sandbox._cgroup.mode() else None
    if parents is None:
        pytest.skip("no per-run cgroups here")
    left = [n for p in parents[1] for n in os.listdir(p) if n.startswith(f"esbatch-sbx-{os.getpid()}-")]
    assert left == []
