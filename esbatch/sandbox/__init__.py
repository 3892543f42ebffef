"""Run untrusted, model-generated Python (e.g. MBPP answers) in a contained child process (``run_python``).

Layers (process tree: ``_launcher``; ``isolation_report()`` says which are in force, to log with a run):
- its own user (user namespace, or for a root evaluator a uid locked per evaluator, ``_uids``): no capabilities,
  ``no_new_privs``, no further user namespace, a fresh keyring; RLIMIT_NPROC caps its tasks at ``max_procs``;
- a PID namespace: it sees no other process; its exit, or the wall-time SIGKILL of init, kills the whole tree;
- a cgroup capping the tree's memory and pids (``_cgroup``; else init polls memory), plus per-process rlimits;
- mount, network (loopback down) and IPC namespaces: a capped tmpfs working folder, $HOME, /tmp, /run, ... and
  ``ESBATCH_SANDBOX_HIDE`` (colon-separated) hidden, all else read-only; a minimal environment, stdin /dev/null.
Where namespaces are refused it raises ``SandboxError`` unless ``allow_unconfined=True`` (rlimits, session and uid
only; results say ``isolated=False``). No defence against kernel exploits; what stays reachable: docs/limits.md.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

from esbatch.sandbox import _cgroup
from esbatch.sandbox._run import (
    MB,
    SAFE_PATH,
    Limits,
    Outcome,
    SandboxError,
    program_env,
    rlimits,
    run_isolated,
    run_unconfined,
)
from esbatch.sandbox._uids import lease_uid, processes_of_uid, uid_block

__all__ = [
    "SandboxError",
    "SandboxResult",
    "isolation_report",
    "network_isolation_available",
    "processes_of_uid",
    "run_many",
    "run_python",
    "sandbox_python",
]
# /run: the user's agents (/run/user), database and munge sockets; /dev/pts: the user's terminals
HIDDEN = ("/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/dev/pts", "/run", "/var/run")


@dataclass
class SandboxResult:
    ok: bool  # exited 0, not timed out, not killed
    returncode: int | None  # negative: killed by that signal
    timed_out: bool
    stdout: str
    stderr: str
    wall_s: float
    reason: str  # "ok", "timeout", "cpu limit", "memory", "killed by signal SIGKILL", "exit 1", ...
    network_isolated: bool = False  # no network (a network namespace of its own) was in force
    uid: int | None = None  # the unprivileged uid it ran as (root parents only)
    isolated: bool = False  # every layer of the module docstring was in force (network: unless asked for)
    memory_peak_mb: float | None = None  # the tree's peak (cgroup) or the largest total init saw (polled)


# ----------------------------------------------------------------------------- what the program may see


def _hidden_paths() -> list[str]:
    """The folders covered by an empty tmpfs, as real paths."""
    homes = [os.path.expanduser("~"), tempfile.gettempdir()]
    try:
        homes.append(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        pass
    extra = os.environ.get("ESBATCH_SANDBOX_HIDE", "").split(":")
    found = {os.path.realpath(p) for p in [*homes, *HIDDEN, *extra] if p and os.path.isabs(p)}
    return sorted(p for p in found if p != "/" and os.path.isdir(p))


def _visible_prefixes(exe: str, hidden: list[str]) -> list[str]:
    """The interpreter's folders (a venv's and its base installation's) that a hidden folder would cover."""
    under = lambda p, d: p.startswith(d.rstrip("/") + "/")
    prefixes = {os.path.dirname(os.path.dirname(p)) for p in (os.path.abspath(exe), os.path.realpath(exe))}
    return sorted(p for p in prefixes if any(under(p, h) for h in hidden) and not any(under(h, p) for h in hidden))


def _config(code: str, argv: list[str], workdir: str, uid: int | None, lim: Limits, network: bool) -> dict:
    hidden = _hidden_paths()
    root = os.geteuid() == 0
    return {
        "new_user": not root,
        "new_net": not network,
        "uid": uid,
        "workdir": workdir,
        "code": code,
        "argv": argv,
        "env": program_env(workdir),
        "hide": hidden,
        "keep": _visible_prefixes(argv[0], hidden),
        "disk_bytes": lim.disk_mb * MB,
        "inodes": lim.max_files,
        "rlimits": rlimits(lim),  # the program has a user namespace of its own: NPROC counts only its tasks
    }


# ----------------------------------------------------------------------------- probes


def _isolated_run(code: str, argv: list[str], lim: Limits, network: bool) -> tuple[Outcome, int | None]:
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="esbatch_sbx_"))  # stays empty: a tmpfs covers it
    try:
        with lease_uid(contained=True) as uid:
            try:
                cg = _cgroup.create((lim.memory_mb + lim.disk_mb) * MB, lim.max_procs)
            except OSError:  # the cgroups worked at the probe but not now: init's own accounting takes over
                cg = None
            try:
                cfg = _config(code, argv, workdir, uid, lim, network)
                cfg.update(cgroup_procs=cg.procs if cg else [], oom_file=cg.oom_file if cg else None)
                cfg.update(memory_limit=None if cg else lim.memory_mb * MB)
                return run_isolated(cfg, lim, cg), uid
            finally:
                if cg is not None:
                    cg.remove()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@cache
