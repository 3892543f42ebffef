"""The hostile-program suite (no tests here: ``test_sandbox_hostile.py`` runs it as root and as ``nobody``).

Run as ``python test_sandbox_programs.py OUT.jsonl`` by an evaluator process of the user under test, with
``esbatch.sandbox`` importable. Standard library only: the unprivileged run uses the system interpreter and a
copy of the package. Each program runs in ``run_python``; after each one the runner checks the verdict, that
it is still alive itself (it writes the next line), that a bystander process of its own user is alive, and
that no process of the program is left. One JSON line per program, a header line first and ``done`` last.

The environment names what to attack: ``HOME`` holds ``private/token`` (a secret the program must not read)
and ``ESBATCH_SUITE_SECRET`` is in the runner's own environment (for /proc snooping).
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

CASES: dict[str, Callable] = {}
HOSTILE = {"timeout_s": 3.0, "cpu_s": 2}
#: A safety limit, not an expectation: these runs end in a few seconds (their own limits fire at 1.5-4 s). A run
#: over it means the sandbox waited for the program (a sleep of 1000 s, a daemon of 999 s) instead of ending it.
#: Minutes, so a loaded machine never reaches it.
SAFETY_S = 120.0
#: The wall limit of programs that must end on their own: far above their ~0.2 s, so load never reaches it, and far
#: below the leftover daemon's 999 s, so a sandbox that waited for the daemon times out (not ok).
ENDS_ON_ITS_OWN_S = 60.0


def case(fn: Callable) -> Callable:
    CASES[fn.__name__] = fn
    return fn


def _failed_with(r, *texts: str) -> list[str]:
    """The program must have failed, naming one of ``texts`` in its stderr."""
    if r.ok:
        return [f"expected a failure, got ok (stdout {r.stdout[:200]!r})"]
    if texts and not any(t in r.stderr for t in texts):
        return [f"expected one of {texts} in stderr, got {r.stderr[-300:]!r}"]
    return []


def _ok_with(r, stdout: str) -> list[str]:
    return [] if r.ok and r.stdout == stdout else [f"expected ok with {stdout!r}, got {r.reason}: {r.stdout[:200]!r}"]


def _daemon(ctx: dict) -> str:
    """Code that leaves a process behind running ``sleep <marker>`` (the runner looks for the marker)."""
    return f"os.execv('/bin/sleep', ['sleep', '{ctx['marker']}'])"


# ----------------------------------------------------------------------------- signals and processes


@case
def kill_parent(ctx):
    """Its parent is its namespace's init: a root one it may not signal, or one of its own user that ignores it."""
    code = "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept PermissionError:\n"
    code += "    print('refused')\nprint('after')"
    return code, {}, lambda r: _ok_with(r, "refused\nafter\n" if r.uid is not None else "after\n")


@case
def kill_evaluator_by_pid(ctx):
    code = f"import os, signal\ntry:\n    os.kill({ctx['evaluator']}, signal.SIGKILL)\nexcept OSError as e:\n"
    code += "    print(type(e).__name__)"
    return code, {}, lambda r: _ok_with(r, "ProcessLookupError\n")


@case
def kill_bystander_by_pid(ctx):
    code = f"import os, signal\ntry:\n    os.kill({ctx['bystander']}, signal.SIGKILL)\nexcept OSError as e:\n"
    code += "    print(type(e).__name__)"
    return code, {}, lambda r: _ok_with(r, "ProcessLookupError\n")


@case
def kill_minus_one(ctx):
    """kill(-1) spares the caller and init: it reaches only the program's own tree (here: one child)."""
    code = "import os, signal, time\npid = os.fork()\nif pid == 0:\n    time.sleep(30)\n    os._exit(0)\n"
    code += "time.sleep(0.2)\nos.kill(-1, signal.SIGKILL)\nprint('after', os.waitpid(pid, 0)[1])"
    return code, {}, lambda r: _ok_with(r, "after 9\n")


@case
def setsid_double_fork(ctx):
    code = f"import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        {_daemon(ctx)}\n"
    code += "    os._exit(0)\nos.wait()\nprint('parent done')"
    return code, {"timeout_s": ENDS_ON_ITS_OWN_S}, lambda r: _ok_with(r, "parent done\n")  # ok: not timed out


