"""Starting one program and reading its output: the isolated way (through ``_launcher``) and the unconfined one."""

from __future__ import annotations

import marshal
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from esbatch.sandbox import _cgroup
from esbatch.sandbox._uids import kill_uid, processes_of_uid

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launcher.py")
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
MB = 1 << 20


class SandboxError(RuntimeError):
    """The sandbox could not start the program (or, with ``isolated``, could not isolate it)."""


@dataclass
class Limits:
    timeout_s: float
    cpu_s: int
    memory_mb: int
    file_size_mb: int
    disk_mb: int
    max_files: int
    max_procs: int
    max_output: int


@dataclass
class Outcome:
    returncode: int
    timed_out: bool
    stdout: str
    stderr: str
    stderr_tail: bytes
    memory_killed: bool = False
    memory_peak: int | None = None
    report: dict | None = None


def rlimits(lim: Limits, extra_procs: int = 0) -> list[tuple[int, int, int]]:
    fsize, vm, nproc = lim.file_size_mb * MB, lim.memory_mb * MB, lim.max_procs + extra_procs
    return [
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_CPU, lim.cpu_s, lim.cpu_s + 1),  # SIGXCPU at cpu_s, SIGKILL a second later if caught
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_NPROC, nproc, nproc),
        (resource.RLIMIT_AS, vm, vm),
    ]


def program_env(workdir: str) -> dict[str, str]:
    """Nothing of the evaluator's environment (tokens, keys) reaches the program."""
    return {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir, "PYTHONHASHSEED": "0"}


# ----------------------------------------------------------------------------- reading the output


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it: its pid (= process group id) stays reserved."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _text(buf: bytearray, size: int, cap: int) -> str:
    note = f"\n[... output truncated: {size} bytes in all, the first {cap} kept]" if size > cap else ""
    return buf.decode("utf-8", "replace") + note


def collect(proc: subprocess.Popen, deadline: float, cap: int, on_exit: Callable[[], None], status=None) -> tuple:
    """Read stdout/stderr (and the launcher's ``status`` pipe) until exit and EOF, or the deadline. Keeps the
    first ``cap`` bytes of each stream (and the last 4 kB of stderr, to name the error), and drains and drops
    the rest so the child never blocks. (stdout, stderr, stderr tail, timed out, status bytes)"""
    head, size, tail, reports = {proc.stdout: bytearray(), proc.stderr: bytearray()}, {}, b"", bytearray()
    sel = selectors.DefaultSelector()
    for f in [*head, *([status] if status else [])]:
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
            elif f is status:
                reports += chunk[: max(0, MB - len(reports))]
            else:
                size[f] = size.get(f, 0) + len(chunk)
                head[f] += chunk[: max(0, cap - len(head[f]))]
                tail = (tail + chunk)[-4096:] if f is proc.stderr else tail
    sel.close()
    out, err = (_text(buf, size.get(f, 0), cap) for f, buf in head.items())
    return out, err, tail, timed_out, bytes(reports)


# ----------------------------------------------------------------------------- isolated


def _decode_report(field: str) -> dict | None:
    """The file system report init sent as marshal-ed hex; None when damaged. Not ``ast.literal_eval``: Python
    3.11's parser keeps its recursion depth per interpreter, so parses in two threads at once (``run_many``) can
    raise "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905)."""
    try:
        report = marshal.loads(bytes.fromhex(field))
    except (ValueError, EOFError, TypeError):
        return None
    return report if isinstance(report, dict) else None


def _parse_reports(raw: bytes) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(" ")
        found.setdefault(key, value)
    return found


def _send(proc: subprocess.Popen, data: bytes) -> None:
    """The configuration, unbuffered (a launcher that died early must not make close() raise)."""
    view = memoryview(data)
    with suppress(BrokenPipeError):
        while view:
            view = view[os.write(proc.stdin.fileno(), view) :]
    proc.stdin.close()


