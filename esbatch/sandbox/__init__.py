"""Run untrusted, model-generated Python (e.g. MBPP answers) in a contained child process.

Each layer stops a specific way a program can hurt the evaluator or the machine:

- Its own process in a new session, killed as a whole group: the parent enforces the wall-time limit
  even if the program ignores signals or sleeps (RLIMIT_CPU does not count sleeping).
- ``resource`` limits (CPU, address space, file size, processes, no core dumps): an infinite loop, a
  memory bomb or a huge file fails inside the child.
- An unprivileged uid when the parent is root. The kernel does not enforce RLIMIT_NPROC for root, and
  root may read any file and signal any process. Each concurrent run leases its own uid from a private
  range (``UID_BASE`` + 64 per parent pid), so runs never share a fork budget, cannot signal each other,
  and every process left behind (also one that escaped the group with ``setsid``) is killed by uid.
  A non-root parent cannot switch uids: the program runs as the parent's user, so it could signal the
  parent's other processes, and processes that leave the process group can outlive the run.
- New network and mount namespaces: no network at all (a loopback that is down), and every mount
  read-only except the working directory, so world-writable places such as /tmp and /dev/shm are
  closed too. Non-root parents get them through a user namespace. Where the kernel forbids namespaces
  the program runs anyway and the result says ``network_isolated=False``.
- A fresh working directory (deleted afterwards) and a minimal environment: HOME and TMPDIR point at
  that directory and nothing of the parent's environment (tokens, keys) reaches the program.
- stdin is /dev/null; stdout/stderr are read incrementally and only the first ``max_output`` bytes kept.

Files readable by everybody (the standard library, /etc/passwd) remain readable.
"""

from __future__ import annotations

import ctypes
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import cache

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x1, 0x20, 0x1000, 0x4000, 0x40000
# nosuid, nodev, noexec, noatime, nodiratime, relatime: the same bits in statvfs().f_flag and mount(2). A
# read-only remount must repeat them, or a user namespace refuses it (they are locked there).
_KEEP_FLAGS = 0x2 | 0x4 | 0x8 | 0x400 | 0x800 | 0x1000
UID_BASE = int(os.environ.get("ESBATCH_SANDBOX_UID_BASE", "2000000000"))
UIDS_PER_PARENT = 64
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]


@dataclass
class SandboxResult:
    ok: bool  # exited 0, not timed out, not killed
    returncode: int | None  # negative: killed by that signal
    timed_out: bool
    stdout: str
    stderr: str
    wall_s: float
    reason: str  # "ok", "timeout", "cpu limit", "memory", "killed by signal SIGKILL", "exit 1", ...
    network_isolated: bool = False  # network + read-only filesystem namespaces were in force
    uid: int | None = None  # the unprivileged uid it ran as (root parents only)


# ----------------------------------------------------------------------------- in the child, before exec