def _probe() -> tuple[str | None, dict]:
    """(what is missing or None, the launcher's report), from a no-op program run with every layer. A program
    that cannot join its cgroup (a v2 folder delegated without its ancestors) falls back to accounting."""
    true = shutil.which("true", path=SAFE_PATH) or "/bin/true"
    lim = Limits(30.0, 5, 256, 16, 16, 64, 32, 4096)
    for _ in range(2):
        try:
            out, _ = _isolated_run("", [true], lim, network=False)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            if "cgroup" in str(e) and _cgroup.mode() is not None:
                _cgroup.disable()
                continue
            return str(e), {}
        if out.returncode != 0:
            return f"a no-op program failed in the sandbox ({out.returncode}): {out.stderr[-500:]}", {}
        return None, out.report or {}
    return "the sandbox failed twice", {}


def isolation_report() -> dict[str, str | bool]:
    """What is in force for the programs run here (flat, to log as run parameters)."""
    missing, report = _probe()
    root = os.geteuid() == 0
    memory = _cgroup.mode() or "accounting: init polls the namespace's memory (RssAnon+RssShmem) every 10 ms"
    block = uid_block() if root and missing is None else None
    return {
        "isolated": missing is None,
        "missing": missing or "",
        "user": "a leased unprivileged uid (root evaluator)" if root else "unprivileged user namespace",
        "uid_block": f"{block.start}-{block.stop - 1}" if block else "",
        "pid_namespace": missing is None,
        "network_namespace": missing is None,
        "mount_namespace": missing is None,
        "ipc_namespace": missing is None,
        "proc": "fresh /proc of the PID namespace" if missing is None else "the host's",
        "tree_limits": (memory + " + RLIMIT_AS/CPU/FSIZE/NPROC per process") if missing is None else "rlimits only",
        "workdir": "size- and inode-capped tmpfs" if missing is None else "host temporary folder",
        "hidden": ":".join(report.get("hidden", [])),
    }


def network_isolation_available() -> bool:
    """Whether programs run isolated here (network namespace and the rest; kept for earlier callers)."""
    return _probe()[0] is None


@cache
def sandbox_python() -> str:
    """``sys.executable`` if it runs inside the sandbox, else the system python3."""
    candidates = [sys.executable, os.path.realpath(sys.executable), shutil.which("python3", path=SAFE_PATH)]
    for exe in dict.fromkeys(c for c in candidates if c):
        try:
            if run_python("import sys", python=exe, timeout_s=30, allow_unconfined=True).ok:
                return exe
        except (OSError, RuntimeError, subprocess.SubprocessError):
            continue
    raise SandboxError(f"no Python interpreter runs inside the sandbox (tried {candidates})")


# ----------------------------------------------------------------------------- running programs

_warned = False


def _refuse_or_warn(missing: str, allow_unconfined: bool) -> None:
    global _warned
    if not allow_unconfined:
        raise SandboxError(
            f"the sandbox cannot isolate programs here ({missing}); refusing to run untrusted code. Pass "
            "allow_unconfined=True to run it with rlimits only (results then say isolated=False)."
        )
    if not _warned:
        _warned = True
        warnings.warn(
            f"esbatch.sandbox: running programs WITHOUT isolation ({missing}): they can reach the network, "
            "your files and, unless you are root, your other processes",
            RuntimeWarning,
            stacklevel=3,
        )


def _reason(out: Outcome) -> str:
    if out.timed_out:
        return "timeout"
    if out.memory_killed:
        return "memory"
    rc = out.returncode
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        return {"SIGXCPU": "cpu limit", "SIGXFSZ": "file size limit"}.get(name, f"killed by signal {name}")
    if rc != 0:
        return "memory" if b"MemoryError" in out.stderr_tail else f"exit {rc}"
    return "ok"


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
    disk_mb: int | None = None,
    max_files: int = 2048,
    allow_unconfined: bool = False,
) -> SandboxResult:
    """Run ``code`` as a script in the sandbox. Whatever the program does is reported in the result; a
    sandbox that cannot start (no usable interpreter, exec refused, no isolation without ``allow_unconfined``)
    raises ``SandboxError`` (a RuntimeError). ``memory_mb`` caps each process and the tree together,
    ``disk_mb`` (default ``file_size_mb``) and ``max_files`` the working folder."""
    missing = _probe()[0]
    if missing is not None:
        _refuse_or_warn(missing, allow_unconfined)
    exe = python or sandbox_python()
    lim = Limits(timeout_s, cpu_s, memory_mb, file_size_mb, disk_mb or file_size_mb, max_files, max_procs, max_output)
    start = time.monotonic()
    if missing is None:
        out, uid = _isolated_run(code, [exe, "-s", "-B", "main.py"], lim, network)
    else:
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="esbatch_sbx_"))
        try:
            with lease_uid() as uid:
                out = run_unconfined(exe, workdir, code, uid, lim)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    reason = _reason(out)
    peak = None if out.memory_peak is None else out.memory_peak / MB
    isolated = missing is None
    return SandboxResult(
        reason == "ok", out.returncode, out.timed_out, out.stdout, out.stderr, time.monotonic() - start,
        reason, isolated and not network, uid, isolated, peak,
    )  # fmt: skip


def run_many(programs: list[str], *, workers: int | None = None, **limits) -> list[SandboxResult]:
    """``run_python`` over many programs, one thread driving one child each; results in input order."""
    if not programs:
        return []
    if _probe()[0] is not None:
        _refuse_or_warn(_probe()[0], limits.get("allow_unconfined", False))
    if "python" not in limits:
        sandbox_python()  # probe once, before the threads
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda code: run_python(code, **limits), programs))