def _finish_launcher(proc: subprocess.Popen, status, timed_out: bool) -> bytes:
    """Make sure the launcher (and with it the namespace) is gone; the reports still unread."""
    if timed_out:
        with suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)  # the launcher SIGKILLs init: the whole namespace goes
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # init follows it (parent-death signal)
        proc.wait()
    rest = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(status, selectors.EVENT_READ)
    end = time.monotonic() + 2.0
    while time.monotonic() < end and sel.select(0.1):
        chunk = os.read(status.fileno(), 1 << 16)
        if not chunk:
            break
        rest += chunk
    sel.close()
    return bytes(rest)


def run_isolated(cfg: dict, lim: Limits, cgroup: _cgroup.RunCgroup | None) -> Outcome:
    """Run through the launcher (see ``_launcher``); ``cfg`` is what it reads, but for the status pipe."""
    start = time.monotonic()
    status_r, status_w = os.pipe()
    cfg = {**cfg, "status_fd": status_w, "parent": os.getpid()}
    cmd = [sys.executable or "/usr/bin/python3", "-I", "-S", "-B", LAUNCHER]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc = subprocess.Popen(cmd, **pipes, env=cfg["env"], pass_fds=(status_w,), start_new_session=True, cwd="/")
    finally:
        os.close(status_w)
    with proc, os.fdopen(status_r, "rb", buffering=0) as status:
        data = marshal.dumps(cfg)
        _send(proc, len(data).to_bytes(8, "little") + data)
        out, err, tail, timed_out, raw = collect(proc, start + lim.timeout_s, lim.max_output, lambda: None, status)
        raw += _finish_launcher(proc, status, timed_out)
    reports = _parse_reports(raw)
    if "error" in reports:
        raise SandboxError(f"the sandbox could not start the program: {reports['error']}")
    if "init" not in reports and not timed_out:
        raise SandboxError(f"the sandbox launcher failed (exit {proc.returncode}): {err[-2000:]}")
    peak = int(reports["peak"]) if "peak" in reports else None
    memory_killed = "memory" in reports
    if cgroup is not None:
        peak, kills = cgroup.usage()
        memory_killed = memory_killed or kills > 0
    rc = os.waitstatus_to_exitcode(int(reports["status"])) if "status" in reports else -signal.SIGKILL
    report = _decode_report(reports["report"]) if "report" in reports else None
    return Outcome(rc, timed_out, out, err, tail, memory_killed, peak, report)


# ----------------------------------------------------------------------------- unconfined


def _preexec(uid: int | None, limits: list) -> Callable[[], None]:
    def setup() -> None:
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        # Limits last: an address-space limit below what this forked copy of the parent already maps would
        # make the code above fail. The address space is replaced at exec, which is what the limit is for.
        for res, soft, hard in limits:
            resource.setrlimit(res, (soft, hard))

    return setup


def run_unconfined(exe: str, workdir: str, code: str, uid: int | None, lim: Limits) -> Outcome:
    """No namespaces: a new session killed as a whole group, rlimits, and a uid of its own when we are root."""
    start = time.monotonic()
    with open(os.path.join(workdir, "main.py"), "w") as f:
        f.write(code)
    if uid is not None:
        os.chown(workdir, uid, uid)

    def kill_group() -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if uid is not None and processes_of_uid(uid):
            kill_uid(uid)

    # -s -B rather than -I: -I implies -E, which would ignore PYTHONHASHSEED; the environment is replaced
    # wholesale anyway, so the parent's PYTHON* variables never reach the child.
    proc = subprocess.Popen(
        [exe, "-s", "-B", "main.py"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=workdir,
        env=program_env(workdir),
        start_new_session=True,
        preexec_fn=_preexec(uid, rlimits(lim)),
    )
    with proc:
        try:
            out, err, tail, timed_out, _ = collect(proc, start + lim.timeout_s, lim.max_output, kill_group)
        finally:
            kill_group()  # while the child is unreaped, so its process group id cannot be reused
            proc.wait()
    return Outcome(proc.returncode, timed_out, out, err, tail)
