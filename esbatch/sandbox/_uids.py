"""Unprivileged uids for a root evaluator, from a block no other evaluator on the machine can hold.

A block is ``UIDS_PER_BLOCK`` uids, taken with an exclusive ``flock`` on its lock file in a root-owned folder
(``/run/esbatch-sandbox``, else ``/tmp/esbatch-sandbox-uids``: owner root, no group or other write, no symlink)
and held for the evaluator's lifetime; the kernel drops the lock when the process dies, so a crashed evaluator
frees its block. A second evaluator (or a forked copy of this one) takes another block. Processes left over in
a block by a crashed evaluator are killed when the block is taken. Within the block each concurrent run leases
its own uid, so runs never share a fork budget and cannot signal each other.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

UIDS_PER_BLOCK = 64
BLOCKS = 4096
# Blocks are aligned on multiples of UIDS_PER_BLOCK, so evaluators with different bases still name the same
# uids with the same lock file.
UID_BASE = -(-int(os.environ.get("ESBATCH_SANDBOX_UID_BASE", "2000000000")) // UIDS_PER_BLOCK) * UIDS_PER_BLOCK
LOCK_DIRS = ("/run/esbatch-sandbox", "/tmp/esbatch-sandbox-uids")
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

_pool = threading.Condition()
_block: tuple[int, int, int] | None = None  # (lock fd, first uid, owner pid)
_free_uids: list[int] = []


def _processes() -> list[tuple[int, int, bool]]:
    """(pid, real uid, is a zombie) of every process, from /proc."""
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        with suppress(OSError, KeyError, ValueError, IndexError):
            with open(f"/proc/{d}/status") as f:
                st = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
            found.append((int(d), int(st["Uid"].split()[0]), st["State"].strip().startswith("Z")))
    return found


def processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real uid is ``uid``."""
    return [pid for pid, u, zombie in _processes() if u == uid and not zombie]


def kill_uid(uid: int) -> None:
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


def _lock_dir() -> str:
    """The first of LOCK_DIRS that is (or can be made) a root-owned folder nobody else may write to."""
    problems = []
    for d in LOCK_DIRS:
        with suppress(OSError):
            os.mkdir(d, 0o700)
        try:
            st = os.lstat(d)
        except OSError as e:
            problems.append(f"{d}: {e.strerror}")
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022:
            return d
        problems.append(f"{d}: not a root-owned folder closed to others")
    raise RuntimeError(f"no safe folder for the sandbox's uid locks ({'; '.join(problems)})")


def _take_block() -> tuple[int, int]:
    """Lock a free block, starting from one that depends on our pid; (lock fd, first uid)."""
    folder, start = _lock_dir(), os.getpid() % BLOCKS
    for i in range(BLOCKS):
        first = UID_BASE + (start + i) % BLOCKS * UIDS_PER_BLOCK
        path = os.path.join(folder, f"uids-{first}-{first + UIDS_PER_BLOCK - 1}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd, first
    raise RuntimeError(f"all {BLOCKS} sandbox uid blocks are held by other evaluators")


def uid_block() -> range:
    """This process's block (taken on first use, held until exit; a forked copy takes its own)."""
    global _block
    with _pool:
        if _block is None or _block[2] != os.getpid():
            if _block is not None:
                os.close(_block[0])  # the parent's lock: closing our copy leaves it locked for the parent
            fd, first = _take_block()
            _block = (fd, first, os.getpid())
            _free_uids[:] = range(first, first + UIDS_PER_BLOCK)
            busy = {u for _, u, _ in _processes()}
            for uid in _free_uids:
                if uid in busy:  # left by an evaluator that died holding this block
                    kill_uid(uid)
        return range(_block[1], _block[1] + UIDS_PER_BLOCK)


@contextmanager
def lease_uid(contained: bool = False) -> Iterator[int | None]:
    """One unprivileged uid for the duration of a run (None unless we are root); leftovers are killed.
    ``contained``: the run's processes all die with its PID namespace, so the /proc scans are left out."""
    if os.geteuid() != 0:
        yield None
        return
    uid_block()
    with _pool:
        while not _free_uids:
            _pool.wait()
        # Killed orphans stay zombies until init reaps them, and zombies still count against RLIMIT_NPROC:
        # take the least recently used uid that has no process at all.
        busy = set() if contained else {u for _, u, _ in _processes()}
        uid = next((u for u in _free_uids if u not in busy), _free_uids[0])
        _free_uids.remove(uid)
    try:
        yield uid
    finally:
        if not contained:
            kill_uid(uid)
        with _pool:
            if _block is not None and _block[1] <= uid < _block[1] + UIDS_PER_BLOCK:  # not from before a fork
                _free_uids.append(uid)
                _pool.notify()