@case
def child_sleeps_past_wall_limit(ctx):
    code = f"import os\nif os.fork() == 0:\n    {_daemon(ctx)}\nprint('parent exits')"
    return code, {"timeout_s": ENDS_ON_ITS_OWN_S}, lambda r: _ok_with(r, "parent exits\n")  # ok: not timed out


@case
def fork_bomb(ctx):
    return "import os\nwhile True: os.fork()", HOSTILE, lambda r: _failed_with(r) + _quick(r)


@case
def setsid_fork_bomb(ctx):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    while True:\n        try: os.fork()\n"
    code += "        except OSError: pass\nelse:\n    time.sleep(1000)"
    return code, HOSTILE, lambda r: _failed_with(r) + _quick(r)


@case
def thread_bomb(ctx):
    code = "import threading, time\nn = 0\ntry:\n    while True:\n"
    code += "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n        n += 1\n"
    code += "finally:\n    print(n)"

    def check(r):
        started = int(r.stdout.split()[0]) if r.stdout.split() else -1
        return _failed_with(r, "can't start new thread") + _quick(r) + ([] if started < 64 else [f"{started}"])

    return code, HOSTILE, check


@case
def ignores_sigterm(ctx):
    code = "import signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
    code += "    signal.signal(s, signal.SIG_IGN)\ntime.sleep(1000)"

    def check(r):
        # killed by the wall limit (SIGKILL, which it cannot ignore), not before it (load only lengthens wall_s),
        # and not after the program's own 1000 s sleep (SAFETY_S)
        ok = r.timed_out and r.reason == "timeout" and 1.4 < r.wall_s < SAFETY_S
        return [] if ok else [f"{r.reason} {r.wall_s:.1f}s"]

    return code, {"timeout_s": 1.5}, check


@case
def infinite_loop(ctx):
    check = lambda r: _failed_with(r) + ([] if r.reason in ("cpu limit", "timeout") else [r.reason]) + _quick(r)
    return "while True: pass", {"timeout_s": 4.0, "cpu_s": 1}, check


@case
def infinite_output(ctx):
    def check(r):
        good = r.timed_out and "output truncated" in r.stdout and len(r.stdout) < 5_200
        return [] if good else [f"{r.reason}, {len(r.stdout)} chars"]

    return "while True: print('y' * 1000)", {"timeout_s": 2.0, "max_output": 5_000}, check


# ----------------------------------------------------------------------------- memory and disk


@case
def memory_spread_over_children(ctx):
    """Five children of 150 MB each under memory_mb=256: each is below the per-process limit, the tree is not."""
    code = "import os, sys, time\nkids = []\nfor _ in range(5):\n    pid = os.fork()\n    if pid == 0:\n"
    code += "        x = b'1' * (150 << 20)\n        print('got', flush=True)\n"
    code += "        time.sleep(5)\n        os._exit(0)\n"
    code += "    kids.append(pid)\nsys.exit(max(os.waitpid(k, 0)[1] for k in kids) != 0)"

    def check(r):
        problems = _failed_with(r) + ([] if r.reason == "memory" else [f"reason {r.reason}"])
        if r.stdout.count("got") >= 5:
            problems.append("all five children got their 150 MB")
        if r.memory_peak_mb is not None and r.memory_peak_mb > 256 + 16 + 160:  # one allocation between polls
            problems.append(f"peak {r.memory_peak_mb:.0f} MB")
        return problems

    return code, {"memory_mb": 256, "timeout_s": 8.0}, check


@case
def memory_bomb_one_process(ctx):
    check = lambda r: _failed_with(r, "MemoryError") + ([] if r.reason == "memory" else [r.reason])
    return "x = bytearray(10**10)", {"memory_mb": 256, **HOSTILE}, check


@case
def ten_files_of_15_mb(ctx):
    code = "for i in range(10):\n    with open(f'f{i}', 'wb') as f:\n        f.write(b'0' * (15 << 20))"
    return code, {"file_size_mb": 16, "timeout_s": 10.0}, lambda r: _failed_with(r, "No space left on device")


@case
def many_small_files(ctx):
    code = "for i in range(10**6):\n    open(f'f{i}', 'w').close()"
    return code, {"timeout_s": 10.0}, lambda r: _failed_with(r, "No space left on device") + _quick(r)


# ----------------------------------------------------------------------------- files and snooping


