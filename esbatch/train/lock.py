"""One writer per folder: an exclusive ``flock`` on ``<folder>/.lock``, held while a process writes the folder.

Every writer of a run folder (train, resume, a sweep task, a pipeline's driver and each stage, ``esbatch center``,
``esbatch threshold``, an eval that rebuilds a center inside the run) and ``esbatch sweep`` on its sweep folder
enters ``writer_lock`` first. The lock belongs to an open file descriptor, so the kernel releases it when the
process ends, however it ends (SIGKILL included): there is no stale lock to clean up. A second writer gets
``FolderBusy`` (exit code 2) naming the holder, written into the lock file once the lock is taken, before it has
changed anything. Re-entrant within a process (cmd_train holds the lock its RunSession enters again); a folder's
lock does not cover its subfolders (a pipeline's stages lock their own folders). The fd is not inherited by
child processes (PEP 446); the ranks torchrun starts for ``esbatch train`` learn from ``ESBATCH_LOCK_HELD`` that
their parent holds the lock. On NFS and Lustre see docs/architecture.md, "One writer per folder".
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from esbatch.train.rundir import RunFolderError

LOCK_FILE = ".lock"
HELD_ENV = "ESBATCH_LOCK_HELD"  # "<pid>:<folder>": the parent process holds this folder's lock (torchrun ranks)
PROC = Path("/proc")  # where a process's parent is read (a test points it at a made-up process tree)

_held: dict[str, list[int]] = {}  # resolved folder -> [fd, depth]


class FolderBusy(RunFolderError):
    """Another process holds the folder's writer lock; the message names it and says what to do."""


def holder_identity() -> dict[str, object]:
    """Who holds a lock: host, pid, start time and the SLURM job (array job_task) when there is one."""
    env = os.environ
    who: dict[str, object] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    job, idx = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if job and idx:
        who["slurm_job"] = f"{job}_{idx}"
    elif env.get("SLURM_JOB_ID"):
        who["slurm_job"] = env["SLURM_JOB_ID"]
    return who


def _read_holder(raw: str) -> dict[str, object]:
    try:
        who = json.loads(raw)
    except ValueError:
        return {}
    return who if isinstance(who, dict) else {}


def busy_message(folder: Path, raw: str, what: str) -> str:
    """The one line a second writer prints: who holds ``folder`` (from the lock file's text ``raw``, which may
    still be empty if the holder has just taken the lock) and what to do."""
    who = _read_holder(raw)
    if "pid" in who:
        job = f", SLURM job {who['slurm_job']}" if who.get("slurm_job") else ""
        holder = f"process {who['pid']} on host {who.get('host', '?')}{job} (since {who.get('since', '?')})"
        stop = f"scancel {who['slurm_job']}" if who.get("slurm_job") else f"kill {who['pid']} on {who.get('host', '?')}"
    else:
        holder, stop = "another process (it has not written its name yet)", "stop it"
    return (
        f"{folder}: this {what} is being written by {holder}; only one process may write it at a time. "
        f"Wait for that process to end or stop it ({stop}), then run this command again; nothing was changed "
        "(the kernel releases the lock when its holder exits)."
    )


def _inherited(key: str) -> bool:
    """The parent holds this folder's lock and started us as one of its ranks (cmd_train's torchrun)."""
    pid, _, folder = os.environ.get(HELD_ENV, "").partition(":")
    return folder == key and _pid_is_ancestor(pid)


def _pid_is_ancestor(pid: str) -> bool:
    if not pid.isdigit():
        return False
    p = os.getppid()
    for _ in range(8):  # torchrun: esbatch -> torch.distributed.run -> rank
        if p == int(pid):
            return True
        try:
            stat = (PROC / str(p) / "stat").read_text()
            p = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if p <= 1:
            return False
    return False


def held_env(folder: str | Path) -> dict[str, str]:
    """Environment telling this process's children that it holds ``folder``'s lock on their behalf."""
    return {HELD_ENV: f"{os.getpid()}:{Path(folder).resolve()}"}


@contextmanager
def writer_lock(folder: str | Path, what: str = "run folder") -> Iterator[None]:
    """Hold the exclusive writer lock of ``folder`` (created if missing) until the block ends; raise
    ``FolderBusy`` at once, having changed nothing but creating the folder and its lock file, if another
    process holds it."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    key = str(path.resolve())
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    if _inherited(key):
        yield
        return
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raw = os.pread(fd, 4096, 0).decode(errors="replace")
        os.close(fd)
        raise FolderBusy(busy_message(path, raw, what)) from None
    except OSError as e:  # ENOLCK, EOPNOTSUPP: a file system mounted without flock (Lustre noflock, NFS nolock)
        os.close(fd)
        raise RunFolderError(
            f"{path}: cannot take its writer lock ({path / LOCK_FILE}: {e.strerror or e}). The file system does not "
            "support flock here: on Lustre mount with -o flock, on NFS without nolock/local_lock "
            "(docs/architecture.md, One writer per folder), or put the runs on a file system that does."
        ) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder_identity()) + "\n").encode(), 0)
        _held[key] = [fd, 1]
        yield
    finally:
        _held.pop(key, None)
        os.close(fd)  # releases the lock; the file stays (deleting it would race with the next writer's open)


def holds(folder: str | Path) -> bool:
    """Whether this process holds ``folder``'s writer lock."""
    return str(Path(folder).resolve()) in _held