def _mount(src: str | None, target: str, flags: int) -> None:
    if _libc.mount(src and src.encode(), target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _isolate(workdir: str, new_net: bool) -> None:
    """New mount (and network) namespace where everything but ``workdir`` is read-only."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | (CLONE_NEWNET if new_net else 0) | (0 if uid == 0 else CLONE_NEWUSER)
    if _libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")
    if uid != 0:  # map our own ids 1:1, else the namespace cannot create files or mount
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _mount(None, "/", MS_REC | MS_PRIVATE)  # nothing done below propagates back to the host
    _mount(workdir, workdir, MS_BIND)  # the working directory becomes its own mount and stays writable
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    for p in dict.fromkeys(points):
        if p != workdir and not (flag := os.statvfs(p).f_flag) & MS_RDONLY:
            _mount(None, p, MS_REMOUNT | MS_BIND | MS_RDONLY | (flag & _KEEP_FLAGS))


def _preexec(workdir: str, uid: int | None, isolate: bool, new_net: bool, limits: list) -> Callable[[], None]:
    def setup() -> None:
        if isolate:
            _isolate(workdir, new_net)  # needs privileges: before the uid drop
        os.chdir(workdir)  # after the bind mount, so the cwd is the writable mount, not the read-only one below
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        # Limits last: lowering needs no privilege, and an address-space limit below what this forked copy
        # of the parent already maps would make the Python code above fail. The address space is replaced
        # at exec, which is what the limit is for.
        for res, soft, hard in limits:
            resource.setrlimit(res, (soft, hard))

    return setup


# ----------------------------------------------------------------------------- in the parent

_pool = threading.Condition()
_free_uids: list[int] = []
_pool_pid: int | None = None


def _processes() -> list[tuple[int, int, bool]]:
    """(pid, real uid, is a zombie) of every process, from /proc."""
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        with suppress(OSError, KeyError, ValueError):
            with open(f"/proc/{d}/status") as f:
                st = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
            found.append((int(d), int(st["Uid"].split()[0]), st["State"].strip().startswith("Z")))
    return found


def processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real uid is ``uid``."""
    return [pid for pid, u, zombie in _processes() if u == uid and not zombie]


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: a helper becomes ``uid`` and calls kill(-1), which the kernel applies
    to exactly the processes that uid may signal (its own), atomically, so a fork bomb cannot outrun it."""

    def kill_all() -> None:
        with suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)

    true = shutil.which("true", path=SAFE_PATH) or "/bin/true"
    for _ in range(50):
        if not processes_of_uid(uid):
            return
        with suppress(OSError, subprocess.SubprocessError):  # Popen switches uid before preexec_fn runs
            subprocess.run([true], user=uid, group=uid, extra_groups=[], preexec_fn=kill_all, timeout=10)
        time.sleep(0.01)


@contextmanager
def _lease_uid() -> Iterator[int | None]:
    """One unprivileged uid for the duration of a run (None unless the parent is root); leftovers are killed."""
    global _pool_pid
    if os.geteuid() != 0:
        yield None
        return
    with _pool:
        if _pool_pid != os.getpid():  # first use, or a forked copy of the parent: its own range
            _pool_pid = os.getpid()
            base = UID_BASE + (_pool_pid % 4096) * UIDS_PER_PARENT
            _free_uids[:] = range(base, base + UIDS_PER_PARENT)
        while not _free_uids:
            _pool.wait()
        # Killed orphans stay zombies until init reaps them, and zombies still count against RLIMIT_NPROC:
        # take the least recently used uid that has no process at all.
        busy = {u for _, u, _ in _processes()}
        uid = next((u for u in _free_uids if u not in busy), _free_uids[0])
        _free_uids.remove(uid)
    try:
        yield uid
    finally:
        _kill_uid(uid)
        with _pool:
            _free_uids.append(uid)
            _pool.notify()


@cache
def network_isolation_available() -> bool:
    """Whether the kernel lets us create the network + mount namespaces (probed once with a no-op child)."""
    d = os.path.realpath(tempfile.mkdtemp(prefix="esbatch_sbx_probe_"))
    try:
        true = shutil.which("true", path=SAFE_PATH) or "/bin/true"
        subprocess.run([true], preexec_fn=lambda: _isolate(d, True), check=True, timeout=30, stdin=subprocess.DEVNULL)
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(d, ignore_errors=True)


@cache
def sandbox_python() -> str:
    """``sys.executable`` if the sandbox uid may run it, else the system python3 (a venv under /root,
    mode 700, cannot be executed by an unprivileged uid). Programs only get the standard library."""
    candidates = [sys.executable, os.path.realpath(sys.executable), shutil.which("python3", path=SAFE_PATH)]
    for exe in dict.fromkeys(c for c in candidates if c):
        with suppress(OSError, subprocess.SubprocessError):
            if run_python("import sys", python=exe, timeout_s=30).ok:
                return exe
    raise RuntimeError(f"no Python interpreter runs inside the sandbox (tried {candidates})")


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it: its pid (= process group id) stays reserved."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _collect(proc: subprocess.Popen, deadline: float, cap: int, on_exit: Callable[[], None]) -> tuple:
    """Read stdout/stderr until exit and EOF, or the deadline. Keeps the first ``cap`` bytes of each stream
    (and the last 4 kB of stderr, to name the error), and drains and drops the rest so the child never blocks."""
    head, size, tail = {proc.stdout: bytearray(), proc.stderr: bytearray()}, {proc.stdout: 0, proc.stderr: 0}, b""
    sel = selectors.DefaultSelector()
    for f in head:
        sel.register(f, selectors.EVENT_READ)
    exited_at = None
    while True:
        now = time.monotonic()
        if exited_at is None and _exited(proc.pid):
            exited_at = now
            on_exit()  # kill what it left behind, so nothing keeps the pipes open
        if exited_at is not None and (not sel.get_map() or now > exited_at + 2.0):
            timed_out = False
            break
        if now >= deadline:
            timed_out = True
            break
        for key, _ in sel.select(min(0.05, deadline - now)):  # an empty selector just waits
            f, chunk = key.fileobj, os.read(key.fd, 1 << 16)
            if not chunk:
                sel.unregister(f)
            size[f] += len(chunk)
            head[f] += chunk[: max(0, cap - len(head[f]))]
            tail = (tail + chunk)[-4096:] if f is proc.stderr else tail
    sel.close()
    out, err = (
        buf.decode("utf-8", "replace")
        + (f"\n[... output truncated: {size[f]} bytes in all, the first {cap} kept]" if size[f] > cap else "")
        for f, buf in head.items()
    )
    return out, err, tail, timed_out


def _reason(rc: int, timed_out: bool, stderr_tail: bytes) -> str:
    if timed_out:
        return "timeout"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        return {"SIGXCPU": "cpu limit", "SIGXFSZ": "file size limit"}.get(name, f"killed by signal {name}")
    if rc != 0:
        return "memory" if b"MemoryError" in stderr_tail else f"exit {rc}"
    return "ok"


def _rlimits(cpu_s: int, memory_mb: int, file_size_mb: int, max_procs: int) -> list[tuple[int, int, int]]:
    mb = 1 << 20
    return [
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),  # SIGXCPU at cpu_s, SIGKILL a second later if it is caught
        (resource.RLIMIT_FSIZE, file_size_mb * mb, file_size_mb * mb),
        (resource.RLIMIT_NPROC, max_procs, max_procs),
        (resource.RLIMIT_AS, memory_mb * mb, memory_mb * mb),
    ]


def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    cpu_s: int = 5,
    memory_mb: int = 512,
    file_size_mb: int = 16,
    max_procs: int = 32,
    max_output: int = 64_000,
    network: bool = False,
    python: str | None = None,
) -> SandboxResult:
    """Run ``code`` as a script in the sandbox. Whatever the program does is reported in the result; only a
    sandbox that cannot start (no usable interpreter, exec refused) raises."""
    exe = python or sandbox_python()
    isolate = network_isolation_available()
    limits = _rlimits(cpu_s, memory_mb, file_size_mb, max_procs)
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="esbatch_sbx_"))  # as /proc/self/mountinfo spells it
    start = time.monotonic()
    try:
        with _lease_uid() as uid:
            with open(os.path.join(workdir, "main.py"), "w") as f:
                f.write(code)
            if uid is not None:
                os.chown(workdir, uid, uid)
            env = {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir, "PYTHONHASHSEED": "0"}

            def kill_group() -> None:
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                if uid is not None:
                    _kill_uid(uid)

            # -s -B rather than -I: -I implies -E, which would ignore PYTHONHASHSEED; the environment is
            # replaced wholesale anyway, so the parent's PYTHON* variables never reach the child.
            proc = subprocess.Popen(
                [exe, "-s", "-B", "main.py"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
                preexec_fn=_preexec(workdir, uid, isolate, not network, limits),
            )
            try:
                out, err, tail, timed_out = _collect(proc, start + timeout_s, max_output, kill_group)
            finally:
                kill_group()  # while the child is unreaped, so its process group id cannot be reused
                rc = proc.wait()
                proc.stdout.close()
                proc.stderr.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    reason = _reason(rc, timed_out, tail)
    wall = time.monotonic() - start
    return SandboxResult(reason == "ok", rc, timed_out, out, err, wall, reason, isolate and not network, uid)


def run_many(programs: list[str], *, workers: int | None = None, **limits) -> list[SandboxResult]:
    """``run_python`` over many programs, one thread driving one child each; results in input order."""
    if not programs:
        return []
    sandbox_python(), network_isolation_available()  # probe once, before the threads
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda code: run_python(code, **limits), programs))