@case
def read_private_token(ctx):
    code = f"print(open({ctx['token_path']!r}).read())"
    return code, {}, lambda r: _failed_with(r, "FileNotFoundError", "PermissionError") + _no_secret(r, ctx)


@case
def list_home(ctx):
    code = f"import os\nfor root, dirs, files in os.walk({ctx['home']!r}):\n    print(root, dirs, files)"
    return code, {}, lambda r: [] if "token" not in r.stdout and r.ok else [f"{r.reason}: {r.stdout[:300]!r}"]


@case
def write_outside_workdir(ctx):
    targets = [os.path.join(ctx["home"], f"escape-{ctx['marker']}"), f"/tmp/escape-{ctx['marker']}"]
    targets.append(f"/dev/shm/escape-{ctx['marker']}")
    code = f"import sys\nbad = 0\nfor t in {targets!r}:\n    try:\n        open(t, 'w').write('x')\n        bad += 1\n"
    code += "    except OSError as e:\n        print(t, type(e).__name__)\nsys.exit(bad)"

    def check(r):
        leaked = [t for t in targets if os.path.exists(t)]
        return ([] if r.ok and r.stdout.count("Error") == 3 else [f"{r.reason}: {r.stdout!r}"]) + leaked

    return code, {}, check


@case
def proc_snooping(ctx):
    code = "import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\nprint('visible', len(pids))\n"
    code += f"for p in [{ctx['evaluator']!r}, *pids]:\n    for f in ('environ', 'cmdline'):\n        try:\n"
    code += "            print(p, f, open(f'/proc/{p}/{f}', 'rb').read())\n        except OSError as e:\n"
    code += "            print(p, f, type(e).__name__)"

    def check(r):
        visible = int(r.stdout.split()[1]) if r.stdout.startswith("visible") else 999
        return _no_secret(r, ctx) + ([] if r.ok and visible <= 2 else [f"{r.reason}, {visible} processes visible"])

    return code, {}, check


@case
def nested_namespace_unmount(ctx):
    """A new user + mount namespace of its own, then unmount the tmpfs over HOME and remount / read-write."""
    code = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    code += "print('unshare', libc.unshare(0x10000000 | 0x00020000))\n"
    code += f"print('umount', libc.umount2({ctx['home']!r}.encode(), 2), libc.umount2(b'/root', 2))\n"
    code += "print('remount', libc.mount(None, b'/', None, 0x20 | 0x1000, None))\n"
    code += f"print(open({ctx['token_path']!r}).read())"

    def check(r):
        refused = r.stdout.startswith("unshare -1\n")  # no user namespace may be made inside the sandbox
        return _failed_with(r, "FileNotFoundError", "PermissionError") + _no_secret(r, ctx) + [r.stdout] * (not refused)

    return code, {}, check


@case
def terminals_and_sockets(ctx):
    """The user's terminals (/dev/pts) and the sockets under /run (agents, databases, munge) are hidden."""
    code = "import glob\nprint(sorted(glob.glob('/dev/pts/*') + glob.glob('/run/*') + glob.glob('/var/run/*')))"
    return code, {}, lambda r: _ok_with(r, "[]\n")


# ----------------------------------------------------------------------------- network


@case
def tcp_to_evaluator_host(ctx):
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {ctx['port']}), timeout=2).sendall(b'hi')"
    return code, {"timeout_s": 5.0}, lambda r: _failed_with(r, "OSError", "Error")


@case
def tcp_to_the_internet(ctx):
    code = "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)"
    return code, {"timeout_s": 5.0}, lambda r: _failed_with(r, "OSError", "Error")


@case
def abstract_unix_socket(ctx):
    code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({ctx['abstract']!r})\ns.sendall(b'hi')"
    return code, {}, lambda r: _failed_with(r, "Error")


# ----------------------------------------------------------------------------- the runner


def _quick(r) -> list[str]:
    """The run ended within SAFETY_S (a safety limit, see there): the sandbox did not wait for the program."""
    return [] if r.wall_s < SAFETY_S else [f"took {r.wall_s:.1f}s (safety limit {SAFETY_S}s)"]


def _no_secret(r, ctx) -> list[str]:
    leaked = [s for s in (ctx["token"], ctx["env_secret"]) if s in r.stdout or s in r.stderr]
    return [f"secret leaked: {s}" for s in leaked]


def _cmdlines() -> dict[int, bytes]:
    found = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                found[int(d)] = f.read()
        except OSError:
            pass
    return found


def _leftovers(r, marker: str, before: set[int]) -> list[str]:
    """Processes of the program still alive: the marker's, the run's uid's (root), new ones of our uid (not root)."""
    from esbatch.sandbox import processes_of_uid

    def alive() -> list[int]:
        left = [pid for pid, cmd in _cmdlines().items() if marker.encode() in cmd and pid != os.getpid()]
        if r.uid is not None:
            left += processes_of_uid(r.uid)
        if os.getuid() != 0:
            left += sorted(set(processes_of_uid(os.getuid())) - before)
        return sorted(set(left))

    # The kernel kills what is left in the program's PID namespace as its init exits, but a process may not have
    # ended yet when we look: wait on each one's pidfd (readable once it has exited) instead of polling /proc. A
    # real leftover (a daemon sleeping 999 s) is still running when the safety limit runs out.
    fds: dict[int, int] = {}
    for pid in alive():
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:  # ended between the listing and here
            pass
    try:
        pending, deadline = dict(fds), time.monotonic() + SAFETY_S
        while pending and (wait := deadline - time.monotonic()) > 0:
            for fd in select.select(list(pending), [], [], wait)[0]:
                pending.pop(fd)
        left = sorted(pending.values())
    finally:
        for fd in fds:
            os.close(fd)
    return [f"process {pid} left: {_cmdlines().get(pid, b'?')[:80]!r}" for pid in left]


def _servers(ctx: dict) -> tuple[socket.socket, socket.socket]:
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    unix = socket.socket(socket.AF_UNIX)
    ctx["abstract"] = "\0esbatch-suite-" + uuid.uuid4().hex
    unix.bind(ctx["abstract"])
    unix.listen(8)
    unix.setblocking(False)
    ctx["port"] = tcp.getsockname()[1]
    return tcp, unix


def _accepted(servers) -> list[str]:
    got = []
    for s in servers:
        try:
            s.accept()[0].close()
            got.append(f"a program connected to the evaluator's {s.family.name} server")
        except BlockingIOError:
            pass
    return got


def _context() -> dict:
    home = os.environ["HOME"]
    token_path = os.path.join(home, "private", "token")
    with open(token_path) as f:
        token = f.read().strip()
    return {"home": home, "token_path": token_path, "token": token, "evaluator": os.getpid()}


def _run_case(name: str, ctx: dict, bystander: subprocess.Popen, servers) -> dict:
    from esbatch.sandbox import processes_of_uid, run_python

    ctx["marker"] = f"999.{uuid.uuid4().int % 10**12}"  # `sleep 999.<digits>`: unique in any process list
    before = set(processes_of_uid(os.getuid())) if os.getuid() != 0 else set()
    code, kwargs, check = CASES[name](ctx)
    r = run_python(code, **kwargs)
    problems = check(r) + _leftovers(r, ctx["marker"], before) + _accepted(servers)
    if bystander.poll() is not None:
        problems.append(f"the bystander process died ({bystander.returncode})")
    if not r.isolated:
        problems.append("the program did not run isolated")
    fields = ("ok", "reason", "returncode", "timed_out", "uid", "isolated", "memory_peak_mb")
    result = {k: getattr(r, k) for k in fields} | {"wall_s": round(r.wall_s, 2)}
    return {"name": name, "problems": problems, "result": result, "stdout": r.stdout[:300], "stderr": r.stderr[-300:]}


def main(out_path: str, names: list[str]) -> None:
    from esbatch.sandbox import isolation_report

    ctx = _context()
    ctx["env_secret"] = os.environ["ESBATCH_SUITE_SECRET"]
    servers = _servers(ctx)
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    bystander = subprocess.Popen(["sleep", "600"], **quiet)  # must not hold our output open if we fail
    ctx["bystander"] = bystander.pid
    try:
        with open(out_path, "a") as out:
            header = {"uid": os.getuid(), "report": isolation_report(), "python": sys.executable}
            out.write(json.dumps({"name": "header", **header}) + "\n")
            for name in names or list(CASES):
                out.write(json.dumps(_run_case(name, ctx, bystander, servers)) + "\n")
                out.flush()
            out.write(json.dumps({"name": "done"}) + "\n")
    finally:
        bystander.kill()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
